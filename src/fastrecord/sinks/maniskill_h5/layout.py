"""The names and choices of fastrecord's ManiSkill trajectory files: what lies where on disk.

A run named ``NAME`` is ``NAME.h5`` + ``NAME.json`` (ManiSkill's pair) and, while it records or after a
crash, ``NAME.h5.parts/part_KKKKKK.h5`` (`part_name`, matched by `PART_PATTERN`), each part carrying its
episodes' JSON entries (root attribute `EPISODES_ATTR`) and the JSON header (`HEADER_ATTR`). Image leaves
(`IMAGE_KEYS`) are compressed (`COMPRESSIONS`) in chunks of frames x bands of rows (`image_chunks`).

Writer processes import this module: it needs numpy only.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from fastrecord.prestart import H5_WRITER_MODULE

# image leaves, stored compressed (ManiSkill compresses rgb/depth/seg with gzip level 5)
IMAGE_KEYS = ("rgb", "depth", "seg", "segmentation", "position", "normal", "albedo")
COMPRESSIONS = tuple(f"gzip:{k}" for k in range(1, 10)) + ("lzf", "none")  # trajectory_compression values
DEFAULT_COMPRESSION = "gzip:1"  # measured on PickCube-v1 rgb frames: docs/format.md "Image observations on disk"
BAND_BYTES = 2048  # bytes of one frame in an image chunk: a chunk is many frames of a few rows (see image_chunks)
CHUNK_FRAMES = 64  # frames in an image chunk, at most
EPISODES_ATTR = "fastrecord_episodes"  # part file root attribute: JSON list of its episodes' entries
HEADER_ATTR = "fastrecord_header"  # part file root attribute: JSON of the header (env_info, commit_info, ...)
PART_PATTERN = re.compile(r"^part_(\d+)\.h5$")  # a complete part file in NAME.h5.parts/
# in NAME.h5.parts/ while recording: the self-contained copy the close swaps in (`process.extend_copy`); a *.tmp,
# which recovery removes
GROWING_NAME = "consolidating.h5.tmp"
PARTS_SUFFIX = ".parts"  # NAME.h5.parts/ holds the part files of NAME.h5
# the module writer processes import (`fastrecord.processes.IsolatedProcess`): every function they run is there
# (named in `fastrecord.prestart`, which starts one before the fastrecord.sinks package is imported)
WRITER_PROCESS_MODULE = H5_WRITER_MODULE
LOW_DISK = 64 << 20  # bytes free below which a dead writer is blamed on the disk as well


def sibling_paths(h5_path: Path) -> tuple[Path, Path]:
    """``NAME.h5`` -> (``NAME.json``, ``NAME.h5.parts``)."""
    return h5_path.with_suffix(".json"), h5_path.with_name(h5_path.name + PARTS_SUFFIX)


def part_name(k: int) -> str:
    """The file name of part ``k``: ``part_000007.h5``."""
    return f"part_{k:06d}.h5"


def complete_parts(parts_dir: Path) -> list[tuple[int, Path]]:
    """(part number, path) of every complete part file in ``parts_dir``, in part order."""
    if not parts_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in parts_dir.iterdir() if (m := PART_PATTERN.match(p.name))]
    return sorted(found)


def parse_compression(spec: Any) -> tuple[str | None, int | None]:
    """``"gzip:1"`` -> ("gzip", 1), ``"lzf"`` -> ("lzf", None), ``"none"`` -> (None, None); anything else is a
    ValueError naming the choices. All are HDF5 filters that h5py ships, so ManiSkill's readers open them
    (``lzf`` only through h5py, not other HDF5 tools)."""
    if spec not in COMPRESSIONS:
        raise ValueError(
            f"trajectory_compression={spec!r} is unknown; use 'gzip:1' (the default: fastest gzip, files about 15% "
            f"larger than level 5), 'gzip:2' ... 'gzip:9' (smaller, slower; ManiSkill writes 'gzip:5'), 'lzf' "
            f"(as fast as gzip:1, larger files, read by h5py only) or 'none'")
    if spec == "none":
        return None, None
    if spec == "lzf":
        return "lzf", None
    return "gzip", int(spec.split(":")[1])


def has_image_leaves(space: Any) -> bool:
    """Whether an observation space (a gymnasium ``Dict``, nested or not) holds an image leaf, a leaf
    named in `IMAGE_KEYS` (``sensor_data/<camera>/rgb``, ``depth``, ``segmentation``...). A space that is
    not a ``Dict`` (a flat state vector, or an env that declares none) holds none."""
    spaces = getattr(space, "spaces", None)
    if not isinstance(spaces, Mapping):
        return False
    return any((key in IMAGE_KEYS and getattr(sub, "spaces", None) is None) or has_image_leaves(sub)
               for key, sub in spaces.items())


def image_chunks(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    """Chunks of up to 64 frames x a band of rows about 2 KiB a frame (``[T, H, W, C]`` images).

    Consecutive frames of a camera share most pixels; with each frame's band 2 KiB apart, gzip's 32 KiB
    window (lzf's 8 KiB) sees the same rows of the frames before, so the static parts compress to almost
    nothing. On PickCube-v1 rgb frames one frame a chunk stored 64-69% of the raw bytes, these chunks
    7-10%, and compressing was 3-6x faster (docs/format.md "Image observations on disk").
    """
    row = int(np.prod(shape[2:], dtype=np.int64)) * itemsize
    rows = max(1, min(shape[1], BAND_BYTES // max(row, 1)))
    return (max(1, min(shape[0], CHUNK_FRAMES)), rows, *shape[2:])


# ---------------------------------------------------------------------------------------------- JSON
def to_jsonable(x: Any) -> Any:
    """``x`` with numpy arrays and scalars (and torch tensors) turned into lists and Python numbers."""
    if isinstance(x, dict):
        return {str(k): to_jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [to_jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, np.generic):
        return x.item()
    if hasattr(x, "tolist"):  # torch tensors
        return x.tolist()
    return x


def atomic_write_json(path: Path, data: dict) -> None:
    """Write ``data`` as JSON to ``path`` through a synced temporary file and an atomic rename."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(to_jsonable(data), f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_json(path: Path) -> dict | None:
    """The JSON object in ``path``; None if it is missing, unreadable, not JSON or not an object."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


# ---------------------------------------------------------------------------------------------- the disk
def free_bytes(path: Path) -> int | None:
    """Free bytes on the filesystem of ``path`` (or of its nearest existing parent); None if unknown."""
    for p in (path, *path.parents):
        try:
            return shutil.disk_usage(p).free
        except OSError:
            continue
    return None


def is_disk_full(e: BaseException) -> bool:
    """Whether ``e`` says the disk is full."""
    # h5py raises OSError(ENOSPC), or RuntimeError("... errno = 28, error message = 'No space left on device'")
    return (isinstance(e, OSError) and e.errno == errno.ENOSPC) or "No space left on device" in str(e)


def disk_text(path: Path) -> str:
    """The free space of ``path``'s filesystem in words, with the fix when it is nearly full."""
    free = free_bytes(path)
    if free is None:
        return f"the free space of {path} is unknown"
    text = f"{free:,} bytes free on the filesystem of {path}"
    if free < LOW_DISK:
        text += " (nearly full: free space or choose another output_dir)"
    return text
