"""The test double: a small batched env following ManiSkill's GPU-parallel env contract.

ManiSkill allows one env per process on the CPU, so ``num_envs > 1`` batched-tensor semantics cannot
be exercised with a real ManiSkill env on the CI machine. `BatchedDoubleEnv` stands in for
``mani_skill.envs.sapien_env.BaseEnv`` with ``num_envs = N``, following the parts of its contract the
recorder relies on:

- every output is a batched torch tensor ``[N, ...]`` on ``device``; actions ``[N, A]``;
- ``reset(seed=..., options={"env_idx": idx})`` resets only ``idx`` and returns obs for all envs, with
  ``info["reconfigure"]``; ``_episode_seed`` holds the per-env episode seeds;
- ``step`` returns ``(obs, reward [N], terminated [N], truncated [N], info)`` with ``info["success"]``,
  ``info["fail"]`` and ``info["elapsed_steps"]``; truncation at ``max_episode_steps`` (ManiSkill's
  TimeLimit semantics on the GPU: no auto-reset, the caller resets);
- ``render()`` returns ``[N, H, W, 3]`` uint8 on ``device`` in one call;
- ``get_state_dict()`` returns ``{"actors": {...}, "articulations": {...}}`` of ``[N, D]`` tensors.

Frames are deterministic functions of (env, state), so a test can recompute what was rendered and
compare decoded video frames with it: a wrong env or a shifted frame changes the picture.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import torch


class BatchedDoubleEnv(gym.Env):
    metadata = {"render_modes": ["rgb_array"]}

    def __init__(self, num_envs: int = 4, max_episode_steps: int = 8, size: int = 32, device: str = "cpu",
                 success_step: list[int] | None = None, render_mode: str | None = "rgb_array"):
        self.num_envs = num_envs
        self.device = torch.device(device)
        self.max_episode_steps = max_episode_steps
        self.size = size
        self.render_mode = render_mode
        self.control_mode = "pd_joint_delta_pos"
        self.reconfiguration_freq = 0
        self.gpu_sim_enabled = self.device.type == "cuda"
        # env e succeeds (and terminates) once it has taken success_step[e] steps; 0 = never
        self.success_step = torch.tensor(success_step or [0] * num_envs, device=self.device)
        self.single_action_space = gym.spaces.Box(-1, 1, (3,), np.float32)
        self.action_space = gym.spaces.Box(-1, 1, (num_envs, 3), np.float32)
        self.single_observation_space = gym.spaces.Box(-np.inf, np.inf, (4,), np.float32)
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, (num_envs, 4), np.float32)
        self.pos = torch.zeros(num_envs, 3, device=self.device)
        self.elapsed_steps = torch.zeros(num_envs, dtype=torch.int32, device=self.device)
        self._episode_seed = np.zeros(num_envs, dtype=np.int64)
        self.render_calls = 0

    # ------------------------------------------------------------------ contract
    def _obs(self) -> torch.Tensor:
        return torch.cat([self.pos, self.elapsed_steps[:, None].float()], dim=1)

    def reset(self, *, seed=None, options=None):
        options = options or {}
        idx = options.get("env_idx")
        idx = torch.arange(self.num_envs, device=self.device) if idx is None else torch.as_tensor(idx, device=self.device)
        if seed is not None:
            seeds = np.atleast_1d(np.asarray(seed, dtype=np.int64))
            self._episode_seed[idx.cpu().numpy()] = seeds if len(seeds) == len(idx) else seeds[0] + np.arange(len(idx))
        for e in idx.tolist():
            g = torch.Generator().manual_seed(int(self._episode_seed[e]))
            self.pos[e] = torch.rand(3, generator=g).to(self.device)
        self.elapsed_steps[idx] = 0
        return self._obs(), {"reconfigure": False}

    def step(self, action):
        action = torch.as_tensor(action, dtype=torch.float32, device=self.device).reshape(self.num_envs, 3)
        self.pos += 0.1 * action
        self.elapsed_steps += 1
        success = (self.success_step > 0) & (self.elapsed_steps >= self.success_step)
        fail = torch.zeros_like(success)
        truncated = self.elapsed_steps >= self.max_episode_steps
        reward = self.pos.sum(dim=1)
        info = {"success": success, "fail": fail, "elapsed_steps": self.elapsed_steps.clone()}
        return self._obs(), reward, success.clone(), truncated, info

    def render(self):
        self.render_calls += 1
        return frames_for(self.pos, self.elapsed_steps, self.size)

    def get_state_dict(self):
        pose = torch.cat([self.pos, torch.zeros(self.num_envs, 10, device=self.device)], dim=1)
        return {"actors": {"box": pose}, "articulations": {"arm": self.elapsed_steps[:, None].float().repeat(1, 4)}}

    def set_state_dict(self, state, env_idx=None):
        self.pos[:] = torch.as_tensor(state["actors"]["box"][:, :3], device=self.device)


def frames_for(pos: torch.Tensor, elapsed: torch.Tensor, size: int, env_idx: torch.Tensor | int | None = None) -> torch.Tensor:
    """[N, size, size, 3] uint8: a smooth gradient whose offset encodes the env's state and step.

    Smooth content keeps H.264 at high PSNR; consecutive steps differ by far more than coding noise.
    """
    n = pos.shape[0]
    y = torch.arange(size, device=pos.device).view(1, size, 1)
    x = torch.arange(size, device=pos.device).view(1, 1, size)
    base = (pos[:, 0].view(n, 1, 1) * 60 + elapsed.view(n, 1, 1).float() * 23)
    def tri(v):  # a triangle wave: no wrap-around edges for the encoder to smear
        return 255 - ((v % 510) - 255).abs()

    r = tri(base + 2 * x)
    g = tri(base * 0.5 + 2 * y + 80)
    envs = torch.arange(n, device=pos.device) if env_idx is None else torch.as_tensor(env_idx, device=pos.device).expand(n)
    b = tri(envs.view(n, 1, 1) * 50 + x + y)
    return torch.stack([r.expand(n, size, size), g.expand(n, size, size), b.expand(n, size, size).float()], dim=-1).to(torch.uint8)
