"""`fastrecord consolidate PATH.h5`: make a run's ``NAME.h5`` one self-contained file.

A run that crashed (or was killed) leaves ``NAME.h5`` as an index of links into ``NAME.h5.parts/``; a
sharded run joined with ``fastrecord merge --links`` leaves links into ``NAME.shards/``. Such a file
opens only next to those folders. This command, run where the run was recorded, lists every complete
part (also those the crash left unlisted), copies every episode into one self-contained ``NAME.h5``
(atomic rename) with its ``NAME.json``, then removes ``NAME.h5.parts/`` (a sharded run's shards are
kept: they are what a resumed run continues). It prints one line: the file, its episodes, its size.

Given a run's ``NAME.lerobot`` (the LeRobot dataset of ``lerobot=True``), it folds the finished episodes a
killed run left in ``NAME.lerobot.parts/`` into the dataset's files (`fastrecord.sinks.lerobot.repair`).

Either way the whole run is made to agree first (`fastrecord.sinks.reconcile`, what a resume does): the
episodes its outputs hold past its results file's commit log are discarded from every output, its
trajectory and its LeRobot dataset are both consolidated, and its manifest then says ``closed``. A run
whose files were deleted, truncated or added by hand is refused with one line naming the file, and
nothing is changed.

Examples:
    fastrecord consolidate recordings/trajectory.h5      # after a crash or kill: one file to copy
    fastrecord consolidate runs/demos.h5                 # a sharded run joined with --links: copy it in
    fastrecord consolidate recordings/trajectory.lerobot # a killed run's LeRobot dataset: every finished episode in
"""

from __future__ import annotations

import argparse
from pathlib import Path


def configure_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="the run's NAME.h5 (next to its NAME.h5.parts/ or NAME.shards/), or its NAME.lerobot: "
                                "both are consolidated")


def consolidate_run(path: str | Path) -> str:
    """Make the run of ``path`` (its NAME.h5 or NAME.lerobot) self-contained (see the module docstring);
    returns the summary, a line per output. A run still recording, a damaged run, or a path that is no run,
    is a ValueError naming the fix."""
    from fastrecord.shards import list_shards, lock_held, merge
    from fastrecord.sinks.maniskill_h5 import sibling_paths
    from fastrecord.sinks.reconcile import finish_outputs, mib

    path = Path(path)
    if path.suffix not in (".h5", ".lerobot") or (path.suffix == ".h5" and path.is_dir()):
        raise ValueError(f"{str(path)!r} is not a NAME.h5 trajectory file nor a NAME.lerobot dataset; pass the NAME.h5 "
                         f"(or NAME.lerobot) of a recorded run")
    name, folder = path.stem, path.parent
    h5 = folder / f"{name}.h5"
    _json_path, parts_dir = sibling_paths(h5)
    lerobot = folder / f"{name}.lerobot"
    if lock_held(folder, name):
        raise ValueError(f"{path} is being recorded now (its lock .{name}.lock is held); consolidate it once that "
                         f"recording has ended (it consolidates itself when it closes)")
    if path.suffix == ".h5" and list_shards(folder, name):
        report = merge(folder, name)
        missing = f"; {len(report.missing)} expected episodes are missing (fastrecord merge {folder} --name {name} " \
                  f"lists them)" if report.missing else ""
        return (f"{h5}: {report.episodes} episodes from {len(report.shards)} shard(s) copied into one self-contained "
                f"file ({mib(h5)}); {name}.shards/ kept{missing}")
    has_h5 = h5.exists() or parts_dir.is_dir()
    has_lerobot = lerobot.is_dir() or lerobot.with_name(lerobot.name + ".parts").is_dir()
    if not (has_h5 if path.suffix == ".h5" else has_lerobot):
        if path.suffix == ".lerobot":
            raise ValueError(f"{lerobot} is no LeRobot dataset of a run: neither it nor {lerobot.name}.parts/ exist; "
                             f"pass the NAME.lerobot folder of a recorded run")
        raise ValueError(f"{h5} is no run: neither it nor {parts_dir.name}/ nor {name}.shards/ exist; pass the NAME.h5 "
                         f"of a recorded run, in the folder it was recorded in")
    return "\n".join(finish_outputs(folder, name, has_h5, has_lerobot))


def main_from_args(args: argparse.Namespace) -> int:
    print(consolidate_run(args.path))
    return 0
