"""`GroupRenderer`: one batched render of N CPU-simulated ManiSkill envs held in this process.

The envs ("mirrors") are never stepped here: their render shapes read their poses from one CUDA tensor
(`set_poses`, one row per moving entity, `fastrecord.render.bodies` order), which whoever runs the
physics fills. This is what ManiSkill does for GPU simulation (``ManiSkillScene._sapien_setup_gpu_rendering``)
with the PhysX GPU pose array; here the array is filled from CPU physics. Pictures come out as one CUDA
tensor per camera name, converted by the camera's own shader config, as ManiSkill's ``Camera.get_obs``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import sapien
import torch

from fastrecord.render import BatchedRenderError
from fastrecord.render.bodies import POSE_WIDTH, RenderBodies

CUDA_ROW = 13  # SAPIEN's CUDA rigid-body row: pose (7) then linear and angular velocity (6)
HIDDEN_AT = 99999.0  # where a hidden object is put while sensors take their pictures (ManiSkill's GPU-sim way)
MODALITIES = (
    "rgb",
    "depth",
    "position",
    "segmentation",
    "normal",
    "albedo",
)  # what ManiSkill's Camera.get_obs can give


def _entities_of(obj: Any) -> list[Any]:
    """The SAPIEN entities of a ManiSkill actor (its ``_objs``) or articulation (its links')."""
    if hasattr(obj, "links"):
        return [px_link.entity for link in obj.links for px_link in link._objs]
    return list(obj._objs)


def _camera(base: Any, name: str) -> Any:
    scene = base.scene
    cam = scene.human_render_cameras.get(name) or scene.sensors.get(name)
    if cam is None:
        raise ValueError(f"camera {name!r} is not in this env; its cameras are "
                         f"{sorted([*scene.human_render_cameras, *scene.sensors])}")
    return cam


class GroupRenderer:
    """Renders N CPU-simulated ManiSkill envs (``num_envs == 1`` each, rendering on a CUDA device) in one
    ``sapien.render.RenderSystemGroup``.

    Owns: the group (rebuilt after any env's scene changed), the CUDA pose tensor, one camera group per
    camera name, and where each env's hidden objects are while it renders: shown for human cameras,
    hidden for sensors (as ManiSkill's ``render_rgb_array`` / ``_get_obs_sensor_data``). A scene in a
    group cannot change what it holds or shows, so hidden objects stay visible and are moved far away
    for a sensor's picture, as ManiSkill hides them in GPU simulation.
    """

    def __init__(self, envs: Sequence[Any], device: str | torch.device = "cuda") -> None:
        if not envs:
            raise ValueError("GroupRenderer needs at least one env")
        self.envs = [e.unwrapped for e in envs]
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"device={str(device)!r}: a RenderSystemGroup renders from CUDA poses; pass a CUDA device "
                             f"such as 'cuda' or 'cuda:0', or render each env by itself")
        self.bodies = [RenderBodies(e) for e in self.envs]
        self._group: Any = None
        self._camera_groups: dict[str, Any] = {}
        self._rows: list[int] = []
        self._poses: torch.Tensor | None = None
        self._host: torch.Tensor | None = None  # pinned staging of the poses' upload
        self._hidden_rows = torch.zeros(0, dtype=torch.long)
        self._stream = torch.cuda.Stream(self.device)
        self._copied: torch.cuda.Event | None = None
        self.rebuilds = 0  # how often the group was (re)built: once, plus once per reconfiguration that changed a scene

    @property
    def num_envs(self) -> int:
        return len(self.envs)

    def invalidate(self) -> None:
        """Some env's scene changed (a reconfiguring reset): the group is rebuilt at the next render."""
        self._group = None
        self._camera_groups = {}

    def _ensure(self) -> None:
        if self._group is not None and not any(b.scene_changed for b in self.bodies):
            return
        for b in self.bodies:
            b.refresh()
        for env in self.envs:  # shown for good: a scene in a group cannot change visibility, so sensors hide by pose
            for obj in env._hidden_objects:
                obj.show_visual()
        rows = [len(b.entities) for b in self.bodies]
        poses = torch.zeros((sum(rows), CUDA_ROW), device=self.device, dtype=torch.float32)
        poses[:, 3] = 1.0  # identity rotations until the first poses arrive
        offset = 0
        hidden: list[int] = []
        for env, b in zip(self.envs, self.bodies, strict=True):
            index = {id(e): offset + k for k, e in enumerate(b.entities)}
            for obj in env._hidden_objects:
                hidden += [index[id(e)] for e in _entities_of(obj) if id(e) in index]
            for k, entity in enumerate(b.entities):
                body = entity.find_component_by_type(sapien.render.RenderBodyComponent)
                if body is not None:
                    for shape in body.render_shapes:
                        shape.set_gpu_pose_batch_index(offset + k)
            scene = b.base.scene
            for cam in [*scene.human_render_cameras.values(), *scene.sensors.values()]:
                for component in getattr(getattr(cam, "camera", None), "_render_cameras", ()):
                    row = index.get(id(component.entity))
                    if row is not None:  # mounted on a moving entity (a hand camera): follows its row
                        component.set_gpu_pose_batch_index(row)
            offset += len(b.entities)
        group = sapien.render.RenderSystemGroup([e.scene.sub_scenes[0].render_system for e in self.envs])
        group.set_cuda_poses(sapien.CudaArray(poses))
        self._group, self._poses, self._rows, self._camera_groups = group, poses, rows, {}
        self._hidden_rows = torch.as_tensor(hidden, dtype=torch.long, device=self.device)
        self.rebuilds += 1

    def warm(self, names: Sequence[str]) -> None:
        """Build the group and cameras ``names``' camera groups and draw one picture of each (at the poses set, or
        the first ones: identity rotations at the origin), waiting for it: what the first render would otherwise
        wait for (SAPIEN's group, the cameras' render targets and CUDA buffers, the first submissions). May run
        on another thread than the renders after it."""
        with torch.cuda.device(self.device):
            self._ensure()
            for name in names:
                self.take_pictures([name], sensor=False)
                self.read_sensor_data(name, ("rgb",))
            torch.cuda.synchronize(self.device)

    def set_poses(self, poses: Sequence[np.ndarray] | np.ndarray | torch.Tensor) -> None:
        """Every env's entity poses, ``[B_i, 7]`` each (or all rows concatenated): what the next render shows."""
        self._ensure()
        assert self._poses is not None
        if not isinstance(poses, (torch.Tensor, np.ndarray)):
            got = [np.shape(p)[0] for p in poses]
            if got != self._rows:
                raise ValueError(f"poses for {got} entities per env, but the scenes have {self._rows}: a sub-env "
                                 f"reconfigured without its mirror (call invalidate/resync first)")
            poses = np.concatenate(poses, axis=0) if len(poses) > 1 else poses[0]
        expected = (self._poses.shape[0], POSE_WIDTH)
        if tuple(poses.shape) != expected:
            raise ValueError(f"poses of shape {tuple(poses.shape)}; expected {expected}")
        if isinstance(poses, torch.Tensor):
            flat = poses
        else:
            if self._host is None or self._host.shape[0] != expected[0]:
                self._host = torch.empty(expected, dtype=torch.float32, pin_memory=True)
            self._host.numpy()[:] = poses  # pinned: the upload below neither stages nor asks CUDA what the memory is
            flat = self._host
        with torch.cuda.stream(self._stream):
            self._poses[:, :POSE_WIDTH].copy_(flat, non_blocking=True)
        self._stream.synchronize()  # SAPIEN reads the array on its own stream; the pinned buffer is free again

    def set_poses_from_envs(self) -> None:
        """Poses read from the envs' own entities (envs of this process whose states were set here). The
        entity lists are refreshed first: an env that reconfigured has a new scene, whose entities these are."""
        self._ensure()
        self.set_poses([b.poses() for b in self.bodies])

    def _camera_group(self, name: str) -> Any:
        cg = self._camera_groups.get(name)
        if cg is None:
            cams = [_camera(e, name) for e in self.envs]
            textures = list(cams[0].config.shader_config.texture_names.keys())
            try:
                cg = self._group.create_camera_group([c.camera._render_cameras[0] for c in cams], textures)
            except RuntimeError as e:
                raise BatchedRenderError(
                    f"could not make one camera group of {len(cams)} {name!r} cameras on {self.device} "
                    f"({e}); use fewer envs per process or smaller cameras"
                ) from e
            self._camera_groups[name] = cg
        return cg

    def take_pictures(self, names: Sequence[str], *, sensor: bool) -> None:
        """Submit cameras ``names``' pictures of every env at the poses set (``sensor``: hidden objects hidden):
        SAPIEN draws them while this thread goes on; `read_sensor_data` waits for them."""
        self._ensure()
        assert self._poses is not None  # built by _ensure
        groups = [self._camera_group(name) for name in names]
        if self._copied is not None:  # the last picture left SAPIEN's buffers before these overwrite them
            self._copied.synchronize()
        hide = sensor and len(self._hidden_rows) > 0
        if hide:  # as ManiSkill hides objects in GPU simulation: moved far away for this picture
            with torch.cuda.stream(self._stream):
                kept = self._poses[self._hidden_rows, :3].clone()
                self._poses[self._hidden_rows, :3] = HIDDEN_AT
            self._stream.synchronize()
        self._group.update_render()
        if hide:
            with torch.cuda.stream(self._stream):
                self._poses[self._hidden_rows, :3] = kept
            self._stream.synchronize()
        for cg in groups:
            cg.take_picture()

    def _copied_out(self, pictures: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copies of ``pictures`` (a texture transform's output is often a view of SAPIEN's buffer, which the
        next picture overwrites): the copies are done before the next picture is taken."""
        out = {}
        for key, value in pictures.items():
            out[key] = torch.empty(value.shape, dtype=value.dtype, device=self.device)
            out[key].copy_(value)
        self._copied = torch.cuda.Event()
        self._copied.record()
        return out

    def render(self, name: str, *, sensor: bool | None = None) -> torch.Tensor:
        """Every env's picture from camera ``name``: ``[N, H, W, 3]`` uint8 on the CUDA device, as the env's
        own render would give it (``render_rgb_array`` for a human camera: hidden objects shown; a sensor's
        rgb: hidden objects hidden). ``sensor`` overrides which of the two ``name`` is."""
        is_sensor = name not in self.envs[0].scene.human_render_cameras if sensor is None else sensor
        textures = _camera(self.envs[0], name).config.shader_config.texture_names
        if not any("rgb" in gives for gives in textures.values()):
            raise ValueError(f"camera {name!r} has no rgb texture (its shader gives {dict(textures)})")
        self.take_pictures([name], sensor=is_sensor)
        rgb = self.read_sensor_data(name, ("rgb",))["rgb"]
        return rgb if rgb.shape[-1] == 3 else rgb[..., :3].contiguous()

    def sensor_data(
        self, name: str, modalities: Sequence[str], apply_texture_transforms: bool = True
    ) -> dict[str, torch.Tensor]:
        """Sensor camera ``name``'s observation of every env (`take_pictures` then `read_sensor_data`)."""
        self.take_pictures([name], sensor=True)
        return self.read_sensor_data(name, modalities, apply_texture_transforms)

    def read_sensor_data(
        self, name: str, modalities: Sequence[str], apply_texture_transforms: bool = True
    ) -> dict[str, torch.Tensor]:
        """Camera ``name``'s last picture (`take_pictures`) as ManiSkill's ``Camera.get_obs`` gives one env's:
        ``{modality: [N, ...]}`` on the CUDA device for the ``modalities`` asked for (rgb, depth, position,
        segmentation, normal, albedo), the texture transforms of the camera's shader applied; without them
        ``{texture name: raw picture}``. Copies: SAPIEN's buffers are free for the next picture once they are done."""
        shader = _camera(self.envs[0], name).config.shader_config
        textures = [tex for tex, gives in shader.texture_names.items() if any(m in gives for m in modalities)]
        cg = self._camera_group(name)
        images: dict[str, torch.Tensor] = {}
        for tex in textures:
            picture = cg.get_picture_cuda(tex).torch()
            images |= shader.texture_transforms[tex](picture) if apply_texture_transforms else {tex: picture}
        if apply_texture_transforms:  # as Camera.get_obs: a texture gives several modalities, those not asked for go
            images = {k: v for k, v in images.items() if k not in MODALITIES or k in modalities}
        return self._copied_out(images)
