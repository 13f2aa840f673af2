"""Memory probes of the benchmark: a process's RSS and PSS from ``/proc``, and monitor threads sampling
peaks while a phase runs (this process, fastrecord's encoder and writer processes, CUDA memory).

A window shorter than the sampling interval still has true peaks: the monitors sample as they start and
as they stop, and this process's peak RSS is its high-water mark (``VmHWM``), reset as the window opens."""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch


def status_bytes(key: str, pid: int | str = "self") -> int:
    """A ``/proc/PID/status`` size field (``VmRSS``, ``VmHWM``, ...) in bytes; 0 where it cannot be read."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def rss(pid: int | str = "self") -> int:
    """Resident set size of a process in bytes (0 where unknown)."""
    return status_bytes("VmRSS", pid)


def reset_peak_rss() -> bool:
    """Reset this process's high-water mark of RSS (``VmHWM``) to its current RSS (Linux: writing 5 to
    ``/proc/self/clear_refs``); False where that cannot be done (``VmHWM`` then keeps the process's peak)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def pss(pid: int) -> int:
    """Proportional set size of a process in bytes: its share of pages it shares with others (0 where unknown)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class MemoryMonitor:
    """Owns a sampling thread: this process's RSS, encoder processes' PSS and CUDA memory every
    ``interval`` s (the encoders' every 25th sample: costly), kept as peaks between ``__enter__`` and
    ``__exit__``. Everything is also sampled at both ends, and the peak RSS includes the high-water mark
    since ``__enter__`` (`reset_peak_rss`), so a window with no sample in it still has true peaks."""

    def __init__(self, device: torch.device, interval: float = 0.2) -> None:
        self.device = device
        self.interval = interval
        self.peak_rss = 0
        self.peak_children_pss = 0
        self.peak_total = 0
        self._hwm_reset = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="bench-memory")

    def sample(self, children: bool = False) -> dict[str, int]:
        """Cheap by default (this process's RSS, CUDA memory); ``children`` adds encoders' PSS (costly)."""
        from fastrecord.staging import default_staging_pool
        from fastrecord.video import pool as encoder_pool

        out = dict(host_rss=rss(), staging_reserved=default_staging_pool().bytes_reserved)
        if children:
            # the pool as it is, if any (default_encoder_pool() would start one just to be measured)
            running = encoder_pool.started_encoder_pool()
            out["encoders_pss"] = sum(pss(p) for p in (running.pids() if running is not None else []))
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            out.update(device_used=total - free, torch_reserved=torch.cuda.memory_reserved(self.device))
        return out

    def _record(self, s: dict[str, int]) -> None:
        self.peak_rss = max(self.peak_rss, s["host_rss"])
        if "encoders_pss" in s:
            self.peak_children_pss = max(self.peak_children_pss, s["encoders_pss"])
            self.peak_total = max(self.peak_total, s["host_rss"] + s["encoders_pss"])

    def _run(self) -> None:
        k = 0
        while not self._stop.wait(self.interval):
            k += 1
            self._record(self.sample(children=k % 25 == 0))

    def __enter__(self) -> MemoryMonitor:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self._hwm_reset = reset_peak_rss()
        self._record(self.sample(children=True))
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._record(self.sample(children=True))
        if self._hwm_reset:
            self.peak_rss = max(self.peak_rss, status_bytes("VmHWM"))

    def peaks(self) -> dict[str, float]:
        out = dict(host_rss_gib=self.peak_rss / 2**30, encoders_pss_gib=self.peak_children_pss / 2**30,
                   host_total_gib=self.peak_total / 2**30)
        if self.device.type == "cuda":
            out["device_torch_peak_gib"] = torch.cuda.max_memory_reserved(self.device) / 2**30
        return out


class ChildrenPss:
    """Owns a sampling thread: the peak summed PSS of the processes ``pids()`` names (the HDF5 writers)
    every ``interval`` s between ``__enter__`` and ``__exit__``, and once at each end."""

    def __init__(self, pids: Callable[[], list[int]], interval: float = 0.2) -> None:
        self.pids, self.interval, self.peak = pids, interval, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="bench-writers-pss")

    def _sample(self) -> None:
        self.peak = max(self.peak, sum(pss(p) for p in self.pids()))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> ChildrenPss:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
