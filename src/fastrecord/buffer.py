"""Per-env episode storage on the env's device.

`EpisodeBuffer` owns one preallocated tensor ``[num_envs, capacity, *shape]`` per recorded leaf (frames,
observation leaves, env-state leaves, actions, rewards, flags) and the per-env cursors. Slot 0 of an
env holds its episode's reset data; slot t holds the data after its t-th step. Writes are one
indexed assignment per leaf for all envs (no Python loop over envs); the only device-to-host copy is
`gather`, once per batch of finished episodes.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping
from typing import Any

import numpy as np
import torch

from fastrecord.staging import Yuv420Frames, default_staging_pool, rgb_to_yuv420p, shared_memory_supported

GiB = 1024**3


class BufferTooLargeError(MemoryError):
    """The episode buffer would not fit in the memory of its device."""


def flatten_tree(tree: Mapping | torch.Tensor, prefix: str) -> dict[str, torch.Tensor]:
    """{"a": {"b": x}} -> {"prefix/a/b": x}; a bare tensor -> {prefix: x}."""
    if not isinstance(tree, Mapping):
        return {prefix: tree}
    out: dict[str, torch.Tensor] = {}
    for k, v in tree.items():
        out.update(flatten_tree(v, f"{prefix}/{k}"))
    return out


def free_bytes(device: torch.device) -> int:
    """Memory that a new allocation on ``device`` can still take."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        # memory cached by torch's allocator is reusable too
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


class EpisodeBuffer:
    """Owns: the per-leaf storage tensors, the per-env cursors (host truth, device mirror), capacity.

    ``cursor[e]`` is the slot last written for env ``e`` (-1 before its first reset), so the episode in
    progress of env ``e`` spans slots ``0..cursor[e]`` and has ``cursor[e]`` steps.
    """

    def __init__(self, num_envs: int, device: torch.device | str, capacity: int, headroom: float = 0.9) -> None:
        if capacity < 2:
            raise ValueError(f"buffer capacity={capacity} must be >= 2 (a reset slot and one step)")
        self.num_envs = num_envs
        self.device = torch.device(device)
        self.capacity = capacity
        self.headroom = headroom  # fraction of free memory the buffer may take
        self.cursor = np.full(num_envs, -1, dtype=np.int64)
        self._cursor_dev = torch.full((num_envs,), -1, dtype=torch.long, device=self.device)
        self._rows = torch.arange(num_envs, device=self.device)
        self._bufs: dict[str, torch.Tensor] = {}
        self._copy_stream: Any = None  # CUDA side stream of asynchronous gathers, made at first use

    # ------------------------------------------------------------------ layout
    @property
    def fields(self) -> dict[str, torch.Tensor]:
        return self._bufs

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._bufs.values())

    def _alloc(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, capacity: int) -> torch.Tensor:
        full = (self.num_envs, capacity, *shape)
        need = int(np.prod(full)) * torch.empty((), dtype=dtype).element_size()
        free = free_bytes(self.device)
        if need > self.headroom * free:
            raise BufferTooLargeError(
                f"fastrecord's episode buffer for {name!r} needs {need / GiB:.2f} GiB on {self.device} "
                f"({self.num_envs} envs x {capacity} steps x {list(shape)} {dtype}), but only "
                f"{free / GiB:.2f} GiB is free. Lower the video resolution "
                f"(human_render_camera_configs=dict(width=..., height=...)), record fewer envs, pass a smaller "
                f"buffer_capacity (longer episodes grow the buffer), or set save_video=False."
            )
        return torch.empty(full, dtype=dtype, device=self.device)

    def _ensure_field(self, name: str, value: torch.Tensor) -> torch.Tensor:
        buf = self._bufs.get(name)
        shape = tuple(value.shape[1:])
        if buf is None or buf.shape[2:] != shape or buf.dtype != value.dtype:
            if buf is not None and (self.cursor > 0).any():
                raise ValueError(
                    f"recorded field {name!r} changed from {list(buf.shape[2:])} {buf.dtype} to {list(shape)} "
                    f"{value.dtype} while episodes were in progress; reconfigure only with a full reset"
                )
            self._bufs.pop(name, None)
            buf = self._bufs[name] = self._alloc(name, shape, value.dtype, self.capacity)
        return buf

    def retain_only(self, names: set[str]) -> None:
        """Drop fields no longer produced (e.g. after a reconfiguring full reset)."""
        for name in list(self._bufs):
            if name not in names:
                del self._bufs[name]

    def _grow(self, min_capacity: int) -> None:
        new_cap = max(2 * self.capacity, min_capacity)
        for name, buf in list(self._bufs.items()):
            new = self._alloc(name, tuple(buf.shape[2:]), buf.dtype, new_cap)
            new[:, : self.capacity] = buf
            self._bufs[name] = new
        self.capacity = new_cap

    # ------------------------------------------------------------------ writes
    def start(self, env_idx: np.ndarray, data: Mapping[str, torch.Tensor]) -> None:
        """Begin new episodes for ``env_idx``: slot 0 gets their rows of ``data`` (rows of all envs)."""
        self.cursor[env_idx] = 0
        if len(env_idx) == self.num_envs:
            self._cursor_dev.zero_()
            rows = None
        else:
            rows = torch.as_tensor(env_idx, device=self.device)
            self._cursor_dev[rows] = 0
        for name, value in data.items():
            buf = self._ensure_field(name, value)
            if rows is None:
                buf[:, 0] = value
            else:
                buf[rows, 0] = value[rows]

    def step(self, data: Mapping[str, torch.Tensor], restart: np.ndarray | None = None) -> None:
        """Every env advances one slot and gets its row of ``data``.

        ``restart`` (bool per env) marks envs whose data this step is a fresh reset (vector envs that
        auto-reset on the step after an episode ends): they write slot 0 instead.
        """
        fresh = np.zeros(self.num_envs, dtype=bool) if restart is None else restart
        if ((self.cursor < 0) & ~fresh).any():
            raise RuntimeError(
                f"step() for envs {np.flatnonzero((self.cursor < 0) & ~fresh).tolist()} whose episode has ended "
                f"or never started: call env.reset() first"
            )
        if fresh.any():
            self.cursor = np.where(restart, 0, self.cursor + 1)
            self._cursor_dev = torch.tensor(self.cursor, device=self.device)  # a copy, never a view
        else:
            self.cursor += 1
            self._cursor_dev += 1
        top = int(self.cursor.max())
        if top >= self.capacity:
            self._grow(top + 1)
        # one index_copy_ per leaf into the [num_envs * capacity, ...] view: half the GPU time of an
        # advanced-indexing put, and far cheaper on the CPU
        slots = self._rows * self.capacity + self._cursor_dev
        for name, value in data.items():
            buf = self._ensure_field(name, value)
            if value.dtype != buf.dtype or value.shape[0] != self.num_envs:
                value = value.to(buf.dtype).expand(self.num_envs, *buf.shape[2:])
            buf.view(-1, *buf.shape[2:]).index_copy_(0, slots, value)

    def restart_from_last(self, env_idx: np.ndarray) -> None:
        """Start new episodes for ``env_idx`` at their current state (slot cursor -> slot 0)."""
        rows = torch.as_tensor(env_idx, device=self.device)
        last = self._cursor_dev[rows]
        for buf in self._bufs.values():
            buf[rows, 0] = buf[rows, last]
        self.cursor[env_idx] = 0
        self._cursor_dev[rows] = 0

    # ------------------------------------------------------------------ reads
    def read_last(self, names: list[str], env_idx: np.ndarray) -> dict[str, np.ndarray]:
        """Small read: each named field at the current slot of ``env_idx`` (one sync)."""
        rows = torch.as_tensor(env_idx, device=self.device)
        cur = self._cursor_dev[rows]
        return {n: self._bufs[n][rows, cur].cpu().numpy() for n in names if n in self._bufs}

    def gather(self, env_idx: np.ndarray, names: list[str] | None = None, *,
               yuv420p: Collection[str] = ()) -> dict[str, np.ndarray]:
        """Copy the episodes in progress of ``env_idx`` to host memory in one batch.

        Returns ``{name: array [len(env_idx), max_len, ...]}`` with ``max_len = cursor.max() + 1``
        over ``env_idx``; rows of shorter episodes are padded with stale data past their cursor.

        The arrays live in reusable staging memory (`fastrecord.staging`: pinned once, shared with
        encoder processes), which returns to its pool when the last array viewing it is collected.

        ``yuv420p`` names uint8 ``[..., H, W, 3]`` RGB fields (even H and W, CUDA buffer) to return as
        `Yuv420Frames` ``[len(env_idx), max_len, H * 3 // 2, W]``: converted on the GPU and copied
        asynchronously on a side stream (half the bytes of RGB); their ``wait_ready()`` blocks until the
        copy has landed, and `encode_mp4` does that itself. Other fields are ready on return.
        """
        env_idx = np.asarray(env_idx, dtype=np.int64).reshape(-1)
        length = int(self.cursor[env_idx].max()) + 1
        whole = len(env_idx) == self.num_envs and bool((env_idx == np.arange(self.num_envs)).all())
        rows = None if whole else torch.as_tensor(env_idx, device=self.device)
        cuda = self.device.type == "cuda"
        selected = {n: b for n, b in self._bufs.items() if names is None or n in names}

        def part(buf: torch.Tensor, lo: int = 0, hi: int | None = None) -> torch.Tensor:
            hi = len(env_idx) if hi is None else hi
            return buf[lo:hi, :length] if rows is None else buf[rows[lo:hi], :length]

        yuv = {n for n in yuv420p if n in selected and cuda and _yuv_eligible(selected[n])}
        layout: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
        for name, buf in selected.items():
            if name in yuv:
                h, w = buf.shape[-3:-1]
                layout[name] = ((len(env_idx), length, *buf.shape[2:-3], h * 3 // 2, w), np.dtype(np.uint8))
            elif (dt := _numpy_dtype(buf.dtype)) is not None:
                layout[name] = ((len(env_idx), length, *buf.shape[2:]), dt)
        total = sum(int(np.prod(s, dtype=np.int64)) * dt.itemsize + 4096 for s, dt in layout.values())
        if total < _STAGING_MIN_BYTES or not shared_memory_supported():
            yuv, layout = set(), {}
        lease = default_staging_pool().lease(total, pin=cuda) if layout else None

        out: dict[str, np.ndarray] = {}
        pending: list[torch.Tensor] = []
        for name, buf in selected.items():  # plain fields first: one sync covers them, not the conversion
            if name in yuv:
                continue
            src = part(buf)
            if name in layout:
                dst = lease.array(*layout[name])
                torch.from_numpy(dst).copy_(src, non_blocking=cuda)
                out[name] = dst
            elif cuda:
                host = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
                host.copy_(src, non_blocking=True)
                pending.append(host)
                out[name] = host
            else:
                t = src.clone()
                pending.append(t)
                out[name] = t
        if cuda:
            torch.cuda.current_stream(self.device).synchronize()
        for name, v in out.items():
            if isinstance(v, torch.Tensor):
                out[name] = v.numpy()
        del pending
        for name in yuv:
            out[name] = self._gather_yuv(selected[name], lease.array(*layout[name]), part)
            lease.arena.pending = out[name].ready  # a reuse of the arena waits for this copy
        return {n: out[n] for n in selected if n in out}

    def _gather_yuv(self, buf: torch.Tensor, dst: np.ndarray, part: Any) -> Yuv420Frames:
        """Convert on the current stream, copy to ``dst`` on a side stream, in chunks of envs."""
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.device)
        current = torch.cuda.current_stream(self.device)
        per_env = max(1, buf[0].numel()) * dst.shape[1] // max(1, buf.shape[1])
        chunk = max(1, _YUV_CHUNK_BYTES // max(1, per_env))
        for lo in range(0, dst.shape[0], chunk):
            hi = min(lo + chunk, dst.shape[0])
            yuv = rgb_to_yuv420p(part(buf, lo, hi))
            self._copy_stream.wait_stream(current)
            with torch.cuda.stream(self._copy_stream):
                torch.from_numpy(dst[lo:hi]).copy_(yuv, non_blocking=True)
            yuv.record_stream(self._copy_stream)  # the allocator must not reuse it before the copy ends
            del yuv
        ready = torch.cuda.Event(blocking=True)  # waiters sleep rather than spin (encoders need the cores)
        ready.record(self._copy_stream)
        return Yuv420Frames(dst, ready=ready)


_STAGING_MIN_BYTES = 1024 * 1024  # smaller gathers (flags for the keep filter) skip the staging pool
_YUV_CHUNK_BYTES = 256 * 1024 * 1024  # RGB bytes converted per chunk (bounds the float temporaries)


def _yuv_eligible(buf: torch.Tensor) -> bool:
    return buf.dtype == torch.uint8 and buf.ndim >= 5 and buf.shape[-1] == 3 and buf.shape[-3] % 2 == 0 and buf.shape[-2] % 2 == 0


def _numpy_dtype(dtype: torch.dtype) -> np.dtype | None:
    try:
        return torch.empty(0, dtype=dtype).numpy().dtype
    except (TypeError, RuntimeError):
        return None
