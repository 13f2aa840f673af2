"""`RenderBodies`: which entities of one CPU-simulated ManiSkill scene move, in a fixed order, and their poses.

The order is ManiSkill's own for GPU rendering (``ManiSkillScene._get_all_render_bodies``): the entities
of every non-static actor, then every articulation's links. Two envs built from the same scene (same
task, same episode seed at reconfiguration) list the same entities in the same order, so the poses read
in a sub-env process drive the render shapes of its mirror in the rendering process row by row. The
``signature`` says what the scene looks like (entity names, render shapes, their sizes, meshes and
colours, static ones included): equal signatures mean the mirror needs no rebuild.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import sapien

POSE_WIDTH = 7  # p (3) then q (4, wxyz), SAPIEN's layout in a CUDA rigid-body row


def _shape_signature(shape: Any) -> tuple:
    """What one render shape looks like, as comparable plain values."""
    sig: list[Any] = [type(shape).__name__]
    for attr in ("half_size", "radius", "half_length", "scale", "filename"):
        value = getattr(shape, attr, None)
        if value is not None:
            sig.append((attr, tuple(np.round(np.asarray(value, dtype=np.float64).reshape(-1), 6))
                        if not isinstance(value, str) else value))
    pose = shape.local_pose
    sig.append(tuple(np.round(np.concatenate([pose.p, pose.q]).astype(np.float64), 6)))
    materials = [part.material for part in getattr(shape, "parts", ())] or [getattr(shape, "material", None)]
    for mat in materials:
        if mat is not None:
            tex = getattr(mat, "base_color_texture", None)
            sig.append(("color", tuple(np.round(np.asarray(mat.base_color, dtype=np.float64), 4)),
                        getattr(tex, "filename", None) if tex is not None else None))
    return tuple(sig)


def _entity_signature(entity: sapien.Entity) -> tuple:
    body = entity.find_component_by_type(sapien.render.RenderBodyComponent)
    shapes = () if body is None else tuple(_shape_signature(s) for s in body.render_shapes)
    return (entity.name, shapes)


class RenderBodies:
    """The moving entities of one CPU-simulated ManiSkill env (``num_envs == 1``), in render order.

    Owns: the entity list of the env's current scene (rebuilt by `refresh` after a reconfiguration).
    """

    def __init__(self, base_env: Any) -> None:
        self.base = base_env
        self._scene: Any = None
        self.entities: list[sapien.Entity] = []
        self.refresh()

    @property
    def scene_changed(self) -> bool:
        """The env reconfigured (a new SAPIEN scene) since the last `refresh`."""
        return self.base.scene.sub_scenes[0] is not self._scene

    def refresh(self) -> bool:
        """Re-list the entities if the env's scene is new; True if it was."""
        scene = self.base.scene
        if scene.sub_scenes[0] is self._scene:
            return False
        if len(scene.sub_scenes) != 1:
            raise ValueError(
                f"RenderBodies reads CPU-simulated envs with one scene; this one has {len(scene.sub_scenes)} "
                f"(a GPU-simulated env renders in one batch by itself)"
            )
        entities: list[sapien.Entity] = []
        for actor in scene.actors.values():
            if actor.px_body_type != "static":
                entities += list(actor._objs)
        for articulation in scene.articulations.values():
            for link in articulation.links:
                entities += [px_link.entity for px_link in link._objs]
        self.entities = entities
        self._scene = scene.sub_scenes[0]
        return True

    def poses(self) -> np.ndarray:
        """``[B, 7]`` float32: each entity's pose (p, q) as the env's own render would read it."""
        out = np.empty((len(self.entities), POSE_WIDTH), dtype=np.float32)
        for i, entity in enumerate(self.entities):
            pose = entity.pose
            out[i, :3] = pose.p
            out[i, 3:] = pose.q
        return out

    def signature(self) -> tuple:
        """What the scene looks like: the moving entities in order, then the static ones (by name).

        The first reading of a triangle mesh's materials in a process waits while SAPIEN loads the mesh's parts
        (once a mesh file a process: PickCube's table 113 ms, each panda link 4-14 ms, about 0.19 s for the scene
        on the 2-core CPU machine); later scenes of the same meshes read in 1-3 ms. `PoseReporter` and the mirrors'
        thread (`group_rendered`) read it once at the env's make, so that a sub-env's first reset does not wait."""
        scene = self.base.scene
        static = sorted((_entity_signature(e) for actor in scene.actors.values() if actor.px_body_type == "static"
                         for e in actor._objs), key=repr)
        return (tuple(_entity_signature(e) for e in self.entities), tuple(static))
