"""Staging memory (leases of pinned shared-memory arenas, `locate`)."""

from __future__ import annotations

import gc
import threading
import time

import numpy as np
import pytest

from fastrecord import hostcopy, pinning, staging
from fastrecord.staging import StagingPool, locate

needs_shm = pytest.mark.skipif(not staging.shared_memory_supported(), reason="needs memfd + fd passing (Linux)")


# ---------------------------------------------------------------------------------------------- leases
@needs_shm
def test_staging_lease_released_when_last_view_dies_and_reused():
    pool = StagingPool(prefetch=False)
    lease = pool.lease(3 * 1024 * 1024)
    a = lease.array((4, 8, 8, 3))
    b = lease.array((10,), np.float32)
    view = a[1, :2]
    arena_id = lease.arena.id
    assert locate(view) == (lease.arena, view.ctypes.data - lease.arena.address)
    del lease, a, b
    gc.collect()
    assert pool.num_leased == 1  # `view` still reads it
    del view
    gc.collect()
    assert pool.num_leased == 0
    again = pool.lease(1024 * 1024)
    assert again.arena.id == arena_id and pool.arenas_created == 1
    del again
    pool.close()


@needs_shm
def test_staging_prefetch_makes_the_next_arena_ahead():
    pool = StagingPool(prefetch=True)
    first = pool.lease(1024 * 1024)
    deadline = time.time() + 10
    while pool.arenas_created < 2 and time.time() < deadline:
        time.sleep(0.01)
    assert pool.arenas_created == 2  # made on a background thread
    second = pool.lease(1024 * 1024)  # takes the prefetched one
    assert second.arena.id != first.arena.id
    del first, second
    gc.collect()
    pool.close()


@needs_shm
def test_staging_waits_for_a_release_beyond_max_arenas():
    pool = StagingPool(prefetch=False, max_arenas=1)
    first = pool.lease(1024 * 1024)
    got = []
    t = threading.Thread(target=lambda: got.append(pool.lease(1024 * 1024)))
    t.start()
    time.sleep(0.3)
    assert not got  # memory stays bounded: the second lease waits
    arena_id = first.arena.id
    del first
    gc.collect()
    t.join(timeout=10)
    assert got and got[0].arena.id == arena_id and pool.arenas_created == 1 and pool.wait_seconds > 0.2
    got.clear()
    gc.collect()
    pool.close()


@needs_shm
def test_small_shared_leases_share_one_arena_until_it_is_full():
    """A few episodes ending at one step take a region of the open shared arena, not an arena each; the
    arena returns to the pool once the pool moved on and every region's arrays are gone."""
    mib = 1024 * 1024
    pool = StagingPool(prefetch=False, share_bytes=64 * mib, min_bytes=256 * mib)
    regions = [pool.lease(5 * mib, shared=True) for _ in range(6)]
    arrays = [r.array((5 * mib,)) for r in regions]
    for i, a in enumerate(arrays):
        a[:] = i
    assert {r.arena.id for r in regions} == {regions[0].arena.id} and pool.arenas_created == 1
    assert [int(a[0]) for a in arrays] == list(range(6))  # regions do not overlap
    big = pool.lease(40 * mib, shared=True)  # more than half the shared size: an arena of its own
    assert big.arena.id != regions[0].arena.id
    more = [pool.lease(5 * mib, shared=True) for _ in range(12)]  # 18 x 5 MiB: a second shared arena
    assert len({r.arena.id for r in regions + more}) == 2
    first = regions[0].arena.id
    del regions, more, big
    gc.collect()
    assert pool.num_leased == 2 and first in pool._leased  # the arrays of the first shared arena still read it
    del arrays, a
    gc.collect()
    assert first not in pool._leased and pool.num_leased == 1  # the open shared arena stays with the pool
    pool.close()


@needs_shm
def test_byte_budget_makes_a_lease_wait_and_grows_with_the_largest_lease():
    mib = 1024 * 1024
    pool = StagingPool(prefetch=False, min_bytes=128 * mib, budget_factor=2.0, wait_timeout=30)
    a = pool.lease(60 * mib)  # 64 MiB arenas: two fit in the budget of 128 MiB
    b = pool.lease(60 * mib)
    got = []
    t = threading.Thread(target=lambda: got.append(pool.lease(60 * mib)))
    t.start()
    time.sleep(0.3)
    assert not got and pool.budget == 128 * mib  # memory bounded by bytes: the third waits for a release
    del a
    gc.collect()
    t.join(timeout=10)
    assert got and pool.arenas_created == 2
    big = pool.lease(200 * mib)  # grown on demand: the budget follows the largest lease
    assert pool.budget >= 2 * 200 * mib and pool.arenas_created == 3
    del b, big
    got.clear()
    gc.collect()
    pool.close()


@needs_shm
def test_reserve_makes_an_arena_ahead_on_a_background_thread():
    mib = 1024 * 1024
    pool = StagingPool()
    pool.reserve(100 * mib)
    deadline = time.time() + 10
    while pool.arenas_created < 1 and time.time() < deadline:
        time.sleep(0.01)
    lease = pool.lease(100 * mib)  # takes the one made ahead
    assert pool.arenas_created == 1 and lease.arena.size >= 100 * mib
    del lease
    gc.collect()
    pool.close()


# ---------------------------------------------------------------------------------------------- locate
def test_locate_ignores_ordinary_arrays():
    assert locate(np.zeros((4, 4), np.uint8)) is None


@needs_shm
def test_reserve_makes_several_arenas_at_once_and_leases_take_them():
    mib = 1024 * 1024
    pool = StagingPool(min_bytes=0)  # the budget: 2.5 x the largest lease (two 256 MiB arenas, not three)
    pool.reserve(250 * mib, count=2)  # one batch being filled while the encoders read the other
    deadline = time.time() + 10
    while pool.arenas_created < 2 and time.time() < deadline:
        time.sleep(0.01)
    assert pool.arenas_created == 2 and pool.bytes_reserved == 2 * 256 * mib
    a, b = pool.lease(250 * mib), pool.lease(250 * mib)  # both made ahead: no make on this thread
    assert a.arena.id != b.arena.id and pool.arenas_created == 2
    pool.reserve(250 * mib, count=2)  # both leased: a third is beyond the budget
    time.sleep(0.2)
    assert pool.arenas_created == 2
    del a, b
    gc.collect()
    pool.reserve(250 * mib, count=2)  # both free again: nothing to make
    time.sleep(0.2)
    assert pool.arenas_created == 2
    pool.close()


@needs_shm
def test_populate_allocates_every_page_of_an_arena_from_threads():
    arena = staging.Arena(64 * 1024 * 1024, pin=False)
    try:
        import os

        assert os.fstat(arena.fd).st_blocks * 512 < arena.size  # a fresh memfd holds no pages yet
        arena.buffer[::4096] = 7
        pinning.populate(arena.buffer, threads=4)
        assert os.fstat(arena.fd).st_blocks * 512 >= arena.size  # every page allocated (and zeroed)
        assert not arena.buffer.any()
    finally:
        arena.close()


# ---------------------------------------------------------------------------------------------- pinned piece by piece
@pytest.fixture
def fake_pinning(monkeypatch):
    """CUDA's page-locking stood in for (no GPU here): pieces of 1 MiB, each "registered" once ``gate`` allows it,
    noted in ``registered``; unregistrations noted in ``unregistered``."""
    state = dict(registered=[], unregistered=[], gate=threading.Semaphore(0), fail_at=None)

    def register(buffer, threads=None):
        state["gate"].acquire()
        if state["fail_at"] is not None and len(state["registered"]) == state["fail_at"]:
            return False
        state["registered"].append((buffer.ctypes.data, buffer.nbytes))
        return True

    monkeypatch.setattr(staging, "PIN_PIECE", 1024 * 1024)
    monkeypatch.setattr(pinning, "register", register)
    monkeypatch.setattr(pinning, "unregister", lambda address: state["unregistered"].append(address))
    return state


def test_piece_ranges_cut_at_the_pieces_borders(monkeypatch):
    monkeypatch.setattr(staging, "PIN_PIECE", 100)  # read by hostcopy at each call
    assert hostcopy.piece_ranges(30, 90) == [(30, 90)]
    assert hostcopy.piece_ranges(30, 250) == [(30, 100), (100, 200), (200, 250)]
    assert hostcopy.piece_ranges(100, 300) == [(100, 200), (200, 300)]
    assert hostcopy.piece_ranges(5, 5) == []


@needs_shm
def test_an_arena_pinned_piece_by_piece_runs_each_waiting_copy_once_its_piece_is_pinned(fake_pinning):
    """A fresh process's first staging arena: copies into its first pieces go out while the rest are pinned (the
    first 256 MiB in 0.06 s on the H100 machine, the whole 2.4 GiB in 0.57 s); each piece registered on its own
    and unregistered at close."""
    mib = 1024 * 1024
    arena = staging.Arena(4 * mib, "pieces")
    assert arena.pinning and arena.pinned and arena.pinned_upto == 0
    ran = []
    arena.when_pinned(mib // 2, lambda: ran.append(("a", arena.pinned_upto)))
    arena.when_pinned(3 * mib, lambda: ran.append(("b", arena.pinned_upto)))
    arena.when_pinned(2 * mib, lambda: ran.append(("c", arena.pinned_upto)))
    pinner = threading.Thread(target=arena.pin_pieces)
    pinner.start()
    fake_pinning["gate"].release()  # the first piece
    deadline = time.time() + 10
    while not ran and time.time() < deadline:
        time.sleep(0.01)
    assert ran == [("a", mib)]  # the others wait for their pieces
    for _ in range(3):
        fake_pinning["gate"].release()
    pinner.join(10)
    assert ran == [("a", mib), ("c", 2 * mib), ("b", 3 * mib)]
    assert not arena.pinning and arena.pinned and arena.pinned_upto == 4 * mib
    assert [n for _, n in fake_pinning["registered"]] == [mib] * 4
    arena.when_pinned(4 * mib, lambda: ran.append(("now", arena.pinned_upto)))  # pinned: runs here, at once
    assert ran[-1] == ("now", 4 * mib)
    arena.wait_pinned(4 * mib)
    addresses = [a for a, _ in fake_pinning["registered"]]
    arena.close()
    assert fake_pinning["unregistered"] == addresses  # each piece, as registered


@needs_shm
def test_a_piece_that_cannot_be_pinned_leaves_the_rest_unpinned_and_frees_the_waiting_copies(fake_pinning):
    mib = 1024 * 1024
    fake_pinning["fail_at"] = 1
    arena = staging.Arena(3 * mib, "pieces")
    ran = []
    arena.when_pinned(3 * mib, lambda: ran.append(arena.pinned_upto))
    for _ in range(3):
        fake_pinning["gate"].release()
    arena.pin_pieces()
    assert ran == [mib] and not arena.pinned and not arena.pinning  # the copy ran (into pageable memory)
    arena.wait_pinned(3 * mib)  # does not wait for pieces that will never be pinned
    arena.close()
    assert len(fake_pinning["unregistered"]) == 1


@needs_shm
def test_a_reserved_arena_is_leased_while_its_pieces_are_still_being_pinned(fake_pinning):
    pool = StagingPool()
    pool.reserve(3 * 1024 * 1024, pin=True, count=1)
    deadline = time.time() + 10
    while pool.bytes_reserved == 0 and time.time() < deadline:
        time.sleep(0.01)
    (reserved,) = pool._free
    lease = pool.lease(3 * 1024 * 1024, pin=True)  # no piece pinned yet: leased at once all the same
    assert lease.arena is reserved and reserved.pinning and reserved.pinned_upto == 0
    for _ in range(256):  # its pieces, and those of the arena the pool makes ahead (64 MiB each, 1 MiB a piece)
        fake_pinning["gate"].release()
    reserved.wait_pinned(reserved.size)
    assert reserved.pinned and not reserved.pinning
    del lease
    gc.collect()
    pool.close()


def test_a_landing_waits_for_the_copies_into_one_view_only():
    """An episode's encoder waits for the copies into its own frames (`Yuv420Frames.wait_ready`), not the batch's."""
    landing = hostcopy.Landing()
    first, second = landing.add(0, 100), landing.add(100, 200)
    first.done()
    landing.wait_for(10, 50)  # only the first copy: done
    threading.Timer(0.2, second.done).start()
    t0 = time.perf_counter()
    landing.wait_for(90, 20)  # overlaps the second: waits for it
    assert time.perf_counter() - t0 >= 0.1
    failed = hostcopy.Landing()
    failed.previous = landing
    failed.add(200, 300).done(error=OSError("boom"))
    with pytest.raises(RuntimeError, match="a copy into staging memory failed: boom"):
        failed.synchronize()
    landing.synchronize()
