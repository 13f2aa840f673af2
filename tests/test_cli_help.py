"""A CLI that explains itself: --version, every flag's help with its default, one-line errors for modes
and backends ManiSkill or this machine refuse, ManiSkill's noise silenced, a readable info overlay."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import checkout_env, fastrecord_cli

from fastrecord import RecordEpisode
from fastrecord.commands.cli import SUBCOMMANDS, build_parser, main
from fastrecord.video import decode_mp4

ROOT = Path(__file__).resolve().parents[1]


def test_version(capsys):
    from fastrecord import __version__

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith(f"fastrecord {__version__} (mani_skill 3.0.1")


def test_import_fastrecord_is_light_and_exports_on_use():
    """``import fastrecord`` imports neither torch nor ManiSkill (the exports load on first use), so a replay's
    forkserver can import them while the caller does; every exported name resolves."""
    code = ("import sys, fastrecord\n"
            "assert not {'torch', 'mani_skill', 'gymnasium'} & set(sys.modules), sorted(sys.modules)\n"
            "from fastrecord import RecordEpisode, make_eval_envs, WorkerError\n"
            "assert 'mani_skill' in sys.modules\n"
            "print(sorted(n for n in fastrecord.__all__ if getattr(fastrecord, n) is not None))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=checkout_env())
    assert r.returncode == 0, r.stderr[-2000:]
    import fastrecord

    assert r.stdout.strip() == str(sorted(fastrecord.__all__))
    with pytest.raises(AttributeError, match="has no attribute 'Nope'"):
        fastrecord.Nope


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser, _ = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def test_every_flag_of_every_subcommand_has_help_with_its_default():
    """info and gallery: every flag; record, replay, bench: every flag backed by a config field with a default
    (their flags default to None, "not given"; the help shows the dataclass's default)."""
    import dataclasses
    import importlib

    subs = _subparsers()
    assert set(subs) == set(SUBCOMMANDS) == {"record", "replay", "bench", "info", "gallery", "merge", "consolidate"}
    for name, p in subs.items():
        config = SUBCOMMANDS[name][2]
        fields = {}
        if config:
            module, _, cls = config.partition(":")
            fields = {f.name: f for f in dataclasses.fields(getattr(importlib.import_module(module), cls))
                      if f.default is not dataclasses.MISSING and f.default not in ("", ())}
        if name in ("record", "replay"):  # their recording flags are RecordOptions' fields
            from fastrecord.options import RecordOptions

            fields |= {f.name: f for f in dataclasses.fields(RecordOptions)}
        formatter = p._get_formatter()
        for action in p._actions:
            if isinstance(action, argparse._HelpAction) or (config and action.dest not in fields):
                continue
            text = formatter._expand_help(action) if action.help else ""
            assert text.strip(), f"fastrecord {name} {action.option_strings or action.dest}: no help"
            if action.option_strings:
                assert "default" in text.lower(), f"fastrecord {name} {action.option_strings}: {text!r}"


@pytest.mark.parametrize(
    "argv, expected",
    [
        (
            ["record", "--help"],
            [
                "--num-envs NUM_ENVS",
                "(default: 1)",
                "where the .h5/.json and the MP4s go (default:",
                "--control-mode CONTROL_MODE None: the task's default",
                "--video-workers VIDEO_WORKERS background encoder processes (None: one per usable core, at most 16; "
                "beside a CPU vector env's sub-env processes only the cores they leave encode while the envs step, "
                "every one at close)",
                "--no-video write no MP4 videos: the trajectory only (sets save_video=False; default save_video=True)",
                "--no-trajectory write no trajectory",
                "--video-crf VIDEO_CRF",
                "(default: 23)",
                "--trajectory-compression TRAJECTORY_COMPRESSION",
                "--if-exists {error,overwrite,resume}",
                "--trajectory-name TRAJECTORY_NAME NAME of the trajectory pair",
                "(default: trajectory)",
            ],
        ),
        (["replay", "--help"], ["(default: auto)", "--keep {all,success,success_once,failure}"]),
        (["bench", "--help"], ["fastrecord's constant rate factor (default: 23)", "(default: ultrafast)"]),
        (["info", "--help"], ["--json", "(default: False)", "fastrecord info recordings --json"]),
        (["gallery", "--help"], ["(default: DIR/gallery.html)", "fastrecord gallery recordings"]),
        (["merge", "--help"], ["--name NAME", "(default: trajectory)", "fastrecord merge recordings --links"]),
        (["--help"], ["{record,replay,bench,info,gallery,merge,consolidate}", "--version"]),
    ],
)
def test_help_texts(capsys, argv, expected):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for piece in expected:
        assert " ".join(piece.split()) in text, piece
    if argv[0] == "record":  # the old help read as the opposite of the flag, and said threads for processes
        assert "(default: save_video=True)" not in text and "thread" not in text
    if argv[0] in ("record", "replay"):  # "default: none" read as the value none (a reward mode); a moved section
        assert "(default: none)" not in text and "README: Image" not in text
        assert "normalized_dense, none (default: the task's)" in text or argv[0] == "replay"
        assert "(docs/format.md: Image observations on disk)" in text


# ---------------------------------------------------------------------------------------------- one-line errors
@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["record", "--obs-mode", "rgbx"],
            "obs_mode='rgbx' is unknown ('rgbx' is not a camera texture); use state, state_dict, none, sensor_data, rgbd, "
            "pointcloud, or camera textures joined with '+'",
        ),
        (
            ["replay", "missing.h5", "--obs-mode", "rgb+dpeth"],
            "obs_mode='rgb+dpeth' is unknown ('dpeth' is not a camera texture)",
        ),
        (
            ["record", "--sim-backend", "physx_gpu"],
            "sim_backend='physx_gpu' is unknown; use one of physx_cpu, cpu, physx_cuda",
        ),
    ],
)
def test_unknown_modes_are_one_line_errors(tmp_path, capsys, argv, message):
    assert main([*argv, "--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"fastrecord {argv[0]}: error: {message}") and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["record", "--sim-backend", "physx_cuda"],
            "sim_backend='physx_cuda' needs a CUDA device and this machine has none",
        ),
        (["record", "--render-backend", "gpu"], "render_backend='gpu' needs a CUDA device and this machine has none"),
        (["replay", "x.h5", "--sim-backend", "physx_cuda"], "sim_backend='physx_cuda' needs a CUDA device"),
        (
            ["record", "--config", "{cfg}"],
            "render_backend='sapien_cuda' needs a CUDA device",
        ),  # from the config file too
    ],
)
def test_cuda_backends_without_cuda(tmp_path, capsys, argv, message):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("render_backend: sapien_cuda\n")
    argv = [a.format(cfg=cfg) for a in argv]
    assert main([*argv, "--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"fastrecord {argv[0]}: error: {message}") and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


def test_unknown_control_mode_is_maniskills_check_rephrased(tmp_path):
    """ManiSkill refuses it when the env is made (an assert with a traceback); the CLI prints one line."""
    r = fastrecord_cli("record", "PickCube-v1", "--control-mode", "pd_joint_bogus", "--episodes", "1", "--width",
                       "32", "--height", "32", "--output-dir", str(tmp_path / "out"), cwd=ROOT)
    assert r.returncode == 2, r.stderr
    assert r.stderr == ("fastrecord record: error: control_mode='pd_joint_bogus' is not supported by PickCube-v1's "
                        "robot; use one of pd_joint_delta_pos, pd_joint_pos, pd_ee_delta_pos, pd_ee_delta_pose, "
                        "pd_ee_pose, pd_joint_target_delta_pos, pd_ee_target_delta_pos, pd_ee_target_delta_pose, "
                        "pd_joint_vel, pd_joint_pos_vel, pd_joint_delta_pos_vel\n")
    assert not (tmp_path / "out").exists()


def test_maniskill_noise_silenced_in_the_cli(tmp_path):
    r = fastrecord_cli("record", "PickCube-v1", "--episodes", "1", "--max-episode-steps", "2", "--width", "32",
                       "--height", "32", "--no-video", "--output-dir", str(tmp_path / "out"),
                       env={"PYTHONWARNINGS": "default"}, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "episodes: 1 finished, 1 kept" in r.stdout
    assert "not installed with git" not in r.stderr and "DeprecationWarning" not in r.stderr, r.stderr


# ---------------------------------------------------------------------------------------------- the info overlay
def _record_128(make_env, out: Path, info_on_video: bool) -> np.ndarray:
    env = make_env("PickCube-v1", max_episode_steps=4, human_render_camera_configs=dict(width=128, height=128))
    env = RecordEpisode(env, out, trajectory_name="t", save_trajectory=False, info_on_video=info_on_video)
    env.reset(seed=3)
    for _ in range(4):
        env.step(np.zeros(env.action_space.shape, dtype=np.float32))
    env.close()
    (video,) = out.glob("*.mp4")
    return decode_mp4(video).astype(np.int16)


def test_info_overlay_is_readable_at_128(make_env, tmp_path):
    plain = _record_128(make_env, tmp_path / "plain", False)
    text = _record_128(make_env, tmp_path / "info", True)
    assert plain.shape == text.shape == (5, 128, 128, 3)
    diff = np.abs(text - plain).max(axis=-1)  # [T, H, W]
    assert diff[0].mean() < 2  # the reset frame has no info
    for t in range(1, 5):
        changed = diff[t] > 40
        rows = np.flatnonzero(changed.mean(axis=1) > 0.02)
        assert rows.size, f"frame {t}: no text drawn"
        assert rows.max() < 0.5 * 128, f"frame {t}: text reaches row {rows.max()} of 128"
        assert 0.02 < changed.mean() < 0.3, f"frame {t}: text covers {changed.mean():.0%} of the frame"
        assert diff[t, 64:].mean() < 3  # the lower half is the scene, untouched


def test_version_and_help_start_without_torch():
    """The parser configures only the subcommand asked for: ``--version``, the top-level help and a
    subcommand's one-line list import neither torch nor ManiSkill; nor does ``replay --help`` (its parser
    and ReplayConfig's defaults come from modules that do not), whose text names no internal function."""
    code = ("import sys\n"
            "from fastrecord.commands.cli import main\n"
            "try:\n"
            "    main(sys.argv[1:])\n"
            "except SystemExit:\n"
            "    pass\n"
            "print('HEAVY', sorted({'torch', 'mani_skill'} & set(sys.modules)))\n")
    out = {}
    for argv in (["--version"], ["--help"], ["replay", "--help"]):
        r = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=300,
                           env=checkout_env())
        assert r.returncode == 0, r.stderr[-2000:]
        assert "HEAVY []" in r.stdout, (argv, r.stdout[-500:])
        out[argv[0]] = r.stdout
    assert "replay" in out["--help"] and "run a policy in N envs" in out["--help"]  # every subcommand listed
    assert "--workers WORKERS" in out["replay"] and "default_workers" not in out["replay"]

