"""Make a stopped run's outputs agree before it goes on: `inspect_run` (read only) and `reconcile`; finish a
killed run's outputs as its close would have: `finish_run` (``fastrecord consolidate``, a resumed replay with
nothing left to replay).

The rule (docs/format.md, "Crash safety"): a kept episode is *done* once its row is in
``NAME.results.jsonl``, and its row is written only after every output holds it for good
(`fastrecord.sinks.results`). So the results file is the run's commit log: its kept rows are episodes
``0 .. n-1``, in order, and every output holds at least those. What an output holds beyond them (a
SIGKILL, a full disk, a failed sink stopped the run before the others caught up) is not done: a resumed
run discards it from every output (`reconcile`) and records those episodes again, so each episode is in
every output exactly once. An output that holds *fewer* than the log (a file deleted, truncated or
replaced after the run) is damage: reported, one line per file, and nothing is changed.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastrecord.sinks import formats
from fastrecord.sinks.runfiles import MANIFEST_SUFFIX, RESULTS_SUFFIX, listed_files, owned_intent_files, pending_intents

if TYPE_CHECKING:
    from fastrecord.sinks.base import RunDirectory
    from fastrecord.sinks.lerobot.check import DatasetState

log = logging.getLogger("fastrecord")


@dataclass
class RunState:
    """What a run's outputs hold (`inspect_run`)."""

    name: str
    committed: int  # n: kept episodes 0 .. n-1 are done (rows in the results file; else what every output holds)
    rows: list[dict[str, Any]] | None  # the results file's rows (None: no results file)
    keep_rows: int  # the rows of the commit log (the rest are torn or past it)
    h5: dict[str, Any] | None  # `process.scan_here` of NAME.h5 (None: the run keeps no trajectory)
    lerobot: DatasetState | None  # the LeRobot dataset (None: none)
    videos: dict[str, list[int]] = field(default_factory=dict)  # video file (relative) -> kept episodes in it
    problems: list[str] = field(default_factory=list)  # damage, one line each (naming the file and the fix)

    def beyond(self) -> dict[str, list[int]]:
        """Per output, the episodes it holds past the commit log (a resume discards them)."""
        n, out = self.committed, {}
        if self.h5 is not None and any(i >= n for i in self.h5["ids"]):
            out[f"{self.name}.h5"] = sorted(i for i in self.h5["ids"] if i >= n)
        if self.lerobot is not None and any(s >= n for s in self.lerobot.parts):
            out[f"{self.name}.lerobot"] = sorted(s for s in self.lerobot.parts if s >= n)
        gone = sorted({e for eps in self.videos.values() for e in eps if e >= n})
        if gone:
            out["videos"] = gone
        return out


def commit_log(rows: list[dict[str, Any]]) -> tuple[int, int]:
    """(n, k): the kept episodes ``0 .. n-1`` the first ``k`` rows commit (rows of episodes not kept among
    them); rows after a kept row that breaks the sequence are not part of the log."""
    n = k = 0
    for i, row in enumerate(rows):
        eid = row.get("episode_id")
        if eid is not None:
            if eid != n:
                break
            n += 1
        k = i + 1
    return n, k


def _prefix(ids: list[int]) -> int:
    """How many of ``ids`` are ``0, 1, 2, ...`` from the start."""
    n = 0
    for i in ids:
        if i != n:
            break
        n += 1
    return n


def episode_ranges(ids: list[int]) -> str:
    """``0-3, 7, 9-10``: the ids, sorted, in runs."""
    ids = sorted(set(ids))
    runs: list[str] = []
    start = prev = None
    for i in ids + [None]:
        if start is not None and prev is not None and (i is None or i != prev + 1):  # prev is set once start is
            runs.append(str(start) if start == prev else f"{start}-{prev}")
            start = None
        if i is not None and start is None:
            start = i
        prev = i
    return ", ".join(runs)


def _is_video(rel: str) -> bool:
    """Whether a listed file is a video of the run (`fastrecord.sinks.mp4`)."""
    return rel.endswith(formats.RECORDING_SUFFIXES["mp4"])


def inspect_run(output_dir: str | Path, name: str, videos: bool = True) -> RunState:
    """Read every output of run ``name`` in ``output_dir`` (nothing is written): the commit log, what
    each output holds, and every disagreement that is damage (`RunState.problems`). ``videos``: check the
    LeRobot dataset's videos with PyAV too (their length)."""
    from fastrecord.sinks.results import read_results

    out = Path(output_dir)
    fix = "restore it from a copy, or record the run again (--if-exists overwrite / if_exists='overwrite')"
    results = out / f"{name}{RESULTS_SUFFIX}"
    rows = [r for r in read_results(results) if isinstance(r, dict)] if results.exists() else None
    n_rows, keep = commit_log(rows) if rows is not None else (0, 0)
    problems: list[str] = []
    h5 = None
    if formats.present(out, name, "maniskill_h5"):
        from fastrecord.sinks.maniskill_h5 import run_in_child

        h5 = run_in_child("scan_here", str(out / f"{name}.h5"))
        problems += [f"{name}.h5.parts/{u} cannot be read; restore it or move it out (its episodes are then recorded "
                     f"again)" for u in h5["unreadable"]]
    lerobot = None
    if formats.present(out, name, "lerobot"):
        from fastrecord.sinks.lerobot.check import scan_dataset

        lerobot = scan_dataset(out / f"{name}.lerobot", videos=videos)
        problems += lerobot.problems
    owned = {**listed_files(out, name), **owned_intent_files(out, name)}
    vids = {f: e for f, e in owned.items() if _is_video(f) and (out / f).exists()}
    seqs = lerobot.seqs if lerobot else None
    n = n_rows if rows is not None else min((_prefix(x) for x in [(h5 or {}).get("ids"), seqs] if x is not None),
                                            default=0)
    for what, ids in ((f"{name}.h5", (h5 or {}).get("ids")), (f"{name}.lerobot", lerobot.seqs if lerobot else None)):
        if ids is not None and _prefix(ids) < n:
            lacking = sorted(set(range(n)) - set(ids))
            if lacking:
                problems.append(f"{what} lacks episode(s) {episode_ranges(lacking)} that {name}{RESULTS_SUFFIX} "
                                f"commits; {fix}")
            else:  # every committed episode is there, but not in order 0, 1, 2, ... or some twice
                twice = sorted(i for i, k in Counter(ids).items() if k > 1)
                problems.append(f"{what} holds the episodes {name}{RESULTS_SUFFIX} commits out of order"
                                + (f", episode(s) {episode_ranges(twice)} twice" if twice else "")
                                + f" (in file order: {', '.join(map(str, list(ids)[:40]))}"
                                + (" ..." if len(ids) > 40 else "") + f"); {fix}")
    if lerobot is not None and any(s >= n for s in lerobot.filed):
        extra = episode_ranges([s for s in lerobot.filed if s >= n])
        problems.append(f"{name}.lerobot's dataset files hold episode(s) {extra} "
                        f"that no results row commits (written by an older fastrecord); {fix}")
    named = {row.get("video") for row in (rows or [])[:keep]}
    for row in (rows or [])[:keep]:
        video = row.get("video")
        if isinstance(video, str) and not (out / video).exists():
            problems.append(f"{video} (the video of episode {row.get('episode_id')}) is missing; {fix}")
    for f, eps in owned.items():  # listed by the manifest: gone although its episodes are committed
        if f not in named and _is_video(f) and eps and all(e < n for e in eps) and not (out / f).exists():
            problems.append(f"{f} (a video of episode(s) {episode_ranges(eps)}, listed in {name}.fastrecord.json) is "
                            f"missing; {fix}")
    return RunState(name, n, rows, keep, h5, lerobot, vids, problems)


def refuse_damage(output_dir: Path, name: str, what: str = "cannot resume") -> RunState:
    """`inspect_run` (read only), raising a one-line ValueError naming the first damaged file."""
    state = inspect_run(output_dir, name)
    if state.problems:
        more = f" (and {len(state.problems) - 1} more: fastrecord info lists them)" if len(state.problems) > 1 else ""
        raise ValueError(f"{what} run {name!r} in {str(output_dir)!r}: {state.problems[0]}{more}")
    return state


def reconcile(run: RunDirectory, state: RunState | None = None) -> RunState:
    """Before a resumed run records: discard from every output what the commit log does not hold (see the
    module docstring), set ``run.committed`` and the manifest's episode counter to it. Raises a ValueError
    (one line, nothing changed) if an output lacks a committed episode. ``state``: `refuse_damage`'s, if
    the caller inspected the run under its lock already."""
    out, name = run.output_dir, run.name
    state = state or refuse_damage(out, name)
    n = state.committed
    beyond = state.beyond()
    if state.h5 is not None and f"{name}.h5" in beyond:
        from fastrecord.sinks.maniskill_h5 import run_in_child

        run_in_child("trim_here", str(out / f"{name}.h5"), n)
    if state.lerobot is not None:
        parts = state.lerobot.root.with_name(state.lerobot.root.name + ".parts")
        for seq in beyond.get(f"{name}.lerobot", []):
            for p in parts.glob(f"ep_{seq:08d}.*"):
                p.unlink()
    gone = [f for f, eps in state.videos.items() if any(e >= n for e in eps)]
    for f in gone:
        (out / f).unlink(missing_ok=True)
    for e in pending_intents(out, name):  # encoder temporaries a kill left
        for tmp in out.glob(f"{e['intent']}.*.part"):
            tmp.unlink(missing_ok=True)
    run.remove_files(gone)
    if state.rows is not None:
        results = out / f"{name}{RESULTS_SUFFIX}"
        text = results.read_text()
        kept = "".join(json.dumps(r, allow_nan=False) + "\n" for r in state.rows[: state.keep_rows])
        if kept != text:
            from fastrecord.sinks.base import atomic_write_bytes

            atomic_write_bytes(results, kept.encode())
    run.committed = n
    run.set_counter("episodes", n)
    if beyond:
        what = "; ".join(f"{k}: {episode_ranges(v)}" for k, v in beyond.items())
        log.warning("fastrecord: resuming %r: discarded the episodes the run had not committed to every output when it "
                    "stopped (%s); they are recorded again", name, what)
    return state


# ---------------------------------------------------------------------------------------------- finishing a run
def finish_run(folder: Path, name: str) -> list[str]:
    """Finish the outputs of run ``name`` in ``folder`` as its close would have, if a kill stopped it before
    (its manifest does not say ``closed``): made to agree, consolidated, marked closed (`finish_outputs`); the
    summary lines (none for a closed run or no run). A resumed replay with nothing left to replay calls it."""
    from fastrecord.sinks.base import read_manifest
    from fastrecord.sinks.maniskill_h5 import sibling_paths

    manifest = read_manifest(folder / f"{name}{MANIFEST_SUFFIX}")
    if not manifest or manifest.get("status") == "closed":
        return []
    h5, lerobot = folder / f"{name}.h5", folder / f"{name}.lerobot"
    has_h5 = h5.exists() or sibling_paths(h5)[1].is_dir()
    has_lerobot = lerobot.is_dir() or lerobot.with_name(lerobot.name + ".parts").is_dir()
    return finish_outputs(folder, name, has_h5, has_lerobot)


def finish_outputs(folder: Path, name: str, has_h5: bool, has_lerobot: bool) -> list[str]:
    """Consolidate every output of run ``name``, made to agree first (`fastrecord.sinks.reconcile`), then
    mark its manifest ``closed``; the summary lines. A run without a manifest (ManiSkill's files, an older
    fastrecord's) has its outputs consolidated as they are."""
    from fastrecord.sinks.base import RunDirectory, read_manifest
    from fastrecord.sinks.maniskill_h5 import one_writer_process

    manifest = read_manifest(folder / f"{name}{MANIFEST_SUFFIX}")
    with one_writer_process():  # the check, the trim and the consolidation: one HDF5 process
        if not manifest:
            return _consolidate_outputs(folder, name, has_h5, has_lerobot)
        refuse_damage(folder, name, "not consolidating")  # read only: a damaged run is refused before writing
        run = RunDirectory(folder, name, "resume", options=manifest.get("options")).open()
        status = manifest.get("status", "recording")
        try:
            reconcile(run)
            lines = _consolidate_outputs(folder, name, has_h5, has_lerobot)
            status = "closed"
            return lines
        finally:
            run.close(status=status)


def _consolidate_outputs(folder: Path, name: str, has_h5: bool, has_lerobot: bool) -> list[str]:
    """The trajectory made one self-contained file, the LeRobot dataset's parts folded into its files; a line each."""
    from fastrecord.sinks.lerobot import repair
    from fastrecord.sinks.maniskill_h5 import consolidate, read_json, sibling_paths

    lines = []
    if has_h5:
        h5 = folder / f"{name}.h5"
        json_path, parts_dir = sibling_paths(h5)
        had_parts = parts_dir.is_dir()
        consolidate(h5)
        episodes = len((read_json(json_path) or {}).get("episodes") or [])
        done = f"{parts_dir.name}/ removed" if had_parts else "it was self-contained already"
        lines.append(f"{h5}: {episodes} episodes in one self-contained file ({mib(h5)}); {done}")
    if has_lerobot:
        root = folder / f"{name}.lerobot"
        parts = root.with_name(root.name + ".parts")
        had = sum(1 for p in parts.glob("ep_*.parquet")) if parts.is_dir() else 0
        w = repair(root)
        lines.append(f"{root}: {w.episodes} episodes, {w.frames} frames in {w.files} file(s) of each kind; "
                     + (f"{had} finished episode(s) folded in from {parts.name}/" if had else "nothing to fold in"))
    return lines


def mib(path: Path) -> str:
    """A file's size as the summaries print it (``1.5 MiB``, ``12.0 KiB``)."""
    n = path.stat().st_size
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"
