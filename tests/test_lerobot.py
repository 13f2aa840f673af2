"""LeRobot v3.0 datasets: fastrecord's own, written while recording (``lerobot=True``,
`fastrecord.sinks.lerobot`), and ManiSkill's converter (mani_skill/trajectory/convert_to_lerobot.py) run
on fastrecord's rgb trajectories. Read back with pyarrow and PyAV: parquet rows, videos, meta; compared
with the HDF5 recording of the same run and with the converter's schema; a SIGKILLed run resumed and
repaired. LeRobot itself loading these datasets and training on them: test_lerobot_interop.py (in LeRobot's own
venv). Needs the ``lerobot`` extra (pandas, opencv-python-headless, pyarrow, tyro)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import av
import h5py
import numpy as np
import pytest
import torch

for module in ("pandas", "cv2", "pyarrow", "tyro"):
    pytest.importorskip(module, reason=f"ManiSkill's LeRobot converter needs {module}: pip install -e '.[lerobot]'")

import pandas as pd  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
from conftest import fastrecord_cli, leaves, record_args, run_then_kill, torchrun, torchrun_env  # noqa: E402

from fastrecord import RecordEpisode  # noqa: E402
from fastrecord.sinks.lerobot import LeRobotSink  # noqa: E402
from fastrecord.testing import BatchedDoubleEnv, psnr  # noqa: E402
from fastrecord.video import VideoSettings, decode_mp4  # noqa: E402

SIZE = 64


def maniskill_convert(h5_path: Path, out: Path) -> subprocess.CompletedProcess:
    """ManiSkill's converter to LeRobot, as the README shows it (fps: PickCube's control frequency), on a
    PickCube-v1 trajectory of SIZE x SIZE images."""
    return subprocess.run([sys.executable, "-m", "mani_skill.trajectory.convert_to_lerobot", "--traj-path", str(h5_path),
                           "--output-dir", str(out), "--fps", "20", "--image-size", f"{SIZE}x{SIZE}", "--robot-type",
                           "panda"], capture_output=True, text=True, timeout=600)


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
    r = maniskill_convert(h5_path, out)
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


# ---------------------------------------------------------------------------------------------- fastrecord's sink
CAMERA_KEY = "observation.images.base_camera"
WORKER = Path(__file__).with_name("lerobot_worker.py")


def read_dataset(root: Path) -> tuple[dict, pd.DataFrame, pd.DataFrame]:
    """(info.json, every data row, every episode row) of a LeRobot dataset, files in order."""
    info = json.loads((root / "meta" / "info.json").read_text())
    data = pd.concat([pq.read_table(p).to_pandas() for p in sorted((root / "data").glob("chunk-*/file-*.parquet"))],
                     ignore_index=True)
    episodes = pd.concat(
        [pq.read_table(p).to_pandas() for p in sorted((root / "meta" / "episodes").glob("chunk-*/file-*.parquet"))],
        ignore_index=True,
    )
    return info, data, episodes


def decode_timed(path: Path) -> tuple[np.ndarray, np.ndarray, str, str]:
    """Every frame of a video (RGB), its time in seconds, the codec and the pixel format."""
    with av.open(str(path)) as c:
        stream = c.streams.video[0]
        codec, pix_fmt = stream.codec_context.name, stream.codec_context.pix_fmt
        frames = [(float(f.pts * f.time_base), f.to_ndarray(format="rgb24")) for f in c.decode(stream)]
    return np.stack([f for _, f in frames]), np.array([t for t, _ in frames]), codec, pix_fmt


def check_videos(root: Path, info: dict, episodes: pd.DataFrame, frames_of: list[np.ndarray] | None = None,
                 min_psnr: float = 30.0, exact: bool = True) -> None:
    """Every video file decodes; each episode's frames lie at from_timestamp + k / fps (LeRobot's reader seeks
    there), are as many as its rows, and match ``frames_of[episode]`` (the recorded frames). ``exact``: a
    file holds ``episodes``' frames and no more (else more may follow: a killed run's next episodes)."""
    fps = info["fps"]
    for key in [k for k, v in info["features"].items() if v["dtype"] == "video"]:
        for (chunk, file), eps in episodes.groupby([f"videos/{key}/chunk_index", f"videos/{key}/file_index"]):
            video, times, codec, pix_fmt = decode_timed(
                root / info["video_path"].format(video_key=key, chunk_index=chunk, file_index=file)
            )
            assert (codec, pix_fmt) == ("h264", "yuv420p")  # plays in browsers
            assert len(video) == eps["length"].sum() if exact else len(video) >= eps["length"].sum()
            start = 0.0
            for _, ep in eps.iterrows():
                lo, n = ep[f"videos/{key}/from_timestamp"], int(ep["length"])
                assert lo == pytest.approx(start, abs=1e-6) and ep[f"videos/{key}/to_timestamp"] == pytest.approx(
                    lo + n / fps, abs=1e-6
                )
                hits = [int(np.argmin(abs(times - (lo + k / fps)))) for k in range(n)]
                assert all(abs(times[h] - (lo + k / fps)) < 1e-4 for k, h in enumerate(hits))  # LeRobot's tolerance_s
                if frames_of is not None:
                    assert psnr(video[hits], frames_of[int(ep["episode_index"])]) >= min_psnr
                start = lo + n / fps


@pytest.fixture(scope="module")
def pickcube_run(tmp_path_factory):
    """A PickCube-v1 CPU recording (rgb observations, 64x64 sensor camera) written as HDF5 and LeRobot in one
    run; episodes of 5 (the time limit), 3, 4 and 2 steps, the keep filter dropping the one of 3."""
    import gymnasium as gym
    import mani_skill.envs  # registers the tasks
    from mani_skill.utils.registration import REGISTERED_ENVS

    assert "PickCube-v1" in REGISTERED_ENVS and mani_skill.envs
    out = tmp_path_factory.mktemp("pickcube")
    env = gym.make(
        "PickCube-v1",
        obs_mode="rgb",
        render_mode="rgb_array",
        sim_backend="physx_cpu",
        max_episode_steps=5,
        sensor_configs=dict(width=SIZE, height=SIZE),
        human_render_camera_configs=dict(width=SIZE, height=SIZE),
    )
    env = RecordEpisode(env, out, trajectory_name="demo", save_video=False, lerobot=True,
                        keep=lambda info: int(info["elapsed_steps"]) != 3)
    env.reset(seed=0)
    for steps in (5, 3, 4, 2):
        for _ in range(steps):
            env.step(env.action_space.sample())
        env.reset()
    env.close()
    return out


def test_lerobot_sink_equals_the_hdf5_recording(pickcube_run):
    root = pickcube_run / "demo.lerobot"
    info, data, episodes = read_dataset(root)
    with h5py.File(pickcube_run / "demo.h5") as f:
        trajs = [leaves(f[f"traj_{i}"]) for i in range(len(f))]
    lengths = [len(t["actions"]) for t in trajs]
    assert lengths == [5, 4, 2]  # the keep filter applies to both outputs alike
    assert not (pickcube_run / "demo.lerobot.parts").exists()  # closed: every episode is in the dataset's files

    # rows: one per step, the recorded values (ManiSkill's converter's mapping, plus reward/done/success)
    assert episodes["length"].tolist() == lengths and episodes["episode_index"].tolist() == [0, 1, 2]
    assert data["episode_index"].tolist() == [i for i, t in enumerate(lengths) for _ in range(t)]
    assert data["index"].tolist() == list(range(sum(lengths)))
    assert data["frame_index"].tolist() == [k for t in lengths for k in range(t)]
    np.testing.assert_allclose(
        data["timestamp"], [k / 20 for t in lengths for k in range(t)], atol=1e-6
    )  # PickCube: 20 Hz
    column = {k: np.stack(data[k].to_numpy()) for k in ("action", "observation.state")}
    np.testing.assert_array_equal(column["action"], np.concatenate([t["actions"] for t in trajs]))
    # observation.state: every non-image observation leaf, in the observation's order (ManiSkill's state)
    keys = ["obs/agent/qpos", "obs/agent/qvel", "obs/extra/is_grasped", "obs/extra/tcp_pose", "obs/extra/goal_pos"]
    state = np.concatenate([np.concatenate([t[k][:-1].reshape(len(t[k]) - 1, -1) for k in keys], 1) for t in trajs])
    np.testing.assert_array_equal(column["observation.state"], state.astype(np.float32))
    names = info["features"]["observation.state"]["names"]
    assert names[:2] == ["agent.qpos.0", "agent.qpos.1"] and names[9] == "agent.qvel.0" and len(names) == 29
    assert names[18:22] == ["extra.is_grasped", "extra.tcp_pose.0", "extra.tcp_pose.1", "extra.tcp_pose.2"]
    assert names[-1] == "extra.goal_pos.2"
    np.testing.assert_array_equal(data["next.reward"], np.concatenate([t["rewards"] for t in trajs]))
    np.testing.assert_array_equal(data["next.done"], np.concatenate([t["terminated"] | t["truncated"] for t in trajs]))
    np.testing.assert_array_equal(data["next.success"], np.concatenate([t["success"] for t in trajs]))
    assert data["next.done"].tolist().count(True) == 1  # the time limit of the first episode

    # episodes: many per file, their row ranges and video spans
    assert (episodes["data/chunk_index"] == 0).all() and (episodes["data/file_index"] == 0).all()
    assert episodes["dataset_from_index"].tolist() == [0, 5, 9] and episodes["dataset_to_index"].tolist() == [5, 9, 11]
    assert episodes["tasks"].map(list).tolist() == [["PickCube-v1"]] * 3
    check_videos(root, info, episodes, [t["obs/sensor_data/base_camera/rgb"][:-1] for t in trajs])

    # meta
    assert (info["codebase_version"], info["fps"], info["robot_type"]) == ("v3.0", 20, "panda")
    assert (info["total_episodes"], info["total_frames"], info["total_tasks"]) == (3, 11, 1)
    assert info["features"][CAMERA_KEY]["shape"] == [SIZE, SIZE, 3]
    assert info["features"][CAMERA_KEY]["info"]["video.codec"] == "h264"
    assert list(pd.read_parquet(root / "meta" / "tasks.parquet").index) == ["PickCube-v1"]
    stats = json.loads((root / "meta" / "stats.json").read_text())
    assert stats["action"]["count"] == [11]
    np.testing.assert_allclose(stats["action"]["mean"], column["action"].mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(stats["action"]["std"], column["action"].std(0), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(stats["observation.state"]["max"], column["observation.state"].max(0), rtol=1e-6)
    assert set(stats["action"]) == {"min", "max", "mean", "std", "count", "q01", "q10", "q50", "q90", "q99"}
    rgb = np.concatenate([t["obs/sensor_data/base_camera/rgb"][:-1] for t in trajs]).reshape(-1, 3) / 255.0
    np.testing.assert_allclose(np.ravel(stats[CAMERA_KEY]["mean"]), rgb.mean(0), rtol=1e-6)
    np.testing.assert_allclose(np.ravel(stats[CAMERA_KEY]["std"]), rgb.std(0), rtol=1e-5)


def test_lerobot_sink_has_the_schema_of_maniskills_converter(pickcube_run, tmp_path):
    """ManiSkill's converter run on the HDF5 file of the same episodes: every feature, episode column and data
    column it writes is ours too, with the same dtypes, shapes and names and the same episode index, but for
    its extra ``task`` string column (LeRobot's own datasets carry the task as task_index +
    meta/tasks.parquet, which both have) and observation.state (theirs: qpos, ours: the whole state, qpos
    first); so are its info.json keys but for those LeRobot 0.4's LeRobotDataset.create does not write
    (``total_chunks``, ``total_videos``, a ``fps`` in each feature)."""
    conv = tmp_path / "converted"
    r = maniskill_convert(pickcube_run / "demo.h5", conv)
    assert r.returncode == 0, r.stderr[-3000:]
    info, data, episodes = read_dataset(pickcube_run / "demo.lerobot")
    their_info, their_data, their_episodes = read_dataset(conv)

    assert set(their_info) - set(info) == {"total_chunks", "total_videos"}
    for key in ("codebase_version", "robot_type", "total_episodes", "total_frames", "total_tasks", "fps",
                "splits", "data_path", "video_path", "chunks_size"):
        assert info[key] == their_info[key], key
    assert set(their_info["features"]) - set(info["features"]) == {"task"}
    for key, theirs in their_info["features"].items():
        if key == "task":
            continue
        ours = info["features"][key]
        assert "fps" not in ours, key
        if key == "observation.state":
            assert ours["names"][:9] == [f"agent.qpos.{i}" for i in range(9)] and theirs["shape"] == [9]
            np.testing.assert_array_equal(np.stack(data[key].to_numpy())[:, :9], np.stack(their_data[key].to_numpy()))
            continue
        assert (ours["dtype"], ours["shape"], ours["names"]) == (theirs["dtype"], theirs["shape"], theirs["names"]), key
        if theirs["dtype"] == "video":  # the same keys; the codec: H.264 here, mp4v (no browser plays it) there
            assert (
                set(ours["info"]) == set(theirs["info"])
                and their_info["features"][key]["info"]["video.codec"] == "mp4v"
            )
            assert ours["info"]["video.fps"] == 20 and isinstance(ours["info"]["video.fps"], int)  # as LeRobot's

    assert set(their_episodes.columns) <= set(episodes.columns)
    for col in (
        "episode_index",
        "length",
        "dataset_from_index",
        "dataset_to_index",
        "data/chunk_index",
        "data/file_index",
        f"videos/{CAMERA_KEY}/from_timestamp",
        "stats/action/min",
        "stats/action/count",
    ):
        if col.endswith("from_timestamp"):  # they store each episode in a file of its own: 0 each
            assert (their_episodes[col] == 0).all() and episodes[col].tolist() == [0, 0.25, 0.45]
            continue
        assert [np.ravel(v).tolist() for v in episodes[col]] == [np.ravel(v).tolist() for v in their_episodes[col]], col
    assert set(their_data.columns) - set(data.columns) == {"task"}
    for col in ("episode_index", "index", "frame_index", "task_index"):
        assert data[col].tolist() == their_data[col].tolist(), col
    np.testing.assert_array_equal(np.stack(data["action"].to_numpy()), np.stack(their_data["action"].to_numpy()))
    np.testing.assert_array_equal(data["timestamp"].to_numpy(), their_data["timestamp"].to_numpy())


def record_double(out: Path, rounds: int, **sink_kw) -> RecordEpisode:
    """``rounds`` of 4 episodes of 3 steps in a 4-env `BatchedDoubleEnv` (rgb observations), LeRobot through a
    `LeRobotSink` with ``sink_kw``, and HDF5."""
    env = BatchedDoubleEnv(num_envs=4, max_episode_steps=3, size=32, obs_mode="rgb", success_step=[2, 0, 3, 0])
    sink = LeRobotSink(20, "Double-v0", VideoSettings(), **sink_kw)
    env = RecordEpisode(env, out, trajectory_name="double", save_video=False, sinks=[sink], keep="success")
    for r in range(rounds):
        env.reset(seed=r)
        for _ in range(3):
            env.step(torch.as_tensor(env.action_space.sample()).reshape(4, -1))
    env.close()
    return env


def test_the_videos_and_the_dataset_encode_under_one_limit_while_the_env_steps(tmp_path, monkeypatch):
    """``lerobot=True`` beside the videos: the recorder's encoders share one `EncodeGate`, so while the env steps
    no more than its limit (the cores a CPU vector env's sub-envs leave: here 1) encode at once, the videos' and the
    dataset's together; at the close every output is written (its dataset's videos equal the recorded frames)."""
    import threading
    import time

    from fastrecord import video as video_mod
    from fastrecord.sinks import mp4 as mp4_mod

    lock, active, most, calls = threading.Lock(), [0], [0], [0]

    def counting(real):
        def encode(*args, **kwargs):
            with lock:
                active[0] += 1
                calls[0] += 1
                most[0] = max(most[0], active[0])
            try:
                time.sleep(0.05)  # long enough for another encode to start beside it, were it allowed
                return real(*args, **kwargs)
            finally:
                with lock:
                    active[0] -= 1
        return encode

    monkeypatch.setattr(mp4_mod, "encode_mp4", counting(mp4_mod.encode_mp4))  # the videos'
    monkeypatch.setattr(video_mod, "encode_mp4", counting(video_mod.encode_mp4))  # the dataset's (imported at its call)
    monkeypatch.setattr("fastrecord.sinks.factory.stepping_video_workers", lambda workers, processes, cores: 1)
    env = BatchedDoubleEnv(num_envs=4, max_episode_steps=3, size=32, obs_mode="rgb")
    env = RecordEpisode(env, tmp_path, trajectory_name="double", lerobot=True, video_workers=4)
    rec = env.recorder
    assert rec.videos._gate is rec.lerobot.gate and rec.lerobot.gate.limit == 1
    for r in range(2):
        env.reset(seed=r)
        for _ in range(3):
            env.step(torch.as_tensor(env.action_space.sample()).reshape(4, -1))
    env.reset(seed=2)  # the second round's episodes end here
    deadline = time.monotonic() + 120
    while calls[0] < 16:  # 8 videos, 8 of the dataset's: encoded while the "env steps" (nobody waits)
        assert time.monotonic() < deadline, f"{calls[0]} of 16 encodes in 120 s"
        time.sleep(0.02)
    assert most[0] == 1 == rec.lerobot.gate.most
    env.close()
    info, _, episodes = read_dataset(tmp_path / "double.lerobot")
    assert info["total_episodes"] == 8 and len(list(tmp_path.glob("*.mp4"))) == 8
    with h5py.File(tmp_path / "double.h5") as f:
        frames = [f[f"traj_{i}/obs/sensor_data/base_camera/rgb"][:-1] for i in range(8)]
    check_videos(tmp_path / "double.lerobot", info, episodes, frames, min_psnr=28)


def test_lerobot_files_roll_past_the_size_limit_and_keep_success(tmp_path):
    """A video limit of a few KiB: a new file every couple of episodes, each with the episodes' offsets in its
    own file; keep='success' writes the two succeeding envs' episodes only."""
    record_double(tmp_path, rounds=4, video_files_size_in_mb=0.004)
    info, data, episodes = read_dataset(tmp_path / "double.lerobot")
    with h5py.File(tmp_path / "double.h5") as f:
        trajs = [leaves(f[f"traj_{i}"]) for i in range(len(f))]
    assert len(trajs) == info["total_episodes"] == 8  # envs 0 and 2 succeed, every round
    assert all(t["success"][-1] for t in trajs)
    assert episodes["length"].tolist() == [len(t["actions"]) for t in trajs] == [3] * 8
    files = episodes["data/file_index"].tolist()
    assert files[0] == 0 and files == sorted(files) and len(set(files)) >= 2  # rolled, in episode order
    assert (episodes[f"videos/{CAMERA_KEY}/file_index"] == episodes["data/file_index"]).all()
    assert len(list((tmp_path / "double.lerobot" / "data").glob("*/*.parquet"))) == len(set(files))
    np.testing.assert_array_equal(np.stack(data["observation.state"].to_numpy()),
                                  state_by_names(trajs, info["features"]["observation.state"]["names"]))
    assert data["next.success"].tolist() == [False, True, True, False, False, True] * 4  # env 0 from step 2, env 2 at 3
    check_videos(
        tmp_path / "double.lerobot",
        info,
        episodes,
        [t["obs/sensor_data/base_camera/rgb"][:-1] for t in trajs],
        min_psnr=28,
    )


def state_by_names(trajs: list[dict[str, np.ndarray]], names: list[str]) -> np.ndarray:
    """observation.state as its dimension names say (``agent.qpos.3``: column 3 of obs/agent/qpos), from the
    HDF5 episodes (each observation but the last), float32."""
    cols = []
    for name in names:
        leaf, _, i = name.rpartition(".") if name.rpartition(".")[2].isdigit() else (name, "", "")
        leaf = "obs/" + leaf.replace(".", "/")
        cols.append(np.concatenate([t[leaf][:-1].reshape(len(t["actions"]), -1)[:, int(i or 0)] for t in trajs]))
    return np.stack(cols, 1).astype(np.float32)


def kill_worker(out: Path, min_finished: int) -> int:
    """Run tests/lerobot_worker.py until ``min_finished`` episodes are committed, go on a moment, SIGKILL it;
    returns how many it had reported committed."""
    return run_then_kill([sys.executable, str(WORKER), str(out)], min_finished, 0.7)[0]


def check_killed(out: Path, durable: int) -> tuple[int, int, int]:
    """What a killed run left: the dataset as LeRobot's reader loads it (the episodes and the first rows that
    info.json counts: numbered 0, 1, ..., their rows in place, every video frame at its time), the episodes
    committed past those counts (in the files, or in a committed ``.pending`` episodes file) and the parts
    (each readable); returns (episodes LeRobot loads, episodes in the files, parts)."""
    root, parts = out / "crash.lerobot", out / "crash.lerobot.parts"
    visible = 0
    committed: set[int] = set()
    if (root / "meta" / "info.json").exists():
        info, data, episodes = read_dataset(root)
        visible, frames = info["total_episodes"], info["total_frames"]
        seen = episodes[episodes["episode_index"] < visible]
        assert seen["episode_index"].tolist() == list(range(visible)) and seen["length"].sum() == frames <= len(data)
        assert data["index"][:frames].tolist() == list(range(frames)) and data["episode_index"][:frames].max() < visible
        check_videos(root, info, seen, exact=False)
        committed |= set(episodes["episode_index"])
    committing = list(root.glob("meta/episodes/*/*.parquet.pending"))  # a file committed, its renames to come
    for p in committing:
        committed |= set(pq.read_table(p)["episode_index"].to_pylist())
    from fastrecord.sinks.lerobot.writer import FILE_META

    consumed = {
        seq
        for p in [*root.glob("meta/episodes/*/*.parquet"), *committing]  # parts a file holds: removed
        for seq in json.loads(pq.read_schema(p).metadata[FILE_META])["parts"]
    }  # after it (a kill may come first)
    pending = (
        [p for p in sorted(parts.glob("ep_*.parquet")) if int(p.name[3:11]) not in consumed] if parts.is_dir() else []
    )
    for p in pending:  # a finished episode not yet in a file: its rows and its video
        table = pq.read_table(p)
        video, _, _, _ = decode_timed(p.with_name(p.stem + f".{CAMERA_KEY}.mp4"))
        assert len(video) == table.num_rows == 4
    assert len(committed) + len(pending) >= durable
    return visible, len(committed), len(pending)


def check_complete(out: Path, at_least: int, durable: int) -> tuple[pd.DataFrame, np.ndarray, list[np.ndarray]]:
    """The dataset holds ``at_least`` episodes, numbered 0, 1, ... in files, and no parts; its first
    ``durable`` episodes (those both outputs had committed before the kill) are the HDF5 file's first ones.
    Returns its episode rows, its action column and the HDF5 file's actions."""
    info, data, episodes = read_dataset(out / "crash.lerobot")
    assert not (out / "crash.lerobot.parts").exists()
    n = len(episodes)
    assert n >= at_least and episodes["episode_index"].tolist() == list(range(n))
    assert data["index"].tolist() == list(range(len(data))) and info["total_episodes"] == n
    with h5py.File(out / "crash.h5") as f:
        actions = [f[f"traj_{i}/actions"][:] for i in range(len(f))]
    ours = np.stack(data["action"].to_numpy())
    np.testing.assert_array_equal(ours[: 4 * durable], np.concatenate(actions[:durable]))
    check_videos(out / "crash.lerobot", info, episodes)
    return episodes, ours, actions


def committed_episodes(out: Path) -> int:
    """The run's commit log: the kept episodes every output held (a kept episode's row waits for all of them)."""
    from fastrecord.sinks.results import read_results

    return sum(r["episode_id"] is not None for r in read_results(out / "crash.results.jsonl"))


def resume_four_steps(out: Path) -> None:
    """tests/lerobot_worker.py's recorder on ``out`` again (``resume``: it takes up the committed parts, drops the
    rest, goes on after them), one episode of 4 steps in each of its 4 envs, closed."""
    sys.path.insert(0, str(WORKER.parent))
    from lerobot_worker import make

    env = make(str(out), "resume")
    env.reset(seed=100)
    for _ in range(4):
        env.step(torch.as_tensor(env.action_space.sample()).reshape(4, -1))
    env.close()


def kill_worker_at(out: Path, patch: str) -> None:
    """Run tests/lerobot_worker.py on ``out`` with ``patch`` (Python run first, in the worker's process: it
    kills the process with ``os._exit(9)`` at a chosen point, as a SIGKILL: no cleanup, no flush)."""
    script = (
        "import os, sys, pathlib\n"
        f"sys.path[:0] = [{str(WORKER.parents[1] / 'src')!r}, {str(WORKER.parent)!r}]  # this checkout's fastrecord\n"
        "from fastrecord.sinks.lerobot import writer\n"
        + patch
        + "from lerobot_worker import main\n"
        "main(sys.argv[1], 'error')\n"
    )
    r = subprocess.run([sys.executable, "-c", script, str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 9, r.stderr[-3000:]


def test_lerobot_sigkill_then_resume(tmp_path):
    durable = kill_worker(tmp_path, min_finished=12)
    visible, in_files, pending = check_killed(tmp_path, durable)
    assert visible > 0 and durable > 0  # LeRobot reads the dataset as it is (the run's newest commits may lag)
    from fastrecord.sinks.results import read_results

    committed = committed_episodes(tmp_path)
    assert durable <= committed <= in_files + pending
    resume_four_steps(tmp_path)
    # every output holds the same episodes: the committed ones, then the resumed run's 4, each once
    episodes, ours, theirs = check_complete(tmp_path, at_least=committed + 4, durable=committed + 4)
    assert len(episodes) == len(theirs) == committed + 4
    rows = read_results(tmp_path / "crash.results.jsonl")
    assert [r["episode_id"] for r in rows] == list(range(committed + 4))
    assert [r["length"] for r in rows] == episodes["length"].tolist()


def test_a_kill_while_a_file_is_committed_leaves_a_loadable_dataset(tmp_path):
    """The process dies inside the step that writes a file group, after its rows and episodes took their
    names and before meta/info.json counts them (deterministic here): LeRobot's reader, which reads what
    info.json counts, loads the dataset of the episodes before, every frame in place; a resumed run counts
    the committed ones and goes on."""
    kill_worker_at(tmp_path, (
        "calls = []\n"
        "original = writer.LeRobotWriter._write_meta\n"
        "def write_meta(self):\n"
        "    calls.append(1)\n"
        "    if len(calls) == 3:\n"
        "        os._exit(9)\n"
        "    original(self)\n"
        "writer.LeRobotWriter._write_meta = write_meta\n"
    ))
    root = tmp_path / "crash.lerobot"
    visible, in_files, pending = check_killed(tmp_path, durable=0)  # info.json, the rows and episodes it counts agree
    assert in_files > visible > 0  # episodes in the dataset, more committed but not yet counted
    done = committed_episodes(tmp_path)
    assert visible <= done <= in_files + pending
    resume_four_steps(tmp_path)
    assert not list(root.rglob(".*.next"))
    episodes, _, _ = check_complete(tmp_path, at_least=done + 4, durable=done + 4)  # the outputs agree
    assert len(episodes) == done + 4


@pytest.mark.parametrize("where", ["before-renames", "between-renames"])
def test_a_kill_between_a_groups_rewrite_and_its_renames_is_taken_up(tmp_path, where):
    """The open file group is rewritten with more episodes: its ``.pending`` episodes file is written beside
    the older one, then the renames give it (and its hidden rows) their names. A kill before them, or between
    the rows' rename and the episodes file's (deterministic here), leaves both episodes files of the group:
    the dataset LeRobot loads is whole, ``fastrecord info`` reports no damage, and a resumed run takes the
    ``.pending`` commit up and goes on (the fault CI found under load: the resume refused the dataset)."""
    kill_worker_at(tmp_path, (
        f"where = {where!r}\n"
        "original_group = writer.LeRobotWriter._group\n"
        "class Killing:\n"
        "    def __init__(self, proc): self.proc = proc\n"
        "    def call(self, name, *args):\n"
        "        done = self.proc.call(name, *args)\n"
        "        if name == 'write_group' and not args[3]:  # a rewrite of a group that holds episodes\n"
        "            if where == 'before-renames':\n"
        "                os._exit(9)  # as a kill: no cleanup, no flush\n"
        "            pathlib.Path(done['staged']).replace(done['data'])\n"
        "            os._exit(9)\n"
        "        return done\n"
        "    def __getattr__(self, name): return getattr(self.proc, name)\n"
        "writer.LeRobotWriter._group = lambda self: Killing(original_group(self))\n"
    ))
    root = tmp_path / "crash.lerobot"
    committing = list(root.glob("meta/episodes/*/*.parquet.pending"))
    assert len(committing) == 1 and committing[0].with_name(committing[0].name[: -len(".pending")]).exists()
    visible, in_files, pending = check_killed(tmp_path, durable=0)  # LeRobot loads what info.json counts, whole
    assert in_files > visible > 0
    info = fastrecord_cli("info", str(tmp_path))
    assert info.returncode == 0 and "damage" not in info.stdout, info.stdout + info.stderr[-2000:]
    done = committed_episodes(tmp_path)
    assert visible <= done <= in_files + pending
    resume_four_steps(tmp_path)
    assert not list(root.rglob("*.pending")) and not list(root.rglob(".*.next"))
    episodes, _, _ = check_complete(tmp_path, at_least=done + 4, durable=done + 4)  # the outputs agree
    assert len(episodes) == done + 4


def test_lerobot_sigkill_then_consolidate(tmp_path):
    """``fastrecord consolidate NAME.lerobot`` folds a killed run's parts into the dataset."""
    durable = kill_worker(tmp_path, min_finished=8)
    visible, in_files, pending = check_killed(tmp_path, durable)
    done = committed_episodes(tmp_path)
    assert durable <= done and visible <= done  # LeRobot's reader sees committed episodes only
    r = fastrecord_cli("consolidate", str(tmp_path / "crash.lerobot"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"{done} episodes" in r.stdout  # what every output held: the trajectory is consolidated with it
    check_complete(tmp_path, at_least=done, durable=done)


def test_lerobot_without_pyarrow_names_the_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow -> ImportError
    env = BatchedDoubleEnv(num_envs=2, max_episode_steps=3, size=32, obs_mode="rgb")
    with pytest.raises(ValueError, match=r"pyarrow is not installed: pip install 'fastrecord\[lerobot\]'"):
        RecordEpisode(env, tmp_path, lerobot=True)
    assert not any(tmp_path.iterdir())  # refused before anything was written


def test_record_command_writes_only_lerobot(tmp_path):
    """``fastrecord record --lerobot --no-trajectory --no-video``: the LeRobot dataset alone, a state
    observation (obs_mode=state) as observation.state, no video."""
    r = fastrecord_cli(*record_args(tmp_path, episodes=2, max_steps=3), "--lerobot", "--no-trajectory", "--no-video",
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert str(tmp_path / "trajectory.lerobot") in r.stdout  # the summary lists the dataset
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trajectory.fastrecord.json", "trajectory.lerobot",
                                                          "trajectory.results.jsonl"]
    info, data, episodes = read_dataset(tmp_path / "trajectory.lerobot")
    assert info["video_path"] is None and not (tmp_path / "trajectory.lerobot" / "videos").exists()
    state = np.stack(data["observation.state"].to_numpy())
    assert info["features"]["observation.state"]["shape"] == [state.shape[1]] and state.shape == (
        6,
        42,
    )  # PickCube's state
    assert episodes["length"].tolist() == [3, 3] and data["next.done"].tolist() == [False, False, True] * 2
    rows = [json.loads(line) for line in (tmp_path / "trajectory.results.jsonl").read_text().splitlines()]
    assert [row["episode_id"] for row in rows] == [0, 1]


# ---------------------------------------------------------------------------------------------- sharded runs
def same_dataset(a: Path, b: Path, frames_of: list[np.ndarray]) -> None:
    """Datasets ``a`` and ``b`` hold the same episodes: info.json, every data row, every meta/episodes column
    (indices, from/to timestamps, per-episode stats), stats.json and tasks; the videos of ``b`` decode to
    ``frames_of`` (PSNR >= 30) at the timestamps LeRobot seeks."""
    info_a, data_a, eps_a = read_dataset(a)
    info_b, data_b, eps_b = read_dataset(b)
    assert info_a == info_b
    assert list(data_a.columns) == list(data_b.columns) and len(data_a) == len(data_b)
    for col in data_a.columns:
        np.testing.assert_array_equal(np.stack(data_a[col].to_numpy()), np.stack(data_b[col].to_numpy()), err_msg=col)
    assert list(eps_a.columns) == list(eps_b.columns)
    for col in eps_a.columns:
        va, vb = (
            [
                np.ravel(np.stack(v)) if isinstance(v, np.ndarray) and v.dtype == object else np.ravel(v)
                for v in eps_a[col]
            ],
            [
                np.ravel(np.stack(v)) if isinstance(v, np.ndarray) and v.dtype == object else np.ravel(v)
                for v in eps_b[col]
            ],
        )
        for x, y in zip(va, vb):
            if x.dtype.kind == "f":
                np.testing.assert_allclose(x, y, rtol=1e-9, atol=1e-12, err_msg=col)
            else:
                np.testing.assert_array_equal(x, y, err_msg=col)
    sa, sb = (json.loads((r / "meta" / "stats.json").read_text()) for r in (a, b))
    assert sa.keys() == sb.keys()
    for k in sa:
        for stat in sa[k]:
            np.testing.assert_allclose(
                np.asarray(sa[k][stat], float), np.asarray(sb[k][stat], float), rtol=1e-9, err_msg=f"{k} {stat}"
            )
    assert pd.read_parquet(a / "meta" / "tasks.parquet").equals(pd.read_parquet(b / "meta" / "tasks.parquet"))
    check_videos(b, info_b, eps_b, frames_of)


def test_join_datasets_reorders_across_files(tmp_path):
    """`join_datasets` on a dataset of several files, its episodes taken in another order: rows, indices,
    stats and videos (cut out of their files without re-encoding) are those of the source episodes."""
    from fastrecord.sinks.lerobot.join import episode_entries, join_datasets

    record_double(tmp_path / "src", rounds=4, video_files_size_in_mb=0.004)
    root = tmp_path / "src" / "double.lerobot"
    info, data, episodes = read_dataset(root)
    assert episodes[f"videos/{CAMERA_KEY}/file_index"].nunique() > 1
    n = len(episodes)
    order = list(range(n))[::2] + list(range(n))[1::2]
    assert (
        join_datasets(tmp_path / "joined.lerobot", [(root, ep, {"global_index": g}) for g, ep in enumerate(order)]) == n
    )
    ji, jd, je = read_dataset(tmp_path / "joined.lerobot")
    assert (ji["total_episodes"], ji["total_frames"]) == (n, len(data))
    assert je["episode_index"].tolist() == list(range(n)) and jd["index"].tolist() == list(range(len(data)))
    assert je["length"].tolist() == episodes["length"].iloc[order].tolist()
    for new, old in enumerate(order):
        a, b = jd[jd["episode_index"] == new], data[data["episode_index"] == old]
        np.testing.assert_array_equal(np.stack(a["action"].to_numpy()), np.stack(b["action"].to_numpy()))
        np.testing.assert_array_equal(a["timestamp"], b["timestamp"])
    np.testing.assert_allclose(
        json.loads((tmp_path / "joined.lerobot" / "meta" / "stats.json").read_text())["action"]["mean"],
        np.stack(data["action"].to_numpy()).astype(np.float64).mean(0),
        rtol=1e-6,
        atol=1e-6,  # the stats are float32 sums of random actions in [-1, 1]: a mean near 0 has no relative precision
    )
    frames = {}
    for (chunk, file), eps in episodes.groupby([f"videos/{CAMERA_KEY}/chunk_index", f"videos/{CAMERA_KEY}/file_index"]):
        video, times, _, _ = decode_timed(
            root / info["video_path"].format(video_key=CAMERA_KEY, chunk_index=chunk, file_index=file)
        )
        for _, ep in eps.iterrows():
            lo = ep[f"videos/{CAMERA_KEY}/from_timestamp"]
            frames[int(ep["episode_index"])] = video[
                [int(np.argmin(abs(times - (lo + k / 20)))) for k in range(int(ep["length"]))]
            ]
    check_videos(tmp_path / "joined.lerobot", ji, je, [frames[old] for old in order], min_psnr=99)  # the same packets
    assert [e["global_index"] for _, e, _ in episode_entries(tmp_path / "joined.lerobot")] == list(range(n))
    with pytest.raises(ValueError, match=r"holds episodes 1, 3, 5.* that the datasets being joined no longer have"):
        join_datasets(
            tmp_path / "joined.lerobot", [(root, ep, {"global_index": g}) for g, ep in enumerate(order) if g % 2 == 0]
        )
    assert read_dataset(tmp_path / "joined.lerobot")[0]["total_episodes"] == n  # left as it was


SHARDED = [
    "-m",
    "fastrecord",
    "record",
    "PickCube-v1",
    "--obs-mode",
    "rgb",
    "--sensor-configs",
    json.dumps(dict(width=SIZE, height=SIZE)),
    "--episodes",
    "5",
    "--max-episode-steps",
    "6",
    "--width",
    "64",
    "--height",
    "64",
    "--no-video",
    "--seed",
    "3",
    "--lerobot",
]


@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory):
    """The same 5 PickCube-v1 episodes (rgb, --lerobot) recorded by one process and by torchrun with 2
    ranks (gloo on 127.0.0.1); (plain run dir, sharded run dir, the sharded run's stdout)."""
    base = tmp_path_factory.mktemp("lrshards")
    r = subprocess.run([sys.executable, *SHARDED, "--output-dir", str(base / "plain")], capture_output=True, text=True,
                       timeout=600, env=torchrun_env())
    assert r.returncode == 0, r.stderr[-3000:]
    r = torchrun(2, [*SHARDED, "--output-dir", str(base / "sharded")], timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return base / "plain", base / "sharded", r.stdout


def test_sharded_record_joins_the_lerobot_shards(sharded_runs):
    plain, sharded, stdout = sharded_runs
    assert (
        "5 episodes from 2 shard(s)" in stdout
        and f"{sharded / 'trajectory.lerobot'}: 5 episodes (LeRobot v3.0)" in stdout
    )
    for rank, gs in ((0, [0, 2, 4]), (1, [1, 3])):  # each rank's own dataset: its share, in its order
        from fastrecord.sinks.lerobot.join import episode_entries

        shard = sharded / "trajectory.shards" / f"rank{rank:05d}" / "trajectory.lerobot"
        assert [(e["global_index"], e["source_rank"]) for _, e, _ in episode_entries(shard)] == [(g, rank) for g in gs]
    with h5py.File(plain / "trajectory.h5") as f:
        frames = [f[f"traj_{i}/obs/sensor_data/base_camera/rgb"][:-1] for i in range(5)]
    same_dataset(plain / "trajectory.lerobot", sharded / "trajectory.lerobot", frames)
    assert not [p.name for p in sharded.iterdir() if p.name.startswith(".trajectory.lerobot")]  # no temporaries left


def test_merge_again_rebuilds_the_same_lerobot_dataset(sharded_runs, tmp_path):
    """``fastrecord merge`` of the run again (a killed join's leftovers present): the same dataset; with a
    shard gone, it refuses to drop that shard's episodes from the joined dataset."""
    import shutil

    plain, sharded, _ = sharded_runs
    run = tmp_path / "run"
    shutil.copytree(sharded, run)
    (run / ".trajectory.lerobot.join" / "parts").mkdir(parents=True)  # what a killed join leaves
    (run / ".trajectory.lerobot.join" / "parts" / "ep_00000000.parquet").write_bytes(b"torn")
    r = fastrecord_cli("merge", str(run), env={"OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"{run / 'trajectory.lerobot'}: 5 episodes (LeRobot v3.0)" in r.stdout
    assert not (run / ".trajectory.lerobot.join").exists()
    with h5py.File(plain / "trajectory.h5") as f:
        frames = [f[f"traj_{i}/obs/sensor_data/base_camera/rgb"][:-1] for i in range(5)]
    same_dataset(plain / "trajectory.lerobot", run / "trajectory.lerobot", frames)
    shutil.rmtree(run / "trajectory.shards" / "rank00001" / "trajectory.lerobot")
    r = fastrecord_cli("merge", str(run), env={"OMP_NUM_THREADS": "1"})
    assert r.returncode != 0 and "holds episodes 1, 3 that the datasets being joined no longer have" in r.stderr
    assert read_dataset(run / "trajectory.lerobot")[0]["total_episodes"] == 5  # kept


def test_replay_workers_join_the_lerobot_shards(pickcube_run, tmp_path):
    """``replay --workers 2 --lerobot``: each worker writes its share's dataset; the joined one (episodes
    in the source's order) equals a one-process replay's in one env (the same order)."""
    from fastrecord import replay_trajectories

    kw = dict(obs_mode="rgb", lerobot=True, save_video=False, trajectory_name="rp")
    one = replay_trajectories(
        str(pickcube_run / "demo.h5"), str(tmp_path / "one"), workers=1, num_envs=1, **kw
    )  # in order
    two = replay_trajectories(str(pickcube_run / "demo.h5"), str(tmp_path / "two"), workers=2, **kw)
    assert (one.kept, two.kept, two.workers) == (3, 3, 2) and tmp_path / "two" / "rp.lerobot" in two.files
    with h5py.File(tmp_path / "one" / "rp.h5") as f:
        frames = [f[f"traj_{i}/obs/sensor_data/base_camera/rgb"][:-1] for i in range(3)]
    same_dataset(tmp_path / "one" / "rp.lerobot", tmp_path / "two" / "rp.lerobot", frames)


def test_make_eval_envs_sharded_lerobot_without_trajectory(tmp_path, monkeypatch):
    """make_eval_envs(episodes=3, record_kwargs=dict(lerobot=True)) (no trajectory, world size 1): closing
    joins the shard's LeRobot dataset alone, global episodes 0..2 in order."""
    from fastrecord import make_eval_envs
    from fastrecord.make_env import sharding_of

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    env_kwargs = dict(
        obs_mode="rgb",
        render_mode="rgb_array",
        max_episode_steps=4,
        control_mode="pd_ee_delta_pos",
        sensor_configs=dict(width=SIZE, height=SIZE),
        human_render_camera_configs=dict(width=SIZE, height=SIZE),
    )
    envs = make_eval_envs(
        "PushCube-v1",
        2,
        "physx_cpu",
        env_kwargs,
        dict(obs_horizon=1),
        video_dir=str(tmp_path),
        episodes=3,
        seed=7,
        record_kwargs=dict(lerobot=True, save_video=False, trajectory_name="ev"),
    )
    try:
        envs.reset()
        batches = 0
        while batches < 2:
            _, _, _, truncated, _ = envs.step(np.zeros((2, 4), dtype=np.float32))
            batches += bool(np.asarray(truncated).any())
    finally:
        envs.close()
    report = sharding_of(envs).report
    assert report.ok and not report.trajectory and report.lerobot_episodes == 3 and report.shards == {0: 3}
    assert (
        report.lines()[0]
        == f"{tmp_path / 'ev.lerobot'}: 3 episodes (LeRobot v3.0) from 1 shard(s); the shards hold no trajectory"
    )
    rows = [json.loads(x) for x in (tmp_path / "ev.results.jsonl").read_text().splitlines()]
    assert [(r["global_index"], r["episode_id"]) for r in rows] == [(g, g) for g in range(3)]  # each kept row once
    assert not (tmp_path / "ev.h5").exists()
    info, data, episodes = read_dataset(tmp_path / "ev.lerobot")
    assert episodes["length"].tolist() == [4, 4, 4] and data["index"].tolist() == list(range(12))
    shard, _, _ = read_dataset(tmp_path / "ev.shards" / "rank00000" / "ev.lerobot")
    assert shard == info
    check_videos(tmp_path / "ev.lerobot", info, episodes)


def test_a_failed_meta_write_then_resume_files_each_episode_once(tmp_path):
    """A disk that fills while a file group is committed: its rows and episodes file took their names, then
    meta/info.json's write fails (deterministic here: the third call raises ENOSPC once). The run ends with that
    error, and no later write files the group's episodes a second time (in a new group); a resumed run finds each
    committed episode once and goes on (the fault CI met once on a full disk: resume refused the dataset)."""
    script = (
        "import errno, sys\n"
        f"sys.path[:0] = [{str(WORKER.parents[1] / 'src')!r}, {str(WORKER.parent)!r}]  # this checkout's fastrecord\n"
        "from fastrecord.sinks.lerobot import writer\n"
        "calls = []\n"
        "original = writer.LeRobotWriter._write_meta\n"
        "def write_meta(self):\n"
        "    calls.append(1)\n"
        "    if len(calls) == 3:\n"
        "        raise OSError(errno.ENOSPC, 'No space left on device')\n"
        "    original(self)\n"
        "writer.LeRobotWriter._write_meta = write_meta\n"
        "from lerobot_worker import main\n"
        "main(sys.argv[1], 'error')\n"
    )
    r = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "No space left on device" in r.stderr, r.stderr[-3000:]
    from fastrecord.sinks.lerobot.check import scan_dataset

    seqs = scan_dataset(tmp_path / "crash.lerobot").seqs
    assert len(seqs) == len(set(seqs)), seqs  # no episode in two file groups
    done = committed_episodes(tmp_path)
    resume_four_steps(tmp_path)
    episodes, _, _ = check_complete(tmp_path, at_least=done + 4, durable=done + 4)
    assert len(episodes) == done + 4
