"""After a crash: `recover` lists every complete part again, `consolidate` makes one self-contained
``NAME.h5`` of them. Both run in a writer process (`run_in_child`); `process.recover_here` and
`process.consolidate_here` do the work there.
"""

from __future__ import annotations

import contextlib
import json
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fastrecord.prestart import helper
from fastrecord.processes import ChildDied, IsolatedProcess
from fastrecord.sinks.maniskill_h5.layout import WRITER_PROCESS_MODULE, disk_text, is_disk_full
from fastrecord.workers import WorkerError

_held = threading.local()  # .depth: `one_writer_process` nesting in this thread; .proc: the process it holds, or None


@contextlib.contextmanager
def one_writer_process() -> Iterator[None]:
    """Inside: this thread's `run_in_child` calls share one writer process (started at the first, stopped on
    leaving) instead of starting one each. A process start is a Python interpreter importing numpy and h5py
    (0.17 s on the 2-core CPU machine): `fastrecord.shards.merge` makes two calls a shard and two more.
    A call that raised keeps the process (``keep_after_error``); one whose process died is `run_in_child`'s
    WorkerError, and the next call starts a new process. Nested uses share the outer one's."""
    if getattr(_held, "depth", 0):
        _held.depth += 1
        try:
            yield
        finally:
            _held.depth -= 1
        return
    _held.proc, _held.depth = None, 1
    try:
        yield
    finally:
        proc, _held.proc, _held.depth = _held.proc, None, 0
        if proc is not None:
            proc.stop()


def _process() -> tuple[IsolatedProcess, bool]:
    """The process for one `run_in_child` call, and whether the caller owns it (stops it after the call)."""
    shared = getattr(_held, "depth", 0) > 0
    if shared and _held.proc is not None and _held.proc.alive():
        return _held.proc, False
    proc = helper(WRITER_PROCESS_MODULE, "the HDF5 writer process", background=False, keep_after_error=shared)
    if shared:
        _held.proc = proc
    return proc, not shared


def run_in_child(func: str, *args: Any) -> Any:
    """Run ``func`` of `fastrecord.sinks.maniskill_h5.process` (its first argument a path) in a writer process
    (a fresh one, or the one `one_writer_process` holds); a crash there is a WorkerError here, naming the path
    and the free disk space."""
    proc, owned = _process()  # the caller waits: at the caller's priority
    try:
        return proc.call(func, *args)
    except ChildDied as e:
        where = Path(args[0])
        raise WorkerError(f"{e} while running {func} on {where}; {disk_text(where.parent)}") from e
    except OSError as e:
        if is_disk_full(e):
            where = Path(args[0])
            raise WorkerError(f"No space left on device while running {func} on {where}: {disk_text(where.parent)}. "
                              f"Free space or choose another output_dir") from e
        raise
    finally:
        if owned:
            proc.stop()


def recover(h5_path: str | Path) -> int:
    """Rebuild ``NAME.h5`` (the index) and ``NAME.json`` from the complete part files alone.

    For files a crash left behind: leftover ``*.tmp`` half-written parts are deleted; every complete part
    is listed, in part order, with episodes renumbered to consecutive ids 0..n-1 (index links and JSON
    entries alike). Parts written before parts carried their JSON entries take them from ``NAME.json``.
    A self-contained (consolidated) ``NAME.h5`` with no parts is left as it is. Returns the number of
    episodes. Parts that cannot be read are left in place, unlisted, with a warning.
    """
    state = run_in_child("recover_here", str(h5_path), None, False)
    if state["skipped"]:
        warnings.warn(f"recover({str(h5_path)!r}): part files not listed: {state['skipped']}", stacklevel=2)
    return len(state["episodes"])


def consolidate(h5_path: str | Path) -> Path:
    """Make ``NAME.h5`` one self-contained file: `recover` first (so complete parts a crash left unlisted
    are kept), copy every episode into a new file with the same group names and JSON ids (in a writer
    process, atomic rename), and only then remove ``NAME.h5.parts``. Returns ``NAME.h5``."""
    run_in_child("consolidate_here", str(h5_path), None)
    return Path(h5_path)


# ---------------------------------------------------------------------------------------------- what a run holds
# The tests of `fastrecord.sinks.formats.RUN_FILES` for this format's files: whether an earlier run's file holds
# recorded episodes (a run that recorded nothing is replaced, whatever ``if_exists`` says).
def h5_holds_episodes(path: Path, output_dir: Path, name: str) -> bool:
    """Whether ``NAME.h5`` holds any ``traj_*`` group, or cannot be read, or has no ``NAME.json`` beside it
    (then it is kept too).

    Read in a writer process (`run_in_child`), as every other HDF5 access to a run's files while recording:
    the file is what an earlier run left, maybe damaged, and the HDF5 library must not take the caller's
    process down on it (a process start, about 0.14 s on a busy 2-core machine, paid only when an earlier run
    of the name recorded nothing)."""
    if not (Path(output_dir) / f"{name}.json").exists():
        return True  # an HDF5 file without its episode list: keep it
    try:
        state = run_in_child("groups_of", str(path))
    except Exception:  # noqa: BLE001 - the reader died on it: unreadable, so kept
        return True
    return "error" in state or any(str(k).startswith("traj_") for k in state.get("names", []))


def json_holds_episodes(path: Path, output_dir: Path, name: str) -> bool:
    """Whether ``NAME.json`` lists an episode, or cannot be read."""
    try:
        episodes = json.loads(Path(path).read_text()).get("episodes")
        return not isinstance(episodes, list) or bool(episodes)
    except (OSError, ValueError, AttributeError):
        return True  # unreadable: keep it, the user decides


def json_episodes(path: Path) -> int | None:
    """How many episodes ``NAME.json`` lists (None: unreadable)."""
    try:
        return len(json.loads(Path(path).read_text()).get("episodes", []))
    except (OSError, ValueError, AttributeError, TypeError):
        return None
