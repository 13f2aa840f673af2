"""Encoder processes: libx264 outside the GIL, frames read from shared staging memory.

Threads of one process share the GIL, which held 16 threads of libx264 ultrafast near 2,200 frames/s
on a 16-core machine where 16 processes encode 7,000. `EncoderProcessPool` starts helper processes that
import only numpy, PyAV and `fastrecord.video.encode`; the frames are not pickled: they live in staging
memory that the encoder process maps (`fastrecord.staging`), so a job message is a file name, an offset
and a shape.
"""

from __future__ import annotations

import atexit
import builtins
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fastrecord import staging as _staging
from fastrecord.video.encode import EncoderError, VideoSettings, _check_frames, _encode_here, check_video_settings
from fastrecord.workers import background_nice

_MSG_MAX = 1 << 20
# The encoder process imports fastrecord.video without running fastrecord/__init__.py (which imports
# torch, gymnasium and ManiSkill), and never imports the parent's __main__ (unlike multiprocessing's
# spawn, which re-runs unguarded user scripts).
_BOOT = (
    "import sys, types\n"
    "if sys.path and sys.path[0] == '': sys.path.pop(0)\n"
    "pkg = types.ModuleType('fastrecord'); pkg.__path__ = [sys.argv[2]]; sys.modules['fastrecord'] = pkg\n"
    "from fastrecord.video.pool import _worker_main\n"
    "_worker_main(int(sys.argv[1]), int(sys.argv[3]))\n"
)


def _worker_main(fd: int, nice: int = 0) -> None:
    """Encoder process loop: map arenas, encode jobs, reply ('ok', wall s, cpu s, path written) or ('error', ...).
    ``nice``: its priority below the caller's (`fastrecord.workers.background_nice`)."""
    import mmap
    import signal

    from fastrecord.workers import lower_priority

    lower_priority(nice)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it closes us
    sock = socket.socket(fileno=fd)
    arenas: dict[int, mmap.mmap] = {}
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(sock, _MSG_MAX, 4)
        except (OSError, EOFError):
            break
        if not data:
            break  # the parent closed the socket (or died)
        msg = pickle.loads(data)
        kind = msg[0]
        if kind == "arena":
            _, aid, size = msg
            arenas[aid] = mmap.mmap(fds[0], size, mmap.MAP_SHARED, mmap.PROT_READ)
            os.close(fds[0])
        elif kind == "forget":
            mm = arenas.pop(msg[1], None)
            if mm is not None:
                try:
                    mm.close()
                except BufferError:
                    pass
        elif kind == "encode":
            _, path, aid, offset, shape, fmt, settings, overlay = msg
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                count = int(np.prod(shape))
                frames = np.frombuffer(arenas[aid], dtype=np.uint8, count=count, offset=offset).reshape(shape)
                written = _encode_here(Path(path), frames, settings, fmt, overlay)
                del frames
                reply: tuple = ("ok", time.perf_counter() - t0, time.process_time() - c0, str(written))
            except BaseException as e:  # noqa: BLE001 - sent to the parent, raised there
                frames = None
                reply = ("error", type(e).__name__, str(e), traceback.format_exc())
            try:
                sock.send(pickle.dumps(reply))
            except OSError:  # the parent died (SIGKILL) while we encoded: nobody to answer
                break
        elif kind == "stop":
            break
    for mm in arenas.values():
        try:
            mm.close()
        except BufferError:
            pass


class _EncoderProcess:
    """Owns: one encoder process and the parent's end of its socket."""

    def __init__(self) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pkg_dir = str(Path(__file__).resolve().parent.parent)  # the fastrecord package
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _BOOT, str(child.fileno()), pkg_dir, str(background_nice())],
                pass_fds=[child.fileno()], stdin=subprocess.DEVNULL, close_fds=True,
                # a session of its own: a SIGTERM to the caller's process group (torchrun stopping a worker, a
                # job scheduler's killpg) is the caller's to handle; it closes us, and its death ends our socket
                start_new_session=True,
            )
        finally:
            child.close()
        self.sock = parent
        self.arenas: set[int] = set()
        self.send_lock = threading.Lock()
        self.idle_since = time.monotonic()

    def send(self, msg: tuple, fds: list[int] | None = None) -> None:
        data = pickle.dumps(msg)
        with self.send_lock:
            if fds:
                socket.send_fds(self.sock, [data], fds)
            else:
                self.sock.send(data)

    def recv(self) -> tuple:
        data = self.sock.recv(_MSG_MAX)
        if not data:
            raise EOFError("encoder process closed its socket")
        return pickle.loads(data)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 5.0) -> None:
        try:
            self.send(("stop",))
        except OSError:
            pass
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.sock.close()


@dataclass
class EncoderStats:
    jobs: int = 0  # videos encoded
    frames: int = 0  # frames encoded
    encode_seconds: float = 0.0  # wall time inside encoder processes, summed over jobs
    encode_cpu_seconds: float = 0.0  # CPU time of encoder processes, summed over jobs
    copied_bytes: int = 0  # frames copied into staging memory first (not already there)


class EncoderProcessPool:
    """Owns: encoder processes (started on demand, at most ``max_processes``; idle ones stop after
    ``idle_timeout`` seconds) and the arenas each has mapped.

    `encode` is called from many threads; each call takes one idle process for the whole video, so
    concurrency equals the number of calling threads (e.g. `WorkerPool` workers), capped here.
    """

    def __init__(self, max_processes: int | None = None, idle_timeout: float = 60.0,
                 staging: _staging.StagingPool | None = None) -> None:
        if not _staging.shared_memory_supported():
            raise ValueError("EncoderProcessPool needs Linux (memfd and fd passing); use VideoSettings(executor='thread')")
        self.max_processes = max_processes or max(1, os.cpu_count() or 1)
        self.idle_timeout = idle_timeout
        # frames not already in staging memory are copied into arenas of this pool's own: one per
        # video in flight, so no count limit (the callers' queue bounds them)
        self._own_staging = staging is None
        self.staging = staging or _staging.StagingPool(max_bytes=1 << 60, prefetch=False, max_cached_bytes=1 << 30)
        self._cond = threading.Condition()
        self._idle: list[_EncoderProcess] = []
        self._all: list[_EncoderProcess] = []
        self._starting = 0
        self._closed = False
        self.stats = EncoderStats()
        self._reaper: threading.Thread | None = None
        _staging.on_arena_close(self._forget)

    # -------------------------------------------------------------- processes
    def start(self, n: int) -> None:
        """Start processes up to ``n`` now (they import PyAV in parallel), rather than at first use."""
        with self._cond:
            todo = max(0, min(n, self.max_processes) - len(self._all) - self._starting)
            self._starting += todo
        procs = []
        try:
            for _ in range(todo):
                procs.append(_EncoderProcess())
        finally:
            with self._cond:
                self._starting -= todo
                self._all.extend(procs)
                self._idle.extend(procs)
                if procs:
                    self._ensure_reaper()
                self._cond.notify_all()

    @property
    def num_processes(self) -> int:
        with self._cond:
            return len(self._all)

    def pids(self) -> list[int]:
        with self._cond:
            return [p.proc.pid for p in self._all]

    def _acquire(self) -> _EncoderProcess:
        with self._cond:
            while True:
                if self._closed:
                    raise RuntimeError("encode on a closed EncoderProcessPool")
                while self._idle:
                    p = self._idle.pop()
                    if p.alive():
                        return p
                    self._all.remove(p)
                if len(self._all) + self._starting < self.max_processes:
                    self._starting += 1
                    break
                self._cond.wait()
        try:
            p = _EncoderProcess()
        finally:
            with self._cond:
                self._starting -= 1
        with self._cond:
            self._all.append(p)
            self._ensure_reaper()
        return p

    def _release(self, p: _EncoderProcess, ok: bool) -> None:
        if not ok:
            with self._cond:
                if p in self._all:
                    self._all.remove(p)
                self._cond.notify()
            try:
                p.proc.kill()
                p.proc.wait()
            except OSError:
                pass
            p.sock.close()
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
                p.stop()

    def _forget(self, arena_id: int) -> None:
        """An arena is being unmapped in this process: have encoder processes drop their mapping too."""
        with self._cond:
            procs = [p for p in self._all if arena_id in p.arenas]
        for p in procs:
            p.arenas.discard(arena_id)
            try:
                p.send(("forget", arena_id))
            except OSError:
                pass

    # -------------------------------------------------------------- jobs
    def encode(self, path: str | Path, frames: np.ndarray, settings: VideoSettings, overlay: Any = None) -> Path:
        """Encode in an encoder process; blocks until the file is written, raises its error here.
        ``overlay`` (a `fastrecord.video.overlay.Overlay`, RGB frames) is drawn in that process.

        Returns the path written: ``path``, or the next free ``STEM_k.mp4`` where ``path`` is taken
        (an existing file is never replaced).
        """
        fmt = _check_frames(frames)
        settings = check_video_settings(settings)
        if fmt == "yuv420p":
            frames.wait_ready()  # an asynchronous device-to-host copy may still be landing
            frames = frames.view(np.ndarray)
        loc = _staging.locate(frames)
        copy = None
        if loc is None:  # not in staging memory yet: one copy (the encode costs far more)
            lease = self.staging.lease(frames.nbytes)
            copy = lease.array(frames.shape)
            np.copyto(copy, frames)
            loc = _staging.locate(copy)
            del lease
            with self._cond:
                self.stats.copied_bytes += frames.nbytes
        arena, offset = loc
        p = self._acquire()
        ok = False
        try:
            if arena.id not in p.arenas:
                p.send(("arena", arena.id, arena.size), [arena.fd])
                p.arenas.add(arena.id)
            p.send(("encode", str(path), arena.id, offset, tuple(frames.shape), fmt, settings, overlay or None))
            reply = p.recv()
            ok = True
        except (OSError, EOFError) as e:
            code = p.proc.poll()
            raise EncoderError(f"the encoder process for {path} died (exit code {code}): {e}") from None
        finally:
            self._release(p, ok)
            del copy
        if reply[0] == "error":
            _, name, text, tb = reply
            exc_type = getattr(builtins, name, None)
            msg = f"{text} (in encoder process; its traceback:\n{tb})"
            if isinstance(exc_type, type) and issubclass(exc_type, Exception) and not issubclass(exc_type, KeyError):
                try:
                    raise exc_type(msg)
                except TypeError:
                    pass
            raise EncoderError(f"{name}: {msg}")
        with self._cond:
            self.stats.jobs += 1
            self.stats.frames += frames.shape[0]
            self.stats.encode_seconds += reply[1]
            self.stats.encode_cpu_seconds += reply[2]
        return Path(reply[3])

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
        for p in procs:
            p.stop()
        if self._own_staging:
            self.staging.close()

    def __enter__(self) -> EncoderProcessPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_default_pool: EncoderProcessPool | None = None
_default_lock = threading.Lock()


def default_encoder_pool() -> EncoderProcessPool:
    """The process-wide encoder pool `encode_mp4` uses (started lazily, stopped at exit)."""
    global _default_pool
    with _default_lock:
        if _default_pool is None or _default_pool._closed:
            _default_pool = EncoderProcessPool()
            atexit.register(_default_pool.close)
        return _default_pool
