"""`fastrecord record`: run a policy in N envs, record the episodes, print a summary.

Examples:
    fastrecord record PickCube-v1                                # 4 episodes, CPU sim + render
    fastrecord record PushCube-v1 --num-envs 4 --episodes 16 --keep success
    fastrecord record PickCube-v1 --config configs/pickcube_cpu.yaml
    fastrecord record PickCube-v1 --policy fastrecord.policies:pick_cube_policy --keep success
    fastrecord record PickCube-v1 --output-dir recordings --if-exists resume   # record what the run lacks
    fastrecord record PickCube-v1 --no-video --trajectory-compression gzip:5 --video-crf 28

Episode g of a run (0 .. --episodes - 1) is reset with seed --seed + g and the random policy is seeded
per episode, so the same command records the same dataset, with or without torchrun; --if-exists resume
records the episodes of --episodes the run does not have yet (a crashed or stopped run continues where it
ended). Every recording option of `fastrecord.RecordOptions` has a flag and a config key of the same name.

Ctrl-C or SIGTERM stops the run between two steps: every finished episode is saved, the episodes in
progress are not (a cut episode is not a finished one: --if-exists resume records it whole, with its
seed), the summary is printed, and the exit status is 130 (SIGINT) or 143 (SIGTERM). A sharded run
(OUTPUT_DIR/NAME.shards/ holds shards) resumed without torchrun is resumed from its shards, in this one
process, and joined again.

This module is the command line and the summary it prints; the recording loop is
`fastrecord.commands.record_run`, the env stack it records from `fastrecord.commands.record_env`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from fastrecord.checks import env_kwargs_of, json_flag, json_or_text, load_config, parse_env_kwarg
from fastrecord.commands.config import RECORD_DEFAULTS, RecordConfig
from fastrecord.commands.record_env import EarlySubenvs, early_subenvs
from fastrecord.commands.record_run import ShardedSummary, run_record, run_record_sharded
from fastrecord.exits import StopSignals
from fastrecord.options import add_record_flags


def print_sharded(s: ShardedSummary, output_dir: str | Path) -> None:
    """Rank 0's summary of a sharded run: each rank, the results of all, the merge report."""
    if s.interrupted:
        print(
            f"rank {s.rank}: interrupted ({s.interrupted}) after {s.finished} of its {s.scheduled} episodes; the "
            f"episodes in progress were not saved. Run the same command again to resume (then fastrecord merge "
            f"{output_dir} if it was not joined)"
        )
        return
    if s.rank != 0:
        return
    for r in s.ranks:
        rate = r["env_steps"] / r["seconds"] if r["seconds"] > 0 else 0.0
        print(
            f"rank {r['rank']}: {r['finished']}/{r['scheduled']} scheduled episodes finished, {r['kept']} kept; "
            f"{r['env_steps']} env-steps in {r['seconds']:.1f} s = {rate:.1f} env-steps/s "
            f"(start-up {r['startup_seconds']:.1f} s)"
            + (f"; interrupted ({r['interrupted']})" if r.get("interrupted") else "")
        )
    rows = [row for r in s.ranks for row in r["results"]]
    print_results(rows, len(rows), None)
    if s.report is not None:
        for line in s.report.lines():
            print(line)
    print(f"run directory: {output_dir} (shards in {Path(output_dir) / (s.shard_dir.parent.name)})")


def configure_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("env_id", nargs="?", help="ManiSkill task id (default PickCube-v1)")
    p.add_argument("--config", help="YAML preset filling RecordConfig (see configs/)")
    p.add_argument("--num-envs", type=int)
    p.add_argument("--episodes", type=int)
    p.add_argument("--policy", help="'random' or 'module:factory'")
    p.add_argument("--output-dir")
    p.add_argument("--sim-backend")
    p.add_argument("--render-backend")
    p.add_argument(
        "--batched-render",
        choices=["auto", "on", "off"],
        help="CPU simulation with --num-envs > 1: step the envs in processes of their own and render all of "
        "them in one batch in this process (needs a CUDA device); auto: when rendering on a CUDA device",
    )
    p.add_argument(
        "--vector",
        choices=["auto", "sync", "async"],
        help="CPU simulation with --num-envs > 1: sync (the envs in this process: what a policy reading the simulator "
        "needs) | async (each env in a process of its own, answering each step with its frame; drawn in one batch "
        "here where the batched render runs) | auto (default: the batched render where it runs, else async where the "
        "CPU draws something, else sync)",
    )
    p.add_argument(
        "--envs-per-process",
        type=int,
        help="with the batched render: sub-envs each process simulates (default: 2, at least 4 processes and at most "
        "one a core; 1 gives each env a process of its own, as gymnasium's AsyncVectorEnv)",
    )
    p.add_argument("--obs-mode")
    p.add_argument("--control-mode")
    p.add_argument("--width", type=int)
    p.add_argument("--height", type=int)
    p.add_argument("--max-episode-steps", type=int)
    p.add_argument("--seed", type=int)
    env = p.add_argument_group("env options (gym.make keywords)")
    env.add_argument("--reward-mode")
    env.add_argument("--shader-dir")
    env.add_argument("--robot-uids", type=json_or_text)
    env.add_argument("--sim-config", type=json_flag("--sim-config", (dict,), '{"sim_freq": 200, "control_freq": 20}'))
    env.add_argument("--sensor-configs", type=json_flag("--sensor-configs", (dict,), '{"width": 128, "height": 128}'))
    env.add_argument(
        "--env-kwargs",
        nargs="+",
        type=parse_env_kwarg,
        metavar="KEY=VALUE",
        help="any gym.make keywords, each KEY=VALUE with the value as JSON where it parses, else a string "
        "(reward_mode=dense shader_dir=rt-fast sim_config='{\"sim_freq\": 200}'); added to the config's "
        "env_kwargs; a key that has a flag of its own (--obs-mode, --reward-mode, ...) goes through one of the two",
    )
    p.add_argument(
        "--log",
        choices=["tensorboard", "wandb"],
        help="also log each kept episode (success, length, success rate, a few videos) to TensorBoard "
        "(OUTPUT_DIR/tensorboard/NAME) or W&B (OUTPUT_DIR/wandb); needs pip install fastrecord[loggers]",
    )
    add_record_flags(p, defaults=RECORD_DEFAULTS, help=RECORD_HELP)


# Where `record`'s meaning of a recording option is narrower than the library's.
RECORD_HELP = {
    "trajectory_name": "NAME of the trajectory pair (NAME.h5 + NAME.json), run manifest and results file",
    "if_exists": "when output_dir already holds a run of this NAME: 'error' (refuse), 'overwrite' (delete that run's "
                 "files first), 'resume' (keep them and record the episodes of --episodes it lacks, with their seeds)",
    "keep": "which finished episodes are written",
}


def _config(args: argparse.Namespace) -> RecordConfig:
    opts = {k: v for k, v in vars(args).items() if k not in ("config", "command", "func", "log", "early")}
    opts["env_kwargs"] = env_kwargs_of(opts.get("env_kwargs"))
    return load_config(RecordConfig, args.config, **opts)


def start_subenvs(args: argparse.Namespace) -> EarlySubenvs | None:
    """The CLI's early start, before its checks and imports: the run's sub-env processes of the batched render
    (`fastrecord.commands.record_env.early_subenvs`), made while this process imports; None under torchrun."""
    from fastrecord.shards import rank_info

    return None if rank_info().distributed else early_subenvs(_config(args))


def main_from_args(args: argparse.Namespace) -> int:
    early = vars(args).pop("early", None)  # the CLI's `start_subenvs`: ended by the CLI where not taken over
    cfg = _config(args)
    from fastrecord.shards import rank_info

    distributed = rank_info().distributed
    from fastrecord.sinks.loggers import log_sinks
    from fastrecord.workers import claim_process

    claim_process()  # this process is the CLI's (see fastrecord.workers.claim_process)

    resume_shards = not distributed and resumes_shards(cfg)
    if distributed or resume_shards:  # torchrun: this process records one shard
        if early is not None:
            early.close()
        if resume_shards:
            print(
                f"resuming the sharded run {cfg.record.trajectory_name!r} in {cfg.output_dir} from its shards "
                f"({cfg.record.trajectory_name}.shards/), in this one process; the shards are joined again at the end"
            )
        with StopSignals("record") as stop:
            sharded = run_record_sharded(cfg, stop=stop, sinks=log_sinks(getattr(args, "log", None)))
            print_sharded(sharded, cfg.output_dir)
            return stop.exit_code
    with StopSignals("record") as stop:
        s = run_record(cfg, stop=stop, sinks=log_sinks(getattr(args, "log", None)), early=early)
        if s.interrupted:
            print(interrupted_line(s.interrupted, s.finished_before_stop, s.cut, cfg.record.keep, saved=False))
        if s.scheduled < cfg.episodes:
            print(f"resumed: {cfg.episodes - s.scheduled} of the run's {cfg.episodes} episodes were on disk, "
                  f"{s.scheduled} to record")
        print(f"episodes: {s.episodes} finished, {s.kept} kept, {s.successes} successful")
        print_results(s.results, s.finished_in_run, s.results_path)
        print_speed_and_files(s.env_steps, s.seconds, s.files, cfg.output_dir, s.startup_seconds)
        return stop.exit_code


def resumes_shards(cfg: RecordConfig) -> bool:
    """Whether ``cfg`` resumes a sharded run (``--if-exists resume``, and ``OUTPUT_DIR/NAME.shards/`` holds
    shard folders): `run_record_sharded` then continues it from its shards, whatever the world size."""
    from fastrecord.shards import list_shards

    name = cfg.record.trajectory_name
    if cfg.record.if_exists != "resume" or not name:
        return False
    return bool(list_shards(cfg.output_dir, name))


def interrupted_line(signal_name: str, finished: int, in_progress: int, keep: Any, saved: bool = True) -> str:
    """The one line an interrupted run prints before its summary (record: the episodes in progress are not
    ``saved``; replay in one process: the replays in progress are)."""
    cut = f"{in_progress} episode{'s' if in_progress != 1 else ''} in progress"
    if not saved:
        tail = (f"{cut} not saved (--if-exists resume records {'them' if in_progress != 1 else 'it'} whole)"
                if in_progress else "no episode in progress")
    else:
        tail = f"{cut} saved" if keep == "all" else f"{cut} saved if kept (keep={keep})"
    return f"interrupted ({signal_name}): stopped after {finished} episode{'s' if finished != 1 else ''}; {tail}"


def print_results(rows: list[dict[str, Any]], counted: int, path: Path | None) -> None:
    """The results part of a run's summary (record, replay): the first ``counted`` rows are the episodes
    the progress bar counted; rows after them ended at close (in progress, saved), listed but not rated."""
    from fastrecord.sinks.results import summary_lines

    lines = summary_lines(rows[:counted])
    extra = len(rows) - counted
    if extra > 0:
        lines[0] += f" (+{extra} in progress at the end: in the results file, not rated)"
    for line in lines:
        print(line)
    if path is not None:
        print(f"results: {path}")


def print_speed_and_files(env_steps: int, seconds: float, files: list[Path], where: str | Path,
                          startup: float | None = None) -> None:
    """The end of a run's summary (record, replay): start-up, throughput, then the first files written."""
    rate = env_steps / seconds if seconds > 0 else 0.0
    if startup is not None:
        print(f"start-up (env creation): {startup:.1f} s")
    print(f"speed: {env_steps} env-steps in {seconds:.1f} s = {rate:.1f} env-steps/s")
    print(f"files ({len(files)}) in {where}:")
    for f in files[:10]:
        print(f"  {f}")
    if len(files) > 10:
        print(f"  ... and {len(files) - 10} more")
