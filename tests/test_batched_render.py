"""One batched render of CPU-simulated envs (`fastrecord.render`): the entity lists and poses that drive it
(here, on the CPU), and on a CUDA machine (``gpu``) every batched picture compared with the env's own
rendering of the same state, for the human camera and the sensor cameras, across resets that reconfigure."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest

from fastrecord.render.bodies import RenderBodies
from fastrecord.render.vector import INFO_KEY, PoseReporter

SMALL = dict(human_render_camera_configs=dict(width=64, height=64), sensor_configs=dict(width=48, height=48))


def _make(env_id: str, obs_mode: str = "state", **kw):
    import mani_skill.envs  # noqa: F401

    kw = {
        **dict(obs_mode=obs_mode, render_mode="rgb_array", sim_backend="physx_cpu", reconfiguration_freq=1),
        **SMALL,
        **kw,
    }
    return gym.make(env_id, **kw)


def test_bodies_follow_the_scene_and_read_entity_poses():
    env = _make("PickCube-v1")
    try:
        env.reset(seed=3)
        bodies = RenderBodies(env.unwrapped)
        names = [e.name for e in bodies.entities]
        assert "scene-0_cube" in names and "scene-0_goal_site" in names and "panda_hand" in names
        assert not any("ground" in n for n in names)  # static: rendered where it stands, no row
        for _ in range(3):
            env.step(env.action_space.sample())
        poses = bodies.poses()
        assert poses.shape == (len(names), 7) and poses.dtype == np.float32
        for row, entity in zip(poses, bodies.entities):
            np.testing.assert_allclose(row, np.concatenate([entity.pose.p, entity.pose.q]), atol=1e-6)
        sig = bodies.signature()
        env.reset(seed=4)  # reconfigures (reconfiguration_freq=1): a new SAPIEN scene, the same look
        assert bodies.scene_changed and bodies.refresh() and not bodies.scene_changed
        assert bodies.signature() == sig and bodies.entities[0] is not None
    finally:
        env.close()


def test_a_scene_is_a_function_of_its_episode_seed():
    """What mirroring rests on: PegInsertionSide draws its peg and box sizes at reconfiguration; two envs
    reconfigured with one episode seed look the same (whatever their obs mode), other seeds differ."""
    a, b = (
        _make("PegInsertionSide-v1", obs_mode="rgb", robot_uids="panda"),
        _make("PegInsertionSide-v1", robot_uids="panda"),
    )
    try:
        a.reset(seed=0)
        sig0 = RenderBodies(a.unwrapped).signature()
        a.reset(seed=1)
        sig1 = RenderBodies(a.unwrapped).signature()
        assert sig0 != sig1
        b.reset(seed=1, options={"reconfigure": True})
        assert RenderBodies(b.unwrapped).signature() == sig1
    finally:
        a.close()
        b.close()


def test_pose_reporter_reports_poses_every_step_and_scenes_when_new():
    env = PoseReporter(_make("PickCube-v1"))
    try:
        _, info = env.reset(seed=5)
        poses, scene = info[INFO_KEY]
        assert poses.shape[1] == 7 and scene is not None and scene[1] == 5
        _, _, _, _, info = env.step(env.action_space.sample())
        poses2, scene2 = info[INFO_KEY]
        assert scene2 is None and poses2.shape == poses.shape and not np.array_equal(poses2, poses)
        _, info = env.reset(seed=6)
        assert info[INFO_KEY][1] is not None and info[INFO_KEY][1][1] == 6
    finally:
        env.close()


def test_make_eval_envs_renders_per_process_without_cuda(tmp_path):
    import torch

    from fastrecord import make_eval_envs
    from fastrecord.render.vector import GroupRenderedVectorEnv

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the batched path is the default (tested by the gpu cases)")
    kw = dict(
        obs_mode="state",
        render_mode="rgb_array",
        max_episode_steps=4,
        **{k: v for k, v in SMALL.items() if "human" in k},
    )
    with pytest.raises(ValueError, match=r"batched_render=True.*CUDA"):
        make_eval_envs(
            "PickCube-v1", 2, "physx_cpu", kw, dict(obs_horizon=1), video_dir=str(tmp_path), batched_render=True
        )
    with pytest.raises(ValueError, match="batched_render='yes' must be None"):
        make_eval_envs(
            "PickCube-v1", 2, "physx_cpu", kw, dict(obs_horizon=1), video_dir=str(tmp_path), batched_render="yes"
        )
    with pytest.raises(ValueError, match=r"batched_render=True renders once a step.*render_substeps"):
        make_eval_envs("PickCube-v1", 2, "physx_cpu", kw, dict(obs_horizon=1), video_dir=str(tmp_path),
                       batched_render=True, record_kwargs=dict(render_substeps=True))
    envs = make_eval_envs("PickCube-v1", 2, "physx_cpu", kw, dict(obs_horizon=1), video_dir=str(tmp_path))
    try:
        cur, kinds = envs, []
        while cur is not None:
            kinds.append(type(cur))
            cur = getattr(cur, "env", None)
        assert GroupRenderedVectorEnv not in kinds
    finally:
        envs.close()


def test_record_batched_render_on_without_cuda_is_one_line(tmp_path, capsys):
    import torch

    from fastrecord.commands.cli import main

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    out = tmp_path / "run"
    rc = main(["record", "PickCube-v1", "--num-envs", "2", "--episodes", "2", "--batched-render", "on",
               "--output-dir", str(out), "--width", "64", "--height", "64"])
    err = capsys.readouterr().err
    assert rc == 2 and "--batched-render on renders on a CUDA device" in err and "--batched-render auto or off" in err
    assert not out.exists()  # refused before anything was made


# ------------------------------------------------------------------------------------------ on a GPU
def _psnr_min(a, b) -> float:
    from fastrecord.testing import frame_psnr

    a, b = np.asarray(a), np.asarray(b)
    if np.array_equal(a, b):
        return float("inf")
    return float(np.min(frame_psnr(a, b)))


def _make_or_skip(env_id: str, **kw):
    try:
        return _make(env_id, **kw)
    except (RuntimeError, OSError) as e:  # the GPU machine's kit lacks some of ManiSkill's assets (the wrist
        # camera's mesh; ManiSkill then asks on stdin whether to download them)
        if "No such file" in str(e) or "stdin" in str(e):
            pytest.skip(f"{env_id}'s assets are not on this machine: {e}")
        raise


@pytest.mark.gpu
@pytest.mark.parametrize(
    "env_id,kw",
    [("PickCube-v1", {}), ("PegInsertionSide-v1", dict(robot_uids="panda")), ("PegInsertionSide-v1", {})],
    ids=["PickCube", "PegInsertion-panda", "PegInsertion-wristcam"],
)
def test_group_pictures_equal_each_envs_own_render(env_id, kw):
    """Drivers step on the CPU; mirrors (reset to the drivers' seeds) render their poses in one group:
    human camera (PickCube: its hidden goal shown) and every sensor (hidden objects hidden; the wrist
    camera rides a link) equal the drivers' own pictures, before and after resets that reconfigure
    (PegInsertionSide draws its peg and box sizes from the episode seed)."""
    import torch

    from fastrecord.render.group import GroupRenderer

    n = 3
    drivers = [_make_or_skip(env_id, obs_mode="rgb", render_backend="gpu", **kw) for _ in range(n)]
    mirrors = [_make_or_skip(env_id, obs_mode="rgb", render_backend="gpu", **kw) for _ in range(n)]
    try:
        group = GroupRenderer(mirrors)
        for round_, seeds in enumerate(([0, 1, 2], [7, 8, 9])):
            for d, m, s in zip(drivers, mirrors, seeds):
                d.reset(seed=s)
                m.reset(seed=s, options={"reconfigure": True})
            for step in range(4):
                if step:
                    for d in drivers:
                        d.step(d.action_space.sample())
                group.set_poses([RenderBodies(d.unwrapped).poses() for d in drivers])
                batched = group.render("render_camera").cpu().numpy()
                own = np.concatenate([torch.as_tensor(d.render()).cpu().numpy() for d in drivers])
                assert batched.shape == own.shape and batched.dtype == np.uint8
                assert _psnr_min(batched, own) >= 40, (round_, step)
                for cam in drivers[0].unwrapped.scene.sensors:
                    pics = group.render(cam).cpu().numpy()
                    own = np.concatenate(
                        [
                            torch.as_tensor(d.unwrapped.get_obs()["sensor_data"][cam]["rgb"]).cpu().numpy()
                            for d in drivers
                        ]
                    )
                    assert _psnr_min(pics, own) >= 40, (round_, step, cam)
        assert group.rebuilds == 2  # the first build, and once after the reconfiguring resets
    finally:
        for e in drivers + mirrors:
            e.close()


@pytest.mark.gpu
def test_vector_env_render_equals_sub_env_renders_across_reconfiguration():
    """The sub-envs step in their own processes and report poses; the mirrors follow their reconfigurations
    (PegInsertionSide: new peg and box sizes each seed) and one batched render equals every sub-env's render."""
    import torch

    from fastrecord.make_env import cpu_vector_env
    from fastrecord.render.vector import GroupRenderedVectorEnv, make_mirror_factory

    kw = dict(obs_mode="state", render_mode="rgb_array", render_backend="gpu", robot_uids="panda",
              **{k: v for k, v in SMALL.items() if "human" in k})
    task = "PegInsertionSide-v1"
    envs = GroupRenderedVectorEnv(cpu_vector_env(task, 3, kw, [], report_poses=True), make_mirror_factory(task, kw))
    try:
        for seeds in ([0, 1, 2], [3, 4, 5]):
            envs.reset(seed=seeds)
            for step in range(3):
                if step:
                    envs.step(envs.action_space.sample())
                own = np.concatenate(
                    [np.asarray(torch.as_tensor(f).cpu()).reshape(-1, 64, 64, 3) for f in envs.call("render")]
                )
                assert _psnr_min(envs.render().cpu().numpy(), own) >= 40
        assert envs.mirror_rebuilds >= 3  # the second seeds' objects differ from the first's
        mask = np.array([True, False, True])
        envs.reset(options={"reset_mask": mask})  # unseeded, partial: the sub-envs draw their own episode seeds
        own = np.concatenate([np.asarray(torch.as_tensor(f).cpu()).reshape(-1, 64, 64, 3) for f in envs.call("render")])
        assert _psnr_min(envs.render().cpu().numpy(), own) >= 40
    finally:
        envs.close()


@pytest.mark.gpu
def test_make_eval_envs_cpu_branch_records_batched_videos(tmp_path):
    """The baseline's CPU path on a CUDA machine: batched rendering by default, every env's video written,
    frames decoding to the sub-envs' own pictures of the first reset."""
    import av

    from fastrecord import make_eval_envs
    from fastrecord.render.vector import GroupRenderedVectorEnv

    kw = dict(obs_mode="state", render_mode="rgb_array", render_backend="gpu", max_episode_steps=6,
              human_render_camera_configs=dict(width=64, height=64))
    envs = make_eval_envs("PickCube-v1", 3, "physx_cpu", kw, dict(obs_horizon=1), video_dir=str(tmp_path),
                          record_kwargs=dict(info_on_video=False))
    cur, kinds = envs, []
    while cur is not None:
        kinds.append(type(cur))
        cur = getattr(cur, "env", None)
    assert GroupRenderedVectorEnv in kinds
    envs.reset(seed=0)
    for _ in range(6):
        _, _, _, trunc, info = envs.step(envs.action_space.sample())
    assert np.asarray(trunc).all() and "final_info" in info
    envs.close()
    videos = sorted(tmp_path.rglob("*.mp4"))
    assert len(videos) == 3
    for v in videos:
        with av.open(str(v)) as f:
            frames = [fr.to_ndarray(format="rgb24") for fr in f.decode(video=0)]
        assert len(frames) == 7 and frames[0].shape == (64, 64, 3)  # the reset frame and 6 steps


def test_a_batched_render_that_cannot_go_on_is_a_runtime_failure_of_the_cli():
    """A mirror that cannot rebuild its sub-env's scene, or a camera group the device cannot hold, is one
    line and exit 1 in the CLI (`fastrecord.commands.cli.is_runtime_failure`), not a traceback."""
    from fastrecord.commands.cli import failure_line, is_runtime_failure
    from fastrecord.render import BatchedRenderError

    e = BatchedRenderError("sub-env 3's scene (episode seed 7) could not be rebuilt; use --batched-render off")
    assert is_runtime_failure(e) and not is_runtime_failure(RuntimeError("a bug"))
    import argparse

    line = failure_line(e, argparse.Namespace(command="merge"))
    assert line.startswith("sub-env 3's scene") and "\n" not in line


def test_mirrors_are_built_without_walking_the_callers_objects():
    """`scenes_built`: ManiSkill's collection at each scene build walks only what the build made (the older
    objects frozen for the while), the freeze is undone on leaving, and ``collect=True`` frees the scenes a
    reconfiguring reset replaced."""
    import gc
    import weakref

    from fastrecord.render.vector import scenes_built
    from fastrecord.workers import imports_frozen

    if gc.get_freeze_count() or imports_frozen():
        pytest.skip("this process froze its objects (scenes_built then leaves the freeze alone)")
    env = _make("PickCube-v1")
    try:
        env.reset(seed=0)
        old = weakref.ref(env.unwrapped.scene)
        walked = []
        gc.callbacks.append(lambda phase, info: walked.append(gc.get_freeze_count()) if phase == "start" else None)
        try:
            with scenes_built(collect=True):
                env.reset(seed=1, options={"reconfigure": True})
        finally:
            gc.callbacks.pop()
        assert walked and walked[0] > 0  # ManiSkill's collection ran with the older objects frozen
        assert gc.get_freeze_count() == 0 and old() is None
    finally:
        env.close()


_FEW_FROZEN = """
import gc
gc.freeze()  # another library's, early: a few objects of the interpreter's start, the imports below out of it
few = gc.get_freeze_count()
from fastrecord.render.vector import scenes_built
from fastrecord.workers import freeze_imports
made_after = [[i] for i in range(10_000)]  # a full collection would walk these
with scenes_built():
    assert gc.get_freeze_count() > few + len(made_after), (few, gc.get_freeze_count())
assert gc.get_freeze_count() == 0  # leaving put everything back in the collector's reach
freeze_imports()  # fastrecord's own process: its freeze is for good, and scenes_built leaves it alone
frozen = gc.get_freeze_count()
with scenes_built():
    assert gc.get_freeze_count() == frozen
assert gc.get_freeze_count() == frozen
print("ok", few)
"""


def test_scenes_built_freezes_where_another_library_froze_a_few_objects():
    """A user's process where some library froze a few objects (``gc.get_freeze_count() > 0``, as in the baseline
    eval on the GPU machine: 375) has not frozen its imports: `scenes_built` still freezes what exists, and leaving
    puts everything back in the collector's reach. Only fastrecord's own processes (`freeze_imports`) are left
    alone. In a fresh interpreter: this one's freeze depends on the tests before."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", _FEW_FROZEN], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stderr[-2000:]


def test_uses_of_scenes_built_share_one_freeze():
    """The mirrors' thread and the caller's vector env (gymnasium's dummy env) build scenes at the same time: the
    first use to leave keeps the freeze for the other, the last undoes it."""
    import gc
    import threading

    from fastrecord.render.vector import scenes_built
    from fastrecord.workers import imports_frozen

    if gc.get_freeze_count() or imports_frozen():
        pytest.skip("this process froze its objects (scenes_built then leaves the freeze alone)")
    inside, leave = threading.Event(), threading.Event()

    def other() -> None:
        with scenes_built():
            inside.set()
            leave.wait(30)

    thread = threading.Thread(target=other)
    thread.start()
    assert inside.wait(30)
    with scenes_built():
        with scenes_built():  # nested
            pass
        assert gc.get_freeze_count() > 0
    after_ours = gc.get_freeze_count()
    leave.set()
    thread.join()
    assert after_ours > 0 and gc.get_freeze_count() == 0


def test_envs_closed_together_walk_the_heap_once():
    """`collections_deferred` (the batched render's close of its mirrors): ManiSkill's full collection at
    each env's close becomes one collection on leaving, which still frees the closed envs' scenes; the process's
    own ``gc.collect`` is never replaced."""
    import gc
    import weakref

    from fastrecord.render.vector import collections_deferred

    envs = [_make("PickCube-v1") for _ in range(3)]
    for i, env in enumerate(envs):
        env.reset(seed=i)
    scenes = [weakref.ref(env.unwrapped.scene) for env in envs]
    collect = gc.collect
    walks: list[int] = []
    gc.callbacks.append(lambda phase, info: walks.append(info["generation"]) if phase == "start" else None)
    automatic = gc.isenabled()
    gc.disable()  # only the collections asked for are counted
    try:
        with collections_deferred():
            for env in envs:
                env.close()  # each runs ManiSkill's gc.collect()
            del env
            envs.clear()  # the envs gone too: their scenes are garbage (cycles) from here
            assert walks == [] and all(s() is not None for s in scenes)
        assert walks == [2]  # one full collection, on leaving
    finally:
        gc.callbacks.pop()
        if automatic:
            gc.enable()
    assert all(s() is None for s in scenes)
    from mani_skill.envs import sapien_env

    assert gc.collect is collect and sapien_env.gc is gc  # put back


def test_a_collection_left_for_later_runs_before_the_next_scenes_are_built():
    """`collections_deferred(later=True)` (the batched render's close): leaving collects nothing, the closed envs'
    scenes stay until this process next builds scenes through fastrecord (`scenes_built` runs the collection left
    pending first), and a deferral with nothing asked leaves nothing pending."""
    import gc
    import weakref

    from fastrecord.render import vector
    from fastrecord.render.vector import collections_deferred, scenes_built

    envs = [_make("PickCube-v1") for _ in range(2)]
    for i, env in enumerate(envs):
        env.reset(seed=i)
    scenes = [weakref.ref(env.unwrapped.scene) for env in envs]
    walks: list[int] = []
    gc.callbacks.append(lambda phase, info: walks.append(info["generation"]) if phase == "start" else None)
    automatic = gc.isenabled()
    gc.disable()
    try:
        with collections_deferred(later=True):
            for env in envs:
                env.close()
            del env
            envs.clear()
        assert walks == [] and vector._collection_pending and all(s() is not None for s in scenes)
        with scenes_built():
            assert walks == [2] and not vector._collection_pending
            assert all(s() is None for s in scenes)
        with collections_deferred(later=True):
            pass  # nothing closed: nothing asked
        assert not vector._collection_pending
    finally:
        gc.callbacks.pop()
        if automatic:
            gc.enable()


@pytest.mark.gpu
def test_record_cli_batched_render_writes_every_video_and_ends_its_sub_envs(tmp_path):
    """`fastrecord record` with the batched render (auto on a CUDA machine): every episode's video decodes to
    its frames, the trajectory holds every episode, and no sub-env process is left alive after the command
    (how the close ends them: `test_a_terminating_close_ends_the_sub_env_processes_without_their_close`)."""
    import json
    import multiprocessing as mp

    import av

    from fastrecord.commands.cli import main

    rc = main(["record", "PickCube-v1", "--num-envs", "2", "--episodes", "4", "--max-episode-steps", "5",
               "--width", "64", "--height", "64", "--output-dir", str(tmp_path)])
    assert rc == 0
    assert not [p for p in mp.active_children() if p.is_alive()]
    episodes = json.loads((tmp_path / "trajectory.json").read_text())["episodes"]
    assert sorted(e["episode_id"] for e in episodes) == [0, 1, 2, 3]
    videos = sorted(tmp_path.glob("*.mp4"))
    assert len(videos) == 4
    for v in videos:
        with av.open(str(v)) as f:
            frames = [fr.to_ndarray(format="rgb24") for fr in f.decode(video=0)]
        assert len(frames) == 6 and frames[0].shape == (64, 64, 3) and frames[0].std() > 0


@pytest.mark.parametrize("terminate", [False, True])
def test_a_terminating_close_ends_the_sub_env_processes_without_their_close(terminate):
    """`GroupRenderedVectorEnv.terminate_subenvs` (set by `fastrecord record`, whose sub-envs hold nothing to
    save): its close ends the vector env's processes with ``terminate=True``; otherwise (make_eval_envs) the
    sub-envs are asked to close. The mirrors are closed either way. No CUDA needed: the group is not built."""
    from fastrecord.render.vector import GroupRenderedVectorEnv

    class Subenvs:
        closed_with: dict | None = None

        def close(self, **kwargs):
            Subenvs.closed_with = kwargs

    class Mirror:
        closed = False

        def close(self):
            self.closed = True

    wrapper = object.__new__(GroupRenderedVectorEnv)  # only what close() reads
    mirror = Mirror()
    wrapper.env, wrapper.mirrors, wrapper.terminate_subenvs = Subenvs(), [mirror], terminate
    wrapper.close()
    assert Subenvs.closed_with == ({"terminate": True} if terminate else {})
    assert mirror.closed and wrapper.mirrors == []


@pytest.mark.parametrize("warm_fails", [False, True])
def test_the_mirrors_thread_warms_the_renderer_that_the_vector_env_takes(monkeypatch, warm_fails):
    """`group_rendered`: the thread that builds the mirrors also makes their renderer and warms it (one picture per
    human camera), while the sub-envs start; the vector env takes that renderer. A warm-up that fails is dropped
    (the renderer invalidated: the first render builds the group again and raises what it must). No CUDA needed:
    the renderer is a stand-in here (the pictures themselves: the GPU tests above)."""
    import threading

    from fastrecord.render import vector

    warmed: list[tuple[str, list[str]]] = []
    invalidated: list[bool] = []

    class Scene:
        def __init__(self):
            self.human_render_cameras = {"render_camera": None}

    class Mirror:
        def __init__(self):
            self.scene = Scene()

        @property
        def unwrapped(self):
            return self

        def close(self):
            pass

    class Bodies:
        def signature(self):
            return ()

    class Renderer:
        def __init__(self, envs, device):
            self.envs, self.bodies = [e.unwrapped for e in envs], [Bodies() for _ in envs]

        def warm(self, names):
            warmed.append((threading.current_thread().name, list(names)))
            if warm_fails:
                raise RuntimeError("no picture")

        def invalidate(self):
            invalidated.append(True)

    monkeypatch.setattr(vector, "GroupRenderer", Renderer)
    envs = vector.group_rendered(lambda: gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1")] * 2), Mirror, 2)
    try:
        assert isinstance(envs.renderer, Renderer) and envs.renderer.envs == envs.mirrors
        assert warmed == [("fastrecord-mirrors", ["render_camera"])]
        assert invalidated == ([True] if warm_fails else [])
    finally:
        envs.close()


def test_a_subclass_that_changes_reset_resets_whole_unless_it_changes_reset_wait_too():
    """`RecordVectorEpisode` resets a batched render in two halves only where its class says so (``resets_async``):
    a subclass whose ``reset`` changes the answer and that has no ``reset_wait`` of its own resets whole; the
    mirrored replay's, which adds its sensors in both, keeps the two halves."""
    from fastrecord.render.vector import GroupRenderedVectorEnv
    from fastrecord.replay.mirrored import MirroredReplayVectorEnv

    class Changed(GroupRenderedVectorEnv):
        def reset(self, **kwargs):
            return super().reset(**kwargs)

    assert GroupRenderedVectorEnv.resets_async and MirroredReplayVectorEnv.resets_async
    assert not Changed.resets_async
