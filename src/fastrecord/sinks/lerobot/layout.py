"""LeRobot v3.0's layout and fastrecord's mapping onto it: paths, columns, features, statistics.

A run named ``NAME`` with ``lerobot=True`` writes the dataset folder ``NAME.lerobot/`` (LeRobot's
``root``) and, while it records or after a crash, ``NAME.lerobot.parts/`` (one committed part per
finished episode, see `fastrecord.sinks.lerobot.writer`)::

    NAME.lerobot/meta/info.json                                  codebase_version v3.0, totals, fps, features
    NAME.lerobot/meta/stats.json                                 mean/std/min/max/count of every feature
    NAME.lerobot/meta/tasks.parquet                              the task (the env id) -> task_index 0
    NAME.lerobot/meta/episodes/chunk-CCC/file-FFF.parquet        a row per episode: length, indices, offsets, stats
    NAME.lerobot/data/chunk-CCC/file-FFF.parquet                 a row per step
    NAME.lerobot/videos/<key>/chunk-CCC/file-FFF.mp4             many episodes per file, one after the other

The mapping of ManiSkill's trajectory (`episode_columns`; ManiSkill's ``convert_to_lerobot`` maps the
first three the same way, the rest it does not write): ``actions`` -> ``action``, ``obs/agent/qpos``
(or a flat state observation) -> ``observation.state``, ``obs/sensor_data/<cam>/rgb`` ->
``observation.images.<cam>`` (video), ``rewards`` -> ``next.reward``, ``terminated | truncated`` ->
``next.done``, ``success`` -> ``next.success`` (LeRobot's names in its simulation datasets). An
episode of T steps is T rows: observation t with action t and its outcome (the last observation, after
the last action, is not a row).

Needs numpy only (pyarrow is imported by the writer).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fastrecord.sinks.base import atomic_write_bytes

CODEBASE_VERSION = "v3.0"
DEFAULT_CHUNK_SIZE = 1000  # files per chunk folder (LeRobot's DEFAULT_CHUNK_SIZE)
DEFAULT_DATA_FILE_SIZE_IN_MB = 100  # a data file is closed past this size (LeRobot's default)
DEFAULT_VIDEO_FILE_SIZE_IN_MB = 500  # a video file is closed past this size (LeRobot's default)
DATA_PATH = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
VIDEO_PATH = "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
EPISODES_PATH = "meta/episodes/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
TASKS_PATH = "meta/tasks.parquet"
INFO_PATH = "meta/info.json"
STATS_PATH = "meta/stats.json"
DATASET_SUFFIX = ".lerobot"  # NAME.lerobot/: the dataset
PARTS_SUFFIX = ".lerobot.parts"  # NAME.lerobot.parts/: finished episodes not yet in the dataset's files
IMAGE_PREFIX = "observation.images."
INDEX_COLUMNS = ("timestamp", "frame_index", "episode_index", "index", "task_index")
# LeRobot's DEFAULT_FEATURES: the bookkeeping columns of every dataset
INDEX_FEATURES = {
    "timestamp": {"dtype": "float32", "shape": [1], "names": None},
    "frame_index": {"dtype": "int64", "shape": [1], "names": None},
    "episode_index": {"dtype": "int64", "shape": [1], "names": None},
    "index": {"dtype": "int64", "shape": [1], "names": None},
    "task_index": {"dtype": "int64", "shape": [1], "names": None},
}
STAT_NAMES = ("min", "max", "mean", "std", "count")


def dataset_paths(output_dir: Path, name: str) -> tuple[Path, Path]:
    """(``NAME.lerobot``, ``NAME.lerobot.parts``) of run ``name`` in ``output_dir``."""
    return output_dir / f"{name}{DATASET_SUFFIX}", output_dir / f"{name}{PARTS_SUFFIX}"


def group_of(chunk_index: int, file_index: int, chunks_size: int) -> int:
    """The running number of file ``chunk-CCC/file-FFF`` (files fill a chunk, then the next)."""
    return chunk_index * chunks_size + file_index


def chunk_file(group: int, chunks_size: int) -> tuple[int, int]:
    """(chunk_index, file_index) of the ``group``-th file."""
    return divmod(group, chunks_size)


# ---------------------------------------------------------------------------------------------- columns
def _flat(a: np.ndarray, t: int) -> np.ndarray:
    return np.asarray(a[:t]).reshape(t, -1)


def episode_columns(datasets: Mapping[str, np.ndarray], length: int, fps: float) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The columns of one episode of ``length`` steps (``{feature: [T] or [T, D]}``, index columns with
    provisional episode values) and its camera frames (``{observation.images.<cam>: [T, H, W, 3] uint8}``),
    from the episode's trajectory arrays (`fastrecord.episode.EpisodeData.datasets`)."""
    t = int(length)
    cols: dict[str, np.ndarray] = {}
    if "obs/agent/qpos" in datasets:
        cols["observation.state"] = _flat(datasets["obs/agent/qpos"], t).astype(np.float32, copy=False)
    elif "obs" in datasets:  # a flat observation (obs_mode="state"): the whole vector
        cols["observation.state"] = _flat(datasets["obs"], t).astype(np.float32, copy=False)
    if "actions" in datasets:
        cols["action"] = _flat(datasets["actions"], t).astype(np.float32, copy=False)
    else:  # per-agent actions (multi-agent envs): concatenated in key order
        leaves = sorted(k for k in datasets if k.startswith("actions/"))
        if not leaves:
            raise ValueError("the episode has no actions to write as LeRobot's 'action' column (datasets: "
                             f"{sorted(datasets)[:8]}...)")
        cols["action"] = np.concatenate([_flat(datasets[k], t) for k in leaves], axis=1).astype(np.float32, copy=False)
    if "rewards" in datasets:
        cols["next.reward"] = np.asarray(datasets["rewards"][:t], dtype=np.float32).reshape(t)
    done = np.zeros(t, dtype=bool)
    for key in ("terminated", "truncated"):
        if key in datasets:
            done |= np.asarray(datasets[key][:t], dtype=bool).reshape(t)
    cols["next.done"] = done
    if "success" in datasets:
        cols["next.success"] = np.asarray(datasets["success"][:t], dtype=bool).reshape(t)
    cols["timestamp"] = (np.arange(t, dtype=np.float64) / fps).astype(np.float32)
    cols["frame_index"] = np.arange(t, dtype=np.int64)
    cols["episode_index"] = np.zeros(t, dtype=np.int64)  # set when the episode joins a file
    cols["index"] = np.arange(t, dtype=np.int64)  # ditto
    cols["task_index"] = np.zeros(t, dtype=np.int64)
    images = {}
    for key in sorted(datasets):
        parts = key.split("/")
        if len(parts) == 4 and parts[:2] == ["obs", "sensor_data"] and parts[3] == "rgb":
            a = datasets[key]
            if a.dtype == np.uint8 and a.ndim == 4 and a.shape[-1] == 3:
                images[IMAGE_PREFIX + parts[2]] = a[:t]
    return cols, images


def features_of(cols: Mapping[str, np.ndarray], images: Mapping[str, np.ndarray], fps: float, codec: str) -> dict[str, Any]:
    """info.json's ``features`` for an episode's columns and camera frames."""
    out: dict[str, Any] = {}
    names = {"action": "action_{}", "observation.state": "joint_{}"}
    for key, a in cols.items():
        if key in INDEX_FEATURES:
            continue
        dtype = "bool" if a.dtype == np.bool_ else str(a.dtype)
        width = a.shape[1] if a.ndim == 2 else 1
        fmt = names.get(key)
        out[key] = {"dtype": dtype, "shape": [width], "names": [fmt.format(i) for i in range(width)] if fmt else None}
    for key, frames in images.items():
        h, w = frames.shape[1] + frames.shape[1] % 2, frames.shape[2] + frames.shape[2] % 2  # yuv420p: even sides
        out[key] = {"dtype": "video", "shape": [h, w, 3], "names": ["height", "width", "channels"],
                    "info": {"video.fps": float(fps), "video.height": h, "video.width": w, "video.channels": 3,
                             "video.codec": "h264" if "264" in codec else codec, "video.pix_fmt": "yuv420p",
                             "video.is_depth_map": False, "has_audio": False}}
    out.update({k: dict(v) for k, v in INDEX_FEATURES.items()})
    for v in out.values():
        v["fps"] = float(fps)  # as ManiSkill's converter writes them
    return out


# ---------------------------------------------------------------------------------------------- statistics
def column_stats(a: np.ndarray) -> dict[str, list]:
    """min/max/mean/std/count of a column ``[T]`` or ``[T, D]`` over its rows (lists of length D, or 1)."""
    x = np.asarray(a, dtype=np.float64).reshape(len(a), -1)
    return {"min": x.min(0).tolist(), "max": x.max(0).tolist(), "mean": x.mean(0).tolist(), "std": x.std(0).tolist(),
            "count": [int(len(a))]}


def image_stats(frames: np.ndarray) -> dict[str, list]:
    """Per-channel min/max/mean/std of ``[T, H, W, 3]`` uint8 frames scaled to [0, 1], LeRobot's shape
    ``[3, 1, 1]``; count: the frames."""
    x = frames.reshape(-1, 3)
    n = x.shape[0]
    s = x.sum(0, dtype=np.float64)
    sq = np.einsum("ij,ij->j", x, x, dtype=np.float64) if n < 1 << 26 else (x.astype(np.float64) ** 2).sum(0)
    mean = s / n
    std = np.sqrt(np.maximum(sq / n - mean**2, 0.0))

    def shaped(v: np.ndarray) -> list:
        return [[[float(c)]] for c in v]

    return {"min": shaped(x.min(0) / 255.0), "max": shaped(x.max(0) / 255.0), "mean": shaped(mean / 255.0),
            "std": shaped(std / 255.0), "count": [int(frames.shape[0])]}


def episode_stats(cols: Mapping[str, np.ndarray], images: Mapping[str, np.ndarray]) -> dict[str, dict[str, list]]:
    return {**{k: column_stats(v) for k, v in cols.items()}, **{k: image_stats(v) for k, v in images.items()}}


def aggregate_stats(per_episode: Sequence[Mapping[str, Mapping[str, Any]]]) -> dict[str, dict[str, Any]]:
    """The dataset's statistics from its episodes': counts add up, means are weighted, variances combine
    (within plus between episodes), min and max are element-wise."""
    out: dict[str, dict[str, Any]] = {}
    keys = dict.fromkeys(k for s in per_episode for k in s)
    for key in keys:
        items = [s[key] for s in per_episode if key in s]
        n = np.array([float(np.ravel(i["count"])[0]) for i in items])
        means = np.stack([np.asarray(i["mean"], dtype=np.float64) for i in items])
        stds = np.stack([np.asarray(i["std"], dtype=np.float64) for i in items])
        w = (n / n.sum()).reshape(-1, *([1] * (means.ndim - 1)))
        mean = (w * means).sum(0)
        var = (w * (stds**2 + (means - mean) ** 2)).sum(0)
        out[key] = {"min": np.min(np.stack([np.asarray(i["min"], dtype=np.float64) for i in items]), 0).tolist(),
                    "max": np.max(np.stack([np.asarray(i["max"], dtype=np.float64) for i in items]), 0).tolist(),
                    "mean": mean.tolist(), "std": np.sqrt(var).tolist(), "count": [int(n.sum())]}
    return out


def flat_stats(stats: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """``{feature: {stat: v}}`` -> ``{"stats/<feature>/<stat>": v}`` (meta/episodes' columns)."""
    return {f"stats/{k}/{s}": v for k, d in stats.items() for s, v in d.items()}


def unflat_stats(row: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for col, v in row.items():
        if col.startswith("stats/") and v is not None:
            feature, stat = col[len("stats/"):].rsplit("/", 1)
            out.setdefault(feature, {})[stat] = v
    return out


# ---------------------------------------------------------------------------------------------- meta
def info_json(*, features: Mapping[str, Any], fps: float, robot_type: str, episodes: int, frames: int, files: int,
              chunks_size: int, data_mb: float, video_mb: float) -> dict[str, Any]:
    """meta/info.json: LeRobot's keys (``create_empty_dataset_info``) and the two ManiSkill's converter adds
    (``total_chunks``, ``total_videos``)."""
    cameras = [k for k, v in features.items() if v.get("dtype") == "video"]
    return {
        "codebase_version": CODEBASE_VERSION, "robot_type": robot_type, "total_episodes": episodes,
        "total_frames": frames, "total_tasks": 1, "total_videos": episodes * len(cameras),
        "total_chunks": (files + chunks_size - 1) // chunks_size if files else 0, "chunks_size": chunks_size,
        "data_files_size_in_mb": data_mb, "video_files_size_in_mb": video_mb,
        "fps": int(fps) if float(fps).is_integer() else float(fps), "splits": {"train": f"0:{episodes}"},
        "data_path": DATA_PATH, "video_path": VIDEO_PATH if cameras else None, "features": dict(features),
    }


def write_file(path: Path, data: bytes) -> None:
    """A dataset file: its folder made, then written atomically (`fastrecord.sinks.base.atomic_write_bytes`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, data)


def write_json(path: Path, data: Any) -> None:
    write_file(path, json.dumps(data, indent=4).encode())
