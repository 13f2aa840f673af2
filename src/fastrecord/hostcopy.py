"""Copies of the episode buffer's fields to host memory, for `fastrecord.buffer.EpisodeBuffer.gather`: which
fields go through staging memory (`staging_layout`), and the copies into it (`copy_to_staging`: one numpy copy
per episode on the CPU, asynchronous chunks from CUDA); `LeafTransform`, a conversion on the device first.

Device-to-host copies into an arena still being pinned piece by piece (`fastrecord.staging.Arena.pin_pieces`) stay
inside one piece each and wait for it (`device_to_host`, `copy_pinned_pieces`); `Landing` tells when they landed.
"""

from __future__ import annotations

import functools
import itertools
import threading
from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np
import torch

from fastrecord import staging
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


# ---------------------------------------------------------------------------------------------- pinned pieces
def piece_ranges(start: int, stop: int) -> list[tuple[int, int]]:
    """Byte ranges of ``start..stop`` (offsets in an arena) cut at its pieces' borders (`staging.PIN_PIECE`): each
    lies in one piece."""
    piece = staging.PIN_PIECE
    cuts = list(range((start // piece + 1) * piece, stop, piece))
    bounds = [start, *cuts, stop]
    return [(a, b) for a, b in itertools.pairwise(bounds) if b > a]


class Landing:
    """Asynchronous device-to-host copies into staging memory, some perhaps not enqueued yet (their pieces still
    being pinned): a byte range each, with the CUDA event of its copy once enqueued. `synchronize` waits for all
    of them; `wait_for` for those that overlap one array (an episode's frames: its own chunk, not the batch's)."""

    def __init__(self) -> None:
        self._units: list[_Unit] = []
        self.previous: Any = None  # the copies into the same arena before these (`Arena.pending`): `synchronize`

    def add(self, lo: int, hi: int) -> _Unit:
        unit = _Unit(lo, hi)
        self._units.append(unit)
        return unit

    def synchronize(self) -> None:
        """Wait for these copies and every earlier one into the same arena (``previous``, a chain)."""
        node: Any = self
        while isinstance(node, Landing):
            for u in node._units:
                u.wait()
            node = node.previous
        if node is not None:  # a plain CUDA event
            node.synchronize()
        self.previous = None

    def wait_for(self, address: int, nbytes: int) -> None:
        for u in self._units:
            if u.lo < address + nbytes and address < u.hi:
                u.wait()


class _Unit:
    """One copy of a `Landing`: addresses ``lo..hi``; `done` gives its CUDA event (or the error that stopped it)."""

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi
        self._queued = threading.Event()
        self._event: Any = None
        self._error: BaseException | None = None

    def done(self, event: Any = None, error: BaseException | None = None) -> None:
        self._event, self._error = event, error
        self._queued.set()

    def wait(self) -> None:
        self._queued.wait()
        if self._error is not None:
            raise RuntimeError(f"a copy into staging memory failed: {self._error}") from self._error
        if self._event is not None:
            self._event.synchronize()


def device_to_host(dst: np.ndarray, src: Any, stream: Any, after: Any, landing: Landing) -> None:
    """Copy ``src`` (a contiguous CUDA tensor of ``dst``'s bytes) into ``dst`` (staging memory, C-contiguous) on
    ``stream`` once ``after`` (a CUDA event: ``src`` written) has happened, in pieces of the arena's pinning
    (`piece_ranges`), each enqueued as soon as its piece is pinned (now, or by the pinning thread), each noted in
    ``landing``. ``src`` is kept until its copies are enqueued (and marked as used on ``stream``)."""
    found = staging.locate(dst)
    flat_dst = dst.reshape(-1).view(np.uint8)
    flat_src = src.reshape(-1).view(torch.uint8)
    if found is None:
        arena, base, ranges = None, 0, [(0, flat_dst.nbytes)]
    else:
        arena, base = found
        ranges = piece_ranges(base, base + flat_dst.nbytes)
    for lo, hi in ranges:
        unit = landing.add(dst.ctypes.data + lo - base, dst.ctypes.data + hi - base)

        def copy(lo: int = lo, hi: int = hi, unit: _Unit = unit) -> None:
            try:
                with torch.cuda.device(src.device), torch.cuda.stream(stream):
                    stream.wait_event(after)
                    part = flat_src[lo - base:hi - base]
                    torch.from_numpy(flat_dst[lo - base:hi - base]).copy_(part, non_blocking=True)
                    src.record_stream(stream)  # the allocator must not reuse it before the copy ends
                    event = torch.cuda.Event(blocking=True)  # waiters sleep rather than spin (encoders need cores)
                    event.record(stream)
                unit.done(event)
            except BaseException as e:  # noqa: BLE001 - raised where the copy is waited for
                unit.done(error=e)

        if arena is None:
            copy()
        else:
            arena.when_pinned(hi, copy)


def copy_pinned_pieces(dst: np.ndarray, src: Any) -> None:
    """Copy ``src`` (a contiguous CUDA tensor of ``dst``'s bytes) into ``dst`` (staging memory) on the current
    stream, asynchronously, piece by piece of the arena's pinning, each once its piece is pinned (waiting here)."""
    found = staging.locate(dst)
    flat_dst = torch.from_numpy(dst.reshape(-1).view(np.uint8))
    flat_src = src.reshape(-1).view(torch.uint8)
    if found is None:
        flat_dst.copy_(flat_src, non_blocking=True)
        return
    arena, base = found
    for lo, hi in piece_ranges(base, base + flat_dst.numel()):
        arena.wait_pinned(hi)
        flat_dst[lo - base:hi - base].copy_(flat_src[lo - base:hi - base], non_blocking=True)
