"""`benchmarks/bench_replay.py`'s refusals: counts below their minimum are argparse usage errors naming the value,
and an earlier run's input in ``--work-dir`` is named (with the fix) rather than recorded over."""

from __future__ import annotations

import sys

import pytest

from benchmarks import bench_replay as br


@pytest.mark.parametrize("argv, message", [
    (["--busy", "-1"], "argument --busy: -1 is below 0: give 0 or more"),
    (["--count", "0"], "argument --count: 0 is below 1: give 1 or more"),
    (["--repeat", "x"], "argument --repeat: 'x' is not an integer"),
])
def test_counts_below_their_minimum_are_usage_errors(argv, message, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bench_replay.py", *argv])
    with pytest.raises(SystemExit) as e:
        br.main()
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_an_earlier_input_in_the_work_dir_is_named_not_recorded_over(tmp_path):
    folder = tmp_path / "input"
    folder.mkdir()
    (folder / "pickcube.h5").write_bytes(b"an earlier run's input")
    with pytest.raises(SystemExit) as e:
        br.record_input(folder, 2, 5, None)
    assert "exists (an earlier run's input): replay it with --traj" in str(e.value)
    assert (folder / "pickcube.h5").read_bytes() == b"an earlier run's input"
