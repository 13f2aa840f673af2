"""Background work with bounded memory and errors that surface in the caller, and the forkserver.

`WorkerPool` owns a bounded job queue and its worker threads. Producers block in `submit` when the
queue is full (backpressure: nothing is ever dropped). A worker that raises keeps the exception; the
next `submit`, `wait_until_done` or `close` re-raises it in the caller's thread.

Helper processes (`IsolatedProcess`, `background_nice`, ...) live in `fastrecord.processes`.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

_SENTINEL = object()


class WorkerError(RuntimeError):
    """A background job failed; the original exception is chained as ``__cause__``."""


class WorkerPool:
    """Owns: a bounded queue of jobs, ``num_workers`` daemon threads, and the first worker error.

    ``handler(job)`` runs on a worker thread for every submitted job. With ``num_workers=1`` jobs run
    in submission order, which the HDF5 writer relies on.
    """

    def __init__(
        self,
        handler: Callable[[Any], None],
        num_workers: int = 1,
        max_pending: int = 4,
        name: str = "fastrecord",
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers={num_workers} must be >= 1")
        if max_pending < 1:
            raise ValueError(f"max_pending={max_pending} must be >= 1")
        self._handler = handler
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self._error: BaseException | None = None
        self._error_lock = threading.Lock()
        self._closed = False
        self.blocked_seconds = 0.0  # time producers spent waiting in submit() for a free slot
        self._threads = [
            threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True) for i in range(num_workers)
        ]
        for t in self._threads:
            t.start()

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is _SENTINEL:
                    return
                if self._error is None:  # after a failure, drain without working
                    self._handler(job)
            except BaseException as e:  # noqa: BLE001 - kept and re-raised in the caller
                with self._error_lock:
                    if self._error is None:
                        self._error = e
            finally:
                job = None  # drop the job (and e.g. its frames' staging memory) before waiting again
                self._queue.task_done()

    def raise_if_failed(self) -> None:
        if self._error is not None:
            err = self._error
            raise WorkerError(f"a background writer failed: {type(err).__name__}: {err}") from err

    def submit(self, job: Any) -> None:
        """Queue a job; blocks while the queue is full (the writers set the pace, nothing is dropped)."""
        if self._closed:
            raise RuntimeError("submit() on a closed WorkerPool")
        self.raise_if_failed()
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            t0 = time.perf_counter()
            self._queue.put(job)
            self.blocked_seconds += time.perf_counter() - t0

    def wait_until_done(self) -> None:
        """Block until every submitted job has run, then re-raise the first worker error, if any."""
        self._queue.join()
        self.raise_if_failed()

    def close(self) -> None:
        """Finish queued jobs, stop the workers, re-raise the first worker error. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for _ in self._threads:
            self._queue.put(_SENTINEL)
        for t in self._threads:
            t.join()
        self.raise_if_failed()

    @property
    def pending(self) -> int:
        return self._queue.qsize()

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------- forkserver
# Processes that run ManiSkill envs (replay workers, a CPU vector env's sub-envs) come from
# multiprocessing's forkserver, with these modules imported once in the server: each process it forks
# starts with torch, ManiSkill and fastrecord already imported (spawn re-imported them in every process:
# about 5 s each, longer when 16 start together), and nothing of the caller (CUDA, threads, open files)
# is copied, as with spawn. "__main__" is multiprocessing's own default: a user script's guarded main module,
# so that wrappers or tasks defined there unpickle in the children.
# "fastrecord.replay.workers" is the replay library's process code (worker processes), and with it its env
# code (`fastrecord.replay.envs`: a CPU vector env's sub-envs); "fastrecord.commands.record_env" holds `record`'s
# sub-env factory and "fastrecord.render.vector" the batched render's pose reporter, which every sub-env of
# a batched render unpickles (a module the server cannot import is skipped by multiprocessing).
FORKSERVER_PRELOAD = ("__main__", "fastrecord.make_env", "fastrecord.replay.workers",
                      "fastrecord.commands.record_env", "fastrecord.render.vector")


def forkserver_context() -> Any:
    """multiprocessing's forkserver context, its server preloading `FORKSERVER_PRELOAD` (where the server
    is not running yet; one server serves the whole process)."""
    import multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))
    return ctx


def freeze_imports() -> None:
    """Take every object alive now (what the process imported: torch, ManiSkill, SAPIEN) out of the garbage
    collector's reach (``gc.freeze``), in processes fastrecord owns (its CLI, replay workers, CPU sub-envs).

    ManiSkill calls ``gc.collect()`` whenever it builds or clears a scene (env creation, close, and each
    reset of a CPU eval env, which reconfigures), to release GPU memory; a full collection walks every
    tracked object, about 0.17 s a call on a 2-core machine once torch and ManiSkill are imported, two
    per replay env. Frozen objects are skipped (and never freed: they live as long as the modules). Not for
    a user's process: the library API does not call it."""
    import gc

    gc.freeze()


def claim_process() -> None:
    """What fastrecord does to a process it owns (its CLI, replay workers, CPU sub-envs), never to a user's:
    `freeze_imports`, and SAPIEN's BRDF table handed to every camera ManiSkill makes from now on
    (`fastrecord.render.lut.install`: no 5 s table computed on a CPU renderer)."""
    from fastrecord.render import lut

    freeze_imports()
    lut.install()


def start_forkserver() -> None:
    """Start the forkserver now (it imports its preload while the caller goes on with its own imports)."""
    from multiprocessing import forkserver

    forkserver_context()
    forkserver.ensure_running()


# ---------------------------------------------------------------------------------------------- spaces probe
class SpacesProbe:
    """Owns: one forkserver process that builds an env with ``thunk`` and sends back what gymnasium's
    ``AsyncVectorEnv`` reads off a dummy env (metadata, render mode, action and observation spaces), and the
    thread that waits for it.

    ``AsyncVectorEnv.__init__`` builds that dummy env in the caller, and closes it, before it starts a single
    sub-env process: a whole ManiSkill env made and destroyed on the critical path (2-3 s of a 16-env start on
    the H200 machine, beside the batched render's mirror scenes). Started early (the CLI starts it before its
    own imports), the probe builds it on another core meanwhile; `first_thunk` hands the vector env a stand-in
    with the probe's answers. Any failure of the probe leaves the dummy to gymnasium (its error then raised
    where it always was)."""

    def __init__(self, thunk: Callable[[], Any]) -> None:
        self._thunk = thunk
        self._answer: dict[str, Any] | None = None
        self._thread = threading.Thread(target=self._run, name="fastrecord-spaces-probe", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            ctx = forkserver_context()
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_probe_spaces, args=(self._thunk, send), name="fastrecord-spaces-probe",
                               daemon=True)
            proc.start()  # waits for the server's preload
            send.close()
            try:
                answer = recv.recv()
            except EOFError:
                answer = None
            proc.join()
            self._answer = answer if isinstance(answer, dict) else None
        except Exception:  # noqa: BLE001 - a probe that cannot run leaves the dummy env to gymnasium
            self._answer = None

    def stand_in(self, timeout: float = 120.0) -> Any:
        """A `SpacesStandIn` with the probe env's answers, or None (the probe failed or did not answer)."""
        self._thread.join(timeout)
        return None if self._answer is None else SpacesStandIn(**self._answer)


def _probe_spaces(thunk: Callable[[], Any], conn: Any) -> None:
    answer = None
    try:
        env = thunk()
        answer = dict(metadata=dict(env.metadata), render_mode=env.render_mode, action_space=env.action_space,
                      observation_space=env.observation_space)
        env.close()
    except Exception:  # noqa: BLE001 - the caller's own dummy env then raises it where it always did
        answer = None
    try:
        conn.send(answer)
    except OSError:  # the caller is gone or no longer waits
        pass
    finally:
        conn.close()


class SpacesStandIn:
    """What ``AsyncVectorEnv.__init__`` reads off its dummy env, without the env."""

    def __init__(self, metadata: dict[str, Any], render_mode: Any, action_space: Any, observation_space: Any) -> None:
        self.metadata, self.render_mode = metadata, render_mode
        self.action_space, self.observation_space = action_space, observation_space

    def close(self) -> None:
        pass


class _FirstThunk:
    """Sub-env 0's thunk of a vector env: in the process that made it (``AsyncVectorEnv``'s dummy env) the
    probe's stand-in where the probe answered, elsewhere (sub-env 0's own process) the env itself."""

    def __init__(self, thunk: Callable[[], Any], probe: SpacesProbe) -> None:
        self.thunk, self.pid = thunk, os.getpid()
        self.probe: SpacesProbe | None = probe

    def __getstate__(self) -> dict[str, Any]:
        return {"thunk": self.thunk, "probe": None, "pid": self.pid}

    def __call__(self) -> Any:
        if self.probe is not None and os.getpid() == self.pid:
            stand_in, self.probe = self.probe.stand_in(), None  # one dummy a vector env
            if stand_in is not None:
                return stand_in
        return self.thunk()


def first_thunk(thunks: list[Callable[[], Any]], probe: SpacesProbe | None) -> list[Callable[[], Any]]:
    """``thunks`` with the first one answering ``AsyncVectorEnv``'s dummy env from ``probe`` (None: as given)."""
    if probe is None or not thunks:
        return thunks
    return [_FirstThunk(thunks[0], probe), *thunks[1:]]
