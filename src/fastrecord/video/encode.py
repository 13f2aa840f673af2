"""MP4 encoding with PyAV (libav's H.264 encoders), in encoder processes.

We use PyAV directly rather than imageio's ffmpeg subprocess: no pipe copy of every frame, the codec is
checked up front, and the encoder's threads and options are ours to set.

`encode_mp4` is called from writer threads. By default (``VideoSettings.executor="auto"`` on Linux) the
encode itself runs in a helper process of `EncoderProcessPool`: threads of one process share the GIL,
which held 16 threads of libx264 ultrafast near 2,200 frames/s on a 16-core machine where 16 processes
encode 7,000. The frames are not pickled: they live in staging memory that the encoder process maps
(`fastrecord.staging`), so a job message is a file name, an offset and a shape. Frames given as
`Yuv420Frames` (converted on the GPU) skip the encoder's colour conversion.

This module imports only numpy, PyAV and `fastrecord.staging` (encoder processes import it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import av
import numpy as np

from fastrecord import staging as _staging
from fastrecord.staging import Yuv420Frames

# encoders tried, in order, when codec="auto": NVENC where the GPU has one, libx264 otherwise
_AUTO_CODECS = ("h264_nvenc", "libx264")
EXECUTORS = ("auto", "process", "thread")


@dataclass(frozen=True)
class VideoSettings:
    codec: str = "libx264"  # "auto" picks h264_nvenc where usable, else libx264
    crf: int = 23  # constant rate factor (lower = better); ManiSkill's imageio default is crf 25 (preset medium)
    preset: str = "ultrafast"  # libx264 speed/size trade-off: ultrafast at crf 23 beats ManiSkill's default
    # video on PSNR (fastrecord bench) at ~3x its encode speed, with files ~3x larger
    pix_fmt: str = "yuv420p"  # plays in browsers
    threads: int = 1  # encoder threads per video; parallelism comes from the writer workers
    fps: int = 30  # frames per second of the file
    executor: str = "auto"  # where encode_mp4 encodes: auto (a helper process where supported) | process | thread


class EncoderError(RuntimeError):
    """An encoder process failed or died; the message carries its error and traceback."""


def codec_available(name: str) -> bool:
    try:
        av.codec.Codec(name, "w")
    except (av.codec.codec.UnknownCodecError, ValueError):
        return False
    return True


def _nvenc_usable() -> bool:
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


def resolve_codec(name: str) -> str:
    """Return an encoder PyAV can open, or raise ValueError naming the choices.

    ``"auto"`` tries ``h264_nvenc`` (only where it actually encodes a frame: the libav build has it AND
    the GPU has an NVENC unit, which e.g. the H100/H200 lack), then falls back to ``libx264``.
    """
    if name == "auto":
        if name not in _resolved:
            for c in _AUTO_CODECS:
                if codec_available(c) and (c != "h264_nvenc" or _nvenc_usable()):
                    _resolved[name] = c
                    break
            else:
                raise ValueError("codec='auto' found no H.264 encoder in this PyAV build; install PyAV from PyPI (`pip install av`)")
        return _resolved[name]
    if not codec_available(name):
        raise ValueError(
            f"video codec {name!r} is not available in this PyAV/FFmpeg build; use 'libx264' (always shipped "
            f"with PyAV's wheels), 'auto', or another encoder listed by `python -c \"import av; print(av.codecs_available)\"`"
        )
    return name


def _even(img: np.ndarray) -> np.ndarray:
    """yuv420p needs even sides: pad the last row/column by repetition when odd."""
    h, w = img.shape[-3:-1]
    if h % 2 == 0 and w % 2 == 0:
        return img
    pad = [(0, 0)] * (img.ndim - 3) + [(0, h % 2), (0, w % 2), (0, 0)]
    return np.pad(img, pad, mode="edge")


def _check_frames(frames: Any) -> str:
    """The pixel format of ``frames`` ('rgb24' or 'yuv420p'), or ValueError."""
    if isinstance(frames, Yuv420Frames):
        if frames.ndim != 3 or frames.dtype != np.uint8 or frames.shape[1] % 3 or frames.shape[2] % 2:
            raise ValueError(f"yuv420p frames must be [T, H*3/2, W] uint8 with even H and W, got shape {frames.shape}")
        return "yuv420p"
    if not isinstance(frames, np.ndarray) or frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise ValueError(
            f"frames must be [T, H, W, 3] uint8, got shape {getattr(frames, 'shape', None)} dtype {getattr(frames, 'dtype', type(frames))}"
        )
    return "rgb24"


def _stream_options(settings: VideoSettings) -> dict[str, str]:
    if settings.codec == "libx264":
        return {"crf": str(settings.crf), "preset": settings.preset}
    if settings.codec == "h264_nvenc":
        return {"cq": str(settings.crf), "preset": "p4"}
    return {}


def _encode_here(path: Path, frames: np.ndarray, settings: VideoSettings, fmt: str) -> None:
    """Encode in this thread. ``frames``: [T, H, W, 3] rgb24 or [T, H*3/2, W] yuv420p."""
    if fmt == "rgb24":
        frames = _even(frames)
        height, width = frames.shape[1], frames.shape[2]
    else:
        height, width = frames.shape[1] * 2 // 3, frames.shape[2]
    tmp = path.with_name(path.name + ".part")
    with av.open(str(tmp), mode="w", format="mp4") as container:
        stream = container.add_stream(settings.codec, rate=settings.fps)
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
    os.replace(tmp, path)


_wrap = getattr(av.VideoFrame, "from_numpy_buffer", av.VideoFrame.from_ndarray)


def _use_processes(settings: VideoSettings) -> bool:
    if settings.executor not in EXECUTORS:
        raise ValueError(f"VideoSettings.executor={settings.executor!r} is unknown; use one of {EXECUTORS}")
    if settings.executor == "thread":
        return False
    supported = _staging.shared_memory_supported()
    if settings.executor == "process" and not supported:
        raise ValueError("VideoSettings.executor='process' needs Linux (memfd and fd passing); use executor='thread' or 'auto'")
    return supported


def encode_mp4(path: str | Path, frames: np.ndarray, settings: VideoSettings,
               pool: Any = None) -> Path:
    """Encode ``frames`` ([T, H, W, 3] uint8 RGB, or `Yuv420Frames`) to an MP4 at ``path``.

    The file appears atomically (written under a temporary name, then renamed), so a killed process
    never leaves a truncated video behind. Blocks until the file is written; the encode runs in an
    encoder process (``pool``, by default the process-wide `default_encoder_pool`) unless
    ``settings.executor="thread"``.
    """
    path = Path(path)
    fmt = _check_frames(frames)
    if _use_processes(settings):
        from fastrecord.video.pool import default_encoder_pool

        (pool or default_encoder_pool()).encode(path, frames, settings)
    else:
        if fmt == "yuv420p":
            frames = frames.plain()
        _encode_here(path, frames, settings, fmt)
    return path


def decode_mp4(path: str | Path) -> np.ndarray:
    """Decode every frame of a video to [T, H, W, 3] uint8 RGB."""
    with av.open(str(path)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
