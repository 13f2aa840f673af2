"""`TrajectoryWriter` in writer processes: round trips, a killed writer, a full disk, crash + recover/resume.

Real files read back with h5py and compared with what was submitted. Episode data are a function of the
episode's seed (``make_episode``), so an episode can be checked after its id was renumbered.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from fastrecord.episode import EpisodeData
from fastrecord.sinks.maniskill_h5 import TrajectoryWriter, consolidate, recover
from fastrecord.workers import WorkerError

HEADER = {"env_info": {"env_id": "Test-v0", "env_kwargs": {"obs_mode": "rgb"}, "max_episode_steps": 6},
          "commit_info": {"mani_skill": "test"}}
SRC = Path(__file__).parents[1] / "src"


def make_episode(episode_id: int, seed: int, frame: int = 8) -> EpisodeData:
    """An episode whose every array is determined by ``seed``; ``frame`` is the camera's side in pixels."""
    rng = np.random.default_rng(seed)
    t = int(rng.integers(2, 6))
    datasets = {
        "actions": rng.standard_normal((t, 4)).astype(np.float32),
        "rewards": rng.standard_normal(t).astype(np.float32),
        "terminated": np.zeros(t, bool),
        "truncated": np.arange(t) == t - 1,
        "success": rng.random(t) > 0.5,
        "env_states/actors/cube": rng.standard_normal((t + 1, 13)).astype(np.float32),
        "env_states/articulations/panda": rng.standard_normal((t + 1, 31)).astype(np.float32),
        "obs/agent/qpos": rng.standard_normal((t + 1, 9)).astype(np.float32),
        "obs/sensor_data/base_camera/rgb": rng.integers(0, 256, (t + 1, frame, frame, 3), dtype=np.uint8),
    }
    meta = dict(episode_id=episode_id, episode_seed=seed, elapsed_steps=t, control_mode="pd_joint_delta_pos",
                reset_kwargs={"seed": seed, "options": {}}, success=bool(datasets["success"][-1]))
    return EpisodeData(episode_id, 0, t, datasets, meta, frames=np.zeros((t + 1, 2, 2, 3), np.uint8))


def check_file(h5_path: Path, json_path: Path | None = None) -> list[dict]:
    """The pair lists consecutive ids, every listed episode is in the .h5 with the data its seed gives."""
    from mani_skill.utils.io_utils import load_json

    meta = load_json(str(json_path or h5_path.with_suffix(".json")))
    assert meta["env_info"] == HEADER["env_info"]
    episodes = meta["episodes"]
    assert [e["episode_id"] for e in episodes] == list(range(len(episodes)))
    with h5py.File(h5_path, "r") as f:
        assert len(f) >= len(episodes)
        for e in episodes:
            g = f[f"traj_{e['episode_id']}"]
            want = make_episode(e["episode_id"], e["episode_seed"], frame=g["obs/sensor_data/base_camera/rgb"].shape[1])
            assert e["elapsed_steps"] == want.elapsed_steps
            for path, data in want.datasets.items():
                np.testing.assert_array_equal(g[path][:], data, err_msg=f"traj_{e['episode_id']}/{path}")
    return episodes


def self_contained(h5_path: Path) -> bool:
    with h5py.File(h5_path, "r") as f:
        return all(isinstance(f.get(k, getlink=True), h5py.HardLink) for k in f)


def snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


# ---------------------------------------------------------------------------------------------- round trip
def test_round_trip_two_writers_many_batches(tmp_path):
    """2 writer processes, 40 small batches: ids 0..n-1 in submission order, every value as submitted."""
    h5 = tmp_path / "run.h5"
    w = TrajectoryWriter(h5, HEADER, num_writers=2, max_pending=3, index_interval_s=0.01)
    w.wait_until_done()  # a valid empty pair once the index process has started (the constructor does not wait)
    assert h5.exists() and h5.with_suffix(".json").exists() and check_file(h5) == []
    assert w.next_episode_id == 0 and len(w.pids) == 3 and os.getpid() not in w.pids
    rng = random.Random(0)
    seeds, eid = [], 0
    for b in range(40):
        batch = [make_episode(eid + j, 100 + eid + j) for j in range(rng.randint(1, 4))]
        seeds += [e.meta["episode_seed"] for e in batch]
        w.submit(batch)
        eid += len(batch)
        if b == 20:
            w.wait_until_done()
            assert w.num_episodes == eid
            assert [e["episode_seed"] for e in check_file(h5)] == seeds
    w.wait_until_done()
    assert w.num_episodes == eid and len(w.json_data["episodes"]) == eid
    assert not self_contained(h5)  # an index of links into the parts while recording
    w.close()
    w.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        w.submit([make_episode(eid, 0)])
    episodes = check_file(h5)
    assert [e["episode_seed"] for e in episodes] == seeds  # submission order
    assert episodes == w.json_data["episodes"]
    assert self_contained(h5) and not (tmp_path / "run.h5.parts").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.h5", "run.json"]
    with h5py.File(h5) as f:  # ManiSkill's layout and compression
        rgb = f["traj_0/obs/sensor_data/base_camera/rgb"]
        # gzip level 1 (the default), every frame in one chunk (episodes < 64 frames; 8 rows of 24 bytes < 2 KiB)
        assert rgb.compression == "gzip" and rgb.compression_opts == 1 and rgb.chunks == rgb.shape
        assert f["traj_0/actions"].compression is None
        assert list(f["traj_0"]) == ["actions", "rewards", "terminated", "truncated", "success", "env_states", "obs"]


def test_large_batches_are_spread_over_the_writers(tmp_path):
    """A batch of 7 episodes with 3 writers becomes 3 parts (2 + 3 + 2 episodes), written in parallel and
    listed in submission order; a batch of one episode is one part."""
    h5 = tmp_path / "run.h5"
    with TrajectoryWriter(h5, HEADER, num_writers=3, consolidate_on_close=False) as w:
        w.submit([make_episode(i, 50 + i, frame=16) for i in range(7)])
        w.submit([make_episode(7, 57, frame=16)])  # one episode: one part
        w.wait_until_done()
        parts = sorted(p.name for p in (tmp_path / "run.h5.parts").iterdir())
        assert parts == [f"part_{k:06d}.h5" for k in range(4)]
        sizes = []
        for p in parts:
            with h5py.File(tmp_path / "run.h5.parts" / p, "r") as f:
                sizes.append(len(f))
        assert sizes == [2, 3, 2, 1]
    meta = json.loads(h5.with_suffix(".json").read_text())
    assert [e["episode_seed"] for e in meta["episodes"]] == list(range(50, 58))
    with h5py.File(h5, "r") as f:
        for i in range(8):
            want = make_episode(i, 50 + i, frame=16)
            for path, data in want.datasets.items():
                np.testing.assert_array_equal(f[f"traj_{i}/{path}"][:], data)


def test_small_batches_queued_behind_a_slow_one_share_a_part(tmp_path):
    """While the writer compresses a large batch, one-episode batches queue up: the writer takes what is
    queued together as one part (one file, one fsync); ids, order and values as submitted."""
    from fastrecord.sinks.maniskill_h5.writer import part_runs

    big = make_episode(0, 40)
    big.datasets["obs/sensor_data/base_camera/rgb"] = np.random.default_rng(0).integers(
        0, 256, (64, 256, 256, 3), dtype=np.uint8
    )
    with TrajectoryWriter(
        tmp_path / "run.h5", HEADER, num_writers=1, consolidate_on_close=False, compression="gzip:9"
    ) as w:
        w.submit([big])  # seconds of gzip 9 on noise
        for i in range(1, 5):
            w.submit([make_episode(i, 40 + i)])
        w.wait_until_done()
        # the big one alone or with the first small ones it found queued, the rest together: 2 parts
        assert len(list((tmp_path / "run.h5.parts").iterdir())) == 2
    with h5py.File(tmp_path / "run.h5", "r") as f:
        assert len({f.get(f"traj_{i}", getlink=True).filename for i in range(5)}) == 2
        for i in range(1, 5):
            for path, data in make_episode(i, 40 + i).datasets.items():
                np.testing.assert_array_equal(f[f"traj_{i}/{path}"][:], data)
    assert [e["episode_seed"] for e in json.loads((tmp_path / "run.json").read_text())["episodes"]] == [
        40,
        41,
        42,
        43,
        44,
    ]
    # which queued jobs share a part: consecutive numbers, all mergeable (not pieces of a spread batch), under the byte cap
    one = [("traj_0", {"a": np.zeros(10, np.uint8)}, {})]
    jobs = [(3, one, True), (4, one, True), (6, one, True), (7, one, False), (8, one, True), (9, one, True)]
    assert [[j[0] for j in run] for run in part_runs(jobs)] == [[3, 4], [6], [7], [8, 9]]
    assert [[j[0] for j in run] for run in part_runs(jobs, max_bytes=15)] == [[3], [4], [6], [7], [8], [9]]


def test_one_writer_is_the_index_process(tmp_path):
    """One writer (the default without image leaves): one helper process writes the parts and the index
    (issue 20: its start is the recorder's set-up); it publishes an empty pair once started (the constructor does
    not wait for it), every batch is listed after wait_until_done, and close() consolidates in that process."""
    h5 = tmp_path / "run.h5"
    w = TrajectoryWriter(h5, HEADER, index_interval_s=0.0)
    try:
        assert len(w.pids) == 1 and os.getpid() not in w.pids
        w.wait_until_done()
        assert json.loads(h5.with_suffix(".json").read_text())["episodes"] == [] and check_file(h5) == []
        for b in range(5):
            w.submit([make_episode(2 * b + j, 40 + 2 * b + j) for j in range(2)])
            if b % 2:
                w.wait_until_done()
                assert [e["episode_seed"] for e in check_file(h5)] == list(range(40, 40 + 2 * b + 2))
    finally:
        w.close()
    assert [e["episode_seed"] for e in check_file(h5)] == list(range(40, 50)) and self_contained(h5)


def test_a_prestarted_writer_process_is_the_one_the_writer_takes(tmp_path):
    """`fastrecord.prestart`: a writer process started before the recorder (while a command makes its envs) is the
    one the next TrajectoryWriter takes, renamed, and writes the same files; a spare that died is skipped (a new
    process starts); a merge's spare (kept after an error) is not a recorder's; the spares nobody took stop."""
    from fastrecord import prestart
    from fastrecord.sinks.maniskill_h5.layout import WRITER_PROCESS_MODULE

    prestart.prestart_h5_writer()
    prestart.prestart_h5_writer()  # tops up to one: no second spare
    prestart.prestart_h5_writer(merge=True)
    assert prestart.spares(WRITER_PROCESS_MODULE) == 2
    spare = prestart._spares[(WRITER_PROCESS_MODULE, False, False)][0]
    h5 = tmp_path / "run.h5"
    w = TrajectoryWriter(h5, HEADER, index_interval_s=0.0)
    try:
        assert w.pids == [spare.pid] and spare.name == "HDF5 writer process 0"
        w.submit([make_episode(0, 7), make_episode(1, 8)])
    finally:
        w.close()
    assert [e["episode_seed"] for e in check_file(h5)] == [7, 8] and self_contained(h5)
    assert prestart.spares(WRITER_PROCESS_MODULE) == 1  # the merge's spare waits

    prestart.prestart_h5_writer()
    dead = prestart._spares[(WRITER_PROCESS_MODULE, False, False)][0]
    dead.proc.kill()
    dead.proc.wait()
    w = TrajectoryWriter(tmp_path / "other.h5", HEADER)
    try:
        assert w.pids != [dead.pid] and len(w.pids) == 1
    finally:
        w.close()
    waiting = [p for procs in prestart._spares.values() for p in procs]
    prestart.stop_spares()
    assert prestart.spares(WRITER_PROCESS_MODULE) == 0 and all(p.poll() is not None for p in waiting)


def test_a_forked_child_does_not_take_its_parents_spares():
    """A spare belongs to the process that started it: a fork (a worker, the forkserver made of the caller) starts
    its own; the parent's spare still serves the parent."""
    from fastrecord import prestart
    from fastrecord.sinks.maniskill_h5.layout import WRITER_PROCESS_MODULE

    prestart.prestart_h5_writer()
    try:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: no spare of its parent's
            os.write(write, str(prestart.spares(WRITER_PROCESS_MODULE)).encode())
            os._exit(0)
        os.close(write)
        assert os.read(read, 16) == b"0"
        os.waitpid(pid, 0)
        os.close(read)
        assert prestart.spares(WRITER_PROCESS_MODULE) == 1
        proc = prestart.helper(WRITER_PROCESS_MODULE, "taken", background=False)
        assert proc.alive() and proc.name == "taken"
        proc.stop()
    finally:
        prestart.stop_spares()


def test_writer_processes_are_isolated(tmp_path):
    """The writers import neither torch nor ManiSkill, and ignore SIGINT/SIGTERM (the parent closes them)."""
    w = TrajectoryWriter(tmp_path / "run.h5", HEADER)
    try:
        w.submit([make_episode(0, 0)])
        w.wait_until_done()
        for pid in w.pids:
            maps = Path(f"/proc/{pid}/maps").read_text()
            assert "h5py" in maps and "torch" not in maps and "sapien" not in maps
            os.kill(pid, signal.SIGTERM)
            os.kill(pid, signal.SIGINT)
        time.sleep(0.3)
        w.raise_if_failed()  # all alive
        w.submit([make_episode(1, 1)])
    finally:
        w.close()
    assert len(check_file(tmp_path / "run.h5")) == 2
    assert all(_state(pid) in ("gone", "Z") for pid in w.pids)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


# ---------------------------------------------------------------------------------------------- failures
def test_killed_writer_process(tmp_path):
    """SIGKILL of a writer mid-part: WorkerError naming it; what was committed stays readable; close()
    raises and keeps the parts; consolidate() afterwards makes one file of them."""
    h5 = tmp_path / "run.h5"
    w = TrajectoryWriter(h5, HEADER)
    try:
        w.submit([make_episode(i, 500 + i) for i in range(3)])
        w.wait_until_done()
        # a large batch of incompressible frames, so that the writer is caught mid-part
        w.submit([make_episode(3 + i, 600 + i, frame=192) for i in range(24)])
        deadline = time.monotonic() + 60
        while not (tmp_path / "run.h5.parts" / "part_000001.h5.tmp").exists():
            assert time.monotonic() < deadline, "the writer never started part 1"
            time.sleep(0.002)
        os.kill(w.pids[0], signal.SIGKILL)
        with pytest.raises(
            WorkerError,
            match=r"HDF5 writer process 0 \(pid \d+\) was killed by signal SIGKILL \(9\) "
            r"while writing part_000001\.h5 \(episodes 3-26\); [\d,]+ bytes free",
        ) as e:
            w.wait_until_done()
        assert "3 finished episode(s) are safely on disk, listed in run.h5 + run.json" in str(e.value)
        with pytest.raises(WorkerError, match="SIGKILL"):
            w.submit([make_episode(27, 0)])
        assert len(check_file(h5)) == 3
    finally:
        with pytest.raises(WorkerError, match="SIGKILL"):
            w.close()
    w.close()  # idempotent: raised once
    assert (tmp_path / "run.h5.parts" / "part_000000.h5").exists()  # not consolidated, not deleted
    assert not (tmp_path / "run.h5.parts" / "part_000001.h5.tmp").exists()
    assert len(check_file(h5)) == 3
    consolidate(h5)
    assert len(check_file(h5)) == 3 and self_contained(h5) and not (tmp_path / "run.h5.parts").exists()


@pytest.mark.parametrize("writers", [2, 1])
def test_writer_killed_while_idle(tmp_path, writers):
    """A writer that dies between batches is reported at the next call, with its exit signal. With one
    writer it was the index process too: close() lists what is safe through a fresh one."""
    w = TrajectoryWriter(tmp_path / "run.h5", HEADER, num_writers=writers)
    w.submit([make_episode(0, 0)])
    w.wait_until_done()
    killed = writers - 1
    os.kill(w.pids[killed], signal.SIGKILL)
    time.sleep(0.2)
    with pytest.raises(WorkerError, match=rf"HDF5 writer process {killed} \(pid \d+\) was killed by signal SIGKILL "
                                          r".*1 finished"):
        w.submit([make_episode(1, 1)])
    with pytest.raises(WorkerError):
        w.close()
    assert len(check_file(tmp_path / "run.h5")) == 1
    assert (tmp_path / "run.h5.parts" / "part_000000.h5").exists()  # kept, not consolidated


def test_full_disk(small_disk):
    """Writing until the disk is full: a WorkerError naming ENOSPC, the free bytes and the fix; this
    process lives on; every committed episode is readable."""
    h5 = small_disk / "run.h5"
    w = TrajectoryWriter(h5, HEADER, index_interval_s=0.0)
    eid = 0
    try:
        with pytest.raises(WorkerError) as e:
            for _ in range(100):  # ~250 KiB a batch of incompressible frames: full after a few
                w.submit([make_episode(eid + j, 700 + eid + j, frame=64) for j in range(4)])
                eid += 4
                w.wait_until_done()
        msg = str(e.value)
        assert "No space left on device" in msg and "bytes free on that filesystem" in msg, msg
        assert "Free space or choose another output_dir" in msg
        assert f"{w.num_episodes} finished episode(s) are safely on disk" in msg
        assert w.num_episodes >= 4
        listed = check_file(h5)
        assert len(listed) == w.num_episodes
    finally:
        with pytest.raises(WorkerError, match="No space left"):
            w.close()
    assert (small_disk / "run.h5.parts").is_dir()  # kept
    assert len(check_file(h5)) == len(listed)


# ---------------------------------------------------------------------------------------------- crash, recover, resume
_CHILD = """
import sys, types
pkg = types.ModuleType("fastrecord"); pkg.__path__ = [{src!r} + "/fastrecord"]; sys.modules["fastrecord"] = pkg
sys.path.insert(0, {tests!r})
from test_sink_maniskill_h5 import record_forever
record_forever({out!r}, {writers!r})
"""


def record_forever(out: str, writers: int) -> None:
    """In a child process (killed by the test): submit batches without end, report what is committed."""
    w = TrajectoryWriter(Path(out) / "run.h5", HEADER, num_writers=writers, index_interval_s=0.02)
    print("pids", *w.pids, flush=True)
    eid = b = 0
    while True:
        n = 1 + b % 4
        w.submit([make_episode(eid + j, 1000 + eid + j, frame=24) for j in range(n)])
        eid += n
        b += 1
        if b % 3 == 0:
            w.wait_until_done()
            print("committed", w.num_episodes, flush=True)


def record_then_kill(out: Path, min_committed: int, extra_s: float, writers: int = 2) -> int:
    """Run `record_forever`, SIGKILL it ``extra_s`` after ``min_committed`` episodes; wait for its writers
    to leave (they see the parent's socket close). Returns the episodes it had reported committed."""
    code = _CHILD.format(src=str(SRC), tests=str(Path(__file__).parent), out=str(out), writers=writers)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    committed, pids = 0, []
    try:
        deadline = time.monotonic() + 120
        for line in proc.stdout:
            if line.startswith("pids"):
                pids = [int(p) for p in line.split()[1:]]
            if line.startswith("committed"):
                committed = int(line.split()[1])
                if committed >= min_committed:
                    break
            assert time.monotonic() < deadline, "recording too slow"
        os.set_blocking(proc.stdout.fileno(), False)
        time.sleep(extra_s)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    for line in proc.stdout:
        if line.startswith("committed"):
            committed = int(line.split()[1])
    deadline = time.monotonic() + 30
    while any(_state(p) not in ("gone", "Z") for p in pids):
        assert time.monotonic() < deadline, "orphaned writer processes did not leave"
        time.sleep(0.01)
    return committed


@pytest.mark.parametrize("trial", range(3))
def test_crash_then_resume(tmp_path, trial):
    """Killed at a random moment: the pair on disk is consistent; resume=True recovers every complete part
    (consecutive ids, data intact), appends after it, and the result is one file ManiSkill reads. Trial 1
    records with one writer, which writes the index too."""
    random.seed(trial)
    h5 = tmp_path / "run.h5"
    durable = record_then_kill(tmp_path, min_committed=6, extra_s=random.uniform(0.0, 0.4),
                               writers=1 if trial == 1 else 2)
    assert len(check_file(h5)) >= durable  # as the crash left it: consistent

    before = snapshot(tmp_path)
    with pytest.raises(FileExistsError, match=r"run\.h5, run\.json, run\.h5\.parts already exist.*resume=True"):
        TrajectoryWriter(h5, HEADER)
    assert snapshot(tmp_path) == before  # refused, nothing deleted

    complete = sorted((tmp_path / "run.h5.parts").glob("part_*.h5"))
    w = TrajectoryWriter(h5, HEADER, resume=True, num_writers=2)
    recovered = w.next_episode_id
    assert recovered >= durable and w.num_episodes == recovered
    assert not list((tmp_path / "run.h5.parts").glob("*.tmp"))
    with h5py.File(h5) as f:
        assert len(f) == recovered
    listed = 0
    for part in complete:
        with h5py.File(part, "r") as f:
            listed += len(json.loads(f.attrs["fastrecord_episodes"]))
    assert listed == recovered
    seeds = [e["episode_seed"] for e in check_file(h5)]
    for k in range(3):
        start = w.next_episode_id + 2 * k
        w.submit([make_episode(start + j, 5000 + start + j) for j in range(2)])
    w.close()
    episodes = check_file(h5)
    assert len(episodes) == recovered + 6
    assert [e["episode_seed"] for e in episodes] == seeds + [5000 + recovered + j for j in range(6)]
    assert self_contained(h5) and not (tmp_path / "run.h5.parts").exists()

    # a closed (consolidated) run resumes too: it becomes the first part
    w = TrajectoryWriter(h5, HEADER, resume=True)
    assert w.next_episode_id == len(episodes)
    w.submit([make_episode(len(episodes), 9000)])
    w.close()
    final = check_file(h5)
    assert final[:-1] == episodes and final[-1]["episode_seed"] == 9000 and self_contained(h5)


def _write_run(tmp_path: Path, batches: int, **kw) -> tuple[Path, list[int]]:
    """A run left as a crash leaves it (not consolidated); returns NAME.h5 and the seeds in order."""
    h5 = tmp_path / "run.h5"
    w = TrajectoryWriter(h5, HEADER, consolidate_on_close=False, **kw)
    seeds, eid = [], 0
    for b in range(batches):
        batch = [make_episode(eid + j, 300 + eid + j) for j in range(2 + b % 2)]
        seeds += [e.meta["episode_seed"] for e in batch]
        eid += len(batch)
        w.submit(batch)
        if b == 1:
            w.wait_until_done()
            stale = {p: p.read_bytes() for p in (h5, h5.with_suffix(".json"))}
    w.close()
    for p, data in stale.items():  # the index as it was before the last parts: they are complete, unlisted
        p.write_bytes(data)
    return h5, seeds


def test_the_close_swaps_in_the_copy_grown_while_recording(tmp_path):
    """While recording, the index process grows the self-contained copy (``NAME.h5.parts/consolidating.h5.tmp``)
    with every episode it lists; close() completes that very file with the episodes listed since and swaps it in
    (the same inode), instead of copying every episode then."""
    h5 = tmp_path / "run.h5"
    growing = tmp_path / "run.h5.parts" / "consolidating.h5.tmp"
    w = TrajectoryWriter(h5, HEADER, num_writers=2, index_interval_s=0.0)
    assert not growing.exists()  # nothing listed yet: no copy
    for b in range(3):
        w.submit([make_episode(2 * b + j, 300 + 2 * b + j) for j in range(2)])
    w.wait_until_done()
    inode = growing.stat().st_ino
    w.submit([make_episode(6, 306)])  # listed after the copy was last grown: the close copies it
    w.close()
    assert h5.stat().st_ino == inode and self_contained(h5)
    assert [e["episode_seed"] for e in check_file(h5)] == list(range(300, 307))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.h5", "run.json"]


def test_the_grown_copy_starts_again_or_is_given_up(tmp_path, monkeypatch):
    """`process.extend_copy` in this process, on a run's parts: links that do not extend the copy start it again;
    a consolidation whose links the copy is no prefix of copies everything; an OSError (a full disk) gives the
    copy up for the run (its file removed at once) and the consolidation still copies every episode."""
    import errno
    import importlib

    proc = importlib.import_module("fastrecord.sinks.maniskill_h5.process")
    monkeypatch.setattr(proc, "_growing", {})
    monkeypatch.setattr(proc, "_given_up", set())
    monkeypatch.setattr(proc, "_abandoned", [])
    h5, seeds = _write_run(tmp_path, batches=4)
    state = proc.recover_here(str(h5), None, False)
    links, doc = state["links"], {**state["header"], "episodes": state["episodes"]}
    growing = tmp_path / "run.h5.parts" / "consolidating.h5.tmp"
    assert proc.extend_copy(str(h5), links[:3]) == 3 and proc.extend_copy(str(h5), links[:5]) == 5
    assert proc.extend_copy(str(h5), links[1:4]) == 3  # not an extension of the 5: started again with these 3
    proc.consolidate_here(str(h5), None, (links, doc))  # the copy is no prefix of links: all copied
    assert [e["episode_seed"] for e in check_file(h5)] == seeds and self_contained(h5)
    assert not growing.exists() and not proc._growing

    h5, seeds = _write_run(tmp_path / "full", batches=4)
    state = proc.recover_here(str(h5), None, False)
    links, doc = state["links"], {**state["header"], "episodes": state["episodes"]}
    growing = h5.parent / "run.h5.parts" / "consolidating.h5.tmp"
    assert proc.extend_copy(str(h5), links[:2]) == 2 and growing.exists()
    copy_links = proc._copy_links

    def full(dst, folder, some):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(proc, "_copy_links", full)
    assert proc.extend_copy(str(h5), links[:4]) == 0 and not growing.exists()
    monkeypatch.setattr(proc, "_copy_links", copy_links)
    assert proc.extend_copy(str(h5), links) == 0 and not growing.exists()  # given up for this run
    proc.consolidate_here(str(h5), None, (links, doc))
    assert [e["episode_seed"] for e in check_file(h5)] == seeds and self_contained(h5)
    for f in proc._abandoned:  # left open by the writer process (HDF5 may crash closing it after ENOSPC); not here
        f.close()


def test_consolidate_keeps_complete_unindexed_parts(tmp_path):
    h5, seeds = _write_run(tmp_path, batches=6)
    assert len(check_file(h5)) == 5  # the stale index lists the first two batches only
    (tmp_path / "run.h5.parts" / "part_000006.h5.tmp").write_bytes(b"half a part")
    assert consolidate(h5) == h5
    episodes = check_file(h5)
    assert [e["episode_seed"] for e in episodes] == seeds
    assert self_contained(h5) and sorted(p.name for p in tmp_path.iterdir()) == ["run.h5", "run.json"]


def test_recover_renumbers_around_a_lost_part(tmp_path):
    """A part lost in the middle (parallel writers, crash): the later parts' episodes move down to keep
    ids consecutive; index link names differ from their targets; the JSON ids are fixed to match."""
    h5, seeds = _write_run(tmp_path, batches=5, num_writers=2)  # each batch spread over 2 parts
    parts = tmp_path / "run.h5.parts"
    with h5py.File(parts / "part_000001.h5") as f:
        lost = [e["episode_seed"] for e in json.loads(f.attrs["fastrecord_episodes"])]
    with h5py.File(parts / "part_000002.h5") as f:
        next_group = next(iter(f))
    (parts / "part_000001.h5").unlink()
    kept = [s for s in seeds if s not in lost]
    first = seeds.index(lost[0])  # the id the first episode of part 2 moves down to
    assert recover(h5) == len(kept)
    episodes = check_file(h5)
    assert [e["episode_seed"] for e in episodes] == kept
    with h5py.File(h5) as f:
        link = f.get(f"traj_{first}", getlink=True)
        assert isinstance(link, h5py.ExternalLink)
        assert (link.filename, link.path) == ("run.h5.parts/part_000002.h5", f"/{next_group}")
        assert next_group != f"traj_{first}"
    assert recover(h5) == len(kept)  # recovering again changes nothing
    assert check_file(h5) == episodes
    consolidate(h5)
    assert check_file(h5) == episodes and self_contained(h5)


def test_recover_parts_without_entries_use_the_json(tmp_path):
    """Parts written before parts carried their JSON entries (no attribute) take them from NAME.json."""
    h5 = tmp_path / "run.h5"
    parts = tmp_path / "run.h5.parts"
    parts.mkdir()
    entries = []
    for k in range(2):  # the old writer's layout: traj_{id} groups, entries in NAME.json only
        with h5py.File(parts / f"part_{k:06d}.h5", "w", track_order=True) as f:
            for i in (2 * k, 2 * k + 1):
                ep = make_episode(i, 40 + i)
                g = f.create_group(f"traj_{i}", track_order=True)
                for path, data in ep.datasets.items():
                    g.create_dataset(path, data=data)
                entries.append(ep.meta)
    with h5py.File(h5, "w") as f:  # a stale index listing part 0 only
        for i in (0, 1):
            f[f"traj_{i}"] = h5py.ExternalLink("run.h5.parts/part_000000.h5", f"/traj_{i}")
    h5.with_suffix(".json").write_text(json.dumps({**HEADER, "episodes": entries}))
    assert recover(h5) == 4
    assert [e["episode_seed"] for e in check_file(h5)] == [40, 41, 42, 43]
    with h5py.File(parts / "part_000001.h5") as f:  # given its entries for good
        assert [e["episode_seed"] for e in json.loads(f.attrs["fastrecord_episodes"])] == [42, 43]
    w = TrajectoryWriter(h5, HEADER, resume=True)
    assert w.next_episode_id == 4
    w.submit([make_episode(4, 44)])
    w.close()
    assert [e["episode_seed"] for e in check_file(h5)] == [40, 41, 42, 43, 44]


def test_resume_on_nothing_starts_fresh_and_recover_on_nothing_raises(tmp_path):
    w = TrajectoryWriter(tmp_path / "run.h5", HEADER, resume=True)
    assert w.next_episode_id == 0
    w.submit([make_episode(0, 1)])
    w.close()
    assert len(check_file(tmp_path / "run.h5")) == 1
    with pytest.raises(FileNotFoundError, match="nothing to recover"):
        recover(tmp_path / "other.h5")
    with pytest.raises(ValueError, match="num_writers=0"):
        TrajectoryWriter(tmp_path / "x.h5", HEADER, num_writers=0)
    shutil.rmtree(tmp_path)


def test_commit_info_is_maniskills_without_importing_gitpython_where_there_is_no_checkout(tmp_path, monkeypatch):
    """The trajectory JSON's ``commit_info``: ManiSkill's `get_commit_info` where ManiSkill's folder is a git checkout,
    else None, as that function answers there, without its GitPython import (0.1-0.4 s of each recorder's start)."""
    import mani_skill

    from fastrecord.sinks.factory import commit_info

    package = tmp_path / "site" / "mani_skill"
    package.mkdir(parents=True)
    monkeypatch.setattr(mani_skill, "PACKAGE_DIR", package)
    monkeypatch.setattr(mani_skill, "get_commit_info", lambda: pytest.fail("GitPython's way where there is no checkout"))
    assert commit_info() is None
    (package.parent / ".git").mkdir()
    monkeypatch.setattr(mani_skill, "get_commit_info", lambda: {"commit_id": "abc", "branch": "main"})
    assert commit_info() == {"commit_id": "abc", "branch": "main"}
    r = subprocess.run([sys.executable, "-c", "import sys, mani_skill; from fastrecord.sinks.factory import commit_info; "
                        "print(commit_info(), 'git' in sys.modules)"], capture_output=True, text=True, timeout=300)
    assert r.stdout.split() == ["None", "False"], r.stderr[-2000:]  # this installation: a package, no checkout
