"""`fastrecord bench` phases for the recording paths other than "every episode ends together" (issue 9).

  staggered  the batched source with per-env episode lengths (``stagger_steps``, drawn by the env at each
             reset from the episode seed) and per-env successes that end episodes early; only the
             finished envs are reset (ManiSkill's GPU contract: ``reset(options={"env_idx": ...})``),
             as in data collection with early termination. Compare with the ``fastrecord`` phase
             (all episodes end together) of the same run, on the same frames.
  coldstart  a fresh process records its first ``coldstart_episodes`` episodes, once with synchronous
             and once with staggered ends: set-up seconds (imports, construction, first episode out),
             the rate over those episodes from the recorder's construction to the last video on disk
             (``rate_from_construct``: what a user waits for once fastrecord is imported; the import is
             reported apart) and from the first reset (``env_frames_per_s``), close() after the
             encoders' last video, the interpreter's exit, peak host RSS and device memory.
  cpueval    the CPU branch of `fastrecord.make_eval_envs` (an AsyncVectorEnv of ``cpueval_envs``
             CPU-simulated envs, GPU rendering where CUDA is present): a step+render loop of the same
             envs, no videos, every env's video with the info overlay (the branch's default) and with
             the overlay off, in env-steps/s, measured one after the other on one vector env.

Each phase returns a dict that `benchmarks.bench` stores under its name.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

import fastrecord
from benchmarks.config import BenchConfig
from benchmarks.memory import MemoryMonitor, rss, status_bytes
from benchmarks.phases_record import blocked_seconds, mp4_frames
from benchmarks.profiling import SpanTrace, StepTimers, cprofile_top, trace_recording
from fastrecord.testing import BatchedDoubleEnv, psnr, source_env

CHECKOUT = Path(__file__).resolve().parents[1]  # the source checkout holding benchmarks/


# ---------------------------------------------------------------------------------------------- staggered
def stagger_length_fn(lo: int, hi: int):
    """``f(env, episode_seed) -> length`` in ``lo..hi``, a fixed function of the seed (reproducible)."""
    span = hi - lo + 1

    def length(env: int, seed: int) -> int:
        return lo + (int(seed) * 2654435761 + 97 * int(env)) % span

    return length


def staggered_source(bank: np.ndarray, num_envs: int, device: torch.device, lo: int, hi: int,
                     sim_seconds: float = 0.0) -> BatchedDoubleEnv:
    """The bench's batched source with per-env episode lengths ``lo..hi`` and successes: every third env
    succeeds (terminates) at a step of its own in ``lo..hi``, so those episodes end earlier still."""
    success = [(lo + (7 * e) % (hi - lo + 1)) if e % 3 == 0 else 0 for e in range(num_envs)]
    return BatchedDoubleEnv(num_envs=num_envs, max_episode_steps=hi, device=device, bank=bank, sim_seconds=sim_seconds,
                            episode_lengths=stagger_length_fn(lo, hi), success_step=success)


def record_episodes(src: BatchedDoubleEnv, out: Path, *, episodes: int, warmup_episodes: int, workers: int,
                    video: dict[str, Any], staggered: bool, check: bool = True, profile_steps: int = 0,
                    monitor: Any = None, bank: np.ndarray | None = None, trace: bool = False) -> dict[str, Any]:
    """Record through `fastrecord.RecordEpisode` until ``warmup_episodes + episodes`` episodes have ended;
    measure the last ``episodes``. ``staggered``: reset the finished envs only, as they end; otherwise
    every env together once all have ended (they end together). Returns rates, the stepping thread's
    time split, staging and encoder figures, and (``check``) dropped frames per video. ``trace``: also the
    timeline from construction (`benchmarks.profiling.SpanTrace`: what ran when, encoders busy per slice)."""
    from fastrecord import RecordEpisode
    from fastrecord.video import decode_mp4, default_encoder_pool

    n = src.num_envs
    device = src.device
    # the wrapping imports the modules construction imports (PyAV among them): it is counted as construction
    t_construct = time.perf_counter()
    spans = SpanTrace(origin=t_construct) if trace else None
    busy_keys = trace_recording(spans) if spans is not None else ()
    env = RecordEpisode(src, str(out), save_trajectory=False, video_workers=workers, **video)
    construct_s = time.perf_counter() - t_construct
    rec = env.recorder
    pool = default_encoder_pool()
    timers = StepTimers()
    timers.wrap(rec, "finalize", "finalize")
    timers.wrap(rec, "_write", "write (gather + hand-off)")
    timers.wrap(rec, "on_step", "on_step")
    timers.wrap(rec, "on_reset", "on_reset")
    from fastrecord.buffer import EpisodeBuffer
    from fastrecord.staging import StagingPool

    timers.wrap(EpisodeBuffer, "gather", "gather")
    timers.wrap(StagingPool, "lease", "staging lease")
    action = torch.zeros(n, 3, device=device)
    next_seed = n
    expected: dict[int, int] = {}  # episode id -> frames its video must have
    first_episode: int | None = None
    finished = 0
    steps = 0
    frames_measured = 0
    per_step: list[float] = []
    t0 = busy0 = blocked0 = 0.0
    measuring = warmup_episodes == 0
    t_first_out: float | None = None
    t_start = time.perf_counter()
    if spans is not None:
        spans.mark("constructed")
    env.reset(seed=list(range(n)))
    if spans is not None:
        spans.mark("first reset done")
    if measuring:
        pool.reset_stats()
        t0, busy0, blocked0 = time.perf_counter(), src.busy_seconds, blocked_seconds(rec)
        first_episode = rec.next_episode_id
        if monitor is not None:
            monitor.__enter__()
    prof = None
    res: dict[str, Any] = {}
    while True:
        s0, e0 = time.perf_counter(), src.busy_seconds
        _, _, term, trunc, info = env.step(action)
        done = term | trunc
        if measuring:
            steps += 1
        if staggered:
            idx = torch.nonzero(done).flatten()
            rows = idx.cpu().numpy()
        else:
            rows = np.arange(n) if bool(done.all()) else np.zeros(0, np.int64)
            idx = None
        if len(rows):
            lengths = info["elapsed_steps"].cpu().numpy()[rows]
            for k, e in enumerate(rows):
                expected[rec.next_episode_id + k] = int(lengths[k]) + 1
                if measuring:
                    frames_measured += int(lengths[k]) + 1
            seeds = list(range(next_seed, next_seed + len(rows)))
            next_seed += len(rows)
            if staggered:
                env.reset(seed=seeds, options={"env_idx": idx})
            else:
                env.reset(seed=seeds)
            finished += len(rows)
            if t_first_out is None:
                t_first_out = time.perf_counter() - t_start
            if spans is not None and len(spans.marks) < 24:  # the first ends: where a fresh process waits
                spans.mark(f"episodes ended: {finished}")
        if measuring:
            per_step.append((time.perf_counter() - s0) - (src.busy_seconds - e0))
        if prof is not None and steps >= profile_steps:
            prof.disable()
            break
        if not measuring and finished >= warmup_episodes:
            rec.wait_until_done()
            pool.reset_stats()
            timers.clear()
            measuring = True
            first_episode = rec.next_episode_id
            t0, busy0, blocked0 = time.perf_counter(), src.busy_seconds, blocked_seconds(rec)
            if monitor is not None:
                monitor.__enter__()
        elif measuring and finished >= warmup_episodes + episodes and prof is None:
            loop_s = time.perf_counter() - t0
            last_episode = rec.next_episode_id
            if spans is not None:
                spans.mark("loop end")
            rec.wait_until_done()
            total_s = time.perf_counter() - t0
            if spans is not None:
                spans.mark("last video out")
                res["trace"] = spans.summary(busy_keys)
                spans.restore()
                spans = None
            res["seconds_from_construct"] = time.perf_counter() - t_construct  # warm-up included, if any
            if monitor is not None:
                monitor.__exit__()
                res["memory"] = monitor.peaks()
            res.update(_measured(rec, src, pool, timers, per_step, steps, loop_s, total_s, busy0, blocked0,
                                 last_episode - first_episode, frames_measured, workers))
            if profile_steps <= 0:
                break
            import cProfile

            prof = cProfile.Profile()
            steps = 0
            prof.enable()
    timers.restore()
    if spans is not None:
        spans.restore()
    res.update(staggered=staggered, construct_seconds=construct_s, first_episode_out_seconds=t_first_out)
    if prof is not None:
        res["cprofile_top"] = cprofile_top(prof)
    # episodes still in progress are dropped, not written: they were not measured. The encoders' work is done
    # (wait_until_done above): what close() takes now is its own (thread joins, final files)
    t_close = time.perf_counter()
    rec.close(flush=False)
    res["close_after_drain_seconds"] = time.perf_counter() - t_close
    env.env.close()
    videos = {int(p.name.split("_env")[0]): p for p in out.glob("*.mp4")}
    res["videos_written"] = sum(1 for i in expected if i in videos)
    if check:
        counts = {i: mp4_frames(videos[i]) if i in videos else 0 for i in expected}
        res["dropped_frames"] = int(sum(max(0, expected[i] - counts[i]) for i in expected))
        res["bad_videos"] = int(sum(counts[i] != expected[i] for i in expected))
        if bank is not None:
            q = []
            for i in sorted(videos)[-3:]:
                e = int(videos[i].name.split("_env")[1].split("_")[0])
                dec = decode_mp4(videos[i])
                clip = bank[e % len(bank)]
                ref = clip[np.minimum(np.arange(len(dec)), len(clip) - 1)]
                q.append(psnr(dec, ref))
            res["psnr_db"] = float(np.mean(q))
    for p in out.glob("*.mp4"):
        p.unlink()
    return res


def _measured(
    rec: Any,
    src: Any,
    pool: Any,
    timers: StepTimers,
    per_step: list[float],
    steps: int,
    loop_s: float,
    total_s: float,
    busy0: float,
    blocked0: float,
    episodes: int,
    frames: int,
    workers: int,
) -> dict[str, Any]:
    from fastrecord.staging import default_staging_pool

    staging = default_staging_pool()
    blocked = blocked_seconds(rec) - blocked0
    stats = pool.reset_stats()
    busy = src.busy_seconds - busy0
    n = max(1, steps)
    return dict(
        workers=workers, episodes=episodes, frames=frames, steps=steps, loop_seconds=loop_s, seconds=total_s,
        env_frames_per_s=frames / total_s, mean_episode_frames=frames / max(1, episodes),
        episodes_ending_per_step=episodes / n,
        recorder_ms_per_step=1000 * (loop_s - busy) / n,
        recorder_ms_per_step_excl_wait=1000 * (loop_s - busy - blocked) / n,
        backpressure_wait_ms_per_step=1000 * blocked / n,
        step_ms_p50=1000 * statistics.median(per_step), step_ms_p99=1000 * float(np.percentile(per_step, 99)),
        split_ms_per_step={k: 1000 * v / n for k, v in timers.t.items()}, calls=dict(timers.n),
        first_call_ms={k: 1000 * v for k, v in timers.first.items()},
        encoder_busy_fraction=stats.encode_seconds / (total_s * workers), encoder_jobs=stats.jobs,
        encoder_copied_bytes=stats.copied_bytes,
        staging=dict(arenas_created=staging.arenas_created, reserved_gib=staging.bytes_reserved / 2**30,
                     pinned_gib_total=staging.bytes_pinned_total / 2**30, wait_seconds=staging.wait_seconds,
                     **{k: getattr(staging, k) for k in ("max_arenas", "max_bytes", "make_seconds", "over_limit")
                        if hasattr(staging, k)}),
    )


def _video_kwargs(cfg: BenchConfig) -> dict[str, Any]:
    return dict(video_codec=cfg.codec, video_crf=cfg.crf, video_preset=cfg.preset)


def phase_staggered(
    cfg: BenchConfig, bank: np.ndarray, device: torch.device, out: Path, workers: int
) -> dict[str, Any]:
    lo, hi = cfg.stagger_steps
    episodes = cfg.stagger_episodes or cfg.batches * cfg.num_envs
    src = staggered_source(bank, cfg.num_envs, device, lo, hi)
    res = record_episodes(src, out / "staggered", episodes=episodes, warmup_episodes=cfg.warmup_batches * cfg.num_envs,
                          workers=workers, video=_video_kwargs(cfg), staggered=True, bank=bank,
                          profile_steps=cfg.stagger_profile_steps if cfg.profile else 0, monitor=MemoryMonitor(device))
    res["episode_steps_range"] = [lo, hi]
    from fastrecord.staging import default_staging_pool

    pool = default_staging_pool()
    for limit in cfg.stagger_arena_limits:  # diagnosis: the same run with another cap on staging arenas
        before = pool.max_arenas
        pool.max_arenas = limit
        try:
            src = staggered_source(bank, cfg.num_envs, device, lo, hi)
            r = record_episodes(src, out / f"staggered_{limit}", episodes=episodes, warmup_episodes=cfg.num_envs,
                                workers=workers, video=_video_kwargs(cfg), staggered=True, check=False)
        finally:
            pool.max_arenas = before
        res[f"max_arenas_{limit}"] = {k: v for k, v in r.items() if k not in ("cprofile_top",)}
    return res


# ---------------------------------------------------------------------------------------------- coldstart
def phase_coldstart(
    cfg: BenchConfig, bank: np.ndarray, device: torch.device, out: Path, workers: int
) -> dict[str, Any]:
    """Two fresh processes (synchronous, staggered), each recording its first ``coldstart_episodes``."""
    out.mkdir(parents=True, exist_ok=True)
    bank_path = out / "coldstart_bank.npy"
    np.save(bank_path, bank)
    res: dict[str, Any] = {}
    try:
        for mode in ("sync", "staggered"):
            args = dict(bank=str(bank_path), out=str(out / f"coldstart_{mode}"), num_envs=cfg.num_envs,
                        device=str(device), episodes=cfg.coldstart_episodes, workers=workers, video=_video_kwargs(cfg),
                        staggered=mode == "staggered", stagger_steps=list(cfg.stagger_steps),
                        result=str(out / f"coldstart_{mode}.json"))
            env = dict(os.environ)  # the child imports this checkout's benchmarks and the fastrecord we run
            env["PYTHONPATH"] = os.pathsep.join([str(CHECKOUT), str(Path(fastrecord.__file__).resolve().parents[1]),
                                                 env.get("PYTHONPATH", "")])
            t0 = time.perf_counter()
            p = subprocess.run(
                [
                    sys.executable,
                    "-c",
                    "import sys, time; t = time.time(); "
                    "from benchmarks.paths import coldstart_main; coldstart_main(sys.argv[1], t)",
                    json.dumps(args),
                ],
                env=env,
                capture_output=True,
                text=True,
                timeout=cfg.coldstart_timeout,
            )
            wall = time.perf_counter() - t0
            if p.returncode != 0:
                raise RuntimeError(f"coldstart {mode} child failed (exit {p.returncode}): {p.stderr[-3000:]}")
            r = json.loads(Path(args["result"]).read_text())
            r["process_wall_seconds"] = wall
            r["exit_seconds"] = time.time() - r.pop("child_end_time")
            res[mode] = r
    finally:
        bank_path.unlink(missing_ok=True)
    return res


def coldstart_main(arg: str, t_process: float) -> None:
    """The fresh process of the coldstart phase: imports, builds the source, records, writes JSON."""
    a = json.loads(arg)
    # the imports of this module (fastrecord, torch) are part of the set-up reported; the interpreter's
    # start is not: python -c measured from its first line
    import_s = time.time() - t_process
    device = torch.device(a["device"])
    bank = np.load(a["bank"])
    lo, hi = a["stagger_steps"]
    src = (staggered_source(bank, a["num_envs"], device, lo, hi) if a["staggered"]
           else source_env(bank, a["num_envs"], device))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    rss_before = rss()
    peak_before = status_bytes("VmHWM")  # the monitor resets the high-water mark as the recording starts
    mon = MemoryMonitor(device)
    t0 = time.perf_counter()
    r = record_episodes(src, Path(a["out"]), episodes=a["episodes"], warmup_episodes=0, workers=a["workers"],
                        video=a["video"], staggered=a["staggered"], check=True, monitor=mon, bank=bank, trace=True)
    r["import_seconds"] = import_s
    r["setup_seconds"] = import_s + r["construct_seconds"]
    # what the user waits for once fastrecord is imported: construction, the first reset, every step, the
    # encoders' last video (the source's own reset and steps included: the warm rate includes its steps)
    r["rate_from_construct"] = r["frames"] / r["seconds_from_construct"]
    r["rate_incl_construct"] = r["frames"] / (r["seconds"] + r["construct_seconds"])
    r["host_rss_before_gib"] = rss_before / 2**30
    r["host_peak_rss_gib"] = max(peak_before, status_bytes("VmHWM")) / 2**30  # this process's peak (not inherited)
    r["record_wall_seconds"] = time.perf_counter() - t0
    if device.type == "cuda":
        r["device_peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / 2**30
    r["child_end_time"] = time.time()  # the parent takes the interpreter's exit (exit hooks: encoders stopped) from here
    Path(a["result"]).write_text(json.dumps(r, default=str))


# ---------------------------------------------------------------------------------------------- cpueval
def phase_cpueval(cfg: BenchConfig, device: torch.device, out: Path, workers: int) -> dict[str, Any]:
    """make_eval_envs' CPU branch: one AsyncVectorEnv of ``cpueval_envs`` envs, wrapped as make_eval_envs
    wraps it (RecordEpisode outside the vector env, EvalVectorEnv above), one mode after the other."""
    from fastrecord import RecordEpisode
    from fastrecord.make_env import SOURCE_DESC, SOURCE_TYPE, EvalVectorEnv, cpu_vector_env

    render = "gpu" if device.type == "cuda" else "cpu"
    size = cfg.cpueval_size or cfg.width
    n = cfg.cpueval_envs
    steps = cfg.cpueval_steps
    kw = dict(obs_mode="state", control_mode="pd_joint_delta_pos", render_mode="rgb_array", sim_backend="physx_cpu",
              render_backend=render, human_render_camera_configs=dict(width=size, height=size),
              max_episode_steps=cfg.cpueval_episode_steps)
    t0 = time.perf_counter()
    vec = cpu_vector_env(cfg.cpueval_env, n, kw, [])
    res: dict[str, Any] = dict(env_id=cfg.cpueval_env, num_envs=n, size=size, render_backend=render, steps=steps,
                               episode_steps=cfg.cpueval_episode_steps, start_seconds=time.perf_counter() - t0)
    rng = np.random.default_rng(0)
    actions = rng.uniform(-1, 1, size=(steps + cfg.cpueval_episode_steps, n, *vec.single_action_space.shape)).astype(
        np.float32
    )

    render_s = [0.0]

    def loop(env: Any, render_each: bool, k: int, offset: int = 0) -> float:
        render_s[0] = 0.0
        t = time.perf_counter()
        for i in range(k):
            env.step(actions[offset + i])
            if render_each:
                r0 = time.perf_counter()
                vec.call("render")
                render_s[0] += time.perf_counter() - r0
        return time.perf_counter() - t

    try:
        modes: list[tuple[str, dict[str, Any] | None, bool]] = [
            ("step_render", None, True), ("no_video", None, False),
            ("video_overlay", dict(info_on_video=True), False), ("video_no_overlay", dict(info_on_video=False), False),
        ]
        for name, rec_kw, render_each in modes:
            rec = None
            inner: Any = vec
            if rec_kw is not None:
                inner = rec = RecordEpisode(
                    vec,
                    str(out / f"cpueval_{name}"),
                    save_trajectory=False,
                    source_type=SOURCE_TYPE,
                    source_desc=SOURCE_DESC,
                    video_workers=workers,
                    **_video_kwargs(cfg),
                    **rec_kw,
                )
            env = EvalVectorEnv(inner, 2)
            env.reset(seed=list(range(n)))
            loop(env, render_each, cfg.cpueval_episode_steps)  # one episode of warm-up (first renders, encoders)
            timers = None
            if rec is not None:
                rec.recorder.wait_until_done()
                from fastrecord.buffer import EpisodeBuffer

                timers = StepTimers()
                timers.wrap(rec.recorder, "on_step", "on_step")
                timers.wrap(rec.recorder.view, "render", "render")
                timers.wrap(rec.recorder, "finalize", "finalize")
                timers.wrap(rec.recorder, "_write", "write (gather + hand-off)")
                timers.wrap(EpisodeBuffer, "gather", "gather")
                timers.wrap(EpisodeBuffer, "step", "buffer step")
                timers.wrap(vec, "step", "vector env step")
                timers.wrap(vec, "reset", "vector env reset")
            secs = loop(env, render_each, steps, offset=cfg.cpueval_episode_steps)
            drain = 0.0
            if rec is not None:
                d0 = time.perf_counter()
                rec.recorder.wait_until_done()
                drain = time.perf_counter() - d0
            total = secs + drain
            res[name] = dict(env_steps_per_s=n * steps / total, ms_per_step=1000 * secs / steps, drain_seconds=drain,
                             render_ms_per_step=1000 * render_s[0] / steps)
            if timers is not None:
                res[name]["split_ms_per_step"] = {k: 1000 * v / steps for k, v in timers.t.items()}
                timers.restore()
                rec.recorder.close(flush=False)  # the vector env stays open for the next mode
                res[name]["videos"] = len(list((out / f"cpueval_{name}").glob("*.mp4")))
    finally:
        vec.close()
    base = res["step_render"]["env_steps_per_s"]
    for name in ("no_video", "video_overlay", "video_no_overlay"):
        res[name]["of_step_render"] = res[name]["env_steps_per_s"] / base
    return res


# ---------------------------------------------------------------------------------------------- table
def trace_line(trace: dict[str, Any]) -> str:
    """A fresh process's timeline (`SpanTrace.summary`) in one line: when the encoders answered, the first gather,
    the arenas pinned, Triton loaded (trees before 2026-12-06's), the first encode, and the encoders' video time against the run's."""
    keys = trace.get("keys", {})

    def first(key: str, end: bool = True) -> str:
        k = keys.get(key)
        return "-" if not k else f"{k['first_end' if end else 'first_start']:.2f}"

    pinned = keys.get("arena: pinned (every piece)") or keys.get("arena: made (pinned)")
    pinned_by = "-" if not pinned else f"{pinned['first_start'] + pinned['total'] / max(1, pinned['n']):.2f} (mean)"
    answered = first("encoder: started -> answered")
    triton = f"Triton loaded {first('triton: warm-up')}; " if "triton: warm-up" in keys else ""
    answered = first("encoder: started (forked: ready)") if answered == "-" else answered
    return (f"first reset done {trace.get('marks', {}).get('first reset done', float('nan')):.2f}; first encoder ready "
            f"{answered}; first gather {first('gather', False)}-{first('gather')}; "
            f"an arena pinned by {pinned_by}; {triton}first encode "
            f"{trace.get('busy_first_start', float('nan')):.2f}; encoders busy {trace.get('busy_seconds', 0):.1f} s")


def table_rows(r: dict[str, Any]) -> list[str]:
    """The table rows of these phases (``| what | value |``), each rate beside its reference of the same run."""
    rows: list[str] = []
    fr, st, cs, ce = r.get("fastrecord"), r.get("staggered"), r.get("coldstart"), r.get("cpueval")
    sync = fr["env_frames_per_s"] if fr else None

    def of(x: float, ref: float | None) -> str:
        return f" ({x / ref:.0%} of all-end-together)" if ref else ""

    def mem(m: dict[str, Any]) -> str:
        out = f"peak host RSS {m.get('host_rss_gib', 0):.2f} GiB"
        return out + (f", device {m['device_torch_peak_gib']:.1f} GiB (torch)" if "device_torch_peak_gib" in m else "")

    if st:
        lo, hi = st["episode_steps_range"]
        rows.append(
            f"| staggered: lengths {lo}-{hi} from the env, partial resets | {st['env_frames_per_s']:,.0f} env-frames/s"
            f"{of(st['env_frames_per_s'], sync)} over {st['episodes']} episodes, {st['episodes_ending_per_step']:.1f} "
            f"ending a step; stepping thread {st['recorder_ms_per_step_excl_wait']:.2f} ms/step own + "
            f"{st['backpressure_wait_ms_per_step']:.1f} waiting; encoders busy {st['encoder_busy_fraction']:.0%}; "
            f"{st.get('dropped_frames', '?')} dropped frames; {mem(st.get('memory', {}))} |"
        )
    if cs:
        for mode in ("sync", "staggered"):
            c = cs.get(mode)
            if not c:
                continue
            ref = sync if mode == "sync" else (st or {}).get("env_frames_per_s")
            cold = c.get("rate_from_construct", c["env_frames_per_s"])
            share = (f" = {cold / ref:.0%} of the warm {mode} rate ({ref:,.0f}); from the first reset "
                     f"{c['env_frames_per_s']:,.0f} = {c['env_frames_per_s'] / ref:.0%}") if ref else ""
            rows.append(
                f"| cold start, {mode}: fresh process, first {c['episodes']} episodes, construction to the last video "
                f"| {cold:,.0f} env-frames/s{share}; import {c['import_seconds']:.1f} s (not counted), construct "
                f"{c['construct_seconds']:.2f} s, first episode out at {c['first_episode_out_seconds']:.2f} s; "
                f"close after the encoders' last video {c.get('close_after_drain_seconds', float('nan')):.2f} s, "
                f"exit {c.get('exit_seconds', float('nan')):.2f} s; peak host RSS {c['host_peak_rss_gib']:.1f} GiB"
                + (f", device {c['device_peak_reserved_gib']:.1f} GiB" if "device_peak_reserved_gib" in c else "")
                + f"; {c.get('dropped_frames', '?')} dropped frames |"
            )
            if c.get("trace"):
                rows.append(f"| cold start, {mode}: where it waited (s after construction) | {trace_line(c['trace'])} |")
    if ce:
        what = f"make_eval_envs CPU branch: {ce['num_envs']} x {ce['env_id']} {ce['size']}x{ce['size']}, render {ce['render_backend']}"
        vals = "; ".join(f"{name.replace('_', ' ')} {ce[name]['env_steps_per_s']:,.0f}"
                         + (f" ({ce[name]['of_step_render']:.0%})" if "of_step_render" in ce[name] else "")
                         for name in ("step_render", "no_video", "video_overlay", "video_no_overlay") if name in ce)
        rows.append(f"| {what} | env-steps/s: {vals} (share of the step+render loop) |")
    return rows
