"""Checked by mypy (scripts/lint.sh; pyproject's [tool.mypy] files), never run: a type checker sees the
parameters of the public entry points.

Each call marked ``# type: ignore[code]`` is one the checker must refuse. With ``warn_unused_ignores``, a
checker that stopped seeing the parameters (a wrapper back to ``*args, **kwargs``, say) fails on the
ignore it no longer needs.
"""

from __future__ import annotations

import gymnasium as gym

from fastrecord import (
    RecordEpisode,
    RecordOptions,
    RecordVectorEpisode,
    ReplaySummary,
    make_eval_envs,
    replay_trajectories,
)


def _never_called(env: gym.Env, venv: gym.vector.VectorEnv) -> None:
    rec: RecordEpisode = RecordEpisode(env, "out", True, "name", keep="success", video_crf=30)
    vec: RecordVectorEpisode = RecordVectorEpisode(venv, "out", save_video=False, if_exists="resume")
    RecordEpisode(env, "out", save_videos=True)  # type: ignore[call-arg]
    RecordEpisode(env, "out", keep="sometimes")  # type: ignore[arg-type]
    RecordEpisode(env, "out", if_exists="replace")  # type: ignore[arg-type]
    RecordVectorEpisode(venv, "out", video_crf="high")  # type: ignore[arg-type]
    # ManiSkill's 15 parameters may be positional, fastrecord's (keep, ...) not
    RecordEpisode(env, "out", True, None, True, False, True, None, None, True, True, True, 30, False, False, None,
                  None, "all")  # type: ignore[call-arg]
    RecordOptions(video_fps="30")  # type: ignore[arg-type]
    envs: gym.vector.VectorEnv = make_eval_envs("PickCube-v1", 2, "physx_cpu", {}, {"obs_horizon": 1})
    make_eval_envs("PickCube-v1", "2", "physx_cpu", {}, {})  # type: ignore[arg-type]
    make_eval_envs("PickCube-v1", 2, "physx_cpu", {}, {}, None, [], "all")  # type: ignore[call-arg]
    summary: ReplaySummary = replay_trajectories("demo.h5", "out", obs_mode="rgb", num_envs=4, save_video=False)
    replay_trajectories("demo.h5", obs=1)  # type: ignore[call-arg]
    replay_trajectories("demo.h5", num_envs="4")  # type: ignore[arg-type]
    replay_trajectories("demo.h5", "out", "rgb")  # type: ignore[call-arg]
    del rec, vec, envs, summary
