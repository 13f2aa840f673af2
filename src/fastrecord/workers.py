"""Background work with bounded memory and errors that surface in the caller, and the forkserver.

`WorkerPool` owns a bounded job queue and its worker threads. Producers block in `submit` when the
queue is full (backpressure: nothing is ever dropped). A worker that raises keeps the exception; the
next `submit`, `wait_until_done` or `close` re-raises it in the caller's thread.

Helper processes (`IsolatedProcess`, `background_nice`, ...) live in `fastrecord.processes`.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

_SENTINEL = object()


class WorkerError(RuntimeError):
    """A background job failed; the original exception is chained as ``__cause__``."""


class WorkerPool:
    """Owns: a bounded queue of jobs, ``num_workers`` daemon threads, and the first worker error.

    ``handler(job)`` runs on a worker thread for every submitted job. With ``num_workers=1`` jobs run
    in submission order, which the HDF5 writer relies on.
    """

    def __init__(
        self,
        handler: Callable[[Any], None],
        num_workers: int = 1,
        max_pending: int = 4,
        name: str = "fastrecord",
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers={num_workers} must be >= 1")
        if max_pending < 1:
            raise ValueError(f"max_pending={max_pending} must be >= 1")
        self._handler = handler
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self._error: BaseException | None = None
        self._error_lock = threading.Lock()
        self._closed = False
        self.blocked_seconds = 0.0  # time producers spent waiting in submit() for a free slot
        self._threads = [
            threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True) for i in range(num_workers)
        ]
        for t in self._threads:
            t.start()

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is _SENTINEL:
                    return
                if self._error is None:  # after a failure, drain without working
                    self._handler(job)
            except BaseException as e:  # noqa: BLE001 - kept and re-raised in the caller
                with self._error_lock:
                    if self._error is None:
                        self._error = e
            finally:
                job = None  # drop the job (and e.g. its frames' staging memory) before waiting again
                self._queue.task_done()

    def raise_if_failed(self) -> None:
        if self._error is not None:
            err = self._error
            raise WorkerError(f"a background writer failed: {type(err).__name__}: {err}") from err

    def submit(self, job: Any,
               while_blocked: Callable[[], contextlib.AbstractContextManager[Any]] | None = None) -> None:
        """Queue a job; blocks while the queue is full (the writers set the pace, nothing is dropped), inside
        ``while_blocked()`` where given (e.g. letting every writer work while the caller waits)."""
        if self._closed:
            raise RuntimeError("submit() on a closed WorkerPool")
        self.raise_if_failed()
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            t0 = time.perf_counter()
            with while_blocked() if while_blocked is not None else contextlib.nullcontext():
                self._queue.put(job)
            self.blocked_seconds += time.perf_counter() - t0

    def wait_until_done(self) -> None:
        """Block until every submitted job has run, then re-raise the first worker error, if any."""
        self._queue.join()
        self.raise_if_failed()

    def close(self) -> None:
        """Finish queued jobs, stop the workers, re-raise the first worker error. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for _ in self._threads:
            self._queue.put(_SENTINEL)
        for t in self._threads:
            t.join()
        self.raise_if_failed()

    @property
    def pending(self) -> int:
        return self._queue.qsize()

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------- forkserver
# Processes that run ManiSkill envs (replay workers, a CPU vector env's sub-envs) come from
# multiprocessing's forkserver, with these modules imported once in the server: each process it forks
# starts with torch, ManiSkill and fastrecord already imported (spawn re-imported them in every process:
# about 5 s each, longer when 16 start together). The server is the caller forked where that is safe
# (`start_forkserver`, `fork_refusal`: no other thread, no open file, no GPU driver; the imports the caller made
# are then not made again; its file descriptors are pointed at /dev/null in the fork), else a fresh interpreter
# (nothing of the caller copied, as with spawn). "__main__" is multiprocessing's own default: a user script's
# guarded main module, so that wrappers or tasks defined there unpickle in the children.
# "fastrecord.replay.workers" is the replay library's process code (worker processes), and with it its env
# code (`fastrecord.replay.envs`: a CPU vector env's sub-envs); "fastrecord.commands.record_env" holds `record`'s
# sub-env factory and "fastrecord.render.vector" the batched render's pose reporter, which every sub-env of
# a batched render unpickles (a module the server cannot import is skipped by multiprocessing).
FORKSERVER_PRELOAD = ("__main__", "fastrecord.make_env", "fastrecord.replay.workers",
                      "fastrecord.commands.record_env", "fastrecord.render.vector")


def affinity_cores() -> int:
    """The cores this process may use (its affinity mask; ``os.cpu_count()`` where there is none): whether the
    forkserver starts before the caller's own imports (`fastrecord.PRESTART_CORES`)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def usable_cores(ranks: int | None = None) -> int:
    """The CPU cores this process may use: its affinity mask (narrowed by ``taskset``, a container's cpuset or a job
    scheduler; ``os.cpu_count()`` where the platform has no affinity call), shared with the other ranks of its host:
    ``ranks`` of them, None: torchrun's ``LOCAL_WORLD_SIZE`` (1 without it). At least 1. Every default sized to the
    machine (encoders, writers, replay workers) reads this, through `fastrecord.options`; it lives here, where no
    numpy is imported, for the CLI's guess made before its imports (`fastrecord.commands.cli`)."""
    cores = affinity_cores()
    if ranks is None:
        try:
            ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        except ValueError:
            ranks = 1
    return max(1, cores // max(1, ranks))


def forkserver_context() -> Any:
    """multiprocessing's forkserver context, its server running (`start_forkserver`: preloading
    `FORKSERVER_PRELOAD`; one server serves the whole process)."""
    ctx = _context()
    start_forkserver()
    return ctx


def _context() -> Any:
    import multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))  # where the server is not running yet
    return ctx


def freeze_imports() -> None:
    """Take every object alive now (what the process imported: torch, ManiSkill, SAPIEN) out of the garbage
    collector's reach (``gc.freeze``), in processes fastrecord owns (its CLI, replay workers, CPU sub-envs).

    ManiSkill calls ``gc.collect()`` whenever it builds or clears a scene (env creation, close, and each
    reset of a CPU eval env, which reconfigures), to release GPU memory; a full collection walks every
    tracked object, about 0.17 s a call on a 2-core machine once torch and ManiSkill are imported, two
    per replay env. Frozen objects are skipped (and never freed: they live as long as the modules). Not for
    a user's process: the library API does not call it. `imports_frozen` tells afterwards."""
    import gc

    global _imports_frozen
    gc.freeze()
    _imports_frozen = True


_imports_frozen = False


def imports_frozen() -> bool:
    """Whether `freeze_imports` ran in this process (a process of fastrecord's own). Not ``gc.get_freeze_count()``:
    a user's process may hold a few frozen objects of another library's (375 in the baseline eval on the GPU
    machine, 2026-12-06), with its imports unfrozen."""
    return _imports_frozen


def claim_process() -> None:
    """What fastrecord does to a process it owns (its CLI, replay workers, CPU sub-envs), never to a user's:
    `freeze_imports`, and SAPIEN's BRDF table handed to every camera ManiSkill makes from now on
    (`fastrecord.render.lut.install`: no 5 s table computed on a CPU renderer)."""
    from fastrecord.render import lut

    freeze_imports()
    lut.install()


def start_forkserver() -> None:
    """Start the forkserver now, where it is not running (it imports its preload while the caller goes on).

    Where this process is safe to fork (`fork_refusal`: one thread, no open file, no GPU driver), the server is this
    process forked (`_zygote`): it starts with everything imported here (torch, ManiSkill, the caller's own
    modules), so only what is missing of `FORKSERVER_PRELOAD` is imported, not a fresh interpreter's all of
    it. Elsewhere multiprocessing's own start: a fresh interpreter."""
    import multiprocessing.forkserver as mp_forkserver
    from multiprocessing import util

    from fastrecord.system import stamp

    _context()
    with _start_lock:
        spawn: Any = util.spawnv_passfds

        def start(path: Any, args: list[str], passfds: Any) -> int:
            if len(args) < 2 or not str(args[-1]).startswith("from multiprocessing.forkserver import main"):
                return int(spawn(path, args, passfds))  # the resource tracker
            refusal = "off" if os.environ.get(ZYGOTE_ENV, "") == "0" else fork_refusal()
            if refusal is not None:  # a fresh interpreter, its unused imports deferred first (as a zygote's are)
                stamp(f"forkserver_spawned_{refusal}")
                return int(spawn(path, [*args[:-1], _DEFER_FIRST + str(args[-1])], passfds))
            return _zygote(str(args[-1]), list(passfds))

        patched: Any = util
        patched.spawnv_passfds = start  # what ensure_running calls to start the server (where it is not running)
        try:
            mp_forkserver.ensure_running()
        finally:
            patched.spawnv_passfds = spawn
    stamp(f"forkserver_{forkserver_origin()}")


# prepended to a fresh server's start line: the server and its children are fastrecord's own processes
# (`fastrecord.deferred`); a server that cannot import fastrecord before its preload sets its sys.path starts as
# before
_DEFER_FIRST = "try:\n import fastrecord.deferred\n fastrecord.deferred.install()\nexcept ImportError:\n pass\n"
ZYGOTE_ENV = "FASTRECORD_ZYGOTE"  # "0": the forkserver is always a fresh interpreter
_start_lock = threading.Lock()
_zygotes: set[int] = set()  # pids of servers this process forked from itself


def forkserver_origin() -> str:
    """How this process's forkserver started: "zygote" (this process forked), "spawned" (a fresh interpreter),
    or "none" (not running)."""
    import multiprocessing.forkserver as mp_forkserver

    pid = getattr(mp_forkserver._forkserver, "_forkserver_pid", None)
    return "none" if pid is None else "zygote" if pid in _zygotes else "spawned"


# What a process maps once it has talked to a GPU driver (CUDA's, or a Vulkan driver's: NVIDIA's, Mesa's): a copy
# of such a process cannot use the driver (CUDA refuses it; Vulkan's objects belong to the parent).
_DRIVER_LIBRARIES = ("libcuda.so", "libGLX_nvidia", "libnvidia-glcore", "libnvidia-gpucomp", "libvulkan_",
                     "libnvidia-eglcore", "libnvoptix")


def fork_refusal() -> str | None:
    """Why a fork of this process could not run ManiSkill envs as a fresh process does, or None: another Python
    thread (a fork copies only the forking thread: a lock another one held stays held), an open regular file
    (`_open_regular_files`: a library's state about it would be stale in the fork), a GPU driver loaded
    (`_DRIVER_LIBRARIES`, named; CUDA's only once initialised: `_cuda_driver_initialised`), CUDA initialised by
    torch. Native thread pools may be running: OpenBLAS's
    (numpy, scipy) are made fork-safe by OpenBLAS itself; OpenMP's (torch's CPU ops) are not, and `_zygote` turns
    them off in the fork."""
    import sys

    if threading.active_count() != 1:
        return "threads"
    if _open_regular_files():
        return "files"
    maps = _mapped_files()
    if maps is None:
        return "maps"
    loaded = next((lib for lib in _DRIVER_LIBRARIES if lib in maps and not (lib == "libcuda.so" and
                                                                           not _cuda_driver_initialised())), None)
    if loaded is not None:
        return loaded.strip("_.-")
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_initialized():
            return "cuda"
    except Exception:  # noqa: BLE001 - a torch without CUDA support
        pass
    return None


def _open_regular_files() -> list[int]:
    """This process's descriptors (past the standard streams) of regular files, memfds included. A library may
    hold such a file open with its own state about it (HDF5 shares one open file among every open of the same
    path in a process): in a fork that state would outlive the descriptor (pointed at /dev/null by `_zygote`)
    and read nothing from a file a child opens again, so the server is then a fresh interpreter."""
    import stat

    found = []
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return [-1]
    for name in names:
        fd = int(name)
        if fd <= 2:
            continue
        try:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                found.append(fd)
        except OSError:  # the listing's own descriptor, closed since
            continue
    return found


def _mapped_files() -> str | None:
    """This process's memory map (``/proc/self/maps``: the libraries it loaded), or None where unreadable."""
    try:
        with open("/proc/self/maps") as f:
            return f.read()
    except OSError:
        return None


CUDA_ERROR_NOT_INITIALIZED = 3  # the CUDA driver API's answer before the process's ``cuInit``


def _cuda_driver_initialised() -> bool:
    """Whether this process initialised the CUDA driver (``cuInit``), which a fork cannot use. The library is
    mapped by some imports (torch's CUDA builds) without being initialised: ``cuCtxGetCurrent`` then answers
    `CUDA_ERROR_NOT_INITIALIZED`. Any other answer, or none, counts as initialised."""
    import ctypes

    try:
        driver = ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)  # the mapped copy, never a new one
        return int(driver.cuCtxGetCurrent(ctypes.byref(ctypes.c_void_p()))) != CUDA_ERROR_NOT_INITIALIZED
    except (OSError, AttributeError):
        return True


def _fresh_forkserver_state() -> None:
    """In the server forked from this process (`_zygote`): multiprocessing's forkserver state as a fresh interpreter
    has it. The fork happened inside ``ForkServer.ensure_running``, which holds the state's lock while it starts the
    server (and `start_forkserver` its own), so the server's children (replay workers) inherited both held, and a
    worker starting sub-env processes of its own (``--workers 2 --num-envs 4`` where the CPU draws, ``--vector
    async``) waited on them forever.
    Every module-level function is the new state's, as multiprocessing binds them at import; `start_forkserver`'s own
    lock, held as well, is a new one."""
    import multiprocessing.forkserver as mp_forkserver

    global _start_lock
    _start_lock = threading.Lock()
    fresh = mp_forkserver.ForkServer()
    mp_forkserver._forkserver = fresh
    for name in ("ensure_running", "get_inherited_fds", "connect_to_new_process", "set_forkserver_preload"):
        setattr(mp_forkserver, name, getattr(fresh, name))


def _zygote(code: str, passfds: list[int]) -> int:
    """Fork this process into multiprocessing's forkserver: the child runs ``code`` (the server's own start,
    `multiprocessing.forkserver.main`) and never returns into the caller's frames; returns the child's pid.

    In the child, before the server starts: every file descriptor but the standard streams and the server's own
    (``passfds``) is pointed at /dev/null, as a fresh server has none of them (the write end of the server's
    "alive" pipe, whose last holder's exit ends the server; the caller's pipes and sockets; an open regular file
    refuses the fork instead, `fork_refusal`), and the numbers stay taken, so an object of the caller's that still
    writes to one writes nowhere; every signal this process handles in Python is given back its default (a
    ``SIGTERM`` ends a sub-env as in a fresh process, not through this process's handler); torch's CPU ops run on
    one thread (see `fork_refusal`); a main module run from a file is put aside, so that the server imports the
    script anew as ``__mp_main__``, as a fresh server does (classes defined after the line that started the server
    then unpickle in its children)."""
    import signal
    import sys

    for stream in (sys.stdout, sys.stderr):  # not written twice, by this process and the fork
        try:
            stream.flush()
        except (AttributeError, ValueError, OSError):
            pass
    pid = os.fork()
    if pid:
        _zygotes.add(pid)
        return pid
    try:  # the server: nothing below returns into the caller's frames
        devnull = os.open(os.devnull, os.O_RDWR)
        keep = {0, 1, 2, devnull, *passfds}
        for name in os.listdir("/proc/self/fd"):
            if int(name) not in keep:
                try:
                    os.dup2(devnull, int(name))
                except OSError:  # the listing's own descriptor, closed since
                    pass
        torch = sys.modules.get("torch")
        if torch is not None:  # OpenMP's threads of this process's torch ops are not in the fork: a parallel region
            torch.set_num_threads(1)  # would wait for them forever. One thread: no region (one env a process)
        for sig in signal.valid_signals():
            try:
                handler = signal.getsignal(sig)
                if callable(handler) and sig != signal.SIGINT:
                    signal.signal(sig, signal.SIG_DFL)
            except (OSError, ValueError):
                continue
        signal.signal(signal.SIGINT, signal.default_int_handler)
        main = sys.modules.get("__main__")
        if getattr(main, "__file__", None):
            import types

            sys.modules["__main__"] = types.ModuleType("__main__")  # `spawn.import_main_path` runs the script anew
        _fresh_forkserver_state()
        import importlib

        from fastrecord.deferred import install

        install()  # the server and the env processes it forks are fastrecord's own (inherited where the caller is)

        from fastrecord.system import stamp_beside

        for module in FORKSERVER_PRELOAD:  # the server's preload (its own start imports the main module, then
            if module != "__main__":  # finds these imported), timed for benchmarks/bench_replay.py --stamps
                try:
                    importlib.import_module(module)
                except ImportError:  # as multiprocessing's preload: left out
                    pass
        stamp_beside("forkserver", "forkserver_preloaded")
        exec(code, {"__name__": "__fastrecord_forkserver__"})  # multiprocessing's own start line
    except SystemExit:
        pass
    except BaseException:  # noqa: BLE001 - reported, then this process ends
        import traceback

        traceback.print_exc()
    finally:
        os._exit(0)
    return 0  # unreachable: the child leaves through os._exit
