"""Benchmark phase ``realenv``: a real ManiSkill env (CPU simulation, GPU rendering where CUDA is present),
bare step+render beside fastrecord's and ManiSkill's recorders, and where the recorder's per-step time goes.

Returns a dict that `benchmarks.bench` stores under ``realenv``.
"""

from __future__ import annotations

import importlib
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch

from benchmarks.config import BenchConfig, encoder_workers
from benchmarks.phases_record import pyav_images_to_video
from benchmarks.profiling import start_pyspy, stop_pyspy, summarize_profile


def phase_realenv(cfg: BenchConfig, device: torch.device, out: Path) -> dict[str, Any]:
    """One real env (``content_env``, CPU simulation): step+render alone, fastrecord's video, video +
    trajectory, and ManiSkill's video, each in ms a step over ``real_env_steps`` steps."""
    import mani_skill.envs  # noqa: F401
    ms_record = importlib.import_module("mani_skill.utils.wrappers.record")

    from fastrecord import RecordEpisode

    render = "gpu" if device.type == "cuda" else "cpu"
    steps = cfg.episode_steps
    kw = dict(num_envs=1, obs_mode="state", render_mode="rgb_array", sim_backend="physx_cpu", render_backend=render,
              human_render_camera_configs=dict(width=cfg.width, height=cfg.height), max_episode_steps=steps)

    calls: dict[str, list[float]] = {}

    def loop(env: Any, render_each: bool, tag: str | None = None) -> float:
        env.action_space.seed(0)
        env.reset(seed=0)
        steps_t: list[float] = []
        resets_t: list[float] = []
        t0 = time.perf_counter()
        for i in range(cfg.real_env_steps):
            a = env.action_space.sample()
            s0 = time.perf_counter()
            _, _, term, trunc, _ = env.step(a)
            if render_each:
                env.render()
            steps_t.append(time.perf_counter() - s0)
            if bool(np.asarray(torch.as_tensor(term | trunc).cpu()).any()):
                r0 = time.perf_counter()
                env.reset()
                resets_t.append(time.perf_counter() - r0)
        total = time.perf_counter() - t0
        if tag:
            calls[f"{tag}_step_ms_p50"] = 1000 * statistics.median(steps_t)
            calls[f"{tag}_reset_ms_mean"] = 1000 * float(np.mean(resets_t)) if resets_t else 0.0
        return total

    res: dict[str, Any] = dict(env_id=cfg.content_env, render_backend=render, steps=cfg.real_env_steps,
                               size=[cfg.height, cfg.width], episode_steps=steps)
    env = gym.make(cfg.content_env, **kw)
    loop(env, True)  # warm-up (shader compilation, first render)
    res["bare_step_render_ms"] = 1000 * loop(env, True, "bare") / cfg.real_env_steps
    env.close()
    for name, save_traj in (("fastrecord_video", False), ("fastrecord_video_traj", True)):
        env = RecordEpisode(
            gym.make(cfg.content_env, **kw),
            str(out / name),
            save_trajectory=save_traj,
            video_codec=cfg.codec,
            video_crf=cfg.crf,
            video_preset=cfg.preset,
            video_workers=encoder_workers(cfg),
        )
        loop(env, False)
        env.recorder.wait_until_done()
        prof = start_pyspy(out / f"pyspy_{name}.txt", rate=500) if cfg.profile and name == "fastrecord_video" else None
        t = loop(env, False, name)
        stop_pyspy(prof)
        if prof is not None:
            res["profile_" + name] = summarize_profile(out / f"pyspy_{name}.txt", top=20)
        t0 = time.perf_counter()
        env.recorder.wait_until_done()
        drain = time.perf_counter() - t0
        env.close()
        res[f"{name}_ms"] = 1000 * t / cfg.real_env_steps
        res[f"{name}_drain_s"] = drain
        res[f"{name}_slowdown"] = res[f"{name}_ms"] / res["bare_step_render_ms"] - 1
    res.update(realenv_diag(cfg, kw, loop, out, device))
    try:
        import imageio_ffmpeg  # noqa: F401
    except ImportError:
        ms_record.images_to_video = pyav_images_to_video
    env = ms_record.RecordEpisode(gym.make(cfg.content_env, **kw), str(out / "maniskill_real"), save_trajectory=False)
    loop(env, False)
    t = loop(env, False, "maniskill")
    env.close()
    res.update(calls)
    res["maniskill_video_ms"] = 1000 * t / cfg.real_env_steps
    res["maniskill_video_slowdown"] = res["maniskill_video_ms"] / res["bare_step_render_ms"] - 1
    shutil.rmtree(out / "maniskill_real", ignore_errors=True)
    for name in ("fastrecord_video", "fastrecord_video_traj"):
        shutil.rmtree(out / name, ignore_errors=True)
    return res


def realenv_diag(cfg: BenchConfig, kw: dict, loop: Any, out: Path, device: torch.device) -> dict[str, Any]:
    """Where the recorder's per-step time goes on a real env: EpisodeBuffer.step's host time as is,
    then again after a device sync (so it cannot include waiting for earlier GPU work)."""
    from fastrecord import RecordEpisode
    from fastrecord.buffer import EpisodeBuffer

    orig = EpisodeBuffer.step
    res: dict[str, Any] = {}
    for variant in ("as_is", "contiguous"):
        times: list[float] = []
        strided: set[str] = set()

        def step(
            self: Any, data: Any, restart: Any = None, _v: str = variant,
            _strided: set[str] = strided, _times: list[float] = times,
        ) -> None:
            t = time.perf_counter()
            if _v == "contiguous":
                orig(self, {k: v.contiguous() for k, v in data.items()}, restart)
            else:
                _strided.update(k for k, v in data.items() if not v.is_contiguous())
                orig(self, data, restart)
            _times.append(time.perf_counter() - t)

        EpisodeBuffer.step = step
        try:
            env = RecordEpisode(
                gym.make(cfg.content_env, **kw),
                str(out / "diag"),
                save_trajectory=False,
                video_codec=cfg.codec,
                video_crf=cfg.crf,
                video_preset=cfg.preset,
                video_workers=encoder_workers(cfg),
            )
            loop(env, False)
            times.clear()
            t = loop(env, False, f"diag_{variant}")
            env.close()
        finally:
            EpisodeBuffer.step = orig
        res[f"diag_{variant}_ms_per_step"] = 1000 * t / cfg.real_env_steps
        res[f"diag_{variant}_buffer_step_ms_p50"] = 1000 * statistics.median(times)
        if variant == "as_is":
            res["diag_strided_leaves"] = sorted(strided)
    shutil.rmtree(out / "diag", ignore_errors=True)
    return res

