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
from typing import Any

import gymnasium as gym
import h5py
import numpy as np
import torch

from fastrecord.replay.config import Divergence, ReplayConfig, ReplaySummary, StopRequest
from fastrecord.replay.envs import BatchedEnv, VectorBatch, make_replay_env, tree_index, tree_stack
from fastrecord.replay.plan import ReplayPlan, Verdict
from fastrecord.sinks.maniskill_h5 import TrajectoryFile


def run_plan(plan: ReplayPlan, episodes: list[dict[str, Any]], out: Path, name: str, n: int, stop: StopRequest | None,
             sinks: list[Any] | None, t0: float, progress: Callable[[int], None] | None = None,
             shard: tuple[int, list[int], bool] | None = None) -> ReplaySummary:
    """Replay ``episodes`` (of ``plan.episodes``) in ``n`` envs into ``out/name``: the whole replay, or a
    shard's (``shard``: its rank, the global index of each episode, whether the sharded run resumes). With
    ``resume``, or in a shard, the episodes the output already holds (also in complete parts a crash left)
    are not replayed again."""
    cfg = plan.cfg
    if shard is not None:
        from fastrecord import shards

        tags = {int(ep["episode_id"]): shards.episode_meta(g, shard[0]) for ep, g in zip(episodes, shard[1])}
    else:
        tags = {}
    done = replayed_sources(out, name) if (cfg.resume or shard is not None) else set()
    todo = [ep for ep in episodes if int(ep["episode_id"]) not in done]
    skipped = len(episodes) - len(todo)
    if not todo:  # a resumed replay that is complete: nothing to make or write
        return ReplaySummary(0, 0, 0, [], 0, 0.0, out, [], startup_seconds=time.perf_counter() - t0, skipped=skipped)
    n = min(n, len(todo))
    verdict = Verdict()  # ManiSkill's rule, decided per replay by the loop that ends it
    resume = cfg.resume or bool(done) or (shard is not None and shard[2])
    rec_kwargs = plan.recorder_kwargs(out, name, verdict, sinks, resume=resume)

    def meta(ep: Mapping[str, Any]) -> dict[str, Any]:  # the output entry names its input episode from the start
        return {"source_episode_id": int(ep["episode_id"]), **tags.get(int(ep["episode_id"]), {})}

    if plan.convert:
        summary = _convert(cfg, plan.traj, todo, plan.env_id, plan.kwargs, plan.ori_kwargs, plan.max_steps, rec_kwargs,
                           verdict, stop, t0, progress, meta)
    else:
        if plan.vector == "batched":
            env = make_replay_env(plan.env_id, plan.kwargs, plan.max_steps, n, cpu_wrapper=False)
            batch: VectorBatch | BatchedEnv = BatchedEnv(env, rec_kwargs)
        else:
            thunk = functools.partial(make_replay_env, plan.env_id, plan.kwargs, plan.max_steps)
            batch = VectorBatch(thunk, n, plan.vector == "async" and n > 1, rec_kwargs, plan.render_device)
        summary = _drive(cfg, plan.traj, todo, batch, verdict, stop, t0, progress, meta)
    summary.skipped = skipped
    summary.output_dir = out
    new_h5 = out / f"{name}.h5"
    if cfg.save_trajectory and new_h5.with_suffix(".json").exists():  # absent when interrupted before any episode
        summary.files = [new_h5, new_h5.with_suffix(".json")] + summary.files
    if cfg.option("lerobot") and (out / f"{name}.lerobot").is_dir():
        summary.files.append(out / f"{name}.lerobot")
    summary.files.append(summary.results_path)
    return summary


def _convert(cfg: ReplayConfig, traj: TrajectoryFile, episodes: list[dict], env_id: str, kwargs: dict[str, Any],
             ori_kwargs: dict[str, Any], max_steps: int | None, rec_kwargs: Any, verdict: Verdict,
             stop: StopRequest | None, t0: float, progress: Callable[[int], None] | None = None,
             meta: Callable[[Mapping[str, Any]], dict] | None = None) -> ReplaySummary:
    """``-c``: convert each episode's actions with ManiSkill's own code, one episode at a time, as its tool
    does in a CPU env: ``ori_env`` steps the recorded actions and the target env (recorded by fastrecord)
    follows it in the target control mode, several steps per recorded one where needed."""
    from mani_skill.trajectory.utils.actions import conversion
    from tqdm import tqdm

    from fastrecord.record import RecordEpisode

    converter = {"pd_joint_pos": conversion.from_pd_joint_pos,
                 "pd_joint_delta_pos": conversion.from_pd_joint_delta_pos}[ori_kwargs["control_mode"]]
    stopping = (lambda: stop.requested) if stop is not None else (lambda: False)
    ori_env = gym.make(env_id, max_episode_steps=max_steps,
                       **{**ori_kwargs, "render_mode": None, "obs_mode": "state"})  # only its controller is read
    try:
        target = gym.make(env_id, num_envs=1, max_episode_steps=max_steps, **kwargs)
        env = RecordEpisode(target, **rec_kwargs(target.unwrapped.control_freq))
    except BaseException:
        ori_env.close()
        raise
    rec = env.recorder
    startup = time.perf_counter() - t0
    t_run = time.perf_counter()
    diverged: list[Divergence] = []
    sources: list[int] = []
    successes = env_steps = done = 0
    bar = tqdm(
        total=len(episodes),
        unit="episode",
        disable=not cfg.progress or progress is not None,
        dynamic_ncols=True,
        desc="convert",
    )
    try:
        for ep in episodes:
            if stopping():
                break
            reset_kwargs = copy.deepcopy(ep.get("reset_kwargs") or {})
            reset_kwargs["seed"] = int(ep["episode_seed"])  # ManiSkill's sanity_check_and_format_seed
            ori_actions = traj.actions(ep)
            for attempt in range(cfg.max_retry + 1):
                options = dict(reset_kwargs.get("options") or {})
                ori_env.reset(seed=reset_kwargs["seed"], options=options)
                if cfg.use_first_env_state:
                    first = tree_stack([tree_index(traj.env_states(ep), 0)], torch.device(target.unwrapped.device))
                    ori_env.unwrapped.set_state_dict(first)
                    options["reset_to_env_states"] = {"env_states": first}  # recorded as the episode's first state
                env.reset(seed=reset_kwargs["seed"], options=options)
                info = converter(
                    cfg.target_control_mode, ori_actions, ori_env, env, render=False, pbar=None, verbose=cfg.verbose
                )
                env_steps += int(np.asarray(target.unwrapped.elapsed_steps).reshape(-1)[0])
                replayed = (
                    bool(np.asarray(torch.as_tensor(info["success"]).cpu()).reshape(-1)[0])
                    if "success" in info
                    else None
                )
                truncated = (
                    max_steps is not None
                    and int(np.asarray(target.unwrapped.elapsed_steps).reshape(-1)[0]) >= max_steps
                )
                ok = cfg.maniskill_keeps(replayed, truncated)
                last = ok or attempt == cfg.max_retry
                verdict.value = ok
                before = rec.num_episodes
                check_replayed(rec, 0, ep, traj.h5_path.name)
                rec.set_episode_meta(
                    [0], [meta(ep) if meta is not None else {"source_episode_id": int(ep["episode_id"])}]
                )
                env.flush_trajectory()
                if rec.num_episodes > before:
                    sources.append(int(ep["episode_id"]))
                if last:
                    break
            done += 1
            successes += bool(replayed)
            recorded = traj.recorded_success(ep)
            if replayed is not None and recorded is not None and replayed != recorded:
                diverged.append(Divergence(int(ep["episode_id"]), recorded, replayed))
            if cfg.maniskill and not ok:
                tqdm.write(f"Episode {ep['episode_id']} is not replayed successfully. Skipping")
            bar.update(1)
            bar.set_postfix(kept=rec.num_episodes, diverged=len(diverged))
            if progress is not None:
                progress(1)
        rec.wait_until_done()
    finally:
        bar.close()
        try:
            rec.set_episode_meta([0], [None])  # a replay cut by an exception (Ctrl-C) is not saved: --resume redoes it
            env.close()
        finally:
            ori_env.close()
    return ReplaySummary(done, rec.num_episodes, successes, diverged, env_steps, time.perf_counter() - t_run, Path("."),
                         sorted(rec.video_paths), sources, stop.name if stopping() else None, 0,
                         startup_seconds=startup, results=list(rec.results.rows), results_path=rec.results.path,
                         converted=True)


def _drive(cfg: ReplayConfig, traj: TrajectoryFile, episodes: list[dict], batch: VectorBatch | BatchedEnv,
           verdict: Verdict, stop: StopRequest | None = None, t0: float | None = None,
           progress: Callable[[int], None] | None = None, meta: Callable[[Mapping[str, Any]], dict] | None = None,
           ) -> ReplaySummary:
    """Keep every env busy: when an env's episode ends, flush it and start the next pending one there
    (ManiSkill's --max-retry: the same episode again, while it fails and retries are left).

    A ``stop`` request ends the loop between two steps; the replays in progress are not saved (a cut
    replay is not a finished one: re-running with ``resume`` replays it whole), as `fastrecord record` does."""
    from tqdm import tqdm

    stopping = (lambda: stop.requested) if stop is not None else (lambda: False)
    startup = time.perf_counter() - t0 if t0 is not None else 0.0
    t_run = time.perf_counter()

    n = batch.num_envs
    per_step = cfg.replay_by == "states"
    pending = deque(range(len(episodes)))
    retries = np.zeros(len(episodes), dtype=np.int64)
    slot: list[int | None] = [None] * n  # index into episodes
    actions: list[np.ndarray | None] = [None] * n
    t = np.zeros(n, dtype=np.int64)
    length = np.zeros(n, dtype=np.int64)
    act = np.zeros((n, *batch.action_shape), dtype=np.float32)
    diverged: list[Divergence] = []
    sources: list[int] = []  # output episode k replays input episode sources[k]
    successes = env_steps = partial = cut = done_count = 0
    rec = batch.recorder

    def flush(e: int) -> None:
        before = rec.num_episodes
        ep = episodes[slot[e]]
        check_replayed(rec, e, ep, traj.h5_path.name)  # non-finite data stops the replay before it is written
        tag = meta(ep) if meta is not None else {"source_episode_id": int(ep["episode_id"])}
        rec.set_episode_meta([e], [tag])
        batch.flush(e)
        if rec.num_episodes > before:
            sources.append(int(episodes[slot[e]]["episode_id"]))
        slot[e] = None

    def plan(i: int) -> dict[str, Any]:
        ep = episodes[i]
        a = traj.actions(ep)
        if a.ndim != 2 or a.shape[1:] != tuple(batch.action_shape):
            raise ValueError(
                f"{traj.h5_path.name} traj_{ep['episode_id']}/actions has shape {a.shape}, but the env takes "
                f"actions of shape {tuple(batch.action_shape)}; was it recorded with another control mode or robot?"
            )
        states = traj.env_states(ep) if (per_step or cfg.use_first_env_state) else None
        opts = (ep.get("reset_kwargs") or {}).get("options") or {}
        return dict(
            seed=int(ep["episode_seed"]), options=opts, states=states, per_step=per_step, length=len(a), actions=a
        )

    def start(envs: list[int]) -> None:
        plans = []
        for e in envs:
            i = pending.popleft()
            p = plan(i)
            slot[e], actions[e], t[e], length[e] = i, p.pop("actions"), 0, p["length"]
            plans.append(p)
        batch.start(np.asarray(envs), plans)

    bar = tqdm(
        total=len(episodes),
        unit="episode",
        disable=not cfg.progress or progress is not None,
        dynamic_ncols=True,
        desc="replay",
    )
    try:
        if not stopping():
            start(list(range(n)))
        success, truncated = None, np.zeros(n, dtype=bool)
        while not stopping() and any(s is not None for s in slot):
            act[:] = 0
            for e in range(n):
                if slot[e] is not None:
                    act[e] = actions[e][t[e]]
            success, truncated = batch.step(act)
            active = np.array([s is not None for s in slot])
            t[active] += 1
            env_steps += int(active.sum())
            done = [e for e in range(n) if slot[e] is not None and t[e] >= length[e]]
            finished = 0
            for e in done:
                i = slot[e]
                ep = episodes[i]
                replayed = None if success is None else bool(success[e])
                verdict.value = ok = cfg.maniskill_keeps(replayed, bool(truncated[e]))
                if not ok and retries[i] < cfg.max_retry:  # ManiSkill's --max-retry: again, before the others
                    retries[i] += 1
                    flush(e)
                    pending.appendleft(i)
                    continue
                recorded = traj.recorded_success(ep)
                successes += bool(replayed)
                finished += 1
                if replayed is not None and recorded is not None and replayed != recorded:
                    diverged.append(Divergence(int(ep["episode_id"]), recorded, replayed))
                if cfg.maniskill and not ok and (cfg.keep_filter is None):
                    tqdm.write(f"Episode {ep['episode_id']} is not replayed successfully. Skipping")
                flush(e)
            if done:
                done_count += finished
                bar.update(finished)
                bar.set_postfix(kept=rec.num_episodes, diverged=len(diverged))
                if progress is not None:
                    progress(finished)
                refill = done[: len(pending)]
                if refill:
                    start(refill)
        if stopping():  # the replays in progress are not saved: re-running with --resume replays them whole
            for e in range(n):
                if slot[e] is not None:
                    cut += 1
                    rec.set_episode_meta([e], [None])
                    slot[e] = None
        rec.wait_until_done()
    finally:
        bar.close()
        try:  # every finished replay was flushed: what is in progress (an exception, Ctrl-C) is not saved
            rec.set_episode_meta(np.arange(n), [None] * n)
        finally:
            batch.close()
    return ReplaySummary(done_count, rec.num_episodes, successes, diverged, env_steps, time.perf_counter() - t_run,
                         Path("."), sorted(rec.video_paths), sources, stop.name if stopping() else None, partial,
                         startup_seconds=startup, results=list(rec.results.rows), results_path=rec.results.path)


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
