"""LeRobot 0.4.4 itself, in its own venv, on LeRobot datasets fastrecord wrote (``lerobot=True``): `LeRobotDataset`
loads a dataset of one file, one rolled over several files and one joined from torchrun shards; random rows
come back with the values of their parquet rows, and their camera frames (the row's and the one before, through
``delta_timestamps``), decoded by both of LeRobot's video backends (torchcodec and pyav), equal ours and match
the recorded camera frames; ``lerobot-train`` trains an ACT policy a few steps on the CPU, offline, and the
policy it saved selects an action for a row of the dataset.

LeRobot pins torch < 2.11, so it lives in a venv of its own: ``bash scripts/setup_lerobot.sh`` builds it and
links it as ``.venv-lerobot`` (.ci/run does so before the tests). ``FASTRECORD_LEROBOT_PYTHON`` names another
Python with lerobot 0.4.4; ``FASTRECORD_LEROBOT_PYTHON=skip`` skips these tests, outside CI only. Without that,
a missing venv fails the tests. Feature names, shapes and dtypes are read from meta/info.json."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
from collections.abc import Callable
from pathlib import Path

import av
import h5py
import numpy as np
import pytest
import torch

INSTALL = "pip install -e '.[lerobot]'"
pd = pytest.importorskip("pandas", reason=f"reading LeRobot datasets needs pandas: {INSTALL}")
pq = pytest.importorskip("pyarrow.parquet", reason=f"reading LeRobot datasets needs pyarrow: {INSTALL}")

from conftest import torchrun  # noqa: E402

from fastrecord import RecordEpisode  # noqa: E402
from fastrecord.sinks.lerobot import LeRobotSink  # noqa: E402
from fastrecord.testing import BatchedDoubleEnv, psnr  # noqa: E402
from fastrecord.video import VideoSettings  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("lerobot_interop_worker.py")
SIZE = 64
BACKENDS = ("torchcodec", "pyav")


# ---------------------------------------------------------------------------------------------- LeRobot's venv
def lerobot_python() -> Path:
    """The Python of LeRobot's venv: FASTRECORD_LEROBOT_PYTHON, else .venv-lerobot/bin/python of this checkout.
    Missing: the test fails, naming the command that builds it; ``skip`` skips, except in CI."""
    value = os.environ.get("FASTRECORD_LEROBOT_PYTHON", "")
    in_ci = os.environ.get("CI", "").lower() in ("1", "true", "yes")
    if value == "skip":
        if in_ci:
            pytest.fail("FASTRECORD_LEROBOT_PYTHON=skip, but CI=true: CI runs the LeRobot interop tests; unset it")
        pytest.skip("LeRobot interop tests disabled by FASTRECORD_LEROBOT_PYTHON=skip")
    python = Path(value) if value else REPO / ".venv-lerobot" / "bin" / "python"
    if not python.exists():
        pytest.fail(f"no Python with lerobot at {python}: run `bash scripts/setup_lerobot.sh` (builds .venv-lerobot, "
                    "~8 GB, a few minutes), or set FASTRECORD_LEROBOT_PYTHON to one (=skip to skip these tests)")
    return python


@pytest.fixture(scope="module")
def lerobot(tmp_path_factory) -> Callable[..., subprocess.CompletedProcess]:
    """Runs a program of LeRobot's venv (``python`` or a console script next to it) offline, on the CPU, with a
    Hugging Face cache of its own and without this checkout on its path; fails the test on a non-zero exit."""
    python = lerobot_python()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env |= dict(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HOME=str(tmp_path_factory.mktemp("hf_home")),
                WANDB_MODE="disabled", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="2")

    def run(program: str, *args: str | Path, timeout: float = 600) -> subprocess.CompletedProcess:
        exe = python if program == "python" else python.parent / program
        r = subprocess.run([str(exe), *map(str, args)], capture_output=True, text=True, timeout=timeout, env=env)
        assert r.returncode == 0, f"{program} {' '.join(map(str, args))}:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
        return r

    return run


# ---------------------------------------------------------------------------------------------- the datasets
@pytest.fixture(scope="module")
def one_file(tmp_path_factory) -> tuple[Path, Path]:
    """PickCube-v1 on the CPU, rgb observations (64x64 sensor camera), 4 episodes of 6 (the time limit), 4, 6
    and 3 steps, recorded as HDF5 and as a LeRobot dataset of one file: (dataset root, HDF5 file)."""
    import gymnasium as gym
    import mani_skill.envs  # noqa: F401  (registers the tasks)

    out = tmp_path_factory.mktemp("one_file")
    camera = dict(width=SIZE, height=SIZE)
    env = gym.make("PickCube-v1", obs_mode="rgb", render_mode="rgb_array", sim_backend="physx_cpu", max_episode_steps=6,
                   sensor_configs=camera, human_render_camera_configs=camera)
    env = RecordEpisode(env, out, trajectory_name="demo", save_video=False, lerobot=True)
    env.reset(seed=0)
    for steps in (6, 4, 6, 3):
        for _ in range(steps):
            env.step(env.action_space.sample())
        env.reset()
    env.close()
    return out / "demo.lerobot", out / "demo.h5"


@pytest.fixture(scope="module")
def many_files(tmp_path_factory) -> tuple[Path, Path]:
    """12 episodes of 3 steps of a 4-env `BatchedDoubleEnv` (rgb observations, 32x32), a video file limit of
    4 KB: the dataset's videos roll over several files. (dataset root, HDF5 file)."""
    out = tmp_path_factory.mktemp("many_files")
    env = BatchedDoubleEnv(num_envs=4, max_episode_steps=3, size=32, obs_mode="rgb")
    sink = LeRobotSink(20, "Double-v0", VideoSettings(), video_files_size_in_mb=0.004)
    env = RecordEpisode(env, out, trajectory_name="double", save_video=False, sinks=[sink])
    for r in range(3):
        env.reset(seed=r)
        for _ in range(3):
            env.step(torch.as_tensor(env.action_space.sample()).reshape(4, -1))
    env.close()
    return out / "double.lerobot", out / "double.h5"


@pytest.fixture(scope="module")
def joined(tmp_path_factory) -> tuple[Path, Path]:
    """5 PickCube-v1 episodes (rgb, --lerobot) recorded by torchrun with 2 ranks (gloo on 127.0.0.1), whose
    shards' datasets rank 0 joined: (joined dataset root, joined HDF5 file)."""
    out = tmp_path_factory.mktemp("joined")
    r = torchrun(2, ["-m", "fastrecord", "record", "PickCube-v1", "--obs-mode", "rgb",
                     "--sensor-configs", json.dumps(dict(width=SIZE, height=SIZE)), "--episodes", "5",
                     "--max-episode-steps", "6", "--width", "64", "--height", "64", "--no-video", "--seed", "3",
                     "--lerobot", "--output-dir", str(out)], timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "5 episodes from 2 shard(s)" in r.stdout
    return out / "trajectory.lerobot", out / "trajectory.h5"


def read_dataset(root: Path) -> tuple[dict, pd.DataFrame, pd.DataFrame, list[str]]:
    """(meta/info.json, every data row, every episode row, the tasks by index) of a LeRobot dataset."""
    info = json.loads((root / "meta" / "info.json").read_text())

    def rows(folder: Path) -> pd.DataFrame:
        return pd.concat([pq.read_table(p).to_pandas() for p in sorted(folder.glob("chunk-*/file-*.parquet"))],
                         ignore_index=True)

    tasks = pd.read_parquet(root / "meta" / "tasks.parquet")
    by_index = [str(t) for t in tasks.sort_values("task_index").index]
    return info, rows(root / "data"), rows(root / "meta" / "episodes"), by_index


def video_frames(root: Path, info: dict, episode: pd.Series, key: str) -> np.ndarray:
    """The episode's frames of camera ``key``, decoded by PyAV (this venv's) from its video file at the times
    LeRobot seeks: from_timestamp + k / fps."""
    path = root / info["video_path"].format(video_key=key, chunk_index=int(episode[f"videos/{key}/chunk_index"]),
                                            file_index=int(episode[f"videos/{key}/file_index"]))
    with av.open(str(path)) as c:
        decoded = [(float(f.pts * f.time_base), f.to_ndarray(format="rgb24")) for f in c.decode(c.streams.video[0])]
    times = np.array([t for t, _ in decoded])
    lo, fps = float(episode[f"videos/{key}/from_timestamp"]), info["fps"]
    picked = []
    for k in range(int(episode["length"])):
        hit = int(np.argmin(abs(times - (lo + k / fps))))
        assert abs(times[hit] - (lo + k / fps)) < 1e-4  # LeRobot's tolerance_s
        picked.append(decoded[hit][1])
    return np.stack(picked)


def recorded(h5_path: Path, episode: int, path: str) -> np.ndarray:
    """``traj_<episode>/<path>`` of the HDF5 recording of the same run (its episodes are the dataset's, in order)."""
    with h5py.File(h5_path) as f:
        return f[f"traj_{episode}/{path}"][:]


def recorded_frames(h5_path: Path, episode: int, key: str) -> np.ndarray:
    """The camera frames the env returned in episode ``episode`` (its rows: the last observation has no row)."""
    return recorded(h5_path, episode, f"obs/sensor_data/{key.removeprefix('observation.images.')}/rgb")[:-1]


def as_uint8(images: np.ndarray) -> np.ndarray:
    """LeRobot's [..., C, H, W] float frames in [0, 1] as [..., H, W, C] uint8."""
    return np.round(np.moveaxis(images, -3, -1) * 255).astype(np.uint8)


# ---------------------------------------------------------------------------------------------- the tests
@pytest.mark.parametrize("dataset", ["one_file", "many_files", "joined"])
def test_lerobot_reads_random_rows_with_both_video_backends(dataset, lerobot, request, tmp_path):
    """LeRobotDataset, with torchcodec and with pyav: as many rows and episodes as the dataset holds; random rows
    (and the last) hold their parquet values for every non-video feature of info.json, their task and the
    recorded action; each camera returns the row's frame and the one before (padded at an episode's start),
    equal to our PyAV decode of the file (exactly, with either backend) and matching the frames the env returned
    (PSNR >= 30 dB)."""
    root, h5_path = request.getfixturevalue(dataset)
    info, data, episodes, tasks = read_dataset(root)
    cameras = [k for k, v in info["features"].items() if v["dtype"] == "video"]
    values = [k for k, v in info["features"].items() if v["dtype"] not in ("video", "image", "string")]
    assert cameras and {"action", "observation.state", "index", "episode_index", "frame_index"} <= set(values)
    if dataset == "many_files":
        assert episodes[f"videos/{cameras[0]}/file_index"].nunique() > 1
    rng = np.random.default_rng(0)
    rows = sorted({*rng.choice(len(data), size=min(8, len(data)), replace=False).tolist(), len(data) - 1})
    lerobot("python", WORKER, "items", root, tmp_path / "items.npz", ",".join(BACKENDS), ",".join(map(str, rows)))
    saved = dict(np.load(tmp_path / "items.npz"))
    for backend in BACKENDS:
        meta = {k: saved[f"{backend}/meta/{k}"] for k in ("backend", "len", "episodes", "fps", "camera_keys")}
        assert (str(meta["backend"]), int(meta["len"]), int(meta["episodes"]), int(meta["fps"])) \
            == (backend, len(data), info["total_episodes"], info["fps"])
        assert sorted(meta["camera_keys"].tolist()) == sorted(cameras)

    for row in rows:
        parquet = data.iloc[row]
        ep = int(parquet["episode_index"])
        episode = episodes[episodes["episode_index"] == ep].iloc[0]
        k = int(parquet["frame_index"])
        for backend in BACKENDS:
            item = {key.split("/", 2)[2]: v for key, v in saved.items() if key.startswith(f"{backend}/{row}/")}
            for key in values:  # a feature of shape [1] comes back as a scalar
                assert item[key].size == math.prod(info["features"][key]["shape"]), (backend, row, key)
                np.testing.assert_array_equal(np.ravel(item[key]), np.ravel(parquet[key]).astype(item[key].dtype),
                                              err_msg=f"{backend} row {row} {key}")
            assert str(item["task"]) == tasks[int(parquet["task_index"])]
            np.testing.assert_array_equal(item["action"], recorded(h5_path, ep, "actions")[k])  # the env's action
            for cam in cameras:
                frames = as_uint8(item[cam])  # [2, H, W, 3]: frame k - 1 (k = 0: frame 0, padded), frame k
                assert frames.shape == (2, *info["features"][cam]["shape"]), (backend, cam, frames.shape)
                assert item[f"{cam}_is_pad"].tolist() == [k == 0, False]
                ours = video_frames(root, info, episode, cam)[[max(k - 1, 0), k]]
                np.testing.assert_array_equal(frames, ours, err_msg=f"{backend} row {row} {cam}")
                assert psnr(frames, recorded_frames(h5_path, ep, cam)[[max(k - 1, 0), k]]) >= 30, (backend, row, cam)


def test_lerobot_train_runs_act_on_the_dataset(one_file, lerobot, tmp_path):
    """``lerobot-train``: a small ACT policy (no pretrained backbone: nothing is downloaded), 3 steps of batches of
    4 on the CPU, offline, torchcodec decoding; a finite loss at every step; the checkpoint's policy has the
    dataset's features, and, loaded back with its processors, selects a finite action of the action's size
    for a row of the dataset."""
    root, _ = one_file
    info, data, _, _ = read_dataset(root)
    out = tmp_path / "train"
    r = lerobot("lerobot-train", "--dataset.repo_id=local/fastrecord", f"--dataset.root={root}",
                "--dataset.video_backend=torchcodec", "--policy.type=act", "--policy.device=cpu",
                "--policy.push_to_hub=false", "--policy.pretrained_backbone_weights=null", "--policy.dim_model=64",
                "--policy.n_heads=2", "--policy.dim_feedforward=128", "--policy.n_encoder_layers=1",
                "--policy.n_decoder_layers=1", "--policy.n_vae_encoder_layers=1", "--policy.chunk_size=4",
                "--policy.n_action_steps=4", "--steps=3", "--batch_size=4", "--num_workers=0", "--log_freq=1",
                "--save_freq=3", "--seed=0", f"--output_dir={out}", timeout=900)
    log = r.stdout + r.stderr
    losses = [float(x) for x in re.findall(r"step:\S+ .*?loss:(\S+)", log)]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses), log[-3000:]
    assert f"dataset.num_frames={len(data)}" in log.replace("'", "")
    model = out / "checkpoints" / "last" / "pretrained_model"
    assert {"config.json", "model.safetensors", "train_config.json"} <= {p.name for p in model.iterdir()}
    config = json.loads((model / "config.json").read_text())
    features = {k: v["shape"] for k, v in {**config["input_features"], **config["output_features"]}.items()}
    assert features["action"] == info["features"]["action"]["shape"]
    assert features["observation.state"] == info["features"]["observation.state"]["shape"]
    for key, feature in info["features"].items():
        if feature["dtype"] == "video":
            h, w, c = feature["shape"]
            assert features[key] == [c, h, w]
    lerobot("python", WORKER, "act", model, root, "7", tmp_path / "action.npz")
    action = np.load(tmp_path / "action.npz")["action"]
    assert action.shape == (1, *info["features"]["action"]["shape"]) and np.isfinite(action).all()
