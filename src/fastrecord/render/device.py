"""This process's SAPIEN render device, opened early on a thread of its own (`open_early`).

SAPIEN opens one render engine a process (the Vulkan device and its CUDA interop), when the first
``sapien.render.RenderSystem`` is made, and keeps it while any render system holds it. The batched render's first
mirror scene opened it: 0.66 s alone on the H200 machine, seconds when the run's sub-env processes open theirs at the
same moment (docs/performance.md). `fastrecord record` knows from its command line that it will draw on a CUDA
device; it opens the engine here while it imports torch and ManiSkill, before the sub-envs begin making their envs,
and holds it until its mirrors hold it (`release_early`).

One engine a process: while one is held, SAPIEN refuses a render system on another device ("current SAPIEN version
only supports single-GPU rendering"), so the device opened here must be the one the envs' ``render_backend`` names
(`device_of`), and an early open of another is let go before their scenes (`settle_early`). Light to import: the
CLI's early start uses it before torch is imported.
"""

from __future__ import annotations

import threading
from typing import Any

from fastrecord.system import stamp

__all__ = ["CUDA_NAMES", "device_of", "on_cuda", "open_early", "release_early", "settle_early", "wait_early"]

_lock = threading.Lock()
_early: _EarlyDevice | None = None  # process-wide, as SAPIEN's engine is (docs/design.md, "Process-wide state")


CUDA_NAMES = ("gpu", "cuda", "sapien_cuda")  # ManiSkill's render backends on a CUDA device, each with an optional ":N"


def on_cuda(render_backend: str | None) -> bool:
    """Whether a ManiSkill render backend names a CUDA device ("gpu", "cuda", "sapien_cuda", each with an optional
    ":N")."""
    return str(render_backend or "").partition(":")[0] in CUDA_NAMES


def device_of(render_backend: str | None) -> str:
    """The CUDA device a ManiSkill render backend renders on, as ManiSkill's ``parse_sim_and_render_backend`` reads
    it: "gpu:N", "cuda:N" or "sapien_cuda:N" -> "cuda:N"; any other -> "cuda" (the batched render's default)."""
    name, _, index = str(render_backend or "").partition(":")
    return f"cuda:{index}" if index and name in CUDA_NAMES else "cuda"


class _EarlyDevice:
    def __init__(self, device: str) -> None:
        self.device = device
        self.system: Any = None  # a render system holding the engine, until released
        self.thread = threading.Thread(target=self._open, name="fastrecord-render-device", daemon=True)

    def _open(self) -> None:
        stamp("render_device_opening")
        try:
            import sapien

            self.system = sapien.render.RenderSystem(sapien.Device(self.device))
        except Exception:  # noqa: BLE001 - an optimisation only: the envs' own make opens it, and raises what it must
            return
        stamp("render_device_opened")


def open_early(device: str) -> None:
    """Start opening this process's render engine on ``device`` ("cuda" or "cuda:N") on a thread, held until
    `release_early`; a second call while one is open or opening does nothing. A failure is dropped: the envs' own
    make opens the engine (and raises what it must)."""
    global _early
    with _lock:
        if _early is not None:
            return
        _early = _EarlyDevice(device)
        _early.thread.start()


def wait_early() -> str | None:
    """Wait until an early open (if any) has ended, so that no scene is made while it runs; the device it opened,
    or None (none was asked for, or it failed)."""
    early = _early
    if early is None:
        return None
    early.thread.join()
    return early.device if early.system is not None else None


def settle_early(device: str) -> None:
    """Before scenes that render on ``device`` are made: wait for an early open, and let go of it where it opened
    another device (a guess from the command line that the run's own options overrode): SAPIEN would refuse their
    device while it holds that one."""
    opened = wait_early()
    if opened is not None and opened != device:
        release_early()


def release_early() -> None:
    """Let go of the early open's render system (after it ended): the engine stays while the envs' scenes hold it,
    and closes with the last of them as it would have. Idempotent; a later `open_early` opens anew."""
    global _early
    with _lock:
        early, _early = _early, None
    if early is not None:
        early.thread.join()
        early.system = None
