"""Which files a run owns: its fixed names, its manifest ``NAME.fastrecord.json`` and its journal.

The manifest is rewritten at most once a second while a run records (and at its end); every file the run
writes is also a line of its journal ``.NAME.fastrecord.journal`` at once (append-only, flushed): a
video's name before it is encoded (an *intent*) and the file it became (a ``_k`` name where the one asked
for was taken), with the kept episodes it holds. A manifest write folds the journal in and starts it
afresh. So after a ``kill -9`` the manifest and the journal together list every file of the run
(`listed_files`; `fastrecord.sinks.formats.run_files` adds the files each format declares), and
`owned_intent_files` finds a video published in the instant between its file and
its journal line.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

MANIFEST_SUFFIX = ".fastrecord.json"
JOURNAL_SUFFIX = ".fastrecord.journal"  # .NAME.fastrecord.journal: files added since the manifest was last written
RESULTS_SUFFIX = ".results.jsonl"  # NAME.results.jsonl: one row per finished episode (fastrecord.sinks.results)


def append_line(f: Any, line: bytes) -> None:
    """Append ``line`` (a newline at its end) to ``f``, a binary file opened for appending without a buffer
    (``open(path, "ab", buffering=0)``): one write where the disk takes it, through at once (a kill keeps whole
    lines). A write that fails part way (a full disk, a signal's exception) is undone, so the file ends at its
    last whole line and the line, written again, is there once (a buffered file keeps the failed bytes and
    writes them again before the retry's: the line twice)."""
    fd = f.fileno()
    end = os.lseek(fd, 0, os.SEEK_END)
    data = memoryview(line)
    try:
        while data:
            data = data[f.write(data):]
    except BaseException:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, end)
        raise


def read_manifest(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def glob_escape(name: str) -> str:
    """``name`` with glob's special characters escaped."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


def lock_path(output_dir: Path, name: str) -> Path:
    """``.NAME.lock``: held (`fastrecord.locks`) by the process recording run ``name`` while it records."""
    return Path(output_dir) / f".{name}.lock"


def journal_path(output_dir: Path, name: str) -> Path:
    """``.NAME.fastrecord.journal``: one JSON line per file the run wrote since its manifest was last written."""
    return Path(output_dir) / f".{name}{JOURNAL_SUFFIX}"


def read_journal(path: Path) -> list[dict[str, Any]]:
    """The entries of a run's journal (a torn last line, from a kill mid-write, is skipped)."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and isinstance(entry.get("file") or entry.get("intent"), str):
            out.append(entry)
    return out


def listed_files(output_dir: Path, name: str) -> dict[str, list[int]]:
    """Every file run ``name`` says it wrote (its manifest's ``files`` and its journal's), relative to
    ``output_dir``, with the episode ids each holds (``[]``: none named, e.g. the results file)."""
    manifest = read_manifest(Path(output_dir) / f"{name}{MANIFEST_SUFFIX}")
    episodes = manifest.get("file_episodes")
    episodes = episodes if isinstance(episodes, dict) else {}
    out: dict[str, list[int]] = {}
    for f in manifest.get("files", []):
        if isinstance(f, str):
            out.setdefault(f, [int(e) for e in episodes.get(f, []) if isinstance(e, int)])
    for entry in read_journal(journal_path(output_dir, name)):
        if isinstance(entry.get("file"), str):
            out.setdefault(entry["file"], [int(e) for e in entry.get("episodes", []) if isinstance(e, int)])
    return out


def results_videos(output_dir: Path, name: str) -> list[str]:
    """The videos run ``name``'s results rows (``NAME.results.jsonl``) name (``video``, and ``videos``: every
    piece of a joined split video), relative to ``output_dir``: for a joined sharded run, the videos its join
    linked next to ``NAME.h5`` (`fastrecord.shards.videos`), which its manifest does not list. A torn or foreign
    line is skipped."""
    try:
        lines = (Path(output_dir) / f"{name}{RESULTS_SUFFIX}").read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return []
    out: list[str] = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if not isinstance(row, dict):
            continue
        pieces = row.get("videos")  # a joined row's split video: every piece
        for video in [row.get("video"), *(pieces if isinstance(pieces, list) else [])]:
            if isinstance(video, str) and video and not os.path.isabs(video):
                out.append(video)
    return list(dict.fromkeys(out))


def pending_intents(output_dir: Path, name: str) -> list[dict[str, Any]]:
    """The files run ``name`` was writing when it stopped: ``{"intent": name asked for, "episodes": [...],
    "t": time.time() before}`` entries (its manifest's ``pending`` and its journal's) without a ``file``
    entry ``"for"`` them. The file may have landed under that name or a ``_k`` one (`owned_intent_files`)."""
    manifest = read_manifest(Path(output_dir) / f"{name}{MANIFEST_SUFFIX}")
    entries = [e for e in manifest.get("pending", []) if isinstance(e, dict) and isinstance(e.get("intent"), str)]
    journal = read_journal(journal_path(output_dir, name))
    entries += [e for e in journal if isinstance(e.get("intent"), str)]
    done = {e.get("for") for e in journal if isinstance(e.get("file"), str)}
    return [e for e in {e["intent"]: e for e in entries}.values() if e["intent"] not in done]


def owned_intent_files(output_dir: Path, name: str) -> dict[str, list[int]]:
    """The files of `pending_intents` on disk: the name asked for or a ``STEM_k`` one that no other run in
    ``output_dir`` lists and that was written after the intent (its mtime): a kill between a video's
    publication and its journal entry leaves such a file."""
    output_dir = Path(output_dir)
    intents = pending_intents(output_dir, name)
    if not intents:
        return {}
    others: set[str] = set()
    for m in output_dir.glob(f"*{MANIFEST_SUFFIX}"):
        other = m.name[: -len(MANIFEST_SUFFIX)]
        if other != name:
            others |= set(listed_files(output_dir, other)) | set(results_videos(output_dir, other))  # joined videos too
    out: dict[str, list[int]] = {}
    for e in intents:
        want = Path(e["intent"])
        stem, suffix = want.stem, want.suffix
        for p in [output_dir / want, *sorted(output_dir.glob(f"{glob_escape(str(want.parent / stem))}_*{suffix}"))]:
            rel = os.path.relpath(p, output_dir)
            tail = p.stem[len(stem) + 1:]
            if p != output_dir / want and not tail.isdigit():
                continue
            try:
                fresh = p.stat().st_mtime >= float(e.get("t", 0)) - 1.0
            except OSError:
                continue
            if fresh and rel not in others:
                out[rel] = [int(x) for x in e.get("episodes", []) if isinstance(x, int)]
    return out
