"""A replay over several processes: worker processes (``workers > 1``) or torchrun ranks, each replaying
a share of the episodes into its own shard (`fastrecord.shards`), and the join of the shards into ``NAME.h5`` +
``NAME.json`` in input order. A torchrun rank replays input episodes ``g`` with ``g % N`` its rank; worker
processes take the next episode from one shared counter whenever one of their envs is free, so that they end
together (a worker whose envs were made later, or whose episodes are shorter, replays fewer).

A worker that fails or is killed does not stop the others: the error names it and the missing
episodes, and running the same replay again replays only what is missing.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastrecord.exits import StopSignals
from fastrecord.processes import exit_description
from fastrecord.replay.config import ReplayConfig, ReplaySummary, ReplayWorkerError, StartCancelled, StopRequest
from fastrecord.replay.drive import replayed_sources, run_plan
from fastrecord.replay.plan import ReplayPlan, make_plan
from fastrecord.shards import ranges_text
from fastrecord.sinks.maniskill_h5 import open_trajectory
from fastrecord.sinks.runfiles import RESULTS_SUFFIX
from fastrecord.system import child_timeline, quiet_third_party, stamp
from fastrecord.workers import claim_process, forkserver_context

if TYPE_CHECKING:
    from fastrecord.sinks.base import RunDirectory


class _WorkerStop(StopSignals):
    """A replay worker's stop request: SIGTERM (the caller forwards its SIGINT/SIGTERM as one SIGTERM;
    a terminal's Ctrl-C, sent to the whole process group, is ignored here), or the caller's death."""

    def __init__(self, parent: int) -> None:
        super().__init__("replay worker")
        self.parent = parent

    @property
    def requested(self) -> bool:
        if self.signum is None and not self._caller_alive():
            self.signum = signal.SIGTERM  # orphaned: stop, the shard keeps what is finished
        return self.signum is not None

    def _caller_alive(self) -> bool:
        import multiprocessing as mp

        caller = mp.parent_process()  # the caller, also when the forkserver forked us (our OS parent is the server)
        if caller is not None and caller.pid == self.parent:
            return caller.is_alive()
        return os.getppid() == self.parent

    def __enter__(self) -> _WorkerStop:
        super().__enter__()
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        return self


@dataclass(frozen=True)
class _Share:
    """One worker's (or rank's) part of a sharded replay."""

    rank: int
    world: int
    indices: list[int]  # global indices (positions in the input's episode list) still to replay, increasing
    num_envs: int
    out: Path  # the shard's folder: DIR/NAME.shards/rankNNNNN (a run named NAME)
    resume: bool  # the sharded run resumes: a shard there is this rank's earlier work, added to
    # replay workers: a shared counter (`multiprocessing.Value`) of ``indices`` handed out, ``indices`` then every
    # worker's list (all the episodes still to replay), each taking the next when one of its envs is free; None: this
    # rank replays its own ``indices``
    claims: Any = None


def _shares(plan: ReplayPlan, world: int, num_envs: int, done: set[int], resume: bool,
            claims: Any = None) -> list[_Share]:
    """Each rank's global episodes minus ``done`` (input episode ids some shard holds), its envs (``num_envs`` split
    as evenly as possible; none where it has no episode) and its shard folder. Without ``claims``, a rank's episodes
    are `fastrecord.shards`' ``g % world``; with them (worker processes), every worker's list is all the episodes and
    the counter hands them out, while each worker's envs are as many as its ``g % world`` share would take."""
    from fastrecord import shards

    total = len(plan.episodes)
    todo = [g for g in range(total) if int(plan.episodes[g]["episode_id"]) not in done]
    out = []
    for rank in range(world):
        mine = [g for g in shards.episodes_of(rank, world, total) if int(plan.episodes[g]["episode_id"]) not in done]
        envs = min(num_envs // world + (rank < num_envs % world), len(mine))
        out.append(_Share(rank, world, todo if claims is not None and envs else mine, envs,
                          shards.shard_dir(plan.out, plan.name, rank), resume, claims))
    return out


def _scheduled(shares: list[_Share]) -> int:
    """Episodes the shares replay together."""
    if any(s.claims is not None for s in shares):
        return max(len(s.indices) for s in shares)
    return sum(len(s.indices) for s in shares)


def _sharded_done(plan: ReplayPlan) -> set[int]:
    """Input episode ids that any shard folder of ``plan.name`` holds (also of an earlier world size)."""
    from fastrecord import shards

    done: set[int] = set()
    for folder in shards.list_shards(plan.out, plan.name).values():
        done |= replayed_sources(folder, plan.name)
    return done


def _run_share(plan: ReplayPlan, share: _Share, stop: StopRequest | None, t0: float,
               progress: Callable[[int], None] | None, gate: Callable[[], None] | None = None) -> ReplaySummary:
    """Replay one share into its shard (a worker process, or a torchrun rank)."""
    mine = [plan.episodes[g] for g in share.indices]
    return run_plan(plan, mine, share.out, plan.name, share.num_envs, stop, None, t0, progress,
                    shard=(share.rank, share.indices, share.resume), claims=share.claims, gate=gate)


def _gate(go: Any, stop: StopRequest) -> Callable[[], None]:
    """What a worker calls once its envs are made, before its recorder: wait for the caller's ``go`` (an Event set
    once the input's data passed its check); a stop request meanwhile (the check failed) is `StartCancelled`."""

    def wait() -> None:
        while not go.wait(0.05):
            if stop.requested:
                raise StartCancelled
        stamp("go")

    return wait


def _worker_main(cfg: ReplayConfig, share: _Share, t0: float, messages: Any, parent: int, go: Any) -> None:
    """A replay worker process (forked by the forkserver): the replay's own code path on its share; reports
    on ``messages``."""
    import traceback

    entered = time.perf_counter() - t0  # perf_counter is the system's monotonic clock: the caller's t0 holds here
    child_timeline(f"worker{share.rank}")  # benchmarks/bench_replay.py --stamps: this worker's phases, its own file
    stamp("worker_entered")

    from tqdm import tqdm

    quiet_third_party()
    claim_process()  # ManiSkill's gc.collect() at env creation and close skips the imported modules; BRDF table
    # tqdm's default lock is a multiprocessing RLock: here a named semaphore of the forkserver's kind, which
    # the resource tracker reported leaked at exit ("1 leaked semaphore"); the caller draws the progress bar
    tqdm.set_lock(threading.RLock())
    with _WorkerStop(parent) as stop:
        try:
            traj = open_trajectory(cfg.traj_path)
            try:
                # resume=False: the caller resumed the sharded run (share.resume says so); with it make_plan would
                # take this one process for a --workers 1 --resume of a sharded replay and refuse
                plan = make_plan(dataclasses.replace(cfg, workers=1, num_envs=share.num_envs, resume=False), traj,
                                 checked=True)  # the caller checked every episode's data
                stamp("plan_made")
                s = _run_share(plan, share, stop, t0, lambda k: messages.put(("progress", share.rank, k)),
                               gate=_gate(go, stop))
            finally:
                traj.close()
        except StartCancelled:  # the caller's check of the input failed: nothing written, nothing to report
            messages.close()
            messages.join_thread()
            raise SystemExit(0) from None
        except BaseException as e:  # noqa: BLE001 - reported to the caller, which raises it
            messages.put(
                ("error", share.rank, type(e).__name__, str(e), isinstance(e, ValueError), traceback.format_exc())
            )
            messages.close()
            messages.join_thread()
            raise SystemExit(1) from None
    s.worker_times = [(entered, s.startup_seconds, s.startup_seconds + s.seconds)]
    stamp("worker_done")
    messages.put(("done", share.rank, s))
    messages.close()
    messages.join_thread()


def _claim_sharded(plan: ReplayPlan, world: int) -> tuple[RunDirectory, bool]:
    """The run directory's claim on ``NAME`` for a sharded replay (`fastrecord.sinks.RunDirectory` with
    ``options["sharding"]``, as `fastrecord.shards.DistributedRun` makes it): ``--overwrite`` removes an
    earlier replay of that name (its shards too), ``--resume`` keeps it; without either, an unfinished
    sharded replay of that name (a worker was killed, the replay was interrupted) is resumed, anything
    else is refused. Returns (the RunDirectory, whether it resumes)."""
    from fastrecord import shards
    from fastrecord.sinks.base import MANIFEST_SUFFIX, RunDirectory, read_manifest

    cfg = plan.cfg
    if_exists = plan.if_exists
    before = read_manifest(plan.out / f"{plan.name}{MANIFEST_SUFFIX}")
    sharded_before = isinstance(before.get("options", {}).get("sharding"), dict)
    if if_exists == "error" and sharded_before and before.get("status") != "closed":
        print(f"resuming the unfinished sharded replay {plan.name!r} in {plan.out}", flush=True)
        if_exists = "resume"
    options = dict(traj_path=str(plan.traj.h5_path), obs_mode=cfg.obs_mode, by=cfg.replay_by, count=cfg.count,
                   sharding=shards.sharding_options(world, 0, len(plan.episodes)))
    run = RunDirectory(plan.out, plan.name, if_exists, options=options).open()
    try:
        if run.resuming and not sharded_before:
            raise ValueError(
                f"{str(plan.out)!r} holds a replay named {plan.name!r} that was not sharded; resume it with "
                f"--workers 1 --resume, or pass --overwrite, another --trajectory-name or --output-dir"
            )
        run.add_file(shards.shards_root(plan.out, plan.name))
        run.add_file(plan.out / f"{plan.name}.h5")
        run.add_file(plan.out / f"{plan.name}.json")
    except BaseException:
        run.close(status="failed") if run.resuming else run.abandon()
        raise
    return run, run.resuming


def run_workers(plan: ReplayPlan, stop: StopRequest | None, sinks: list[Any] | None, t0: float,
                check: Callable[[], None] | None = None) -> ReplaySummary:
    """Split the episodes over ``plan.workers`` processes (forked by `fastrecord.workers.forkserver_context`),
    each with its own envs and recorder writing its own shard (`fastrecord.shards`:
    ``DIR/NAME.shards/rankNNNNN/``), then merge the shards
    into ``NAME.h5`` + ``NAME.json`` (`fastrecord.shards.merge`: episode ``g`` of the input is ``traj_g``).

    Progress and results are gathered here. A worker's exception or death (a signal, the OOM killer)
    does not stop the others: their shards are merged, the merge names the missing episodes, and then
    a `ReplayWorkerError` (a ValueError where every worker refused a bad option or file) names the
    worker and the cause; running the same command again replays only what is missing. A SIGINT or
    SIGTERM of this process reaches each worker as one SIGTERM: they stop between two steps (the
    replays in progress are not saved: re-running resumes them) and the shards are merged.

    ``check``: the input's check (its outputs agree, `fastrecord.replay.api.check_input`; its episodes' data,
    `fastrecord.replay.plan.check_input`), run here while the workers make their envs;
    they replay once it passed. Its error ends them before they write anything and is raised, the run directory
    left as it was. With ``--overwrite`` the claim, which deletes the earlier replay, comes after the check passed
    (the workers make their envs meanwhile too), except for a conversion (`_claimed_after`)."""
    cfg, world = plan.cfg, plan.workers
    if sinks:
        raise ValueError(f"--log with --workers {world}: a logger takes the replays of one process; pass --workers 1")
    overwrite = check is not None and plan.if_exists == "overwrite"
    if overwrite and plan.convert:  # fixed shares: a worker reads its shard's episodes before its envs (the earlier
        assert check is not None  # replay's, until the claim deleted them): the input checked and claimed first
        check()
        check = None
    late_claim = overwrite and not plan.convert
    run, resuming = (None, False) if late_claim else _claim_sharded(plan, world)
    stamp("workers_claimed")  # benchmarks/bench_replay.py --stamps: the start between the plan and the workers
    try:
        # forked from a clean server that imported ManiSkill once: no CUDA context, threads or locks copied
        ctx = forkserver_context()
        # a conversion of control modes replays each episode in its own loop: the fixed shares
        claims = None if plan.convert else ctx.Value("q", 0)
        shares = _shares(plan, world, plan.num_envs, _sharded_done(plan) if resuming else set(), resuming, claims)
        busy = [s for s in shares if s.indices and s.num_envs]
        messages, go = ctx.Queue(), ctx.Event()
        procs = {s.rank: ctx.Process(target=_worker_main, args=(cfg, s, t0, messages, os.getpid(), go),
                                     name=f"fastrecord-replay-{s.rank}") for s in busy}
        stamp("workers_starting")
        for p in procs.values():
            p.start()
        stamp("workers_started")
        if late_claim:
            run = _claimed_after(check, procs, messages, plan, world)
        else:
            assert run is not None
            _checked(check, procs, messages, run, resuming)
        go.set()
        if cfg.save_trajectory:  # the merge's HDF5 process, started while the workers replay
            from fastrecord.prestart import prestart_h5_writer

            prestart_h5_writer(merge=True)
        summaries, failures, value_errors = _gather(procs, len(busy), messages, stop, cfg.progress,
                                                    _scheduled(busy), world)
        try:  # every worker has reported (its shard closed): the merge runs while their processes exit (a process
            # with a GPU render device took 0.35-0.45 s to exit on the H100 machine)
            if value_errors and len(value_errors) == len(failures) == len(busy):  # a bad option or file: all refused
                raise ValueError(value_errors[min(value_errors)])
            m0 = time.perf_counter()
            report = _join(plan)
            merge_seconds = time.perf_counter() - m0
            stamp("merged")
        finally:
            _await_exits(procs, messages)
            stamp("workers_exited")
        summary = _summarize(plan, [summaries[r] for r in sorted(summaries)], report, stop, t0,
                             scheduled=_scheduled(shares))
        summary.merge_seconds = merge_seconds
    except BaseException:
        if run is not None:
            run.close(status="failed")  # a no-op where `_checked` gave the claim up
        raise
    assert run is not None
    interrupted = stop is not None and stop.requested
    run.close(status="failed" if (failures or summary.missing or interrupted) else "closed")
    if failures:
        raise _worker_error(plan, shares, failures, summary)
    return summary


def _checked(check: Callable[[], None] | None, procs: dict[int, Any], messages: Any, run: RunDirectory,
             resuming: bool) -> None:
    """Run ``check`` while the worker processes make their envs; where it raises, end them (they wait for the go
    before their recorders: nothing written), give up the run's claim as `_claim_sharded`'s failure does (a new run's
    files removed, a resumed one's kept) and raise its error."""
    if check is None:
        return
    try:
        check()
    except BaseException:
        _end_workers(procs, messages)
        run.close(status="failed") if resuming else run.abandon()
        raise
    stamp("input_checked")


def _claimed_after(check: Callable[[], None] | None, procs: dict[int, Any], messages: Any, plan: ReplayPlan,
                   world: int) -> RunDirectory:
    """An ``--overwrite`` replay's claim (`_claim_sharded`: the earlier replay of its name deleted), made once ``check``
    passed, while the worker processes make their envs (checked first, the workers started 0.5-1.2 s after the plan on
    the H100); its workers take their episodes from the counter (never reading the earlier shards). Where the check or
    the claim fails, the workers are ended (they wait for the go before their recorders: nothing written) and its
    error is raised, the earlier replay left as it was."""
    try:
        if check is not None:
            check()
            stamp("input_checked")
        run, resuming = _claim_sharded(plan, world)
    except BaseException:
        _end_workers(procs, messages)
        raise
    assert not resuming  # an --overwrite
    return run


def _end_workers(procs: dict[int, Any], messages: Any) -> None:
    """Kill the worker processes ``procs`` still running and await their exits."""
    for p in procs.values():
        if p.exitcode is None:
            p.kill()
    _await_exits(procs, messages)


def _gather(procs: dict[int, Any], busy: int, messages: Any, stop: StopRequest | None, progress: bool, total: int,
            world: int) -> tuple[dict[int, ReplaySummary], dict[int, str], dict[int, str]]:
    """Wait for the ``busy`` worker processes ``procs``, showing their progress (one bar of ``total`` episodes)
    and forwarding a stop request to each as one SIGTERM: each worker's summary, each failed worker's cause, and
    the ValueErrors among those (a bad option or file). Every worker has reported (or died) when it returns; their
    exits are the caller's to await (`_await_exits`), except after an exception here, which ends and awaits them."""
    import queue as queue_mod

    from tqdm import tqdm

    failures: dict[int, str] = {}
    value_errors: dict[int, str] = {}
    summaries: dict[int, ReplaySummary] = {}
    exited: dict[int, float] = {}
    forwarded = False
    bar = tqdm(
        total=total,
        unit="episode",
        disable=not progress,
        dynamic_ncols=True,
        desc=f"replay, {world} workers",
    )
    try:
        while len(summaries) + len(failures) < busy:
            if stop is not None and stop.requested and not forwarded:
                forwarded = True
                for p in procs.values():
                    if p.exitcode is None:
                        os.kill(p.pid, signal.SIGTERM)
            try:
                msg = messages.get(timeout=0.2)
            except queue_mod.Empty:
                now = time.monotonic()
                for r, p in procs.items():
                    if (
                        p.exitcode is not None and r not in summaries and r not in failures
                        and now - exited.setdefault(r, now) > 2.0  # its last message would have arrived by now
                    ):
                        failures[r] = f"{exit_description(p.exitcode)} without a report"
                continue
            kind, rank = msg[0], msg[1]
            if kind == "progress":
                bar.update(msg[2])
            elif kind == "done":
                summaries[rank] = msg[2]
            elif kind == "error":
                _, _, etype, text, is_value_error, tb = msg
                failures[rank] = f"failed: {etype}: {text}"
                if is_value_error:
                    value_errors[rank] = text
                else:
                    failures[rank] += f"\n(worker {rank}'s traceback:\n{tb.rstrip()})"
    except BaseException:  # after an exception here (Ctrl-C), stop them as for a signal
        for p in procs.values():
            if p.exitcode is None and not forwarded:
                os.kill(p.pid, signal.SIGTERM)
        _await_exits(procs, messages)
        raise
    finally:
        bar.close()
    return summaries, failures, value_errors


def _await_exits(procs: dict[int, Any], messages: Any) -> None:
    """Wait for the worker processes' exits (each ended after 120 s), then close their queue."""
    for p in procs.values():
        p.join(timeout=120)
        if p.exitcode is None:
            p.kill()
            p.join()
    messages.close()


def _worker_error(plan: ReplayPlan, shares: list[Any], failures: dict[int, str], summary: ReplaySummary
                  ) -> ReplayWorkerError:
    """The error naming the first failed worker, its cause, the others and the episodes missing from the join."""
    world = plan.workers
    first = min(failures)
    share = shares[first]
    others = f" (and worker(s) {sorted(set(failures) - {first})})" if len(failures) > 1 else ""
    missing = (
        f"; {len(summary.missing)} of {len(plan.episodes)} episodes are missing from {plan.out / plan.name}.h5 "
        f"(global indices {ranges_text(summary.missing)})"
        if summary.missing
        else ""
    )
    episodes = (f"sharing {len(share.indices)} episodes with the others" if share.claims is not None
                else f"{len(share.indices)} episodes")
    return ReplayWorkerError(
        f"replay worker {first} of {world} ({episodes}, shard {share.out}) "
        f"{failures[first]}{others}"
        f"{missing}. The other workers' episodes are kept: run the same command again to replay only the missing "
        f"ones"
    )


def _join(plan: ReplayPlan) -> Any:
    """Join the shards into ``NAME.h5`` + ``NAME.json``, ``NAME.lerobot``, the results rows and the videos next to
    them (`fastrecord.shards.merge`); its `MergeReport`, or None when no shard has anything to join (stopped
    before any episode)."""
    from fastrecord import shards

    try:
        return shards.merge(plan.out, plan.name, expected=len(plan.episodes))
    except shards.NothingToMerge:
        return None


def _summarize(plan: ReplayPlan, done: list[ReplaySummary], report: Any, stop: StopRequest | None, t0: float,
               scheduled: int) -> ReplaySummary:
    """The summary of a sharded replay: the workers' (or ranks') summaries summed, the merge's outcome.
    ``scheduled``: episodes the shards were given (the others were on disk already)."""
    total = len(plan.episodes)
    startup = max((s.startup_seconds for s in done), default=time.perf_counter() - t0)
    files: list[Path] = []
    sources: list[int] = []
    missing: list[int] = []
    if report is not None and report.trajectory:
        meta = json.loads(report.json_path.read_text())
        sources = [int(e["source_episode_id"]) for e in meta["episodes"]]
        files = [report.h5_path, report.json_path]
    if report is not None and (report.trajectory or not plan.cfg.save_trajectory):
        missing = list(report.missing)
    elif plan.cfg.save_trajectory:
        missing = list(range(total))
    if report is not None and report.lerobot_path is not None:
        files.append(report.lerobot_path)
    joined = list(report.videos) if report is not None else []  # the joined videos, next to NAME.h5
    files += joined
    linked = {_inode(v) for v in joined}
    for s in done:  # and the shards' videos the join did not link (tiled ones)
        files += [f for f in s.files if f.suffix == ".mp4" and _inode(f) not in linked]
    joined_results = plan.out / f"{plan.name}{RESULTS_SUFFIX}"  # the shards' rows joined (`shards.merge`)
    if report is not None and joined_results.exists():
        files.append(joined_results)
    else:
        files += [s.results_path for s in done if s.results_path is not None]
    interrupted = (
        stop.name if stop is not None and stop.requested else next((s.interrupted for s in done if s.interrupted), None)
    )
    return ReplaySummary(
        episodes=sum(s.episodes for s in done),
        kept=sum(s.kept for s in done),
        successes=sum(s.successes for s in done),
        diverged=sorted((d for s in done for d in s.diverged), key=lambda d: d.episode_id),
        env_steps=sum(s.env_steps for s in done),
        seconds=time.perf_counter() - t0 - startup,
        output_dir=plan.out,
        files=files,
        source_episode_ids=sources,
        interrupted=interrupted,
        partial=0,
        startup_seconds=startup,
        results=[r for s in done for r in s.results],
        results_path=joined_results if report is not None and joined_results.exists() else None,
        converted=any(s.converted for s in done),
        skipped=total - scheduled + sum(s.skipped for s in done),
        workers=plan.workers,
        missing=missing,
        worker_times=[w for s in done for w in s.worker_times],
    )


def _inode(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_dev, st.st_ino


def run_rank(plan: ReplayPlan, stop: StopRequest | None, sinks: list[Any] | None, t0: float) -> ReplaySummary:
    """One torchrun rank of a sharded replay (`fastrecord.shards.DistributedRun`): rank 0 claims the run
    directory, each rank replays its global episodes (``g % world_size``) that no shard holds into its
    shard, and rank 0 merges once every rank is done. Returns this rank's summary (rank 0: everyone's,
    and the merge's)."""
    from fastrecord import shards

    cfg = plan.cfg
    if sinks:
        raise ValueError("--log under torchrun: a logger takes the replays of one process; run without torchrun")
    options = dict(traj_path=str(plan.traj.h5_path), obs_mode=cfg.obs_mode, by=cfg.replay_by, count=cfg.count)
    run = shards.DistributedRun(plan.out, plan.name, total=len(plan.episodes), base_seed=0, if_exists=plan.if_exists,
                                options=options).open()
    try:
        rank, world, resume = run.rank, run.world_size, run.if_exists == "resume"
        done = _sharded_done(plan) if resume else set()
        mine = [g for g in shards.episodes_of(rank, world, len(plan.episodes))
                if int(plan.episodes[g]["episode_id"]) not in done]
        share = _Share(rank, world, mine, max(1, min(plan.num_envs, len(mine))), run.shard_dir, resume)
        plan.kwargs["sim_backend"], plan.kwargs["render_backend"] = shards.rank_backends(
            plan.kwargs["sim_backend"], plan.kwargs["render_backend"])  # this rank's GPU, where there are GPUs
        if not cfg.progress or rank == 0:
            bar_cfg = plan
        else:  # one progress bar: rank 0's
            bar_cfg = dataclasses.replace(plan, cfg=dataclasses.replace(cfg, progress=False))
        if mine:
            s = _run_share(bar_cfg, share, stop, t0, None)
        else:
            s = ReplaySummary(0, 0, 0, [], 0, 0.0, share.out, [], startup_seconds=time.perf_counter() - t0)
        s.workers = world
        if s.interrupted:  # no end exchange: the other ranks may be gone (torchrun stops them all on a failure)
            run.close(status="failed")
            return s
        everyone, report = run.finish({"replay": s})
    except BaseException:
        run.close(status="failed")
        raise
    run.close()
    if rank != 0:
        return s
    summary = _summarize(plan, [x["replay"] for x in everyone], report, stop, t0,
                         scheduled=len(plan.episodes) - len(done))
    summary.workers = world
    return summary


