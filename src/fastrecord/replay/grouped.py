"""A replay worker's CPU envs held in its own process (`fastrecord.replay.envs.ReplayStates` each):
`PreparedSyncVectorEnv` (each env draws itself, the draws submitted together) and `GroupedSyncVectorEnv`
(every env drawn in one ``RenderSystemGroup``).

Each env simulates on the CPU and sets its recorded states as before (`fastrecord.replay.envs.ReplayStates`);
what changes is who draws. The envs' own scenes are the members of one group
(`fastrecord.render.group.GroupRenderer`, fed their entities' poses from this process), so a step of the
vector env is: every env simulates and sets its state (``ReplayStates.prepare``), then one picture per
sensor camera name covers every env, then each env computes its observation, reading its slice of that
picture where ManiSkill's ``BaseEnv._get_obs_sensor_data`` would render its own; ``render()`` (the videos)
is one picture per human camera name. An env that observes outside a step (a reset) or the ordinary way
(a wrapper below `ReplayStates`) gets a picture of the group taken there and then.

A scene in a group cannot hide objects (SAPIEN refuses to change its visibility), so nothing here calls
ManiSkill's own sensor or render code for these envs: their hidden objects are moved away for sensor
pictures instead (`GroupRenderer`).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import gymnasium as gym
import numpy as np
import numpy.typing as npt
import torch

from fastrecord.render.group import MODALITIES, GroupRenderer
from fastrecord.system import stamp

STATE_MODES = ("state", "state_dict")
# SyncVectorEnv.step's return: observations, rewards, terminations, truncations, infos
_StepResult: TypeAlias = tuple[
    Any, npt.NDArray[np.float64], npt.NDArray[np.bool_], npt.NDArray[np.bool_], dict[str, Any]
]


class PreparedSyncVectorEnv(gym.vector.SyncVectorEnv):
    """A SyncVectorEnv of replay envs (one process) whose step first `ReplayStates.prepare`s every env
    (simulate, set the state, submit the renders) and then steps them (read the pictures, observe):
    the renders of all its envs overlap on the GPU instead of each waiting for its own."""

    def step(self, actions: Any) -> _StepResult:
        for env, action in zip(self.envs, gym.vector.utils.iterate(self.action_space, actions), strict=True):
            env.get_wrapper_attr("prepare")(action)
        return super().step(actions)


def sensor_modalities(base: Any) -> tuple[str, ...]:
    """The modalities ``BaseEnv._get_obs_sensor_data`` asks each camera for in ``base``'s obs mode."""
    if base.obs_mode in STATE_MODES:  # ManiSkill renders rgb and depth there when asked (not by default)
        return ("rgb", "depth")
    visual = base.obs_mode_struct.visual
    return tuple(m for m in MODALITIES if getattr(visual, m, False))


def groupable(base: Any) -> str | None:
    """Why the env ``base`` cannot render in a group (None: it can): every sensor must be a camera."""
    from mani_skill.sensors.camera import Camera

    others = [name for name, s in base.scene.sensors.items() if not isinstance(s, Camera)]
    if others:
        return f"its sensors {others} are not cameras, which a RenderSystemGroup cannot draw"
    return None


def _stamped(make: Callable[[], gym.Env], name: str) -> Callable[[], gym.Env]:
    """``make``, stamping ``name`` when it returns (`fastrecord.system.stamp`: where a worker's start-up goes)."""

    def made() -> gym.Env:
        env = make()
        stamp(name)
        return env

    return made


class GroupedSyncVectorEnv(PreparedSyncVectorEnv):
    """A SyncVectorEnv of replay envs drawn in one batch per camera name (see the module docstring).

    Owns: the `GroupRenderer` over its envs' scenes, and the step's sensor pictures (one dict per env, from
    the moment every env is prepared until it has observed)."""

    renders_batched = True  # fastrecord's VectorEnvView calls render() once instead of call("render")

    def __init__(self, env_fns: Sequence[Callable[[], gym.Env]], device: str = "cuda", **kwargs: Any) -> None:
        super().__init__([_stamped(fn, f"env{i}_made") for i, fn in enumerate(env_fns)], **kwargs)
        try:
            bases: list[Any] = [e.unwrapped for e in self.envs]  # ManiSkill envs
            why = groupable(bases[0])
            if why is not None:
                from fastrecord.render import BatchedRenderError

                raise BatchedRenderError(f"env {bases[0].spec.id if bases[0].spec else type(bases[0]).__name__} cannot "
                                         f"render in one batch: {why}; replay with --batched-render off")
            self.renderer = GroupRenderer(bases, device=device)
            stamp("group_renderer_built")
            self._pictures: list[dict[str, Any] | None] | None = None
            # the replay loop's next actions (`step`: pipelined), the actions prepared ahead, and the sensor data's
            # layout ({camera: {modality: (shape, dtype)}}, from the last pictures read)
            self.lookahead: list[Any] | None = None
            self._ahead: list[Any] = [None] * self.num_envs
            self._layout: dict[str, dict[str, tuple[torch.Size, torch.dtype]]] | None = None
            for i, (env, base) in enumerate(zip(self.envs, bases, strict=True)):
                env.get_wrapper_attr("replay_states").grouped = True
                base._get_obs_sensor_data = functools.partial(self._sensor_data, i)
        except BaseException:
            super().close()
            raise

    def _sensor_data(self, i: int, apply_texture_transforms: bool = True) -> dict[str, Any]:
        """Env ``i``'s ``_get_obs_sensor_data``: its slice of the step's pictures, else of pictures taken now."""
        picture = self._pictures[i] if self._pictures is not None else None
        if picture is not None and apply_texture_transforms:
            return picture
        return self._draw_sensors(apply_texture_transforms)[i]

    def _draw_sensors(self, apply_texture_transforms: bool = True) -> list[dict[str, Any]]:
        """Every env's sensor data at its entities' current poses: one picture per camera name, brought to the
        host in one copy per camera and modality (the envs' observations are CPU data)."""
        renderer = self.renderer
        base = renderer.envs[0]
        names = list(base.scene.sensors)
        modalities = sensor_modalities(base)
        renderer.set_poses_from_envs()
        renderer.take_pictures(names, sensor=True)
        out: list[dict[str, Any]] = [{} for _ in renderer.envs]
        for name in names:
            data = renderer.read_sensor_data(name, modalities, apply_texture_transforms)
            host = {k: v.cpu() for k, v in data.items()}
            if apply_texture_transforms:  # what a pipelined step's host tensors look like
                self._layout = {**(self._layout or {}), name: {k: (v.shape, v.dtype) for k, v in host.items()}}
            for i, env_data in enumerate(out):
                env_data[name] = {k: v[i : i + 1] for k, v in host.items()}
        return out

    def _read_sensors(self, hosts: dict[str, dict[str, torch.Tensor]]) -> None:
        """Wait for the pictures `take_pictures` submitted and copy each camera's modalities into ``hosts``."""
        modalities = sensor_modalities(self.renderer.envs[0])
        for name, mods in hosts.items():
            data = self.renderer.read_sensor_data(name, modalities)
            if data.keys() != mods.keys() or any(data[k].shape != v.shape for k, v in mods.items()):
                raise RuntimeError(f"camera {name!r} gave {({k: tuple(v.shape) for k, v in data.items()})}, not the "
                                   f"{({k: tuple(v.shape) for k, v in mods.items()})} of its earlier pictures")
            for k, v in mods.items():
                v.copy_(data[k])

    def step(self, actions: Any) -> _StepResult:
        """Prepare every env (simulate, set its state) unless the last step ran ahead, draw every env's sensors in
        one batch, observe. With `lookahead` set (the next step's action of each env that goes on, None for the
        others), pipelined: the pictures are submitted, every env observes into host tensors that the pictures
        fill later, the next step's physics runs (`ReplayStates.prepare` ``ahead``) while the GPU draws, then the
        pictures are read into those tensors."""
        ahead, self.lookahead = self.lookahead, None
        acts = list(gym.vector.utils.iterate(self.action_space, actions))
        ready = []
        for i, (env, action) in enumerate(zip(self.envs, acts, strict=True)):
            if self._ahead[i] is not None:  # prepared at the last step, with the action the loop said would come
                if not np.array_equal(np.asarray(self._ahead[i]), np.asarray(action)):
                    raise RuntimeError(f"env {i} ran the physics ahead with another action than the step's: a bug in "
                                       f"the replay loop's lookahead")
                ready.append(True)
            else:
                ready.append(env.get_wrapper_attr("prepare")(action))
        self._ahead = [None] * self.num_envs
        if not any(ready):
            return gym.vector.SyncVectorEnv.step(self, actions)
        if ahead is None or self._layout is None:
            self._pictures = [d if r else None for d, r in zip(self._draw_sensors(), ready, strict=True)]
            try:
                return gym.vector.SyncVectorEnv.step(self, actions)
            finally:
                self._pictures = None
        self.renderer.set_poses_from_envs()
        self.renderer.take_pictures(list(self._layout), sensor=True)
        hosts = {name: {k: torch.empty(shape, dtype=dtype) for k, (shape, dtype) in mods.items()}
                 for name, mods in self._layout.items()}
        self._pictures = [{name: {k: v[i : i + 1] for k, v in mods.items()} for name, mods in hosts.items()} if r
                          else None for i, r in enumerate(ready)]
        try:
            results = [env.step(action) for env, action in zip(self.envs, acts, strict=True)]
        finally:
            self._pictures = None
        for i, (env, action) in enumerate(zip(self.envs, ahead, strict=True)):
            if action is not None and env.get_wrapper_attr("prepare")(action, ahead=True):
                self._ahead[i] = action
        self._read_sensors(hosts)
        return self._batched(results)

    def reset(self, *, seed: Any = None, options: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
        """As ``SyncVectorEnv.reset``; an env reset here forgets the step it prepared ahead (`ReplayStates.reset`
        drops it too)."""
        mask = (options or {}).get("reset_mask")
        self._ahead = [None if mask is None or mask[i] else a for i, a in enumerate(self._ahead)]
        return super().reset(seed=seed, options=options)

    def _batched(self, results: list[tuple[Any, Any, Any, Any, dict[str, Any]]]) -> _StepResult:
        """``SyncVectorEnv.step``'s return (autoreset disabled) of each env's step ``results``."""
        infos: dict[str, Any] = {}
        for i, (obs, rew, terminated, truncated, info) in enumerate(results):
            self._env_obs[i] = obs
            self._rewards[i], self._terminations[i], self._truncations[i] = rew, terminated, truncated
            infos = self._add_info(infos, info, i)
        self._observations = gym.vector.utils.concatenate(self.single_observation_space, self._env_obs,
                                                          self._observations)
        self._autoreset_envs = np.logical_or(self._terminations, self._truncations)
        return (copy.deepcopy(self._observations) if self.copy else self._observations, np.copy(self._rewards),
                np.copy(self._terminations), np.copy(self._truncations), infos)

    def render(self) -> torch.Tensor:  # type: ignore[override]  # batched tensors, as ManiSkill's BaseEnv.render
        """Every env's human camera pictures: ``[num_envs, H, W, 3]`` uint8 on the CUDA device (several cameras:
        side by side, as ManiSkill tiles them)."""
        self.renderer.set_poses_from_envs()
        names = list(self.renderer.envs[0].scene.human_render_cameras)
        frames = [self.renderer.render(name, sensor=False) for name in names]
        return frames[0] if len(frames) == 1 else torch.cat(frames, dim=2)
