"""`fastrecord bench` (``benchmarks/`` of the checkout) at tiny shapes on CPU: every phase runs and reports,
bad arguments are refused, and the command says what to do where the checkout is missing.

(What the benchmark relies on is tested in its modules' files: test_staging.py, test_buffer.py,
test_workers.py, test_video.py, and its source env, `BatchedDoubleEnv`, in test_testing.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import checkout_env


def test_bench_smoke_tiny_cpu(tmp_path):
    from benchmarks.bench import format_table, run_bench
    from benchmarks.config import BenchConfig

    cfg = BenchConfig(
        num_envs=4,
        width=32,
        height=32,
        episode_steps=4,
        batches=2,
        device="cpu",
        content="gradient",
        workers=2,
        baseline_steps=2,
        sweep=("ultrafast:20",),
        sweep_episodes=2,
        ceiling_episodes=2,
        keepup_batches=1,
        skip=("realenv", "coldstart", "cpueval"),
        json=str(tmp_path / "bench.json"),
        imageobs_content="gradient",
        imageobs_size=16,
        imageobs_episode_steps=4,
        imageobs_steps=9,
        imageobs_repeats=1,
        imageobs_writers_sweep=(2,),
    )
    r = run_bench(cfg, log=lambda m: None)
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["summary"]["speedup"] == pytest.approx(r["summary"]["speedup"])
    fr = r["fastrecord"]
    assert fr["episodes"] == 8 and fr["videos_written"] == 8
    assert fr["dropped_frames"] == 0 and fr["bad_videos"] == 0 and fr["psnr_db"] > 30
    assert r["maniskill"]["env_frames_per_s"] > 0 and r["maniskill"]["psnr_db"] > 30
    assert r["ceiling"]["ceiling_fps"] == pytest.approx(r["ceiling"]["one_process_fps_yuv420p"] * 2)
    assert r["quality"]["rows"][0]["psnr_db"] > 30
    assert "slowdown" in r["keepup"] and "ring_write_device_ms" in r["micro"]
    table = format_table(r)
    assert "ratio fastrecord / ManiSkill" in table and "encode ceiling" in table
    # the memory and host-work cells hold what was measured, also in a run shorter than a sampling interval
    m = fr["memory"]
    assert m["host_rss_gib"] > 0.05 and m["encoders_pss_gib"] > 0 and m["host_total_gib"] >= m["host_rss_gib"]
    assert f"host {m['host_rss_gib']:.2f} GiB RSS" in table and "host 0.00 GiB" not in table
    assert (
        r["maniskill"]["host_ms_per_step"] > 0
        and f"({r['maniskill']['host_ms_per_step']:.2f} ms host work a step" in table
    )
    io = r["imageobs"]  # the same episodes (partial resets from the env) in both files, every env-step counted
    assert io["same_episodes"] and io["fastrecord"]["episodes_in_file"] == io["maniskill"]["episodes_in_file"] > 4
    assert io["fastrecord"]["env_steps"] == io["maniskill"]["env_steps"] == 9 * 4
    assert io["fastrecord"]["rgb_compression"] == "gzip:1" and io["maniskill"]["rgb_compression"] == "gzip:5"
    assert io["ratio"] > 0 and io["fastrecord"]["setup_seconds"] > 0 and "imageobs: ratio" in table
    # the default row runs fastrecord's default and says what it resolved to; the tuned row is labelled as such
    from fastrecord.options import default_trajectory_writers, usable_cores

    assert (
        r["machine"]["cpus"] == usable_cores() and f"{usable_cores()} " in table.splitlines()[0]
    )  # the affinity mask's
    assert io["trajectory_writers"] is None and io["default_writers"] == default_trajectory_writers(
        usable_cores(), True
    )
    assert (
        f"default: trajectory_writers=None -> {io['default_writers']} (chosen for {usable_cores()} usable cores"
        in table
    )
    (tuned,) = io["sweep"]
    assert tuned["trajectory_writers"] == tuned["run"]["writers_started"] == 2
    # every ratio is the quotient of the two rates it names (not just positive): tuned, and the summary's speedup
    assert tuned["ratio"] == pytest.approx(tuned["run"]["env_steps_per_s"] / io["maniskill_runs"][0]["env_steps_per_s"])
    assert tuned["ratio_with_setup"] == pytest.approx(
        tuned["run"]["env_steps_per_s_with_setup"] / io["maniskill_runs"][0]["env_steps_per_s_with_setup"])
    speedup = fr["env_frames_per_s"] / r["maniskill"]["env_frames_per_s"]
    assert r["summary"]["speedup"] == pytest.approx(speedup) and f"{speedup:.1f}x" in table
    assert tuned["run"]["episodes_in_file"] == io["maniskill"]["episodes_in_file"]
    assert "imageobs, tuned: trajectory_writers=2 (not the default)" in table
    # the same pair beside a spinning process (BenchConfig's default imageobs_busy_cores=1), in the same run
    busy = io["busy"]
    assert busy["cores"] == 1 and len(busy["cores_held"]) == 1 and busy["cores_held"][0] > 0
    assert (
        busy["fastrecord"]["episodes_in_file"]
        == busy["maniskill"]["episodes_in_file"]
        == io["maniskill"]["episodes_in_file"]
    )
    assert (
        busy["fastrecord"]["writers_started"] == io["default_writers"]
        and busy["ratio"] > 0
        and busy["ratio_with_setup"] > 0
    )
    for x in (io, busy):  # each ratio is the median of the runs' ratios, set-up inside the timing or not
        assert x["ratio"] == pytest.approx(
            x["fastrecord_runs"][0]["env_steps_per_s"] / x["maniskill_runs"][0]["env_steps_per_s"]
        )
        f, m = x["fastrecord_runs"][0], x["maniskill_runs"][0]
        assert x["ratio_with_setup"] == pytest.approx(
            (m["setup_seconds"] + m["seconds"]) / (f["setup_seconds"] + f["seconds"]))
    assert (
        "imageobs, busy: 1 other process(es) spinning (held " in table
        and "with the recorder's set-up inside the timing" in table
    )


def test_memory_monitor_peaks_are_true_in_a_window_with_no_sample():
    """`MemoryMonitor` and `ChildrenPss` over a window shorter than their sampling interval (the default
    bench's runs are): this process's peak RSS counts memory allocated and freed inside the window (its
    high-water mark), and the children are measured at the window's ends."""
    import subprocess
    import sys

    import numpy as np
    import torch

    from benchmarks.memory import ChildrenPss, MemoryMonitor, pss, rss

    child = subprocess.Popen([sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(60)"],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"  # its start is over: its memory
        # no longer grows (measured while it still started, it grew between the window's end and the check: a CI flake)
        with (
            MemoryMonitor(torch.device("cpu"), interval=3600) as mon,
            ChildrenPss(lambda: [child.pid], interval=3600) as kids,
        ):
            block = np.ones(256 << 17)  # 256 MiB, touched
            del block
        after = rss()
        peaks = mon.peaks()
        assert peaks["host_rss_gib"] * 2**30 >= after + (200 << 20)  # the freed block is in the peak
        assert kids.peak >= pss(child.pid) > 0
    finally:
        child.kill()
        child.wait()


def test_cpu_load_keeps_cores_busy_and_leaves_nothing_running():
    """`benchmarks.load.CpuLoad`: the spinning processes run (they gain CPU time) between enter and exit,
    say how much CPU they held, and are gone after; 0 starts nothing; a bad count is refused."""
    import os
    import time

    from benchmarks.load import CpuLoad, cpu_seconds

    with CpuLoad(1) as load:
        (proc,) = load._procs
        before = cpu_seconds(proc.pid)
        assert before >= 0.05  # enter returned once it was spinning
        deadline = time.monotonic() + 30
        while cpu_seconds(proc.pid) <= before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert cpu_seconds(proc.pid) > before and proc.poll() is None
    assert proc.poll() is not None and load.cores_held > 0 and load._procs == []
    with pytest.raises(ProcessLookupError):
        os.kill(proc.pid, 0)
    with CpuLoad(0) as idle:
        assert idle._procs == []
    assert idle.cores_held == 0
    assert cpu_seconds(2**22 + 12345) == 0.0  # no such process
    with pytest.raises(ValueError, match=r"cores=-1: pass an int >= 0"):
        CpuLoad(-1)


def test_bench_imageobs_options_are_checked():
    from benchmarks.config import BenchConfig

    with pytest.raises(ValueError, match="trajectory_compression='zstd' is unknown"):
        BenchConfig(trajectory_compression="zstd")
    with pytest.raises(ValueError, match="imageobs_content='video' is unknown"):
        BenchConfig(imageobs_content="video")
    with pytest.raises(ValueError, match="imageobs_episode_steps=1 must be at least 2"):
        BenchConfig(imageobs_episode_steps=1)
    with pytest.raises(
        ValueError, match=r"imageobs_writers_sweep=\[8, 0\] holds \[0\]: every entry must be an integer >= 1"
    ):
        BenchConfig(imageobs_writers_sweep=(8, 0))
    with pytest.raises(ValueError, match=r"imageobs_busy_cores=-1 must be at least 0; pass --imageobs-busy-cores N"):
        BenchConfig(imageobs_busy_cores=-1)


def test_bench_cli_rejects_unknown_phase():
    from benchmarks.bench import run_bench
    from benchmarks.config import BenchConfig

    with pytest.raises(ValueError, match="unknown phase"):
        run_bench(BenchConfig(skip=("warp",)))


def test_bench_rejects_unknown_content():
    from benchmarks.bench import run_bench
    from benchmarks.config import BenchConfig

    with pytest.raises(ValueError, match=r"content='video' is unknown; use 'maniskill'.*or 'gradient'"):
        run_bench(BenchConfig(content="video"))


def test_bench_command_without_the_checkout_is_one_line_naming_the_fix(tmp_path, monkeypatch, capsys):
    """fastrecord installed without its source checkout: no benchmarks/ beside src/ to run."""
    from fastrecord.commands import bench
    from fastrecord.commands.cli import main

    monkeypatch.setattr(bench, "BENCHMARKS", tmp_path / "benchmarks")
    for argv in (["bench"], ["bench", "--help"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1, err
        assert err.startswith("fastrecord bench: error: the benchmark is not installed with fastrecord") and \
            "clone fastrecord's repository and run `fastrecord bench` from the checkout" in err, err


def test_bench_runs_the_benchmarks_of_a_checkout_reached_through_a_link(tmp_path, monkeypatch):
    """A checkout whose benchmarks/ is a link to the imported package (a bare src tree beside a copy of the rest)
    loads them; another package of that name is still refused, naming both."""
    import benchmarks
    from fastrecord.commands import bench

    real = Path(benchmarks.__path__[0])
    (tmp_path / "benchmarks").symlink_to(real, target_is_directory=True)
    monkeypatch.setattr(bench, "BENCHMARKS", tmp_path / "benchmarks")
    assert bench.load_benchmarks("config").__name__ == "benchmarks.config"
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "__init__.py").write_text("")
    monkeypatch.setattr(bench, "BENCHMARKS", tmp_path / "other")
    with pytest.raises(ValueError, match=r"another 'benchmarks' package is imported \(.*\), not .*other"):
        bench.load_benchmarks("config")


def test_bench_help_imports_neither_torch_nor_the_benchmark_runner():
    """`fastrecord bench --help` reads the flags from benchmarks/config.py alone: it answers at once."""
    import subprocess
    import sys

    env = checkout_env()  # this checkout's code
    code = (
        "import sys\nfrom fastrecord.commands.cli import main\ntry:\n    main(['bench', '--help'])\n"
        "except SystemExit as e:\n    assert e.code == 0\n"
        "print(sorted(m for m in ('torch', 'mani_skill', 'benchmarks.bench', 'benchmarks.config') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert "--trajectory-compression" in out and out.strip().splitlines()[-1] == "['benchmarks.config']"
