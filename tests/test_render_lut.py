"""The BRDF lookup table fastrecord hands SAPIEN's CPU-rendered cameras (fastrecord.render.lut): the same
pictures to the bit as ManiSkill alone, in a process fastrecord owns (every camera) and in a user's (the cameras
of the env RecordEpisode wraps, and nothing else of the process); SAPIEN's own table wherever a scene has an
environment map."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from fastrecord.render import lut

# StackCube-v1 (state observations, human camera) made before fastrecord is imported, then PickCube-v1 (rgb
# observations: its sensor camera renders in gym.make, and the human camera). "maniskill": ManiSkill alone;
# "user": a user's script, StackCube wrapped by RecordEpisode; "claimed": a process of fastrecord's (its CLI,
# workers, sub-envs: `claim_process`).
SCRIPT = """
import json, sys
import numpy as np
import gymnasium as gym
import mani_skill.envs
mode, out, pictures_path = sys.argv[1:]
cam = dict(width=96, height=96)
if mode == "claimed":
    from fastrecord.workers import claim_process
    claim_process()
stack = gym.make("StackCube-v1", obs_mode="state", render_mode="rgb_array", sim_backend="physx_cpu",
                 human_render_camera_configs=cam)
supplied = []
if mode != "maniskill":
    import fastrecord
    from fastrecord.render import lut
    if mode == "user":
        stack = fastrecord.RecordEpisode(stack, out, save_video=True, save_trajectory=False)
    supplied.append(lut.supplied)
pictures = {}
for name in ("stack", "pick"):
    if name == "pick":
        env = gym.make("PickCube-v1", obs_mode="rgb", render_mode="rgb_array", sim_backend="physx_cpu",
                       human_render_camera_configs=cam, sensor_configs=cam)
    else:
        env = stack
    obs, _ = env.reset(seed=5)
    for t in range(3):
        pictures[f"{name}_render_{t}"] = np.asarray(env.render())
        if name == "pick":
            pictures[f"{name}_sensor_{t}"] = np.asarray(obs["sensor_data"]["base_camera"]["rgb"])
        obs, *_ = env.step(env.action_space.sample() * 0 + 0.3)
    if mode != "maniskill":
        supplied.append(lut.supplied)
    env.close()
np.savez(pictures_path, **pictures)
print(json.dumps(supplied))
"""


def _run(mode: str, tmp_path) -> tuple[dict[str, np.ndarray], list[int]]:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(SCRIPT), mode, str(tmp_path / mode),
                          str(tmp_path / f"{mode}.npz")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    with np.load(tmp_path / f"{mode}.npz") as f:
        return dict(f), json.loads(out.stdout.strip().splitlines()[-1])


def test_pictures_are_maniskills_own_to_the_bit(tmp_path):
    """Fresh processes (SAPIEN makes its table once a process): every human-camera and sensor picture equal to
    ManiSkill's alone. Handed the table: in a process of fastrecord's, every camera ManiSkill makes (StackCube's
    human camera; PickCube's sensor and human camera); in a user's, only the cameras of the env RecordEpisode
    wraps (PickCube, made by the script itself, keeps SAPIEN's)."""
    alone, none = _run("maniskill", tmp_path)
    assert none == [] and len(alone) == 9
    for key, picture in alone.items():
        assert picture.shape[-3:] == (96, 96, 3) and picture.std() > 5, key  # a scene, not a blank frame
    for mode in ("claimed", "user"):
        ours, (made, stacked, picked) = _run(mode, tmp_path)  # cameras handed the table: after StackCube's make,
        if mode == "claimed":  # after its pictures, after PickCube's
            assert 0 < made == stacked < picked, (made, stacked, picked)
        else:  # at RecordEpisode's first picture
            assert 0 == made < stacked == picked, (made, stacked, picked)
        assert sorted(ours) == sorted(alone)
        for key, picture in alone.items():
            np.testing.assert_array_equal(ours[key], picture, err_msg=f"{mode}: {key}")


def test_the_table_is_the_split_sum_integral():
    """Against a Monte Carlo estimate of the same integral (random directions, not the Hammersley set), at
    texel centres laid out as SAPIEN samples them (rows N.V, columns roughness)."""
    size = 8
    table = lut.brdf_lut(size=size, samples=4096)
    assert table.shape == (size, size, 2) and table.dtype == np.float32
    rng = np.random.default_rng(0)
    centres = (np.arange(size) + 0.5) / size
    for row, col in ((0, 4), (4, 4), (7, 7), (2, 1), (6, 0)):
        n_v, alpha = centres[row], centres[col] ** 2
        u, v = rng.random(400_000), rng.random(400_000)
        cos = np.sqrt((1 - u) / (1 + (alpha**2 - 1) * u))
        h = np.stack([np.sqrt(1 - cos**2) * np.cos(2 * np.pi * v), np.sqrt(1 - cos**2) * np.sin(2 * np.pi * v), cos])
        view = np.array([np.sqrt(1 - n_v**2), 0.0, n_v])
        v_h = view @ h
        n_l = 2 * v_h * cos - n_v
        k = alpha / 2
        vis = np.where(n_l > 0, n_l / (n_l * (1 - k) + k) * n_v / (n_v * (1 - k) + k) * v_h / (cos * n_v), 0)
        fresnel = (1 - v_h) ** 5
        expected = [((1 - fresnel) * vis).mean(), (fresnel * vis).mean()]
        np.testing.assert_allclose(table[row, col], expected, atol=4e-3, err_msg=f"N.V {n_v}, roughness {col}")
    assert table[-1, 0, 0] > 0.98 and table[-1, 0, 1] < 0.01  # a smooth surface seen head-on reflects F0


@pytest.fixture
def cubemap(tmp_path):
    import imageio.v3 as iio
    from sapien import render

    faces = []
    for i in range(6):
        faces.append(str(tmp_path / f"face{i}.png"))
        iio.imwrite(faces[-1], np.full((8, 8, 3), 40 * i, np.uint8))
    return render.RenderCubemap(*faces)


def test_a_scene_with_an_environment_map_keeps_sapiens_table(cubemap, monkeypatch):
    import sapien

    scene = sapien.Scene()
    assert lut._wants_table(scene)  # CPU rendering, no environment map: the table multiplies black
    scene.render_system.cubemap = cubemap
    assert not lut._wants_table(scene)

    textures = []

    class Camera:
        def set_texture(self, name, texture):
            textures.append(name)

    before = lut.supplied
    lut.supply([scene], [Camera()])
    assert textures == [] and lut.supplied == before
    lut.supply([sapien.Scene()], [Camera()])
    assert textures == ["BRDFLUT"] and lut.supplied == before + 1
    monkeypatch.setenv("FASTRECORD_BRDF_LUT", "0")  # turned off: nothing handed over
    lut.supply([sapien.Scene()], [Camera()])
    assert textures == ["BRDFLUT"] and lut.supplied == before + 1


def test_record_episode_hands_the_table_to_a_sync_vector_envs_sub_envs_once_a_scene(tmp_path):
    """In a user's process, the sub-envs of a SyncVectorEnv RecordEpisode wraps: their cameras before the
    recorder's first picture, not again while the scene stays, and again after a reconfiguring reset."""
    import gymnasium as gym
    from mani_skill.utils.wrappers import CPUGymWrapper

    import fastrecord

    def make():
        return CPUGymWrapper(gym.make("PushCube-v1", obs_mode="state", render_mode="rgb_array", sim_backend="physx_cpu",
                                      human_render_camera_configs=dict(width=32, height=32), reconfiguration_freq=1))

    envs = fastrecord.RecordEpisode(gym.vector.SyncVectorEnv([make]), tmp_path, save_trajectory=False)
    try:
        before = lut.supplied
        envs.reset(seed=[0])
        first_scene = lut.supplied
        assert first_scene > before
        for _ in range(3):
            envs.step(envs.action_space.sample())
        assert lut.supplied == first_scene  # the same scene: handed over once
        envs.reset(seed=[1])  # reconfiguration_freq=1: a new scene, new cameras
        assert lut.supplied > first_scene
    finally:
        envs.close()
    assert list(tmp_path.glob("*.mp4"))  # the recorder did render


def test_a_refused_table_leaves_the_camera_and_env_creation_alone(monkeypatch):
    """Another SAPIEN that refuses the texture: no error reaches env creation, nothing more is handed over."""
    import sapien

    calls = []

    class Refusing:
        def set_texture(self, name, texture):
            calls.append(name)
            raise TypeError("incompatible function arguments")

    monkeypatch.setattr(lut, "_failure", None)
    before = lut.supplied
    lut.supply([sapien.Scene()], [Refusing()])
    assert calls == ["BRDFLUT"] and lut.supplied == before and "incompatible" in lut._failure
    lut.supply([sapien.Scene()], [Refusing()])
    assert calls == ["BRDFLUT"]  # not tried again in this process


EVAL_SCRIPT = """
import gc, json
from fastrecord import make_eval_envs
if __name__ == "__main__":
    envs = make_eval_envs("PickCube-v1", 2, "physx_cpu",
                          dict(obs_mode="state", human_render_camera_configs=dict(width=64, height=64)),
                          dict(max_episode_steps=5, obs_horizon=1), video_dir=None)
    from fastrecord.render import lut
    from mani_skill.envs.scene import ManiSkillScene
    envs.reset(seed=0)
    print(json.dumps([gc.get_freeze_count(), lut._installed, hasattr(ManiSkillScene.add_camera, "__wrapped__")]))
    envs.close()
"""


def test_make_eval_envs_leaves_the_callers_process_unclaimed(tmp_path):
    """gymnasium's AsyncVectorEnv builds its dummy env with sub-env 0's thunk in the caller's process: there the
    thunk must not do what it does in a sub-env's own process (freeze the imports, patch ManiSkill's cameras)."""
    script = tmp_path / "eval_script.py"  # a file: the forkserver imports the caller's __main__
    script.write_text(textwrap.dedent(EVAL_SCRIPT))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    frozen, installed, wrapped = json.loads(out.stdout.strip().splitlines()[-1])
    assert (frozen, installed, wrapped) == (0, False, False)
