"""Benchmark phases recording the batched source (`fastrecord.testing.source_env`: a clip bank replayed on
the device, every episode ending together), fastrecord beside ManiSkill's own wrapper.

  maniskill   ManiSkill's RecordEpisode video path (to_numpy + tile_images every step, one tiled video)
  fastrecord  fastrecord.RecordEpisode (device ring buffer + per-env MP4) flat out: env-frames/s, the
              stepping thread's own time per step, memory per batch (flat?), dropped frames, PSNR
  keepup      the same with a simulated step time so encoders keep up: bare loop vs recorded loop

Each phase returns a dict that `benchmarks.bench` stores under its name.
"""

from __future__ import annotations

import importlib
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.config import BenchConfig, encoder_workers
from benchmarks.memory import MemoryMonitor, rss
from benchmarks.profiling import start_pyspy, stop_pyspy, summarize_profile
from fastrecord.testing import BatchedDoubleEnv, psnr, source_env


def mp4_frames(path: Path) -> int:
    """The frames of an MP4 (its header's count, else decoded)."""
    import av

    with av.open(str(path)) as c:
        n = c.streams.video[0].frames
        if n:
            return n
        return sum(1 for _ in c.decode(video=0))


def pyav_images_to_video(images: list, output_dir: str, video_name: str, fps: int = 10, quality: float | None = 5,
                         verbose: bool = True, **kwargs: Any) -> None:
    """ManiSkill's images_to_video (imageio-ffmpeg: libx264, crf = int((1 - quality/10) * 51), preset medium,
    yuv420p, threads auto) through PyAV, for machines without the ffmpeg binary imageio needs."""
    import av

    crf = int((1 - (quality if quality is not None else 5) / 10.0) * 51)
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, video_name.replace(" ", "_").replace("\n", "_") + ".mp4")
    with av.open(path, "w") as c:
        st = c.add_stream("libx264", rate=fps)
        st.height, st.width = images[0].shape[:2]
        st.pix_fmt = "yuv420p"
        st.options = {"crf": str(crf)}
        st.codec_context.thread_count = 0
        for im in images:
            c.mux(st.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(im), format="rgb24")))
        c.mux(st.encode())


def phase_maniskill(cfg: BenchConfig, bank: np.ndarray, device: torch.device, out: Path) -> dict[str, Any]:
    """ManiSkill's RecordEpisode over ``baseline_steps`` steps of the source: rate, host work, encode time, PSNR."""
    ms_record = importlib.import_module("mani_skill.utils.wrappers.record")

    from fastrecord.video import decode_mp4

    try:
        import imageio_ffmpeg  # noqa: F401

        encoder = "imageio-ffmpeg (ManiSkill's own path)"
    except ImportError:
        encoder = "PyAV stand-in for imageio-ffmpeg (same libx264 settings: crf 25, preset medium, yuv420p)"
        ms_record.images_to_video = pyav_images_to_video
    encode_time = [0.0]
    inner = ms_record.images_to_video

    def timed(*a: Any, **k: Any) -> None:
        t0 = time.perf_counter()
        inner(*a, **k)
        encode_time[0] += time.perf_counter() - t0

    ms_record.images_to_video = timed
    steps = min(cfg.baseline_steps, bank.shape[1] - 1)
    src = source_env(bank, cfg.num_envs, device)
    vdir = out / "maniskill"
    rss0 = rss()
    try:
        with MemoryMonitor(device) as mon:
            env = ms_record.RecordEpisode(
                src, str(vdir), save_trajectory=False, max_steps_per_video=steps, video_fps=30
            )
            env.reset(seed=0)
            action = torch.zeros(cfg.num_envs, 3, device=device)
            t0, busy0 = time.perf_counter(), src.busy_seconds  # the reset's env time is not the loop's
            for _ in range(steps):
                env.step(action)
            total = time.perf_counter() - t0
            env.close()
    finally:
        ms_record.images_to_video = inner
    frames = cfg.num_envs * (steps + 1)
    host_s = total - encode_time[0] - (src.busy_seconds - busy0)  # the wrapper's own work: not env, not encoding
    res = dict(encoder=encoder, steps=steps, frames=frames, seconds=total, env_frames_per_s=frames / total,
               host_ms_per_step=1000 * host_s / steps, encode_seconds=encode_time[0],
               memory=mon.peaks(), host_rss_growth_gib=(mon.peak_rss - rss0) / 2**30)
    videos = sorted(vdir.glob("*.mp4"))
    if videos:
        tiled = decode_mp4(videos[0])
        h, w = bank.shape[2:4]
        nrows = int(np.sqrt(cfg.num_envs))
        q = []
        for e in sorted({0, cfg.num_envs // 2, cfg.num_envs - 1}):
            r, c = e % nrows, e // nrows
            q.append(psnr(tiled[:, r * h:(r + 1) * h, c * w:(c + 1) * w], bank[e % len(bank), : tiled.shape[0]]))
        res.update(psnr_db=float(np.mean(q)), tiled_size=list(tiled.shape[1:3]))
    shutil.rmtree(vdir, ignore_errors=True)
    return res


def run_fastrecord(
    cfg: BenchConfig,
    bank: np.ndarray,
    device: torch.device,
    out: Path,
    batches: int,
    warmup: int,
    sim_seconds: float = 0.0,
    check: bool = True,
    profile: Path | None = None,
) -> dict[str, Any]:
    """fastrecord.RecordEpisode (videos only) over ``warmup + batches`` batches of the source's episodes (all
    ending together), the last ``batches`` measured: rates, the stepping thread's time, memory per batch,
    and (``check``) dropped frames and PSNR of the videos; ``profile``: py-spy's samples go there."""
    from fastrecord import RecordEpisode
    from fastrecord.video import decode_mp4, default_encoder_pool

    workers = encoder_workers(cfg)
    src = source_env(bank, cfg.num_envs, device, sim_seconds=sim_seconds)
    env = RecordEpisode(src, str(out), save_trajectory=False, video_codec=cfg.codec, video_crf=cfg.crf,
                        video_preset=cfg.preset, video_workers=workers)
    rec = env.recorder
    pool = default_encoder_pool()
    pool.start(workers)
    steps = bank.shape[1] - 1
    action = torch.zeros(cfg.num_envs, 3, device=device)
    per_step: list[float] = []
    finalize: list[float] = []
    mem: list[dict[str, int]] = []
    env.reset(seed=0)
    t0 = busy0 = blocked0 = 0.0
    prof = None
    monitor = MemoryMonitor(device)
    for b in range(warmup + batches):
        if b == warmup:
            rec.wait_until_done()
            pool.reset_stats()
            monitor.__enter__()
            if profile is not None:
                prof = start_pyspy(profile)
            t0, busy0, blocked0 = time.perf_counter(), src.busy_seconds, blocked_seconds(rec)
        for _ in range(steps):
            s0, e0 = time.perf_counter(), src.busy_seconds
            env.step(action)
            if b >= warmup:
                per_step.append((time.perf_counter() - s0) - (src.busy_seconds - e0))
        f0, e0 = time.perf_counter(), src.busy_seconds
        env.reset()  # ends every env's episode: keep, gather, queue
        if b >= warmup:
            finalize.append((time.perf_counter() - f0) - (src.busy_seconds - e0))
            mem.append(monitor.sample())  # cheap: children's PSS only on the monitor thread, rarely
    loop_s = time.perf_counter() - t0
    rec.wait_until_done()
    total_s = time.perf_counter() - t0
    stop_pyspy(prof)
    monitor.__exit__()
    blocked = blocked_seconds(rec) - blocked0
    stats = pool.reset_stats()
    n_steps = batches * steps
    frames = batches * cfg.num_envs * (steps + 1)
    recorder_s = (loop_s - (src.busy_seconds - busy0))
    res: dict[str, Any] = dict(
        workers=workers, batches=batches, episodes=batches * cfg.num_envs, frames=frames,
        loop_seconds=loop_s, seconds=total_s, env_frames_per_s=frames / total_s,
        sim_ms_per_step=1000 * sim_seconds,
        recorder_ms_per_step=1000 * recorder_s / n_steps,
        recorder_ms_per_step_excl_wait=1000 * (recorder_s - blocked) / n_steps,
        backpressure_wait_ms_per_step=1000 * blocked / n_steps,
        step_ms_p50=1000 * statistics.median(per_step), step_ms_p99=1000 * float(np.percentile(per_step, 99)),
        finalize_ms_mean=1000 * float(np.mean(finalize)),
        encoder_busy_fraction=stats.encode_seconds / (total_s * workers),
        encoder_cpu_per_frame_ms=1000 * stats.encode_cpu_seconds / max(1, stats.frames),
        encoder_jobs=stats.jobs, staging_copied_bytes=stats.copied_bytes,
        staging=staging_info(),
        memory=monitor.peaks(),
        memory_per_batch=[{k: round(v / 2**30, 3) for k, v in m.items()} for m in mem],
    )
    env.close()
    videos = sorted(out.glob("*.mp4"))
    written = len(videos) - (warmup * cfg.num_envs)
    res["videos_written"] = written
    if check:
        counts = [mp4_frames(p) for p in videos]
        res["dropped_frames"] = int(sum(max(0, steps + 1 - c) for c in counts))
        res["bad_videos"] = int(sum(c != steps + 1 for c in counts))
        sample = videos[-min(len(videos), 4):]
        q = []
        for p in sample:
            e = int(p.stem.split("_env")[1].split("_")[0])
            q.append(psnr(decode_mp4(p), bank[e % len(bank)]))
        res["psnr_db"] = float(np.mean(q))
    for p in videos:
        p.unlink()
    return res


def blocked_seconds(rec: Any) -> float:
    """Seconds the producer waited for the writers: a full job queue or no free staging arena."""
    from fastrecord.staging import default_staging_pool

    return rec.videos.blocked_seconds + default_staging_pool().wait_seconds


def staging_info() -> dict[str, Any]:
    """The default staging pool's arenas and bytes (reserved, pinned over the run), its cap and overruns."""
    from fastrecord.staging import default_staging_pool

    p = default_staging_pool()
    return dict(arenas_created=p.arenas_created, reserved_gib=p.bytes_reserved / 2**30,
                pinned_gib_total=p.bytes_pinned_total / 2**30, max_arenas=p.max_arenas, over_limit=p.over_limit)


def phase_fastrecord(cfg: BenchConfig, bank: np.ndarray, device: torch.device, out: Path) -> dict[str, Any]:
    prof = out / "pyspy_raw.txt" if cfg.profile else None
    res = run_fastrecord(cfg, bank, device, out / "fastrecord", cfg.batches, cfg.warmup_batches, profile=prof)
    if prof is not None:
        res["profile"] = summarize_profile(prof)
    return res


def bare_loop(src: BatchedDoubleEnv, steps: int, batches: int) -> float:
    """Seconds of ``batches`` episodes of ``steps`` steps + renders of the source alone (no recorder)."""
    action = torch.zeros(src.num_envs, 3, device=src.device)
    src.reset(seed=0)
    t0 = time.perf_counter()
    for _ in range(batches):
        for _ in range(steps):
            src.step(action)
            src.render()
        src.reset()
    if src.device.type == "cuda":
        torch.cuda.synchronize(src.device)
    return time.perf_counter() - t0


def phase_keepup(
    cfg: BenchConfig, bank: np.ndarray, device: torch.device, out: Path, flat_fps: float
) -> dict[str, Any]:
    steps = bank.shape[1] - 1
    target_fps = cfg.keepup_fraction * flat_fps
    step_s = cfg.num_envs * (steps + 1) / steps / target_fps
    bare_fast = bare_loop(source_env(bank, cfg.num_envs, device), steps, 1) / steps
    sim = max(0.0, step_s - bare_fast)
    bare = bare_loop(source_env(bank, cfg.num_envs, device, sim_seconds=sim), steps, cfg.keepup_batches)
    res = run_fastrecord(cfg, bank, device, out / "keepup", cfg.keepup_batches, 1, sim_seconds=sim, check=False)
    n = cfg.keepup_batches * steps
    res["bare_ms_per_step"] = 1000 * bare / n
    res["recorded_ms_per_step"] = 1000 * res["loop_seconds"] / n
    res["slowdown"] = res["loop_seconds"] / bare - 1
    res["target_env_frames_per_s"] = target_fps
    return res
