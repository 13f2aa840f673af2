"""NAME.results.jsonl: one row per finished episode (kept or not), equal to the trajectory JSON and the
env's flags; the Wilson interval; the printed summary of `fastrecord record`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gymnasium as gym
import h5py
import numpy as np
import pytest
import torch
from conftest import FullOnce

from fastrecord import RecordEpisode
from fastrecord.sinks import EpisodeEnded, Sink
from fastrecord.sinks.results import finite_row, rate_text, read_results, summary_lines, wilson_interval
from fastrecord.testing import BatchedDoubleEnv


def test_wilson_interval_known_values():
    # Wilson 95% score interval (z = 1.959964): 31/50 -> [0.4815, 0.7414]; 0/10 -> [0, 0.2775]; 10/10 -> [0.7225, 1]
    np.testing.assert_allclose(wilson_interval(31, 50), (0.48150, 0.74137), atol=1e-5)
    np.testing.assert_allclose(wilson_interval(0, 10), (0.0, 0.277533), atol=1e-6)
    np.testing.assert_allclose(wilson_interval(10, 10), (0.722467, 1.0), atol=1e-6)
    assert wilson_interval(0, 0) == (0.0, 1.0)
    assert rate_text("success", 31, 50) == "success 0.62 [0.48, 0.74] (31/50)"


def run_double(out, keep: str, save_trajectory: bool = True, save_video: bool = True):
    """3 envs, 4-step time limit; env 0 succeeds from step 2, env 1 never, env 2 from step 3. Two batches:
    a full one (every env truncated at 4), then 2 steps ended by close (in progress)."""
    double = BatchedDoubleEnv(num_envs=3, max_episode_steps=4, success_step=[2, 0, 3])
    env = RecordEpisode(double, str(out), trajectory_name="run", keep=keep, save_trajectory=save_trajectory,
                        save_video=save_video)
    flags, rewards = [], []
    env.reset(seed=[10, 11, 12])
    for t in range(4):
        _, rew, terminated, truncated, info = env.step(torch.full((3, 3), 0.1 * (t + 1)))
        flags.append((info["success"].clone(), terminated.clone(), truncated.clone()))
        rewards.append(rew.clone())
    env.reset(seed=[20, 21, 22])
    for _ in range(2):
        _, rew, *_ = env.step(torch.zeros(3, 3))
        rewards.append(rew.clone())
    env.close()
    return env, flags, rewards


@pytest.mark.parametrize("keep", ["all", "success"])
def test_rows_equal_the_trajectory_json_and_the_env_flags(tmp_path, keep):
    env, flags, rewards = run_double(tmp_path, keep)
    rows = read_results(tmp_path / "run.results.jsonl")
    assert rows == env.recorder.results.rows
    # first batch: env order at each end; success at the last step, at any step, lengths, returns
    first, second = rows[:3], rows[3:]
    assert [(r["env_idx"], r["seed"], r["length"]) for r in first] == [(0, 10, 4), (1, 11, 4), (2, 12, 4)]
    assert [(r["env_idx"], r["seed"], r["length"]) for r in second] == [(0, 20, 2), (1, 21, 2), (2, 22, 2)]
    last_success, last_term, last_trunc = flags[-1]
    assert [r["success"] for r in first] == last_success.tolist() == [True, False, True]
    assert [r["success_once"] for r in first] == torch.stack([f[0] for f in flags]).any(0).tolist()
    assert [r["terminated"] for r in first] == last_term.tolist() and [
        r["truncated"] for r in first
    ] == last_trunc.tolist()
    np.testing.assert_allclose([r["return"] for r in first], torch.stack(rewards[:4]).sum(0).tolist(), rtol=1e-6)
    np.testing.assert_allclose([r["return"] for r in second], torch.stack(rewards[4:]).sum(0).tolist(), rtol=1e-6)
    # second batch ended by close: env 0 succeeded at step 2, the others not; neither flag set by the env
    assert [r["success"] for r in second] == [True, False, False]
    assert not any(r["terminated"] is False and r["truncated"] for r in second)
    # kept rows carry the ids of the trajectory JSON, in order, and their videos; the others null
    episodes = json.loads((tmp_path / "run.json").read_text())["episodes"]
    kept = [r for r in rows if r["episode_id"] is not None]
    assert [r["episode_id"] for r in kept] == [e["episode_id"] for e in episodes]
    assert [(r["seed"], r["length"], r["success"]) for r in kept] == [
        (e["episode_seed"], e["elapsed_steps"], e["success"]) for e in episodes]
    expect_kept = [True] * 6 if keep == "all" else [True, False, True, True, False, False]
    assert [r["episode_id"] is not None for r in rows] == expect_kept
    for r in rows:
        if r["episode_id"] is None:
            assert r["video"] is None
        else:
            assert r["video"] == f"{r['episode_id']}_env{r['env_idx']}_{'success' if r['success'] else 'failure'}.mp4"
            assert (tmp_path / r["video"]).is_file()
    manifest = json.loads((tmp_path / "run.fastrecord.json").read_text())
    assert "run.results.jsonl" in manifest["files"]


def test_video_only_run_counts_failures_and_names_renamed_videos(tmp_path):
    """An evaluation keeping no trajectory and only the videos of successes still lists every episode;
    a video whose name was taken (another run in the folder) is listed under the name written."""
    (tmp_path / "0_env0_success.mp4").write_bytes(b"an earlier run's video")
    env, _, _ = run_double(tmp_path, "success", save_trajectory=False)
    rows = read_results(tmp_path / "run.results.jsonl")
    assert len(rows) == 6 and [r["success"] for r in rows] == [True, False, True, True, False, False]
    assert [r["video"] for r in rows if r["video"]] == [
        "0_env0_success_1.mp4",
        "1_env2_success.mp4",
        "2_env0_success.mp4",
    ]
    assert summary_lines(rows[:3])[0] == ("results of 3 episodes: success 0.67 [0.21, 0.94] (2/3), "
                                          "success_once 0.67 [0.21, 0.94] (2/3)")


def test_rows_survive_a_resume_and_a_crash_keeps_rows_so_far(tmp_path):
    run_double(tmp_path, "all", save_video=False)
    rows = read_results(tmp_path / "run.results.jsonl")
    env = RecordEpisode(BatchedDoubleEnv(num_envs=3, max_episode_steps=4), str(tmp_path), trajectory_name="run",
                        if_exists="resume", save_video=False)
    env.reset(seed=[30, 31, 32])
    for _ in range(4):
        env.step(torch.zeros(3, 3))
    env.reset(seed=[40, 41, 42])  # the first batch is finished: its rows follow once every output holds it
    env.wait_until_done()
    now = read_results(tmp_path / "run.results.jsonl")
    assert now[:6] == rows and [r["episode_id"] for r in now[6:]] == [6, 7, 8]
    env.close()


def test_record_cli_prints_results_and_startup(tmp_path, capsys):
    """A real PickCube-v1 CPU run through `fastrecord record`: rows equal the JSON; the summary's counts
    are the bar's; start-up reported apart."""
    from fastrecord.commands.cli import main

    out = tmp_path / "rec"
    assert main(["record", "PickCube-v1", "--episodes", "2", "--max-episode-steps", "3", "--width", "64",
                 "--height", "64", "--output-dir", str(out), "--keep", "all"]) == 0
    printed = capsys.readouterr().out
    rows = read_results(out / "trajectory.results.jsonl")
    episodes = json.loads((out / "trajectory.json").read_text())["episodes"]
    assert [(r["episode_id"], r["seed"], r["length"], r["success"]) for r in rows] == [
        (e["episode_id"], e["episode_seed"], e["elapsed_steps"], e["success"]) for e in episodes]
    assert all(r["truncated"] and r["video"] == f"{r['episode_id']}_env0_failure.mp4" for r in rows)
    with __import__("h5py").File(out / "trajectory.h5") as f:
        for r in rows:
            np.testing.assert_allclose(r["return"], f[f"traj_{r['episode_id']}/rewards"][:].sum(), rtol=1e-5)
            assert r["success_once"] == bool(f[f"traj_{r['episode_id']}/success"][:].any())
    assert "results of 2 episodes: success 0.00 [0.00, 0.66] (0/2)" in printed
    assert "mean length 3.0 steps" in printed and "start-up (env creation):" in printed
    assert f"results: {out / 'trajectory.results.jsonl'}" in printed


def strict_rows(path) -> list[dict]:
    """The rows of a results file read by a strict JSON parser: NaN, Infinity and -Infinity refused."""

    def refuse(constant: str):
        raise ValueError(f"{constant} is not JSON")

    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


class NanRewards(gym.Wrapper):
    """Env 1's rewards are NaN, env 2's +inf (a corrupted or diverging env); env 0's are finite."""

    def step(self, action):
        obs, rew, terminated, truncated, info = self.env.step(action)
        rew = rew.clone().double()
        rew[1], rew[2] = float("nan"), float("inf")
        return obs, rew, terminated, truncated, info


def test_results_are_strict_json_with_non_finite_returns(tmp_path):
    """NaN or infinite returns are written as null and the row names them; the file parses strictly."""
    env = RecordEpisode(
        NanRewards(BatchedDoubleEnv(num_envs=3, max_episode_steps=4)),
        str(tmp_path),
        trajectory_name="run",
        save_video=False,
        save_trajectory=False,
    )
    env.reset(seed=[0, 1, 2])
    for _ in range(4):
        env.step(torch.zeros(3, 3))
    env.close()
    rows = strict_rows(tmp_path / "run.results.jsonl")
    assert rows == env.recorder.results.rows
    assert [r["return"] is None for r in rows] == [False, True, True]
    assert [r.get("non_finite") for r in rows] == [None, ["return"], ["return"]]
    assert np.isfinite(rows[0]["return"])
    line = summary_lines(rows)[1]
    assert line == f"mean length 4.0 steps, mean return {rows[0]['return']:.3f} (2 non-finite, left out)"
    assert finite_row({"a": [1.0, float("-inf")], "b": {"c": float("nan")}, "d": 2}) == {
        "a": [1.0, None], "b": {"c": None}, "d": 2, "non_finite": ["a", "b"]}


class Outcomes(Sink):
    """A user's sink that keeps what it receives: kept episodes and every episode's outcome."""

    wants_datasets = False

    def __init__(self) -> None:
        self.submitted: list[int] = []
        self.ended: list[EpisodeEnded] = []

    def submit(self, episodes):
        self.submitted += [ep.episode_id for ep in episodes]

    def episodes_ended(self, ended):
        assert all(ev.episode_id in self.submitted for ev in ended if ev.kept)  # submitted first
        self.ended += list(ended)


def test_every_sink_gets_an_event_for_every_finished_episode(tmp_path):
    """With keep='success' a sink receives only kept episodes, but an `EpisodeEnded` for each: the same
    outcome as the results rows."""
    sink = Outcomes()
    double = BatchedDoubleEnv(num_envs=3, max_episode_steps=4, success_step=[2, 0, 3])
    env = RecordEpisode(double, str(tmp_path), trajectory_name="run", keep="success", sinks=[sink], save_video=False)
    env.reset(seed=[10, 11, 12])
    for _ in range(4):
        env.step(torch.ones(3, 3))
    env.close()
    rows = read_results(tmp_path / "run.results.jsonl")
    assert len(sink.ended) == len(rows) == 3 and sink.submitted == [0, 1]
    assert [ev.kept for ev in sink.ended] == [True, False, True]
    assert [(ev.episode_id, ev.env_idx, ev.seed, ev.length, ev.success, ev.success_once, ev.terminated, ev.truncated)
            for ev in sink.ended] == [(r["episode_id"], r["env_idx"], r["seed"], r["length"], r["success"],
                                       r["success_once"], r["terminated"], r["truncated"]) for r in rows]
    np.testing.assert_allclose([ev.episode_return for ev in sink.ended], [r["return"] for r in rows])
    assert [ev.fail for ev in sink.ended] == [False] * 3  # the double reports fail, never set here
    assert [ev.has_frames for ev in sink.ended] == [False] * 3  # no frame sink: no frames captured


class FailsOnce(Sink):
    """A user's sink whose first `episodes_ended` raises (a logger losing its connection, say)."""

    wants_datasets = False

    def __init__(self) -> None:
        self.calls = 0

    def submit(self, episodes):
        pass

    def episodes_ended(self, ended):
        self.calls += 1
        if self.calls == 1:
            raise ConnectionError("the dashboard went away")


def _two_episodes_then_a_reset_raises(tmp_path: Path, first: Any, outcomes: Outcomes, error: type[BaseException],
                                      match: str | None = None) -> RecordEpisode:
    """A recorder of 2 envs with the sinks ``first`` then ``outcomes``: one episode each (seeds 10, 11, 3 steps),
    then the reset that ends them raises ``error`` (from ``first``); returns the recorder, still open."""
    double = BatchedDoubleEnv(num_envs=2, max_episode_steps=3)
    env = RecordEpisode(double, str(tmp_path), trajectory_name="run", sinks=[first, outcomes], save_video=False)
    env.reset(seed=[10, 11])
    for _ in range(3):
        env.step(torch.ones(2, 3))
    with pytest.raises(error, match=match):
        env.reset(seed=[12, 13])
    return env


def test_a_sink_raising_in_episodes_ended_reaches_the_caller_and_loses_nothing(tmp_path):
    """The error of a sink's `episodes_ended` is raised in the caller (at the reset that ended the
    episodes); the sinks after it still get the event (the results file has its rows), the episodes are
    written once (never finalized again by the next reset or by close), and recording goes on."""
    failing, outcomes = FailsOnce(), Outcomes()
    env = _two_episodes_then_a_reset_raises(tmp_path, failing, outcomes, ConnectionError, "the dashboard went away")
    assert [(ev.episode_id, ev.env_idx, ev.seed) for ev in outcomes.ended] == [(0, 0, 10), (1, 1, 11)]
    env.wait_until_done()  # the rows follow once the trajectory holds the episodes
    assert [(r["episode_id"], r["seed"]) for r in read_results(tmp_path / "run.results.jsonl")] == [(0, 10), (1, 11)]
    env.reset(seed=[12, 13])  # the ended episodes are not finalized again
    for _ in range(2):
        env.step(torch.ones(2, 3))
    env.close()  # saves the two episodes in progress
    assert failing.calls == 2 and outcomes.submitted == [0, 1, 2, 3]
    assert [(ev.episode_id, ev.seed, ev.length) for ev in outcomes.ended] == [
        (0, 10, 3),
        (1, 11, 3),
        (2, 12, 2),
        (3, 13, 2),
    ]
    rows = read_results(tmp_path / "run.results.jsonl")
    assert [(r["episode_id"], r["seed"], r["length"]) for r in rows] == [(0, 10, 3), (1, 11, 3), (2, 12, 2), (3, 13, 2)]
    eps = json.loads((tmp_path / "run.json").read_text())["episodes"]
    assert [(e["episode_id"], e["episode_seed"], e["elapsed_steps"]) for e in eps] == [
        (0, 10, 3),
        (1, 11, 3),
        (2, 12, 2),
        (3, 13, 2),
    ]
    with h5py.File(tmp_path / "run.h5", "r") as f:
        assert sorted(f) == ["traj_0", "traj_1", "traj_2", "traj_3"]
        assert [f[f"traj_{i}/actions"].shape[0] for i in range(4)] == [3, 3, 2, 2]


class Commits(Sink):
    """A user's sink that notes every `after_commit`: (committed, wait, kept rows in the results file then)."""

    wants_datasets = False

    def __init__(self) -> None:
        self.calls: list[tuple[int, bool, int]] = []

    def submit(self, episodes):
        pass

    def after_commit(self, committed, wait):
        rows = read_results(self.run.path(".results.jsonl"))
        self.calls.append((committed, wait, sum(r["episode_id"] is not None for r in rows)))


def _three_envs_stepped(tmp_path: Path, sink: Sink, steps: int) -> RecordEpisode:
    """A recorder of 3 envs (episodes of 4 steps, successes at steps 2, 0, 3) with ``sink``, reset with seeds
    10, 11, 12 and stepped ``steps`` times."""
    double = BatchedDoubleEnv(num_envs=3, max_episode_steps=4, success_step=[2, 0, 3])
    env = RecordEpisode(double, str(tmp_path), trajectory_name="run", sinks=[sink], save_video=False)
    env.reset(seed=[10, 11, 12])
    for _ in range(steps):
        env.step(torch.ones(3, 3))
    return env


def test_every_output_hears_each_advance_of_the_commit_log(tmp_path):
    """`Sink.after_commit`: the results sink tells every output when the commit log advances, after the rows are
    written; ``recorder.wait_until_done`` (one pass over the sinks) leaves the log at every kept episode, told
    with ``wait=True`` where that pass committed them (the trajectory's writer process lists them)."""
    sink = Commits()
    env = _three_envs_stepped(tmp_path, sink, 4)
    env.reset(seed=[20, 21, 22])  # the 3 truncated episodes end here
    env.recorder.wait_until_done()
    assert sink.calls and sink.calls[-1][0] == env.recorder.run.committed == 3
    assert all(committed == kept for committed, _, kept in sink.calls)  # told once the rows are on disk
    assert [c for c, _, _ in sink.calls] == sorted({c for c, _, _ in sink.calls})  # each advance once, in order
    told = len(sink.calls)
    env.close()
    assert len(sink.calls) == told  # nothing more to commit at close
    assert len(json.loads((tmp_path / "run.json").read_text())["episodes"]) == 3


def test_the_close_commits_without_waiting_and_the_outputs_finish_their_files_in_their_close(tmp_path):
    """At close the results sink writes the last rows, then tells the outputs with ``wait=False`` (they finish
    their files in their own close, which runs beside the other outputs'); every episode in every output."""
    sink = Commits()
    env = _three_envs_stepped(tmp_path, sink, 3)
    env.close()  # the 3 episodes in progress end here
    assert sink.calls[-1][:2] == (3, False) and sink.calls[-1][2] == 3  # told after their rows were written
    assert env.recorder.run.committed == 3
    assert len(json.loads((tmp_path / "run.json").read_text())["episodes"]) == 3
    assert [r["length"] for r in read_results(tmp_path / "run.results.jsonl")] == [3, 3, 3]


class Slow(Sink):
    """A sink whose close meets the others at a barrier (only closes that run at the same time pass it), or
    raises, and notes when it closed."""

    wants_datasets = False

    def __init__(self, name, log, barrier=None, error=None):
        self.name, self.log, self.barrier, self.error = name, log, barrier, error

    def submit(self, episodes):
        pass

    def close(self):
        if self.barrier is not None:
            self.barrier.wait(timeout=20)  # BrokenBarrierError if the closes ran one after the other
        self.log.append(self.name)
        if self.error is not None:
            raise self.error


def test_close_sinks_runs_the_outputs_side_by_side_and_the_last_after_them():
    import threading

    from fastrecord.sinks.base import close_sinks

    log: list[str] = []
    barrier = threading.Barrier(3)
    a, b = Slow("a", log, barrier), Slow("b", log, barrier, error=ValueError("b failed"))
    user = Slow("user", log, barrier)  # the calling thread's close meets the two threads' at the barrier
    last = Slow("last", log, error=OSError("last failed"))
    errors = close_sinks([a, b, user, last], side_by_side=[a, b], last=last)
    assert [type(e) for e in errors] == [ValueError, OSError]  # in the sinks' order, every sink closed
    assert sorted(log[:3]) == ["a", "b", "user"] and log[3] == "last"


class InterruptedAtSubmit(Sink):
    """A user's sink whose first `submit` is where a Ctrl-C (``KeyboardInterrupt``) or a SIGTERM (``SystemExit``, from
    `fastrecord.install_signal_handlers`' handler) lands."""

    wants_datasets = False

    def __init__(self, error: BaseException) -> None:
        self.calls, self.error = 0, error

    def submit(self, episodes):
        self.calls += 1
        if self.calls == 1:
            raise self.error


@pytest.mark.parametrize("error", [KeyboardInterrupt(), SystemExit(143)], ids=["ctrl_c", "sigterm"])
def test_a_ctrl_c_during_one_sinks_hand_off_still_reaches_the_sinks_after_it(tmp_path, error):
    """A Ctrl-C while the finished episodes go to the sinks: the sinks after the interrupted one still take them,
    then the KeyboardInterrupt (or SIGTERM's SystemExit) reaches the caller; the trajectory and the later sink hold the
    same episodes (without it an output could hold an episode that another never got: CI met a trajectory of 3
    episodes beside 2 videos, after a Ctrl-C and again, on 2026-12-08, after a SIGTERM).
    The episodes' results rows, written at their end events after the hand-off, are not (the interrupt ends that
    reset): a resumed run records those episodes again."""
    interrupted, outcomes = InterruptedAtSubmit(error), Outcomes()
    env = _two_episodes_then_a_reset_raises(tmp_path, interrupted, outcomes, type(error))
    assert outcomes.submitted == [0, 1]
    env.close()
    with h5py.File(tmp_path / "run.h5", "r") as f:
        assert sorted(k for k in f if k.startswith("traj_")) == ["traj_0", "traj_1"]


def test_a_results_row_whose_write_failed_is_written_once_when_written_again(tmp_path):
    """The disk fills while a results row is written (half of it on disk): the error reaches the caller, the file
    still ends at its last whole row, and the row written again (space back, at the close) is there once, every
    line whole: the commit log holds every episode (a buffered file wrote the failed bytes again before the
    retry's row: that row twice, and the log ended there)."""
    env = _three_envs_stepped(tmp_path, Outcomes(), 4)
    results = env.recorder.results
    results._file = FullOnce(results._file)
    env.reset(seed=[20, 21, 22])  # the 3 episodes end: their rows wait for the trajectory
    with pytest.raises(OSError, match="No space left"):
        env.recorder.wait_until_done()
    assert (tmp_path / "run.results.jsonl").read_bytes() == b""  # the half row undone
    env.close()  # space is back: the rows are written
    lines = (tmp_path / "run.results.jsonl").read_text().splitlines()
    assert [json.loads(line)["episode_id"] for line in lines] == [0, 1, 2]
    from fastrecord.sinks.reconcile import commit_log

    assert commit_log(read_results(tmp_path / "run.results.jsonl")) == (3, 3)
