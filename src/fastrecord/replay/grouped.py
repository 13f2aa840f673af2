"""A replay worker's CPU envs held in its own process (`fastrecord.replay.envs.ReplayStates` each):
`PreparedSyncVectorEnv` (each env draws itself, the draws submitted together) and `GroupedSyncVectorEnv`
(every env drawn in one ``RenderSystemGroup``).

Each env simulates on the CPU and sets its recorded states as before (`fastrecord.replay.envs.ReplayStates`);
what changes is who draws. The envs' own scenes are the members of one group
(`fastrecord.render.group.GroupRenderer`, fed their entities' poses from this process), so a step of the
vector env is: every env simulates and sets its state (``ReplayStates.prepare``), then one picture per
sensor camera name covers every env, then each env computes its observation, reading its slice of that
picture where ManiSkill's ``BaseEnv._get_obs_sensor_data`` would render its own; ``render()`` (the videos)
is one picture per human camera name. The envs are split into two groups (`draw_groups`): the first
group's pictures are drawn on the GPU while the second group simulates on the CPU. An env that observes
outside a step (a reset) or the ordinary way (a wrapper below `ReplayStates`) gets a picture of its group
taken there and then.

A scene in a group cannot hide objects (SAPIEN refuses to change its visibility), so nothing here calls
ManiSkill's own sensor or render code for these envs: their hidden objects are moved away for sensor
pictures instead (`GroupRenderer`).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from typing import Any

import gymnasium as gym
import numpy as np
import torch

from fastrecord.render.group import GroupRenderer

STATE_MODES = ("state", "state_dict")


class PreparedSyncVectorEnv(gym.vector.SyncVectorEnv):
    """A SyncVectorEnv of replay envs (one process) whose step first `ReplayStates.prepare`s every env
    (simulate, set the state, submit the renders) and then steps them (read the pictures, observe):
    the renders of all its envs overlap on the GPU instead of each waiting for its own."""

    def step(self, actions: Any):
        for env, action in zip(self.envs, gym.vector.utils.iterate(self.action_space, actions)):
            env.get_wrapper_attr("prepare")(action)
        return super().step(actions)


def sensor_modalities(base: Any) -> tuple[str, ...]:
    """The modalities ``BaseEnv._get_obs_sensor_data`` asks each camera for in ``base``'s obs mode."""
    if base.obs_mode in STATE_MODES:  # ManiSkill renders rgb and depth there when asked (not by default)
        return ("rgb", "depth")
    visual = base.obs_mode_struct.visual
    return tuple(m for m in ("rgb", "depth", "position", "segmentation", "normal", "albedo") if getattr(visual, m, False))


def groupable(base: Any) -> str | None:
    """Why the env ``base`` cannot render in a group (None: it can): every sensor must be a camera."""
    from mani_skill.sensors.camera import Camera

    others = [name for name, s in base.scene.sensors.items() if not isinstance(s, Camera)]
    if others:
        return f"its sensors {others} are not cameras, which a RenderSystemGroup cannot draw"
    return None


def draw_groups() -> int:
    """Groups a worker's envs are split into (`GroupedSyncVectorEnv`): 2, or ``FASTRECORD_DRAW_GROUPS`` (a
    measurement aid for `benchmarks/bench_replay.py`'s sweep)."""
    value = os.environ.get("FASTRECORD_DRAW_GROUPS", "2")
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"FASTRECORD_DRAW_GROUPS={value!r} must be a whole number >= 1; unset it for the default 2")
    return int(value)


class GroupedSyncVectorEnv(PreparedSyncVectorEnv):
    """A SyncVectorEnv of replay envs drawn in batches (see the module docstring).

    Owns: one `GroupRenderer` per slice of its envs (`draw_groups`, as even as can be: the first slice draws on
    the GPU while the next simulates on the CPU), and the step's sensor pictures (one dict per env, from the
    moment every env is prepared until it has observed)."""

    renders_batched = True  # fastrecord's VectorEnvView calls render() once instead of call("render")

    def __init__(self, env_fns: Sequence[Callable[[], gym.Env]], device: str = "cuda", groups: int | None = None,
                 **kwargs: Any) -> None:
        super().__init__(env_fns, **kwargs)
        try:
            bases = [e.unwrapped for e in self.envs]
            why = groupable(bases[0])
            if why is not None:
                from fastrecord.render import BatchedRenderError

                raise BatchedRenderError(f"env {bases[0].spec.id if bases[0].spec else type(bases[0]).__name__} cannot "
                                         f"render in one batch: {why}; replay with --batched-render off")
            k = min(groups or draw_groups(), len(bases))
            self._slices = [[int(i) for i in part] for part in np.array_split(np.arange(len(bases)), k)]
            self.renderers = [GroupRenderer([bases[i] for i in part], device=device) for part in self._slices]
            self._pictures: list[dict[str, Any] | None] | None = None
            for i, (env, base) in enumerate(zip(self.envs, bases)):
                env.get_wrapper_attr("replay_states").grouped = True
                base._get_obs_sensor_data = functools.partial(self._sensor_data, i)
        except BaseException:
            super().close()
            raise

    def _sensor_data(self, i: int, apply_texture_transforms: bool = True) -> dict[str, Any]:
        """Env ``i``'s ``_get_obs_sensor_data``: its slice of the step's pictures, else of pictures taken now."""
        if self._pictures is not None and self._pictures[i] is not None and apply_texture_transforms:
            return self._pictures[i]
        g = next(g for g, part in enumerate(self._slices) if i in part)
        self._submit(g)
        return self._read(g, apply_texture_transforms)[self._slices[g].index(i)]

    def _submit(self, g: int) -> None:
        """Group ``g``'s sensor pictures at its envs' current poses, submitted (SAPIEN draws them meanwhile)."""
        renderer = self.renderers[g]
        renderer.set_poses_from_envs()
        renderer.take_pictures(list(renderer.envs[0].scene.sensors), sensor=True)

    def _read(self, g: int, apply_texture_transforms: bool = True) -> list[dict[str, Any]]:
        """Group ``g``'s envs' sensor data from its last pictures: brought to the host in one copy per camera
        and modality (the envs' observations are CPU data)."""
        renderer = self.renderers[g]
        base = renderer.envs[0]
        modalities = sensor_modalities(base)
        out: list[dict[str, Any]] = [{} for _ in renderer.envs]
        for name in base.scene.sensors:
            data = renderer.read_sensor_data(name, modalities, apply_texture_transforms)
            host = {k: v.cpu() for k, v in data.items()}
            for i, env_data in enumerate(out):
                env_data[name] = {k: v[i : i + 1] for k, v in host.items()}
        return out

    def step(self, actions: Any):
        per_env = list(gym.vector.utils.iterate(self.action_space, actions))
        ready = [False] * len(self.envs)
        submitted = []
        for g, part in enumerate(self._slices):  # group g draws while group g + 1 simulates
            for i in part:
                ready[i] = self.envs[i].get_wrapper_attr("prepare")(per_env[i])
            if any(ready[i] for i in part):
                self._submit(g)
                submitted.append(g)
        if submitted:
            self._pictures = [None] * len(self.envs)
            for g in submitted:
                for i, data in zip(self._slices[g], self._read(g)):
                    self._pictures[i] = data if ready[i] else None
        try:
            return gym.vector.SyncVectorEnv.step(self, actions)
        finally:
            self._pictures = None

    def render(self) -> torch.Tensor:
        """Every env's human camera pictures: ``[num_envs, H, W, 3]`` uint8 on the CUDA device (several cameras:
        side by side, as ManiSkill tiles them)."""
        frames = []
        for renderer in self.renderers:
            renderer.set_poses_from_envs()
            names = list(renderer.envs[0].scene.human_render_cameras)
            shots = [renderer.render(name, sensor=False) for name in names]
            frames.append(shots[0] if len(shots) == 1 else torch.cat(shots, dim=2))
        return frames[0] if len(frames) == 1 else torch.cat(frames, dim=0)
