"""Fault injection: every stop of record, eval and replay, followed by a resume, leaves each episode
exactly once in every output (HDF5, videos, results, LeRobot), no partial episode, and outputs that
agree with each other and with the run manifest (docs/format.md, "Crash safety").

The matrix is stop kind (SIGKILL, SIGTERM, SIGINT, a full disk, an exception in a sink) x command
(``fastrecord record``, ``make_eval_envs``, ``fastrecord replay``) x outputs; the first session runs in
a subprocess (tests/fault_worker.py) and is stopped, the resume runs here. The default run takes a
representative case of each stop and command; ``-m slow`` runs the whole product.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from conftest import run_then_kill

WORKER = Path(__file__).with_name("fault_worker.py")
sys.path.insert(0, str(WORKER.parent))
import fault_worker  # noqa: E402

SIGNALS = {"sigkill": signal.SIGKILL, "sigterm": signal.SIGTERM, "sigint": signal.SIGINT}


# ---------------------------------------------------------------------------------------------- checks
def check_run(out: Path, outputs: set[str], name: str = "run") -> list[dict]:
    """Every output of run ``name`` holds the same episodes 0 .. n-1, each once and whole; returns the
    kept results rows."""
    from fastrecord.sinks.base import MANIFEST_SUFFIX, journal_path, read_manifest
    from fastrecord.sinks.reconcile import inspect_run
    from fastrecord.sinks.results import read_results
    from fastrecord.video import decode_mp4

    rows = read_results(out / f"{name}.results.jsonl")
    kept = [r for r in rows if r["episode_id"] is not None]
    n = len(kept)
    assert [r["episode_id"] for r in kept] == list(range(n)), [r["episode_id"] for r in rows]
    assert all(r["terminated"] or r["truncated"] for r in rows), "a partial episode (cut, not ended by the env)"
    state = inspect_run(out, name)
    assert state.problems == [] and state.committed == n and state.beyond() == {}
    lengths = [r["length"] for r in kept]
    actions = None
    if "h5" in outputs:
        eps = json.loads((out / f"{name}.json").read_text())["episodes"]
        assert [e["episode_id"] for e in eps] == list(range(n))
        assert [(e["elapsed_steps"], e["episode_seed"]) for e in eps] == [(r["length"], r["seed"]) for r in kept]
        with h5py.File(out / f"{name}.h5", "r") as f:
            assert sorted(f, key=lambda g: int(g[5:])) == [f"traj_{i}" for i in range(n)]
            actions = [f[f"traj_{i}/actions"][:] for i in range(n)]
        assert [len(a) for a in actions] == lengths
        assert not (out / f"{name}.h5.parts").exists()
    else:
        assert not (out / f"{name}.h5").exists()
    videos = sorted(p.name for p in out.glob("*.mp4"))
    if "mp4" in outputs:
        assert videos == sorted(r["video"] for r in kept)  # one each, no leftover of a discarded episode
        for r in kept:
            assert len(decode_mp4(out / r["video"])) == r["length"] + 1, r["video"]
    else:
        assert videos == []
    if "lerobot" in outputs:
        import pyarrow.parquet as pq

        root = out / f"{name}.lerobot"
        assert not root.with_name(root.name + ".parts").exists()
        info = json.loads((root / "meta/info.json").read_text())
        assert info["total_episodes"] == n and info["total_frames"] == sum(lengths)
        episodes = pq.read_table(sorted((root / "meta/episodes").glob("*/*.parquet"))).to_pandas()
        assert episodes["length"].tolist() == lengths
        if actions is not None:
            data = pq.read_table(sorted((root / "data").glob("*/*.parquet"))).to_pandas()
            np.testing.assert_array_equal(np.stack(data["action"].to_numpy()), np.concatenate(actions))
    manifest = read_manifest(out / f"{name}{MANIFEST_SUFFIX}")
    assert manifest["status"] == "closed" and manifest["counters"]["episodes"] == n
    assert set(videos) <= set(manifest["files"]) and all((out / f).exists() for f in manifest["files"])
    assert len(manifest["files"]) == len(set(manifest["files"]))  # each once, also after a resume
    assert manifest["started"] <= manifest["updated"]
    assert not journal_path(out, name).exists() and not list(out.glob(f".{name}{MANIFEST_SUFFIX}.*.tmp"))
    return kept


# ---------------------------------------------------------------------------------------------- sessions
def first_session(out: Path, command: str, outputs: str, stop: str, source: Path | None) -> int:
    """Run ``command`` in a subprocess and stop it with ``stop``; returns the kept episodes it committed."""

    argv = [sys.executable, str(WORKER), str(out), command, outputs]
    argv += ["none"] if stop in SIGNALS else [f"{stop}:2"]
    argv += [str(source)] if source is not None else []
    if stop in SIGNALS:
        run_then_kill(argv, min_finished=2, extra_s=0.15, sig=SIGNALS[stop])
    else:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=300)
        assert r.returncode != 0 and "injected" in r.stdout + r.stderr, r.stderr[-3000:]
    return fault_worker.committed(out)


def resume(out: Path, command: str, outputs: set[str], source: Path | None) -> None:
    code = fault_worker.run(str(out), command, outputs, [], True, str(source) if source else None)
    assert code == 0


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A recording to replay: fault_worker.EPISODES episodes of PickCube-v1."""
    out = tmp_path_factory.mktemp("source")
    assert fault_worker.run(str(out), "record", {"h5"}, [], False, None) == 0
    return out / "run.h5"


def run_case(tmp_path: Path, command: str, outputs: str, stop: str, source: Path | None) -> list[dict]:
    out = tmp_path / "out"
    src = source if command.startswith("replay") else None
    before = first_session(out, command, outputs, stop, src)
    wanted = set(outputs.split("+"))
    resume(out, command, wanted, src)
    if command == "replay2":  # each shard is a run of its own; the merged pair lists every input episode once
        kept = [r for shard in sorted(out.glob("run.shards/rank*")) for r in check_run(shard, wanted)]
        merged = json.loads((out / "run.json").read_text())["episodes"]
        assert [e["source_episode_id"] for e in merged] == list(range(fault_worker.EPISODES))
    else:
        kept = check_run(out, wanted)
    if command == "record":  # the run's episodes, each once: global episode g with seed base + g
        assert sorted(r["global_index"] for r in kept) == list(range(fault_worker.EPISODES))
        assert all(r["seed"] == r["global_index"] for r in kept)
    elif command.startswith("replay"):  # every input episode replayed once
        assert sorted(r["source_episode_id"] for r in kept) == list(range(fault_worker.EPISODES))
    else:  # an evaluation goes on after what it committed
        assert len(kept) == before + fault_worker.EPISODES
    return kept


@pytest.mark.parametrize("command", ["replay", "record"])
def test_killed_after_its_last_commit_is_finished_by_the_resume(tmp_path, request, command):
    """Killed once every episode is committed (rows written) but before any output was closed (the HDF5 parts
    not consolidated, LeRobot's parts not folded into its files): the resume, with nothing left to replay or
    record, finishes every output as the close would have."""
    out = tmp_path / "out"
    source = request.getfixturevalue("source") if command == "replay" else None
    argv = [sys.executable, str(WORKER), str(out), command, "h5+lerobot", f"killed-at-commit:{fault_worker.EPISODES}"]
    r = subprocess.run(argv + ([str(source)] if source else []), capture_output=True, text=True, timeout=300)
    assert r.returncode == 9 and "killed at commit" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]
    assert fault_worker.committed(out) == fault_worker.EPISODES
    assert (out / "run.h5.parts").is_dir() or (out / "run.lerobot.parts").is_dir()  # left for the close to finish
    resume(out, command, {"h5", "lerobot"}, source)
    kept = check_run(out, {"h5", "lerobot"})
    assert len(kept) == fault_worker.EPISODES
    assert json.loads((out / "run.fastrecord.json").read_text())["status"] == "closed"


CHEAP = [
    ("record", "h5+mp4+lerobot", "sigkill"),
    ("record", "h5+lerobot", "sigint"),
    ("eval", "h5+mp4+lerobot", "sink-error"),
    ("eval", "h5+mp4", "sigterm"),
    ("replay", "h5+mp4+lerobot", "sigint"),
    ("record", "mp4+lerobot", "enospc"),
    ("replay2", "h5+mp4", "sigint"),  # replay --workers 2 --resume resumes a sharded replay
]
FULL = [(c, o, s) for c in ("record", "eval", "replay") for o in ("h5+mp4+lerobot", "h5", "mp4", "lerobot")
        for s in ("sigkill", "sigterm", "sigint", "enospc", "sink-error") if (c, o, s) not in CHEAP]


@pytest.fixture(autouse=True)
def _workers_import_this_checkout(monkeypatch):
    """Replay workers are forked from a forkserver, which imports fastrecord by PYTHONPATH, not pytest's path."""
    monkeypatch.setenv("PYTHONPATH", str(WORKER.parents[1] / "src"))


@pytest.mark.parametrize("command,outputs,stop", CHEAP)
def test_stop_then_resume(tmp_path, request, command, outputs, stop):
    run_case(tmp_path, command, outputs, stop, request.getfixturevalue("source") if "replay" in command else None)


@pytest.mark.slow
@pytest.mark.parametrize("command,outputs,stop", FULL)
def test_stop_then_resume_full_matrix(tmp_path, request, command, outputs, stop):
    run_case(tmp_path, command, outputs, stop, request.getfixturevalue("source") if "replay" in command else None)


def test_full_disk_then_resume_keeps_every_output_in_step(tmp_path):
    """The issue's case: the disk fills while `fastrecord record` writes HDF5, videos and LeRobot (filled by
    the test once 2 episodes are committed); space is freed and the run resumed: the LeRobot dataset, the
    trajectory, the videos and the results hold the same episodes, each once."""

    from conftest import tmpfs

    with tmpfs(tmp_path / "disk", "size=16m") as disk:
        full_disk_then_resume(disk)


def full_disk_then_resume(small_disk: Path) -> None:
    import errno
    import os

    out = small_disk / "run"
    proc = subprocess.Popen([sys.executable, str(WORKER), str(out), "record", "h5+mp4+lerobot", "none"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "FAULT_EPISODES": "24"})
    for line in proc.stdout:
        if line.startswith("finished") and int(line.split()[1]) >= 2:
            break
    filler = small_disk / "filler"
    with open(filler, "wb", buffering=0) as f:  # every byte left
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as e:
            assert e.errno == errno.ENOSPC
    _, err = proc.communicate(timeout=300)
    assert proc.returncode != 0 and "No space left on device" in err, err[-3000:]
    filler.unlink()
    os.environ["FAULT_EPISODES"] = "24"
    try:
        before = fault_worker.committed(out)
        fault_worker.EPISODES = 24
        resume(out, "record", {"h5", "mp4", "lerobot"}, None)
    finally:
        fault_worker.EPISODES = int(os.environ.pop("FAULT_EPISODES"))
    kept = check_run(out, {"h5", "mp4", "lerobot"})
    assert before >= 2 and sorted(r["global_index"] for r in kept) == list(range(24))


def test_after_kill_9_the_manifest_lists_every_file_and_consolidate_closes_the_run(tmp_path):
    """The manifest and its journal list every video a SIGKILLed run wrote (an overwrite then removes them
    all); a manifest write's temporary left by the kill is removed; ``fastrecord consolidate`` makes every
    output agree and marks the run closed, its start time kept."""
    from fastrecord.commands.cli import main
    from fastrecord.sinks.base import MANIFEST_SUFFIX, RunDirectory, listed_files, owned_intent_files, read_manifest

    out = tmp_path / "out"
    argv = [sys.executable, str(WORKER), str(out), "record", "h5+mp4", "none"]
    run_then_kill(argv, min_finished=2, extra_s=0.3, sig=signal.SIGKILL)
    listed = {**listed_files(out, "run"), **owned_intent_files(out, "run")}
    videos = {p.name for p in out.glob("*.mp4")}
    assert videos and videos <= set(listed)
    started = read_manifest(out / f"run{MANIFEST_SUFFIX}")["started"]
    (out / f".run{MANIFEST_SUFFIX}.4242.tmp").write_text("{")  # what a kill during a manifest write leaves
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    RunDirectory(copy, "run", "overwrite").open().close()  # every file of the killed run is removed
    assert not list(copy.glob("*.mp4")) and not list(copy.glob(".run*.tmp"))
    assert main(["consolidate", str(out / "run.h5")]) == 0
    check_run(out, {"h5", "mp4"})
    assert read_manifest(out / f"run{MANIFEST_SUFFIX}")["started"] == started
