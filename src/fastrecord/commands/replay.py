"""`fastrecord replay`: replay saved ManiSkill trajectories side by side and record them again.

Reads a ``NAME.h5`` + ``NAME.json`` pair written by fastrecord or by ManiSkill's ``RecordEpisode`` and
replays N episodes at once, in a gymnasium vector env of CPU envs (``physx_cpu``) or in one
GPU-parallel ManiSkill env (``physx_cuda``). The output goes through fastrecord's recorder: new
MP4s (any camera, resolution, shader) and a new trajectory (any observation mode).

Examples:
    fastrecord replay demos/trajectory.h5                            # re-render videos + trajectory
    fastrecord replay demos/trajectory.h5 --obs-mode rgb --no-video  # state -> rgb observations
    fastrecord replay demos/trajectory.h5 --width 512 --height 512 --shader default --keep success
    fastrecord replay demos/trajectory.h5 --video-source sensor:base_camera --obs-mode rgb
    fastrecord replay demos/trajectory.h5 --by actions               # reports diverging episodes
    fastrecord replay demos/trajectory.h5 --count 10 --num-envs 2 --output-dir replayed --overwrite
    fastrecord replay demos/trajectory.h5 --config configs/replay_rgb.yaml
    fastrecord replay demos/trajectory.h5 --obs-mode rgb --no-video --workers 16 --num-envs 16
    fastrecord replay demos/trajectory.h5 --video-crf 30 --trajectory-compression gzip:5
    torchrun --standalone --nproc-per-node 4 -m fastrecord replay demos/trajectory.h5 --obs-mode rgb

Replay by env states (``--by states``, the default) sets every recorded state exactly: each step
runs the physics from the recorded state (so contact-based checks such as grasping see real
contacts), then sets the next recorded state and computes observation, reward and success on it.
Replay by actions (``--by actions``) resets with the episode seed and applies the recorded actions;
episodes whose final success differs from the recorded one are reported.

Every recording option of ``fastrecord.RecordOptions`` has a flag and a config key of the same name, as
for ``fastrecord record``, bar the three a replay decides itself (``save_on_reset``, ``if_exists``: see
--overwrite and --resume, ``video_layout``: one video per replay). Their replay defaults differ in four:
the output NAME is ManiSkill's ``<stem>.<obs>.<control>.<backend>``, the videos run at the task's
control frequency, and ManiSkill's flags choose which replays are kept and whether rewards are written.

Episodes are renumbered in the order they finish; each output JSON episode names the episode it
replays in ``source_episode_id``. Existing output files are never replaced without ``--overwrite``;
``--resume`` continues an interrupted replay, skipping the episodes it holds.

``--workers N`` splits the episodes over N processes, each with its own envs and recorder writing a
shard (each env takes the next input episode no worker took when it is free; by default several workers on
machines of 8 or more cores, see --workers below); the shards are joined at the end into ``NAME.h5`` (a copy of every
episode) + ``NAME.json``, in input order, with each episode's videos linked next to them as one process names
them. Under torchrun each rank is one worker and rank 0 joins. A worker that
fails or is killed does not stop the others; the error names it and the missing episodes, and
re-running resumes.

ManiSkill's command line works with the program's name changed: every flag of
``python -m mani_skill.trajectory.replay_trajectory`` (``--traj-path``, ``-o``, ``-c``, ``--save-traj``,
``--save-video``, ``--use-env-states``, ``--allow-failure``, ``--discard-timeout``, ``--max-retry``, ...)
is accepted with its meaning, and any of them (every ManiSkill command has ``--traj-path``) switches to
ManiSkill's defaults: by actions unless ``--use-env-states``, nothing written unless ``--save-traj`` /
``--save-video``, only successful replays kept unless ``--allow-failure``, rewards only with
``--record-rewards``, one env unless ``-n``, and the output ``<stem>.<obs>.<control>.<backend>.h5`` next
to the input, replacing an earlier replay of that name as ManiSkill's tool does. ``-c`` converts the
actions to another control mode with ManiSkill's own conversion code (``from_pd_joint_pos``,
``from_pd_joint_delta_pos``), one episode at a time in a CPU env:

    fastrecord replay --traj-path demos/trajectory.h5 --use-env-states -o rgb --save-traj --count 10
    fastrecord replay --traj-path demos/trajectory.h5 -c pd_ee_delta_pose --save-traj --allow-failure

From Python: ``fastrecord.replay_trajectories(path, output_dir, **options)`` (the package
``fastrecord.replay``) runs the same replay.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from fastrecord.checks import env_kwargs_of, load_config, parse_env_kwarg
from fastrecord.exits import StopSignals
from fastrecord.options import add_record_flags
from fastrecord.replay.api import run_replay
from fastrecord.replay.config import (
    BATCHED_RENDER_CHOICES,
    BY_CHOICES,
    RECORDING_OPTIONS,
    RENDER_MODES,
    VECTOR_CHOICES,
    ReplayConfig,
    ReplaySummary,
    ReplayWorkerError,
)
from fastrecord.replay.layout import ENVS_PER_WORKER, MANY_CORES
from fastrecord.workers import claim_process

if TYPE_CHECKING:
    from fastrecord.packed import PackedLaunch

__all__ = ["ReplayConfig", "config_from_args", "configure_parser", "main_from_args", "print_summary", "worker_timeline"]


def configure_parser(p: argparse.ArgumentParser) -> None:
    """Add replay's flags to ``p`` (fastrecord's, then ManiSkill's ``replay_trajectory`` flags)."""
    p.add_argument("traj_path", nargs="?", help="the NAME.h5 to replay (NAME.json next to it)")
    p.add_argument(
        "--config",
        help="YAML file of replay options: fastrecord.ReplayConfig's fields, e.g. 'obs_mode: rgb' (see configs/)",
    )
    p.add_argument("--output-dir", help="where the new files go (default: a 'replay' folder next to the input)")
    p.add_argument("--by", choices=BY_CHOICES, help="replay by recorded env states (default) or by actions")
    p.add_argument(
        "--use-first-env-state",
        action="store_const",
        const=True,
        help="--by actions: start from the recorded first state",
    )
    p.add_argument("--count", type=int, help="replay only the first COUNT episodes")
    p.add_argument("--num-envs", type=int, help="episodes replayed side by side (default: one per CPU core)")
    p.add_argument("--vector", choices=VECTOR_CHOICES,
                   help="auto | sync (CPU envs in this process) | async (CPU envs in sub-env processes: each runs its "
                        "next step while this one records; auto's choice where the CPU draws several envs) | batched "
                        "(GPU sim)")
    p.add_argument("--sim-backend", help="physx_cpu | physx_cuda (default: the file's, CPU where CUDA is absent)")
    p.add_argument("--render-backend", help="auto | cpu | gpu")
    p.add_argument("--batched-render", choices=BATCHED_RENDER_CHOICES,
                   help="CPU simulation: draw each worker's envs in one batch per camera (one RenderSystemGroup on the "
                        "CUDA device) for image observations and videos; auto (default): where it can run")
    p.add_argument("--obs-mode", help="observation mode of the new trajectory, e.g. rgb, rgbd, pointcloud")
    p.add_argument("--width", type=int, help="video camera width")
    p.add_argument("--height", type=int, help="video camera height")
    p.add_argument("--shader", help="shader pack of the video camera: minimal, default, rt, rt-fast")
    p.add_argument("--overwrite", action="store_const", const=True,
                   help="replace the output of an earlier replay or recording of this name (never the input)")
    p.add_argument("--resume", action="store_const", const=True,
                   help="continue an earlier replay of this name that was interrupted or lost a worker: the episodes "
                        "it holds are kept and not replayed again")
    p.add_argument(
        "--workers",
        type=int,
        help="processes that replay a share of the episodes each, with their own envs and recorder, merged "
        f"at the end (default on CPU machines of {MANY_CORES}+ cores: one per {ENVS_PER_WORKER} envs rendering "
        f"on a GPU, one per env rendering on the CPU; else 1, and 1 with --log or ManiSkill's flags without -n; "
        f"--resume keeps the earlier replay's layout)",
    )
    p.add_argument("--quiet", dest="progress", action="store_const", const=False, help="no progress bar")
    p.add_argument(
        "--env-kwargs",
        nargs="+",
        type=parse_env_kwarg,
        metavar="KEY=VALUE",
        help="gym.make keywords replacing the file's env_kwargs of those keys (and adding others), each KEY=VALUE "
        "with the value as JSON where it parses, else a string: reward_mode=dense shader_dir=rt-fast "
        "sim_config='{\"sim_freq\": 200}'; a key with a flag of its own (--obs-mode, --reward-mode, "
        "--sim-backend, ...) goes through one of the two",
    )
    p.add_argument(
        "--log",
        choices=["tensorboard", "wandb"],
        help="also log each kept replay (success, length, success rate, a few videos) to TensorBoard "
        "(OUTPUT_DIR/tensorboard/NAME) or W&B (OUTPUT_DIR/wandb); needs pip install fastrecord[loggers]",
    )
    add_record_flags(p, include=RECORDING_OPTIONS, help=REPLAY_HELP,
                     title="recording options (fastrecord.RecordOptions; a replay decides save_on_reset, if_exists and "
                           "video_layout itself)")
    _add_maniskill_flags(p)


def _add_maniskill_flags(p: argparse.ArgumentParser) -> None:
    """Add the flags of ManiSkill's ``replay_trajectory`` to ``p``, in a group of their own."""
    ms = p.add_argument_group(
        "ManiSkill's replay_trajectory flags",
        "the flags of python -m mani_skill.trajectory.replay_trajectory, same meaning; any of them (or -o/-n/-b with "
        "--traj-path) switches to ManiSkill's defaults: by actions, nothing written unless --save-traj/--save-video, "
        "successful replays only, no rewards, one env, output next to the input")
    ms.add_argument(
        "--traj-path", dest="ms_traj_path", help="the NAME.h5 to replay (ManiSkill's spelling of TRAJ_PATH)"
    )
    ms.add_argument(
        "-c", "--target-control-mode", help="convert the actions to this control mode (ManiSkill's conversion code)"
    )
    flag = argparse.BooleanOptionalAction
    ms.add_argument("--save-traj", dest="ms_save_traj", action=flag, help="write the new .h5/.json")
    ms.add_argument("--save-video", dest="ms_save_video", action=flag, help="write videos")
    ms.add_argument("--use-env-states", action=flag, help="replay by env states (fastrecord: --by states)")
    ms.add_argument("--allow-failure", action=flag, help="also write replays that do not end in success")
    ms.add_argument("--discard-timeout", action=flag, help="drop replays truncated by the time limit")
    ms.add_argument("--max-retry", type=int, help="replay a failed episode up to this many more times")
    ms.add_argument("--record-rewards", dest="ms_record_rewards", action=flag, help="write rewards (record_reward)")
    ms.add_argument("--reward-mode", help="the env's reward mode, e.g. sparse, dense, normalized_dense, none")
    ms.add_argument("--render-mode", choices=RENDER_MODES, help="render mode of the videos")
    ms.add_argument("--verbose", action=flag, help="name each replay that is not kept")
    ms.add_argument("--vis", action=flag, help="not supported: fastrecord replays have no GUI viewer")
    # ManiSkill's short spellings of flags both tools have
    for short, dest in (("-o", "obs_mode"), ("-n", "num_envs"), ("-b", "sim_backend")):
        ms.add_argument(
            short, dest=f"ms_{dest}", type=int if dest == "num_envs" else str, help=f"--{dest.replace('_', '-')}"
        )


# The help of the recording options whose replay default is its own (`fastrecord.replay.config.REPLAY_DEFAULTS`).
REPLAY_HELP = {
    "trajectory_name": "base name of the new .h5/.json, run manifest and results file "
    "(default NAME.<obs>.<control>.<backend>)",
    "keep": "which replayed episodes are written (default all; with ManiSkill's flags: the successful ones, see "
    "--allow-failure and --discard-timeout)",
    "video_fps": "frames per second of the videos (default: the task's control frequency; 7.5 and 29.97 work)",
    "record_reward": "write no rewards (with ManiSkill's flags none are written unless --record-rewards)",
}

MANISKILL_ONLY = (
    "ms_traj_path",
    "target_control_mode",
    "ms_save_traj",
    "ms_save_video",
    "use_env_states",
    "allow_failure",
    "discard_timeout",
    "max_retry",
    "ms_record_rewards",
    "reward_mode",
    "render_mode",
    "verbose",
)


def config_from_args(args: argparse.Namespace) -> ReplayConfig:
    """The CLI's `ReplayConfig`: fastrecord's flags, and ManiSkill's with their meaning and defaults."""
    opts = {k: v for k, v in vars(args).items() if k not in ("config", "command", "func", "log", "forks", "early")}
    opts["env_kwargs"] = env_kwargs_of(opts.get("env_kwargs"))
    if opts.pop("vis", None):
        raise ValueError("--vis opens ManiSkill's GUI viewer, which fastrecord replay does not; record videos with "
                         "--save-video instead, or use python -m mani_skill.trajectory.replay_trajectory --vis")
    maniskill = any(opts.get(k) is not None for k in MANISKILL_ONLY)
    for short in ("obs_mode", "num_envs", "sim_backend"):
        value = opts.pop(f"ms_{short}")
        if value is not None:
            if opts.get(short) is not None and opts[short] != value:
                raise ValueError(
                    f"-{short[0]} {value} and --{short.replace('_', '-')} {opts[short]} disagree; pass one"
                )
            opts[short] = value
    path = opts.pop("ms_traj_path")
    if path is not None:
        if opts.get("traj_path") not in (None, path):
            raise ValueError(f"two trajectories given ({opts['traj_path']} and --traj-path {path}); pass one")
        opts["traj_path"] = path
    save_traj, save_video = opts.pop("ms_save_traj"), opts.pop("ms_save_video")
    use_env_states = opts.pop("use_env_states")
    rewards = opts.pop("ms_record_rewards")
    if rewards is not None:
        if opts.get("record_reward") not in (None, rewards):
            raise ValueError("--no-record-reward and --record-rewards disagree; pass one")
        opts["record_reward"] = rewards
    if maniskill:
        # ManiSkill's defaults: nothing written unless asked; by actions unless --use-env-states
        if opts.get("save_trajectory") is None:
            opts["save_trajectory"] = bool(save_traj)
        if opts.get("save_video") is None:
            opts["save_video"] = bool(save_video)
        if use_env_states is not None:
            by = "states" if use_env_states else "actions"
            if opts.get("by") not in (None, by):
                raise ValueError(
                    f"--by {opts['by']} and --{'' if use_env_states else 'no-'}use-env-states disagree; pass one"
                )
            opts["by"] = by
    return load_config(ReplayConfig, args.config, maniskill=maniskill or None, **opts)


def print_summary(s: ReplaySummary, cfg: ReplayConfig) -> None:
    """The replay's summary for a terminal: what was replayed and written, divergences, results, speed, files."""
    from fastrecord.commands.record import print_results, print_speed_and_files
    from fastrecord.shards import ranges_text as ranges

    keep = cfg.keep_filter
    if keep is None:
        keep = (
            "success"
            + (", not truncated" if cfg.discard_timeout else "")
            + (f", {cfg.max_retry} retries" if cfg.max_retry else "")
        )
    elif cfg.maniskill and cfg.discard_timeout:
        keep = "not truncated"
    if s.interrupted:  # what is in progress is not saved: --resume replays it whole
        print(f"interrupted ({s.interrupted}): stopped after {s.episodes} episode{'s' if s.episodes != 1 else ''}; the "
              f"replays in progress were not saved, running the same command again with --resume replays them")
    how = (f"converted to {cfg.target_control_mode}" if s.converted
           else f"by {'env states' if cfg.replay_by == 'states' else 'actions'}")
    print(f"replayed {s.episodes} episodes {how}: {s.successes} successful, {s.kept} written (keep={keep})"
          + (f" by {s.workers} workers" if s.workers > 1 else ""))
    if s.skipped:
        print(f"resumed: {s.skipped} episodes were already replayed and kept")
    if s.missing:
        print(
            f"missing: {len(s.missing)} input episodes are not in the output (global indices, the positions in the "
            f"input: {ranges(s.missing)}); running the same command again replays them"
        )
    if cfg.maniskill:  # ManiSkill's own last line, for scripts that read it
        print(
            f"Replayed {s.episodes} episodes, "
            f"{s.kept}/{s.episodes}={s.kept / max(s.episodes, 1) * 100:.2f}% demos saved"
        )
    if s.diverged:
        hint = ""
        if cfg.replay_by == "actions" and not cfg.use_first_env_state:
            hint = (" (an episode whose seed does not reproduce its recorded start, e.g. after an unseeded auto-reset, "
                    "diverges from the first step: --use-first-env-state starts each from its recorded first state)")
        shown = ", ".join(
            f"{d.episode_id} ({'success' if d.recorded else 'failure'} -> {'success' if d.replayed else 'failure'})"
            for d in s.diverged[:10]
        )
        more = f" and {len(s.diverged) - 10} more" if len(s.diverged) > 10 else ""
        print(f"success diverged from the recording in {len(s.diverged)} episodes: {shown}{more}{hint}")
    else:
        print("success matches the recording in every episode")
    print_results(s.results, len(s.results), s.results_path)
    if s.worker_times:
        print(worker_timeline(s))
    print_speed_and_files(s.env_steps, s.seconds, s.files, s.output_dir, s.startup_seconds)


def worker_timeline(s: ReplaySummary) -> str:
    """One line: when the workers were up, replaying and done (first-last, seconds since the replay began),
    and the merge."""
    def span(i: int) -> str:
        lo, hi = min(w[i] for w in s.worker_times), max(w[i] for w in s.worker_times)
        return f"{lo:.1f}-{hi:.1f} s"

    before = "" if s.process_age is None else f" (this process began it {s.process_age:.1f} s after its own start)"
    return (
        f"workers ({len(s.worker_times)}): up (interpreter, imports) at {span(0)}, replaying from {span(1)} (envs "
        f"made), done at {span(2)}; merge {s.merge_seconds:.1f} s; seconds since the replay began{before}"
    )


def start_subenvs(args: argparse.Namespace) -> PackedLaunch | None:
    """The CLI's early start, before its checks and imports: the sub-env processes of a replay that will draw its envs
    in this process (`fastrecord.replay.early.early_subenvs`), or None."""
    from fastrecord.replay.early import early_subenvs

    return early_subenvs(config_from_args(args))


def main_from_args(args: argparse.Namespace) -> int:
    """Run ``fastrecord replay``: the replay (`fastrecord.replay.run_replay`) under the CLI's signal
    handlers, then its summary; returns the exit status."""
    forks = vars(args).pop("forks", False)  # the CLI's: the forkserver is still to start (few cores)
    early = vars(args).pop("early", None)  # the CLI's `start_subenvs`: ended by the CLI where not taken over
    cfg = config_from_args(args)
    if not cfg.traj_path:
        raise ValueError("no trajectory given: pass the NAME.h5 to replay (or traj_path in the --config file)")
    from fastrecord.sinks.loggers import log_sinks

    claim_process()  # this process is the CLI's (see fastrecord.workers.claim_process)
    if forks:  # the CLI did not start the forkserver before its imports (few cores): now,
        import fastrecord.replay.workers  # noqa: F401 - its preload, before any file is open, as this process's fork
        from fastrecord.workers import start_forkserver

        start_forkserver()
    from fastrecord.system import stamp

    with StopSignals("replay") as stop:
        try:
            stamp("imported")  # benchmarks/bench_whole.py: the replay (workers, envs, loop, merge) runs from here
            s = run_replay(cfg, stop=stop, sinks=log_sinks(getattr(args, "log", None)), early=early)
            stamp("loop_end")
        except ReplayWorkerError as e:  # the worker's cause and what is on disk, as one message (no traceback of ours)
            print(f"fastrecord replay: error: {e}", file=sys.stderr)
            return 1
        from fastrecord.shards import rank_info

        info = rank_info()
        if info.distributed and info.rank != 0:  # rank 0 prints everyone's summary
            stopped = f" ({s.interrupted})" if s.interrupted else ""
            print(f"rank {info.rank}: replayed {s.episodes} episodes into {s.output_dir}{stopped}")
        else:
            print_summary(s, cfg)
        return stop.exit_code
