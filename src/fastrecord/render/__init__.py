"""Batched rendering of CPU-simulated ManiSkill scenes: one ``RenderSystemGroup`` per parallel step.

ManiSkill renders GPU-simulated envs in one batch (``ManiSkillScene._sapien_setup_gpu_rendering``: every
sub-scene's render system in one ``sapien.render.RenderSystemGroup``, fed a CUDA pose array). Nothing in
that API needs PhysX on the GPU, so CPU-simulated envs are rendered the same way here:

- `bodies.RenderBodies` lists, in a fixed order, the entities of one CPU env whose poses the render
  needs, and reads their poses (``[B, 7]``) and a signature of what the scene looks like. It runs where
  the physics runs (a sub-env process).
- `group.GroupRenderer` holds N "mirror" envs in the process that renders: the same scenes (rebuilt from
  the same episode seed when a sub-env reconfigures into a scene that looks different), never stepped;
  their render shapes read their poses from one CUDA tensor, and each camera name is one camera group.
- `vector.GroupRenderedVectorEnv` puts the two together over a gymnasium vector env of CPU envs: the
  sub-envs report their poses with every step and reset, and ``render()`` is one batched render of every
  env's human camera, a ``[N, H, W, 3]`` uint8 CUDA tensor.

Needs a CUDA device (SAPIEN's group reads CUDA poses and hands CUDA pictures); without one, envs render
one by one, in their own processes, as before (`available`).

`lut` is the CPU side: SAPIEN's BRDF lookup table handed to cameras rendered on lavapipe, which would otherwise
compute it at each process's first picture (about 5 s).
"""

from __future__ import annotations

__all__ = ["BatchedRenderError", "available", "use_batched"]  # internal (docs/api.md): for fastrecord's own modules


class BatchedRenderError(RuntimeError):
    """A batched render that cannot go on (a sub-env's scene its mirror cannot rebuild, a camera group the
    device cannot hold): the message names the fix (``batched_render=False``, fewer or smaller cameras)."""


def available(render_backend: str | None = "auto") -> bool:
    """Whether batched group rendering can run here: a CUDA device torch sees, and a ManiSkill render
    backend that renders on it ("auto", or "gpu", "cuda", "sapien_cuda", each with an optional ":N")."""
    from fastrecord.render.device import on_cuda

    if render_backend not in (None, "auto") and not on_cuda(render_backend):
        return False
    from fastrecord.system import torch_sees_cuda

    return torch_sees_cuda()


def use_batched(wanted: bool | None, *, num_envs: int, render_backend: str | None, render_mode: str | None,
                videos: bool, substeps: bool, flag: str, instead: str) -> bool:
    """Whether a vector env of ``num_envs`` CPU envs renders its videos in one batch.

    ``wanted``: None chooses (more than one env, videos to record, ``render_mode="rgb_array"``, a CUDA
    render backend, no ``render_substeps``); True requires it (a ValueError naming ``flag`` and the
    choices ``instead`` where it cannot run); False never. Substep frames are each sub-env's own renders
    (`fastrecord.substeps.SubstepFrames`), so they exclude a batched render."""
    if wanted is False or not videos:
        return False
    if substeps:
        if wanted:
            raise ValueError(
                f"{flag} renders once a step and render_substeps wants a frame after every physics substep, "
                f"which each sub-env renders itself; drop one of them"
            )
        return False
    usable = available(render_backend)
    if wanted is None:
        return num_envs > 1 and render_mode == "rgb_array" and usable
    if not usable:
        from fastrecord.system import torch_sees_cuda

        why = "" if torch_sees_cuda() else " (torch sees no CUDA device)"
        raise ValueError(
            f"{flag} renders on a CUDA device, and here render_backend={render_backend!r}{why}; use {instead}"
        )
    if render_mode != "rgb_array":
        raise ValueError(f"{flag} renders the envs' videos, which needs render_mode='rgb_array' (got {render_mode!r})")
    return True
