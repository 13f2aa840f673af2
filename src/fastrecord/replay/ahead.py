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
ahead: the env state (`fastrecord.reported.STATE_KEY`, answered to ``call("get_state")``) and, with ``frames``
(videos of the render camera), the env's own ``render()`` of the step (`fastrecord.reported.FRAME_KEY`, what
``render()`` here returns), as `fastrecord.record`'s sub-envs report theirs (`fastrecord.reported`, without running
ahead: a policy's next action waits for the step's observation). As
`fastrecord.replay.mirrored.MirroredReplayVectorEnv` (the same run ahead, drawn in this process on a GPU).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, SupportsFloat

import gymnasium as gym
import numpy as np

from fastrecord.reported import STATE_KEY, ReportedVectorEnv, reported_info


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
    env's frame of it (`fastrecord.reported.FRAME_KEY`)."""

    def __init__(self, env: gym.Env, frames: bool = False) -> None:
        super().__init__(env)
        self.frames = frames
        self._replay: Any = env.get_wrapper_attr("replay_states")

    def _report(self, info: dict[str, Any]) -> dict[str, Any]:
        return reported_info(info, self._replay.get_state(), self.env.render if self.frames else None)

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


class AheadReplayVectorEnv(ReportedVectorEnv):
    """A vector env of replay sub-envs (`AheadReporter`, one a `fastrecord.packed.PackedVectorEnv` process) that run
    each step ahead once they answered the one before; ``get_state`` and ``render()`` are answered from their reports
    (`fastrecord.reported.ReportedVectorEnv`).

    Owns: ``lookahead`` (each env's next action, None where its episode ends: set by the replay loop before a step,
    used by that step only)."""

    def __init__(self, env: gym.vector.VectorEnv, frames: bool) -> None:
        super().__init__(env, frames)
        self.lookahead: list[Any] | None = None

    def step(self, actions: Any) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        ahead, self.lookahead = self.lookahead, None
        if ahead is not None and any(a is not None for a in ahead):
            obs, rew, terminated, truncated, info = self._sub.step_ahead(actions, ahead)
        else:
            obs, rew, terminated, truncated, info = self._sub.step(actions)
        return obs, rew, terminated, truncated, self._take(info)


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
