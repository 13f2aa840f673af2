"""The env side of a replay: `ReplayStates` plays recorded episodes in a ManiSkill env, `make_replay_env`
builds one, and `VectorBatch` / `BatchedEnv` hold N of them (a gymnasium vector env of CPU envs, or one
GPU-parallel ManiSkill env) with fastrecord's recorder on top.

The forkserver preloads this module (`fastrecord.workers.FORKSERVER_PRELOAD`): a CPU vector env's
sub-env processes and the replay's worker processes start with it, torch and ManiSkill imported.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, SupportsFloat, TypeAlias

import gymnasium as gym
import numpy as np
import torch

from fastrecord.envs import SubEnvAccess
from fastrecord.replay.grouped import GroupedSyncVectorEnv, PreparedSyncVectorEnv
from fastrecord.system import stamp
from fastrecord.workers import claim_process, forkserver_context

if TYPE_CHECKING:
    from fastrecord.packed import PackedLaunch
    from fastrecord.replay.mirrored import ReplaySubenv

# ManiSkill's ``BaseEnv.step``: the observation, then reward, terminated and truncated as batched tensors, and info
_Step: TypeAlias = tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor, dict[str, Any]]


def tree_index(tree: Mapping[str, Any], t: int) -> dict[str, Any]:
    """Row ``t`` of every array of a nested dict (a recorded ``env_states`` tree at step ``t``)."""
    return {k: (tree_index(v, t) if isinstance(v, Mapping) else v[t]) for k, v in tree.items()}


def tree_stack(trees: list[Mapping[str, Any]], device: torch.device) -> dict[str, Any]:
    """Nested dicts of the same keys stacked leaf by leaf into tensors on ``device`` (one row per tree)."""
    first = trees[0]
    return {
        k: (tree_stack([t[k] for t in trees], device) if isinstance(first[k], Mapping)
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
        base: Any = env.unwrapped  # a ManiSkill env
        self.n = base.num_envs
        self.device = torch.device(base.device)
        self._pending: dict[int, dict[str, Any]] = {}
        self._plans: list[dict[str, Any] | None] = [None] * self.n
        self._t = np.zeros(self.n, dtype=np.int64)
        self._active = np.zeros(self.n, dtype=bool)
        self._state_keys: set[str] | None = None
        self._last_step: _Step | None = None
        self._last_frame: Any = None
        self._holding = False  # a single env idle since before its last step: `render` returns its held frame
        self._time_limit = self._direct_step_time_limit()
        self._prepared: Any = None  # the action `prepare` took, until `step` observes it
        self._observed_state: Any = None  # `get_state` of the state last observed, while `prepare` ran ahead of it
        self.grouped = False  # rendered in a RenderSystemGroup by its vector env (`prepare`)
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
    def replay_states(self) -> ReplayStates:
        """This wrapper, found from above through ``get_wrapper_attr`` (`fastrecord.replay.grouped`)."""
        return self

    @property
    def replay_plan(self) -> dict[str, Any] | None:
        return self._plans[0]

    @replay_plan.setter
    def replay_plan(self, plan: dict[str, Any] | None) -> None:
        """Vector envs' ``set_attr`` entry point (one env per process): None leaves the env as it is."""
        if plan is not None:
            self.load([0], [plan])

    def load(self, env_idx: list[int] | np.ndarray, plans: list[dict[str, Any]]) -> None:
        for e, plan in zip(np.asarray(env_idx).reshape(-1).tolist(), plans, strict=True):
            if plan.get("states") is not None:
                self._check_state_keys(plan["states"])
            self._pending[e] = plan

    def _check_state_keys(self, states: Mapping[str, Any]) -> None:
        if self._state_keys is None:
            base: Any = self.env.unwrapped  # a ManiSkill env
            self._state_keys = _tree_keys(base.get_state_dict())
        theirs = {k for k in _tree_keys(states) if not k.startswith("controller/")}
        ours = {k for k in self._state_keys if not k.startswith("controller/")}
        if theirs != ours:
            raise ValueError(
                f"the recorded env states do not fit this env: missing here {sorted(theirs - ours)[:5]}, not recorded "
                f"{sorted(ours - theirs)[:5]}. The file was recorded with another task version or env kwargs; replay "
                "it by actions (--by actions) or with the env kwargs it was recorded with"
            )

    # -- gym API
    def reset(self, *, seed: Any = None, options: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
        options = dict(options or {})
        idx = options.get("env_idx")
        idx = np.arange(self.n) if idx is None else np.asarray(torch.as_tensor(idx).cpu()).reshape(-1)
        plans = [self._pending.pop(int(e), None) for e in idx]
        loaded = [p for p in plans if p is not None]  # every env's plan, or none (checked below)
        if loaded:
            if len(loaded) < len(plans):
                raise RuntimeError(
                    f"reset of envs {idx.tolist()} where only some have a replay plan; load a plan for each"
                )
            seeds = [int(p["seed"]) for p in loaded]
            partial = len(idx) < self.n
            # ManiSkill 3.0.1 seeds a reset with one seed per env of the whole batch only
            seed = seeds[0] if self.n == 1 else (None if partial else seeds)
            options |= {
                k: v for k, v in (loaded[0].get("options") or {}).items() if k not in ("env_idx", "reset_to_env_states")
            }
            if all(p.get("states") is not None for p in loaded):
                first = tree_stack([tree_index(p["states"], 0) for p in loaded], self.device)
                options["reset_to_env_states"] = {"env_states": first}
            elif partial:
                raise ValueError(
                    "a partial reset of a GPU-parallel env cannot reproduce seeded episodes; replay with the "
                    "recorded first states (--by states, or --by actions --use-first-env-state)"
                )
        obs, info = self.env.reset(seed=seed, options=options)
        if seed is None and loaded:  # bookkeeping: the recorder reads the seeds from here
            base: Any = self.env.unwrapped  # a ManiSkill env
            base._episode_seed[idx] = [int(p["seed"]) for p in loaded]
        for e, p in zip(idx.tolist(), plans, strict=True):
            self._plans[e] = p
            self._t[e] = 0
            self._active[e] = p is not None and p["length"] > 0
        self._last_step = None
        self._prepared = None
        self._observed_state = None
        self._holding = False
        return obs, info

    def get_state(self) -> torch.Tensor:
        """``BaseEnv.get_state`` of the state the last step observed, also after `prepare` ran the next step's
        physics ahead of it (``ahead``): what the recorder reads after each step."""
        if self._observed_state is not None:
            return self._observed_state
        base: Any = self.env.unwrapped  # a ManiSkill env
        return base.get_state()

    def prepare(self, action: Any, ahead: bool = False) -> bool:
        """The first half of the next `step` (with the same action), for a vector env that holds several
        single envs in one process (`PreparedSyncVectorEnv`): simulate, set the recorded state and
        submit the cameras' renders, without waiting for them. SAPIEN renders asynchronously, so the
        renders of all of a process's envs then run together on the GPU before the first is read
        (on a GPU, 4 envs: 2.4 ms an env-step against 4.8 one after the other). Does nothing where
        `step` would not take its direct path (by actions, idle, another wrapper below) or the
        observation has no camera.

        ``grouped`` (the env renders in a `fastrecord.render.group.GroupRenderer`, `GroupedSyncVectorEnv`):
        simulate and set the state only, by actions too; the vector env then renders every env's sensors in
        one batch. Returns whether the env now holds the state its next `step` observes.

        ``ahead``: called right after a step, with the next step's action, while the vector env's pictures of
        that step are being drawn (`GroupedSyncVectorEnv`, pipelined): `get_state` keeps answering the state
        that step observed until the next step."""
        if self._prepared is not None or not self._camera_obs or self._idle():
            return False
        rows = self._per_step_rows()
        if self._time_limit is False or not (rows or self.grouped):
            return False
        base: Any = self.env.unwrapped  # a ManiSkill env
        if ahead:
            self._observed_state = base.get_state()
        stepped = self._advance(action, rows)
        if not self.grouped:
            for obj in base._hidden_objects:  # as BaseEnv._get_obs_sensor_data, before its render
                obj.hide_visual()
            base.scene.update_render(update_sensors=True, update_human_render_cameras=False)
            base.capture_sensor_data()
        self._prepared = action if stepped is None else stepped
        return True

    def step(self, action: Any) -> _Step:  # type: ignore[override]  # batched tensors, as ManiSkill's BaseEnv.step
        if self._prepared is not None:  # `prepare` simulated, set the state and rendered: observe
            stepped, self._prepared, self._holding = self._prepared, None, False
            self._observed_state = None
            with _rendered(self.env.unwrapped):
                obs, rew, terminated, info = self._observe(stepped, {})
            return self._finish(obs, rew, terminated, info)
        self._holding = self._idle()
        if self._holding:
            assert self._last_step is not None  # `_idle` holds only after a step
            return self._last_step  # the episode is over: hold still until the next plan
        rows = self._per_step_rows()
        if rows and self._time_limit is not False:
            stepped = self._advance(action, rows)
            obs, rew, terminated, info = self._observe(action if stepped is None else stepped, {})
            return self._finish(obs, rew, terminated, info)
        env: Any = self.env  # ManiSkill's own wrappers: batched tensors where gymnasium's types say float and bool
        obs, rew, terminated, truncated, info = env.step(action)
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
        return [e for e in map(int, np.flatnonzero(self._active)) if self._playing(e)["per_step"]]

    def _playing(self, e: int) -> dict[str, Any]:
        """The plan env ``e`` plays (it is active: its reset loaded one)."""
        plan = self._plans[e]
        assert plan is not None, f"env {e} plays no replay plan"
        return plan

    def _advance(self, action: Any, rows: list[int]) -> Any:
        """BaseEnv.step without its observation and reward: they would be of the simulated state, which
        the recorded one replaces at once (for camera observations, a second render per step). The
        physics step stays in every obs mode: contact forces (PickCube's is_grasped) and a controller's
        target are not in the recorded state (tests/test_replay_physics_step.py, docs/replay.md). Returns
        the action as the env took it (None: as given)."""
        base: Any = self.env.unwrapped  # a ManiSkill env
        stepped = base._step_action(action)
        base._elapsed_steps += 1
        self._t[self._active] += 1
        if rows:
            self._set_states(rows)
        return stepped

    def _finish(self, obs: Any, rew: Any, terminated: Any, info: dict[str, Any], truncated: Any = None) -> _Step:
        if truncated is None:  # the direct path: ManiSkill's TimeLimitWrapper's flag
            limit = self._time_limit
            base: Any = self.env.unwrapped  # a ManiSkill env
            truncated = (base.elapsed_steps >= limit if limit is not None
                         else torch.zeros(self.n, dtype=torch.bool, device=self.device))
        self._active &= self._t < np.array([p["length"] if p else 0 for p in self._plans])
        self._last_step = (obs, rew, terminated, truncated, info)
        return self._last_step

    def render(self) -> torch.Tensor:  # type: ignore[override]  # batched tensors, as ManiSkill's BaseEnv.render
        if self._holding and self._last_frame is not None:  # not on the step that ended the episode: its frame is new
            return self._last_frame
        self._last_frame = self.env.render()
        return self._last_frame

    # -- internals
    def _direct_step_time_limit(self) -> int | bool | None:
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
        base: Any = self.env.unwrapped  # a ManiSkill env
        recorded = tree_stack([tree_index(self._playing(e)["states"], int(self._t[e])) for e in rows], self.device)
        if len(rows) == self.n:
            base.set_state_dict(recorded)
        else:  # the other envs keep their simulated state
            state = base.get_state_dict()
            _tree_set_rows(state, recorded, torch.as_tensor(rows, device=self.device))
            base.set_state_dict(state)

    def _observe(self, action: Any, step_info: dict[str, Any]
                 ) -> tuple[Any, torch.Tensor, torch.Tensor, dict[str, Any]]:
        """Observation, reward, termination and info of the state just set (as ``BaseEnv.step``)."""
        base: Any = self.env.unwrapped  # a ManiSkill env
        info = base.get_info()
        obs = base.get_obs(info, unflattened=True)
        act = torch.as_tensor(
            np.asarray(action) if not isinstance(action, torch.Tensor) else action, device=self.device
        )
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
def _rendered(base: Any) -> Iterator[None]:
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

    def step(self, action: Any) -> tuple[Any, SupportsFloat, bool, bool, dict[str, Any]]:
        obs, rew, terminated, truncated, info = self.env.step(action)
        return obs, rew, False, False, {**info, _TERMINATED: bool(terminated), _TRUNCATED: bool(truncated)}

    def get_state_dict(self) -> dict[str, Any]:
        """The env state as numpy arrays: torch tensors leave an AsyncVectorEnv worker through torch's
        shared-memory hand-off (a socket round trip per tensor), which made replays ~2x slower."""
        from mani_skill.utils import common

        base: Any = self.env.unwrapped  # a ManiSkill env
        return common.to_numpy(base.get_state_dict())


class _DoneFromInfo(SubEnvAccess, gym.vector.VectorWrapper):
    """Puts the sub-envs' true terminated/truncated flags (see `_DoneInInfo`) back for the recorder."""

    @property
    def renders_batched(self) -> bool:  # read by fastrecord's VectorEnvView (a GroupedSyncVectorEnv below)
        return getattr(self.env, "renders_batched", False)

    def step(self, actions: Any) -> tuple[Any, Any, np.ndarray, np.ndarray, dict[str, Any]]:
        obs, rew, _, _, info = self.env.step(actions)
        info = dict(info)
        terminated, truncated = info.pop(_TERMINATED), info.pop(_TRUNCATED)
        info.pop("_" + _TERMINATED, None)
        info.pop("_" + _TRUNCATED, None)
        return obs, rew, terminated, truncated, info


def make_replay_env(env_id: str, env_kwargs: dict[str, Any], max_episode_steps: int | None, num_envs: int = 1,
                    cpu_wrapper: bool = True) -> gym.Env:
    """One replay env: ``gym.make`` -> `ReplayStates` (-> `SubstepFrames` -> ``CPUGymWrapper`` -> `_DoneInInfo` for a
    vector env: its sub-envs render their substeps themselves for ``--render-substeps``, nothing otherwise)."""
    import mani_skill.envs  # noqa: F401 - registers the tasks
    from mani_skill.utils.wrappers import CPUGymWrapper
    from mani_skill.utils.wrappers.flatten import FlattenActionSpaceWrapper

    from fastrecord.system import use_lavapipe_if_no_gpu

    use_lavapipe_if_no_gpu()  # worker processes too
    env = gym.make(env_id, num_envs=num_envs, max_episode_steps=max_episode_steps, **env_kwargs)
    if isinstance(env.action_space, gym.spaces.Dict):  # multi-agent: recorded as flat vectors (as ManiSkill's replay)
        env = FlattenActionSpaceWrapper(env)
    env = ReplayStates(env)
    if not cpu_wrapper:
        return env
    from fastrecord.substeps import SubstepFrames

    return _DoneInInfo(CPUGymWrapper(SubstepFrames(env)))


# ---------------------------------------------------------------------------------------------- batches
# The replay loop (`fastrecord.replay.drive`) drives either adapter the same way: start(env_idx, plans),
# step(actions) -> (success, truncated), flush(env), close(); each records through its own RecordEpisode.
def in_worker(thunk: Callable[[], gym.Env]) -> gym.Env:
    """An AsyncVectorEnv worker's env: the worker ignores Ctrl-C (a terminal sends it to the whole process
    group), so that the parent can stop the replay and still step and close its envs."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    claim_process()
    return thunk()


RecorderKwargs = Callable[[int], dict[str, Any]]  # control_freq -> RecordEpisode kwargs (`ReplayPlan.recorder_kwargs`)


class VectorBatch:
    """N CPU envs in a gymnasium vector env (autoreset disabled), recorded by fastrecord from outside.

    Owns: the vector env (sub-processes with ``asynchronous``) and the `RecordEpisode` wrapped around it."""

    def __init__(self, thunk: Callable[[], gym.Env], num_envs: int, asynchronous: bool,
                 rec_kwargs: RecorderKwargs, render_device: str | None = None, subenv: ReplaySubenv | None = None,
                 launch: PackedLaunch | None = None, frames: bool = False, run_ahead: bool = True) -> None:
        """``render_device``: a CUDA device the envs render on in one batch: envs in this process
        (`fastrecord.replay.grouped.GroupedSyncVectorEnv`), or with ``asynchronous`` envs in sub-env processes drawn
        here (`fastrecord.replay.mirrored.MirroredReplayVectorEnv`, whose sub-envs ``subenv`` makes, each in its
        process, and whose mirrors are made of its env id, keywords and time limit: those ``thunk`` makes its env of;
        ``launch``: their processes, if started early and making those envs); None: each env renders itself. With
        ``asynchronous`` and no ``render_device``, ``run_ahead``: each env in a process of its own runs its next step
        while this one records (`fastrecord.replay.ahead`; ``frames``: each step's answer carries the env's frame, for
        videos of the render camera); else gymnasium's ``AsyncVectorEnv`` (``--render-substeps``: the recorder asks
        the sub-envs for their substeps' frames after each step)."""
        from fastrecord.record import RecordVectorEpisode

        mode = gym.vector.AutoresetMode.DISABLED
        envs: gym.vector.VectorEnv
        mirrored = asynchronous and render_device is not None
        if launch is not None and not mirrored:  # sub-envs started for a replay drawn here, which this one is not:
            launch.close()  # ended at once, their cores and memory back before these envs start (as mirrored ones)
        if mirrored:
            from fastrecord.replay.mirrored import mirrored_replay_env

            assert render_device is not None  # mirrored
            if subenv is None:
                raise ValueError("VectorBatch: envs in sub-env processes drawn in one batch need subenv (what makes "
                                 "each sub-env in its process, and its mirror)")
            envs = mirrored_replay_env(subenv, num_envs, render_device, launch=launch)
        elif asynchronous and run_ahead:
            from fastrecord.replay.ahead import ahead_replay_env

            envs = ahead_replay_env(functools.partial(in_worker, thunk), num_envs, frames)
        elif asynchronous:
            thunk = functools.partial(in_worker, thunk)
            forkserver_context()  # its sub-envs start with ManiSkill imported
            envs = gym.vector.AsyncVectorEnv([thunk] * num_envs, context="forkserver", autoreset_mode=mode)
        elif render_device is not None:
            envs = GroupedSyncVectorEnv([thunk] * num_envs, device=render_device, autoreset_mode=mode)
        else:
            envs = PreparedSyncVectorEnv([thunk] * num_envs, autoreset_mode=mode)
        self.envs = envs
        stamp("vector_env_made")  # a replay's timeline: the envs, then the recorder (its writer process's first answer)
        self.num_envs = num_envs
        try:
            self.control_freq = envs.get_attr("control_freq")[0]
            shape = envs.single_action_space.shape
            assert shape is not None, "a replay env's actions are flat vectors (make_replay_env)"
            self.action_shape: tuple[int, ...] = shape
            options = rec_kwargs(self.control_freq)
            self.env = RecordVectorEpisode(_DoneFromInfo(envs), **options)  # what RecordEpisode makes of a vector env
        except BaseException:
            envs.close()
            raise
        self.recorder = self.env.recorder
        # the next step's physics runs while a step's pictures are drawn (`GroupedSyncVectorEnv.step`), except where
        # the recorder draws the render camera after each step (videos): that picture must show the step's state
        # (`MirroredReplayVectorEnv`: each sub-env runs the next step ahead in its process while this one draws, videos
        # included)
        from fastrecord.replay.ahead import AheadReplayVectorEnv
        from fastrecord.replay.mirrored import MirroredReplayVectorEnv

        self.pipelined = isinstance(envs, (MirroredReplayVectorEnv, AheadReplayVectorEnv)) or (
            isinstance(envs, GroupedSyncVectorEnv)
            and not (options["save_video"] and options["video_source"] == "render"))
        self._started = False

    def start(self, env_idx: np.ndarray, plans: list[dict[str, Any]]) -> None:
        values: list[Any] = [None] * self.num_envs
        seeds: list[int | None] = [None] * self.num_envs
        for e, p in zip(env_idx, plans, strict=True):
            values[e], seeds[e] = p, int(p["seed"])
        self.envs.set_attr("replay_plan", values)
        mask = np.zeros(self.num_envs, dtype=bool)
        mask[env_idx] = True
        options = None if not self._started else {"reset_mask": mask}
        if not self._started and not mask.all():
            # fewer episodes than envs at the first start (a worker whose fellow workers took the rest from their
            # shared counter): every env is reset once, as a vector env must be before a masked reset, the idle ones
            # without a plan (they stay idle), their episodes never recorded
            idle = np.flatnonzero(~mask)
            self.recorder.set_episode_meta(idle, [None] * len(idle))
        self.env.reset(seed=seeds, options=options)
        self._started = True

    def step(self, actions: np.ndarray, ahead: list[np.ndarray | None] | None = None
             ) -> tuple[np.ndarray | None, np.ndarray]:
        """Step every env: (success per env or None if the env reports none, truncated per env). ``ahead``: each
        env's action at the step after this one (None: its episode ends here), for a pipelined vector env."""
        if self.pipelined and ahead is not None:
            pipelined: Any = self.envs  # a GroupedSync- or MirroredReplayVectorEnv
            pipelined.lookahead = ahead
        _, _, _, truncated, info = self.env.step(actions)
        truncated = np.asarray(truncated, dtype=bool).reshape(self.num_envs)
        if "success" not in info:
            return None, truncated
        return np.asarray(info["success"], dtype=bool).reshape(self.num_envs), truncated

    def flush(self, e: int) -> None:
        self.env.flush_trajectory(env_idxs_to_flush=[e])

    def close(self) -> None:
        self.env.close()


class BatchedEnv:
    """N envs in one ManiSkill env (GPU simulation; on the CPU N = 1), recorded by fastrecord.

    Owns: the `ReplayStates`-wrapped env (closed with the recorder) and the `RecordEpisode` around it."""

    def __init__(self, env: ReplayStates, rec_kwargs: RecorderKwargs) -> None:
        from fastrecord.record import RecordEpisode

        base: Any = env.unwrapped  # a ManiSkill env
        self.num_envs = base.num_envs
        self.device = torch.device(base.device)
        self.control_freq = base.control_freq
        self.action_shape: tuple[int, ...] = base.single_action_space.shape
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

    def step(self, actions: np.ndarray, ahead: list[np.ndarray | None] | None = None
             ) -> tuple[np.ndarray | None, np.ndarray]:
        """Step every env: (success per env or None if the env reports none, truncated per env); ``ahead`` unused."""
        _, _, _, truncated, info = self.env.step(torch.as_tensor(actions, device=self.device))
        truncated = np.asarray(torch.as_tensor(truncated).cpu(), dtype=bool).reshape(self.num_envs)
        if "success" not in info:
            return None, truncated
        s = info["success"]
        return (s.cpu().numpy() if isinstance(s, torch.Tensor) else np.asarray(s)).astype(bool).reshape(
            self.num_envs
        ), truncated

    def flush(self, e: int) -> None:
        self.env.flush_trajectory(env_idxs_to_flush=[e])

    def close(self) -> None:
        self.env.close()
