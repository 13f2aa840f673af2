"""The fresh processes `benchmarks/bench_whole.py` launches for the jobs it writes itself: ManiSkill's ways of
recording and evaluating, and the diffusion-policy baseline's eval loop over `fastrecord.make_eval_envs`.

Each program is what a user would write (its imports first, then the envs, a loop, close), with phase stamps
(`fastrecord.system.stamp`: nothing without ``FASTRECORD_TIMELINE``) at the same points as `fastrecord record`:
``imported`` (imports done, env creation starts), ``env_ready``, ``reset``, ``first_step``, ``loop_end``,
``closed``. Run: ``python -m benchmarks.whole_children JOB JSON_ARGS``.

- ``record_maniskill``: N ManiSkill ``RecordEpisode`` envs (CPU simulation) in a gymnasium ``AsyncVectorEnv``
  with the forkserver context, as ManiSkill's baselines make theirs (the default, fork, fails with a GPU
  render backend: the dummy env gymnasium builds in the caller initialises CUDA, which a forked sub-env
  cannot use), each env's video and trajectory in a folder of its own (in one folder their files overwrite
  each other's); ``video=False``: the same loop with no recorder at all.
- ``eval_maniskill``: ManiSkill's diffusion-policy ``make_eval_envs`` CPU branch (examples/baselines/
  diffusion_policy/diffusion_policy/make_env.py): ``gym.make(..., reconfiguration_freq=1)``, FrameStack,
  ``CPUGymWrapper(ignore_terminations=True, record_metrics=True)``, ManiSkill's ``RecordEpisode`` in sub-env 0
  only (``video=True``, its default) and ``AsyncVectorEnv(context="forkserver")``.
- ``eval_fastrecord``: the same loop over ``fastrecord.make_eval_envs`` (every env's video).
"""

from __future__ import annotations

import atexit
import json
import sys
from pathlib import Path
from typing import Any

from fastrecord.system import stamp, use_lavapipe_if_no_gpu


def _env_kwargs(a: dict[str, Any]) -> dict[str, Any]:
    return dict(obs_mode="state", render_mode="rgb_array", sim_backend="physx_cpu", render_backend=a["render"],
                human_render_camera_configs=dict(width=a["size"], height=a["size"]),
                max_episode_steps=a["episode_steps"])


def _video_writer() -> None:
    """Where imageio has no ffmpeg (the GPU machine's kit), ManiSkill's ``images_to_video`` through PyAV with
    its own settings (`benchmarks.phases_record.pyav_images_to_video`, as `fastrecord bench` does)."""
    try:
        import imageio_ffmpeg  # noqa: F401
    except ImportError:
        from mani_skill.utils.wrappers import record as ms_record

        from benchmarks.phases_record import pyav_images_to_video

        ms_record.images_to_video = pyav_images_to_video


class _RecordThunk:
    """One sub-env of ManiSkill's record way (a class, so that any multiprocessing context can send it)."""

    def __init__(self, a: dict[str, Any], i: int) -> None:
        self.a, self.i = a, i

    def __call__(self) -> Any:
        import gymnasium as gym
        import mani_skill.envs  # noqa: F401 - registers the tasks
        from mani_skill.utils.wrappers import CPUGymWrapper, RecordEpisode

        use_lavapipe_if_no_gpu()
        env = CPUGymWrapper(gym.make(self.a["env_id"], **_env_kwargs(self.a)))
        if self.a["video"]:
            _video_writer()
            env = RecordEpisode(env, output_dir=str(Path(self.a["out"]) / f"env{self.i}"), save_trajectory=True,
                                save_video=True, source_type="bench", source_desc="bench_whole")
        return env


def record_maniskill(a: dict[str, Any]) -> None:
    """Episodes of ``episode_steps`` random steps, every env reset together with its own seeds, until
    ``episodes`` episodes have ended (rounded up to whole batches of ``num_envs``)."""
    import gymnasium as gym
    import mani_skill.envs  # noqa: F401
    import numpy as np

    stamp("imported")
    n = a["num_envs"]
    envs = gym.vector.AsyncVectorEnv([_RecordThunk(a, i) for i in range(n)], context="forkserver",
                                     autoreset_mode=gym.vector.AutoresetMode.DISABLED)
    stamp("env_ready")
    envs.action_space.seed(0)
    done, seed = 0, 0
    while done < a["episodes"]:
        envs.reset(seed=list(range(seed, seed + n)))
        seed += n
        stamp("reset")
        for _ in range(a["episode_steps"]):
            envs.step(envs.action_space.sample())
            stamp("first_step")
        done += n
    stamp("loop_end")
    envs.close()
    stamp("closed")
    del np


class _EvalThunk:
    """One sub-env of ManiSkill's baseline eval (its ``cpu_make_env`` thunk, as a picklable class)."""

    def __init__(self, a: dict[str, Any], seed: int, video_dir: str | None) -> None:
        self.a, self.seed, self.video_dir = a, seed, video_dir

    def __call__(self) -> Any:
        import gymnasium as gym
        import mani_skill.envs  # noqa: F401
        from mani_skill.utils.wrappers import CPUGymWrapper, FrameStack, RecordEpisode

        use_lavapipe_if_no_gpu()
        env = gym.make(self.a["env_id"], reconfiguration_freq=1, **_eval_kwargs(self.a))
        env = FrameStack(env, num_stack=self.a["obs_horizon"])
        env = CPUGymWrapper(env, ignore_terminations=True, record_metrics=True)
        if self.video_dir:
            _video_writer()
            env = RecordEpisode(env, output_dir=self.video_dir, save_trajectory=False, info_on_video=True,
                                source_type="diffusion_policy", source_desc="diffusion_policy evaluation rollout")
        env.action_space.seed(self.seed)
        env.observation_space.seed(self.seed)
        return env


def _eval_kwargs(a: dict[str, Any]) -> dict[str, Any]:
    return {**_env_kwargs(a), "control_mode": "pd_joint_delta_pos"}


def _eval_loop(envs: Any, a: dict[str, Any]) -> None:
    """The baseline's ``evaluate`` shape: reset once, then ``steps`` steps (the envs reset themselves at
    truncation), random actions drawn up front."""
    import numpy as np

    rng = np.random.default_rng(0)
    actions = rng.uniform(-1, 1, size=(a["steps"], *envs.action_space.shape)).astype(np.float32)
    envs.reset(seed=0)
    stamp("reset")
    for i in range(a["steps"]):
        envs.step(actions[i])
        stamp("first_step")
    stamp("loop_end")
    envs.close()
    stamp("closed")
    atexit.register(stamp, "atexit_first")  # atexit runs last-registered first: before the libraries' handlers


def _exit_stamps() -> None:
    """Registered first, so run last of the exit handlers: ``atexit_last`` -> exit is the interpreter's own
    teardown (modules, SAPIEN's and CUDA's destructors); ``closed`` -> ``atexit_first`` the join of non-daemon
    threads; ``atexit_first`` -> ``atexit_last`` the libraries' exit handlers (multiprocessing's joins)."""
    atexit.register(stamp, "atexit_last")


def eval_maniskill(a: dict[str, Any]) -> None:
    _exit_stamps()
    import gymnasium as gym
    import mani_skill.envs  # noqa: F401
    import torch  # noqa: F401 - the baseline's script imports it (its agent)

    stamp("imported")
    n = a["num_envs"]
    video = a["out"] if a["video"] else None
    envs = gym.vector.AsyncVectorEnv([_EvalThunk(a, seed, video if seed == 0 else None) for seed in range(n)],
                                     context="forkserver")
    stamp("env_ready")
    _eval_loop(envs, a)


def eval_fastrecord(a: dict[str, Any]) -> None:
    _exit_stamps()
    if a.get("prestart"):  # the script starts fastrecord's forkserver first: its preload overlaps the imports
        from fastrecord.workers import start_forkserver

        start_forkserver()
    import gymnasium as gym  # noqa: F401 - the baseline's script's imports, in its order
    import torch  # noqa: F401

    from fastrecord import make_eval_envs  # the one-line switch from diffusion_policy.make_env

    stamp("imported")
    sweep = {"envs_per_process": a["envs_per_process"]} if "envs_per_process" in a else {}  # bench_whole's sweep only
    envs = make_eval_envs(a["env_id"], a["num_envs"], "physx_cpu", _eval_kwargs(a), dict(obs_horizon=a["obs_horizon"]),
                          video_dir=a["out"] if a["video"] else None, **sweep)
    stamp("env_ready")
    _eval_loop(envs, a)


JOBS = {"record_maniskill": record_maniskill, "eval_maniskill": eval_maniskill, "eval_fastrecord": eval_fastrecord}


if __name__ == "__main__":
    use_lavapipe_if_no_gpu()
    JOBS[sys.argv[1]](json.loads(sys.argv[2]))
