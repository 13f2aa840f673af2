"""Which global episode each env slot runs: `EpisodeSchedule` (a rank's share, or an unsharded run's
episodes from `single_schedule`), the loop that records it (`record_schedule`), and the random policy
seeded per episode (`SeededRandomPolicy`) that makes a run reproducible whatever the world size.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fastrecord.shards.layout import (
    committed_global_indices,
    episode_meta,
    episode_seed,
    list_shards,
    results_rows,
    shards_root,
)
from fastrecord.sinks.maniskill_h5.layout import PARTS_SUFFIX, complete_parts


class SeededRandomPolicy:
    """Uniform random actions, drawn per env slot from the action space seeded with the episode's seed at
    each episode start: episode ``g``'s actions are the same whatever slot, rank or world size runs it.

    Owns: one copy of the single-env action space per slot. `EpisodeSchedule` calls `restart`.
    """

    def __init__(self, single_action_space: Any, num_envs: int) -> None:
        import copy

        self.spaces = [copy.deepcopy(single_action_space) for _ in range(num_envs)]

    def restart(self, slots: Iterable[int], seeds: Iterable[int]) -> None:
        for e, s in zip(slots, seeds, strict=True):
            self.spaces[int(e)].seed(int(s))

    def __call__(self, obs: Any) -> np.ndarray:
        return np.stack([s.sample() for s in self.spaces])


class EpisodeSchedule:
    """Owns: the global episodes this rank still has to record (in increasing ``g``) and which one each
    env slot runs.

    ``todo`` are the global indices to record (`episodes_of` minus what the shards have committed).
    `assign(slots)` gives the next episodes to env slots that are about to be reset; slots left without
    one (the schedule ran out) run spare episodes that are not recorded (their meta is None). ``rank``
    None: an unsharded run (`single_schedule`), whose episodes carry ``global_index`` only.
    """

    def __init__(self, todo: Sequence[int], num_envs: int, rank: int | None, base_seed: int) -> None:
        self.todo = [int(g) for g in todo]
        self._queue = deque(self.todo)
        self.num_envs = num_envs
        self.rank = rank
        self.base_seed = int(base_seed)
        self.current: list[int | None] = [None] * num_envs  # global episode running in each slot
        self.seeds = np.full(num_envs, self.base_seed, dtype=np.int64)  # each slot's current reset seed
        self.finished: list[int] = []  # global episodes that ended, in finish order

    @property
    def active(self) -> np.ndarray:
        """``[num_envs]`` bool: slots running a scheduled episode."""
        return np.array([g is not None for g in self.current], dtype=bool)

    @property
    def done(self) -> bool:
        return not self._queue and not self.active.any()

    def assign(self, slots: Iterable[int]) -> list[dict[str, int] | None]:
        """The episodes in ``slots`` end (if scheduled: they count as finished); give each slot the next
        global episode. Updates `seeds` (spare slots keep theirs) and returns the recorder's metas."""
        metas: list[dict[str, int] | None] = []
        for e in slots:
            e = int(e)
            ended = self.current[e]
            if ended is not None:
                self.finished.append(ended)
            g = self._queue.popleft() if self._queue else None
            self.current[e] = g
            if g is not None:
                self.seeds[e] = episode_seed(self.base_seed, g)
            if g is None:
                metas.append(None)
            else:
                metas.append(episode_meta(g, self.rank) if self.rank is not None else {"global_index": g})
        return metas


def check_resume(run_dir: str | Path, name: str, *, base_seed: int) -> None:
    """Whether the run ``name`` on disk in ``run_dir`` can be resumed by an unsharded run with seed
    ``base_seed``; reads its ``NAME.json`` and results file only (no env, no HDF5, nothing written), so
    that ``fastrecord record --if-exists resume`` refuses before it makes anything. `single_schedule`
    checks again once the run is open (its complete parts recovered). Raises ValueError when:

    - ``NAME.json`` exists but is not a JSON object (truncated, edited): which episodes and seeds the run
      holds is unknown (``fastrecord consolidate`` rebuilds it where part files hold the entries);
    - its episodes have no ``global_index`` (recorded by `RecordEpisode` directly): their seeds are unknown;
    - its episodes or results rows were recorded with another base seed (their seeds minus their global
      indices), since global episode g has seed ``base_seed + g``;
    - ``NAME.shards/`` holds shards: a sharded run, which a plain run must not write beside
      (``fastrecord record`` resumes it from its shards, `fastrecord.commands.record_run.run_record_sharded`).
    """
    run_dir = Path(run_dir)
    where = f"cannot resume run {name!r} in {str(run_dir)!r}"
    if list_shards(run_dir, name):
        raise ValueError(
            f"{where}: it is a sharded run ({shards_root(run_dir, name).name}/ holds its shards); resume it from "
            f"its shards (fastrecord record, or run_record_sharded), or join them first with fastrecord merge "
            f"{run_dir} --name {name}"
        )
    path = run_dir / f"{name}.json"
    doc: Any = None
    if path.exists():
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            doc = e
        if not isinstance(doc, dict) or not isinstance(doc.get("episodes", []), list):
            why = (
                f"{type(doc).__name__}: {doc}" if isinstance(doc, Exception) else "not an object with an episodes list"
            )
            parts = run_dir / f"{name}.h5{PARTS_SUFFIX}"
            fix = (
                f"fastrecord consolidate {run_dir / (name + '.h5')} rebuilds it from the part files in {parts.name}/, "
                "then resume"
                if complete_parts(parts)
                else "restore it from a copy, or pass --if-exists overwrite (deletes the run), or record into another "
                "--output-dir or --trajectory-name"
            )
            raise ValueError(
                f"{where}: {path.name} cannot be read ({why[:200]}), so which episodes and seeds it holds is "
                f"unknown; {fix}"
            )
    entries = [e for e in doc.get("episodes", []) if isinstance(e, dict)] if isinstance(doc, dict) else []
    untagged = sum("global_index" not in e for e in entries)
    if untagged:
        raise ValueError(
            f"{where}: {untagged} of its episodes have no global_index (recorded by RecordEpisode in Python or "
            f"an older fastrecord), so which seeds it holds is unknown; record into another --output-dir or "
            f"--trajectory-name, or pass --if-exists overwrite"
        )
    rows = [r for r in results_rows(run_dir, name) if "global_index" in r]
    bases = {
        int(e[k]) - int(e["global_index"])
        for e, k in [*((e, "episode_seed") for e in entries), *((r, "seed") for r in rows)]
        if _is_int(e.get(k)) and _is_int(e.get("global_index"))
    }
    if bases and bases != {int(base_seed)}:
        before = min(bases)
        raise ValueError(
            f"{where}: it was recorded with seed {before} and this command has seed {base_seed}; episode g "
            f"has seed base + g, so pass --seed {before} (or record into another --output-dir or "
            f"--trajectory-name)"
        )


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def single_schedule(run_dir: str | Path, name: str, *, total: int, base_seed: int, num_envs: int) -> EpisodeSchedule:
    """The schedule of an unsharded run (one process records global episodes ``0 .. total-1`` into
    ``run_dir/NAME.h5`` itself, as ``fastrecord record`` without torchrun): the episodes its ``NAME.json``
    and results file do not have (`committed_global_indices`; all of them in a new run), so a resumed
    run continues the seed sequence and ``total`` is the run's size. Call it once the recorder has
    opened the run (a resumed run has then recovered its complete parts). Raises ValueError where
    `check_resume` does."""
    if isinstance(total, bool) or not isinstance(total, int) or total < 1:
        raise ValueError(f"total={total!r} must be an integer >= 1 (the number of episodes in the run)")
    check_resume(run_dir, name, base_seed=base_seed)
    done = committed_global_indices(run_dir, name)
    return EpisodeSchedule([g for g in range(total) if g not in done], num_envs, None, base_seed)


def record_schedule(env: Any, recorder: Any, schedule: EpisodeSchedule, act: Any, *,
                    stop: Any = None, on_step: Any = None) -> int:
    """Run ``schedule``'s episodes in ``env`` (the recorded env stack whose recorder is ``recorder``);
    returns the env-steps taken.

    Every env slot is reset by this loop with its episode's seed (``schedule.seeds``) when its episode
    ends (terminated or truncated), and the recorder is told the slot's global episode right after
    (`EpisodeRecorder.set_episode_meta`). ``env`` must not auto-reset: a ManiSkill env (batched or one
    env; ``ManiSkillVectorEnv(auto_reset=False)`` on top is fine), partial resets through
    ``options["env_idx"]``, or a gymnasium vector env with ``autoreset_mode=DISABLED`` (recorded by
    `RecordVectorEpisode`), partial resets through ``options["reset_mask"]``. ``act(obs)`` gives the
    batched action; if it has ``restart(slots, seeds)`` (`SeededRandomPolicy`) it is called at each
    reset. ``stop()`` is checked between steps; ``on_step(schedule)`` after each step (progress).
    """
    import torch

    from fastrecord.system import stamp

    n = schedule.num_envs
    restart = getattr(act, "restart", None)

    def reset(slots: np.ndarray) -> Any:
        metas = schedule.assign(slots)
        seeds = [int(s) for s in schedule.seeds]
        if n == 1:
            obs, _ = env.reset(seed=seeds[0])
        elif len(slots) == n:
            obs, _ = env.reset(seed=seeds)
        else:
            obs, _ = env.reset(seed=seeds, options=recorder.view.partial_reset_options(slots))
        recorder.set_episode_meta(slots, metas)
        if restart is not None:
            restart(slots, schedule.seeds[slots])
        return obs

    def flags(x: Any) -> np.ndarray:
        return (x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)).reshape(-1).astype(bool)

    steps = 0
    obs = reset(np.arange(n))
    stamp("reset")  # benchmarks/bench_whole.py's phases (nothing without FASTRECORD_TIMELINE)
    while not schedule.done and not (stop is not None and stop()):
        obs, _, terminated, truncated, _ = env.step(act(obs))
        steps += n
        ended = np.flatnonzero(flags(terminated) | flags(truncated))
        if len(ended):
            obs = reset(ended)
        if on_step is not None:
            on_step(schedule)
    return steps
