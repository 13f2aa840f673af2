"""SAPIEN's BRDF lookup table, handed to the cameras ManiSkill makes where the table cannot change a picture.

A process's first picture through SAPIEN computes a 512x512 BRDF lookup table (svulkan2's
``SVResourceManager::getDefaultBRDFLUT``: a compute shader integrating 1,024 GGX samples a texel), for any camera
that was not given one. On a GPU that takes milliseconds; on the CPU machines, where Mesa's lavapipe runs the
shader, 4.9-5.3 s, in every process that renders (about 30% of the README job: docs/performance.md). The
table weighs one term only, the environment map's specular reflection (``specularIBL`` in SAPIEN's ``default``
and ``minimal`` shaders: environment colour x (F0 * A + B)); a scene without an environment map samples SAPIEN's
black default cubemap, so there the table multiplies zero. For cameras that render on the CPU in such a scene,
`install` (every camera ManiSkill makes, in processes fastrecord owns) and `supply_env` (the cameras of an env
fastrecord wraps) hand SAPIEN a table computed here (the same integral at 64x64, in 0.08 s), and SAPIEN computes
none. Pictures are the same to the bit (tests/test_render_lut.py). A scene with an environment map (ReplicaCAD,
``set_environment_map``) keeps SAPIEN's own table; an environment map set after the cameras were made would meet
this one (the same integral at a coarser resolution; not compared with SAPIEN's own table, whose shader source is
not in the wheel).

``FASTRECORD_BRDF_LUT=0`` turns it off (benchmarks/bench_first_render.py measures both ways).
"""

from __future__ import annotations

import functools
import os
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["brdf_lut", "install", "supplied", "supply_env"]  # internal (docs/api.md)

supplied = 0  # cameras of this process given the table (tests read it)
_installed = False
_texture: Any = None
_failure: str | None = None  # why SAPIEN refused the table (then nothing more is handed over in this process)
# env -> a weak reference to the scene `supply_env` last saw (weak both ways: a closed env's old scene, and its
# SAPIEN resources, are not kept alive here)
_scenes: weakref.WeakKeyDictionary[Any, weakref.ref[Any]] = weakref.WeakKeyDictionary()


def brdf_lut(size: int = 64, samples: int = 512) -> np.ndarray:
    """The split-sum GGX lookup table ([size, size, 2] float32: scale A and bias B of F0), laid out as SAPIEN's
    shaders sample it: ``texture(samplerBRDFLUT, vec2(roughness, dot(N, V)))``, so rows are N.V and columns
    roughness, each at its texel's centre. Hammersley samples, importance-sampled GGX with alpha = roughness^2,
    Smith-Schlick visibility with k = alpha / 2 (Karis 2013)."""
    i = np.arange(samples, dtype=np.uint32)
    bits = (i << np.uint32(16)) | (i >> np.uint32(16))  # the radical inverse of i in base 2
    for shift, mask in ((1, 0x55555555), (2, 0x33333333), (4, 0x0F0F0F0F), (8, 0x00FF00FF)):
        m = np.uint32(mask)
        bits = ((bits & m) << np.uint32(shift)) | ((bits & ~m) >> np.uint32(shift))
    u, v = i / samples, bits * 2.0**-32
    centres = (np.arange(size) + 0.5) / size
    alpha = centres[:, None] ** 2  # [roughness, 1]
    cos_h = np.sqrt((1 - u) / (1 + (alpha**2 - 1) * u))  # [roughness, sample]: the half vector H
    sin_h = np.sqrt(1 - cos_h**2)
    hx = sin_h * np.cos(2 * np.pi * v)
    n_v = centres[:, None, None]  # [N.V, 1, 1]; V = (sqrt(1 - n_v^2), 0, n_v)
    v_h = np.sqrt(1 - n_v**2) * hx + n_v * cos_h  # [N.V, roughness, sample]
    n_l = 2 * v_h * cos_h - n_v  # L = 2 (V.H) H - V
    k = alpha / 2
    vis = (n_l / (n_l * (1 - k) + k)) * (n_v / (n_v * (1 - k) + k)) * v_h / (cos_h * n_v)
    vis = np.where(n_l > 0, vis, 0.0)
    fresnel = (1 - np.clip(v_h, 0, 1)) ** 5
    return np.stack([((1 - fresnel) * vis).mean(-1), (fresnel * vis).mean(-1)], -1).astype(np.float32)


def _wants_table(scene: Any) -> bool:
    """Whether a camera of this SAPIEN scene may be given the table: it renders on the CPU, and the scene has
    no environment map."""
    try:
        system = scene.render_system
        return bool(system.device.is_cpu()) and system.cubemap is None
    except (AttributeError, RuntimeError):  # no render system: nothing renders, nothing to hand over
        return False


def _enabled() -> bool:
    return _failure is None and os.environ.get("FASTRECORD_BRDF_LUT", "1") != "0"


def supply(scenes: Sequence[Any], cameras: Sequence[Any]) -> None:
    """Hand the table to each SAPIEN camera (``RenderCameraComponent``) whose scene (same index) wants it.

    Only ever a speed-up: where SAPIEN refuses the texture (another SAPIEN version), the camera keeps its own table,
    and this process hands over no more (`_failure` says why); env creation goes on."""
    global supplied, _texture, _failure
    if not _enabled():
        return
    for scene, camera in zip(scenes, cameras, strict=False):  # ManiSkill: camera i is in sub-scene i
        if not _wants_table(scene):
            continue
        try:
            if _texture is None:
                from sapien import render

                _texture = render.RenderTexture(brdf_lut(), 2, "R32G32Sfloat", filter_mode="linear",
                                                address_mode="edge")
            camera.set_texture("BRDFLUT", _texture)
        except Exception as e:  # noqa: BLE001 - a camera without the table renders as before, 5 s later
            _failure = f"{type(e).__name__}: {e}"
            return
        supplied += 1


def supply_env(env: Any) -> None:
    """Hand the table to the cameras a ManiSkill env (its ``BaseEnv``) has, once a scene: `fastrecord.RecordEpisode`
    calls it before each picture of the envs it wraps in the caller's process (the env itself, or a
    ``SyncVectorEnv``'s sub-envs), so a new scene's cameras (a reconfiguring reset) get it before their first."""
    scene = getattr(env, "scene", None)
    if scene is None:
        return
    try:
        seen = _scenes.get(env)
        if seen is not None and seen() is scene:
            return
        _scenes[env] = weakref.ref(scene)
    except TypeError:  # an env (or scene) that cannot be weakly referenced: handed over at every call
        pass
    for group in (getattr(scene, "sensors", None) or {}, getattr(scene, "human_render_cameras", None) or {}):
        for sensor in group.values():
            supply(scene.sub_scenes, getattr(getattr(sensor, "camera", None), "_render_cameras", ()))


def install() -> None:
    """From now on in this process, every camera ManiSkill makes (``ManiSkillScene.add_camera``: sensors and
    human render cameras, at each reconfiguration) is handed the table where `supply` allows. Idempotent;
    ``FASTRECORD_BRDF_LUT=0`` leaves ManiSkill as it is."""
    global _installed
    if _installed or not _enabled():
        return
    from mani_skill.envs.scene import ManiSkillScene

    original = ManiSkillScene.add_camera

    @functools.wraps(original)
    def add_camera(self: Any, *args: Any, **kwargs: Any) -> Any:
        camera = original(self, *args, **kwargs)
        supply(self.sub_scenes, getattr(camera, "_render_cameras", ()))
        return camera

    ManiSkillScene.add_camera = add_camera
    _installed = True
