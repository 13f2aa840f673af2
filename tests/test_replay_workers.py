"""fastrecord replay --workers: episodes split over worker processes, shards merged (fastrecord.shards).

Real ManiSkill CPU envs (PickCube-v1, physx_cpu, lavapipe rendering), state -> rgb with 32x32 sensor
cameras, short episodes recorded here with seeded random actions. Each worker is a spawned process
that imports ManiSkill and builds its own env, so these cases take a minute or so each.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import gymnasium as gym
import h5py
import numpy as np
import pytest
from conftest import CAMERA, checkout_env, fastrecord_cli, leaves, torchrun

from fastrecord.replay import ReplayConfig, ReplayWorkerError, default_workers, run_replay

ENV_ID = "PickCube-v1"
SENSORS = dict(sensor_configs=dict(width=32, height=32))
NAME = "demo.rgb.pd_joint_delta_pos.physx_cpu"


def record(out: Path, episodes: int, steps: int) -> Path:
    """``episodes`` PickCube episodes of ``steps`` seeded random steps (truncated by the time limit)."""
    import mani_skill.envs  # noqa: F401

    from fastrecord import RecordEpisode

    env = RecordEpisode(gym.make(ENV_ID, obs_mode="state", control_mode="pd_joint_delta_pos", render_mode="rgb_array",
                                 sim_backend="physx_cpu", human_render_camera_configs=CAMERA, max_episode_steps=steps),
                        str(out), trajectory_name="demo", save_video=False)
    rng = np.random.default_rng(0)
    for seed in range(episodes):
        env.reset(seed=seed)
        for _ in range(steps):
            env.step(rng.uniform(-1, 1, size=(1, 8)).astype(np.float32))
    env.close()
    return out / "demo.h5"


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    return record(tmp_path_factory.mktemp("demo"), episodes=5, steps=6)


def replay(src: Path, out: Path, **kw):
    cfg = ReplayConfig.from_values(dict(traj_path=str(src), output_dir=str(out), obs_mode="rgb", save_video=False,
                                        progress=False, env_kwargs=SENSORS, **kw))
    s = run_replay(cfg)
    return s, out / f"{NAME}.h5", json.loads((out / f"{NAME}.json").read_text())


def assert_matches_input(src: Path, new_h5: Path, meta: dict) -> None:
    """Every output episode holds its input episode's actions and env states (replayed by states)."""
    with h5py.File(src) as f, h5py.File(new_h5) as g:
        for ep in meta["episodes"]:
            a, b = leaves(f[f"traj_{ep['source_episode_id']}"]), leaves(g[f"traj_{ep['episode_id']}"])
            np.testing.assert_array_equal(b["actions"], a["actions"])
            for k in a:
                if k.startswith("env_states/"):
                    np.testing.assert_allclose(b[k], a[k], rtol=0, atol=1e-6, err_msg=k)
            assert b["obs/sensor_data/base_camera/rgb"].shape == (ep["elapsed_steps"] + 1, 32, 32, 3)


def test_two_workers_give_the_episodes_of_one(demo, tmp_path):
    """--workers 2: same episodes, in input order, as one process; each entry says where it came from;
    ManiSkill's replay_trajectory reads the merged file (external links into the shards)."""
    s1, h5_1, meta1 = replay(demo, tmp_path / "one", workers=1, num_envs=1)
    s2, h5_2, meta2 = replay(demo, tmp_path / "two", workers=2, num_envs=2)
    assert (s1.episodes, s1.kept, s2.episodes, s2.kept, s2.workers, s2.missing) == (5, 5, 5, 5, 2, [])
    assert [e["source_episode_id"] for e in meta1["episodes"]] == [0, 1, 2, 3, 4]
    assert [(e["episode_id"], e["source_episode_id"], e["global_index"]) for e in meta2["episodes"]] == [
        (g, g, g) for g in range(5)]
    assert sorted(p.name for p in (tmp_path / "two" / f"{NAME}.shards").iterdir()) == ["rank00000", "rank00001"]
    # each episode was replayed once, by the worker that took it (whichever had an env free): its shard holds it
    held = {rank: sorted(e["global_index"] for e in json.loads(
        (tmp_path / "two" / f"{NAME}.shards" / f"rank{rank:05d}" / f"{NAME}.json").read_text())["episodes"])
        for rank in (0, 1)}
    assert sorted(held[0] + held[1]) == list(range(5))
    assert all(e["global_index"] in held[e["source_rank"]] for e in meta2["episodes"])
    assert len(s2.worker_times) == 2 and s2.merge_seconds > 0  # the timeline the CLI prints
    assert all(0 <= up <= replaying <= done for up, replaying, done in s2.worker_times), s2.worker_times
    with h5py.File(h5_1) as f, h5py.File(h5_2) as g:
        assert sorted(f) == sorted(g) == [f"traj_{i}" for i in range(5)]
        for k in range(5):
            a, b = leaves(f[f"traj_{k}"]), leaves(g[f"traj_{k}"])
            assert a.keys() == b.keys()
            for key in a:
                if a[key].dtype in (np.uint8, np.bool_) or key == "actions":
                    np.testing.assert_array_equal(b[key], a[key], err_msg=key)  # rgb images: bit-exact
                else:
                    np.testing.assert_allclose(b[key], a[key], rtol=0, atol=1e-6, err_msg=key)
    for x, y in zip(meta1["episodes"], meta2["episodes"]):
        assert (x["episode_seed"], x["elapsed_steps"]) == (y["episode_seed"], y["elapsed_steps"])
    assert_matches_input(demo, h5_2, meta2)

    r = subprocess.run([sys.executable, "-m", "mani_skill.trajectory.replay_trajectory", "--traj-path", str(h5_2),
                        "--use-env-states", "--count", "3"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Replayed 3 episodes" in r.stdout

    # the finished replay again: refused without --overwrite; --resume finds nothing to do (no worker is started)
    with pytest.raises(
        ValueError, match=r"already holds a run named .*--resume .*--overwrite \(overwrite=True\) deletes it first"
    ):
        replay(demo, tmp_path / "two", workers=2, num_envs=2)
    s3, _, meta3 = replay(demo, tmp_path / "two", workers=2, num_envs=2, resume=True)
    assert (s3.episodes, s3.skipped, s3.missing) == (0, 5, []) and meta3["episodes"] == meta2["episodes"]
    with pytest.raises(ValueError, match=r"is a sharded replay .*resume it with --workers 2 or more"):
        replay(demo, tmp_path / "two", workers=1, num_envs=1, resume=True)


def run_cli(argv: list[str], **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "fastrecord", "replay", *argv], env=checkout_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def test_each_worker_writes_its_phases_to_a_timeline_of_its_own(demo, tmp_path):
    """With FASTRECORD_TIMELINE (benchmarks/bench_replay.py --stamps) each worker's phases go to ``PATH.workerN``, in
    order, and the caller's file holds the caller's phases: no worker rewrote it with what it inherited."""
    path = tmp_path / "timeline.json"
    r = fastrecord_cli("replay", str(demo), "--workers", "2", "--num-envs", "2", "--no-video", "--obs-mode", "rgb",
                       "--output-dir", str(tmp_path / "out"), "--env-kwargs",
                       f"sensor_configs={json.dumps(SENSORS['sensor_configs'])}",
                       env={"FASTRECORD_TIMELINE": str(path)})
    assert r.returncode == 0, r.stderr[-2000:]
    caller = json.loads(path.read_text())
    assert {"main", "imported", "loop_end"} <= set(caller) and "worker_entered" not in caller
    phases = ["worker_entered", "plan_made", "envs_made", "first_step_done", "drive_loop_end", "recorder_drained",
              "worker_done"]
    for rank in (0, 1):
        got = json.loads((tmp_path / f"timeline.json.worker{rank}").read_text())
        assert [k for k in sorted(got, key=got.get) if k in phases] == phases
        assert "main" not in got and caller["imported"] < got["worker_entered"] < got["worker_done"] < caller["loop_end"]

    # --overwrite: the workers start before the input's check, and the claim that deletes the earlier replay waits for
    # the check (it used to run first: 0.5-1.2 s before any worker started, on the H100 machine); the earlier replay is
    # replaced whole, each input episode once
    path.unlink()
    r = fastrecord_cli("replay", str(demo), "--workers", "2", "--num-envs", "2", "--no-video", "--obs-mode", "rgb",
                       "--output-dir", str(tmp_path / "out"), "--env-kwargs",
                       f"sensor_configs={json.dumps(SENSORS['sensor_configs'])}", "--overwrite",
                       env={"FASTRECORD_TIMELINE": str(path)})
    assert r.returncode == 0, r.stderr[-2000:]
    caller = json.loads(path.read_text())
    assert caller["plan_made"] <= caller["workers_started"] < caller["input_checked"] < caller["merged"]
    meta = json.loads((tmp_path / "out" / f"{NAME}.json").read_text())
    assert sorted(e["source_episode_id"] for e in meta["episodes"]) == [0, 1, 2, 3, 4]
    assert_matches_input(demo, tmp_path / "out" / f"{NAME}.h5", meta)


def test_workers_whose_envs_are_sub_env_processes_replay_every_episode(demo, tmp_path):
    """Workers of 2 envs that the CPU draws hold them in sub-env processes (`fastrecord.replay.ahead`), which each worker
    starts from a forkserver of its own: its server (forked from the CLI where that is safe) once inherited the lock
    multiprocessing held while starting it, and the workers waited on it forever. The CLI's command finishes, with
    every episode's actions and states."""
    r = fastrecord_cli("replay", str(demo), "--workers", "2", "--num-envs", "4", "--render-backend", "cpu",
                       "--no-video", "--obs-mode", "rgb", "--output-dir", str(tmp_path / "out"), "--env-kwargs",
                       f"sensor_configs={json.dumps(SENSORS['sensor_configs'])}", timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    meta = json.loads((tmp_path / "out" / f"{NAME}.json").read_text())
    assert [e["source_episode_id"] for e in meta["episodes"]] == list(range(5))
    assert_matches_input(demo, tmp_path / "out" / f"{NAME}.h5", meta)


def test_workers_videos_are_where_one_process_puts_them(demo, tmp_path):
    """--workers 2 with videos: each episode's video is in the output folder under the name one process gives it
    (a hard link of the worker's file in its shard), with the same frames; the summary lists the files one process
    lists (the joined results rows, not the shards')."""
    import av

    def replay_videos(out: Path, workers: int, num_envs: int):
        cfg = ReplayConfig.from_values(dict(traj_path=str(demo), output_dir=str(out), obs_mode="state", progress=False,
                                            workers=workers, num_envs=num_envs, count=3))
        return run_replay(cfg)

    def frames(path: Path) -> np.ndarray:
        with av.open(str(path)) as c:
            return np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)])

    one, two = replay_videos(tmp_path / "one", 1, 1), replay_videos(tmp_path / "two", 2, 2)
    names = sorted(p.name for p in (tmp_path / "one").glob("*.mp4"))
    assert len(names) == 3 and sorted(p.name for p in (tmp_path / "two").glob("*.mp4")) == names
    # the same files as one process lists, in the output folder: trajectory, videos, the results rows
    assert sorted(p.name for p in two.files) == sorted(p.name for p in one.files)
    assert all(p.parent == tmp_path / "two" for p in two.files) and two.results_path in two.files
    shard_videos = list((tmp_path / "two").glob("*.shards/rank*/*.mp4"))
    assert len(shard_videos) == 3
    for name in names:
        joined = tmp_path / "two" / name
        assert any(os.path.samefile(joined, v) for v in shard_videos)
        np.testing.assert_array_equal(frames(joined), frames(tmp_path / "one" / name))
    assert one.kept == two.kept == 3


def test_the_default_layout_is_one_process_where_only_that_fits(demo, tmp_path, monkeypatch):
    """On a machine of many cores (here: told 16) the default is workers, except: a replay with a logger (`sinks`,
    `--log`: one process's replays) runs in one process instead of refusing; ManiSkill's command lines without -n
    replay in one env, as its tool; and a replay that continues an earlier one takes that one's layout (one
    process for an unsharded replay resumed, its workers for a sharded one) instead of refusing."""
    import fastrecord.options
    from fastrecord.replay.plan import make_plan
    from fastrecord.sinks.base import Sink
    from fastrecord.sinks.maniskill_h5 import open_trajectory

    monkeypatch.setattr(fastrecord.options, "usable_cores", lambda *a, **k: 16)

    def plan_of(out: Path, **kw):
        cfg = ReplayConfig.from_values(dict(traj_path=str(demo), output_dir=str(out), progress=False, **kw))
        traj = open_trajectory(cfg.traj_path)
        try:
            return make_plan(cfg, traj)
        finally:
            traj.close()

    assert plan_of(tmp_path / "a", save_video=False).workers == 5  # one env a worker (CPU rendering), one an episode
    assert plan_of(tmp_path / "a", maniskill=True, save_trajectory=True).workers == 1
    assert plan_of(tmp_path / "a", maniskill=True, save_trajectory=True, num_envs=2).workers == 2

    class Seen(Sink):
        wants_datasets = False

        def __init__(self) -> None:
            self.episodes = 0

        def submit(self, episodes) -> None:
            self.episodes += len(episodes)

    seen = Seen()
    cfg = ReplayConfig.from_values(dict(traj_path=str(demo), output_dir=str(tmp_path / "one"), progress=False,
                                        save_video=False, count=2, num_envs=1))
    s = run_replay(cfg, sinks=[seen])
    assert (s.workers, s.kept, seen.episodes) == (1, 2, 2)
    # continued: the one-process replay resumed in one process; a sharded one in its workers
    assert plan_of(tmp_path / "one", save_video=False, resume=True, num_envs=1).workers == 1
    replay(demo, tmp_path / "two", workers=2, num_envs=2, count=2)
    assert plan_of(tmp_path / "two", save_video=False, obs_mode="rgb", env_kwargs=SENSORS, resume=True,
                   num_envs=2).workers == 2
    monkeypatch.setattr(fastrecord.options, "usable_cores", lambda *a, **k: 2)  # a machine whose default is one process
    assert plan_of(tmp_path / "two", save_video=False, obs_mode="rgb", env_kwargs=SENSORS, resume=True,
                   num_envs=2).workers == 2


def test_killed_worker_then_rerun_resumes(tmp_path):
    """SIGKILL worker 1 once it has written an episode: the caller names it and the missing episodes (those its env
    had taken and not finished; worker 0 takes every other one), the merge holds the rest; the same command again
    replays only what is missing."""
    n = 16
    src = record(tmp_path / "in", episodes=n, steps=8)
    config = tmp_path / "replay.yaml"
    config.write_text(json.dumps({"env_kwargs": SENSORS}))  # YAML is a superset of JSON
    out = tmp_path / "out"
    argv = [str(src), "--output-dir", str(out), "--obs-mode", "rgb", "--no-video", "--workers", "2", "--num-envs", "2",
            "--config", str(config), "--quiet"]
    proc = run_cli(argv)
    shard = out / f"{NAME}.shards" / "rank00001"
    deadline = time.monotonic() + 600
    while not list((shard / f"{NAME}.h5.parts").glob("part_*.h5")):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.05)
    pid = int((shard / f".{NAME}.lock").read_text().split()[1])  # "pid N on host": the worker holds its shard's lock
    os.kill(pid, signal.SIGKILL)
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 1, stderr[-3000:]
    assert "replay worker 1 of 2" in stderr and "SIGKILL" in stderr and "run the same command again" in stderr
    first = json.loads((out / f"{NAME}.json").read_text())["episodes"]
    held = [e["global_index"] for e in first]
    assert len(set(held)) == len(held) < n  # what the workers had listed, each episode once
    assert f"of {n} episodes are missing" in stderr

    proc = run_cli(argv)
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-3000:]
    assert "resuming the unfinished sharded replay" in stdout
    meta = json.loads((out / f"{NAME}.json").read_text())
    assert [e["global_index"] for e in meta["episodes"]] == list(range(n))
    assert [e["source_episode_id"] for e in meta["episodes"]] == list(range(n))
    assert_matches_input(src, out / f"{NAME}.h5", meta)
    manifest = json.loads((out / f"{NAME}.fastrecord.json").read_text())
    assert manifest["status"] == "closed" and manifest["options"]["sharding"]["world_size"] == 2


def test_a_worker_exception_names_the_worker_and_cause(demo, tmp_path):
    """Episode 1 has actions of the wrong shape: the worker that takes it (each has one env) fails, the other replays
    every other episode, they are merged, and the error names the worker, the cause and the missing episode."""
    bad = tmp_path / "in" / "demo.h5"
    bad.parent.mkdir()
    with h5py.File(demo) as f, h5py.File(bad, "w") as g:
        for k in f:
            f.copy(f[k], g, name=k)
        actions = g["traj_1/actions"][:]
        del g["traj_1/actions"]
        g["traj_1/actions"] = np.concatenate([actions, actions[:, :1]], axis=1)
    bad.with_suffix(".json").write_text(demo.with_suffix(".json").read_text())
    with pytest.raises(
        ReplayWorkerError,
        match=r"replay worker [01] of 2 \(sharing 5 episodes with the others, .*failed: ValueError: .*traj_1/actions "
        r"has shape \(6, 9\).*1 of 5 episodes are missing.*global indices 1\)",
    ):
        replay(bad, tmp_path / "out", workers=2, num_envs=2)
    meta = json.loads((tmp_path / "out" / f"{NAME}.json").read_text())
    assert [e["global_index"] for e in meta["episodes"]] == [0, 2, 3, 4]


def test_bad_workers_values_are_refused(demo, tmp_path, capsys):
    from fastrecord.commands.cli import main

    def err(*argv: str) -> str:
        assert main(["replay", str(demo), "--output-dir", str(tmp_path / "out"), *argv]) == 2
        return capsys.readouterr().err

    assert "workers=0 must be at least 1; pass workers=1 or more (the --workers flag" in err("--workers", "0")
    assert "workers=-2 must be at least 1" in err("--workers", "-2")
    assert "--workers 3 with --num-envs 2" in err("--workers", "3", "--num-envs", "2")
    assert "pass --num-envs 3 or more, or --workers 2 or fewer" in err("--workers", "3", "--num-envs", "2")
    assert "--resume keeps" in err("--resume", "--overwrite")
    assert "--log with --workers 2" in err("--workers", "2", "--num-envs", "2", "--log", "tensorboard")
    assert main(["replay", str(demo), "--workers", "two"]) == 2  # argparse's mistakes: one line, status 2 too
    assert "argument --workers: invalid int value: 'two'; see fastrecord replay --help" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"workers='2' must be int or null, not str"):
        ReplayConfig(traj_path=str(demo), workers="2")
    assert not (tmp_path / "out").exists()  # nothing written


def test_the_cli_starts_the_forkserver_early_for_replays_that_fork(monkeypatch):
    """`fastrecord replay` guesses from its command line alone whether it will fork processes (workers, or a
    CPU vector env's sub-envs), and then starts the forkserver (its imports) before its own imports."""
    import fastrecord.system
    from fastrecord.commands.cli import _replay_forks

    monkeypatch.setattr(fastrecord.system, "has_nvidia_gpu", lambda: True)  # a GPU draws (below: the CPU)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)  # the machine's cores: not what counts
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))  # the cores this process may use
    assert _replay_forks(["replay", "x.h5"])  # by default one env per core (and one worker per env on 8+)
    assert _replay_forks(["replay", "x.h5", "--workers", "4"])
    assert _replay_forks(["replay", "x.h5", "--workers=2", "--num-envs", "2"])
    assert not _replay_forks(["replay", "x.h5", "--workers", "1", "-n", "4"])  # one process holds its 4 envs
    assert _replay_forks(["replay", "x.h5", "--workers", "1", "-n", "8"])  # more: one sub-process each
    assert _replay_forks(["replay", "x.h5", "--workers", "1", "-n", "2", "--vector", "async"])
    assert not _replay_forks(["replay", "x.h5", "--workers", "1", "--num-envs", "1"])
    assert not _replay_forks(["replay", "x.h5", "--num-envs=1"])
    assert not _replay_forks(["replay", "x.h5", "--sim-backend", "physx_cuda"])  # one batched GPU env
    assert not _replay_forks(["replay", "x.h5", "-b", "cuda:1", "-n", "64"])
    assert _replay_forks(["replay", "x.h5", "-b", "cuda:1", "--workers", "2"])  # workers: batched envs each
    assert not _replay_forks(["record", "PickCube-v1"])
    # the default is one process with a logger (16 envs still fork: one sub-process each) and for ManiSkill's command
    # lines without -n (one env)
    assert not _replay_forks(["replay", "x.h5", "--log", "tensorboard", "-n", "4"])
    assert _replay_forks(["replay", "x.h5", "--log", "tensorboard"])
    assert not _replay_forks(["replay", "--traj-path", "x.h5", "--save-video"])
    assert _replay_forks(["replay", "--traj-path", "x.h5", "-n", "8"])
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})  # taskset -c 0,1 on the 64-core machine
    assert not _replay_forks(["replay", "x.h5"])  # one process holds the 2 envs
    assert _replay_forks(["replay", "x.h5", "-n", "6"])
    assert not _replay_forks(["replay", "x.h5", "-n", "6", "--vector", "sync"])
    # drawn by the CPU, several envs in the one process: each in a sub-env process (`fastrecord.replay.ahead`)
    assert _replay_forks(["replay", "x.h5", "--render-backend", "cpu"])
    assert not _replay_forks(["replay", "x.h5", "--render-backend", "cpu", "--render-substeps"])
    assert not _replay_forks(["replay", "x.h5", "--render-backend", "cpu", "--vector", "sync"])
    assert not _replay_forks(["replay", "x.h5", "--render-backend", "cpu", "-n", "1"])
    # nothing drawn (state observations, no video): the envs stay in this process
    assert not _replay_forks(["replay", "x.h5", "--render-backend", "cpu", "--no-video"])
    assert not _replay_forks(["replay", "x.h5", "--render-backend", "cpu", "--no-video", "--obs-mode", "state"])
    assert _replay_forks(["replay", "x.h5", "--render-backend", "cpu", "--no-video", "--obs-mode", "rgb"])
    assert _replay_forks(["replay", "x.h5", "--render-backend", "cpu", "--no-video", "--log", "tensorboard"])
    assert not _replay_forks(["replay", "--traj-path", "x.h5", "-n", "2", "--render-backend", "cpu"])
    assert _replay_forks(["replay", "--traj-path", "x.h5", "-n", "2", "--render-backend", "cpu", "--save-video"])
    monkeypatch.setattr(fastrecord.system, "has_nvidia_gpu", lambda: False)
    assert _replay_forks(["replay", "x.h5"])
    assert _replay_forks(["replay", "x.h5", "--workers", "1", "-n", "4"])
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3})
    assert not _replay_forks(["replay", "x.h5"])


def test_default_workers(monkeypatch):
    """Sized to the cores this process may use (its affinity mask, shared by torchrun's ranks on the host),
    not to the machine's: 2 usable cores of 64 are a small machine."""
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert default_workers(None, 96, gpu_sim=False) == 1  # a small machine: one process
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(32)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two ranks share the 32 cores
    assert default_workers(None, 96, gpu_sim=False) == 16  # rendering on the CPU: one worker per env, one env per core
    assert default_workers(None, 5, gpu_sim=False) == 5  # at most one per episode
    assert default_workers(4, 96, gpu_sim=False) == 4
    assert default_workers(None, 96, gpu_sim=False, gpu_render=True) == 4  # on a GPU: 4 envs a worker
    assert default_workers(6, 96, gpu_sim=False, gpu_render=True) == 2
    assert default_workers(None, 96, gpu_sim=True) == 1  # one batched GPU env holds every env


def test_torchrun_ranks_replay_their_shares(demo, tmp_path):
    """torchrun --standalone --nproc-per-node 2 -m fastrecord replay: each rank replays g % 2, rank 0 merges."""
    config = tmp_path / "replay.yaml"
    config.write_text(json.dumps({"env_kwargs": SENSORS}))
    out = tmp_path / "out"
    r = torchrun(2, ["-m", "fastrecord", "replay", str(demo), "--output-dir", str(out), "--obs-mode", "rgb",
                     "--no-video", "--num-envs", "1", "--config", str(config), "--quiet"], timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "rank 1: replayed 2 episodes" in r.stdout
    assert re.search(
        r"replayed 5 episodes by env states: \d+ successful, 5 written \(keep=all\) by 2 workers", r.stdout
    )
    meta = json.loads((out / f"{NAME}.json").read_text())
    assert [(e["global_index"], e["source_rank"]) for e in meta["episodes"]] == [(g, g % 2) for g in range(5)]
    assert_matches_input(demo, out / f"{NAME}.h5", meta)


def test_workers_take_the_next_episode_when_an_env_is_free():
    """Replay workers share one counter of their episodes (`replay.drive._Claims`, a `multiprocessing.Value` made as
    `run_workers` makes it): each env that is free takes the next episode no worker took, so a worker that started
    later or got shorter episodes replays fewer; every episode is taken once; a retry goes back to its own worker
    first; an env for which nothing is left stays idle (its reset leaves it out)."""
    import multiprocessing as mp
    from types import SimpleNamespace

    from fastrecord.replay.drive import _Slots

    class Batch:
        num_envs, action_shape = 2, (1,)

        def __init__(self) -> None:
            self.resets: list[list[int]] = []

        def start(self, envs, plans) -> None:
            self.resets.append([int(e) for e in envs])

    episodes = [{"episode_id": i, "episode_seed": i} for i in range(5)]
    traj = SimpleNamespace(actions=lambda ep: np.zeros((3, 1), np.float32), h5_path=Path("in.h5"))
    cfg = SimpleNamespace(replay_by="actions", use_first_env_state=False)
    counter = mp.get_context("forkserver").Value("q", 0)
    early, late = Batch(), Batch()
    a, b = _Slots(cfg, traj, episodes, early, counter), _Slots(cfg, traj, episodes, late, counter)
    a.start([0, 1])  # the worker whose envs were made first takes 0 and 1
    assert a.slot == [0, 1] and len(b.pending) == 3
    a.slot[0] = None
    a.start([0])  # its env 0 is free again before the other worker starts: 2
    b.start([0, 1])  # 3 and 4
    assert (a.slot, b.slot) == ([2, 1], [3, 4]) and len(a.pending) == 0
    a.pending.appendleft(1)  # a retry of episode 1 stays with the worker that replayed it
    a.slot[1] = None
    a.start([1])
    b.slot[0] = b.slot[1] = None
    b.start([0, 1])  # nothing left: both idle, no reset
    assert a.slot == [2, 1] and b.slot == [None, None] and counter.value == 5
    assert (early.resets, late.resets) == ([[0, 1], [0], [1]], [[0, 1]])


@pytest.mark.parametrize("vector", ["async", "sync"])
def test_a_worker_left_fewer_episodes_than_envs_replays_them_and_records_nothing_else(demo, tmp_path, vector):
    """Workers share one counter of the episodes (`replay.drive._Claims`): a worker whose fellows took all but one by the
    time its 2 envs were made starts that one in env 0 and leaves env 1 idle. Its envs (sub-env processes,
    `PackedVectorEnv`, which refuses a masked reset before any reset; or in its own process) are reset whole once,
    env 1 without a plan; the
    output holds the one episode, equal to its input, and nothing of the idle env (full-suite CI saw this worker fail
    with "sub-env 1 was left out of a masked reset before its first reset")."""
    import multiprocessing
    import time as time_

    from fastrecord.replay.drive import run_plan
    from fastrecord.replay.plan import make_plan
    from fastrecord.sinks.maniskill_h5 import open_trajectory

    cfg = ReplayConfig.from_values(dict(traj_path=str(demo), output_dir=str(tmp_path), obs_mode="rgb", save_video=False,
                                        progress=False, env_kwargs=SENSORS, num_envs=2, vector=vector,
                                        render_backend="cpu"))
    traj = open_trajectory(cfg.traj_path)
    try:
        plan = make_plan(cfg, traj)
        counter = multiprocessing.get_context("fork").Value("q", len(plan.episodes) - 1)  # the others took 4 of 5
        s = run_plan(plan, plan.episodes, tmp_path, NAME, 2, None, None, time_.perf_counter(), claims=counter)
    finally:
        traj.close()
    assert (s.kept, counter.value) == (1, len(plan.episodes))
    meta = json.loads((tmp_path / f"{NAME}.json").read_text())
    assert [e["source_episode_id"] for e in meta["episodes"]] == [4]
    assert_matches_input(demo, tmp_path / f"{NAME}.h5", meta)
