"""WorkerPool: bounded queue, ordered single worker, errors re-raised in the caller, idempotent close."""

from __future__ import annotations

import json
import os
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


def _priority(pid: int, settled: bool = False) -> tuple[int, bool]:
    """(niceness above this process's, SCHED_IDLE?) of a helper; unless ``settled``, waits up to 20 s for
    the child to lower its priority (first thing after its imports)."""
    import os

    deadline = time.monotonic() + (0 if settled else 20)
    while True:
        nice = os.getpriority(os.PRIO_PROCESS, pid) - os.getpriority(os.PRIO_PROCESS, 0)
        idle = os.sched_getscheduler(pid) == os.SCHED_IDLE
        if nice or idle or time.monotonic() >= deadline:
            return nice, idle
        time.sleep(0.05)


def test_encoder_processes_run_below_the_callers_priority(monkeypatch):
    """Encoder processes take FASTRECORD_BACKGROUND_NICE (default 10, or SCHED_IDLE), so the stepping
    process and a CPU vector env's sub-envs get the cores first; a bad value names the variable."""
    import os

    from fastrecord.processes import DEFAULT_NICE, background_nice
    from fastrecord.video.pool import EncoderProcessPool

    monkeypatch.delenv("FASTRECORD_BACKGROUND_NICE", raising=False)
    assert background_nice() == DEFAULT_NICE == 10
    pool = EncoderProcessPool(1)
    try:
        pool.start(1)
        assert pool.wait_started(30)
        assert _priority(pool.pids()[0]) == (min(10, 19 - os.getpriority(os.PRIO_PROCESS, 0)), False)
    finally:
        pool.close()

    monkeypatch.setenv("FASTRECORD_BACKGROUND_NICE", "idle")
    pool = EncoderProcessPool(1)
    try:
        pool.start(1)
        assert pool.wait_started(30)
        assert _priority(pool.pids()[0])[1] is True
    finally:
        pool.close()

    for bad in ("-3", "20", "low"):
        monkeypatch.setenv("FASTRECORD_BACKGROUND_NICE", bad)
        with pytest.raises(ValueError, match=r"FASTRECORD_BACKGROUND_NICE=.*0 .* 19, or 'idle'"):
            background_nice()


@pytest.mark.parametrize("setting", [None, "19", "idle"])
def test_hdf5_writer_processes_run_at_the_callers_priority(tmp_path, monkeypatch, setting):
    """The recorder waits for its HDF5 writers (backpressure, close), as ManiSkill's wrapper waits for its
    in-process writes: they run at the caller's priority, whatever FASTRECORD_BACKGROUND_NICE says (below
    it, a machine with one busy core starved them). Checked after every process has answered a call, so
    any change of priority would have happened; the part file is read back."""
    import h5py
    import numpy as np

    from fastrecord.episode import EpisodeData
    from fastrecord.sinks.maniskill_h5 import TrajectoryWriter

    if setting is None:
        monkeypatch.delenv("FASTRECORD_BACKGROUND_NICE", raising=False)
    else:
        monkeypatch.setenv("FASTRECORD_BACKGROUND_NICE", setting)
    rgb = np.arange(3 * 8 * 8 * 3, dtype=np.uint8).reshape(3, 8, 8, 3)
    episodes = [EpisodeData(i, 0, 2, {"actions": np.full((2, 4), i, np.float32), "obs/sensor_data/cam/rgb": rgb},
                            dict(episode_id=i, episode_seed=i, elapsed_steps=2)) for i in range(2)]
    w = TrajectoryWriter(
        tmp_path / "run.h5", {"env_info": {"env_id": "Test-v0"}}, num_writers=2, consolidate_on_close=False
    )
    try:
        w.submit(episodes)  # one part per writer: both answer
        w.wait_until_done()  # the index process answers too
        assert len(w.pids) == 3
        for pid in w.pids:
            assert _priority(pid, settled=True) == (0, False), pid
    finally:
        w.close()
    with h5py.File(tmp_path / "run.h5", "r") as f:
        assert f["traj_1/actions"][0, 0] == 1 and (f["traj_0/obs/sensor_data/cam/rgb"][()] == rgb).all()


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


# ---------------------------------------------------------------------------------------------- helper processes
def test_helper_process_calls_by_name_and_by_reference_and_reraises_errors():
    """One child-process layer: calls by a function name of the served module or by a module-level function
    of any fastrecord module; a child's builtin exception is raised here with its type, errno and traceback;
    by default the child is gone after an error."""
    from fastrecord.processes import IsolatedProcess, RemoteError
    from fastrecord.video.encode import codec_available, resolve_codec

    proc = IsolatedProcess("fastrecord.video.encode", "the probe process")
    try:
        assert proc.call("resolve_codec", "libx264") == "libx264"
        assert proc.call(codec_available, "libx264") is True  # another module's function, by reference
        with pytest.raises(TypeError, match="module-level function of a fastrecord module"):
            proc.call(lambda: None)
        with pytest.raises(KeyError) as info:
            proc.call("_checked.__getitem__", "missing")  # a dotted name resolves too
        assert info.value.args == ("missing",)
        assert (
            "raised in the probe process (pid" in info.value.__notes__[0] and "KeyError" in info.value.remote_traceback
        )
        assert proc.poll() == 1 and not proc.alive()
    finally:
        proc.stop()
    proc.stop()  # idempotent
    with pytest.raises(RuntimeError, match="on a stopped process"):
        proc.call(resolve_codec, "libx264")

    keeper = IsolatedProcess("fastrecord.video.encode", "the keeper", keep_after_error=True)
    try:
        with pytest.raises(FileNotFoundError) as info:
            keeper.call("_publish", "/nonexistent/a.part", "/nonexistent/a.mp4")
        assert info.value.errno == 2
        assert keeper.call("resolve_codec", "libx264") == "libx264"  # it served the next call
        with pytest.raises(RemoteError, match=r"UnknownCodecError: .*nope"):  # not a builtin type
            keeper.call("av.codec.Codec", "nope", "w")
    finally:
        keeper.stop()


def _unknown_codec() -> None:
    """Not a fastrecord function: refused by reference (only fastrecord modules are resolved in the child)."""


def test_helper_process_refuses_foreign_functions_and_reports_a_dead_child():
    import os
    import signal

    from fastrecord.processes import ChildDied, IsolatedProcess

    proc = IsolatedProcess("fastrecord.video.encode", "the victim")
    try:
        with pytest.raises(TypeError, match="_unknown_codec"):
            proc.call(_unknown_codec)
        assert proc.call("codec_available", "libx264") is True
        os.kill(proc.pid, signal.SIGKILL)
        with pytest.raises(ChildDied, match=r"the victim \(pid \d+\) was killed by signal SIGKILL \(9\)") as info:
            proc.call("codec_available", "libx264")
        assert info.value.returncode == -9
        with pytest.raises(ChildDied, match="was killed"):
            proc.notify("codec_available", "libx264")
    finally:
        proc.stop()
    with pytest.raises(ValueError, match="serves a fastrecord module"):
        IsolatedProcess("os")


def test_helper_process_takes_file_descriptors_and_one_way_requests(tmp_path):
    """``fds=`` passes descriptors (the encoder pool's staging arenas) to a one-way request; a failed one-way
    request ends the child and is raised by the next call."""
    import os

    from fastrecord import staging
    from fastrecord.processes import IsolatedProcess

    path = tmp_path / "data"
    path.write_bytes(b"x" * 4096)
    proc = IsolatedProcess("fastrecord.staging", "the mapper", keep_after_error=True)
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            proc.notify(staging.map_arena, 7, 4096, fds=[fd])
        finally:
            os.close(fd)
        mapped = "_mapped.__len__"  # the arenas the helper process holds mapped
        assert proc.call(mapped) == 1
        proc.notify(staging.forget_arena, 7)
        assert proc.call(mapped) == 0
        proc.notify(staging.map_arena, 8, 4096)  # no descriptor: a TypeError there
        with pytest.raises(TypeError, match="fd"):
            proc.call(mapped)
        assert not proc.alive()
    finally:
        proc.stop()


def test_no_import_circle_through_the_process_video_and_staging_modules():
    """`scripts/import_cycles.py` reads every import of the package (function-level ones included): no
    circle runs through the helper-process, worker, video, staging or buffer modules."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).parents[1]
    spec = importlib.util.spec_from_file_location("import_cycles", root / "scripts" / "import_cycles.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    ours = ("fastrecord.processes", "fastrecord.workers", "fastrecord.video", "fastrecord.staging", "fastrecord.buffer")
    found = [c for c in mod.cycles(root / "src" / "fastrecord") if any(m.startswith(ours) for m in c)]
    assert found == []


def test_the_forkserver_started_by_the_make_eval_envs_import(tmp_path):
    """`from fastrecord import make_eval_envs` starts the forkserver in a script's main process (its preload then
    overlaps the script's imports), not in a process multiprocessing started, nor on a machine of few cores."""
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "probe.py"
    script.write_text(
        "import multiprocessing, pickle\n"
        "from multiprocessing import forkserver\n"
        "def child():\n"
        "    from fastrecord import make_eval_envs  # noqa: F401\n"
        "    return forkserver._forkserver._forkserver_pid is None\n"
        "if __name__ == '__main__':\n"
        "    import fastrecord\n"
        "    fastrecord.PRESTART_CORES = 10 ** 6  # a machine with fewer cores: no server started\n"
        "    fastrecord._prestart_forkserver()\n"
        "    print('few cores', forkserver._forkserver._forkserver_pid is None)\n"
        "    fastrecord.PRESTART_CORES = 1\n"
        "    from fastrecord import make_eval_envs  # noqa: F401\n"
        "    print('server', forkserver._forkserver._forkserver_pid is not None)\n"
        "    from fastrecord.workers import forkserver_context\n"
        "    with forkserver_context().Pool(1) as pool:\n"
        "        print('child starts none', pool.apply(child))\n")
    src = str(Path(__file__).parents[1] / "src")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600,
                       env={**__import__("os").environ, "PYTHONPATH": src})
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.splitlines() == [
        "few cores True",
        "server True",
        "child starts none True",
    ]


def test_the_clis_fork_guess_imports_no_numpy():
    """The CLI guesses whether it forks (`_replay_forks`, `_record_forks`) and starts the forkserver before its own
    imports: the guess imports nothing heavy (numpy: 0.1 s of the 2-core machine before the server's fork)."""
    import subprocess
    import sys

    code = ("import sys; from fastrecord.commands.cli import _record_forks, _replay_forks; "
            "_replay_forks(['replay', 'x.h5']); _record_forks(['record', 'PickCube-v1', '--num-envs', '4']); "
            "print(sorted(m for m in ('numpy', 'torch', 'mani_skill', 'sapien') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[]"


def test_record_starts_the_forkserver_first_where_its_envs_fork(monkeypatch):
    """`fastrecord record` guesses from its command line whether its envs step in forkserver processes (CPU
    simulation, several envs, the batched render or drawn by the CPU) and then starts the server before its own
    imports."""
    from fastrecord import system
    from fastrecord.commands.cli import _record_forks

    monkeypatch.setattr(system, "has_nvidia_gpu", lambda: True)
    assert _record_forks(["record", "PickCube-v1", "--num-envs", "16"])
    assert _record_forks(["record", "--num-envs=4", "--render-backend", "gpu"])
    assert _record_forks(["record", "--num-envs", "4", "--render-backend", "cpu", "--batched-render", "on"])
    # drawn by the CPU: each env in a process of its own where they draw something (`fastrecord.reported`)
    assert _record_forks(["record", "--num-envs", "4", "--render-backend", "cpu"])
    assert not _record_forks(["record", "--num-envs", "4", "--render-backend", "cpu", "--no-video"])
    assert _record_forks(["record", "--num-envs", "4", "--render-backend", "cpu", "--no-video", "--obs-mode", "rgb"])
    assert not _record_forks(["record", "--num-envs", "4", "--render-backend", "cpu", "--vector", "sync"])
    assert not _record_forks(["record", "--num-envs", "4", "--render-backend", "cpu", "--render-substeps"])
    assert not _record_forks(["record", "--num-envs", "4", "--batched-render", "off"])  # each drawing on the GPU
    assert _record_forks(["record", "--num-envs", "4", "--batched-render", "off", "--vector", "async"])
    assert not _record_forks(["record", "--num-envs", "1"])
    assert not _record_forks(["record", "PickCube-v1"])  # one env by default
    assert not _record_forks(["record", "--num-envs", "16", "--sim-backend", "physx_cuda"])  # one batched GPU env
    assert not _record_forks(["record", "--num-envs", "16", "--help"])
    assert not _record_forks(["replay", "x.h5", "--num-envs", "16"])
    monkeypatch.setattr(system, "has_nvidia_gpu", lambda: False)
    assert _record_forks(["record", "--num-envs", "16"])  # auto: the CPU draws, each env in a process
    assert not _record_forks(["record", "--num-envs", "16", "--no-video"])
    # the sub-envs started early follow the same guess on the run's config (none where nothing forks)
    import dataclasses

    import fastrecord
    from fastrecord.commands.config import RecordConfig
    from fastrecord.commands.record_env import early_subenvs

    cfg = RecordConfig(num_envs=16)
    assert early_subenvs(cfg) is None  # auto render, no CUDA: no batched render
    monkeypatch.setattr(system, "has_nvidia_gpu", lambda: True)
    monkeypatch.setattr(fastrecord, "PRESTART_CORES", 10 ** 6)
    assert early_subenvs(cfg) is None  # too few cores: the forkserver starts after the imports
    monkeypatch.setattr(fastrecord, "PRESTART_CORES", 1)
    assert early_subenvs(dataclasses.replace(cfg, num_envs=1)) is None
    assert early_subenvs(dataclasses.replace(cfg, batched_render="off")) is None
    assert early_subenvs(dataclasses.replace(cfg, sim_backend="physx_cuda")) is None
    assert early_subenvs(dataclasses.replace(cfg, record=dataclasses.replace(cfg.record, save_video=False))) is None


ZYGOTE_SCRIPT = """
import os, signal, sys, threading
import torch
from multiprocessing import forkserver
from fastrecord import workers
mode = sys.argv[1]
if __name__ == "__main__":
    (torch.ones(1 << 20) + 1).sum()  # torch's OpenMP threads started (on more than one core)
    signal.signal(signal.SIGTERM, lambda *a: None)  # a handler of the caller's: not the children's
    if mode == "thread":
        stop = threading.Event()
        threading.Thread(target=stop.wait, daemon=True).start()
    if mode == "driver":
        import gymnasium as gym
        import mani_skill.envs  # noqa: F401
        from fastrecord.system import use_lavapipe_if_no_gpu
        use_lavapipe_if_no_gpu()
        gym.make("PickCube-v1", obs_mode="state", render_mode="rgb_array", sim_backend="physx_cpu",
                 human_render_camera_configs=dict(width=32, height=32)).reset(seed=0)  # a Vulkan driver loaded
    import fcntl
    held = -1
    if mode == "file":  # a lock file this process holds as the server starts
        held = os.open(sys.argv[2], os.O_RDWR | os.O_CREAT)
        fcntl.flock(held, fcntl.LOCK_EX)
    workers.start_forkserver()  # as `from fastrecord import make_eval_envs` does near a script's top


class DefinedAfter:  # defined after the server started: a fork of the caller at that line had not run this
    pass


def child(held_fd, held_path):
    from fastrecord.deferred import is_deferred
    main = sys.modules["__main__"]
    return dict(name=main.__name__, defined_after=hasattr(main, "DefinedAfter"), mani_skill="mani_skill" in sys.modules,
                pyplot_deferred=is_deferred(sys.modules.get("matplotlib.pyplot")),
                sigterm_default=signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
                parallel_op=float((torch.ones(1 << 20) * 2).sum()), held_fd=_points_to(held_fd, held_path))


def _points_to(fd, path):
    if fd < 0:
        return "none held"
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return "closed"
    return "devnull" if target == os.devnull else "the lock file" if target == os.path.realpath(path) else "other"


if __name__ == "__main__":
    import json
    if mode == "thread":
        stop.set()
    with workers.forkserver_context().Pool(1) as pool:
        answer = pool.apply(child, (held, sys.argv[2]))
        if held >= 0:
            os.close(held)  # released here while the server runs: a new holder must get it
            again = os.open(sys.argv[2], os.O_RDWR)
            try:
                fcntl.flock(again, fcntl.LOCK_EX | fcntl.LOCK_NB)
                answer["lock_free"] = True
            except BlockingIOError:
                answer["lock_free"] = False
    from fastrecord.deferred import DeferringFinder
    answer["caller_deferring"] = any(isinstance(f, DeferringFinder) for f in sys.meta_path)
    print(json.dumps(dict(origin=workers.forkserver_origin(), server=forkserver._forkserver._forkserver_pid,
                          **answer)))
"""


@pytest.mark.parametrize("mode", ["safe", "thread", "file", "driver", "off"])
def test_the_forkserver_is_the_callers_fork_where_that_is_safe(tmp_path, mode):
    """Where the caller has no other Python thread, no regular file open and no GPU driver loaded, its forkserver is the caller forked
    (`workers.start_forkserver`: torch, ManiSkill and the caller's modules already imported); elsewhere, or with
    FASTRECORD_ZYGOTE=0, a fresh interpreter. Either way its children are what a fresh server's are: the script's
    main module run anew as ``__mp_main__`` (a class defined after the line that started the server unpickles),
    default signal handlers, ManiSkill preloaded, torch's parallel ops working (the caller's OpenMP threads are not
    in a fork), none of the caller's open files (a lock file's flock is free once the caller lets go), ManiSkill's
    unused imports deferred (`fastrecord.deferred`; never in the caller's own process); and the server ends with the
    caller (its copy of the "alive" pipe's write end pointed at /dev/null)."""
    import subprocess
    import sys
    import time
    from pathlib import Path

    script = tmp_path / "zygote.py"
    script.write_text(ZYGOTE_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src"),
           "FASTRECORD_TIMELINE": str(tmp_path / "timeline.json")}
    if mode == "off":
        env["FASTRECORD_ZYGOTE"] = "0"
    r = subprocess.run([sys.executable, str(script), mode, str(tmp_path / "held.lock")], capture_output=True,
                       text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    answer = json.loads(r.stdout.strip().splitlines()[-1])
    assert answer.pop("origin") == ("zygote" if mode == "safe" else "spawned")
    if mode == "safe":  # the server's preload timed in a file of its own (benchmarks/bench_replay.py --stamps)
        assert "forkserver_preloaded" in json.loads((tmp_path / "timeline.json.forkserver").read_text())
    server = answer.pop("server")
    if mode == "file":  # a regular file open (a library's state about it would be stale in a fork): a fresh server
        assert answer.pop("held_fd") != "the lock file" and answer.pop("lock_free") is True
    else:
        assert answer.pop("held_fd") == "none held"
    # the server and its children are fastrecord's: ManiSkill's unused imports deferred there
    # (`fastrecord.deferred`), not in the caller's process
    assert answer == dict(name="__mp_main__", defined_after=True, mani_skill=True, pyplot_deferred=True,
                          sigterm_default=True, parallel_op=float(2 << 20), caller_deferring=False)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the server leaves once its caller has
        try:
            os.kill(server, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the forkserver {server} outlived its caller")


def test_a_cuda_driver_mapped_but_not_initialised_leaves_the_fork_safe(monkeypatch):
    """torch's CUDA builds map libcuda at import without initialising it (``cuInit``): a fork can still use CUDA
    then, and the forkserver may be the caller's fork. Initialised, or a Vulkan driver loaded: a fresh server."""
    import threading

    from fastrecord import workers

    monkeypatch.setattr(threading, "active_count", lambda: 1)
    monkeypatch.setattr(workers, "_open_regular_files", list)
    maps = "7f00-7f01 r-xp 0 0:0 0 /usr/lib/x86_64-linux-gnu/libcuda.so.565.57.01\n"
    monkeypatch.setattr(workers, "_mapped_files", lambda: maps)
    monkeypatch.setattr(workers, "_cuda_driver_initialised", lambda: False)
    assert workers.fork_refusal() is None
    monkeypatch.setattr(workers, "_cuda_driver_initialised", lambda: True)
    assert workers.fork_refusal() == "libcuda.so"
    monkeypatch.setattr(workers, "_cuda_driver_initialised", lambda: False)
    maps += "7f02-7f03 r-xp 0 0:0 0 /usr/lib/x86_64-linux-gnu/libGLX_nvidia.so.0\n"
    assert workers.fork_refusal() == "libGLX_nvidia"
    monkeypatch.setattr(workers, "_open_regular_files", lambda: [7])
    assert workers.fork_refusal() == "files"
    monkeypatch.setattr(threading, "active_count", lambda: 2)
    assert workers.fork_refusal() == "threads"


def test_torch_sees_cuda_asks_nvml_while_cuda_is_not_open(monkeypatch):
    """`torch_sees_cuda` (a plan's "is the render backend gpu?") answers from ``torch.cuda.device_count()`` (NVML)
    while CUDA is not open in the process, never ``is_available()``, which opens it; once open, ``is_available()``."""
    import torch

    from fastrecord.system import torch_sees_cuda

    expected = torch.cuda.is_available()
    asked = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: asked.append("is_available") or False)
    for count in (1, 0):
        monkeypatch.setattr(torch.cuda, "device_count", lambda count=count: count)
        assert torch_sees_cuda() is bool(count)
    assert asked == []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert torch_sees_cuda() is False and asked == ["is_available"]
    monkeypatch.undo()
    assert torch_sees_cuda() is expected


def test_no_cuda_driver_mapped_counts_as_initialised():
    """Asked where libcuda is not mapped (this machine), the driver check answers "initialised", never loading it."""
    from fastrecord import workers

    if "libcuda.so" in (workers._mapped_files() or ""):
        pytest.skip("a CUDA driver is mapped in this process")
    assert workers._cuda_driver_initialised() is True
    assert "libcuda.so" not in (workers._mapped_files() or "")


def test_a_fork_server_forks_helpers_with_its_modules_imported_and_follows_them():
    """`ForkServer`: encoder processes forked from one that imported PyAV once (16 fresh interpreters importing it
    answered in 0.62-1.3 s on the H100 machine). Its children serve calls as any helper, are the server's children
    with its libraries loaded, see their caller as alive, and a death by SIGKILL is told with its signal."""
    import signal
    from pathlib import Path

    from fastrecord.processes import ChildDied, ForkServer, IsolatedProcess, fork_server_supported, parent_alive

    if not fork_server_supported():
        pytest.skip("fork servers need Linux 5.3+ (pidfds)")
    server = ForkServer(["fastrecord.video.pool"])
    try:
        child = IsolatedProcess("fastrecord.video.pool", "a forked helper", keep_after_error=True, server=server)
        assert child.call(parent_alive) is True
        assert int(Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) == server._proc.pid
        assert "libavcodec" in Path(f"/proc/{child.pid}/maps").read_text()  # PyAV, imported by the server
        assert child.alive() and child.poll() is None
        os.kill(child.pid, signal.SIGKILL)
        with pytest.raises(ChildDied, match=r"a forked helper \(pid \d+\) was killed by signal SIGKILL \(9\)"):
            child.call(parent_alive)
        assert child.poll() == -signal.SIGKILL and not child.alive()
        other = IsolatedProcess("fastrecord.video.pool", "another", server=server)
        other.stop()
        assert other.poll() == 0
    finally:
        server.close()
    assert not server.alive()
