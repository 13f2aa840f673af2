"""Staging memory (leases of pinned shared-memory arenas, `locate`) and the RGB -> yuv420p conversion."""

from __future__ import annotations

import gc
import threading
import time

import av
import numpy as np
import pytest
import torch

from fastrecord import staging
from fastrecord.staging import StagingPool, locate, rgb_to_yuv420p, yuv420p_to_rgb_numpy
from fastrecord.testing import psnr, smooth_frames

needs_shm = pytest.mark.skipif(not staging.shared_memory_supported(), reason="needs memfd + fd passing (Linux)")






# ---------------------------------------------------------------------------------------------- yuv420p
def test_rgb_to_yuv420p_matches_libswscale_luma():
    rgb = smooth_frames(2)
    mine = rgb_to_yuv420p(torch.from_numpy(rgb)).numpy()
    assert mine.shape == (2, 48, 48)
    for i in range(2):
        ref = av.VideoFrame.from_ndarray(rgb[i], format="rgb24").reformat(format="yuv420p").to_ndarray()
        assert np.abs(ref[:32].astype(int) - mine[i, :32]).max() <= 1  # Y plane: rounding only
        assert np.abs(ref[32:].astype(int) - mine[i, 32:]).mean() < 2  # chroma: another 2x2 filter
    # as faithful as libswscale's own conversion (chroma subsampling loses the same detail)
    sws = np.stack([av.VideoFrame.from_ndarray(f, format="rgb24").reformat(format="yuv420p").to_ndarray() for f in rgb])
    assert psnr(yuv420p_to_rgb_numpy(mine), rgb) >= psnr(yuv420p_to_rgb_numpy(sws), rgb) - 0.3


def test_rgb_to_yuv420p_rejects_odd_sizes():
    with pytest.raises(ValueError, match="even H and W"):
        rgb_to_yuv420p(torch.zeros(1, 3, 4, 3, dtype=torch.uint8))


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


# ---------------------------------------------------------------------------------------------- locate
def test_locate_ignores_ordinary_arrays():
    assert locate(np.zeros((4, 4), np.uint8)) is None
