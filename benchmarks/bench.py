"""The benchmark's runner: `run_bench` makes the clip bank, runs each phase not skipped (see the package
docstring), and keeps the results; `format_table` prints them; `main_from_args` is ``fastrecord bench``."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

import benchmarks
from benchmarks import imageobs, paths, phases_encode, phases_realenv, phases_record
from benchmarks.config import CONTENTS, PHASES, BenchConfig, bench_device, configure_parser, encoder_workers
from fastrecord.checks import load_config
from fastrecord.testing import gradient_clips, make_bank, maniskill_clips


def run_bench(cfg: BenchConfig, log: Any = print) -> dict[str, Any]:
    """Every phase of ``cfg`` not skipped, in `PHASES` order, on one clip bank; a line to ``log`` after each.
    Returns {"config", "machine", "source", <phase>: its results, "summary"}, also written to ``cfg.json``."""
    unknown = set(cfg.skip) - set(PHASES)
    if unknown:
        raise ValueError(f"skip={sorted(unknown)}: unknown phase(s); phases are {PHASES}")
    if cfg.content not in CONTENTS:
        raise ValueError(f"content={cfg.content!r} is unknown; use 'maniskill' (rendered clips) or 'gradient'")
    device = bench_device(cfg)
    workers = encoder_workers(cfg)
    tmp = None
    if cfg.output_dir is None:
        tmp = tempfile.mkdtemp(prefix="fastrecord-bench-")
    out = Path(cfg.output_dir or tmp)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"config": asdict(cfg), "machine": _machine(device)}
    try:
        t0 = time.perf_counter()
        frames = cfg.episode_steps + 1
        if cfg.content == "maniskill":
            clips = maniskill_clips(cfg.content_env, cfg.clips, frames, cfg.height, cfg.width,
                                    "gpu" if device.type == "cuda" else "cpu")
        else:
            clips = gradient_clips(cfg.clips, frames, cfg.height, cfg.width)
        bank = make_bank(clips, cfg.variants)
        results["source"] = dict(
            content=cfg.content, clips=cfg.clips, variants=cfg.variants, seconds=time.perf_counter() - t0
        )
        log(f"[bench] source: {cfg.content} clips {list(bank.shape)} on {device} in {time.perf_counter() - t0:.1f}s")
        for phase in PHASES:
            if phase in cfg.skip:
                continue
            if phase == "keepup" and "fastrecord" not in results:
                continue
            t0 = time.perf_counter()
            if phase == "ceiling":
                r = phases_encode.phase_ceiling(cfg, bank, workers, out)
            elif phase == "quality":
                r = phases_encode.phase_quality(cfg, bank, workers, out)
            elif phase == "maniskill":
                r = phases_record.phase_maniskill(cfg, bank, device, out)
            elif phase == "fastrecord":
                r = phases_record.phase_fastrecord(cfg, bank, device, out)
            elif phase == "keepup":
                r = phases_record.phase_keepup(cfg, bank, device, out, results["fastrecord"]["env_frames_per_s"])
            elif phase == "realenv":
                r = phases_realenv.phase_realenv(cfg, device, out)
            elif phase == "micro":
                r = phases_encode.phase_micro(cfg, device)
            elif phase == "staggered":
                r = paths.phase_staggered(cfg, bank, device, out, workers)
            elif phase == "coldstart":
                r = paths.phase_coldstart(cfg, bank, device, out, workers)
            elif phase == "cpueval":
                r = paths.phase_cpueval(cfg, device, out, workers)
            else:
                r = imageobs.phase_imageobs(cfg, device, out)
            r["phase_seconds"] = time.perf_counter() - t0
            results[phase] = r
            log(f"[bench] {phase}: {time.perf_counter() - t0:.1f}s {json.dumps(_short(r))}")
            if cfg.json:
                Path(cfg.json).write_text(json.dumps(results, indent=2, default=str))
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    results["summary"] = summary(results)
    if cfg.json:
        Path(cfg.json).write_text(json.dumps(results, indent=2, default=str))
    return results



def _short(r: dict[str, Any]) -> dict[str, Any]:
    return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()
            if not isinstance(v, (list, dict))}


def _machine(device: torch.device) -> dict[str, Any]:
    import av

    from fastrecord.options import usable_cores

    # cpus: the cores this process may use (its affinity mask, what the defaults are sized by); cpu_count: the machine's
    info: dict[str, Any] = dict(
        cpus=usable_cores(),
        cpu_count=os.cpu_count(),
        python=sys.version.split()[0],
        torch=torch.__version__,
        av=av.__version__,
    )
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    from fastrecord.video import encode as video

    info["nvenc_in_pyav_build"] = video.codec_available("h264_nvenc")
    info["codec_auto_resolves_to"] = video.resolve_codec("auto")
    info["nvenc_usable"] = info["codec_auto_resolves_to"] == "h264_nvenc"  # auto takes NVENC wherever it encodes
    try:
        import mani_skill
        import sapien

        info.update(mani_skill=mani_skill.__version__, sapien=sapien.__version__)
    except ImportError:
        pass
    return info


def summary(r: dict[str, Any]) -> dict[str, Any]:
    s: dict[str, Any] = {}
    fr, ms, ce = r.get("fastrecord"), r.get("maniskill"), r.get("ceiling")
    if fr:
        s["fastrecord_env_frames_per_s"] = fr["env_frames_per_s"]
    if ms:
        s["maniskill_env_frames_per_s"] = ms["env_frames_per_s"]
    if fr and ms:
        s["speedup"] = fr["env_frames_per_s"] / ms["env_frames_per_s"]
    if ce:
        s["ceiling_fps"] = ce["ceiling_fps"]
        s["all_processes_fps"] = ce["all_processes_fps_yuv420p"]
        if fr:
            s["fraction_of_ceiling"] = fr["env_frames_per_s"] / ce["ceiling_fps"]
            s["fraction_of_all_processes"] = fr["env_frames_per_s"] / ce["all_processes_fps_yuv420p"]
    return s


def _cores(machine: dict[str, Any]) -> str:
    """'16 cores', or '4 of 16 cores' where the affinity mask (or torchrun's ranks) leaves this process fewer."""
    usable, total = machine["cpus"], machine.get("cpu_count")
    return f"{usable} cores" if total in (None, usable) else f"{usable} of {total} cores"


def format_table(r: dict[str, Any]) -> str:
    cfg = r["config"]
    lines = [
        f"fastrecord bench: {cfg['num_envs']} envs x {cfg['height']}x{cfg['width']}, {cfg['episode_steps']}-step episodes, "
        f"{r['machine'].get('gpu', 'CPU')}, {_cores(r['machine'])}; frames: {cfg['content']}",
        "",
        "| what | value |",
        "| --- | --- |",
    ]

    def row(k: str, v: Any) -> None:
        lines.append(f"| {k} | {v} |")

    ms, fr, ce, kp, re_, q, mi = (
        r.get(k) for k in ("maniskill", "fastrecord", "ceiling", "keepup", "realenv", "quality", "micro")
    )
    if ms:
        row(
            "ManiSkill RecordEpisode (tile every step, one video)",
            f"{ms['env_frames_per_s']:,.0f} env-frames/s "
            f"({ms['host_ms_per_step']:.2f} ms host work a step, {ms['encode_seconds']:.1f} s encode for {ms['steps'] + 1} frames), "
            f"PSNR {ms.get('psnr_db', float('nan')):.1f} dB",
        )
    if fr:
        row(
            "fastrecord RecordEpisode (ring + per-env MP4)",
            f"{fr['env_frames_per_s']:,.0f} env-frames/s over {fr['episodes']} episodes, "
            f"PSNR {fr.get('psnr_db', float('nan')):.1f} dB, {fr.get('dropped_frames', '?')} dropped frames",
        )
    if fr and ms:
        row("ratio fastrecord / ManiSkill", f"{fr['env_frames_per_s'] / ms['env_frames_per_s']:.1f}x")
    if ce:
        row(
            "encode ceiling (one process x workers)",
            f"{ce['one_process_fps_yuv420p']:,.0f} x {ce['workers']} = {ce['ceiling_fps']:,.0f} frames/s "
            f"(all {ce['workers']} measured together: {ce['all_processes_fps_yuv420p']:,.0f}; one process from rgb24: {ce['one_process_fps_rgb24']:,.0f})",
        )
        if fr:
            row("fastrecord / ceiling", f"{fr['env_frames_per_s'] / ce['ceiling_fps']:.0%} (of all-together: "
                f"{fr['env_frames_per_s'] / ce['all_processes_fps_yuv420p']:.0%})")
    if fr:
        row(
            "stepping thread, flat out",
            f"{fr['recorder_ms_per_step_excl_wait']:.2f} ms/step own work + "
            f"{fr['backpressure_wait_ms_per_step']:.1f} ms/step waiting for encoders (p50 step {fr['step_ms_p50']:.2f} ms)",
        )
        m = fr["memory"]
        row(
            "peak memory, flat out",
            f"host {m['host_rss_gib']:.2f} GiB RSS (staging {fr['staging']['reserved_gib']:.2f} GiB) + encoders {m['encoders_pss_gib']:.2f} GiB PSS"
            + (f", device {m['device_torch_peak_gib']:.1f} GiB (torch)" if "device_torch_peak_gib" in m else ""),
        )
        mb = fr["memory_per_batch"]
        if len(mb) > 1:
            row(
                "memory per batch, first -> last",
                ", ".join(f"{k} {mb[0][k]:.2f} -> {mb[-1][k]:.2f} GiB" for k in mb[0]),
            )
    if kp:
        row(
            "keep-up run (encoders keep up)",
            f"{kp['env_frames_per_s']:,.0f} env-frames/s, stepping thread {kp['recorder_ms_per_step_excl_wait']:.2f} ms/step "
            f"own + {kp['backpressure_wait_ms_per_step']:.2f} waiting; bare loop {kp['bare_ms_per_step']:.1f} ms/step -> "
            f"recorded {kp['recorded_ms_per_step']:.1f} ms/step ({kp['slowdown']:+.1%})",
        )
    if mi:
        row(
            "device time",
            f"ring write {mi['ring_write_device_ms']:.3f} ms/step (host {mi['ring_write_host_ms']:.3f}; index_copy_ path when envs are at different steps: {mi['ring_write_index_copy_device_ms']:.3f}); "
            f"yuv420p conversion {mi['yuv420p_device_ms_per_step']:.3f} ms/step equivalent"
            + (
                f"; gather issue {mi['gather_issue_ms']:.1f} ms, lands in {mi['gather_total_ms']:.0f} ms ({mi['gather_gb_per_s']:.0f} GB/s)"
                if "gather_total_ms" in mi
                else ""
            ),
        )
    if re_:
        row(
            f"real env {re_['env_id']} (1 env, render {re_['render_backend']})",
            f"bare step+render {re_['bare_step_render_ms']:.2f} ms; "
            f"fastrecord video {re_['fastrecord_video_ms']:.2f} ms ({re_['fastrecord_video_slowdown']:+.1%}), "
            f"video+trajectory {re_['fastrecord_video_traj_ms']:.2f} ms ({re_['fastrecord_video_traj_slowdown']:+.1%}); "
            f"ManiSkill video {re_['maniskill_video_ms']:.2f} ms ({re_['maniskill_video_slowdown']:+.1%}); per call: "
            f"step p50 bare {re_['bare_step_ms_p50']:.2f} / fastrecord {re_['fastrecord_video_step_ms_p50']:.2f} ms, "
            f"reset {re_['fastrecord_video_reset_ms_mean']:.1f} ms",
        )
    lines += paths.table_rows(r)
    lines += imageobs.table_rows(r)
    if q:
        lines += ["", "| preset:crf | PSNR dB | frames/s, all workers | kbit/frame |", "| --- | --- | --- | --- |"]
        for x in q["rows"]:
            lines.append(
                f"| {x['preset']}:{x['crf']} | {x['psnr_db']:.2f} | {x['parallel_fps']:,.0f} | {x['kbit_per_frame']:.1f} |"
            )
    return "\n".join(lines)


def main_from_args(args: argparse.Namespace) -> int:
    """``fastrecord bench``: the flags over the --config file over `BenchConfig`; progress on stderr, the table on stdout."""
    opts = {k: v for k, v in vars(args).items() if k not in ("config", "command", "func")}
    if opts.get("skip") is not None:
        opts["skip"] = tuple(s for s in opts["skip"].split(",") if s)
    cfg = load_config(BenchConfig, args.config, **opts)
    lists = {k: tuple(v) for k, v in asdict(cfg).items() if isinstance(v, list)}  # YAML lists -> the fields' tuples
    if lists:
        cfg = BenchConfig(**{**asdict(cfg), **lists})
    results = run_bench(cfg, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(format_table(results))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.bench [flags]``: the same flags and output as ``fastrecord bench``."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench", description=benchmarks.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    configure_parser(p)
    try:
        return main_from_args(p.parse_args(argv))
    except ValueError as e:
        p.error(str(e))


if __name__ == "__main__":
    sys.exit(main())
