"""LeRobot v3.0's layout and fastrecord's mapping onto it: paths, columns, features, meta/info.json.

A run named ``NAME`` with ``lerobot=True`` writes the dataset folder ``NAME.lerobot/`` (LeRobot's
``root``) and, while it records or after a crash, ``NAME.lerobot.parts/`` (one committed part per
finished episode, see `fastrecord.sinks.lerobot.writer`)::

    NAME.lerobot/meta/info.json                                  codebase_version v3.0, totals, fps, features
    NAME.lerobot/meta/stats.json                                 min/max/mean/std/count/q01..q99 of every feature
    NAME.lerobot/meta/tasks.parquet                              the task (the env id) -> task_index 0
    NAME.lerobot/meta/episodes/chunk-CCC/file-FFF.parquet        a row per episode: length, indices, offsets, stats
    NAME.lerobot/data/chunk-CCC/file-FFF.parquet                 a row per step
    NAME.lerobot/videos/<key>/chunk-CCC/file-FFF.mp4             many episodes per file, one after the other

The mapping of ManiSkill's trajectory (`episode_columns`): ``actions`` -> ``action``, every non-image
observation leaf side by side (or the flat state observation; `state_leaves`, `state_names`) ->
``observation.state``, ``obs/sensor_data/<cam>/rgb`` -> ``observation.images.<cam>`` (video),
``rewards`` -> ``next.reward``, ``terminated | truncated`` -> ``next.done``, ``success`` ->
``next.success`` (LeRobot's names in its simulation datasets). An episode of T steps is T rows:
observation t with action t and its outcome (the last observation, after the last action, is not a row).
The statistics are `fastrecord.sinks.lerobot.stats`'.

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
DEFAULT_VIDEO_FILE_SIZE_IN_MB = 200  # a video file is closed past this size (LeRobot 0.4's default)
DATA_PATH = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
VIDEO_PATH = "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
EPISODES_PATH = "meta/episodes/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
TASKS_PATH = "meta/tasks.parquet"
INFO_PATH = "meta/info.json"
STATS_PATH = "meta/stats.json"
DATASET_SUFFIX = ".lerobot"  # NAME.lerobot/: the dataset
PARTS_SUFFIX = ".lerobot.parts"  # NAME.lerobot.parts/: finished episodes not yet in the dataset's files
IMAGE_PREFIX = "observation.images."
# the codec's canonical name in a video feature's info (what LeRobot's get_video_info reads from the file)
CODEC_NAMES = {"libx264": "h264", "h264_nvenc": "h264", "libsvtav1": "av1", "libaom-av1": "av1", "libx265": "hevc"}
INDEX_COLUMNS = ("timestamp", "frame_index", "episode_index", "index", "task_index")
# LeRobot's DEFAULT_FEATURES: the bookkeeping columns of every dataset
INDEX_FEATURES = {
    "timestamp": {"dtype": "float32", "shape": [1], "names": None},
    "frame_index": {"dtype": "int64", "shape": [1], "names": None},
    "episode_index": {"dtype": "int64", "shape": [1], "names": None},
    "index": {"dtype": "int64", "shape": [1], "names": None},
    "task_index": {"dtype": "int64", "shape": [1], "names": None},
}
IMAGE_GROUPS = ("sensor_data", "sensor_param")  # observation groups outside observation.state (cameras, their poses)


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


def state_leaves(datasets: Mapping[str, Any], keys: Sequence[str] | None = None,
                 layout: Sequence[tuple[str, int]] | None = None) -> list[str]:
    """The trajectory leaves that make ``observation.state``, in order: with ``keys`` None, every
    observation leaf but the cameras' (``obs/sensor_data/...``, ``obs/sensor_param/...``) in the env's
    order (``layout``: ManiSkill's state dictionary, ``agent`` then ``extra``, each leaf as the env returns
    it: the order of ManiSkill's flattened state observation; leaves it lacks after them, sorted), or
    the whole flat observation ``obs`` (obs_mode="state"); else the leaves under each of ``keys``
    (``"agent/qpos"``, ``"extra"``, dots or slashes), in the order of ``keys``. ValueError for a key
    that names no leaf."""
    if keys is None:
        if "obs" in datasets:
            return ["obs"]
        rank = {f"obs/{path}": i for i, (path, _) in enumerate(layout or ())}
        found = [k for k in datasets if k.startswith("obs/") and k.split("/")[1] not in IMAGE_GROUPS]
        return sorted(found, key=lambda k: (rank.get(k, len(rank)), k))
    out: list[str] = []
    for key in keys:
        prefix = "obs/" + key.strip("/").replace(".", "/")
        found = [k for k in datasets if (k == prefix or k.startswith(prefix + "/")) and k not in out]
        if not found:
            have = sorted({"/".join(k.split("/")[1:3]) for k in datasets if k.startswith("obs/")})
            if not have:
                raise ValueError(f"lerobot_state_keys: {key!r} names no observation leaf: the observation is one "
                                 f"array (obs_mode='state'); pass lerobot_state_keys=None, which makes it the state")
            raise ValueError(f"lerobot_state_keys: {key!r} names no observation leaf; use some of "
                             f"{have} (or None: every leaf but the cameras')")
        out += found
    return out


def _dimension_names(path: str, width: int) -> list[str]:
    """``agent.qpos.0``, ... of a leaf ``agent/qpos``; a scalar leaf (width 0) is named as it is."""
    base = path.replace("/", ".")
    return [base] if width == 0 else [f"{base}.{i}" for i in range(width)]


def state_names(leaves: Sequence[str], datasets: Mapping[str, np.ndarray],
                layout: Sequence[tuple[str, int]] | None = None) -> list[str]:
    """A name per dimension of ``observation.state``: ``agent.qpos.0`` (the leaf's path after ``obs/``, dots
    for slashes, then the index in its flattened row; a scalar leaf, ``extra.is_grasped``, has no index);
    the flat observation of obs_mode="state" is named by the env's state ``layout`` where its widths add
    up to the observation's (ManiSkill flattens that dictionary into it), else ``state.0``, ``state.1``, ..."""
    out: list[str] = []
    for leaf in leaves:
        a = datasets[leaf]
        width = int(np.prod(a.shape[1:], dtype=np.int64))
        if leaf == "obs":
            named = [n for path, w in (layout or ()) for n in _dimension_names(path, w)]
            out += named if len(named) == width else [f"state.{i}" for i in range(width)]
            continue
        out += _dimension_names(leaf[len("obs/"):], 0 if a.ndim == 1 else width)
    return out


def episode_columns(datasets: Mapping[str, np.ndarray], length: int, fps: float,
                    state_keys: Sequence[str] | None = None, layout: Sequence[tuple[str, int]] | None = None,
                    ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The columns of one episode of ``length`` steps (``{feature: [T] or [T, D]}``, index columns with
    provisional episode values) and its camera frames (``{observation.images.<cam>: [T, H, W, 3] uint8}``),
    from the episode's trajectory arrays (`fastrecord.episode.EpisodeData.datasets`); ``observation.state``
    holds the leaves of `state_leaves` (``state_keys``, ``layout``) side by side, as float32."""
    t = int(length)
    cols: dict[str, np.ndarray] = {}
    leaves = state_leaves(datasets, state_keys, layout)
    if leaves:
        cols["observation.state"] = np.concatenate([_flat(datasets[k], t).astype(np.float32) for k in leaves], axis=1)
    if "actions" in datasets:
        cols["action"] = _flat(datasets["actions"], t).astype(np.float32, copy=False)
    else:  # per-agent actions (multi-agent envs): concatenated in key order
        actions = sorted(k for k in datasets if k.startswith("actions/"))
        if not actions:
            raise ValueError("the episode has no actions to write as LeRobot's 'action' column (datasets: "
                             f"{sorted(datasets)[:8]}...)")
        cols["action"] = np.concatenate([_flat(datasets[k], t) for k in actions], axis=1).astype(np.float32, copy=False)
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


def features_of(cols: Mapping[str, np.ndarray], images: Mapping[str, np.ndarray], fps: float, codec: str,
                state: Sequence[str] | None = None) -> dict[str, Any]:
    """info.json's ``features`` for an episode's columns and camera frames, as LeRobot's
    ``LeRobotDataset.create`` and ``get_video_info`` write them (dtype, shape, names; a video's ``info``).
    ``state``: the names of ``observation.state``'s dimensions (`state_names`)."""
    out: dict[str, Any] = {}
    for key, a in cols.items():
        if key in INDEX_FEATURES:
            continue
        dtype = "bool" if a.dtype == np.bool_ else str(a.dtype)
        width = a.shape[1] if a.ndim == 2 else 1
        names = None
        if key == "action":
            names = [f"action_{i}" for i in range(width)]
        elif key == "observation.state":
            names = list(state) if state is not None and len(state) == width else [f"state.{i}" for i in range(width)]
        out[key] = {"dtype": dtype, "shape": [width], "names": names}
    for key, frames in images.items():
        h, w = frames.shape[1] + frames.shape[1] % 2, frames.shape[2] + frames.shape[2] % 2  # yuv420p: even sides
        out[key] = {"dtype": "video", "shape": [h, w, 3], "names": ["height", "width", "channels"],
                    "info": {"video.height": h, "video.width": w, "video.codec": CODEC_NAMES.get(codec, codec),
                             "video.pix_fmt": "yuv420p", "video.is_depth_map": False,
                             "video.fps": int(fps) if float(fps).is_integer() else float(fps), "video.channels": 3,
                             "has_audio": False}}
    out.update({k: dict(v) for k, v in INDEX_FEATURES.items()})
    return out


# ---------------------------------------------------------------------------------------------- meta
def info_json(*, features: Mapping[str, Any], fps: float, robot_type: str, episodes: int, frames: int,
              chunks_size: int, data_mb: float, video_mb: float) -> dict[str, Any]:
    """meta/info.json: LeRobot's keys, in its order (``create_empty_dataset_info`` and the totals its
    ``save_episode`` keeps)."""
    cameras = [k for k, v in features.items() if v.get("dtype") == "video"]
    return {
        "codebase_version": CODEBASE_VERSION, "robot_type": robot_type, "total_episodes": episodes,
        "total_frames": frames, "total_tasks": 1, "chunks_size": chunks_size,
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
