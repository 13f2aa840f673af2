"""Benchmark phase ``imageobs``: trajectories with image observations (issue 9).

  imageobs  ManiSkill's rgb observation (state leaves + ``sensor_data/base_camera/rgb``, ``imageobs_size``
            square frames of the content env's sensor camera, or gradients), trajectory only (keep all, no
            video), envs finishing at different steps: per-env lengths drawn by the env at each reset
            (``imageobs_episode_steps / 2 .. imageobs_episode_steps``) and every third env succeeding
            (terminating) early; only the finished envs are reset, with new seeds. The same source, seeds
            and frames go through ManiSkill's ``RecordEpisode(save_trajectory=True, save_video=False)``
            and ``fastrecord.RecordEpisode(save_trajectory=True, save_video=False)``, one after the other
            in this process. Each: env-steps/s over ``imageobs_steps`` parallel steps up to everything on
            disk (``close()`` included), the stepping thread's own milliseconds a step, set-up seconds
            (construction + first reset), peak host RSS (+ writer processes' PSS) and device memory, file
            size. The frames stay on the source's device (CUDA tensors on a GPU machine). fastrecord runs
            its default ``trajectory_writers`` (the table says what it resolved to); each count of
            ``imageobs_writers_sweep`` runs beside it, in rows labelled "tuned" (not the default). With
            ``imageobs_busy_cores`` (default 1), each repeat also runs the default pair beside that many
            other processes spinning (`benchmarks.load.CpuLoad`: a busy machine), so the table has both
            ratios, idle and busy, from one run; each ratio also with the recorder's set-up (construction
            + first reset) inside the timing.

Returns a dict that `benchmarks.bench` stores under ``imageobs``.
"""

from __future__ import annotations

import importlib
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.config import BenchConfig
from benchmarks.load import CpuLoad
from benchmarks.memory import ChildrenPss, MemoryMonitor, rss
from fastrecord.testing import BatchedDoubleEnv, gradient_clips, make_bank, sensor_clips


def imageobs_lengths(max_steps: int) -> Callable[[int, int], int]:
    """``f(env, episode_seed) -> length`` in ``max_steps // 2 .. max_steps``, drawn by the env at each reset."""
    lo = max(1, max_steps // 2)

    def length(env_idx: int, seed: int) -> int:
        return lo + (env_idx * 7 + seed * 13) % (max_steps - lo + 1)

    return length


def imageobs_env(num_envs: int, bank: np.ndarray, device: torch.device) -> BatchedDoubleEnv:
    """The source: rgb observations from ``bank`` (episodes as long as its clips at most), per-env lengths
    from the env, every third env succeeding at two thirds of the longest episode."""
    steps = bank.shape[1] - 1
    success = [max(1, (2 * steps) // 3) if e % 3 == 2 else 0 for e in range(num_envs)]
    return BatchedDoubleEnv(num_envs=num_envs, max_episode_steps=steps, device=device, bank=bank, obs_mode="rgb",
                            episode_lengths=imageobs_lengths(steps), success_step=success)


def imageobs_loop(env: Any, num_envs: int, device: torch.device, steps: int) -> int:
    """``steps`` parallel steps; the envs that finished (terminated or truncated) are reset alone, with new
    seeds. Returns the episodes finished."""
    action = torch.zeros(num_envs, 3, device=device)
    finished, seed = 0, num_envs
    for _ in range(steps):
        _, _, term, trunc, _ = env.step(action)
        done = torch.nonzero(term | trunc).reshape(-1).cpu().numpy()
        if len(done):
            env.reset(seed=list(range(seed, seed + len(done))), options={"env_idx": done})
            seed += len(done)
            finished += len(done)
    return finished


def _measure(make: Callable[[], Any], src: BatchedDoubleEnv, steps: int, device: torch.device,
             pids: Callable[[], list[int]] = list) -> dict[str, Any]:
    """One recorder over ``steps`` parallel steps: set-up, loop, close (everything on disk), memory."""
    rss0 = rss()
    with MemoryMonitor(device) as mon, ChildrenPss(pids) as writers:
        t0 = time.perf_counter()
        env = make()
        env.reset(seed=list(range(src.num_envs)))
        setup = time.perf_counter() - t0
        busy0 = src.busy_seconds
        t1 = time.perf_counter()
        finished = imageobs_loop(env, src.num_envs, src.device, steps)
        loop = time.perf_counter() - t1
        own = loop - (src.busy_seconds - busy0)
        t2 = time.perf_counter()
        env.close()
        close = time.perf_counter() - t2
    env_steps = steps * src.num_envs
    mem = mon.peaks()
    mem["writers_pss_gib"] = writers.peak / 2**30
    return dict(setup_seconds=setup, loop_seconds=loop, close_seconds=close, seconds=loop + close,
                env_steps=env_steps, episodes_finished=finished,
                env_steps_per_s=env_steps / (loop + close), loop_env_steps_per_s=env_steps / loop,
                env_steps_per_s_with_setup=env_steps / (setup + loop + close),
                recorder_ms_per_step=1000 * own / steps, memory=mem, host_rss_growth_gib=(mon.peak_rss - rss0) / 2**30)


def _file_stats(h5: Path) -> dict[str, Any]:
    import h5py

    out: dict[str, Any] = dict(file_mib=h5.stat().st_size / 2**20)
    with h5py.File(h5, "r") as f:
        out["episodes_in_file"] = len(f)
        rgb = [f[k]["obs/sensor_data/base_camera/rgb"] for k in f]
        raw = sum(d.size for d in rgb)
        out["rgb_stored_fraction"] = sum(d.id.get_storage_size() for d in rgb) / max(raw, 1)
        out["rgb_frames"] = sum(d.shape[0] for d in rgb)
        out["rgb_chunks"] = list(rgb[0].chunks) if rgb and rgb[0].chunks else None
        out["rgb_compression"] = f"{rgb[0].compression}:{rgb[0].compression_opts}" if rgb else None
    return out


def phase_imageobs(cfg: BenchConfig, device: torch.device, out: Path) -> dict[str, Any]:
    """ManiSkill's and fastrecord's RecordEpisode (trajectory only) over the same rgb-observation episodes,
    ``imageobs_repeats`` runs each, interleaved; the median run of each and their ratios. fastrecord runs
    with ``cfg.trajectory_writers`` (None: its default, resolved by the recorder and reported), then with
    each count of ``imageobs_writers_sweep`` (tuned runs, reported under ``sweep``, not as the default).
    With ``cfg.imageobs_busy_cores``, each repeat also runs the first pair beside that many spinning
    processes (reported under ``busy``, with the cores they held)."""
    from fastrecord.options import usable_cores

    size, steps, frames = cfg.imageobs_size, cfg.imageobs_steps, cfg.imageobs_episode_steps + 1
    t0 = time.perf_counter()
    if cfg.imageobs_content == "maniskill":
        clips = sensor_clips(cfg.content_env, cfg.clips, frames, size, "gpu" if device.type == "cuda" else "cpu")
    else:
        clips = gradient_clips(cfg.clips, frames, size, size)
    bank = make_bank(clips, cfg.variants)
    res: dict[str, Any] = dict(num_envs=cfg.num_envs, size=size, content=cfg.imageobs_content, steps=steps,
                               episode_steps=[max(1, cfg.imageobs_episode_steps // 2), cfg.imageobs_episode_steps],
                               device=str(device), trajectory_writers=cfg.trajectory_writers, cores=usable_cores(),
                               trajectory_compression=cfg.trajectory_compression,
                               source_seconds=time.perf_counter() - t0)
    recorders = [("maniskill", None), ("fastrecord", cfg.trajectory_writers)]
    recorders += [(f"fastrecord_writers_{n}", n) for n in cfg.imageobs_writers_sweep]
    # (key prefix, spinning processes, recorders): idle, then the default pair on a busy machine
    conditions = [("", 0, recorders)] + (
        [("busy_", cfg.imageobs_busy_cores, recorders[:2])] if cfg.imageobs_busy_cores else []
    )
    held: list[float] = []
    # interleaved (a loaded machine slows all alike): each repeat runs every recorder once in each condition
    for rep in range(cfg.imageobs_repeats):
        for prefix, cores, names in conditions:
            with CpuLoad(cores) as load:
                for name, writers in names:
                    r = _run_recorder(
                        cfg, bank, device, out / f"imageobs_{prefix}{name}_{rep}", name == "maniskill", writers
                    )
                    res.setdefault(f"{prefix}{name}_runs", []).append(r)
            if cores:
                held.append(load.cores_held)
    res.update(_medians(res, [name for name, _ in recorders]))
    res.update(_ratios(res, "fastrecord"))
    res["default_writers"] = res["fastrecord"]["writers_started"]
    res["same_episodes"] = res["fastrecord"]["episodes_in_file"] == res["maniskill"]["episodes_in_file"]
    res["sweep"] = [
        dict(trajectory_writers=n, run=res[f"fastrecord_writers_{n}"], **_ratios(res, f"fastrecord_writers_{n}"))
        for n in cfg.imageobs_writers_sweep
    ]
    if cfg.imageobs_busy_cores:
        busy = {k[len("busy_"):]: res.pop(k) for k in list(res) if k.startswith("busy_")}
        res["busy"] = dict(
            cores=cfg.imageobs_busy_cores,
            cores_held=held,
            **busy,
            **_medians(busy, ["maniskill", "fastrecord"]),
            **_ratios(busy, "fastrecord"),
        )
    return res


def _run_recorder(cfg: BenchConfig, bank: np.ndarray, device: torch.device, d: Path, maniskill: bool,
                  writers: int | None) -> dict[str, Any]:
    """One recorder (ManiSkill's, or fastrecord's with ``writers``) over a fresh source: `_measure`, the
    file's figures, the writer count fastrecord started; the files are removed after."""
    from fastrecord import RecordEpisode

    ms_record = importlib.import_module("mani_skill.utils.wrappers.record")
    src = imageobs_env(cfg.num_envs, bank, device)
    holder: list[Any] = []

    def make() -> Any:
        if maniskill:
            return ms_record.RecordEpisode(src, str(d), save_trajectory=True, trajectory_name="traj", save_video=False)
        env = RecordEpisode(src, str(d), save_trajectory=True, trajectory_name="traj", save_video=False,
                            trajectory_writers=writers, trajectory_compression=cfg.trajectory_compression)
        holder.append(env)
        return env

    def pids() -> list[int]:
        sink = holder[0].recorder.trajectory if holder else None
        return sink.writer.pids if sink is not None and sink.writer is not None else []

    r = _measure(make, src, cfg.imageobs_steps, device, pids)
    r.update(_file_stats(d / "traj.h5"))
    if holder:
        r["writers_started"] = holder[0].recorder.trajectory.writers  # the count the recorder chose or was given
    shutil.rmtree(d, ignore_errors=True)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return r


def _medians(res: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """The median run (by env-steps/s to everything on disk) of each name's ``res[f"{name}_runs"]``."""
    return {name: rs[int(np.argsort([r["env_steps_per_s"] for r in rs])[len(rs) // 2])]
            for name in names if (rs := res[f"{name}_runs"])}


def _ratios(res: dict[str, Any], name: str) -> dict[str, Any]:
    """``name``'s runs against ManiSkill's of the same repeats, pair by pair: the ratios to everything on
    disk (``ratios``, median ``ratio``) and with the recorder's set-up inside the timing (``*_with_setup``)."""
    out: dict[str, Any] = {}
    for key, rate in (("", "env_steps_per_s"), ("_with_setup", "env_steps_per_s_with_setup")):
        ratios = [f[rate] / m[rate] for m, f in zip(res["maniskill_runs"], res[f"{name}_runs"])]
        out[f"ratios{key}"] = ratios
        out[f"ratio{key}"] = float(np.median(ratios))
    return out


def table_rows(r: dict[str, Any]) -> list[str]:
    x = r.get("imageobs")
    if not x:
        return []
    ms, fr = x["maniskill"], x["fastrecord"]

    def mem(m: dict[str, Any]) -> str:
        text = f"host {m['host_rss_gib']:.2f} GiB RSS"
        if m.get("writers_pss_gib"):
            text += f" + writers {m['writers_pss_gib']:.2f} GiB PSS"
        if "device_torch_peak_gib" in m:
            text += f", device {m['device_torch_peak_gib']:.2f} GiB (torch)"
        return text

    def row(label: str, m: dict[str, Any]) -> str:
        return (
            f"| imageobs, {label}, {head} | {m['env_steps_per_s']:,.0f} env-steps/s to everything on disk "
            f"({m['episodes_in_file']} episodes, {m['file_mib']:.1f} MiB, rgb stored {m['rgb_stored_fraction']:.0%} of raw); "
            f"stepping thread {m['recorder_ms_per_step']:.1f} ms/step; close {m['close_seconds']:.2f} s; "
            f"set-up {m['setup_seconds']:.2f} s; peak {mem(m['memory'])} |"
        )

    def runs(v: list[float]) -> str:
        return ", ".join(f"{a:.2f}" for a in v)

    head = (f"{x['num_envs']} envs x {x['size']}x{x['size']} rgb + state ({x['content']}), episodes of "
            f"{x['episode_steps'][0]}-{x['episode_steps'][1]} steps, partial resets")
    if x["trajectory_writers"] is None:
        chosen = f"default: trajectory_writers=None -> {x['default_writers']} (chosen for {x['cores']} usable cores, image leaves)"
    else:
        chosen = f"set: trajectory_writers={x['trajectory_writers']} (not the default)"
    def ratio(v: dict[str, Any]) -> str:
        return (
            f"{v['ratio']:.2f}x to everything on disk (runs: {runs(v['ratios'])}); {v['ratio_with_setup']:.2f}x with "
            f"the recorder's set-up inside the timing (runs: {runs(v['ratios_with_setup'])})"
        )

    rows = [
        row("ManiSkill RecordEpisode", ms),
        row(f"fastrecord RecordEpisode, {chosen}, {x['trajectory_compression']}", fr),
        f"| imageobs: ratio fastrecord / ManiSkill ({chosen}) | {ratio(x)} |",
    ]
    b = x.get("busy")
    if b:
        load = (
            f"busy: {b['cores']} other process(es) spinning (held {min(b['cores_held']):.2f}-{max(b['cores_held']):.2f} "
            f"of {x['cores']} usable cores)"
        )
        rows += [row(f"{load}, ManiSkill RecordEpisode", b["maniskill"]),
                 row(f"{load}, fastrecord RecordEpisode, {chosen}, {x['trajectory_compression']}", b["fastrecord"]),
                 f"| imageobs, {load}: ratio fastrecord / ManiSkill ({chosen}) | {ratio(b)} |"]
    for s in x.get("sweep", []):
        n = s["trajectory_writers"]
        rows.append(row(f"tuned: trajectory_writers={n} (not the default), {x['trajectory_compression']}", s["run"]))
        rows.append(
            f"| imageobs, tuned: ratio fastrecord (trajectory_writers={n}, not the default) / ManiSkill | {ratio(s)} |"
        )
    return rows
