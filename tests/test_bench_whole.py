"""`benchmarks/bench_whole.py` (whole commands, launch to exit) and the phase stamps it reads: the timing,
table and ratio machinery on a tiny stand-in process (fast), and its real jobs at a tiny size (slow)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks import bench_whole as bw

STAMPS = ("imported", "env_ready", "reset", "first_step", "loop_end", "closed")


def test_stamps_are_written_only_with_the_variable_and_the_first_one_stays(tmp_path):
    path = tmp_path / "timeline.json"
    code = ("import time; from fastrecord.system import stamp; stamp('a'); time.sleep(0.05); stamp('b'); "
            "stamp('a'); print('done')")
    env = bw.child_env(None, path)
    subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True)
    got = json.loads(path.read_text())
    assert list(got) == ["a", "b"] and 0.04 < got["b"] - got["a"] < 5
    env.pop("FASTRECORD_TIMELINE")
    path.unlink()
    subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True)
    assert not path.exists()


def test_stamps_from_many_threads_at_once_are_all_written(tmp_path):
    """A close stamps from its own thread while the caller's stamps too: every stamp lands, none raises."""
    path = tmp_path / "timeline.json"
    code = ("import sys, threading; from fastrecord.system import stamp\n"
            "sys.setswitchinterval(1e-6)  # threads switch inside a stamp's writes (the race, every run)\n"
            "ts = [threading.Thread(target=lambda i=i: [stamp(f't{i}_{k}') for k in range(50)]) for i in range(8)]\n"
            "[t.start() for t in ts]; [t.join() for t in ts]; print('done')")
    out = subprocess.run([sys.executable, "-c", code], env=bw.child_env(None, path), check=True, capture_output=True,
                         text=True)
    assert out.stdout.strip() == "done" and "Traceback" not in out.stderr
    assert sorted(json.loads(path.read_text())) == sorted(f"t{i}_{k}" for i in range(8) for k in range(50))
    assert [p.name for p in tmp_path.iterdir()] == ["timeline.json"]  # no temporary file left


def test_launch_reads_phases_and_the_table_and_ratios_use_them(tmp_path):
    code = ("import time; from fastrecord.system import stamp\n"
            + "".join(f"stamp({name!r}); time.sleep(0.02)\n" for name in STAMPS))
    r = bw.launch("record", "fastrecord record", [sys.executable, "-c", code], tmp_path, env_steps=100)
    assert list(r.stamps) == ["launch", *STAMPS, "exit"]
    assert all(r.phase(n) is not None and r.phase(n) >= 0 for n, _, _ in bw.PHASES)
    assert sum(r.phase(n) for n, _, _ in bw.PHASES) == pytest.approx(r.seconds)
    one = bw.Result("record", "fastrecord record, 1 env", r.seconds, {**r.stamps, "first_step": r.first_step / 2})
    ms = bw.Result("record", "ManiSkill, every video", 2 * r.seconds, {"launch": 0.0, "exit": 2 * r.seconds})
    rows = bw.table([r, one, ms])
    assert rows[0].count("|") == rows[1].count("|") == rows[2].count("|") == rows[4].count("|")
    cells = [c.strip() for c in rows[4].split("|")[1:-1]]
    assert cells[0] == "ManiSkill, every video" and cells[2:] == [""] * (len(bw.PHASES) + 3)  # no stamps: no phases
    replay = bw.Result("replay", "fastrecord replay, 8 episodes", 3.0, {"launch": 0.0, "imported": 1.0, "loop_end": 2.5,
                                                                       "exit": 3.0})
    cells = [c.strip() for c in bw.table([replay])[2].split("|")[1:-1]]
    assert cells[2] == "1.0" and cells[-1] == "1.5" and replay.phase("replay") == 1.5 and r.phase("replay") is None
    lines = bw.ratios([r, one, ms], bw.SIZES["gpu"], {"": None})
    assert "record: ManiSkill every video / fastrecord: 2.00x (target >= 2)" in lines
    assert "record: time to first step, 16 envs / 1 env: 2.00x (target <= 1.3)" in lines
    with pytest.raises(RuntimeError, match="failed \\(exit 3\\)"):
        bw.launch("eval", "broken", [sys.executable, "-c", "raise SystemExit(3)"], tmp_path)


def test_detail_lists_the_stamps_inside_env_creation_and_close_in_time_order(tmp_path):
    stamps = {"launch": 0.0, "imported": 1.0, "subenvs_ready": 2.5, "mirrors_built": 2.0, "env_ready": 3.0,
              "reset": 3.5, "first_step": 4.0, "loop_end": 10.0, "recorder_closed": 10.4, "closed": 10.5,
              "atexit_last": 10.75, "exit": 11.0}
    lines = bw.detail(bw.Result("eval", "x", 11.0, stamps))
    assert lines == ["envs 2.00 s: mirrors_built +1.00, subenvs_ready +1.50",
                     "close 1.00 s: recorder_closed +0.40, closed +0.50, atexit_last +0.75"]
    assert bw.detail(bw.Result("eval", "x", 1.0, {"launch": 0.0, "exit": 1.0})) == []


def test_bad_arguments_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        bw.main(["--only", "nope", "--work-dir", str(tmp_path)])
    assert "--only nope: not a job" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bw.main(["--src", f"x={tmp_path}", "--work-dir", str(tmp_path)])
    assert "must be LABEL=PATH" in capsys.readouterr().err
    for flag, value in (("--replay-episodes", "x"), ("--replay-episodes", "96,0"), ("--envs-per-process", "-1")):
        with pytest.raises(SystemExit):
            bw.main([flag, value, "--work-dir", str(tmp_path)])
        assert f"{flag} {value!r}: give positive integers" in capsys.readouterr().err


def test_src_first_runs_the_other_trees_jobs_first(tmp_path, monkeypatch, capsys):
    """--src-first: the --src trees' record and eval jobs before this checkout's (whose 1-env record job follows its
    own); without --src it is refused."""
    src = tmp_path / "before_src"
    (src / "fastrecord").mkdir(parents=True)
    order: list[str] = []

    def fake_launch(job, label, argv, work, src=None, env_steps=0):
        order.append(f"{label} <- {src.name if src else 'checkout'}")
        return bw.Result(job, label, 1.0, {"launch": 0.0, "first_step": 0.5, "exit": 1.0})

    monkeypatch.setattr(bw, "launch", fake_launch)
    monkeypatch.setattr(bw.subprocess, "run", lambda *a, **k: None)  # the page-cache warm-up
    common = ["--only", "record,eval", "--skip-maniskill", "--src", f"before={src}", "--work-dir", str(tmp_path / "w")]
    assert bw.main([*common, "--src-first"]) == 0
    assert order == ["fastrecord record (before) <- before_src", "fastrecord record <- checkout",
                     "fastrecord record, 1 env <- checkout", "fastrecord make_eval_envs (before) <- before_src",
                     "fastrecord make_eval_envs <- checkout"]
    order.clear()
    assert bw.main(common) == 0
    assert order[0] == "fastrecord record <- checkout" and order[2] == "fastrecord record (before) <- before_src"
    with pytest.raises(SystemExit):
        bw.main(["--src-first", "--work-dir", str(tmp_path / "w")])
    assert "--src-first runs the --src trees' jobs first" in capsys.readouterr().err


@pytest.mark.slow
def test_eval_jobs_tiny_real_processes(tmp_path):
    """The three eval jobs at a tiny size: real processes, every phase stamped, the videos each way writes."""
    s = bw.Size(num_envs=2, size=32, render="cpu", record_episodes=2, episode_steps=3, eval_steps=4,
                replay_episodes=(2,), replay_envs=2)
    results: list[bw.Result] = []
    bw.eval_jobs(s, tmp_path, {"": None}, results)
    assert [r.label for r in results] == ["fastrecord make_eval_envs", "ManiSkill eval, env 0's video",
                                          "ManiSkill eval, no video"]
    for r in results:
        assert all(r.phase(n) is not None for n, _, _ in bw.PHASES), (r.label, r.stamps)
        assert r.env_steps == 8
    # 4 steps of 3-step episodes: every env's first episode ends (fastrecord: each env's; ManiSkill: env 0's)
    assert len(list((tmp_path / "fr_eval").glob("*.mp4"))) >= 2
    assert len(list((tmp_path / "ms_eval").glob("*.mp4"))) >= 1
    assert not (tmp_path / "ms_eval_none").exists()


def test_profile_eval_tiny_real_processes(tmp_path):
    """`benchmarks.profile_eval` at a tiny size: each variant a real process, its steps and timers printed and
    saved (the recorder's timers only where there is one)."""
    from pathlib import Path

    out = tmp_path / "profile.json"
    r = subprocess.run([sys.executable, "-m", "benchmarks.profile_eval", "--num-envs", "2", "--size", "32", "--steps",
                        "4", "--episode-steps", "3", "--render", "cpu", "--variants", "default,no_video", "--json",
                        str(out)], capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[1])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "== default:" in r.stdout and "== no_video:" in r.stdout, r.stdout
    results = {x["variant"]: x for x in json.loads(out.read_text())}
    assert len(results["default"]["steps"]) == 4 and sum(reset for _, reset in results["default"]["steps"]) == 1
    assert "EpisodeRecorder.on_step" in results["default"]["loop_timers"]
    assert "EpisodeRecorder.on_step" not in results["no_video"]["loop_timers"]
    assert results["default"]["close"] > 0 and "RecordVectorEpisode.close" in results["default"]["close_timers"]


def test_profile_replay_tiny_real_processes(tmp_path):
    """`benchmarks.profile_replay` at a tiny size: its input recorded, each variant a real process replaying it,
    its layers timed and saved (on the CPU the batched render does not run: no sub-env or drawing layer)."""
    from pathlib import Path

    out = tmp_path / "profile.json"
    r = subprocess.run([sys.executable, "-m", "benchmarks.profile_replay", "--episodes", "2", "--steps", "3",
                        "--num-envs", "2", "--variants", "async,sync", "--json", str(out)],
                       capture_output=True, text=True, timeout=400, cwd=Path(__file__).parents[1])
    assert r.returncode == 0, r.stderr[-3000:]
    results = {x["variant"]: x for x in json.loads(out.read_text())}
    assert sorted(results) == ["async", "sync"], r.stdout
    for res in results.values():
        assert res["episodes"] == 2 and res["env_steps"] == 6
        assert res["layers"]["batch.step"]["calls"] == 3 and res["layers"]["batch.start"]["calls"] == 1
        assert res["loop_s"] > 0 and res["process_s"] >= res["call_s"]
