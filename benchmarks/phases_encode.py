"""Benchmark phases of the encoders and the device work, apart from any env.

  ceiling   one encoder process's frames/s (x workers = the ceiling), and all workers measured together
  quality   PSNR against the source frames and parallel frames/s for each ``sweep`` setting
  micro     device time of the ring write and of the yuv420p conversion

Each phase returns a dict that `benchmarks.bench` stores under its name.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.config import BenchConfig
from fastrecord.testing import psnr


def video_settings(cfg: BenchConfig, preset: str | None = None, crf: int | None = None, threads: int = 1) -> Any:
    """fastrecord's `VideoSettings` of the run, or another preset / crf (the quality sweep)."""
    from fastrecord.video import VideoSettings, resolve_codec

    return VideoSettings(codec=resolve_codec(cfg.codec), crf=cfg.crf if crf is None else crf,
                         preset=preset or cfg.preset, threads=threads)


def yuv_host(frames: np.ndarray) -> Any:
    """``[T, H, W, 3]`` uint8 frames as host yuv420p (`Yuv420Frames`), converted where fastrecord converts."""
    from fastrecord.video.yuv import Yuv420Frames, rgb_to_yuv420p

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    return Yuv420Frames(rgb_to_yuv420p(torch.from_numpy(frames).to(dev)).cpu().numpy())


def parallel_encode(jobs: list[tuple[Path, np.ndarray]], settings: Any, workers: int, pool: Any) -> float:
    """Encode ``jobs`` with ``workers`` threads each driving one encoder process; returns wall seconds."""
    from fastrecord.video import encode_mp4
    from fastrecord.workers import WorkerPool

    t0 = time.perf_counter()
    with WorkerPool(lambda job: encode_mp4(job[0], job[1], settings, pool=pool), num_workers=workers,
                    max_pending=len(jobs) + 1, name="bench-encode") as wp:
        for job in jobs:
            wp.submit(job)
        wp.wait_until_done()
    return time.perf_counter() - t0



def phase_ceiling(cfg: BenchConfig, bank: np.ndarray, workers: int, out: Path) -> dict[str, Any]:
    from fastrecord.video import EncoderProcessPool

    settings = video_settings(cfg)
    n_eps = cfg.ceiling_episodes or 2 * workers
    episodes = [bank[i % len(bank)] for i in range(n_eps)]
    yuv = [yuv_host(e) for e in episodes]
    frames_per = episodes[0].shape[0]
    res: dict[str, Any] = {"settings": asdict(settings), "episode_frames": frames_per}
    with EncoderProcessPool(max_processes=workers, idle_timeout=0) as pool:
        pool.start(workers)
        parallel_encode([(out / "warm.mp4", yuv[0])], settings, 1, pool)  # first use of the pool
        for fmt, src in (("yuv420p", yuv), ("rgb24", episodes)):
            k = min(len(src), max(2, workers // 4))
            secs = parallel_encode([(out / f"one_{fmt}_{i}.mp4", src[i]) for i in range(k)], settings, 1, pool)
            res[f"one_process_fps_{fmt}"] = k * frames_per / secs
        secs = parallel_encode([(out / f"all_{i}.mp4", yuv[i]) for i in range(n_eps)], settings, workers, pool)
        res["all_processes_fps_yuv420p"] = n_eps * frames_per / secs
    res["workers"] = workers
    res["ceiling_fps"] = res["one_process_fps_yuv420p"] * workers
    for f in out.glob("*.mp4"):
        f.unlink()
    return res


def phase_quality(cfg: BenchConfig, bank: np.ndarray, workers: int, out: Path) -> dict[str, Any]:
    from fastrecord.video import EncoderProcessPool, decode_mp4

    n_eps = cfg.sweep_episodes or 2 * workers
    episodes = [bank[i % len(bank)] for i in range(n_eps)]
    yuv = [yuv_host(e) for e in episodes]
    rows = []
    with EncoderProcessPool(max_processes=workers, idle_timeout=0) as pool:
        pool.start(workers)
        parallel_encode(
            [(out / f"warm{i}.mp4", yuv[i % len(yuv)]) for i in range(workers)], video_settings(cfg), workers, pool
        )
        for spec in cfg.sweep:
            preset, crf = spec.split(":")
            s = video_settings(cfg, preset=preset, crf=int(crf))
            jobs = [(out / f"q_{preset}_{crf}_{i}.mp4", yuv[i]) for i in range(n_eps)]
            secs = parallel_encode(jobs, s, workers, pool)
            frames = sum(len(e) for e in episodes)
            check = list(range(min(len(bank), n_eps)))
            q = [psnr(decode_mp4(jobs[i][0]), episodes[i]) for i in check]
            size = sum(p.stat().st_size for p, _ in jobs)
            rows.append(dict(preset=preset, crf=int(crf), psnr_db=float(np.mean(q)), parallel_fps=frames / secs,
                             kbit_per_frame=size * 8 / 1000 / frames))
            for p, _ in jobs:
                p.unlink()
    return {"episodes": n_eps, "rows": rows}



def phase_micro(cfg: BenchConfig, device: torch.device) -> dict[str, Any]:
    """Device time per step of the ring write, and of the yuv420p conversion per episode batch."""
    from fastrecord.buffer import EpisodeBuffer
    from fastrecord.video import yuv

    steps = cfg.episode_steps
    buf = EpisodeBuffer(cfg.num_envs, steps + 1)
    frame = torch.randint(0, 256, (cfg.num_envs, cfg.height, cfg.width, 3), dtype=torch.uint8, device=device)
    buf.start(np.arange(cfg.num_envs), {"frames": frame})
    res: dict[str, Any] = {}
    cuda = device.type == "cuda"

    def timed(fn: Any, reps: int) -> tuple[float, float]:
        """(host ms, device ms) per call."""
        if cuda:
            torch.cuda.synchronize(device)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        host = (time.perf_counter() - t0) / reps
        if cuda:
            b.record()
            b.synchronize()
            return 1000 * host, a.elapsed_time(b) / reps
        return 1000 * host, 1000 * host

    def ring() -> None:
        if buf.cursor.max() >= steps:
            buf.cursor[:] = 0  # every env at the same step: the contiguous-copy path of EpisodeBuffer.step
        buf.step({"frames": frame})

    ring()
    res["ring_write_host_ms"], res["ring_write_device_ms"] = timed(ring, 3 * steps)
    flat = buf.fields["frames"].view(-1, *frame.shape[1:])
    slots = torch.arange(cfg.num_envs, device=device) + cfg.num_envs  # slot 1 of every env, as envs at different steps
    res["ring_write_index_copy_device_ms"] = timed(lambda: flat.index_copy_(0, slots, frame), 3 * steps)[1]
    buf.cursor[:] = steps
    episode = buf.fields["frames"][: steps + 1].transpose(0, 1)  # [envs, steps, H, W, 3], as gather reads it
    k = min(8, cfg.num_envs)
    t0 = time.perf_counter()
    yuv.rgb_to_yuv420p(episode[:1])
    if cuda:
        torch.cuda.synchronize(device)
    res["yuv420p_first_call_s"] = time.perf_counter() - t0
    host, dev = timed(lambda: yuv.rgb_to_yuv420p(episode[:k]), 3)
    res["yuv420p_device_ms_per_batch"] = dev * cfg.num_envs / k
    res["yuv420p_device_ms_per_step"] = res["yuv420p_device_ms_per_batch"] / steps
    if cuda:
        for i in range(2):  # the first lease makes (and pins) an arena: time the second
            t0 = time.perf_counter()
            host_arr = buf.gather(np.arange(cfg.num_envs), transforms={"frames": yuv.YUV420P})["frames"]
            issue = time.perf_counter() - t0
            host_arr.wait_ready()
            total = time.perf_counter() - t0
            res["gather_issue_ms"] = 1000 * issue
            res["gather_total_ms"] = 1000 * total
            res["gather_gb_per_s"] = host_arr.nbytes / total / 1e9
            del host_arr
        t0 = time.perf_counter()
        plain = buf.gather(np.arange(cfg.num_envs))["frames"]
        res["gather_rgb_ms"] = 1000 * (time.perf_counter() - t0)
        res["gather_rgb_gb_per_s"] = plain.nbytes / (time.perf_counter() - t0) / 1e9
        del plain
    return res

