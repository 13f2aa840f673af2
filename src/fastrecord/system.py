"""Machine set-up helpers: pick a Vulkan driver SAPIEN can render with; how long this process has run; the
phase timestamps a whole-command benchmark reads (`stamp`)."""

from __future__ import annotations

import glob
import logging
import os
import threading
import warnings

_LAVAPIPE = ("/usr/share/vulkan/icd.d/lvp_icd.json", "/usr/share/vulkan/icd.d/lvp_icd.x86_64.json")


def has_nvidia_vulkan() -> bool:
    """Whether an NVIDIA Vulkan driver is installed (a cheap guess at "SAPIEN renders on a CUDA device here",
    without importing torch)."""
    return bool(glob.glob("/usr/share/vulkan/icd.d/nvidia*.json") + glob.glob("/etc/vulkan/icd.d/nvidia*.json"))


def has_nvidia_gpu() -> bool:
    """A cheap guess (no torch import) at "torch sees a CUDA device here": an NVIDIA device node, or an NVIDIA
    Vulkan driver installed or named by ``VK_DRIVER_FILES`` / ``VK_ICD_FILENAMES``."""
    named = os.environ.get("VK_DRIVER_FILES", "") + os.environ.get("VK_ICD_FILENAMES", "")
    devices = os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/nvidia0")
    return devices or "nvidia" in named or has_nvidia_vulkan()


def torch_sees_cuda() -> bool:
    """Whether torch sees a CUDA device (``torch.cuda.is_available()``'s answer), without opening CUDA in this process
    where it is not open yet: ``torch.cuda.device_count()`` asks NVML first (it honours ``CUDA_VISIBLE_DEVICES``), as
    ``is_available`` does with ``PYTORCH_NVML_BASED_CUDA_CHECK=1``. A command's plan asks it before it forks its
    workers, which open CUDA themselves: ``is_available()`` took 181-207 ms of a fresh process on the H100 machine,
    this 16-19 ms (`benchmarks/probe_cuda_check.py`)."""
    import torch

    if torch.cuda.is_initialized():
        return torch.cuda.is_available()
    return torch.cuda.device_count() > 0


def use_lavapipe_if_no_gpu() -> str | None:
    """On a machine without an NVIDIA Vulkan driver, point the Vulkan loader at Mesa's lavapipe (CPU).

    Must run before SAPIEN creates its renderer. Leaves an explicit ``VK_ICD_FILENAMES`` alone.
    Returns the ICD file chosen, or None.
    """
    if os.environ.get("VK_ICD_FILENAMES") or os.environ.get("VK_DRIVER_FILES"):
        return None
    if has_nvidia_vulkan():
        return None
    for path in _LAVAPIPE:
        if os.path.exists(path):
            os.environ["VK_ICD_FILENAMES"] = path
            return path
    return None


def process_age() -> float | None:
    """Seconds since this process started (Linux: ``/proc/self/stat``'s start time against ``/proc/uptime``,
    to a clock tick), interpreter start-up and imports included; None where ``/proc`` does not say."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))  # field 22: starttime
    except (OSError, ValueError, IndexError):
        return None


TIMELINE_ENV = "FASTRECORD_TIMELINE"  # a path: the commands write their phases' wall-clock times there (JSON)
_stamps: dict[str, float] = {}
_stamps_lock = threading.Lock()  # a close stamps from its own thread while the caller's thread stamps too


def stamp(name: str) -> None:
    """Note that phase ``name`` was reached now (``time.time()``; the first stamp of a name stays), where the
    environment variable ``FASTRECORD_TIMELINE`` names a file: the file is rewritten with every stamp so far
    (a few small writes a run; nothing at all without the variable). `benchmarks/bench_whole.py` launches
    whole commands with it and reads where their seconds went. Threads stamp one at a time (two of them once
    shared the temporary file: one's rename found it gone, and the close it stamped failed)."""
    path = os.environ.get(TIMELINE_ENV)
    if not path or name in _stamps:
        return
    import time

    with _stamps_lock:
        if name in _stamps:
            return
        _stamps[name] = time.time()
        _write_stamps(path, _stamps)


def _write_stamps(path: str, stamps: dict[str, float]) -> None:
    """``stamps`` as ``path``'s whole JSON, written beside it and renamed over it (a reader never sees half)."""
    import json

    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(stamps, f)
    os.replace(tmp, path)


def stamp_beside(tag: str, name: str) -> None:
    """Note phase ``name`` in ``<FASTRECORD_TIMELINE>.<tag>`` (created or added to), leaving this process's own
    timeline as it is: a process whose children stamp their own files (the forkserver, which a failed write must
    not end: an unwritable file is left unstamped). Nothing without the variable."""
    path = os.environ.get(TIMELINE_ENV)
    if not path:
        return
    import json
    import time

    target = f"{path}.{tag}"
    try:
        with open(target) as f:
            stamps = json.load(f)
    except (OSError, ValueError):
        stamps = {}
    stamps.setdefault(name, time.time())
    try:
        _write_stamps(target, stamps)
    except OSError:
        pass


def child_timeline(tag: str) -> None:
    """In a child process that stamps phases of its own (a replay worker): its stamps go to
    ``<FASTRECORD_TIMELINE>.<tag>``, starting empty, instead of rewriting the caller's file with the stamps this
    process inherited from it. Nothing without the variable."""
    path = os.environ.get(TIMELINE_ENV)
    if not path:
        return
    with _stamps_lock:
        os.environ[TIMELINE_ENV] = f"{path}.{tag}"
        _stamps.clear()


QUIET_MANISKILL = ("is not installed with git",)  # ManiSkill log lines the CLI drops (repeated, not actionable)
MANISKILL_LOGGERS = ("mani_skill ", "mani_skill")  # 3.0.1 names its logger with a trailing space


class _DropMessages(logging.Filter):
    def __init__(self, needles: tuple[str, ...]) -> None:
        super().__init__()
        self.needles = needles

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(n in message for n in self.needles)


def quiet_third_party() -> None:
    """Silence ManiSkill's repeated, non-actionable warnings for this (CLI) process only."""
    for name in MANISKILL_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessages) for f in logger.filters):
            logger.addFilter(_DropMessages(QUIET_MANISKILL))
    for category in (DeprecationWarning, PendingDeprecationWarning, FutureWarning):
        warnings.filterwarnings("ignore", category=category)
