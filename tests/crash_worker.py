"""Records forever until killed; prints 'finished N' once N episodes are durable on disk.

Used by test_crash.py:  python crash_worker.py OUT_DIR {maniskill|double} [signals]
(``signals``: call `fastrecord.install_signal_handlers` first, as the ``fastrecord`` command does)
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "src"))  # this checkout's fastrecord

from fastrecord.system import use_lavapipe_if_no_gpu

use_lavapipe_if_no_gpu()

import torch  # noqa: E402

import fastrecord  # noqa: E402
from fastrecord import RecordEpisode  # noqa: E402


def main(out: str, kind: str) -> None:
    if kind == "maniskill":
        import gymnasium as gym
        import mani_skill.envs  # noqa: F401

        env = gym.make("PickCube-v1", obs_mode="state", render_mode="rgb_array", sim_backend="physx_cpu",
                       human_render_camera_configs=dict(width=64, height=64), max_episode_steps=5)
        steps = 5
    else:
        from fastrecord.testing import BatchedDoubleEnv

        env = BatchedDoubleEnv(num_envs=8, max_episode_steps=4, size=64)
        steps = 4
    env = RecordEpisode(env, out, trajectory_name="crash")
    n = env.unwrapped.num_envs
    seed = 0
    try:  # a script's usual shape: SIGKILL (and SIGTERM without the opt-in) skip the finally
        while True:
            env.reset(seed=seed)
            seed += 1
            for _ in range(steps):
                env.step(torch.as_tensor(env.action_space.sample()).reshape(n, -1))
            env.reset(seed=seed)  # ends the episodes: they go to the writers
            env.wait_until_done()
            print(f"finished {env.recorder.num_episodes}", flush=True)
    finally:
        env.close()


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # what a program started from a shell has
    if sys.argv[3:] == ["signals"]:
        fastrecord.install_signal_handlers()
    main(sys.argv[1], sys.argv[2])
