"""WorkerPool: bounded queue, ordered single worker, errors re-raised in the caller, idempotent close."""

from __future__ import annotations

import threading
import time

import pytest

from fastrecord.workers import WorkerError, WorkerPool


def test_runs_every_job_in_order_with_one_worker():
    seen = []
    with WorkerPool(seen.append, num_workers=1, max_pending=2) as pool:
        for i in range(50):
            pool.submit(i)
    assert seen == list(range(50))


def test_backpressure_blocks_the_producer_instead_of_dropping():
    gate = threading.Event()
    done = []

    def slow(job):
        gate.wait()
        done.append(job)

    pool = WorkerPool(slow, num_workers=1, max_pending=2)
    pool.submit(0)  # taken by the worker, which waits at the gate
    time.sleep(0.05)
    pool.submit(1)
    pool.submit(2)  # queue full now
    t = threading.Thread(target=pool.submit, args=(3,))
    t.start()
    t.join(timeout=0.2)
    assert t.is_alive()  # the producer waits
    gate.set()
    t.join(timeout=5)
    pool.close()
    assert sorted(done) == [0, 1, 2, 3]


def test_errors_are_raised_in_the_caller():
    def fail_on_3(job):
        if job == 3:
            raise KeyError("bad job 3")

    pool = WorkerPool(fail_on_3, num_workers=2, max_pending=4)
    for i in range(5):
        pool.submit(i)
    with pytest.raises(WorkerError, match="KeyError: 'bad job 3'") as info:
        pool.wait_until_done()
    assert isinstance(info.value.__cause__, KeyError)
    with pytest.raises(WorkerError):
        pool.submit(6)
    with pytest.raises(WorkerError):
        pool.close()
    pool.close()  # idempotent: nothing more to raise


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_workers=0 must be >= 1"):
        WorkerPool(print, num_workers=0)


def test_backpressure_wait_is_counted():
    def slow(job):
        time.sleep(0.05)

    with WorkerPool(slow, num_workers=1, max_pending=1) as pool:
        for i in range(4):
            pool.submit(i)
        pool.wait_until_done()
        assert pool.blocked_seconds > 0.03


def test_helper_processes_run_below_the_callers_priority(monkeypatch):
    """Encoder and HDF5 writer processes take FASTRECORD_BACKGROUND_NICE (default 10, or SCHED_IDLE), so the
    stepping process and a CPU vector env's sub-envs get the cores first; a bad value names the variable."""
    import os

    from fastrecord.video.pool import EncoderProcessPool
    from fastrecord.workers import DEFAULT_NICE, IsolatedProcess, background_nice

    def priority(pid: int) -> tuple[int, bool]:
        deadline = time.monotonic() + 20  # the child lowers its priority first thing after its imports
        while time.monotonic() < deadline:
            nice = os.getpriority(os.PRIO_PROCESS, pid) - os.getpriority(os.PRIO_PROCESS, 0)
            idle = os.sched_getscheduler(pid) == os.SCHED_IDLE
            if nice or idle:
                break
            time.sleep(0.05)
        return nice, idle

    monkeypatch.delenv("FASTRECORD_BACKGROUND_NICE", raising=False)
    assert background_nice() == DEFAULT_NICE == 10
    pool = EncoderProcessPool(1)
    writer = IsolatedProcess("fastrecord.sinks.maniskill_h5")
    try:
        pool.start(1)
        assert priority(pool.pids()[0]) == (min(10, 19 - os.getpriority(os.PRIO_PROCESS, 0)), False)
        assert priority(writer.pid)[0] > 0
    finally:
        writer.stop()
        pool.close()

    monkeypatch.setenv("FASTRECORD_BACKGROUND_NICE", "idle")
    pool = EncoderProcessPool(1)
    try:
        pool.start(1)
        assert priority(pool.pids()[0])[1] is True
    finally:
        pool.close()

    for bad in ("-3", "20", "low"):
        monkeypatch.setenv("FASTRECORD_BACKGROUND_NICE", bad)
        with pytest.raises(ValueError, match=r"FASTRECORD_BACKGROUND_NICE=.*0 .* 19, or 'idle'"):
            background_nice()


def test_forkserver_preloads_maniskill_once(tmp_path):
    """Replay workers and CPU vector envs come from one forkserver that imported ManiSkill and fastrecord's
    env code before forking (spawn imported them in every process). In a fresh process: the server is
    one per process, and its preload is fixed when it starts."""
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "probe.py"
    script.write_text(
        "import sys\n"
        "def probe():\n"
        "    return sorted(m for m in ('mani_skill', 'torch', 'fastrecord.replay.envs', 'fastrecord.replay.workers')\n"
        "                  if m in sys.modules)\n"
        "if __name__ == '__main__':\n"
        "    from fastrecord.workers import forkserver_context\n"
        "    ctx = forkserver_context()\n"
        "    assert 'mani_skill' not in sys.modules  # the caller itself imported nothing heavy\n"
        "    with ctx.Pool(1) as pool:\n"
        "        print(pool.apply(probe))\n")
    src = str(Path(__file__).parents[1] / "src")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                       env={**__import__("os").environ, "PYTHONPATH": src})
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "['fastrecord.replay.envs', 'fastrecord.replay.workers', 'mani_skill', 'torch']"


def test_processes_of_ours_freeze_their_imports(tmp_path):
    """A replay's sub-env process freezes the objects its imports made (`fastrecord.workers.freeze_imports`,
    which replay workers and the CLI call too), so that ManiSkill's gc.collect() at each scene build skips
    them; importing fastrecord in a user's process freezes nothing."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("import gc\n"
            "from fastrecord.replay.envs import in_worker\n"
            "before = gc.get_freeze_count()\n"
            "after = in_worker(gc.get_freeze_count)\n"
            "print(before, after > 10000)\n")
    src = str(Path(__file__).parents[1] / "src")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**__import__("os").environ, "PYTHONPATH": src})
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["0", "True"]
