"""One command of the fault matrix (tests/test_faults.py), stopped by a fault, or resumed after one.

    python fault_worker.py OUT COMMAND OUTPUTS FAULT [resume] [SOURCE.h5]

COMMAND: ``record`` (``fastrecord record`` PickCube-v1, the CLI with its signal handlers), ``eval``
(``make_eval_envs``, one CPU env, a script's loop: SIGTERM is Python's default, Ctrl-C a
KeyboardInterrupt) or ``replay`` (``fastrecord replay SOURCE.h5``). OUTPUTS: ``h5``, ``mp4``,
``lerobot`` joined by ``+`` (the results file is always written); ``rgb`` records a camera image too.
FAULT: ``none`` (run until killed), ``sink-error:K`` (a user sink raises in the stepping thread when
episode K ends), ``enospc:K`` (a background sink's write of episode K fails with ENOSPC) or
``killed-at-commit:K`` (the process dies once K kept episodes are committed, before any output is closed).
A thread prints ``finished N`` whenever N kept episodes are committed (rows in OUT/run.results.jsonl),
for `conftest.run_then_kill`.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "src"))  # this checkout's fastrecord

from fastrecord.system import use_lavapipe_if_no_gpu

use_lavapipe_if_no_gpu()

from fastrecord.sinks.base import BackgroundSink, Sink  # noqa: E402

EPISODES = int(os.environ.get("FAULT_EPISODES", 6))  # record, replay: the run's total; eval: episodes a session runs
STEPS = 4  # steps an episode (max_episode_steps)


class SinkError(Sink):
    """A user's sink that raises when kept episode ``at`` is submitted (on the stepping thread)."""

    wants_datasets = False

    def __init__(self, at: int) -> None:
        self.at = at

    def submit(self, episodes):
        if any(ep.episode_id == self.at for ep in episodes):
            raise RuntimeError(f"injected: the sink failed at episode {self.at}")


class DiskFull(BackgroundSink):
    """A sink writing in the background whose write of episode ``at`` fails as a full disk does."""

    wants_datasets = False

    def __init__(self, at: int) -> None:
        self.at = at

    def write(self, episode):
        if episode.episode_id == self.at:
            raise OSError(errno.ENOSPC, "No space left on device (injected)")


class KilledAtCommit(Sink):
    """A user's sink whose process dies (``os._exit(9)``, as a SIGKILL leaves it: no close, no exit handler) once
    the run's commit log reaches ``at`` kept episodes: every row written, no output's files finished."""

    wants_datasets = False

    def __init__(self, at: int) -> None:
        self.at = at

    def submit(self, episodes):
        pass

    def after_commit(self, committed, wait):
        if committed >= self.at:
            print(f"injected: killed at commit {committed}", flush=True)
            os._exit(9)


def committed(out: Path) -> int:
    """Kept episodes committed in OUT/run (its results file, or its shards' of a sharded replay)."""
    n = 0
    for results in [out / "run.results.jsonl", *sorted(out.glob("run.shards/rank*/run.results.jsonl"))]:
        try:
            rows = [json.loads(x) for x in results.read_text().splitlines() if x.strip()]
            n += sum(r.get("episode_id") is not None for r in rows)
        except (OSError, ValueError):
            pass
    return n


def report(out: Path) -> None:
    """Print ``finished N`` whenever the committed kept episodes grow."""
    last = -1
    while True:
        n = committed(out)
        if n != last:
            print(f"finished {n}", flush=True)
            last = n
        time.sleep(0.05)


def fault_sinks(fault: str) -> list[Sink]:
    kind, _, at = fault.partition(":")
    return {"none": [], "sink-error": [SinkError(int(at or 0))], "enospc": [DiskFull(int(at or 0))],
            "killed-at-commit": [KilledAtCommit(int(at or 0))]}[kind]


def flags(outputs: set[str]) -> list[str]:
    out = [] if "h5" in outputs else ["--no-trajectory"]
    out += [] if "mp4" in outputs else ["--no-video"]
    return out + (["--lerobot"] if "lerobot" in outputs else [])


def hold_lerobot_parts() -> None:
    """LeRobot's committed episodes stay parts until the close (no file group is written while recording), so
    that a kill finds each of them as a part (FAULT_HOLD_LEROBOT_PARTS=1)."""
    from fastrecord.sinks.lerobot.writer import LeRobotWriter

    roll = LeRobotWriter.roll
    LeRobotWriter.roll = lambda self, final=False: roll(self, final) if final else None  # type: ignore[method-assign]


def main(out: str, command: str, outputs: set[str], fault: str, resume: bool, source: str | None) -> int:
    threading.Thread(target=report, args=(Path(out),), daemon=True).start()
    if os.environ.get("FAULT_HOLD_LEROBOT_PARTS"):
        hold_lerobot_parts()
    sinks = fault_sinks(fault)
    import fastrecord.sinks.loggers as loggers

    loggers.log_sinks = lambda log: list(sinks)  # the CLIs' --log sinks: the injected fault
    return run(out, command, outputs, sinks, resume, source)


def run(out: str, command: str, outputs: set[str], sinks: list[Sink], resume: bool, source: str | None) -> int:
    """COMMAND into OUT/run (``sinks``: eval's extra sinks; the CLIs take theirs from ``log_sinks``)."""
    from fastrecord.commands.cli import main as cli

    obs = ["--obs-mode", "rgb"] if "rgb" in outputs else []
    if command == "record":
        return cli(["record", "PickCube-v1", "--episodes", str(EPISODES), "--max-episode-steps", str(STEPS), "--width",
                    "32", "--height", "32", "--output-dir", out, "--trajectory-name", "run", "--keep", "all",
                    *obs, *flags(outputs), *(["--if-exists", "resume"] if resume else [])])
    if command in ("replay", "replay2"):  # replay2: two worker processes, a sharded replay
        workers = "2" if command == "replay2" else "1"
        return cli(["replay", source, "--output-dir", out, "--trajectory-name", "run", "--workers", workers,
                    "--num-envs", workers, "--keep", "all", "--width", "32", "--height", "32", *obs, *flags(outputs),
                    *(["--resume"] if resume else [])])
    return evaluate(out, outputs, sinks, resume)


def evaluate(out: str, outputs: set[str], sinks: list[Sink], resume: bool) -> int:
    """A policy evaluation's usual script: make_eval_envs, a loop of EPISODES episodes, close."""
    import numpy as np

    from fastrecord import make_eval_envs

    env_kwargs = dict(obs_mode="rgb" if "rgb" in outputs else "state", render_mode="rgb_array", max_episode_steps=STEPS,
                      human_render_camera_configs=dict(width=32, height=32),
                      sensor_configs=dict(width=32, height=32))
    envs = make_eval_envs("PickCube-v1", 1, "physx_cpu", env_kwargs, dict(obs_horizon=1), video_dir=out,
                          record_kwargs=dict(trajectory_name="run", save_trajectory="h5" in outputs,
                                             save_video="mp4" in outputs, lerobot="lerobot" in outputs, sinks=sinks,
                                             if_exists="resume" if resume else "error"))
    try:
        envs.reset(seed=1000 if resume else 0)
        for _ in range(EPISODES * STEPS):
            envs.step(np.stack([envs.single_action_space.sample()]))
    finally:
        envs.close()
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # what a program started from a shell has
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also when the tests run in a background job
    args = sys.argv[1:]
    rest = args[4:]
    resume = "resume" in rest
    source = next((a for a in rest if a.endswith(".h5")), None)
    sys.exit(main(args[0], args[1], set(args[2].split("+")), args[3], resume, source))
