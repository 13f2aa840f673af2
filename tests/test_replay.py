"""fastrecord replay: round trips against the recording, files from ManiSkill's recorder, errors.

Real ManiSkill CPU envs (lavapipe rendering), 64x64 cameras, episodes of 6-14 steps. The recordings
mix a scripted PushCube success and a failure, of different lengths (so replay slots refill).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import gymnasium as gym
import h5py
import numpy as np
import pytest
from conftest import CAMERA, leaves

from fastrecord.replay import ReplayConfig, run_replay
from fastrecord.sinks.results import read_results
from fastrecord.video import decode_mp4

ENV_ID = "PushCube-v1"
MAX_STEPS = 16
# (seed, policy, steps): scripted episodes stop once successful; the still one fails
EPISODES = [(1, "scripted", MAX_STEPS), (2, "still", 6), (4, "scripted", MAX_STEPS)]
KW = dict(obs_mode="state", control_mode="pd_ee_delta_pos", render_mode="rgb_array", sim_backend="physx_cpu",
          human_render_camera_configs=CAMERA, max_episode_steps=MAX_STEPS)


def push_cube_policy():
    path = Path(__file__).parents[1] / "scripts" / "evaluate.py"
    spec = importlib.util.spec_from_file_location("fastrecord_example_evaluate", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.push_cube_policy


def record(wrapper_cls, out: Path, name: str) -> Path:
    import mani_skill.envs  # noqa: F401

    policy = push_cube_policy()
    env = wrapper_cls(gym.make(ENV_ID, **KW), str(out), trajectory_name=name, save_video=False)
    for seed, kind, steps in EPISODES:
        obs, _ = env.reset(seed=seed)
        for _ in range(steps):
            action = policy(np.asarray(obs)) if kind == "scripted" else np.zeros((1, 4), np.float32)
            obs, _, _, _, info = env.step(action)
            if bool(info["success"]):
                break
    env.close()
    return out / f"{name}.h5"


@pytest.fixture(scope="module")
def fastrecord_file(tmp_path_factory) -> Path:
    from fastrecord import RecordEpisode

    return record(RecordEpisode, tmp_path_factory.mktemp("fastrecord"), "demo")


@pytest.fixture(scope="module")
def maniskill_file(tmp_path_factory) -> Path:
    from mani_skill.utils.wrappers import RecordEpisode

    return record(RecordEpisode, tmp_path_factory.mktemp("maniskill"), "ms_demo")


def replay(path: Path, out: Path, **kw) -> tuple:
    """Replay in a SyncVectorEnv (one process: quicker to start for these small files)."""
    cfg = ReplayConfig.from_values(
        dict(traj_path=str(path), output_dir=str(out), progress=False, **{"vector": "sync", **kw})
    )
    s = run_replay(cfg)
    new = sorted(out.glob("*.h5"))
    assert len(new) == 1
    return s, new[0], json.loads(new[0].with_suffix(".json").read_text())


def assert_same_episodes(original: Path, new_h5: Path, new_meta: dict, state_atol: float) -> None:
    """Every output episode equals the input episode it names in source_episode_id."""
    old_meta = json.loads(original.with_suffix(".json").read_text())
    old_eps = {e["episode_id"]: e for e in old_meta["episodes"]}
    with h5py.File(original) as f, h5py.File(new_h5) as g:
        for ep in new_meta["episodes"]:
            src = old_eps[ep["source_episode_id"]]
            assert (ep["episode_seed"], ep["elapsed_steps"], ep["success"]) == (
                src["episode_seed"],
                src["elapsed_steps"],
                src["success"],
            )
            a, b = leaves(f[f"traj_{src['episode_id']}"]), leaves(g[f"traj_{ep['episode_id']}"])
            assert a.keys() == b.keys()
            for k in a:
                if k.startswith("env_states/"):
                    # PhysX stores articulations in reduced coordinates: a set/get round trip moves
                    # their float32 poses by ~1e-8; actors come back bit-exact
                    np.testing.assert_allclose(b[k], a[k], rtol=0, atol=state_atol, err_msg=k)
                elif a[k].dtype == np.bool_ or k == "actions":
                    np.testing.assert_array_equal(b[k], a[k], err_msg=k)
                else:
                    np.testing.assert_allclose(b[k], a[k], rtol=0, atol=1e-5, err_msg=k)


def test_replay_by_states_reproduces_recorded_states_and_success(fastrecord_file, tmp_path):
    """Two CPU envs side by side (AsyncVectorEnv, the default), refilled as episodes end; videos re-rendered."""
    cfg = ReplayConfig(traj_path=str(fastrecord_file), output_dir=str(tmp_path), progress=False, num_envs=2)
    s = run_replay(cfg)
    assert (s.episodes, s.kept, s.successes, s.diverged) == (3, 3, 2, [])
    new_h5 = tmp_path / "demo.state.pd_ee_delta_pos.physx_cpu.h5"
    meta = json.loads(new_h5.with_suffix(".json").read_text())
    assert sorted(e["source_episode_id"] for e in meta["episodes"]) == [0, 1, 2]
    assert_same_episodes(fastrecord_file, new_h5, meta, state_atol=1e-6)
    with h5py.File(fastrecord_file) as f:
        actors = [k for k in leaves(f["traj_0"]) if k.startswith("env_states/actors/")]
    with h5py.File(fastrecord_file) as f, h5py.File(new_h5) as g:  # actors' states: bit-exact
        for ep in meta["episodes"]:
            for k in actors:
                np.testing.assert_array_equal(
                    g[f"traj_{ep['episode_id']}/{k}"][:], f[f"traj_{ep['source_episode_id']}/{k}"][:]
                )
    videos = sorted(p for p in s.files if p.suffix == ".mp4")
    assert len(videos) == 3 and sorted(p.name.endswith("_success.mp4") for p in videos) == [False, True, True]
    for ep in meta["episodes"]:
        (video,) = tmp_path.glob(f"{ep['episode_id']}_env*.mp4")
        assert decode_mp4(video).shape == (ep["elapsed_steps"] + 1, CAMERA["height"], CAMERA["width"], 3)


def test_the_writer_process_starts_while_the_envs_are_made(fastrecord_file, tmp_path, monkeypatch):
    """The replay starts its recorder's HDF5 writer process before it makes its envs (`fastrecord.prestart`): when
    the recorder asks for one, it is waiting, and it writes the replay."""
    from fastrecord import prestart
    from fastrecord.sinks.maniskill_h5.layout import WRITER_PROCESS_MODULE

    asked = []
    real = prestart.helper

    def helper(module, name, **kw):
        asked.append((name, kw.get("keep_after_error", False), prestart.spares(module, keep_after_error=False)))
        return real(module, name, **kw)

    monkeypatch.setattr(prestart, "helper", helper)
    monkeypatch.setattr("fastrecord.sinks.maniskill_h5.writer.helper", helper)
    s, new_h5, meta = replay(fastrecord_file, tmp_path, num_envs=1)
    assert asked[0] == ("HDF5 writer process 0", False, 1)  # the recorder's, a spare waiting
    assert s.kept == 3 and sorted(e["source_episode_id"] for e in meta["episodes"]) == [0, 1, 2]
    assert prestart.spares(WRITER_PROCESS_MODULE, keep_after_error=False) == 0


def test_replay_by_actions_agrees_on_success(fastrecord_file, tmp_path):
    """CPU PhysX is deterministic: seeded resets and the recorded actions give the recorded successes.

    In one env, episodes replay in the recorded order and come out bit-exact. Side by side, an episode
    may follow another predecessor in its env's scene than it did when recorded, and PhysX's contact
    caches outlive resets: it starts exactly as recorded and ends with the recorded success.
    """
    s, new_h5, meta = replay(fastrecord_file, tmp_path / "one", by="actions", num_envs=1, save_video=False)
    assert (s.episodes, s.successes, s.diverged) == (3, 2, [])
    assert [e["source_episode_id"] for e in meta["episodes"]] == [0, 1, 2]
    assert_same_episodes(fastrecord_file, new_h5, meta, state_atol=0)

    s, new_h5, meta = replay(fastrecord_file, tmp_path / "two", by="actions", num_envs=2, save_video=False)
    assert (s.episodes, s.successes, s.diverged) == (3, 2, [])
    with h5py.File(fastrecord_file) as f, h5py.File(new_h5) as g:
        for ep in meta["episodes"]:
            a, b = leaves(f[f"traj_{ep['source_episode_id']}"]), leaves(g[f"traj_{ep['episode_id']}"])
            np.testing.assert_array_equal(b["actions"], a["actions"])
            assert b["success"][-1] == a["success"][-1]
            for k in a:
                if k.startswith("env_states/"):
                    np.testing.assert_array_equal(b[k][0], a[k][0], err_msg=k)


def test_replay_by_actions_reports_diverging_episodes(fastrecord_file, tmp_path):
    """A recording whose success flags disagree with its actions: the replay names those episodes."""
    tampered = tmp_path / "in" / "demo.h5"
    tampered.parent.mkdir()
    shutil.copy(fastrecord_file, tampered)
    shutil.copy(fastrecord_file.with_suffix(".json"), tampered.with_suffix(".json"))
    with h5py.File(tampered, "r+") as f:
        f["traj_0/success"][-1] = False
    s, _, _ = replay(tampered, tmp_path / "out", by="actions", num_envs=1, save_video=False)
    assert [(d.episode_id, d.recorded, d.replayed) for d in s.diverged] == [(0, False, True)]


def test_file_written_by_maniskill_record_episode_replays(maniskill_file, tmp_path):
    s, new_h5, meta = replay(maniskill_file, tmp_path, num_envs=2, save_video=False)
    assert (s.episodes, s.kept, s.successes, s.diverged) == (3, 3, 2, [])
    assert sorted(e["source_episode_id"] for e in meta["episodes"]) == [0, 1, 2]
    assert_same_episodes(maniskill_file, new_h5, meta, state_atol=1e-6)


def test_rgb_rerecording_holds_the_images_the_env_renders(fastrecord_file, tmp_path, monkeypatch):
    """state -> rgb: each recorded image is what the env renders in the recorded state. Two envs in one
    process: their renders are submitted together (`ReplayStates.prepare`) and read after."""
    import mani_skill.envs  # noqa: F401

    from fastrecord.replay import envs as replay_envs

    observed = []
    rendered_before = replay_envs._rendered

    def counting(base):
        observed.append(base)
        return rendered_before(base)

    monkeypatch.setattr(replay_envs, "_rendered", counting)
    sensors = dict(width=48, height=48)
    s, new_h5, meta = replay(fastrecord_file, tmp_path, obs_mode="rgb", num_envs=2, count=3,
                             video_source="sensor:base_camera", env_kwargs=dict(sensor_configs=sensors))
    assert s.episodes == 3 and len(s.files) == 6  # h5, json, three videos from the sensor camera, results
    assert len(observed) == s.env_steps and len({id(b) for b in observed}) == 2  # every step took the prepared path
    env = gym.make(ENV_ID, **{**KW, "obs_mode": "rgb", "sensor_configs": sensors})
    try:
        env.reset(seed=0)
        with h5py.File(new_h5) as g:
            for ep in meta["episodes"]:
                traj = g[f"traj_{ep['episode_id']}"]
                images = traj["obs/sensor_data/base_camera/rgb"][:]
                assert images.shape == (ep["elapsed_steps"] + 1, 48, 48, 3)
                states = leaves(traj["env_states"])
                (video,) = tmp_path.glob(f"{ep['episode_id']}_env*.mp4")
                frames = decode_mp4(video)
                for t in (0, ep["elapsed_steps"] // 2, ep["elapsed_steps"]):
                    tree: dict = {}
                    for k, v in states.items():
                        group, name = k.split("/")
                        tree.setdefault(group, {})[name] = v[t : t + 1]
                    env.unwrapped.set_state_dict(tree)
                    rendered = env.unwrapped.get_obs()["sensor_data"]["base_camera"]["rgb"][0].numpy()
                    np.testing.assert_array_equal(images[t], rendered)
                    assert np.abs(frames[t].astype(int) - rendered.astype(int)).mean() < 12  # H.264 at crf 23
    finally:
        env.close()


def test_keep_success_and_batched_env_path(fastrecord_file, tmp_path):
    """keep='success' writes the successful replays only; vector='batched' is the GPU-sim code path
    (one ManiSkill env holding N envs), which runs on the CPU with N = 1."""
    s, new_h5, meta = replay(fastrecord_file, tmp_path, vector="batched", keep="success")
    assert (s.episodes, s.kept, s.successes) == (3, 2, 2)
    assert [e["source_episode_id"] for e in meta["episodes"]] == [0, 2] and all(e["success"] for e in meta["episodes"])
    assert sorted(p.name for p in tmp_path.glob("*.mp4")) == ["0_env0_success.mp4", "1_env0_success.mp4"]
    assert_same_episodes(fastrecord_file, new_h5, meta, state_atol=1e-6)


# ---------------------------------------------------------------------------------------------- errors
def test_output_is_never_overwritten_without_asking(fastrecord_file, tmp_path):
    replay(fastrecord_file, tmp_path, count=1, num_envs=1, save_video=False)
    with pytest.raises(
        ValueError, match=r"already holds .*demo\.state\.pd_ee_delta_pos\.physx_cpu\.h5.*--resume.*--overwrite"
    ) as e:
        replay(fastrecord_file, tmp_path, count=1, num_envs=1, save_video=False)
    assert "if-exists" not in str(e.value) and "if_exists" not in str(e.value)  # replay has no such option
    s, _, meta = replay(fastrecord_file, tmp_path, count=1, num_envs=1, save_video=False, overwrite=True)
    assert s.episodes == 1 and len(meta["episodes"]) == 1


def test_replay_trajectories_from_python(fastrecord_file, tmp_path):
    """``fastrecord.replay_trajectories``: the replay as a function, its options checked once, before any file."""
    import fastrecord

    with pytest.raises(TypeError, match=r"replay_trajectories\(\) got an unexpected keyword argument 'obs'"):
        fastrecord.replay_trajectories(fastrecord_file, tmp_path / "bad", obs=1)
    with pytest.raises(ValueError, match="vector='nope'"):
        fastrecord.replay_trajectories(fastrecord_file, tmp_path / "bad", vector="nope")
    assert not (tmp_path / "bad").exists()
    s = fastrecord.replay_trajectories(fastrecord_file, tmp_path / "out", count=2, num_envs=1, vector="sync",
                                       save_video=False, progress=False)
    assert isinstance(s, fastrecord.ReplaySummary)
    assert (s.episodes, s.kept, s.successes, s.diverged) == (2, 2, 1, [])
    new_h5 = tmp_path / "out" / "demo.state.pd_ee_delta_pos.physx_cpu.h5"
    assert s.files[:2] == [new_h5, new_h5.with_suffix(".json")]
    assert_same_episodes(fastrecord_file, new_h5, json.loads(new_h5.with_suffix(".json").read_text()), state_atol=1e-6)


def test_refuses_to_write_over_its_input(fastrecord_file, tmp_path):
    with pytest.raises(ValueError, match="write over its input"):
        replay(fastrecord_file, fastrecord_file.parent, trajectory_name="demo", overwrite=True)


def write(path: Path, data: bytes | str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data) if isinstance(data, bytes) else path.write_text(data)
    return path


def test_missing_corrupt_and_foreign_files_are_named(fastrecord_file, tmp_path):
    def error(path: Path, **kw) -> str:
        with pytest.raises(ValueError) as e:
            run_replay(
                ReplayConfig.from_values(
                    dict(traj_path=str(path), output_dir=str(tmp_path / "out"), progress=False, **kw)
                )
            )
        return str(e.value)

    assert "does not exist" in error(tmp_path / "nope.h5")
    lonely = write(tmp_path / "lonely" / "a.h5", b"")
    assert "a.json" in error(lonely) and "is missing" in error(lonely)
    corrupt = write(tmp_path / "corrupt" / "b.h5", b"not an hdf5 file" * 10)
    write(corrupt.with_suffix(".json"), fastrecord_file.with_suffix(".json").read_text())
    msg = error(corrupt)
    assert str(corrupt) in msg and "not a readable HDF5 file" in msg
    bad_json = write(tmp_path / "badjson" / "c.h5", fastrecord_file.read_bytes())
    write(bad_json.with_suffix(".json"), '{"env_info": {')
    assert "c.json" in error(bad_json) and "not valid JSON" in error(bad_json)
    foreign = tmp_path / "foreign" / "d.h5"
    foreign.parent.mkdir()
    with h5py.File(foreign, "w") as f:
        f["images"] = np.zeros((2, 4))
    write(foreign.with_suffix(".json"), json.dumps({"name": "something else"}))
    assert "not ManiSkill trajectory metadata" in error(foreign)
    write(foreign.with_suffix(".json"), fastrecord_file.with_suffix(".json").read_text())
    msg = error(foreign)
    assert "has no group 'traj_0'" in msg and "do not belong together" in msg
    assert "no env_states" in error(write_without_states(fastrecord_file, tmp_path / "nostates" / "e.h5"))
    assert "--obs-mode rgb" in error(fastrecord_file, video_source="sensor:base_camera")


def write_without_states(src: Path, dst: Path) -> Path:
    dst.parent.mkdir(parents=True)
    shutil.copy(src.with_suffix(".json"), dst.with_suffix(".json"))
    with h5py.File(src) as f, h5py.File(dst, "w") as g:
        for traj in f:
            g[f"{traj}/actions"] = f[f"{traj}/actions"][:]
    return dst


def test_cli_prints_summary_and_errors(fastrecord_file, tmp_path, capsys):
    from fastrecord.commands.cli import main

    out = tmp_path / "cli"
    assert main(["replay", str(fastrecord_file), "--output-dir", str(out), "--count", "2", "--num-envs", "1",
                 "--no-video", "--by", "actions", "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "replayed 2 episodes by actions: 1 successful, 2 written" in printed
    assert "success matches the recording in every episode" in printed
    assert main(["replay", str(tmp_path / "missing.h5")]) == 2
    assert "missing.h5" in capsys.readouterr().err


def _replay_parser():
    import argparse

    from fastrecord.commands.cli import build_parser

    parser, _ = build_parser("replay")
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return parser, sub.choices["replay"]


def test_every_recording_option_is_a_flag_and_a_config_key(fastrecord_file, tmp_path, capsys):
    """Each RecordOptions field a command line can set (bar the three a replay decides itself) is a `replay`
    flag and a config key, checked once by RecordOptions, and reaches the replay's recorder (its run manifest)."""
    from fastrecord.checks import load_config
    from fastrecord.commands.cli import main
    from fastrecord.commands.replay import config_from_args
    from fastrecord.options import cli_option_names, flag_of
    from fastrecord.replay.config import RECORDING_OPTIONS, REPLAY_DECIDES

    assert REPLAY_DECIDES == ("save_on_reset", "if_exists", "video_layout")
    assert set(RECORDING_OPTIONS) == set(cli_option_names()) - set(REPLAY_DECIDES)
    assert {"trajectory_compression", "video_crf", "video_preset", "trajectory_writers", "info_on_video",
            "max_steps_per_video", "buffer_capacity", "video_workers", "record_env_state"} <= set(RECORDING_OPTIONS)
    parser, replay_parser = _replay_parser()
    flags = {a.dest: a.option_strings for a in replay_parser._actions}
    for name in RECORDING_OPTIONS:
        assert flags[name] == [flag_of(name)], name
    assert not set(REPLAY_DECIDES) & set(flags) and "--if-exists" not in replay_parser.format_help()
    args = parser.parse_args(["replay", "x.h5", "--video-crf", "30", "--trajectory-compression", "gzip:5",
                              "--video-preset", "fast", "--trajectory-writers", "2", "--info-on-video",
                              "--max-steps-per-video", "9", "--buffer-capacity", "40", "--no-record-env-state"])
    assert config_from_args(args).record == dict(video_crf=30, trajectory_compression="gzip:5", video_preset="fast",
                                                 trajectory_writers=2, info_on_video=True, max_steps_per_video=9,
                                                 buffer_capacity=40, record_env_state=False)
    yaml_cfg = tmp_path / "c.yaml"
    yaml_cfg.write_text("video_crf: 31\ntrajectory_compression: lzf\nvideo_fps: null\nobs_mode: rgb\n")
    cfg = load_config(ReplayConfig, yaml_cfg)
    assert (cfg.record, cfg.obs_mode, cfg.option("video_fps"), cfg.option("video_codec")) == (
        dict(video_crf=31, trajectory_compression="lzf"), "rgb", None, "auto")
    # a bad value: RecordOptions' message, with the flag and the config key, before anything is written
    assert (
        main(
            [
                "replay",
                str(fastrecord_file),
                "--output-dir",
                str(tmp_path / "bad"),
                "--trajectory-compression",
                "gzip:10",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert (
        "trajectory_compression='gzip:10'" in err
        and "(the --trajectory-compression flag, or trajectory_compression: in" in err
    )
    assert not (tmp_path / "bad").exists()
    with pytest.raises(ValueError, match=r"video_crf=2\.5 must be an integer"):
        fastrecord_replay(fastrecord_file, tmp_path / "bad", video_crf=2.5)
    with pytest.raises(ValueError, match=r"a replay takes one of \('all', 'success', .*not a callable"):
        fastrecord_replay(fastrecord_file, tmp_path / "bad", keep=lambda info: True)

    out = tmp_path / "out"
    assert (
        main(
            [
                "replay",
                str(fastrecord_file),
                "--output-dir",
                str(out),
                "--count",
                "2",
                "--num-envs",
                "1",
                "--vector",
                "sync",
                "--quiet",
                "--trajectory-name",
                "again",
                "--video-crf",
                "30",
                "--trajectory-compression",
                "gzip:5",
                "--video-preset",
                "fast",
                "--no-record-reward",
                "--keep",
                "success",
                "--video-fps",
                "12.5",
                "--max-steps-per-video",
                "4",
            ]
        )
        == 0
    )
    options = json.loads((out / "again.fastrecord.json").read_text())["options"]
    assert {k: options[k] for k in ("video_crf", "trajectory_compression", "video_preset", "record_reward", "keep",
                                    "video_fps", "max_steps_per_video", "trajectory_name")} == dict(
        video_crf=30, trajectory_compression="gzip:5", video_preset="fast", record_reward=False, keep="success",
        video_fps=12.5, max_steps_per_video=4, trajectory_name="again")
    # what the replay decides: no save at reset, no tiling, the task's control frequency when no --video-fps
    assert (options["save_on_reset"], options["video_layout"], options["if_exists"]) == (False, "per_env", "error")
    with h5py.File(out / "again.h5") as f:
        assert "rewards" not in f["traj_0"]
    assert len(list(out.glob("0_env0_success*.mp4"))) > 1  # 16 steps in pieces of at most 4
    fastrecord_replay(fastrecord_file, tmp_path / "fps", count=1, num_envs=1, vector="sync", progress=False,
                      save_trajectory=False)
    (manifest,) = (tmp_path / "fps").glob("*.fastrecord.json")
    assert json.loads(manifest.read_text())["options"]["video_fps"] == 20  # PushCube-v1's control frequency


def fastrecord_replay(path: Path, out: Path, **kw):
    import fastrecord

    return fastrecord.replay_trajectories(path, out, **kw)


def test_maniskill_flags_map_to_recording_options():
    """ManiSkill's --save-traj, --save-video, --record-rewards set the recording options; any of them switches to
    ManiSkill's defaults (nothing written unless asked, no rewards unless --record-rewards)."""
    from fastrecord.commands.replay import config_from_args

    parser, _ = _replay_parser()

    def cfg(*argv: str) -> ReplayConfig:
        return config_from_args(parser.parse_args(["replay", *argv]))

    c = cfg("--traj-path", "x.h5", "--save-traj")
    assert c.maniskill and (c.save_trajectory, c.save_video, c.replay_by) == (True, False, "actions")
    assert c.recorder_kwargs("n", 20, lambda info: True, "overwrite", "d")["record_reward"] is False
    c = cfg("--traj-path", "x.h5", "--save-video", "--record-rewards", "--video-crf", "28")
    assert c.record == dict(save_video=True, save_trajectory=False, record_reward=True, video_crf=28)
    rec = c.recorder_kwargs("n", 20, lambda info: True, "overwrite", "d")
    assert (rec["record_reward"], rec["video_crf"], rec["video_fps"], rec["trajectory_name"]) == (True, 28, 20, "n")
    assert cfg("x.h5").recorder_kwargs("n", 20, lambda info: True, "error", "d")["record_reward"] is True
    with pytest.raises(ValueError, match="--no-record-reward and --record-rewards disagree"):
        cfg("--traj-path", "x.h5", "--record-rewards", "--no-record-reward")


# ---------------------------------------------------------------------------------------------- ManiSkill's flags
@pytest.fixture(scope="module")
def joint_pos_file(tmp_path_factory) -> Path:
    """PickCube-v1 in pd_joint_pos (the mode ManiSkill's conversion starts from): episodes 0 and 2 succeed
    (fastrecord's scripted ee policy, its joint targets replayed as pd_joint_pos actions), 1 fails."""
    import mani_skill.envs  # noqa: F401
    import torch

    from fastrecord import RecordEpisode
    from fastrecord.policies import _pick_cube_action

    out = tmp_path_factory.mktemp("jointpos")
    kw = dict(obs_mode="state", render_mode="rgb_array", sim_backend="physx_cpu", human_render_camera_configs=CAMERA,
              max_episode_steps=50)
    ee = gym.make("PickCube-v1", control_mode="pd_ee_delta_pos", **kw)
    env = RecordEpisode(gym.make("PickCube-v1", control_mode="pd_joint_pos", **kw), str(out), trajectory_name="demo",
                        save_video=False)
    for seed, steps in ((0, 50), (1, 8), (2, 50)):
        ee.reset(seed=seed)
        env.reset(seed=seed)
        for _ in range(steps):
            a = _pick_cube_action(ee.unwrapped)
            if seed == 1:
                a[:, 3] = 1.0  # never grasps
            ee.step(a)
            target = ee.unwrapped.agent.controller.controllers["arm"]._target_qpos[0]
            _, _, _, _, info = env.step(torch.cat([target, a[0, 3:]]).numpy())
            if bool(info["success"]):
                break
    env.close()
    ee.close()
    meta = json.loads((out / "demo.json").read_text())
    assert [e["success"] for e in meta["episodes"]] == [True, False, True]
    return out / "demo.h5"


def run_both(src: Path, tmp_path: Path, flags: list[str]) -> dict[str, Path]:
    """The same command line through ManiSkill's tool and fastrecord's, each on its own copy of the input."""
    import subprocess
    import sys

    from fastrecord.commands.cli import main

    dirs = {}
    for tool in ("maniskill", "fastrecord"):
        d = tmp_path / tool
        d.mkdir()
        shutil.copy(src, d / src.name)
        shutil.copy(src.with_suffix(".json"), d / src.with_suffix(".json").name)
        argv = ["--traj-path", str(d / src.name), *flags]
        if tool == "maniskill":
            r = subprocess.run([sys.executable, "-m", "mani_skill.trajectory.replay_trajectory", *argv],
                               capture_output=True, text=True, timeout=600)
            assert r.returncode == 0, r.stderr[-3000:]
        else:
            assert main(["replay", *argv, "--quiet"]) == 0
        dirs[tool] = d
    return dirs


def h5_outputs(d: Path) -> list[Path]:
    return sorted(p for p in d.glob("*.h5") if p.name != "demo.h5")


@pytest.mark.parametrize(
    "flags, name, kept",
    [
        (
            ["--use-env-states", "-o", "rgb", "--save-traj", "--count", "2"],
            "demo.rgb.pd_joint_pos.physx_cpu.h5",
            [True],
        ),
        (
            ["--save-traj", "--allow-failure", "--record-rewards"],
            "demo.state.pd_joint_pos.physx_cpu.h5",
            [True, False, True],
        ),
        (["--save-traj", "-n", "1", "-b", "physx_cpu"], "demo.state.pd_joint_pos.physx_cpu.h5", [True, True]),
    ],
)
def test_maniskill_command_lines_give_maniskill_outputs(joint_pos_file, tmp_path, flags, name, kept):
    dirs = run_both(joint_pos_file, tmp_path, flags)
    outs = {tool: h5_outputs(d) for tool, d in dirs.items()}
    assert [p.name for p in outs["maniskill"]] == [p.name for p in outs["fastrecord"]] == [name]
    theirs, ours = (
        json.loads(outs[t][0].with_suffix(".json").read_text())["episodes"] for t in ("maniskill", "fastrecord")
    )
    assert [e["success"] for e in theirs] == [e["success"] for e in ours] == kept
    recorded = {e["episode_id"]: e for e in json.loads(joint_pos_file.with_suffix(".json").read_text())["episodes"]}
    assert [e["elapsed_steps"] for e in ours] == [recorded[e["source_episode_id"]]["elapsed_steps"] for e in ours]
    with h5py.File(outs["maniskill"][0]) as f, h5py.File(outs["fastrecord"][0]) as g:
        for a, b in zip(theirs, ours):
            x, y = leaves(f[f"traj_{a['episode_id']}"]), leaves(g[f"traj_{b['episode_id']}"])
            obs = lambda tree: {k: v.shape[1:] for k, v in tree.items() if k == "obs" or k.startswith("obs/")}  # noqa: E731
            assert obs(x) == obs(y) and obs(x)
            assert ("rewards" in x) == ("rewards" in y) == ("--record-rewards" in flags)
            # ManiSkill 3.0.1's tool keeps a dropped failure's steps in its recorder's buffer and writes them in
            # front of the next kept episode (here 8 + 12 = 20 steps); its own steps come last, as ours
            n = b["elapsed_steps"]
            assert a["elapsed_steps"] == n or (a["elapsed_steps"] > n and "--allow-failure" not in flags)
            np.testing.assert_array_equal(x["actions"][-n:], y["actions"])
    # every replay, kept or not, is in the results file
    rows = read_results(dirs["fastrecord"] / name.replace(".h5", ".results.jsonl"))
    assert len(rows) == (2 if "--count" in flags else 3) and sum(r["episode_id"] is not None for r in rows) == len(kept)


def test_control_mode_conversion_matches_maniskill(joint_pos_file, tmp_path, capsys):
    """-c pd_ee_delta_pose through ManiSkill's conversion code: same converted actions, successes and states."""
    dirs = run_both(joint_pos_file, tmp_path, ["-c", "pd_ee_delta_pose", "--save-traj", "--allow-failure"])
    assert "converted to pd_ee_delta_pose" in capsys.readouterr().out
    outs = {tool: h5_outputs(d) for tool, d in dirs.items()}
    assert (
        [p.name for p in outs["fastrecord"]]
        == [p.name for p in outs["maniskill"]]
        == ["demo.state.pd_ee_delta_pose.physx_cpu.h5"]
    )
    theirs, ours = (
        json.loads(outs[t][0].with_suffix(".json").read_text())["episodes"] for t in ("maniskill", "fastrecord")
    )
    assert [e["control_mode"] for e in ours] == ["pd_ee_delta_pose"] * 3
    assert [e["success"] for e in ours] == [e["success"] for e in theirs]
    assert sum(e["success"] for e in ours) >= 1
    with h5py.File(outs["maniskill"][0]) as f, h5py.File(outs["fastrecord"][0]) as g:
        for a, b in zip(theirs, ours):
            x, y = leaves(f[f"traj_{a['episode_id']}"]), leaves(g[f"traj_{b['episode_id']}"])
            assert y["actions"].shape == x["actions"].shape and y["actions"].shape[1] == 7
            np.testing.assert_allclose(y["actions"], x["actions"], atol=1e-5)
            for k in x:
                if k.startswith("env_states/"):
                    np.testing.assert_allclose(y[k][-1], x[k][-1], atol=1e-4, err_msg=k)
    # the converted file replays by its actions to the same successes
    s, _, _ = replay(outs["fastrecord"][0], tmp_path / "again", by="actions", num_envs=1, save_video=False)
    assert s.diverged == [] and s.successes == sum(e["success"] for e in ours)


def test_maniskill_flag_errors(joint_pos_file, tmp_path, capsys):
    from fastrecord.commands.cli import main

    def err(*argv: str) -> str:
        assert main(["replay", "--traj-path", str(joint_pos_file), *argv]) == 2
        return capsys.readouterr().err

    assert "converting to another control mode" in err("-c", "pd_ee_delta_pose", "--use-env-states")
    assert "--vis" in err("--vis")
