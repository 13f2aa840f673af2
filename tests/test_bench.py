"""The benchmark at tiny shapes on CPU, and the performance internals it relies on: staging memory,
GPU-side yuv420p conversion, the episode buffer's gather, writer backpressure. (Encoding, encoder processes
and codec choice are tested in test_video.py.)"""

from __future__ import annotations

import gc
import json
import time

import av
import numpy as np
import pytest
import torch

from fastrecord import staging
from fastrecord.buffer import EpisodeBuffer
from fastrecord.staging import StagingPool, Yuv420Frames, locate, rgb_to_yuv420p, yuv420p_to_rgb_numpy
from fastrecord.workers import WorkerPool

needs_shm = pytest.mark.skipif(not staging.shared_memory_supported(), reason="needs memfd + fd passing (Linux)")


def smooth_frames(t: int = 6, h: int = 32, w: int = 48, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    steps = rng.integers(-3, 4, size=(t, h, w, 3))
    return np.clip(np.cumsum(steps, axis=2) + 128, 0, 255).astype(np.uint8)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    return 10 * np.log10(255.0**2 / np.mean((a.astype(np.float64) - b) ** 2))


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


# ---------------------------------------------------------------------------------------------- staging
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
    import threading

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


def test_locate_ignores_ordinary_arrays():
    assert locate(np.zeros((4, 4), np.uint8)) is None


# ---------------------------------------------------------------------------------------------- gather
def _filled_buffer(n: int = 3, steps: int = 4, size: int = 32) -> tuple[EpisodeBuffer, torch.Tensor]:
    buf = EpisodeBuffer(n, steps + 1)
    frames = torch.from_numpy(np.stack([smooth_frames(steps + 1, size, size, seed=e) for e in range(n)]))
    big = torch.arange(n * 40000, dtype=torch.float32).reshape(n, 40000)  # pushes the gather past 1 MiB
    buf.start(np.arange(n), {"frames": frames[:, 0], "obs/big": big})
    for t in range(1, steps + 1):
        buf.step({"frames": frames[:, t], "obs/big": big + t})
    return buf, frames


def test_gather_returns_buffer_contents_in_staging_memory():
    buf, frames = _filled_buffer()
    out = buf.gather(np.array([2, 0]))
    np.testing.assert_array_equal(out["frames"], frames.numpy()[[2, 0]])
    assert out["obs/big"][0, 3, 0] == 2 * 40000 + 3
    if staging.shared_memory_supported():
        assert locate(out["frames"][1]) is not None  # encoder processes read it in place
    # yuv420p is a CUDA-buffer option: on a CPU buffer the frames stay RGB
    assert not isinstance(buf.gather(np.arange(3), yuv420p=("frames",))["frames"], Yuv420Frames)


def test_gather_small_fields_skip_staging():
    buf = EpisodeBuffer(2, 3)
    buf.start(np.arange(2), {"success": torch.zeros(2, dtype=torch.bool)})
    buf.step({"success": torch.tensor([True, False])})
    out = buf.gather(np.arange(2), names=["success"])
    assert out["success"][:, 1].tolist() == [True, False] and locate(out["success"]) is None


@pytest.mark.gpu
def test_gather_yuv420p_on_cuda_matches_cpu_conversion():
    buf, frames = _filled_buffer()
    big = torch.zeros(3, 200000, device="cuda")  # pushes the gather past the staging threshold
    gpu = EpisodeBuffer(3, 5)
    gpu.start(np.arange(3), {"frames": frames[:, 0].cuda(), "obs/big": big})
    for t in range(1, 5):
        gpu.step({"frames": frames[:, t].cuda(), "obs/big": big})
    out = gpu.gather(np.array([1, 2]), yuv420p=("frames",))["frames"]
    assert isinstance(out, Yuv420Frames) and out.frame_size == (32, 32)
    out.wait_ready()
    diff = np.abs(out.view(np.ndarray).astype(int) - rgb_to_yuv420p(frames[[1, 2]], kernel="torch").numpy())
    assert diff.max() <= 1 and (diff > 0).mean() < 0.01  # float rounding between the kernels


# ---------------------------------------------------------------------------------------------- workers
def test_worker_pool_counts_backpressure_wait():
    def slow(job):
        time.sleep(0.05)

    with WorkerPool(slow, num_workers=1, max_pending=1) as pool:
        for i in range(4):
            pool.submit(i)
        pool.wait_until_done()
        assert pool.blocked_seconds > 0.03


# ---------------------------------------------------------------------------------------------- benchmark
def test_bench_smoke_tiny_cpu(tmp_path, capsys):
    from fastrecord.commands.bench import BenchConfig, format_table, run_bench

    cfg = BenchConfig(num_envs=4, width=32, height=32, episode_steps=4, batches=2, device="cpu", content="gradient",
                      workers=2, baseline_steps=2, sweep=("ultrafast:20",), sweep_episodes=2, ceiling_episodes=2,
                      keepup_batches=1, skip=("realenv",), json=str(tmp_path / "bench.json"))
    r = run_bench(cfg, log=lambda m: None)
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["summary"]["speedup"] == pytest.approx(r["summary"]["speedup"])
    fr = r["fastrecord"]
    assert fr["episodes"] == 8 and fr["videos_written"] == 8
    assert fr["dropped_frames"] == 0 and fr["bad_videos"] == 0 and fr["psnr_db"] > 30
    assert r["maniskill"]["env_frames_per_s"] > 0 and r["maniskill"]["psnr_db"] > 30
    assert r["ceiling"]["ceiling_fps"] == pytest.approx(r["ceiling"]["one_process_fps_yuv420p"] * 2)
    assert r["quality"]["rows"][0]["psnr_db"] > 30
    assert "slowdown" in r["keepup"] and "ring_write_device_ms" in r["micro"]
    table = format_table(r)
    assert "ratio fastrecord / ManiSkill" in table and "encode ceiling" in table


def test_bench_cli_rejects_unknown_phase():
    from fastrecord.commands.bench import BenchConfig, run_bench

    with pytest.raises(ValueError, match="unknown phase"):
        run_bench(BenchConfig(skip=("warp",)))
