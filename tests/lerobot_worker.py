"""Records LeRobot episodes until killed; prints 'finished N' once N episodes are committed on disk.

Used by test_lerobot.py:  python lerobot_worker.py OUT_DIR [resume]
A `BatchedDoubleEnv` of 4 envs with an rgb observation; a tiny video file limit, so that a dataset file
is closed after every few episodes and a kill finds both dataset files and parts.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "src"))  # this checkout's fastrecord

import torch

from fastrecord import RecordEpisode
from fastrecord.sinks.lerobot import LeRobotSink
from fastrecord.testing import BatchedDoubleEnv
from fastrecord.video import VideoSettings

STEPS = 4


def make(out: str, if_exists: str = "error") -> RecordEpisode:
    env = BatchedDoubleEnv(num_envs=4, max_episode_steps=STEPS, size=32, obs_mode="rgb")
    sink = LeRobotSink(20, "Double-v0", VideoSettings(), video_files_size_in_mb=0.004)
    return RecordEpisode(env, out, trajectory_name="crash", save_video=False, if_exists=if_exists, sinks=[sink])


def main(out: str, if_exists: str) -> None:
    env = make(out, if_exists)
    seed = 0
    try:
        while True:
            env.reset(seed=seed)
            seed += 1
            for _ in range(STEPS):
                env.step(torch.as_tensor(env.action_space.sample()).reshape(4, -1))
            env.reset(seed=seed)  # ends the episodes: they go to the sinks
            env.wait_until_done()
            print(f"finished {env.recorder.num_episodes}", flush=True)
    finally:
        env.close()


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "error")
