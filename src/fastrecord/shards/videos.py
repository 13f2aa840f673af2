"""The videos of a joined run: `merge` puts each joined episode's videos next to ``DIR/NAME.h5``, where a
run in one process (and ManiSkill's ``RecordEpisode``) writes them, named by the global episode.

A shard names its per-env videos by its own episode ids (``{e}_env{i}_success.mp4`` in
``DIR/NAME.shards/rankNNNNN/``; `fastrecord.sinks.video_names`). The join gives each joined episode ``g``'s
videos the name a run in one process gives episode ``g``: ``DIR/{g}_env{i}[_success|_failure][_part{k}].mp4``
(``i``: the env slot that played it in its shard). Each is a hard link of the shard's file: no second copy on
disk, and the shard keeps its own, so merging again, resuming and ``fastrecord merge --links`` work as before.
Where the file system has no hard links, the video is copied (`JoinedVideos.copied` counts those).

Nothing is replaced: a name already taken by another file gets ``_1``, ``_2``, ... (as the encoder does),
except a file this join placed before (the same file, or, for a copy, the same bytes under a name the run's
joined results rows give), which is kept. The joined ``NAME.results.jsonl`` names each episode's first
video, so the run owns them (`fastrecord.sinks.runfiles.results_videos`): ``--if-exists overwrite`` removes
them with the run. Tiled videos (``video_layout="tiled"``, several episodes a file) stay in their shard.
"""

from __future__ import annotations

import contextlib
import filecmp
import itertools
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from fastrecord.sinks.runfiles import listed_files, results_videos
from fastrecord.sinks.video_names import parse_video_name, video_name

_TMP = ".join.tmp"  # DIR/.{name}.join.tmp: a copy being made (no hard links); a kill leaves it, the next join ends it


@dataclass
class JoinedVideos:
    """Where `join_videos` put the videos: ``names`` maps (rank, the video's name in its shard folder) to its
    name in DIR; ``paths`` lists them in DIR, by global episode; ``copied``: how many are copies."""

    names: dict[tuple[int, str], str] = field(default_factory=dict)
    paths: list[Path] = field(default_factory=list)
    pieces: dict[int, list[str]] = field(default_factory=dict)  # g -> its videos' names in DIR, in piece order
    copied: int = 0


def join_videos(run_dir: Path, name: str, shards: dict[int, Path], chosen: dict[int, tuple[int, int]]) -> JoinedVideos:
    """Link the videos of every joined episode (``chosen``: ``{g: (rank, its episode id in that shard)}``) from
    its shard folder into ``run_dir``, named by ``g``. The shard's videos of an episode are the per-env videos
    its manifest and journal list with that one episode."""
    run_dir = Path(run_dir)
    for tmp in run_dir.glob(f".*.mp4{_TMP}"):  # a copy a kill cut short (under the merge's lock: nobody else's)
        tmp.unlink(missing_ok=True)
    of_shard = {(rank, eid): g for g, (rank, eid) in chosen.items()}
    todo: list[tuple[int, int, int, str, Path, str]] = []  # (g, part, rank, name in the shard, file, name in DIR)
    for rank, folder in shards.items():
        for rel, episodes in listed_files(folder, name).items():
            parsed = parse_video_name(Path(rel).name)
            if parsed is None or not parsed.per_env or len(episodes) != 1 or Path(rel).name != rel:
                continue
            g = of_shard.get((rank, episodes[0]))
            if g is None or not (folder / rel).is_file():
                continue
            assert parsed.env_idx is not None  # per_env
            want = video_name(g, parsed.env_idx, parsed.success, parsed.part)
            todo.append((g, parsed.part or 0, rank, rel, folder / rel, want))
    ours = set(results_videos(run_dir, name))  # the names an earlier join gave (its results rows)
    joined = JoinedVideos()
    for g, _, rank, rel, src, want in sorted(todo, key=lambda t: t[:4]):
        placed, copied = _place(src, run_dir, want, ours)
        joined.names[(rank, rel)] = placed
        joined.pieces.setdefault(g, []).append(placed)
        joined.paths.append(run_dir / placed)
        joined.copied += copied
    return joined


def _place(src: Path, run_dir: Path, want: str, ours: set[str]) -> tuple[str, bool]:
    """Put ``src`` into ``run_dir`` as ``want`` (or ``want`` with ``_k`` where that name is another file's);
    returns (the name, whether it is a copy)."""
    stem = want[: -len(".mp4")]
    for k in itertools.count():
        placed = want if k == 0 else f"{stem}_{k}.mp4"
        dst = run_dir / placed
        if dst.exists() or dst.is_symlink():
            if _same(dst, src, placed in ours):
                return placed, not os.path.samefile(dst, src)
            continue
        try:
            os.link(src, dst)
            return placed, False
        except FileExistsError:
            continue
        except OSError:  # no hard links on this file system (or the shards on another one): a copy
            if _copy(src, dst):
                return placed, True
    raise AssertionError("unreachable")


def _same(dst: Path, src: Path, ours: bool) -> bool:
    """``dst`` is ``src`` (a link), or a copy of it an earlier join made (``ours``: the run's results name it)."""
    try:
        return os.path.samefile(dst, src) or (ours and dst.is_file() and filecmp.cmp(dst, src, shallow=False))
    except OSError:
        return False


def _copy(src: Path, dst: Path) -> bool:
    """Copy ``src`` to ``dst`` whole (a temporary file, then the name), never over another file: False when
    ``dst`` was taken meanwhile."""
    tmp = dst.with_name(f".{dst.name}{_TMP}")
    try:
        shutil.copyfile(src, tmp)  # a full disk stops it part way: the finally removes the piece
        if dst.exists():
            return False
        os.replace(tmp, dst)  # under the merge's lock; the encoders of other runs create their names exclusively
        return True
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
