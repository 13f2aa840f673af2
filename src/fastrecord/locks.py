"""Lock files: one process at a time holds ``path`` (an exclusive ``flock``, released by the kernel when the
process dies), and the file says who (``pid P on HOST``) for the error or log line of the next one.

The one helper of the run directory's claim of a name (``.NAME.lock``, `fastrecord.sinks.base.RunDirectory`)
and of a merge of shards (``.NAME.merge.lock``, `fastrecord.shards.join.merge`). The holder removes the
file as it ends, before the close that releases the lock: a process that opened the file before that and
then takes the lock holds a lock on a removed file, which is no lock, so it opens the new one.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path


class LockHeld(Exception):
    """Another process holds the lock (``holder``: what it wrote in the file, ``""`` if nothing yet)."""

    def __init__(self, path: Path, holder: str) -> None:
        super().__init__(f"{path} is held by {holder or 'an unknown process'}")
        self.path = path
        self.holder = holder


def take_lock(path: Path, *, wait: bool = False, waiting: Callable[[str], None] | None = None) -> int:
    """Take the lock ``path`` (created if missing) and write this process into it; returns the open file
    descriptor that holds it (`release_lock` gives it back). Held by another process: `LockHeld`, or with
    ``wait`` block until it is free, first calling ``waiting(holder)`` (e.g. a log line)."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip()
            if not wait:
                os.close(fd)
                raise LockHeld(Path(path), holder) from None
            if waiting is not None:
                waiting(holder)
            fcntl.flock(fd, fcntl.LOCK_EX)
        try:  # the previous holder may have removed the file between our open and flock: take the new one
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)
    except BaseException:  # no space for the owner line: give the lock back, its file removed (nothing left)
        release_lock(Path(path), fd)
        raise
    return fd


def release_lock(path: Path, fd: int) -> None:
    """Give back a lock `take_lock` took: remove the file, then close the descriptor (which releases it)."""
    try:
        Path(path).unlink(missing_ok=True)
    finally:
        os.close(fd)


@contextlib.contextmanager
def holding(path: Path, *, wait: bool = True, waiting: Callable[[str], None] | None = None) -> Iterator[None]:
    """`take_lock` for the ``with`` block (waiting for it by default), then `release_lock`."""
    fd = take_lock(path, wait=wait, waiting=waiting)
    try:
        yield
    finally:
        release_lock(path, fd)


def lock_held(path: Path) -> bool:
    """Whether a live process holds the lock ``path`` now (a missing file: no)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False
