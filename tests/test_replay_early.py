"""A replay drawn in one process (``--workers 1 --vector async``): its sub-env processes started before the CLI's
imports (`fastrecord.replay.early`), taken over by the replay where they are its envs and ended where they are not.
On the CPU machine the CUDA checks are stood in for (the drawing by `_MirrorPictures`, as in
tests/test_replay_batched_render.py); the GPU test runs the whole command."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from test_replay_batched_render import LENGTHS, _assert_identical_replays, _plan, mirrored_on_the_cpu, record_input


@pytest.fixture(scope="module")
def pickcube_file(tmp_path_factory) -> Path:
    return record_input(tmp_path_factory.mktemp("input"))


@pytest.fixture
def gpu_machine(monkeypatch):
    """This machine as a 16-core one with an NVIDIA driver and a CUDA render device, its forkserver started before
    the CLI's imports."""
    import fastrecord
    import fastrecord.options
    import fastrecord.render
    import fastrecord.replay.plan
    from fastrecord import system

    monkeypatch.setattr(fastrecord.options, "usable_cores", lambda *args: 16)
    monkeypatch.setattr(fastrecord.replay.plan, "usable_cores", lambda *args: 16)
    monkeypatch.setattr(fastrecord.render, "available",
                        lambda backend="auto": backend in ("gpu", "auto") or str(backend).startswith("cuda"))
    monkeypatch.setattr(system, "has_nvidia_gpu", lambda: True)
    monkeypatch.setattr(fastrecord.replay.plan, "_cuda", lambda: True)
    monkeypatch.setattr(fastrecord, "PRESTART_CORES", 1)


def test_the_early_guess_is_the_plans_envs(pickcube_file, tmp_path, gpu_machine):
    """Where the guess (options and the input's JSON, no torch) starts sub-envs, they are the ones the plan makes:
    the same factory (env id, keywords, time limit) and as many; it starts none where the plan may not draw in one
    process (the worker processes of the default layout among them)."""
    from fastrecord.replay.config import ReplayConfig
    from fastrecord.replay.early import MirroredSubenv, _guess

    def both(**kw):
        kw = {"workers": 1, "vector": "async", **kw}
        cfg = ReplayConfig.from_values(dict(traj_path=str(pickcube_file), output_dir=str(tmp_path / "out"),
                                            progress=False, **kw))
        return _guess(cfg), (lambda: _plan(pickcube_file, tmp_path, **kw))

    started = 0
    for kw in (dict(obs_mode="rgb"), dict(), dict(obs_mode="rgbd", num_envs=3, count=3),
               dict(obs_mode="rgb", width=40, height=24, shader="minimal"),
               dict(obs_mode="rgb", env_kwargs={"reward_mode": "sparse"}),
               dict(obs_mode="rgb", by="actions"), dict(obs_mode="rgb", save_video=False)):
        guess, plan_of = both(**kw)
        assert guess is not None, kw
        plan = plan_of()
        assert (plan.workers, plan.vector, plan.render_device) == (1, "async", "cuda"), kw
        subenv, n = guess
        assert subenv == MirroredSubenv(plan.env_id, plan.kwargs, plan.max_steps) and n == plan.num_envs, kw
        started += 1
    assert started == 7
    for kw in (dict(save_video=False), dict(obs_mode="pointcloud"), dict(workers=None, vector="auto"),
               dict(workers=2), dict(vector="sync"), dict(resume=True), dict(batched_render="off"), dict(num_envs=1),
               dict(count=1), dict(render_backend="cpu"), dict(sim_backend="physx_cuda"),
               dict(render_substeps=True)):
        assert both(**kw)[0] is None, kw


@pytest.fixture
def launch_spy(monkeypatch):
    """Every `fastrecord.packed.PackedLaunch` made meanwhile, and those a vector env took over: (made, taken)."""
    from fastrecord.packed import PackedLaunch

    made: list[PackedLaunch] = []
    taken: list[PackedLaunch] = []
    real_init, real_take = PackedLaunch.__init__, PackedLaunch.take

    def init(self, *args, **kwargs):
        made.append(self)
        real_init(self, *args, **kwargs)

    def take(self):
        taken.append(self)
        return real_take(self)

    monkeypatch.setattr(PackedLaunch, "__init__", init)
    monkeypatch.setattr(PackedLaunch, "take", take)
    return made, taken


def test_a_replay_takes_over_the_subenvs_started_for_it_and_ends_others(pickcube_file, tmp_path, monkeypatch,
                                                                          launch_spy):
    """The processes `early_subenvs` started for a replay are the ones it steps (taken over, none started again),
    and the replay equals one whose envs draw themselves; processes started for other options (another camera size)
    are ended by the replay that could not use them, which starts its own."""
    import fastrecord
    from fastrecord.replay import run_replay
    from fastrecord.replay.config import ReplayConfig
    from fastrecord.replay.early import early_subenvs

    mirrored_on_the_cpu(monkeypatch)
    monkeypatch.setattr(fastrecord, "PRESTART_CORES", 1)
    launches, taken = launch_spy

    def cfg(out: str, **kw) -> ReplayConfig:
        return ReplayConfig.from_values({**dict(traj_path=str(pickcube_file), output_dir=str(tmp_path / out),
                                                trajectory_name="out", num_envs=3, workers=1, vector="async",
                                                obs_mode="rgb", render_backend="cpu", batched_render="on",
                                                save_video=False, progress=False), **kw})

    on = cfg("on")
    early = early_subenvs(on)
    assert early is not None and launches == [early]
    s = run_replay(on, early=early)
    assert s.episodes == len(LENGTHS)
    assert taken == [early] and len(launches) == 1  # its own processes: none started after the plan
    off = cfg("off", batched_render="off", vector="sync")
    assert run_replay(off).episodes == len(LENGTHS)
    _assert_identical_replays(tmp_path / "on" / "out.h5", tmp_path / "off" / "out.h5")

    other = early_subenvs(dataclasses.replace(on, width=40))  # made for another camera: not this replay's envs
    assert other is not None and other is launches[-1]
    s = run_replay(cfg("again"), early=other)
    assert s.episodes == len(LENGTHS)
    assert other not in taken and len(launches) == 3 and launches[-1] in taken
    assert other.processes and not any(p.is_alive() for p in other.processes)
    _assert_identical_replays(tmp_path / "again" / "out.h5", tmp_path / "off" / "out.h5")


def test_the_cli_replays_with_the_subenvs_it_started_before_its_imports(pickcube_file, tmp_path, monkeypatch,
                                                                         launch_spy):
    """`fastrecord replay` (the CLI, in this process) hands the sub-env processes it started from its options to the
    replay, which steps them: one launch, taken over, and the replay's episodes all written."""
    import fastrecord
    from fastrecord.commands.cli import main

    mirrored_on_the_cpu(monkeypatch)
    monkeypatch.setattr(fastrecord, "PRESTART_CORES", 1)
    launches, taken = launch_spy
    rc = main(["replay", str(pickcube_file), "--obs-mode", "rgb", "--no-video", "--num-envs", "3", "--workers", "1",
               "--vector", "async", "--render-backend", "cpu", "--batched-render", "on", "--trajectory-name", "out",
               "--output-dir", str(tmp_path / "out"), "--quiet"])
    assert rc == 0
    assert len(launches) == 1 and taken == launches  # started by the CLI before its checks, stepped by the replay
    meta = json.loads((tmp_path / "out" / "out.json").read_text())
    assert sorted(e["source_episode_id"] for e in meta["episodes"]) == list(range(len(LENGTHS)))


LAUNCH_PROBE = """
import sys
import fastrecord, fastrecord.options, fastrecord.packed
from fastrecord import system
fastrecord.PRESTART_CORES = 1
system.has_nvidia_gpu = lambda: True
fastrecord.options.usable_cores = lambda *args: 16

def launched(self, *args, **kwargs):
    print("launched; imported:", sorted(m for m in ("torch", "mani_skill", "sapien") if m in sys.modules), flush=True)
    raise SystemExit(0)

fastrecord.packed.PackedLaunch.__init__ = launched
from fastrecord.commands.cli import main
sys.exit(main(sys.argv[1:]) or 3)
"""


@pytest.mark.parametrize("command", ["record", "replay"])
def test_the_cli_starts_its_subenvs_before_importing_torch(tmp_path, command):
    """`fastrecord record` and `replay` start their sub-env processes before anything imports torch, ManiSkill or
    SAPIEN, even where the options' checks import ManiSkill (``--obs-mode``) or the process asks for its rank."""
    if command == "record":
        args = ["record", "PickCube-v1", "--num-envs", "4", "--obs-mode", "rgb"]
    else:
        h5 = tmp_path / "demo.h5"
        h5.touch()
        episodes = [dict(episode_id=i, seed=i, elapsed_steps=n, control_mode="pd_joint_delta_pos")
                    for i, n in enumerate(LENGTHS)]
        h5.with_suffix(".json").write_text(json.dumps(dict(
            env_info=dict(env_id="PickCube-v1", max_episode_steps=10, env_kwargs=dict(obs_mode="state")),
            episodes=episodes)))
        args = ["replay", str(h5), "--obs-mode", "rgb", "--workers", "1", "--vector", "async"]
    root = Path(__file__).parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(LAUNCH_PROBE), *args, "--output-dir",
                           str(tmp_path / "out")], capture_output=True, text=True, timeout=120, cwd=root, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "launched; imported: []" in done.stdout, (done.stdout, done.stderr[-3000:])


@pytest.mark.parametrize(("num_envs", "sizes"), [(1, [1]), (2, [2]), (4, [4]), (5, [3, 2]), (7, [4, 3]), (9, [3, 3, 3]),
                                                (16, [4, 4, 4, 4]), (17, [4, 4, 4, 4, 1])])
def test_a_replay_drawn_in_one_process_packs_its_subenvs_four_at_most(num_envs, sizes):
    from fastrecord.packed import process_sizes
    from fastrecord.replay.layout import subenvs_per_process

    assert process_sizes(num_envs, subenvs_per_process(num_envs)) == sizes


@pytest.mark.parametrize(("asynchronous", "render_device"), [(False, None), (False, "cuda"), (True, None)])
def test_a_launch_the_replay_does_not_draw_is_ended_before_its_envs_are_made(asynchronous, render_device):
    """An early launch reaching a replay whose envs are not drawn in this process (each env draws itself, or its envs
    are held here) is ended at once, before those envs are made: its processes do not sit idle through the replay.
    (gymnasium's AsyncVectorEnv, ``run_ahead=False``, makes a first env here: the order is seen in this process.)"""
    from fastrecord.replay.envs import VectorBatch

    events: list[str] = []

    class Launch:
        def close(self, wait: bool = True) -> None:
            events.append("launch ended")

    def make():
        events.append("env made")
        raise RuntimeError("enough")

    with pytest.raises(RuntimeError, match="enough"):
        VectorBatch(make, 2, asynchronous, lambda freq: {}, render_device, launch=Launch(), run_ahead=False)
    assert events[:2] == ["launch ended", "env made"]


REFUSAL_PROBE = """
import sys
import fastrecord, fastrecord.options, fastrecord.packed
from fastrecord import system
fastrecord.PRESTART_CORES = 1
system.has_nvidia_gpu = lambda: True
fastrecord.options.usable_cores = lambda *args: 16

class Launch:
    def __init__(self, *args, **kwargs):
        print("launched", flush=True)

    def made_for(self, *args):
        return False

    def close(self, wait=True):
        print(f"closed, wait={wait}", flush=True)

fastrecord.packed.PackedLaunch = Launch
from fastrecord.commands.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_refused_replay_ends_its_early_launch_without_waiting_for_its_starts(tmp_path):
    """A replay whose sub-envs the CLI started early, then refused (its input is no HDF5 file), ends the launch with
    ``close(wait=False)``: the one-line error does not wait for the forkserver's preload (seconds on a GPU machine)."""
    h5 = tmp_path / "demo.h5"
    h5.write_text("not an HDF5 file")
    episodes = [dict(episode_id=i, episode_seed=i, elapsed_steps=n, control_mode="pd_joint_delta_pos")
                for i, n in enumerate(LENGTHS)]
    h5.with_suffix(".json").write_text(json.dumps(dict(
        env_info=dict(env_id="PickCube-v1", max_episode_steps=10, env_kwargs=dict(obs_mode="state")), episodes=episodes)))
    root = Path(__file__).parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(REFUSAL_PROBE), "replay", str(h5), "--obs-mode", "rgb",
                           "--workers", "1", "--vector", "async", "--output-dir", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120, cwd=root, env=env)
    assert done.returncode == 2 and "is not a readable HDF5 file" in done.stderr, (done.stdout, done.stderr[-3000:])
    assert done.stdout.splitlines()[0] == "launched" and "closed, wait=False" in done.stdout.splitlines()
    assert "closed, wait=True" not in done.stdout


@pytest.mark.gpu
def test_the_cli_replay_drawn_in_one_process_equals_each_env_drawing_itself(pickcube_file, tmp_path, launch_spy):
    """On a GPU machine of `fastrecord.PRESTART_CORES` or more cores, `fastrecord replay --workers 1 --vector async`
    draws its envs in one process from sub-env processes started before its imports, and writes what a replay whose
    envs draw themselves writes (state -> rgb, render videos)."""
    from test_replay_batched_render import _assert_same_replays, _assert_same_videos

    from fastrecord import PRESTART_CORES
    from fastrecord.commands.cli import main
    from fastrecord.workers import affinity_cores

    if affinity_cores() < PRESTART_CORES:
        pytest.skip(f"{affinity_cores()} cores: the sub-envs start after the imports below {PRESTART_CORES}")
    launches, taken = launch_spy
    common = [str(pickcube_file), "--obs-mode", "rgb", "--num-envs", "3", "--trajectory-name", "out", "--quiet",
              "--workers", "1"]
    assert main(["replay", *common, "--output-dir", str(tmp_path / "one"), "--vector", "async"]) == 0
    assert len(launches) == 1 and taken == launches  # one launch, the early one, taken over
    assert main(["replay", *common, "--output-dir", str(tmp_path / "off"), "--batched-render", "off",
                 "--vector", "sync"]) == 0
    _assert_same_replays(tmp_path / "one" / "out.h5", tmp_path / "off" / "out.h5")
    _assert_same_videos(tmp_path / "one", tmp_path / "off")
