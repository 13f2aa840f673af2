"""Frame transforms for the encoders: RGB to yuv420p on the device, and the frame type that marks the result.

`Yuv420Frames` marks frames already converted to yuv420p (on the GPU by `rgb_to_yuv420p`): half the bytes
of RGB to copy, and no colour conversion left for the encoder. Its ``ready`` event says when an
asynchronous device-to-host copy has landed; `wait_ready` blocks on it. `YUV420P` is the conversion as a
transform of `fastrecord.buffer.EpisodeBuffer.gather` (``transforms={"frames": YUV420P}``).

This module imports only numpy at import time (torch and triton lazily): encoder processes import it.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class Yuv420Frames(np.ndarray):
    """Frames in yuv420p planar layout, ``[..., H * 3 // 2, W]`` uint8 per frame (the layout of
    ``av.VideoFrame.from_ndarray(..., format="yuv420p")``): the Y plane (H rows), then U and V
    (H/4 rows of W each). BT.601 limited range, the colours libswscale gives RGB frames by default.

    ``ready`` (a CUDA event or None) is set while an asynchronous copy into this memory is in flight;
    call `wait_ready` before reading. Slices keep both.
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
        if ev is not None:
            ev.synchronize()

    def plain(self) -> np.ndarray:
        """The same memory as a plain ndarray (waits for the copy first)."""
        self.wait_ready()
        return self.view(np.ndarray)


# BT.601, limited ("tv") range, as libswscale's default for RGB -> yuv420p
_Y = (65.481 / 255, 128.553 / 255, 24.966 / 255)
_U = (-37.797 / 255, -74.203 / 255, 112.0 / 255)
_V = (112.0 / 255, -93.786 / 255, -18.214 / 255)
_coef_cache: dict[Any, Any] = {}


def _coef(device: Any) -> Any:
    """The [3, 3] matrix on ``device``, made once: a fresh host->device copy would sync the stream."""
    import torch

    c = _coef_cache.get(device)
    if c is None:
        c = _coef_cache[device] = torch.tensor([_Y, _U, _V], dtype=torch.float32).to(device)
    return c


def rgb_to_yuv420p(rgb: Any, out: Any = None, kernel: str = "auto") -> Any:
    """Torch ``[..., H, W, 3]`` uint8 RGB (H, W even) -> ``[..., H * 3 // 2, W]`` uint8 yuv420p.

    Chroma is the mean over each 2x2 block (computed as the chroma of the block's mean RGB, which is the
    same by linearity). ``kernel``: "triton" (one pass, CUDA only), "torch" (a few memory-bound torch
    kernels, any device), or "auto" (triton where it runs).
    """
    import torch

    *lead, h, w, c = rgb.shape
    if c != 3 or h % 2 or w % 2:
        raise ValueError(f"rgb_to_yuv420p needs [..., H, W, 3] with even H and W, got {list(rgb.shape)}")
    if out is None:
        out = torch.empty((*lead, h * 3 // 2, w), dtype=torch.uint8, device=rgb.device)
    if kernel != "torch" and rgb.device.type == "cuda" and triton_kernel() is not None:
        _rgb_to_yuv420p_triton(rgb, out)
        return out
    if kernel == "triton":
        raise ValueError("kernel='triton' needs a CUDA tensor and the triton package")
    coef = _coef(rgb.device)  # [3 out, 3 in]
    x = rgb.to(torch.float32)
    flat = out.view(*lead, h * w * 3 // 2)
    y = torch.matmul(x, coef[0]).add_(16.5).clamp_(0, 255)
    flat[..., : h * w].copy_(y.view(*lead, h * w))  # float -> uint8 truncates: +0.5 above rounds
    del y
    mean = x.view(*lead, h // 2, 2, w // 2, 2, 3).mean(dim=(-4, -2))  # [..., H/2, W/2, 3]
    del x
    uv = torch.matmul(mean, coef[1:].T).add_(128.5).clamp_(0, 255)  # [..., H/2, W/2, 2]
    q = h * w // 4
    flat[..., h * w : h * w + q].copy_(uv[..., 0].reshape(*lead, q))
    flat[..., h * w + q :].copy_(uv[..., 1].reshape(*lead, q))
    return out


_TRITON: Any = False  # False: not tried yet; None: unavailable


def triton_kernel() -> Any:
    """The Triton kernel and the triton module (the kernel compiled at first launch), or None where triton
    is missing."""
    global _TRITON
    if _TRITON is not False:
        return _TRITON
    try:
        import triton
        import triton.language as tl
    except Exception:  # noqa: BLE001 - any import problem: use the torch path
        _TRITON = None
        return None

    @triton.jit
    def _kernel(src, dst, frames_per_env, env_stride, frame_stride, H, W,
                cy0, cy1, cy2, cu0, cu1, cu2, cv0, cv1, cv2, BLOCK: tl.constexpr):
        f = tl.program_id(0)  # one frame per row of the grid
        q = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # 2x2 pixel quads of that frame
        hw2 = (H // 2) * (W // 2)
        mask = q < hw2
        qy = q // (W // 2)
        qx = q % (W // 2)
        base = src + (f // frames_per_env).to(tl.int64) * env_stride + (f % frames_per_env).to(tl.int64) * frame_stride
        obase = dst + f.to(tl.int64) * (H * W * 3 // 2)
        rs = tl.zeros([BLOCK], dtype=tl.float32)
        gs = tl.zeros([BLOCK], dtype=tl.float32)
        bs = tl.zeros([BLOCK], dtype=tl.float32)
        for d in tl.static_range(4):
            py = 2 * qy + d // 2
            px = 2 * qx + d % 2
            off = (py * W + px) * 3
            r = tl.load(base + off, mask=mask, other=0).to(tl.float32)
            g = tl.load(base + off + 1, mask=mask, other=0).to(tl.float32)
            b = tl.load(base + off + 2, mask=mask, other=0).to(tl.float32)
            y = tl.minimum(tl.maximum(r * cy0 + g * cy1 + b * cy2 + 16.5, 0.0), 255.0)
            tl.store(obase + py * W + px, y.to(tl.uint8), mask=mask)
            rs += r
            gs += g
            bs += b
        rs = rs * 0.25
        gs = gs * 0.25
        bs = bs * 0.25
        u = tl.minimum(tl.maximum(rs * cu0 + gs * cu1 + bs * cu2 + 128.5, 0.0), 255.0)
        v = tl.minimum(tl.maximum(rs * cv0 + gs * cv1 + bs * cv2 + 128.5, 0.0), 255.0)
        tl.store(obase + H * W + q, u.to(tl.uint8), mask=mask)
        tl.store(obase + H * W + hw2 + q, v.to(tl.uint8), mask=mask)

    _TRITON = (_kernel, triton)
    return _TRITON


def _rgb_to_yuv420p_triton(rgb: Any, out: Any) -> None:
    kernel, triton = _TRITON
    h, w = rgb.shape[-3:-1]
    # frames may sit in a strided [envs, steps] view of the ring buffer: address them by (env, step)
    x = rgb.reshape(-1, *rgb.shape[-4:]) if rgb.ndim > 5 else rgb[(None,) * (5 - rgb.ndim)]
    if tuple(x.stride()[-3:]) != (w * 3, 3, 1):
        x = x.contiguous()
    envs, steps = x.shape[0], x.shape[1]
    if envs * steps == 0:
        return
    block = 1024
    grid = (envs * steps, triton.cdiv((h // 2) * (w // 2), block))
    kernel[grid](x, out, steps, x.stride(0), x.stride(1), h, w, *_Y, *_U, *_V, BLOCK=block)


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
    `fastrecord.buffer.LeafTransform`): uint8 ``[..., H, W, 3]`` leaves with even H and W, converted by
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
