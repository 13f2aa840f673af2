"""The `fastrecord record` main job, as a user runs it."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
from conftest import checkout_env, record_args

from fastrecord.commands.cli import main
from fastrecord.video import decode_mp4


def test_record_default_job_small(tmp_path, capsys):
    out = tmp_path / "rec"
    rc = main(["record", "PickCube-v1", "--episodes", "2", "--max-episode-steps", "4", "--width", "64",
               "--height", "64", "--output-dir", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "episodes: 2 finished, 2 kept" in printed and "env-steps/s" in printed
    eps = json.loads((out / "trajectory.json").read_text())["episodes"]
    assert [e["elapsed_steps"] for e in eps] == [4, 4]
    with h5py.File(out / "trajectory.h5") as f:
        assert sorted(f) == ["traj_0", "traj_1"]
    assert decode_mp4(out / "0_env0_failure.mp4").shape == (5, 64, 64, 3)


def test_record_vector_env_from_yaml(tmp_path, capsys):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"env_id: PushCube-v1\nnum_envs: 2\nepisodes: 2\nmax_episode_steps: 3\nwidth: 64\nheight: 64\n"
                   f"output_dir: {tmp_path / 'rec'}\nkeep: failure\n")
    assert main(["record", "--config", str(cfg)]) == 0
    eps = json.loads((tmp_path / "rec" / "trajectory.json").read_text())["episodes"]
    assert len(eps) >= 2 and not any(e["success"] for e in eps)
    assert {p.name.split("_")[1] for p in (tmp_path / "rec").glob("*.mp4")} == {"env0", "env1"}


@pytest.mark.parametrize(
    "argv, match",
    [
        (["record", "NoSuchTask-v9"], "env_id='NoSuchTask-v9' is not a registered ManiSkill task"),
        (["record", "--policy", "nomodule"], "policy='nomodule' must be 'random' or 'module:factory'"),
    ],
)
def test_record_errors(tmp_path, capsys, argv, match):
    assert main(argv + ["--output-dir", str(tmp_path), "--episodes", "1", "--width", "32", "--height", "32"]) == 2
    assert match in capsys.readouterr().err


def test_unknown_yaml_option(tmp_path, capsys):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("env: PickCube-v1\n")
    assert main(["record", "--config", str(cfg)]) == 2
    assert "unknown option(s) ['env'] for RecordConfig" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- mistakes
def _files(root) -> set:
    return {p.relative_to(root) for p in root.rglob("*")} if root.exists() else set()


def _write(path, text: str):
    path.write_text(text)
    return str(path)


BAD_INPUTS = [
    # (argv after the command, regex of the message)
    (["record", "--num-envs", "0"], r"num_envs=0 must be at least 1; pass num_envs=1 or more \(the --num-envs flag"),
    (["record", "--episodes", "0"], r"episodes=0 must be at least 1; .*the --episodes flag"),
    (["record", "--envs-per-process", "0"], r"envs_per_process=0 must be at least 1; .*the --envs-per-process flag"),
    (["record", "--width", "-64"], r"width=-64 must be at least 1; .*the --width flag"),
    (
        ["record", "--width", "100000"],
        r"width=100000 is larger than the 16384 pixels H.264 \(libx264\) encodes; pass "
        r"width=16384 or less \(the --width flag",
    ),
    (["record", "--height", "-1"], r"height=-1 must be at least 1; .*the --height flag"),
    (
        ["record", "--reward-mode", "foo"],
        r"reward_mode='foo' is not a reward mode of PickCube-v1; use one of "
        r"normalized_dense, dense, sparse, none$",
    ),
    (["record", "--env-kwargs", "reward_mode=bogus"], r"reward_mode='bogus' is not a reward mode of PickCube-v1"),
    (
        ["record", "--robot-uids", "pandaa"],
        r"robot_uids='pandaa': 'pandaa' is not a registered ManiSkill robot; "
        r"did you mean panda",
    ),
    (
        ["record", "--sim-config", '{{"bogus": 1}}'],
        r"PickCube-v1 refused its keywords \(.*sim_config=\{'bogus': 1\}.*\): UnexpectedDataError: .*bogus",
    ),
    (
        ["record", "--no-save-on-reset"],
        r"save_on_reset=False saves episodes only through flush_trajectory\(\)/"
        r"flush_video\(\) calls, which fastrecord record never makes: it would record "
        r"nothing; drop --no-save-on-reset",
    ),
    (
        ["record", "--policy", "fastrecord.policies:pick_cube_policy"],
        r"policy='fastrecord.policies:pick_cube_policy' drives control_mode='pd_ee_delta_pos' and this run has the task's "
        r"default; pass --control-mode pd_ee_delta_pos$",
    ),
    (
        ["record", "--policy", "fastrecord.policies:pick_cube_policy", "--control-mode", "pd_joint_pos"],
        r"this run has 'pd_joint_pos'; pass --control-mode pd_ee_delta_pos$",
    ),
    (["record", "--bogus"], r"unrecognized arguments: --bogus; see fastrecord record --help$"),
    (["record", "--num-envs", "x"], r"argument --num-envs: invalid int value: 'x'; see fastrecord record --help$"),
    (
        ["record", "--video-fps", "0"],
        r"video_fps=0(\.0)? must be a positive number of frames per second .*the --video-fps flag",
    ),
    (["record", "--video-fps", "-30"], r"video_fps=-30(\.0)? must be a positive number"),
    (["record", "--video-workers", "0"], r"video_workers=0 must be an integer >= 1"),
    (
        ["record", "--trajectory-compression", "gzip:11"],
        r"trajectory_compression='gzip:11'.*the --trajectory-compression flag",
    ),
    (["record", "--buffer-capacity", "1"], r"buffer_capacity=1 must be an integer >= 2"),
    (["record", "--config", "{bad_crf}"], r"video_crf='high' must be an integer .*video_crf: in the --config file"),
    (["record", "--video-codec", ""], r"video_codec='' must be an encoder name"),  # the wrapper's own check
    (
        ["record", "--config", "{tmp}/nope.yaml"],
        r"config file '.*nope\.yaml' does not exist; pass the path of a YAML preset",
    ),
    (
        ["record", "--config", "{bad_yaml}"],
        r"config file '.*bad\.yaml' is not valid YAML at line 3, column \d+: .*flow sequence from line 2",
    ),
    (
        ["record", "--config", "{not_mapping}"],
        r"config file '.*list\.yaml' must hold a mapping of option: value, got list",
    ),
    (["record", "--config", "{unknown}"], r"unknown option\(s\) \['env'\] for RecordConfig"),
    (["record", "--config", "{wrong_type}"], r"num_envs='two' must be int, not str"),
    (["replay", "demo.h5", "--num-envs", "0"], r"num_envs=0 must be at least 1; .*the --num-envs flag"),
    (["replay", "demo.h5", "--width", "20000"], r"width=20000 is larger than the 16384 pixels"),
    (["replay", "demo.h5", "--width", "-1"], r"width=-1 must be at least 1"),
    (["replay", "demo.h5", "--video-fps", "-5"], r"video_fps=-5(\.0)? must be a positive number"),
    (["replay", "demo.h5", "--count", "0"], r"count=0 must be at least 1"),
    (["replay", "--config", "{tmp}/nope.yaml"], r"config file '.*nope\.yaml' does not exist"),
    (["replay", "--config", "{bad_yaml}"], r"is not valid YAML at line 3"),
    (["replay", "--config", "{not_mapping}"], r"must hold a mapping"),
    (["bench", "--config", "{tmp}/nope.yaml"], r"config file '.*nope\.yaml' does not exist"),
    (["bench", "--config", "{bad_yaml}"], r"is not valid YAML at line 3"),
    (["bench", "--config", "{not_mapping}"], r"must hold a mapping"),
    (["bench", "--config", "{unknown}"], r"unknown option\(s\) \['env'\] for BenchConfig"),
]


@pytest.mark.parametrize("argv, pattern", BAD_INPUTS, ids=[" ".join(a) for a, _ in BAD_INPUTS])
def test_mistakes_are_one_line_exit_2_and_write_nothing(tmp_path, capsys, monkeypatch, argv, pattern):
    paths = dict(
        tmp=tmp_path,
        bad_yaml=_write(tmp_path / "bad.yaml", "env_id: PickCube-v1\nnum_envs: [1, 2\nepisodes: 3\n"),
        not_mapping=_write(tmp_path / "list.yaml", "- PickCube-v1\n- 2\n"),
        unknown=_write(tmp_path / "unknown.yaml", "env: PickCube-v1\n"),
        wrong_type=_write(tmp_path / "type.yaml", "num_envs: two\n"),
        bad_crf=_write(tmp_path / "crf.yaml", "video_crf: high\n"),
    )
    out = tmp_path / "out"
    monkeypatch.chdir(tmp_path)  # a default output dir would land here
    before = _files(tmp_path)
    argv = [a.format(**paths) for a in argv]
    if argv[0] != "bench":
        argv += ["--output-dir", str(out)]
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err + captured.out, captured.err
    assert re.match(rf"fastrecord {argv[0]}: error: .*{pattern}", lines[0]), lines[0]
    assert _files(tmp_path) == before


def test_if_exists_error_refuses_and_leaves_the_run_alone(tmp_path, capsys):
    out = tmp_path / "rec"
    argv = ["record", "PushCube-v1", "--episodes", "1", "--max-episode-steps", "2", "--width", "32", "--height", "32",
            "--output-dir", str(out)]
    assert main(argv) == 0
    before = {p: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("fastrecord record: error: ") and len(err.strip().splitlines()) == 1, err
    assert "trajectory" in err and "overwrite" in err and "Traceback" not in err
    assert {p: p.read_bytes() for p in out.iterdir()} == before
    # --if-exists overwrite replaces it; resume records the episodes of --episodes (the total) it lacks
    assert main(argv + ["--if-exists", "overwrite"]) == 0
    assert len(json.loads((out / "trajectory.json").read_text())["episodes"]) == 1
    assert main(argv + ["--if-exists", "resume"]) == 0  # it has its 1 episode: nothing to add
    assert len(json.loads((out / "trajectory.json").read_text())["episodes"]) == 1
    assert main(argv[:3] + ["2"] + argv[4:] + ["--if-exists", "resume"]) == 0
    eps = json.loads((out / "trajectory.json").read_text())["episodes"]
    assert [e["episode_id"] for e in eps] == [0, 1]
    with h5py.File(out / "trajectory.h5") as f:
        assert sorted(f) == ["traj_0", "traj_1"]


# ---------------------------------------------------------------------------------------------- seeds and resume
def _seeds(out: Path) -> dict[int, int]:
    """{global episode: its reset seed} of the run in ``out`` (episode_seed and reset_kwargs agree)."""
    eps = json.loads((out / "trajectory.json").read_text())["episodes"]
    for e in eps:
        assert e["reset_kwargs"]["seed"] == e["episode_seed"], e
    return {e["global_index"]: e["episode_seed"] for e in eps}


def _actions(out: Path) -> dict[int, tuple]:
    """{global episode: (actions, cube poses)} read back from the run in ``out``."""
    eps = json.loads((out / "trajectory.json").read_text())["episodes"]
    with h5py.File(out / "trajectory.h5") as f:
        return {e["global_index"]: (f[f"traj_{e['episode_id']}/actions"][()],
                                    f[f"traj_{e['episode_id']}/env_states/actors/cube"][()]) for e in eps}


SMALL = ["--max-episode-steps", "3", "--width", "32", "--height", "32", "--no-video"]


def test_resume_after_a_stopped_run_continues_seeds_and_tops_up_to_the_total(tmp_path, capsys):
    out = tmp_path / "rec"
    argv = ["record", "PushCube-v1", *SMALL, "--seed", "100", "--output-dir", str(out)]
    assert main(argv + ["--episodes", "2"]) == 0  # a run of 5 that stopped after 2
    assert _seeds(out) == {0: 100, 1: 101}
    capsys.readouterr()
    assert main(argv + ["--episodes", "5", "--if-exists", "resume"]) == 0
    printed = capsys.readouterr().out
    assert (
        "resumed: 2 of the run's 5 episodes were on disk, 3 to record" in printed and "episodes: 3 finished" in printed
    )
    assert _seeds(out) == {g: 100 + g for g in range(5)}
    assert main(argv + ["--episodes", "5", "--if-exists", "resume"]) == 0  # complete: nothing added
    assert _seeds(out) == {g: 100 + g for g in range(5)}


def _file_bytes(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (hidden ones too), by relative path: its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_refused_resume_makes_no_env_and_changes_no_file(tmp_path, capsys, monkeypatch):
    """--if-exists resume with another --seed, or with a NAME.json that cannot be read (truncated): one
    line, exit 2, before any env is made, and every file of the run byte for byte as it was (the
    manifest included)."""
    out = tmp_path / "rec"
    argv = ["record", "PushCube-v1", *SMALL, "--episodes", "1", "--output-dir", str(out)]
    assert main(argv + ["--seed", "3"]) == 0
    capsys.readouterr()

    def no_env(*args, **kwargs):
        raise AssertionError("an env was made for a resume that is refused")

    monkeypatch.setattr("fastrecord.commands.record_run.make_recorded_env", no_env)
    resume = argv + ["--episodes", "2", "--if-exists", "resume"]

    def refused(extra: list[str], message: str) -> None:
        before = _file_bytes(out)
        assert main(resume + extra) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if "mani_skill" not in line]
        assert len(err) == 1 and err[0].startswith("fastrecord record: error: cannot resume run 'trajectory'"), err
        assert message in err[0], err
        assert _file_bytes(out) == before

    refused(["--seed", "4"], "it was recorded with seed 3 and this command has seed 4; episode g has seed base + g, so "
                             "pass --seed 3")
    assert _seeds(out) == {0: 3}
    text = (out / "trajectory.json").read_text()
    (out / "trajectory.json").write_text(text[: len(text) // 2])  # cut short
    refused(["--seed", "3"], "trajectory.json cannot be read (JSONDecodeError: ")
    refused(["--seed", "3"], "so which episodes and seeds it holds is unknown; restore it from a copy, or pass "
                             "--if-exists overwrite (deletes the run)")


class StopAfter:
    """`StopSignals` as `run_record` reads it: ``requested`` turns true at its ``n``-th look (between steps)."""

    name = "SIGINT"

    def __init__(self, n: int) -> None:
        self.n, self.looks = n, 0

    @property
    def requested(self) -> bool:
        self.looks += 1
        return self.looks >= self.n


def test_a_stop_mid_episode_saves_no_cut_episode_and_resume_records_it_whole(tmp_path):
    """A run stopped (Ctrl-C, SIGTERM) one step into its second episode: the cut episode is not written,
    has no results row and is not counted as done, so --if-exists resume records it whole, with its seed,
    and the run ends as the uninterrupted one (a sharded run does the same)."""
    from fastrecord.checks import load_config
    from fastrecord.commands.config import RecordConfig
    from fastrecord.commands.record_run import run_record

    out = tmp_path / "rec"
    kw = dict(env_id="PushCube-v1", max_episode_steps=3, width=32, height=32, save_video=False, seed=100,
              output_dir=str(out))
    # looks: 1 before the loop, then one before each step: 3 steps of episode 0, 1 of episode 1, stop
    s = run_record(load_config(RecordConfig, None, episodes=3, **kw), progress=False, stop=StopAfter(6))
    assert (s.interrupted, s.episodes, s.kept, s.cut) == ("SIGINT", 1, 1, 1)
    eps = json.loads((out / "trajectory.json").read_text())["episodes"]
    assert [(e["global_index"], e["elapsed_steps"]) for e in eps] == [(0, 3)]
    assert [(r["global_index"], r["length"]) for r in json.loads("[" + ",".join(
        (out / "trajectory.results.jsonl").read_text().splitlines()) + "]")] == [(0, 3)]
    s = run_record(load_config(RecordConfig, None, episodes=3, if_exists="resume", **kw), progress=False)
    assert (s.scheduled, s.episodes, s.cut) == (2, 2, 0)
    eps = json.loads((out / "trajectory.json").read_text())["episodes"]
    assert [(e["global_index"], e["episode_seed"], e["elapsed_steps"]) for e in eps] == [
        (0, 100, 3),
        (1, 101, 3),
        (2, 102, 3),
    ]
    whole = tmp_path / "whole"
    run_record(load_config(RecordConfig, None, episodes=3, **{**kw, "output_dir": str(whole)}), progress=False)
    a, b = _actions(out), _actions(whole)
    for g in range(3):
        for x, y in zip(a[g], b[g]):
            np.testing.assert_array_equal(x, y)


def test_same_command_same_dataset_with_or_without_torchrun(tmp_path):
    """The random policy is seeded per episode: two runs of one command, and a sharded run of world size 1
    (what torchrun runs), record the same actions and states for each global episode."""
    from fastrecord.checks import load_config
    from fastrecord.commands.config import RecordConfig
    from fastrecord.commands.record_run import run_record_sharded

    argv = ["record", "PushCube-v1", *SMALL, "--num-envs", "2", "--episodes", "3"]
    assert main(argv + ["--output-dir", str(tmp_path / "a")]) == 0
    assert main(argv + ["--output-dir", str(tmp_path / "b")]) == 0
    a, b = _actions(tmp_path / "a"), _actions(tmp_path / "b")
    assert sorted(a) == sorted(b) == [0, 1, 2]
    cfg = load_config(RecordConfig, None, env_id="PushCube-v1", num_envs=2, episodes=3, max_episode_steps=3, width=32,
                      height=32, save_video=False, output_dir=str(tmp_path / "sharded"))
    run_record_sharded(cfg, progress=False)
    c = _actions(tmp_path / "sharded")
    for g in range(3):
        for x, y, z in zip(a[g], b[g], c[g]):
            assert x.shape[0] >= 1 and (x == y).all() and (x == z).all(), g


def test_plain_resume_of_a_sharded_run_resumes_from_its_shards(tmp_path, capsys, monkeypatch):
    """`fastrecord record --if-exists resume` without torchrun on a sharded run whose joined NAME.h5 is
    older than its shards (a merge that never ran after the last episodes): the missing global episodes
    only are recorded, into the shards, and the joined pair is rebuilt from them: no episode twice."""
    from fastrecord.checks import load_config
    from fastrecord.commands.config import RecordConfig
    from fastrecord.commands.record_run import run_record_sharded

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    out = tmp_path / "rec"
    kw = dict(env_id="PushCube-v1", max_episode_steps=3, width=32, height=32, save_video=False, seed=7,
              output_dir=str(out))
    run_record_sharded(load_config(RecordConfig, None, episodes=2, **kw), progress=False)
    older = {n: (out / n).read_bytes() for n in ("trajectory.h5", "trajectory.json")}  # joined: episodes 0, 1
    run_record_sharded(load_config(RecordConfig, None, episodes=3, if_exists="resume", **kw), progress=False)
    for n, data in older.items():  # as if the last merge had not run: the shards hold 0-2, the joined pair 0-1
        (out / n).write_bytes(data)
    capsys.readouterr()
    assert main(["record", "PushCube-v1", *SMALL, "--seed", "7", "--episodes", "4", "--output-dir", str(out),
                 "--if-exists", "resume"]) == 0
    printed = capsys.readouterr().out
    assert "resuming the sharded run 'trajectory' in " in printed and "from its shards" in printed, printed
    assert "rank 0: 1/1 scheduled episodes finished" in printed, printed
    shard = json.loads((out / "trajectory.shards" / "rank00000" / "trajectory.json").read_text())["episodes"]
    assert sorted(e["global_index"] for e in shard) == [0, 1, 2, 3]
    assert _seeds(out) == {g: 7 + g for g in range(4)}
    with h5py.File(out / "trajectory.h5") as f:
        assert sorted(f) == [f"traj_{g}" for g in range(4)]
    # with another seed: refused before anything is written
    before = _file_bytes(out)
    assert main(["record", "PushCube-v1", *SMALL, "--seed", "8", "--episodes", "5", "--output-dir", str(out),
                 "--if-exists", "resume"]) == 2
    assert "recorded with base seed 7 and this command has seed 8" in capsys.readouterr().err
    assert _file_bytes(out) == before


def test_every_recording_option_is_a_flag_and_a_config_key(tmp_path):
    """Each RecordOptions field (bar the callables and the source metadata) has a `record` flag and a
    config key, and reaches the wrapper."""
    import dataclasses

    from fastrecord.checks import load_config
    from fastrecord.commands.cli import build_parser
    from fastrecord.commands.config import RecordConfig
    from fastrecord.commands.record_env import recorder_kwargs
    from fastrecord.options import CLI_EXCLUDED, RecordOptions, flag_of

    names = [f.name for f in dataclasses.fields(RecordOptions) if f.name not in CLI_EXCLUDED]
    assert {"trajectory_compression", "video_crf", "video_preset", "trajectory_writers", "info_on_video",
            "max_steps_per_video", "buffer_capacity"} <= set(names)
    parser, _ = build_parser("record")
    args = parser.parse_args(["record", "--video-crf", "30", "--video-preset", "fast", "--trajectory-writers", "2",
                              "--trajectory-compression", "lzf", "--info-on-video", "--max-steps-per-video", "9",
                              "--buffer-capacity", "16", "--no-video", "--keep", "success"])
    cfg = load_config(RecordConfig, None, **{n: getattr(args, n) for n in names})
    rec = recorder_kwargs(cfg)
    assert (
        rec["video_crf"],
        rec["video_preset"],
        rec["trajectory_writers"],
        rec["trajectory_compression"],
        rec["info_on_video"],
        rec["max_steps_per_video"],
        rec["buffer_capacity"],
        rec["save_video"],
        rec["keep"],
    ) == (30, "fast", 2, "lzf", True, 9, 16, False, "success")
    assert flag_of("save_video") == "--no-video" and flag_of("save_trajectory") == "--no-trajectory"
    yaml_cfg = tmp_path / "c.yaml"
    yaml_cfg.write_text("video_crf: 31\ntrajectory_compression: gzip:5\nepisodes: 2\n")
    cfg = load_config(RecordConfig, yaml_cfg)
    assert (cfg.record.video_crf, cfg.record.trajectory_compression, cfg.episodes) == (31, "gzip:5", 2)


# ---------------------------------------------------------------------------------------------- signals
REPO = Path(__file__).resolve().parents[1]


def _episodes_on_disk(out: Path) -> int:
    try:
        return len(json.loads((out / "trajectory.json").read_text())["episodes"])
    except (OSError, ValueError, KeyError):
        return 0


def _interrupt(tmp_path, signals: list[int]) -> tuple[subprocess.CompletedProcess, Path, int]:
    """Start `fastrecord record` for far more episodes than it will get to, wait until one is on disk,
    send ``signals`` (a short pause between them), and let it finish."""
    out = tmp_path / "rec"
    cmd = [sys.executable, "-m", "fastrecord", *record_args(out, episodes=1000, max_steps=3)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=checkout_env(),
                            cwd=tmp_path)
    try:
        deadline = time.monotonic() + 240
        while _episodes_on_disk(out) < 1:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no episode recorded within 240 s"
            time.sleep(0.2)
        seen = _episodes_on_disk(out)
        for i, s in enumerate(signals):
            if i:
                time.sleep(0.3)
            proc.send_signal(s)
        stdout, stderr = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr), out, seen


def _check_interrupted(result, out: Path, seen: int, name: str, code: int) -> None:
    assert result.returncode == code, (result.returncode, result.stderr[-3000:])
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    m = re.fullmatch(rf"interrupted \({name}\): stopped after (\d+) episodes?; (?:(1) episode in progress not saved "
                     rf"\(--if-exists resume records it whole\)|no episode in progress)", lines[0])
    assert m, result.stdout
    finished = re.search(r"^episodes: (\d+) finished, (\d+) kept", result.stdout, re.MULTILINE)
    assert finished and "env-steps/s" in result.stdout and "files (" in result.stdout
    total = int(finished[1])
    assert total == int(m[1]) >= seen  # the episode cut by the signal is not one of them
    meta = json.loads((out / "trajectory.json").read_text())
    assert len(meta["episodes"]) == total == int(finished[2])
    assert [e["global_index"] for e in meta["episodes"]] == list(range(total))
    assert len((out / "trajectory.results.jsonl").read_text().splitlines()) == total
    with h5py.File(out / "trajectory.h5", "r") as f:
        assert len(f) == total
        for ep in meta["episodes"]:  # whole episodes only: 3 steps (the time limit), or fewer if it succeeded
            g = f[f"traj_{ep['episode_id']}"]
            T = ep["elapsed_steps"]
            assert (
                (T == 3 or ep["success"])
                and g["actions"].shape[0] == T
                and g["env_states/actors/cube"].shape[0] == T + 1
            )
    videos = sorted(out.glob("*.mp4"))
    assert len(videos) == total
    for ep in meta["episodes"]:
        (path,) = [p for p in videos if p.name.startswith(f"{ep['episode_id']}_")]
        assert decode_mp4(path).shape == (ep["elapsed_steps"] + 1, 64, 64, 3)


def test_sigterm_stops_record_like_ctrl_c(tmp_path):
    result, out, seen = _interrupt(tmp_path, [signal.SIGTERM])
    _check_interrupted(result, out, seen, "SIGTERM", 143)


def test_ctrl_c_twice_stops_record_and_keeps_files_whole(tmp_path):
    result, out, seen = _interrupt(tmp_path, [signal.SIGINT, signal.SIGINT])
    _check_interrupted(result, out, seen, "SIGINT", 130)


def test_record_presets_load():
    """Every `fastrecord record` preset in configs/ fills RecordConfig (run options and recording options)."""
    from fastrecord.checks import load_config
    from fastrecord.commands.config import RecordConfig

    presets = [p for p in sorted((REPO / "configs").glob("*.yaml")) if "fastrecord record --config" in p.read_text()]
    assert len(presets) >= 3
    for p in presets:
        cfg = load_config(RecordConfig, p)
        assert cfg.episodes >= 1 and cfg.record.trajectory_name == "trajectory", p


def test_resume_after_a_crash_continues_the_seed_sequence(tmp_path, capsys):
    """A run killed with SIGKILL, then the same command with --if-exists resume: the episodes the crash left
    are kept, the run goes on with the next global episodes (seed --seed + g), no start state twice."""
    result, out, seen = _interrupt(tmp_path, [signal.SIGKILL])
    assert result.returncode == -signal.SIGKILL
    total = seen + 2
    assert main(["record", "PickCube-v1", "--episodes", str(total), "--max-episode-steps", "3", "--width", "64",
                 "--height", "64", "--output-dir", str(out), "--if-exists", "resume"]) == 0
    seeds = _seeds(out)
    assert len(seeds) >= total and sorted(seeds) == list(range(len(seeds))), seeds
    assert all(seed == g for g, seed in seeds.items()), seeds
