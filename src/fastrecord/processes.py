"""Helper processes that run fastrecord functions on request: one process type, one wire protocol.

`IsolatedProcess` is a child process serving calls from its parent: the HDF5 writers (work that may crash
its process: HDF5 after a full disk) and the encoder processes (libx264 outside the GIL, frames read from
shared memory) are both one. It is started with `subprocess.Popen` (multiprocessing's spawn and
forkserver re-import the user's ``__main__``; fork copies CUDA state and threads) and imports only the
fastrecord modules whose functions it runs, not ``fastrecord/__init__.py`` (torch, ManiSkill) nor the
``__init__`` of the packages between: bare package modules stand in for them.

The wire: a Unix stream socket pair, messages pickled with `multiprocessing.connection` framing (any size). A request is
``(target, args, nfds, answer)``: ``target`` a function name of the served module or a ``(module, qualified name)`` pair
(dotted names resolve attribute by attribute); ``nfds`` file descriptors follow it as SCM_RIGHTS data and are appended
to ``args``; ``answer=False`` makes it one-way (`IsolatedProcess.notify`). An answer is ``("ok", result)`` or
``("error", details, leaving)``. A child's exception is raised in the caller with the same builtin type (``OSError``
with its errno), else as `RemoteError`; a child that died is `ChildDied`.

Background helpers (encoders) run below the caller's CPU priority (`background_nice`); helpers whose work
the caller waits on (HDF5 writers: ``background=False``) run at the caller's own priority.

A `ForkServer` is a helper that imports a few fastrecord modules once and forks helpers from itself
(``IsolatedProcess(..., server=...)``): each starts with those imports done (the encoders: PyAV and numpy).
"""

from __future__ import annotations

import builtins
import os
import signal
import socket
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

NICE_ENV = "FASTRECORD_BACKGROUND_NICE"
DEFAULT_NICE = 10


def background_nice() -> int:
    """How much lower the CPU priority of fastrecord's background helper processes (the encoders) is than
    the caller's: ``$FASTRECORD_BACKGROUND_NICE``, 0..19 (a niceness increment) or ``idle`` (Linux's
    SCHED_IDLE: they run only on cores nothing else wants), default 10. Returned as an int: -1 is idle.

    The stepping process and the simulation's processes (a CPU vector env's sub-envs) then get a core
    first whenever they want one, and the background work uses what they leave: 16 encoder processes
    drawing the info overlay at full priority slow the steps and resets of 16 CPU sub-envs by about a
    quarter. Unprivileged: it can only lower a priority; 0 leaves it alone.

    HDF5 writer processes are not background helpers (``IsolatedProcess(background=False)``): they run at
    the caller's priority whatever this says. ManiSkill's wrapper writes its trajectories in the caller's
    own process; writers at nice 10 starved on a machine with another busy process (2 cores, one kept
    busy: 1.2x ManiSkill's wrapper, 1.6x at the caller's priority; docs/performance.md)."""
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
        raise ValueError(
            f"{NICE_ENV}={raw!r}: expected an integer from 0 (helper processes as urgent as the caller) to "
            f"19, or 'idle' (only CPU nothing else wants); unset it for the default {DEFAULT_NICE}"
        )
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


class ChildDied(RuntimeError):
    """An `IsolatedProcess` ended (a signal, ``os._exit``) before it answered a call."""

    def __init__(self, message: str, returncode: int | None) -> None:
        super().__init__(message)
        self.returncode = returncode


class RemoteError(RuntimeError):
    """An exception of a non-builtin type raised by a function in an `IsolatedProcess`; the message starts
    with that type's name."""


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


_parent_pid: int | None = None  # in a child: the pid of the process that started it
_server_pid: int | None = None  # in a child forked by a `ForkServer`: that server's pid (its parent process)


def parent_alive() -> bool:
    """In an `IsolatedProcess`: whether the process that started it still runs (it is reparented when
    that one dies). Check before making a result visible that the dead parent would not have known of.
    A child of a `ForkServer` is the server's child: the server leaves when the caller dies (its socket ends),
    and the caller is asked directly meanwhile."""
    if _parent_pid is None:
        return True
    if _server_pid is None:
        return os.getppid() == _parent_pid
    return os.getppid() == _server_pid and _pid_exists(_parent_pid)


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ---------------------------------------------------------------------------------------------- exceptions
_PLAIN = (str, bytes, int, float, bool, type(None))


def _builtin_class(e: BaseException) -> type | None:
    """The builtin exception class ``e`` is, or is a namesake subclass of (PyAV's ``av.error.FileNotFoundError``
    is a ``FileNotFoundError``), else None."""
    cls = getattr(builtins, type(e).__name__, None)
    if isinstance(cls, type) and issubclass(cls, Exception) and isinstance(e, cls):
        return cls
    return None


def _describe_exception(e: BaseException) -> dict[str, Any]:
    cls = _builtin_class(e)
    args = e.args if all(isinstance(a, _PLAIN) for a in e.args) else None
    return dict(type=cls.__name__ if cls else f"{type(e).__module__}.{type(e).__qualname__}", builtin=cls is not None,
                errno=getattr(e, "errno", None), strerror=getattr(e, "strerror", None),
                filename=getattr(e, "filename", None), message=str(e), args=args,
                traceback="".join(traceback.format_exception(type(e), e, e.__traceback__)))


def _rebuild_exception(d: dict[str, Any], where: str) -> BaseException:
    """The child's exception as one of the same builtin type where possible (OSError keeps its errno and
    file name), else `RemoteError`; its traceback is ``remote_traceback`` and a note naming ``where``."""
    e: BaseException | None = None
    if d["builtin"]:
        cls = getattr(builtins, d["type"])
        try:
            if issubclass(cls, OSError) and d["errno"] is not None:
                prefix = f"[Errno {d['errno']}] "
                text = d["message"][len(prefix):] if d["message"].startswith(prefix) else d["message"]
                if d["filename"]:
                    e = cls(d["errno"], d["strerror"] or text, d["filename"])
                else:  # the message may name a file the exception does not hold (PyAV's errors)
                    e = cls(d["errno"], text)
            elif d["args"] is not None:
                e = cls(*d["args"])
            else:
                e = cls(d["message"])
        except TypeError:
            e = None
    if e is None:
        e = RemoteError(f"{d['type']}: {d['message']}")
    e.remote_traceback = d["traceback"]  # type: ignore[attr-defined]
    note = f"(raised in {where}; its traceback:\n{d['traceback'].rstrip()})"
    if sys.version_info >= (3, 11):
        e.add_note(note)
    else:  # Python 3.10 has no add_note (mypy at python_version 3.10 found the call); traceback then omits it
        e.__notes__ = [*getattr(e, "__notes__", []), note]  # type: ignore[attr-defined]
    return e


# ---------------------------------------------------------------------------------------------- the child
# The child ignores SIGINT (Ctrl-C is the parent's; the parent closes it) and SIGTERM, and leaves when the
# parent's end of the socket closes, the parent's death included.
_BOOT = (
    "import signal, sys, types\n"
    "signal.signal(signal.SIGINT, signal.SIG_IGN); signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "if sys.path and sys.path[0] == '': sys.path.pop(0)\n"
    "pkg = types.ModuleType('fastrecord'); pkg.__path__ = [sys.argv[2]]; sys.modules['fastrecord'] = pkg\n"
    "from fastrecord.processes import _child_main\n"
    "_child_main(int(sys.argv[1]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6] == '1')\n"
)
_FD_MARK = b"F"  # the one byte that carries a request's file descriptors


def import_bare(module: str) -> Any:
    """Import ``fastrecord.<...>`` with bare package modules standing in for the packages above it that
    are not imported yet (their ``__init__`` is not run). For helper processes."""
    import importlib
    import types

    names = module.split(".")
    root = Path(sys.modules["fastrecord"].__path__[0])
    for i in range(2, len(names)):
        pkg_name = ".".join(names[:i])
        if pkg_name not in sys.modules:
            pkg = types.ModuleType(pkg_name)
            pkg.__path__ = [str(root.joinpath(*names[1:i]))]
            sys.modules[pkg_name] = pkg
    return importlib.import_module(module)


def _resolve(target: str | tuple[str, str], served: Any, cache: dict[Any, Callable[..., Any]]) -> Callable[..., Any]:
    fn = cache.get(target)
    if fn is None:
        fn, path = (served, target) if isinstance(target, str) else (import_bare(target[0]), target[1])
        for part in path.split("."):
            fn = getattr(fn, part)
        cache[target] = fn
    return fn


def _child_main(fd: int, module: str, parent_pid: int, nice: int, keep_after_error: bool) -> None:
    """The child's loop: requests in, answers out (see the module docstring).

    Unless ``keep_after_error``, the child reports an error and leaves at once with ``os._exit``: a library
    that failed (HDF5 after ENOSPC) may crash on cleanup, and its state is not trusted for a next call. An
    exception that Python would only print ("Exception ignored in ...", e.g. h5py failing to flush in a
    destructor on a full disk, just before HDF5 segfaults) is such an error too. A failed one-way request
    ends the child either way: the parent cannot know what state it left, and hears of it at its next call.
    """
    from multiprocessing.connection import Connection

    global _parent_pid
    _parent_pid = parent_pid
    lower_priority(nice)
    conn = Connection(fd)
    sock = socket.socket(fileno=os.dup(fd))
    _serving.clear()
    _serving.extend([conn, sock])  # what a process this one forks (a `ForkServer`'s child) closes first

    def report(e: BaseException, leaving: bool) -> None:
        try:
            conn.send(("error", _describe_exception(e), leaving))
        except BaseException:  # noqa: BLE001 - the parent is gone, or the report cannot be sent: leave
            leaving = True
        if leaving:
            os._exit(1)

    if not keep_after_error:
        sys.unraisablehook = lambda u: report(u.exc_value or RuntimeError(u.err_msg or "unraisable"), True)
        # Cython destructors (h5py's, on a full disk) print through sys.excepthook before sys.unraisablehook:
        # the error goes to the parent, which reports it once, instead of a traceback on the user's terminal
        sys.excepthook = lambda kind, value, tb: report(value, True)
    try:
        served = import_bare(module)
    except BaseException as e:  # noqa: BLE001 - answered to the first call
        report(e, True)
    cache: dict[Any, Callable[..., Any]] = {}
    while True:
        try:
            target, args, nfds, answer = conn.recv()
            if nfds:
                mark, fds, _, _ = socket.recv_fds(sock, 1, nfds)
                if mark != _FD_MARK or len(fds) != nfds:
                    raise OSError(f"expected {nfds} file descriptor(s) after a request, got {len(fds)}")
                args = (*args, *fds)
        except (EOFError, OSError):
            break  # the parent closed the socket, or died
        try:
            result = _resolve(target, served, cache)(*args)
        except BaseException as e:  # noqa: BLE001 - sent to the parent, raised there
            report(e, not (keep_after_error and answer))
            continue
        if answer:
            try:
                conn.send(("ok", result))
            except OSError:
                break  # the parent is gone
            except Exception as e:  # noqa: BLE001 - a result that does not pickle: nothing was sent
                report(e, not keep_after_error)
    os._exit(0)


_serving: list[Any] = []  # this child's own connection to its parent (socket ends), while it serves


# ---------------------------------------------------------------------------------------------- a fork server
# Functions a `ForkServer`'s process runs (it is an IsolatedProcess serving this module).
_forked: dict[int, int | None] = {}  # pid of each child forked here -> its exit status once reaped


def _serve_forks(modules: list[str]) -> None:
    """In the server, first: import ``modules`` (what its children start with) and reap children as they end."""
    for m in modules:
        import_bare(m)
    signal.signal(signal.SIGCHLD, lambda *_: _reap())


def _reap() -> None:
    while _forked:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _forked[pid] = os.waitstatus_to_exitcode(status)


def _fork_child(module: str, parent_pid: int, nice: int, keep_after_error: bool, fd: int) -> int:
    """In the server: fork a child that serves ``module`` on ``fd`` (an `IsolatedProcess` child, with the server's
    imports done); returns its pid."""
    _reap()
    server = os.getpid()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the server's loop
        global _server_pid
        try:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for end in _serving:  # the server's connection is not this child's
                try:
                    end.close()
                except OSError:
                    pass
            _forked.clear()
            _server_pid = server
            _child_main(fd, module, parent_pid, nice, keep_after_error)
        finally:
            os._exit(0)
    os.close(fd)
    _forked[pid] = None
    return pid


def _exit_status(pid: int) -> int | None:
    """In the server: the exit status of its child ``pid`` once it has ended, else None."""
    _reap()
    return _forked.get(pid)


class ForkServer:
    """Owns: a helper process (an `IsolatedProcess` of this module, at the caller's priority) that imports
    ``preload`` (fastrecord modules) once, then forks `IsolatedProcess` children from itself on request
    (``IsolatedProcess(..., server=this)``): each starts with those modules imported, in a few milliseconds.
    Sixteen encoder processes each importing PyAV and numpy answered 0.62 s after they started on the H100
    machine's 16 cores, and 1.1-1.3 s while a fresh recorder pinned its staging memory; the server imports them
    once. Forking is safe there: the server runs no thread, opens no GPU driver, holds no file.

    Its children are the server's: the caller follows them through pidfds (`_ServerChild`), kills them itself, and
    learns their exit status from the server. The server leaves when the caller closes it or dies; children it
    forked keep serving their own sockets until closed, as any `IsolatedProcess`."""

    def __init__(self, preload: Sequence[str], name: str = "the fastrecord fork server") -> None:
        self.name = name
        self._proc = IsolatedProcess(__name__, name, keep_after_error=True, background=False)
        self._proc.notify(_serve_forks, list(preload))  # the imports run while the caller goes on

    def alive(self) -> bool:
        return self._proc.alive()

    def fork(self, child_fd: int, module: str, nice: int, keep_after_error: bool) -> int:
        """A child serving ``module`` on ``child_fd`` (sent to the server, which owns it then); its pid."""
        return int(self._proc.call(_fork_child, module, os.getpid(), nice, keep_after_error, fds=[child_fd]))

    def exit_status(self, pid: int) -> int | None:
        """``pid``'s exit status once the server has reaped it; None while it runs, or where the server is gone."""
        try:
            return self._proc.call(_exit_status, pid)
        except (ChildDied, RuntimeError, OSError):
            return None

    def close(self) -> None:
        self._proc.stop(timeout=5.0)


class _ServerChild:
    """A `ForkServer`'s child as `subprocess.Popen` is used by `IsolatedProcess`: pid, poll, wait, kill (through a
    pidfd: not another process that reused the pid)."""

    def __init__(self, pid: int, server: ForkServer) -> None:
        self.pid = pid
        self._server = server
        self.returncode: int | None = None
        self._pidfd = os.pidfd_open(pid)

    def _ended(self, timeout: float | None) -> bool:
        import select

        p = select.poll()
        p.register(self._pidfd, select.POLLIN)
        return bool(p.poll(None if timeout is None else max(0, int(timeout * 1000))))

    def poll(self) -> int | None:
        if self.returncode is None and self._ended(0):
            self._collect()
        return self.returncode

    def _collect(self) -> None:
        import time

        status = None
        for _ in range(50):  # the server reaps it on SIGCHLD: a moment after the pidfd said it ended
            status = self._server.exit_status(self.pid)
            if status is not None or not self._server.alive():
                break
            time.sleep(0.01)
        self.returncode = status if status is not None else -int(signal.SIGKILL)  # unknown: the server is gone
        try:
            os.close(self._pidfd)
        except OSError:
            pass

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not self._ended(timeout):
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0)
            self._collect()
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)


def fork_server_supported() -> bool:
    """Fork servers need Linux: fork, pidfds (Linux 5.3) and fd passing."""
    return hasattr(os, "fork") and hasattr(os, "pidfd_open") and hasattr(signal, "pidfd_send_signal") and \
        hasattr(socket, "send_fds")


# ---------------------------------------------------------------------------------------------- the parent
def _target(func: str | Callable[..., Any]) -> str | tuple[str, str]:
    """What a request names: a function name of the served module, or a module-level function's
    (module, qualified name)."""
    if isinstance(func, str):
        return func
    module, qualname = getattr(func, "__module__", None), getattr(func, "__qualname__", "")
    if not callable(func) or not isinstance(module, str) or not module.startswith("fastrecord.") or "<" in qualname:
        raise TypeError(f"func={func!r}: a helper process runs a function named by a string (of its module) or a "
                        f"module-level function of a fastrecord module, e.g. fastrecord.video.pool.encode_job")
    return module, qualname


class IsolatedProcess:
    """Owns: one helper process serving ``fastrecord.<module>``'s functions (and module-level functions of
    other fastrecord modules), and the parent's end of its socket.

    ``call(func, *args)`` runs ``func(*args)`` there and returns its result; ``func`` is a function name of
    ``module`` or a module-level function of a fastrecord module (resolved by name in the child). An
    exception in the child is raised here with the same builtin type (``OSError`` with its errno), else
    as `RemoteError`; either carries the child's traceback (``remote_traceback`` and a note). Unless
    ``keep_after_error``, the child is gone after an error. A child that died is `ChildDied`. One call at a
    time (calls from several threads queue on a lock); `notify` sends a one-way request meanwhile.
    ``fds=``: file descriptors sent along (SCM_RIGHTS), appended to ``args`` in the child, which owns them.
    ``stop()`` closes the socket; the child leaves. ``background``: run below the caller's CPU priority
    (`background_nice`), for work that may lag (encoders); False: at the caller's priority, for work the
    caller waits on (HDF5 writers).
    """

    def __init__(self, module: str, name: str = "the fastrecord helper process", *, keep_after_error: bool = False,
                 background: bool = True, server: ForkServer | None = None) -> None:
        from multiprocessing.connection import Connection

        if not module.startswith("fastrecord."):
            raise ValueError(
                f"module={module!r}: an IsolatedProcess serves a fastrecord module, e.g. "
                "'fastrecord.sinks.maniskill_h5'"
            )
        self.name = name
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        pkg_dir = str(Path(__file__).resolve().parent)  # the fastrecord package
        self.proc: Any
        try:
            if server is not None:  # forked by the server (which owns the child's end once sent)
                nice = background_nice() if background else 0
                self.proc = _ServerChild(server.fork(child.fileno(), module, nice, keep_after_error), server)
            else:
                self.proc = subprocess.Popen(
                    [sys.executable, "-c", _BOOT, str(child.fileno()), pkg_dir, module, str(os.getpid()),
                     str(background_nice() if background else 0), "1" if keep_after_error else "0"],
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
        self._sock = parent  # for file descriptors
        self._conn = Connection(os.dup(parent.fileno()))  # for messages
        self._lock = threading.Lock()  # one call at a time
        self._send_lock = threading.Lock()  # one request on the wire at a time
        self._stopped = False
        self.busy = False  # a call is in flight

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        """The exit status if the child has ended (negative: the signal), else None."""
        return self.proc.poll()

    def alive(self) -> bool:
        return not self._stopped and self.proc.poll() is None

    def _send(self, func: str | Callable[..., Any], args: tuple, fds: Sequence[int], answer: bool) -> None:
        request = (_target(func), args, len(fds), answer)
        with self._send_lock:
            self._conn.send(request)
            if fds:
                socket.send_fds(self._sock, [_FD_MARK], list(fds))

    def call(self, func: str | Callable[..., Any], *args: Any, fds: Sequence[int] = ()) -> Any:
        with self._lock:
            if self._stopped:
                raise RuntimeError(f"{self.name}: call({func!r}) on a stopped process")
            self.busy = True
            try:
                try:
                    self._send(func, args, fds, True)
                except OSError:
                    pass  # the child left: an error it sent before leaving may wait to be read
                try:
                    reply = self._conn.recv()
                except (EOFError, OSError):
                    code = self._wait_exit()
                    raise ChildDied(f"{self.name} (pid {self.pid}) {exit_description(code)}", code) from None
            finally:
                self.busy = False
        if reply[0] == "error":
            if reply[2]:
                self._wait_exit()
            raise _rebuild_exception(reply[1], f"{self.name} (pid {self.pid})")
        return reply[1]

    def notify(self, func: str | Callable[..., Any], *args: Any, fds: Sequence[int] = ()) -> None:
        """Run ``func(*args)`` in the child without waiting for it (after any call in flight); an error
        there ends the child and is raised by the next `call`. `ChildDied` where the child is gone."""
        if self._stopped:
            raise RuntimeError(f"{self.name}: notify({func!r}) on a stopped process")
        try:
            self._send(func, args, fds, False)
        except OSError:
            code = self._wait_exit()
            raise ChildDied(f"{self.name} (pid {self.pid}) {exit_description(code)}", code) from None

    def _wait_exit(self, timeout: float = 5.0) -> int | None:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def _close_socket(self) -> None:
        for end in (self._conn, self._sock):
            try:
                end.close()
            except OSError:
                pass

    def stop(self, timeout: float = 10.0) -> None:
        """Close the socket (the child leaves after its current call), wait, SIGKILL if it hangs. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self._close_socket()
        if self._wait_exit(timeout) is None:
            self.proc.kill()
            self.proc.wait()

    def kill(self) -> None:
        """SIGKILL the child now (a call in flight on another thread gets `ChildDied`) and close the socket.
        Idempotent."""
        try:
            self.proc.kill()
        except OSError:
            pass
        self.proc.wait()
        if not self._stopped:
            self._stopped = True
            self._close_socket()
