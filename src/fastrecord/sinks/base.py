"""The output seam: `Sink` (where finished episodes go) and `RunDirectory` (who owns the files).

A recorder hands every kept, finished episode (`fastrecord.episode.EpisodeData`) to each of its sinks, and the outcome
of every finished episode, kept or not (`fastrecord.episode.EpisodeEnded`), too. fastrecord's own outputs are sinks
(`maniskill_h5.ManiSkillH5Sink`, `mp4.Mp4Sink`, `lerobot.LeRobotSink`, `results.ResultsSink`, the loggers), built from
the options by `fastrecord.sinks.factory.build_sinks`; a user's sink is passed to the wrapper as
``RecordEpisode(env, dir, sinks=[MySink()])``. Adding an output format is a new module in this package, with
its files declared in `fastrecord.sinks.formats` (this module knows no format: it asks that registry).

`RunDirectory` is the one owner of a run's files in ``output_dir``. A run is named (``trajectory_name``,
a unique timestamp by default) and owns the ``NAME{suffix}`` files its formats declare
(`fastrecord.sinks.formats.RUN_FILES`), the manifest ``NAME.fastrecord.json`` (options, status, and every
other file the run wrote, e.g. its videos) and a lock ``.NAME.lock`` held while it records
(`fastrecord.locks`). Policy, the same for the wrapper and every command:

- never delete or replace a file of another run, nor of an earlier run of the same name unless asked;
- an existing run of the same name: ``if_exists="error"`` (default) refuses with the choices,
  ``"overwrite"`` deletes exactly that run's files first, ``"resume"`` keeps them and adds episodes;
- two recorders on one name are prevented by the lock (also across processes; a killed process's lock
  is released by the kernel), and default names never collide.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from fastrecord.episode import EpisodeData, EpisodeEnded
from fastrecord.locks import LockHeld, release_lock, take_lock
from fastrecord.sinks import formats
from fastrecord.sinks.formats import run_files
from fastrecord.sinks.runfiles import (  # noqa: F401 - the run's file names, re-exported
    JOURNAL_SUFFIX,
    MANIFEST_SUFFIX,
    RESULTS_SUFFIX,
    append_line,
    glob_escape,
    journal_path,
    listed_files,
    lock_path,
    owned_intent_files,
    read_manifest,
)
from fastrecord.workers import WorkerPool

log = logging.getLogger("fastrecord")



class OutputExistsError(ValueError):
    """The output directory already holds a run of this name (or another recorder is writing it).

    ``found``: what the earlier run left, without the message's advice (its ``if_exists=...`` choices), for
    callers whose own options choose differently (``fastrecord replay``: resume, overwrite); None where
    the advice is not about ``if_exists`` (another recorder holds the name)."""

    def __init__(self, message: str, found: str | None = None) -> None:
        super().__init__(message)
        self.found = found


# ---------------------------------------------------------------------------------------------- sinks
class Sink:
    """A destination of finished episodes.

    Lifecycle: ``open(run)`` once (after the run directory is claimed), ``submit(episodes)`` for each
    batch of kept episodes (on the stepping thread: return quickly or block for backpressure, never drop),
    then ``episodes_ended(ended)`` with the outcome of every episode of that batch, kept or not (the same
    call of the recorder; optional), ``after_commit(n, wait)`` each time the run's commit log advances,
    ``raise_if_failed()`` before each step, ``wait_until_done()``, ``close()`` (idempotent, re-raises).

    ``wants_frames``: episodes carry ``frames`` (``[T+1, H, W, 3]`` uint8, or `Yuv420Frames` if
    ``accepts_yuv420p`` and every frame sink accepts them). ``wants_datasets``: episodes carry the
    trajectory arrays (observations, env states, actions, ...).
    """

    wants_frames: bool = False
    wants_datasets: bool = True
    accepts_yuv420p: bool = False

    def open(self, run: RunDirectory) -> None:
        self.run = run

    def submit(self, episodes: Sequence[EpisodeData]) -> None:
        raise NotImplementedError

    def episodes_ended(self, ended: Sequence[EpisodeEnded]) -> None:
        """Episodes ended (kept ones have an ``episode_id`` and were submitted just before); on the
        stepping thread. The default ignores them."""

    def committed(self, episode_id: int) -> bool:
        """Whether kept episode ``episode_id`` (submitted before) is on disk for good in this output. The
        results row of an episode, the run's commit (`fastrecord.sinks.results`), waits until every sink
        says so. The default: at once (a sink that writes in ``submit``, or keeps nothing on disk)."""
        return True

    def after_commit(self, committed: int, wait: bool) -> None:
        """The run's commit log advanced: kept episodes ``0 .. committed-1`` are done in every output (their
        results rows are written; ``run.committed`` says so too). Called on the stepping thread by the results
        sink (`fastrecord.sinks.results`), after every other sink's ``wait_until_done`` when ``wait``: then
        return once the sink has taken them in (a sink that puts only committed episodes into its files,
        LeRobot's, rolls its file group here). The default: nothing."""

    def raise_if_failed(self) -> None:
        pass

    def wait_until_done(self) -> None:
        pass

    def close(self) -> None:
        pass

    @property
    def files(self) -> list[Path]:
        """Files this sink has written so far (for summaries)."""
        return []


class BackgroundSink(Sink):
    """A sink whose ``write(job)`` runs on background threads (``workers`` of them) with a bounded queue
    (`fastrecord.workers.WorkerPool`): the stepping thread waits when writers fall behind, and a writer's
    exception is re-raised in the caller (`fastrecord.WorkerError`) at the next step, ``wait_until_done``
    or ``close``. By default every submitted episode is a job; a sink that makes its own jobs on the
    stepping thread (pieces of a video, a row of scalars) hands them to ``queue(job)``.

    The built-in `fastrecord.sinks.mp4.Mp4Sink` and the loggers (`fastrecord.sinks.loggers`) are
    BackgroundSinks. ``workers``/``max_pending`` may be set per instance before ``open``."""

    workers: int = 1
    max_pending: int | None = None  # None: 2 x workers
    thread_name: str | None = None  # the worker threads' name (None: fastrecord-<class name>), -0, -1, ...
    _pool: WorkerPool | None = None

    def write(self, job: Any) -> None:
        raise NotImplementedError

    def open(self, run: RunDirectory) -> None:
        super().open(run)
        n = max(1, int(self.workers))
        self._pool = WorkerPool(self.write, num_workers=n, max_pending=self.max_pending or 2 * n,
                                name=self.thread_name or f"fastrecord-{type(self).__name__}")

    def queue(self, job: Any) -> None:
        """Hand ``job`` to a writer thread (on the stepping thread; blocks while the queue is full, inside
        `while_blocked`)."""
        if self._pool is None:
            raise RuntimeError(f"{type(self).__name__}: a job before open(); the recorder opens its sinks first")
        self._pool.submit(job, while_blocked=self.while_blocked)

    def while_blocked(self) -> contextlib.AbstractContextManager[Any]:
        """What holds while the stepping thread waits for room in the queue (nothing here)."""
        return contextlib.nullcontext()

    def submit(self, episodes: Sequence[EpisodeData]) -> None:
        for ep in episodes:
            self.queue(ep)

    def raise_if_failed(self) -> None:
        if self._pool is not None:
            self._pool.raise_if_failed()

    def wait_until_done(self) -> None:
        if self._pool is not None:
            self._pool.wait_until_done()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()

    @property
    def blocked_seconds(self) -> float:
        """Time the stepping thread waited for a free slot in the queue (backpressure)."""
        return self._pool.blocked_seconds if self._pool is not None else 0.0


def takes_render_frames(video_source: str, save_video: bool, sinks: Sequence[Any] | None) -> bool:
    """Whether a recorder takes the render camera's frames (its envs then draw them each step): videos of it
    (``save_video`` with ``video_source='render'``), or an extra sink wanting frames (a logger's videos). Before the
    recorder is made (it decides the same from its built sinks: any ``wants_frames``), e.g. to lay out its envs."""
    return video_source == "render" and bool(save_video or any(getattr(s, "wants_frames", False)
                                                               for s in sinks or ()))


def close_sinks(
    sinks: Sequence[Sink], side_by_side: Sequence[Sink] = (), last: Sink | None = None
) -> list[BaseException]:
    """Close ``sinks``: those in ``side_by_side`` (fastrecord's own outputs, whose close waits on their helper
    processes: the HDF5 file's consolidation, the encoders' last videos, LeRobot's last file group) each on a
    thread of its own, at the same time; the others (a user's sinks) one after the other on the calling thread,
    in order, meanwhile; ``last`` (the results sink) once all of them are closed. Returns the errors in the
    sinks' order; every sink is closed whatever another raised. A first Ctrl-C while waiting is kept (returned
    last) and the closes go on; a second one leaves them (their threads are daemons)."""
    found: dict[int, BaseException] = {}

    def close_one(i: int, s: Sink) -> None:
        try:
            s.close()
        except BaseException as e:  # noqa: BLE001 - returned to the caller
            found[i] = e

    own = [i for i, s in enumerate(sinks) if any(s is o for o in side_by_side) and s is not last]
    threads = [threading.Thread(target=close_one, args=(i, sinks[i]), daemon=True,
                                name=f"fastrecord-close-{type(sinks[i]).__name__}") for i in own]
    for t in threads:
        t.start()
    for i, s in enumerate(sinks):
        if i not in own and s is not last:
            close_one(i, s)
    interrupted: BaseException | None = None
    for t in threads:
        while t.is_alive():
            try:
                t.join()
            except BaseException as e:  # the first Ctrl-C / SIGTERM: the closes go on; the next one leaves
                if interrupted is not None:
                    raise
                interrupted = e
    for i, s in enumerate(sinks):
        if s is last:
            close_one(i, s)
    errors = [found[i] for i in sorted(found)]
    return errors + ([interrupted] if interrupted is not None else [])


# ---------------------------------------------------------------------------------------------- run directory

def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a synced hidden temporary file and an atomic rename (a reader sees
    the old file or the new one, never half of one)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk: no half-written temporary left behind
        raise


def recorded_nothing(output_dir: Path, name: str, existing: list[Path]) -> bool:
    """Whether the run ``name`` whose files are ``existing`` recorded nothing: no counter above 0 in its manifest,
    and none of its files holds recordings, as the format owning each says (`fastrecord.sinks.formats`: no episode
    in ``NAME.json``, no part or shard files, other files empty, folders without videos or parquet files: a logger's
    folder of no episode, a LeRobot dataset of none). What start-up left when it was interrupted (Ctrl-C, a bad
    camera name found at the first reset) or a run closed before its first episode ended."""
    if not (output_dir / f"{name}{MANIFEST_SUFFIX}").is_file():
        return False  # not a run fastrecord made: never judged empty
    manifest = read_manifest(output_dir / f"{name}{MANIFEST_SUFFIX}")
    if any(isinstance(v, int) and v > 0 for v in manifest.get("counters", {}).values()):
        return False
    return not any(formats.file_holds_recordings(p, output_dir, name) for p in existing)


class RunDirectory:
    """Owns: one run's claim on ``output_dir`` (the lock of its name), the decision about what an earlier
    run of that name left (error / overwrite / resume), and the run manifest listing the run's files.

    ``open()`` is the first thing that touches the disk; ``close(status)`` releases the claim. An earlier
    run of the name that recorded nothing (`recorded_nothing`: no episode, video, part or shard, e.g. one
    stopped during start-up) counts as absent whatever ``if_exists`` says: its files are replaced, so the
    same command can be run again. An ``open()`` that fails (no space for the manifest) removes what it
    created, the lock and the folders included.
    """

    def __init__(self, output_dir: str | Path, name: str | None, if_exists: str = "error",
                 options: dict[str, Any] | None = None, manifest_interval_s: float = 1.0,
                 check_resume: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.output_dir = Path(output_dir)
        # called with the earlier run's manifest when this run resumes it, under the lock and before anything
        # is written: its error (e.g. another base seed) leaves every file of the earlier run as it was
        self.check_resume = check_resume
        self.requested_name = name
        self.name = name or ""
        self.if_exists = if_exists
        self.options = options or {}
        self.resuming = False
        self.previous: dict[str, Any] = {}  # the manifest of the run being resumed
        self.counters: dict[str, int] = {}  # e.g. episodes / next_video_id, saved in the manifest
        self._files: list[str] = []
        self._file_episodes: dict[str, list[int]] = {}  # a listed file -> the kept episodes it holds (videos)
        self._intents: dict[str, dict[str, Any]] = {}  # files being written: name asked for -> journal entry
        self._journal: Any = None  # the open journal (.NAME.fastrecord.journal), append-only
        self._started = ""
        # kept episodes of this run committed to every output (their results rows written): ids 0 .. committed-1;
        # a sink that combines episodes into files (LeRobot) waits for it (`fastrecord.sinks.results`)
        self.committed = 0
        self._lock_fd: int | None = None
        self._mutex = threading.Lock()
        self._interval = manifest_interval_s
        self._last_write = 0.0
        self._dirty = False
        self._created = False  # this run created its manifest (vs. resumed one)
        self._made: list[Path] = []  # the folders `open` created (deepest first)
        self._closed = False

    # -------------------------------------------------------------- claim
    def path(self, suffix: str) -> Path:
        return self.output_dir / f"{self.name}{suffix}"

    @property
    def manifest_path(self) -> Path:
        return self.path(MANIFEST_SUFFIX)

    def open(self) -> RunDirectory:
        made = [p for p in (self.output_dir, *self.output_dir.parents) if not p.exists()]  # deepest first
        self._made = made  # what `abandon` removes again where it stays empty
        try:
            self.output_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            self._remove_folders(made)
            raise ValueError(
                f"output_dir={str(self.output_dir)!r} cannot be created ({e.strerror}); pass a writable directory"
            ) from e
        try:
            if not self.output_dir.is_dir() or not os.access(self.output_dir, os.W_OK | os.X_OK):
                raise ValueError(
                    f"output_dir={str(self.output_dir)!r} is not a writable directory; "
                    "pass a directory you can write to"
                )
            if self.requested_name:
                self._claim(self.requested_name, default_name=False)
            else:  # ManiSkill's timestamp name, made unique: never another run's files
                stamp = time.strftime("%Y%m%d_%H%M%S")
                for k in range(10_000):
                    if self._claim(stamp if k == 0 else f"{stamp}_{k}", default_name=True):
                        break
            self._started = self.previous.get("started") or time.strftime("%Y-%m-%dT%H:%M:%S%z")
            self._write_manifest(status="recording", force=True)
        except BaseException:
            if self._created:
                self.manifest_path.unlink(missing_ok=True)
            self._release()
            self._remove_folders(made)
            raise
        return self

    @staticmethod
    def _remove_folders(made: list[Path]) -> None:
        """Remove the folders of ``made`` (deepest first) that are still empty: what a failed open created."""
        for p in made:
            try:
                p.rmdir()
            except OSError:
                return

    def _claim(self, name: str, default_name: bool) -> bool:
        """Take the lock of ``name`` and apply the policy; False when a default name is taken."""
        try:
            self._lock_fd = take_lock(lock_path(self.output_dir, name))
        except LockHeld as e:
            if default_name:
                return False
            raise OutputExistsError(
                f"another recorder ({e.holder or 'unknown process'}) is writing trajectory_name={name!r} in "
                f"{str(self.output_dir)!r}; give this run another trajectory_name or output_dir, or wait until "
                f"the other one is closed"
            ) from None
        self.name = name
        for tmp in formats.temporaries(self.output_dir, name):
            tmp.unlink(missing_ok=True)  # a manifest write a kill cut short (the name is ours now: nobody writes it)
        existing = run_files(self.output_dir, name)
        if not existing:
            return True
        if default_name:
            self._release()
            return False
        if recorded_nothing(self.output_dir, name, existing):
            for p in existing:
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
            log.info("fastrecord: replaced the earlier run %r in %s, which recorded nothing", name, self.output_dir)
            return True
        self.previous = read_manifest(self.manifest_path)
        if self.if_exists == "error":
            self._release()
            found = self._exists_message(existing)
            raise OutputExistsError(
                f"{found} Choose: if_exists='resume' (CLI: --if-exists resume) keeps it and adds episodes after it; "
                f"if_exists='overwrite' (--if-exists overwrite) deletes it first; or pass another trajectory_name "
                f"or output_dir.", found=found)
        if self.if_exists == "overwrite":
            for p in existing:
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
            log.warning("fastrecord: if_exists='overwrite' removed %d file(s) of the earlier run %r in %s",
                        len(existing), name, self.output_dir)
            self.previous = {}
            return True
        # resume: keep everything, continue the earlier run's counters and file list
        if self.check_resume is not None:
            try:
                self.check_resume(self.previous)
            except BaseException:
                self._release()
                raise
        self.resuming = True
        listed = listed_files(self.output_dir, name)
        listed.update(owned_intent_files(self.output_dir, name))
        self._files = list(listed)
        self._file_episodes = {f: e for f, e in listed.items() if e}
        self.counters = {k: int(v) for k, v in self.previous.get("counters", {}).items()}
        return True

    def _exists_message(self, existing: list[Path]) -> str:
        """What the earlier run of this name left, in one sentence or two (no advice)."""
        what = ", ".join(p.name + ("/" if p.is_dir() else "") for p in existing[:6])
        if len(existing) > 6:
            what += f" and {len(existing) - 6} more"
        listed = formats.episodes_listed(self.output_dir, self.name)
        episodes = "" if listed is None else f" ({listed} episodes)"
        status = self.previous.get("status")
        left = " It was left by a run that did not close (crash or kill)." if status == "recording" else ""
        return f"{str(self.output_dir)!r} already holds a run named {self.name!r}{episodes}: {what}.{left}"

    # -------------------------------------------------------------- manifest
    def intend_file(self, path: str | Path, episodes: Sequence[int] = ()) -> None:
        """Say that this run is about to write ``path`` (a video, for ``episodes``): a journal line, before the
        file may appear (under that name or a ``_k`` one), so that a kill in between leaves no file nobody
        owns (`owned_intent_files`). `add_file` with ``intended=path`` confirms it."""
        rel = os.path.relpath(Path(path), self.output_dir)
        entry = {"intent": rel, "episodes": [int(e) for e in episodes], "t": time.time()}
        with self._mutex:
            self._intents[rel] = entry
            self._append_journal(entry)

    def add_file(self, path: str | Path, episodes: Sequence[int] = (), intended: str | Path | None = None) -> None:
        """Record a file this run wrote (``episodes``: the kept episode ids it holds; ``intended``: the name
        `intend_file` asked for): a journal line at once, the manifest rewritten at most once an interval.
        Thread-safe; a file already listed is listed once."""
        rel = os.path.relpath(Path(path), self.output_dir)
        entry: dict[str, Any] = {"file": rel, "episodes": [int(e) for e in episodes]}
        if intended is not None:
            entry["for"] = os.path.relpath(Path(intended), self.output_dir)
        with self._mutex:
            if intended is not None:
                self._intents.pop(entry["for"], None)
            if rel in self._files and intended is None:
                return
            if rel not in self._files:
                self._files.append(rel)
            if episodes:
                self._file_episodes[rel] = entry["episodes"]
            self._append_journal(entry)
            self._dirty = True
        self._write_manifest(status="recording")

    def remove_files(self, rels: Sequence[str]) -> None:
        """Drop files from the list (they were deleted: `fastrecord.sinks.reconcile` discarded their episodes)."""
        with self._mutex:
            gone = set(rels)
            self._files = [f for f in self._files if f not in gone]
            for f in gone:
                self._file_episodes.pop(f, None)
            self._dirty = True

    def _append_journal(self, entry: dict[str, Any]) -> None:
        """One line, written through (under ``_mutex``): it survives a kill of this process; a write that fails part
        way is undone (`runfiles.append_line`)."""
        if self._journal is None:
            path = journal_path(self.output_dir, self.name)
            self._journal = open(path, "ab", buffering=0)  # noqa: SIM115 (open for the run; _release closes)
        append_line(self._journal, (json.dumps(entry) + "\n").encode())

    def set_counter(self, key: str, value: int) -> None:
        with self._mutex:
            self.counters[key] = int(value)
            self._dirty = True

    def _write_manifest(self, status: str, force: bool = False) -> None:
        now = time.monotonic()
        with self._mutex:
            if not force and (not self._dirty or now - self._last_write < self._interval):
                return
            from fastrecord import __version__

            data = dict(
                fastrecord=__version__, name=self.name, status=status, pid=os.getpid(), host=socket.gethostname(),
                started=self._started, updated=time.strftime("%Y-%m-%dT%H:%M:%S%z"), options=self.options,
                counters=self.counters, files=self._files, file_episodes=self._file_episodes,
                pending=list(self._intents.values()),
            )
            atomic_write_bytes(self.manifest_path, json.dumps(data, indent=2, default=repr).encode())
            self._created = True
            self._dirty = False
            self._last_write = now
            # the manifest lists everything the journal said: start it afresh (a kill right here leaves both)
            if self._journal is not None:
                self._journal.truncate(0)
                self._journal.seek(0)
            else:  # an earlier run's (resume: read at the claim, listed now)
                journal_path(self.output_dir, self.name).unlink(missing_ok=True)

    # -------------------------------------------------------------- release
    def _release(self, manifest_final: bool = False) -> None:
        """Close the journal and give the name's lock back. The journal is removed only where the final
        manifest (``manifest_final``) was written: a close whose manifest write failed (a full disk) keeps it,
        the only list of the files added since the last manifest, for the resume or ``consolidate``."""
        if self._journal is not None:
            try:
                self._journal.close()
            except OSError:  # its last lines could not be written (a full disk): what reached the disk stays
                pass
            self._journal = None
            if manifest_final and not self._intents:
                journal_path(self.output_dir, self.name).unlink(missing_ok=True)
        if self._lock_fd is not None:
            fd, self._lock_fd = self._lock_fd, None
            release_lock(lock_path(self.output_dir, self.name), fd)

    def abandon(self) -> None:
        """Construction failed before anything was recorded: remove what this run created (never what an
        earlier run of a resumed name left), release the name."""
        if self._created and not self.resuming:
            created = [self.output_dir / f for f in self._files]
            declared = [f.path(self.output_dir, self.name) for f in formats.RUN_FILES if f.abandon]
            for p in (*declared, *created):
                if p.is_dir():
                    shutil.rmtree(p, ignore_errors=True)
                elif p.exists():
                    p.unlink()
        self._closed = True
        self._release(manifest_final=True)  # nothing recorded: its journal lists nothing to keep
        if self._created and not self.resuming:
            self._remove_folders(self._made)  # the output folders its open made, where nothing else is in them

    def close(self, status: str = "closed") -> None:
        """Write the final manifest and release the name. Idempotent."""
        if self._closed:
            return
        self._closed = True
        written = False
        try:
            self._write_manifest(status=status, force=True)
            written = True
        finally:
            self._release(manifest_final=written)


class EpisodeHandoff:
    """Hands ended episodes to every sink (``episodes_ended``): every sink hears of every episode, even after
    another sink failed; the first error is raised after all.

    Owns: the batches held back inside `held`."""

    def __init__(self, sinks: Sequence[Sink]) -> None:
        self.sinks = sinks
        self._held: list[list[EpisodeEnded]] | None = None

    def __call__(self, events: list[EpisodeEnded]) -> None:
        if self._held is not None:
            self._held.append(events)
            return
        errors = []
        for s in self.sinks:
            try:
                s.episodes_ended(events)
            except Exception as e:  # noqa: BLE001 - the first is raised below
                errors.append(e)
        if errors:
            raise errors[0]

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Inside, the ended episodes' events (``episodes_ended``: the results rows, the loggers) reach the sinks on
        leaving, in order: a vector env's reset holds them while its sub-envs reset. The kept episodes' data
        (``submit``: the videos' encodes) is not held; it reaches the sinks as the episodes end. A sink's error is
        raised on leaving unless the body's own leaves; the batches are handed off either way."""
        held: list[list[EpisodeEnded]] = []
        self._held, ok = held, False
        try:
            yield
            ok = True
        finally:
            self._held = None
            first: Exception | None = None
            for events in held:
                try:
                    self(events)
                except Exception as e:  # noqa: BLE001 - the first is raised below, unless the body's own error leaves
                    first = first or e
            if first is not None and ok:
                raise first
