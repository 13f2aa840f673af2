"""`fastrecord consolidate PATH.h5`: make a run's ``NAME.h5`` one self-contained file.

A run that crashed (or was killed) leaves ``NAME.h5`` as an index of links into ``NAME.h5.parts/``; a
sharded run joined with ``fastrecord merge --links`` leaves links into ``NAME.shards/``. Such a file
opens only next to those folders. This command, run where the run was recorded, lists every complete
part (also those the crash left unlisted), copies every episode into one self-contained ``NAME.h5``
(atomic rename) with its ``NAME.json``, then removes ``NAME.h5.parts/`` (a sharded run's shards are
kept: they are what a resumed run continues). It prints one line: the file, its episodes, its size.

Given a run's ``NAME.lerobot`` (the LeRobot dataset of ``lerobot=True``), it folds the finished episodes a
killed run left in ``NAME.lerobot.parts/`` into the dataset's files (`fastrecord.sinks.lerobot.repair`).

Examples:
    fastrecord consolidate recordings/trajectory.h5      # after a crash or kill: one file to copy
    fastrecord consolidate runs/demos.h5                 # a sharded run joined with --links: copy it in
    fastrecord consolidate recordings/trajectory.lerobot # a killed run's LeRobot dataset: every finished episode in
"""

from __future__ import annotations

import argparse
from pathlib import Path


def configure_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="the run's NAME.h5 (next to its NAME.h5.parts/ or NAME.shards/), or its NAME.lerobot")


def consolidate_run(h5_path: str | Path) -> str:
    """Make ``h5_path`` self-contained (see the module docstring); returns the one-line summary. A run
    still recording, or a path that is no run, is a ValueError naming the fix."""
    from fastrecord.shards import list_shards, lock_held, merge
    from fastrecord.sinks.maniskill_h5 import consolidate, read_json, sibling_paths

    h5 = Path(h5_path)
    if h5.suffix == ".lerobot":
        return _repair_lerobot(h5)
    if h5.suffix != ".h5" or h5.is_dir():
        raise ValueError(f"{str(h5)!r} is not a NAME.h5 trajectory file; pass the NAME.h5 of a recorded run")
    name, folder = h5.stem, h5.parent
    json_path, parts_dir = sibling_paths(h5)
    if lock_held(folder, name):
        raise ValueError(f"{h5} is being recorded now (its lock .{name}.lock is held); consolidate it once that "
                         f"recording has ended (it consolidates itself when it closes)")
    if list_shards(folder, name):
        report = merge(folder, name)
        missing = f"; {len(report.missing)} expected episodes are missing (fastrecord merge {folder} --name {name} " \
                  f"lists them)" if report.missing else ""
        return (f"{h5}: {report.episodes} episodes from {len(report.shards)} shard(s) copied into one self-contained "
                f"file ({_mib(h5)}); {name}.shards/ kept{missing}")
    if not h5.exists() and not parts_dir.is_dir():
        raise ValueError(f"{h5} is no run: neither it nor {parts_dir.name}/ nor {name}.shards/ exist; pass the NAME.h5 "
                         f"of a recorded run, in the folder it was recorded in")
    had_parts = parts_dir.is_dir()
    consolidate(h5)
    episodes = len((read_json(json_path) or {}).get("episodes") or [])
    done = f"{parts_dir.name}/ removed" if had_parts else "it was self-contained already"
    return f"{h5}: {episodes} episodes in one self-contained file ({_mib(h5)}); {done}"


def _repair_lerobot(root: Path) -> str:
    from fastrecord.shards import lock_held
    from fastrecord.sinks.lerobot import repair

    name = root.name[: -len(".lerobot")]
    if lock_held(root.parent, name):
        raise ValueError(f"{root} is being recorded now (its lock .{name}.lock is held); consolidate it once that "
                         f"recording has ended (it consolidates itself when it closes)")
    parts = root.with_name(root.name + ".parts")
    had = sum(1 for p in parts.glob("ep_*.parquet")) if parts.is_dir() else 0
    w = repair(root)
    return (f"{root}: {w.episodes} episodes, {w.frames} frames in {w.files} file(s) of each kind; "
            f"{had} finished episode(s) folded in from {parts.name}/" if had else
            f"{root}: {w.episodes} episodes, {w.frames} frames in {w.files} file(s) of each kind; nothing to fold in")


def _mib(path: Path) -> str:
    n = path.stat().st_size
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def main_from_args(args: argparse.Namespace) -> int:
    print(consolidate_run(args.path))
    return 0
