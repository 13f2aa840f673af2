"""Encoder processes (libx264 outside the GIL, frames read from shared staging memory) and `encode_mp4`,
which picks where a video is encoded.

Threads of one process share the GIL, which held 16 threads of libx264 ultrafast near 2,200 frames/s
on a 16-core machine where 16 processes encode 7,000. `EncoderProcessPool` starts helper processes
(`fastrecord.processes.IsolatedProcess`) that import only numpy, PyAV and this package's modules; the
frames are not pickled: they live in staging memory that the encoder process maps (`fastrecord.staging`;
its file descriptor is sent once per process), so a job is a file name, an offset and a shape.
`EncodeGate` bounds how many of a recorder's videos encode at once while its env steps.
"""

from __future__ import annotations

import atexit
import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fastrecord.options import usable_cores
from fastrecord.processes import ChildDied, ForkServer, IsolatedProcess, RemoteError, fork_server_supported
from fastrecord.staging import (
    StagingPool,
    forget_arena,
    locate,
    map_arena,
    mapped_frames,
    on_arena_close,
    shared_memory_supported,
)
from fastrecord.video.encode import (
    EncoderError,
    VideoSettings,
    check_frames,
    check_video_settings,
    encode_here,
    use_processes,
)
from fastrecord.video.yuv import Yuv420Frames


# ---------------------------------------------------------------------------------------------- in the encoder process
# The jobs an encoder process runs (`IsolatedProcess.call` / `notify` by reference), on the frames of the arenas
# it has mapped (`fastrecord.staging.map_arena`).
def encode_job(path: str, arena_id: int, offset: int, shape: tuple[int, ...], fmt: str, settings: VideoSettings,
               overlay: Any) -> tuple[float, float, str]:
    """Encode the frames at ``offset`` of a mapped arena (`encode_here`); returns (wall s, CPU s, path written)."""
    t0, c0 = time.perf_counter(), time.process_time()
    frames = mapped_frames(arena_id, offset, shape)
    try:
        written = encode_here(Path(path), frames, settings, fmt, overlay)
    finally:
        del frames  # the arena can be unmapped once no array views it
    return time.perf_counter() - t0, time.process_time() - c0, str(written)


def ready_probe() -> None:
    """Answered once the encoder process has imported its modules (PyAV, numpy): it is ready for jobs."""


# ---------------------------------------------------------------------------------------------- in the caller
@dataclass(eq=False)
class _Encoder:
    """One encoder process, the arenas it has mapped, and whether it has answered (imported its modules)."""

    process: IsolatedProcess
    arenas: set[int] = field(default_factory=set)
    idle_since: float = field(default_factory=time.monotonic)
    ready: threading.Event = field(default_factory=threading.Event)


def _start_encoder(server: ForkServer | None = None) -> _Encoder:
    """An encoder process, forked by ``server`` (its modules imported already: ready at once) where one is given
    and answers, else a fresh interpreter (its readiness awaited on a thread: it imports PyAV first)."""
    proc = None
    if server is not None and server.alive():
        try:
            proc = IsolatedProcess(__name__, "the encoder process", keep_after_error=True, server=server)
        except (ChildDied, RemoteError, OSError, RuntimeError):  # the server failed: a fresh interpreter instead
            proc = None
    enc = _Encoder(proc if proc is not None else IsolatedProcess(__name__, "the encoder process",
                                                                   keep_after_error=True))
    if proc is not None:  # forked with its modules imported: ready now (a job finds it dead if it died)
        enc.ready.set()
    else:
        threading.Thread(target=_await_ready, args=(enc,), daemon=True, name="fastrecord-encoder-ready").start()
    return enc


def _await_ready(enc: _Encoder) -> None:
    try:
        enc.process.call(ready_probe)
    except Exception:  # noqa: BLE001 - a process that died: the next job finds it dead and replaces it
        pass
    enc.ready.set()


@dataclass
class EncoderStats:
    jobs: int = 0  # videos encoded
    frames: int = 0  # frames encoded
    encode_seconds: float = 0.0  # wall time inside encoder processes, summed over jobs
    encode_cpu_seconds: float = 0.0  # CPU time of encoder processes, summed over jobs
    copied_bytes: int = 0  # frames copied into staging memory first (not already there)
    jobs_here: int = 0  # videos encoded in the calling thread while the processes were starting


class EncoderProcessPool:
    """Owns: encoder processes (started on demand, at most ``max_processes``, by default the usable cores:
    `fastrecord.options.usable_cores`, the affinity mask's; idle ones stop after
    ``idle_timeout`` seconds) and the arenas each has mapped.

    `encode` is called from many threads; each call takes one idle process for the whole video, so
    concurrency equals the number of calling threads (e.g. `WorkerPool` workers), capped here.
    """

    def __init__(self, max_processes: int | None = None, idle_timeout: float = 60.0,
                 staging: StagingPool | None = None) -> None:
        if not shared_memory_supported():
            raise ValueError(
                "EncoderProcessPool needs Linux (memfd and fd passing); use VideoSettings(executor='thread')"
            )
        self.max_processes = max_processes or usable_cores()  # the affinity mask's cores, as every default
        self.idle_timeout = idle_timeout
        # frames not already in staging memory are copied into arenas of this pool's own: one per
        # video in flight, so no count limit (the callers' queue bounds them)
        self._own_staging = staging is None
        self.staging = staging or StagingPool(max_bytes=1 << 60, prefetch=False, max_cached_bytes=1 << 30)
        self._cond = threading.Condition()
        self._idle: list[_Encoder] = []
        self._all: list[_Encoder] = []
        self._starting = 0
        self._closed = False
        self.stats = EncoderStats()
        self._reaper: threading.Thread | None = None
        self._server: ForkServer | None = None  # forks the encoder processes (`fork_server`)
        self._here = threading.Semaphore(1)  # one caller at a time encodes in its thread while processes start
        self._server_lock = threading.Lock()
        on_arena_close(self._forget)

    # -------------------------------------------------------------- processes
    def fork_server(self) -> ForkServer | None:
        """The process the encoders are forked from, with numpy, PyAV and the encoder's modules imported once
        (`fastrecord.processes.ForkServer`), started at the first call; None where fork servers are not
        supported, the pool is closed, or the server could not start (each encoder is a fresh interpreter then)."""
        with self._server_lock:
            if self._server is None and not self._closed and fork_server_supported():
                try:
                    self._server = ForkServer([__name__], "the encoders' fork server")
                except Exception:  # noqa: BLE001 - no server (it could not start, or died at once): fresh interpreters
                    return None
            return self._server

    def start(self, n: int) -> None:
        """Start processes up to ``n`` now rather than at first use, without waiting for them: they are forked on
        a background thread from the fork server, which imports their modules once while the caller goes on
        (0.35-0.64 s on the H100 machine, then a few milliseconds each). Until the first is forked, a job of
        executor "auto" is encoded in a caller's thread, one at a time (`_acquire`); the others wait for a
        process."""
        with self._cond:
            todo = max(0, min(n, self.max_processes) - len(self._all) - self._starting)
            self._starting += todo
        if todo:
            threading.Thread(target=self._start_some, args=(todo,), daemon=True,
                             name="fastrecord-encoder-start").start()

    def _start_some(self, todo: int) -> None:
        server = self.fork_server()
        for _ in range(todo):
            p = None
            try:
                if not self._closed:
                    p = _start_encoder(server)
            except Exception:  # noqa: BLE001 - a process that cannot start: jobs start their own (and raise there)
                p = None
            with self._cond:
                self._starting -= 1
                late = p is not None and self._closed
                if p is not None and not late:
                    self._all.append(p)
                    self._idle.append(p)
                    self._ensure_reaper()
                self._cond.notify_all()
            if late and p is not None:  # the pool closed meanwhile
                p.process.stop(timeout=5.0)

    def wait_started(self, timeout: float | None = None) -> bool:
        """Wait until no process is being started (`start` forks them on a thread); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._starting == 0, timeout)

    @property
    def num_processes(self) -> int:
        with self._cond:
            return len(self._all)

    def pids(self) -> list[int]:
        with self._cond:
            return [p.process.pid for p in self._all]

    @property
    def closed(self) -> bool:
        return self._closed

    def _acquire(self, here_while_starting: bool = False) -> _Encoder | None:
        """An idle encoder process (started if none is and the cap allows), waiting for one otherwise.
        ``here_while_starting``: None when the idle ones are all still importing their modules (a fresh
        pool of fresh interpreters), or none exists yet (the fork server is importing them), and no other caller
        is encoding in its thread: the caller encodes in its own thread (one at a time: a 512x512 video took 0.41
        s in one of many threads, GIL-bound, against 0.085 s in a process, and a writer thread encoding here
        gives no job to the processes meanwhile), then releases ``_here``."""
        with self._cond:
            while True:
                if self._closed:
                    raise RuntimeError("encode on a closed EncoderProcessPool")
                for p in [p for p in self._idle if not p.process.alive()]:  # died while idle: replaced below
                    self._idle.remove(p)
                    self._all.remove(p)
                # the longest idle first (`_release` appends): every process gets work and is warm (its first
                # video's overlay font, codec and mapped arenas) when all are needed at once, e.g. at a close after
                # `Mp4Sink` let fewer encode at a time while the envs stepped (on the H100 machine the eval's close
                # took 0.49-0.52 s against 0.26-0.27 s when the most recently idle went first, which left 9 of 16
                # encoders without work until the close; a fresh encoder's first video with info text took ~2x)
                ready = [p for p in self._idle if p.ready.is_set()]
                if ready:
                    self._idle.remove(ready[0])
                    return ready[0]
                starting = bool(self._idle) or (self._starting > 0 and not self._all)  # none ready: all importing
                if here_while_starting and starting and self._here.acquire(blocking=False):
                    return None  # the caller encodes here (and releases `_here`)
                if self._idle:
                    return self._idle.pop(0)
                if len(self._all) + self._starting < self.max_processes:
                    self._starting += 1
                    break
                self._cond.wait()
        try:
            p = _start_encoder(self.fork_server())
        finally:
            with self._cond:
                self._starting -= 1
        with self._cond:
            self._all.append(p)
            self._ensure_reaper()
        return p

    def _release(self, p: _Encoder, ok: bool) -> None:
        if not ok:
            with self._cond:
                if p in self._all:
                    self._all.remove(p)
                self._cond.notify()
            p.process.kill()
            return
        p.idle_since = time.monotonic()
        with self._cond:
            self._idle.append(p)
            self._cond.notify()

    def _ensure_reaper(self) -> None:
        if self._reaper is None and self.idle_timeout > 0:
            self._reaper = threading.Thread(target=self._reap, name="fastrecord-encoder-reaper", daemon=True)
            self._reaper.start()

    def _reap(self) -> None:
        while True:
            time.sleep(min(5.0, self.idle_timeout))
            now = time.monotonic()
            with self._cond:
                if self._closed:
                    return
                old = [p for p in self._idle if now - p.idle_since > self.idle_timeout]
                for p in old:
                    self._idle.remove(p)
                    self._all.remove(p)
            for p in old:
                p.process.stop(timeout=5.0)

    def _forget(self, arena_id: int) -> None:
        """An arena is being unmapped in this process: have encoder processes drop their mapping too."""
        with self._cond:
            procs = [p for p in self._all if arena_id in p.arenas]
        for p in procs:
            p.arenas.discard(arena_id)
            try:
                p.process.notify(forget_arena, arena_id)
            except RuntimeError:  # the process died (ChildDied) or was stopped: nothing left to unmap
                pass

    # -------------------------------------------------------------- jobs
    def encode(self, path: str | Path, frames: np.ndarray, settings: VideoSettings, overlay: Any = None) -> Path:
        """Encode in an encoder process; blocks until the file is written, raises its error here.
        ``overlay`` (a `fastrecord.video.overlay.Overlay`) is drawn in that process, on the frames as given.

        Returns the path written: ``path``, or the next free ``STEM_k.mp4`` where ``path`` is taken
        (an existing file is never replaced).
        """
        fmt = check_frames(frames)
        settings = check_video_settings(settings)
        if isinstance(frames, Yuv420Frames):  # fmt "yuv420p"
            frames.wait_ready()  # an asynchronous device-to-host copy may still be landing
            frames = frames.view(np.ndarray)
        # executor "auto": while a fresh pool's processes are still importing PyAV (0.3-1 s), the first
        # videos are encoded in the calling thread (PyAV encodes outside the GIL) instead of waiting
        p = self._acquire(here_while_starting=settings.executor == "auto")
        if p is None:
            try:
                t0, c0 = time.perf_counter(), time.thread_time()
                written = encode_here(Path(path), frames, settings, fmt, overlay or None)
                self._count(frames.shape[0], time.perf_counter() - t0, time.thread_time() - c0, here=True)
            finally:
                self._here.release()
            return written
        return self._encode_in(p, path, frames, fmt, settings, overlay)

    def _encode_in(self, p: _Encoder, path: str | Path, frames: np.ndarray, fmt: str, settings: VideoSettings,
                   overlay: Any) -> Path:
        """Encode in process ``p`` (acquired), released after the job whatever happens."""
        copy = None
        try:
            loc = locate(frames)
            if loc is None:  # not in staging memory yet: one copy (the encode costs far more)
                lease = self.staging.lease(frames.nbytes)
                copy = lease.array(frames.shape)
                np.copyto(copy, frames)
                loc = locate(copy)
                assert loc is not None  # a lease's array lies in a staging arena
                del lease
                with self._cond:
                    self.stats.copied_bytes += frames.nbytes
            arena, offset = loc
            proc = p.process
            if arena.id not in p.arenas:
                proc.notify(map_arena, arena.id, arena.size, fds=[arena.fd])
                p.arenas.add(arena.id)
            wall, cpu, written = proc.call(encode_job, str(path), arena.id, offset, tuple(frames.shape), fmt,
                                           settings, overlay or None)
            p.ready.set()  # it has answered
        except ChildDied as e:
            raise EncoderError(f"{e} while encoding {path}") from e
        except RemoteError as e:
            raise EncoderError(str(e)) from e
        finally:
            self._release(p, p.process.alive())  # after an error in its job, a live process serves the next
            del copy
        self._count(frames.shape[0], wall, cpu)
        return Path(written)

    def _count(self, frames: int, wall: float, cpu: float, here: bool = False) -> None:
        with self._cond:
            self.stats.jobs += 1
            self.stats.frames += frames
            self.stats.encode_seconds += wall
            self.stats.encode_cpu_seconds += cpu
            self.stats.jobs_here += int(here)

    def reset_stats(self) -> EncoderStats:
        with self._cond:
            s, self.stats = self.stats, EncoderStats()
        return s

    def close(self) -> None:
        """Stop every process (after its current job). Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            procs, self._all, self._idle = list(self._all), [], []
            self._cond.notify_all()
        # every process told at once, then waited for: one after the other, each stop waited for its process to
        # wake up and leave before the next heard of it (16 processes at an interpreter's exit)
        stops = [threading.Thread(target=p.process.stop, args=(5.0,), name="fastrecord-encoder-stop")
                 for p in procs[1:]]
        for t in stops:
            t.start()
        if procs:
            procs[0].process.stop(timeout=5.0)
        for t in stops:
            t.join()
        with self._server_lock:
            server, self._server = self._server, None
        if server is not None:  # after its children: their exit statuses came from it
            server.close()
        if self._own_staging:
            self.staging.close()

    def __enter__(self) -> EncoderProcessPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_default_pool: EncoderProcessPool | None = None  # the pool of default_encoder_pool (read by started_encoder_pool)
_default_lock = threading.Lock()


def default_encoder_pool() -> EncoderProcessPool:
    """The process-wide encoder pool `encode_mp4` uses (started lazily, stopped at exit)."""
    global _default_pool
    with _default_lock:
        if _default_pool is None or _default_pool.closed:
            _default_pool = EncoderProcessPool()
            atexit.register(_default_pool.close)
        return _default_pool


def started_encoder_pool() -> EncoderProcessPool | None:
    """The process-wide encoder pool if `default_encoder_pool` has made one, else None (starts nothing:
    for monitoring its processes)."""
    return _default_pool


def encode_mp4(path: str | Path, frames: np.ndarray, settings: VideoSettings,
               pool: EncoderProcessPool | None = None, overlay: Any = None) -> Path:
    """Encode ``frames`` ([T, H, W, 3] uint8 RGB, or `Yuv420Frames`) to an MP4 at ``path``; return the path
    written: ``path``, or ``STEM_1.mp4``, ``STEM_2.mp4``, ... where that name is taken (never replaced).

    The file appears atomically (written under a temporary name, then linked into place), so a killed
    process never leaves a truncated video behind. ``settings`` go through `check_video_settings` (cached).
    Blocks until the file is written; the encode runs in an encoder process (``pool``, by default the
    process-wide `default_encoder_pool`) unless ``settings.executor="thread"``. ``overlay`` (a
    `fastrecord.video.overlay.Overlay`, with either kind of frames) is drawn there too, not in the caller.
    """
    path = Path(path)
    fmt = check_frames(frames)
    settings = check_video_settings(settings)
    if use_processes(settings):
        return (pool or default_encoder_pool()).encode(path, frames, settings, overlay=overlay)
    if isinstance(frames, Yuv420Frames):  # fmt "yuv420p"
        frames = frames.plain()
    return encode_here(path, frames, settings, fmt, overlay)


class EncodeGate:
    """How many writer threads encode at once: ``limit`` while the env steps, every one while the caller waits for
    the outputs (`lifted`). One gate covers a recorder's encoders: its videos' (`fastrecord.sinks.mp4.Mp4Sink`) and
    its LeRobot dataset's (`fastrecord.sinks.lerobot.LeRobotSink`), each holding a slot only while it encodes."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._cond = threading.Condition()
        self._active = 0
        self._lifted = 0  # callers waiting for the videos (the limit is off meanwhile)
        self.most = 0  # the most encodes seen at once

    @contextlib.contextmanager
    def slot(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: self._lifted > 0 or self._active < self.limit)
            self._active += 1
            self.most = max(self.most, self._active)
        try:
            yield
        finally:
            with self._cond:
                self._active -= 1
                self._cond.notify()

    @contextlib.contextmanager
    def lifted(self) -> Iterator[None]:
        with self._cond:
            self._lifted += 1
            self._cond.notify_all()
        try:
            yield
        finally:
            with self._cond:
                self._lifted -= 1
