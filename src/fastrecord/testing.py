"""The test double: a small batched env following ManiSkill's GPU-parallel env contract.

ManiSkill allows one env per process on the CPU, so ``num_envs > 1`` batched-tensor semantics cannot
be exercised with a real ManiSkill env on the CI machine. `BatchedDoubleEnv` stands in for
``mani_skill.envs.sapien_env.BaseEnv`` with ``num_envs = N`` (wrapped in its TimeLimit), following the
parts of its contract the recorder relies on:

- every output is a batched torch tensor ``[N, ...]`` on ``device``; actions ``[N, A]``;
- ``reset(seed=..., options={"env_idx": idx})`` resets only ``idx`` and returns obs for all envs, with
  ``info["reconfigure"]``; ``_episode_seed`` holds the per-env episode seeds;
- ``step`` returns ``(obs, reward [N], terminated [N], truncated [N], info)`` with ``info["success"]``,
  ``info["fail"]`` and ``info["elapsed_steps"]``; ``terminated = success | fail``; truncation once an
  env has taken its episode's length in steps (ManiSkill's TimeLimit semantics on the GPU: no
  auto-reset, the caller resets);
- ``render()`` returns ``[N, H, W, 3]`` uint8 on ``device`` in one call;
- ``step`` runs ``_sim_steps_per_control`` physics substeps (``sim_steps_per_control``, default 1), each
  moving the state by its share of the action and followed by ``_after_simulation_step()`` (the hook
  ``render_substeps`` uses; ``scene._gpu_fetch_all()`` exists, counted, for the GPU sim's fetch);
- ``get_state_dict()`` returns ``{"actors": {...}, "articulations": {...}}`` of ``[N, D]`` tensors;
- observations follow ``obs_mode``: ``"state"`` a flat ``[N, 4]`` tensor; ``"rgb"`` ManiSkill's dict of
  an rgb observation (``agent/{qpos,qvel}``, ``extra/{tcp_pose,goal_pos,is_grasped}``,
  ``sensor_param/<camera>/{extrinsic_cv,cam2world_gl,intrinsic_cv}``, ``sensor_data/<camera>/rgb``
  ``[N, H, W, 3]`` uint8), the camera showing the same frames as ``render()``.

It is the one double of tests, benchmark (``benchmarks/``, run by ``fastrecord bench``) and profiler
(``benchmarks/profile_step.py``):

- frames: by default deterministic functions of (env, state) (`frames_for`), so a test can recompute
  what was rendered and compare decoded video frames with it: a wrong env or a shifted frame changes
  the picture. With ``bank`` (clips rendered by a real task, or synthetic), env ``e`` at step ``t`` of
  its episode shows ``bank[e % clips, min(t, frames - 1)]``: one gather on the device per render.
- episode lengths: ``max_episode_steps`` for every env, or per env (``episode_lengths``: a list, or a
  function of the env and its episode seed called at each reset), so episodes end at different steps.
- cost: ``sim_seconds`` of sleep per step emulates simulation time; ``busy_seconds`` sums the time
  spent inside ``step``, ``render`` and ``reset`` (a benchmark subtracts it to get the recorder's own).

Per-env state lives in ``[N]`` tensors updated with masks: no Python loop over envs in ``step`` or
``render`` (``reset`` loops over the envs it resets to draw their start states and lengths).

Clip banks for ``bank``: `gradient_clips` (synthetic), `maniskill_clips` (a real task's human camera),
`sensor_clips` (a real task's sensor camera, the frames of an rgb observation), `make_bank` (shifted
copies, so neighbouring envs differ), and `source_env` (the double replaying a bank). Picture checks:
`psnr`, `frame_psnr`, `smooth_frames`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import gymnasium as gym
import numpy as np
import torch

EpisodeLengths = Sequence[int] | Callable[[int, int], int]
OBS_MODES = ("state", "rgb")


class BatchedDoubleEnv(gym.Env):
    """Owns: the batched state (``pos [N, 3]``, ``elapsed_steps [N]``, per-env episode seeds and lengths),
    the frame source (`frames_for` or a clip bank on ``device``), and the counters ``render_calls`` and
    ``busy_seconds``."""

    metadata: ClassVar[dict[str, Any]] = {"render_modes": ["rgb_array"]}  # type: ignore[misc]  # Env's, shared

    def __init__(
        self,
        num_envs: int = 4,
        max_episode_steps: int = 8,
        size: int = 32,
        device: str | torch.device = "cpu",
        success_step: list[int] | None = None,
        render_mode: str | None = "rgb_array",
        *,
        bank: np.ndarray | torch.Tensor | None = None,
        sim_seconds: float = 0.0,
        episode_lengths: EpisodeLengths | None = None,
        fail_step: list[int] | None = None,
        obs_mode: str = "state",
        camera: str = "base_camera",
        sim_steps_per_control: int = 1,
    ) -> None:
        """
        Args:
            num_envs: parallel envs ``N``.
            max_episode_steps: the TimeLimit: truncation after this many steps (the bound of ``episode_lengths``).
            size: side of the square `frames_for` frames (with ``bank`` the frames are the bank's ``H x W``).
            device: where every tensor lives (``cuda`` also sets ``gpu_sim_enabled``).
            success_step: env ``e`` succeeds (and terminates) once it has taken ``success_step[e]`` steps; 0 = never.
            render_mode: ``"rgb_array"`` (kept for wrappers that check it).
            bank: ``[clips, frames, H, W, 3]`` uint8 clips (numpy or torch) replayed instead of `frames_for`.
            sim_seconds: sleep per ``step``, emulating simulation time.
            episode_lengths: per-env episode length: ``[N]`` ints, or ``f(env_idx, episode_seed) -> int``
                called for each env at each of its resets; ``None``: ``max_episode_steps`` for all.
            fail_step: like ``success_step`` for ``info["fail"]``; 0 = never.
            obs_mode: ``"state"`` (a ``[N, 4]`` tensor) or ``"rgb"`` (ManiSkill's rgb observation dict,
                state leaves + ``sensor_data/<camera>/rgb``).
            camera: the sensor camera's name under ``obs_mode="rgb"``.
            sim_steps_per_control: physics substeps of a step, each followed by ``_after_simulation_step()``.
        """
        if obs_mode not in OBS_MODES:
            raise ValueError(f"obs_mode={obs_mode!r} is unknown; BatchedDoubleEnv has {OBS_MODES} (ManiSkill's names)")
        self.num_envs = num_envs
        self.device = torch.device(device)
        self.max_episode_steps = max_episode_steps
        self.size = size
        self.render_mode = render_mode
        self.control_mode = "pd_joint_delta_pos"
        self.reconfiguration_freq = 0
        self.gpu_sim_enabled = self.device.type == "cuda"
        self.success_step = self._per_env("success_step", success_step)
        self.fail_step = self._per_env("fail_step", fail_step)
        self.sim_seconds = sim_seconds
        self.single_action_space = gym.spaces.Box(-1, 1, (3,), np.float32)
        self.action_space = gym.spaces.Box(-1, 1, (num_envs, 3), np.float32)
        self.obs_mode = obs_mode
        self.camera = camera
        self.pos = torch.zeros(num_envs, 3, device=self.device)
        self.elapsed_steps = torch.zeros(num_envs, dtype=torch.int32, device=self.device)
        self._episode_seed = np.zeros(num_envs, dtype=np.int64)
        self.render_calls = 0
        self.busy_seconds = 0.0
        if (
            isinstance(sim_steps_per_control, bool)
            or not isinstance(sim_steps_per_control, int)
            or sim_steps_per_control < 1
        ):
            raise ValueError(
                f"sim_steps_per_control={sim_steps_per_control!r} must be an integer >= 1 (physics substeps a step)"
            )
        self._sim_steps_per_control = sim_steps_per_control
        self.scene = _DoubleScene()

        self._set_bank(bank)
        self._set_lengths(episode_lengths)
        self.single_observation_space = _space(self._obs(), batched=False)
        self.observation_space = _space(self._obs(), batched=True)

    def _set_bank(self, bank: np.ndarray | torch.Tensor | None) -> None:
        """The clip bank's tensors on ``self.device`` (``bank`` checked: `__init__`'s argument)."""
        self.bank: torch.Tensor | None = None
        if bank is not None:
            bank = torch.as_tensor(bank)
            if bank.ndim != 5 or bank.shape[-1] != 3 or bank.dtype != torch.uint8 or 0 in bank.shape:
                raise ValueError(f"bank has shape {list(bank.shape)} {bank.dtype}; BatchedDoubleEnv needs "
                                 f"[clips, frames, H, W, 3] uint8 (e.g. gradient_clips(2, 11, 64, 64))")
            self.bank = bank.to(self.device)
            # env e shows clip e % clips: frame (clip, t) is row clip * frames + t of the flat bank, so a
            # render is one index_select (torch's CPU advanced indexing is far slower for image rows)
            self._bank_rows = self.bank.view(-1, *self.bank.shape[2:])
            self._clip_row = (torch.arange(self.num_envs, device=self.device) % bank.shape[0]) * bank.shape[1]
            self._last_frame = bank.shape[1] - 1

    def _set_lengths(self, episode_lengths: EpisodeLengths | None) -> None:
        """Each env's episode length (``episode_lengths`` checked: `__init__`'s argument)."""
        self._length_fn: Callable[[int, int], int] | None = None
        self._lengths = torch.full((self.num_envs,), self.max_episode_steps, dtype=torch.int32, device=self.device)
        if callable(episode_lengths):
            self._length_fn = episode_lengths
        elif episode_lengths is not None:
            lengths = [int(n) for n in episode_lengths]
            if len(lengths) != self.num_envs:
                raise ValueError(f"episode_lengths has {len(lengths)} entries for num_envs={self.num_envs}; "
                                 f"give one length per env, or a function (env_idx, episode_seed) -> length")
            self._check_lengths(lengths, list(range(self.num_envs)))
            self._lengths[:] = torch.tensor(lengths, dtype=torch.int32)

    def _per_env(self, name: str, steps: list[int] | None) -> torch.Tensor:
        steps = [0] * self.num_envs if steps is None else list(steps)
        if len(steps) != self.num_envs:
            raise ValueError(
                f"{name} has {len(steps)} entries for num_envs={self.num_envs}; give one per env (0 = never)"
            )
        return torch.tensor(steps, device=self.device)

    def _check_lengths(self, lengths: list[int], envs: list[int]) -> None:
        bad = [(e, n) for e, n in zip(envs, lengths, strict=True) if not 1 <= n <= self.max_episode_steps]
        if bad:
            raise ValueError(f"episode_lengths {bad} ((env, length) pairs) are outside 1..max_episode_steps="
                             f"{self.max_episode_steps}; raise max_episode_steps (the TimeLimit) or shorten them")

    @property
    def episode_lengths(self) -> torch.Tensor:
        """``[N]`` int32 on ``device``: the step at which each env's current episode truncates."""
        return self._lengths

    # ------------------------------------------------------------------ contract
    def _obs(self) -> torch.Tensor | dict[str, Any]:
        flat = torch.cat([self.pos, self.elapsed_steps[:, None].float()], dim=1)
        if self.obs_mode == "state":
            return flat
        n, dev = self.num_envs, self.device
        qpos = torch.cat([self.pos, self.pos, self.elapsed_steps[:, None].float().expand(n, 3)], dim=1)  # [N, 9]
        cam = torch.eye(4, device=dev).expand(n, 4, 4).clone()
        cam[:, :3, 3] = self.pos
        return {
            "agent": {"qpos": qpos, "qvel": 0.1 * qpos},
            "extra": {
                "is_grasped": self.elapsed_steps % 2 == 1,
                "tcp_pose": torch.cat([self.pos, torch.ones(n, 1, device=dev), torch.zeros(n, 3, device=dev)], dim=1),
                "goal_pos": -self.pos,
            },
            "sensor_param": {
                self.camera: {
                    "extrinsic_cv": cam[:, :3, :4].contiguous(),
                    "cam2world_gl": cam,
                    "intrinsic_cv": torch.eye(3, device=dev).expand(n, 3, 3).clone(),
                }
            },
            "sensor_data": {self.camera: {"rgb": self._frames()}},
        }

    def _frames(self) -> torch.Tensor:
        if self.bank is None:
            return frames_for(self.pos, self.elapsed_steps, self.size)
        rows = self._clip_row + self.elapsed_steps.clamp(max=self._last_frame)
        if self.device.type == "cpu":  # numpy: torch's CPU gather waits for its intra-op threads on busy cores
            return torch.from_numpy(self._bank_rows.numpy()[rows.numpy()])
        return self._bank_rows.index_select(0, rows)

    def reset(self, *, seed: int | Sequence[int] | None = None,
              options: dict | None = None) -> tuple[Any, dict[str, Any]]:
        t0 = time.perf_counter()
        idx = (options or {}).get("env_idx")
        rows = (
            np.arange(self.num_envs)
            if idx is None
            else np.asarray(torch.as_tensor(idx).cpu(), dtype=np.int64).reshape(-1)
        )
        if seed is not None:
            seeds = np.atleast_1d(np.asarray(seed, dtype=np.int64))
            if len(seeds) == self.num_envs:  # ManiSkill: a list of num_envs seeds replaces every env's seed
                self._episode_seed[:] = seeds
            else:  # one seed per reset env, or a first seed counted up
                self._episode_seed[rows] = seeds if len(seeds) == len(rows) else seeds[0] + np.arange(len(rows))
        dev_rows = torch.as_tensor(rows, device=self.device)
        start = [torch.rand(3, generator=torch.Generator().manual_seed(int(self._episode_seed[e]))) for e in rows]
        if start:
            self.pos[dev_rows] = torch.stack(start).to(self.device)
        if self._length_fn is not None:
            lengths = [int(self._length_fn(int(e), int(self._episode_seed[e]))) for e in rows]
            self._check_lengths(lengths, rows.tolist())
            self._lengths[dev_rows] = torch.tensor(lengths, dtype=torch.int32).to(self.device)
        self.elapsed_steps[dev_rows] = 0
        obs = self._obs()
        self.busy_seconds += time.perf_counter() - t0
        return obs, {"reconfigure": False}

    def step(  # type: ignore[override]  # batched tensors, as ManiSkill's BaseEnv.step
        self, action: Any
    ) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor, dict[str, Any]]:
        t0 = time.perf_counter()
        if self.sim_seconds:
            time.sleep(self.sim_seconds)
        action = torch.as_tensor(action, dtype=torch.float32, device=self.device).reshape(self.num_envs, 3)
        if self._sim_steps_per_control == 1:
            self.pos += 0.1 * action
            self._after_simulation_step()
        else:
            for _ in range(self._sim_steps_per_control):  # ManiSkill's _step_action: physics, then the hook
                self.pos += (0.1 / self._sim_steps_per_control) * action
                self._after_simulation_step()
        self.elapsed_steps += 1
        success = (self.success_step > 0) & (self.elapsed_steps >= self.success_step)
        fail = (self.fail_step > 0) & (self.elapsed_steps >= self.fail_step)
        truncated = self.elapsed_steps >= self._lengths
        reward = self.pos.sum(dim=1)
        info = {"success": success, "fail": fail, "elapsed_steps": self.elapsed_steps.clone()}
        out = self._obs(), reward, success | fail, truncated, info
        self.busy_seconds += time.perf_counter() - t0
        return out

    def _after_simulation_step(self) -> None:
        """Called after each physics substep of a step (ManiSkill's hook; nothing by default)."""

    def render(self) -> torch.Tensor:  # type: ignore[override]  # batched tensors, as ManiSkill's BaseEnv.render
        t0 = time.perf_counter()
        self.render_calls += 1
        img = self._frames()
        self.busy_seconds += time.perf_counter() - t0
        return img

    def get_state_dict(self) -> dict:
        pose = torch.cat([self.pos, torch.zeros(self.num_envs, 10, device=self.device)], dim=1)
        return {"actors": {"box": pose}, "articulations": {"arm": self.elapsed_steps[:, None].float().repeat(1, 4)}}

    def set_state_dict(self, state: dict, env_idx: Any = None) -> None:
        """Box positions of all envs, or of ``env_idx`` (``state`` then has ``len(env_idx)`` rows), as ManiSkill."""
        pos = torch.as_tensor(state["actors"]["box"][:, :3], device=self.device)
        if env_idx is None:
            self.pos[:] = pos
        else:
            self.pos[torch.as_tensor(env_idx, device=self.device)] = pos


class _DoubleScene:
    """The part of ManiSkill's scene that ``render_substeps`` calls: ``_gpu_fetch_all`` (counted)."""

    def __init__(self) -> None:
        self.gpu_fetches = 0

    def _gpu_fetch_all(self) -> None:
        self.gpu_fetches += 1


def _space(obs: Any, batched: bool) -> gym.Space:
    """The observation space of an observation (tree) of ``[N, ...]`` tensors."""
    if isinstance(obs, dict):
        return gym.spaces.Dict({k: _space(v, batched) for k, v in obs.items()})
    shape = tuple(obs.shape) if batched else tuple(obs.shape[1:])
    if obs.dtype == torch.uint8:
        return gym.spaces.Box(0, 255, shape, np.uint8)
    if obs.dtype == torch.bool:
        return gym.spaces.Box(0, 1, shape, np.bool_)
    return gym.spaces.Box(-np.inf, np.inf, shape, np.float32)


def frames_for(
    pos: torch.Tensor, elapsed: torch.Tensor, size: int, env_idx: torch.Tensor | int | None = None
) -> torch.Tensor:
    """[N, size, size, 3] uint8: a smooth gradient whose offset encodes the env's state and step.

    Smooth content keeps H.264 at high PSNR; consecutive steps differ by far more than coding noise.
    """
    n = pos.shape[0]
    y = torch.arange(size, device=pos.device).view(1, size, 1)
    x = torch.arange(size, device=pos.device).view(1, 1, size)
    base = (pos[:, 0].view(n, 1, 1) * 60 + elapsed.view(n, 1, 1).float() * 23)
    def tri(v: torch.Tensor) -> torch.Tensor:  # a triangle wave: no wrap-around edges for the encoder to smear
        return 255 - ((v % 510) - 255).abs()

    r = tri(base + 2 * x)
    g = tri(base * 0.5 + 2 * y + 80)
    envs = (
        torch.arange(n, device=pos.device) if env_idx is None else torch.as_tensor(env_idx, device=pos.device).expand(n)
    )
    b = tri(envs.view(n, 1, 1) * 50 + x + y)
    return torch.stack([r.expand(n, size, size), g.expand(n, size, size), b.expand(n, size, size).float()], dim=-1).to(
        torch.uint8
    )


# ---------------------------------------------------------------------------------------------- clip banks
def gradient_clips(clips: int, frames: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    """``[clips, frames, H, W, 3]`` uint8 smooth moving gradients (triangle waves: no wrap edges)."""
    rng = np.random.default_rng(seed)
    y = np.arange(height, dtype=np.float32)[:, None]
    x = np.arange(width, dtype=np.float32)[None, :]
    out = np.empty((clips, frames, height, width, 3), np.uint8)

    def tri(v: np.ndarray) -> np.ndarray:
        return 255 - np.abs((v % 510) - 255)

    for c in range(clips):
        a = rng.uniform(0.5, 3.0, size=3)
        for t in range(frames):
            out[c, t, ..., 0] = tri(a[0] * x + 7 * t + 40 * c)
            out[c, t, ..., 1] = tri(a[1] * y + 3 * t + 80)
            out[c, t, ..., 2] = tri(a[2] * (x + y) / 2 + 5 * t)
    return out


def maniskill_clips(env_id: str, clips: int, frames: int, height: int, width: int, render_backend: str,
                    seed: int = 0) -> np.ndarray:
    """``[clips, frames, H, W, 3]`` uint8 from a real ManiSkill task's human camera under random actions
    (CPU simulation, ``render_backend`` rendering); clip ``c`` is the episode of seed ``seed + c``."""
    import mani_skill.envs  # noqa: F401 - registers the tasks

    env = gym.make(env_id, num_envs=1, obs_mode="state", render_mode="rgb_array", sim_backend="physx_cpu",
                   render_backend=render_backend, human_render_camera_configs=dict(width=width, height=height))
    return _roll_out(env, clips, frames, height, width, seed, lambda obs: env.render())


def sensor_clips(env_id: str, clips: int, frames: int, size: int, render_backend: str, seed: int = 0) -> np.ndarray:
    """``[clips, frames, size, size, 3]`` uint8: a real task's sensor camera (``obs_mode="rgb"``, the first
    camera, ``size x size``) under random actions: the frames an rgb observation holds."""
    import mani_skill.envs  # noqa: F401 - registers the tasks

    env = gym.make(env_id, num_envs=1, obs_mode="rgb", sim_backend="physx_cpu", render_backend=render_backend,
                   sensor_configs=dict(width=size, height=size))
    return _roll_out(env, clips, frames, size, size, seed, lambda obs: next(iter(obs["sensor_data"].values()))["rgb"])


def _roll_out(env: gym.Env, clips: int, frames: int, height: int, width: int, seed: int,
              frame_of: Callable[[Any], Any]) -> np.ndarray:
    """``frames`` frames (``frame_of(obs)`` after the reset and after each random step) of ``clips``
    episodes of ``env``, seeds ``seed, seed + 1, ...``; closes ``env``."""
    out = np.empty((clips, frames, height, width, 3), np.uint8)
    try:
        env.action_space.seed(seed)
        for c in range(clips):
            obs, _ = env.reset(seed=seed + c)
            for t in range(frames):
                if t:
                    obs, *_ = env.step(env.action_space.sample())
                img = frame_of(obs)
                out[c, t] = (img.cpu().numpy() if isinstance(img, torch.Tensor) else np.asarray(img)).reshape(
                    height, width, 3
                )
    finally:
        env.close()
    return out


def make_bank(clips: np.ndarray, variants: int) -> np.ndarray:
    """Each clip and ``variants - 1`` copies rolled sideways: ``[clips * variants, T, H, W, 3]``."""
    w = clips.shape[3]
    banks = [np.roll(clips, shift=(v * w) // max(variants, 1), axis=3) for v in range(variants)]
    return np.ascontiguousarray(np.stack(banks, axis=1).reshape(-1, *clips.shape[1:]))


def source_env(
    bank: np.ndarray, num_envs: int, device: str | torch.device, sim_seconds: float = 0.0
) -> BatchedDoubleEnv:
    """The benchmark's batched source: `BatchedDoubleEnv` replaying ``bank`` (env ``e`` shows clip
    ``e % len(bank)``), episodes as long as the clips (``frames - 1`` steps), ``sim_seconds`` of emulated
    simulation a step."""
    return BatchedDoubleEnv(num_envs=num_envs, max_episode_steps=bank.shape[1] - 1, device=device, bank=bank,
                            sim_seconds=sim_seconds)


# ---------------------------------------------------------------------------------------------- picture checks
def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """PSNR in dB of two uint8 arrays as a whole (inf when identical)."""
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else float(10 * np.log10(255.0**2 / mse))


def frame_psnr(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per-frame PSNR in dB of two ``[T, H, W, 3]`` uint8 stacks (capped at 100 dB for identical frames)."""
    mse = ((a.astype(np.float64) - b.astype(np.float64)) ** 2).reshape(len(a), -1).mean(axis=1)
    return 10 * np.log10(255.0**2 / np.maximum(mse, 1e-10))


def smooth_frames(t: int = 6, h: int = 32, w: int = 48, seed: int = 0) -> np.ndarray:
    """``[t, h, w, 3]`` uint8 frames of smooth random texture: H.264 keeps them at high PSNR."""
    rng = np.random.default_rng(seed)
    steps = rng.integers(-3, 4, size=(t, h, w, 3))
    return np.clip(np.cumsum(steps, axis=2) + 128, 0, 255).astype(np.uint8)
