"""`fastrecord replay` drawing each worker's CPU-simulated envs in one batch (`fastrecord.replay.grouped`):
where the plan chooses it (here, on the CPU, with the CUDA check stood in for), and on a CUDA machine
(``gpu``) a replay drawn in one batch equals the same replay with every env drawing itself: camera
observations, every other recorded value, and the videos, by states and by actions, across resets that
reconfigure."""

from __future__ import annotations

import json
from pathlib import Path

import gymnasium as gym
import h5py
import numpy as np
import pytest
from conftest import leaves

from fastrecord.sinks.base import Sink

SMALL = dict(human_render_camera_configs=dict(width=64, height=64), sensor_configs=dict(width=48, height=48))
LENGTHS = (5, 8, 3, 6)  # episodes that end at different steps


def record_input(out: Path, env_id: str = "PickCube-v1", **kw) -> Path:
    """Random-action episodes of ``LENGTHS`` steps, state observations, recorded by fastrecord."""
    import mani_skill.envs  # noqa: F401

    from fastrecord import RecordEpisode

    env = gym.make(env_id, obs_mode="state", render_mode="rgb_array", sim_backend="physx_cpu", max_episode_steps=10,
                   **SMALL, **kw)
    env = RecordEpisode(env, str(out), trajectory_name="demo", save_video=False)
    env.action_space.seed(3)
    for seed, steps in enumerate(LENGTHS):
        env.reset(seed=seed)
        for _ in range(steps):
            env.step(env.action_space.sample())
    env.close()
    return out / "demo.h5"


@pytest.fixture(scope="module")
def pickcube_file(tmp_path_factory) -> Path:
    return record_input(tmp_path_factory.mktemp("input"))


def _plan(path: Path, tmp_path: Path, sinks=None, **kw):
    from fastrecord.replay.config import ReplayConfig
    from fastrecord.replay.plan import make_plan
    from fastrecord.sinks.maniskill_h5 import open_trajectory

    cfg = ReplayConfig.from_values(dict(traj_path=str(path), output_dir=str(tmp_path / "out"), progress=False, **kw))
    traj = open_trajectory(cfg.traj_path)
    try:
        return make_plan(cfg, traj, sinks=sinks)
    finally:
        traj.close()


def test_the_plan_draws_in_one_batch_where_it_can(pickcube_file, tmp_path, monkeypatch):
    """auto: camera observations or render videos, more than one env a worker, a CUDA render device; the envs
    then sit in the worker's own process (sync). on: required, else one error naming the fix."""
    import fastrecord.render

    monkeypatch.setattr(
        fastrecord.render,
        "available",
        lambda backend="auto": backend in ("gpu", "auto") or str(backend).startswith("cuda"),
    )
    rgb = dict(obs_mode="rgb", render_backend="gpu", num_envs=4, workers=1)
    plan = _plan(pickcube_file, tmp_path, **rgb)
    assert (plan.render_device, plan.vector) == ("cuda", "sync")
    assert _plan(pickcube_file, tmp_path, **{**rgb, "render_backend": "cuda:1"}).render_device == "cuda:1"
    assert _plan(pickcube_file, tmp_path, **rgb, batched_render="off").render_device is None
    assert _plan(pickcube_file, tmp_path, **{**rgb, "num_envs": 1}).render_device is None  # one env: nothing to batch
    # state observations and no video: nothing drawn; state observations with render videos: drawn
    assert _plan(pickcube_file, tmp_path, **{**rgb, "obs_mode": "state"}, save_video=False).render_device is None
    assert _plan(pickcube_file, tmp_path, **{**rgb, "obs_mode": "state"}).render_device == "cuda"
    # videos of the sensors' render mode come from each env's own render_sensors: not batched
    assert _plan(pickcube_file, tmp_path, **{**rgb, "obs_mode": "state"}, render_mode="sensors").render_device is None
    # async: the envs in sub-env processes, drawn in one group of mirrors in the replaying process
    assert (_plan(pickcube_file, tmp_path, **rgb, vector="async").render_device,) == ("cuda",)
    assert _plan(pickcube_file, tmp_path, **{**rgb, "obs_mode": "pointcloud"}, vector="async").render_device is None
    with pytest.raises(ValueError, match=r"--batched-render on .*--vector async .*'pointcloud'.*use --vector sync"):
        _plan(pickcube_file, tmp_path, **{**rgb, "obs_mode": "pointcloud"}, vector="async", batched_render="on")
    with pytest.raises(ValueError, match=r"--batched-render on .*--vector batched holds one env"):
        _plan(pickcube_file, tmp_path, **rgb, vector="batched", batched_render="on")
    with pytest.raises(ValueError, match="render_substeps"):
        _plan(pickcube_file, tmp_path, **rgb, batched_render="on", render_substeps=True)
    with pytest.raises(ValueError, match=r"--batched-render on renders on a CUDA device.*render_backend='cpu'"):
        _plan(pickcube_file, tmp_path, **{**rgb, "render_backend": "cpu"}, batched_render="on")
    with pytest.raises(ValueError, match="batched_render='yes' is unknown; use one of auto, on, off"):
        _plan(pickcube_file, tmp_path, **rgb, batched_render="yes")


def test_where_the_cpu_draws_each_env_is_a_process_that_runs_ahead(pickcube_file, tmp_path, monkeypatch):
    """auto, the envs drawn by the CPU (lavapipe: one process draws one picture at a time), several in one process:
    each env in a sub-env process of its own that runs ahead (`fastrecord.replay.ahead`: vector async, no batched
    render); nothing drawn, a GPU drawing, --render-substeps or one env: the envs stay in this process (sync)."""
    import fastrecord.replay.plan

    monkeypatch.setattr(fastrecord.replay.plan, "usable_cores", lambda *args: 2)  # one process, whatever this machine
    rgb = dict(obs_mode="rgb", render_backend="cpu", num_envs=2)
    plan = _plan(pickcube_file, tmp_path, **rgb)
    assert (plan.workers, plan.vector, plan.render_device) == (1, "async", None)
    assert _plan(pickcube_file, tmp_path, **{**rgb, "obs_mode": "state"}).vector == "async"  # its videos are drawn
    state = _plan(pickcube_file, tmp_path, **{**rgb, "obs_mode": "state"}, save_video=False)
    assert (state.vector, state.frames) == ("sync", False)
    # a logger's videos without --save-video (a sink wanting frames) are drawn as videos are
    logged = _plan(pickcube_file, tmp_path, sinks=[_FramesSink()], **{**rgb, "obs_mode": "state"}, save_video=False)
    assert (logged.vector, logged.frames) == ("async", True)
    assert _plan(pickcube_file, tmp_path, **rgb, render_substeps=True).vector == "sync"
    assert _plan(pickcube_file, tmp_path, **{**rgb, "num_envs": 1}).vector == "sync"
    assert _plan(pickcube_file, tmp_path, **{**rgb, "render_backend": "gpu"}, batched_render="off").vector == "sync"
    assert _plan(pickcube_file, tmp_path, **rgb, vector="sync").vector == "sync"


def _frames(path: Path) -> np.ndarray:
    import av

    with av.open(str(path)) as c:
        return np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)])


@pytest.mark.parametrize("by", ["states", "actions"])
def test_envs_run_ahead_in_their_processes_record_what_one_process_does(pickcube_file, tmp_path, by):
    """`fastrecord.replay.ahead` (each env in its own process runs its next step while this one records): 3 envs
    over 4 episodes of different lengths (slots refilled mid-run), camera observations and a video of every episode:
    every recorded value and every decoded video frame equal those of the same replay with the envs in this process
    (each frame the env's own render of its step, though the env has run its next step by the time it is recorded)."""
    import fastrecord
    from fastrecord.replay.ahead import AheadReplayVectorEnv

    steps: list[int] = []
    real_step = AheadReplayVectorEnv.step

    def spy(self, actions):
        steps.append(sum(a is not None for a in self.lookahead or ()))
        return real_step(self, actions)

    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(AheadReplayVectorEnv, "step", spy)
        for vector in ("async", "sync"):
            s = fastrecord.replay_trajectories(pickcube_file, tmp_path / vector, trajectory_name="out", num_envs=3,
                                               workers=1, vector=vector, obs_mode="rgb", by=by, render_backend="cpu",
                                               save_video=True, progress=False)
            assert s.episodes == len(LENGTHS)
            out[vector] = tmp_path / vector / "out.h5"
    assert sum(steps) == sum(LENGTHS) - 4  # every env ran ahead except at its episode's last step
    _assert_identical_replays(out["async"], out["sync"])
    videos = sorted(p.name for p in (tmp_path / "sync").glob("*.mp4"))
    assert len(videos) == len(LENGTHS) and videos == sorted(p.name for p in (tmp_path / "async").glob("*.mp4"))
    for name in videos:
        a, b = _frames(tmp_path / "async" / name), _frames(tmp_path / "sync" / name)
        assert len(a) == len(b) and len(a) in [n + 1 for n in LENGTHS]
        np.testing.assert_array_equal(a, b, err_msg=name)


class _FramesSink(Sink):
    """A sink that wants frames (as a logger's videos do): each episode's frames by its input episode."""

    wants_frames = True

    def __init__(self) -> None:
        self.frames: dict[int, np.ndarray] = {}

    def submit(self, episodes) -> None:
        for ep in episodes:
            self.frames[int(ep.meta["source_episode_id"])] = np.asarray(ep.frames)


def test_a_logger_wanting_videos_gets_the_frames_of_envs_run_ahead(pickcube_file, tmp_path):
    """A sink that wants frames (a logger's videos) without --save-video: the sub-envs run ahead report their frames
    all the same, and the sink gets the frames a replay with the envs in this process gives it."""
    from fastrecord.replay.api import run_replay
    from fastrecord.replay.config import ReplayConfig

    got = {}
    for vector in ("async", "sync"):
        sink = _FramesSink()
        cfg = ReplayConfig.from_values(dict(traj_path=str(pickcube_file), output_dir=str(tmp_path / vector),
                                            num_envs=3, workers=1, vector=vector, render_backend="cpu",
                                            save_video=False, progress=False))
        assert run_replay(cfg, sinks=[sink]).episodes == len(LENGTHS)
        got[vector] = sink.frames
    assert sorted(got["async"]) == sorted(got["sync"]) == list(range(len(LENGTHS)))
    for e, frames in got["sync"].items():
        assert frames.shape[0] == LENGTHS[e] + 1
        np.testing.assert_array_equal(got["async"][e], frames, err_msg=f"episode {e}")


def test_replay_batched_render_on_without_cuda_is_one_line(pickcube_file, tmp_path, capsys):
    import torch

    from fastrecord.commands.cli import main

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    rc = main(["replay", str(pickcube_file), "--obs-mode", "rgb", "--batched-render", "on", "--output-dir",
               str(tmp_path / "out"), "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and "--batched-render on renders on a CUDA device" in err and "--batched-render off or auto" in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()  # refused before anything was made


def test_a_replay_videos_last_frame_shows_the_episodes_last_state(pickcube_file, tmp_path):
    """Each env's last frame is drawn after its last step (a replay env that finished its episode holds its
    frame only from the next step on; it once held it on the last step, repeating the frame before)."""
    import mani_skill.envs  # noqa: F401
    import torch

    import fastrecord
    from fastrecord.replay.envs import tree_index, tree_stack
    from fastrecord.testing import frame_psnr
    from fastrecord.video import decode_mp4

    fastrecord.replay_trajectories(pickcube_file, tmp_path, trajectory_name="out", num_envs=3, workers=1, vector="sync",
                                   obs_mode="state", progress=False, video_crf=10)
    meta = json.loads((tmp_path / "out.json").read_text())
    env = gym.make("PickCube-v1", obs_mode="state", render_mode="rgb_array", sim_backend="physx_cpu", **SMALL)
    try:
        with h5py.File(tmp_path / "out.h5", "r") as f:
            for ep in meta["episodes"]:
                frames = decode_mp4(next(tmp_path.glob(f"{ep['episode_id']}_env*.mp4")))
                env.reset(seed=ep["episode_seed"])
                states = leaves(f[f"traj_{ep['episode_id']}"]["env_states"])
                tree: dict = {}
                for k, v in states.items():
                    node = tree
                    *parents, leaf = k.split("/")
                    for part in parents:
                        node = node.setdefault(part, {})
                    node[leaf] = v
                env.unwrapped.set_state_dict(tree_stack([tree_index(tree, len(frames) - 1)], torch.device("cpu")))
                own = np.asarray(torch.as_tensor(env.render()).cpu()).reshape(frames[-1:].shape)
                last, before = (float(frame_psnr(frames[[i]], own)[0]) for i in (-1, -2))
                assert last >= 30 and last > before + 3, (ep["episode_id"], last, before)
    finally:
        env.close()


# ------------------------------------------------------------------------------------------ on a GPU
def _psnr_min(a: np.ndarray, b: np.ndarray) -> float:
    from fastrecord.testing import frame_psnr

    if np.array_equal(a, b):
        return float("inf")
    return float(np.min(frame_psnr(a.reshape(-1, *a.shape[-3:]), b.reshape(-1, *b.shape[-3:]))))


def _assert_same_replays(a: Path, b: Path) -> None:
    """Two replays of one input: the same episodes, every recorded value equal (rgb pictures: PSNR >= 40; depth and
    the like in int16 millimetres: within 2 of each other at 99.5% of pixels). Every mismatch is listed."""
    meta_a, meta_b = (json.loads(p.with_suffix(".json").read_text()) for p in (a, b))
    assert [e["source_episode_id"] for e in meta_a["episodes"]] == [e["source_episode_id"] for e in meta_b["episodes"]]
    bad: list[str] = []
    with h5py.File(a, "r") as fa, h5py.File(b, "r") as fb:
        for ep in meta_a["episodes"]:
            key = f"traj_{ep['episode_id']}"
            la, lb = leaves(fa[key]), leaves(fb[key])
            assert la.keys() == lb.keys()
            pictures = [k for k in la if k.startswith("obs/sensor_data/")]
            assert any(k.endswith("/rgb") for k in pictures), sorted(la)
            for k in la:
                x, y = la[k], lb[k]
                if k in pictures and x.dtype == np.uint8:
                    psnr = [_psnr_min(x[[t]], y[[t]]) for t in range(len(x))]
                    if min(psnr) < 40:
                        bad.append(f"{key} {k}: PSNR by frame {[round(p, 1) for p in psnr]}")
                elif k in pictures:  # poses reach the GPU as float32 there: a pixel may round to the next millimetre
                    diff = np.abs(x.astype(np.int64) - y.astype(np.int64)).reshape(len(x), -1)
                    if np.mean(diff <= 2) < 0.995:
                        bad.append(
                            f"{key} {k}: pixels off by > 2 by frame {np.mean(diff > 2, axis=1).round(3).tolist()}, "
                            f"largest {diff.max(axis=1).tolist()}"
                        )
                elif not np.allclose(x, y, atol=1e-5):
                    bad.append(
                        f"{key} {k}: largest difference {float(np.max(np.abs(x.astype(float) - y.astype(float))))}"
                    )
    assert not bad, "\n".join(bad)


def _assert_same_videos(a: Path, b: Path) -> None:
    from fastrecord.video import decode_mp4

    va, vb = sorted(a.glob("*.mp4")), sorted(b.glob("*.mp4"))
    assert [p.name for p in va] == [p.name for p in vb] and va
    for pa, pb in zip(va, vb):
        fa, fb = decode_mp4(pa), decode_mp4(pb)
        assert fa.shape == fb.shape and _psnr_min(fa, fb) >= 40, pa.name


def _replay_both(src: Path, tmp_path: Path, vector: str = "sync", **kw) -> tuple[Path, Path]:
    """The replay drawn in one batch (``vector``: sync, the envs in this process; async, in sub-env processes drawn
    in this one) and the replay whose envs draw themselves (sync)."""
    import fastrecord

    out = {}
    for batched in ("on", "off"):
        s = fastrecord.replay_trajectories(src, tmp_path / batched, trajectory_name="out", num_envs=3, workers=1,
                                           vector=vector if batched == "on" else "sync", batched_render=batched,
                                           progress=False, **kw)
        assert s.episodes == len(LENGTHS)
        out[batched] = tmp_path / batched
    return out["on"], out["off"]


@pytest.mark.gpu
@pytest.mark.parametrize("vector", ["sync", "async"])
@pytest.mark.parametrize("by", ["states", "actions"])
def test_grouped_replay_equals_each_env_drawing_itself(pickcube_file, tmp_path, by, vector):
    """PickCube-v1 state -> rgb, 3 envs over 4 episodes of different lengths (slots refilled mid-run):
    the sensor pictures (its goal hidden), agent/extra/sensor_param, states, rewards and the render camera's
    videos (its goal shown) equal a replay whose envs draw themselves; the envs in this process (sync) or in
    sub-env processes drawn here (async, `fastrecord.replay.mirrored`: running ahead, videos included)."""
    assert (
        _plan(pickcube_file, tmp_path, obs_mode="rgb", num_envs=3, workers=1, vector=vector).render_device is not None
    )
    on, off = _replay_both(pickcube_file, tmp_path, vector, obs_mode="rgb", by=by)
    _assert_same_replays(on / "out.h5", off / "out.h5")
    _assert_same_videos(on, off)


@pytest.mark.gpu
@pytest.mark.parametrize("vector", ["sync", "async"])
def test_grouped_replay_follows_reconfiguring_resets(tmp_path, vector):
    """PegInsertionSide-v1 (panda) reconfigures at every reset (its peg and box sizes come from the episode
    seed): the group is rebuilt with each new scene, and the replay still equals the unbatched one (rgbd:
    depth too)."""
    try:
        src = record_input(tmp_path / "input", "PegInsertionSide-v1", robot_uids="panda", reconfiguration_freq=1)
    except (RuntimeError, OSError) as e:
        if "No such file" in str(e) or "stdin" in str(e):
            pytest.skip(f"PegInsertionSide-v1's assets are not on this machine: {e}")
        raise
    on, off = _replay_both(src, tmp_path, vector, obs_mode="rgbd", save_video=False)
    _assert_same_replays(on / "out.h5", off / "out.h5")



# ------------------------------------------------------------------------------ the pipelined step on the CPU
def _assert_identical_replays(a: Path, b: Path) -> None:
    """Two replays of one input on the CPU: the same episodes, every recorded value (camera pictures included) equal."""
    meta_a, meta_b = (json.loads(p.with_suffix(".json").read_text()) for p in (a, b))
    assert [e["source_episode_id"] for e in meta_a["episodes"]] == [e["source_episode_id"] for e in meta_b["episodes"]]
    with h5py.File(a, "r") as fa, h5py.File(b, "r") as fb:
        for ep in meta_a["episodes"]:
            key = f"traj_{ep['episode_id']}"
            la, lb = leaves(fa[key]), leaves(fb[key])
            assert la.keys() == lb.keys() and any(k.endswith("/rgb") for k in la)
            for k in la:
                np.testing.assert_array_equal(la[k], lb[k], err_msg=f"{key} {k}")


class _OwnPictures:
    """Stands in for `fastrecord.render.group.GroupRenderer` where there is no CUDA device (a test double): when the
    group would submit its pictures, each env draws its own sensors (ManiSkill's ``_get_obs_sensor_data``, lavapipe)
    at its current state; `read_sensor_data` hands them over later, as the group's pictures are read after the next
    step's physics ran (`GroupedSyncVectorEnv.step`, pipelined)."""

    def __init__(self, envs, device="cuda") -> None:
        self.envs = list(envs)
        self.taken: list[dict] = []
        self.pictures = 0

    def set_poses_from_envs(self) -> None:
        pass

    def take_pictures(self, names, *, sensor: bool) -> None:
        assert sensor
        self.taken = [type(b)._get_obs_sensor_data(b) for b in self.envs]  # the class's: the instance's is patched
        self.pictures += 1

    def read_sensor_data(self, name, modalities, apply_texture_transforms=True):
        import torch

        assert apply_texture_transforms
        return {m: torch.cat([t[name][m] for t in self.taken]) for m in modalities if m in self.taken[0][name]}


@pytest.mark.parametrize("by", ["states", "actions"])
def test_pipelined_grouped_replay_equals_each_env_drawing_itself_on_the_cpu(pickcube_file, tmp_path, monkeypatch, by):
    """The pipelined step's wiring without a GPU (pictures from `_OwnPictures`): the next step's physics runs
    before the step's pictures are read, yet every recorded value (the sensor pictures, states, rewards,
    agent/extra observations) equals a replay whose envs draw themselves; 3 envs over 4 episodes of different
    lengths (slots refilled mid-run), trajectory only."""
    import fastrecord
    import fastrecord.replay.grouped
    import fastrecord.replay.plan

    monkeypatch.setattr(fastrecord.replay.plan, "_render_device",
                        lambda cfg, *args: None if cfg.batched_render == "off" else "cuda")
    monkeypatch.setattr(fastrecord.replay.grouped, "GroupRenderer", _OwnPictures)
    ahead: list[int] = []
    real_step = fastrecord.replay.grouped.GroupedSyncVectorEnv.step

    def spy(self, actions):
        out = real_step(self, actions)
        ahead.append(sum(a is not None for a in self._ahead))
        return out

    monkeypatch.setattr(fastrecord.replay.grouped.GroupedSyncVectorEnv, "step", spy)
    out = {}
    for batched in ("on", "off"):
        s = fastrecord.replay_trajectories(pickcube_file, tmp_path / batched, trajectory_name="out", num_envs=3,
                                           workers=1, obs_mode="rgb", by=by, render_backend="cpu", save_video=False,
                                           batched_render=batched, progress=False)
        assert s.episodes == len(LENGTHS)
        out[batched] = tmp_path / batched / "out.h5"
    # 9 steps (slot 2 plays 3 then 6); every env ran ahead except at its episode's last step
    assert len(ahead) == max(LENGTHS[0], LENGTHS[2] + LENGTHS[3], LENGTHS[1]) and sum(ahead) == sum(LENGTHS) - 4
    _assert_identical_replays(out["on"], out["off"])


# ------------------------------------------------------------------- sub-envs in processes, drawn in this one
class _MirrorPictures:
    """Stands in for `fastrecord.render.group.GroupRenderer` of `fastrecord.replay.mirrored` where there is no CUDA
    device (a test double): each mirror is set to the state its sub-env reported with the poses (``states``, handed
    over by the test before each drawing) and draws its own sensors (ManiSkill's ``_get_obs_sensor_data``,
    lavapipe); everything else the group does is left out."""

    def __init__(self, envs, device="cuda") -> None:
        from fastrecord.render.bodies import RenderBodies

        self.envs = [e.unwrapped for e in envs]
        self.bodies = [RenderBodies(e) for e in self.envs]
        self.states: list = []
        self.taken: list[dict] = []
        self.pictures = 0

    def warm(self, names) -> None:
        pass

    def invalidate(self) -> None:
        pass

    def set_poses(self, poses) -> None:
        import torch

        assert len(poses) == len(self.envs) == len(self.states)
        for base, state in zip(self.envs, self.states):
            base.set_state(torch.as_tensor(state))

    def take_pictures(self, names, *, sensor: bool) -> None:
        assert sensor
        self.taken = [type(b)._get_obs_sensor_data(b) for b in self.envs]  # the class's: the instance's is patched
        self.pictures += 1

    def read_sensor_data(self, name, modalities, apply_texture_transforms=True):
        import torch

        return {m: torch.cat([t[name][m] for t in self.taken]) for m in modalities if m in self.taken[0][name]}


def mirrored_on_the_cpu(monkeypatch) -> None:
    """`fastrecord.replay.mirrored` without a GPU: the plan draws in one batch wherever it is not told off, the
    group's pictures come from `_MirrorPictures` (each mirror set to the state its sub-env reported), and the mirrors
    draw with lavapipe, as the envs."""
    import fastrecord.render.vector
    import fastrecord.replay.mirrored
    import fastrecord.replay.plan
    from fastrecord.render.vector import mirror_kwargs

    monkeypatch.setattr(fastrecord.replay.plan, "_render_device",
                        lambda cfg, *args: None if cfg.batched_render == "off" else "cuda")
    monkeypatch.setattr(fastrecord.render.vector, "GroupRenderer", _MirrorPictures)
    monkeypatch.setattr(fastrecord.replay.mirrored, "mirror_kwargs",
                        lambda kwargs, backend=None: {**mirror_kwargs(kwargs), "render_backend": "cpu"})
    cls = fastrecord.replay.mirrored.MirroredReplayVectorEnv
    real_with_sensors = cls._with_sensors

    def with_sensors(self, obs):
        self.renderer.states = list(self._states)
        return real_with_sensors(self, obs)

    monkeypatch.setattr(cls, "_with_sensors", with_sensors)


@pytest.mark.parametrize("by", ["states", "actions"])
def test_mirrored_replay_equals_each_env_drawing_itself_on_the_cpu(pickcube_file, tmp_path, monkeypatch, by):
    """`--vector async` drawn in one batch (`fastrecord.replay.mirrored`) without a GPU: the sub-envs play in their
    processes and run each next step ahead while this process draws (pictures from `_MirrorPictures`, at the state
    each sub-env reported) and records (each step's state from the reports), yet every recorded value (sensor pictures, states, rewards, agent/extra
    observations) equals a replay whose envs draw themselves; 3 envs over 4 episodes of different lengths."""
    import fastrecord
    from fastrecord.packed import PackedVectorEnv

    mirrored_on_the_cpu(monkeypatch)
    ahead: list[int] = []
    real_step_ahead = PackedVectorEnv.step_ahead

    def spy(self, actions, nxt):
        ahead.append(sum(a is not None for a in nxt))
        return real_step_ahead(self, actions, nxt)

    monkeypatch.setattr(PackedVectorEnv, "step_ahead", spy)
    asked: list[str] = []
    real_call = PackedVectorEnv.call

    def call_spy(self, name, *args, **kwargs):
        asked.append(name)
        return real_call(self, name, *args, **kwargs)

    monkeypatch.setattr(PackedVectorEnv, "call", call_spy)
    out = {}
    for batched in ("on", "off"):  # off: each sub-env draws itself, run ahead too (`fastrecord.replay.ahead`)
        ahead.clear()
        asked.clear()
        s = fastrecord.replay_trajectories(pickcube_file, tmp_path / batched, trajectory_name="out", num_envs=3,
                                           workers=1, vector="async", obs_mode="rgb", by=by, render_backend="cpu",
                                           save_video=False, batched_render=batched, progress=False)
        assert s.episodes == len(LENGTHS)
        out[batched] = tmp_path / batched / "out.h5"
        # 9 steps (slot 2 plays 3 then 6), the last with no env going on (a plain step); every env ran ahead except
        # at its episode's last step
        assert len(ahead) == max(LENGTHS[0], LENGTHS[2] + LENGTHS[3], LENGTHS[1]) - 1, batched
        assert sum(ahead) == sum(LENGTHS) - 4, batched
        # the recorder's per-step states came from the sub-envs' reports: no process running ahead was asked
        assert "get_state" not in asked and "get_state_dict" in asked, batched
    _assert_identical_replays(out["on"], out["off"])
