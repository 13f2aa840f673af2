"""gym.make keywords from the command line and YAML configs: ``--env-kwargs KEY=VALUE ...`` and the named
flags (``--reward-mode``, ``--shader-dir``, ``--robot-uids``, ``--sim-config``, ``--sensor-configs``), in
``record`` and ``replay``; and ``--render-substeps`` end to end."""

from __future__ import annotations

import json
import re

import h5py
import numpy as np
import pytest

from fastrecord.commands.cli import main
from fastrecord.testing import frame_psnr
from fastrecord.video import decode_mp4

SMALL = ["--episodes", "2", "--max-episode-steps", "4", "--width", "32", "--height", "32"]


def _exit_status(argv: list[str]) -> int:
    """``fastrecord`` with ``argv``: its exit status (argparse's own errors exit from inside main)."""
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


def _rewards(out) -> list[np.ndarray]:
    with h5py.File(out / "trajectory.h5") as f:
        return [f[f"traj_{i}/rewards"][()] for i in range(2)]


def _env_info(out) -> dict:
    return json.loads((out / "trajectory.json").read_text())["env_info"]


def test_env_kwargs_reach_gym_make_and_the_json(tmp_path, capsys):
    """--env-kwargs reward_mode=dense: NAME.json's env_kwargs say so, and the rewards are the dense ones
    (the same seeded random actions as the default run, whose normalized_dense rewards are 1/5 of them)."""
    assert main(["record", "PickCube-v1", *SMALL, "--output-dir", str(tmp_path / "default")]) == 0
    assert main(["record", "PickCube-v1", *SMALL, "--output-dir", str(tmp_path / "dense"),
                 "--env-kwargs", "reward_mode=dense", "robot_init_qpos_noise=0.02"]) == 0
    info = _env_info(tmp_path / "dense")["env_kwargs"]
    assert info["reward_mode"] == "dense" and info["robot_init_qpos_noise"] == 0.02
    assert "reward_mode" not in _env_info(tmp_path / "default")["env_kwargs"]
    for dense, default in zip(_rewards(tmp_path / "dense"), _rewards(tmp_path / "default")):
        assert not np.allclose(dense, default)
        np.testing.assert_allclose(dense / 5, default, rtol=1e-4)  # PickCube: normalized_dense = dense / 5


def test_yaml_env_kwargs_and_named_flags(tmp_path, capsys):
    """A YAML config's env_kwargs plus --env-kwargs (added to it), the named flags (JSON for --sim-config),
    and --render-substeps: every keyword reaches gym.make, the video has a frame per physics substep."""
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"env_id: PickCube-v1\noutput_dir: {tmp_path / 'rec'}\nenv_kwargs:\n  reward_mode: sparse\n"
                   f"  enable_shadow: false\n")
    assert main(["record", "--config", str(cfg), *SMALL, "--env-kwargs", "robot_init_qpos_noise=0",
                 "--sim-config", '{"sim_freq": 100, "control_freq": 50}', "--robot-uids", "panda",
                 "--render-substeps"]) == 0
    out = tmp_path / "rec"
    kw = _env_info(out)["env_kwargs"]
    assert (kw["reward_mode"], kw["enable_shadow"], kw["robot_init_qpos_noise"], kw["robot_uids"]) == (
        "sparse",
        False,
        0,
        "panda",
    )
    assert kw["sim_config"] == {"sim_freq": 100, "control_freq": 50}
    assert all(set(np.unique(r)) <= {0.0, 1.0} for r in _rewards(out))  # sparse
    assert decode_mp4(out / "0_env0_failure.mp4").shape[0] == 1 + 4 * (100 // 50 + 1)  # 2 substeps + the step's frame


@pytest.mark.parametrize(
    "argv, yaml, pattern",
    [
        (["--env-kwargs", "reward_mode"], None, r"argument --env-kwargs: 'reward_mode' is not KEY=VALUE"),
        (["--env-kwargs", "a=1", "a=2"], None, r"--env-kwargs gives a twice \(a=1 and a=2\)"),
        (["--reward-mode", "sparse", "--env-kwargs", "reward_mode=dense"], None,
         r"reward_mode is given twice: --reward-mode 'sparse' and --env-kwargs reward_mode='dense'"),
        (["--env-kwargs", "obs_mode=rgb"], "obs_mode: state\n", r"obs_mode is given twice: --obs-mode 'state'"),
        (["--env-kwargs", "reward_mod=dense"], None,
         r"env_kwargs reward_mod='dense': PickCube-v1 takes no keyword 'reward_mod'; did you mean reward_mode"),
        ([], "env_kwargs:\n  shaders: rt\n", r"PickCube-v1 takes no keyword 'shaders'"),
        (["--sim-config", "{sim_freq: 100}"], None, r"argument --sim-config: '\{sim_freq: 100\}' is not JSON"),
        (["--sensor-configs", "[1]"], None, r"argument --sensor-configs: '\[1\]' is a JSON list, not a JSON object"),
        (["--env-kwargs", 'human_render_camera_configs={"width": 64}'], None, r"the video camera is given twice"),
        (["--env-kwargs", "render_mode=human"], None, r"env_kwargs render_mode='human' .*: record renders its videos"),
    ],
)
def test_env_kwargs_errors(tmp_path, capsys, argv, yaml, pattern):
    """One line, exit status 2, nothing written."""
    extra = []
    if yaml is not None:
        (tmp_path / "c.yaml").write_text(yaml)
        extra = ["--config", str(tmp_path / "c.yaml")]
    out = tmp_path / "out"
    assert _exit_status(["record", "PickCube-v1", *SMALL, "--output-dir", str(out), *extra, *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert re.search(pattern, err[-1]), err
    assert not out.exists()


def test_replay_env_kwargs_replace_the_files(tmp_path, capsys):
    """replay --env-kwargs reward_mode=dense: the file said normalized_dense (the task's default); the
    replay's env and its JSON take dense, and its rewards are the recording's times 5."""
    src = tmp_path / "src"
    assert main(["record", "PickCube-v1", *SMALL, "--output-dir", str(src), "--no-video",
                 "--env-kwargs", "reward_mode=normalized_dense"]) == 0
    assert main(["replay", str(src / "trajectory.h5"), "--output-dir", str(tmp_path / "rep"), "--no-video",
                 "--vector", "sync", "--num-envs", "1", "--workers", "1", "--trajectory-name", "r",
                 "--env-kwargs", "reward_mode=dense"]) == 0
    info = json.loads((tmp_path / "rep" / "r.json").read_text())
    assert info["env_info"]["env_kwargs"]["reward_mode"] == "dense"
    with h5py.File(tmp_path / "rep" / "r.h5") as f:
        replayed = [f[f"traj_{i}/rewards"][()] for i in range(2)]
    for rep, rec in zip(replayed, _rewards(src)):
        np.testing.assert_allclose(rep, rec * 5, rtol=1e-4)

    assert (
        main(
            [
                "replay",
                str(src / "trajectory.h5"),
                "--output-dir",
                str(tmp_path / "rep2"),
                "--reward-mode",
                "sparse",
                "--env-kwargs",
                "reward_mode=dense",
            ]
        )
        == 2
    )
    assert (
        "reward_mode is given twice: --reward-mode 'sparse' and --env-kwargs reward_mode='dense'"
        in capsys.readouterr().err
    )
    assert main(["replay", str(src / "trajectory.h5"), "--output-dir", str(tmp_path / "rep2"),
                 "--env-kwargs", "control_mode=pd_ee_delta_pos"]) == 2
    assert "-c/--target-control-mode converts" in capsys.readouterr().err
    assert (
        main(["replay", str(src / "trajectory.h5"), "--output-dir", str(tmp_path / "rep2"), "--env-kwargs", "bogus=1"])
        == 2
    )
    assert "PickCube-v1 takes no keyword 'bogus'" in capsys.readouterr().err
    assert not (tmp_path / "rep2").exists()


def test_replay_render_substeps(tmp_path, capsys):
    """replay --render-substeps in an AsyncVectorEnv (its sub-envs render their substeps themselves): a video
    of 1 + T * (sim_steps_per_control + 1) frames per replayed episode, equal in length to record's."""
    src = tmp_path / "src"
    assert main(["record", "PushCube-v1", *SMALL, "--output-dir", str(src), "--render-substeps"]) == 0
    recorded = decode_mp4(src / "0_env0_failure.mp4")
    assert main(["replay", str(src / "trajectory.h5"), "--output-dir", str(tmp_path / "rep"), "--vector", "async",
                 "--num-envs", "2", "--workers", "1", "--width", "32", "--height", "32", "--render-substeps",
                 "--no-trajectory"]) == 0
    assert recorded.shape[0] == 1 + 4 * (100 // 20 + 1)
    ours, theirs = _videos_by_seed(tmp_path / "rep"), _videos_by_seed(src)
    assert sorted(ours) == sorted(theirs) and len(ours) == 2
    for seed, replayed in ours.items():  # the substeps re-simulated from the recorded states: the recording's pictures
        assert replayed.shape == recorded.shape
        assert frame_psnr(replayed, theirs[seed]).min() >= 28, seed  # frame by frame, against its own episode
        other = next(v for s, v in theirs.items() if s != seed)
        assert frame_psnr(replayed, other).min() < 28, seed  # the check tells the two episodes apart


def _videos_by_seed(folder) -> dict[int, np.ndarray]:
    """{episode seed: its decoded video} of a run, from its results file (each row names its episode's video)."""
    rows = [json.loads(line) for line in next(folder.glob("*.results.jsonl")).read_text().splitlines()]
    return {row["seed"]: decode_mp4(folder / row["video"]) for row in rows}
