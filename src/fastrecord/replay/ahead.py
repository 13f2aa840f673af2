"""A replay's envs each in a process of its own that draws its own cameras, one step ahead of this process:
`AheadReplayVectorEnv` (``--vector async`` where the envs are not drawn in one batch; the default where the CPU draws
them, lavapipe, and one process holds several).

Where the CPU draws (Mesa's lavapipe), a process draws its pictures one after another (on the 2-core machine two
PickCube envs in one process took 37 ms an env-step with 64x64 sensors, one env alone 44 ms; the same two in two
processes 22.5 ms). So each env here has a process of its own (`fastrecord.packed.PackedVectorEnv`, one env a
process). A replay is a script (every action is recorded), so each process, once it has answered a step, runs its
env's whole next step (`AheadReporter.run_ahead`: physics, the recorded state, the observation with its pictures,
the reward, the video frame) while this process records the step it answered: the recorder's work and the envs'
overlap. gymnasium's ``AsyncVectorEnv`` (what ``--vector async`` ran before) made every step wait for this process's
recorder, asked each sub-env for its state after each step (a second round trip, a torch tensor through shared
memory), and built a dummy env in this process before starting.

Each step's answer carries what the recorder reads of that step, so nothing is asked of a sub-env that may be a step
ahead: the env state (`fastrecord.replay.mirrored.STATE_KEY`, answered to ``call("get_state")``) and, with
``frames`` (videos of the render camera), the env's own ``render()`` of the step (`FRAME_KEY`, what ``render()``
here returns). As `fastrecord.replay.mirrored.MirroredReplayVectorEnv` (the same run ahead, drawn in this process on
a GPU).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, SupportsFloat

import gymnasium as gym
import numpy as np
import torch

from fastrecord.envs import to_numpy

STATE_KEY = "fastrecord_state"  # a sub-env's env state after its step or reset, in its info
FRAME_KEY = "fastrecord_frame"  # a sub-env's render() of the step or reset it answers, in its info (with frames)


class RunsAhead(gym.Wrapper):
    """A replay sub-env (in its own process) that runs its next step ahead: `AheadReporter` here,
    `fastrecord.replay.mirrored.ReplayReporter` (drawn elsewhere). Subclasses answer a step in ``_step`` (its info
    carrying the env state under `STATE_KEY`) and set ``_answered`` at a reset.

    Owns: the step it ran ahead (`run_ahead`: its action and its answer) until the step that takes it, and the state
    of the last step or reset answered (`get_state`)."""

    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        self._ahead: tuple[np.ndarray, tuple] | None = None
        self._answered: np.ndarray | None = None

    def get_state(self) -> np.ndarray:
        """The state of the last reset or step answered, not that of a step run ahead since (the caller answers the
        recorder from the reports without asking)."""
        if self._answered is None:
            raise RuntimeError("get_state before the first reset: reset the env first")
        return self._answered

    def run_ahead(self, action: Any) -> None:
        """The whole next step with ``action`` (the step after the one just answered), while the caller records the
        one just answered (`fastrecord.packed.PackedVectorEnv.step_ahead`); the step that follows answers with it."""
        self._ahead = None
        self._ahead = (np.array(action, copy=True), self._step(action))

    def step(self, action: Any) -> tuple[Any, SupportsFloat, bool, bool, dict[str, Any]]:
        if self._ahead is None:
            answer = self._step(action)
        else:
            ran, answer = self._ahead
            self._ahead = None
            if not np.array_equal(ran, np.asarray(action)):
                raise RuntimeError("this sub-env ran its next step ahead with another action than its step's: a bug in "
                                   "the replay loop's lookahead")
        self._answered = answer[4][STATE_KEY]
        return answer

    def _step(self, action: Any) -> tuple[Any, SupportsFloat, bool, bool, dict[str, Any]]:
        raise NotImplementedError


class AheadReporter(RunsAhead):
    """Wraps one replay sub-env (`fastrecord.replay.envs.make_replay_env`'s, outermost, in its own process) that draws
    its own cameras: every step's and reset's info carries the env state (`STATE_KEY`) and, with ``frames``, the
    env's frame of it (`FRAME_KEY`)."""

    def __init__(self, env: gym.Env, frames: bool = False) -> None:
        super().__init__(env)
        self.frames = frames
        self._replay: Any = env.get_wrapper_attr("replay_states")

    def _report(self, info: dict[str, Any]) -> dict[str, Any]:
        info = dict(info)
        info[STATE_KEY] = to_numpy(self._replay.get_state())
        if self.frames:
            info[FRAME_KEY] = np.asarray(to_numpy(self.env.render()))
        return info

    def reset(self, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        self._ahead = None  # a step run ahead that is not taken (the loop reset the env instead) is dropped
        obs, info = self.env.reset(**kwargs)
        info = self._report(info)
        self._answered = info[STATE_KEY]
        return obs, info

    def _step(self, action: Any) -> tuple[Any, SupportsFloat, bool, bool, dict[str, Any]]:
        obs, rew, terminated, truncated, info = self.env.step(action)
        return obs, rew, terminated, truncated, self._report(info)


class _AheadSubenv:
    """Makes one sub-env in its process: the replay env ``thunk`` makes (`fastrecord.replay.envs.in_worker`'s: the
    process ignores Ctrl-C), under `AheadReporter`. Picklable."""

    def __init__(self, thunk: Callable[[], gym.Env], frames: bool) -> None:
        self.thunk, self.frames = thunk, frames

    def __call__(self) -> gym.Env:
        return AheadReporter(self.thunk(), frames=self.frames)


class AheadReplayVectorEnv(gym.vector.VectorWrapper):
    """A vector env of replay sub-envs (`AheadReporter`, one a `fastrecord.packed.PackedVectorEnv` process) that run
    each step ahead once they answered the one before.

    Owns: each sub-env's last reported state and frame, and ``lookahead`` (each env's next action, None where its
    episode ends: set by the replay loop before a step, used by that step only)."""

    answers_calls = True  # `call("get_state")`, from the reports; fastrecord's vector wrappers above ask it first
    renders_batched = True  # fastrecord's VectorEnvView calls render() (the reported frames), not call("render")
    resets_async = True  # reset_async / reset_wait

    def __init__(self, env: gym.vector.VectorEnv, frames: bool) -> None:
        super().__init__(env)
        self._sub: Any = env  # a PackedVectorEnv: call, get_attr, set_attr, reset_async, step_ahead
        self.frames = frames
        self._states: list[np.ndarray | None] = [None] * self.num_envs
        self._frames: list[np.ndarray | None] = [None] * self.num_envs
        self.lookahead: list[Any] | None = None

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
        """As the sub-envs' ``call``; ``get_state`` is answered from their last reports (they may be running the next
        step ahead: their report is the state their last step observed)."""
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
        ahead, self.lookahead = self.lookahead, None
        if ahead is not None and any(a is not None for a in ahead):
            obs, rew, terminated, truncated, info = self._sub.step_ahead(actions, ahead)
        else:
            obs, rew, terminated, truncated, info = self._sub.step(actions)
        return obs, rew, terminated, truncated, self._take(info)

    def render(self) -> torch.Tensor:  # type: ignore[override]  # batched, as ManiSkill's BaseEnv.render
        """Every env's frame of the step or reset it last answered, ``[num_envs, H, W, 3]``."""
        if not self.frames:
            raise RuntimeError("render() of an AheadReplayVectorEnv made with frames=False: its sub-envs report no "
                               "frames; make it with frames=True (videos of the render camera)")
        if any(f is None for f in self._frames):
            raise RuntimeError("render() before reset(): reset the envs first")
        return torch.from_numpy(np.stack([f.reshape(f.shape[-3:]) for f in self._frames if f is not None]))

    def close(self, **kwargs: Any) -> None:
        """The sub-envs play recorded states and hold nothing to save: their processes end at once."""
        kwargs.setdefault("terminate", True)
        self.env.close(**kwargs)


def ahead_replay_env(thunk: Callable[[], gym.Env], num_envs: int, frames: bool) -> AheadReplayVectorEnv:
    """``num_envs`` replay envs (each made by ``thunk`` in a process of its own, started by the forkserver: ManiSkill
    imported), autoreset disabled, run ahead; ``frames``: each step's answer carries the env's frame (videos)."""
    from fastrecord.packed import PackedVectorEnv
    from fastrecord.workers import forkserver_context

    forkserver_context()  # its sub-envs start with ManiSkill imported
    subenv = _AheadSubenv(thunk, frames)
    mode = gym.vector.AutoresetMode.DISABLED
    envs = PackedVectorEnv([subenv] * num_envs, 1, context="forkserver", autoreset_mode=mode)
    return AheadReplayVectorEnv(envs, frames)
