"""The crash-safe writer of ManiSkill trajectory files (``NAME.h5`` + ``NAME.json``): a crash loses
nothing finished and a full disk never takes the caller's process down.

Crash safety. HDF5 has no journal: a process killed while the library holds dirty metadata leaves a file
h5py cannot open (ManiSkill's writer loses every episode that way). So while recording, each batch of
finished episodes goes to its own file ``NAME.h5.parts/part_K.h5``, written under a temporary name and
renamed into place once closed. The parts are the truth: each one also stores its episodes' JSON entries
(root attribute ``fastrecord_episodes``) and the JSON header (``fastrecord_header``). ``NAME.h5`` is a
small index of external links to the parts, rebuilt whole and swapped in with an atomic rename, then the
JSON likewise; both list the same episodes. `recover` rebuilds them from the parts alone (after a crash
some complete parts may not be listed yet); `consolidate` copies everything into one self-contained
``NAME.h5`` (atomic rename) and only then removes the parts. That copy grows while recording: after each
index publish the index process copies the newly listed episodes into ``NAME.h5.parts/consolidating.h5.tmp``
(`process.extend_copy`), so ``close()`` copies only the episodes listed since and renames it.
``TrajectoryWriter(resume=True)`` appends to what is on disk.

Isolation. Every h5py write happens in writer processes (`fastrecord.processes.IsolatedProcess` of
`layout.WRITER_PROCESS_MODULE`, which imports numpy, h5py and the layout only): ``num_writers`` of them
write whole part files in parallel (image observations are compressed in parallel), one more writes the
index and consolidates. With one writer (the default without image observations, and on small machines)
that writer writes the index too: one helper process, whose start (about 0.2 s of CPU importing numpy and
h5py) is the recorder's set-up; its calls are one at a time, so a part and the index never interleave.
A failure there is a `WorkerError` in the caller naming the cause, the fix, and what is safe on disk.
Episode ids stay consecutive in submission order: the index lists the longest prefix of batches whose
parts are complete.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from fastrecord.prestart import helper
from fastrecord.processes import ChildDied, IsolatedProcess, exit_description
from fastrecord.sinks.maniskill_h5.layout import (
    DEFAULT_COMPRESSION,
    GROWING_NAME,
    LOW_DISK,
    WRITER_PROCESS_MODULE,
    disk_text,
    free_bytes,
    is_disk_full,
    parse_compression,
    part_name,
    sibling_paths,
    to_jsonable,
)
from fastrecord.workers import WorkerError

if TYPE_CHECKING:
    from fastrecord.episode import EpisodeData


def part_runs(jobs: list[tuple[int, list, bool]], max_bytes: int = 64 << 20) -> list[list[tuple[int, list, bool]]]:
    """Jobs in runs of consecutive part numbers (of at most ``max_bytes`` of arrays): each run is one part."""
    runs: list[list[tuple[int, list, bool]]] = []
    size = 0
    for job in jobs:
        nbytes = sum(a.nbytes for _, datasets, _ in job[1] for a in datasets.values())
        if runs and job[0] == runs[-1][-1][0] + 1 and job[2] and runs[-1][-1][2] and size + nbytes <= max_bytes:
            runs[-1].append(job)
            size += nbytes
        else:
            runs.append([job])
            size = nbytes
    return runs



class TrajectoryWriter:
    """Owns: ``NAME.h5``, ``NAME.json``, the part files, the writer processes that fill them (one thread
    each feeds its process), and the index process that publishes the index and JSON (with one writer,
    that writer: one process).

    ``submit(episodes)`` queues a batch as one part (blocking when the writers are behind: at most
    ``max_pending`` batches wait); ``wait_until_done()`` returns once everything submitted is on disk and
    listed; ``close()`` drains, publishes, consolidates (``consolidate_on_close``, not after a failure)
    and re-raises. A failure of any writer is a `WorkerError` at the next call; the parts stay.

    ``resume=False`` refuses existing files (`FileExistsError`); ``resume=True`` recovers them and
    appends, episode ids continuing at ``next_episode_id``.
    """

    def __init__(self, h5_path: Path, header: dict[str, Any], *, resume: bool = False, num_writers: int = 1,
                 max_pending: int = 4, index_interval_s: float = 1.0, consolidate_on_close: bool = True,
                 compression: str = DEFAULT_COMPRESSION) -> None:
        if not isinstance(num_writers, int) or num_writers < 1:
            raise ValueError(f"num_writers={num_writers!r}: pass an int >= 1 (writer processes, e.g. 1-4)")
        parse_compression(compression)
        self.compression = compression
        self.num_writers = num_writers
        if not isinstance(max_pending, int) or max_pending < 1:
            raise ValueError(f"max_pending={max_pending!r}: pass an int >= 1 (batches waiting for a writer)")
        self.h5_path = Path(h5_path)
        self.json_path, self.parts_dir = sibling_paths(self.h5_path)
        existing = [p for p in (self.h5_path, self.json_path, self.parts_dir) if p.exists()]
        if existing and not resume:
            names = ", ".join(p.name for p in existing)
            raise FileExistsError(
                f"{names} already exist in {self.h5_path.parent}: TrajectoryWriter(resume=False) never replaces a "
                f"recording. Pass resume=True to append to it, or remove them, or choose another output_dir or name"
            )
        self._header: dict[str, Any] = {k: v for k, v in to_jsonable(dict(header)).items() if k != "episodes"}
        self._committed: list[dict[str, Any]] = []  # JSON entries whose parts are complete, in id order
        self.json_data: dict[str, Any] = {**self._header, "episodes": self._committed}
        self._links: list[tuple[str, str, str]] = []  # (index name, part file, group in it), one per committed
        self._done: dict[int, list[tuple[str, dict]]] = {}  # complete parts not yet in the prefix
        self._next_part = 0  # number of the next submitted part
        self._next_commit = 0  # the first part not in the committed prefix
        self._in_flight = 0  # batches submitted and not finished
        self._published = -1  # episodes listed by the index + JSON on disk
        self._last_publish = 0.0
        self._last_alive_check = 0.0
        self._index_interval_s = index_interval_s
        self._consolidate_on_close = consolidate_on_close
        self._failure: tuple[str, BaseException | None] | None = None
        self._closed = False
        self._stopping = False
        # pids of processes whose call (and its error handling) is under way, once per call: with one writer,
        # the feeding thread's part and the caller's index publish may both hold that process's pid
        self._active: list[int] = []
        self.blocked_seconds = 0.0  # time submit() waited for a free slot
        self._lock = threading.Lock()
        self._publish_lock = threading.Lock()
        # (part, entries, may share a part with its neighbours), or None: stop
        self._jobs: queue.Queue[tuple[int, list, bool] | None] = queue.Queue(maxsize=max_pending)
        self._index: IsolatedProcess | None = None
        self._first_index: threading.Thread | None = None  # the first publish (a new run's), on a thread of its own
        self._writers: list[IsolatedProcess] = []
        # at the caller's CPU priority, not below it: the recorder waits for them (backpressure, close), as
        # ManiSkill's wrapper waits for its own in-process writes; below it, a busy machine starves them
        try:  # processes start in parallel; the first call waits for its process's imports
            # a spare started while the envs were made (`fastrecord.prestart`), else a new process
            self._writers = [helper(WRITER_PROCESS_MODULE, f"HDF5 writer process {i}", background=False)
                             for i in range(num_writers)]
            # one writer also writes the index: a second process would double the start's CPU (issue 20)
            self._index = self._writers[0] if num_writers == 1 else helper(
                WRITER_PROCESS_MODULE, "the HDF5 index process", background=False)
            if existing:
                self._resume()
            else:
                self.parts_dir.mkdir(parents=True, exist_ok=True)
                # an empty but valid file pair, published by the index process once it has started, while the caller
                # goes on (a new interpreter importing h5py: 0.5-0.8 s of a recorder's start on the H100 machine with
                # four replay workers starting); its failure is raised at the next call, as any writer's
                self._first_index = threading.Thread(target=self._publish, args=(True,), daemon=True,
                                                     name="fastrecord-h5-first-index")
                self._first_index.start()
        except BaseException:
            self._stop_processes()
            raise
        self.next_episode_id = len(self._committed)
        self._threads = [threading.Thread(target=self._run, args=(p,), name=f"fastrecord-h5-{i}", daemon=True)
                         for i, p in enumerate(self._writers)]
        for t in self._threads:
            t.start()

    def _index_process(self) -> IsolatedProcess:
        """The process that writes the index (``_index``: None only while __init__ starts the processes)."""
        assert self._index is not None, "the HDF5 index process is not started"
        return self._index

    def _resume(self) -> None:
        try:
            state = self._index_process().call("recover_here", str(self.h5_path), self._header, True)
        except (ChildDied, OSError) as e:
            raise WorkerError(self._explain(e, f"recovering {self.h5_path.name} to resume", self.parts_dir)) from e
        if state["skipped"]:
            warnings.warn(f"resuming {self.h5_path}: part files not listed: {state['skipped']}", stacklevel=3)
        self._committed.extend(state["episodes"])
        self._links.extend(tuple(link) for link in state["links"])
        self._next_part = self._next_commit = state["next_part"]
        self._published = len(self._committed)
        self._last_publish = time.monotonic()

    # -------------------------------------------------------------- caller side
    @property
    def num_episodes(self) -> int:
        return len(self._committed)

    @property
    def pids(self) -> list[int]:
        """Process ids: the part writers, then the index process (unless a writer is it: one writer)."""
        return [p.pid for p in self._processes()]

    def _processes(self) -> list[IsolatedProcess]:
        """Every helper process, each once: the writers, then the index process if it is not one of them."""
        extra = [self._index] if self._index is not None and all(self._index is not w for w in self._writers) else []
        return [*self._writers, *extra]

    def submit(self, episodes: list[EpisodeData]) -> None:
        """Queue one batch of finished episodes: one part file, or one per writer when the batch has more
        episodes than one (so a batch's compression runs on every writer); blocks while ``max_pending`` wait."""
        if self._closed:
            raise RuntimeError("submit() on a closed TrajectoryWriter; open a new one with resume=True to append")
        self.raise_if_failed()
        if not episodes:
            return
        entries = []
        for ep in episodes:
            meta = to_jsonable(dict(ep.meta))
            meta["episode_id"] = int(ep.episode_id)
            entries.append((f"traj_{int(ep.episode_id)}", {k: np.asarray(v) for k, v in ep.datasets.items()}, meta))
        # a batch larger than one episode a writer is spread over the writers: one part each, in order
        n = min(self.num_writers, len(entries))
        bounds = [round(i * len(entries) / n) for i in range(n + 1)]
        for lo, hi in itertools.pairwise(bounds):
            with self._lock:
                k = self._next_part
                self._next_part += 1
                self._in_flight += 1
            t0 = time.perf_counter()
            self._jobs.put((k, entries[lo:hi], n == 1))  # (part, entries, may share a part with its neighbours)
            self.blocked_seconds += time.perf_counter() - t0
        self.raise_if_failed()

    def add_writers(self, total: int) -> None:
        """Grow to ``total`` writer processes (nothing if it has as many): the recorder sizes an automatic
        count from the observations the env actually returns, at its first reset, after this writer opened.
        The new processes take batches submitted from now on; the index process stays where it is."""
        if self._closed or self._stopping or total <= len(self._writers):
            return
        first = len(self._writers)
        new = [IsolatedProcess(WRITER_PROCESS_MODULE, f"HDF5 writer process {i}", background=False)
               for i in range(first, total)]
        threads = [threading.Thread(target=self._run, args=(p,), name=f"fastrecord-h5-{first + i}", daemon=True)
                   for i, p in enumerate(new)]
        with self._lock:
            self._writers.extend(new)
            self._threads.extend(threads)
            self.num_writers = len(self._writers)
        for t in threads:
            t.start()

    def raise_if_failed(self, max_age: float = 0.0) -> None:
        """Raise a writer's failure; a process that died while idle counts too (its exit status is polled
        unless polled less than ``max_age`` seconds ago: the per-step check of the sink)."""
        if self._failure is None and not self._stopping and time.monotonic() - self._last_alive_check >= max_age:
            self._check_alive()
        if self._failure is not None:
            text, cause = self._failure
            raise WorkerError(f"{text}. {self._safe_text()}") from cause

    def wait_until_done(self) -> None:
        """Block until every submitted batch is on disk and listed by ``NAME.h5`` + ``NAME.json``."""
        if self._closed:
            self.raise_if_failed()
            return
        self._jobs.join()
        self._await_first_index()
        self.raise_if_failed()
        self._publish(force=True)
        self.raise_if_failed()

    def _await_first_index(self) -> None:
        """Wait for the first publish: before anything else the index process does (a close's consolidation must
        not be followed by that empty index)."""
        if self._first_index is not None:
            self._first_index.join()

    def close(self) -> None:
        """Drain, publish, consolidate (unless a writer failed), stop the processes, re-raise. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._await_first_index()
            for _ in self._threads:
                self._jobs.put(None)
            for t in self._threads:
                t.join()
            if self._failure is None:
                self._check_alive()
            failed = self._failure is not None
            if failed or not self._consolidate_on_close:  # consolidating publishes (from the parts) itself
                self._publish(force=True, best_effort=failed)
            if self._failure is None and self._consolidate_on_close:
                try:
                    with self._lock:  # every batch is written: the links and entries of every part
                        known = (list(self._links), {**self._header, "episodes": list(self._committed)})
                    self._index_process().call("consolidate_here", str(self.h5_path), self._header, known)
                except BaseException as e:  # noqa: BLE001 - raised below as a WorkerError
                    self._fail(self._explain(e, f"consolidating {self.h5_path.name}", self.h5_path.parent), e)
                    self.h5_path.with_name(self.h5_path.name + ".tmp").unlink(missing_ok=True)
                    self._publish(force=True, best_effort=True)  # the index lists every committed episode
        finally:
            self._stop_processes()
            # a copy grown for a consolidation that did not happen (a failure): nobody writes it now
            (self.parts_dir / GROWING_NAME).unlink(missing_ok=True)
        self.raise_if_failed()

    def __enter__(self) -> TrajectoryWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -------------------------------------------------------------- feeding threads
    def _run(self, proc: IsolatedProcess) -> None:
        while True:
            jobs = [self._jobs.get()]
            # small batches queued behind this one (the writers fell behind: envs finishing a few at a time)
            # share its part: one file, one fsync, one round trip for all of them
            while jobs[-1] is not None and jobs[-1][2]:
                try:
                    nxt = self._jobs.get_nowait()
                except queue.Empty:
                    break
                jobs.append(nxt)
            try:
                for run in part_runs([j for j in jobs if j is not None]):
                    if self._failure is None:
                        self._write(proc, run)
                    else:  # after a failure, drain without working
                        with self._lock:
                            self._in_flight -= len(run)
                if jobs[-1] is None:
                    return
            finally:
                for _ in jobs:
                    self._jobs.task_done()
                jobs, run = [], []  # drop the batches' arrays before waiting again

    def _write(self, proc: IsolatedProcess, run: list[tuple[int, list, bool]]) -> None:
        """Write the jobs of ``run`` (consecutive part numbers) as one part, named by the first."""
        k = run[0][0]
        entries = [e for job in run for e in job[1]]
        name = part_name(k)
        tmp = self.parts_dir / (name + ".tmp")
        metas = [(group, meta) for group, _, meta in entries]
        self._active.append(proc.pid)
        try:
            proc.call("write_part", str(tmp), str(self.parts_dir / name), self._header, entries, self.compression)
        except BaseException as e:  # noqa: BLE001 - raised in the caller as a WorkerError
            ids = f"{metas[0][1]['episode_id']}-{metas[-1][1]['episode_id']}"
            with self._lock:
                self._in_flight -= len(run)
            self._fail(self._explain(e, f"writing {name} (episodes {ids})", tmp), e)
            tmp.unlink(missing_ok=True)  # garbage; frees the space for the index below
            self._publish(force=True, best_effort=True)
            return
        finally:
            self._active.remove(proc.pid)
        with self._lock:
            self._done[k] = metas
            for job in run[1:]:  # the parts it absorbed: no file, no episodes
                self._done[job[0]] = []
            while self._next_commit in self._done:
                part = part_name(self._next_commit)
                for group, meta in self._done.pop(self._next_commit):
                    meta["episode_id"] = len(self._committed)
                    self._links.append((f"traj_{meta['episode_id']}", part, group))
                    self._committed.append(meta)
                self._next_commit += 1
            self._in_flight -= len(run)
            idle = self._in_flight == 0
        # rebuilding the index costs O(episodes): at most once per interval while busy
        self._publish(force=idle)

    def _publish(self, force: bool, best_effort: bool = False) -> None:
        """Swap in the index + JSON of the committed prefix (in the index process: with one writer, that one)."""
        if not force and time.monotonic() - self._last_publish < self._index_interval_s:
            return
        if not self._publish_lock.acquire(blocking=force):
            return  # another thread is publishing
        try:
            with self._lock:
                n = len(self._committed)
                if n == self._published:
                    return
                links = list(self._links[:n])
                doc = {**self._header, "episodes": list(self._committed[:n])}
            index = self._index_process()
            active = [index.pid]
            self._active.append(index.pid)
            try:
                # after a failure (with one writer, perhaps of the writer that was the index process too):
                # a fresh process lists what is safe
                if best_effort and index.poll() is not None:
                    index.stop()
                    index = self._index = IsolatedProcess(WRITER_PROCESS_MODULE, "the HDF5 index process",
                                                          background=False)
                    active.append(index.pid)
                    self._active.append(index.pid)
                index.call("publish_index", str(self.h5_path), links, doc)
                # the close's copy, grown now: the close then copies only the episodes listed after this. With one
                # writer (it is the index process) only when it is idle (force): a copy there would delay the parts
                # queued behind it; a saturated writer leaves the copy to the close, as before
                if links and self._consolidate_on_close and not best_effort and (force or self.num_writers > 1):
                    index.call("extend_copy", str(self.h5_path), links)
            except BaseException as e:  # noqa: BLE001 - raised in the caller as a WorkerError
                for p in (self.h5_path, self.json_path):
                    p.with_name(p.name + ".tmp").unlink(missing_ok=True)
                if not best_effort:
                    self._fail(self._explain(e, f"writing the index {self.h5_path.name} + {self.json_path.name}",
                                             self.h5_path), e)
                return
            finally:
                for pid in active:
                    self._active.remove(pid)
            self._published = n
            self._last_publish = time.monotonic()
        finally:
            self._publish_lock.release()

    # -------------------------------------------------------------- failures
    def _fail(self, text: str, cause: BaseException | None) -> None:
        with self._lock:
            if self._failure is None:
                self._failure = (text, cause)

    def _check_alive(self) -> None:
        """A process that died while idle (a signal, the OOM killer) is a failure too."""
        self._last_alive_check = time.monotonic()
        for p in self._processes():
            code = p.poll()
            if code is not None and p.pid not in self._active and not self._stopping:
                err = ChildDied(f"{p.name} (pid {p.pid}) {exit_description(code)}", code)
                self._fail(self._explain(err, "waiting for work", self.parts_dir), err)
                return

    def _explain(self, e: BaseException, what: str, path: Path) -> str:
        """The cause of a failure in words, with the fix where there is one."""
        if is_disk_full(e):
            free = free_bytes(path.parent)
            return (f"No space left on device while {what} ({path}): {free:,} bytes free on that filesystem. "
                    f"Free space or choose another output_dir")
        if isinstance(e, ChildDied):
            free = free_bytes(path.parent)
            if free is not None and free < LOW_DISK:  # HDF5 may crash rather than report ENOSPC
                return (f"{e} while {what}, with {free:,} bytes free on the filesystem of {path}: most likely "
                        f"No space left on device. Free space or choose another output_dir")
            return f"{e} while {what}; {disk_text(path.parent)}"
        tb = getattr(e, "remote_traceback", None)
        text = f"{type(e).__name__} while {what} ({path}): {e}"
        return text + (f"\n(in the writer process; its traceback:\n{tb})" if tb and not isinstance(e, OSError) else "")

    def _safe_text(self) -> str:
        n, listed = len(self._committed), max(self._published, 0)
        text = f"{n} finished episode(s) are safely on disk"
        if listed >= n:
            text += f", listed in {self.h5_path.name} + {self.json_path.name}"
        else:
            text += (f": {listed} listed in {self.h5_path.name} + {self.json_path.name}, {n - listed} more in complete "
                     f"part files (fastrecord.sinks.maniskill_h5.recover({str(self.h5_path)!r}) lists them)")
        return (text + f"; the part files in {self.parts_dir} are kept: "
                f"`fastrecord consolidate {self.h5_path}` makes one self-contained file of them")

    def _stop_processes(self) -> None:
        self._stopping = True
        for p in self._processes():
            p.stop()

