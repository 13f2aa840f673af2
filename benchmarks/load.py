"""A competing CPU load for the benchmark: other processes keeping cores busy while a phase measures, as a
training job, another evaluation or a test suite would on a shared machine."""

from __future__ import annotations

import os
import subprocess
import sys
import time

# pure Python, no I/O; leaves when its parent is gone (a benchmark killed without its finally blocks)
_SPIN = ("import os, sys\nparent = int(sys.argv[1])\n"
         "while os.getppid() == parent:\n    for _ in range(100000):\n        pass\n")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used (``/proc/PID/stat``); 0.0 where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: fields 14, 15 of stat


class CpuLoad:
    """Owns: ``cores`` processes spinning between ``__enter__`` and ``__exit__`` at this process's priority
    (not pinned: the scheduler places them, as it would another program). ``__enter__`` returns once
    each has started spinning; ``cores_held`` is then the CPU they took over the wall time between enter
    and exit, in cores (close to ``cores`` where the machine has them to give). ``cores=0``: no load."""

    def __init__(self, cores: int) -> None:
        if isinstance(cores, bool) or not isinstance(cores, int) or cores < 0:
            raise ValueError(f"cores={cores!r}: pass an int >= 0 (processes spinning, one core's worth each)")
        self.cores = cores
        self.cores_held = 0.0
        self._procs: list[subprocess.Popen] = []
        self._t0 = 0.0
        self._cpu0 = 0.0

    def _cpu(self) -> float:
        return sum(cpu_seconds(p.pid) for p in self._procs)

    def __enter__(self) -> CpuLoad:
        try:
            for _ in range(self.cores):
                self._procs.append(subprocess.Popen([sys.executable, "-S", "-c", _SPIN, str(os.getpid())],
                                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL))
            deadline = time.monotonic() + 10
            while self._procs and time.monotonic() < deadline and min(cpu_seconds(p.pid) for p in self._procs) < 0.05:
                time.sleep(0.01)  # past the interpreter's start: spinning
        except BaseException:
            self._stop()
            raise
        self._t0, self._cpu0 = time.perf_counter(), self._cpu()
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.perf_counter() - self._t0
        if self._procs and wall > 0:
            self.cores_held = (self._cpu() - self._cpu0) / wall
        self._stop()

    def _stop(self) -> None:
        for p in self._procs:
            p.kill()
        for p in self._procs:
            p.wait()
        self._procs = []
