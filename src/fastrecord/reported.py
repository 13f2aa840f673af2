"""CPU envs each in a process of its own that answer every step with what the recorder reads of it: the env state and,
for videos, the env's own frame (`ReportedVectorEnv`). `fastrecord record --num-envs N` where the CPU draws (lavapipe),
and the base of the replay's run-ahead envs (`fastrecord.replay.ahead`).

Where the CPU draws, a process draws its pictures one after another: on the 2-core machine two PickCube envs with a
128x128 camera in one process (gymnasium's ``SyncVectorEnv``) stepped and drew at 19-23 env-steps/s, the same two in
two processes answering with their frames at 29 (512x512: 13-14 against 16). gymnasium's ``AsyncVectorEnv`` would
take three round trips a step (the step, ``call("render")``, ``call("get_state")``); here each sub-env
(`StepReporter`) puts its env state (`STATE_KEY`) and, with ``frames``, its ``render()`` (`FRAME_KEY`) into the
step's info, and `ReportedVectorEnv` answers the recorder's ``call("get_state")`` and ``render()`` from those
reports: one round trip a step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, SupportsFloat

import gymnasium as gym
import numpy as np
import torch

from fastrecord.envs import to_numpy

__all__ = ["FRAME_KEY", "STATE_KEY", "InfoReporter", "ReportedVectorEnv", "StepReporter", "reported_info",
           "reported_vector_env"]

STATE_KEY = "fastrecord_state"  # a sub-env's env state after its step or reset, in its info
FRAME_KEY = "fastrecord_frame"  # a sub-env's render() of the step or reset it answers, in its info (with frames)


def reported_info(info: dict[str, Any], state: Any, frame: Callable[[], Any] | None) -> dict[str, Any]:
    """``info`` with the env ``state`` under `STATE_KEY` and, where ``frame`` is given, its value under `FRAME_KEY`
    (numpy both: they cross to the caller's process)."""
    info = dict(info)
    info[STATE_KEY] = to_numpy(state)
    if frame is not None:
        info[FRAME_KEY] = np.asarray(to_numpy(frame()))
    return info


class InfoReporter(gym.Wrapper):
    """A sub-env wrapper (outermost, in the sub-env's process) whose every reset's and step's info goes through
    ``_report`` (what the caller's process reads of it): `StepReporter` here, the batched render's
    `fastrecord.render.vector.PoseReporter`."""

    def _report(self, info: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    def reset(self, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        obs, info = self.env.reset(**kwargs)
        return obs, self._report(info)

    def step(self, action: Any) -> tuple[Any, SupportsFloat, bool, bool, dict[str, Any]]:
        obs, rew, terminated, truncated, info = self.env.step(action)
        return obs, rew, terminated, truncated, self._report(info)


class StepReporter(InfoReporter):
    """Wraps one CPU sub-env (outermost, in its own process): every step's and reset's info carries the env state
    (``env.unwrapped.get_state()``, what the recorder asks a sub-env for) and, with ``frames``, the env's
    ``render()``."""

    def __init__(self, env: gym.Env, frames: bool = False) -> None:
        super().__init__(env)
        self.frames = frames

    def _report(self, info: dict[str, Any]) -> dict[str, Any]:
        base: Any = self.env.unwrapped  # ManiSkill's BaseEnv
        return reported_info(info, base.get_state(), self.env.render if self.frames else None)


class ReportedVectorEnv(gym.vector.VectorWrapper):
    """A vector env of sub-envs that report their state (and with ``frames`` their frame) with each step and reset
    (a `fastrecord.packed.PackedVectorEnv`, one sub-env a process): ``call("get_state")`` and ``render()`` are answered
    from the last reports, without asking the sub-envs.

    Owns: each sub-env's last reported state and frame."""

    answers_calls = True  # `call("get_state")`, from the reports; fastrecord's vector wrappers above ask it first
    renders_batched = True  # fastrecord's VectorEnvView calls render() (the reported frames), not call("render")
    resets_async = True  # reset_async / reset_wait

    def __init__(self, env: gym.vector.VectorEnv, frames: bool) -> None:
        super().__init__(env)
        self._sub: Any = env  # a PackedVectorEnv: call, get_attr, set_attr, reset_async, step_ahead
        self.frames = frames
        self._states: list[np.ndarray | None] = [None] * self.num_envs
        self._frames: list[np.ndarray | None] = [None] * self.num_envs

    def _take(self, info: dict[str, Any]) -> dict[str, Any]:
        info = dict(info)
        for key, into in ((STATE_KEY, self._states), (FRAME_KEY, self._frames)):
            values = info.pop(key, None)
            mask = info.pop("_" + key, None)
            if values is None:
                continue
            for j in np.flatnonzero(mask if mask is not None else np.ones(self.num_envs, dtype=bool)):
                into[j] = values[j]
        return info

    def call(self, name: str, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """As the sub-envs' ``call``; ``get_state`` is answered from their last reports (the state their last step or
        reset observed; a replay's sub-env may be running its next step ahead meanwhile)."""
        if name == "get_state" and not args and not kwargs and all(s is not None for s in self._states):
            return tuple(self._states)
        return self._sub.call(name, *args, **kwargs)

    def get_attr(self, name: str) -> tuple[Any, ...]:
        return self._sub.get_attr(name)

    def set_attr(self, name: str, values: Any) -> None:
        self._sub.set_attr(name, values)

    def reset(self, *, seed: Any = None, options: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
        obs, info = self.env.reset(seed=seed, options=options)
        return obs, self._take(info)

    def reset_async(self, *, seed: Any = None, options: dict[str, Any] | None = None) -> None:
        self._sub.reset_async(seed=seed, options=options)

    def reset_wait(self) -> tuple[Any, dict[str, Any]]:
        obs, info = self._sub.reset_wait()
        return obs, self._take(info)

    def step(self, actions: Any) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        obs, rew, terminated, truncated, info = self._sub.step(actions)
        return obs, rew, terminated, truncated, self._take(info)

    def render(self) -> torch.Tensor:  # type: ignore[override]  # batched, as ManiSkill's BaseEnv.render
        """Every env's frame of the step or reset it last answered, ``[num_envs, H, W, 3]``."""
        if not self.frames:
            raise RuntimeError(f"render() of a {type(self).__name__} made with frames=False: its sub-envs report no "
                               f"frames; make it with frames=True (videos of the render camera)")
        if any(f is None for f in self._frames):
            raise RuntimeError("render() before reset(): reset the envs first")
        return torch.from_numpy(np.stack([f.reshape(f.shape[-3:]) for f in self._frames if f is not None]))

    def close(self, **kwargs: Any) -> None:
        """The sub-envs hold nothing to save (the recorder is in this process): their processes end at once."""
        kwargs.setdefault("terminate", True)
        self.env.close(**kwargs)


def reported_vector_env(env_fn: Callable[[], gym.Env], num_envs: int, frames: bool,
                        autoreset_mode: gym.vector.AutoresetMode = gym.vector.AutoresetMode.DISABLED,
                        ) -> ReportedVectorEnv:
    """``num_envs`` envs made by ``env_fn`` (picklable; its env is wrapped in `StepReporter` there), each in a process
    of its own started by the forkserver (ManiSkill imported); ``frames``: each answer carries the env's frame."""
    from fastrecord.packed import PackedVectorEnv
    from fastrecord.workers import forkserver_context

    forkserver_context()  # its sub-envs start with ManiSkill imported
    envs = PackedVectorEnv([_Reporting(env_fn, frames)] * num_envs, 1, context="forkserver",
                           autoreset_mode=autoreset_mode)
    return ReportedVectorEnv(envs, frames)


class _Reporting:
    """Makes one sub-env in its process: ``env_fn``'s env under `StepReporter`. Picklable."""

    def __init__(self, env_fn: Callable[[], gym.Env], frames: bool) -> None:
        self.env_fn, self.frames = env_fn, frames

    def __call__(self) -> gym.Env:
        return StepReporter(self.env_fn(), frames=self.frames)
