"""`fastrecord.render.device`: the render device named as ManiSkill names it, and opened early on a thread, before the
process makes its scenes. Its cases that open a device run in fresh interpreters (SAPIEN keeps one render engine a
process): on lavapipe here, on the GPU with ``-m gpu``."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import checkout_env

from fastrecord.render.device import device_of, on_cuda

BACKENDS = ["gpu", "gpu:1", "cuda", "cuda:2", "sapien_cuda", "sapien_cuda:3"]


def test_the_device_named_is_the_one_maniskill_renders_on(monkeypatch):
    """`device_of` answers, for every CUDA spelling of ``render_backend``, the device string ManiSkill's own
    ``parse_sim_and_render_backend`` gives ``sapien.Device`` (caught here instead of opened)."""
    from mani_skill.envs.utils.system import backend

    monkeypatch.setattr(backend.sapien, "Device", lambda name: f"device:{name}")
    for name in BACKENDS:
        assert on_cuda(name)
        assert f"device:{device_of(name)}" == backend.parse_sim_and_render_backend("physx_cpu", name).render_device
    for name in ("cpu", "sapien_cpu", "none", None, "auto"):
        assert not on_cuda(name)


def test_the_batched_render_takes_every_cuda_spelling(monkeypatch):
    """`fastrecord.render.available` (whether a vector env's videos are drawn in one batch) answers yes for every
    CUDA spelling and "auto" where torch sees CUDA, no for the CPU's, and no anywhere torch sees none."""
    from fastrecord import render, system

    monkeypatch.setattr(system, "torch_sees_cuda", lambda: True)
    assert all(render.available(name) for name in [*BACKENDS, "auto", None])
    assert not any(render.available(name) for name in ("cpu", "sapien_cpu", "none"))
    monkeypatch.setattr(system, "torch_sees_cuda", lambda: False)
    assert not any(render.available(name) for name in BACKENDS)


SCRIPT = """
    import json, os, sys, time
    import numpy as np
    from fastrecord.system import use_lavapipe_if_no_gpu
    use_lavapipe_if_no_gpu()
    from fastrecord.render import device
    backend, early, out = sys.argv[1], sys.argv[2], sys.argv[3]
    if early != "none":
        device.open_early(early)
        device.open_early("cuda:9")  # a second call while one is open: nothing
    import gymnasium as gym
    import mani_skill.envs
    opened = device.wait_early()
    made = time.time()
    env = gym.make("PickCube-v1", obs_mode="state", render_mode="rgb_array", sim_backend="physx_cpu",
                   render_backend=backend, human_render_camera_configs=dict(width=64, height=64))
    env.reset(seed=3)
    device.release_early()
    env.step(env.action_space.sample() * 0)
    frame = env.render()
    np.save(out, np.asarray(frame.cpu() if hasattr(frame, "cpu") else frame))
    env.close()
    stamps = json.loads(open(os.environ["FASTRECORD_TIMELINE"]).read()) if os.path.exists(
        os.environ["FASTRECORD_TIMELINE"]) else {}
    print(json.dumps({"opened": opened, "made": made, "stamps": stamps, "left": device._early is None}))
"""


def run_script(tmp_path, backend: str, early: str) -> tuple[dict, np.ndarray]:
    out, timeline = tmp_path / f"{early}.npy", tmp_path / f"{early}.timeline.json"
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(SCRIPT), backend, early, str(out)], capture_output=True,
                       text=True, timeout=300, env=checkout_env(FASTRECORD_TIMELINE=str(timeline)))
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1]), np.load(out)


@pytest.mark.parametrize("backend", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_an_engine_opened_early_draws_the_pictures_a_process_draws_without_it(tmp_path, backend):
    """Opened on a thread before ManiSkill is imported, the device is open before the env is made (the thread
    stamped it), the env made afterwards draws on it the very picture a process that never opened it early draws,
    and the early hold is let go; a second open while one is held does nothing."""
    device = device_of(backend) if on_cuda(backend) else backend
    early, frame = run_script(tmp_path, backend, device)
    plain, ref = run_script(tmp_path, backend, "none")
    assert early["opened"] == device and early["left"] and plain["opened"] is None
    assert early["stamps"]["render_device_opening"] <= early["stamps"]["render_device_opened"] <= early["made"]
    assert "render_device_opening" not in plain["stamps"]
    assert frame.shape == (1, 64, 64, 3) and frame.std() > 0
    np.testing.assert_array_equal(frame, ref)


def test_an_early_open_of_another_device_is_let_go_before_the_scenes():
    """`settle_early` (what the mirrors' thread calls before its first scene) keeps an early open of the device the
    scenes render on and lets go of one of another device, which SAPIEN would refuse them while held. The module's
    state only: the device opened here is the one this test session holds already (conftest's ``render_device``)."""
    import torch

    from fastrecord.render import device

    held = "cuda" if torch.cuda.is_available() else "cpu"
    device.open_early(held)
    device.settle_early(held)
    assert device.wait_early() == held
    device.settle_early("cuda:1")
    assert device.wait_early() is None and device._early is None
    device.release_early()  # nothing to let go: no error


def test_a_device_that_cannot_open_is_left_to_the_envs(tmp_path):
    """An early open that fails (a CUDA device this machine lacks) raises nothing: waiting for it says nothing was
    opened, and the env made afterwards on the CPU draws as it would have."""
    early, frame = run_script(tmp_path, "cpu", "cuda:7")
    assert early["opened"] is None and early["left"]
    assert "render_device_opening" in early["stamps"] and "render_device_opened" not in early["stamps"]
    assert frame.std() > 0
