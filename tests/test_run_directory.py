"""The run directory: nothing recorded is lost, replaced or mixed (re-runs, crashes, two writers, exits).

Each case reproduces a way a recorder used to lose or mix data, through the public wrapper, and reads
the files back.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from conftest import SRC, FullOnce

from fastrecord import RecordEpisode
from fastrecord.sinks.base import MANIFEST_SUFFIX, OutputExistsError, RunDirectory
from fastrecord.testing import BatchedDoubleEnv
from fastrecord.video import decode_mp4


def record(out: Path, batches: int = 1, num_envs: int = 2, steps: int = 3, seed: int = 0, **kwargs) -> RecordEpisode:
    """Record ``batches`` batches of ``num_envs`` episodes of ``steps`` steps with the batched double; closed."""
    env = RecordEpisode(BatchedDoubleEnv(num_envs=num_envs, max_episode_steps=steps, size=32), out, **kwargs)
    for b in range(batches):
        env.reset(seed=seed + b * num_envs)
        for _ in range(steps):
            env.step(torch.zeros(num_envs, 3))
    env.close()
    return env


def digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and not p.name.startswith(".")}


def episodes(json_path: Path) -> list[dict]:
    return json.loads(json_path.read_text())["episodes"]


def check_pair(h5_path: Path) -> list[dict]:
    """NAME.h5 and NAME.json list the same consecutive episodes with consistent lengths."""
    eps = episodes(h5_path.with_suffix(".json"))
    assert [e["episode_id"] for e in eps] == list(range(len(eps)))
    with h5py.File(h5_path, "r") as f:
        assert sorted(f.keys(), key=lambda k: int(k.split("_")[1])) == [f"traj_{i}" for i in range(len(eps))]
        for e in eps:
            g = f[f"traj_{e['episode_id']}"]
            assert g["actions"].shape[0] == e["elapsed_steps"]
            assert g["obs"].shape[0] == e["elapsed_steps"] + 1
    return eps


# ---------------------------------------------------------------------------------------------- re-runs
def test_rerun_refuses_and_changes_nothing(tmp_path):
    record(tmp_path, trajectory_name="t")
    before = digest(tmp_path)
    with pytest.raises(
        OutputExistsError,
        match=r"already holds a run named 't' \(2 episodes\).*if_exists='resume'.*if_exists='overwrite'",
    ):
        RecordEpisode(BatchedDoubleEnv(num_envs=2), tmp_path, trajectory_name="t")
    assert digest(tmp_path) == before


def test_overwrite_removes_exactly_that_runs_files(tmp_path):
    record(tmp_path, trajectory_name="t", batches=2)  # 4 episodes, 4 videos
    record(tmp_path, trajectory_name="other", seed=100)  # another run in the same folder
    other = {k: v for k, v in digest(tmp_path).items() if k.startswith("other") or k in
             json.loads((tmp_path / f"other{MANIFEST_SUFFIX}").read_text())["files"]}
    env = record(tmp_path, trajectory_name="t", if_exists="overwrite", seed=50)  # 2 episodes now
    now = digest(tmp_path)
    assert all(now.get(k) == v for k, v in other.items()), "the other run's files must not change"
    mine = [f for f in json.loads((tmp_path / f"t{MANIFEST_SUFFIX}").read_text())["files"] if f.endswith(".mp4")]
    videos = sorted(p.name for p in tmp_path.glob("*.mp4"))
    theirs = [f for f in json.loads((tmp_path / f"other{MANIFEST_SUFFIX}").read_text())["files"] if f.endswith(".mp4")]
    assert videos == sorted(mine + theirs), "no stale video of the overwritten run is left"
    assert len(mine) == 2 and sorted(mine) == sorted(p.name for p in env.recorder.video_paths)
    assert [e["episode_seed"] for e in check_pair(tmp_path / "t.h5")] == [50, 51]


def test_zero_kept_episodes_do_not_report_the_old_run(tmp_path):
    record(tmp_path, trajectory_name="t")
    record(tmp_path, trajectory_name="t", if_exists="overwrite", keep="success")  # the double never succeeds
    assert episodes(tmp_path / "t.json") == []
    with h5py.File(tmp_path / "t.h5", "r") as f:
        assert list(f.keys()) == []
    assert not list(tmp_path.glob("*.mp4"))


def test_resume_adds_episodes_after_a_closed_run(tmp_path):
    record(tmp_path, trajectory_name="t", seed=0)
    with h5py.File(tmp_path / "t.h5", "r") as f:
        first = {k: f[k]["obs"][()] for k in f}
    env = record(tmp_path, trajectory_name="t", if_exists="resume", seed=10)
    eps = check_pair(tmp_path / "t.h5")
    assert [e["episode_seed"] for e in eps] == [0, 1, 10, 11]
    with h5py.File(tmp_path / "t.h5", "r") as f:
        for k, v in first.items():
            np.testing.assert_array_equal(f[k]["obs"][()], v)
    assert sorted(p.name for p in env.recorder.video_paths) == ["2_env0_failure.mp4", "3_env1_failure.mp4"]
    files = [f for f in json.loads((tmp_path / f"t{MANIFEST_SUFFIX}").read_text())["files"] if f.endswith(".mp4")]
    assert sorted(files) == [f"{i}_env{i % 2}_failure.mp4" for i in range(4)]


def test_crash_then_resume_keeps_every_durable_episode(tmp_path):
    from test_crash import record_then_kill

    durable = record_then_kill(tmp_path, "double", min_finished=16, extra_s=0.3)
    with pytest.raises(OutputExistsError, match=r"did not close"):
        RecordEpisode(BatchedDoubleEnv(num_envs=8, max_episode_steps=4, size=64), tmp_path, trajectory_name="crash")
    env = RecordEpisode(BatchedDoubleEnv(num_envs=8, max_episode_steps=4, size=64), tmp_path, trajectory_name="crash",
                        if_exists="resume")
    resumed_from = env.recorder.first_episode_id
    assert resumed_from >= durable
    env.reset(seed=1000)
    for _ in range(4):
        env.step(torch.zeros(8, 3))
    env.close()
    eps = check_pair(tmp_path / "crash.h5")
    assert len(eps) == resumed_from + 8
    assert [e["episode_seed"] for e in eps[-8:]] == list(range(1000, 1008))
    assert not (tmp_path / "crash.h5.parts").exists()  # closed: one self-contained file again


# ---------------------------------------------------------------------------------------------- two writers
HOLDER = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {src!r})
    from fastrecord import RecordEpisode
    from fastrecord.testing import BatchedDoubleEnv
    env = RecordEpisode(BatchedDoubleEnv(num_envs=2, max_episode_steps=3), sys.argv[1], trajectory_name="t")
    env.reset(seed=0)
    import os, time
    while not os.path.exists(os.path.join(sys.argv[1], "t.json")):  # its writer process's first (empty) index
        time.sleep(0.01)
    print("ready", flush=True)
    sys.stdin.readline()
""")


def test_two_processes_cannot_record_one_name(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER.format(src=str(SRC)), str(tmp_path)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        with pytest.raises(
            OutputExistsError, match=rf"another recorder \(pid {holder.pid} on .*\) is writing trajectory_name='t'"
        ):
            RecordEpisode(BatchedDoubleEnv(num_envs=2), tmp_path, trajectory_name="t", if_exists="overwrite")
        assert (tmp_path / "t.h5").exists() and (tmp_path / f"t{MANIFEST_SUFFIX}").exists()  # untouched
    finally:
        holder.kill()
        holder.wait()
    # the kernel released the dead holder's lock: the name is free again, its files are a crashed run
    RecordEpisode(BatchedDoubleEnv(num_envs=2), tmp_path, trajectory_name="t", if_exists="resume").close()


def test_two_wrappers_in_one_process_cannot_share_a_name(tmp_path):
    a = RecordEpisode(BatchedDoubleEnv(num_envs=2), tmp_path, trajectory_name="t")
    with pytest.raises(OutputExistsError, match="another recorder"):
        RecordEpisode(BatchedDoubleEnv(num_envs=2), tmp_path, trajectory_name="t")
    a.close()


def test_default_names_never_collide(tmp_path):
    envs = [RecordEpisode(BatchedDoubleEnv(num_envs=2, max_episode_steps=2), tmp_path) for _ in range(3)]
    names = [e.recorder.trajectory_name for e in envs]
    assert len(set(names)) == 3, names
    for k, env in enumerate(envs):
        env.reset(seed=100 * k)
        for _ in range(2):
            env.step(torch.zeros(2, 3))
    for env in envs:
        env.close()
    for k, name in enumerate(names):
        eps = check_pair(tmp_path / f"{name}.h5")
        assert [e["episode_seed"] for e in eps] == [100 * k, 100 * k + 1]
        with h5py.File(tmp_path / f"{name}.h5", "r") as f:  # the data are this run's: positions from its seeds
            first = BatchedDoubleEnv(num_envs=2)
            first.reset(seed=100 * k)
            np.testing.assert_allclose(f["traj_0"]["obs"][0], first._obs()[0].numpy())


# ---------------------------------------------------------------------------------------------- exits
SCRIPT = textwrap.dedent("""
    import signal, sys, torch
    # what an interactive user's Python has; a parent that runs the tests in a background job hands its
    # children SIGINT ignored, and Python then installs no KeyboardInterrupt handler
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    sys.path.insert(0, {src!r})
    from fastrecord.system import use_lavapipe_if_no_gpu
    use_lavapipe_if_no_gpu()
    import gymnasium as gym, mani_skill.envs
    import fastrecord
    from fastrecord import RecordEpisode
    fastrecord.install_signal_handlers()  # SIGTERM -> SystemExit: the opt-in the fastrecord command makes
    env = gym.make("PickCube-v1", obs_mode="state", render_mode="rgb_array", sim_backend="physx_cpu",
                   human_render_camera_configs=dict(width=64, height=64), max_episode_steps=4)
    env = RecordEpisode(env, sys.argv[1], trajectory_name="t")
    forever = sys.argv[2] == "forever"
    k = 0
    while forever or k < 3:
        env.reset(seed=k)
        for _ in range(4):
            env.step(env.action_space.sample())
        k += 1
        print("episodes", k, flush=True)
    env.reset(seed=k)  # ends the third episode; the script ends without env.close()
""")


def test_script_without_close_keeps_every_finished_episode(tmp_path):
    r = subprocess.run([sys.executable, "-c", SCRIPT.format(src=str(SRC)), str(tmp_path), "3"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    eps = check_pair(tmp_path / "t.h5")
    assert len(eps) == 3
    videos = sorted(tmp_path.glob("*.mp4"))
    assert [p.name for p in videos] == ["0_env0_failure.mp4", "1_env0_failure.mp4", "2_env0_failure.mp4"]
    assert all(len(decode_mp4(p)) == 5 for p in videos)
    assert json.loads((tmp_path / f"t{MANIFEST_SUFFIX}").read_text())["status"] == "closed"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_and_sigint_close_the_recorder(tmp_path, sig):
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT.format(src=str(SRC)), str(tmp_path), "forever"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.startswith("episodes") and int(line.split()[1]) >= 2:
            break
    time.sleep(0.2)
    os.kill(proc.pid, sig)
    _, err = proc.communicate(timeout=120)
    # SIGTERM: SystemExit(143) from fastrecord's handler; SIGINT: KeyboardInterrupt, which Python reports by
    # ending with SIGINT itself (-2) after the exit hooks ran
    assert proc.returncode == (143 if sig == signal.SIGTERM else -signal.SIGINT), err
    if sig == signal.SIGTERM:
        assert "Traceback" not in err
    eps = check_pair(tmp_path / "t.h5")
    assert len(eps) >= 2
    assert len(list(tmp_path.glob("*.mp4"))) == len(eps)
    assert not (tmp_path / "t.h5.parts").exists()  # closed and consolidated
    assert json.loads((tmp_path / f"t{MANIFEST_SUFFIX}").read_text())["status"] == "closed"


# ---------------------------------------------------------------------------------------------- construction
def test_failed_construction_leaves_nothing_that_blocks_a_retry(tmp_path):
    from fastrecord.sinks import Sink

    class BrokenSink(Sink):
        def open(self, run):
            raise RuntimeError("cannot reach the logging server")

        def submit(self, episodes):
            pass

    with pytest.raises(RuntimeError, match="logging server"):
        RecordEpisode(BatchedDoubleEnv(num_envs=2), tmp_path, trajectory_name="t", sinks=[BrokenSink()])
    assert [p.name for p in tmp_path.iterdir()] == []
    record(tmp_path, trajectory_name="t")  # the retry works
    assert len(check_pair(tmp_path / "t.h5")) == 2


# ---------------------------------------------------------------------------------------------- full disk
def test_full_disk_is_an_error_in_the_caller_and_keeps_what_was_written(small_disk):
    (small_disk / "filler").write_bytes(os.urandom((2 << 20) - (200 << 10)))  # about 200 KiB left
    out = small_disk / "run"
    env = RecordEpisode(BatchedDoubleEnv(num_envs=4, max_episode_steps=6, size=64), out, trajectory_name="t")
    written = 0
    with pytest.raises(Exception) as e:
        for b in range(200):
            env.reset(seed=4 * b)
            for _ in range(6):
                env.step(torch.zeros(4, 3))
            env.wait_until_done()
            written = env.recorder.num_episodes
    from fastrecord import WorkerError

    assert isinstance(e.value, WorkerError), repr(e.value)
    assert "No space left on device" in str(e.value), str(e.value)
    with pytest.raises(WorkerError):
        env.close()
    eps = check_pair(out / "t.h5")  # readable, consistent, and holding what was durable before
    assert written > 0 and len(eps) >= written


def test_a_close_whose_manifest_cannot_be_written_keeps_the_journal(tmp_path, monkeypatch):
    """A run's files since its last manifest are listed only in its journal; a close on a full disk (the final
    manifest's write fails) keeps the journal, so the resume lists and keeps every one of them (CI saw a
    committed video left unlisted, then duplicated as ``_1`` by the resume, when the close removed it)."""
    import errno

    from fastrecord.sinks import base
    from fastrecord.sinks.runfiles import journal_path, listed_files

    run = RunDirectory(tmp_path, "t", manifest_interval_s=3600).open()  # the first manifest only, at open
    for e in range(3):
        (tmp_path / f"{e}_env0_failure.mp4").write_bytes(b"video")
        run.intend_file(tmp_path / f"{e}_env0_failure.mp4", [e])
        run.add_file(tmp_path / f"{e}_env0_failure.mp4", [e], intended=tmp_path / f"{e}_env0_failure.mp4")

    def no_space(path, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(base, "atomic_write_bytes", no_space)
    with pytest.raises(OSError, match="No space"):
        run.close(status="failed")
    monkeypatch.undo()
    assert journal_path(tmp_path, "t").exists()
    want = {f"{e}_env0_failure.mp4": [e] for e in range(3)}
    assert {f: e for f, e in listed_files(tmp_path, "t").items() if f.endswith(".mp4")} == want
    resumed = RunDirectory(tmp_path, "t", if_exists="resume").open()
    resumed.close()
    manifest = json.loads((tmp_path / f"t{MANIFEST_SUFFIX}").read_text())
    assert set(want) <= set(manifest["files"]) and not journal_path(tmp_path, "t").exists()


# ---------------------------------------------------------------------------------------------- runs that recorded nothing
def test_a_run_that_recorded_nothing_does_not_block_the_same_name(tmp_path):
    RecordEpisode(BatchedDoubleEnv(num_envs=2), tmp_path, trajectory_name="t").close()  # closed before any episode
    assert episodes(tmp_path / "t.json") == []
    record(tmp_path, trajectory_name="t")  # the same command again: replaces the empty run
    assert len(check_pair(tmp_path / "t.h5")) == 2
    with pytest.raises(OutputExistsError, match="already holds a run named 't'"):  # a run with episodes still blocks
        RecordEpisode(BatchedDoubleEnv(num_envs=2), tmp_path, trajectory_name="t")


def test_a_start_up_killed_before_any_episode_does_not_block(tmp_path):
    (tmp_path / f"t{MANIFEST_SUFFIX}").write_text(json.dumps(dict(name="t", status="recording", counters={}, files=[])))
    (tmp_path / "other.mp4").write_bytes(b"not ours")
    record(tmp_path, trajectory_name="t")
    assert len(check_pair(tmp_path / "t.h5")) == 2
    assert (tmp_path / "other.mp4").read_bytes() == b"not ours"  # another run's file: untouched


def test_a_run_with_videos_only_still_blocks(tmp_path):
    record(tmp_path, trajectory_name="t", save_trajectory=False)
    assert list(tmp_path.glob("*.mp4"))
    with pytest.raises(OutputExistsError, match="already holds a run named 't'"):
        RecordEpisode(BatchedDoubleEnv(num_envs=2), tmp_path, trajectory_name="t")


def test_no_space_at_start_leaves_no_folder_nor_lock(small_disk):
    try:
        (small_disk / "filler").write_bytes(os.urandom(4 << 20))
    except OSError:  # full now, as meant
        pass
    with pytest.raises(OSError, match="No space left"):
        RunDirectory(small_disk / "a" / "b", "t").open()
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler"]


def test_an_unknown_sensor_camera_is_refused_before_the_run_directory(tmp_path, make_env):
    from conftest import CAMERA

    env = make_env(obs_mode="rgb", sensor_configs=CAMERA)
    out = tmp_path / "rec"
    with pytest.raises(ValueError, match=r"video_source='sensor:nocam': the env has no RGB camera 'nocam'; its "
                                         r"observations hold base_camera: pass video_source='sensor:base_camera'"):
        RecordEpisode(env, out, trajectory_name="t", video_source="sensor:nocam")
    assert not out.exists()
    state = make_env(obs_mode="state")
    with pytest.raises(
        ValueError, match=r"observations hold no camera images \(obs_mode='state'\); create the env with obs_mode='rgb'"
    ):
        RecordEpisode(state, out, trajectory_name="t", video_source="sensor:base_camera")
    assert not out.exists()
    RecordEpisode(env, out, trajectory_name="t", video_source="sensor:base_camera").close()  # the right name works


def test_files_fastrecord_did_not_make_are_never_taken_for_an_empty_run(tmp_path):
    """A NAME.json without "episodes" (a user's own config.json) and no manifest: refused, nothing deleted."""
    (tmp_path / "t.json").write_text(json.dumps({"lr": 0.1}))
    before = digest(tmp_path)
    with pytest.raises(OutputExistsError):
        RecordEpisode(BatchedDoubleEnv(num_envs=2), tmp_path, trajectory_name="t")
    assert digest(tmp_path) == before


def test_results_of_a_run_with_no_kept_episode_keep_its_name(tmp_path):
    """A run whose keep filter dropped every episode still has results rows: it is not an empty run."""
    record(tmp_path, trajectory_name="t", keep=lambda info: False)
    rows = (tmp_path / "t.results.jsonl").read_text().splitlines()
    assert len(rows) == 2
    with pytest.raises(OutputExistsError):
        RecordEpisode(BatchedDoubleEnv(num_envs=2), tmp_path, trajectory_name="t")
    assert (tmp_path / "t.results.jsonl").read_text().splitlines() == rows


@pytest.mark.parametrize(("h5", "blocks"), [("empty", False), ("episode", True), ("garbage", True)])
def test_an_empty_runs_hdf5_file_is_read_outside_the_callers_process(tmp_path, monkeypatch, h5, blocks):
    """Whether the NAME.h5 of a run whose NAME.json lists no episode holds episodes is read in a writer
    process: h5py never opens it in the caller's (a damaged file must not crash a user's process). An
    empty file: the run recorded nothing and is replaced; a file with a traj_ group or one that is not
    HDF5: kept, the name refused."""
    (tmp_path / f"t{MANIFEST_SUFFIX}").write_text(json.dumps(dict(name="t", status="closed", counters={}, files=[])))
    (tmp_path / "t.json").write_text(json.dumps({"episodes": []}))
    if h5 == "garbage":
        (tmp_path / "t.h5").write_bytes(b"not an HDF5 file")
    else:
        with h5py.File(tmp_path / "t.h5", "w") as f:
            if h5 == "episode":
                f.create_dataset("traj_0/actions", data=np.zeros((2, 3)))

    def no_hdf5_here(*args, **kwargs):
        raise AssertionError(f"h5py.File{args} opened in the caller's process")

    before = digest(tmp_path)
    monkeypatch.setattr(h5py, "File", no_hdf5_here)
    if blocks:
        with pytest.raises(OutputExistsError, match=r"already holds a run named 't' \(0 episodes\): t.h5"):
            RunDirectory(tmp_path, "t").open()
        assert digest(tmp_path) == before
    else:
        RunDirectory(tmp_path, "t").open().close()
        assert not (tmp_path / "t.h5").exists() and not (tmp_path / "t.json").exists()


def test_a_journal_line_whose_write_failed_leaves_the_journal_whole(tmp_path):
    """The disk fills while a journal line is written (half of it on disk): the error reaches the caller, the
    journal still ends at its last whole line, so the next line (space back) is read whole and not glued to the
    half one; the manifest lists all three files (the failed line's file is listed in memory)."""
    from fastrecord.sinks.runfiles import journal_path, read_journal, read_manifest

    run = RunDirectory(tmp_path, "t", manifest_interval_s=3600).open()
    run.add_file(tmp_path / "0_env0_failure.mp4", [0])  # the journal is open from here
    run._journal = FullOnce(run._journal)
    with pytest.raises(OSError, match="No space left"):
        run.add_file(tmp_path / "1_env0_failure.mp4", [1])
    run.add_file(tmp_path / "2_env0_failure.mp4", [2])
    assert [e["file"] for e in read_journal(journal_path(tmp_path, "t"))] == ["0_env0_failure.mp4",
                                                                               "2_env0_failure.mp4"]
    run.close()
    assert read_manifest(tmp_path / "t.fastrecord.json")["files"] == [f"{e}_env0_failure.mp4" for e in range(3)]
