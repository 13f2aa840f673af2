"""The ``fastrecord`` command: record, replay, bench.

    fastrecord record PickCube-v1                     # record 4 episodes (CPU sim/render work)
    fastrecord record --help

Each subcommand lives in its own module with ``configure_parser(parser)`` and ``main_from_args(args)``.
A mistake in the options or the config file is one line, ``fastrecord <cmd>: error: ...``, and exit
status 2, before anything is written. Ctrl-C (SIGINT) and SIGTERM stop ``record`` and ``replay``
cleanly: the env is closed (episodes in progress are saved), the summary is printed, and the exit
status is 130 / 143.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import threading
from types import FrameType

SUBCOMMANDS = {
    "record": ("fastrecord.commands.record", "run a policy in N envs and record its episodes"),
    "replay": ("fastrecord.commands.replay", "replay saved trajectories: re-render videos, convert observation modes"),
    "bench": ("fastrecord.commands.bench", "measure recording throughput against ManiSkill's RecordEpisode"),
}


class StopSignals:
    """Owns the SIGINT/SIGTERM handlers of one run: installed on enter (main thread only), restored on exit.

    A signal does not raise in the middle of a step: it sets `signum`, and the run loop checks
    `requested` between steps, then closes the env from a consistent state (which saves the episodes in
    progress). Later signals, while the files are being finished, are ignored with a message on stderr;
    ``kill -9`` still stops at once, and every finished episode stays readable.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, command: str) -> None:
        self.command = command
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

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
        os.write(2, f"\nfastrecord {self.command}: {name} ignored: saving the episodes in progress, please wait "
                    f"(kill -9 stops at once; finished episodes stay readable)\n".encode())

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()


def main(argv: list[str] | None = None) -> int:
    from fastrecord.system import use_lavapipe_if_no_gpu

    use_lavapipe_if_no_gpu()
    parser = argparse.ArgumentParser(prog="fastrecord", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    modules = {}
    for name, (module, help_) in SUBCOMMANDS.items():
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name == module:
                continue  # subcommand not built in this version
            raise
        modules[name] = mod
        p = sub.add_parser(name, help=help_, description=mod.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.configure_parser(p)
    args = parser.parse_args(argv)
    try:
        return modules[args.command].main_from_args(args)
    except ValueError as e:
        print(f"fastrecord {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C outside a run loop (loading, env creation): nothing half-written to save
        print(f"fastrecord {args.command}: interrupted (SIGINT)", file=sys.stderr)
        return 128 + signal.SIGINT


if __name__ == "__main__":
    sys.exit(main())
