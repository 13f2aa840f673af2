"""`fastrecord replay`: replay saved ManiSkill trajectories side by side and record them again.

Reads a ``NAME.h5`` + ``NAME.json`` pair written by fastrecord or by ManiSkill's ``RecordEpisode`` and
replays N episodes at once, in a gymnasium vector env of CPU envs (``physx_cpu``) or in one
GPU-parallel ManiSkill env (``physx_cuda``). The output goes through fastrecord's recorder: new
MP4s (any camera, resolution, shader) and a new trajectory (any observation mode).

Examples:
    fastrecord replay demos/trajectory.h5                            # re-render videos + trajectory
    fastrecord replay demos/trajectory.h5 --obs-mode rgb --no-video  # state -> rgb observations
    fastrecord replay demos/trajectory.h5 --width 512 --height 512 --shader default --keep success
    fastrecord replay demos/trajectory.h5 --video-source sensor:base_camera --obs-mode rgb
    fastrecord replay demos/trajectory.h5 --by actions               # reports diverging episodes
    fastrecord replay demos/trajectory.h5 --count 10 --num-envs 2 --output-dir replayed --overwrite
    fastrecord replay demos/trajectory.h5 --config configs/replay_rgb.yaml
    fastrecord replay demos/trajectory.h5 --obs-mode rgb --no-video --workers 16 --num-envs 16
    torchrun --standalone --nproc-per-node 4 -m fastrecord replay demos/trajectory.h5 --obs-mode rgb

Replay by env states (``--by states``, the default) sets every recorded state exactly: each step
runs the physics from the recorded state (so contact-based checks such as grasping see real
contacts), then sets the next recorded state and computes observation, reward and success on it.
Replay by actions (``--by actions``) resets with the episode seed and applies the recorded actions;
episodes whose final success differs from the recorded one are reported.

Episodes are renumbered in the order they finish; each output JSON episode names the episode it
replays in ``source_episode_id``. Existing output files are never replaced without ``--overwrite``;
``--resume`` continues an interrupted replay, skipping the episodes it holds.

``--workers N`` (default: see `default_workers`) splits the episodes over N processes (forked by the
preloaded forkserver), each with its own envs and recorder writing a shard (`fastrecord.shards`: input
episode ``g`` goes to worker ``g % N``); the shards are joined at the end into ``NAME.h5`` (external
links) + ``NAME.json``, in input order. Under torchrun each rank is one worker and rank 0 joins. A
worker that fails or is killed does not stop the others; the error names it and the missing episodes,
and re-running resumes.

ManiSkill's command line works with the program's name changed: every flag of
``python -m mani_skill.trajectory.replay_trajectory`` (``--traj-path``, ``-o``, ``-c``, ``--save-traj``,
``--save-video``, ``--use-env-states``, ``--allow-failure``, ``--discard-timeout``, ``--max-retry``, ...)
is accepted with its meaning, and any of them (every ManiSkill command has ``--traj-path``) switches to
ManiSkill's defaults: by actions unless ``--use-env-states``, nothing written unless ``--save-traj`` /
``--save-video``, only successful replays kept unless ``--allow-failure``, rewards only with
``--record-rewards``, one env unless ``-n``, and the output ``<stem>.<obs>.<control>.<backend>.h5`` next
to the input, replacing an earlier replay of that name as ManiSkill's tool does. ``-c`` converts the
actions to another control mode with ManiSkill's own conversion code (``from_pd_joint_pos``,
``from_pd_joint_delta_pos``), one episode at a time in a CPU env:

    fastrecord replay --traj-path demos/trajectory.h5 --use-env-states -o rgb --save-traj --count 10
    fastrecord replay --traj-path demos/trajectory.h5 -c pd_ee_delta_pose --save-traj --allow-failure
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import functools
import json
import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import gymnasium as gym
import h5py
import numpy as np
import torch

from fastrecord.commands.cli import StopSignals
from fastrecord.commands.config import check_at_least, check_choice, check_fps, check_types, load_config
from fastrecord.envs import SubEnvAccess
from fastrecord.episode import KEEP_CHOICES
from fastrecord.workers import ENVS_PER_WORKER, MANY_CORES, forkserver_context, freeze_imports

BY_CHOICES = ("states", "actions")
CONVERTERS = ("pd_joint_pos", "pd_joint_delta_pos")  # control modes ManiSkill's conversion code starts from
VECTOR_CHOICES = ("auto", "sync", "async", "batched")
CPU_BACKENDS = ("physx_cpu", "cpu")
GPU_DEFAULT_ENVS = 64  # episodes replayed side by side in GPU simulation unless --num-envs says otherwise


@dataclass(frozen=True)
class ReplayConfig:
    traj_path: str = ""  # the NAME.h5 to replay (NAME.json must sit next to it)
    output_dir: str | None = None  # None: a "replay" folder next to the input file
    trajectory_name: str | None = None  # None: NAME.<obs_mode>.<control_mode>.<sim_backend> (ManiSkill's naming)
    by: str | None = None  # states (set every recorded env state) | actions (re-simulate the actions); None: states (maniskill: actions)
    use_first_env_state: bool = False  # by actions: start from the recorded first state, not the seeded reset
    count: int | None = None  # replay the first COUNT episodes (None: all)
    num_envs: int | None = None  # episodes side by side (None: CPU one per core, maniskill 1; GPU 64; batched CPU 1)
    vector: str = "auto"  # auto | sync | async (gymnasium vector env of CPU envs) | batched (one ManiSkill env)
    sim_backend: str = "auto"  # auto (the file's, CPU where CUDA is absent) | physx_cpu | physx_cuda
    render_backend: str = "auto"  # auto (GPU if CUDA is present, else CPU) | cpu | gpu
    obs_mode: str | None = None  # observation mode of the new trajectory (None: the file's)
    save_video: bool = True  # write one MP4 per replayed episode
    save_trajectory: bool = True  # write the new NAME.h5/.json pair
    video_source: str = "render"  # render (human render camera) | sensor:<camera> (needs an rgb obs mode)
    width: int | None = None  # video camera width (None: the file's / the task's)
    height: int | None = None  # video camera height
    shader: str | None = None  # shader pack of the video camera: minimal | default | rt | rt-fast
    keep: str | None = None  # all | success | success_once | failure: which replays are written (None: all; maniskill: see allow_failure)
    video_fps: float | None = None  # None: the task's control frequency
    video_codec: str = "auto"  # auto (h264_nvenc where usable, else libx264) | libx264 | any PyAV encoder
    overwrite: bool = False  # replace the output of an earlier run of this name (never the input)
    resume: bool = False  # continue an earlier, interrupted replay of this name: episodes it holds are not replayed again
    workers: int | None = None  # processes replaying a share of the episodes each, merged at the end (None: see default_workers)
    progress: bool = True  # show a progress bar
    env_kwargs: dict[str, Any] = field(default_factory=dict)  # extra gym.make kwargs (override the file's)
    # ManiSkill's replay_trajectory flags, same meaning; `maniskill` switches to its defaults (see the module docstring)
    maniskill: bool = False  # ManiSkill's semantics: set by --traj-path or any other flag only ManiSkill's tool has
    target_control_mode: str | None = None  # -c: convert the actions to this control mode (ManiSkill's conversion code)
    allow_failure: bool = False  # maniskill: also write replays that do not end in success
    discard_timeout: bool = False  # maniskill: drop replays truncated by the time limit at their last step
    max_retry: int = 0  # maniskill: replay a failed episode up to this many more times
    record_rewards: bool | None = None  # write rewards (None: fastrecord yes, maniskill no)
    reward_mode: str | None = None  # the env's reward mode (None: the file's / the task's)
    render_mode: str = "rgb_array"  # render mode of the videos: rgb_array | sensors | all
    verbose: bool = False  # maniskill: print each replay that is not kept

    def __post_init__(self) -> None:
        check_types(self)
        if self.by is not None:
            check_choice(self, "by", BY_CHOICES)
        check_choice(self, "vector", VECTOR_CHOICES)
        if self.keep is not None:
            check_choice(self, "keep", KEEP_CHOICES)
        check_choice(self, "render_mode", ("rgb_array", "sensors", "all"))
        check_at_least(self, 1, count="--count", num_envs="--num-envs", width="--width", height="--height", workers="--workers")
        if self.resume and self.overwrite:
            raise ValueError("--resume keeps the earlier replay's files and --overwrite deletes them; pass one")
        check_at_least(self, 0, max_retry="--max-retry")
        check_fps(self.video_fps)
        if self.use_first_env_state and self.replay_by == "states":
            raise ValueError("use_first_env_state only applies to --by actions (--by states sets every recorded state anyway)")
        if not (self.video_source == "render" or self.video_source.startswith("sensor:")):
            raise ValueError(f"video_source={self.video_source!r} is unknown; use 'render' or 'sensor:<camera name>'")
        if not self.maniskill and not (self.save_video or self.save_trajectory):
            raise ValueError("nothing to write: both the video and the trajectory are off; drop --no-video or --no-trajectory")
        if self.maniskill and self.keep is not None and (self.allow_failure or self.discard_timeout):
            raise ValueError(f"--keep {self.keep} and --allow-failure/--discard-timeout both choose which replays are "
                             f"written; pass one of them")
        if not self.maniskill and (self.allow_failure or self.discard_timeout or self.max_retry):
            raise ValueError("allow_failure, discard_timeout and max_retry are ManiSkill's replay semantics: set "
                             "maniskill: true (the CLI does when a ManiSkill flag is given), or use keep")

    @property
    def replay_by(self) -> str:
        """states | actions: ``by``, else the default of the mode (ManiSkill's tool replays by actions)."""
        return self.by or ("actions" if self.maniskill else "states")

    @property
    def keep_filter(self) -> str | None:
        """The keep choice, or None where ManiSkill's success/allow_failure/discard_timeout rule decides."""
        if self.keep is not None:
            return self.keep
        if self.maniskill and not (self.allow_failure and not self.discard_timeout):
            return None
        return "all"

    def maniskill_keeps(self, success: bool | None, truncated: bool) -> bool:
        """ManiSkill's rule for one replay: success at the end (or --allow-failure), and not truncated
        with --discard-timeout."""
        ok = bool(success) or self.allow_failure
        return ok and not (self.discard_timeout and truncated)


@dataclass
class Divergence:
    episode_id: int  # the episode id in the input file
    recorded: bool  # its recorded final success
    replayed: bool  # the final success of its replay


@dataclass
class ReplaySummary:
    episodes: int  # episodes replayed
    kept: int  # episodes written (keep filter)
    successes: int  # replayed episodes that end in success
    diverged: list[Divergence]  # replays whose final success differs from the recording
    env_steps: int  # env steps replayed (summed over episodes)
    seconds: float  # wall time of the replay loop (the progress bar's), writing included; env creation not
    output_dir: Path
    files: list[Path]
    source_episode_ids: list[int] = field(default_factory=list)  # output episode k replays input episode [k]
    interrupted: str | None = None  # the signal that stopped the replay early ("SIGINT", "SIGTERM")
    partial: int = 0  # interrupted: replays cut short and saved as they were
    startup_seconds: float = 0.0  # env creation, before the progress bar (``seconds`` is the replay after it)
    results: list[dict[str, Any]] = field(default_factory=list)  # NAME.results.jsonl's rows: every replay, retries included
    results_path: Path | None = None
    converted: bool = False  # the actions were converted to another control mode (-c)
    skipped: int = 0  # --resume: episodes the output already held, not replayed again
    workers: int = 1  # processes that replayed a share each
    missing: list[int] = field(default_factory=list)  # sharded: input episodes no shard holds (a worker stopped early)
    # --workers: each worker's (started, replaying, done) in seconds since the replay began: its process up
    # with its imports, its envs made, its share written; and the time the shards' merge took
    worker_times: list[tuple[float, float, float]] = field(default_factory=list)
    merge_seconds: float = 0.0
    process_age: float | None = None  # seconds from this process's start to the replay's (interpreter, imports)


# ---------------------------------------------------------------------------------------------- input
# the ManiSkill format's reader lives with its writer
from fastrecord.sinks.maniskill_h5 import TrajectoryFile, _read_tree, open_trajectory  # noqa: E402,F401


# ---------------------------------------------------------------------------------------------- env side
def _tree_index(tree: Mapping[str, Any], t: int) -> dict[str, Any]:
    return {k: (_tree_index(v, t) if isinstance(v, Mapping) else v[t]) for k, v in tree.items()}


def _tree_stack(trees: list[Mapping[str, Any]], device: torch.device) -> dict[str, Any]:
    first = trees[0]
    return {
        k: (_tree_stack([t[k] for t in trees], device) if isinstance(first[k], Mapping)
            else torch.as_tensor(np.stack([t[k] for t in trees]), device=device))
        for k in first
    }


def _tree_set_rows(dst: Mapping[str, Any], src: Mapping[str, Any], rows: torch.Tensor) -> None:
    for k, v in src.items():
        if k in dst:
            if isinstance(v, Mapping):
                _tree_set_rows(dst[k], v, rows)
            else:
                dst[k][rows] = v.to(dst[k].device, dst[k].dtype)


def _tree_keys(tree: Mapping[str, Any], prefix: str = "") -> set[str]:
    out: set[str] = set()
    for k, v in tree.items():
        out |= _tree_keys(v, f"{prefix}{k}/") if isinstance(v, Mapping) else {prefix + k}
    return out


class ReplayStates(gym.Wrapper):
    """Plays recorded episodes in a ManiSkill env (batched, ``num_envs >= 1``), below the recorder.

    Owns: per env, the episode plan for its next reset, the recorded states being played, the step
    cursor, and (``num_envs == 1``) the last outputs and frame, returned while the env is idle.

    ``load(env_idx, plans)`` (or, through a vector env, ``set_attr("replay_plan", [...])``) queues a
    plan per env: ``seed``, reset ``options``, ``states`` (a tree of ``[T+1, ...]`` arrays or None),
    ``per_step`` (set every state, else only the first) and ``length`` (T). The next reset of that
    env applies it: a reset with the episode's seed and options, to the first recorded state when the
    plan has states (ManiSkill's ``reset_to_env_states``, which also resets the controllers; a partial
    reset of a GPU-parallel env cannot take per-env seeds, so there the states are required). Each
    step then runs the physics from the current state with
    the given action; with ``per_step`` it sets the next recorded state and computes observation,
    info, reward and termination on it, as ``BaseEnv.step`` would. After T steps the env is idle:
    a single env then stops simulating and rendering (its frame is held) until its next plan.
    """

    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        base = env.unwrapped
        self.n = base.num_envs
        self.device = torch.device(base.device)
        self._pending: dict[int, dict[str, Any]] = {}
        self._plans: list[dict[str, Any] | None] = [None] * self.n
        self._t = np.zeros(self.n, dtype=np.int64)
        self._active = np.zeros(self.n, dtype=bool)
        self._state_keys: set[str] | None = None
        self._last_step: tuple | None = None
        self._last_frame: Any = None
        self._time_limit = self._direct_step_time_limit()
        self._prepared: Any = None  # the action `prepare` took, until `step` observes it
        # `prepare` submits the cameras' renders: only worth it where the observation has cameras, and only
        # where BaseEnv computes it as ManiSkill 3.0 does (render, capture, read: `_rendered` skips the first two)
        visual = getattr(getattr(base, "obs_mode_struct", None), "visual", None)
        self._camera_obs = (self.n == 1 and visual is not None and any(vars(visual).values())
                            and all(hasattr(base, a) for a in ("capture_sensor_data", "_hidden_objects", "scene")))

    @property
    def max_episode_steps(self) -> int | None:
        # answered here so that vector envs' get_attr("max_episode_steps") finds it: an AsyncVectorEnv
        # worker asked for a missing attribute shuts down (fastrecord.envs.VectorEnvView probes for it)
        from mani_skill.utils import gym_utils

        return gym_utils.find_max_episode_steps_value(self.env)

    # -- plans
    @property
    def replay_plan(self) -> dict[str, Any] | None:
        return self._plans[0]

    @replay_plan.setter
    def replay_plan(self, plan: dict[str, Any] | None) -> None:
        """Vector envs' ``set_attr`` entry point (one env per process): None leaves the env as it is."""
        if plan is not None:
            self.load([0], [plan])

    def load(self, env_idx: list[int] | np.ndarray, plans: list[dict[str, Any]]) -> None:
        for e, plan in zip(np.asarray(env_idx).reshape(-1).tolist(), plans):
            if plan.get("states") is not None:
                self._check_state_keys(plan["states"])
            self._pending[e] = plan

    def _check_state_keys(self, states: Mapping[str, Any]) -> None:
        if self._state_keys is None:
            self._state_keys = _tree_keys(self.env.unwrapped.get_state_dict())
        theirs = {k for k in _tree_keys(states) if not k.startswith("controller/")}
        ours = {k for k in self._state_keys if not k.startswith("controller/")}
        if theirs != ours:
            raise ValueError(
                f"the recorded env states do not fit this env: missing here {sorted(theirs - ours)[:5]}, not recorded "
                f"{sorted(ours - theirs)[:5]}. The file was recorded with another task version or env kwargs; replay it "
                f"by actions (--by actions) or with the env kwargs it was recorded with"
            )

    # -- gym API
    def reset(self, *, seed: Any = None, options: dict | None = None):
        options = dict(options or {})
        idx = options.get("env_idx")
        idx = np.arange(self.n) if idx is None else np.asarray(torch.as_tensor(idx).cpu()).reshape(-1)
        plans = [self._pending.pop(int(e), None) for e in idx]
        if any(p is not None for p in plans):
            if any(p is None for p in plans):
                raise RuntimeError(f"reset of envs {idx.tolist()} where only some have a replay plan; load a plan for each")
            seeds = [int(p["seed"]) for p in plans]
            partial = len(idx) < self.n
            # ManiSkill 3.0.1 seeds a reset with one seed per env of the whole batch only
            seed = seeds[0] if self.n == 1 else (None if partial else seeds)
            options |= {k: v for k, v in (plans[0].get("options") or {}).items() if k not in ("env_idx", "reset_to_env_states")}
            if all(p.get("states") is not None for p in plans):
                first = _tree_stack([_tree_index(p["states"], 0) for p in plans], self.device)
                options["reset_to_env_states"] = {"env_states": first}
            elif partial:
                raise ValueError("a partial reset of a GPU-parallel env cannot reproduce seeded episodes; replay with the "
                                 "recorded first states (--by states, or --by actions --use-first-env-state)")
        obs, info = self.env.reset(seed=seed, options=options)
        if seed is None and any(p is not None for p in plans):  # bookkeeping: the recorder reads the seeds from here
            base = self.env.unwrapped
            base._episode_seed[idx] = [int(p["seed"]) for p in plans]
        for e, p in zip(idx.tolist(), plans):
            self._plans[e] = p
            self._t[e] = 0
            self._active[e] = p is not None and p["length"] > 0
        self._last_step = None
        self._prepared = None
        return obs, info

    def prepare(self, action: Any) -> None:
        """The first half of the next `step` (with the same action), for a vector env that holds several
        single envs in one process (`_PreparedSyncVectorEnv`): simulate, set the recorded state and
        submit the cameras' renders, without waiting for them. SAPIEN renders asynchronously, so the
        renders of all of a process's envs then run together on the GPU before the first is read
        (on the H200, 4 envs: 2.4 ms an env-step against 4.8 one after the other). Does nothing where
        `step` would not take its direct path (by actions, idle, another wrapper below) or the
        observation has no camera."""
        if self._prepared is not None or not self._camera_obs or self._idle():
            return
        rows = self._per_step_rows()
        if not rows or self._time_limit is False:
            return
        base = self.env.unwrapped
        stepped = self._advance(action, rows)
        for obj in base._hidden_objects:  # as BaseEnv._get_obs_sensor_data, before its render
            obj.hide_visual()
        base.scene.update_render(update_sensors=True, update_human_render_cameras=False)
        base.capture_sensor_data()
        self._prepared = action if stepped is None else stepped

    def step(self, action: Any):
        if self._prepared is not None:  # `prepare` simulated, set the state and rendered: observe
            stepped, self._prepared = self._prepared, None
            with _rendered(self.env.unwrapped):
                obs, rew, terminated, info = self._observe(stepped, {})
            return self._finish(obs, rew, terminated, info)
        if self._idle():
            return self._last_step  # the episode is over: hold still until the next plan
        rows = self._per_step_rows()
        if rows and self._time_limit is not False:
            stepped = self._advance(action, rows)
            obs, rew, terminated, info = self._observe(action if stepped is None else stepped, {})
            return self._finish(obs, rew, terminated, info)
        obs, rew, terminated, truncated, info = self.env.step(action)
        self._t[self._active] += 1
        if rows:
            self._set_states(rows)
            obs, rew, terminated, info = self._observe(action, info)
        return self._finish(obs, rew, terminated, info, truncated)

    def _idle(self) -> bool:
        """A single env whose episode is over (it holds its last step until the next plan)."""
        return self.n == 1 and not self._active.any() and self._last_step is not None

    def _per_step_rows(self) -> list[int]:
        """The envs playing an episode whose every recorded state is set."""
        return [e for e in np.flatnonzero(self._active) if self._plans[e]["per_step"]]

    def _advance(self, action: Any, rows: list[int]) -> Any:
        """BaseEnv.step without its observation and reward: they would be of the simulated state, which
        the recorded one replaces at once (for camera observations, a second render per step). Returns
        the action as the env took it (None: as given)."""
        base = self.env.unwrapped
        stepped = base._step_action(action)
        base._elapsed_steps += 1
        self._t[self._active] += 1
        self._set_states(rows)
        return stepped

    def _finish(self, obs: Any, rew: Any, terminated: Any, info: dict, truncated: Any = None) -> tuple:
        if truncated is None:  # the direct path: ManiSkill's TimeLimitWrapper's flag
            limit, base = self._time_limit, self.env.unwrapped
            truncated = (base.elapsed_steps >= limit if limit is not None
                         else torch.zeros(self.n, dtype=torch.bool, device=self.device))
        self._active &= self._t < np.array([p["length"] if p else 0 for p in self._plans])
        self._last_step = (obs, rew, terminated, truncated, info)
        return self._last_step

    def render(self):
        if self.n == 1 and not self._active.any() and self._last_frame is not None:
            return self._last_frame
        self._last_frame = self.env.render()
        return self._last_frame

    # -- internals
    def _direct_step_time_limit(self) -> int | None | bool:
        """Whether `step` may call BaseEnv's action step directly: only ManiSkill's TimeLimitWrapper (its
        limit is returned, None: no limit) and gymnasium's checkers sit between this wrapper and the base
        env. False where another wrapper (an action transform, gymnasium's own TimeLimit) must see each step."""
        from mani_skill.utils.registration import TimeLimitWrapper

        limit, env = None, self.env
        while isinstance(env, gym.Wrapper):
            if isinstance(env, TimeLimitWrapper):
                limit = env._max_episode_steps
            elif not isinstance(env, (gym.wrappers.OrderEnforcing, gym.wrappers.PassiveEnvChecker)):
                return False
            env = env.env
        return limit

    def _set_states(self, rows: list[int]) -> None:
        base = self.env.unwrapped
        recorded = _tree_stack([_tree_index(self._plans[e]["states"], int(self._t[e])) for e in rows], self.device)
        if len(rows) == self.n:
            base.set_state_dict(recorded)
        else:  # the other envs keep their simulated state
            state = base.get_state_dict()
            _tree_set_rows(state, recorded, torch.as_tensor(rows, device=self.device))
            base.set_state_dict(state)

    def _observe(self, action: Any, step_info: dict) -> tuple:
        """Observation, reward, termination and info of the state just set (as ``BaseEnv.step``)."""
        base = self.env.unwrapped
        info = base.get_info()
        obs = base.get_obs(info, unflattened=True)
        act = torch.as_tensor(np.asarray(action) if not isinstance(action, torch.Tensor) else action, device=self.device)
        reward = base.get_reward(obs=obs, action=act, info=info)
        obs = base._flatten_raw_obs(obs)  # ManiSkill 3.0.1's own step computes the reward before flattening too
        success, fail = info.get("success"), info.get("fail")
        if success is not None and fail is not None:
            terminated = torch.logical_or(success, fail)
        elif success is not None or fail is not None:
            terminated = (success if success is not None else fail).clone()
        else:
            terminated = torch.zeros(self.n, dtype=torch.bool, device=self.device)
        base._last_obs = obs
        return obs, reward, terminated, {**step_info, **info}


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


@contextlib.contextmanager
def _rendered(base: Any):
    """Inside: ``base.get_obs`` reads the pictures `ReplayStates.prepare` rendered, without rendering again
    (its scene's ``update_render`` and its ``capture_sensor_data`` do nothing)."""
    scene = base.scene
    base.capture_sensor_data = _noop
    scene.update_render = _noop
    try:
        yield
    finally:
        del base.capture_sensor_data
        del scene.update_render


_TERMINATED, _TRUNCATED = "fastrecord_replay_terminated", "fastrecord_replay_truncated"


class _DoneInInfo(gym.Wrapper):
    """A replay vector env's sub-env: reports terminated/truncated in ``info``, and False to the vector env.

    Recorded episodes often go on after termination (ManiSkill's envs do not stop by themselves), which
    a gymnasium vector env does not allow without a reset. `_DoneFromInfo` gives the flags back above it.
    """

    def step(self, action: Any):
        obs, rew, terminated, truncated, info = self.env.step(action)
        return obs, rew, False, False, {**info, _TERMINATED: bool(terminated), _TRUNCATED: bool(truncated)}

    def get_state_dict(self) -> dict[str, Any]:
        """The env state as numpy arrays: torch tensors leave an AsyncVectorEnv worker through torch's
        shared-memory hand-off (a socket round trip per tensor), which made replays ~2x slower."""
        from mani_skill.utils import common

        return common.to_numpy(self.env.unwrapped.get_state_dict())


class _DoneFromInfo(SubEnvAccess, gym.vector.VectorWrapper):
    """Puts the sub-envs' true terminated/truncated flags (see `_DoneInInfo`) back for the recorder."""

    def step(self, actions: Any):
        obs, rew, _, _, info = self.env.step(actions)
        info = dict(info)
        terminated, truncated = info.pop(_TERMINATED), info.pop(_TRUNCATED)
        info.pop("_" + _TERMINATED, None)
        info.pop("_" + _TRUNCATED, None)
        return obs, rew, terminated, truncated, info


def make_replay_env(env_id: str, env_kwargs: dict[str, Any], max_episode_steps: int | None, num_envs: int = 1,
                    cpu_wrapper: bool = True) -> gym.Env:
    """One replay env: ``gym.make`` -> `ReplayStates` (-> ``CPUGymWrapper`` -> `_DoneInInfo` for a vector env)."""
    import mani_skill.envs  # noqa: F401 - registers the tasks
    from mani_skill.utils.wrappers import CPUGymWrapper
    from mani_skill.utils.wrappers.flatten import FlattenActionSpaceWrapper

    from fastrecord.system import use_lavapipe_if_no_gpu

    use_lavapipe_if_no_gpu()  # worker processes too
    env = gym.make(env_id, num_envs=num_envs, max_episode_steps=max_episode_steps, **env_kwargs)
    if isinstance(env.action_space, gym.spaces.Dict):  # multi-agent: recorded as flat vectors (as ManiSkill's replay)
        env = FlattenActionSpaceWrapper(env)
    env = ReplayStates(env)
    return _DoneInInfo(CPUGymWrapper(env)) if cpu_wrapper else env


# ---------------------------------------------------------------------------------------------- batches
def _in_worker(thunk) -> gym.Env:
    """An AsyncVectorEnv worker's env: the worker ignores Ctrl-C (a terminal sends it to the whole process
    group), so that the parent can stop the replay and still step and close its envs."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    freeze_imports()
    return thunk()


class _PreparedSyncVectorEnv(gym.vector.SyncVectorEnv):
    """A SyncVectorEnv of replay envs (one process) whose step first `ReplayStates.prepare`s every env
    (simulate, set the state, submit the renders) and then steps them (read the pictures, observe):
    the renders of all its envs overlap on the GPU instead of each waiting for its own."""

    def step(self, actions: Any):
        for env, action in zip(self.envs, gym.vector.utils.iterate(self.action_space, actions)):
            env.get_wrapper_attr("prepare")(action)
        return super().step(actions)


class _VectorBatch:
    """N CPU envs in a gymnasium vector env (autoreset disabled), recorded by fastrecord from outside."""

    def __init__(self, thunk, num_envs: int, asynchronous: bool, rec_kwargs: dict[str, Any]) -> None:
        from fastrecord.record import RecordEpisode

        mode = gym.vector.AutoresetMode.DISABLED
        if asynchronous:
            thunk = functools.partial(_in_worker, thunk)
            forkserver_context()  # its sub-envs start with ManiSkill imported
            envs = gym.vector.AsyncVectorEnv([thunk] * num_envs, context="forkserver", autoreset_mode=mode)
        else:
            envs = _PreparedSyncVectorEnv([thunk] * num_envs, autoreset_mode=mode)
        self.envs = envs
        self.num_envs = num_envs
        try:
            self.control_freq = envs.get_attr("control_freq")[0]
            self.action_shape = envs.single_action_space.shape
            self.env = RecordEpisode(_DoneFromInfo(envs), **rec_kwargs(self.control_freq))
        except BaseException:
            envs.close()
            raise
        self.recorder = self.env.recorder
        self._started = False

    def start(self, env_idx: np.ndarray, plans: list[dict[str, Any]]) -> None:
        values: list[Any] = [None] * self.num_envs
        seeds: list[int | None] = [None] * self.num_envs
        for e, p in zip(env_idx, plans):
            values[e], seeds[e] = p, int(p["seed"])
        self.envs.set_attr("replay_plan", values)
        mask = np.zeros(self.num_envs, dtype=bool)
        mask[env_idx] = True
        options = None if (not self._started and mask.all()) else {"reset_mask": mask}
        self.env.reset(seed=seeds, options=options)
        self._started = True

    def step(self, actions: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
        """Step every env: (success per env or None if the env reports none, truncated per env)."""
        _, _, _, truncated, info = self.env.step(actions)
        truncated = np.asarray(truncated, dtype=bool).reshape(self.num_envs)
        if "success" not in info:
            return None, truncated
        return np.asarray(info["success"], dtype=bool).reshape(self.num_envs), truncated

    def flush(self, e: int) -> None:
        self.env.flush_trajectory(env_idxs_to_flush=[e])

    def close(self) -> None:
        self.env.close()


class _BatchedEnv:
    """N envs in one ManiSkill env (GPU simulation; on the CPU N = 1), recorded by fastrecord."""

    def __init__(self, env: gym.Env, rec_kwargs) -> None:
        from fastrecord.record import RecordEpisode

        base = env.unwrapped
        self.num_envs = base.num_envs
        self.device = torch.device(base.device)
        self.control_freq = base.control_freq
        self.action_shape = base.single_action_space.shape
        self.replay: ReplayStates = env
        try:
            self.env = RecordEpisode(env, **rec_kwargs(self.control_freq))
        except BaseException:
            env.close()
            raise
        self.recorder = self.env.recorder
        self._started = False

    def start(self, env_idx: np.ndarray, plans: list[dict[str, Any]]) -> None:
        self.replay.load(env_idx, plans)
        seeds = [int(p["seed"]) for p in plans]
        if not self._started and len(env_idx) == self.num_envs:
            self.env.reset(seed=seeds if self.num_envs > 1 else seeds[0])
        else:
            self.env.reset(seed=seeds, options={"env_idx": torch.as_tensor(env_idx, device=self.device)})
        self._started = True

    def step(self, actions: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
        """Step every env: (success per env or None if the env reports none, truncated per env)."""
        _, _, _, truncated, info = self.env.step(torch.as_tensor(actions, device=self.device))
        truncated = np.asarray(torch.as_tensor(truncated).cpu(), dtype=bool).reshape(self.num_envs)
        if "success" not in info:
            return None, truncated
        s = info["success"]
        return (s.cpu().numpy() if isinstance(s, torch.Tensor) else np.asarray(s)).astype(bool).reshape(self.num_envs), truncated

    def flush(self, e: int) -> None:
        self.env.flush_trajectory(env_idxs_to_flush=[e])

    def close(self) -> None:
        self.env.close()


# ---------------------------------------------------------------------------------------------- run
def _cuda() -> bool:
    return torch.cuda.is_available()


def _resolve_backend(cfg: ReplayConfig, recorded: str | None) -> str:
    if cfg.sim_backend != "auto":
        return cfg.sim_backend
    if recorded is None or recorded in CPU_BACKENDS or recorded == "auto":
        return "physx_cpu"
    return recorded if _cuda() else "physx_cpu"


def _camera_configs(cfg: ReplayConfig, kwargs: dict[str, Any]) -> None:
    """Apply --width/--height/--shader to the camera the videos come from."""
    settings = {k: v for k, v in (("width", cfg.width), ("height", cfg.height), ("shader_pack", cfg.shader)) if v is not None}
    if not settings:
        return
    if cfg.video_source == "render":
        kwargs["human_render_camera_configs"] = {**(kwargs.get("human_render_camera_configs") or {}), **settings}
    else:
        cam = cfg.video_source.split(":", 1)[1]
        sensors = dict(kwargs.get("sensor_configs") or {})
        sensors[cam] = {**(sensors.get(cam) or {}), **settings}
        kwargs["sensor_configs"] = sensors


def run_replay(cfg: ReplayConfig, stop: StopSignals | None = None, sinks: list[Any] | None = None) -> ReplaySummary:
    """Replay ``cfg.traj_path`` and record the replays; see the module docstring.

    With ``stop`` (the CLI's), a SIGINT/SIGTERM ends the replay between two steps: the replays in
    progress are saved as far as they got, the env is closed and the summary says so. With more than
    one worker (``cfg.workers``), worker processes replay a share of the episodes each and the shards
    are merged at the end (see `_run_workers`)."""
    t0 = time.perf_counter()
    from fastrecord.sinks.base import OutputExistsError
    from fastrecord.system import process_age

    age = process_age()
    traj = open_trajectory(cfg.traj_path)
    try:
        plan = _plan(cfg, traj)
        if plan.distributed:
            summary = _run_rank(plan, stop, sinks, t0)
        elif plan.workers > 1:
            summary = _run_workers(plan, stop, sinks, t0)
        else:
            summary = _run_plan(plan, plan.episodes, plan.out, plan.name, plan.num_envs, stop, sinks, t0)
        summary.process_age = age
        return summary
    except OutputExistsError as e:
        raise OutputExistsError(f"{e} (fastrecord replay: --overwrite replaces that replay's files, --resume "
                                f"continues it)") from None
    finally:
        traj.close()


@dataclass
class _Plan:
    """What a replay decided before making any env or file: the same in the caller and in every worker."""

    cfg: ReplayConfig
    traj: TrajectoryFile
    episodes: list[dict[str, Any]]  # the input episodes to replay (the first --count)
    env_id: str
    kwargs: dict[str, Any]  # gym.make kwargs of the replay env
    ori_kwargs: dict[str, Any]  # the env the actions were recorded in (conversion: ManiSkill's ori_env)
    max_steps: int | None
    sim_backend: str
    gpu_sim: bool
    source_mode: str | None  # the recorded control mode
    convert: bool  # -c to another control mode
    out: Path  # output directory
    name: str  # output trajectory name
    num_envs: int  # episodes side by side, over all workers
    vector: str  # sync | async | batched
    workers: int  # processes replaying a share each (1: this one)
    distributed: bool = False  # a torchrun rank: the ranks are the workers (fastrecord.shards)

    @property
    def if_exists(self) -> str:
        if self.cfg.resume:
            return "resume"
        return "overwrite" if (self.cfg.overwrite or self.cfg.maniskill) else "error"

    def recorder_kwargs(self, out: Path, name: str, verdict: _Verdict, sinks: list[Any] | None, resume: bool = False):
        """``control_freq -> RecordEpisode kwargs`` of one recorder writing ``out/name`` (``resume``: add to
        what an earlier replay of that name left)."""
        cfg, keep = self.cfg, self.cfg.keep_filter
        if_exists = "resume" if resume else self.if_exists
        how = (f"converted from {self.source_mode} to {cfg.target_control_mode}" if self.convert
               else f"by {'env states' if cfg.replay_by == 'states' else 'actions'}")

        def rec_kwargs(control_freq: int) -> dict[str, Any]:
            return dict(
                output_dir=str(out), save_trajectory=cfg.save_trajectory, trajectory_name=name, save_video=cfg.save_video,
                save_on_reset=False, video_fps=cfg.video_fps or int(control_freq), keep=keep if keep is not None else verdict,
                video_source=cfg.video_source, video_codec=cfg.video_codec,
                record_reward=cfg.record_rewards if cfg.record_rewards is not None else not cfg.maniskill,
                if_exists=if_exists, source_type="fastrecord-replay",
                source_desc=f"fastrecord replay of {self.traj.h5_path.name} {how}",
                sinks=list(sinks or []),  # --log: logger sinks (fastrecord.sinks.loggers); one recorder per replay
            )

        return rec_kwargs


def _plan(cfg: ReplayConfig, traj: TrajectoryFile) -> _Plan:
    """Check the input and the options and decide the env, the output and the layout; raises ValueError."""
    import mani_skill.envs  # noqa: F401 - registers the tasks

    info = traj.env_info
    env_id = info["env_id"]
    if env_id not in gym.registry:
        raise ValueError(f"{traj.json_path.name} was recorded in {env_id!r}, which is not a registered ManiSkill task here; "
                         f"import the module that registers it, or check the ManiSkill version")
    episodes = traj.episodes[: cfg.count]
    if not episodes:
        raise ValueError(f"{str(traj.json_path)!r} lists no episodes: nothing to replay")
    modes = sorted({ep.get("control_mode") for ep in episodes if ep.get("control_mode")})
    if len(modes) > 1:
        raise ValueError(f"{traj.json_path.name} mixes control modes {modes}; replay them separately (--count, or split the file)")
    by = cfg.replay_by
    if by == "states" or cfg.use_first_env_state:
        lacking = [ep["episode_id"] for ep in episodes if "env_states" not in traj.group(ep)]
        if lacking:
            raise ValueError(f"{str(traj.h5_path)!r} holds no env_states for episodes {lacking[:5]}; replay it by actions (--by actions)")

    # the env: the recorded kwargs, then the replay's choices
    kwargs = {k: v for k, v in (info.get("env_kwargs") or {}).items() if k not in ("num_envs", "max_episode_steps")}
    recorded_backend = kwargs.pop("sim_backend", None)
    sim_backend = _resolve_backend(cfg, recorded_backend)
    gpu_sim = sim_backend not in CPU_BACKENDS
    if gpu_sim and not _cuda():
        raise ValueError(f"sim_backend={sim_backend!r} needs a CUDA GPU, and there is none; use --sim-backend physx_cpu")
    kwargs["sim_backend"] = sim_backend
    kwargs["render_backend"] = cfg.render_backend if cfg.render_backend != "auto" else ("gpu" if _cuda() else "cpu")
    if modes and "control_mode" not in kwargs:
        kwargs["control_mode"] = modes[0]
    source_mode = kwargs.get("control_mode")
    convert = cfg.target_control_mode is not None and cfg.target_control_mode != source_mode
    if convert:
        _check_conversion(cfg, source_mode, by, gpu_sim)
    ori_kwargs = dict(kwargs)
    if cfg.target_control_mode is not None:
        kwargs["control_mode"] = cfg.target_control_mode
    if cfg.obs_mode is not None:
        kwargs["obs_mode"] = cfg.obs_mode
    if cfg.reward_mode is not None:
        kwargs["reward_mode"] = cfg.reward_mode
    kwargs["render_mode"] = cfg.render_mode
    if cfg.maniskill and cfg.shader is not None:
        kwargs["shader_dir"] = cfg.shader  # ManiSkill's --shader: every camera
    else:
        _camera_configs(cfg, kwargs)
    kwargs.update(cfg.env_kwargs)
    if cfg.video_source.startswith("sensor:") and cfg.save_video and kwargs.get("obs_mode", "state") in ("state", "state_dict", "none"):
        raise ValueError(f"video_source={cfg.video_source!r} takes frames from the observation's camera images; "
                         f"add --obs-mode rgb (or rgbd), or use --video-source render")
    longest = max(int(ep["elapsed_steps"]) for ep in episodes)
    max_steps = max(int(info.get("max_episode_steps") or 0), longest) or None

    # where it goes: ManiSkill's name, <stem>.<obs_mode>.<control_mode>.<sim_backend>
    obs_mode = kwargs.get("obs_mode") or "state"
    stem = traj.h5_path.stem.split(".")[0]
    name = cfg.trajectory_name or f"{stem}.{obs_mode}.{kwargs.get('control_mode', 'default')}.{sim_backend}"
    if cfg.output_dir is not None:
        out = Path(cfg.output_dir)
    else:  # ManiSkill's tool writes next to its input
        out = traj.h5_path.parent if cfg.maniskill else traj.h5_path.parent / "replay"
    new_h5 = out / f"{name}.h5"
    if new_h5.exists() and new_h5.resolve() == traj.h5_path.resolve():
        raise ValueError(f"the replay would write over its input {str(traj.h5_path)!r}; pass another --output-dir or --trajectory-name")

    from fastrecord.shards import rank_info

    info = rank_info()
    if info.distributed and cfg.workers not in (None, 1):
        raise ValueError(f"--workers {cfg.workers} under torchrun: the {info.world_size} ranks are the workers (each "
                         f"replays its share); drop --workers, or run without torchrun")
    vector = cfg.vector
    cores = max(1, (os.cpu_count() or 1) // info.local_world_size)  # under torchrun the ranks of a host share its cores
    gpu_render = str(kwargs.get("render_backend")).lower() not in ("cpu", "sapien_cpu")
    workers = (1 if info.distributed else cfg.workers if cfg.workers is not None
               else default_workers(cfg, len(episodes), gpu_sim, gpu_render))
    workers = min(workers, len(episodes))
    if cfg.num_envs is not None:
        n = cfg.num_envs
        if n < workers:
            raise ValueError(f"--workers {workers} with --num-envs {n}: each worker replays in envs of its own, so the "
                             f"workers share the {n} envs; pass --num-envs {workers} or more, or --workers {n} or fewer")
    elif gpu_sim:
        n = GPU_DEFAULT_ENVS * workers
    else:  # CPU: one env per core (ManiSkill's tool: one), or the one env a CPU ManiSkill env holds
        n = workers if (vector == "batched" or cfg.maniskill) else max(cores, workers)
    n = min(n, len(episodes))
    if workers == 1 and not info.distributed and cfg.resume:
        from fastrecord.shards import list_shards

        if list_shards(out, name):  # its NAME.h5 only links into the shards: one process would resume the links
            raise ValueError(f"{str(out / name)}.h5 is a sharded replay (its episodes are in {name}.shards/): resume it with "
                             f"--workers 2 or more (or under torchrun), or pass --overwrite")
    per_worker = -(-n // workers)  # the largest share
    if vector == "auto":
        # CPU envs: up to ENVS_PER_WORKER in this process, their renders submitted together (on 2 cores: one
        # process holding 2 envs 36-38 s, the 2 in sub-processes 46 s); more in sub-processes, one each (on the
        # H200 machine, 16 envs: 34.9 s in sub-processes, 39.2 s in one process)
        vector = "batched" if gpu_sim else ("async" if per_worker > ENVS_PER_WORKER else "sync")
    if vector == "batched" and per_worker > 1 and by == "actions" and not cfg.use_first_env_state:
        raise ValueError("replaying by actions side by side in one GPU-parallel env cannot reproduce the seeded starts "
                         "(ManiSkill seeds partial resets for the whole batch only); add --use-first-env-state")
    if vector == "batched" and not gpu_sim and per_worker > 1:
        raise ValueError(f"vector='batched' runs {per_worker} envs in one ManiSkill env, which needs GPU simulation; on the "
                         f"CPU use vector='async' or 'sync' (or num_envs=1)")
    if vector in ("sync", "async") and gpu_sim and not convert:
        raise ValueError(f"vector={vector!r} makes a vector env of CPU envs; with sim_backend={sim_backend!r} use vector='batched'")
    plan = _Plan(cfg, traj, episodes, env_id, kwargs, ori_kwargs, max_steps, sim_backend, gpu_sim, source_mode, convert,
                 out, name, n, vector, workers, info.distributed)

    from fastrecord.options import RecordOptions

    rec = plan.recorder_kwargs(out, name, _Verdict(), None)(20)
    RecordOptions(**{k: v for k, v in rec.items() if k not in ("output_dir", "sinks")})  # bad values: before any env or file
    return plan


def _run_plan(plan: _Plan, episodes: list[dict[str, Any]], out: Path, name: str, n: int, stop: StopSignals | None,
              sinks: list[Any] | None, t0: float, progress: Callable[[int], None] | None = None,
              shard: tuple[int, list[int], bool] | None = None) -> ReplaySummary:
    """Replay ``episodes`` (of ``plan.episodes``) in ``n`` envs into ``out/name``: the whole replay, or a
    shard's (``shard``: its rank, the global index of each episode, whether the sharded run resumes). With
    ``--resume``, or in a shard,
    the episodes the output already holds (also in complete parts a crash left) are not replayed again."""
    cfg = plan.cfg
    if shard is not None:
        from fastrecord import shards

        tags = {int(ep["episode_id"]): shards.episode_meta(g, shard[0]) for ep, g in zip(episodes, shard[1])}
    else:
        tags = {}
    done = _replayed_sources(out, name) if (cfg.resume or shard is not None) else set()
    todo = [ep for ep in episodes if int(ep["episode_id"]) not in done]
    skipped = len(episodes) - len(todo)
    if not todo:  # a resumed replay that is complete: nothing to make or write
        return ReplaySummary(0, 0, 0, [], 0, 0.0, out, [], startup_seconds=time.perf_counter() - t0, skipped=skipped)
    n = min(n, len(todo))
    verdict = _Verdict()  # ManiSkill's rule, decided per replay by the loop that ends it
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
            batch: _VectorBatch | _BatchedEnv = _BatchedEnv(env, rec_kwargs)
        else:
            thunk = functools.partial(make_replay_env, plan.env_id, plan.kwargs, plan.max_steps)
            batch = _VectorBatch(thunk, n, plan.vector == "async" and n > 1, rec_kwargs)
        summary = _drive(cfg, plan.traj, todo, batch, verdict, stop, t0, progress, meta, save_partial=shard is None)
    summary.skipped = skipped
    summary.output_dir = out
    new_h5 = out / f"{name}.h5"
    if cfg.save_trajectory and new_h5.with_suffix(".json").exists():  # absent when interrupted before any episode
        summary.files = [new_h5, new_h5.with_suffix(".json")] + summary.files
    summary.files.append(summary.results_path)
    return summary


class _Verdict:
    """A keep filter whose answer the replay loop sets just before it ends a replay (ManiSkill's rule
    needs the replay's success and truncation, decided outside the recorder)."""

    value = False

    def __call__(self, final_info: Any) -> bool:
        return self.value


def _check_conversion(cfg: ReplayConfig, source: str | None, by: str, gpu_sim: bool) -> None:
    """Refuse what ManiSkill's tool cannot convert, with its reasons, before anything is made."""
    if by == "states":
        raise ValueError("cannot replay by env states (--use-env-states / --by states) while converting to another control "
                         "mode: the converted actions take a different number of steps to reach the same states; drop one")
    if gpu_sim:
        raise ValueError("control mode conversion (-c) runs in a CPU env, as in ManiSkill's tool; pass -b physx_cpu")
    if source not in CONVERTERS:
        raise ValueError(f"ManiSkill's conversion code converts from {' or '.join(CONVERTERS)}, not from {source!r} "
                         f"(to {cfg.target_control_mode!r}); replay without -c, or record in pd_joint_pos")


def _convert(cfg: ReplayConfig, traj: TrajectoryFile, episodes: list[dict], env_id: str, kwargs: dict[str, Any],
             ori_kwargs: dict[str, Any], max_steps: int | None, rec_kwargs: Any, verdict: _Verdict,
             stop: StopSignals | None, t0: float, progress: Callable[[int], None] | None = None,
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
    bar = tqdm(total=len(episodes), unit="episode", disable=not cfg.progress or progress is not None, dynamic_ncols=True,
               desc="convert")
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
                    first = _tree_stack([_tree_index(traj.env_states(ep), 0)], torch.device(target.unwrapped.device))
                    ori_env.unwrapped.set_state_dict(first)
                    options["reset_to_env_states"] = {"env_states": first}  # recorded as the episode's first state
                env.reset(seed=reset_kwargs["seed"], options=options)
                info = converter(cfg.target_control_mode, ori_actions, ori_env, env, render=False, pbar=None, verbose=cfg.verbose)
                env_steps += int(np.asarray(target.unwrapped.elapsed_steps).reshape(-1)[0])
                replayed = bool(np.asarray(torch.as_tensor(info["success"]).cpu()).reshape(-1)[0]) if "success" in info else None
                truncated = max_steps is not None and int(np.asarray(target.unwrapped.elapsed_steps).reshape(-1)[0]) >= max_steps
                ok = cfg.maniskill_keeps(replayed, truncated)
                last = ok or attempt == cfg.max_retry
                verdict.value = ok
                before = rec.num_episodes
                rec.set_episode_meta([0], [meta(ep) if meta is not None else {"source_episode_id": int(ep["episode_id"])}])
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
            env.close()
        finally:
            ori_env.close()
    return ReplaySummary(done, rec.num_episodes, successes, diverged, env_steps, time.perf_counter() - t_run, Path("."),
                         sorted(rec.video_paths), sources, stop.name if stopping() else None, 0,
                         startup_seconds=startup, results=list(rec.results.rows), results_path=rec.results.path,
                         converted=True)


def _drive(cfg: ReplayConfig, traj: TrajectoryFile, episodes: list[dict], batch: _VectorBatch | _BatchedEnv,
           verdict: _Verdict, stop: StopSignals | None = None, t0: float | None = None,
           progress: Callable[[int], None] | None = None, meta: Callable[[Mapping[str, Any]], dict] | None = None,
           save_partial: bool = True) -> ReplaySummary:
    """Keep every env busy: when an env's episode ends, flush it and start the next pending one there
    (ManiSkill's --max-retry: the same episode again, while it fails and retries are left).

    A ``stop`` request ends the loop between two steps; the replays in progress are then flushed as
    far as they got (partial episodes, named in the summary)."""
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

    def flush(e: int, partial: bool = False) -> None:
        before = rec.num_episodes
        ep = episodes[slot[e]]
        tag = meta(ep) if meta is not None else {"source_episode_id": int(ep["episode_id"])}
        rec.set_episode_meta([e], [tag | {"partial": True} if partial else tag])  # --resume replays a partial one again
        batch.flush(e)
        if rec.num_episodes > before:
            sources.append(int(episodes[slot[e]]["episode_id"]))
        slot[e] = None

    def plan(i: int) -> dict[str, Any]:
        ep = episodes[i]
        a = traj.actions(ep)
        if a.ndim != 2 or a.shape[1:] != tuple(batch.action_shape):
            raise ValueError(f"{traj.h5_path.name} traj_{ep['episode_id']}/actions has shape {a.shape}, but the env takes "
                             f"actions of shape {tuple(batch.action_shape)}; was it recorded with another control mode or robot?")
        states = traj.env_states(ep) if (per_step or cfg.use_first_env_state) else None
        opts = (ep.get("reset_kwargs") or {}).get("options") or {}
        return dict(seed=int(ep["episode_seed"]), options=opts, states=states, per_step=per_step, length=len(a), actions=a)

    def start(envs: list[int]) -> None:
        plans = []
        for e in envs:
            i = pending.popleft()
            p = plan(i)
            slot[e], actions[e], t[e], length[e] = i, p.pop("actions"), 0, p["length"]
            plans.append(p)
        batch.start(np.asarray(envs), plans)

    bar = tqdm(total=len(episodes), unit="episode", disable=not cfg.progress or progress is not None, dynamic_ncols=True,
               desc="replay")
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
        if stopping():  # save the replays in progress as far as they got (a shard does not: re-running resumes them)
            for e in range(n):
                if slot[e] is not None:
                    cut += 1
                    if t[e] > 0 and save_partial:
                        partial += 1
                        replayed = None if success is None else bool(success[e])
                        verdict.value = cfg.maniskill_keeps(replayed, bool(truncated[e]))
                        flush(e, partial=True)
        rec.wait_until_done()
    finally:
        bar.close()
        batch.close()
    return ReplaySummary(done_count, rec.num_episodes, successes, diverged, env_steps, time.perf_counter() - t_run,
                         Path("."), sorted(rec.video_paths), sources, stop.name if stopping() else None, partial,
                         startup_seconds=startup, results=list(rec.results.rows), results_path=rec.results.path)


# ---------------------------------------------------------------------------------------------- workers
def default_workers(cfg: ReplayConfig, episodes: int, gpu_sim: bool, gpu_render: bool = False) -> int:
    """``--workers`` when it is not given.

    CPU simulation on a machine of ``MANY_CORES`` cores or more: the envs (``--num-envs``, by default one
    per core) split into workers of ``ENVS_PER_WORKER`` envs where they render on a GPU, else one env
    per worker; at most one worker per core and one per episode. Each worker steps, renders and records
    its envs in its own process, and no observation crosses a process boundary before the HDF5 writer.
    Measured on the H200 machine (16 cores, 96 PickCube episodes, 16 envs, 2026-12-03): 4 workers of 4
    envs 21.7-26.0 s, 8 of 2 21.9-23.0 s, 16 of 1 26.1 s, 2 of 8 25.3 s, one process 34.9-39.2 s; fewer
    processes also start their envs sooner (16 processes making envs together: 6-10 s; 4: 3 s). On the
    CPU (lavapipe renders each env with the cores it finds) one env per worker. Fewer cores (where every
    process competes for the same one or two), GPU simulation (one batched env already runs every env in
    one process, on one GPU) or under torchrun (the ranks are the workers): one process.
    """
    cores = os.cpu_count() or 1
    if gpu_sim or cores < MANY_CORES:
        return 1
    per_worker = ENVS_PER_WORKER if gpu_render else 1
    return max(1, min(-(-(cfg.num_envs or cores) // per_worker), cores, episodes))


def _replayed_sources(out: Path, name: str) -> set[int]:
    """Input episode ids (``source_episode_id``) that an earlier replay into ``out/name`` finished: its
    JSON's entries, the complete part files a crash left unlisted, and the replays the keep filter did
    not keep (their results rows; replaying them again would drop them again). Partial replays (cut by
    a signal) do not count. Reads only."""
    from fastrecord.sinks.maniskill_h5 import EPISODES_ATTR, _complete_parts, _read_json, _sibling_paths
    from fastrecord.sinks.results import read_results

    json_path, parts_dir = _sibling_paths(out / f"{name}.h5")
    entries = list((_read_json(json_path) or {}).get("episodes") or [])
    for _, part in _complete_parts(parts_dir):
        try:
            with h5py.File(part, "r") as f:
                entries += json.loads(f.attrs.get(EPISODES_ATTR, "[]"))
        except (OSError, ValueError):  # unreadable: its episodes are replayed again
            continue
    results = out / f"{name}.results.jsonl"
    if results.exists():
        entries += [r for r in read_results(results) if r.get("episode_id") is None]
    return {int(e["source_episode_id"]) for e in entries
            if isinstance(e, dict) and "source_episode_id" in e and not e.get("partial")}


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


def _shares(plan: _Plan, world: int, num_envs: int, done: set[int], resume: bool) -> list[_Share]:
    """Each rank's global episodes (`fastrecord.shards`: ``g % world``) minus ``done`` (input episode ids
    some shard holds), its envs (``num_envs`` split as evenly as possible) and its shard folder."""
    from fastrecord import shards

    total = len(plan.episodes)
    out = []
    for rank in range(world):
        mine = [g for g in shards.episodes_of(rank, world, total) if int(plan.episodes[g]["episode_id"]) not in done]
        envs = max(1, min(num_envs // world + (rank < num_envs % world), len(mine)))
        out.append(_Share(rank, world, mine, envs, shards.shard_dir(plan.out, plan.name, rank), resume))
    return out


def _sharded_done(plan: _Plan) -> set[int]:
    """Input episode ids that any shard folder of ``plan.name`` holds (also of an earlier world size)."""
    from fastrecord import shards

    done: set[int] = set()
    for folder in shards.list_shards(plan.out, plan.name).values():
        done |= _replayed_sources(folder, plan.name)
    return done


def _run_share(plan: _Plan, share: _Share, stop: StopSignals | None, t0: float,
               progress: Callable[[int], None] | None) -> ReplaySummary:
    """Replay one share into its shard (a worker process, or a torchrun rank)."""
    mine = [plan.episodes[g] for g in share.indices]
    return _run_plan(plan, mine, share.out, plan.name, share.num_envs, stop, None, t0, progress,
                     shard=(share.rank, share.indices, share.resume))


def _worker_main(cfg: ReplayConfig, share: _Share, t0: float, messages: Any, parent: int) -> None:
    """A replay worker process (forked by the forkserver): the replay's own code path on its share; reports
    on ``messages``."""
    import traceback

    entered = time.perf_counter() - t0  # perf_counter is the system's monotonic clock: the caller's t0 holds here

    from tqdm import tqdm

    from fastrecord.commands.cli import quiet_third_party

    quiet_third_party()
    freeze_imports()  # ManiSkill's gc.collect() at env creation and close then skips the imported modules
    # tqdm's default lock is a multiprocessing RLock: here a named semaphore of the forkserver's kind, which
    # the resource tracker reported leaked at exit ("1 leaked semaphore"); the caller draws the progress bar
    tqdm.set_lock(threading.RLock())
    with _WorkerStop(parent) as stop:
        try:
            traj = open_trajectory(cfg.traj_path)
            try:
                plan = _plan(dataclasses.replace(cfg, workers=1, num_envs=share.num_envs), traj)
                s = _run_share(plan, share, stop, t0, lambda k: messages.put(("progress", share.rank, k)))
            finally:
                traj.close()
        except BaseException as e:  # noqa: BLE001 - reported to the caller, which raises it
            messages.put(("error", share.rank, type(e).__name__, str(e), isinstance(e, ValueError), traceback.format_exc()))
            messages.close()
            messages.join_thread()
            raise SystemExit(1) from None
    s.worker_times = [(entered, s.startup_seconds, s.startup_seconds + s.seconds)]
    messages.put(("done", share.rank, s))
    messages.close()
    messages.join_thread()


class ReplayWorkerError(RuntimeError):
    """A replay worker process failed or died; the message names the worker, its share and the cause."""


def _claim_sharded(plan: _Plan, world: int):
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
            raise ValueError(f"{str(plan.out)!r} holds a replay named {plan.name!r} that was not sharded; resume it with "
                             f"--workers 1 --resume, or pass --overwrite, another --trajectory-name or --output-dir")
        run.add_file(shards.shards_root(plan.out, plan.name))
        run.add_file(plan.out / f"{plan.name}.h5")
        run.add_file(plan.out / f"{plan.name}.json")
    except BaseException:
        run.close(status="failed") if run.resuming else run.abandon()
        raise
    return run, run.resuming


def _run_workers(plan: _Plan, stop: StopSignals | None, sinks: list[Any] | None, t0: float) -> ReplaySummary:
    """Split the episodes over ``plan.workers`` processes (forked by `fastrecord.workers.forkserver_context`),
    each with its own envs and recorder writing its own shard (`fastrecord.shards`:
    ``DIR/NAME.shards/rankNNNNN/``), then merge the shards
    into ``NAME.h5`` + ``NAME.json`` (`fastrecord.shards.merge`: episode ``g`` of the input is ``traj_g``).

    Progress and results are gathered here. A worker's exception or death (a signal, the OOM killer)
    does not stop the others: their shards are merged, the merge names the missing episodes, and then
    a `ReplayWorkerError` (a ValueError where every worker refused a bad option or file) names the
    worker and the cause; running the same command again replays only what is missing. A SIGINT or
    SIGTERM of this process reaches each worker as one SIGTERM: they stop between two steps (the
    replays in progress are not saved: re-running resumes them) and the shards are merged."""
    import queue as queue_mod

    from tqdm import tqdm

    cfg, world = plan.cfg, plan.workers
    if sinks:
        raise ValueError(f"--log with --workers {world}: a logger takes the replays of one process; pass --workers 1")
    run, resuming = _claim_sharded(plan, world)
    failures: dict[int, str] = {}
    value_errors: dict[int, str] = {}
    summaries: dict[int, ReplaySummary] = {}
    try:
        shares = _shares(plan, world, plan.num_envs, _sharded_done(plan) if resuming else set(), resuming)
        busy = [s for s in shares if s.indices]
        ctx = forkserver_context()  # forked from a clean server that imported ManiSkill once: no CUDA context, threads or locks copied
        messages = ctx.Queue()
        procs = {s.rank: ctx.Process(target=_worker_main, args=(cfg, s, t0, messages, os.getpid()),
                                     name=f"fastrecord-replay-{s.rank}") for s in busy}
        for p in procs.values():
            p.start()
        exited: dict[int, float] = {}
        forwarded = False
        bar = tqdm(total=sum(len(s.indices) for s in busy), unit="episode", disable=not cfg.progress, dynamic_ncols=True,
                   desc=f"replay, {world} workers")
        try:
            while len(summaries) + len(failures) < len(busy):
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
                        if p.exitcode is not None and r not in summaries and r not in failures:
                            if now - exited.setdefault(r, now) > 2.0:  # its last message would have arrived by now
                                failures[r] = f"{_exit_text(p.exitcode)} without a report"
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
        finally:  # normally every worker has reported; after an exception here, stop them as for a signal
            bar.close()
            for p in procs.values():
                if p.exitcode is None and not forwarded:
                    os.kill(p.pid, signal.SIGTERM)
            for p in procs.values():
                p.join(timeout=120)
                if p.exitcode is None:
                    p.kill()
                    p.join()
            messages.close()
        if value_errors and len(value_errors) == len(failures) == len(busy):  # a bad option or file: every worker refused it
            raise ValueError(value_errors[min(value_errors)])
        m0 = time.perf_counter()
        report = _join(plan)
        merge_seconds = time.perf_counter() - m0
        summary = _summarize(plan, [summaries[r] for r in sorted(summaries)], report, stop, t0,
                             scheduled=sum(len(s.indices) for s in shares))
        summary.merge_seconds = merge_seconds
    except BaseException:
        run.close(status="failed")
        raise
    interrupted = stop is not None and stop.requested
    run.close(status="failed" if (failures or summary.missing or interrupted) else "closed")
    if failures:
        first = min(failures)
        share = shares[first]
        others = f" (and worker(s) {sorted(set(failures) - {first})})" if len(failures) > 1 else ""
        missing = (f"; {len(summary.missing)} of {len(plan.episodes)} episodes are missing from {plan.out / plan.name}.h5 "
                   f"(global indices {_ranges(summary.missing)})" if summary.missing else "")
        raise ReplayWorkerError(
            f"replay worker {first} of {world} ({len(share.indices)} episodes, shard {share.out}) {failures[first]}{others}"
            f"{missing}. The other workers' episodes are kept: run the same command again to replay only the missing "
            f"ones")
    return summary


def _join(plan: _Plan) -> Any:
    """Join the shards into ``NAME.h5`` + ``NAME.json`` (`fastrecord.shards.merge`); its `MergeReport`, or
    None when no shard has a trajectory to join (no trajectory written, or stopped before any episode)."""
    from fastrecord import shards

    if not plan.cfg.save_trajectory:
        return None
    try:
        return shards.merge(plan.out, plan.name, expected=len(plan.episodes))
    except shards.NothingToMerge:
        return None


def _summarize(plan: _Plan, done: list[ReplaySummary], report: Any, stop: StopSignals | None, t0: float,
               scheduled: int) -> ReplaySummary:
    """The summary of a sharded replay: the workers' (or ranks') summaries summed, the merge's outcome.
    ``scheduled``: episodes the shards were given (the others were on disk already)."""
    total = len(plan.episodes)
    startup = max((s.startup_seconds for s in done), default=time.perf_counter() - t0)
    files: list[Path] = []
    sources: list[int] = []
    missing: list[int] = []
    if report is not None:
        meta = json.loads(report.json_path.read_text())
        sources = [int(e["source_episode_id"]) for e in meta["episodes"]]
        missing = list(report.missing)
        files = [report.h5_path, report.json_path]
    elif plan.cfg.save_trajectory:
        missing = list(range(total))
    for s in done:
        files += [f for f in s.files if f.suffix == ".mp4"]
    files += [s.results_path for s in done if s.results_path is not None]
    interrupted = stop.name if stop is not None and stop.requested else next((s.interrupted for s in done if s.interrupted), None)
    return ReplaySummary(
        episodes=sum(s.episodes for s in done), kept=sum(s.kept for s in done), successes=sum(s.successes for s in done),
        diverged=sorted((d for s in done for d in s.diverged), key=lambda d: d.episode_id),
        env_steps=sum(s.env_steps for s in done), seconds=time.perf_counter() - t0 - startup, output_dir=plan.out,
        files=files, source_episode_ids=sources, interrupted=interrupted, partial=0, startup_seconds=startup,
        results=[r for s in done for r in s.results], results_path=None, converted=any(s.converted for s in done),
        skipped=total - scheduled + sum(s.skipped for s in done), workers=plan.workers, missing=missing,
        worker_times=[w for s in done for w in s.worker_times])


def _run_rank(plan: _Plan, stop: StopSignals | None, sinks: list[Any] | None, t0: float) -> ReplaySummary:
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


def _ranges(ids: list[int]) -> str:
    from fastrecord.shards import _ranges as ranges

    return ranges(ids)


def _exit_text(code: int | None) -> str:
    from fastrecord.workers import exit_description

    return exit_description(code)


# ---------------------------------------------------------------------------------------------- CLI
def configure_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("traj_path", nargs="?", help="the NAME.h5 to replay (NAME.json next to it)")
    p.add_argument("--config", help="YAML preset filling ReplayConfig (see configs/)")
    p.add_argument("--output-dir", help="where the new files go (default: a 'replay' folder next to the input)")
    p.add_argument("--trajectory-name", help="base name of the new .h5/.json (default NAME.<obs>.<control>.<backend>)")
    p.add_argument("--by", choices=BY_CHOICES, help="replay by recorded env states (default) or by actions")
    p.add_argument("--use-first-env-state", action="store_const", const=True, help="--by actions: start from the recorded first state")
    p.add_argument("--count", type=int, help="replay only the first COUNT episodes")
    p.add_argument("--num-envs", type=int, help="episodes replayed side by side (default: one per CPU core)")
    p.add_argument("--vector", choices=VECTOR_CHOICES, help="auto | sync | async (CPU vector env) | batched (GPU sim)")
    p.add_argument("--sim-backend", help="physx_cpu | physx_cuda (default: the file's, CPU where CUDA is absent)")
    p.add_argument("--render-backend", help="auto | cpu | gpu")
    p.add_argument("--obs-mode", help="observation mode of the new trajectory, e.g. rgb, rgbd, pointcloud")
    p.add_argument("--no-video", dest="save_video", action="store_const", const=False, help="write no MP4s")
    p.add_argument("--no-trajectory", dest="save_trajectory", action="store_const", const=False, help="write no .h5/.json")
    p.add_argument("--video-source", help="render (human camera, default) or sensor:<camera>")
    p.add_argument("--width", type=int, help="video camera width")
    p.add_argument("--height", type=int, help="video camera height")
    p.add_argument("--shader", help="shader pack of the video camera: minimal, default, rt, rt-fast")
    p.add_argument("--keep", choices=KEEP_CHOICES, help="which replayed episodes are written (default all)")
    p.add_argument("--video-fps", type=float)
    p.add_argument("--video-codec")
    p.add_argument("--overwrite", action="store_const", const=True,
                   help="replace the output of an earlier replay or recording of this name (never the input)")
    p.add_argument("--resume", action="store_const", const=True,
                   help="continue an earlier replay of this name that was interrupted or lost a worker: the episodes "
                        "it holds are kept and not replayed again")
    p.add_argument("--workers", type=int,
                   help="processes that replay a share of the episodes each, with their own envs and recorder, merged "
                        f"at the end (default on CPU machines of {MANY_CORES}+ cores: one per {ENVS_PER_WORKER} envs rendering "
                        f"on a GPU, one per env rendering on the CPU; else 1)")
    p.add_argument("--quiet", dest="progress", action="store_const", const=False, help="no progress bar")
    p.add_argument("--log", choices=["tensorboard", "wandb"],
                   help="also log each kept replay (success, length, success rate, a few videos) to TensorBoard "
                        "(OUTPUT_DIR/tensorboard/NAME) or W&B (OUTPUT_DIR/wandb); needs pip install fastrecord[loggers]")
    ms = p.add_argument_group(
        "ManiSkill's replay_trajectory flags",
        "the flags of python -m mani_skill.trajectory.replay_trajectory, same meaning; any of them (or -o/-n/-b with "
        "--traj-path) switches to ManiSkill's defaults: by actions, nothing written unless --save-traj/--save-video, "
        "successful replays only, no rewards, one env, output next to the input")
    ms.add_argument("--traj-path", dest="ms_traj_path", help="the NAME.h5 to replay (ManiSkill's spelling of TRAJ_PATH)")
    ms.add_argument("-c", "--target-control-mode", help="convert the actions to this control mode (ManiSkill's conversion code)")
    flag = argparse.BooleanOptionalAction
    ms.add_argument("--save-traj", dest="ms_save_traj", action=flag, help="write the new .h5/.json")
    ms.add_argument("--save-video", dest="ms_save_video", action=flag, help="write videos")
    ms.add_argument("--use-env-states", action=flag, help="replay by env states (fastrecord: --by states)")
    ms.add_argument("--allow-failure", action=flag, help="also write replays that do not end in success")
    ms.add_argument("--discard-timeout", action=flag, help="drop replays truncated by the time limit")
    ms.add_argument("--max-retry", type=int, help="replay a failed episode up to this many more times")
    ms.add_argument("--record-rewards", action=flag, help="write rewards")
    ms.add_argument("--reward-mode", help="the env's reward mode, e.g. sparse, dense, normalized_dense, none")
    ms.add_argument("--render-mode", choices=("rgb_array", "sensors", "all"), help="render mode of the videos")
    ms.add_argument("--verbose", action=flag, help="name each replay that is not kept")
    ms.add_argument("--vis", action=flag, help="not supported: fastrecord replays have no GUI viewer")
    # ManiSkill's short spellings of flags both tools have
    for short, dest in (("-o", "obs_mode"), ("-n", "num_envs"), ("-b", "sim_backend")):
        ms.add_argument(short, dest=f"ms_{dest}", type=int if dest == "num_envs" else str, help=f"--{dest.replace('_', '-')}")


MANISKILL_ONLY = ("ms_traj_path", "target_control_mode", "ms_save_traj", "ms_save_video", "use_env_states", "allow_failure",
                  "discard_timeout", "max_retry", "record_rewards", "reward_mode", "render_mode", "verbose")


def config_from_args(args: argparse.Namespace) -> ReplayConfig:
    """The CLI's `ReplayConfig`: fastrecord's flags, and ManiSkill's with their meaning and defaults."""
    opts = {k: v for k, v in vars(args).items() if k not in ("config", "command", "func", "log")}
    if opts.pop("vis", None):
        raise ValueError("--vis opens ManiSkill's GUI viewer, which fastrecord replay does not; record videos with "
                         "--save-video instead, or use python -m mani_skill.trajectory.replay_trajectory --vis")
    maniskill = any(opts.get(k) is not None for k in MANISKILL_ONLY)
    for short in ("obs_mode", "num_envs", "sim_backend"):
        value = opts.pop(f"ms_{short}")
        if value is not None:
            if opts.get(short) is not None and opts[short] != value:
                raise ValueError(f"-{short[0]} {value} and --{short.replace('_', '-')} {opts[short]} disagree; pass one")
            opts[short] = value
    path = opts.pop("ms_traj_path")
    if path is not None:
        if opts.get("traj_path") not in (None, path):
            raise ValueError(f"two trajectories given ({opts['traj_path']} and --traj-path {path}); pass one")
        opts["traj_path"] = path
    save_traj, save_video = opts.pop("ms_save_traj"), opts.pop("ms_save_video")
    use_env_states = opts.pop("use_env_states")
    if maniskill:
        # ManiSkill's defaults: nothing written unless asked; by actions unless --use-env-states
        if opts.get("save_trajectory") is None:
            opts["save_trajectory"] = bool(save_traj)
        if opts.get("save_video") is None:
            opts["save_video"] = bool(save_video)
        if use_env_states is not None:
            by = "states" if use_env_states else "actions"
            if opts.get("by") not in (None, by):
                raise ValueError(f"--by {opts['by']} and --{'' if use_env_states else 'no-'}use-env-states disagree; pass one")
            opts["by"] = by
    return load_config(ReplayConfig, args.config, maniskill=maniskill or None, **opts)


def print_summary(s: ReplaySummary, cfg: ReplayConfig) -> None:
    from fastrecord.commands.record import interrupted_line, print_results, print_speed_and_files

    keep = cfg.keep_filter
    if keep is None:
        keep = "success" + (", not truncated" if cfg.discard_timeout else "") + (f", {cfg.max_retry} retries" if cfg.max_retry else "")
    elif cfg.maniskill and cfg.discard_timeout:
        keep = "not truncated"
    if s.interrupted and s.workers > 1:  # workers do not save what is in progress: re-running replays it whole
        print(f"interrupted ({s.interrupted}): stopped after {s.episodes} episode{'s' if s.episodes != 1 else ''}; the "
              f"replays in progress were not saved, running the same command again replays them")
    elif s.interrupted:
        print(interrupted_line(s.interrupted, s.episodes, s.partial, keep) + " (partial replays)" * bool(s.partial))
    how = (f"converted to {cfg.target_control_mode}" if s.converted
           else f"by {'env states' if cfg.replay_by == 'states' else 'actions'}")
    print(f"replayed {s.episodes} episodes {how}: {s.successes} successful, {s.kept} written (keep={keep})"
          + (f" by {s.workers} workers" if s.workers > 1 else ""))
    if s.skipped:
        print(f"resumed: {s.skipped} episodes were already replayed and kept")
    if s.missing:
        print(f"missing: {len(s.missing)} input episodes are not in the output (global indices, the positions in the input: "
              f"{_ranges(s.missing)}); running the same command again replays them")
    if cfg.maniskill:  # ManiSkill's own last line, for scripts that read it
        print(f"Replayed {s.episodes} episodes, {s.kept}/{s.episodes}={s.kept / max(s.episodes, 1) * 100:.2f}% demos saved")
    if s.diverged:
        hint = ""
        if cfg.replay_by == "actions" and not cfg.use_first_env_state:
            hint = (" (an episode whose seed does not reproduce its recorded start, e.g. after an unseeded auto-reset, "
                    "diverges from the first step: --use-first-env-state starts each from its recorded first state)")
        shown = ", ".join(f"{d.episode_id} ({'success' if d.recorded else 'failure'} -> {'success' if d.replayed else 'failure'})"
                          for d in s.diverged[:10])
        more = f" and {len(s.diverged) - 10} more" if len(s.diverged) > 10 else ""
        print(f"success diverged from the recording in {len(s.diverged)} episodes: {shown}{more}{hint}")
    else:
        print("success matches the recording in every episode")
    print_results(s.results, len(s.results), s.results_path)
    if s.worker_times:
        print(worker_timeline(s))
    print_speed_and_files(s.env_steps, s.seconds, s.files, s.output_dir, s.startup_seconds)


def worker_timeline(s: ReplaySummary) -> str:
    """One line: when the workers were up, replaying and done (first-last, seconds since the replay began),
    and the merge."""
    def span(i: int) -> str:
        lo, hi = min(w[i] for w in s.worker_times), max(w[i] for w in s.worker_times)
        return f"{lo:.1f}-{hi:.1f} s"

    before = "" if s.process_age is None else f" (this process began it {s.process_age:.1f} s after its own start)"
    return (f"workers ({len(s.worker_times)}): up (interpreter, imports) at {span(0)}, replaying from {span(1)} (envs made), "
            f"done at {span(2)}; merge {s.merge_seconds:.1f} s; seconds since the replay began{before}")


def main_from_args(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    if not cfg.traj_path:
        raise ValueError("no trajectory given: pass the NAME.h5 to replay (or traj_path in the --config file)")
    from fastrecord.sinks.loggers import log_sinks

    freeze_imports()  # this process is the CLI's (see fastrecord.workers.freeze_imports)
    with StopSignals("replay") as stop:
        try:
            s = run_replay(cfg, stop=stop, sinks=log_sinks(getattr(args, "log", None)))
        except ReplayWorkerError as e:  # the worker's cause and what is on disk, as one message (no traceback of ours)
            print(f"fastrecord replay: error: {e}", file=sys.stderr)
            return 1
        from fastrecord.shards import rank_info

        info = rank_info()
        if info.distributed and info.rank != 0:  # rank 0 prints everyone's summary
            stopped = f" ({s.interrupted})" if s.interrupted else ""
            print(f"rank {info.rank}: replayed {s.episodes} episodes into {s.output_dir}{stopped}")
        else:
            print_summary(s, cfg)
        return stop.exit_code
