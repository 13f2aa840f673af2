"""Runs in LeRobot's own venv (.venv-lerobot, made by scripts/setup_lerobot.sh), never in the project's: LeRobot
0.4.4's own classes read what fastrecord wrote, and what they return is saved for tests/test_lerobot_interop.py
to compare with the recording. Imports nothing of fastrecord.

    python lerobot_interop_worker.py items ROOT OUT.npz BACKEND[,BACKEND...] ROW[,ROW...]
        for each video backend, LeRobotDataset(root=ROOT, video_backend=BACKEND), each camera asked for the row's
        frame and the one before (delta_timestamps): every value it returns for each row as
        OUT.npz["BACKEND/ROW/KEY"], the dataset's sizes as OUT.npz["BACKEND/meta/..."]
    python lerobot_interop_worker.py act CHECKPOINT ROOT ROW OUT.npz
        the ACT policy `lerobot-train` saved in CHECKPOINT (its pretrained_model folder) and its processors, fed
        row ROW of the dataset at ROOT: the action it selects, as OUT.npz["action"]
"""

from __future__ import annotations

import sys

import numpy as np
import torch


def items(root: str, out: str, backends: str, rows: str) -> None:
    from lerobot.datasets.lerobot_dataset import LeRobotDataset, LeRobotDatasetMetadata

    meta = LeRobotDatasetMetadata("local/fastrecord", root=root)
    delta = {key: [-1 / meta.fps, 0.0] for key in meta.camera_keys}
    saved: dict[str, np.ndarray] = {}
    for backend in backends.split(","):
        ds = LeRobotDataset("local/fastrecord", root=root, video_backend=backend, delta_timestamps=delta or None)
        saved |= {f"{backend}/meta/len": np.array(len(ds)), f"{backend}/meta/episodes": np.array(ds.num_episodes),
                  f"{backend}/meta/fps": np.array(ds.fps), f"{backend}/meta/backend": np.array(ds.video_backend),
                  f"{backend}/meta/camera_keys": np.array(list(meta.camera_keys))}
        for row in map(int, rows.split(",")):
            for key, value in ds[row].items():
                saved[f"{backend}/{row}/{key}"] = value.numpy() if isinstance(value, torch.Tensor) else np.array(value)
    np.savez(out, **saved)


def act(checkpoint: str, root: str, row: str, out: str) -> None:
    from lerobot.datasets.lerobot_dataset import LeRobotDataset
    from lerobot.policies.act.modeling_act import ACTPolicy
    from lerobot.policies.factory import make_pre_post_processors

    policy = ACTPolicy.from_pretrained(checkpoint).eval()
    pre, post = make_pre_post_processors(policy.config, pretrained_path=checkpoint)
    item = LeRobotDataset("local/fastrecord", root=root)[int(row)]
    obs = {k: v for k, v in item.items() if k.startswith("observation.") or k == "task"}
    with torch.inference_mode():
        action = post(policy.select_action(pre(obs)))
    np.savez(out, action=action.numpy())


if __name__ == "__main__":
    {"items": items, "act": act}[sys.argv[1]](*sys.argv[2:])
