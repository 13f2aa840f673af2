"""`fastrecord bench`: recording throughput against ManiSkill's RecordEpisode, in one run, on the same frames.

Examples:
    fastrecord bench                                        # CPU-sized run: 8 envs x 64x64, 10-step episodes
    fastrecord bench --config configs/bench_h200.yaml       # the README's table: 128 envs x 512x512 on a GPU
    fastrecord bench --num-envs 32 --skip maniskill,realenv --json bench.json

Frames come from a batched source env (`fastrecord.testing.BatchedDoubleEnv` with a clip ``bank``:
ManiSkill's batched-env contract, frames on the device, one gather a render) that replays clips rendered
by a real ManiSkill task (``content: maniskill``) or synthetic gradients (``content: gradient``), so both
recorders see identical frames and the source costs almost nothing. Phases (each can be skipped with ``--skip``):

  ceiling   one encoder process's frames/s (x workers = the ceiling), and all workers measured together
  quality   PSNR against the source frames and parallel frames/s for each ``sweep`` setting
  maniskill ManiSkill's RecordEpisode video path (to_numpy + tile_images every step, one tiled video)
  fastrecord  fastrecord.RecordEpisode (device ring buffer + per-env MP4) flat out: env-frames/s, the
            stepping thread's own time per step, memory per batch (flat?), dropped frames, PSNR
  keepup    the same with a simulated step time so encoders keep up: bare loop vs recorded loop
  realenv   a real ManiSkill env (CPU simulation, GPU rendering where CUDA is present): bare vs recorded
  micro     device time of the ring write and of the yuv420p conversion
  staggered per-env episode lengths drawn by the env, partial resets of the finished envs (`bench_paths`)
  coldstart fresh processes recording their first episodes: set-up seconds, rate, peak memory
  cpueval   make_eval_envs' CPU branch: videos with and without the overlay beside a step+render loop

Output: a readable table on stdout and everything in JSON (``--json``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch

from fastrecord.commands import bench_imageobs, bench_paths
from fastrecord.commands.config import load_config
from fastrecord.testing import BatchedDoubleEnv, psnr

PHASES = ("ceiling", "quality", "maniskill", "fastrecord", "keepup", "realenv", "micro", "staggered", "coldstart", "cpueval", "imageobs")


@dataclass(frozen=True)
class BenchConfig:
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
    trajectory_writers: int = 2  # imageobs phase: fastrecord's HDF5 writer processes
    trajectory_compression: str = "gzip:1"  # imageobs phase: fastrecord's image compression
    output_dir: str | None = None  # where videos go (None: a temporary directory, removed after)
    json: str | None = None  # write the results here

    def __post_init__(self) -> None:
        from fastrecord.commands.config import check_at_least

        check_at_least(self, 1, num_envs="--num-envs", width="--width", height="--height", episode_steps="--episode-steps",
                       batches="--batches", clips="--clips", variants="--variants", workers="--workers",
                       baseline_steps="--baseline-steps", keepup_batches="--keepup-batches", coldstart_episodes="--coldstart-episodes",
                       cpueval_envs="--cpueval-envs", cpueval_steps="--cpueval-steps", cpueval_episode_steps="--cpueval-episode-steps")
        bench_imageobs.check_config(self)
        lo, hi = self.stagger_steps
        if not 1 <= lo <= hi:
            raise ValueError(f"stagger_steps={list(self.stagger_steps)} must be [lo, hi] with 1 <= lo <= hi (e.g. [30, 60])")
        check_at_least(self, 0, warmup_batches="--warmup-batches")


# ---------------------------------------------------------------------------------------------- sources
def gradient_clips(clips: int, frames: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    """[clips, frames, H, W, 3] uint8 smooth moving gradients (triangle waves: no wrap edges)."""
    rng = np.random.default_rng(seed)
    y = np.arange(height, dtype=np.float32)[:, None]
    x = np.arange(width, dtype=np.float32)[None, :]
    out = np.empty((clips, frames, height, width, 3), np.uint8)

    def tri(v: np.ndarray) -> np.ndarray:
        return 255 - np.abs((v % 510) - 255)

    for c in range(clips):
        a = rng.uniform(0.5, 3.0, size=3)
        for t in range(frames):
            out[c, t, ..., 0] = tri(a[0] * x + 7 * t + 40 * c)
            out[c, t, ..., 1] = tri(a[1] * y + 3 * t + 80)
            out[c, t, ..., 2] = tri(a[2] * (x + y) / 2 + 5 * t)
    return out


def maniskill_clips(env_id: str, clips: int, frames: int, height: int, width: int, render_backend: str,
                    seed: int = 0) -> np.ndarray:
    """[clips, frames, H, W, 3] uint8 from a real ManiSkill task's human camera under random actions."""
    import mani_skill.envs  # noqa: F401

    env = gym.make(env_id, num_envs=1, obs_mode="state", render_mode="rgb_array", sim_backend="physx_cpu",
                   render_backend=render_backend, human_render_camera_configs=dict(width=width, height=height))
    out = np.empty((clips, frames, height, width, 3), np.uint8)
    try:
        env.action_space.seed(seed)
        for c in range(clips):
            env.reset(seed=seed + c)
            for t in range(frames):
                if t:
                    env.step(env.action_space.sample())
                img = env.render()
                out[c, t] = (img.cpu().numpy() if isinstance(img, torch.Tensor) else np.asarray(img)).reshape(height, width, 3)
    finally:
        env.close()
    return out


def make_bank(clips: np.ndarray, variants: int) -> np.ndarray:
    """Each clip and ``variants - 1`` copies rolled sideways: [clips * variants, T, H, W, 3]."""
    w = clips.shape[3]
    banks = [np.roll(clips, shift=(v * w) // max(variants, 1), axis=3) for v in range(variants)]
    return np.ascontiguousarray(np.stack(banks, axis=1).reshape(-1, *clips.shape[1:]))


def source_env(bank: np.ndarray, num_envs: int, device: torch.device, sim_seconds: float = 0.0) -> BatchedDoubleEnv:
    """The batched source: `BatchedDoubleEnv` replaying ``bank`` (env ``e`` shows clip ``e % len(bank)``),
    episodes as long as the clips (``frames - 1`` steps), ``sim_seconds`` of emulated simulation a step."""
    return BatchedDoubleEnv(num_envs=num_envs, max_episode_steps=bank.shape[1] - 1, device=device, bank=bank,
                            sim_seconds=sim_seconds)


# ---------------------------------------------------------------------------------------------- helpers


def _rss(pid: int | str = "self") -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _pss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class MemoryMonitor:
    """Samples this process's RSS, encoder processes' PSS and CUDA memory every ``interval`` s."""

    def __init__(self, device: torch.device, interval: float = 0.2) -> None:
        self.device = device
        self.interval = interval
        self.peak_rss = 0
        self.peak_children_pss = 0
        self.peak_total = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="bench-memory")

    def sample(self, children: bool = False) -> dict[str, int]:
        """Cheap by default (this process's RSS, CUDA memory); ``children`` adds encoders' PSS (costly)."""
        from fastrecord.staging import default_staging_pool
        from fastrecord.video.pool import _default_pool

        out = dict(host_rss=_rss(), staging_reserved=default_staging_pool().bytes_reserved)
        if children:
            pids = _default_pool.pids() if _default_pool is not None else []
            out["encoders_pss"] = sum(_pss(p) for p in pids)
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            out.update(device_used=total - free, torch_reserved=torch.cuda.memory_reserved(self.device))
        return out

    def _run(self) -> None:
        k = 0
        while not self._stop.wait(self.interval):
            k += 1
            s = self.sample(children=k % 25 == 0)
            self.peak_rss = max(self.peak_rss, s["host_rss"])
            if "encoders_pss" in s:
                self.peak_children_pss = max(self.peak_children_pss, s["encoders_pss"])
                self.peak_total = max(self.peak_total, s["host_rss"] + s["encoders_pss"])

    def __enter__(self) -> MemoryMonitor:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def peaks(self) -> dict[str, float]:
        out = dict(host_rss_gib=self.peak_rss / 2**30, encoders_pss_gib=self.peak_children_pss / 2**30,
                   host_total_gib=self.peak_total / 2**30)
        if self.device.type == "cuda":
            out["device_torch_peak_gib"] = torch.cuda.max_memory_reserved(self.device) / 2**30
        return out


def _settings(cfg: BenchConfig, preset: str | None = None, crf: int | None = None, threads: int = 1):
    from fastrecord.video import VideoSettings, resolve_codec

    return VideoSettings(codec=resolve_codec(cfg.codec), crf=cfg.crf if crf is None else crf,
                         preset=preset or cfg.preset, threads=threads)


def _yuv_host(frames: np.ndarray):
    from fastrecord.staging import Yuv420Frames, rgb_to_yuv420p

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    return Yuv420Frames(rgb_to_yuv420p(torch.from_numpy(frames).to(dev)).cpu().numpy())


def _parallel_encode(jobs: list[tuple[Path, np.ndarray]], settings: Any, workers: int, pool: Any) -> float:
    """Encode ``jobs`` with ``workers`` threads each driving one encoder process; returns wall seconds."""
    from fastrecord.video import encode_mp4
    from fastrecord.workers import WorkerPool

    t0 = time.perf_counter()
    with WorkerPool(lambda job: encode_mp4(job[0], job[1], settings, pool=pool), num_workers=workers,
                    max_pending=len(jobs) + 1, name="bench-encode") as wp:
        for job in jobs:
            wp.submit(job)
        wp.wait_until_done()
    return time.perf_counter() - t0


def _mp4_frames(path: Path) -> int:
    import av

    with av.open(str(path)) as c:
        n = c.streams.video[0].frames
        if n:
            return n
        return sum(1 for _ in c.decode(video=0))


# ---------------------------------------------------------------------------------------------- phases
def phase_ceiling(cfg: BenchConfig, bank: np.ndarray, workers: int, out: Path) -> dict[str, Any]:
    from fastrecord.video import EncoderProcessPool

    settings = _settings(cfg)
    n_eps = cfg.ceiling_episodes or 2 * workers
    episodes = [bank[i % len(bank)] for i in range(n_eps)]
    yuv = [_yuv_host(e) for e in episodes]
    frames_per = episodes[0].shape[0]
    res: dict[str, Any] = {"settings": asdict(settings), "episode_frames": frames_per}
    with EncoderProcessPool(max_processes=workers, idle_timeout=0) as pool:
        pool.start(workers)
        _parallel_encode([(out / "warm.mp4", yuv[0])], settings, 1, pool)  # first use of the pool
        for fmt, src in (("yuv420p", yuv), ("rgb24", episodes)):
            k = min(len(src), max(2, workers // 4))
            secs = _parallel_encode([(out / f"one_{fmt}_{i}.mp4", src[i]) for i in range(k)], settings, 1, pool)
            res[f"one_process_fps_{fmt}"] = k * frames_per / secs
        secs = _parallel_encode([(out / f"all_{i}.mp4", yuv[i]) for i in range(n_eps)], settings, workers, pool)
        res["all_processes_fps_yuv420p"] = n_eps * frames_per / secs
    res["workers"] = workers
    res["ceiling_fps"] = res["one_process_fps_yuv420p"] * workers
    for f in out.glob("*.mp4"):
        f.unlink()
    return res


def phase_quality(cfg: BenchConfig, bank: np.ndarray, workers: int, out: Path) -> dict[str, Any]:
    from fastrecord.video import EncoderProcessPool, decode_mp4

    n_eps = cfg.sweep_episodes or 2 * workers
    episodes = [bank[i % len(bank)] for i in range(n_eps)]
    yuv = [_yuv_host(e) for e in episodes]
    rows = []
    with EncoderProcessPool(max_processes=workers, idle_timeout=0) as pool:
        pool.start(workers)
        _parallel_encode([(out / f"warm{i}.mp4", yuv[i % len(yuv)]) for i in range(workers)], _settings(cfg), workers, pool)
        for spec in cfg.sweep:
            preset, crf = spec.split(":")
            s = _settings(cfg, preset=preset, crf=int(crf))
            jobs = [(out / f"q_{preset}_{crf}_{i}.mp4", yuv[i]) for i in range(n_eps)]
            secs = _parallel_encode(jobs, s, workers, pool)
            frames = sum(len(e) for e in episodes)
            check = list(range(min(len(bank), n_eps)))
            q = [psnr(decode_mp4(jobs[i][0]), episodes[i]) for i in check]
            size = sum(p.stat().st_size for p, _ in jobs)
            rows.append(dict(preset=preset, crf=int(crf), psnr_db=float(np.mean(q)), parallel_fps=frames / secs,
                             kbit_per_frame=size * 8 / 1000 / frames))
            for p, _ in jobs:
                p.unlink()
    return {"episodes": n_eps, "rows": rows}


def _pyav_images_to_video(images: list, output_dir: str, video_name: str, fps: int = 10, quality: float | None = 5,
                          verbose: bool = True, **kwargs: Any) -> None:
    """ManiSkill's images_to_video (imageio-ffmpeg: libx264, crf = int((1 - quality/10) * 51), preset medium,
    yuv420p, threads auto) through PyAV, for machines without the ffmpeg binary imageio needs."""
    import av

    crf = int((1 - (quality if quality is not None else 5) / 10.0) * 51)
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, video_name.replace(" ", "_").replace("\n", "_") + ".mp4")
    with av.open(path, "w") as c:
        st = c.add_stream("libx264", rate=fps)
        st.height, st.width = images[0].shape[:2]
        st.pix_fmt = "yuv420p"
        st.options = {"crf": str(crf)}
        st.codec_context.thread_count = 0
        for im in images:
            c.mux(st.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(im), format="rgb24")))
        c.mux(st.encode())


def phase_maniskill(cfg: BenchConfig, bank: np.ndarray, device: torch.device, out: Path) -> dict[str, Any]:
    ms_record = importlib.import_module("mani_skill.utils.wrappers.record")

    from fastrecord.video import decode_mp4

    try:
        import imageio_ffmpeg  # noqa: F401

        encoder = "imageio-ffmpeg (ManiSkill's own path)"
    except ImportError:
        encoder = "PyAV stand-in for imageio-ffmpeg (same libx264 settings: crf 25, preset medium, yuv420p)"
        ms_record.images_to_video = _pyav_images_to_video
    encode_time = [0.0]
    inner = ms_record.images_to_video

    def timed(*a: Any, **k: Any) -> None:
        t0 = time.perf_counter()
        inner(*a, **k)
        encode_time[0] += time.perf_counter() - t0

    ms_record.images_to_video = timed
    steps = min(cfg.baseline_steps, bank.shape[1] - 1)
    src = source_env(bank, cfg.num_envs, device)
    vdir = out / "maniskill"
    rss0 = _rss()
    try:
        with MemoryMonitor(device) as mon:
            env = ms_record.RecordEpisode(src, str(vdir), save_trajectory=False, max_steps_per_video=steps, video_fps=30)
            env.reset(seed=0)
            action = torch.zeros(cfg.num_envs, 3, device=device)
            t0 = time.perf_counter()
            for _ in range(steps):
                env.step(action)
            total = time.perf_counter() - t0
            env.close()
    finally:
        ms_record.images_to_video = inner
    frames = cfg.num_envs * (steps + 1)
    host_s = total - encode_time[0] - src.busy_seconds
    res = dict(encoder=encoder, steps=steps, frames=frames, seconds=total, env_frames_per_s=frames / total,
               host_ms_per_step=1000 * host_s / steps, encode_seconds=encode_time[0],
               memory=mon.peaks(), host_rss_growth_gib=(mon.peak_rss - rss0) / 2**30)
    videos = sorted(vdir.glob("*.mp4"))
    if videos:
        tiled = decode_mp4(videos[0])
        h, w = bank.shape[2:4]
        nrows = int(np.sqrt(cfg.num_envs))
        q = []
        for e in sorted({0, cfg.num_envs // 2, cfg.num_envs - 1}):
            r, c = e % nrows, e // nrows
            q.append(psnr(tiled[:, r * h:(r + 1) * h, c * w:(c + 1) * w], bank[e % len(bank), : tiled.shape[0]]))
        res.update(psnr_db=float(np.mean(q)), tiled_size=list(tiled.shape[1:3]))
    shutil.rmtree(vdir, ignore_errors=True)
    return res


def _run_fastrecord(cfg: BenchConfig, bank: np.ndarray, device: torch.device, out: Path, batches: int,
                    warmup: int, sim_seconds: float = 0.0, check: bool = True, profile: Path | None = None) -> dict[str, Any]:
    from fastrecord import RecordEpisode
    from fastrecord.video import decode_mp4, default_encoder_pool

    workers = _workers(cfg)
    src = source_env(bank, cfg.num_envs, device, sim_seconds=sim_seconds)
    env = RecordEpisode(src, str(out), save_trajectory=False, video_codec=cfg.codec, video_crf=cfg.crf,
                        video_preset=cfg.preset, video_workers=workers)
    rec = env.recorder
    pool = default_encoder_pool()
    pool.start(workers)
    steps = bank.shape[1] - 1
    action = torch.zeros(cfg.num_envs, 3, device=device)
    per_step: list[float] = []
    finalize: list[float] = []
    mem: list[dict[str, int]] = []
    env.reset(seed=0)
    t0 = busy0 = blocked0 = 0.0
    prof = None
    monitor = MemoryMonitor(device)
    for b in range(warmup + batches):
        if b == warmup:
            rec.wait_until_done()
            pool.reset_stats()
            monitor.__enter__()
            if profile is not None:
                prof = _start_pyspy(profile)
            t0, busy0, blocked0 = time.perf_counter(), src.busy_seconds, _blocked(rec)
        for _ in range(steps):
            s0, e0 = time.perf_counter(), src.busy_seconds
            env.step(action)
            if b >= warmup:
                per_step.append((time.perf_counter() - s0) - (src.busy_seconds - e0))
        f0, e0 = time.perf_counter(), src.busy_seconds
        env.reset()  # ends every env's episode: keep, gather, queue
        if b >= warmup:
            finalize.append((time.perf_counter() - f0) - (src.busy_seconds - e0))
            mem.append(monitor.sample())  # cheap: children's PSS only on the monitor thread, rarely
    loop_s = time.perf_counter() - t0
    rec.wait_until_done()
    total_s = time.perf_counter() - t0
    _stop_pyspy(prof)
    monitor.__exit__()
    blocked = _blocked(rec) - blocked0
    stats = pool.reset_stats()
    n_steps = batches * steps
    frames = batches * cfg.num_envs * (steps + 1)
    recorder_s = (loop_s - (src.busy_seconds - busy0))
    res: dict[str, Any] = dict(
        workers=workers, batches=batches, episodes=batches * cfg.num_envs, frames=frames,
        loop_seconds=loop_s, seconds=total_s, env_frames_per_s=frames / total_s,
        sim_ms_per_step=1000 * sim_seconds,
        recorder_ms_per_step=1000 * recorder_s / n_steps,
        recorder_ms_per_step_excl_wait=1000 * (recorder_s - blocked) / n_steps,
        backpressure_wait_ms_per_step=1000 * blocked / n_steps,
        step_ms_p50=1000 * statistics.median(per_step), step_ms_p99=1000 * float(np.percentile(per_step, 99)),
        finalize_ms_mean=1000 * float(np.mean(finalize)),
        encoder_busy_fraction=stats.encode_seconds / (total_s * workers),
        encoder_cpu_per_frame_ms=1000 * stats.encode_cpu_seconds / max(1, stats.frames),
        encoder_jobs=stats.jobs, staging_copied_bytes=stats.copied_bytes,
        staging=_staging_info(),
        memory=monitor.peaks(),
        memory_per_batch=[{k: round(v / 2**30, 3) for k, v in m.items()} for m in mem],
    )
    env.close()
    videos = sorted(out.glob("*.mp4"))
    written = len(videos) - (warmup * cfg.num_envs)
    res["videos_written"] = written
    if check:
        counts = [_mp4_frames(p) for p in videos]
        res["dropped_frames"] = int(sum(max(0, steps + 1 - c) for c in counts))
        res["bad_videos"] = int(sum(c != steps + 1 for c in counts))
        sample = videos[-min(len(videos), 4):]
        q = []
        for p in sample:
            e = int(p.stem.split("_env")[1].split("_")[0])
            q.append(psnr(decode_mp4(p), bank[e % len(bank)]))
        res["psnr_db"] = float(np.mean(q))
    for p in videos:
        p.unlink()
    return res


def _blocked(rec: Any) -> float:
    """Seconds the producer waited for the writers: a full job queue or no free staging arena."""
    from fastrecord.staging import default_staging_pool

    return rec.videos.blocked_seconds + default_staging_pool().wait_seconds


def _staging_info() -> dict[str, Any]:
    from fastrecord.staging import default_staging_pool

    p = default_staging_pool()
    return dict(arenas_created=p.arenas_created, reserved_gib=p.bytes_reserved / 2**30,
                pinned_gib_total=p.bytes_pinned_total / 2**30, max_arenas=p.max_arenas, over_limit=p.over_limit)


def _stop_pyspy(prof: subprocess.Popen | None) -> None:
    if prof is None:
        return
    import signal

    time.sleep(0.5)
    prof.send_signal(signal.SIGINT)  # py-spy writes its profile on SIGINT
    try:
        prof.wait(timeout=30)
    except subprocess.TimeoutExpired:
        prof.kill()


def _start_pyspy(path: Path, rate: int = 50) -> subprocess.Popen | None:
    exe = shutil.which("py-spy")
    if exe is None:
        return None
    native: list[str] = []
    p = subprocess.Popen([exe, "record", "--pid", str(os.getpid()), "--subprocesses", *native, "--rate", str(rate), "--duration",
                             "300", "--format", "raw", "--output", str(path), "--nonblocking"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # let it attach
    return p


def summarize_profile(path: Path, top: int = 15) -> dict[str, list[tuple[str, float]]]:
    """Leaf frames of a py-spy raw (collapsed) profile, as shares of samples, per process kind."""
    if not path.exists():
        return {}
    by_proc: dict[str, dict[str, int]] = {}
    totals: dict[str, int] = {}
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        frames = stack.split(";")
        proc = "encoder" if "_worker_main" in stack else "parent"
        leaf = next((f for f in reversed(frames) if not f.startswith("process ") and not f.startswith("thread ")), frames[-1])
        by_proc.setdefault(proc, {})
        by_proc[proc][leaf] = by_proc[proc].get(leaf, 0) + int(n)
        totals[proc] = totals.get(proc, 0) + int(n)
    return {p: [(k, round(v / totals[p], 4)) for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:top]]
            for p, d in by_proc.items()}


def phase_fastrecord(cfg: BenchConfig, bank: np.ndarray, device: torch.device, out: Path) -> dict[str, Any]:
    prof = out / "pyspy_raw.txt" if cfg.profile else None
    res = _run_fastrecord(cfg, bank, device, out / "fastrecord", cfg.batches, cfg.warmup_batches, profile=prof)
    if prof is not None:
        res["profile"] = summarize_profile(prof)
    return res


def _bare_loop(src: BatchedDoubleEnv, steps: int, batches: int) -> float:
    action = torch.zeros(src.num_envs, 3, device=src.device)
    src.reset(seed=0)
    t0 = time.perf_counter()
    for _ in range(batches):
        for _ in range(steps):
            src.step(action)
            src.render()
        src.reset()
    if src.device.type == "cuda":
        torch.cuda.synchronize(src.device)
    return time.perf_counter() - t0


def phase_keepup(cfg: BenchConfig, bank: np.ndarray, device: torch.device, out: Path, flat_fps: float) -> dict[str, Any]:
    steps = bank.shape[1] - 1
    target_fps = cfg.keepup_fraction * flat_fps
    step_s = cfg.num_envs * (steps + 1) / steps / target_fps
    bare_fast = _bare_loop(source_env(bank, cfg.num_envs, device), steps, 1) / steps
    sim = max(0.0, step_s - bare_fast)
    bare = _bare_loop(source_env(bank, cfg.num_envs, device, sim_seconds=sim), steps, cfg.keepup_batches)
    res = _run_fastrecord(cfg, bank, device, out / "keepup", cfg.keepup_batches, 1, sim_seconds=sim, check=False)
    n = cfg.keepup_batches * steps
    res["bare_ms_per_step"] = 1000 * bare / n
    res["recorded_ms_per_step"] = 1000 * res["loop_seconds"] / n
    res["slowdown"] = res["loop_seconds"] / bare - 1
    res["target_env_frames_per_s"] = target_fps
    return res


def phase_realenv(cfg: BenchConfig, device: torch.device, out: Path) -> dict[str, Any]:
    import mani_skill.envs  # noqa: F401
    ms_record = importlib.import_module("mani_skill.utils.wrappers.record")

    from fastrecord import RecordEpisode

    render = "gpu" if device.type == "cuda" else "cpu"
    steps = cfg.episode_steps
    kw = dict(num_envs=1, obs_mode="state", render_mode="rgb_array", sim_backend="physx_cpu", render_backend=render,
              human_render_camera_configs=dict(width=cfg.width, height=cfg.height), max_episode_steps=steps)

    calls: dict[str, list[float]] = {}

    def loop(env: Any, render_each: bool, tag: str | None = None) -> float:
        env.action_space.seed(0)
        env.reset(seed=0)
        steps_t: list[float] = []
        resets_t: list[float] = []
        t0 = time.perf_counter()
        for i in range(cfg.real_env_steps):
            a = env.action_space.sample()
            s0 = time.perf_counter()
            _, _, term, trunc, _ = env.step(a)
            if render_each:
                env.render()
            steps_t.append(time.perf_counter() - s0)
            if bool(np.asarray(torch.as_tensor(term | trunc).cpu()).any()):
                r0 = time.perf_counter()
                env.reset()
                resets_t.append(time.perf_counter() - r0)
        total = time.perf_counter() - t0
        if tag:
            calls[f"{tag}_step_ms_p50"] = 1000 * statistics.median(steps_t)
            calls[f"{tag}_reset_ms_mean"] = 1000 * float(np.mean(resets_t)) if resets_t else 0.0
        return total

    res: dict[str, Any] = dict(env_id=cfg.content_env, render_backend=render, steps=cfg.real_env_steps,
                               size=[cfg.height, cfg.width], episode_steps=steps)
    env = gym.make(cfg.content_env, **kw)
    loop(env, True)  # warm-up (shader compilation, first render)
    res["bare_step_render_ms"] = 1000 * loop(env, True, "bare") / cfg.real_env_steps
    env.close()
    for name, save_traj in (("fastrecord_video", False), ("fastrecord_video_traj", True)):
        env = RecordEpisode(gym.make(cfg.content_env, **kw), str(out / name), save_trajectory=save_traj,
                            video_codec=cfg.codec, video_crf=cfg.crf, video_preset=cfg.preset, video_workers=_workers(cfg))
        loop(env, False)
        env.recorder.wait_until_done()
        prof = _start_pyspy(out / f"pyspy_{name}.txt", rate=500) if cfg.profile and name == "fastrecord_video" else None
        t = loop(env, False, name)
        _stop_pyspy(prof)
        if prof is not None:
            res["profile_" + name] = summarize_profile(out / f"pyspy_{name}.txt", top=20)
        t0 = time.perf_counter()
        env.recorder.wait_until_done()
        drain = time.perf_counter() - t0
        env.close()
        res[f"{name}_ms"] = 1000 * t / cfg.real_env_steps
        res[f"{name}_drain_s"] = drain
        res[f"{name}_slowdown"] = res[f"{name}_ms"] / res["bare_step_render_ms"] - 1
    res.update(_realenv_diag(cfg, kw, loop, out, device))
    try:
        import imageio_ffmpeg  # noqa: F401
    except ImportError:
        ms_record.images_to_video = _pyav_images_to_video
    env = ms_record.RecordEpisode(gym.make(cfg.content_env, **kw), str(out / "maniskill_real"), save_trajectory=False)
    loop(env, False)
    t = loop(env, False, "maniskill")
    env.close()
    res.update(calls)
    res["maniskill_video_ms"] = 1000 * t / cfg.real_env_steps
    res["maniskill_video_slowdown"] = res["maniskill_video_ms"] / res["bare_step_render_ms"] - 1
    shutil.rmtree(out / "maniskill_real", ignore_errors=True)
    for name in ("fastrecord_video", "fastrecord_video_traj"):
        shutil.rmtree(out / name, ignore_errors=True)
    return res


def _realenv_diag(cfg: BenchConfig, kw: dict, loop: Any, out: Path, device: torch.device) -> dict[str, Any]:
    """Where the recorder's per-step time goes on a real env: EpisodeBuffer.step's host time as is,
    then again after a device sync (so it cannot include waiting for earlier GPU work)."""
    from fastrecord import RecordEpisode
    from fastrecord.buffer import EpisodeBuffer

    orig = EpisodeBuffer.step
    res: dict[str, Any] = {}
    for variant in ("as_is", "contiguous"):
        times: list[float] = []
        strided: set[str] = set()

        def step(self: Any, data: Any, restart: Any = None, _v: str = variant) -> None:
            t = time.perf_counter()
            if _v == "contiguous":
                orig(self, {k: v.contiguous() for k, v in data.items()}, restart)
            else:
                strided.update(k for k, v in data.items() if not v.is_contiguous())
                orig(self, data, restart)
            times.append(time.perf_counter() - t)

        EpisodeBuffer.step = step
        try:
            env = RecordEpisode(gym.make(cfg.content_env, **kw), str(out / "diag"), save_trajectory=False,
                                video_codec=cfg.codec, video_crf=cfg.crf, video_preset=cfg.preset, video_workers=_workers(cfg))
            loop(env, False)
            times.clear()
            t = loop(env, False, f"diag_{variant}")
            env.close()
        finally:
            EpisodeBuffer.step = orig
        res[f"diag_{variant}_ms_per_step"] = 1000 * t / cfg.real_env_steps
        res[f"diag_{variant}_buffer_step_ms_p50"] = 1000 * statistics.median(times)
        if variant == "as_is":
            res["diag_strided_leaves"] = sorted(strided)
    shutil.rmtree(out / "diag", ignore_errors=True)
    return res


def phase_micro(cfg: BenchConfig, device: torch.device) -> dict[str, Any]:
    """Device time per step of the ring write, and of the yuv420p conversion per episode batch."""
    from fastrecord import staging
    from fastrecord.buffer import EpisodeBuffer

    steps = cfg.episode_steps
    buf = EpisodeBuffer(cfg.num_envs, steps + 1)
    frame = torch.randint(0, 256, (cfg.num_envs, cfg.height, cfg.width, 3), dtype=torch.uint8, device=device)
    buf.start(np.arange(cfg.num_envs), {"frames": frame})
    res: dict[str, Any] = {}
    cuda = device.type == "cuda"

    def timed(fn: Any, reps: int) -> tuple[float, float]:
        """(host ms, device ms) per call."""
        if cuda:
            torch.cuda.synchronize(device)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        host = (time.perf_counter() - t0) / reps
        if cuda:
            b.record()
            b.synchronize()
            return 1000 * host, a.elapsed_time(b) / reps
        return 1000 * host, 1000 * host

    def ring() -> None:
        if buf.cursor.max() >= steps:
            buf.cursor[:] = 0  # every env at the same step: the contiguous-copy path of EpisodeBuffer.step
        buf.step({"frames": frame})

    ring()
    res["ring_write_host_ms"], res["ring_write_device_ms"] = timed(ring, 3 * steps)
    flat = buf.fields["frames"].view(-1, *frame.shape[1:])
    slots = torch.arange(cfg.num_envs, device=device) + cfg.num_envs  # slot 1 of every env, as envs at different steps
    res["ring_write_index_copy_device_ms"] = timed(lambda: flat.index_copy_(0, slots, frame), 3 * steps)[1]
    buf.cursor[:] = steps
    episode = buf.fields["frames"][: steps + 1].transpose(0, 1)  # [envs, steps, H, W, 3], as gather reads it
    k = min(8, cfg.num_envs)
    kernels = ["torch"] + (["triton"] if cuda and staging._triton_kernel() is not None else [])
    for kern in kernels:
        t0 = time.perf_counter()
        staging.rgb_to_yuv420p(episode[:1], kernel=kern)
        if cuda:
            torch.cuda.synchronize(device)
        res[f"yuv420p_{kern}_first_call_s"] = time.perf_counter() - t0
        host, dev = timed(lambda: staging.rgb_to_yuv420p(episode[:k], kernel=kern), 3)
        res[f"yuv420p_{kern}_device_ms_per_batch"] = dev * cfg.num_envs / k
    if "triton" in kernels:
        a = staging.rgb_to_yuv420p(episode[:k], kernel="torch")
        b = staging.rgb_to_yuv420p(episode[:k], kernel="triton")
        d = (a.int() - b.int()).abs()
        res["yuv420p_triton_vs_torch_maxdiff"] = int(d.max())
        res["yuv420p_triton_vs_torch_differing"] = float((d > 0).float().mean())
    best = kernels[-1]
    res["yuv420p_device_ms_per_batch"] = res[f"yuv420p_{best}_device_ms_per_batch"]
    res["yuv420p_device_ms_per_step"] = res["yuv420p_device_ms_per_batch"] / steps
    if cuda:
        for i in range(2):  # the first lease makes (and pins) an arena: time the second
            t0 = time.perf_counter()
            host_arr = buf.gather(np.arange(cfg.num_envs), yuv420p=("frames",))["frames"]
            issue = time.perf_counter() - t0
            host_arr.wait_ready()
            total = time.perf_counter() - t0
            res["gather_issue_ms"] = 1000 * issue
            res["gather_total_ms"] = 1000 * total
            res["gather_gb_per_s"] = host_arr.nbytes / total / 1e9
            del host_arr
        t0 = time.perf_counter()
        plain = buf.gather(np.arange(cfg.num_envs))["frames"]
        res["gather_rgb_ms"] = 1000 * (time.perf_counter() - t0)
        res["gather_rgb_gb_per_s"] = plain.nbytes / (time.perf_counter() - t0) / 1e9
        del plain
    return res


# ---------------------------------------------------------------------------------------------- driver
def _workers(cfg: BenchConfig) -> int:
    return cfg.workers or max(1, min(os.cpu_count() or 1, 16))


def _device(cfg: BenchConfig) -> torch.device:
    if cfg.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(cfg.device)


def run_bench(cfg: BenchConfig, log: Any = print) -> dict[str, Any]:
    unknown = set(cfg.skip) - set(PHASES)
    if unknown:
        raise ValueError(f"skip={sorted(unknown)}: unknown phase(s); phases are {PHASES}")
    if cfg.content not in ("maniskill", "gradient"):
        raise ValueError(f"content={cfg.content!r} is unknown; use 'maniskill' (rendered clips) or 'gradient'")
    device = _device(cfg)
    workers = _workers(cfg)
    tmp = None
    if cfg.output_dir is None:
        tmp = tempfile.mkdtemp(prefix="fastrecord-bench-")
    out = Path(cfg.output_dir or tmp)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"config": asdict(cfg), "machine": _machine(device)}
    try:
        t0 = time.perf_counter()
        frames = cfg.episode_steps + 1
        if cfg.content == "maniskill":
            clips = maniskill_clips(cfg.content_env, cfg.clips, frames, cfg.height, cfg.width,
                                    "gpu" if device.type == "cuda" else "cpu")
        else:
            clips = gradient_clips(cfg.clips, frames, cfg.height, cfg.width)
        bank = make_bank(clips, cfg.variants)
        results["source"] = dict(content=cfg.content, clips=cfg.clips, variants=cfg.variants, seconds=time.perf_counter() - t0)
        log(f"[bench] source: {cfg.content} clips {list(bank.shape)} on {device} in {time.perf_counter() - t0:.1f}s")
        for phase in PHASES:
            if phase in cfg.skip:
                continue
            if phase == "keepup" and "fastrecord" not in results:
                continue
            t0 = time.perf_counter()
            if phase == "ceiling":
                r = phase_ceiling(cfg, bank, workers, out)
            elif phase == "quality":
                r = phase_quality(cfg, bank, workers, out)
            elif phase == "maniskill":
                r = phase_maniskill(cfg, bank, device, out)
            elif phase == "fastrecord":
                r = phase_fastrecord(cfg, bank, device, out)
            elif phase == "keepup":
                r = phase_keepup(cfg, bank, device, out, results["fastrecord"]["env_frames_per_s"])
            elif phase == "realenv":
                r = phase_realenv(cfg, device, out)
            elif phase == "micro":
                r = phase_micro(cfg, device)
            elif phase == "staggered":
                r = bench_paths.phase_staggered(cfg, bank, device, out, workers, MemoryMonitor)
            elif phase == "coldstart":
                r = bench_paths.phase_coldstart(cfg, bank, device, out, workers)
            elif phase == "cpueval":
                r = bench_paths.phase_cpueval(cfg, device, out, workers)
            else:
                r = bench_imageobs.phase_imageobs(cfg, device, out, MemoryMonitor)
            r["phase_seconds"] = time.perf_counter() - t0
            results[phase] = r
            log(f"[bench] {phase}: {time.perf_counter() - t0:.1f}s {json.dumps(_short(r))}")
            if cfg.json:
                Path(cfg.json).write_text(json.dumps(results, indent=2, default=str))
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    results["summary"] = summary(results)
    if cfg.json:
        Path(cfg.json).write_text(json.dumps(results, indent=2, default=str))
    return results


def _short(r: dict[str, Any]) -> dict[str, Any]:
    return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()
            if not isinstance(v, (list, dict))}


def _machine(device: torch.device) -> dict[str, Any]:
    import av

    info: dict[str, Any] = dict(cpus=os.cpu_count(), python=sys.version.split()[0], torch=torch.__version__, av=av.__version__)
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    from fastrecord.video import encode as video

    info["nvenc_in_pyav_build"] = video.codec_available("h264_nvenc")
    info["nvenc_usable"] = info["nvenc_in_pyav_build"] and video._nvenc_usable()
    info["codec_auto_resolves_to"] = video.resolve_codec("auto")
    try:
        import mani_skill
        import sapien

        info.update(mani_skill=mani_skill.__version__, sapien=sapien.__version__)
    except ImportError:
        pass
    return info


def summary(r: dict[str, Any]) -> dict[str, Any]:
    s: dict[str, Any] = {}
    fr, ms, ce = r.get("fastrecord"), r.get("maniskill"), r.get("ceiling")
    if fr:
        s["fastrecord_env_frames_per_s"] = fr["env_frames_per_s"]
    if ms:
        s["maniskill_env_frames_per_s"] = ms["env_frames_per_s"]
    if fr and ms:
        s["speedup"] = fr["env_frames_per_s"] / ms["env_frames_per_s"]
    if ce:
        s["ceiling_fps"] = ce["ceiling_fps"]
        s["all_processes_fps"] = ce["all_processes_fps_yuv420p"]
        if fr:
            s["fraction_of_ceiling"] = fr["env_frames_per_s"] / ce["ceiling_fps"]
            s["fraction_of_all_processes"] = fr["env_frames_per_s"] / ce["all_processes_fps_yuv420p"]
    return s


def format_table(r: dict[str, Any]) -> str:
    cfg = r["config"]
    lines = [f"fastrecord bench: {cfg['num_envs']} envs x {cfg['height']}x{cfg['width']}, {cfg['episode_steps']}-step episodes, "
             f"{r['machine'].get('gpu', 'CPU')}, {r['machine']['cpus']} cores; frames: {cfg['content']}",
             "", "| what | value |", "| --- | --- |"]

    def row(k: str, v: Any) -> None:
        lines.append(f"| {k} | {v} |")

    ms, fr, ce, kp, re_, q, mi = (r.get(k) for k in ("maniskill", "fastrecord", "ceiling", "keepup", "realenv", "quality", "micro"))
    if ms:
        row("ManiSkill RecordEpisode (tile every step, one video)", f"{ms['env_frames_per_s']:,.0f} env-frames/s "
            f"({ms['host_ms_per_step']:.0f} ms host work a step, {ms['encode_seconds']:.1f} s encode for {ms['steps'] + 1} frames), "
            f"PSNR {ms.get('psnr_db', float('nan')):.1f} dB")
    if fr:
        row("fastrecord RecordEpisode (ring + per-env MP4)", f"{fr['env_frames_per_s']:,.0f} env-frames/s over {fr['episodes']} episodes, "
            f"PSNR {fr.get('psnr_db', float('nan')):.1f} dB, {fr.get('dropped_frames', '?')} dropped frames")
    if fr and ms:
        row("ratio fastrecord / ManiSkill", f"{fr['env_frames_per_s'] / ms['env_frames_per_s']:.1f}x")
    if ce:
        row("encode ceiling (one process x workers)", f"{ce['one_process_fps_yuv420p']:,.0f} x {ce['workers']} = {ce['ceiling_fps']:,.0f} frames/s "
            f"(all {ce['workers']} measured together: {ce['all_processes_fps_yuv420p']:,.0f}; one process from rgb24: {ce['one_process_fps_rgb24']:,.0f})")
        if fr:
            row("fastrecord / ceiling", f"{fr['env_frames_per_s'] / ce['ceiling_fps']:.0%} (of all-together: "
                f"{fr['env_frames_per_s'] / ce['all_processes_fps_yuv420p']:.0%})")
    if fr:
        row("stepping thread, flat out", f"{fr['recorder_ms_per_step_excl_wait']:.2f} ms/step own work + "
            f"{fr['backpressure_wait_ms_per_step']:.1f} ms/step waiting for encoders (p50 step {fr['step_ms_p50']:.2f} ms)")
        m = fr["memory"]
        row("peak memory, flat out", f"host {m['host_rss_gib']:.1f} GiB RSS (staging {fr['staging']['reserved_gib']:.1f} GiB) + encoders {m['encoders_pss_gib']:.1f} GiB PSS"
            + (f", device {m['device_torch_peak_gib']:.1f} GiB (torch)" if "device_torch_peak_gib" in m else ""))
        mb = fr["memory_per_batch"]
        if len(mb) > 1:
            row("memory per batch, first -> last", ", ".join(f"{k} {mb[0][k]:.2f} -> {mb[-1][k]:.2f} GiB" for k in mb[0]))
    if kp:
        row("keep-up run (encoders keep up)", f"{kp['env_frames_per_s']:,.0f} env-frames/s, stepping thread {kp['recorder_ms_per_step_excl_wait']:.2f} ms/step "
            f"own + {kp['backpressure_wait_ms_per_step']:.2f} waiting; bare loop {kp['bare_ms_per_step']:.1f} ms/step -> "
            f"recorded {kp['recorded_ms_per_step']:.1f} ms/step ({kp['slowdown']:+.1%})")
    if mi:
        row("device time", f"ring write {mi['ring_write_device_ms']:.3f} ms/step (host {mi['ring_write_host_ms']:.3f}; index_copy_ path when envs are at different steps: {mi['ring_write_index_copy_device_ms']:.3f}); "
            f"yuv420p conversion {mi['yuv420p_device_ms_per_step']:.3f} ms/step equivalent"
            + (f"; gather issue {mi['gather_issue_ms']:.1f} ms, lands in {mi['gather_total_ms']:.0f} ms ({mi['gather_gb_per_s']:.0f} GB/s)"
               if "gather_total_ms" in mi else ""))
    if re_:
        row(f"real env {re_['env_id']} (1 env, render {re_['render_backend']})", f"bare step+render {re_['bare_step_render_ms']:.2f} ms; "
            f"fastrecord video {re_['fastrecord_video_ms']:.2f} ms ({re_['fastrecord_video_slowdown']:+.1%}), "
            f"video+trajectory {re_['fastrecord_video_traj_ms']:.2f} ms ({re_['fastrecord_video_traj_slowdown']:+.1%}); "
            f"ManiSkill video {re_['maniskill_video_ms']:.2f} ms ({re_['maniskill_video_slowdown']:+.1%}); per call: "
            f"step p50 bare {re_['bare_step_ms_p50']:.2f} / fastrecord {re_['fastrecord_video_step_ms_p50']:.2f} ms, "
            f"reset {re_['fastrecord_video_reset_ms_mean']:.1f} ms")
    lines += bench_paths.table_rows(r)
    lines += bench_imageobs.table_rows(r)
    if q:
        lines += ["", "| preset:crf | PSNR dB | frames/s, all workers | kbit/frame |", "| --- | --- | --- | --- |"]
        for x in q["rows"]:
            lines.append(f"| {x['preset']}:{x['crf']} | {x['psnr_db']:.2f} | {x['parallel_fps']:,.0f} | {x['kbit_per_frame']:.1f} |")
    return "\n".join(lines)


def configure_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML preset filling BenchConfig (see configs/bench_*.yaml)")
    p.add_argument("--num-envs", type=int)
    p.add_argument("--width", type=int)
    p.add_argument("--height", type=int)
    p.add_argument("--episode-steps", type=int)
    p.add_argument("--batches", type=int)
    p.add_argument("--device")
    p.add_argument("--content", choices=["maniskill", "gradient"])
    p.add_argument("--workers", type=int)
    p.add_argument("--codec")
    p.add_argument("--preset")
    p.add_argument("--crf", type=int)
    p.add_argument("--baseline-steps", type=int)
    p.add_argument("--imageobs-size", type=int)
    p.add_argument("--imageobs-steps", type=int)
    p.add_argument("--trajectory-writers", type=int)
    p.add_argument("--trajectory-compression")
    p.add_argument("--skip", help=f"comma-separated phases to skip: {','.join(PHASES)}")
    p.add_argument("--profile", action="store_const", const=True, help="sample the flat-out run with py-spy")
    p.add_argument("--output-dir")
    p.add_argument("--json", help="write all results here")


def main_from_args(args: argparse.Namespace) -> int:
    opts = {k: v for k, v in vars(args).items() if k not in ("config", "command", "func")}
    if opts.get("skip") is not None:
        opts["skip"] = tuple(s for s in opts["skip"].split(",") if s)
    cfg = load_config(BenchConfig, args.config, **opts)
    if isinstance(cfg.sweep, list) or isinstance(cfg.skip, list):
        cfg = BenchConfig(**{**asdict(cfg), "sweep": tuple(cfg.sweep), "skip": tuple(cfg.skip)})
    results = run_bench(cfg, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(format_table(results))
    return 0
