"""Frames after every physics substep: ``render_substeps=True``, with ManiSkill 3.0.1's meaning.

ManiSkill's ``RecordEpisode(render_substeps=True)`` replaces the env's ``BaseEnv._after_simulation_step``
(called after each of the ``sim_steps_per_control`` physics steps of one ``env.step``) by a function that
also renders a frame (after ``scene._gpu_fetch_all()`` on GPU simulation), and still captures its usual
frame after the step: a step adds ``sim_steps_per_control + 1`` frames to the video (the last substep's
picture and the step's own show the same state; the info overlay is on the step's only), an episode of T
steps has ``1 + T * (sim_steps_per_control + 1)`` frames. fastrecord records the same frames.

`SubstepCapture` is that hook on one ManiSkill env in this process: off until switched on, it copies each
substep's frame into a preallocated ``[num_envs, substeps, H, W, 3]`` tensor on the frame's device, which
the recorder takes after the step. The views (`fastrecord.envs`) attach it to a ManiSkill env (one env or
a GPU-batched one) and to each sub-env of a ``SyncVectorEnv``. The sub-envs of an ``AsyncVectorEnv`` live
in other processes, where nothing of the recorder's runs: wrap each in `SubstepFrames` in the vector env's
env functions, and the sub-env renders its substeps in its own process and hands the frames back through
the vector env's ``call``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np
import torch

ATTR = "_fastrecord_substeps"  # where a ManiSkill env keeps its `SubstepCapture`
TAKE = "fastrecord_substep_frames"  # `SubstepFrames`' method names, called through a vector env's `call`
SWITCH = "fastrecord_substep_capture"


def sim_steps_per_control(base: Any) -> int:
    """The physics steps of one ``env.step`` of ManiSkill env ``base`` (its ``BaseEnv``), or a ValueError
    naming what is missing."""
    n = getattr(base, "_sim_steps_per_control", None)
    if not callable(getattr(base, "_after_simulation_step", None)) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(
            f"render_substeps=True hooks the physics substeps of a ManiSkill env (BaseEnv._after_simulation_step and "
            f"_sim_steps_per_control); {type(base).__name__} has no such hook. Record ManiSkill envs, or pass "
            f"render_substeps=False"
        )
    return int(n)


class SubstepCapture:
    """Owns: the hook on one ManiSkill env's ``_after_simulation_step``, the on/off switch, and the frames of
    the substeps since the last `take` (``[num_envs, substeps, H, W, 3]``, preallocated on the frames'
    device at the first capture)."""

    def __init__(self, base: Any, render: Callable[[], Any]) -> None:
        self.base = base
        self.render = render
        self.substeps = sim_steps_per_control(base)
        self.active = False
        self._frames: torch.Tensor | None = None
        self._count = 0
        self._before = vars(base).get("_after_simulation_step")  # an instance hook already there (ManiSkill's wrapper)
        original = base._after_simulation_step

        def after_simulation_step() -> None:
            original()
            if self.active:
                self._capture()

        base._after_simulation_step = after_simulation_step
        setattr(base, ATTR, self)

    @classmethod
    def attach(cls, base: Any, render: Callable[[], Any]) -> SubstepCapture:
        """The capture of ManiSkill env ``base``: the one already attached (by a `SubstepFrames`), else a new
        one that renders with ``render`` (the env's ``render`` seen through its wrappers)."""
        have = vars(base).get(ATTR)
        return have if isinstance(have, SubstepCapture) else cls(base, render)

    def _capture(self) -> None:
        if getattr(self.base, "gpu_sim_enabled", False):
            self.base.scene._gpu_fetch_all()  # as ManiSkill's hook: the poses the renderer reads
        img = self.render()
        img = img if isinstance(img, torch.Tensor) else torch.from_numpy(np.asarray(img))
        if img.ndim == 3:
            img = img[None]
        if self._count >= self.substeps:  # a second step without a take (frames not recorded): start over
            self._count = 0
        if self._frames is None or self._frames.shape[2:] != img.shape[1:] or self._frames.shape[0] != img.shape[0] \
                or self._frames.device != img.device or self._frames.dtype != img.dtype:
            self._frames = torch.empty(
                (img.shape[0], self.substeps, *img.shape[1:]), dtype=img.dtype, device=img.device
            )
        self._frames[:, self._count].copy_(img)  # a copy now: a GPU render's picture is reused by the next
        self._count += 1

    def take(self) -> torch.Tensor | None:
        """The frames of the substeps of the last step, ``[num_envs, substeps, H, W, 3]`` (valid until the
        next step), or None when the last step captured none (switched off, or the env was reset instead)."""
        n, self._count = self._count, 0
        if n == 0 or self._frames is None:
            return None
        if n != self.substeps:
            raise RuntimeError(f"the env ran {n} physics substeps since the last step's frames were taken, "
                               f"not sim_steps_per_control={self.substeps}")
        return self._frames

    def detach(self) -> None:
        """Put the env's ``_after_simulation_step`` back as it was before `attach`."""
        if vars(self.base).get(ATTR) is not self:
            return
        if self._before is None:
            vars(self.base).pop("_after_simulation_step", None)
        else:
            self.base._after_simulation_step = self._before
        vars(self.base).pop(ATTR, None)


class SubstepFrames(gym.Wrapper):
    """A sub-env wrapper for ``render_substeps=True`` on an ``AsyncVectorEnv``: the sub-env renders a frame
    after each physics substep in its own process, and the recorder takes them through the vector env's
    ``call``. Costs nothing until a recorder switches it on.

        envs = gym.vector.AsyncVectorEnv([lambda: SubstepFrames(gym.make("PickCube-v1", render_mode="rgb_array"))] * 4)
        envs = fastrecord.RecordEpisode(envs, "videos", render_substeps=True)

    (``make_eval_envs(..., wrappers=[SubstepFrames])`` adds it to its CPU sub-envs.) A ``SyncVectorEnv``
    or a single env needs no wrapper: the recorder hooks them itself."""

    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        sim_steps_per_control(env.unwrapped)  # a clear error at construction for an env without substeps
        self._capture: SubstepCapture | None = None

    def fastrecord_substep_capture(self, on: bool) -> int:
        """Switch capturing on or off; returns the env's ``sim_steps_per_control``."""
        base = self.env.unwrapped
        capture = self._capture if vars(base).get(ATTR) is self._capture else None
        if capture is None:  # first use, or detached by a recorder
            capture = SubstepCapture.attach(base, self.env.render)
            self._capture = capture
        capture.active = bool(on)
        return capture.substeps

    def fastrecord_substep_frames(self) -> np.ndarray | None:
        """The substep frames of the last step, ``[substeps, H, W, 3]`` uint8, or None (none captured)."""
        frames = None if self._capture is None else self._capture.take()
        return None if frames is None else frames[0].cpu().numpy()

    def close(self) -> None:
        if self._capture is not None:
            self._capture.detach()
            self._capture = None
        super().close()


def step_frames(post: torch.Tensor, substeps: list[torch.Tensor | None], count: int) -> torch.Tensor:
    """One step's frames of every env, ``[num_envs, count + 1, H, W, 3]``: each env's ``count`` substep frames
    (``substeps[e]``, ``[count, H, W, 3]``; None: the env was reset rather than stepped, its step's frame
    ``post[e]`` stands in) followed by its frame after the step, ``post[e]``."""
    out = post[:, None].repeat(1, count + 1, *([1] * (post.ndim - 1)))
    for e, sub in enumerate(substeps):
        if sub is not None:
            sub = torch.as_tensor(sub)
            if tuple(sub.shape) != (count, *post.shape[1:]):
                raise ValueError(
                    f"env {e} gave substep frames of shape {list(sub.shape)}; expected {[count, *post.shape[1:]]} "
                    f"(sim_steps_per_control and the video camera must be the same in every sub-env)"
                )
            out[e, :count] = sub.to(out.device)
    return out
