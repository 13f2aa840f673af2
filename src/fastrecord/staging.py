"""Host staging memory that encoder processes can read in place.

`StagingPool` owns reusable host arenas: anonymous shared memory (``memfd``) mapped in this process and,
on CUDA machines, page-locked with ``cudaHostRegister`` so device-to-host copies are DMA. An arena is
leased to one `EpisodeBuffer.gather` call and returns to the pool when the last array viewing it is
garbage collected, so the costly pinning (about 2 s for 2.5 GB) happens once per arena, not once per
batch. Encoder processes map the same arena (its file descriptor is passed over a socket) and read the
frames without a copy.

This module imports only the standard library and numpy at import time (torch lazily): encoder
processes import it.
"""

from __future__ import annotations

import bisect
import itertools
import mmap
import os
import threading
import time
import weakref
from typing import Any, cast

import numpy as np

from fastrecord import pinning

MiB = 1024**2
_ARENA_ALIGN = 64 * MiB  # arenas are sized in these steps, so similar batches reuse one arena
_FIELD_ALIGN = 4096  # each field of a lease starts on a page


def shared_memory_supported() -> bool:
    """memfd arenas need Linux (os.memfd_create) and fd passing over Unix sockets."""
    import socket

    return hasattr(os, "memfd_create") and hasattr(socket, "send_fds") and hasattr(socket, "AF_UNIX")


class Arena:
    """Owns: one shared mapping (memfd + mmap) and its CUDA host registration, if any.

    ``pin="pieces"``: the mapping is made now and pinned later, piece by piece (`pin_pieces`, `PIN_PIECE` bytes each,
    registered separately), so copies can land in the first pieces while the rest are pinned. A device-to-host copy
    must then stay inside one piece (a copy across two registrations is refused: "invalid argument", seen on the H100
    machine) and wait for its piece: `when_pinned`, or `fastrecord.hostcopy.device_to_host`, which does both."""

    _ids = itertools.count()

    def __init__(self, size: int, pin: bool | str) -> None:
        self.id = next(Arena._ids)
        self.size = size
        self.fd = os.memfd_create(f"fastrecord-{os.getpid()}-{self.id}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, size)
            self.mm = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise
        self.buffer: np.ndarray | None = np.frombuffer(self.mm, dtype=np.uint8)  # exports the mapping; close() drops it
        self.address = self.buffer.ctypes.data
        self.pending: Any = None  # event of an asynchronous copy into this arena, awaited before reuse
        self._cond = threading.Condition()
        self._registered: list[int] = []  # addresses registered with CUDA: the arena's, or each piece's
        self._waiting: list[tuple[int, Any]] = []  # (end offset, callback) until the pieces up to there are pinned
        self._closing = False
        if pin == "pieces":
            self.pinned = True  # to be: pieces are pinned in order (`pin_pieces`); False if a registration fails
            self.pinned_upto = 0  # bytes from the start pinned so far
            self.pinning = True
        else:
            self.pinned = bool(pin) and pinning.register(self.buffer)
            self._registered = [self.address] if self.pinned else []
            self.pinned_upto = size
            self.pinning = False

    def pin_pieces(self, populate_threads: int | None = None) -> None:
        """Pin a ``pin="pieces"`` arena, piece after piece (its pages populated first: `fastrecord.pinning`),
        running the callbacks waiting for each piece (`when_pinned`) as it is done; on the caller's thread. A piece
        that cannot be registered leaves it and the rest unpinned (copies into them go through pageable memory)."""
        buf = self.buffer
        ok = buf is not None
        lo = 0
        while lo < self.size and ok:
            hi = min(lo + PIN_PIECE, self.size)
            with self._cond:
                if self._closing:
                    break
            assert buf is not None  # close() waits for this loop to stop before it drops the buffer
            ok = pinning.register(buf[lo:hi], populate_threads)
            with self._cond:
                if ok:
                    self._registered.append(self.address + lo)
                    self.pinned_upto = hi
                ready = [w for w in self._waiting if w[0] <= hi or not ok]
                self._waiting = [w for w in self._waiting if w[0] > hi and ok]
                self._cond.notify_all()
            for _, fn in ready:
                fn()
            lo = hi
        with self._cond:
            if self.pinned_upto < self.size:
                self.pinned = False
            self.pinning = False
            rest, self._waiting = self._waiting, []
            self._cond.notify_all()
        for _, fn in rest:
            fn()

    def when_pinned(self, end: int, fn: Any) -> None:
        """Run ``fn()`` once the pieces up to byte ``end`` are pinned (or pinning stopped): now, on this thread, if
        they are; else on the pinning thread, right after the piece."""
        with self._cond:
            if self.pinning and end > self.pinned_upto:
                self._waiting.append((end, fn))
                return
        fn()

    def wait_pinned(self, end: int) -> None:
        """Block until the pieces up to byte ``end`` are pinned (or pinning stopped)."""
        with self._cond:
            self._cond.wait_for(lambda: not self.pinning or self.pinned_upto >= end)

    def close(self) -> None:
        with self._cond:  # a pinning thread stops after its current piece
            self._closing = True
            self._cond.wait_for(lambda: not self.pinning)
        for hook in list(_close_hooks):
            fn = hook()
            if fn is None:
                _close_hooks.discard(hook)
            else:
                fn(self.id)
        for address in self._registered:  # never an address not registered (an arena closed before its first piece)
            pinning.unregister(address)
        self._registered = []
        self.pinned = False
        self.buffer = None
        try:
            self.mm.close()
        except BufferError:  # a view still exists (a leaked lease): the OS frees it at exit
            pass
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


PIN_PIECE = 256 * MiB  # bytes of an arena pinned at once (`Arena.pin_pieces`): the first in 0.06 s on the H100 machine


_close_hooks: set[weakref.WeakMethod] = set()


def on_arena_close(method: Any) -> None:
    """Call ``method(arena_id)`` (a bound method, held weakly) before any arena is unmapped."""
    _close_hooks.add(weakref.WeakMethod(method))


# live arenas by start address, so an array can be traced back to the arena (and offset) it views
_registry_lock = threading.Lock()
_registry_starts: list[int] = []
_registry: dict[int, Arena] = {}


def _register(arena: Arena) -> None:
    with _registry_lock:
        bisect.insort(_registry_starts, arena.address)
        _registry[arena.address] = arena


def _unregister(arena: Arena) -> None:
    with _registry_lock:
        i = bisect.bisect_left(_registry_starts, arena.address)
        if i < len(_registry_starts) and _registry_starts[i] == arena.address:
            del _registry_starts[i]
        _registry.pop(arena.address, None)


def locate(array: np.ndarray) -> tuple[Arena, int] | None:
    """(arena, byte offset) when ``array`` is a C-contiguous view of a live staging arena, else None."""
    if not isinstance(array, np.ndarray) or not array.flags.c_contiguous:
        return None
    addr = array.ctypes.data
    with _registry_lock:
        i = bisect.bisect_right(_registry_starts, addr) - 1
        if i < 0:
            return None
        arena = _registry[_registry_starts[i]]
    offset = addr - arena.address
    if offset + array.nbytes > arena.size:
        return None
    return arena, offset


class Lease:
    """A leased arena. Arrays made by `array` view it; the arena goes back to its pool once the lease
    and every array viewing it are gone."""

    def __init__(self, pool: StagingPool, arena: Arena) -> None:
        self.arena = arena
        # the one array every array of this lease views (numpy collapses view chains onto it, since its
        # own base is not an ndarray): when it is collected, no view of the lease is left
        self._root = np.frombuffer(arena.mm, dtype=np.uint8)
        self._cursor = 0
        weakref.finalize(self._root, pool._release, arena)

    @property
    def pinned(self) -> bool:
        return self.arena.pinned

    @property
    def room(self) -> int:
        """Bytes not yet handed out."""
        return self.arena.size - self._cursor

    def array(self, shape: tuple[int, ...], dtype: Any = np.uint8) -> np.ndarray:
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        start = self._cursor
        if start + nbytes > self.arena.size:
            raise MemoryError(f"staging lease of {self.arena.size} bytes cannot hold {nbytes} more at offset {start}")
        self._cursor = _round_up(start + nbytes, _FIELD_ALIGN)
        return self._root[start : start + nbytes].view(dtype).reshape(shape)

    def sub(self, nbytes: int) -> SubLease:
        """The next ``nbytes`` of this lease as a lease of their own (the arena is shared by both)."""
        start = self._cursor
        self.array((nbytes,))
        return SubLease(self, start, nbytes)


class SubLease:
    """A region of a shared arena (`StagingPool.lease` with ``shared=True``): arrays carved from it view
    the arena, which returns to its pool once every region's arrays are gone and the pool moved on."""

    def __init__(self, parent: Lease, start: int, size: int) -> None:
        self.arena = parent.arena
        self._root = parent._root[start : start + size]
        self._cursor = 0
        self.size = size

    @property
    def pinned(self) -> bool:
        return self.arena.pinned

    def array(self, shape: tuple[int, ...], dtype: Any = np.uint8) -> np.ndarray:
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        start = self._cursor
        if start + nbytes > self.size:
            raise MemoryError(f"staging region of {self.size} bytes cannot hold {nbytes} more at offset {start}")
        self._cursor = _round_up(start + nbytes, _FIELD_ALIGN)
        return self._root[start : start + nbytes].view(dtype).reshape(shape)


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def _arena_size(want: int) -> int:
    return max(_round_up(want, _ARENA_ALIGN), _ARENA_ALIGN)


class StagingPool:
    """Owns: the staging arenas, leased or free, and the open shared arena that small leases are carved
    from. Free arenas are reused (smallest that fits first); at most ``max_cached_bytes`` of free arenas
    are kept, larger excess is unmapped.

    Memory is sized to what is in flight and grown on demand: arenas are made when a lease finds none
    free, up to a byte budget (``max_bytes``; by default ``budget_factor`` x the largest lease asked for,
    at least ``min_bytes``), beyond which a lease waits for a release (backpressure: the encoders set
    the pace). Small leases (``shared=True``, at most half of ``share_bytes``: a few episodes ending at
    one step) share one arena until it is full, instead of taking an arena each: one pinning, one
    mapping in each encoder process, for many groups of finished episodes.
    """

    def __init__(self, max_cached_bytes: int = 16 * 1024 * MiB, prefetch: bool = True, max_arenas: int | None = None,
                 wait_timeout: float = 60.0, max_bytes: int | None = None, min_bytes: int = 2048 * MiB,
                 budget_factor: float = 2.5, share_bytes: int = 512 * MiB) -> None:
        self.max_cached_bytes = max_cached_bytes
        self.prefetch = prefetch  # make the next arena ahead of need, on a background thread
        self.max_arenas = max_arenas  # leases wait for a release beyond this many arenas (None: no count limit)
        self.max_bytes = max_bytes  # ... or beyond this many bytes of arenas (None: budget_factor x largest lease)
        self.min_bytes = min_bytes  # the automatic byte budget is at least this
        self.budget_factor = budget_factor
        self.share_bytes = share_bytes  # size of the arenas that small leases share
        self.largest_lease = 0
        self.wait_timeout = wait_timeout  # ... for at most this long, then make one more
        self.wait_seconds = 0.0  # time lease() waited for a release (backpressure)
        self.over_limit = 0  # arenas made past max_arenas after a timed-out wait
        self._making_here = 0
        self._making_bytes = 0  # bytes of arenas being made (counted in the budget)
        self._lock = threading.Lock()
        self._made = threading.Condition(self._lock)
        self._making = 0  # arenas being made on background threads
        self._free: list[Arena] = []
        self._leased: dict[int, Arena] = {}
        self._shared: dict[bool, Lease] = {}  # pin -> the open shared arena's lease
        self._share_lock = threading.Lock()
        self.arenas_created = 0
        self.bytes_pinned_total = 0
        self.make_seconds = 0.0  # time spent making (mapping, pinning) arenas, on any thread
        self._closed = False

    @property
    def budget(self) -> int:
        """Bytes of arenas (leased or free) beyond which a lease waits for a release."""
        if self.max_bytes is not None:
            return self.max_bytes
        return max(self.min_bytes, int(self.budget_factor * self.largest_lease))

    def lease(self, nbytes: int, pin: bool = False, shared: bool = False) -> Lease | SubLease:
        """An arena of at least ``nbytes``; ``pin`` asks for CUDA page-locked memory (when CUDA works).

        ``shared``: a lease of at most half of ``share_bytes`` is a region of the open shared arena (a
        `SubLease`), which is leased like any other when a region does not fit in the open one.

        When the arenas reach the budget (bytes, and ``max_arenas`` if set) and all are leased, this
        waits for one to come back (the encoders set the pace; memory stays flat), up to
        ``wait_timeout`` seconds, after which it makes one more rather than deadlock on a caller that
        keeps its arrays. When no free arena would be left for another lease of this size, one more is
        made (and pinned) on a background thread, so a steady stream of leases finds it ready instead of
        paying the pinning (about 0.7 s per GB) on the caller's thread.
        """
        want = nbytes + _FIELD_ALIGN * 64
        if shared and want <= self.share_bytes // 2:
            with self._share_lock:
                open_ = self._shared.get(pin)
                if open_ is None or open_.room < want:
                    self._shared.pop(pin, None)  # the pool moves on: the old arena returns once its regions die
                    open_ = cast(Lease, self.lease(self.share_bytes - _FIELD_ALIGN * 64, pin))  # not shared: whole
                    self._shared[pin] = open_
                return open_.sub(want)
        size = _arena_size(want)
        with self._lock:
            self.largest_lease = max(self.largest_lease, want)
        t0 = time.perf_counter()
        make = False
        evicted: list[Arena] = []
        with self._lock:
            while True:
                arena = self._take_free(want, pin)
                if arena is not None:
                    break
                full = self._full_locked(want)
                if full and self._free:  # a free arena too small (or unpinned): unmap it to make room
                    evicted.append(self._free.pop(self._free.index(min(self._free, key=lambda a: a.size))))
                    continue
                if not full and not self._making:
                    make = True
                    self._making_here += 1
                    self._making_bytes += size
                    break
                if time.perf_counter() - t0 > self.wait_timeout:
                    make = True
                    self._making_here += 1
                    self._making_bytes += size
                    self.over_limit += 1
                    break
                self._made.wait(timeout=0.5)  # a release or a background arena is on its way
            waited = time.perf_counter() - t0
        for a in evicted:
            _unregister(a)
            a.close()
        if arena is not None and arena.pending is not None:  # its last lease was dropped mid-copy
            arena.pending.synchronize()
            arena.pending = None
        if arena is None:  # make: none free, and room made for one (or waited past wait_timeout)
            try:
                arena = self._make(want, pin)
            finally:
                with self._lock:
                    self._making_here -= 1
                    self._making_bytes -= size
        with self._lock:
            self.wait_seconds += waited if not make else 0.0
            self._leased[arena.id] = arena
            if self.prefetch and self._take_free(want, pin, peek=True) is None:
                self._make_ahead_locked(_arena_size(want), pin)  # sized to the lease, not to a larger arena it took
        return Lease(self, arena)

    def reserve(self, nbytes: int, pin: bool = False, count: int = 1) -> None:
        """Leases of ``nbytes`` are coming (say, the first batches of episodes): make ``count`` arenas for
        them now, less the free ones that fit (within the budget, which counts them), on background threads at
        once. Two are what a stream of such leases holds: one being filled, one being encoded. Both are made at
        once, while a fresh process's encoders have no work yet (made one after the other, the second was pinned
        while the encoders worked and its populating threads took their cores: H100 machine, 2026-12-06). Each is
        leasable as soon as it is mapped, its pages pinned piece by piece (`Arena.pin_pieces`)."""
        want = nbytes + _FIELD_ALIGN * 64
        with self._lock:
            self.largest_lease = max(self.largest_lease, want)
            have = sum(1 for a in self._free if a.size >= want and (a.pinned or not pin))
            for _ in range(count - have):
                self._make_ahead_locked(_round_up(want, _ARENA_ALIGN), pin, limit=count)

    def _make_ahead_locked(self, size: int, pin: bool, limit: int = 1) -> None:
        """Start making an arena of ``size`` on a background thread, unless ``limit`` are being made already,
        the budget is reached, or the free arenas would exceed ``max_cached_bytes``."""
        if self.prefetch and self._making < limit and not self._full_locked(size) \
                and self._reserved_locked() + self._making_bytes + size <= self.max_cached_bytes:
            self._making += 1
            self._making_bytes += _arena_size(size)
            threading.Thread(target=self._make_ahead, args=(size, pin), daemon=True, name="fastrecord-staging").start()

    def _count_locked(self) -> int:
        return len(self._free) + len(self._leased) + self._making + self._making_here

    def _full_locked(self, want: int) -> bool:
        """Would one more arena of ``want`` bytes exceed the budget (or the arena count)?"""
        if self.max_arenas is not None and self._count_locked() >= self.max_arenas:
            return True
        if self._count_locked() == 0:
            return False  # the first arena is always allowed, however large
        in_flight = self._reserved_locked() + self._making_bytes
        return in_flight + _arena_size(want) > self.budget

    def _take_free(self, want: int, pin: bool, peek: bool = False) -> Arena | None:
        fits = [a for a in self._free if a.size >= want and (a.pinned or not pin)]
        if not fits:
            return None
        arena = min(fits, key=lambda a: a.size)
        if not peek:
            self._free.remove(arena)
        return arena

    def _make(self, want: int, pin: bool) -> Arena:
        """A new arena of ``want`` bytes, mapped; its pieces pinned on a thread of its own (the caller leases it at
        once: copies wait for their pieces)."""
        t0 = time.perf_counter()
        arena = Arena(_arena_size(want), "pieces" if pin else False)
        _register(arena)
        with self._lock:
            self.make_seconds += time.perf_counter() - t0
            self.arenas_created += 1
        if arena.pinning:
            try:
                threading.Thread(target=self._pin, args=(arena, True), daemon=True,
                                 name="fastrecord-staging-pin").start()
            except RuntimeError:  # no thread can start: pinned here, before the lease (a waiting copy would hang)
                self._pin(arena, False)
        return arena

    def _pin(self, arena: Arena, background: bool) -> None:
        """Pin ``arena`` piece by piece, on this thread; ``background`` (a thread of its own): at the encoders'
        priority, which its populating threads inherit (at the caller's, they took the cores of the encoders that
        had started on the first pieces)."""
        from fastrecord.processes import background_nice, lower_priority

        if background:
            try:
                lower_priority(background_nice())  # this thread only (Linux: a niceness is a thread's)
            except ValueError:  # a bad FASTRECORD_BACKGROUND_NICE: the encoders raise it
                pass
        t0 = time.perf_counter()
        arena.pin_pieces()
        with self._lock:
            self.make_seconds += time.perf_counter() - t0
            if arena.pinned:
                self.bytes_pinned_total += arena.size

    def _make_ahead(self, size: int, pin: bool) -> None:
        try:
            arena = self._make(size, pin)  # leasable once mapped: its pieces are pinned on a thread of its own
            with self._lock:
                self._free.append(arena)
        except Exception:  # noqa: BLE001 - only an optimisation; lease() makes its own
            pass
        finally:
            with self._lock:
                self._making -= 1
                self._making_bytes -= _arena_size(size)
                self._made.notify_all()

    def _reserved_locked(self) -> int:
        return sum(a.size for a in self._free) + sum(a.size for a in self._leased.values())

    def _release(self, arena: Arena) -> None:
        with self._lock:
            self._leased.pop(arena.id, None)
            if self._closed:
                drop = [arena]
            else:
                self._free.append(arena)
                drop = []
            self._made.notify_all()
        for a in drop:
            _unregister(a)
            a.close()
        self._trim()

    def _trim(self) -> None:
        with self._lock:
            drop = []
            while self._free and sum(a.size for a in self._free) > self.max_cached_bytes:
                drop.append(self._free.pop(self._free.index(min(self._free, key=lambda a: a.size))))
        for a in drop:
            _unregister(a)
            a.close()

    @property
    def bytes_reserved(self) -> int:
        """Bytes of all arenas, leased or free."""
        with self._lock:
            return self._reserved_locked()

    @property
    def num_leased(self) -> int:
        with self._lock:
            return len(self._leased)

    def close(self) -> None:
        """Unmap free arenas now; leased ones are unmapped when released. Idempotent."""
        with self._share_lock:
            self._shared.clear()  # the open shared arena returns once its regions die
        with self._lock:
            self._closed = True
            drop, self._free = self._free, []
        for a in drop:
            _unregister(a)
            a.close()


_default_pool: StagingPool | None = None
_default_lock = threading.Lock()


def default_staging_pool() -> StagingPool:
    """The process-wide pool that `EpisodeBuffer.gather` and the encoders share."""
    global _default_pool
    with _default_lock:
        if _default_pool is None:
            _default_pool = StagingPool()
        return _default_pool


# ---------------------------------------------------------------------------------------------- a helper process's side
# The arenas a helper process (an encoder, a LeRobot part process) has mapped from the caller, by id: the caller
# sends each arena's memfd once (``map_arena``), then only (arena id, offset, shape) of the frames to read.
_mapped: dict[int, mmap.mmap] = {}


def map_arena(arena_id: int, size: int, fd: int) -> None:
    """Map a staging arena (its memfd ``fd``, which this takes over) read-only in this helper process."""
    try:
        _mapped[arena_id] = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
    finally:
        os.close(fd)


def forget_arena(arena_id: int) -> None:
    """Unmap an arena the caller is unmapping (a frame array still viewing it keeps it until collected)."""
    mm = _mapped.pop(arena_id, None)
    if mm is not None:
        try:
            mm.close()
        except BufferError:  # a view of it is still alive: unmapped when collected
            pass


def mapped_frames(arena_id: int, offset: int, shape: tuple[int, ...]) -> np.ndarray:
    """The uint8 frames of ``shape`` at ``offset`` of a mapped arena, read in place."""
    return np.frombuffer(_mapped[arena_id], dtype=np.uint8, count=int(np.prod(shape)), offset=offset).reshape(shape)
