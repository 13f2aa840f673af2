"""Driving a replay: the loop that keeps N envs busy with recorded episodes, and the conversion of
actions to another control mode (ManiSkill's conversion code, one episode at a time).

`run_plan` replays a list of episodes into one output (the whole replay, or one worker's shard);
`replayed_sources` reads which input episodes an earlier replay into that output finished.
"""

from __future__ import annotations

import copy
import functools
import json
import time
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import gymnasium as gym
import h5py
import numpy as np
import torch

from fastrecord.replay.config import Divergence, ReplayConfig, ReplaySummary, StopRequest
from fastrecord.replay.early import MirroredSubenv
from fastrecord.replay.envs import BatchedEnv, ReplayStates, VectorBatch, make_replay_env, tree_index, tree_stack
from fastrecord.replay.plan import ReplayPlan, Verdict
from fastrecord.sinks.maniskill_h5 import TrajectoryFile
from fastrecord.system import stamp

if TYPE_CHECKING:
    from fastrecord.packed import PackedLaunch


def run_plan(plan: ReplayPlan, episodes: list[dict[str, Any]], out: Path, name: str, n: int, stop: StopRequest | None,
             sinks: list[Any] | None, t0: float, progress: Callable[[int], None] | None = None,
             shard: tuple[int, list[int], bool] | None = None, launch: PackedLaunch | None = None,
             claims: Any = None, gate: Callable[[], None] | None = None) -> ReplaySummary:
    """Replay ``episodes`` (of ``plan.episodes``) in ``n`` envs into ``out/name``: the whole replay, or a
    shard's (``shard``: its rank, the global index of each episode, whether the sharded run resumes). With
    ``resume``, or in a shard, the episodes the output already holds (also in complete parts a crash left)
    are not replayed again. ``launch``: sub-env processes started before the plan
    (`fastrecord.replay.early.early_subenvs`), taken over where they make the envs this replay draws in this
    process, else ended. ``claims``: a counter shared with other worker processes replaying the same ``episodes``
    (`_Claims`: each env takes the next one not taken when it is free); None: these are this replay's own.
    ``gate``: called once the envs are made, before the recorder (a worker waits there for its caller's check of the
    input; its `StartCancelled` ends the replay having written nothing)."""
    cfg = plan.cfg
    if shard is not None:
        from fastrecord import shards

        tags = {int(ep["episode_id"]): shards.episode_meta(g, shard[0])
                for ep, g in zip(episodes, shard[1], strict=True)}
    else:
        tags = {}
    # (with claims every worker's list must stay the same: the caller left out what any shard holds)
    done = replayed_sources(out, name) if (cfg.resume or shard is not None) and claims is None else set()
    todo = [ep for ep in episodes if int(ep["episode_id"]) not in done]
    skipped = len(episodes) - len(todo)
    if not todo:  # a resumed replay that is complete: nothing to replay, but a kill after its last episode left
        from fastrecord.sinks.reconcile import finish_run  # its outputs to finish as its close would have

        finish_run(out, name)
        return ReplaySummary(0, 0, 0, [], 0, 0.0, out, [], startup_seconds=time.perf_counter() - t0, skipped=skipped)
    n = min(n, len(todo))
    if cfg.save_trajectory:  # the recorder's HDF5 writer process starts (an interpreter, h5py) while the envs are made
        from fastrecord.prestart import prestart_h5_writer

        prestart_h5_writer()
    verdict = Verdict()  # ManiSkill's rule, decided per replay by the loop that ends it
    resume = cfg.resume or bool(done) or (shard is not None and shard[2])
    rec_kwargs = plan.recorder_kwargs(out, name, verdict, sinks, resume=resume)
    if gate is not None:  # every path reads the recorder's options right before it makes the recorder: the gate there
        rec_kwargs = _gated(rec_kwargs, gate)

    def meta(ep: Mapping[str, Any]) -> dict[str, Any]:  # the output entry names its input episode from the start
        return {"source_episode_id": int(ep["episode_id"]), **tags.get(int(ep["episode_id"]), {})}

    tally = _Tally(cfg, traj_name=plan.traj.h5_path.name, total=len(todo), stop=stop, t0=t0, progress=progress,
                   meta=meta, desc="convert" if plan.convert else "replay")
    if plan.convert:
        summary = _convert(cfg, plan, todo, rec_kwargs, verdict, tally)
    else:
        if plan.vector == "batched":
            env = make_replay_env(plan.env_id, plan.kwargs, plan.max_steps, n, cpu_wrapper=False)
            assert isinstance(env, ReplayStates)  # what make_replay_env returns without its CPU wrappers
            batch: VectorBatch | BatchedEnv = BatchedEnv(env, rec_kwargs)
        else:
            thunk = functools.partial(make_replay_env, plan.env_id, plan.kwargs, plan.max_steps)
            batch = VectorBatch(thunk, n, plan.vector == "async" and n > 1, rec_kwargs, plan.render_device,
                                subenv=MirroredSubenv(plan.env_id, plan.kwargs, plan.max_steps), launch=launch,
                                frames=plan.frames,
                                run_ahead=not cfg.option("render_substeps"))
        summary = _drive(cfg, plan.traj, todo, batch, verdict, tally, claims)
    summary.skipped = skipped
    summary.output_dir = out
    new_h5 = out / f"{name}.h5"
    if cfg.save_trajectory and new_h5.with_suffix(".json").exists():  # absent when interrupted before any episode
        summary.files = [new_h5, new_h5.with_suffix(".json")] + summary.files
    if cfg.option("lerobot") and (out / f"{name}.lerobot").is_dir():
        summary.files.append(out / f"{name}.lerobot")
    assert summary.results_path is not None  # the recorder's results sink, opened with it (`_Tally.summary`)
    summary.files.append(summary.results_path)
    return summary


def _gated(rec_kwargs: Callable[[int], dict[str, Any]], gate: Callable[[], None]) -> Callable[[int], dict[str, Any]]:
    """``rec_kwargs``, passing ``gate`` first (once the envs are made, before the recorder)."""

    def gated(control_freq: int) -> dict[str, Any]:
        gate()
        return rec_kwargs(control_freq)

    return gated


class _Claims:
    """The episodes of worker processes that replay one list together (`fastrecord.replay.workers`): a shared counter
    (a `multiprocessing.Value` with its lock) of the positions handed out. Used as `_Slots.pending`: ``popleft`` takes
    the next position no worker took (IndexError: none left), ``appendleft`` puts back a retry of this worker's (it
    goes first, here)."""

    def __init__(self, counter: Any, total: int) -> None:
        self.counter, self.total = counter, total
        self.retry: deque[int] = deque()

    def __len__(self) -> int:  # an upper bound: another worker may take one meanwhile
        return len(self.retry) + max(0, self.total - self.counter.value)

    def popleft(self) -> int:
        if self.retry:
            return self.retry.popleft()
        with self.counter.get_lock():
            i = int(self.counter.value)
            if i >= self.total:
                raise IndexError("every episode is taken")
            self.counter.value = i + 1
        return i

    def appendleft(self, i: int) -> None:
        self.retry.appendleft(i)


class _Tally:
    """What both replay loops (`_drive`, `_convert`) keep and show the same way. Owns: the progress bar (or the
    caller's ``progress``: a worker's share of one bar), the stop request, the finished replays' successes and
    divergences, which input episode each output episode replays, and the summary made of them."""

    def __init__(self, cfg: ReplayConfig, traj_name: str, total: int, stop: StopRequest | None, t0: float | None,
                 progress: Callable[[int], None] | None, meta: Callable[[Mapping[str, Any]], dict], desc: str) -> None:
        self.cfg, self.traj_name, self.stop, self.meta, self.progress = cfg, traj_name, stop, meta, progress
        self.t0, self.total, self.desc = t0, total, desc
        self.startup = self.t_run = 0.0
        self.diverged: list[Divergence] = []
        self.sources: list[int] = []  # output episode k replays input episode sources[k]
        self.successes = self.env_steps = self.done = 0
        self.bar: Any = None

    def started(self) -> None:
        """The envs are made: the start-up ends and the replay's own time (and its progress bar) begins."""
        from tqdm import tqdm

        stamp("envs_made")
        self.t_run = time.perf_counter()
        self.startup = self.t_run - self.t0 if self.t0 is not None else 0.0
        self.bar = tqdm(total=self.total, unit="episode", disable=not self.cfg.progress or self.progress is not None,
                        dynamic_ncols=True, desc=self.desc)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    @property
    def stopping(self) -> bool:
        return self.stop is not None and self.stop.requested

    def write(self, rec: Any, e: int, ep: Mapping[str, Any], flush: Callable[[], None]) -> None:
        """Save env ``e``'s replay of ``ep`` (``flush``), named by its input episode; non-finite data stops the
        replay before it is written (`check_replayed`). The keep filter decides whether it is written."""
        before = rec.num_episodes
        check_replayed(rec, e, ep, self.traj_name)
        rec.set_episode_meta([e], [self.meta(ep)])
        flush()
        if rec.num_episodes > before:
            self.sources.append(int(ep["episode_id"]))

    def finished(self, ep: Mapping[str, Any], replayed: bool | None, recorded: bool | None, ok: bool) -> None:
        """One replay of ``ep`` over for good (no retry left): its success against the recorded one."""
        self.done += 1
        self.successes += bool(replayed)
        if replayed is not None and recorded is not None and replayed != recorded:
            self.diverged.append(Divergence(int(ep["episode_id"]), recorded, replayed))
        if self.cfg.maniskill and not ok and self.cfg.keep_filter is None:
            from tqdm import tqdm

            tqdm.write(f"Episode {ep['episode_id']} is not replayed successfully. Skipping")

    def shown(self, finished: int, kept: int) -> None:
        self.bar.update(finished)
        self.bar.set_postfix(kept=kept, diverged=len(self.diverged))
        if self.progress is not None:
            self.progress(finished)

    def summary(self, rec: Any, cut: int = 0, converted: bool = False) -> ReplaySummary:
        return ReplaySummary(self.done, rec.num_episodes, self.successes, self.diverged, self.env_steps,
                             time.perf_counter() - self.t_run, Path("."), sorted(rec.video_paths), self.sources,
                             self.stop.name if self.stop is not None and self.stopping else None, 0,
                             startup_seconds=self.startup, results=list(rec.results.rows),
                             results_path=rec.results.path, converted=converted)


def _convert(cfg: ReplayConfig, plan: ReplayPlan, episodes: list[dict], rec_kwargs: Any, verdict: Verdict,
             tally: _Tally) -> ReplaySummary:
    """``-c``: convert each episode's actions with ManiSkill's own code, one episode at a time, as its tool
    does in a CPU env: ``ori_env`` steps the recorded actions and the target env (recorded by fastrecord)
    follows it in the target control mode, several steps per recorded one where needed."""
    from fastrecord.record import RecordEpisode

    ori_env = gym.make(plan.env_id, max_episode_steps=plan.max_steps,
                       **{**plan.ori_kwargs, "render_mode": None, "obs_mode": "state"})  # only its controller is read
    try:
        target = gym.make(plan.env_id, num_envs=1, max_episode_steps=plan.max_steps, **plan.kwargs)
        base: Any = target.unwrapped  # a ManiSkill env
        env = RecordEpisode(target, **rec_kwargs(base.control_freq))
    except BaseException:
        ori_env.close()
        raise
    rec = env.recorder
    tally.started()
    try:
        for ep in episodes:
            if tally.stopping:
                break
            for _attempt in range(cfg.max_retry + 1):
                replayed, truncated = _convert_once(cfg, plan, ep, ori_env, env, tally)
                verdict.value = ok = cfg.maniskill_keeps(replayed, truncated)
                tally.write(rec, 0, ep, env.flush_trajectory)
                if ok:
                    break
            tally.finished(ep, replayed, plan.traj.recorded_success(ep), ok)
            tally.shown(1, rec.num_episodes)
        rec.wait_until_done()
    finally:
        tally.close()
        try:
            rec.set_episode_meta([0], [None])  # a replay cut by an exception (Ctrl-C) is not saved: --resume redoes it
            env.close()
        finally:
            ori_env.close()
    return tally.summary(rec, converted=True)


def _convert_once(cfg: ReplayConfig, plan: ReplayPlan, ep: Mapping[str, Any], ori_env: gym.Env, env: Any,
                  tally: _Tally) -> tuple[bool | None, bool]:
    """One conversion of ``ep`` (ManiSkill's ``from_pd_joint_pos`` / ``from_pd_joint_delta_pos``) from its seeded
    reset (or its recorded first state): the replay's success (None: the task reports none) and truncation."""
    from mani_skill.trajectory.utils.actions import conversion

    converter = {"pd_joint_pos": conversion.from_pd_joint_pos,
                 "pd_joint_delta_pos": conversion.from_pd_joint_delta_pos}[plan.ori_kwargs["control_mode"]]
    target = env.unwrapped
    seed = int(ep["episode_seed"])  # ManiSkill's sanity_check_and_format_seed
    options = dict((copy.deepcopy(ep.get("reset_kwargs") or {})).get("options") or {})
    ori_env.reset(seed=seed, options=options)
    if cfg.use_first_env_state:
        first = tree_stack([tree_index(plan.traj.env_states(ep), 0)], torch.device(target.device))
        ori_base: Any = ori_env.unwrapped  # a ManiSkill env
        ori_base.set_state_dict(first)
        options["reset_to_env_states"] = {"env_states": first}  # recorded as the episode's first state
    env.reset(seed=seed, options=options)
    info = converter(cfg.target_control_mode, plan.traj.actions(ep), ori_env, env, render=False, pbar=None,
                     verbose=cfg.verbose)
    steps = int(np.asarray(target.elapsed_steps).reshape(-1)[0])
    tally.env_steps += steps
    replayed = bool(np.asarray(torch.as_tensor(info["success"]).cpu()).reshape(-1)[0]) if "success" in info else None
    return replayed, plan.max_steps is not None and steps >= plan.max_steps


class _Slots:
    """The replay loop's envs: which pending episode each plays (``slot``: an index into ``episodes``, None: idle),
    its recorded actions and its step, and the episodes not started yet (``pending``)."""

    def __init__(self, cfg: ReplayConfig, traj: TrajectoryFile, episodes: list[dict], batch: VectorBatch | BatchedEnv,
                 claims: Any = None):
        self.cfg, self.traj, self.episodes, self.batch = cfg, traj, episodes, batch
        n = batch.num_envs
        self.pending: deque[int] | _Claims = (
            deque(range(len(episodes))) if claims is None else _Claims(claims, len(episodes)))
        self.retries = np.zeros(len(episodes), dtype=np.int64)
        self.slot: list[int | None] = [None] * n
        self.actions: list[np.ndarray] = [np.zeros((0, *batch.action_shape), dtype=np.float32)] * n
        self.t = np.zeros(n, dtype=np.int64)
        self.length = np.zeros(n, dtype=np.int64)
        self.act = np.zeros((n, *batch.action_shape), dtype=np.float32)

    def _plan(self, i: int) -> tuple[dict[str, Any], np.ndarray]:
        """Episode ``i``'s replay plan (`fastrecord.replay.envs.ReplayStates`) and its recorded actions."""
        ep, traj, shape = self.episodes[i], self.traj, tuple(self.batch.action_shape)
        a = traj.actions(ep)
        if a.ndim != 2 or a.shape[1:] != shape:
            raise ValueError(
                f"{traj.h5_path.name} traj_{ep['episode_id']}/actions has shape {a.shape}, but the env takes "
                f"actions of shape {shape}; was it recorded with another control mode or robot?"
            )
        per_step = self.cfg.replay_by == "states"
        states = traj.env_states(ep) if (per_step or self.cfg.use_first_env_state) else None
        opts = (ep.get("reset_kwargs") or {}).get("options") or {}
        return dict(seed=int(ep["episode_seed"]), options=opts, states=states, per_step=per_step, length=len(a)), a

    def start(self, envs: list[int]) -> None:
        """Envs ``envs`` start the next pending episodes (a reset of those envs); where none is left (other workers
        took the last ones), the others stay idle."""
        plans, started = [], []
        for e in envs:
            try:
                i = self.pending.popleft()
            except IndexError:
                break
            p, self.actions[e] = self._plan(i)
            self.slot[e], self.t[e], self.length[e] = i, 0, p["length"]
            plans.append(p)
            started.append(e)
        if started:
            self.batch.start(np.asarray(started), plans)

    def step(self) -> tuple[np.ndarray | None, np.ndarray, int]:
        """Every busy env takes its next recorded action (each also says the one after, for a pipelined batch):
        (success, truncated, env-steps taken)."""
        active = np.array([s is not None for s in self.slot])
        self.act[:] = 0
        ahead: list[np.ndarray | None] = [None] * len(self.slot)
        for e in np.flatnonzero(active):
            self.act[e] = self.actions[e][self.t[e]]
            if self.t[e] + 1 < self.length[e]:
                ahead[e] = self.actions[e][self.t[e] + 1].astype(self.act.dtype)  # as the step will give it
        success, truncated = self.batch.step(self.act, ahead)
        self.t[active] += 1
        return success, truncated, int(active.sum())

    def ended(self) -> list[int]:
        return [e for e, s in enumerate(self.slot) if s is not None and self.t[e] >= self.length[e]]

    @property
    def busy(self) -> bool:
        return any(s is not None for s in self.slot)


def _drive(cfg: ReplayConfig, traj: TrajectoryFile, episodes: list[dict], batch: VectorBatch | BatchedEnv,
           verdict: Verdict, tally: _Tally, claims: Any = None) -> ReplaySummary:
    """Keep every env busy: when an env's episode ends, flush it and start the next pending one there
    (ManiSkill's --max-retry: the same episode again, while it fails and retries are left).

    A stop request ends the loop between two steps; the replays in progress are not saved (a cut
    replay is not a finished one: re-running with ``resume`` replays it whole), as `fastrecord record` does."""
    slots = _Slots(cfg, traj, episodes, batch, claims)
    rec = batch.recorder
    tally.started()
    try:
        if not tally.stopping:
            slots.start(list(range(batch.num_envs)))
        while not tally.stopping and slots.busy:
            success, truncated, steps = slots.step()
            if not tally.env_steps:
                stamp("first_step_done")
            tally.env_steps += steps
            done = slots.ended()
            finished = 0
            for e in done:
                i = slots.slot[e]
                assert i is not None
                ep = episodes[i]
                replayed = None if success is None else bool(success[e])
                verdict.value = ok = cfg.maniskill_keeps(replayed, bool(truncated[e]))
                tally.write(rec, e, ep, functools.partial(batch.flush, e))
                slots.slot[e] = None
                if not ok and slots.retries[i] < cfg.max_retry:  # ManiSkill's --max-retry: again, before the others
                    slots.retries[i] += 1
                    slots.pending.appendleft(i)
                    continue
                tally.finished(ep, replayed, traj.recorded_success(ep), ok)
                finished += 1
            if done:
                tally.shown(finished, rec.num_episodes)
                refill = done[: len(slots.pending)]
                if refill:
                    slots.start(refill)
        if tally.stopping:  # the replays in progress are not saved: re-running with --resume replays them whole
            for e in range(batch.num_envs):
                if slots.slot[e] is not None:
                    rec.set_episode_meta([e], [None])
                    slots.slot[e] = None
        stamp("drive_loop_end")
        rec.wait_until_done()
        stamp("recorder_drained")
    finally:
        tally.close()
        try:  # every finished replay was flushed: what is in progress (an exception, Ctrl-C) is not saved
            rec.set_episode_meta(np.arange(batch.num_envs), [None] * batch.num_envs)
        finally:
            batch.close()
    return tally.summary(rec)


def check_replayed(rec: Any, e: int, ep: Mapping[str, Any], source: str) -> None:
    """Raise one ValueError when the episode env ``e`` of recorder ``rec`` is about to write (a replay of
    ``ep``, of file ``source``) holds non-finite observations, states, actions or rewards: the replay
    stops there rather than write NaN. Checks the recorder's buffer rows of that env, float fields only."""
    from fastrecord.episode import field_of

    buf = rec.buffer
    if buf is None or buf.cursor[e] < 0:
        return
    last = int(buf.cursor[e])
    for name, data in buf.fields.items():
        if not data.is_floating_point():
            continue
        first = 1 if field_of(name).kind == "transition" else 0  # slot 0 of a step field holds nothing
        rows = data[first: last + 1, e]
        bad = ~torch.isfinite(rows)
        if not bool(bad.any()):
            continue
        steps = np.flatnonzero(bad.reshape(len(rows), -1).any(dim=1).cpu().numpy()) + first
        raise ValueError(
            f"the replay of {source} traj_{ep['episode_id']} produced {int(bad.sum())} non-finite values in {name} "
            f"(steps {int(steps[0])}-{int(steps[-1])}), so the replay stopped before writing it; the episodes finished "
            f"before it are written. Check that episode's recorded actions and env states (fastrecord info), and "
            f"replay the others with --count, or re-record it")


def replayed_sources(out: Path, name: str) -> set[int]:
    """Input episode ids (``source_episode_id``) that an earlier replay into ``out/name`` finished: the rows
    of its results file's commit log (`fastrecord.sinks.reconcile.commit_log`: every output holds a kept
    one; a replay the keep filter did not keep counts too: replaying it again would drop it again). A
    replay without a results file (an older fastrecord): its JSON's entries and complete part files.
    Partial replays (saved by an older fastrecord when cut by a signal) do not count. Reads only."""
    from fastrecord.sinks.maniskill_h5 import EPISODES_ATTR, complete_parts, read_json, sibling_paths
    from fastrecord.sinks.reconcile import commit_log
    from fastrecord.sinks.results import read_results

    results = out / f"{name}.results.jsonl"
    if results.exists():
        rows = [r for r in read_results(results) if isinstance(r, dict)]
        rows = rows[: commit_log(rows)[1]]
        return {int(r["source_episode_id"]) for r in rows if "source_episode_id" in r and not r.get("partial")}

    json_path, parts_dir = sibling_paths(out / f"{name}.h5")
    entries = list((read_json(json_path) or {}).get("episodes") or [])
    for _, part in complete_parts(parts_dir):
        try:
            with h5py.File(part, "r") as f:
                entries += json.loads(f.attrs.get(EPISODES_ATTR, "[]"))
        except (OSError, ValueError):  # unreadable: its episodes are replayed again
            continue
    return {int(e["source_episode_id"]) for e in entries
            if isinstance(e, dict) and "source_episode_id" in e and not e.get("partial")}
