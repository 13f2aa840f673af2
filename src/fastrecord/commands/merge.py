"""`fastrecord merge DIR`: join the shards of a sharded run into one ManiSkill dataset.

A sharded run (``torchrun ... -m fastrecord record ... --output-dir DIR``, or ``fastrecord replay
--workers N``) records each rank's episodes in ``DIR/NAME.shards/rankNNNNN/``; rank 0 joins them at the
end. This command builds or rebuilds the joined pair ``DIR/NAME.h5`` + ``DIR/NAME.json`` (episodes
sorted by global index g, ``episode_id = g``), e.g. after a crash or while a resumed run is still going.
By default ``NAME.h5`` holds a copy of every episode (self-contained: copy it alone anywhere);
``--links`` writes an index of external links into the shards instead (no copy, but ``NAME.h5`` then
opens only next to ``NAME.shards/``). Each joined episode's videos are linked next to ``NAME.h5``, named by
g (``3_env0_success.mp4``; hard links of the shards' files, copies where the file system has none; a name
another file holds gets ``_1``). It is idempotent and changes no shard.

Examples:
    fastrecord merge recordings                      # recordings/trajectory.h5 + .json from the shards
    fastrecord merge recordings --name demos         # the run named demos
    fastrecord merge recordings --links              # an index of links into the shards (no copy)
    fastrecord merge recordings --json               # the report as JSON

Missing global episodes are reported, not an error; the exit status is 1 when some are missing or a
shard is still recording, 0 otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path


def configure_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", help="the run directory (the --output-dir of the sharded recording)")
    p.add_argument("--name", default="trajectory", help="the run's name (--trajectory-name of the recording)")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--links", action="store_true",
                     help="write NAME.h5 as an index of external links into the shards (no copy; it opens only next "
                          "to NAME.shards/) instead of one self-contained file")
    how.add_argument("--consolidate", action="store_true",
                     help="copy every episode into one self-contained NAME.h5 (the default; as ManiSkill's "
                          "merge_trajectory; the shards are kept)")
    p.add_argument("--expected", type=int, help="global episodes expected (default: the run manifest's total)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def main_from_args(args: argparse.Namespace) -> int:
    from fastrecord.shards import merge

    if args.expected is not None and args.expected < 1:
        raise ValueError(f"expected={args.expected} must be at least 1; pass --expected N with N >= 1, or leave it out")
    out = Path(args.dir)
    if (out / f"{args.name}.shards").is_dir() and not os.access(out, os.W_OK):
        raise PermissionError(
            f"cannot merge into {out}: the folder is read-only and merge writes {args.name}.h5 + "
            f"{args.name}.json there; make it writable or copy the run elsewhere (nothing was changed)"
        )
    report = merge(args.dir, args.name, links=args.links, expected=args.expected)
    if args.json:
        data = dataclasses.asdict(report) | {"ok": report.ok}
        print(json.dumps(data, default=str, indent=2))
    else:
        for line in report.lines():
            print(line)
    return 0 if report.ok else 1
