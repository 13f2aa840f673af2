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
"""

from __future__ import annotations


def available(render_backend: str | None = "auto") -> bool:
    """Whether batched group rendering can run here: a CUDA device torch sees, and a ManiSkill render
    backend that renders on it ("auto", "gpu", "cuda[:N]", "sapien_cuda")."""
    if render_backend not in (None, "auto", "gpu", "sapien_cuda") and not str(render_backend).startswith("cuda"):
        return False
    import torch

    return torch.cuda.is_available()
