"""A recording process killed with SIGKILL leaves every finished episode readable and replayable; SIGTERM
does the same in a library user's process (fastrecord leaves its signals alone) and closes the run where
the process opted in (`fastrecord.install_signal_handlers`, as the ``fastrecord`` command does)."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
from conftest import run_then_kill

WORKER = Path(__file__).with_name("crash_worker.py")


def record_then_kill(out: Path, kind: str, min_finished: int, extra_s: float, sig: int = signal.SIGKILL,
                     opt_in: bool = False, codes: list[int] | None = None) -> int:
    """Start the worker, wait until ``min_finished`` episodes are durable, go on ``extra_s``, send ``sig``.

    Returns how many episodes the worker had reported durable before the kill; appends the worker's exit
    status to ``codes``. ``opt_in``: the worker calls `fastrecord.install_signal_handlers` first.
    """
    argv = [sys.executable, str(WORKER), str(out), kind] + (["signals"] if opt_in else [])
    finished, code = run_then_kill(argv, min_finished, extra_s, sig)
    if codes is not None:
        codes.append(code)
    return finished


def check_readable(out: Path, at_least: int) -> list[dict]:
    meta = json.loads((out / "crash.json").read_text())  # never half-written
    episodes = meta["episodes"]
    assert len(episodes) >= at_least
    with h5py.File(out / "crash.h5", "r") as f:  # opens: not ManiSkill's "bad object header"
        for e in episodes:  # every listed episode is there, whole
            g = f[f"traj_{e['episode_id']}"]
            assert g["actions"].shape[0] == e["elapsed_steps"]
            assert g["obs"].shape[0] == e["elapsed_steps"] + 1
            assert np.isfinite(g["obs"][:]).all()
    return episodes


@pytest.mark.parametrize("trial", range(3))
def test_kill_at_random_moments(tmp_path, trial):
    """Batched double (8 envs, 64x64): killed anywhere in the write cycle, the file pair stays consistent."""
    random.seed(trial)
    durable = record_then_kill(tmp_path, "double", min_finished=8, extra_s=random.uniform(0.0, 1.5))
    check_readable(tmp_path, at_least=durable)


def test_kill_real_env_then_replay(tmp_path):
    """PickCube-v1 on the CPU: after SIGKILL, ManiSkill's replay tool replays every surviving episode."""
    durable = record_then_kill(tmp_path, "maniskill", min_finished=3, extra_s=1.0)
    episodes = check_readable(tmp_path, at_least=durable)
    out = subprocess.run(
        [sys.executable, "-m", "mani_skill.trajectory.replay_trajectory", "--traj-path", str(tmp_path / "crash.h5"),
         "--use-env-states", "--allow-failure", "-b", "physx_cpu"],
        capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"Replayed {len(episodes)} episodes" in out.stdout + out.stderr


def test_consolidate_after_a_crash(tmp_path):
    """consolidate() turns the crash-left index + parts into one self-contained file with the same data."""
    from fastrecord.sinks.maniskill_h5 import consolidate

    durable = record_then_kill(tmp_path, "double", min_finished=16, extra_s=0.3)
    before = check_readable(tmp_path, at_least=durable)
    with h5py.File(tmp_path / "crash.h5") as f:
        obs = {k: f[k]["obs"][:] for k in f}
    consolidate(tmp_path / "crash.h5")
    assert not (tmp_path / "crash.h5.parts").exists()
    after = check_readable(tmp_path, at_least=durable)
    # every indexed episode, unchanged; complete parts the crash left unindexed are kept too, after them
    assert after[: len(before)] == before
    assert [e["episode_id"] for e in after] == list(range(len(after)))
    with h5py.File(tmp_path / "crash.h5") as f:
        assert all(f.get(k, getlink=True).__class__ is h5py.HardLink for k in f)
        for k, v in obs.items():
            np.testing.assert_array_equal(f[k]["obs"][:], v)


def test_sigterm_in_a_library_users_process_kills_it_and_keeps_finished_episodes(tmp_path):
    """Without the opt-in SIGTERM does what it does to any Python program (exit -15, no ``finally``, no
    exit hooks); every episode reported durable is still readable."""
    codes: list[int] = []
    durable = record_then_kill(tmp_path, "double", min_finished=8, extra_s=0.3, sig=signal.SIGTERM, codes=codes)
    assert codes == [-signal.SIGTERM]
    check_readable(tmp_path, at_least=durable)


def test_sigterm_after_the_opt_in_closes_the_run(tmp_path):
    """With `install_signal_handlers` SIGTERM is SystemExit(143): the script's ``finally`` closes the env, so
    the trajectory is consolidated and the run marked closed."""
    codes: list[int] = []
    durable = record_then_kill(tmp_path, "double", min_finished=8, extra_s=0.3, sig=signal.SIGTERM, opt_in=True,
                               codes=codes)
    assert codes == [143]
    check_readable(tmp_path, at_least=durable)
    assert not (tmp_path / "crash.h5.parts").exists()
    assert json.loads((tmp_path / "crash.fastrecord.json").read_text())["status"] == "closed"


def test_recording_leaves_the_process_signal_handlers_alone(tmp_path):
    import fastrecord
    from fastrecord import RecordEpisode
    from fastrecord.testing import BatchedDoubleEnv

    before = signal.getsignal(signal.SIGTERM)
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        env = RecordEpisode(BatchedDoubleEnv(num_envs=2, max_episode_steps=2), tmp_path, save_video=False)
        env.close()
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        assert fastrecord.install_signal_handlers() is True  # the opt-in: only over the default
        with pytest.raises(SystemExit) as exit_:
            signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)
        assert exit_.value.code == 143
        mine = lambda signum, frame: None  # noqa: E731 - a handler the program installed itself
        signal.signal(signal.SIGTERM, mine)
        assert fastrecord.install_signal_handlers() is False and signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, before)


def test_run_then_kill_never_hangs():
    """The helper fails, and kills the worker, when the worker stays silent or ignores the signal (it used to
    block on the worker's next line, and wait for its exit, without end)."""
    silent = [sys.executable, "-c", "import time; time.sleep(60)"]
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match="worker too slow: 0/1 episodes in 2 s"):
        run_then_kill(silent, 1, 0.0, timeout=2)
    stubborn = [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "print('finished 1', flush=True); time.sleep(60)"]
    with pytest.raises(AssertionError, match="did not stop within 2 s of signal"):
        run_then_kill(stubborn, 1, 0.0, sig=signal.SIGTERM, timeout=30, stop_timeout=2)
    assert time.monotonic() - t0 < 30
    assert run_then_kill([sys.executable, "-c", "print('finished 3', flush=True); import time; time.sleep(60)"],
                         2, 0.2) == (3, -signal.SIGKILL)
