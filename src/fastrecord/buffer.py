"""Per-env episode storage on the env's device.

`EpisodeBuffer` owns one preallocated tensor ``[num_envs, capacity, *shape]`` per recorded leaf (frames,
observation leaves, env-state leaves, actions, rewards, flags) and the per-env cursors. Slot 0 of an
env holds its episode's reset data; slot t holds the data after its t-th step. Writes are one
indexed assignment per leaf for all envs (no Python loop over envs); the only device-to-host copy is
`gather`, once per batch of finished episodes.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import numpy as np
import torch

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
        for name, value in data.items():
            buf = self._ensure_field(name, value)
            buf[self._rows, self._cursor_dev] = value

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

    def gather(self, env_idx: np.ndarray, names: list[str] | None = None) -> dict[str, np.ndarray]:
        """Copy the episodes in progress of ``env_idx`` to host memory in one batch.

        Returns ``{name: array [len(env_idx), max_len, ...]}`` with ``max_len = cursor.max() + 1``
        over ``env_idx``; rows of shorter episodes are padded with stale data past their cursor.
        """
        length = int(self.cursor[env_idx].max()) + 1
        rows = torch.as_tensor(env_idx, device=self.device)
        pinned = self.device.type == "cuda"
        out: dict[str, torch.Tensor] = {}
        for name, buf in self._bufs.items():
            if names is not None and name not in names:
                continue
            part = buf[rows, :length] if len(env_idx) < self.num_envs else buf[:, :length]
            if pinned:
                host = torch.empty(part.shape, dtype=part.dtype, pin_memory=True)
                host.copy_(part, non_blocking=True)
                out[name] = host
            else:
                out[name] = part.clone()
        if pinned:
            torch.cuda.current_stream(self.device).synchronize()
        return {k: v.numpy() for k, v in out.items()}
