"""Video encoding (fastrecord.video.encode), encoder processes (fastrecord.video.pool) and the RGB -> yuv420p
conversion (fastrecord.video.yuv): settings checked up front, encodes in a thread and in encoder processes,
fractional frame rates, publishing that never replaces a file, codec auto-selection with its fallback."""

from __future__ import annotations

import errno
import os
import threading
import time
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest
import torch

from fastrecord import staging
from fastrecord.testing import frame_psnr, psnr, smooth_frames
from fastrecord.video import (
    EncoderError,
    EncoderProcessPool,
    VideoSettings,
    check_video_settings,
    decode_mp4,
    encode_mp4,
    resolve_codec,
)
from fastrecord.video import encode as video_mod
from fastrecord.video.yuv import Yuv420Frames, rgb_to_yuv420p, yuv420p_to_rgb_numpy

needs_shm = pytest.mark.skipif(not staging.shared_memory_supported(), reason="needs memfd + fd passing (Linux)")
EXECUTORS = ["thread", pytest.param("process", marks=needs_shm)]






@pytest.fixture
def encoder_pool():
    pool = EncoderProcessPool(max_processes=2) if staging.shared_memory_supported() else None
    yield pool
    if pool is not None:
        pool.close()


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
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs an affinity mask (Linux)")
def test_encoder_pool_is_capped_at_the_affinity_masks_cores(monkeypatch):
    # taskset / a container's cpuset narrow the cores this process may use: the pool counts those, not the machine's
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(before)})
    try:
        with EncoderProcessPool() as enc:
            assert enc.max_processes == 1
    finally:
        os.sched_setaffinity(0, before)
    with EncoderProcessPool() as enc:
        assert enc.max_processes == len(before)


@needs_shm
def test_encoder_process_errors_surface_in_the_caller(tmp_path):
    with EncoderProcessPool(max_processes=1) as enc:
        with pytest.raises(FileNotFoundError, match="No such file") as info:
            enc.encode(tmp_path / "missing" / "x.mp4", smooth_frames(2), VideoSettings())
        assert info.value.errno == errno.ENOENT
        assert (
            "raised in the encoder process" in info.value.__notes__[0] and "encode_here" in info.value.remote_traceback
        )
        # the process survived its job's error and still works
        enc.encode(tmp_path / "ok.mp4", smooth_frames(2), VideoSettings())
        assert (tmp_path / "ok.mp4").exists()


@needs_shm
def test_encoder_pool_hands_out_the_longest_idle_process(tmp_path):
    """Videos one after the other go to each process in turn (the longest idle first), so every process has
    encoded (mapped the staging memory, drawn text, opened the codec) before a close needs all of them at once."""
    with EncoderProcessPool(max_processes=3) as enc:
        enc.start(3)
        assert enc.wait_started(30)
        for i in range(3):
            assert enc.encode(tmp_path / f"{i}.mp4", smooth_frames(2), VideoSettings()) == tmp_path / f"{i}.mp4"
        assert enc.num_processes == 3
        assert all(p.arenas for p in enc._all)  # each of the three encoded one video
    for i in range(3):
        assert decode_mp4(tmp_path / f"{i}.mp4").shape == smooth_frames(2).shape


@needs_shm
def test_dead_encoder_process_raises_encoder_error_and_is_replaced(tmp_path, monkeypatch):
    with EncoderProcessPool(max_processes=1) as enc:
        enc.start(1)
        assert enc.wait_started(30)
        p = enc._idle[0].process
        p.proc.kill()
        p.proc.wait()
        # an idle process found dead is replaced before use
        enc.encode(tmp_path / "a.mp4", smooth_frames(2), VideoSettings())
        # one that dies during a job fails that job with EncoderError, and is replaced afterwards
        q = enc._idle[0].process
        q.proc.kill()
        q.proc.wait()
        monkeypatch.setattr(type(q), "alive", lambda self: True)
        with pytest.raises(
            EncoderError,
            match=r"the encoder process \(pid \d+\) was killed by signal SIGKILL \(9\) while encoding .*b\.mp4",
        ):
            enc.encode(tmp_path / "b.mp4", smooth_frames(2), VideoSettings())
        monkeypatch.undo()
        enc.encode(tmp_path / "c.mp4", smooth_frames(2), VideoSettings())
        assert enc.num_processes == 1 and (tmp_path / "c.mp4").exists()
    enc.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        enc.encode(tmp_path / "d.mp4", smooth_frames(2), VideoSettings())


def test_encode_mp4_rejects_bad_frames(tmp_path):
    with pytest.raises(ValueError, match=r"\[T, H, W, 3\] uint8"):
        encode_mp4(tmp_path / "x.mp4", np.zeros((2, 8, 8), np.uint8), VideoSettings())


# ---------------------------------------------------------------------------------------------- settings
@pytest.mark.parametrize(
    "field, value, match",
    [
        ("fps", 0, r"video_fps=0 must be a positive number of frames per second \(e\.g\. 30"),
        ("fps", -30, r"video_fps=-30 must be a positive number of frames per second"),
        ("fps", -7.5, r"video_fps=-7\.5 must be a positive number"),
        ("fps", Fraction(-1, 2), r"video_fps=Fraction\(-1, 2\) must be a positive number"),
        ("fps", float("nan"), r"video_fps=nan must be a positive number"),
        ("fps", float("inf"), r"video_fps=inf must be a positive number"),
        ("fps", True, r"video_fps=True must be a positive number"),
        ("fps", "30", r"video_fps='30' must be a positive number"),
        ("fps", 1e-5, r"video_fps=1e-05 is below .*1/1001 frames per second.*use at least 1/1001"),
        ("codec", "aac", r"video_codec='aac' is an audio encoder, not a video encoder; use 'libx264' .* or 'auto'"),
        ("codec", "h265_magic", r"video codec 'h265_magic' is not available.*use 'libx264'.*'auto'"),
        ("codec", None, r"video_codec=None must be an encoder name; use 'libx264' or 'auto'"),
        (
            "codec",
            "mjpeg",
            r"video_codec='mjpeg' with pix_fmt='yuv420p'.*failed a trial encode.*Non full-range YUV"
            r".*use video_codec='libx264' or 'auto'",
        ),
        ("crf", 52, r"video_crf=52 must be an integer from 0 to 51 for libx264.*\(e\.g\. 23\)"),
        ("crf", -1, r"video_crf=-1 must be an integer from 0 to 51 for libx264"),
        ("crf", 23.5, r"video_crf=23\.5 must be an integer from 0 to 51"),
        ("crf", "23", r"video_crf='23' must be an integer"),
        ("crf", False, r"video_crf=False must be an integer"),
        (
            "preset",
            "turbo",
            r"video_preset='turbo' is not a libx264 preset; use one of ultrafast, superfast, .*placebo",
        ),
        ("preset", "p4", r"video_preset='p4' is not a libx264 preset"),
        ("threads", 0, r"video_threads=0 must be an integer >= 1"),
        ("threads", 1.5, r"video_threads=1\.5 must be an integer >= 1"),
        ("pix_fmt", "yuv42Op", r"video_pix_fmt='yuv42Op' is not a pixel format libav knows; use e\.g\. 'yuv420p'"),
        (
            "pix_fmt",
            "rgb24",
            r"video_pix_fmt='rgb24' is not one libx264 encodes; use one of yuv420p, .*\(e\.g\. 'yuv420p'\)",
        ),
        ("executor", "gpu", r"video_executor='gpu' is unknown; use one of auto, process, thread"),
    ],
)
def test_check_video_settings_rejects(field, value, match, tmp_path):
    settings = VideoSettings(**{field: value})
    with pytest.raises(ValueError, match=match):
        check_video_settings(settings)
    # encode_mp4 checks before anything is written
    with pytest.raises(ValueError, match=match):
        encode_mp4(tmp_path / "x.mp4", smooth_frames(2), settings)
    assert not list(tmp_path.iterdir())


def test_check_video_settings_accepts_and_resolves_auto():
    assert check_video_settings(VideoSettings()) == VideoSettings()
    resolved = check_video_settings(VideoSettings(codec="auto", fps=Fraction(30000, 1001)))
    assert resolved.codec == resolve_codec("auto") and resolved.fps == Fraction(30000, 1001)
    for preset in video_mod.X264_PRESETS[:3]:
        check_video_settings(VideoSettings(preset=preset, crf=0))
    check_video_settings(VideoSettings(codec="mjpeg", pix_fmt="yuvj420p"))  # the pixel format mjpeg takes
    check_video_settings(VideoSettings(fps=np.float32(12.5), crf=np.int64(51), threads=2))


def test_check_video_settings_trial_encodes_once_per_settings(monkeypatch):
    monkeypatch.setattr(video_mod, "_checked", {})
    calls = []
    real = video_mod._encode_to
    monkeypatch.setattr(video_mod, "_encode_to", lambda *a: (calls.append(a[2]), real(*a))[1])
    for _ in range(3):
        check_video_settings(VideoSettings(crf=20))
    assert len(calls) == 1 and isinstance(calls[0].fps, int)
    check_video_settings(VideoSettings(crf=21))
    assert len(calls) == 2
    for _ in range(2):  # a failing verdict is cached too
        with pytest.raises(ValueError, match="failed a trial encode"):
            check_video_settings(VideoSettings(codec="mjpeg"))
    assert len(calls) == 3
    # fps=True hashes like fps=1, but the field checks run on every call, before the cache
    check_video_settings(VideoSettings(fps=1))
    with pytest.raises(ValueError, match="video_fps=True"):
        check_video_settings(VideoSettings(fps=True))
    assert av.logging.get_level() is None  # the trial's log capture left PyAV's logging as it was


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("fps, rate", [(7.5, Fraction(15, 2)), (Fraction(15, 2), Fraction(15, 2)),
                                       (29.97, Fraction(2997, 100)), (Fraction(30000, 1001), Fraction(30000, 1001)),
                                       (10, Fraction(10))])
def test_fractional_fps_encodes_at_that_rate(tmp_path, executor, fps, rate, encoder_pool):
    frames = smooth_frames(9)
    out = encode_mp4(tmp_path / "v.mp4", frames, VideoSettings(fps=fps, crf=18, executor=executor), pool=encoder_pool)
    with av.open(str(out)) as container:
        stream = container.streams.video[0]
        assert stream.average_rate == rate
        decoded = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
    assert len(decoded) == 9 and psnr(np.stack(decoded), frames) > 30


# ---------------------------------------------------------------------------------------------- publishing
@pytest.mark.parametrize("executor", EXECUTORS)
def test_existing_video_is_never_replaced(tmp_path, executor, encoder_pool):
    old = tmp_path / "0_env0_success.mp4"
    old.write_bytes(b"an earlier run's video")
    settings = VideoSettings(executor=executor)
    frames = smooth_frames(4)
    first = encode_mp4(old, frames, settings, pool=encoder_pool)
    second = encode_mp4(old, frames, settings, pool=encoder_pool)
    assert old.read_bytes() == b"an earlier run's video"
    assert first == tmp_path / "0_env0_success_1.mp4" and second == tmp_path / "0_env0_success_2.mp4"
    assert decode_mp4(first).shape == decode_mp4(second).shape == frames.shape
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0_env0_success.mp4", "0_env0_success_1.mp4",
                                                          "0_env0_success_2.mp4"]


@needs_shm
def test_encoder_pool_returns_the_path_written(tmp_path):
    (tmp_path / "a.mp4").write_bytes(b"x")
    with EncoderProcessPool(max_processes=1) as enc:
        assert enc.encode(tmp_path / "b.mp4", smooth_frames(2), VideoSettings()) == tmp_path / "b.mp4"
        assert enc.encode(str(tmp_path / "a.mp4"), smooth_frames(2), VideoSettings()) == tmp_path / "a_1.mp4"
    assert (tmp_path / "a.mp4").read_bytes() == b"x"


def test_same_name_from_two_threads_gives_two_videos(tmp_path):
    settings = VideoSettings(executor="thread")
    frames = [smooth_frames(30, 64, 64, seed=s) for s in (1, 2)]
    out: dict[int, object] = {}
    threads = [
        threading.Thread(target=lambda i=i: out.__setitem__(i, encode_mp4(tmp_path / "v.mp4", frames[i], settings)))
        for i in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(p.name for p in out.values()) == ["v.mp4", "v_1.mp4"]
    for i in range(2):  # each file holds its own frames, whole: as an encode alone makes them
        alone = encode_mp4(tmp_path / f"alone{i}.mp4", frames[i], settings)
        np.testing.assert_array_equal(decode_mp4(out[i]), decode_mp4(alone))


@pytest.mark.parametrize("err", [errno.EPERM, errno.EXDEV, errno.ENOTSUP])
def test_publish_without_hard_links_reserves_the_name(tmp_path, monkeypatch, err):
    def no_links(src, dst):
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(video_mod.os, "link", no_links)
    (tmp_path / "v.mp4").write_bytes(b"old")
    out = encode_mp4(tmp_path / "v.mp4", smooth_frames(3), VideoSettings(executor="thread"))
    assert out == tmp_path / "v_1.mp4" and (tmp_path / "v.mp4").read_bytes() == b"old"
    assert decode_mp4(out).shape[0] == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v.mp4", "v_1.mp4"]


def test_publish_raises_other_link_errors_and_cleans_up(tmp_path, monkeypatch):
    def broken(src, dst):
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(video_mod.os, "link", broken)
    with pytest.raises(OSError, match="I/O error"):
        encode_mp4(tmp_path / "v.mp4", smooth_frames(3), VideoSettings(executor="thread"))
    assert not list(tmp_path.iterdir())


def test_failed_encode_leaves_no_part_file(tmp_path, monkeypatch):
    calls = []

    def wrap_then_fail(img, format):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("encoder failed mid-video")
        return av.VideoFrame.from_ndarray(np.ascontiguousarray(img), format=format)

    check_video_settings(VideoSettings(executor="thread"))  # the trial encode before the patch
    monkeypatch.setattr(video_mod, "_wrap", wrap_then_fail)
    with pytest.raises(RuntimeError, match="mid-video"):
        encode_mp4(tmp_path / "v.mp4", smooth_frames(5), VideoSettings(executor="thread"))
    assert len(calls) == 3 and not list(tmp_path.iterdir())


# ---------------------------------------------------------------------------------------------- codec choice
@pytest.fixture
def fresh_codec_cache(monkeypatch):
    monkeypatch.setattr(video_mod, "_resolved", {})


def test_auto_codec_falls_back_to_libx264_when_nvenc_cannot_encode(monkeypatch, fresh_codec_cache):
    monkeypatch.setattr(video_mod, "codec_available", lambda name: True)  # a build with NVENC compiled in
    monkeypatch.setattr(video_mod, "nvenc_usable", lambda: False)  # ... on a GPU without an encoder (H200)
    assert resolve_codec("auto") == "libx264"


def test_auto_codec_picks_nvenc_where_it_encodes(monkeypatch, fresh_codec_cache):
    monkeypatch.setattr(video_mod, "codec_available", lambda name: True)
    monkeypatch.setattr(video_mod, "nvenc_usable", lambda: True)
    assert resolve_codec("auto") == "h264_nvenc"


def test_prefetch_probes_once_on_a_thread_and_the_recorders_call_waits_for_it(monkeypatch, fresh_codec_cache):
    """`prefetch_codec` (the commands and make_eval_envs, before their envs are made): the NVENC probe runs on a
    thread, once; a later resolve_codec waits for it instead of probing again. Only "auto" is probed."""
    import threading

    started, release, probes = threading.Event(), threading.Event(), []

    def slow_probe():
        probes.append(threading.current_thread().name)
        started.set()
        release.wait(5)
        return False

    monkeypatch.setattr(video_mod, "codec_available", lambda name: True)
    monkeypatch.setattr(video_mod, "nvenc_usable", slow_probe)
    video_mod.prefetch_codec("libx264", None)  # nothing to probe
    assert not started.wait(0.2) and probes == []
    video_mod.prefetch_codec("libx264", "auto")
    assert started.wait(5)
    threading.Timer(0.2, release.set).start()
    assert resolve_codec("auto") == "libx264"  # waited for the prefetch's answer
    assert probes == ["fastrecord-codec-probe"]
    video_mod.prefetch_codec("auto")  # resolved already: no thread
    assert probes == ["fastrecord-codec-probe"]


def test_with_an_nvidia_driver_the_prefetch_probes_in_a_helper_process(monkeypatch, fresh_codec_cache):
    """Opening NVENC holds the GIL of the process that probes (0.43 s on the H100 machine): with a driver loaded,
    the prefetch's thread asks a helper process instead, and answers what the probe here answers."""
    probes = []

    def elsewhere():
        probes.append(threading.current_thread().name)
        return False

    monkeypatch.setattr(video_mod, "codec_available", lambda name: True)
    monkeypatch.setattr(video_mod, "nvidia_driver_present", lambda: True)
    monkeypatch.setattr(video_mod, "nvenc_usable", lambda: pytest.fail("probed in the caller's process"))
    monkeypatch.setattr(video_mod, "nvenc_usable_elsewhere", elsewhere)
    video_mod.prefetch_codec("auto")
    assert resolve_codec("auto") == "libx264"
    assert probes == ["fastrecord-codec-probe"]


@needs_shm
def test_the_helper_processs_nvenc_probe_answers_as_this_ones():
    # asked without the fallback that takes any failure for "no NVENC": a helper that cannot answer raises here
    assert video_mod.ask_helper(video_mod.nvenc_usable) is video_mod.nvenc_usable()
    assert video_mod.nvenc_usable_elsewhere() is video_mod.nvenc_usable()
    from fastrecord.processes import parent_alive

    assert video_mod.ask_helper(parent_alive) is True  # ran in a child of this process


def test_a_prefetch_that_fails_leaves_the_error_to_the_recorders_call(monkeypatch, fresh_codec_cache):
    monkeypatch.setattr(video_mod, "codec_available", lambda name: False)  # a PyAV build without H.264 encoders
    video_mod.prefetch_codec("auto")
    with pytest.raises(ValueError, match=r"codec='auto' found no H.264 encoder.*pip install av"):
        resolve_codec("auto")


def test_auto_codec_on_this_machine_is_usable(fresh_codec_cache):
    # the real probe: here (no NVIDIA encoder) it must fall back, and what it returns must open
    codec = resolve_codec("auto")
    assert codec in ("h264_nvenc", "libx264")
    if not torch.cuda.is_available():
        assert codec == "libx264"


def test_nvenc_probe_is_false_without_nvenc():
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine may have NVENC")
    assert video_mod.nvenc_usable() is False


def _pil_overlay(frames: np.ndarray, overlay) -> np.ndarray:
    """The overlay as PIL draws it (the implementation before glyph caching): text on a dark RGBA band,
    alpha-composited over each frame."""
    from PIL import Image, ImageDraw, ImageFont

    from fastrecord.video.overlay import OVERLAY_MAX_FRACTION, overlay_lines

    out = np.array(frames, copy=True)
    h, w = out.shape[1:3]
    size = max(8, min(16, round(16 * h / 256)))
    face = ImageFont.truetype(overlay.font, size=size)
    line_h, margin = size + max(1, size // 4), max(2, size // 4)
    max_lines = max(1, int(OVERLAY_MAX_FRACTION * h) // line_h)
    max_chars = max(4, int((w - 2 * margin) // max(1.0, face.getlength("0"))))
    for s, info in enumerate(overlay):
        if not info:
            continue
        lines = overlay_lines(info, max_lines, max_chars)
        width = int(max(face.getlength(t) for t in lines))
        bw, bh = min(w, width + 2 * margin + 1), min(h, len(lines) * line_h + margin + 1)
        region = Image.fromarray(np.ascontiguousarray(out[s, :bh, :bw])).convert("RGBA")
        band = Image.new("RGBA", (bw, bh), (0, 0, 0, 110))
        draw = ImageDraw.Draw(band)
        for i, text in enumerate(lines):
            draw.text((margin, margin // 2 + i * line_h), text, fill=(0, 255, 0, 255), font=face)
        out[s, :bh, :bw] = np.asarray(Image.alpha_composite(region, band).convert("RGB"))
    return out


@pytest.mark.parametrize("size", [100, 128, 256, 512])
def test_overlay_from_cached_glyphs_is_pils_picture(size):
    """draw_overlay composes cached glyph masks with numpy (FreeType rendered every line of every frame:
    ~1 ms a line); the picture is PIL's: at most a few pixels of a glyph's edge differ by more than 2."""
    from fastrecord.video.overlay import Overlay, draw_overlay, maniskill_font

    rng = np.random.default_rng(size)
    t = 12
    frames = rng.integers(0, 256, (t + 1, size, size, 3), dtype=np.uint8)
    cols = {
        "success": rng.random(t) > 0.5,
        "fail": np.zeros(t, bool),
        "reward": rng.random(t).astype(np.float32),
        "elapsed_steps": np.arange(1, t + 1),
        "tcp_to_obj_dist": rng.random(t),
        "very_long_key_name_for_cut": rng.random(t),
    }
    ov = Overlay.of_episode(cols, maniskill_font())
    ours, pil = draw_overlay(frames, ov), _pil_overlay(frames, ov)
    diff = np.abs(ours.astype(int) - pil.astype(int)).max(-1)
    assert (diff > 2).sum() <= 0.002 * diff.size and np.array_equal(ours[0], frames[0])
    assert diff[:, size // 2 :].max() == 0  # below the band: untouched


@pytest.mark.parametrize("size", [64, 130, 512])
def test_overlay_on_yuv420p_is_the_rgb_overlay_converted(size):
    """Frames converted to yuv420p on the GPU keep that form with the info text: draw_overlay composites the band on
    the planes. The luma is the RGB picture's converted (within rounding); the chroma is too wherever the band's
    alpha is even over a 2x2 block, and differs at a few glyph edges only; the rest of the frame is untouched."""
    from fastrecord.video.overlay import Overlay, draw_overlay, maniskill_font

    rng = np.random.default_rng(size)
    t = 9
    frames = smooth_frames(t + 1, size, size, seed=size)
    cols = {"success": rng.random(t) > 0.5, "reward": rng.random(t).astype(np.float32), "elapsed_steps": np.arange(t)}
    ov = Overlay.of_episode(cols, maniskill_font())
    yuv = rgb_to_yuv420p(torch.from_numpy(frames)).numpy()
    want = rgb_to_yuv420p(torch.from_numpy(draw_overlay(frames, ov))).numpy()
    got = draw_overlay(yuv, ov, fmt="yuv420p")
    assert got.shape == yuv.shape and got.dtype == np.uint8
    diff = np.abs(got.astype(int) - want.astype(int))
    assert diff[:, :size].max() <= 1  # Y
    assert (diff[:, size:] > 2).sum() <= 0.01 * diff[:, size:].size  # U, V: glyph edges
    assert frame_psnr(got, want).min() > 45
    assert np.array_equal(got[0], yuv[0])  # the reset frame has no text
    assert not np.array_equal(got[1], yuv[1])
    assert np.array_equal(got[:, size // 2 : size], yuv[:, size // 2 : size])  # luma below the band: untouched
    with pytest.raises(ValueError, match="fmt='bgr24'"):
        draw_overlay(frames, ov, fmt="bgr24")


@pytest.mark.parametrize("executor", EXECUTORS)
def test_yuv420p_frames_with_an_overlay_encode_as_the_rgb_ones(tmp_path, executor, encoder_pool):
    """An `Overlay` with `Yuv420Frames` is drawn where the video is encoded (an encoder process, or this thread):
    the video is that of the frames drawn on in RGB, then converted."""
    from fastrecord.video.overlay import Overlay, draw_overlay, maniskill_font

    frames = smooth_frames(12, 256, 320, seed=3)
    ov = Overlay.of_episode({"success": np.arange(11) > 6, "reward": np.linspace(0, 1, 11)}, maniskill_font())

    def yuv(rgb: np.ndarray) -> Yuv420Frames:
        return Yuv420Frames(rgb_to_yuv420p(torch.from_numpy(rgb)).numpy())

    settings = VideoSettings(executor=executor, crf=12)
    got = decode_mp4(encode_mp4(tmp_path / "yuv.mp4", yuv(frames), settings, pool=encoder_pool, overlay=ov))
    want = decode_mp4(encode_mp4(tmp_path / "rgb.mp4", yuv(draw_overlay(frames, ov)), settings, pool=encoder_pool))
    assert got.shape == want.shape == frames.shape
    assert frame_psnr(got, want).min() > 42
    top = got[1:, :40, :80].astype(int)  # green text in the band of every frame after the reset
    assert (((top[..., 1] > 150) & (top[..., 0] < 100)).sum(axis=(1, 2)) > 20).all()


def test_mp4_sink_draws_a_callers_per_frame_info_on_either_kind_of_frames(tmp_path):
    """A sink's caller may hand per-frame dicts as the overlay (not an `Overlay`): the writer thread draws them on RGB
    frames and on `Yuv420Frames` alike, and both videos are as close to the RGB drawing as each other."""
    from fastrecord.episode import EpisodeData
    from fastrecord.sinks.base import RunDirectory
    from fastrecord.sinks.mp4 import Mp4Sink
    from fastrecord.video.overlay import draw_overlay, maniskill_font

    yy, xx = np.mgrid[0:256, 0:320]  # smooth both ways: yuv420p's halved chroma keeps it
    frames = np.stack([np.stack([xx * 0.7 + 3 * t, yy * 0.9 + t, (xx + yy) * 0.35], -1) for t in range(6)]).astype(np.uint8)
    infos = [{}] + [{"success": i > 3, "reward": 0.25 * i} for i in range(1, 6)]
    yuv = Yuv420Frames(rgb_to_yuv420p(torch.from_numpy(frames)).numpy())
    sink = Mp4Sink(VideoSettings(fps=10, crf=12), num_envs=2, workers=2, info_on_video=True)
    run = RunDirectory(tmp_path, "t").open()
    sink.open(run)
    try:
        sink.submit([EpisodeData(episode_id=i, env_idx=i, elapsed_steps=5, datasets={}, meta={}, frames=f,
                                 overlay=infos) for i, f in enumerate((frames, yuv))])
        sink.wait_until_done()
    finally:
        sink.close()
        run.close(status="closed")
    want = draw_overlay(frames, infos, font=maniskill_font())
    (rgb_path,) = tmp_path.glob("0_env0*.mp4")
    (yuv_path,) = tmp_path.glob("1_env1*.mp4")
    got_rgb, got_yuv = decode_mp4(rgb_path), decode_mp4(yuv_path)
    assert got_rgb.shape == got_yuv.shape == frames.shape
    near_rgb, near_yuv = frame_psnr(got_rgb, want), frame_psnr(got_yuv, want)
    assert near_rgb.min() > 30 and near_yuv.min() > 30 and np.abs(near_rgb - near_yuv).max() < 1.5
    assert (frame_psnr(got_yuv[1:, :40], frames[1:, :40]) < 25).all()  # the text's band, on every frame after the reset


# ---------------------------------------------------------------------------------------------- names
@pytest.mark.parametrize("episode_id, env_idx, success, part, name", [
    (3, 1, True, None, "3_env1_success.mp4"),
    (3, 1, False, None, "3_env1_failure.mp4"),
    (12, 0, None, None, "12_env0.mp4"),
    (7, 2, True, 1, "7_env2_success_part1.mp4"),
    (7, 2, None, 0, "7_env2_part0.mp4"),
])
def test_video_names_round_trip(episode_id, env_idx, success, part, name):
    from fastrecord.sinks.mp4 import video_name
    from fastrecord.sinks.video_names import VideoName, parse_video_name

    assert video_name(episode_id, env_idx, success, part) == name
    expect = VideoName(episode_id, env_idx, success, part)
    assert parse_video_name(name) == parse_video_name(name[:-4]) == expect
    assert parse_video_name(name[:-4] + "_2.mp4") == expect  # a taken name's suffix


def test_tiled_and_foreign_video_names():
    from fastrecord.sinks.video_names import VideoName, parse_video_name, tiled_video_name

    assert tiled_video_name(4) == "4.mp4" and parse_video_name("4.mp4") == VideoName(4)
    assert not parse_video_name("4.mp4").per_env
    for other in ("clip.mp4", "3_env.mp4", "3_envx_success.mp4", "env1_3.mp4", "3_env1_maybe.mp4"):
        assert parse_video_name(other) is None, other


def test_rgb_to_yuv420p_in_pieces_strided_and_any_default_dtype_equals_one_pass_and_the_exact_rounding(
        monkeypatch):
    from fastrecord.video import yuv

    frames = torch.from_numpy(np.stack([smooth_frames(3, 16, 24, seed=s) for s in range(5)]))  # [5, 3, 16, 24, 3]
    whole = rgb_to_yuv420p(frames)
    monkeypatch.setattr(yuv, "_PIECE_BYTES", frames[0].numel() * 2)  # 2 envs at a time
    np.testing.assert_array_equal(rgb_to_yuv420p(frames).numpy(), whole.numpy())
    # a ring buffer's [steps, envs] read as [envs, steps] (the gather's strided view), into a given output
    ring = frames.transpose(0, 1).contiguous()
    out = torch.empty_like(whole)
    assert rgb_to_yuv420p(ring.transpose(0, 1), out=out) is out
    np.testing.assert_array_equal(out.numpy(), whole.numpy())
    # a caller's default dtype changes nothing (its temporaries stay float32)
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        np.testing.assert_array_equal(rgb_to_yuv420p(frames).numpy(), whole.numpy())
    finally:
        torch.set_default_dtype(before)
    # every value is BT.601 limited range rounded to nearest, computed in float64 (a float32 sum off by one
    # at an exact .5 is the only difference allowed)
    x = frames.double().numpy()
    h, w = x.shape[-3:-1]
    ys = x @ np.array(yuv._Y) + 16
    m = x.reshape(5, 3, h // 2, 2, w // 2, 2, 3).mean(axis=(3, 5))
    us, vs = m @ np.array(yuv._U) + 128, m @ np.array(yuv._V) + 128
    got = whole.numpy().reshape(5, 3, -1).astype(int)
    want = np.concatenate([np.floor(p + 0.5).reshape(5, 3, -1) for p in (ys, us, vs)], axis=-1).astype(int)
    diff = np.abs(got - want)
    assert diff.max() <= 1 and (diff > 0).mean() < 1e-3


@needs_shm
def test_encoder_pool_close_stops_every_process():
    enc = EncoderProcessPool(max_processes=4)
    enc.start(4)
    assert enc.wait_started(30)
    procs = [p.process for p in enc._all]
    enc.close()
    assert len(procs) == 4 and all(p.poll() is not None for p in procs)


@needs_shm
def test_first_videos_encode_here_until_the_fork_server_has_forked_an_encoder(tmp_path, monkeypatch):
    """With a fork server (the default on Linux 5.3+): until its first encoder is forked (the server imports PyAV
    first), a video of executor "auto" is encoded in the calling thread; then in the forked processes, ready at once."""
    from fastrecord.processes import ForkServer, fork_server_supported

    if not fork_server_supported():
        pytest.skip("fork servers need Linux 5.3+ (pidfds)")
    gate = threading.Event()  # holds the server back: it is still importing PyAV
    fork = ForkServer.fork
    monkeypatch.setattr(ForkServer, "fork", lambda self, *a: (gate.wait(20), fork(self, *a))[1])
    frames = smooth_frames(6)
    with EncoderProcessPool(max_processes=2) as enc:
        enc.start(2)
        enc.encode(tmp_path / "here.mp4", frames, VideoSettings(crf=18))  # no encoder yet: this thread
        assert enc.stats.jobs_here == 1 and enc.num_processes == 0
        gate.set()
        assert enc.wait_started(30) and enc.num_processes == 2
        server = enc.fork_server()
        assert server is not None
        for p in enc._all:  # forked by the server, ready without a probe
            assert p.ready.is_set()
            stat = Path(f"/proc/{p.process.pid}/stat").read_text()
            assert int(stat.rsplit(")", 1)[1].split()[1]) == server._proc.pid
        enc.encode(tmp_path / "proc.mp4", frames, VideoSettings(crf=18))
        assert enc.stats.jobs_here == 1 and enc.stats.jobs == 2
    assert not server.alive()  # the pool's close stopped it, after its encoders
    for name in ("here.mp4", "proc.mp4"):
        assert decode_mp4(tmp_path / name).shape == frames.shape


@needs_shm
def test_first_videos_encode_in_the_calling_thread_while_the_processes_start(tmp_path, monkeypatch):
    """Where encoders are fresh interpreters (no fork server: not Linux 5.3+), the first videos are encoded in the
    calling thread while they import PyAV."""
    from fastrecord.video import pool as vpool

    gate = threading.Event()  # holds the processes' "ready" back: they are still importing PyAV
    ready = vpool._await_ready
    monkeypatch.setattr(vpool, "_await_ready", lambda e: (gate.wait(20), ready(e)))
    monkeypatch.setattr(vpool, "fork_server_supported", lambda: False)  # fresh interpreters: they import PyAV
    frames = smooth_frames(6)
    with EncoderProcessPool(max_processes=2) as enc:
        enc.start(2)
        enc.encode(tmp_path / "here.mp4", frames, VideoSettings(crf=18))  # none ready: this thread encodes
        assert enc.wait_started(30)
        assert enc.stats.jobs_here == 1 and enc.stats.copied_bytes == 0 and enc.num_processes == 2
        enc.encode(tmp_path / "proc.mp4", frames, VideoSettings(crf=18, executor="process"))  # waits for one
        assert enc.stats.jobs_here == 1 and enc.stats.copied_bytes == frames.nbytes
        gate.set()
        deadline = time.time() + 20
        while not all(p.ready.is_set() for p in enc._all) and time.time() < deadline:
            time.sleep(0.01)
        enc.encode(tmp_path / "ready.mp4", frames, VideoSettings(crf=18))  # ready: a process
        assert enc.stats.jobs == 3 and enc.stats.jobs_here == 1
    encode_mp4(tmp_path / "thread.mp4", frames, VideoSettings(crf=18, executor="thread"))
    ref = decode_mp4(tmp_path / "thread.mp4")
    for name in ("here.mp4", "proc.mp4", "ready.mp4"):
        np.testing.assert_array_equal(decode_mp4(tmp_path / name), ref)  # the same encoder, the same file


@pytest.mark.parametrize("path", ["record", "make_eval_envs"])
def test_the_commands_probe_the_codec_while_their_envs_are_made(path, monkeypatch, fresh_codec_cache, tmp_path):
    """`fastrecord record` and `make_eval_envs` start codec "auto"'s probe before they make their envs (on the H200
    machine it took 0.66 s, with a driver loaded): the probe ran on the prefetch's thread, and
    every video was still written."""
    probes = []

    def probe():
        probes.append(threading.current_thread().name)
        return False

    monkeypatch.setattr(video_mod, "codec_available", lambda name: True)
    monkeypatch.setattr(video_mod, "nvenc_usable", probe)
    if path == "record":
        from fastrecord.commands.cli import main

        assert main(["record", "PickCube-v1", "--episodes", "1", "--max-episode-steps", "3", "--width", "32",
                     "--height", "32", "--output-dir", str(tmp_path)]) == 0
    else:
        from fastrecord import make_eval_envs

        kw = dict(obs_mode="state", render_mode="rgb_array", max_episode_steps=3,
                  human_render_camera_configs=dict(width=32, height=32))
        envs = make_eval_envs("PickCube-v1", 1, "physx_cpu", kw, dict(obs_horizon=1), video_dir=str(tmp_path))
        envs.reset(seed=0)
        for _ in range(3):
            envs.step(envs.action_space.sample())
        envs.close()
    assert probes == ["fastrecord-codec-probe"]
    assert len(list(tmp_path.rglob("*.mp4"))) == 1


def test_a_recorder_is_made_while_the_codec_probe_runs_and_its_first_video_waits_for_it(monkeypatch, fresh_codec_cache,
                                                                                         tmp_path):
    """A RecordEpisode made directly (no command prefetched the probe) with codec "auto": its construction does not
    wait for the NVENC probe (0.46 s on the H100 machine, most of a fresh recorder's construction); the probe runs
    once on its thread, and the first video, encoded with what it chose, waits for its answer."""
    import gymnasium as gym
    import mani_skill.envs  # noqa: F401 - registers PickCube-v1

    from fastrecord import RecordEpisode

    probes, release = [], threading.Event()

    def slow_probe():
        probes.append(threading.current_thread().name)
        release.wait(10)
        return False

    monkeypatch.setattr(video_mod, "nvenc_usable", slow_probe)
    monkeypatch.setattr(video_mod, "codec_available", lambda name: True)  # a PyAV build with NVENC compiled in
    env = gym.make("PickCube-v1", obs_mode="state", render_mode="rgb_array", max_episode_steps=3,
                   human_render_camera_configs=dict(width=32, height=32))
    t0 = time.perf_counter()
    env = RecordEpisode(env, str(tmp_path), save_trajectory=False)
    assert time.perf_counter() - t0 < 5 and not release.is_set()  # made while the probe still ran
    env.reset(seed=0)
    for _ in range(3):
        env.step(env.action_space.sample())
    threading.Timer(0.3, release.set).start()
    env.close()  # the video waited for the probe's answer
    assert probes == ["fastrecord-codec-probe"]
    (video,) = tmp_path.glob("*.mp4")
    with av.open(str(video)) as c:
        assert c.streams.video[0].codec_context.name == "h264" and c.streams.video[0].frames == 4


def test_a_bad_video_option_with_codec_auto_fails_at_construction_without_probing(monkeypatch, fresh_codec_cache,
                                                                                   tmp_path):
    import gymnasium as gym
    import mani_skill.envs  # noqa: F401

    from fastrecord import RecordEpisode

    probes = []
    monkeypatch.setattr(video_mod, "nvenc_usable", lambda: probes.append(1) or False)
    env = gym.make("PickCube-v1", obs_mode="state", render_mode="rgb_array",
                   human_render_camera_configs=dict(width=32, height=32))
    with pytest.raises(ValueError, match=r"video_crf=99 must be an integer from 0 to 51"):
        RecordEpisode(env, str(tmp_path), save_trajectory=False, video_crf=99)
    env.close()
    assert not list(tmp_path.iterdir())  # nothing written before the check


def test_make_eval_envs_without_videos_probes_no_codec(monkeypatch, fresh_codec_cache, tmp_path):
    """Trajectories only: no encoder is needed, so no NVENC probe (nor the CUDA context it opens) in the caller."""
    probes = []
    monkeypatch.setattr(video_mod, "codec_available", lambda name: True)
    monkeypatch.setattr(video_mod, "nvenc_usable", lambda: probes.append(1) or False)
    from fastrecord import make_eval_envs

    kw = dict(obs_mode="state", render_mode="rgb_array", max_episode_steps=3,
              human_render_camera_configs=dict(width=32, height=32))
    envs = make_eval_envs("PickCube-v1", 1, "physx_cpu", kw, dict(obs_horizon=1), video_dir=str(tmp_path),
                          record_kwargs=dict(save_video=False, save_trajectory=True))
    envs.close()
    assert probes == []


def test_videos_encode_no_more_at_once_than_stepping_workers_until_the_caller_waits(tmp_path, monkeypatch):
    """`Mp4Sink`'s writers: while the env steps at most ``stepping_workers`` of them encode at once (beside a CPU
    vector env's sub-env processes the other cores are theirs); while the caller waits for the videos (for room in
    the queue, ``wait_until_done``, ``close``) every writer encodes: three encodes meet at a barrier, which breaks
    unless all three run at once. Every video decodes to its episode's frames."""
    from fastrecord.episode import EpisodeData
    from fastrecord.sinks import mp4 as mp4_mod
    from fastrecord.sinks.base import RunDirectory

    real = mp4_mod.encode_mp4
    lock, active, most = threading.Lock(), [0], [0]
    meet: dict[int, threading.Barrier] = {}  # episode id -> the barrier its encode waits at

    def counted(path, *args, **kwargs):
        with lock:
            active[0] += 1
            most[0] = max(most[0], active[0])
        try:
            barrier = meet.get(int(Path(path).name.split("_")[0]))
            if barrier is not None:
                barrier.wait()
            else:
                time.sleep(0.05)  # long enough for a second encode to start beside it, were it allowed
            return real(path, *args, **kwargs)
        finally:
            with lock:
                active[0] -= 1

    monkeypatch.setattr(mp4_mod, "encode_mp4", counted)
    clips = [smooth_frames(t=6, h=32, w=48, seed=s) for s in range(4)]
    sink = mp4_mod.Mp4Sink(VideoSettings(fps=10), num_envs=3, workers=3, stepping_workers=1)
    run = RunDirectory(tmp_path, "t").open()
    sink.open(run)

    def episodes(ids):
        return [EpisodeData(episode_id=i, env_idx=i % 3, elapsed_steps=5, datasets={}, meta={}, frames=clips[i % 4])
                for i in ids]

    try:
        assert (sink.workers, sink.stepping_workers, sink.max_pending) == (3, 1, 6)
        sink.submit(episodes(range(3)))  # the env "steps" on: nobody waits for these
        deadline = time.monotonic() + 120
        while len(sink.files) < 3:
            assert time.monotonic() < deadline, "the first three videos were not written"
            time.sleep(0.02)
        assert most[0] == 1 == sink.most_at_once
        meet.update(dict.fromkeys((3, 4, 5), threading.Barrier(3, timeout=60)))
        sink.submit(episodes(range(3, 6)))
        sink.wait_until_done()  # the limit is off while the caller waits: the barrier of three passes
        assert most[0] == 3
        most[0] = 0
        meet.update(dict.fromkeys((6, 7, 8), threading.Barrier(3, timeout=60)))
        # 3 writers hold a job each (one at the barrier, two held back by the limit) and the queue takes 6: the
        # tenth submit waits for room, and meanwhile every writer encodes
        sink.submit(episodes(range(6, 16)))
        assert most[0] == 3
        sink.wait_until_done()
    finally:
        sink.close()
        run.close(status="closed")
    assert len(sink.files) == 16
    for path in sink.files:
        decoded = decode_mp4(path)
        clip = clips[int(path.name.split("_")[0]) % 4]
        assert decoded.shape == clip.shape
        assert psnr(decoded, clip) > 30
