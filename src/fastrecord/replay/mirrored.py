"""A replay's CPU envs simulated in sub-env processes and drawn in this one, all in one group:
`MirroredReplayVectorEnv` (issue 27, item 2: one render pipeline for eval, record and replay).

The layout is `make_eval_envs`' and `fastrecord record`'s batched render (`fastrecord.render.vector`): the sub-envs
(`fastrecord.packed.PackedVectorEnv`, several to a process) play their episodes (`fastrecord.replay.envs.ReplayStates`)
and draw nothing; this process holds one mirror env per sub-env (same scene, never stepped) in one
`fastrecord.render.group.GroupRenderer`, fed the poses each sub-env reports with its step.

What a step does:

- The sub-envs step (physics from the recorded state, the next recorded state set, observation, reward) and
  answer with their observation *without* its sensor pictures (a sub-env draws none: `ReplayReporter` drops
  ``sensor_data``, ~80 KB an env a step of 128x128 rgb + depth it would otherwise pickle), their entities' poses
  and their env state (what the recorder asks every sub-env for after each step, answered here from the step's
  report: no second round trip).
- With the replay loop's next actions (`MirroredReplayVectorEnv.lookahead`), each process, once it has answered,
  runs its envs' whole next step (physics, recorded state, observation, reward, report: `ReplayReporter.run_ahead`)
  while this process draws and records: the sub-envs' work and the GPU's drawing overlap, and the next step's
  answer is ready when it is asked for. A replay is a script (every action and state is recorded), so running a
  step early changes nothing but when it runs.
- This process sets the mirrors' poses, takes one picture per sensor camera name (hidden objects moved away, as
  ManiSkill does in GPU simulation), brings them to the host and puts each env's slice back into its
  observation's ``sensor_data``; ``render()`` (videos) draws the human cameras the same way, so videos do not stop
  the overlap (the worker-held `fastrecord.replay.grouped.GroupedSyncVectorEnv` cannot run ahead with them).

Scenes that change (reconfiguring resets) are followed as in the eval: the sub-env reports its new scene's
signature and seed, the mirror is reset to that seed with ``reconfigure=True`` and must look the same.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, SupportsFloat

import gymnasium as gym
import numpy as np

from fastrecord.envs import to_numpy
from fastrecord.render.group import GroupRenderer
from fastrecord.render.vector import GroupRenderedVectorEnv, PoseReporter, group_rendered, mirror_kwargs
from fastrecord.replay.ahead import RunsAhead
from fastrecord.replay.grouped import sensor_modalities
from fastrecord.replay.layout import subenvs_per_process
from fastrecord.reported import STATE_KEY

if TYPE_CHECKING:
    from fastrecord.packed import PackedLaunch


def _no_sensor_data(*args: Any, **kwargs: Any) -> dict[str, Any]:
    """A sub-env's or mirror's ``_get_obs_sensor_data``: nothing (this process's group draws the sensors)."""
    return {}


def _without_sensors(obs: Any) -> Any:
    return {k: v for k, v in obs.items() if k != "sensor_data"} if isinstance(obs, dict) else obs


class ReplayReporter(RunsAhead, PoseReporter):
    """Wraps one replay sub-env (`fastrecord.replay.envs.make_replay_env`'s, outermost, in its own process) that runs
    ahead (`RunsAhead`: its ``get_state`` is the state of the last step or reset answered, not that of a step run
    ahead since, which the rendering process answers from the reports: `MirroredReplayVectorEnv.call`).

    Its observations and observation space lack ``sensor_data`` (``full_observation_space`` has it: what the rendering
    process puts back); every step's and reset's info carries the poses (`PoseReporter`) and the env state
    (`STATE_KEY`)."""

    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)  # RunsAhead's, then PoseReporter's
        self.replay: Any = env.get_wrapper_attr("replay_states")
        full = env.observation_space
        self.full_observation_space = full
        if isinstance(full, gym.spaces.Dict) and "sensor_data" in full.spaces:
            self.observation_space = gym.spaces.Dict({k: v for k, v in full.spaces.items() if k != "sensor_data"})
        base: Any = env.unwrapped  # a ManiSkill env
        base._get_obs_sensor_data = _no_sensor_data

    def _report(self, info: dict[str, Any]) -> dict[str, Any]:
        info = super()._report(info)  # PoseReporter's
        info[STATE_KEY] = to_numpy(self.replay.get_state())
        return info

    def reset(self, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        self._ahead = None  # a step run ahead that is not taken (the loop reset the env instead) is dropped
        obs, info = super().reset(**kwargs)  # PoseReporter's (RunsAhead has none)
        self._answered = info[STATE_KEY]
        return _without_sensors(obs), info

    def _step(self, action: Any) -> tuple[Any, SupportsFloat, bool, bool, dict[str, Any]]:
        """The whole step (physics, recorded state, observation, reward, report): `RunsAhead.step` answers with it, or
        `RunsAhead.run_ahead` keeps it while the rendering process draws the step before."""
        obs, rew, terminated, truncated, info = PoseReporter.step(self, action)
        return _without_sensors(obs), rew, terminated, truncated, info


class MirroredReplayVectorEnv(GroupRenderedVectorEnv):
    """A vector env of replay sub-envs (`ReplayReporter`, in `fastrecord.packed.PackedVectorEnv` processes) drawn
    here in one group: observations with their ``sensor_data`` back, ``render()`` of every env's human cameras.

    Owns (beyond `GroupRenderedVectorEnv`'s mirrors and renderer): each sub-env's last reported env state, and
    ``lookahead`` (each env's next action, None where its episode ends: set by the replay loop before a step,
    used by that step only)."""

    terminate_subenvs = True  # the sub-envs play recorded states and hold nothing to save
    answers_calls = True  # `call("get_state")`, from the reports; fastrecord's vector wrappers above ask it first

    def __init__(self, env: gym.vector.VectorEnv, *, mirrors: list[gym.Env], renderer: GroupRenderer | None = None,
                 device: str = "cuda") -> None:
        super().__init__(env, device=device, mirrors=mirrors, renderer=renderer)
        subenvs: Any = env  # a PackedVectorEnv of ReplayReporter sub-envs
        full = subenvs.get_attr("full_observation_space")[0]
        self.single_observation_space = full
        self.observation_space = gym.vector.utils.batch_space(full, self.num_envs)
        sensors = full.spaces.get("sensor_data") if isinstance(full, gym.spaces.Dict) else None
        self._sensor_space: gym.spaces.Dict | None = (
            sensors if isinstance(sensors, gym.spaces.Dict) and len(sensors.spaces) else None)
        self._modalities = sensor_modalities(self.renderer.envs[0])  # the mirrors observe in the replay's obs mode
        self._states: list[np.ndarray | None] = [None] * self.num_envs
        self.lookahead: list[Any] | None = None

    @staticmethod
    def warm_cameras(base: Any) -> list[str]:
        """The human cameras (videos) and the sensors (observations)."""
        return [*base.scene.human_render_cameras, *base.scene.sensors]

    def _take(self, info: dict) -> dict:
        info = dict(info)
        states = info.pop(STATE_KEY, None)
        mask = info.pop("_" + STATE_KEY, None)
        if states is not None:
            for j in np.flatnonzero(mask if mask is not None else np.ones(self.num_envs, dtype=bool)):
                self._states[j] = states[j]
        return super()._take(info)

    def call(self, name: str, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """As the sub-envs' ``call``; ``get_state`` is answered from their last reports (they may be running the
        next step ahead, and their report is the state their last step observed)."""
        if name == "get_state" and not args and not kwargs and all(s is not None for s in self._states):
            return tuple(self._states)
        return self.env.call(name, *args, **kwargs)

    def reset(self, *, seed: Any = None, options: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
        obs, info = super().reset(seed=seed, options=options)
        return self._with_sensors(obs), info

    def reset_wait(self) -> tuple[Any, dict[str, Any]]:
        obs, info = super().reset_wait()
        return self._with_sensors(obs), info

    def step(self, actions: Any) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        ahead, self.lookahead = self.lookahead, None
        if ahead is not None and any(a is not None for a in ahead):
            obs, rew, terminated, truncated, info = self.env.step_ahead(actions, ahead)
        else:
            obs, rew, terminated, truncated, info = self.env.step(actions)
        info = self._take(info)
        return self._with_sensors(obs), rew, terminated, truncated, info

    def _with_sensors(self, obs: Any) -> Any:
        """``obs`` (the sub-envs', without sensor data) with every env's sensor pictures drawn here at its reported
        poses, in the full observation space's order."""
        if self._sensor_space is None:
            return obs
        renderer = self.renderer
        names = list(self._sensor_space.spaces)
        renderer.set_poses(self._reported_poses("a step"))
        renderer.take_pictures(names, sensor=True)
        data: dict[str, dict[str, np.ndarray]] = {}
        for name in names:
            space = self._sensor_space[name]
            assert isinstance(space, gym.spaces.Dict)  # ManiSkill's sensor_data: {camera: {modality: Box}}
            got = renderer.read_sensor_data(name, self._modalities)
            missing = [k for k in space.spaces if k not in got]
            if missing:
                raise RuntimeError(f"camera {name!r}'s group pictures lack {missing} of its observation "
                                   f"{list(space.spaces)}: replay with --batched-render off")
            data[name] = {k: got[k].cpu().numpy() for k in space.spaces}
        full: Any = self.single_observation_space  # a Dict with sensor_data (__init__)
        return {k: (data if k == "sensor_data" else obs[k]) for k in full.spaces}


class ReplaySubenv(Protocol):
    """Makes one sub-env of `MirroredReplayVectorEnv` in its process (`fastrecord.replay.early.MirroredSubenv`: the
    replay env of these three under `ReplayReporter`); the mirrors are made of the same env id, keywords and time
    limit. Picklable, and equal to another where it makes the same env."""

    @property
    def env_id(self) -> str: ...

    @property
    def env_kwargs(self) -> dict[str, Any]: ...

    @property
    def max_episode_steps(self) -> int | None: ...

    def __call__(self) -> gym.Env: ...


def mirrored_replay_env(subenv: ReplaySubenv, num_envs: int, device: str,
                        launch: PackedLaunch | None = None) -> MirroredReplayVectorEnv:
    """``num_envs`` replay envs (each made by ``subenv`` in its process) in `fastrecord.packed.PackedVectorEnv`
    processes (autoreset disabled), drawn here in one group on ``device``; the mirrors are made (and the group warmed)
    on a thread while the sub-envs start (`group_rendered`). ``launch``: sub-env processes started before this
    process's imports (`fastrecord.replay.early.early_subenvs`), taken over where they make these envs, else ended."""
    from fastrecord.packed import PackedVectorEnv
    from fastrecord.workers import forkserver_context

    env_id, env_kwargs, max_episode_steps = subenv.env_id, subenv.env_kwargs, subenv.max_episode_steps
    kw = mirror_kwargs(env_kwargs, device)
    kw["obs_mode"] = env_kwargs.get("obs_mode") or "state"  # the mirrors' sensors as the sub-envs' (their modalities)
    fns = [subenv] * num_envs
    mode = gym.vector.AutoresetMode.DISABLED
    taken = launch if launch is not None and launch.made_for(fns, mode) else None
    if launch is not None and taken is None:
        launch.close()  # other envs than these (a wrong guess): their cores and memory back before ours start

    def make_mirror() -> gym.Env:
        import mani_skill.envs  # noqa: F401 - registers the tasks

        mirror = gym.make(env_id, max_episode_steps=max_episode_steps, **kw)
        base: Any = mirror.unwrapped  # a ManiSkill env
        base._get_obs_sensor_data = _no_sensor_data  # a reset to a new scene observes: no drawing there
        return mirror

    def make_envs() -> gym.vector.VectorEnv:
        if taken is None:
            forkserver_context()  # the sub-envs start with ManiSkill imported
        return PackedVectorEnv(fns, subenvs_per_process(num_envs), context="forkserver", autoreset_mode=mode,
                               launch=taken)

    envs = group_rendered(make_envs, make_mirror, num_envs, device=device, cls=MirroredReplayVectorEnv)
    assert isinstance(envs, MirroredReplayVectorEnv)
    return envs
