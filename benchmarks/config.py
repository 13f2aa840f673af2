"""The benchmark's configuration: `BenchConfig` (what YAML presets in ``configs/bench_*.yaml`` and the flags
of ``fastrecord bench`` fill), its checks, and the flags themselves.

Light on purpose (no torch, no ManiSkill): ``fastrecord bench --help`` imports only this module.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastrecord.checks import check_at_least

if TYPE_CHECKING:
    import torch

PHASES = (
    "ceiling",
    "quality",
    "maniskill",
    "fastrecord",
    "keepup",
    "realenv",
    "micro",
    "staggered",
    "coldstart",
    "cpueval",
    "imageobs",
)
CONTENTS = ("maniskill", "gradient")  # where the frames come from: clips rendered by a real task, or synthetic


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark run: the source's shape and content, fastrecord's encoder settings, and each phase's
    sizes. Every value is checked on construction (a ValueError naming the option and the fix)."""

    num_envs: int = 8  # parallel envs of the batched source
    width: int = 64  # frame width
    height: int = 64  # frame height
    episode_steps: int = 10  # steps per episode (frames per episode = steps + 1)
    batches: int = 3  # measured batches of episodes (num_envs episodes each) in the flat-out run
    warmup_batches: int = 1  # batches run first and not measured (process start, staging pinning)
    device: str = "auto"  # where the source's frames live: auto (cuda if present) | cuda | cpu
    content: str = "gradient"  # maniskill (clips rendered by content_env) | gradient (synthetic)
    content_env: str = "PickCube-v1"  # task whose human camera renders the clips
    clips: int = 2  # distinct clips rendered
    variants: int = 2  # shifted copies of each clip, so neighbouring envs differ
    workers: int | None = None  # encoder workers (None: one per core, at most 16)
    codec: str = "libx264"  # fastrecord's encoder (auto: h264_nvenc where usable)
    preset: str = "ultrafast"  # fastrecord's libx264 preset
    crf: int = 23  # fastrecord's constant rate factor
    baseline_steps: int = 5  # steps of ManiSkill's path (slow: a few are enough for a rate)
    sweep: tuple[str, ...] = ("ultrafast:23", "medium:25")  # preset:crf pairs for the quality phase
    sweep_episodes: int | None = None  # episodes per sweep setting (None: 2 x workers)
    ceiling_episodes: int | None = None  # episodes for the all-workers ceiling (None: 2 x workers)
    keepup_fraction: float = 0.6  # keep-up run: the producer's rate as a fraction of the flat-out rate
    keepup_batches: int = 2  # batches in the keep-up run (and its bare loop)
    real_env_steps: int = 40  # steps of the real-env runs
    skip: tuple[str, ...] = ()  # phases not to run
    profile: bool = False  # sample the flat-out run with py-spy (parent and encoder processes)
    stagger_steps: tuple[int, int] = (6, 12)  # staggered phase: per-env episode lengths drawn from lo..hi by the env
    stagger_episodes: int | None = None  # staggered phase: measured episodes (None: batches x num_envs)
    stagger_profile_steps: int = 60  # with profile: steps of the staggered run sampled by cProfile afterwards
    stagger_arena_limits: tuple[int, ...] = ()  # staggered phase: run again with the staging pool's max_arenas at each
    coldstart_episodes: int = 16  # coldstart phase: episodes recorded by each fresh process
    coldstart_timeout: float = 300.0  # coldstart phase: seconds before a fresh process is given up
    cpueval_env: str = "PickCube-v1"  # cpueval phase: the task of make_eval_envs' CPU branch
    cpueval_envs: int = 2  # cpueval phase: envs of the AsyncVectorEnv
    cpueval_size: int | None = None  # cpueval phase: human camera side (None: width)
    cpueval_steps: int = 10  # cpueval phase: measured steps per mode
    cpueval_episode_steps: int = 5  # cpueval phase: max_episode_steps (also the warm-up of each mode)
    imageobs_size: int = 64  # imageobs phase: side of the square rgb observation (ManiSkill's default camera: 128)
    imageobs_content: str = "maniskill"  # imageobs phase: maniskill (content_env's sensor camera) | gradient
    imageobs_episode_steps: int = 50  # imageobs phase: longest episode (lengths from half of it, drawn by the env)
    imageobs_steps: int = 200  # imageobs phase: measured parallel steps of each recorder
    imageobs_repeats: int = 2  # imageobs phase: runs of each recorder, interleaved (the median is reported)
    trajectory_writers: int | None = None
    imageobs_writers_sweep: tuple[
        int, ...
    ] = ()  # imageobs phase: also run with each of these trajectory_writers (labelled tuned rows)
    trajectory_compression: str = "gzip:1"  # imageobs phase: fastrecord's image compression
    imageobs_busy_cores: int = 1  # imageobs phase: also run ManiSkill's and fastrecord's default beside this many spinning processes (0: idle only)
    output_dir: str | None = None  # where videos go (None: a temporary directory, removed after)
    json: str | None = None  # write the results here

    def __post_init__(self) -> None:
        check_at_least(
            self,
            1,
            num_envs="--num-envs",
            width="--width",
            height="--height",
            episode_steps="--episode-steps",
            batches="--batches",
            clips="--clips",
            variants="--variants",
            workers="--workers",
            baseline_steps="--baseline-steps",
            keepup_batches="--keepup-batches",
            coldstart_episodes="--coldstart-episodes",
            cpueval_envs="--cpueval-envs",
            cpueval_steps="--cpueval-steps",
            cpueval_episode_steps="--cpueval-episode-steps",
        )
        check_imageobs(self)
        lo, hi = self.stagger_steps
        if not 1 <= lo <= hi:
            raise ValueError(
                f"stagger_steps={list(self.stagger_steps)} must be [lo, hi] with 1 <= lo <= hi (e.g. [30, 60])"
            )
        check_at_least(self, 0, warmup_batches="--warmup-batches")


def check_imageobs(cfg: BenchConfig) -> None:
    """The imageobs phase's fields; a bad value is a ValueError naming the fix."""
    from fastrecord.sinks.maniskill_h5 import parse_compression

    check_at_least(cfg, 1, imageobs_size="--imageobs-size", imageobs_steps="--imageobs-steps",
                   imageobs_repeats="a --config file with imageobs_repeats:", trajectory_writers="--trajectory-writers")
    bad = [n for n in cfg.imageobs_writers_sweep if isinstance(n, bool) or not isinstance(n, int) or n < 1]
    if bad:
        raise ValueError(
            f"imageobs_writers_sweep={list(cfg.imageobs_writers_sweep)} holds {bad}: every entry must be an "
            f"integer >= 1 (trajectory_writers to run beside the default, e.g. [8]); fix it in the --config file"
        )
    check_at_least(cfg, 2, imageobs_episode_steps="a --config file with imageobs_episode_steps:")
    check_at_least(cfg, 0, imageobs_busy_cores="--imageobs-busy-cores")
    if cfg.imageobs_content not in CONTENTS:
        raise ValueError(f"imageobs_content={cfg.imageobs_content!r} is unknown; use 'maniskill' (the sensor camera "
                         f"of content_env) or 'gradient' (synthetic)")
    parse_compression(cfg.trajectory_compression)


def encoder_workers(cfg: BenchConfig) -> int:
    """The encoder processes of a run: ``cfg.workers``, or fastrecord's default (`default_video_workers`)."""
    from fastrecord.options import default_video_workers, usable_cores

    return cfg.workers or default_video_workers(usable_cores())


def bench_device(cfg: BenchConfig) -> torch.device:
    """Where the source's frames live: ``cfg.device``, with ``auto`` as cuda where present, else cpu."""
    import torch

    if cfg.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(cfg.device)


def configure_parser(p: argparse.ArgumentParser) -> None:
    """The flags of ``fastrecord bench``: each fills the `BenchConfig` field of its name (None: not given)."""
    p.add_argument("--config", help="YAML preset filling BenchConfig (see configs/bench_*.yaml)")
    p.add_argument("--num-envs", type=int)
    p.add_argument("--width", type=int)
    p.add_argument("--height", type=int)
    p.add_argument("--episode-steps", type=int)
    p.add_argument("--batches", type=int)
    p.add_argument("--device")
    p.add_argument("--content", choices=list(CONTENTS))
    p.add_argument("--workers", type=int)
    p.add_argument("--codec")
    p.add_argument("--preset")
    p.add_argument("--crf", type=int)
    p.add_argument("--baseline-steps", type=int)
    p.add_argument("--imageobs-size", type=int)
    p.add_argument("--imageobs-steps", type=int)
    p.add_argument("--trajectory-writers", type=int)
    p.add_argument(
        "--imageobs-busy-cores", type=int, help="imageobs: processes spinning beside the busy runs (0: none)"
    )
    p.add_argument("--trajectory-compression")
    p.add_argument("--skip", help=f"comma-separated phases to skip: {','.join(PHASES)}")
    p.add_argument("--profile", action="store_const", const=True, help="sample the flat-out run with py-spy")
    p.add_argument("--output-dir")
    p.add_argument("--json", help="write all results here")
