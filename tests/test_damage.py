"""Damaged runs: a deleted, truncated or extra file of any output is one line from ``fastrecord info``,
``consolidate`` and a resume, naming the file and what to do; exit status non-zero; nothing is rewritten,
deleted or renumbered (docs/format.md, "Crash safety")."""

from __future__ import annotations

import shutil
import signal
import sys
from pathlib import Path

import pytest
from conftest import run_then_kill

WORKER = Path(__file__).with_name("fault_worker.py")
sys.path.insert(0, str(WORKER.parent))
import fault_worker  # noqa: E402


@pytest.fixture(scope="module")
def closed_run(tmp_path_factory) -> Path:
    """A closed `fastrecord record` run of PickCube-v1 with HDF5, videos, results and a LeRobot dataset
    holding a camera video."""
    out = tmp_path_factory.mktemp("closed") / "run"
    assert fault_worker.run(str(out), "record", {"h5", "mp4", "lerobot", "rgb"}, [], False, None) == 0
    return out


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.rglob("*"))
            if (p.is_file() and not p.name.startswith(".")) or p.name.endswith(".journal")}


def refused(out: Path, capsys, *texts: str) -> None:
    """info exits 1 naming the damage; consolidate (both paths) exits non-zero with one line; nothing changed."""
    from fastrecord.commands.cli import main

    before = snapshot(out)
    capsys.readouterr()
    assert main(["info", str(out / "run.h5")]) == 1
    printed = capsys.readouterr().out
    damage = [line for line in printed.splitlines() if line.startswith("  damage: ")]
    assert damage and all(t in printed for t in texts), printed
    for target in ("run.h5", "run.lerobot"):
        assert main(["consolidate", str(out / target)]) != 0
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and all(t in err for t in texts), err
    replayed = out.parent / "replayed"
    assert main(["replay", str(out / "run.h5"), "--output-dir", str(replayed)]) == 2  # replay's input check
    err = capsys.readouterr().err
    assert "cannot replay run 'run'" in err and all(t in err for t in texts) and not replayed.exists(), err
    assert snapshot(out) == before  # nothing written, deleted or renumbered


def copy_of(run: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(run, out)
    return out


def truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


DAMAGE = {
    "data parquet deleted": (lambda out: (out / "run.lerobot/data/chunk-000/file-000.parquet").unlink(),
                             ["run.lerobot/data/chunk-000/file-000.parquet is missing"]),
    "data parquet truncated": (lambda out: truncate(out / "run.lerobot/data/chunk-000/file-000.parquet"),
                               ["run.lerobot/data/chunk-000/file-000.parquet cannot be read (truncated"]),
    "episodes file deleted": (lambda out: (out / "run.lerobot/meta/episodes/chunk-000/file-000.parquet").unlink(),
                              ["run.lerobot/meta/episodes/chunk-000/file-000.parquet is missing"]),
    "camera video deleted": (lambda out: next((out / "run.lerobot/videos").rglob("file-000.mp4")).unlink(),
                             ["/chunk-000/file-000.mp4 is missing"]),
    "camera video truncated": (lambda out: truncate(next((out / "run.lerobot/videos").rglob("file-000.mp4"))),
                               ["/chunk-000/file-000.mp4"]),
    "extra data file": (lambda out: shutil.copy(out / "run.lerobot/data/chunk-000/file-000.parquet",
                                                out / "run.lerobot/data/chunk-000/file-001.parquet"),
                        ["file-001.parquet is not counted by any episodes file (extra)"]),
    "episode video deleted": (lambda out: (out / "1_env0_failure.mp4").unlink(),
                              ["1_env0_failure.mp4 (the video of episode 1) is missing"]),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_closed_run_is_refused_and_left_as_it_is(closed_run, tmp_path, capsys, damage):
    out = copy_of(closed_run, tmp_path)
    make, texts = DAMAGE[damage]
    make(out)
    refused(out, capsys, *texts)
    from fastrecord.sinks.base import RunDirectory
    from fastrecord.sinks.reconcile import reconcile

    run = RunDirectory(out, "run", "resume").open()  # what a resumed run does first
    try:
        with pytest.raises(ValueError, match="cannot resume run 'run'"):
            reconcile(run)
    finally:
        run.close()


def test_replay_workers_refuse_a_damaged_input_while_they_make_their_envs(closed_run, tmp_path, capsys):
    """With worker processes the input's outputs are checked while the workers make their envs (not before they
    start): the same one-line refusal, the workers ended before writing, no output folder left, the input as it
    was."""
    from fastrecord.commands.cli import main

    out = copy_of(closed_run, tmp_path)
    make, texts = DAMAGE["episode video deleted"]
    make(out)
    before = snapshot(out)
    replayed = out.parent / "replayed"
    assert main(["replay", str(out / "run.h5"), "--output-dir", str(replayed), "--workers", "2", "--num-envs", "2",
                 "--no-video"]) == 2
    err = capsys.readouterr().err
    assert "cannot replay run 'run'" in err and all(t in err for t in texts), err
    assert len(err.strip().splitlines()) == 1 and not replayed.exists()
    assert snapshot(out) == before


def test_an_intact_run_agrees(closed_run, capsys):
    from fastrecord.commands.cli import main

    assert main(["info", str(closed_run / "run.h5")]) == 0
    agree = f"outputs: {fault_worker.EPISODES} episodes committed; every output and the manifest agree"
    assert agree in capsys.readouterr().out


@pytest.mark.parametrize("output", ["h5", "lerobot"])
def test_a_killed_run_missing_a_part_is_refused_not_renumbered(tmp_path, capsys, monkeypatch, output):
    """A killed run's parts: one of a committed episode deleted (HDF5 part, or a LeRobot part) while later ones
    remain; info, consolidate and a resume refuse, and nothing is renumbered. LeRobot's parts are held until
    the close (FAULT_HOLD_LEROBOT_PARTS): a kill finds the committed ones as parts, not yet in files (else the
    first part left may be one past the commit log, whose loss is no damage: under load CI could see that). The
    run has 24 episodes, so that the kill after 4 lands long before the close (with 6, a late kill found the close
    folding the parts into the files: the first part's episode was in them, its part's loss no damage)."""
    out = tmp_path / "run"
    argv = [sys.executable, str(WORKER), str(out), "record", "h5+lerobot", "none"]
    monkeypatch.setenv("FAULT_HOLD_LEROBOT_PARTS", "1")
    monkeypatch.setenv("FAULT_EPISODES", "24")
    monkeypatch.setattr(fault_worker, "EPISODES", 24)  # the resume below, in this process
    run_then_kill(argv, min_finished=4, extra_s=0.0, sig=signal.SIGKILL)
    if output == "h5":
        parts = sorted((out / "run.h5.parts").glob("part_*.h5"))
        assert len(parts) >= 2
        parts[0].unlink()
        texts = ["run.h5 lacks episode(s) 0"]
    else:
        parts = sorted((out / "run.lerobot.parts").glob("ep_*.parquet"))
        assert len(parts) >= 2
        victim = int(parts[0].name[3:11])
        assert victim < fault_worker.committed(out)  # a committed episode's part
        for p in (out / "run.lerobot.parts").glob(f"ep_{victim:08d}.*"):
            p.unlink()
        texts = [f"run.lerobot lacks episode(s) {victim}"]
    refused(out, capsys, *texts)
    before = snapshot(out)
    assert fault_worker.run(str(out), "record", {"h5", "lerobot"}, [], True, None) == 2  # --if-exists resume
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "cannot resume run 'run'" in err and texts[0] in err
    assert snapshot(out) == before


def test_episodes_out_of_order_or_twice_are_named_with_the_order_found(closed_run, tmp_path, capsys, monkeypatch):
    """Every committed episode is in the LeRobot dataset, but not in order 0, 1, 2, ... (one twice): the damage line
    says so and prints the order found, instead of "lacks episode(s)" with an empty list (what CI met once after a
    full disk; the order found is what whoever meets it next needs)."""
    from fastrecord.sinks.lerobot import check

    out = copy_of(closed_run, tmp_path)
    scan = check.scan_dataset

    def reordered(*args, **kwargs):
        st = scan(*args, **kwargs)
        st.filed = [st.filed[1], st.filed[0], *st.filed[1:]]  # 1, 0, 1, 2, ...: out of order, episode 1 twice
        return st

    monkeypatch.setattr(check, "scan_dataset", reordered)
    refused(out, capsys, "run.lerobot holds the episodes run.results.jsonl commits out of order, episode(s) 1 twice "
                         "(in file order: 1, 0, 1, 2")
