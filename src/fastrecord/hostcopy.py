"""Copies of the episode buffer's fields to host memory, for `fastrecord.buffer.EpisodeBuffer.gather`: which
fields go through staging memory (`staging_layout`), and the copies into it (`copy_to_staging`: one numpy copy
per episode on the CPU, asynchronous chunks from CUDA); `LeafTransform`, a conversion on the device first.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np
import torch

from fastrecord.staging import shared_memory_supported


class LeafTransform(Protocol):
    """A conversion of a recorded leaf on its device, done by `EpisodeBuffer.gather` before the copy to the
    host (e.g. `fastrecord.video.yuv.YUV420P`: RGB frames to yuv420p, half the bytes to copy).

    ``accepts(buf)``: whether the leaf's buffer ``[capacity, envs, *leaf]`` can be converted; ``shape``:
    the converted leaf's shape from ``leaf``; ``dtype``: its numpy dtype; ``transform(part)``: ``[envs,
    steps, *leaf]`` tensor -> ``[envs, steps, *shape(leaf)]`` tensor on the same device; ``wrap(host,
    ready)``: the host array (``ready``: the CUDA event of its asynchronous copy) -> what gather returns.
    """

    dtype: np.dtype

    def accepts(self, buf: torch.Tensor) -> bool: ...

    def shape(self, leaf_shape: tuple[int, ...]) -> tuple[int, ...]: ...

    def __call__(self, part: torch.Tensor, /) -> torch.Tensor: ...

    def wrap(self, host: np.ndarray, ready: Any) -> np.ndarray: ...


STAGING_MIN_BYTES = 1024 * 1024  # smaller gathers (flags for the keep filter) skip the staging pool
CHUNK_BYTES = 256 * 1024 * 1024  # bytes of a field read per chunk of a gather (bounds device temporaries)


def staging_layout(selected: Mapping[str, torch.Tensor], transforms: Mapping[str, LeafTransform] | None, envs: int,
                    length: int) -> tuple[dict[str, LeafTransform], dict[str, tuple[tuple[int, ...], np.dtype]], int]:
    """A gather's fields in staging memory: (the fields converted on their device (CUDA ones a transform
    accepts), ``{name: (shape, dtype)}`` of the fields staged, the bytes to lease); nothing staged where the
    gather is small (`STAGING_MIN_BYTES`) or shared memory is not supported."""
    converted = {n: t for n, t in (transforms or {}).items()
                 if n in selected and selected[n].is_cuda and t.accepts(selected[n])}
    layout: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
    for name, buf in selected.items():
        if name in converted:
            t = converted[name]
            layout[name] = ((envs, length, *t.shape(tuple(buf.shape[2:]))), np.dtype(t.dtype))
        elif (dt := numpy_dtype(buf.dtype)) is not None:
            layout[name] = ((envs, length, *buf.shape[2:]), dt)
    total = sum(int(np.prod(s, dtype=np.int64)) * dt.itemsize + 4096 for s, dt in layout.values())
    if total < STAGING_MIN_BYTES or not shared_memory_supported():
        return {}, {}, total
    return converted, layout, total


def copy_to_staging(buf: torch.Tensor, dst: np.ndarray, env_idx: np.ndarray, length: int, part: Any) -> np.ndarray:
    """The episodes ``env_idx`` of ``buf`` (their first ``length`` slots) into ``dst``, staging memory: on the
    CPU one numpy copy per episode; from CUDA asynchronously, in chunks of envs (the caller synchronizes)."""
    if (host := host_view(buf)) is not None:  # CPU: one numpy copy (see `step`)
        # one copy per episode of its contiguous frames: np.take of the swapped view would copy
        # the whole buffer first (0.45 s for 16 envs x 51 frames x 256x256, this: 0.04 s)
        for i, e in enumerate(env_idx.tolist()):
            np.copyto(dst[i], host[:length, e])
        return dst
    # in chunks of envs: a strided device-to-host copy goes through a device temporary
    from fastrecord.staging import copy_pinned_pieces

    for lo, hi in chunks(len(env_idx), buf[0, 0].numel() * buf.element_size() * length):
        src = part(buf, lo, hi)
        if src.is_cuda:  # within the arena's pinned pieces (one copy each), waiting for a piece still being pinned
            copy_pinned_pieces(dst[lo:hi], src.contiguous())
        else:
            torch.from_numpy(dst[lo:hi]).copy_(src)
    return dst


def chunks(n: int, bytes_per_env: int) -> list[tuple[int, int]]:
    """``(lo, hi)`` ranges over ``n`` envs of at most `CHUNK_BYTES` each (at least one env)."""
    step = max(1, CHUNK_BYTES // max(1, bytes_per_env))
    return [(lo, min(lo + step, n)) for lo in range(0, n, step)]


def host_view(t: torch.Tensor) -> np.ndarray | None:
    """A numpy view of a CPU tensor (None on other devices and for dtypes numpy lacks)."""
    if t.device.type != "cpu" or t.requires_grad or numpy_dtype(t.dtype) is None:
        return None
    return t.numpy()


@functools.cache
def numpy_dtype(dtype: torch.dtype) -> np.dtype | None:
    try:
        return torch.empty(0, dtype=dtype).numpy().dtype
    except (TypeError, RuntimeError):
        return None
