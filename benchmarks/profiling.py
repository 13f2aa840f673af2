"""Profiling aids of the benchmark: py-spy sampling of this process and its children, method timers on
the stepping thread, and cProfile's top functions."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any


def start_pyspy(path: Path, rate: int = 50) -> subprocess.Popen | None:
    """py-spy sampling this process and its children ``rate`` times a second into ``path`` (raw collapsed
    stacks); None where py-spy is not installed."""
    exe = shutil.which("py-spy")
    if exe is None:
        return None
    p = subprocess.Popen([exe, "record", "--pid", str(os.getpid()), "--subprocesses", "--rate", str(rate), "--duration",
                          "300", "--format", "raw", "--output", str(path), "--nonblocking"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # let it attach
    return p


def stop_pyspy(prof: subprocess.Popen | None) -> None:
    """Stop a `start_pyspy` sampler (None: none was started); it writes its profile as it stops."""
    if prof is None:
        return
    import signal

    time.sleep(0.5)
    prof.send_signal(signal.SIGINT)  # py-spy writes its profile on SIGINT
    try:
        prof.wait(timeout=30)
    except subprocess.TimeoutExpired:
        prof.kill()


def summarize_profile(path: Path, top: int = 15) -> dict[str, list[tuple[str, float]]]:
    """Leaf frames of a py-spy raw (collapsed) profile, as shares of samples, per process kind."""
    if not path.exists():
        return {}
    by_proc: dict[str, dict[str, int]] = {}
    totals: dict[str, int] = {}
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        frames = stack.split(";")
        proc = (
            "encoder" if "_worker_main" in stack else "parent"
        )  # the encoder processes' entry (fastrecord.video.pool)
        leaf = next(
            (f for f in reversed(frames) if not f.startswith("process ") and not f.startswith("thread ")), frames[-1]
        )
        by_proc.setdefault(proc, {})
        by_proc[proc][leaf] = by_proc[proc].get(leaf, 0) + int(n)
        totals[proc] = totals.get(proc, 0) + int(n)
    return {p: [(k, round(v / totals[p], 4)) for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:top]]
            for p, d in by_proc.items()}



class StepTimers:
    """Owns wrappers around a few methods (the stepping thread's own work, split up): the wall time summed
    per key, the calls, and the first call's time; `restore` puts the methods back."""

    def __init__(self) -> None:
        self.t: dict[str, float] = {}
        self.n: dict[str, int] = {}
        self.first: dict[str, float] = {}  # the first call's seconds (cold start: what the first episodes wait for)
        self._undo: list[tuple[Any, str, Any]] = []

    def wrap(self, owner: Any, name: str, key: str) -> None:
        orig = getattr(owner, name)
        own = name in getattr(owner, "__dict__", {})

        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return orig(*a, **k)
            finally:
                dt = time.perf_counter() - t0
                self.t[key] = self.t.get(key, 0.0) + dt
                self.n[key] = self.n.get(key, 0) + 1
                self.first.setdefault(key, dt)

        setattr(owner, name, timed)
        self._undo.append((owner, name, orig if own else None))

    def clear(self) -> None:
        self.t.clear()
        self.n.clear()

    def restore(self) -> None:
        for owner, name, orig in reversed(self._undo):
            if orig is None:
                delattr(owner, name)  # it was the class's: drop the instance's wrapper
            else:
                setattr(owner, name, orig)
        self._undo.clear()




def cprofile_top(prof: Any, top: int = 25) -> list[tuple[str, int, float, float]]:
    """(function, calls, own seconds, cumulative seconds), by own time."""
    import pstats

    st = pstats.Stats(prof)
    rows = []
    for (file, line, fn), (cc, nc, tt, ct, _) in st.stats.items():
        rows.append((f"{Path(file).name}:{line}({fn})", int(nc), round(tt, 4), round(ct, 4)))
    rows.sort(key=lambda r: -r[2])
    return rows[:top]

