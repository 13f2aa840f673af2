"""Helper processes started before they are needed: their interpreter start and imports overlap the caller's
other start-up work (making envs) instead of following it.

A recorder's HDF5 writer process (`fastrecord.sinks.maniskill_h5.writer.TrajectoryWriter`) is a fresh interpreter
importing numpy and h5py: 0.14-0.18 s on the 2-core CPU machine before its first answer (the writer publishes an empty
file pair then, on a thread of its own), and a merge of shards waits for its process. The recorder is made after the
envs, so a command started it after its envs were made. `prestart` starts such a process at once; `helper` hands it to
the first caller that asks for a process of that module and kind (or starts a new one, as before).

Spares belong to the process that started them: a forked child does not see its parent's (they are dropped in the
child, not stopped: the parent still owns them), and the spares nobody took are stopped at exit (an idle helper leaves
as soon as its socket closes; one whose parent died leaves by itself).
"""

from __future__ import annotations

import atexit
import os
import threading

from fastrecord.processes import IsolatedProcess

H5_WRITER_MODULE = "fastrecord.sinks.maniskill_h5.process"  # what HDF5 writer processes serve (`prestart_h5_writer`)
_Key = tuple[str, bool, bool]  # (module, background, keep_after_error)
_spares: dict[_Key, list[IsolatedProcess]] = {}
_lock = threading.Lock()
_hooked = False


def prestart(module: str, count: int = 1, *, background: bool = True, keep_after_error: bool = False) -> None:
    """Start helper processes of ``module`` now, up to ``count`` waiting spares of that kind (the ones waiting
    already count). Does not wait for them. A process that cannot start is no error here: `helper` starts one
    then, and raises there."""
    global _hooked
    key = (module, background, keep_after_error)
    with _lock:
        if not _hooked:
            atexit.register(stop_spares)
            os.register_at_fork(after_in_child=_forget)
            _hooked = True
        todo = count - len([p for p in _spares.get(key, []) if p.alive()])
        for _ in range(max(0, todo)):
            try:
                proc = IsolatedProcess(module, f"a spare helper of {module}", background=background,
                                       keep_after_error=keep_after_error)
            except OSError:
                return
            _spares.setdefault(key, []).append(proc)


def helper(module: str, name: str, *, background: bool = True, keep_after_error: bool = False) -> IsolatedProcess:
    """A helper process of ``module``: a spare `prestart` started (renamed ``name``), else a new `IsolatedProcess`."""
    key = (module, background, keep_after_error)
    with _lock:
        waiting = _spares.get(key, [])
        while waiting:
            proc = waiting.pop(0)
            if proc.alive():
                proc.name = name
                return proc
            proc.stop(timeout=1.0)
    return IsolatedProcess(module, name, background=background, keep_after_error=keep_after_error)


def prestart_h5_writer(*, merge: bool = False) -> None:
    """Start an HDF5 writer process now: a recorder's (``merge=False``: what `TrajectoryWriter` takes), or the one
    process a merge of shards runs in (`fastrecord.sinks.maniskill_h5.recover.one_writer_process`). Imports nothing
    of fastrecord.sinks (the CLI calls it before its imports)."""
    prestart(H5_WRITER_MODULE, background=False, keep_after_error=merge)


def spares(module: str, *, keep_after_error: bool | None = None) -> int:
    """Spares of ``module`` waiting (of every kind; ``keep_after_error``: of that kind only)."""
    with _lock:
        return sum(len(v) for k, v in _spares.items()
                   if k[0] == module and keep_after_error in (None, k[2]))


def stop_spares() -> None:
    """Stop every spare nobody took (at exit)."""
    with _lock:
        waiting = [p for procs in _spares.values() for p in procs]
        _spares.clear()
    for proc in waiting:
        proc.stop(timeout=1.0)


def _forget() -> None:
    """In a forked child: the parent's spares are the parent's (its sockets are closed by whoever forks cleanly)."""
    global _lock
    _spares.clear()
    _lock = threading.Lock()  # a fork while another thread held it
