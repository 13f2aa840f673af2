"""The benchmark at tiny shapes on CPU, and the performance internals it relies on: staging memory,
GPU-side yuv420p conversion, encoder processes, codec auto-selection with its fallback."""

from __future__ import annotations

import gc
import json
import time

import av
import numpy as np
import pytest
import torch

from fastrecord import staging
from fastrecord.video import encode as video_mod
from fastrecord.buffer import EpisodeBuffer
from fastrecord.staging import StagingPool, Yuv420Frames, locate, rgb_to_yuv420p, yuv420p_to_rgb_numpy
from fastrecord.video import EncoderError, EncoderProcessPool, VideoSettings, decode_mp4, encode_mp4, resolve_codec
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


# ---------------------------------------------------------------------------------------------- encoders
@needs_shm
def test_encoder_process_matches_thread_encode_and_reads_staging_in_place(tmp_path):
    frames = smooth_frames(8)
    s = VideoSettings(crf=18, preset="ultrafast")
    encode_mp4(tmp_path / "thread.mp4", frames, VideoSettings(crf=18, preset="ultrafast", executor="thread"))
    pool = staging.StagingPool()
    lease = pool.lease(frames.nbytes)
    staged = lease.array(frames.shape)
    staged[:] = frames
    with EncoderProcessPool(max_processes=2, staging=pool) as enc:
        encode_mp4(tmp_path / "plain.mp4", frames, s, pool=enc)
        copied = enc.stats.copied_bytes
        encode_mp4(tmp_path / "staged.mp4", staged, s, pool=enc)
        assert enc.stats.copied_bytes == copied == frames.nbytes  # the staged one went without a copy
        yuv = Yuv420Frames(rgb_to_yuv420p(torch.from_numpy(frames)).numpy())
        encode_mp4(tmp_path / "yuv.mp4", yuv, s, pool=enc)
        assert enc.stats.jobs == 3 and enc.stats.frames == 24
    ref = decode_mp4(tmp_path / "thread.mp4")
    np.testing.assert_array_equal(decode_mp4(tmp_path / "plain.mp4"), ref)
    np.testing.assert_array_equal(decode_mp4(tmp_path / "staged.mp4"), ref)
    from_yuv = decode_mp4(tmp_path / "yuv.mp4")
    assert from_yuv.shape == frames.shape and psnr(from_yuv, frames) >= psnr(ref, frames) - 0.5
    assert not list(tmp_path.glob("*.part"))


@needs_shm
def test_encoder_process_errors_surface_in_the_caller(tmp_path):
    with EncoderProcessPool(max_processes=1) as enc:
        with pytest.raises(FileNotFoundError, match="encoder process"):
            enc.encode(tmp_path / "missing" / "x.mp4", smooth_frames(2), VideoSettings())
        # the process survived its job's error and still works
        enc.encode(tmp_path / "ok.mp4", smooth_frames(2), VideoSettings())
        assert (tmp_path / "ok.mp4").exists()


@needs_shm
def test_dead_encoder_process_raises_encoder_error_and_is_replaced(tmp_path, monkeypatch):
    with EncoderProcessPool(max_processes=1) as enc:
        enc.start(1)
        p = enc._idle[0]
        p.proc.kill()
        p.proc.wait()
        # an idle process found dead is replaced before use
        enc.encode(tmp_path / "a.mp4", smooth_frames(2), VideoSettings())
        # one that dies during a job fails that job with EncoderError, and is replaced afterwards
        q = enc._idle[0]
        q.proc.kill()
        q.proc.wait()
        monkeypatch.setattr(type(q), "alive", lambda self: True)
        with pytest.raises(EncoderError, match="died"):
            enc.encode(tmp_path / "b.mp4", smooth_frames(2), VideoSettings())
        monkeypatch.undo()
        enc.encode(tmp_path / "c.mp4", smooth_frames(2), VideoSettings())
        assert enc.num_processes == 1 and (tmp_path / "c.mp4").exists()
    enc.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        enc.encode(tmp_path / "d.mp4", smooth_frames(2), VideoSettings())


def test_encode_mp4_rejects_bad_frames_and_executor(tmp_path):
    with pytest.raises(ValueError, match=r"\[T, H, W, 3\] uint8"):
        encode_mp4(tmp_path / "x.mp4", np.zeros((2, 8, 8), np.uint8), VideoSettings())
    with pytest.raises(ValueError, match="executor"):
        encode_mp4(tmp_path / "x.mp4", smooth_frames(2), VideoSettings(executor="gpu"))


# ---------------------------------------------------------------------------------------------- codec choice
@pytest.fixture
def fresh_codec_cache(monkeypatch):
    monkeypatch.setattr(video_mod, "_resolved", {})


def test_auto_codec_falls_back_to_libx264_when_nvenc_cannot_encode(monkeypatch, fresh_codec_cache):
    monkeypatch.setattr(video_mod, "codec_available", lambda name: True)  # a build with NVENC compiled in
    monkeypatch.setattr(video_mod, "_nvenc_usable", lambda: False)  # ... on a GPU without an encoder (H200)
    assert resolve_codec("auto") == "libx264"


def test_auto_codec_picks_nvenc_where_it_encodes(monkeypatch, fresh_codec_cache):
    monkeypatch.setattr(video_mod, "codec_available", lambda name: True)
    monkeypatch.setattr(video_mod, "_nvenc_usable", lambda: True)
    assert resolve_codec("auto") == "h264_nvenc"


def test_auto_codec_on_this_machine_is_usable(fresh_codec_cache):
    # the real probe: here (no NVIDIA encoder) it must fall back, and what it returns must open
    codec = resolve_codec("auto")
    assert codec in ("h264_nvenc", "libx264")
    if not torch.cuda.is_available():
        assert codec == "libx264"


def test_nvenc_probe_is_false_without_nvenc():
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine may have NVENC")
    assert video_mod._nvenc_usable() is False


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
