"""Files that travel (issue 17.2): an index of links copied without what it links into is one error naming
the fix; `fastrecord consolidate` makes a crashed run's or a linked join's NAME.h5 self-contained; the
default join of a sharded run opens alone. And what `merge` and `info` say about sharded runs (17.7)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest
from test_shards import _record_double, read_dataset
from test_sink_maniskill_h5 import HEADER, check_file, make_episode

from fastrecord import shards
from fastrecord.commands.cli import main
from fastrecord.sinks.maniskill_h5 import TrajectoryWriter, open_trajectory


@pytest.fixture(autouse=True)
def _one_process(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)


def _copy_alone(h5: Path, to: Path) -> Path:
    """NAME.h5 + NAME.json copied into ``to``, nothing else."""
    to.mkdir(exist_ok=True)
    for p in (h5, h5.with_suffix(".json")):
        shutil.copy(p, to / p.name)
    return to / h5.name


def _crashed_run(out: Path) -> Path:
    """A run left as a crash leaves it: NAME.h5 an index of links into NAME.h5.parts/ (4 episodes)."""
    with TrajectoryWriter(out / "run.h5", HEADER, consolidate_on_close=False) as w:
        w.submit([make_episode(0, 10), make_episode(1, 11)])
        w.submit([make_episode(2, 12), make_episode(3, 13)])
    return out / "run.h5"


def test_crashed_run_copied_alone_then_consolidated(tmp_path, capsys):
    h5 = _crashed_run(tmp_path / "rec")
    copy = _copy_alone(h5, tmp_path / "elsewhere")
    for argv in (["info", str(copy)], ["consolidate", str(copy)]):  # one line each, exit 2, nothing changed
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "Traceback" not in err, err
        assert "run.h5.parts" in err and ("fastrecord consolidate run.h5" in err or "copy run.h5.parts" in err), err
    with pytest.raises(ValueError,
                       match=r"index of links.*4 of its episodes.*run\.h5\.parts.*fastrecord consolidate run\.h5"):
        open_trajectory(copy)
    with h5py.File(copy) as f:
        assert len(f) == 4  # the failed consolidate left the copy as it was

    assert main(["consolidate", str(h5)]) == 0  # where it was recorded
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith(f"{h5}: 4 episodes in one self-contained file")
    assert "run.h5.parts/ removed" in out[0]
    assert not (h5.parent / "run.h5.parts").exists()
    moved = _copy_alone(h5, tmp_path / "elsewhere")
    assert len(check_file(moved)) == 4
    traj = open_trajectory(moved)
    try:
        assert len(traj.episodes) == 4 and traj.actions(traj.episodes[3]).shape[1] == 4
    finally:
        traj.close()
    assert main(["info", str(moved)]) == 0
    assert main(["consolidate", str(h5)]) == 0  # again: nothing to do, said so
    assert "self-contained already" in capsys.readouterr().out


def test_sharded_join_travels_by_default_and_links_only_when_asked(tmp_path, capsys):
    run = tmp_path / "run"
    _record_double(run, total=5)  # joined at the end, with the default: one self-contained file
    alone = _copy_alone(run / "double.h5", tmp_path / "alone")
    with h5py.File(alone) as f:
        assert all(isinstance(f.get(k, getlink=True), h5py.HardLink) for k in f) and len(f) == 5
    recorded = read_dataset(run / "double.h5")
    for g, e in read_dataset(alone).items():
        np.testing.assert_array_equal(e["actions"], recorded[g]["actions"])
    assert main(["info", str(alone)]) == 0
    assert "episodes: 5" in capsys.readouterr().out

    assert main(["merge", str(run), "--name", "double", "--links"]) == 0
    assert "index of links into double.shards/" in capsys.readouterr().out
    linked = _copy_alone(run / "double.h5", tmp_path / "linked")
    assert main(["info", str(linked)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "5 of its episodes" in err and "double.shards" in err, err
    assert "fastrecord consolidate double.h5" in err

    assert main(["consolidate", str(run / "double.h5")]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "5 episodes from 1 shard(s) copied into one self-contained file" in out[0], out
    again = _copy_alone(run / "double.h5", tmp_path / "again")
    assert sorted(read_dataset(again)) == list(range(5))
    assert main(["info", str(again)]) == 0


def test_merge_says_what_is_true_of_a_shard_that_did_not_close(tmp_path):
    _record_double(tmp_path, total=4)
    manifest = shards.shard_dir(tmp_path, "double", 0) / "double.fastrecord.json"
    doc = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**doc, "status": "recording"}))  # killed after its last episode was listed
    report = shards.merge(tmp_path, "double")
    assert report.ok and report.crashed == [0]
    text = "\n".join(report.lines())
    assert "left by a crash" not in text and "resume" not in text
    assert "did not close their shard (crashed or killed), but every expected episode is in the joined dataset" in text
    short = shards.merge(tmp_path, "double", expected=6)  # two episodes are missing: resuming records them
    assert "not closed (crashed or killed): rank(s) [0]; re-running the recording command with --if-exists resume" in \
        "\n".join(short.lines())


def test_info_counts_the_videos_in_shard_folders(tmp_path, capsys):
    _record_double(tmp_path, total=3, save_video=True)
    videos = list(shards.shard_dir(tmp_path, "double", 0).glob("*.mp4"))
    assert videos
    assert main(["info", str(tmp_path / "double.h5")]) == 0
    text = capsys.readouterr().out
    assert f", {len(videos)} videos " in text and "no videos" not in text, text
    assert "shards " in text  # the shards' trajectories are counted in the size
