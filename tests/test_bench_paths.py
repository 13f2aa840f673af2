"""`fastrecord bench` phases of issue 9 (staggered episode ends, cold start, make_eval_envs' CPU branch) at
tiny shapes on CPU: they run, count every frame, and report their rows."""

from __future__ import annotations

import pytest


def test_staggered_and_coldstart_phases_tiny_cpu(tmp_path):
    from benchmarks.bench import format_table, run_bench
    from benchmarks.config import BenchConfig

    cfg = BenchConfig(num_envs=4, width=32, height=32, episode_steps=6, batches=2, warmup_batches=1, device="cpu",
                      content="gradient", workers=2, stagger_steps=(3, 6), coldstart_episodes=6,
                      skip=("ceiling", "quality", "maniskill", "keepup", "realenv", "micro", "cpueval", "imageobs"))
    r = run_bench(cfg, log=lambda m: None)
    st = r["staggered"]
    assert st["episodes"] >= 8 and st["dropped_frames"] == 0 and st["bad_videos"] == 0 and st["psnr_db"] > 30
    assert 3 + 1 <= st["mean_episode_frames"] <= 6 + 1  # lengths drawn by the env, success ends some earlier
    assert st["episodes_ending_per_step"] > 0 and "finalize" in st["split_ms_per_step"]
    for mode in ("sync", "staggered"):
        c = r["coldstart"][mode]
        assert c["episodes"] >= 6 and c["dropped_frames"] == 0 and c["setup_seconds"] > 0 and c["host_peak_rss_gib"] > 0
    table = format_table(r)
    assert (
        "staggered: lengths 3-6 from the env" in table
        and "cold start, sync" in table
        and "of all-end-together" in table
    )


def test_stagger_steps_are_checked():
    from benchmarks.config import BenchConfig

    with pytest.raises(ValueError, match=r"stagger_steps=\[8, 3\] must be \[lo, hi\] with 1 <= lo <= hi"):
        BenchConfig(stagger_steps=(8, 3))
