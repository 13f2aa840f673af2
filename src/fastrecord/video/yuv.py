"""Frame transforms for the encoders: RGB to yuv420p on the device, and the frame type that marks the result.

`Yuv420Frames` marks frames already converted to yuv420p (on the GPU by `rgb_to_yuv420p`): half the bytes
of RGB to copy, and no colour conversion left for the encoder. Its ``ready`` event says when an
asynchronous device-to-host copy has landed; `wait_ready` blocks on it. `YUV420P` is the conversion as a
transform of `fastrecord.buffer.EpisodeBuffer.gather` (``transforms={"frames": YUV420P}``).

This module imports only numpy at import time (torch and triton lazily): encoder processes import it.
"""

from __future__ import annotations

import threading
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


def rgb_to_yuv420p(rgb: Any, out: Any = None, kernel: str = "auto") -> Any:
    """Torch ``[..., H, W, 3]`` uint8 RGB (H, W even) -> ``[..., H * 3 // 2, W]`` uint8 yuv420p.

    Chroma is the mean over each 2x2 block (computed as the chroma of the block's mean RGB, which is the
    same by linearity). ``kernel``: "triton" (one pass, CUDA only), "torch" (a few memory-bound torch
    kernels, any device), "auto" (triton where it runs), or "ready" (triton once it has run on the device
    in this process, torch's kernels until then: no wait for a compile; `warm_triton` loads it).
    """
    import torch

    *lead, h, w, c = rgb.shape
    if c != 3 or h % 2 or w % 2:
        raise ValueError(f"rgb_to_yuv420p needs [..., H, W, 3] with even H and W, got {list(rgb.shape)}")
    if kernel not in ("auto", "triton", "torch", "ready"):
        raise ValueError(f"kernel={kernel!r} is unknown; use 'auto', 'triton', 'torch' or 'ready'")
    if out is None:
        out = torch.empty((*lead, h * 3 // 2, w), dtype=torch.uint8, device=rgb.device)
    cuda = rgb.device.type == "cuda"
    if kernel == "ready" and cuda and rgb.device not in _triton_ready:
        pass  # torch's kernels until `warm_triton` has loaded Triton's (the caller chooses when: it holds the GIL)
    elif kernel != "torch" and cuda and triton_kernel() is not None:
        _rgb_to_yuv420p_triton(rgb, out)
        _triton_ready.add(rgb.device)
        return out
    elif kernel == "triton":
        raise ValueError("kernel='triton' needs a CUDA tensor and the triton package")
    _rgb_to_yuv420p_torch(rgb, out)
    return out


_TORCH_PIECE_BYTES = 64 * 1024 * 1024  # RGB bytes converted at once by the torch kernels (their float temporaries: 4x)


def _rgb_to_yuv420p_torch(rgb: Any, out: Any) -> None:
    """The conversion in plain elementwise torch kernels (no cuBLAS to initialise at a first call), in pieces
    along the leading dim so that the float temporaries stay small."""
    import torch

    *lead, h, w, _ = rgb.shape
    if lead and lead[0] > 1 and rgb.numel() > _TORCH_PIECE_BYTES:
        step = max(1, lead[0] * _TORCH_PIECE_BYTES // rgb.numel())
        for i in range(0, lead[0], step):
            _rgb_to_yuv420p_torch(rgb[i : i + step], out[i : i + step])
        return
    x = rgb.to(torch.float32)
    r, g, b = x.unbind(-1)
    flat = out.view(*lead, h * w * 3 // 2)
    y = (r * _Y[0]).add_(g * _Y[1]).add_(b * _Y[2]).add_(16.5).clamp_(0, 255)
    flat[..., : h * w].copy_(y.view(*lead, h * w))  # float -> uint8 truncates: +0.5 above rounds
    del y, r, g, b
    mean = x.view(*lead, h // 2, 2, w // 2, 2, 3).mean(dim=(-4, -2))  # [..., H/2, W/2, 3]
    del x
    mr, mg, mb = mean.unbind(-1)
    q = h * w // 4
    for k, c in ((0, _U), (1, _V)):
        plane = (mr * c[0]).add_(mg * c[1]).add_(mb * c[2]).add_(128.5).clamp_(0, 255)
        flat[..., h * w + k * q : h * w + (k + 1) * q].copy_(plane.reshape(*lead, q))


# devices where the Triton kernel has run in this process (loaded or compiled): kernel="ready" uses it there
_triton_ready: set[Any] = set()
_warming: set[Any] = set()
_warm_lock = threading.Lock()


def triton_ready(device: Any) -> bool:
    """Whether the Triton kernel has run on ``device`` in this process (a later launch costs no compile)."""
    return device in _triton_ready


def warm_triton(sample: Any) -> threading.Thread | None:
    """Load (or compile) the Triton kernel for frames like ``sample`` (a CUDA ``[envs, steps, H, W, 3]``
    uint8 view of a few frames, strided as the real ones) on a daemon thread, once per device; conversions
    with ``kernel="ready"`` use torch's kernels until it has run. Returns the thread (None: nothing to do).
    A fresh process would otherwise wait for Triton's import and kernel load (seconds) at its first
    conversion, which holds the first finished episodes back."""
    device = sample.device
    with _warm_lock:
        if device in _triton_ready or device in _warming or device.type != "cuda":
            return None
        _warming.add(device)
    t = threading.Thread(target=_warm, args=(sample,), daemon=True, name="fastrecord-warm-yuv")
    t.start()
    return t


def _warm(sample: Any) -> None:
    try:
        import torch

        if triton_kernel() is not None:
            out = rgb_to_yuv420p(sample, kernel="triton")
            torch.cuda.current_stream(sample.device).synchronize()
            del out
    except Exception:  # noqa: BLE001 - only a warm-up: the torch kernels go on converting
        pass


WARM_TRITON_AFTER = 8  # batches of episodes (x the envs) whose frames are gathered before Triton's kernel is loaded


class TritonWarmup:
    """Loads the conversion's Triton kernel (`warm_triton`) once ``after`` episodes' frames have been gathered; the
    gathers convert with torch's kernels (``kernel="ready"``) until then.

    Its import and load hold the GIL for about a second (0.8-1.4 s on the H100 machine): started at the first reset,
    a fresh process's first 50 steps took 0.4-0.55 s (0.1-0.2 ms a step warm) and the first episodes waited for
    them; started two batches in, it held back the stepping thread of staggered episodes until the encoders ran dry
    (2026-12-06). What it saves is small (one kernel for a dozen of torch's each gather), so a recorder
    (`EpisodeRecorder`) loads it `WARM_TRITON_AFTER` batches in, once a fresh process's start is long behind it."""

    def __init__(self, after: int) -> None:
        self.after = after
        self.episodes = 0

    def gathered(self, episodes: int, frames: Any) -> None:
        """``episodes`` more had their frames (``frames``: the ring buffer's ``[capacity, envs, H, W, 3]``, or None)
        gathered."""
        before, self.episodes = self.episodes, self.episodes + episodes
        if before < self.after <= self.episodes and frames is not None and frames.is_cuda and frames.shape[0] >= 3:
            warm_triton(frames[:3, :1].transpose(0, 1))  # strided as a gather's frames: the kernel they launch


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

        # frames_per_env not specialised: episodes of 16 or 48 steps would compile another kernel, each on the
        # stepping thread
        jit = triton.jit(do_not_specialize=["frames_per_env"])
    except Exception:  # noqa: BLE001 - any import problem: use the torch path
        _TRITON = None
        return None

    # left unannotated: triton reads a kernel's annotations as its arguments' kinds and types (``tl.constexpr``
    # among them), so hints here would change what it compiles
    @jit
    def _kernel(  # type: ignore[no-untyped-def]
        src, dst, frames_per_env, env_stride, frame_stride, H, W,
        cy0, cy1, cy2, cu0, cu1, cu2, cv0, cv1, cv2, BLOCK: tl.constexpr,
    ):
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
        return rgb_to_yuv420p(frames, kernel="ready")  # torch's kernels while Triton's loads (a fresh process)

    def wrap(self, host: np.ndarray, ready: Any) -> Yuv420Frames:
        return Yuv420Frames(host, ready=ready)


YUV420P = Yuv420Transform()
