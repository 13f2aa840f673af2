"""Scripted policies and seeds (issue 28.3): the same seeds give the same episodes whatever the world size
and however often the run was resumed. `fastrecord.policies.pick_cube_policy` on PickCube-v1 (CPU PhysX),
recorded by ``fastrecord record`` under torchrun with 1 and 2 processes (loopback, gloo) and in one process
stopped after 3 episodes and resumed: each episode's success and length agree exactly, and so do its actions
(bit for bit on physx_cpu; the README promises 1e-3, what GPU PhysX is expected to hold).

Before the fix the policy read ``is_grasping`` at an episode's first step from the previous episode's
contacts (a reset runs no physics step): the first action, and with it the episode, depended on which
episode the process had run before."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from conftest import TORCHRUN, torchrun_env

POLICY = ["--policy", "fastrecord.policies:pick_cube_policy", "--control-mode", "pd_ee_delta_pos"]
RECORD = ["-m", "fastrecord", "record", "PickCube-v1", *POLICY, "--max-episode-steps", "30", "--no-video",
          "--seed", "3"]
EPISODES = 6


def read_episodes(out: Path) -> dict[int, dict]:
    """{episode_id: seed, success, length, actions} of the joined NAME.h5 + NAME.json."""
    meta = json.loads((out / "trajectory.json").read_text())
    with h5py.File(out / "trajectory.h5", "r") as f:
        return {e["episode_id"]: dict(seed=e["episode_seed"], success=e["success"], steps=e["elapsed_steps"],
                                      actions=f[f"traj_{e['episode_id']}/actions"][:]) for e in meta["episodes"]}


def run(args: list[str]) -> None:
    r = subprocess.run(args, capture_output=True, text=True, timeout=600, env=torchrun_env())
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


@pytest.fixture(scope="module")
def layouts(tmp_path_factory) -> dict[str, dict[int, dict]]:
    base = tmp_path_factory.mktemp("seeds")
    out = {}
    for world in (1, 2):
        run([*TORCHRUN, "--nproc-per-node", str(world), *RECORD, "--episodes", str(EPISODES),
             "--output-dir", str(base / f"w{world}")])
        out[f"torchrun {world}"] = read_episodes(base / f"w{world}")
    resumed = base / "resumed"  # one process: 3 episodes, then the run resumed to 6
    run([sys.executable, *RECORD, "--episodes", "3", "--output-dir", str(resumed)])
    run([sys.executable, *RECORD, "--episodes", str(EPISODES), "--if-exists", "resume", "--output-dir", str(resumed)])
    out["resumed"] = read_episodes(resumed)
    return out


def test_same_seeds_same_episodes_whatever_the_layout(layouts):
    ref = layouts["torchrun 1"]
    assert sorted(ref) == list(range(EPISODES)) and [ref[g]["seed"] for g in ref] == [3 + g for g in range(EPISODES)]
    assert any(e["success"] for e in ref.values()) and not all(e["success"] for e in ref.values())  # a real mix
    for name, eps in layouts.items():
        assert sorted(eps) == sorted(ref), name
        for g in ref:
            a, b = ref[g], eps[g]
            assert (b["seed"], b["success"], b["steps"]) == (a["seed"], a["success"], a["steps"]), (name, g)
            np.testing.assert_array_equal(b["actions"], a["actions"], err_msg=f"{name}: episode {g}")


def test_first_action_ignores_the_previous_episode(make_env):
    """The policy's first action of an episode is the same after an episode that ended holding the cube
    as in a fresh env: it depends on that episode only."""
    import torch

    from fastrecord.policies import pick_cube_policy

    def first_action(env, seed: int) -> torch.Tensor:
        obs, _ = env.reset(seed=seed)
        return pick_cube_policy(env)(obs)

    fresh = make_env("PickCube-v1", control_mode="pd_ee_delta_pos", max_episode_steps=30)
    expected = first_action(fresh, 1)
    fresh.close()
    env = make_env("PickCube-v1", control_mode="pd_ee_delta_pos", max_episode_steps=30)
    obs, _ = env.reset(seed=0)
    act = pick_cube_policy(env)
    for _ in range(30):  # seed 0 grasps the cube and carries it: the last contacts are a grasp's
        obs, _, _, _, info = env.step(act(obs))
    assert bool(env.unwrapped.agent.is_grasping(env.unwrapped.cube).item())
    got = first_action(env, 1)
    env.close()
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
