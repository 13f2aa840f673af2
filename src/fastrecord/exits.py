"""What happens to open recordings when the process ends.

- Recorders still open when the interpreter exits (a script that never calls ``close()``) are closed by
  an exit hook, registered when the first recorder opens (`close_at_exit`): their finished episodes are
  written before the process ends, as ManiSkill's wrapper writes each one at its reset. The hook touches
  nothing but fastrecord's own recorders and the writer pools they own; episodes in progress are not
  saved (as ManiSkill, which saves them only in ``close()``).
- SIGTERM (``kill``, ``docker stop``, a job scheduler) ends a Python program at once, skipping every
  ``finally`` and exit hook, so a recording in flight loses what its writers still hold. Changing that is
  a process-wide decision, so it is opt-in: `install_signal_handlers` makes SIGTERM raise
  ``SystemExit(143)`` instead. The ``fastrecord`` command calls it; a script calls it once at start-up::

      import fastrecord
      fastrecord.install_signal_handlers()
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import weakref
from types import FrameType
from typing import Any, Protocol


class Closable(Protocol):
    def close(self, flush: bool) -> None: ...


class _OpenRecorders:
    """Owns: the set of open recorders (weak references) and the one exit hook that closes them."""

    def __init__(self) -> None:
        self._open: weakref.WeakSet[Closable] = weakref.WeakSet()
        self._registered = False

    def add(self, rec: Closable) -> None:
        self._open.add(rec)
        if not self._registered:
            self._registered = True
            atexit.register(self._at_exit)

    def discard(self, rec: Closable) -> None:
        self._open.discard(rec)

    def _at_exit(self) -> None:
        for rec in list(self._open):
            try:
                rec.close(flush=False)
            except BaseException as e:  # noqa: BLE001 - report, and let the other recorders close
                print(f"fastrecord: closing a recorder at exit failed: {type(e).__name__}: {e}", file=sys.stderr)


_open_recorders = _OpenRecorders()


def close_at_exit(rec: Closable) -> None:
    """Close ``rec`` with ``close(flush=False)`` at interpreter exit if it is still open then."""
    _open_recorders.add(rec)


def forget_at_exit(rec: Closable) -> None:
    """``rec`` was closed: the exit hook leaves it alone."""
    _open_recorders.discard(rec)


def install_signal_handlers() -> bool:
    """Make SIGTERM raise ``SystemExit(143)`` in the main thread, so that ``with``/``finally`` blocks and
    the exit hook close open recorders (their finished episodes and the files' indexes are written) before
    the process ends.

    Only where nobody handles SIGTERM yet: a handler the program installed itself is left alone. Returns
    whether the handler was installed (False also off the main thread, or where signals are unavailable).
    Call it once at start-up, from the main thread.
    """
    if threading.current_thread() is not threading.main_thread():
        return False
    try:
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _exit_on_sigterm)
            return True
    except (ValueError, OSError):  # not the main interpreter, or signals unavailable
        pass
    return False


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


class StopSignals:
    """Owns the SIGINT/SIGTERM handlers of one run: installed on enter (main thread only), restored on exit.

    A signal does not raise in the middle of a step: it sets `signum`, and the run loop checks `requested` between
    steps, then closes the env from a consistent state (`record` drops the episodes in progress, a one-process `replay`
    saves its replays in progress). Later signals, while the files are being finished, are ignored with a message on
    stderr; ``kill -9`` still stops at once, and every finished episode stays readable.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, command: str) -> None:
        self.command = command
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}  # signal -> the handler signal.signal returned

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    @property
    def exit_code(self) -> int:
        """128 + the signal number, the shell's convention (130 for SIGINT, 143 for SIGTERM)."""
        return 128 + self.signum if self.signum is not None else 0

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum = signum
            return
        # os.write, not print: the handler may run while the main thread is inside a write to stderr
        name = signal.Signals(signum).name
        os.write(2, f"\nfastrecord {self.command}: {name} ignored: finishing the files, please wait "
                    f"(kill -9 stops at once; finished episodes stay readable)\n".encode())

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.requested:
            # stopping: files are still finished after the run (encoder and writer pools close at
            # interpreter exit), so later signals are ignored until the process ends; SIG_IGN, not our
            # handler, because Python's finalization resets its own handlers to SIG_DFL (a signal then
            # would kill the process mid-close) but leaves an ignored signal ignored
            for s in self._previous:
                signal.signal(s, signal.SIG_IGN)
            self._previous.clear()
            return
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()


def stopped_by_signal() -> bool:
    """Whether the exception being handled now (in a ``finally`` or ``__exit__``) is a stop: Ctrl-C's
    KeyboardInterrupt, or the SystemExit(130/143) of `install_signal_handlers`. A recorder closed then
    does not save the episodes in progress: a cut episode is not a finished one."""
    import sys

    exc = sys.exc_info()[1]
    return isinstance(exc, KeyboardInterrupt) or (isinstance(exc, SystemExit) and exc.code in (130, 143))
