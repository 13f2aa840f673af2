"""Background work with bounded memory and errors that surface in the caller.

`WorkerPool` owns a bounded job queue and its worker threads. Producers block in `submit` when the
queue is full (backpressure: nothing is ever dropped). A worker that raises keeps the exception; the
next `submit`, `wait_until_done` or `close` re-raises it in the caller's thread.

`IsolatedProcess` is one helper process for work that may crash its process (HDF5 after a full disk):
started with `subprocess.Popen` (multiprocessing's spawn and forkserver re-import the user's
``__main__``; fork copies CUDA state and threads), it imports only the fastrecord module it serves,
not ``fastrecord/__init__.py`` (torch, ManiSkill), and runs that module's functions on request.
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import types
from pathlib import Path
from typing import Any, Callable

_SENTINEL = object()

NICE_ENV = "FASTRECORD_BACKGROUND_NICE"
DEFAULT_NICE = 10


def background_nice() -> int:
    """How much lower the CPU priority of fastrecord's helper processes (encoders, HDF5 writers) is than
    the caller's: ``$FASTRECORD_BACKGROUND_NICE``, 0..19 (a niceness increment) or ``idle`` (Linux's
    SCHED_IDLE: they run only on cores nothing else wants), default 10. Returned as an int: -1 is idle.

    The stepping process and the simulation's processes (a CPU vector env's sub-envs) then get a core
    first whenever they want one, and the background work uses what they leave: on the H200 machine,
    16 encoder processes drawing the info overlay took CPU from 16 PickCube-v1 sub-envs (their steps and
    resets slowed by a quarter). Unprivileged: it can only lower a priority; 0 leaves it alone."""
    raw = os.environ.get(NICE_ENV)
    if raw is None or raw.strip() == "":
        return DEFAULT_NICE
    if raw.strip().lower() == "idle":
        return -1
    try:
        value = int(raw)
    except ValueError:
        value = -2
    if not 0 <= value <= 19:
        raise ValueError(f"{NICE_ENV}={raw!r}: expected an integer from 0 (helper processes as urgent as the caller) to "
                         f"19, or 'idle' (only CPU nothing else wants); unset it for the default {DEFAULT_NICE}")
    return value


def lower_priority(nice: int) -> None:
    """In a helper process: add ``nice`` to its niceness, or (-1) take the SCHED_IDLE policy (where the
    OS refuses, nothing changes)."""
    try:
        if nice == -1 and hasattr(os, "SCHED_IDLE"):
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        elif nice > 0:
            os.nice(nice)
    except OSError:
        pass


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

    def submit(self, job: Any) -> None:
        """Queue a job; blocks while the queue is full (the writers set the pace, nothing is dropped)."""
        if self._closed:
            raise RuntimeError("submit() on a closed WorkerPool")
        self.raise_if_failed()
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            t0 = time.perf_counter()
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
# about 5 s each, longer when 16 start together), and nothing of the caller (CUDA, threads, open files)
# is copied, as with spawn. "__main__" is multiprocessing's own default: a user script's guarded main module,
# so that wrappers or tasks defined there unpickle in the children.
FORKSERVER_PRELOAD = ("__main__", "fastrecord.make_env", "fastrecord.commands.replay")


# The layout of a replay of CPU-simulated envs (`fastrecord.commands.replay.default_workers`; here for the
# CLI's early guess, which must not import torch): from MANY_CORES cores on, several worker processes by
# default; a worker holds up to ENVS_PER_WORKER envs in its own process (their renders submitted together),
# more go to sub-processes of one env each
MANY_CORES = 8
ENVS_PER_WORKER = 4


def forkserver_context() -> Any:
    """multiprocessing's forkserver context, its server preloading `FORKSERVER_PRELOAD` (where the server
    is not running yet; one server serves the whole process)."""
    import multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))
    return ctx


def freeze_imports() -> None:
    """Take every object alive now (what the process imported: torch, ManiSkill, SAPIEN) out of the garbage
    collector's reach (``gc.freeze``), in processes fastrecord owns (its CLI, replay workers, CPU sub-envs).

    ManiSkill calls ``gc.collect()`` whenever it builds or clears a scene (env creation, close, and each
    reset of a CPU eval env, which reconfigures), to release GPU memory; a full collection walks every
    tracked object, about 0.17 s a call on the 2-core machine once torch and ManiSkill are imported, two
    per replay env. Frozen objects are skipped (and never freed: they live as long as the modules). Not for
    a user's process: the library API does not call it."""
    import gc

    gc.freeze()


def start_forkserver() -> None:
    """Start the forkserver now (it imports its preload while the caller goes on with its own imports)."""
    from multiprocessing import forkserver

    forkserver_context()
    forkserver.ensure_running()


# ---------------------------------------------------------------------------------------------- processes
# The child imports fastrecord.<module> without running fastrecord/__init__.py (nor the __init__ of
# the packages between): bare package modules stand in for them. It ignores SIGINT (Ctrl-C is the parent's; the parent closes it) and SIGTERM, and
# leaves when the parent's end of the socket closes, the parent's death included.
_BOOT = (
    "import os, signal, sys, types\n"
    "signal.signal(signal.SIGINT, signal.SIG_IGN); signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "if sys.path and sys.path[0] == '': sys.path.pop(0)\n"
    "names = sys.argv[3].split('.')\n"
    "for i in range(1, len(names)):\n"
    "    pkg = types.ModuleType('.'.join(names[:i])); pkg.__path__ = [os.path.join(sys.argv[2], *names[1:i])]\n"
    "    sys.modules[pkg.__name__] = pkg\n"
    "from fastrecord.workers import _child_main\n"
    "_child_main(int(sys.argv[1]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))\n"
)
_parent_pid: int | None = None  # in a child: the pid of the process that started it


class ChildDied(RuntimeError):
    """An `IsolatedProcess` ended (a signal, ``os._exit``) before it answered a call."""

    def __init__(self, message: str, returncode: int | None) -> None:
        super().__init__(message)
        self.returncode = returncode


class RemoteError(RuntimeError):
    """An exception of a non-builtin type raised by a function in an `IsolatedProcess`."""


def exit_description(returncode: int | None) -> str:
    """``-9`` -> "was killed by signal SIGKILL (9)", ``1`` -> "exited with code 1"."""
    if returncode is None:
        return "is still running"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = "signal"
        return f"was killed by signal {name} ({-returncode})"
    return f"exited with code {returncode}"


def parent_alive() -> bool:
    """In an `IsolatedProcess`: whether the process that started it still runs (it is reparented when
    that one dies). Check before making a result visible that the dead parent would not have known of."""
    return _parent_pid is None or os.getppid() == _parent_pid


def _describe_exception(e: BaseException) -> dict[str, Any]:
    return dict(type=type(e).__name__, errno=getattr(e, "errno", None), strerror=getattr(e, "strerror", None),
                filename=getattr(e, "filename", None), message=str(e),
                traceback="".join(traceback.format_exception(type(e), e, e.__traceback__)))


def _rebuild_exception(d: dict[str, Any]) -> BaseException:
    """The child's exception as one of the same builtin type where possible (OSError keeps its errno)."""
    import builtins

    cls = getattr(builtins, d["type"], None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            if issubclass(cls, OSError) and d["errno"] is not None:
                e = cls(d["errno"], d["strerror"] or d["message"], *([d["filename"]] if d["filename"] else []))
            else:
                e = cls(d["message"])
        except TypeError:
            e = RemoteError(f"{d['type']}: {d['message']}")
    else:
        e = RemoteError(f"{d['type']}: {d['message']}")
    e.remote_traceback = d["traceback"]  # type: ignore[attr-defined]
    return e


def _child_main(fd: int, module: str, parent_pid: int, nice: int = 0) -> None:
    """The child's loop: ``(function name, args)`` in, ``("ok", result)`` or ``("error", details)`` out.

    After an error the child reports, then leaves at once with ``os._exit``: a library that failed
    (HDF5 after ENOSPC) may crash on cleanup, and its state is not trusted for a next call. An exception
    that Python would only print ("Exception ignored in ...", e.g. h5py failing to flush in a destructor
    on a full disk, just before HDF5 segfaults) is such an error too.
    """
    import importlib
    from multiprocessing.connection import Connection

    global _parent_pid
    _parent_pid = parent_pid
    lower_priority(nice)
    conn = Connection(fd)

    def fatal(u: Any) -> None:
        try:
            conn.send(("error", _describe_exception(u.exc_value)))
        finally:
            os._exit(1)

    sys.unraisablehook = fatal
    # Cython destructors (h5py's, on a full disk) print through sys.excepthook before sys.unraisablehook:
    # the error goes to the parent, which reports it once, instead of a traceback on the user's terminal
    sys.excepthook = lambda kind, value, tb: fatal(types.SimpleNamespace(exc_value=value))
    try:
        mod = importlib.import_module(module)
    except BaseException as e:  # noqa: BLE001 - answered to the first call
        conn.send(("error", _describe_exception(e)))
        os._exit(1)
    while True:
        try:
            func, args = conn.recv()
        except (EOFError, OSError):
            break  # the parent closed the socket, or died
        try:
            result = getattr(mod, func)(*args)
        except BaseException as e:  # noqa: BLE001 - sent to the parent, raised there
            try:
                conn.send(("error", _describe_exception(e)))
            finally:
                os._exit(1)
        try:
            conn.send(("ok", result))
        except OSError:
            break
    os._exit(0)


class IsolatedProcess:
    """Owns: one helper process serving ``fastrecord.<module>``'s functions, and the parent's end of
    its socket.

    ``call(func, *args)`` pickles the call over a socketpair (`multiprocessing.connection` framing, so
    messages of any size), runs ``module.func(*args)`` there and returns its result. An exception in
    the child is raised here with the same builtin type (``OSError`` with its errno; else
    `RemoteError`), and the child is gone afterwards; a child that died is `ChildDied`. One call at a
    time (calls from several threads queue on a lock). ``stop()`` closes the socket; the child leaves.
    """

    def __init__(self, module: str, name: str = "the fastrecord helper process") -> None:
        from multiprocessing.connection import Connection

        if not module.startswith("fastrecord."):
            raise ValueError(f"module={module!r}: an IsolatedProcess serves a fastrecord module, e.g. 'fastrecord.sinks.maniskill_h5'")
        self.name = name
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        pkg_dir = str(Path(__file__).resolve().parent)  # the fastrecord package
        try:
            nice = background_nice()
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _BOOT, str(child.fileno()), pkg_dir, module, str(os.getpid()), str(nice)],
                pass_fds=[child.fileno()], stdin=subprocess.DEVNULL, close_fds=True,
                # a session of its own: a SIGTERM to the caller's process group (torchrun stopping a worker, a
                # job scheduler's killpg) is the caller's to handle; it closes us, and its death ends our socket
                start_new_session=True,
            )
        except BaseException:
            parent.close()
            raise
        finally:
            child.close()
        self._conn = Connection(parent.detach())
        self._lock = threading.Lock()
        self._stopped = False
        self.busy = False  # a call is in flight

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        """The exit status if the child has ended (negative: the signal), else None."""
        return self.proc.poll()

    def call(self, func: str, *args: Any) -> Any:
        with self._lock:
            if self._stopped:
                raise RuntimeError(f"{self.name}: call({func!r}) on a stopped process")
            self.busy = True
            try:
                try:
                    self._conn.send((func, args))
                    status, payload = self._conn.recv()
                except (EOFError, OSError):
                    code = self._wait_exit()
                    raise ChildDied(f"{self.name} (pid {self.pid}) {exit_description(code)}", code) from None
            finally:
                self.busy = False
        if status == "error":
            self._wait_exit()
            raise _rebuild_exception(payload)
        return payload

    def _wait_exit(self, timeout: float = 5.0) -> int | None:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, timeout: float = 10.0) -> None:
        """Close the socket (the child leaves after its current call), wait, SIGKILL if it hangs. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        try:
            self._conn.close()
        except OSError:
            pass
        if self._wait_exit(timeout) is None:
            self.proc.kill()
            self.proc.wait()
