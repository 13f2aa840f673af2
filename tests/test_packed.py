"""fastrecord.packed: a vector env of several sub-envs a process, held to gymnasium's AsyncVectorEnv (the three
autoreset modes, reset masks, seeds, call/get_attr/set_attr through wrappers), its packing (`process_sizes`), its
errors raised in the caller, its processes ended by every kind of close; and real ManiSkill CPU envs stepping
as in a SyncVectorEnv."""

from __future__ import annotations

import functools
import gc
import multiprocessing
import os
import signal
import sys
import time
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.spaces import Box, Discrete
from gymnasium.vector import AutoresetMode

from fastrecord.packed import AheadFailed, PackedLaunch, PackedVectorEnv, RemoteTraceback, SubEnvDied, process_sizes

NUM_ENVS = 5
PER_PROCESS = 2  # processes of 2, 2 and 1 sub-envs


@pytest.fixture(autouse=True)
def no_process_left():
    """Every sub-env process a test started has ended when it returns, or is ending (a close returns once the
    processes answered; their exits are awaited on a thread: given 30 s here)."""
    yield
    ending = [p for p in multiprocessing.active_children() if p.name.startswith("fastrecord-subenvs")]
    for p in ending:
        p.join(30)
    left = [p for p in ending if p.is_alive()]
    for p in left:  # do not leak them into the next tests
        p.kill()
        p.join()
    assert left == []


class Counted(gym.Wrapper):
    """Adds deterministic infos (a nested dict too) to every reset and step; a wrapper attribute ``tag`` and
    methods that call/get_attr reach through the wrappers."""

    def __init__(self, env: gym.Env, tag: int = 0):
        super().__init__(env)
        self.tag = tag
        self.count = 0

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        self.count = 0
        return obs, {**info, "count": self.count, "nested": {"tag": self.tag}}

    def step(self, action):
        obs, rew, term, trunc, info = self.env.step(action)
        self.count += 1
        return obs, rew, term, trunc, {**info, "count": self.count, "half": self.count / 2,
                                       "nested": {"even": self.count % 2 == 0}}

    def tagged(self, x, *, scale=1):
        return self.tag, x * scale

    def inner(self, name):
        return getattr(self.unwrapped, name)


def cartpole(tag: int = 0, max_episode_steps: int = 25) -> gym.Env:
    return Counted(gym.make("CartPole-v1", max_episode_steps=max_episode_steps), tag)


def cartpole_fns(n: int = NUM_ENVS) -> list:
    return [functools.partial(cartpole, i) for i in range(n)]


class Scripted(gym.Env):
    """A sub-env whose observation counts its steps; it can fail when made (``init_error``), raise at step
    ``raise_at``, end its process with exit code 7 at step ``exit_at``, or write ``closed_marker`` when closed."""

    observation_space = Box(-np.inf, np.inf, (1,), np.float32)
    action_space = Discrete(2)

    def __init__(self, index: int = 0, raise_at: int | None = None, exit_at: int | None = None,
                 init_error: str | None = None, closed_marker: Path | None = None,
                 raise_unpicklable: bool = False, init_sleep: float = 0.0):
        if init_error:
            raise RuntimeError(init_error)
        time.sleep(init_sleep)
        self.index, self.raise_at, self.exit_at, self.closed_marker = index, raise_at, exit_at, closed_marker
        self.raise_unpicklable = raise_unpicklable
        self.steps = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.steps = 0
        return np.array([self.index * 100], np.float32), {}

    def step(self, action):
        self.steps += 1
        if self.steps == self.raise_at:
            if self.raise_unpicklable:
                raise TwoArgs(self.index, self.steps)
            raise ValueError(f"boom at step {self.steps}")
        if self.steps == self.exit_at:
            os._exit(7)
        return np.array([self.index * 100 + self.steps], np.float32), 1.0, False, False, {}

    def close(self):
        if self.closed_marker is not None:
            Path(self.closed_marker).write_text(str(self.index))


class TwoArgs(Exception):
    """An exception that pickles but does not unpickle (its constructor needs two arguments)."""

    def __init__(self, a, b):
        super().__init__(f"env {a} failed at {b}")


def scripted_fns(n: int = NUM_ENVS, **per_index) -> list:
    """``per_index``: {keyword: {index: value}} for the sub-envs that differ."""
    return [functools.partial(Scripted, i, **{k: v[i] for k, v in per_index.items() if i in v}) for i in range(n)]


def assert_same(ours, theirs, where: str = "", ordered: bool = True) -> None:
    """Equal values of equal types, arrays of equal dtype and shape, dicts with the same keys (``ordered``: in the
    same order; SyncVectorEnv orders SAME_STEP's infos otherwise than AsyncVectorEnv)."""
    assert type(ours) is type(theirs), f"{where}: {type(ours)} vs {type(theirs)}"
    if isinstance(theirs, dict):
        assert (list(ours) if ordered else sorted(ours)) == (list(theirs) if ordered else sorted(theirs)), where
        for k in theirs:
            assert_same(ours[k], theirs[k], f"{where}[{k!r}]", ordered)
    elif isinstance(theirs, np.ndarray):
        assert (ours.dtype, ours.shape) == (theirs.dtype, theirs.shape), where
        if theirs.dtype == object:
            for i, (a, b) in enumerate(zip(ours, theirs)):
                assert_same(a, b, f"{where}[{i}]", ordered)
        else:
            np.testing.assert_array_equal(ours, theirs, err_msg=where)
    elif isinstance(theirs, (tuple, list)):
        assert len(ours) == len(theirs), where
        for i, (a, b) in enumerate(zip(ours, theirs)):
            assert_same(a, b, f"{where}[{i}]", ordered)
    else:
        assert ours == theirs, where


def all_ended(envs) -> bool:
    if isinstance(envs, PackedVectorEnv):
        envs.exited(30)  # a close returns once the processes answered; their exits are awaited on a thread
    return all(not p.is_alive() and p.exitcode is not None for p in envs.processes)


# ---------------------------------------------------------------------------------------------- AsyncVectorEnv's semantics
@pytest.mark.parametrize("mode", list(AutoresetMode), ids=lambda m: m.value)
def test_steps_equal_async_vector_env(mode):
    """200 random steps of 5 CartPoles (episodes of at most 25 steps: terminations and truncations) give what
    AsyncVectorEnv gives: observations, rewards, terminations, truncations and infos, values and dtypes; in
    DISABLED mode the finished envs are reset by ``options["reset_mask"]``."""
    ours = PackedVectorEnv(cartpole_fns(), PER_PROCESS, autoreset_mode=mode)
    theirs = gym.vector.AsyncVectorEnv(cartpole_fns(), autoreset_mode=mode)
    try:
        assert ours.sizes == [2, 2, 1] and len(ours.processes) == 3
        assert ours.num_envs == NUM_ENVS
        assert ours.metadata["autoreset_mode"] == theirs.metadata["autoreset_mode"] == mode
        assert ours.single_observation_space == theirs.single_observation_space
        assert ours.single_action_space == theirs.single_action_space
        assert ours.observation_space == theirs.observation_space
        assert ours.action_space == theirs.action_space
        assert_same(ours.reset(seed=123), theirs.reset(seed=123), "reset")
        rng = np.random.default_rng(0)
        ended = {"terminated": 0, "truncated": 0, "masked resets": 0, "final_obs": 0}
        for t in range(200):
            actions = rng.integers(0, 2, size=NUM_ENVS)
            a, b = ours.step(actions), theirs.step(actions)
            assert_same(a, b, f"step {t}")
            assert a[1].dtype == np.float64 and a[2].dtype == a[3].dtype == np.bool_
            ended["terminated"] += int(a[2].sum())
            ended["truncated"] += int(a[3].sum())
            ended["final_obs"] += int("final_obs" in a[4])
            done = a[2] | a[3]
            if mode == AutoresetMode.DISABLED and done.any():
                seed = None if t % 2 else [int(s) for s in rng.integers(0, 2**31, size=NUM_ENVS)]
                ra = ours.reset(seed=seed, options={"reset_mask": done.copy()})
                rb = theirs.reset(seed=seed, options={"reset_mask": done.copy()})
                assert_same(ra, rb, f"masked reset after step {t}")
                assert list(ra[1]["_count"]) == list(done)  # infos of the reset envs only
                ended["masked resets"] += 1
        assert ended["terminated"] > 0 and ended["truncated"] > 0, ended
        assert (ended["masked resets"] > 0) == (mode == AutoresetMode.DISABLED)
        assert (ended["final_obs"] > 0) == (mode == AutoresetMode.SAME_STEP)
    finally:
        ours.close()
        theirs.close()
    assert all_ended(ours)


def test_reset_seeds_equal_async_vector_env():
    """``reset(seed=int)`` seeds sub-env i with int + i, ``reset(seed=list)`` each with its own (None: unseeded)."""
    ours = PackedVectorEnv(cartpole_fns(), PER_PROCESS)
    theirs = gym.vector.AsyncVectorEnv(cartpole_fns())
    try:
        obs, info = ours.reset(seed=7)
        assert_same((obs, info), theirs.reset(seed=7))
        for i in range(NUM_ENVS):  # what one env seeded 7 + i starts from
            np.testing.assert_array_equal(obs[i], cartpole(i).reset(seed=7 + i)[0])
        seeds = [3, 1, 4, 1, 5]
        obs, info = ours.reset(seed=seeds)
        assert_same((obs, info), theirs.reset(seed=seeds))
        np.testing.assert_array_equal(obs[1], obs[3])  # the same seed: the same start, in different processes
        assert_same(ours.reset(seed=[11, None, 12, None, 13]), theirs.reset(seed=[11, None, 12, None, 13]))
        with pytest.raises(ValueError, match="4 seeds for 5 envs"):
            ours.reset(seed=[1, 2, 3, 4])
        assert_same(ours.reset(seed=0), theirs.reset(seed=0))  # still usable
    finally:
        ours.close()
        theirs.close()


def test_call_get_attr_set_attr_through_wrappers_in_env_order():
    """call/get_attr/set_attr reach wrapper and inner-env attributes, one result an env in env index order across
    the processes, as AsyncVectorEnv's do."""
    ours = PackedVectorEnv(cartpole_fns(), PER_PROCESS)
    theirs = gym.vector.AsyncVectorEnv(cartpole_fns())
    try:
        for env in (ours, theirs):
            env.reset(seed=0)
        assert ours.get_attr("tag") == theirs.get_attr("tag") == (0, 1, 2, 3, 4)
        assert ours.call("tagged", 3, scale=2) == theirs.call("tagged", 3, scale=2) == tuple((i, 6) for i in range(5))
        for env in (ours, theirs):
            env.set_attr("tag", [10, 11, 12, 13, 14])  # per env: on the Counted wrapper, which has it
        assert ours.get_attr("tag") == theirs.get_attr("tag") == (10, 11, 12, 13, 14)
        assert ours.call("tagged", "ab") == ((10, "ab"), (11, "ab"), (12, "ab"), (13, "ab"), (14, "ab"))
        for env in (ours, theirs):
            env.set_attr("force_mag", 5.0)  # one value for all: on the inner CartPole, the only one that has it
        assert ours.call("inner", "force_mag") == theirs.call("inner", "force_mag") == (5.0,) * 5
        assert ours.get_attr("force_mag") == (5.0,) * 5
        for env in (ours, theirs):
            env.set_attr("brand_new", ("a", "b", "c", "d", "e"))  # nowhere yet: set on the outermost wrapper
        assert ours.get_attr("brand_new") == theirs.get_attr("brand_new") == ("a", "b", "c", "d", "e")
        assert ours.get_attr("np_random_seed") == theirs.get_attr("np_random_seed") == (0, 1, 2, 3, 4)
        assert_same(ours.step(np.ones(5, np.int64)), theirs.step(np.ones(5, np.int64)))  # infos carry the new tags
        with pytest.raises(ValueError, match="3 values for 5 envs"):
            ours.set_attr("tag", [1, 2, 3])
        with pytest.raises(ValueError, match="step"):
            ours.call("step", 0)
        assert ours.get_attr("tag") == (10, 11, 12, 13, 14)  # refused in the caller: still open
    finally:
        ours.close()
        theirs.close()


# ---------------------------------------------------------------------------------------------- process_sizes
@pytest.mark.parametrize(("num_envs", "per_process", "cores", "expected"), [
    (16, None, 16, [2] * 8),
    (2, None, 16, [1, 1]),
    (128, None, 16, [8] * 16),
    (16, None, 2, [8, 8]),
    (17, None, 16, [2] * 8 + [1]),
    (6, None, 16, [2, 2, 1, 1]),  # below 16 envs: still 4 processes
    (3, None, 1, [3]),
    (5, 2, None, [2, 2, 1]),
    (5, 1, None, [1] * 5),
    (4, 4, None, [4]),
    (3, 8, None, [3]),
])
def test_process_sizes(num_envs, per_process, cores, expected):
    assert process_sizes(num_envs, per_process, cores=cores) == expected


def test_default_process_sizes_spread_evenly():
    for cores in (1, 2, 3, 16):
        for n in range(1, 70):
            sizes = process_sizes(n, cores=cores)
            assert sum(sizes) == n and max(sizes) - min(sizes) <= 1, (n, cores, sizes)
            assert len(sizes) <= cores and len(sizes) == max(min(n, 4, cores), min(-(-n // 2), cores))


@pytest.mark.parametrize("bad", [0, -1, 2.0, None, True])
def test_bad_num_envs_is_refused(bad):
    with pytest.raises(ValueError, match=rf"num_envs={bad!r}"):
        process_sizes(bad, cores=4)


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, "2"])
def test_bad_envs_per_process_is_refused(bad):
    with pytest.raises(ValueError, match=rf"envs_per_process={bad!r}"):
        process_sizes(5, bad)


def test_a_refused_construction_leaves_nothing_to_clean_up(monkeypatch):
    """Refused before any process starts: a ValueError, and nothing raised later when the half-made object goes."""
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    with pytest.raises(ValueError, match="envs_per_process=0"):
        PackedVectorEnv(cartpole_fns(2), 0)
    with pytest.raises(ValueError, match="env_fns"):
        PackedVectorEnv()
    gc.collect()
    assert [f"{u.exc_type.__name__}: {u.exc_value}" for u in unraisable] == []


# ---------------------------------------------------------------------------------------------- errors
def test_an_error_in_a_sub_env_is_raised_in_the_caller():
    envs = PackedVectorEnv(scripted_fns(raise_at={3: 3}), PER_PROCESS)
    envs.reset(seed=0)
    for _ in range(2):
        envs.step(np.zeros(5, np.int64))
    with pytest.raises(ValueError) as raised:
        envs.step(np.zeros(5, np.int64))
    assert str(raised.value) == "boom at step 3"  # the sub-env's own exception
    notes = "\n".join(raised.value.__notes__)
    assert "sub-env 3's process" in notes and "step" in notes
    cause = raised.value.__cause__
    assert isinstance(cause, RemoteTraceback)
    remote = str(cause)
    assert "Traceback (most recent call last)" in remote and "ValueError: boom at step 3" in remote
    assert "in step" in remote and "test_packed.py" in remote  # where the sub-env raised
    assert envs.closed
    with pytest.raises(gym.error.ClosedEnvironmentError):
        envs.step(np.zeros(5, np.int64))
    with pytest.raises(gym.error.ClosedEnvironmentError):
        envs.get_attr("index")
    envs.close()  # nothing more to do
    assert all_ended(envs)


def test_an_error_that_does_not_unpickle_comes_as_its_text():
    envs = PackedVectorEnv(scripted_fns(raise_at={4: 1}, raise_unpicklable={4: True}), PER_PROCESS)
    envs.reset()
    with pytest.raises(RuntimeError) as raised:
        envs.step(np.zeros(5, np.int64))
    assert str(raised.value) == "TwoArgs: env 4 failed at 1"
    assert "sub-env 4's process" in raised.value.__notes__[0]
    assert "TwoArgs: env 4 failed at 1" in str(raised.value.__cause__)
    assert envs.closed and all_ended(envs)


def test_an_error_making_a_sub_env_is_raised_by_the_constructor():
    with pytest.raises(RuntimeError) as raised:
        PackedVectorEnv(scripted_fns(init_error={2: "no env for you"}), PER_PROCESS)
    assert str(raised.value) == "no env for you"
    assert "sub-env 2's process" in raised.value.__notes__[0]
    assert "its start" in raised.value.__notes__[0]
    assert "in __init__" in str(raised.value.__cause__)
    # the no_process_left fixture: the other processes were ended too


def test_a_process_slow_to_make_its_sub_envs_is_named_once_then_awaited(monkeypatch, caplog):
    """A sub-env whose make takes longer than `START_NOTICE_S`: one warning names its process's sub-envs and pid, and
    the vector env is made once it answers, stepping as any other."""
    import fastrecord.packed

    monkeypatch.setattr(fastrecord.packed, "START_NOTICE_S", 0.3)
    with caplog.at_level("WARNING", logger="fastrecord"):
        envs = PackedVectorEnv(scripted_fns(init_sleep={3: 3.0}), PER_PROCESS)
    try:
        slow = [r.getMessage() for r in caplog.records if "making its envs" in r.getMessage()]
        # the first process may wait for the forkserver's start too; the last one answered while the second slept
        assert not any("sub-envs 4-4" in m for m in slow)
        assert [m for m in slow if "sub-envs 2-3" in m] == [f"fastrecord: the process of sub-envs 2-3 (pid {envs.processes[1].pid}) has been making its "
                        f"envs for over 0 s; still waiting for it (a first download of the task's assets takes that "
                        f"long, a hang forever: Ctrl-C stops)"]
        obs, _ = envs.reset(seed=0)
        np.testing.assert_array_equal(obs[:, 0], [0, 100, 200, 300, 400])
    finally:
        envs.close()


def test_a_sub_env_process_that_exits_mid_step_raises_sub_env_died():
    envs = PackedVectorEnv(scripted_fns(exit_at={3: 2}), PER_PROCESS)
    envs.reset()
    envs.step(np.zeros(5, np.int64))
    with pytest.raises(SubEnvDied, match=r"sub-envs 2-3 .*exit code 7"):
        envs.step(np.zeros(5, np.int64))
    assert envs.closed and all_ended(envs)
    with pytest.raises(gym.error.ClosedEnvironmentError):
        envs.reset()


def test_a_killed_sub_env_process_raises_sub_env_died():
    envs = PackedVectorEnv(scripted_fns(), PER_PROCESS)
    try:
        envs.reset()
        os.kill(envs.processes[1].pid, signal.SIGKILL)
        envs.processes[1].join(10)
        with pytest.raises(SubEnvDied, match=rf"sub-envs 2-3 .*exit code {-signal.SIGKILL}"):
            envs.step(np.zeros(5, np.int64))
        assert envs.closed and all_ended(envs)
    finally:
        envs.close(terminate=True)


# ---------------------------------------------------------------------------------------------- closing
def test_close_closes_the_envs_in_their_processes(tmp_path):
    envs = PackedVectorEnv(scripted_fns(closed_marker={i: tmp_path / f"closed-{i}" for i in range(5)}), PER_PROCESS)
    envs.reset()
    envs.step(np.zeros(5, np.int64))
    envs.close()
    assert envs.closed and all_ended(envs)
    assert [p.exitcode for p in envs.processes] == [0, 0, 0]
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"closed-{i}" for i in range(5)]
    envs.close()  # idempotent


def test_close_terminate_ends_the_processes_without_closing_the_envs(tmp_path):
    envs = PackedVectorEnv(scripted_fns(closed_marker={i: tmp_path / f"closed-{i}" for i in range(5)}), PER_PROCESS)
    envs.reset()
    envs.close(terminate=True)
    assert envs.closed and all_ended(envs)
    assert [p.exitcode for p in envs.processes] == [-signal.SIGTERM] * 3
    assert list(tmp_path.iterdir()) == []


def test_a_background_launch_closed_without_being_taken(tmp_path):
    launch = PackedLaunch(scripted_fns(closed_marker={i: tmp_path / f"closed-{i}" for i in range(5)}), PER_PROCESS,
                          background=True)
    launch.close()
    assert len(launch.processes) == 3 and all_ended(launch)
    assert list(tmp_path.iterdir()) == []
    launch.close()  # idempotent


def test_a_launch_closed_without_waiting_returns_at_once_and_its_thread_ends_what_it_starts(monkeypatch):
    """The CLI's refusal of an option ends an early launch with ``close(wait=False)``: it returns while the thread
    is still starting processes (here each start waits 0.5 s, as a start waits for the forkserver's preload), and the
    thread ends each process it started and starts no more."""
    import threading
    import time

    real = multiprocessing.get_context("forkserver")  # what a background launch starts on

    class SlowStarts:
        def get_start_method(self):
            return real.get_start_method()

        def Pipe(self, *args):
            return real.Pipe(*args)

        def Process(self, **kwargs):
            proc = real.Process(**kwargs)
            start = proc.start

            def slow() -> None:
                in_flight.set()
                time.sleep(0.5)
                del proc.start  # the forkserver pickles the process: its own start again
                start()

            proc.start = slow
            return proc

    monkeypatch.setattr("fastrecord.packed.multiprocessing.get_context", lambda context=None: SlowStarts())
    in_flight = threading.Event()
    launch = PackedLaunch(scripted_fns(), PER_PROCESS, background=True)
    assert in_flight.wait(30)  # the first start is under way
    t0 = time.perf_counter()
    launch.close(wait=False)
    assert time.perf_counter() - t0 < 0.25
    launch.close()  # idempotent, and still not waiting
    assert time.perf_counter() - t0 < 0.25
    launch._thread.join(30)
    assert launch._failed is None
    assert len(launch.processes) == 1 and all_ended(launch)  # the start in flight; the other two never began

    waited = PackedLaunch(scripted_fns(), PER_PROCESS, background=True)
    t0 = time.perf_counter()
    waited.close()  # the default waits for the three starts, then ends them
    assert time.perf_counter() - t0 >= 1.5 and len(waited.processes) == 3 and all_ended(waited)


def _parent_pid(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2:].split()[1])


def test_a_background_launch_starts_its_processes_on_the_forkserver_never_by_a_fork_from_its_thread():
    """A fork copies only the forking thread, and a lock another thread held stays held in the copy: a background
    launch on the fork default hung in CI waiting for a sub-env's first message. Its processes are the forkserver's
    children, where a launch on the calling thread (``background=False``) keeps the default, a fork of the caller."""
    launch = PackedLaunch(cartpole_fns(2), 1, background=True)
    envs = PackedVectorEnv(launch=launch)
    try:
        parents = {_parent_pid(p.pid) for p in envs.processes}
        assert len(parents) == 1 and os.getpid() not in parents
        assert envs.reset(seed=1)[0].shape == (2, 4)
    finally:
        envs.close()
    direct = PackedVectorEnv(cartpole_fns(2), 1)
    try:
        assert {_parent_pid(p.pid) for p in direct.processes} == {os.getpid()}
    finally:
        direct.close()
    with pytest.raises(ValueError, match=r"context='fork'.*context='forkserver'"):
        PackedLaunch(cartpole_fns(2), 1, background=True, context="fork")


def test_a_background_launch_taken_over_by_the_vector_env():
    launch = PackedLaunch(cartpole_fns(), PER_PROCESS, autoreset_mode="SameStep", background=True)
    envs = PackedVectorEnv(launch=launch)
    reference = gym.vector.SyncVectorEnv(cartpole_fns(), autoreset_mode=AutoresetMode.SAME_STEP)
    try:
        assert envs.processes is launch.processes and envs.sizes == [2, 2, 1]
        assert envs.autoreset_mode == AutoresetMode.SAME_STEP
        launch.close()  # taken over: the vector env owns the processes now
        assert all(p.is_alive() for p in envs.processes)
        assert_same(envs.reset(seed=42), reference.reset(seed=42))
        rng = np.random.default_rng(1)
        for t in range(60):
            actions = rng.integers(0, 2, size=NUM_ENVS)
            assert_same(envs.step(actions), reference.step(actions), f"step {t}", ordered=False)
    finally:
        envs.close()
        reference.close()
    assert all_ended(envs)


# ---------------------------------------------------------------------------------------------- ManiSkill
def test_maniskill_cpu_envs_step_as_in_a_sync_vector_env():
    """3 PickCube-v1 CPU envs in processes of 2 and 1 (forkserver: this process holds a SAPIEN render system)
    step as a SyncVectorEnv of the same functions does, under the same seeds and actions."""

    def thunk():
        import gymnasium as gym
        import mani_skill.envs  # noqa: F401 - registers the envs, in whatever process makes them
        from mani_skill.utils.wrappers import CPUGymWrapper

        return CPUGymWrapper(gym.make("PickCube-v1", obs_mode="state", sim_backend="physx_cpu", render_backend="cpu"))

    ours = PackedVectorEnv([thunk] * 3, PER_PROCESS, context="forkserver")
    theirs = gym.vector.SyncVectorEnv([thunk] * 3)
    try:
        assert ours.sizes == [2, 1]
        assert ours.single_observation_space == theirs.single_observation_space
        assert ours.single_action_space == theirs.single_action_space
        a, _ = ours.reset(seed=[5, 6, 7])
        b, _ = theirs.reset(seed=[5, 6, 7])
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
        assert not np.allclose(a[0], a[1])  # different seeds: different cube poses
        actions = np.random.default_rng(2).uniform(-1, 1, size=(20, *ours.action_space.shape)).astype(np.float32)
        start = a
        for t, action in enumerate(actions):
            a, ra, ta, ua, _ = ours.step(action)
            b, rb, tb, ub, _ = theirs.step(action)
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7, err_msg=f"step {t}")
            np.testing.assert_allclose(ra, rb, rtol=1e-6, atol=1e-7, err_msg=f"step {t}")
            np.testing.assert_array_equal(ta, tb)
            np.testing.assert_array_equal(ua, ub)
        assert not np.allclose(a, start)  # the robots moved
    finally:
        ours.close()
        theirs.close()
    assert all_ended(ours)


def _pickcube_thunk():
    import gymnasium as gym
    import mani_skill.envs  # noqa: F401 - registers the envs, in whatever process makes them
    from mani_skill.utils.wrappers import CPUGymWrapper

    return CPUGymWrapper(gym.make("PickCube-v1", obs_mode="state", sim_backend="physx_cpu", render_backend="cpu",
                                  render_mode="rgb_array", human_render_camera_configs=dict(width=32, height=32)),
                         ignore_terminations=True)


def test_reset_in_two_halves_answers_as_reset_and_other_commands_wait_for_it():
    """``reset_async`` returns at once and ``reset_wait`` gives what ``reset`` gives; a command sent in between (an
    attribute read) first takes the reset's answers, kept for ``reset_wait``; misuse names the fix; a close with a
    reset in flight closes."""
    ours = PackedVectorEnv(cartpole_fns(3), 2)
    theirs = gym.vector.SyncVectorEnv(cartpole_fns(3))
    try:
        ours.reset_async(seed=3)
        with pytest.raises(RuntimeError, match="reset_wait"):
            ours.reset_async(seed=3)
        assert ours.get_attr("spec")[0].id == "CartPole-v1"  # waits for the reset, then reads
        assert_same(ours.reset_wait(), theirs.reset(seed=3))
        with pytest.raises(RuntimeError, match="reset_async"):
            ours.reset_wait()
        ours.reset_async(options={"reset_mask": np.array([False, True, False])})
    finally:
        ours.close()
        theirs.close()
    assert all_ended(ours)


class _CountedResets(PackedVectorEnv):
    halves = 0

    def reset_async(self, **kwargs):
        type(self).halves += 1
        return super().reset_async(**kwargs)


def test_a_recorder_resets_packed_envs_in_two_halves_and_records_what_a_sync_vector_env_does(tmp_path):
    """`RecordVectorEpisode` over a `PackedVectorEnv` resets it in two halves (the ended episodes taken while the
    sub-envs reset, handed to the writers after) and writes the files a SyncVectorEnv's recording writes: masked
    resets at different steps, every trajectory value and video frame compared. Every reset is seeded: an unseeded
    one draws from the process's own random state, which differs between a sub-env's process and this one."""
    import h5py
    from conftest import leaves

    from fastrecord import RecordVectorEpisode
    from fastrecord.video import decode_mp4

    got = {}
    for name, venv in (("packed", lambda: _CountedResets([_pickcube_thunk] * 3, 2, context="forkserver",
                                                         autoreset_mode=AutoresetMode.DISABLED)),
                       ("sync", lambda: gym.vector.SyncVectorEnv([_pickcube_thunk] * 3,
                                                                 autoreset_mode=AutoresetMode.DISABLED))):
        out = tmp_path / name
        env = RecordVectorEpisode(venv(), out, trajectory_name="run", save_video=True)
        actions = np.random.default_rng(1).uniform(-1, 1, size=(12, 3, 8)).astype(np.float32)
        env.reset(seed=[1, 2, 3])
        for t, action in enumerate(actions):
            env.step(action)
            if t in (3, 7):
                env.reset(seed=[10 + t, None, 20 + t] if t == 3 else [None, 30, None],
                          options={"reset_mask": np.array([t == 3, t == 7, t == 3])})
        env.close()
        with h5py.File(out / "run.h5", "r") as f:
            got[name] = {"h5": leaves(f), "videos": {p.name: decode_mp4(p) for p in sorted(out.glob("*.mp4"))}}
    assert _CountedResets.halves == 3  # the first reset and the two masked ones
    assert got["packed"]["h5"].keys() == got["sync"]["h5"].keys() and len(got["sync"]["h5"]) > 0
    for k, v in got["sync"]["h5"].items():
        np.testing.assert_allclose(got["packed"]["h5"][k], v, rtol=0, atol=1e-5, err_msg=k)
    assert got["packed"]["videos"].keys() == got["sync"]["videos"].keys() and len(got["sync"]["videos"]) == 6
    for k, frames in got["sync"]["videos"].items():
        assert np.abs(got["packed"]["videos"][k].astype(int) - frames.astype(int)).max() <= 2, k


def test_a_masked_reset_before_the_first_reset_names_the_env_and_the_fix():
    """An env left out of a masked reset before it was ever reset has no observation to give: a ValueError naming
    it and the fix (gymnasium's AsyncVectorEnv gives zeros there, an observation no env produced)."""
    envs = PackedVectorEnv(cartpole_fns(3), 2)
    try:
        with pytest.raises(ValueError, match=r"sub-env 1 was left out of a masked reset before its first reset"):
            envs.reset(options={"reset_mask": np.array([True, False, True])})
        assert envs.closed and all_ended(envs)
    finally:
        envs.close(terminate=True)


def test_an_attribute_a_sub_env_lacks_is_an_error_that_leaves_the_envs_stepping():
    """``get_attr`` of a name the sub-envs lack raises their AttributeError in the caller (fastrecord's recorder
    probes ``_max_episode_steps`` so); the envs were not touched, so the vector env stays open and steps on
    (gymnasium's AsyncVectorEnv worker would shut down)."""
    envs = PackedVectorEnv(cartpole_fns(3), 2)
    try:
        envs.reset(seed=0)
        with pytest.raises(AttributeError, match="no_such_attribute") as info:
            envs.get_attr("no_such_attribute")
        assert "the vector env is closed" not in " ".join(getattr(info.value, "__notes__", []))
        assert not envs.closed and all(p.is_alive() for p in envs.processes)
        obs, *_ = envs.step(np.zeros(3, np.int64))
        assert obs.shape == (3, 4)
        assert envs.get_attr("spec")[2].id == "CartPole-v1"
    finally:
        envs.close()
    assert all_ended(envs)


# ---------------------------------------------------------------------------------------------- step_ahead
class RunsAhead(gym.Wrapper):
    """Records, in its process, what `PackedVectorEnv.step_ahead` had it run after each answer (``run_ahead``), and
    whether that ran after the step's answer was sent (the step's observation already counts the step)."""

    def __init__(self, env: gym.Env, fail_with: int | None = None):
        super().__init__(env)
        self.ran: list[tuple[int, int]] = []  # (the action run ahead, the env's step count then)
        self.fail_with = fail_with

    def run_ahead(self, action):
        if int(action) == self.fail_with:
            raise ValueError(f"cannot run {int(action)} ahead")
        self.ran.append((int(action), self.env.unwrapped.steps))


def runs_ahead(i: int, fail_with: int | None = None) -> gym.Env:
    return RunsAhead(Scripted(i), fail_with)


def test_step_ahead_steps_then_runs_the_next_actions_ahead_in_the_processes():
    """Answers as ``step`` does; then each env given a next action (not None) runs it, after the step: the envs
    whose next action is None run nothing."""
    envs = PackedVectorEnv([functools.partial(runs_ahead, i) for i in range(NUM_ENVS)], PER_PROCESS)
    try:
        envs.reset(seed=0)
        obs, rew, term, trunc, _ = envs.step_ahead(np.zeros(5, np.int64), [1, None, 1, 0, None])
        np.testing.assert_array_equal(obs[:, 0], [1, 101, 201, 301, 401])
        assert rew.tolist() == [1.0] * 5 and not term.any() and not trunc.any()
        envs.step_ahead(np.ones(5, np.int64), [None] * 5)
        assert envs.get_attr("ran") == ([(1, 1)], [], [(1, 1)], [(0, 1)], [])
        with pytest.raises(ValueError, match="2 next actions for 5 envs"):
            envs.step_ahead(np.ones(5, np.int64), [None, None])
    finally:
        envs.close()


def test_an_error_running_ahead_is_raised_at_the_next_command_and_closes_the_envs():
    envs = PackedVectorEnv([functools.partial(runs_ahead, i, fail_with=1 if i == 3 else None) for i in range(NUM_ENVS)],
                           PER_PROCESS)
    envs.reset(seed=0)
    envs.step_ahead(np.zeros(5, np.int64), [1] * 5)  # answered: sub-env 3 fails after its answer
    with pytest.raises(AheadFailed, match=r"sub-env 3 failed running its next step ahead \(ValueError: cannot run 1 ahead\)"):
        envs.step(np.ones(5, np.int64))
    assert envs.closed
    envs.close()
    assert all_ended(envs)
