"""MP4 encoding with PyAV (libav's H.264 encoders) in this process: settings, their validation, encode,
publish, decode.

We use PyAV directly rather than imageio's ffmpeg subprocess: no pipe copy of every frame, the codec is
checked up front, and the encoder's threads and options are ours to set. `encode_here` encodes in the
calling thread; `fastrecord.video.pool.encode_mp4` picks where to encode (an encoder process of
`EncoderProcessPool` by default on Linux, which calls `encode_here` there, or the calling thread).
Frames given as `Yuv420Frames` (converted on the GPU) skip the encoder's colour conversion.

`check_video_settings` validates every setting up front (names, ranges, then one trial encode in memory)
so that a bad value fails where it is given, not later in a background encoder. A finished video is
published without replacing anything: a name already taken gets ``_1``, ``_2``, ... (`encode_here`
returns the path written).

This module imports only numpy, PyAV, `fastrecord.staging` and `fastrecord.video.yuv` (encoder processes
import it).
"""

from __future__ import annotations

import errno
import io
import math
import numbers
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, replace
from fractions import Fraction
from pathlib import Path
from typing import Any

import av
import numpy as np

from fastrecord.staging import shared_memory_supported
from fastrecord.video.yuv import Yuv420Frames

# encoders tried, in order, when codec="auto": NVENC where the GPU has one, libx264 otherwise
_AUTO_CODECS = ("h264_nvenc", "libx264")
EXECUTORS = ("auto", "process", "thread")
X264_PRESETS = (
    "ultrafast",
    "superfast",
    "veryfast",
    "faster",
    "fast",
    "medium",
    "slow",
    "slower",
    "veryslow",
    "placebo",
)
# the crf (or NVENC cq) each encoder takes; other encoders get no rate option from us
CRF_RANGES = {"libx264": (0, 51), "h264_nvenc": (0, 51), "libsvtav1": (0, 63)}
SVTAV1_PRESET = "12"  # libsvtav1's speed preset (0-13) when ``preset`` is not a number: LeRobot's (the fastest)


@dataclass(frozen=True)
class VideoSettings:
    codec: str = "libx264"  # "auto" picks h264_nvenc where usable, else libx264
    crf: int = 23  # constant rate factor (lower = better); ManiSkill's imageio default is crf 25 (preset medium)
    preset: str = "ultrafast"  # libx264 speed/size trade-off: ultrafast at crf 23 beats ManiSkill's default
    # video on PSNR (fastrecord bench) at ~3x its encode speed, with files ~3x larger
    pix_fmt: str = "yuv420p"  # plays in browsers
    threads: int = 1  # encoder threads per video; parallelism comes from the writer workers
    fps: int | float | Fraction = 30  # frames per second of the file; a fraction (7.5, 29.97) is encoded as
    # Fraction(fps).limit_denominator(1001)
    executor: str = "auto"  # where encode_mp4 encodes: auto (a helper process where supported) | process | thread
    gop: int | None = None  # keyframe interval in frames (the encoder's ``g``; 1: every frame a key frame); None: the
    # encoder's default (libx264: 250, one key frame per episode video). Training reads random frames: docs/format.md


class EncoderError(RuntimeError):
    """An encoder process failed or died; the message carries its error and traceback."""


def codec_available(name: str) -> bool:
    try:
        av.codec.Codec(name, "w")
    except (av.codec.codec.UnknownCodecError, ValueError):
        return False
    return True


def nvenc_usable() -> bool:
    """NVENC is compiled into some libav builds but needs an NVIDIA GPU with an encoder: encode frames."""
    try:
        ctx = av.codec.CodecContext.create("h264_nvenc", "w")
        ctx.width, ctx.height, ctx.pix_fmt = 256, 256, "yuv420p"
        ctx.time_base = Fraction(1, 30)
        ctx.open()
        frame = av.VideoFrame.from_ndarray(np.zeros((384, 256), np.uint8), format="yuv420p")
        packets = list(ctx.encode(frame)) + list(ctx.encode(None))
        return len(packets) > 0
    except Exception:  # noqa: BLE001 - any failure means "not usable here"
        return False


_resolved: dict[str, str] = {}
_resolving = threading.Lock()  # one probe at a time: a `prefetch_codec` thread and the recorder's own call
_prefetch: threading.Thread | None = None  # the latest `prefetch_codec` thread


def resolve_codec(name: str) -> str:
    """Return an encoder PyAV can open, or raise ValueError naming the choices.

    ``"auto"`` tries ``h264_nvenc`` (only where it actually encodes a frame: the libav build has it AND
    the GPU has an NVENC unit, which e.g. the H100/H200 lack), then falls back to ``libx264``. That probe
    runs once a process (0.43 s on the H100 machine, 0.66 s on the H200, where the driver is loaded and no NVENC
    unit answers; 1 ms without an NVIDIA driver); `prefetch_codec` starts it early, in a helper process.
    """
    if name == "auto":
        prefetch = _prefetch
        if prefetch is not None and prefetch is not threading.current_thread():
            prefetch.join()  # its answer, rather than a second probe here
        return _resolve_auto(nvenc_usable)
    if not codec_available(name):
        raise ValueError(
            f"video codec {name!r} is not available in this PyAV/FFmpeg build; use 'libx264' (always shipped "
            "with PyAV's wheels), 'auto', or another encoder listed by "
            "`python -c \"import av; print(av.codecs_available)\"`"
        )
    return name


def _resolve_auto(probe: Any) -> str:
    with _resolving:
        if "auto" not in _resolved:
            for c in _AUTO_CODECS:
                if codec_available(c) and (c != "h264_nvenc" or probe()):
                    _resolved["auto"] = c
                    break
            else:
                raise ValueError(
                    "codec='auto' found no H.264 encoder in this PyAV build; install PyAV from PyPI "
                    "(`pip install av`)"
                )
    return _resolved["auto"]


def codec_resolved(name: str) -> bool:
    """Whether `resolve_codec` answers ``name`` at once (anything but an "auto" whose probe has not ended)."""
    return name != "auto" or name in _resolved


def nvidia_driver_present() -> bool:
    """Whether this machine has an NVIDIA driver loaded (its control device): where NVENC's probe is slow."""
    return os.path.exists("/dev/nvidiactl")


def nvenc_usable_elsewhere() -> bool:
    """`nvenc_usable`, answered by a helper process (`fastrecord.processes.IsolatedProcess`, which imports PyAV
    and numpy only). PyAV opens a codec holding the GIL: with an NVIDIA driver that open creates a CUDA context
    (0.43 s on the H100 machine), during which no other thread of the caller's process ran, so a probe on a thread
    of the caller stopped the recorder's construction anyway (measured: the construction's next step began the
    moment the probe ended). A helper that cannot answer is taken for "no NVENC" (libx264 always works)."""
    try:
        return bool(ask_helper(nvenc_usable))
    except Exception:  # noqa: BLE001 - a probe that failed: no NVENC
        return False


def ask_helper(func: Any) -> Any:
    """``func()`` (a module-level function of a fastrecord module) run in a helper process that imports PyAV and
    numpy only, which then leaves; its errors are raised here."""
    from fastrecord.processes import IsolatedProcess

    proc = IsolatedProcess("fastrecord.video.encode", "the NVENC probe process")
    try:
        return proc.call(func)
    finally:
        proc.stop(timeout=5.0)


def prefetch_codec(*names: str | None) -> None:
    """Start resolving ``"auto"`` among ``names`` on a daemon thread, so that a recorder made later finds it done
    and one made now does not wait for it (its first video does): for the commands and `make_eval_envs`, which
    call it before they make their envs, and for `RecordEpisode`'s construction. Where an NVIDIA driver is
    loaded the NVENC probe runs in a helper process (`nvenc_usable_elsewhere`): it holds the GIL of the process it
    runs in, and its CUDA context then stays out of this one (whose processes may be forked). A probe that fails
    is left to the recorder's own call, which raises where it always did."""
    if "auto" not in names or "auto" in _resolved:
        return
    probe = nvenc_usable_elsewhere if codec_available("h264_nvenc") and nvidia_driver_present() else nvenc_usable

    def run() -> None:
        try:
            _resolve_auto(probe)
        except Exception:  # noqa: BLE001 - the recorder's own resolve_codec raises it
            pass

    global _prefetch
    _prefetch = threading.Thread(target=run, name="fastrecord-codec-probe", daemon=True)
    _prefetch.start()


def _even(img: np.ndarray) -> np.ndarray:
    """yuv420p needs even sides: pad the last row/column by repetition when odd."""
    h, w = img.shape[-3:-1]
    if h % 2 == 0 and w % 2 == 0:
        return img
    pad = [(0, 0)] * (img.ndim - 3) + [(0, h % 2), (0, w % 2), (0, 0)]
    return np.pad(img, pad, mode="edge")


def check_frames(frames: Any) -> str:
    """The pixel format of ``frames`` ('rgb24' or 'yuv420p'), or ValueError."""
    if isinstance(frames, Yuv420Frames):
        if frames.ndim != 3 or frames.dtype != np.uint8 or frames.shape[1] % 3 or frames.shape[2] % 2:
            raise ValueError(f"yuv420p frames must be [T, H*3/2, W] uint8 with even H and W, got shape {frames.shape}")
        return "yuv420p"
    if not isinstance(frames, np.ndarray) or frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise ValueError(
            f"frames must be [T, H, W, 3] uint8, got shape {getattr(frames, 'shape', None)} dtype "
            f"{getattr(frames, 'dtype', type(frames))}"
        )
    return "rgb24"


def _stream_options(settings: VideoSettings) -> dict[str, str]:
    """The encoder's options: its rate (crf, or NVENC's cq), its preset and the keyframe interval ``g``."""
    gop = {} if settings.gop is None else {"g": str(settings.gop)}
    if settings.codec == "libx264":
        return {"crf": str(settings.crf), "preset": settings.preset, **gop}
    if settings.codec == "h264_nvenc":
        return {"cq": str(settings.crf), "preset": "p4", **gop}
    if settings.codec == "libsvtav1":  # as LeRobot's encode_video_frames passes them
        preset = settings.preset if settings.preset.isdigit() else SVTAV1_PRESET
        return {"crf": str(settings.crf), "preset": preset, **gop, "svtav1-params": f"lp={settings.threads}"}
    return gop


def _stream_rate(fps: int | float | Fraction) -> int | Fraction:
    """The stream's frame rate: integer fps as they are, others as the nearest fraction over at most 1001
    (7.5 -> 15/2, 29.97 -> 2997/100, Fraction(30000, 1001) unchanged)."""
    if isinstance(fps, numbers.Integral):
        return int(fps)
    rate = (Fraction(fps) if isinstance(fps, numbers.Rational) else Fraction(float(fps))).limit_denominator(1001)
    return rate.numerator if rate.denominator == 1 else rate


# ------------------------------------------------------------------------------------------ validation
_MIN_FPS = Fraction(1, 1001)
_TRIAL_SIZE = 256  # trial frames: small, but above hardware encoders' minimum sizes (NVENC's is ~145 px)
_checked: dict[VideoSettings, str | None] = {}  # resolved settings -> None (encodes) or the error message
_check_lock = threading.Lock()


def _field_errors(s: VideoSettings) -> str | None:
    """The first bad field of ``s`` (codec already resolved) as a message, or None."""
    fps = s.fps
    if (
        isinstance(fps, (bool, np.bool_))
        or not isinstance(fps, numbers.Real)
        or not math.isfinite(float(fps))
        or fps <= 0
    ):
        return (
            f"video_fps={fps!r} must be a positive number of frames per second "
            "(e.g. 30, or 7.5, or Fraction(30000, 1001))"
        )
    if _stream_rate(fps) < _MIN_FPS:
        return (
            f"video_fps={fps!r} is below the slowest rate encoded here (1/1001 frames per second); "
            "use at least 1/1001 (e.g. 1)"
        )
    lo, hi = CRF_RANGES.get(s.codec, (None, None))
    if (
        isinstance(s.crf, (bool, np.bool_))
        or not isinstance(s.crf, numbers.Integral)
        or (lo is not None and not lo <= s.crf <= hi)
    ):
        allowed = f"from {lo} to {hi} for {s.codec}" if lo is not None else f"(unused by {s.codec})"
        return f"video_crf={s.crf!r} must be an integer {allowed}; lower is better quality (e.g. 23)"
    if s.codec == "libx264" and s.preset not in X264_PRESETS:
        return (f"video_preset={s.preset!r} is not a libx264 preset; use one of {', '.join(X264_PRESETS)} "
                f"(e.g. 'ultrafast' for speed, 'medium' for smaller files)")
    gop = s.gop
    if gop is not None and (isinstance(gop, (bool, np.bool_)) or not isinstance(gop, numbers.Integral) or gop < 1):
        return f"video_gop={gop!r} must be an integer >= 1 (frames between key frames; e.g. 2) or None (the encoder's)"
    if isinstance(s.threads, (bool, np.bool_)) or not isinstance(s.threads, numbers.Integral) or s.threads < 1:
        return f"video_threads={s.threads!r} must be an integer >= 1 (encoder threads per video; e.g. 1)"
    if not isinstance(s.pix_fmt, str):
        return f"video_pix_fmt={s.pix_fmt!r} must be a pixel format name such as 'yuv420p' (plays in browsers)"
    try:
        av.VideoFormat(s.pix_fmt)
    except ValueError:
        return f"video_pix_fmt={s.pix_fmt!r} is not a pixel format libav knows; use e.g. 'yuv420p' (plays in browsers)"
    formats = [f.name for f in av.codec.Codec(s.codec, "w").video_formats or ()]
    if formats and s.pix_fmt not in formats:
        return (
            f"video_pix_fmt={s.pix_fmt!r} is not one {s.codec} encodes; "
            f"use one of {', '.join(formats)} (e.g. {formats[0]!r})"
        )
    if s.executor not in EXECUTORS:
        return f"video_executor={s.executor!r} is unknown; use one of {', '.join(EXECUTORS)} (e.g. 'auto')"
    if s.executor == "process" and not shared_memory_supported():
        return "video_executor='process' needs Linux (memfd and fd passing); use executor='thread' or 'auto'"
    return None


def _resolve_video_codec(name: Any) -> str:
    """`resolve_codec`, plus: the name is a string and names a VIDEO encoder."""
    if not isinstance(name, str):
        raise ValueError(f"video_codec={name!r} must be an encoder name; use 'libx264' or 'auto'")
    codec = resolve_codec(name)
    kind = av.codec.Codec(codec, "w").type
    if kind != "video":
        raise ValueError(
            f"video_codec={name!r} is an {kind} encoder, not a video encoder; use 'libx264' (always shipped "
            f"with PyAV's wheels) or 'auto'"
        )
    return codec


def _trial_encode(s: VideoSettings) -> str | None:
    """Encode two tiny frames into an in-memory MP4 with ``s`` (the code path of every video): None, or why not."""
    frames = np.zeros((2, _TRIAL_SIZE, _TRIAL_SIZE, 3), np.uint8)
    frames[1] = 255
    level = av.logging.get_level()
    try:
        if level is None:  # with a level set, PyAV's exceptions carry libav's last error line (the reason)
            av.logging.set_level(av.logging.ERROR)
        with av.logging.Capture(local=True):  # ... in the message we raise, not also on stderr
            _encode_to(io.BytesIO(), frames, s, "rgb24")
    except Exception as e:  # noqa: BLE001 - any failure here is a setting libav rejects
        return (f"video_codec={s.codec!r} with pix_fmt={s.pix_fmt!r}, options {_stream_options(s)}, "
                f"threads={s.threads}, fps={s.fps!r} failed a trial encode: {type(e).__name__}: {e}; "
                f"use video_codec='libx264' or 'auto' (with the default pix_fmt 'yuv420p')")
    finally:
        if level is None:
            av.logging.set_level(None)
    return None


def check_video_settings(settings: VideoSettings) -> VideoSettings:
    """Validate every field of ``settings`` and return them with ``codec="auto"`` resolved.

    Raises ValueError naming the bad value, the allowed values and the fix: codec (a video encoder of this
    PyAV build), fps (a positive finite int, float or Fraction), crf (libx264 0..51), preset (libx264's),
    threads >= 1, pix_fmt (one libav knows and the codec takes), executor. Then one trial encode of two
    tiny frames into an in-memory MP4 with exactly these settings catches what libav itself rejects.
    The trial's verdict is cached per settings: it runs once per process per settings.
    """
    if not isinstance(settings, VideoSettings):
        raise ValueError(f"video settings must be a VideoSettings, got {type(settings).__name__}: {settings!r}")
    codec = _resolve_video_codec(settings.codec)
    resolved = settings if codec == settings.codec else replace(settings, codec=codec)
    # every call: cheap, and a dict key cannot tell fps=True from fps=1
    msg = _field_errors(resolved)
    if msg is not None:
        raise ValueError(msg)
    with _check_lock:
        if resolved not in _checked:
            _checked[resolved] = _trial_encode(resolved)
        msg = _checked[resolved]
    if msg is not None:
        raise ValueError(msg)
    return resolved


# ------------------------------------------------------------------------------------------ encode
def _encode_to(target: str | io.BytesIO, frames: np.ndarray, settings: VideoSettings, fmt: str) -> None:
    """Encode ``frames`` ([T, H, W, 3] rgb24 or [T, H*3/2, W] yuv420p) as an MP4 into ``target``."""
    if fmt == "rgb24":
        frames = _even(frames)
        height, width = frames.shape[1], frames.shape[2]
    else:
        height, width = frames.shape[1] * 2 // 3, frames.shape[2]
    if settings.codec == "libsvtav1":
        os.environ.setdefault("SVT_LOG", "1")  # SVT-AV1 prints its whole configuration to stderr at each open
    with av.open(target, mode="w", format="mp4") as container:
        stream = container.add_stream(settings.codec, rate=_stream_rate(settings.fps))
        stream.width, stream.height = width, height
        stream.pix_fmt = settings.pix_fmt
        stream.options = _stream_options(settings)
        stream.codec_context.thread_count = settings.threads
        for img in frames:
            # from_numpy_buffer wraps the memory (read in place by the encoder, which copies what it
            # keeps); from_ndarray would allocate and fill a frame first
            frame = _wrap(img, format=fmt)
            container.mux(stream.encode(frame))
        container.mux(stream.encode())  # flush the encoder


def encode_here(path: Path, frames: np.ndarray, settings: VideoSettings, fmt: str, overlay: Any = None) -> Path:
    """Encode in this thread to a temporary file, then publish it at ``path`` or the next free name
    (`_publish`); returns the path written. A failed encode leaves no temporary file behind.
    ``overlay`` (an `Overlay`) is drawn on a copy of the frames first, in their format ``fmt``."""
    if overlay:
        from fastrecord.video.overlay import draw_overlay

        frames = draw_overlay(frames, overlay, fmt=fmt)
    # one temporary name per writer (encoder processes run one job at a time, threads are told apart by
    # their id), so two videos headed for the same name never write one file
    tmp = path.with_name(f"{path.name}.{os.getpid()}-{threading.get_ident()}.part")
    try:
        _encode_to(str(tmp), frames, settings, fmt)
        return _publish(tmp, path)
    finally:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass


# errors of os.link meaning "this filesystem has no hard links" (EOPNOTSUPP is ENOTSUP on Linux)
_NO_HARD_LINKS = {errno.EPERM, errno.EXDEV, errno.ENOTSUP, errno.EOPNOTSUPP}


def _candidates(path: Path) -> Iterator[Path]:
    """``path``, then ``STEM_1.SUFFIX``, ``STEM_2.SUFFIX``, ... (ManiSkill's avoid_overwriting_video names)."""
    yield path
    k = 1
    while True:
        yield path.with_name(f"{path.stem}_{k}{path.suffix}")
        k += 1


def _publish(tmp: Path, path: Path) -> Path:
    """Give the finished file ``tmp`` the first free name of `_candidates` (``path`` first), atomically and
    never replacing a file; return that name. The caller removes ``tmp``.

    ``os.link`` fails with FileExistsError where the name is taken, so no existing file is ever replaced;
    where the filesystem has no hard links, a name is reserved with ``O_CREAT | O_EXCL`` and ``tmp`` renamed
    over that (empty) reservation.
    """
    for cand in _candidates(path):
        try:
            os.link(tmp, cand)
            return cand
        except FileExistsError:
            continue
        except OSError as e:
            if e.errno not in _NO_HARD_LINKS:
                raise
            break
    for cand in _candidates(path):
        try:
            fd = os.open(cand, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            continue
        os.close(fd)
        try:
            os.rename(tmp, cand)
        except BaseException:
            os.unlink(cand)
            raise
        return cand
    raise AssertionError("unreachable")  # _candidates never ends


_wrap = getattr(av.VideoFrame, "from_numpy_buffer", av.VideoFrame.from_ndarray)


def use_processes(settings: VideoSettings) -> bool:
    """Whether `encode_mp4` encodes with these settings in an encoder process (``executor`` "process", or
    "auto" where shared memory works) rather than in the calling thread; ValueError for a bad executor."""
    if settings.executor not in EXECUTORS:
        raise ValueError(
            f"video_executor={settings.executor!r} is unknown; use one of {', '.join(EXECUTORS)} (e.g. 'auto')"
        )
    if settings.executor == "thread":
        return False
    supported = shared_memory_supported()
    if settings.executor == "process" and not supported:
        raise ValueError("video_executor='process' needs Linux (memfd and fd passing); use executor='thread' or 'auto'")
    return supported


def decode_mp4(path: str | Path) -> np.ndarray:
    """Decode every frame of a video to [T, H, W, 3] uint8 RGB."""
    with av.open(str(path)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])

