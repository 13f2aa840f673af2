"""Frame transforms for the encoders: RGB to yuv420p on the device, and the frame type that marks the result.

`Yuv420Frames` marks frames already converted to yuv420p (on the GPU by `rgb_to_yuv420p`): half the bytes
of RGB to copy, and no colour conversion left for the encoder. Its ``ready`` event says when an
asynchronous device-to-host copy has landed; `wait_ready` blocks on it. `YUV420P` is the conversion as a
transform of `fastrecord.buffer.EpisodeBuffer.gather` (``transforms={"frames": YUV420P}``).

This module imports only numpy at import time (torch lazily): encoder processes import it.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class Yuv420Frames(np.ndarray):
    """Frames in yuv420p planar layout, ``[..., H * 3 // 2, W]`` uint8 per frame (the layout of
    ``av.VideoFrame.from_ndarray(..., format="yuv420p")``): the Y plane (H rows), then U and V
    (H/4 rows of W each). BT.601 limited range, the colours libswscale gives RGB frames by default.

    ``ready`` (a CUDA event, a `fastrecord.hostcopy.Landing`, or None) is set while an asynchronous copy into this
    memory is in flight; call `wait_ready` before reading (a slice waits for the copies into its own bytes only).
    Slices keep both.
    """

    ready: Any

    def __new__(cls, array: np.ndarray, ready: Any = None) -> Yuv420Frames:
        obj = np.asarray(array).view(cls)
        obj.ready = ready
        return obj

    def __array_finalize__(self, obj: Any) -> None:
        self.ready = getattr(obj, "ready", None)

    @property
    def frame_size(self) -> tuple[int, int]:
        """(height, width) of the pictures."""
        return self.shape[-2] * 2 // 3, self.shape[-1]

    def wait_ready(self) -> None:
        ev = self.ready
        if ev is None:
            return
        wait_for = getattr(ev, "wait_for", None)  # a `fastrecord.hostcopy.Landing`: only the copies into this view
        if wait_for is not None and self.size and self.flags.c_contiguous:  # its bytes: one range
            wait_for(self.ctypes.data, self.nbytes)
        else:
            ev.synchronize()

    def plain(self) -> np.ndarray:
        """The same memory as a plain ndarray (waits for the copy first)."""
        self.wait_ready()
        return self.view(np.ndarray)


# BT.601, limited ("tv") range, as libswscale's default for RGB -> yuv420p
_Y = (65.481 / 255, 128.553 / 255, 24.966 / 255)
_U = (-37.797 / 255, -74.203 / 255, 112.0 / 255)
_V = (112.0 / 255, -93.786 / 255, -18.214 / 255)


def rgb_to_yuv420p(rgb: Any, out: Any = None) -> Any:
    """Torch ``[..., H, W, 3]`` uint8 RGB (H, W even; any strides) -> ``[..., H * 3 // 2, W]`` uint8 yuv420p, on
    ``rgb``'s device (into ``out`` where given).

    BT.601 limited range, rounded to nearest, as libswscale's default. Chroma is the chroma of each 2x2 block's mean
    RGB (the mean of the four pixels' chroma, by linearity). Elementwise torch kernels read the uint8 channels
    directly (no float copy of the frames), in pieces of about `_PIECE_BYTES` along the leading dim, so their
    temporaries stay small (a float luma plane, then the blocks' sums in int16). A hand-written one-pass Triton
    kernel did this until 2026-12-06: its import and load held the GIL for up to a third of a second at a time in
    every process that recorded video, and fresh and warm processes recorded faster without it (docs/performance.md,
    "The yuv420p conversion without Triton").
    """
    import torch

    *lead, h, w, c = rgb.shape
    if c != 3 or h % 2 or w % 2:
        raise ValueError(f"rgb_to_yuv420p needs [..., H, W, 3] with even H and W, got {list(rgb.shape)}")
    if out is None:
        out = torch.empty((*lead, h * 3 // 2, w), dtype=torch.uint8, device=rgb.device)
    _convert(rgb, out)
    return out


_PIECE_BYTES = 256 * 1024 * 1024  # RGB bytes converted at once (temporaries: 4/3x for luma, then 1/2x + 1/3x)


def _convert(rgb: Any, out: Any) -> None:
    """`rgb_to_yuv420p` into ``out``, in pieces along the leading dim."""
    import torch

    *lead, h, w, _ = rgb.shape
    if lead and lead[0] > 1 and rgb.numel() > _PIECE_BYTES:
        step = max(1, lead[0] * _PIECE_BYTES // rgb.numel())
        for i in range(0, lead[0], step):
            _convert(rgb[i : i + step], out[i : i + step])
        return
    r, g, b = rgb.unbind(-1)
    flat = out.view(*lead, h * w * 3 // 2)

    def f32(c: float) -> Any:  # a float32 product of an integer tensor and c, whatever torch's default dtype is
        return torch.tensor(c, dtype=torch.float32)

    # uint8 x float32 -> float32; add_(uint8, alpha) promotes in the kernel: one float temporary, no clamp (the sums
    # lie in [16.5, 240.5]); float -> uint8 truncates, so +0.5 rounds
    y = torch.mul(r, f32(_Y[0])).add_(g, alpha=_Y[1]).add_(b, alpha=_Y[2]).add_(16.5)
    flat[..., : h * w].copy_(y.reshape(*lead, h * w))
    del y
    # each 2x2 block's sum in int16 from the four strided uint8 quarters (``sum(dtype=float32)`` would first make a
    # float copy of the whole piece: torch casts a reduction's input to its output type)
    s = rgb[..., 0::2, 0::2, :].to(torch.int16)  # [..., H/2, W/2, 3]
    s.add_(rgb[..., 0::2, 1::2, :]).add_(rgb[..., 1::2, 0::2, :]).add_(rgb[..., 1::2, 1::2, :])
    sr, sg, sb = s.unbind(-1)
    q = h * w // 4
    for k, c in ((0, _U), (1, _V)):  # the block's sum x coefficient / 4: its mean's chroma
        plane = torch.mul(sr, f32(c[0] / 4)).add_(sg, alpha=c[1] / 4).add_(sb, alpha=c[2] / 4).add_(128.5)
        flat[..., h * w + k * q : h * w + (k + 1) * q].copy_(plane.reshape(*lead, q))


def yuv420p_to_rgb_numpy(yuv: np.ndarray) -> np.ndarray:
    """Reference inverse for tests and PSNR checks: ``[..., H*3/2, W]`` -> ``[..., H, W, 3]`` uint8."""
    h = yuv.shape[-2] * 2 // 3
    w = yuv.shape[-1]
    flat = yuv.reshape(*yuv.shape[:-2], -1).astype(np.float32)
    y = flat[..., : h * w].reshape(*yuv.shape[:-2], h, w) - 16
    u = flat[..., h * w : h * w * 5 // 4].reshape(*yuv.shape[:-2], h // 2, w // 2) - 128
    v = flat[..., h * w * 5 // 4 :].reshape(*yuv.shape[:-2], h // 2, w // 2) - 128
    u = u.repeat(2, axis=-2).repeat(2, axis=-1)
    v = v.repeat(2, axis=-2).repeat(2, axis=-1)
    r = 1.164383 * y + 1.596027 * v
    g = 1.164383 * y - 0.391762 * u - 0.812968 * v
    b = 1.164383 * y + 2.017232 * u
    return np.clip(np.stack([r, g, b], axis=-1) + 0.5, 0, 255).astype(np.uint8)


class Yuv420Transform:
    """RGB frames to `Yuv420Frames`, as a transform of `EpisodeBuffer.gather` (the protocol
    `fastrecord.hostcopy.LeafTransform`): uint8 ``[..., H, W, 3]`` leaves with even H and W, converted by
    `rgb_to_yuv420p` on their device. Holds nothing; use the instance `YUV420P`."""

    dtype = np.dtype(np.uint8)

    def accepts(self, buf: Any) -> bool:
        """Whether a buffer ``[capacity, envs, ..., H, W, 3]`` holds frames this converts."""
        import torch

        return (buf.dtype == torch.uint8 and buf.ndim >= 5 and buf.shape[-1] == 3
                and buf.shape[-3] % 2 == 0 and buf.shape[-2] % 2 == 0)

    def shape(self, leaf_shape: tuple[int, ...]) -> tuple[int, ...]:
        """``(..., H, W, 3)`` -> ``(..., H * 3 // 2, W)``."""
        *lead, h, w, _ = leaf_shape
        return (*lead, h * 3 // 2, w)

    def __call__(self, frames: Any) -> Any:
        return rgb_to_yuv420p(frames)

    def wrap(self, host: np.ndarray, ready: Any) -> Yuv420Frames:
        return Yuv420Frames(host, ready=ready)


YUV420P = Yuv420Transform()
