"""Evaluate a policy over many episodes with `fastrecord.make_eval_envs`; keep the videos of successes.

The evaluation loop has the shape of ManiSkill's diffusion-policy baseline (``evaluate(n, agent,
eval_envs, device, sim_backend)``: action chunks, stop a chunk at truncation, read the episode metrics
from ``info["final_info"]``), and the env factory is a one-line switch:

    # from diffusion_policy.make_env import make_eval_envs
    from fastrecord import make_eval_envs

Examples (CPU machine: Mesa's lavapipe renders when there is no GPU):
    python scripts/evaluate.py                                  # scripted PushCube, 2 envs, 8 episodes, successes kept
    python scripts/evaluate.py --noise 1.0 --episodes 16        # a noisy policy: mixed outcomes, success videos only
    python scripts/evaluate.py --policy random --keep all --episodes 4
    python scripts/evaluate.py --keep all --log tensorboard       # then: tensorboard --logdir eval_videos/tensorboard
    python scripts/evaluate.py --sim-backend physx_cuda --num-envs 64 --episodes 256   # GPU machine
    torchrun --standalone --nproc-per-node 4 scripts/evaluate.py --sim-backend physx_cuda --num-envs 64 \
        --episodes 1024 --keep all --save-trajectory        # 4 GPUs: 256 episodes each, one joined dataset

Under torchrun each rank evaluates its share of the global episodes (episode g: seed SEED + g, rank
g % world size) on its own GPU and records into VIDEO_DIR/NAME.shards/rankNNNNN/; rank 0 prints the
results of all ranks and joins the trajectories (with --save-trajectory) into VIDEO_DIR/NAME.h5 + .json.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from fastrecord.options import add_record_flags, given_options


def push_cube_policy(obs: np.ndarray) -> np.ndarray:
    """A scripted PushCube-v1 policy for ``obs_mode="state"``, ``control_mode="pd_ee_delta_pos"``.

    ``obs[..., 35]``: qpos (9), qvel (9), tcp pose (7), goal position (3), cube pose (7). Goes above the
    cube's back side, lowers the closed gripper behind it, pushes it towards the goal (+x), and holds
    still once the cube is near the goal's centre.
    Returns ``[..., 4]`` actions (xyz delta in units of 10 cm, gripper closed).
    """
    tcp, goal, cube = obs[..., 18:21], obs[..., 25:28], obs[..., 28:31]
    pre = cube + np.array([-0.05, 0.0, 0.0])
    pre[..., 2] = 0.02
    above = pre.copy()
    above[..., 2] = 0.08
    at_pre = np.linalg.norm(tcp[..., :2] - pre[..., :2], axis=-1) < 0.01
    pushing = (
        (np.abs(tcp[..., 1] - cube[..., 1]) < 0.015) & (tcp[..., 0] < cube[..., 0] - 0.025) & (tcp[..., 2] < 0.035)
    )
    push = tcp + np.stack(
        [np.full_like(tcp[..., 0], 0.05), 0.5 * (goal[..., 1] - cube[..., 1]), 0.02 - tcp[..., 2]], -1
    )
    target = np.where(pushing[..., None], push, np.where(at_pre[..., None], pre, above))
    arrived = np.linalg.norm(cube[..., :2] - goal[..., :2], axis=-1) < 0.03
    target = np.where(arrived[..., None], tcp, target)
    delta = np.clip((target - tcp) / 0.1, -1.0, 1.0)
    return np.concatenate([delta, -np.ones_like(delta[..., :1])], -1).astype(np.float32)


class ScriptedAgent:
    """`push_cube_policy` on the newest stacked observation, with optional Gaussian action noise."""

    def __init__(self, act_horizon: int, noise: float, seed: int) -> None:
        self.act_horizon, self.noise = act_horizon, noise
        self.rng = np.random.default_rng(seed)

    def get_action(self, obs: torch.Tensor) -> torch.Tensor:
        a = push_cube_policy(obs[:, -1].cpu().numpy())
        a = np.clip(a + self.noise * self.rng.standard_normal(a.shape), -1, 1).astype(np.float32)
        return torch.as_tensor(a)[:, None].repeat(1, self.act_horizon, 1)  # [N, act_horizon, A]


class RandomAgent:
    def __init__(self, action_space, act_horizon: int) -> None:
        self.space, self.act_horizon = action_space, act_horizon

    def get_action(self, obs: torch.Tensor) -> torch.Tensor:
        return torch.stack([torch.as_tensor(self.space.sample()) for _ in range(self.act_horizon)], dim=1)


def evaluate(n: int, agent, eval_envs, device: torch.device, sim_backend: str) -> dict[str, np.ndarray]:
    """Run ``n`` episodes (rounded up to whole batches of envs); return the per-episode metrics."""
    from mani_skill.utils import common
    from tqdm import tqdm

    metrics: dict[str, list] = defaultdict(list)
    obs, _ = eval_envs.reset()
    done_episodes = 0
    with torch.no_grad(), tqdm(total=n, unit="episode") as bar:
        while done_episodes < n:
            actions = agent.get_action(common.to_tensor(obs, device))
            if sim_backend == "physx_cpu":
                actions = actions.cpu().numpy()
            for i in range(actions.shape[1]):
                obs, _, _, truncated, info = eval_envs.step(actions[:, i])
                if truncated.any():
                    break
            if truncated.any():  # ignore_terminations: every env truncates at max_episode_steps together
                finals = info["final_info"]
                if isinstance(finals, dict):  # GPU: ManiSkillVectorEnv's batched final info
                    for k, v in finals["episode"].items():
                        metrics[k].append(v.float().cpu().numpy())
                else:  # CPU: one final info per env
                    for final in finals:
                        for k, v in final["episode"].items():
                            metrics[k].append(np.asarray(v))
                done_episodes += eval_envs.num_envs
                bar.update(eval_envs.num_envs)
    return {k: np.stack(v).reshape(-1) for k, v in metrics.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--env-id", default="PushCube-v1")
    p.add_argument("--policy", choices=["scripted", "random"], default="scripted", help="scripted: PushCube-v1 only")
    p.add_argument("--noise", type=float, default=0.0, help="std of Gaussian noise added to the scripted actions")
    p.add_argument("--num-envs", type=int, default=2)
    p.add_argument("--episodes", type=int, default=8)
    p.add_argument("--sim-backend", default="physx_cpu")
    p.add_argument("--max-episode-steps", type=int, default=30)
    p.add_argument("--obs-horizon", type=int, default=2)
    p.add_argument("--act-horizon", type=int, default=4)
    p.add_argument("--video-dir", default="eval_videos")
    p.add_argument("--width", type=int, default=128, help="video width")
    p.add_argument("--height", type=int, default=128, help="video height")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-trajectory", action="store_true", help="also record the trajectories (NAME.h5 + NAME.json)")
    p.add_argument("--name", default=None, help="the run's name in VIDEO_DIR (default: a timestamp)")
    p.add_argument("--log", choices=["tensorboard", "wandb"], default=None,
                   help="also log each kept episode (success, length, success rate, a few videos) to TensorBoard "
                        "(VIDEO_DIR/tensorboard) or W&B (VIDEO_DIR/wandb); --keep all for the policy's success rate")
    # every other recording option (--keep, --if-exists, --video-crf, ...), from fastrecord.RecordOptions;
    # make_eval_envs decides the info overlay and the video pieces (the baseline's videos); save_on_reset=False would
    # save nothing (this script makes no flush_* calls)
    recording = add_record_flags(p, exclude=("save_trajectory", "trajectory_name", "info_on_video",
                                             "max_steps_per_video", "save_on_reset"),
                                 defaults={"keep": "success"})
    args = p.parse_args(argv)
    keep = args.keep or "success"

    from fastrecord import (
        make_eval_envs,  # the one-line switch from diffusion_policy.make_env
        shards,
    )
    from fastrecord.make_env import sharding_of
    from fastrecord.system import use_lavapipe_if_no_gpu

    use_lavapipe_if_no_gpu()
    if args.policy == "scripted" and args.env_id != "PushCube-v1":
        raise SystemExit(f"--policy scripted solves PushCube-v1 only, not {args.env_id}; use --policy random")
    env_kwargs = dict(
        control_mode="pd_ee_delta_pos",
        reward_mode="sparse",
        obs_mode="state",
        render_mode="rgb_array",
        max_episode_steps=args.max_episode_steps,
        human_render_camera_configs=dict(width=args.width, height=args.height),
    )
    other_kwargs = dict(obs_horizon=args.obs_horizon)
    t0 = time.perf_counter()
    info = shards.rank_info()
    given = {k: v for k, v in given_options(args, recording).items() if k != "keep"}
    record_kwargs = dict(save_trajectory=args.save_trajectory, trajectory_name=args.name, **given)
    sharded = dict(episodes=args.episodes, seed=args.seed) if info.distributed else {}
    envs = make_eval_envs(args.env_id, args.num_envs, args.sim_backend, env_kwargs, other_kwargs,
                          video_dir=args.video_dir, keep=keep, log=args.log, record_kwargs=record_kwargs, **sharded)
    episodes = len(shards.episodes_of(info.rank, info.world_size, args.episodes)) if sharded else args.episodes
    device = torch.device("cuda" if args.sim_backend != "physx_cpu" and torch.cuda.is_available() else "cpu")
    if args.policy == "scripted":
        agent = ScriptedAgent(args.act_horizon, args.noise, args.seed)
    else:
        envs.single_action_space.seed(args.seed)
        agent = RandomAgent(envs.single_action_space, args.act_horizon)
    try:
        metrics = evaluate(episodes, agent, envs, device, args.sim_backend)
    finally:
        envs.close()
    seconds = time.perf_counter() - t0
    sharding = sharding_of(envs)
    if sharding is not None:  # rank 0 speaks for all ranks
        if info.rank == 0:
            from fastrecord.sinks.results import summary_lines

            print(f"{info.world_size} ranks, {args.episodes} global episodes in {seconds:.1f} s (rank 0's time)")
            for line in summary_lines(sharding.rows):
                print(line)
            for line in (sharding.report.lines() if sharding.report is not None else []):
                print(line)
            print(f"videos (keep={keep}) in {args.video_dir}/{sharding.run.name}.shards/rank*/")
        return 0
    videos = sorted(Path(args.video_dir).glob("*.mp4")) if Path(args.video_dir).exists() else []
    print(f"{len(metrics.get('return', []))} episodes in {seconds:.1f} s")
    if args.video_dir:
        from fastrecord.sinks.results import results_of, summary_lines

        for line in summary_lines(results_of(envs).rows):  # every finished episode, kept or not
            print(line)
    for k, v in sorted(metrics.items()):
        print(f"  {k}: {float(np.mean(v)):.3f}")
    print(f"videos (keep={keep}): {len(videos)} in {args.video_dir}/")
    for v in videos[:8]:
        print(f"  {v.name}")
    if args.log:
        print(f"logged to {args.log} in {args.video_dir}/{args.log}/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
