"""The one registry of a run's output files: which format owns each ``NAME{suffix}`` in the output folder, and
how to tell whether it holds recordings.

Each output format declares its files here, as `RunFile` rows of `RUN_FILES`, and its own test of what
they hold lives in its own package (named lazily, ``"module:function"``, so that the run directory imports
neither h5py nor pyarrow before a format is used). Everything that asks "which files are this run's" or
"did this run record anything" asks this module: the run directory's claim (`fastrecord.sinks.base`:
error / overwrite / resume, a run that recorded nothing, `abandon`), `run_files`, the commit log's
check of the outputs (`fastrecord.sinks.reconcile`) and ``fastrecord info``.

A file a run lists in its manifest or journal (a video, a logger's folder) and that no row names is judged
by `holds_recordings`: a folder holds recordings when it holds a file of a format's `RECORDING_SUFFIXES`
anywhere (a video, a LeRobot parquet file), a file when it is not empty.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fastrecord.sinks.runfiles import (
    JOURNAL_SUFFIX,
    MANIFEST_SUFFIX,
    RESULTS_SUFFIX,
    glob_escape,
    listed_files,
    owned_intent_files,
    results_videos,
)

# holds(path, output_dir, name) -> whether the file ``path`` of run ``name`` holds recordings; a file that cannot
# be read holds them (it is kept: the user decides)
Holds = Callable[[Path, Path, str], bool]


@dataclass(frozen=True)
class RunFile:
    """One file (or folder) a run of name ``NAME`` owns in its output folder."""

    suffix: str  # the file is NAME{suffix} (hidden: .NAME{suffix})
    owner: str  # the format that writes it: a sink's package, "results", "run" (manifest, journal), "shards"
    holds: str = "fastrecord.sinks.formats:holds_recordings"  # "module:function", a `Holds`
    folder: bool = False  # a folder (else a file)
    hidden: bool = False  # .NAME{suffix}
    abandon: bool = True  # removed when the run's construction fails before it recorded (`RunDirectory.abandon`)
    marks_run: bool = False  # its presence alone shows a run of NAME in a folder (``fastrecord info``)
    temporaries: bool = False  # .NAME{suffix}.*.tmp: an atomic write a kill cut short (part of this file)
    episodes: str | None = None  # "module:function" (path) -> the episodes it lists, or None (unreadable)

    def path(self, output_dir: Path, name: str) -> Path:
        return Path(output_dir) / (f".{name}{self.suffix}" if self.hidden else f"{name}{self.suffix}")


RUN_FILES: tuple[RunFile, ...] = (
    # ManiSkill's trajectory pair and its crash-safe parts (`fastrecord.sinks.maniskill_h5`)
    RunFile(".h5", "maniskill_h5", "fastrecord.sinks.maniskill_h5.recover:h5_holds_episodes", marks_run=True),
    RunFile(".json", "maniskill_h5", "fastrecord.sinks.maniskill_h5.recover:json_holds_episodes",
            episodes="fastrecord.sinks.maniskill_h5.recover:json_episodes"),
    RunFile(".h5.parts", "maniskill_h5", "fastrecord.sinks.formats:folder_not_empty", folder=True, marks_run=True),
    # the shards of a sharded run (`fastrecord.shards`): other processes' runs, never removed by this one
    RunFile(".shards", "shards", "fastrecord.sinks.formats:folder_not_empty", folder=True, abandon=False),
    # the LeRobot v3.0 dataset and its committed parts (`fastrecord.sinks.lerobot`)
    RunFile(".lerobot", "lerobot", folder=True),
    RunFile(".lerobot.parts", "lerobot", folder=True),
    # the results rows, the run's commit log (`fastrecord.sinks.results`)
    RunFile(RESULTS_SUFFIX, "results"),
    # the run itself: its manifest and journal (`fastrecord.sinks.runfiles`)
    RunFile(MANIFEST_SUFFIX, "run", "fastrecord.sinks.formats:holds_nothing", marks_run=True, temporaries=True),
    RunFile(JOURNAL_SUFFIX, "run", hidden=True),
)

# files that are recordings wherever they are (a folder holding one holds recordings): each format's
# (`fastrecord.sinks.mp4` videos; a LeRobot dataset's rows, its videos being MP4 too)
RECORDING_SUFFIXES: dict[str, tuple[str, ...]] = {"mp4": (".mp4",), "lerobot": (".parquet", ".mp4")}


def _resolve(ref: str) -> Callable[..., object]:
    module, func = ref.split(":")
    return getattr(importlib.import_module(module), func)


def of_format(owner: str) -> list[RunFile]:
    """The files format ``owner`` declares."""
    return [f for f in RUN_FILES if f.owner == owner]


def paths(output_dir: Path, name: str, owner: str | None = None) -> list[Path]:
    """Where the declared files of run ``name`` (of format ``owner``, or all) are, in `RUN_FILES` order,
    whether they exist or not."""
    return [f.path(output_dir, name) for f in RUN_FILES if owner is None or f.owner == owner]


def present(output_dir: Path, name: str, owner: str) -> bool:
    """Whether any file of format ``owner`` of run ``name`` exists."""
    return any(p.exists() for p in paths(output_dir, name, owner))


def temporaries(output_dir: Path, name: str) -> list[Path]:
    """The temporary files of atomic writes a kill cut short (`RunFile.temporaries`), sorted."""
    out: list[Path] = []
    for f in RUN_FILES:
        if f.temporaries:
            out += sorted(Path(output_dir).glob(f".{glob_escape(name)}{f.suffix}.*.tmp"))
    return out


def run_files(output_dir: Path, name: str) -> list[Path]:
    """The files a run of ``name`` owns in ``output_dir`` that exist now: those its formats declare
    (`fastrecord.sinks.formats.RUN_FILES`, and a manifest's temporary file a kill left), those its manifest
    and journal list, and the videos its results rows name (a joined sharded run's: `fastrecord.shards.videos`)."""
    fixed = paths(output_dir, name) + temporaries(output_dir, name)
    owned = {**listed_files(output_dir, name), **owned_intent_files(output_dir, name)}
    folders = [p for p in fixed if p.is_dir()]
    named = [p for p in (output_dir / f for f in results_videos(output_dir, name))
             if not any(p.is_relative_to(d) for d in folders)]  # not one in NAME.shards/ (removed whole)
    listed = [output_dir / f for f in owned] + named
    root = output_dir.resolve()
    inside = [p for p in listed if p.resolve().is_relative_to(root) and p.resolve() != root]
    return [p for p in dict.fromkeys(fixed + inside) if p.exists()]


def declared(path: Path, output_dir: Path, name: str) -> RunFile | None:
    """The row declaring ``path`` as a file of run ``name`` (None: not a declared name)."""
    for f in RUN_FILES:
        if f.path(output_dir, name) == path:
            return f
    return None


def is_temporary(path: Path, name: str) -> bool:
    """Whether ``path`` is a temporary of an atomic write of a declared file (`RunFile.temporaries`)."""
    return any(f.temporaries and path.name.startswith(f".{name}{f.suffix}.") for f in RUN_FILES)


def file_holds_recordings(path: Path, output_dir: Path, name: str) -> bool:
    """Whether ``path``, a file of run ``name`` (declared, listed, or a temporary), holds recordings."""
    if is_temporary(path, name):
        return False
    row = declared(path, output_dir, name)
    holds: Holds = holds_recordings if row is None else _resolve(row.holds)  # type: ignore[assignment]
    return holds(path, output_dir, name)


def episodes_listed(output_dir: Path, name: str) -> int | None:
    """The episodes run ``name``'s files list (the first declared file that says, e.g. ``NAME.json``), or None."""
    for f in RUN_FILES:
        path = f.path(output_dir, name)
        if f.episodes is not None and path.exists():
            n = _resolve(f.episodes)(path)
            if isinstance(n, int):
                return n
    return None


def run_names(folder: Path) -> set[str]:
    """The names of the runs in ``folder``, found by a file that marks one (`RunFile.marks_run`)."""
    names: set[str] = set()
    for p in folder.iterdir():
        for f in RUN_FILES:
            kind = p.is_dir() if f.folder else p.is_file()
            if f.marks_run and not f.hidden and kind and p.name.endswith(f.suffix) and len(p.name) > len(f.suffix):
                names.add(p.name[: -len(f.suffix)])
    return names


# ---------------------------------------------------------------------------------------------- generic tests
def holds_nothing(path: Path, output_dir: Path, name: str) -> bool:
    """The manifest: it lists files, it holds no recording (its counters are read by the run directory)."""
    return False


def folder_not_empty(path: Path, output_dir: Path, name: str) -> bool:
    """A folder of parts or shards: anything in it is recorded."""
    return any(path.iterdir())


def holds_recordings(path: Path, output_dir: Path, name: str) -> bool:
    """A folder: holds a file of `RECORDING_SUFFIXES` anywhere; a file: is not empty."""
    if path.is_dir():
        suffixes = {s for group in RECORDING_SUFFIXES.values() for s in group}
        return any(p.suffix in suffixes for p in path.rglob("*"))
    return path.stat().st_size > 0
