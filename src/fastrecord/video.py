"""MP4 encoding with PyAV (libav's H.264 encoders) and ManiSkill's tiled layout.

We use PyAV directly rather than imageio's ffmpeg subprocess: no pipe copy of every frame, the codec is
checked up front, and the encoder's threads and options are ours to set.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import av
import numpy as np

# encoders tried, in order, when codec="auto": NVENC where the GPU has one, libx264 otherwise
_AUTO_CODECS = ("h264_nvenc", "libx264")


@dataclass(frozen=True)
class VideoSettings:
    codec: str = "libx264"  # "auto" picks h264_nvenc where usable, else libx264
    crf: int = 23  # constant rate factor (lower = better); ManiSkill's imageio default is crf 25
    preset: str = "veryfast"  # libx264 speed/size trade-off
    pix_fmt: str = "yuv420p"  # plays in browsers
    threads: int = 1  # encoder threads per video; parallelism comes from the writer workers
    fps: int = 30  # frames per second of the file


def codec_available(name: str) -> bool:
    try:
        av.codec.Codec(name, "w")
    except (av.codec.codec.UnknownCodecError, ValueError):
        return False
    return True


def _nvenc_usable() -> bool:
    """NVENC is compiled into some libav builds but needs an NVIDIA GPU with an encoder: try one frame."""
    try:
        ctx = av.codec.CodecContext.create("h264_nvenc", "w")
        ctx.width, ctx.height, ctx.pix_fmt = 64, 64, "yuv420p"
        ctx.time_base = __import__("fractions").Fraction(1, 30)
        ctx.open()
        ctx.encode(av.VideoFrame.from_ndarray(np.zeros((64, 64, 3), np.uint8), format="rgb24").reformat(format="yuv420p"))
        return True
    except Exception:  # noqa: BLE001 - any failure means "not usable here"
        return False


def resolve_codec(name: str) -> str:
    """Return an encoder PyAV can open, or raise ValueError naming the choices."""
    if name == "auto":
        for c in _AUTO_CODECS:
            if codec_available(c) and (c != "h264_nvenc" or _nvenc_usable()):
                return c
        raise ValueError("codec='auto' found no H.264 encoder in this PyAV build; install PyAV from PyPI (`pip install av`)")
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


def encode_mp4(path: str | Path, frames: np.ndarray, settings: VideoSettings) -> Path:
    """Encode ``frames`` ([T, H, W, 3] uint8 RGB) to an MP4 at ``path``.

    The file appears atomically (written under a temporary name, then renamed), so a killed process
    never leaves a truncated video behind.
    """
    path = Path(path)
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise ValueError(f"frames must be [T, H, W, 3] uint8, got shape {frames.shape} dtype {frames.dtype}")
    frames = _even(frames)
    tmp = path.with_name(path.name + ".part")
    with av.open(str(tmp), mode="w", format="mp4") as container:
        stream = container.add_stream(settings.codec, rate=settings.fps)
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = settings.pix_fmt
        if settings.codec == "libx264":
            stream.options = {"crf": str(settings.crf), "preset": settings.preset}
        elif settings.codec == "h264_nvenc":
            stream.options = {"cq": str(settings.crf), "preset": "p4"}
        stream.codec_context.thread_count = settings.threads
        for img in frames:
            frame = av.VideoFrame.from_ndarray(img, format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())  # flush the encoder
    os.replace(tmp, path)
    return path


def decode_mp4(path: str | Path) -> np.ndarray:
    """Decode every frame of a video to [T, H, W, 3] uint8 RGB."""
    with av.open(str(path)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
