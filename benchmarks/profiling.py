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



class SpanTrace:
    """Owns wrappers that note every call of a few functions as a span (key, thread, start, end: seconds
    since ``origin``), on whatever thread runs it; `restore` puts them back. For a fresh process's timeline:
    which background work (arenas pinned, encoders started, the codec probed) the first episodes waited for,
    and how many encoders were busy when."""

    def __init__(self, origin: float | None = None) -> None:
        import threading

        self.origin = time.perf_counter() if origin is None else origin
        self.spans: list[tuple[str, str, float, float]] = []
        self.marks: list[tuple[str, float]] = []
        self._lock = threading.Lock()
        self._undo: list[tuple[Any, str, Any, bool]] = []

    def wrap(self, owner: Any, name: str, key: str | None = None) -> None:
        """Note each call of ``owner.name`` (a class's method, or a module's function) as a span ``key``."""
        import threading

        orig = getattr(owner, name)
        own = name in getattr(owner, "__dict__", {})
        key = key or name
        spans, lock = self.spans, self._lock

        def traced(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return orig(*a, **k)
            finally:
                t1 = time.perf_counter()
                with lock:
                    spans.append((key, threading.current_thread().name, t0 - self.origin, t1 - self.origin))

        setattr(owner, name, traced)
        self._undo.append((owner, name, orig, own))

    def mark(self, name: str) -> None:
        """Note that ``name`` happened now."""
        with self._lock:
            self.marks.append((name, time.perf_counter() - self.origin))

    def restore(self) -> None:
        for owner, name, orig, own in reversed(self._undo):
            if own:
                setattr(owner, name, orig)
            else:
                delattr(owner, name)
        self._undo.clear()

    def summary(self, busy_keys: tuple[str, ...] = (), bin_s: float = 0.25, end: float | None = None) -> dict[str, Any]:
        """Per key: calls, the first call's start and end, the longest, the sum; the marks; and, for
        ``busy_keys`` (spans that each hold one encoder), how many were running on average in each ``bin_s``
        slice from the origin to ``end`` (default: the last span's end)."""
        with self._lock:
            spans = list(self.spans)
            marks = list(self.marks)
        keys: dict[str, dict[str, Any]] = {}
        for key, thread, t0, t1 in sorted(spans, key=lambda s: s[2]):
            k = keys.setdefault(key, dict(n=0, first_start=round(t0, 3), first_end=round(t1, 3), longest=0.0,
                                          total=0.0, threads=set()))
            k["n"] += 1
            k["longest"] = round(max(k["longest"], t1 - t0), 4)
            k["total"] = k["total"] + (t1 - t0)
            k["threads"].add(thread.split("-")[0] if thread.startswith("Thread") else thread)
        for k in keys.values():
            k["total"] = round(k["total"], 3)
            k["threads"] = sorted(k["threads"])[:4]
        out: dict[str, Any] = dict(keys=keys, marks={n: round(t, 3) for n, t in marks})
        busy = [(t0, t1) for key, _, t0, t1 in spans if key in busy_keys]
        if busy:
            stop = end if end is not None else max(t1 for _, t1 in busy)
            bins = [0.0] * max(1, int(stop / bin_s) + 1)
            for t0, t1 in busy:
                b = int(max(t0, 0) / bin_s)
                while b < len(bins) and b * bin_s < t1:
                    lo, hi = max(t0, b * bin_s), min(t1, (b + 1) * bin_s)
                    bins[b] += max(0.0, hi - lo) / bin_s
                    b += 1
            out["busy_bin_s"] = bin_s
            out["busy"] = [round(x, 1) for x in bins]
            out["busy_seconds"] = round(sum(t1 - t0 for t0, t1 in busy), 3)
            out["busy_first_start"] = round(min(t0 for t0, _ in busy), 3)
        return out


def trace_recording(trace: SpanTrace) -> tuple[str, ...]:
    """Wrap what a recording process does around its steps (construction's pieces, the first reset's
    reservations, each gather and its staging lease, the encoder processes' start, readiness and jobs, and a
    Triton warm-up in trees before 2026-12-06's); returns the keys whose spans each hold an encoder (for
    `SpanTrace.summary`)."""
    import fastrecord.video as video
    from fastrecord import recorder as recorder_mod
    from fastrecord.buffer import EpisodeBuffer
    from fastrecord.sinks.mp4 import Mp4Sink
    from fastrecord.staging import StagingPool
    from fastrecord.video import encode, pool, yuv

    trace.wrap(video, "resolve_codec", "construct: resolve_codec")
    trace.wrap(encode, "nvenc_usable", "construct: nvenc probe")
    trace.wrap(video, "check_video_settings", "construct: check_video_settings")
    trace.wrap(Mp4Sink, "open", "construct: Mp4Sink.open (encoders started)")
    trace.wrap(pool, "_await_ready", "encoder: started -> answered")  # a fresh interpreter's (no fork server)
    trace.wrap(pool, "_start_encoder", "encoder: started (forked: ready)")
    trace.wrap(recorder_mod.EpisodeRecorder, "on_reset", "step: on_reset")
    trace.wrap(recorder_mod.EpisodeRecorder, "_reserve_staging", "reset: reserve arenas")
    trace.wrap(StagingPool, "_make", "arena: made (mapped)")
    if hasattr(StagingPool, "_pin"):  # pinned piece by piece after it was made (leasable meanwhile)
        trace.wrap(StagingPool, "_pin", "arena: pinned (every piece)")
    trace.wrap(StagingPool, "lease", "gather: staging lease")
    if hasattr(yuv, "_warm"):  # a tree before 2026-12-06's, which loaded a Triton kernel
        trace.wrap(yuv, "_warm", "triton: warm-up")
    trace.wrap(recorder_mod.EpisodeRecorder, "finalize", "step: finalize")
    trace.wrap(EpisodeBuffer, "gather", "gather")
    trace.wrap(yuv.Yuv420Frames, "wait_ready", "encode: wait for the copy")
    trace.wrap(pool.EncoderProcessPool, "_encode_in", "encode: in a process")
    trace.wrap(pool, "encode_here", "encode: in a thread")
    return ("encode: in a process", "encode: in a thread")
