"""The ``fastrecord`` command: record, replay, bench.

    fastrecord record PickCube-v1                     # record 4 episodes (CPU sim/render work)
    fastrecord record --help

Each subcommand lives in its own module with ``configure_parser(parser)`` and ``main_from_args(args)``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = {
    "record": ("fastrecord.commands.record", "run a policy in N envs and record its episodes"),
    "replay": ("fastrecord.commands.replay", "replay saved trajectories: re-render videos, convert observation modes"),
    "bench": ("fastrecord.commands.bench", "measure recording throughput against ManiSkill's RecordEpisode"),
}


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


if __name__ == "__main__":
    sys.exit(main())
