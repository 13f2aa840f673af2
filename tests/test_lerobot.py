"""fastrecord's rgb trajectories -> ManiSkill's converter (mani_skill/trajectory/convert_to_lerobot.py) ->
a LeRobot v3.0 dataset, read back: parquet rows, videos, meta. Needs the ``lerobot`` extra
(pandas, opencv-python-headless, pyarrow, tyro), not the lerobot package."""

from __future__ import annotations

import json
import subprocess
import sys

import h5py
import numpy as np
import pytest

for module in ("pandas", "cv2", "pyarrow", "tyro"):
    pytest.importorskip(module, reason=f"ManiSkill's LeRobot converter needs {module}: pip install -e '.[lerobot]'")

import pandas as pd  # noqa: E402

from fastrecord import RecordEpisode  # noqa: E402
from fastrecord.video import decode_mp4  # noqa: E402
from fastrecord.testing import psnr

SIZE = 64




def test_rgb_trajectory_to_lerobot_with_maniskills_converter(make_env, tmp_path):
    env = make_env("PickCube-v1", obs_mode="rgb", max_episode_steps=5, sensor_configs=dict(width=SIZE, height=SIZE))
    env = RecordEpisode(env, tmp_path / "rec", trajectory_name="demo", save_video=False)
    env.reset(seed=0)
    for steps in (5, 3, 4):  # 5: the time limit; 3 and 4: ended by a reset
        for _ in range(steps):
            env.step(env.action_space.sample())
        env.reset()
    env.close()
    h5_path = tmp_path / "rec" / "demo.h5"
    out = tmp_path / "lerobot"
    # ManiSkill's CLI, as the README shows it (fps: PickCube's control frequency)
    r = subprocess.run([sys.executable, "-m", "mani_skill.trajectory.convert_to_lerobot", "--traj-path", str(h5_path),
                        "--output-dir", str(out), "--fps", "20", "--image-size", f"{SIZE}x{SIZE}", "--robot-type", "panda"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Conversion completed successfully" in r.stderr

    meta = json.loads(h5_path.with_suffix(".json").read_text())
    lengths = [e["elapsed_steps"] for e in meta["episodes"]]
    assert lengths == [5, 3, 4]
    with h5py.File(h5_path) as f:
        actions = [f[f"traj_{i}/actions"][:] for i in range(3)]
        qpos = [f[f"traj_{i}/obs/agent/qpos"][:] for i in range(3)]
        rgb = [f[f"traj_{i}/obs/sensor_data/base_camera/rgb"][:] for i in range(3)]

    # data: one row per step, the recorded actions and joint positions, episodes in order
    data = pd.read_parquet(out / "data" / "chunk-000" / "file-000.parquet")
    assert len(data) == sum(lengths) == 12
    assert data.groupby("episode_index").size().tolist() == lengths
    assert data["index"].tolist() == list(range(12))
    np.testing.assert_array_equal(np.stack(data["action"].to_numpy()), np.concatenate(actions))
    np.testing.assert_array_equal(np.stack(data["observation.state"].to_numpy()),
                                  np.concatenate([q[:t] for q, t in zip(qpos, lengths)]))
    assert set(data["task"]) == {"PickCube-v1"}

    # videos: one per episode, a frame per step, the recorded camera frames (mp4v is lossy)
    for i, t in enumerate(lengths):
        video = decode_mp4(out / "videos" / "observation.images.base_camera" / "chunk-000" / f"file-{i:03d}.mp4")
        assert video.shape == (t, SIZE, SIZE, 3)
        assert psnr(video, rgb[i][:t]) > 20

    # meta
    info = json.loads((out / "meta" / "info.json").read_text())
    assert info["codebase_version"] == "v3.0" and info["robot_type"] == "panda" and info["fps"] == 20
    assert (info["total_episodes"], info["total_frames"], info["total_videos"]) == (3, 12, 3)
    assert info["features"]["action"]["shape"] == [8] and info["features"]["observation.state"]["shape"] == [9]
    assert info["features"]["observation.images.base_camera"]["shape"] == [SIZE, SIZE, 3]
    episodes = pd.read_parquet(out / "meta" / "episodes" / "chunk-000" / "file-000.parquet")
    assert episodes["length"].tolist() == lengths
    assert episodes["dataset_to_index"].tolist() == np.cumsum(lengths).tolist()
    assert list(pd.read_parquet(out / "meta" / "tasks.parquet").index) == ["PickCube-v1"]
    stats = json.loads((out / "meta" / "stats.json").read_text())
    assert stats["action"]["count"] == [12]
