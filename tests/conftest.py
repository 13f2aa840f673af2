"""Shared fixtures: real ManiSkill envs on the CPU (lavapipe rendering), small cameras for speed; and the helpers
several test modules use: this checkout's code in a child process (`checkout_env`, `fastrecord_cli`, `torchrun`),
datasets read back (`leaves`), a worker killed mid-run (`run_then_kill`), small or read-only disks (`tmpfs`)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

from fastrecord.system import use_lavapipe_if_no_gpu

use_lavapipe_if_no_gpu()  # before SAPIEN creates a renderer

CAMERA = dict(width=64, height=64)
REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"
# what torchrun sets in its ranks: a child process started by a test is no rank of the test's own launch, if any
RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]


def checkout_env(**extra: str) -> dict[str, str]:
    """The environment of a child Python process that runs this checkout's fastrecord: this process's, with
    src/ first on PYTHONPATH, without torchrun's rank variables and without FASTRECORD_DEBUG (errors as a user
    sees them), then ``extra`` (e.g. ``OMP_NUM_THREADS="1"``)."""
    env = {k: v for k, v in os.environ.items() if k not in RANK_VARIABLES and k != "FASTRECORD_DEBUG"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SRC), os.environ.get("PYTHONPATH", "")) if p)
    env.update(extra)
    return env


def fastrecord_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 300,
                   **kwargs: Any) -> subprocess.CompletedProcess:
    """``python -m fastrecord ARGS`` in a fresh process, as a user runs it (`checkout_env` plus ``env``), its
    output captured as text; ``kwargs`` go to `subprocess.run` (``cwd``)."""
    return subprocess.run([sys.executable, "-m", "fastrecord", *args], capture_output=True, text=True,
                          env=checkout_env(**(env or {})), timeout=timeout, **kwargs)


def record_args(out: Path, episodes: int, max_steps: int, size: int = 64) -> list[str]:
    """The arguments of a short ``fastrecord record PickCube-v1`` into ``out``: ``episodes`` episodes of at most
    ``max_steps`` steps, a ``size`` x ``size`` video camera."""
    return ["record", "PickCube-v1", "--episodes", str(episodes), "--max-episode-steps", str(max_steps),
            "--width", str(size), "--height", str(size), "--output-dir", str(out)]


def torchrun_env() -> dict[str, str]:
    """`checkout_env` with one OpenMP thread a process: what `torchrun` gives its ranks, and what a test gives the
    one-process run it compares them with."""
    return checkout_env(OMP_NUM_THREADS="1")


def torchrun(nproc: int, args: list[str], timeout: float = 300, **kwargs: Any) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node NPROC ARGS`` (gloo on the loopback) with this checkout's code
    (`torchrun_env`), output captured as text; ``kwargs`` go to `subprocess.run`."""
    return subprocess.run([*TORCHRUN, "--nproc-per-node", str(nproc), *args], capture_output=True, text=True,
                          timeout=timeout, env=torchrun_env(), **kwargs)


def leaves(group: h5py.Group, prefix: str = "") -> dict[str, np.ndarray]:
    """Every dataset under ``group``, read into memory, by its path relative to ``group`` ("obs/agent/qpos")."""
    out: dict[str, np.ndarray] = {}
    for k, v in group.items():
        if isinstance(v, h5py.Group):
            out |= leaves(v, f"{prefix}{k}/")
        else:
            out[prefix + k] = v[:]
    return out


# a recorder's own threads, which its close() ends (not the process-wide ones: the encoder pool's, sub-env reapers)
RECORDER_THREADS = ("fastrecord-h5", "fastrecord-mp4", "fastrecord-lerobot", "fastrecord-wandb")


@pytest.fixture(autouse=True)
def recorders_closed():
    """Every recorder a test makes is closed by the test, also one whose step or reset raised the error the test
    expects: its writer threads end with the test (waited for up to 10 s), else the test fails naming them. Left
    running, they served the tests after them, and a fork from a thread of such a crowded process is the likely
    cause of the launch that hung in CI on 2026-12-07 (docs/design.md)."""
    import threading

    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + 10.0
    while True:
        left = sorted(t.name for t in threading.enumerate()
                      if t not in before and t.name.startswith(RECORDER_THREADS) and t.is_alive())
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not left, f"the test left a recorder open (threads {left}): close the env it wrapped, in a finally"


@pytest.fixture(scope="session", autouse=True)
def render_device():
    """Hold one SAPIEN render system for the whole session: while one exists, each new env reuses the
    device's compiled pipelines (about 1 s to a first frame on lavapipe instead of 10-15 s per env)."""
    import sapien
    import torch

    try:
        holder = sapien.render.RenderSystem(sapien.Device("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError:  # no renderer on this machine: the cases report it themselves
        holder = None
    yield holder


@pytest.fixture
def make_env():
    """gym.make a ManiSkill CPU env with a small human camera; closed after the test."""
    import gymnasium as gym
    import mani_skill.envs  # noqa: F401

    made = []

    def _make(env_id: str = "PickCube-v1", **kwargs):
        kw = dict(obs_mode="state", render_mode="rgb_array", sim_backend="physx_cpu",
                  human_render_camera_configs=CAMERA, max_episode_steps=10)
        kw.update(kwargs)
        env = gym.make(env_id, **kw)
        made.append(env)
        return env

    yield _make
    for env in made:
        try:
            env.close()
        except Exception:  # noqa: BLE001 - already closed by the wrapper
            pass


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@contextlib.contextmanager
def tmpfs(mnt, options: str):
    """A tmpfs mounted on the new folder ``mnt`` with ``options`` (e.g. "size=2m", "ro,size=1m") while in
    the block; the test is skipped where mounting needs root or CAP_SYS_ADMIN."""
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs -o {options} (needs root or CAP_SYS_ADMIN): {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs mounted on a folder of tmp_path (needs root, as in CI)."""
    with tmpfs(tmp_path / "disk", "size=2m") as mnt:
        yield mnt


@pytest.fixture
def read_only(tmp_path):
    """A read-only folder: a read-only tmpfs (root passes permission bits, not a read-only mount)."""
    with tmpfs(tmp_path / "ro", "ro,size=1m") as mnt:
        yield mnt


def run_then_kill(argv: list[str], min_finished: int, extra_s: float, sig: int = signal.SIGKILL,
                  timeout: float = 300, stop_timeout: float = 120) -> tuple[int, int]:
    """Start the worker ``argv`` (it prints ``finished N`` as episodes become durable), wait until ``min_finished``,
    go on ``extra_s``, send ``sig``. Returns (episodes the worker had reported durable, its exit status).

    Never hangs: a worker that has not reported ``min_finished`` within ``timeout`` s (silent or not), or one
    that outlives ``sig`` by ``stop_timeout`` s, is SIGKILLed and the test fails (the reads wait on a
    deadline, not on the worker's next line)."""
    import selectors

    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    os.set_blocking(proc.stdout.fileno(), False)
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    finished, pending = 0, ""

    def read_until(deadline: float, enough: int | None) -> bool:
        """Read the worker's lines until ``deadline``, its exit, or (``enough``) that many finished."""
        nonlocal finished, pending
        while time.monotonic() < deadline:
            if not sel.select(timeout=min(1.0, max(0.0, deadline - time.monotonic()))):
                if proc.poll() is not None:
                    return False
                continue
            chunk = proc.stdout.read()
            if not chunk:  # end of file: the worker closed its output (exited)
                return False
            *lines, pending = (pending + chunk).split("\n")
            for line in lines:
                if line.startswith("finished"):
                    finished = int(line.split()[1])
            if enough is not None and finished >= enough:
                return True
        return enough is None

    try:
        reached = read_until(time.monotonic() + timeout, min_finished)
        assert reached or proc.poll() is not None, f"worker too slow: {finished}/{min_finished} episodes in {timeout} s"
        read_until(time.monotonic() + extra_s, None)  # now kill at an arbitrary moment of recording/writing
    finally:
        proc.send_signal(sig)
        try:
            code = proc.wait(timeout=stop_timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise AssertionError(f"worker did not stop within {stop_timeout} s of signal {sig}") from None
        finally:
            sel.close()
    return finished, code


class FullOnce:
    """Stands in for a file opened without a buffer (``open(path, "ab", buffering=0)``): its first write puts half
    the bytes on disk, then fails as a full disk; the writes after it go through."""

    def __init__(self, f: Any) -> None:
        self.f, self.failed = f, False

    def write(self, data: Any) -> int:
        if not self.failed:
            import errno

            self.failed = True
            self.f.write(bytes(data[: len(data) // 2]))
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.f.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.f, name)
