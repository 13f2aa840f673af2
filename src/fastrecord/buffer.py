"""Per-env episode storage on the devices the recorded data comes from.

`EpisodeBuffer` owns one preallocated tensor ``[capacity, num_envs, *shape]`` per recorded leaf (frames,
observation leaves, env-state leaves, actions, rewards, flags) and the per-env cursors. Slot 0 of an
env holds its episode's reset data; slot t holds the data after its t-th step. Time-major, so that the
common step (every env at the same slot t) writes each leaf as one contiguous block ``buf[t]``: one
plain copy kernel, whatever the buffer's size. Envs at different slots take one ``index_copy_`` per
leaf. Small leaves of one device and dtype that appear together (the step's flags; actions and rewards;
observation and env-state vectors) share one storage side by side (`_Pack`), so a step writes them with
one ``cat`` (each a kernel launch on CUDA) rather than a copy each; every leaf is still a field of its
own shape, a view of that storage. No Python loop over envs; the only device-to-host copy is `gather`,
once per batch of finished episodes.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Iterable, Mapping
from typing import Any

import numpy as np
import torch

from fastrecord.hostcopy import (
    Landing,
    LeafTransform,
    chunks,
    copy_to_staging,
    device_to_host,
    host_view,
    staging_layout,
)
from fastrecord.staging import default_staging_pool

GiB = 1024**3


class BufferTooLargeError(MemoryError):
    """The episode buffer would not fit in the memory of its device."""


class _Pack:
    """Small leaves of one device and dtype stored side by side: ``storage`` ``[capacity, num_envs, width]``,
    leaf ``name`` the columns ``members[name] = (lo, hi, shape)`` (its field: a view, ``[capacity, num_envs,
    *shape]``). A step that brings every member writes them with one ``cat`` into ``storage[t]``."""

    __slots__ = ("device", "flat", "host", "members", "storage")

    def __init__(self, storage: torch.Tensor, members: dict[str, tuple[int, int, tuple[int, ...]]]) -> None:
        self.members = members
        self.set_storage(storage)

    def set_storage(self, storage: torch.Tensor) -> None:
        self.storage = storage
        self.device = storage.device
        self.flat = storage.view(-1, storage.shape[2])
        self.host = host_view(storage)

    def view(self, name: str) -> torch.Tensor:
        lo, hi, shape = self.members[name]
        if not shape:
            return self.storage[:, :, lo]
        cols = self.storage[:, :, lo:hi]
        return cols if len(shape) == 1 else cols.unflatten(2, shape)


_PACK_MAX_DIMS = 2  # leaves packed: at most 2 dims an env (not images) ...
_PACK_MAX_ELEMENTS = 1024  # ... and at most this many elements an env


def _pack_label(names: Iterable[str]) -> str:
    """A pack's name in a `BufferTooLargeError`: every leaf of it."""
    return " + ".join(repr(n) for n in names)


def _packable(value: torch.Tensor) -> bool:
    per_env = int(np.prod(value.shape[1:], dtype=np.int64))
    return 1 <= value.ndim <= _PACK_MAX_DIMS + 1 and 0 < per_env <= _PACK_MAX_ELEMENTS


def flatten_tree(tree: Mapping | torch.Tensor, prefix: str) -> dict[str, torch.Tensor]:
    """{"a": {"b": x}} -> {"prefix/a/b": x}; a bare tensor -> {prefix: x}."""
    out: dict[str, torch.Tensor] = {}
    _flatten_into(out, tree, prefix)
    return out


def _flatten_into(out: dict[str, Any], tree: Any, prefix: str) -> None:
    # every step walks the observation: tensors tested first (a Mapping test is an ABC check)
    if isinstance(tree, torch.Tensor) or not isinstance(tree, Mapping):
        out[prefix] = tree
        return
    for k, v in tree.items():
        _flatten_into(out, v, f"{prefix}/{k}")


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
    """Owns: the per-leaf storage tensors ``[capacity, num_envs, ...]``, the per-env cursors (host truth;
    per-device slot indices only while envs are at different slots), capacity.

    ``cursor[e]`` is the slot last written for env ``e`` (-1 before its first reset), so the episode in
    progress of env ``e`` spans slots ``0..cursor[e]`` and has ``cursor[e]`` steps.
    """

    def __init__(self, num_envs: int, capacity: int, headroom: float = 0.9) -> None:
        if capacity < 2:
            raise ValueError(f"buffer capacity={capacity} must be >= 2 (a reset slot and one step)")
        self.num_envs = num_envs  # each field lives on the device its data arrives on
        self.capacity = capacity
        self.headroom = headroom  # fraction of free memory the buffer may take
        self.cursor = np.full(num_envs, -1, dtype=np.int64)
        self._bufs: dict[str, torch.Tensor] = {}
        self._flat: dict[str, torch.Tensor] = {}  # the same storage viewed as [capacity * num_envs, ...]
        self._host: dict[str, np.ndarray | None] = {}  # the same storage as numpy, for CPU fields (see `step`)
        self._sig: dict[str, tuple[torch.Size, torch.dtype]] = {}  # each field's [num_envs, *shape] and dtype
        self._packs: list[_Pack] = []  # small leaves sharing a storage
        self._pack_of: dict[str, _Pack] = {}
        self._rows = np.arange(num_envs)
        # per device: the flat slot of every env (cursor * num_envs + row), advanced by one add_ a step;
        # dropped whenever cursors move otherwise (resets, restarts) and rebuilt from `cursor`
        self._slots: dict[torch.device, torch.Tensor] = {}
        self._copy_stream: Any = None  # CUDA side stream of asynchronous gathers, made at first use

    # ------------------------------------------------------------------ layout
    @property
    def fields(self) -> dict[str, torch.Tensor]:
        return self._bufs

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._bufs.values())

    def _storages(self) -> list[torch.Tensor]:
        """Every tensor that holds fields (a pack's storage once), for copies of whole slots."""
        return [p.storage for p in self._packs] + [b for n, b in self._bufs.items() if n not in self._pack_of]

    def _alloc(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype, capacity: int, device: torch.device
    ) -> torch.Tensor:
        full = (capacity, self.num_envs, *shape)
        need = int(np.prod(full)) * torch.empty((), dtype=dtype).element_size()
        free = free_bytes(device)
        if need > self.headroom * free:
            raise BufferTooLargeError(
                f"fastrecord's episode buffer for {name!r} needs {need / GiB:.2f} GiB on {device} "
                f"({self.num_envs} envs x {capacity} steps x {list(shape)} {dtype}), but only "
                f"{free / GiB:.2f} GiB is free. Lower the video resolution "
                f"(human_render_camera_configs=dict(width=..., height=...)), record fewer envs, pass a smaller "
                f"buffer_capacity (longer episodes grow the buffer), or set save_video=False"
                + (
                    " or render_substeps=False (it holds every physics substep's frame)."
                    if name == "frames" and len(shape) == 4
                    else "."
                )
            )
        return torch.empty(full, dtype=dtype, device=device)

    def _set(self, name: str, buf: torch.Tensor) -> None:
        self._bufs[name] = buf
        self._sig[name] = (torch.Size((self.num_envs, *buf.shape[2:])), buf.dtype)  # what a step's leaf looks like
        self._flat[name] = buf.view(-1, *buf.shape[2:])
        self._host[name] = host_view(buf)

    def _ensure_fields(self, data: Mapping[str, torch.Tensor]) -> None:
        """A field for every leaf of ``data`` (shape and dtype as the leaf's): new ones allocated, small new
        leaves of one device and dtype packed together (`_Pack`)."""
        new: dict[str, torch.Tensor] = {}
        sig = self._sig
        for name, value in data.items():
            known = sig.get(name)
            if known is not None and value.shape == known[0] and value.dtype == known[1]:
                continue  # the common case, without slicing shapes
            buf = self._bufs.get(name)
            if buf is not None and buf.shape[2:] == value.shape[1:] and buf.dtype == value.dtype:
                continue
            if buf is not None and (self.cursor > 0).any():
                raise ValueError(
                    f"recorded field {name!r} changed from {list(buf.shape[2:])} {buf.dtype} to "
                    f"{list(value.shape[1:])} {value.dtype} while episodes were in progress; "
                    "reconfigure only with a full reset"
                )
            new[name] = value
        if not new:
            return
        groups: dict[tuple[torch.device, torch.dtype], list[str]] = {}
        for name, value in new.items():
            if _packable(value):
                groups.setdefault((value.device, value.dtype), []).append(name)
        packs: list[_Pack] = []
        for (device, dtype), names in groups.items():
            if len(names) < 2:
                continue
            members, width = {}, 0
            for n in names:
                shape = tuple(new[n].shape[1:])
                members[n] = (width, width + int(np.prod(shape, dtype=np.int64)), shape)
                width = members[n][1]
            packs.append(_Pack(self._alloc(_pack_label(names), (width,), dtype, self.capacity, device), members))
        single = {name: self._alloc(name, tuple(value.shape[1:]), value.dtype, self.capacity, value.device)
                  for name, value in new.items() if not any(name in p.members for p in packs)}
        # everything allocated: now replace the old fields
        for name in new:
            self._drop(name)
        for pack in packs:
            self._packs.append(pack)
            for name in pack.members:
                self._pack_of[name] = pack
                self._set(name, pack.view(name))
        for name, buf in single.items():
            self._set(name, buf)

    def _drop(self, name: str) -> None:
        if name not in self._bufs:
            return
        del self._bufs[name], self._flat[name], self._host[name], self._sig[name]
        pack = self._pack_of.get(name)
        if pack is not None:  # the pack dissolves: its other leaves stay where they are, written one by one
            self._packs.remove(pack)
            for n in pack.members:
                del self._pack_of[n]

    def retain_only(self, names: set[str]) -> None:
        """Drop fields no longer produced (e.g. after a reconfiguring full reset)."""
        for name in list(self._bufs):
            if name not in names:
                self._drop(name)

    def _grow(self, min_capacity: int) -> None:
        """All fields get the larger capacity, or none does: every new tensor is allocated before any
        replaces its field, so a `BufferTooLargeError` leaves the buffer (and its episodes) as it was."""
        new_cap = max(2 * self.capacity, min_capacity)
        grown = {name: self._alloc(name, tuple(buf.shape[2:]), buf.dtype, new_cap, buf.device)
                 for name, buf in self._bufs.items() if name not in self._pack_of}
        packs = [
            (
                p,
                self._alloc(
                    _pack_label(p.members), tuple(p.storage.shape[2:]), p.storage.dtype, new_cap, p.storage.device
                ),
            )
            for p in self._packs
        ]
        for name, new in grown.items():
            new[: self.capacity] = self._bufs[name]
            self._set(name, new)
        for pack, new in packs:
            new[: self.capacity] = pack.storage
            pack.set_storage(new)
            for name in pack.members:
                self._set(name, pack.view(name))
        self.capacity = new_cap

    # ------------------------------------------------------------------ writes
    def start(self, env_idx: np.ndarray, data: Mapping[str, torch.Tensor]) -> None:
        """Begin new episodes for ``env_idx``: slot 0 gets their rows of ``data`` (rows of all envs)."""
        self.cursor[env_idx] = 0
        self._slots.clear()
        self._ensure_fields(data)
        if len(env_idx) == self.num_envs:
            self._write(data, 0, 0)
            return
        rows: dict[torch.device, torch.Tensor] = {}  # env_idx on each device, copied there once
        for name, value in data.items():
            buf = self._bufs[name]
            if value.device != buf.device:
                value = value.to(buf.device, non_blocking=buf.is_cuda)
            if (dst := host_view(buf[0])) is not None and (src := host_view(value)) is not None:
                dst[env_idx] = src[env_idx]  # numpy: torch's CPU advanced indexing is slow for image rows
            else:
                r = rows.get(buf.device)
                if r is None:
                    r = rows[buf.device] = torch.as_tensor(env_idx, device=buf.device)
                buf[0, r] = value[r]

    def end(self, env_idx: np.ndarray) -> None:
        """The episodes of ``env_idx`` are over: only a reset (`start`) begins them again."""
        self.cursor[env_idx] = -1

    def step(self, data: Mapping[str, torch.Tensor], restart: np.ndarray | None = None) -> None:
        """Every env advances one slot and gets its row of ``data``.

        ``restart`` (bool per env) marks envs whose data this step is a fresh reset (vector envs that
        auto-reset on the step after an episode ends): they write slot 0 instead.

        The hot path of the recorder: when every env is at the same step (envs reset together, as in
        evaluation) each leaf is one contiguous copy into ``buf[t]``; otherwise one ``index_copy_`` per
        leaf through per-env slot indices kept on the device.
        """
        if restart is not None and not restart.any():
            restart = None  # no env restarts: a plain step
        if restart is not None:
            if ((self.cursor < 0) & ~restart).any():
                self._raise_ended(restart)
            cursor = np.where(restart, 0, self.cursor + 1)
        else:
            if self.cursor.min() < 0:
                self._raise_ended(None)
            cursor = self.cursor + 1
        lo, hi = int(cursor.min()), int(cursor.max())
        if hi >= self.capacity:
            self._grow(hi + 1)  # before any state changes: a failure leaves every episode as it was
        self._ensure_fields(data)  # likewise fields seen for the first time
        # from here on nothing can fail for lack of memory: commit the new cursors, then write
        self.cursor = cursor
        if restart is not None:
            self._slots.clear()
        else:
            for slots in self._slots.values():
                slots.add_(self.num_envs)
        self._write(data, lo, hi)

    def _write(self, data: Mapping[str, torch.Tensor], lo: int, hi: int) -> None:
        """Every env's row of ``data`` into its slot ``cursor`` (all at slot ``lo`` if ``lo == hi``)."""
        packed = self._pack_of
        for name, value in data.items():
            if name not in packed:
                self._write_leaf(name, value, lo, hi)
        for pack in self._packs:
            values = [data.get(name) for name in pack.members]
            present = [v for v in values if v is not None]
            if len(present) == len(values):
                self._write_pack(pack, present, lo, hi)
            else:  # a step without some member (an info key that comes and goes): leaf by leaf
                for name, v in zip(pack.members, values, strict=True):
                    if v is not None:
                        self._write_leaf(name, v, lo, hi)

    def _write_leaf(self, name: str, value: torch.Tensor, lo: int, hi: int) -> None:
        buf = self._bufs[name]
        if value.device != buf.device:
            value = value.to(buf.device, non_blocking=buf.is_cuda)
        if value.shape[0] != self.num_envs:
            value = value.expand(self.num_envs, *buf.shape[2:])
        if (dst := self._host[name]) is not None and (src := host_view(value)) is not None:
            # CPU leaves through numpy: torch's CPU kernels split image copies over its intra-op threads, which wait for
            # cores the writer processes hold (index_copy_ of 8 envs x 64x64 RGB: 0.6-6 ms a call; numpy: 0.01 ms)
            if lo == hi:
                dst[lo] = src
            else:
                dst[self.cursor, self._rows] = src
        elif lo == hi:
            buf[lo].copy_(value)
        else:
            self._flat[name].index_copy_(0, self._slots_on(buf.device), value)

    def _write_pack(self, pack: _Pack, values: list[torch.Tensor], lo: int, hi: int) -> None:
        """Every member of ``pack`` at once: one ``cat`` (into the slot, or then one ``index_copy_``)."""
        n, device = self.num_envs, pack.device
        cols = []
        for v in values:
            if v.requires_grad:  # e.g. actions of a policy run with gradients on: cat(out=) takes none
                v = v.detach()
            if v.device != device:
                v = v.to(device, non_blocking=device.type == "cuda")
            cols.append(v)
        if pack.host is not None:  # CPU: numpy, as `_write_leaf` (the pack's dtype is one numpy has)
            arrays = []
            for c in cols:
                a = c.numpy()
                if a.ndim != 2:
                    a = a.reshape(a.shape[0], -1)
                arrays.append(a if a.shape[0] == n else np.broadcast_to(a, (n, a.shape[1])))
            if lo == hi:
                np.concatenate(arrays, axis=1, out=pack.host[lo])
            else:
                pack.host[self.cursor, self._rows] = np.concatenate(arrays, axis=1)
            return
        for i, c in enumerate(cols):
            if c.ndim != 2:
                c = c.reshape(c.shape[0], -1)
            cols[i] = c if c.shape[0] == n else c.expand(n, -1)
        if lo == hi:
            torch.cat(cols, dim=1, out=pack.storage[lo])
        else:
            pack.flat.index_copy_(0, self._slots_on(device), torch.cat(cols, dim=1))

    def _slots_on(self, device: torch.device) -> torch.Tensor:
        slots = self._slots.get(device)
        if slots is None:
            host = self.cursor * self.num_envs + np.arange(self.num_envs, dtype=np.int64)
            slots = self._slots[device] = torch.as_tensor(host, device=device)  # a copy, never a view of cursor
        return slots

    def _raise_ended(self, restart: np.ndarray | None) -> None:
        fresh = np.zeros(self.num_envs, dtype=bool) if restart is None else restart
        raise RuntimeError(
            f"step() for envs {np.flatnonzero((self.cursor < 0) & ~fresh).tolist()} whose episode has ended "
            f"or never started: call env.reset() first"
        )

    def restart_from_last(self, env_idx: np.ndarray) -> None:
        """Start new episodes for ``env_idx`` at their current state (slot cursor -> slot 0). CPU storages through
        numpy, as `_write_leaf` (a replay's flush of one env of 16 with 128x128 rgb observations: torch's indexing
        10-20 ms a call on the 2-core machine with the writer processes busy, numpy 0.3 ms)."""
        env_idx = np.asarray(env_idx, dtype=np.int64).reshape(-1)
        last_slots = self.cursor[env_idx]
        for buf in self._storages():
            if (host := host_view(buf)) is not None:
                host[0, env_idx] = host[last_slots, env_idx]
                continue
            rows = torch.as_tensor(env_idx, device=buf.device)
            last = torch.as_tensor(last_slots, device=buf.device)
            buf[0, rows] = buf[last, rows]
        self.cursor[env_idx] = 0
        self._slots.clear()

    # ------------------------------------------------------------------ reads
    def read_rows(self, env_idx: np.ndarray, last: Collection[str] = (), whole: Collection[str] = (),
                  extra: Mapping[str, torch.Tensor] | None = None) -> dict[str, np.ndarray]:
        """Small reads for the episodes of ``env_idx`` in one device-to-host transfer (one sync per device
        rather than one per read, each of which waited for all the device work queued so far):
        ``last``: each field at the current slot (``[len(env_idx), ...]``, key = name); ``whole``: each
        field's slots 0..max cursor (``[len(env_idx), max_len, ...]``, key ``"whole/" + name``); ``extra``:
        more tensors, read as they are. Fields this buffer lacks are left out."""
        env_idx = np.asarray(env_idx, dtype=np.int64).reshape(-1)
        length = int(self.cursor[env_idx].max()) + 1 if len(env_idx) else 0
        srcs: dict[str, torch.Tensor] = {}
        index: dict[
            torch.device, tuple[torch.Tensor, torch.Tensor]
        ] = {}  # env_idx and their cursors, copied once a device
        for keys, prefix in ((last, ""), (whole, "whole/")):
            for n in keys:
                buf = self._bufs.get(n)
                if buf is None:
                    continue
                if buf.device not in index:
                    index[buf.device] = (torch.as_tensor(env_idx, device=buf.device),
                                         torch.as_tensor(self.cursor[env_idx], device=buf.device))
                rows, slots = index[buf.device]
                if prefix:
                    srcs[prefix + n] = buf[:length, rows].transpose(0, 1)
                else:
                    srcs[n] = buf[slots, rows]
        srcs.update(extra or {})
        out: dict[str, Any] = {}
        devices = set()
        for k, t in srcs.items():
            if t.is_cuda:
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host.copy_(t, non_blocking=True)
                devices.add(t.device)
                out[k] = host
            else:
                out[k] = t.clone(memory_format=torch.contiguous_format)
        for d in devices:
            torch.cuda.current_stream(d).synchronize()
        return {k: v.numpy() for k, v in out.items()}

    def gather(self, env_idx: np.ndarray, names: list[str] | None = None, *,
               transforms: Mapping[str, LeafTransform] | None = None) -> dict[str, np.ndarray]:
        """Copy the episodes in progress of ``env_idx`` to host memory in one batch.

        Returns ``{name: array [len(env_idx), max_len, ...]}`` with ``max_len = cursor.max() + 1``
        over ``env_idx``; rows of shorter episodes are padded with stale data past their cursor.

        The arrays live in reusable staging memory (`fastrecord.staging`: pinned once, shared with
        encoder processes), which returns to its pool when the last array viewing it is collected.

        ``transforms`` (``{name: LeafTransform}``) converts fields on their device first: those on CUDA that
        the transform accepts, in gathers that go through staging memory; other fields come back as they
        are, so a transform is for consumers that take both forms (the encoders take RGB frames and
        `fastrecord.video.yuv.YUV420P`'s yuv420p). A converted field is copied asynchronously on a side
        stream; what ``wrap`` makes of it must wait for the copy's event before it is read
        (`Yuv420Frames.wait_ready`, which `encode_mp4` calls). Other fields are ready on return.
        """
        env_idx = np.asarray(env_idx, dtype=np.int64).reshape(-1)
        length = int(self.cursor[env_idx].max()) + 1
        whole = len(env_idx) == self.num_envs and bool((env_idx == np.arange(self.num_envs)).all())
        selected = {n: b for n, b in self._bufs.items() if names is None or n in names}
        devices = {b.device for b in selected.values()}
        rows = {} if whole else {d: torch.as_tensor(env_idx, device=d) for d in devices}
        cuda = any(d.type == "cuda" for d in devices)

        def part(buf: torch.Tensor, lo: int = 0, hi: int | None = None) -> torch.Tensor:
            """Envs ``lo:hi`` of ``env_idx`` as ``[envs, length, ...]`` (a transposed view where possible)."""
            hi = len(env_idx) if hi is None else hi
            cols = slice(lo, hi) if whole else rows[buf.device][lo:hi]
            return buf[:length, cols].transpose(0, 1)

        converted, layout, total = staging_layout(selected, transforms, len(env_idx), length)
        # small gathers (a few episodes ending at one step) share an arena with the next ones
        lease = default_staging_pool().lease(total, pin=cuda, shared=True) if layout else None

        out: dict[str, np.ndarray] = {}
        staged: dict[str, torch.Tensor] = {}  # fields copied to host tensors: out once the copies are done
        pending: list[torch.Tensor] = []
        for name, buf in selected.items():  # plain fields first: one sync covers them, not the conversions
            if name in converted:
                continue
            if name in layout:
                assert lease is not None  # leased for every gather with a layout
                out[name] = copy_to_staging(buf, lease.array(*layout[name]), env_idx, length, part)
                continue
            if (host := host_view(buf)) is not None:  # CPU: one numpy copy (see `step`)
                out[name] = np.take(host[:length].swapaxes(0, 1), env_idx, axis=0)
                continue
            src = part(buf)
            if src.is_cuda:
                staged[name] = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
                staged[name].copy_(src, non_blocking=True)
            else:
                staged[name] = src.clone(memory_format=torch.contiguous_format)
            pending.append(staged[name])
        for d in devices:
            if d.type == "cuda":
                torch.cuda.current_stream(d).synchronize()
        for name, tensor in staged.items():
            out[name] = tensor.numpy()
        del pending
        for name, t in converted.items():
            assert lease is not None  # a converted field has a layout
            dst = lease.array(*layout[name])
            ready = self._gather_converted(selected[name], t, dst, part)
            ready.previous = lease.arena.pending  # a shared arena's earlier gathers
            lease.arena.pending = ready  # a reuse of the arena waits for these copies
            out[name] = t.wrap(dst, ready)
        return {n: out[n] for n in selected if n in out}

    def _gather_converted(self, buf: torch.Tensor, transform: LeafTransform, dst: np.ndarray, part: Any) -> Any:
        """Convert on the current stream, copy to ``dst`` on a side stream, in chunks of envs; returns the
        `fastrecord.hostcopy.Landing` of the copies. A chunk's copies are enqueued as soon as the staging pieces
        they land in are pinned: in a fresh process the arena is still being pinned, and the first episodes'
        frames go out (their encoders wait for their own chunk, `Landing.wait_for`) while later pieces pin."""
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(buf.device)
        current = torch.cuda.current_stream(buf.device)
        landing = Landing()
        for lo, hi in chunks(dst.shape[0], buf[0, 0].numel() * buf.element_size() * dst.shape[1]):
            done = transform(part(buf, lo, hi)).contiguous()
            converted = torch.cuda.Event()
            converted.record(current)
            device_to_host(dst[lo:hi], done, self._copy_stream, converted, landing)
            del done
        return landing
