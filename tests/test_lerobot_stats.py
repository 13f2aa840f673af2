"""LeRobot datasets ready for training (issue 29): statistics as LeRobot computes them, the full state,
random-access video, a dataset loadable after every finished episode. Self-contained: pyarrow, PyAV,
numpy; LeRobot's own algorithms are copied below (it cannot be imported here: it pins torch < 2.11)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import av
import h5py
import numpy as np
import pytest
from conftest import leaves

pytest.importorskip("pyarrow")
pytest.importorskip("pandas")
import pandas as pd
import pyarrow.parquet as pq

from fastrecord import RecordEpisode, RecordOptions
from fastrecord.sinks.lerobot.stats import image_stats
from fastrecord.testing import psnr

SIZE = 64
CAMERA = "observation.images.base_camera"
FPS = 20  # PickCube-v1's control frequency


# ------------------------------------------------------------------------------------------------------------
# LeRobot 0.4.4, src/lerobot/datasets/compute_stats.py (RunningQuantileStats with one update, get_feature_stats,
# sample_indices, auto_downsample_height_width, compute_episode_stats, aggregate_feature_stats), copied with
# the same numpy operations; images are given as arrays instead of PNG paths.
QUANTILES = [0.01, 0.10, 0.50, 0.90, 0.99]
QKEYS = [f"q{int(q * 100):02d}" for q in QUANTILES]


def lerobot_quantile(hist, edges, target):
    cumsum = np.cumsum(hist)
    idx = np.searchsorted(cumsum, target)
    if idx == 0:
        return edges[0]
    if idx >= len(cumsum):
        return edges[-1]
    count_before = cumsum[idx - 1]
    count_in_bin = cumsum[idx] - count_before
    if count_in_bin == 0:
        return edges[idx]
    fraction = (target - count_before) / count_in_bin
    return edges[idx] + fraction * (edges[idx + 1] - edges[idx])


def lerobot_running_stats(batch):
    batch = batch.reshape(-1, batch.shape[-1])
    n, width = batch.shape
    mean = np.mean(batch, axis=0)
    mean_sq = np.mean(batch**2, axis=0)
    lo, hi = np.min(batch, axis=0), np.max(batch, axis=0)
    edges = [np.linspace(lo[i] - 1e-10, hi[i] + 1e-10, 5001) for i in range(width)]
    hists = [np.zeros(5000) for _ in range(width)]
    for i in range(width):
        with np.testing.suppress_warnings() as sup:  # np.histogram converts booleans to uint8, and says so
            sup.filter(RuntimeWarning)
            hists[i] += np.histogram(batch[:, i], bins=edges[i])[0]
    stats = {"min": lo.copy(), "max": hi.copy(), "mean": mean, "std": np.sqrt(np.maximum(0, mean_sq - mean**2)),
             "count": np.array([n])}
    for key, q in zip(QKEYS, QUANTILES):
        stats[key] = np.array([lerobot_quantile(h, e, q * n) for h, e in zip(hists, edges)])
    return stats


def lerobot_feature_stats(array, image: bool):
    if image:  # axis=(0, 2, 3), keepdims
        b, c, h, w = array.shape
        reshaped, count = array.transpose(0, 2, 3, 1).reshape(-1, c), b
    else:  # axis=0
        reshaped, count = (array.reshape(-1, 1) if array.ndim == 1 else array), array.shape[0]
    if reshaped.shape[0] < 2:
        stats = {"min": np.min(reshaped, axis=0), "max": np.max(reshaped, axis=0), "mean": np.mean(reshaped, axis=0),
                 "std": np.std(reshaped, axis=0), "count": np.array([count])}
        stats.update({k: stats["mean"].copy() for k in QKEYS})
    else:
        stats = lerobot_running_stats(reshaped)
        stats["count"] = np.array([count])
    if image:
        return {k: v if k == "count" else np.squeeze(v.reshape(1, -1, 1, 1) / 255.0, axis=0) for k, v in stats.items()}
    return stats


def lerobot_sample_indices(n):
    num = max(min(100, n), min(int(n**0.75), 10_000))
    return np.round(np.linspace(0, n - 1, num)).astype(int).tolist()


def lerobot_downsample(img):  # [C, H, W]
    _, height, width = img.shape
    if max(width, height) < 300:
        return img
    factor = int(width / 150) if width > height else int(height / 150)
    return img[:, ::factor, ::factor]


def lerobot_image_stats(frames):
    sampled = np.stack([lerobot_downsample(frames[i].transpose(2, 0, 1)) for i in lerobot_sample_indices(len(frames))])
    return lerobot_feature_stats(sampled, image=True)


def lerobot_aggregate(stats_list):
    out = {}
    for key in {k for s in stats_list for k in s}:
        items = [s[key] for s in stats_list if key in s]
        means = np.stack([s["mean"] for s in items])
        variances = np.stack([s["std"] ** 2 for s in items])
        counts = np.stack([s["count"] for s in items])
        total = counts.sum(axis=0)
        while counts.ndim < means.ndim:
            counts = np.expand_dims(counts, axis=-1)
        mean = (means * counts).sum(axis=0) / total
        var = ((variances + (means - mean) ** 2) * counts).sum(axis=0) / total
        agg = {"min": np.min(np.stack([s["min"] for s in items]), axis=0),
               "max": np.max(np.stack([s["max"] for s in items]), axis=0), "mean": mean, "std": np.sqrt(var),
               "count": total}
        for q in QKEYS:
            agg[q] = (np.stack([s[q] for s in items]) * counts).sum(axis=0) / total
        out[key] = agg
    return out
# ------------------------------------------------------------------------------------------------------------


def true_image_std(frames):
    """The pixels' standard deviation per channel over LeRobot's sample, in [0, 1] (what LeRobot 0.4.4 means
    to compute: it squares uint8 pixels in uint8, which wraps)."""
    sampled = np.stack([lerobot_downsample(frames[i].transpose(2, 0, 1)) for i in lerobot_sample_indices(len(frames))])
    return sampled.transpose(1, 0, 2, 3).reshape(3, -1).astype(np.float64).std(1).reshape(3, 1, 1) / 255.0


def lerobot_buffer(traj: dict, names: list[str], episode: int, first_index: int) -> dict[str, np.ndarray]:
    """An episode as LeRobot's add_frame/save_episode hold it before compute_episode_stats: shape-(1,)
    features [T, 1], timestamps Python floats (float64), indices int64; the state as its names say."""
    t = len(traj["actions"])
    state = []
    for name in names:
        leaf, _, i = name.rpartition(".") if name.rpartition(".")[2].isdigit() else (name, "", "")
        state.append(traj["obs/" + leaf.replace(".", "/")][:t].reshape(t, -1)[:, int(i or 0)])
    return {
        "observation.state": np.stack(state, 1).astype(np.float32),
        "action": traj["actions"].astype(np.float32),
        "next.reward": traj["rewards"].astype(np.float32).reshape(t, 1),
        "next.done": (traj["terminated"] | traj["truncated"]).reshape(t, 1),
        "next.success": traj["success"].reshape(t, 1),
        "timestamp": np.stack([k / FPS for k in range(t)]),
        "frame_index": np.stack(list(range(t))),
        "episode_index": np.full((t,), episode),
        "index": np.arange(first_index, first_index + t),
        "task_index": np.array([0] * t),
    }


def record(out: Path, steps: tuple[int, ...], obs_mode: str = "rgb", check_each=None, **options) -> RecordEpisode:
    """PickCube-v1 on the CPU, episodes of ``steps`` steps (each ended by a reset), HDF5 + LeRobot in one run;
    ``check_each(env, finished)`` after each finished episode, before the run closes."""
    import gymnasium as gym
    import mani_skill.envs  # noqa: F401 - registers the tasks

    env = gym.make("PickCube-v1", obs_mode=obs_mode, sim_backend="physx_cpu", max_episode_steps=max(steps),
                   sensor_configs=dict(width=SIZE, height=SIZE))
    env = RecordEpisode(env, out, trajectory_name="pc", save_video=False, lerobot=True, **options)
    env.reset(seed=0)
    for i, n in enumerate(steps):
        for _ in range(n):
            env.step(env.action_space.sample())
        env.reset()
        if check_each is not None:
            env.wait_until_done()
            check_each(env, i + 1)
    env.close()
    return env


@pytest.fixture(scope="module")
def rgb_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("stats")
    seen = []

    def loadable(env, finished):  # the dataset as LeRobot reads it, after each finished episode
        root = out / "pc.lerobot"
        info = json.loads((root / "meta" / "info.json").read_text())
        episodes = pd.concat([pd.read_parquet(p) for p in sorted((root / "meta" / "episodes").glob("*/*.parquet"))])
        data = pd.concat([pd.read_parquet(p) for p in sorted((root / "data").glob("*/*.parquet"))])
        seen.append((info["total_episodes"], info["total_frames"], len(episodes), len(data),
                     decoded_frames(root, info, episodes)))

    record(out, (5, 1, 4, 3), check_each=loadable)
    return out, seen


def episodes_table(root: Path) -> pd.DataFrame:
    files = sorted((root / "meta" / "episodes").glob("*/*.parquet"))
    return pd.concat([pd.read_parquet(p) for p in files], ignore_index=True)


def decoded_frames(root: Path, info: dict, episodes: pd.DataFrame) -> int:
    """How many rows' frames decode at their timestamps (LeRobot's pyav way: seek, decode forward)."""
    n = 0
    for _, ep in episodes.iterrows():
        path = root / info["video_path"].format(video_key=CAMERA, chunk_index=ep[f"videos/{CAMERA}/chunk_index"],
                                                file_index=ep[f"videos/{CAMERA}/file_index"])
        for k in range(int(ep["length"])):
            n += read_at(path, ep[f"videos/{CAMERA}/from_timestamp"] + k / FPS) is not None
    return n


def read_at(path: Path, ts: float) -> np.ndarray | None:
    """The frame at ``ts`` seconds, as LeRobot's pyav backend reads it (keyframes-only seek, then decode
    forward); None when no frame lies within LeRobot's tolerance (1e-4 s)."""
    with av.open(str(path)) as c:
        stream = c.streams.video[0]
        c.seek(int(ts / stream.time_base), stream=stream, backward=True, any_frame=False)
        for frame in c.decode(stream):
            if frame.time >= ts - 1e-4:
                return frame.to_ndarray(format="rgb24") if abs(frame.time - ts) < 1e-4 else None
    return None


def test_every_finished_episode_is_loadable_before_close(rgb_run):
    """After each finished episode (the run still open, no repair), info.json counts it, its rows and episode
    row are in the files and every one of its frames decodes at its timestamp."""
    _, seen = rgb_run
    frames = np.cumsum([5, 1, 4, 3]).tolist()
    assert [s[0] for s in seen] == [1, 2, 3, 4] and [s[1] for s in seen] == frames
    assert [s[2] for s in seen] == [1, 2, 3, 4] and [s[3] for s in seen] == frames and [s[4] for s in seen] == frames


def test_stats_are_lerobots(rgb_run):
    """meta/episodes' per-episode stats and meta/stats.json equal LeRobot's compute_episode_stats and
    aggregate_stats (copied above) on the recorded data: every non-string feature, quantiles included, with
    LeRobot's types (integer and bool min/max stay integers and bools). Image std: the true one."""
    out, _ = rgb_run
    root = out / "pc.lerobot"
    info = json.loads((root / "meta" / "info.json").read_text())
    names = info["features"]["observation.state"]["names"]
    episodes = pq.read_table(sorted((root / "meta" / "episodes").glob("*/*.parquet"))[0])
    rows = episodes.to_pylist()
    with h5py.File(out / "pc.h5") as f:
        trajs = [leaves(f[f"traj_{i}"]) for i in range(len(f))]
    assert [len(t["actions"]) for t in trajs] == [5, 1, 4, 3]
    theirs, first = [], 0
    for i, (traj, row) in enumerate(zip(trajs, rows)):
        buffer = lerobot_buffer(traj, names, i, first)
        first += len(traj["actions"])
        ref = {k: lerobot_feature_stats(v, image=False) for k, v in buffer.items()}
        frames = traj["obs/sensor_data/base_camera/rgb"][: len(traj["actions"])]
        ref[CAMERA] = lerobot_image_stats(frames)
        theirs.append(ref)
        assert set(ref) == set(info["features"]) and len(ref) == 11
        for key, stats in ref.items():
            for stat, want in stats.items():
                got = row[f"stats/{key}/{stat}"]
                if key == CAMERA and stat == "std":
                    np.testing.assert_allclose(got, true_image_std(frames), rtol=1e-12)
                    continue
                np.testing.assert_allclose(np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64),
                                           rtol=1e-12, atol=0, err_msg=f"episode {i} {key} {stat}")
                assert np.asarray(got).shape == np.asarray(want).shape, (key, stat)
    for key in ("index", "frame_index"):  # integer features: integer min/max/count, as LeRobot writes them
        assert episodes.schema.field(f"stats/{key}/min").type.value_type == "int64"
    assert episodes.schema.field("stats/next.done/max").type.value_type == "bool"
    assert episodes.schema.field("stats/next.done/mean").type.value_type == "double"

    stats = json.loads((root / "meta" / "stats.json").read_text())
    agg = lerobot_aggregate(theirs)
    assert set(stats) == set(agg)
    for key, want in agg.items():
        assert set(stats[key]) == {"min", "max", "mean", "std", "count", *QKEYS}
        for stat, v in want.items():
            if key == CAMERA and stat == "std":
                continue
            # 1e-7: LeRobot squares its in-memory float32 episode std in float32, we the stored float64 value
            got = np.asarray(stats[key][stat], dtype=np.float64)
            np.testing.assert_allclose(got, v, rtol=1e-7, err_msg=f"{key} {stat}")
    assert stats["index"]["min"] == [0] and stats["index"]["max"] == [12] and stats["next.done"]["min"] == [False]
    assert stats["action"]["count"] == [13] and stats[CAMERA]["count"] == [13]  # every frame of short episodes


def test_stats_rebuilt_from_the_episode_columns_as_lerobot_edit_tools_do(rgb_run):
    """lerobot-edit-dataset delete_episodes rebuilds stats.json from the kept episodes' stats/* columns read
    with pandas (dataset_tools._copy_and_reindex_episodes_metadata, image stats flattened back to (3, 1, 1)):
    the columns hold what that needs, and the rebuilt stats of all episodes are stats.json's."""
    out, _ = rgb_run
    root = out / "pc.lerobot"
    info = json.loads((root / "meta" / "info.json").read_text())
    df = episodes_table(root)
    rebuilt = {ep: lerobot_row_stats(df[df["episode_index"] == ep].iloc[0].to_dict(), info) for ep in range(4)}
    for stats in rebuilt.values():
        assert set(stats[CAMERA]) == {"min", "max", "mean", "std", "count", *QKEYS}
        assert all(v.shape == (3, 1, 1) for k, v in stats[CAMERA].items() if k != "count")  # aggregate_stats asserts it
        assert all(v.ndim >= 1 and v.shape == (1,) for s in stats.values() for k, v in s.items() if k == "count")
    kept = lerobot_aggregate([rebuilt[ep] for ep in (0, 2, 3)])  # episode 1 deleted
    assert kept["action"]["count"].tolist() == [12] and kept[CAMERA]["q50"].shape == (3, 1, 1)
    full = json.loads((root / "meta" / "stats.json").read_text())
    again = lerobot_aggregate(list(rebuilt.values()))
    assert set(again) == set(full)
    for key in full:
        for stat in ("min", "max", "mean", "std", "count", *QKEYS):
            np.testing.assert_allclose(again[key][stat], np.asarray(full[key][stat], dtype=np.float64), rtol=1e-12)


def lerobot_row_stats(row: dict, info: dict) -> dict:
    """An episode's stats from its meta/episodes row read with pandas, as LeRobot 0.4.4's
    dataset_tools._copy_and_reindex_episodes_metadata rebuilds them (nested image arrays back to (3, 1, 1))."""
    stats: dict = {}
    for col, value in row.items():
        if not col.startswith("stats/"):
            continue
        feature, stat = col[len("stats/"):].split("/")
        if info["features"][feature]["dtype"] in ("image", "video") and stat != "count":
            if isinstance(value, np.ndarray) and value.dtype == object:
                flat = []
                for item in value:
                    while isinstance(item, np.ndarray):
                        item = item.flatten()[0]
                    flat.append(item)
                value = np.array(flat, dtype=np.float64).reshape(3, 1, 1)
            elif isinstance(value, np.ndarray) and value.shape == (3,):
                value = value.reshape(3, 1, 1)
        assert isinstance(value, np.ndarray), (feature, stat)
        stats.setdefault(feature, {})[stat] = value
    return stats


def test_random_frames_decode_at_their_timestamps_with_a_key_frame_every_two(rgb_run):
    """The videos have a key frame every 2 frames (lerobot_gop's default, LeRobot's g=2), and frames read at
    random rows' timestamps, LeRobot's way, are the recorded ones."""
    out, _ = rgb_run
    root = out / "pc.lerobot"
    info = json.loads((root / "meta" / "info.json").read_text())
    df = episodes_table(root)
    path = root / info["video_path"].format(video_key=CAMERA, chunk_index=0, file_index=0)
    with av.open(str(path)) as c:
        keys = [p.is_keyframe for p in c.demux(c.streams.video[0]) if p.size]
    # episodes of 5, 1, 4, 3 frames: each starts on a key frame, then one every 2 frames
    assert np.flatnonzero(keys).tolist() == [0, 2, 4, 5, 6, 8, 10, 12] and len(keys) == 13
    with h5py.File(out / "pc.h5") as f:
        rgb = [f[f"traj_{i}/obs/sensor_data/base_camera/rgb"][:] for i in range(4)]
    rng = np.random.default_rng(0)
    for ep, k in [(int(e), int(rng.integers(0, int(df.iloc[e]["length"])))) for e in rng.integers(0, 4, 12)]:
        frame = read_at(path, df.iloc[ep][f"videos/{CAMERA}/from_timestamp"] + k / FPS)
        assert frame is not None and psnr(frame, rgb[ep][k]) >= 30


def test_av1_and_picked_state_keys(tmp_path):
    """lerobot_video_codec='libsvtav1' (LeRobot's default encoding: AV1, crf 30, g=2) writes AV1 videos whose
    frames decode at their timestamps; lerobot_state_keys picks the state's leaves in its order."""
    record(tmp_path, (3, 2), lerobot_video_codec="libsvtav1", lerobot_state_keys="extra/tcp_pose,agent.qpos")
    root = tmp_path / "pc.lerobot"
    info = json.loads((root / "meta" / "info.json").read_text())
    names = info["features"]["observation.state"]["names"]
    assert names == [f"extra.tcp_pose.{i}" for i in range(7)] + [f"agent.qpos.{i}" for i in range(9)]
    assert info["features"][CAMERA]["info"]["video.codec"] == "av1"
    data = pd.read_parquet(root / "data" / "chunk-000" / "file-000.parquet")
    with h5py.File(tmp_path / "pc.h5") as f:
        traj = leaves(f["traj_1"])
    state = np.concatenate([traj["obs/extra/tcp_pose"][:2], traj["obs/agent/qpos"][:2]], 1).astype(np.float32)
    np.testing.assert_array_equal(np.stack(data["observation.state"].to_numpy()[3:]), state)
    path = root / "videos" / CAMERA / "chunk-000" / "file-000.mp4"
    with av.open(str(path)) as c:
        assert c.streams.video[0].codec_context.name in ("libdav1d", "av1", "libaom-av1")
    ep1 = episodes_table(root).iloc[1]
    frame = read_at(path, ep1[f"videos/{CAMERA}/from_timestamp"] + 1 / FPS)
    assert frame is not None and psnr(frame, traj["obs/sensor_data/base_camera/rgb"][1]) >= 28


def test_state_mode_names_every_dimension(tmp_path):
    """obs_mode='state': observation.state is the flat observation, each dimension named by ManiSkill's state
    dictionary (agent, then extra, in the env's order)."""
    record(tmp_path, (3,), obs_mode="state")
    root = tmp_path / "pc.lerobot"
    info = json.loads((root / "meta" / "info.json").read_text())
    names = info["features"]["observation.state"]["names"]
    assert len(names) == info["features"]["observation.state"]["shape"][0] == 42
    assert names[:10] == [f"agent.qpos.{i}" for i in range(9)] + ["agent.qvel.0"]
    assert names[18:20] == ["extra.is_grasped", "extra.tcp_pose.0"] and names[-1] == "extra.obj_to_goal_pos.2"
    data = pd.read_parquet(root / "data" / "chunk-000" / "file-000.parquet")
    with h5py.File(tmp_path / "pc.h5") as f:
        obs = f["traj_0/obs"][:3]
    np.testing.assert_array_equal(np.stack(data["observation.state"].to_numpy()), obs.astype(np.float32))


def test_image_stats_of_large_frames_are_lerobots():
    """A long episode of large frames: LeRobot's frame sample (T**0.75 of 600) and its stride-2 downsampling
    (a side of 300 or more), then its statistics; std the true one."""
    rng = np.random.default_rng(1)
    frames = np.clip(rng.normal(120, 40, (600, 40, 320, 3)), 0, 255).astype(np.uint8)
    frames[:, :20] //= 3  # two populations: the quantiles move
    ours, theirs = image_stats(frames), lerobot_image_stats(frames)
    assert ours["count"].tolist() == theirs["count"].tolist() == [len(lerobot_sample_indices(600))] != [600]
    for stat in ("min", "max", "mean", *QKEYS):
        np.testing.assert_allclose(ours[stat], theirs[stat], rtol=1e-12, err_msg=stat)
    np.testing.assert_allclose(ours["std"], true_image_std(frames), rtol=1e-12)
    assert not np.allclose(theirs["std"], true_image_std(frames))  # LeRobot 0.4.4's wraps (see stats.py)


def test_bad_state_keys_name_the_fix(tmp_path):
    with pytest.raises(ValueError, match="lerobot_state_keys=5 must name observation keys"):
        RecordOptions(lerobot_state_keys=5)
    with pytest.raises(ValueError, match="lerobot_gop=0 must be an integer >= 1"):
        RecordOptions(lerobot_gop=0)
    import threading

    import gymnasium as gym
    import mani_skill.envs  # noqa: F401 - registers the tasks

    # refused when the recorder is made, from the env's observation space: no episode run for nothing, no file,
    # no writer thread left behind (before, the first episode's end raised it, its trajectory already written)
    env = gym.make("PickCube-v1", obs_mode="rgb", sim_backend="physx_cpu", sensor_configs=dict(width=SIZE, height=SIZE))
    before = set(threading.enumerate())
    try:
        for keys in ("agent/nothing", "agent/qpos,agent/nothing"):
            with pytest.raises(ValueError, match=r"lerobot_state_keys: 'agent/nothing' names no observation leaf.*"
                                                 r"agent/qpos.*extra/tcp_pose"):
                RecordEpisode(env, tmp_path / "out", trajectory_name="pc", save_video=False, lerobot=True,
                              lerobot_state_keys=keys)
    finally:
        env.close()
    assert not (tmp_path / "out").exists() or list((tmp_path / "out").iterdir()) == []
    assert [t.name for t in set(threading.enumerate()) - before if t.name.startswith("fastrecord")] == []
    # a flat state observation has one leaf, "obs": any key names none of it
    env = gym.make("PickCube-v1", obs_mode="state", sim_backend="physx_cpu")
    try:
        with pytest.raises(ValueError, match=r"'agent/qpos' names no observation leaf: the observation is one array.*"
                                             r"lerobot_state_keys=None"):
            RecordEpisode(env, tmp_path / "state", save_video=False, lerobot=True, lerobot_state_keys="agent/qpos")
    finally:
        env.close()


@pytest.mark.parametrize("column", [
    np.random.default_rng(2).normal(0, 3, (257, 6)).astype(np.float32),  # floats, several dimensions
    np.round(np.random.default_rng(3).normal(0, 2, (100, 3))).astype(np.float32),  # heavy ties
    np.full((40, 2), 0.25, dtype=np.float32),  # a constant: every edge equal in float32
    np.random.default_rng(4).random((64, 1)) > 0.3,  # booleans
    np.arange(1000, 1023, dtype=np.int64),  # integers, 1-D
    np.array([[1.5, -2.0]], dtype=np.float32),  # one row: quantiles are the mean
    np.array([[1.5], [-2.0]], dtype=np.float32),  # two rows
], ids=["float", "ties", "constant", "bool", "int", "one-row", "two-rows"])
def test_vector_stats_are_lerobots(column):
    """Every column kind's statistics equal LeRobot's (copied above), values and dtypes."""
    from fastrecord.sinks.lerobot.stats import vector_stats

    ours, theirs = vector_stats(column), lerobot_feature_stats(column, image=False)
    assert set(ours) == set(theirs)
    for stat, want in theirs.items():
        np.testing.assert_array_equal(ours[stat], want, err_msg=stat)
        assert ours[stat].dtype == want.dtype and ours[stat].shape == want.shape, stat


def total_episodes_soon(info: Path, want: int, timeout: float = 20.0) -> int:
    """meta/info.json's total_episodes once it reaches ``want`` (the writer's timer writes the file groups,
    off the caller's thread), or what it says at the deadline."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        got = json.loads(info.read_text())["total_episodes"] if info.exists() else 0
        if got >= want or time.monotonic() > deadline:
            return got
        time.sleep(0.02)


def test_episodes_finishing_during_the_quiet_time_go_in_by_the_timer(rgb_run, tmp_path):
    """A committed part goes into the dataset's files on the writer's timer thread, not the caller's (which
    returns at once); episodes committed within the quiet time after a write (rewrites keep to a third of
    the time) wait as parts and the timer writes them without a further call; close() then has nothing left
    but the final write."""
    import time

    from fastrecord.sinks.lerobot import LeRobotWriter
    from fastrecord.video import VideoSettings

    out, _ = rgb_run
    with h5py.File(out / "pc.h5") as f:
        trajs = [leaves(f[f"traj_{i}"]) for i in range(2)]
    w = LeRobotWriter(tmp_path / "t.lerobot", tmp_path / "t.lerobot.parts", fps=FPS, task="PickCube-v1",
                      video=VideoSettings(fps=FPS, gop=2, executor="thread"))
    w.write_episode(w.reserve(), trajs[0], len(trajs[0]["actions"]))
    info = tmp_path / "t.lerobot" / "meta" / "info.json"
    assert total_episodes_soon(info, 1) == 1  # in at once, by the timer
    w._quiet_until = time.monotonic() + 0.5  # as after a write of 0.25 s
    w.write_episode(w.reserve(), trajs[1], len(trajs[1]["actions"]))
    assert json.loads(info.read_text())["total_episodes"] == 1 and w.pending == 1  # waits, committed
    assert total_episodes_soon(info, 2) == 2 and w.pending == 0
    w.close()
    assert json.loads(info.read_text())["total_frames"] == sum(len(t["actions"]) for t in trajs)


def test_the_writers_work_runs_in_helper_processes_and_their_errors_reach_the_caller(rgb_run, tmp_path):
    """The statistics, rows and file groups are written by the writer's helper processes (off the caller's
    GIL); a group write that fails there (a part's video gone) is raised here with its builtin type, the
    dataset keeps what info.json counted, the failed episode's part stays, and no process is left."""
    import os
    import time

    from fastrecord.sinks.lerobot import LeRobotWriter
    from fastrecord.video import VideoSettings

    out, _ = rgb_run
    with h5py.File(out / "pc.h5") as f:
        trajs = [leaves(f[f"traj_{i}"]) for i in range(2)]
    root, parts = tmp_path / "t.lerobot", tmp_path / "t.lerobot.parts"
    w = LeRobotWriter(root, parts, fps=FPS, task="PickCube-v1", video=VideoSettings(fps=FPS, gop=2, executor="thread"))
    w.write_episode(w.reserve(), trajs[0], len(trajs[0]["actions"]))
    assert total_episodes_soon(root / "meta" / "info.json", 1) == 1
    procs = [*w._part_procs, w._group_proc]
    assert all(p is not None and p.alive() and p.pid != os.getpid() for p in procs)
    info = json.loads((root / "meta" / "info.json").read_text())
    assert info["total_episodes"] == 1 and info["total_frames"] == len(trajs[0]["actions"])
    episode = pd.read_parquet(next((root / "meta" / "episodes").glob("*/*.parquet")))
    assert episode["stats/action/q50"][0].shape == (trajs[0]["actions"].shape[1],)  # computed there, read back
    w._quiet_until = time.monotonic() + 60  # the next part waits for close()
    w.write_episode(w.reserve(), trajs[1], len(trajs[1]["actions"]))
    assert w.pending == 1
    video = next(parts.glob("ep_00000001.*.mp4"))
    video.unlink()
    with pytest.raises(FileNotFoundError, match="ep_00000001"):
        w.close()
    assert json.loads((root / "meta" / "info.json").read_text())["total_episodes"] == 1
    assert (parts / "ep_00000001.parquet").exists()  # the committed part stays for resume / consolidate
    assert not any(p.alive() for p in procs)



def _meta_write_fails_after_a_group_commit(rgb_run: Any, tmp_path: Path, monkeypatch: Any) -> tuple[Any, list]:
    """A writer whose episode 0 is in the files, and whose group commit of episode 1 was followed by a failed
    meta/info.json write (ENOSPC, raised to the caller); the full disk stays until the caller undoes the patch."""
    import errno
    import time

    from fastrecord.sinks.lerobot import LeRobotWriter
    from fastrecord.video import VideoSettings

    out, _ = rgb_run
    with h5py.File(out / "pc.h5") as f:
        trajs = [leaves(f[f"traj_{i}"]) for i in range(2)]
    root = tmp_path / "t.lerobot"
    w = LeRobotWriter(root, tmp_path / "t.lerobot.parts", fps=FPS, task="PickCube-v1",
                      video=VideoSettings(fps=FPS, gop=2, executor="thread"))
    w.write_episode(w.reserve(), trajs[0], len(trajs[0]["actions"]))
    assert total_episodes_soon(root / "meta" / "info.json", 1) == 1
    w._quiet_until = time.monotonic() + 60  # the next part waits for the final write
    w.write_episode(w.reserve(), trajs[1], len(trajs[1]["actions"]))

    def full_disk(self: LeRobotWriter) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(LeRobotWriter, "_write_meta", full_disk)
    with pytest.raises(OSError, match="No space left"):
        w.roll(final=True)  # episode 1's group took its name, then info.json's write failed
    return w, trajs


def test_a_group_whose_meta_write_failed_is_never_written_again(rgb_run, tmp_path, monkeypatch):
    """The disk fills after a file group took its name (its episodes are in the dataset's files) and before
    meta/info.json is written, and stays full: the close raises that error and puts no episode in the files a
    second time; a resumed run's writer finds each episode once, writes the meta and goes on (the full-disk
    fault test's flake in CI: resume refused the dataset, an episode filed twice by the close's last write)."""
    from fastrecord.sinks.lerobot import LeRobotWriter
    from fastrecord.sinks.lerobot.check import scan_dataset
    from fastrecord.video import VideoSettings

    w, trajs = _meta_write_fails_after_a_group_commit(rgb_run, tmp_path, monkeypatch)
    root = tmp_path / "t.lerobot"
    with pytest.raises(OSError, match="No space left"):
        w.close()  # the meta still cannot be written
    assert scan_dataset(root).seqs == [0, 1]  # each episode once, in order
    monkeypatch.undo()  # space is back
    w = LeRobotWriter(root, tmp_path / "t.lerobot.parts", fps=FPS, task="PickCube-v1", resume=True,
                      video=VideoSettings(fps=FPS, gop=2, executor="thread"))
    w.write_episode(w.reserve(2), trajs[0], len(trajs[0]["actions"]))
    w.close()
    st = scan_dataset(root)
    assert st.seqs == [0, 1, 2] and not st.problems, st.problems
    info = json.loads((root / "meta" / "info.json").read_text())
    assert info["total_episodes"] == 3
    assert info["total_frames"] == 2 * len(trajs[0]["actions"]) + len(trajs[1]["actions"])


def test_a_meta_write_that_failed_is_written_at_close_once_there_is_space(rgb_run, tmp_path, monkeypatch):
    """The same failed meta write, then space comes back before the close: the close writes the meta, and the
    dataset is whole (each episode once, info.json's totals counting both)."""
    from fastrecord.sinks.lerobot.check import scan_dataset

    w, trajs = _meta_write_fails_after_a_group_commit(rgb_run, tmp_path, monkeypatch)
    monkeypatch.undo()
    w.close()
    root = tmp_path / "t.lerobot"
    st = scan_dataset(root)
    assert st.seqs == [0, 1] and not st.problems, st.problems
    info = json.loads((root / "meta" / "info.json").read_text())
    assert info["total_episodes"] == 2 and info["total_frames"] == sum(len(t["actions"]) for t in trajs)
