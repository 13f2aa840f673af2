"""Joining episodes of several LeRobot datasets written by fastrecord into one: the LeRobot side of
`fastrecord.shards.merge` (which picks, from the shards, which episode goes where).

`join_datasets` cuts each picked episode out of its dataset as a part, as `LeRobotWriter` commits
them while recording: its rows (``episode_index``/``index`` renumbered later), its statistics and one
MP4 per camera, cut from the dataset's video file without re-encoding (`video.split_mp4`). A
`LeRobotWriter` then takes those parts up (``resume``) and writes them, in the given order, as the
joined dataset's files: episodes 0..N-1, rows indexed 0..total-1, videos joined without re-encoding,
per-episode from/to timestamps and dataset indices, stats.json aggregated from the episodes'
statistics (counts summed, means weighted, variances combined, min/max element-wise), tasks and
info.json. All of it is built in ``.NAME.lerobot.join/`` next to the target and swapped in with
renames (the old dataset goes to ``.NAME.lerobot.old/`` meanwhile); a join killed at any point leaves
either the old dataset or the new one, and the next join cleans up.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fastrecord.sinks.lerobot.layout import DATA_PATH, INFO_PATH, VIDEO_PATH
from fastrecord.sinks.lerobot.stats import unflat_stats
from fastrecord.sinks.lerobot.writer import FILE_META, PART_META, LeRobotWriter, import_pyarrow


def episode_entries(root: Path) -> list[tuple[int, dict[str, Any], dict[str, Any]]]:
    """``(episode_index, entry, row)`` of every episode in the files of dataset ``root`` (a
    ``NAME.lerobot`` folder written by fastrecord): ``entry`` is what the recorder kept with it
    (``global_index``, ``source_rank`` in a sharded run), ``row`` its meta/episodes row plus the
    dataset's settings under ``"_dataset"``. Empty when ``root`` has no files yet."""
    import_pyarrow()
    import pyarrow.parquet as pq

    out = []
    for path in sorted((Path(root) / "meta" / "episodes").glob("chunk-*/file-*.parquet")):
        table = pq.read_table(path)
        raw = (table.schema.metadata or {}).get(FILE_META)
        if raw is None:
            raise ValueError(f"{path} has no fastrecord metadata ({FILE_META.decode()}): {root} was not written by "
                             f"fastrecord's LeRobot sink, so its episodes cannot be joined; move it out of the run")
        meta = json.loads(raw)
        rows = table.to_pylist()
        entries = meta.get("entries") or [{} for _ in rows]
        for row, entry in zip(rows, entries, strict=True):
            out.append((int(row["episode_index"]), dict(entry), {**row, "_dataset": meta["dataset"]}))
    return out


def _comparable(settings: Mapping[str, Any]) -> str:
    return json.dumps({k: settings.get(k) for k in ("fps", "features")}, sort_keys=True)


def join_datasets(target: Path, sources: Sequence[tuple[Path, int, Mapping[str, Any]]]) -> int:
    """Write the LeRobot dataset ``target`` holding, in this order, episode ``episode_index`` of dataset
    ``root`` for each ``(root, episode_index, entry)`` of ``sources`` (``entry``: kept with the episode,
    as `LeRobotWriter.write_episode` keeps it); returns the episodes written. The sources are read,
    never changed; they must agree on fps and features (else ValueError naming both). Refuses
    (ValueError) to replace a ``target`` holding episodes (by ``global_index``) that ``sources`` does
    not: nothing recorded is dropped. No sources: ``target`` is left as it is, 0."""
    target = Path(target)
    work, old = target.with_name(f".{target.name}.join"), target.with_name(f".{target.name}.old")
    if old.exists():  # a join killed between its two renames
        if target.exists():
            shutil.rmtree(old)
        else:
            old.rename(target)
    shutil.rmtree(work, ignore_errors=True)
    if not sources:
        return 0
    if target.exists():
        _check_kept(target, sources)
    staged, parts = work / target.name, work / "parts"
    parts.mkdir(parents=True)
    found, picks = _pick(sources)
    for root, chosen in picks.items():
        _cut_parts(root, found[root], chosen, parts)
    info = json.loads((next(iter(picks)) / INFO_PATH).read_text())
    writer = LeRobotWriter(staged, parts, resume=True, chunks_size=info["chunks_size"],
                           data_files_size_in_mb=info["data_files_size_in_mb"],
                           video_files_size_in_mb=info["video_files_size_in_mb"])
    writer.close()
    if writer.episodes != len(sources):
        raise ValueError(f"joining into {target}: {writer.episodes} of {len(sources)} episodes were written; the parts "
                         f"are in {work}")
    if target.exists():
        target.rename(old)
    staged.rename(target)
    shutil.rmtree(old, ignore_errors=True)
    shutil.rmtree(work, ignore_errors=True)
    return writer.episodes


Pick = tuple[int, int, dict[str, Any]]  # (place in the joined dataset, episode_index in its source, entry)


def _pick(sources: Sequence[tuple[Path, int, Mapping[str, Any]]]
          ) -> tuple[dict[Path, dict[int, dict[str, Any]]], dict[Path, list[Pick]]]:
    """The rows of every source dataset ({root: {episode_index: row}}) and the picks from each ({root: [Pick]}),
    checked: one schema (fps, features) and every picked episode in its dataset's files (else ValueError)."""
    found: dict[Path, dict[int, dict[str, Any]]] = {}
    picks: dict[Path, list[Pick]] = {}
    first: tuple[Path, dict[str, Any]] | None = None
    for seq, (root, ep, entry) in enumerate(sources):
        root = Path(root)
        if root not in found:
            found[root] = {i: row for i, _, row in episode_entries(root)}
            json.loads((root / INFO_PATH).read_text())  # a source without a readable info.json is refused here
            for row in found[root].values():
                if first is None:
                    first = (root, row["_dataset"])
                elif _comparable(row["_dataset"]) != _comparable(first[1]):
                    raise ValueError(
                        f"{root} and {first[0]} hold episodes of other fps or features; one LeRobot dataset "
                        f"holds one schema: move the foreign dataset out of the run and merge again"
                    )
                break
        if ep not in found[root]:
            raise ValueError(f"{root} holds no episode {ep} in its files")
        picks.setdefault(root, []).append((seq, ep, dict(entry)))
    return found, picks


def _cut_parts(root: Path, rows: dict[int, dict[str, Any]], chosen: list[Pick], parts: Path) -> None:
    """Cut the ``chosen`` episodes of dataset ``root`` out as parts in ``parts`` (as `LeRobotWriter` commits
    them): each camera's MP4 first, cut without re-encoding, then the rows with the part's metadata."""
    import pyarrow.parquet as pq

    from fastrecord.sinks.lerobot.video import split_mp4

    settings = next(iter(rows.values()))["_dataset"]
    cameras = [k for k, v in settings["features"].items() if v.get("dtype") == "video"]
    for key in cameras:  # the videos first: a part is committed by its parquet
        by_video: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for seq, ep, _ in chosen:
            row = rows[ep]
            by_video.setdefault((row[f"videos/{key}/chunk_index"], row[f"videos/{key}/file_index"]), []).append(
                (seq, ep)
            )
        for (c, f), group in by_video.items():
            spans = [(rows[ep][f"videos/{key}/from_timestamp"], rows[ep][f"videos/{key}/to_timestamp"])
                     for _, ep in group]
            split_mp4(root / VIDEO_PATH.format(video_key=key, chunk_index=c, file_index=f), spans,
                      [parts / f"ep_{seq:08d}.{key}.mp4" for seq, _ in group])
    by_data: dict[tuple[int, int], list[Pick]] = {}
    for pick in chosen:
        row = rows[pick[1]]
        by_data.setdefault((row["data/chunk_index"], row["data/file_index"]), []).append(pick)
    for (c, f), picks in by_data.items():
        table = pq.read_table(root / DATA_PATH.format(chunk_index=c, file_index=f)).replace_schema_metadata(None)
        episode = table["episode_index"].to_numpy()
        for seq, ep, entry in picks:
            rows_of = table.filter(episode == ep)
            row = rows[ep]
            if rows_of.num_rows != row["length"]:
                raise ValueError(f"{root}: episode {ep} has {rows_of.num_rows} rows in its data file but length "
                                 f"{row['length']} in meta/episodes; the dataset is damaged")
            meta = dict(seq=seq, length=int(row["length"]), stats=unflat_stats(row), entry=entry, dataset=settings,
                        videos={k: f"ep_{seq:08d}.{k}.mp4" for k in cameras})
            pq.write_table(rows_of.replace_schema_metadata({PART_META: json.dumps(meta)}),
                           parts / f"ep_{seq:08d}.parquet")


def _check_kept(target: Path, sources: Sequence[tuple[Path, int, Mapping[str, Any]]]) -> None:
    """ValueError if ``target`` (a joined dataset) holds global episodes that ``sources`` do not."""
    if not (target / INFO_PATH).is_file():
        raise ValueError(f"{target} exists and is not a LeRobot dataset (no {INFO_PATH}); move it away and merge again")
    have = {e.get("global_index") for _, e, _ in episode_entries(target)}
    keep = {dict(e).get("global_index") for _, _, e in sources}
    lost = sorted(g for g in have - keep if g is not None)
    if None in have or lost:
        shown = ", ".join(map(str, lost[:10])) + (f", ... ({len(lost) - 10} more)" if len(lost) > 10 else "")
        raise ValueError(
            f"{target} holds episodes {shown or '(without global_index)'} that the datasets being joined no "
            f"longer have; joining would drop them. Move {target.name} away first"
        )


class LeRobotJoin:
    """The LeRobot dataset's part of joining a sharded run (`fastrecord.shards.merge`, which drives it): notes
    the shards that recorded a dataset (``read_shard``: its folder or its parts folder exists) and joins their
    datasets into ``DIR/NAME.lerobot`` (``write``): each global episode once (the lowest rank's), ordered by
    global index, renumbered 0..N-1 (`join_datasets`). Read only after the shards passed the damage check."""

    def __init__(self, run_dir: Path, name: str) -> None:
        from fastrecord.shards.layout import shards_root

        self.run_dir, self.name = run_dir, name
        self.root = shards_root(run_dir, name)
        self.roots: dict[int, Path] = {}  # rank -> its NAME.lerobot
        self.duplicates: list[int] = []

    @property
    def found(self) -> bool:
        return bool(self.roots)

    def read_shard(self, rank: int, folder: Path, limit: int | None) -> None:
        from fastrecord.sinks.lerobot.layout import dataset_paths

        if any(p.is_dir() for p in dataset_paths(folder, self.name)):
            self.roots[rank] = dataset_paths(folder, self.name)[0]

    def write(self, report: Any,
              joined: dict[int, tuple[int, dict[str, Any]]]) -> dict[int, tuple[int, dict[str, Any]]]:
        """Join the datasets (a `fastrecord.shards.MergeReport` says what: ``lerobot_path``,
        ``lerobot_episodes``, ``lerobot_missing``: the episodes of ``joined`` (the trajectory's) it lacks);
        returns {g: (rank, {})}."""
        from fastrecord.shards.layout import global_index_of
        from fastrecord.sinks.lerobot.layout import DATASET_SUFFIX

        if not self.roots:
            return {}
        chosen: dict[int, tuple[Path, int, dict[str, Any]]] = {}
        for rank, root in self.roots.items():
            shard = root.parent
            for ep, entry, _ in episode_entries(root) if root.is_dir() else ():
                if "global_index" not in entry:
                    raise ValueError(
                        f"{root} has episode {ep} without a global_index (written by an older fastrecord, or "
                        f"not by a sharded run); it cannot be placed in the joined dataset. Move {shard} "
                        f"out of {self.root}"
                    )
                g = global_index_of(entry, root, f", or move {shard} out of {self.root}")
                if g in chosen:
                    self.duplicates.append(g)
                    continue
                chosen[g] = (root, ep, {"global_index": g, "source_rank": rank})
        target = self.run_dir / f"{self.name}{DATASET_SUFFIX}"
        report.lerobot_episodes = join_datasets(target, [chosen[g] for g in sorted(chosen)])
        report.lerobot_path = target if target.is_dir() else None
        report.lerobot_missing = sorted(set(joined) - set(chosen))
        return {g: (entry["source_rank"], {}) for g, (_, _, entry) in chosen.items()}
