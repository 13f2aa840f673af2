"""Sharded runs (fastrecord.shards): torchrun with 2 ranks (gloo, CPU) on PickCube-v1 and on the batched
test double; every global episode exactly once with id g, the same dataset for world size 1 and 2, a
rank killed with SIGKILL resumed by the same command, ManiSkill's replay tool and loaders on the joined
file; the rules, the schedule and merge's refusals in-process."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import gymnasium as gym
import h5py
import numpy as np
import pytest
from conftest import TORCHRUN, fastrecord_cli, torchrun, torchrun_env

from fastrecord import shards
from fastrecord.sinks.maniskill_h5 import read_json

WORKER = Path(__file__).with_name("shard_worker.py")
# the PickCube recording every torchrun case below runs (world size varies): 8 global episodes; no videos, as
# lavapipe takes 10-30 s per process to a first frame (the double's case checks each shard's videos)
RECORD = ["-m", "fastrecord", "record", "PickCube-v1", "--episodes", "8", "--max-episode-steps", "12", "--width", "64",
          "--height", "64", "--no-video", "--seed", "5"]


def read_dataset(h5_path: Path) -> dict[int, dict]:
    """{episode_id: seed, reset kwargs, length, rank, actions, env states} read back from a joined pair."""
    meta = json.loads(h5_path.with_suffix(".json").read_text())
    out = {}
    with h5py.File(h5_path, "r") as f:
        for e in meta["episodes"]:
            g = f[f"traj_{e['episode_id']}"]
            states: dict[str, np.ndarray] = {}
            g["env_states"].visititems(
                lambda k, v, states=states: states.__setitem__(k, v[:]) if isinstance(v, h5py.Dataset) else None
            )
            out[e["episode_id"]] = dict(
                seed=e["episode_seed"],
                reset_kwargs=e["reset_kwargs"],
                steps=e["elapsed_steps"],
                rank=e["source_rank"],
                global_index=e["global_index"],
                actions=g["actions"][:],
                states=states,
                success=e.get("success"),
            )
    return out


def assert_same_episodes(a: dict[int, dict], b: dict[int, dict]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        for key in ("seed", "reset_kwargs", "steps", "global_index", "success"):
            assert a[k][key] == b[k][key], (k, key, a[k][key], b[k][key])
        np.testing.assert_array_equal(a[k]["actions"], b[k]["actions"])
        assert a[k]["states"].keys() == b[k]["states"].keys()
        for leaf in a[k]["states"]:
            np.testing.assert_array_equal(a[k]["states"][leaf], b[k]["states"][leaf], err_msg=f"episode {k} {leaf}")


# ---------------------------------------------------------------------------------------------- rules, in-process
def test_rank_info_from_torchrun_variables(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    assert shards.rank_info() == shards.RankInfo(0, 1, 0, 1)
    assert not shards.rank_info().distributed
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    info = shards.rank_info()
    assert info == shards.RankInfo(3, 4, 1, 2) and info.distributed
    from fastrecord.options import usable_cores

    assert shards.default_workers(info) == max(1, min(16, usable_cores(2)))
    # the cores this process may use (its affinity mask), not the machine's, shared by the host's ranks
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(12)))
    assert shards.default_workers(info) == 6 and shards.default_workers(shards.RankInfo(0, 1, 0, 1)) == 12
    assert shards.default_workers(shards.RankInfo(0, 1, 0, 1), cap=4) == 4
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {5})
    assert shards.default_workers(info) == 1  # at least one
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert shards.rank_info().distributed  # torchrun with one process is a sharded run too
    monkeypatch.setenv("RANK", "two")
    with pytest.raises(ValueError, match=r"RANK='two' is not an integer"):
        shards.rank_info()
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"rank 5 of world size 2"):
        shards.rank_info()


def test_episode_rule_and_schedule():
    assert [shards.owner(g, 3) for g in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert list(shards.episodes_of(1, 3, 8)) == [1, 4, 7]
    assert sorted(g for r in range(3) for g in shards.episodes_of(r, 3, 8)) == list(range(8))
    assert shards.episode_seed(100, 7) == 107
    assert shards.shard_dir("out", "demo", 2) == Path("out/demo.shards/rank00002")
    with pytest.raises(ValueError, match=r"world_size=0 must be an integer >= 1"):
        shards.owner(1, 0)
    with pytest.raises(ValueError, match=r"rank=3 is outside 0..1"):
        shards.episodes_of(3, 2, 10)
    sch = shards.EpisodeSchedule([1, 4, 7], num_envs=2, rank=1, base_seed=10)
    assert sch.assign([0, 1]) == [{"global_index": 1, "source_rank": 1}, {"global_index": 4, "source_rank": 1}]
    assert sch.seeds.tolist() == [11, 14] and not sch.done
    assert sch.assign([1]) == [{"global_index": 7, "source_rank": 1}] and sch.seeds.tolist() == [11, 17]
    assert sch.assign([0, 1]) == [None, None]  # ran out: spare slots, not recorded
    assert sch.done and sch.finished == [4, 1, 7]


def test_single_schedule_continues_the_run_on_disk(tmp_path):
    """An unsharded run (``fastrecord record`` without torchrun) resumes with the global episodes its
    NAME.json and results file lack: the seed sequence goes on and ``total`` is the run's size."""
    sch = shards.single_schedule(tmp_path, "t", total=3, base_seed=5, num_envs=2)  # a new run: all of them
    assert sch.todo == [0, 1, 2] and sch.assign([0, 1]) == [{"global_index": 0}, {"global_index": 1}]
    assert sch.seeds.tolist() == [5, 6]
    kept = [{"episode_id": i, "episode_seed": 5 + g, "global_index": g} for i, g in enumerate((0, 2))]
    (tmp_path / "t.json").write_text(json.dumps({"episodes": kept}))
    (tmp_path / "t.results.jsonl").write_text(json.dumps({"episode_id": None, "global_index": 1}) + "\n")  # not kept
    sch = shards.single_schedule(tmp_path, "t", total=6, base_seed=5, num_envs=2)
    assert sch.todo == [3, 4, 5]
    sch.assign([0, 1])
    assert sch.seeds.tolist() == [8, 9]
    with pytest.raises(ValueError, match=r"recorded with seed 5 and this command has seed 6; .* pass --seed 5"):
        shards.single_schedule(tmp_path, "t", total=6, base_seed=6, num_envs=2)
    (tmp_path / "u.json").write_text(json.dumps({"episodes": [{"episode_id": 0, "episode_seed": 0}]}))
    with pytest.raises(ValueError, match=r"1 of its episodes have no global_index .* --if-exists overwrite"):
        shards.single_schedule(tmp_path, "u", total=2, base_seed=0, num_envs=1)
    # a NAME.json that cannot be read: refused (never taken for a run without episodes), the fix named
    (tmp_path / "v.json").write_text('{"episodes": [{"episode_id": 0, "global_')
    with pytest.raises(ValueError, match=r"v.json cannot be read \(JSONDecodeError: .*so which episodes and seeds it "
                                         r"holds is unknown; restore it from a copy, or pass --if-exists overwrite"):
        shards.single_schedule(tmp_path, "v", total=2, base_seed=0, num_envs=1)
    with pytest.raises(ValueError, match=r"v.json cannot be read \(not a JSON object\)"):
        shards.committed_global_indices(tmp_path, "v")
    (tmp_path / "v.h5.parts").mkdir()
    (tmp_path / "v.h5.parts" / "part_000000.h5").write_bytes(b"")  # a crashed run's parts carry the entries
    with pytest.raises(ValueError, match=r"unknown; fastrecord consolidate .*v.h5 rebuilds it from the part files in "
                                         r"v.h5.parts/, then resume"):
        shards.check_resume(tmp_path, "v", base_seed=0)
    # a results file (a run without trajectory) with another base seed: refused too
    (tmp_path / "w.results.jsonl").write_text(json.dumps({"episode_id": 0, "global_index": 1, "seed": 11}) + "\n")
    with pytest.raises(ValueError, match=r"recorded with seed 10 and this command has seed 0"):
        shards.check_resume(tmp_path, "w", base_seed=0)


def _record_double(out: Path, total: int, if_exists: str = "error", num_envs: int = 3,
                   save_video: bool = False, save_trajectory: bool = True, **record_kwargs) -> shards.EpisodeSchedule:
    """A sharded run of world size 1 in this process (no torchrun): what shard_worker.py does per rank."""
    from fastrecord import RecordEpisode
    from fastrecord.testing import BatchedDoubleEnv

    run = shards.DistributedRun(out, "double", total=total, base_seed=1000, if_exists=if_exists).open()
    base = BatchedDoubleEnv(num_envs=num_envs, max_episode_steps=9, episode_lengths=lambda e, seed: 2 + seed % 7)
    env = RecordEpisode(base, run.shard_dir, trajectory_name="double", if_exists=run.shard_if_exists,
                        save_video=save_video, save_trajectory=save_trajectory, **record_kwargs)
    schedule = run.plan(env.recorder, num_envs)
    shards.record_schedule(env, env.recorder, schedule, shards.SeededRandomPolicy(base.single_action_space, num_envs))
    env.close()
    _, schedule.report = run.finish({})  # type: ignore[attr-defined]
    run.close()
    return schedule


def test_resume_extends_and_error_refuses_a_closed_run(tmp_path, monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    first = _record_double(tmp_path, total=4)
    assert sorted(first.finished) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match=r"already holds a run named 'double'.*if_exists='resume'"):
        _record_double(tmp_path, total=6)
    again = _record_double(tmp_path, total=6, if_exists="resume")
    assert sorted(again.finished) == [4, 5]  # the episodes on disk were skipped
    data = read_dataset(tmp_path / "double.h5")
    assert sorted(data) == list(range(6))
    for g, ep in data.items():  # episode g: seed base + g, the seeded random policy's actions for that seed
        assert ep["seed"] == 1000 + g == ep["reset_kwargs"]["seed"] and ep["global_index"] == g
        assert ep["steps"] == 2 + (1000 + g) % 7
        space = shards.SeededRandomPolicy(gym.spaces.Box(-1, 1, (3,), np.float32), 1)
        space.restart([0], [1000 + g])
        np.testing.assert_array_equal(ep["actions"], np.concatenate([space(None) for _ in range(ep["steps"])]))
    manifest = json.loads((tmp_path / "double.fastrecord.json").read_text())
    assert manifest["status"] == "closed"
    assert manifest["options"]["sharding"] == dict(world_size=1, base_seed=1000, total=6, rule="g % world_size",
                                                   shards="NAME.shards/rank{rank:05d}")


def test_merge_reports_and_refuses(tmp_path, monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(ValueError, match=r"holds no shard folders.*nothing to merge"):
        shards.merge(tmp_path, "double")
    _record_double(tmp_path, total=5)
    report = shards.merge(tmp_path, "double", expected=7)  # two more asked for than recorded
    assert report.missing == [5, 6] and not report.ok and report.episodes == 5
    assert any("missing: 2 global episodes (5-6)" in line for line in report.lines())
    consolidated = shards.merge(tmp_path, "double")  # the default: one self-contained file
    assert consolidated.ok and consolidated.consolidated
    assert "(one self-contained file)" in consolidated.lines()[0]
    with h5py.File(tmp_path / "double.h5") as f:
        assert all(not isinstance(f.get(k, getlink=True), h5py.ExternalLink) for k in f)
        assert set(f) == {f"traj_{g}" for g in range(5)}
    before = read_dataset(tmp_path / "double.h5")
    relinked = shards.merge(tmp_path, "double", links=True)  # idempotent: an index of links, same episodes
    assert relinked.ok and not relinked.consolidated and "index of links into double.shards/" in relinked.lines()[0]
    with h5py.File(tmp_path / "double.h5") as f:
        assert all(isinstance(f.get(k, getlink=True), h5py.ExternalLink) for k in f)
    assert_same_episodes(before, read_dataset(tmp_path / "double.h5"))
    # a shard of another env: refused, naming both ranks
    other = shards.shard_dir(tmp_path, "double", 1)
    shutil.copytree(shards.shard_dir(tmp_path, "double", 0), other)
    doc = json.loads((other / "double.json").read_text())
    doc["env_info"] = {"env_id": "Other-v0"}  # the double has no registered env_info: None
    (other / "double.json").write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=r"disagree on env_info: rank 0 has .* rank 1 has .*Other-v0"):
        shards.merge(tmp_path, "double")
    shutil.rmtree(other)
    # a self-contained NAME.h5 holding episodes no shard has any more is never replaced
    shards.merge(tmp_path, "double")
    shutil.rmtree(shards.shard_dir(tmp_path, "double", 0))
    shards.shard_dir(tmp_path, "double", 0).mkdir()
    (shards.shard_dir(tmp_path, "double", 0) / "double.json").write_text(json.dumps({**doc, "episodes": []}))
    with pytest.raises(
        ValueError, match=r"self-contained file holding episodes 0, 1, 2, 3, 4 that the files being joined"
    ):
        shards.merge(tmp_path, "double")
    assert len(read_dataset(tmp_path / "double.h5")) == 5


def test_a_null_global_index_in_a_shard_is_one_line_naming_the_file(tmp_path, monkeypatch, capsys):
    """A shard's NAME.json (or results file) whose entry has global_index null, hand-edited or foreign:
    merge, `fastrecord merge` and a resume's plan say which file and what to do, no TypeError traceback."""
    from fastrecord.commands.cli import main

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    _record_double(tmp_path, total=3)
    shard_json = shards.shard_dir(tmp_path, "double", 0) / "double.json"
    doc = json.loads(shard_json.read_text())
    doc["episodes"][1]["global_index"] = None
    shard_json.write_text(json.dumps(doc))
    before = {p: p.read_bytes() for p in (tmp_path / "double.h5", tmp_path / "double.json")}
    match = rf"{shard_json} has an episode entry with global_index=None .*an integer >= 0 .*Fix that entry"
    with pytest.raises(ValueError, match=match + rf", or move {shard_json.parent} out of {shard_json.parent.parent}$"):
        shards.merge(tmp_path, "double")
    with pytest.raises(ValueError, match=match):
        shards.committed_global_indices(shard_json.parent, "double")
    assert main(["merge", str(tmp_path), "--name", "double"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "mani_skill" not in line]  # its import warning
    assert len(err) == 1 and err[0].startswith(f"fastrecord merge: error: {shard_json} has an episode entry with "
                                               f"global_index=None"), err
    doc["episodes"][1]["global_index"], doc["episodes"][1]["episode_id"] = 1, None
    shard_json.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=rf"{shard_json} has an episode entry with episode_id=None \(global_index 1\)"):
        shards.merge(tmp_path, "double")
    assert {p: p.read_bytes() for p in before} == before  # the joined pair was left as it was


def test_concurrent_merges_take_turns(tmp_path, monkeypatch):
    """A `fastrecord merge` started while another merge of the run is between reading the shards and
    swapping in the pair waits for it (it says so), then rebuilds the pair: they never share NAME.h5.tmp."""
    import threading

    from fastrecord.sinks.maniskill_h5 import merge as h5_merge

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    _record_double(tmp_path, total=5)
    expected = read_dataset(tmp_path / "double.h5")
    real_join = h5_merge.join_runs
    seen: dict[str, object] = {}

    def join_while_another_merge_starts(*args, **kwargs):
        other = subprocess.Popen([sys.executable, "-m", "fastrecord", "merge", str(tmp_path), "--name", "double"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=torchrun_env())
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(other.stderr), daemon=True)
        reader.start()
        deadline = time.monotonic() + 120
        while other.poll() is None and not any("waiting for another merge" in line for line in lines):
            assert time.monotonic() < deadline, "the second merge neither waited nor ended within 120 s"
            time.sleep(0.1)
        seen["ended_before_us"] = other.poll() is not None
        seen["proc"], seen["lines"], seen["reader"] = other, lines, reader
        return real_join(*args, **kwargs)

    monkeypatch.setattr(h5_merge, "join_runs", join_while_another_merge_starts)
    report = shards.merge(tmp_path, "double")
    other = seen["proc"]
    out, _ = other.communicate(timeout=120)
    seen["reader"].join(timeout=10)
    assert not seen["ended_before_us"], seen["lines"]
    assert other.returncode == 0, seen["lines"]
    assert any(f"waiting for another merge of 'double' in {tmp_path} (pid {os.getpid()} on " in line
               for line in seen["lines"]), seen["lines"]
    assert report.ok and report.episodes == 5 and "5 episodes from 1 shard(s)" in out
    assert_same_episodes(expected, read_dataset(tmp_path / "double.h5"))
    assert not list(tmp_path.glob("*.tmp")) and not (tmp_path / ".double.merge.lock").exists()


def test_set_episode_meta_checks(tmp_path):
    from fastrecord import RecordEpisode
    from fastrecord.testing import BatchedDoubleEnv

    env = RecordEpisode(BatchedDoubleEnv(num_envs=2), tmp_path, save_video=False)
    try:
        with pytest.raises(ValueError, match=r"2 envs but 1 metas"):
            env.recorder.set_episode_meta([0, 1], [{}])
        with pytest.raises(ValueError, match=r"keys \['episode_id'\] are the recorder's own"):
            env.recorder.set_episode_meta([0], [{"episode_id": 3}])
        with pytest.raises(ValueError, match=r"env index 5 is outside 0..1"):
            env.recorder.set_episode_meta([5], [{}])
    finally:
        env.close()


# ---------------------------------------------------------------------------------------------- torchrun
def test_torchrun_double_same_dataset_for_world_sizes_1_and_2(tmp_path):
    results = {}
    for world in (1, 2):
        out = tmp_path / f"w{world}"
        r = torchrun(world, [str(WORKER), str(out), "11", "3"])
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        lines = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
        assert sorted(line["rank"] for line in lines) == list(range(world))
        for line in lines:  # each rank recorded exactly its share, g % world_size
            assert line["finished"] == list(range(line["rank"], 11, world))
        results[world] = read_dataset(out / "double.h5")
        assert sorted(results[world]) == list(range(11))
        assert [e["episode_id"] for e in json.loads((out / "double.json").read_text())["episodes"]] == list(range(11))
        assert {g: e["rank"] for g, e in results[world].items()} == {g: g % world for g in range(11)}
        for rank in range(world):  # each shard: a normal fastrecord run with its videos and results
            shard = shards.shard_dir(out, "double", rank)
            rows = [json.loads(x) for x in (shard / "double.results.jsonl").read_text().splitlines()]
            assert sorted(r["global_index"] for r in rows) == list(range(rank, 11, world))
            assert all((shard / r["video"]).exists() for r in rows)
    assert_same_episodes(results[1], results[2])


@pytest.fixture(scope="module")
def pickcube_runs(tmp_path_factory):
    """The PickCube recording (RECORD) by torchrun with 1 and with 2 ranks."""
    base = tmp_path_factory.mktemp("pickcube")
    runs = {}
    for world in (1, 2):
        out = base / f"w{world}"
        t0 = time.perf_counter()
        r = torchrun(world, [*RECORD, "--output-dir", str(out)])
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        runs[world] = (out, r.stdout, time.perf_counter() - t0)
    return runs


def test_torchrun_pickcube_world_sizes_1_and_2(pickcube_runs):
    (out1, _, _), (out2, stdout, _) = pickcube_runs[1], pickcube_runs[2]
    assert "8 episodes from 2 shard(s)" in stdout and "rank 1: 4/4 scheduled episodes finished" in stdout
    one, two = read_dataset(out1 / "trajectory.h5"), read_dataset(out2 / "trajectory.h5")
    assert sorted(two) == list(range(8))
    assert {g: e["rank"] for g, e in two.items()} == {g: g % 2 for g in range(8)}
    assert all(e["seed"] == 5 + g for g, e in two.items())
    assert_same_episodes(one, two)
    meta = json.loads((out2 / "trajectory.json").read_text())
    assert meta["env_info"]["env_id"] == "PickCube-v1" and meta["env_info"]["max_episode_steps"] == 12
    with h5py.File(out2 / "trajectory.h5") as f:  # the joined file: self-contained
        assert all(isinstance(f.get(k, getlink=True), h5py.HardLink) for k in f)
    for rank in (0, 1):  # each shard: a normal run, closed, with its own results file
        shard = shards.shard_dir(out2, "trajectory", rank)
        assert json.loads((shard / "trajectory.fastrecord.json").read_text())["status"] == "closed"
        rows = [json.loads(x) for x in (shard / "trajectory.results.jsonl").read_text().splitlines()]
        assert [r["global_index"] for r in rows] == [rank, rank + 2, rank + 4, rank + 6]
    manifest = json.loads((out2 / "trajectory.fastrecord.json").read_text())
    assert manifest["status"] == "closed" and manifest["fastrecord"]
    assert manifest["options"]["sharding"]["world_size"] == 2 and manifest["options"]["sharding"]["base_seed"] == 5
    assert manifest["options"]["args"]["env_id"] == "PickCube-v1"


def test_maniskill_reads_the_joined_dataset(pickcube_runs, tmp_path):
    from mani_skill.trajectory.dataset import ManiSkillTrajectoryDataset
    from mani_skill.utils.io_utils import load_json

    out = pickcube_runs[2][0]
    recorded = read_dataset(out / "trajectory.h5")
    meta = load_json(str(out / "trajectory.json"))
    assert [e["episode_id"] for e in meta["episodes"]] == list(range(8))
    ds = ManiSkillTrajectoryDataset(str(out / "trajectory.h5"), load_count=-1, device="cpu")
    assert len(ds) == sum(e["steps"] for e in recorded.values())
    np.testing.assert_array_equal(np.asarray(ds[0]["action"]), recorded[0]["actions"][0])
    # ManiSkill's replay tool, on a copy of the pair alone (the joined file is self-contained; the tool
    # writes its output next to its input)
    copy = tmp_path / "run"
    copy.mkdir()
    for f in ("trajectory.h5", "trajectory.json"):
        shutil.copy(out / f, copy / f)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "mani_skill.trajectory.replay_trajectory",
            "--traj-path",
            str(copy / "trajectory.h5"),
            "--use-env-states",
            "--save-traj",
            "--allow-failure",
            "-b",
            "physx_cpu",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=torchrun_env(),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Replayed 8 episodes" in r.stdout + r.stderr
    replayed = next(copy.glob("trajectory.*.h5"))
    with h5py.File(replayed) as f:
        for g, e in recorded.items():
            np.testing.assert_allclose(f[f"traj_{g}"]["actions"][:], e["actions"])


def shard_episodes(shard: Path) -> int:
    """Episodes a shard holds: listed in its trajectory.json, or in a complete part its writers wrote (listed
    once published, or by the recovery of a crashed shard)."""
    from fastrecord.sinks.maniskill_h5 import EPISODES_ATTR, complete_parts, sibling_paths

    json_path, parts = sibling_paths(shard / "trajectory.h5")
    ids = {e["episode_id"] for e in ((read_json(json_path) or {}).get("episodes") or [])}
    for _, part in complete_parts(parts):
        with h5py.File(part, "r") as f:
            ids |= {e["episode_id"] for e in json.loads(f.attrs.get(EPISODES_ATTR, "[]"))}
    return len(ids)


def test_killed_rank_resumed_by_the_same_command(pickcube_runs, tmp_path):
    """Rank 1 of ``fastrecord record`` under torchrun is SIGKILLed once its first episode is committed
    (tests/rank_kill.py, deterministic: its stepping waits for that commit, then the kill); the run fails
    and the shard keeps what it committed; the same command again resumes it, and the joined trajectory
    holds the episodes of the run that was never killed."""
    out = tmp_path / "run"
    args = [*RECORD[2:], "--output-dir", str(out)]  # what follows "-m fastrecord"
    killing = subprocess.run([*TORCHRUN, "--nproc-per-node", "2", str(Path(__file__).with_name("rank_kill.py")),
                              *args], capture_output=True, text=True, timeout=300,
                             env={**torchrun_env(), "KILL_RANK": "1"})
    assert killing.returncode != 0, killing.stdout[-2000:] + killing.stderr[-2000:]
    shard1 = shards.shard_dir(out, "trajectory", 1)
    left = shard_episodes(shard1)
    assert left == 1, f"rank 1 holds {left} episodes after the kill (killed once it committed 1)"
    report = shards.merge(out, "trajectory")  # merge reports, not fails
    assert report.missing and report.crashed == [1]
    command = [*TORCHRUN, "--nproc-per-node", "2", *RECORD, "--output-dir", str(out)]
    r = subprocess.run(command, capture_output=True, text=True, timeout=300, env=torchrun_env())
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "is a sharded run that did not finish: resuming it" in r.stderr
    assert "8 episodes from 2 shard(s)" in r.stdout
    assert_same_episodes(read_dataset(pickcube_runs[2][0] / "trajectory.h5"), read_dataset(out / "trajectory.h5"))
    assert json.loads((out / "trajectory.fastrecord.json").read_text())["status"] == "closed"


@pytest.mark.slow
def test_torchrun_evaluate_script(tmp_path):
    """scripts/evaluate.py under torchrun: make_eval_envs(episodes=N) gives each rank its seeds; rank 0
    prints every rank's results and joins the trajectories."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "evaluate.py"
    r = torchrun(
        2,
        [
            str(script),
            "--episodes",
            "5",
            "--num-envs",
            "2",
            "--max-episode-steps",
            "10",
            "--width",
            "64",
            "--height",
            "64",
            "--keep",
            "all",
            "--save-trajectory",
            "--name",
            "ev",
            "--video-dir",
            str(tmp_path),
        ],
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "results of 5 episodes" in r.stdout and "5 episodes from 2 shard(s)" in r.stdout
    data = read_dataset(tmp_path / "ev.h5")
    assert sorted(data) == list(range(5))
    assert all(e["seed"] == g and e["rank"] == g % 2 and e["steps"] == 10 for g, e in data.items())
    for rank, count in ((0, 3), (1, 2)):  # the last batch's spare episode is not recorded
        shard = shards.shard_dir(tmp_path, "ev", rank)
        assert len(list(shard.glob("*.mp4"))) == count
    # the join linked every episode's video next to ev.h5, named by its global episode (as one process names them)
    assert sorted(int(p.name.split("_")[0]) for p in tmp_path.glob("*.mp4")) == list(range(5))


def test_make_eval_envs_sharded_in_one_process(tmp_path, monkeypatch):
    """make_eval_envs(episodes=3, seed=7) without torchrun (world size 1): the envs reset themselves with
    seeds 7, 8, 9; the last batch's spare episode is not recorded; closing joins the shard."""
    from fastrecord import make_eval_envs
    from fastrecord.make_env import sharding_of

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    env_kwargs = dict(obs_mode="state", render_mode="rgb_array", max_episode_steps=4, control_mode="pd_ee_delta_pos",
                      human_render_camera_configs=dict(width=64, height=64))
    envs = make_eval_envs("PushCube-v1", 2, "physx_cpu", env_kwargs, dict(obs_horizon=2), video_dir=str(tmp_path),
                          episodes=3, seed=7, record_kwargs=dict(save_trajectory=True, trajectory_name="ev"))
    try:
        envs.reset()
        batches = 0
        while batches < 2:  # the baseline's loop: all envs truncate together (ignore_terminations)
            _, _, _, truncated, _ = envs.step(np.zeros((2, 4), dtype=np.float32))
            batches += bool(np.asarray(truncated).any())
    finally:
        envs.close()
    sharding = sharding_of(envs)
    assert sharding.report.ok and sharding.report.episodes == 3
    assert sorted(r["global_index"] for r in sharding.rows) == [0, 1, 2]
    data = read_dataset(tmp_path / "ev.h5")
    assert {g: (e["seed"], e["reset_kwargs"]["seed"], e["steps"]) for g, e in data.items()} == {
        g: (7 + g, 7 + g, 4) for g in range(3)
    }
    assert len(list(shards.shard_dir(tmp_path, "ev", 0).glob("*.mp4"))) == 3
    assert sorted(p.name.split("_")[0] for p in tmp_path.glob("*.mp4")) == ["0", "1", "2"]  # next to ev.h5, by g


def test_joined_run_has_one_results_file(tmp_path, monkeypatch):
    """The run directory of a sharded run has NAME.results.jsonl, as an unsharded run's (issue 28.11): every
    global episode's row once, by global index, its episode_id the joined file's, its video the one linked next
    to NAME.h5 (as a run in one process writes it); a resume adds the new episodes' rows and videos without
    repeating the earlier ones."""
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    _record_double(tmp_path, total=4, save_video=True)
    _record_double(tmp_path, total=6, if_exists="resume", save_video=True)
    rows = [json.loads(x) for x in (tmp_path / "double.results.jsonl").read_text().splitlines()]
    assert [(r["global_index"], r["episode_id"], r["source_rank"]) for r in rows] == [(g, g, 0) for g in range(6)]
    meta = json.loads((tmp_path / "double.json").read_text())["episodes"]
    assert [(r["seed"], r["length"]) for r in rows] == [(e["episode_seed"], e["elapsed_steps"]) for e in meta]
    shard = shards.shard_dir(tmp_path, "double", 0)
    shard_rows = {r["global_index"]: r for r in shards.results_rows(shard, "double")}
    for r in rows:  # each video next to double.h5, named by its global episode: a hard link of the shard's file
        video = tmp_path / r["video"]
        assert video.parent == tmp_path and video.name.startswith(f"{r['global_index']}_env"), r["video"]
        assert os.path.samefile(video, shard / shard_rows[r["global_index"]]["video"])
    # the resume's merge placed the first four again as they were: no second name, no other file
    assert sorted(p.name for p in tmp_path.glob("*.mp4")) == sorted(r["video"] for r in rows)


def test_a_merge_does_its_hdf5_work_in_one_process(tmp_path, monkeypatch):
    """`shards.merge` checks each shard and joins them in one HDF5 writer process (`one_writer_process`), not
    one a call (a process start was 0.17 s of a 0.68 s merge of 2 shards); the joined file is the same. Inside
    `one_writer_process` a call that raised keeps the process, a dead process is replaced, and leaving stops it."""
    rec = importlib.import_module("fastrecord.sinks.maniskill_h5.recover")  # the package's `recover` is the function

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    _record_double(tmp_path, total=5)
    started: list = []

    class Counted(rec.IsolatedProcess):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            started.append(self)

    monkeypatch.setattr("fastrecord.prestart.IsolatedProcess", Counted)  # what `prestart.helper` starts (no spare here)
    before = read_dataset(tmp_path / "double.h5")
    for _ in range(2):  # the second also reads the joined NAME.h5 it replaces
        started.clear()
        assert shards.merge(tmp_path, "double").ok
        assert len(started) == 1 and not started[0].alive()
        assert_same_episodes(before, read_dataset(tmp_path / "double.h5"))

    started.clear()
    (tmp_path / "garbage.h5").write_bytes(b"not hdf5")
    with rec.one_writer_process():
        with pytest.raises(ValueError, match=r"garbage\.h5 is not a readable HDF5 file"):
            rec.run_in_child("self_contained", str(tmp_path / "garbage.h5"))
        assert rec.run_in_child("groups_of", str(tmp_path / "double.h5"))["names"] == [f"traj_{g}" for g in range(5)]
        assert len(started) == 1  # kept after the error
        started[0].kill()
        assert rec.run_in_child("groups_of", str(tmp_path / "double.h5"))["self_contained"]
        assert len(started) == 2 and started[1].alive()
    assert not started[1].alive()


def _videos_by_g(out: Path, name: str) -> dict[int, str]:
    rows = [json.loads(x) for x in (out / f"{name}.results.jsonl").read_text().splitlines()]
    return {r["global_index"]: r["video"] for r in rows}


def test_joined_videos_replace_nothing_and_go_with_the_run(tmp_path, monkeypatch):
    """The join links each episode's video next to NAME.h5; a name another file holds gets _1 (the other file is
    left as it was), merging again places nothing twice, the gallery shows each file once, and --if-exists
    overwrite removes the joined videos with the run, not the other file."""
    from fastrecord.commands.gallery import collect
    from fastrecord.commands.info import describe_run

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    foreign = tmp_path / "0_env0_failure.mp4"  # what episode 0's joined video would be named
    foreign.write_bytes(b"not this run's")
    schedule = _record_double(tmp_path, total=4, save_video=True)
    assert schedule.report.ok and len(schedule.report.videos) == 4 and schedule.report.videos_copied == 0
    videos = _videos_by_g(tmp_path, "double")
    assert videos[0] == "0_env0_failure_1.mp4" and foreign.read_bytes() == b"not this run's"
    shard = shards.shard_dir(tmp_path, "double", 0)
    assert all(os.path.samefile(tmp_path / videos[r["global_index"]], shard / r["video"])
               for r in shards.results_rows(shard, "double"))
    before = sorted(p.name for p in tmp_path.glob("*.mp4"))
    again = shards.merge(tmp_path, "double")
    assert again.ok and sorted(p.name for p in again.videos) == sorted(videos.values())
    assert sorted(p.name for p in tmp_path.glob("*.mp4")) == before and _videos_by_g(tmp_path, "double") == videos
    r = fastrecord_cli("merge", str(tmp_path), "--name", "double")  # the user's merge says where they are
    assert r.returncode == 0 and f"{tmp_path}: 4 videos of the joined episodes linked, named by global episode" in (
        r.stdout), r.stdout + r.stderr
    assert sorted(p.name for p in tmp_path.glob("*.mp4")) == before
    tiles = collect(tmp_path, tmp_path / "gallery.html")
    assert sorted(t.path.name for t in tiles) == before  # the shard's four files are the joined four
    files = describe_run(tmp_path / "double.h5")["files"]  # fastrecord info counts each file once
    assert files["videos"] == 4 and files["videos_bytes"] == sum((tmp_path / v).stat().st_size for v in videos.values())
    # another run in the folder, killed while writing its episode 0's video under the same name: it does not
    # take the joined videos for its own (a file of its intent's name that no other run names)
    from fastrecord.sinks.runfiles import owned_intent_files

    (tmp_path / "other.fastrecord.json").write_text(json.dumps(
        {"status": "recording", "pending": [{"intent": "1_env1_failure.mp4", "episodes": [0], "t": 0}]}))
    assert videos[1] == "1_env1_failure.mp4" and owned_intent_files(tmp_path, "other") == {}
    (tmp_path / "other.fastrecord.json").unlink()
    _record_double(tmp_path, total=2, if_exists="overwrite", save_video=True)
    assert not (tmp_path / videos[3]).exists() and not (tmp_path / videos[2]).exists()
    assert foreign.read_bytes() == b"not this run's"
    assert sorted(_videos_by_g(tmp_path, "double")) == [0, 1]


def test_joined_videos_are_copies_where_links_fail(tmp_path, monkeypatch):
    """Where the file system makes no hard links, the join copies each video (the same bytes, under the same
    name), and a merge again recognises its copies (nothing placed twice)."""
    import errno

    from fastrecord.shards import videos as joined_videos

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    _record_double(tmp_path, total=3, save_video=True)
    videos = _videos_by_g(tmp_path, "double")
    for v in videos.values():
        (tmp_path / v).unlink()

    def no_link(src, dst, *a, **k):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(joined_videos.os, "link", no_link)
    for _ in range(2):
        report = shards.merge(tmp_path, "double")
        assert report.videos_copied == 3 and _videos_by_g(tmp_path, "double") == videos
        assert sorted(p.name for p in tmp_path.glob("*.mp4")) == sorted(videos.values())
    shard = shards.shard_dir(tmp_path, "double", 0)
    for r in shards.results_rows(shard, "double"):
        joined = tmp_path / videos[r["global_index"]]
        assert joined.read_bytes() == (shard / r["video"]).read_bytes()
        assert not os.path.samefile(joined, shard / r["video"])
    assert not list(tmp_path.glob(".*.tmp"))


def test_a_run_of_videos_only_is_joined(tmp_path, monkeypatch):
    """A sharded run without trajectory (videos and results only, as an eval's): the join writes the results
    rows and links the videos next to where NAME.h5 would be; nothing is missing."""
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    schedule = _record_double(tmp_path, total=5, save_video=True, save_trajectory=False)
    report = schedule.report
    assert report is not None and report.ok and not report.trajectory and report.episodes == 5
    assert not (tmp_path / "double.h5").exists()
    videos = _videos_by_g(tmp_path, "double")
    assert sorted(videos) == list(range(5)) and all((tmp_path / v).is_file() for v in videos.values())
    assert any("5 videos" in line for line in report.lines())


def test_joined_split_videos_keep_every_piece(tmp_path, monkeypatch):
    """A video split by max_steps_per_video: every piece is linked next to NAME.h5 (``_part{k}``, named by g), the
    joined row lists them all (``videos``), and --if-exists overwrite removes every piece with the run."""
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    _record_double(tmp_path, total=3, save_video=True, max_steps_per_video=3)
    rows = {r["global_index"]: r for r in map(json.loads, (tmp_path / "double.results.jsonl").read_text().splitlines())}
    split = [r for r in rows.values() if "videos" in r]
    assert split, rows
    for r in split:
        g = r["global_index"]
        assert r["video"] == r["videos"][0] and [v.split("_part")[0] for v in r["videos"]] == [f"{g}_env{g}_failure"] * len(
            r["videos"]) and all((tmp_path / v).is_file() for v in r["videos"])
    pieces = sorted(p.name for p in tmp_path.glob("*.mp4"))
    assert len(pieces) == len(list(shards.shard_dir(tmp_path, "double", 0).glob("*.mp4"))) > 3
    _record_double(tmp_path, total=1, if_exists="overwrite", num_envs=1)
    assert not list(tmp_path.glob("*.mp4"))
