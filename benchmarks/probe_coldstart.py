"""Where a fresh recording process loses time (issue 27, item 3): each piece measured in a fresh interpreter.

    PYTHONPATH=src python -m benchmarks.probe_coldstart --num-envs 128 --size 512 --steps 50 --json probe.json

Pieces (seconds): ``arena`` a staging arena of one batch of yuv420p frames made unpinned, pinned as
`fastrecord.staging.Arena` pins it, its pages populated first (one thread, several), two pinned at once;
``stall`` the longest wait of this thread's small CUDA calls while another thread pins an arena;
``copy`` the batch's device-to-host copy into pinned, fresh unpinned and populated unpinned memory;
``yuv`` the first GPU conversion to yuv420p and the second; ``encoders`` starting
the encoder processes until each answers; ``codec`` resolving ``codec="auto"`` (the NVENC probe); ``recorder`` a fresh recorder's first reset
(profiled) and its first two batches' steps one by one; ``evalclose`` `make_eval_envs`' close after 45
steps, split into the recorder's and the vector env's.

On the CPU machine: ``--device cpu --pieces recorder,encoders,codec,evalclose --num-envs 8 --size 64
--eval-envs 2 --eval-size 128``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from typing import Any

PIECES = ("recorder", "arena", "stall", "copy", "yuv", "encoders", "codec", "evalclose")


def _t(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _register(buf: Any) -> float:
    """Seconds to page-lock ``buf`` with cudaHostRegister (then unlocked again)."""
    import torch

    t0 = time.perf_counter()
    err = torch.cuda.cudart().cudaHostRegister(buf.ctypes.data, buf.nbytes, 0)
    dt = time.perf_counter() - t0
    assert int(getattr(err, "value", err)) == 0, err
    torch.cuda.cudart().cudaHostUnregister(buf.ctypes.data)
    return dt


def _mapping(nbytes: int, fallocate: bool = False, populate_flag: bool = False) -> tuple[Any, Any, int]:
    import mmap
    import os

    import numpy as np

    fd = os.memfd_create("probe", os.MFD_CLOEXEC)
    os.ftruncate(fd, nbytes)
    if fallocate:
        os.posix_fallocate(fd, 0, nbytes)
    flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0x8000) if populate_flag else 0)
    mm = mmap.mmap(fd, nbytes, flags, mmap.PROT_READ | mmap.PROT_WRITE)
    return mm, np.frombuffer(mm, dtype=np.uint8), fd


def _unmap(mm: Any, fd: int) -> None:
    import os

    mm.close()
    os.close(fd)


def piece_arena(nbytes: int) -> dict[str, Any]:
    import threading

    import torch

    from fastrecord import pinning, staging

    torch.cuda.init()
    torch.empty(1, device="cuda")
    r: dict[str, Any] = {"gib": nbytes / 2**30}
    mm, buf, fd = _mapping(nbytes)
    r["register_fresh (before)"] = _register(buf)  # what Arena(pin=True) did before: faults in every page
    del buf
    _unmap(mm, fd)
    for k in (1, 4, 8, 16):
        mm, buf, fd = _mapping(nbytes)
        t0 = time.perf_counter()
        pinning.populate(buf, k)
        r[f"populate_{k}"] = time.perf_counter() - t0
        r[f"register_after_populate_{k}"] = _register(buf)
        del buf
        _unmap(mm, fd)
    for name, kw in (("fallocate", dict(fallocate=True)), ("map_populate", dict(populate_flag=True)),
                     ("fallocate+map_populate", dict(fallocate=True, populate_flag=True))):
        t0 = time.perf_counter()
        mm, buf, fd = _mapping(nbytes, **kw)
        r[name] = dict(prepare=time.perf_counter() - t0, register=_register(buf))
        del buf
        _unmap(mm, fd)
    r["Arena(pin=True) (after)"] = _t(lambda: staging.Arena(nbytes, pin=True).close())
    out: list[Any] = []
    threads = [threading.Thread(target=lambda: out.append(staging.Arena(nbytes, pin=True))) for _ in range(2)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    r["two Arena(pin=True) in parallel"] = time.perf_counter() - t0
    for x in out:
        x.close()
    return r


def piece_stall(nbytes: int) -> dict[str, Any]:
    """Whether pinning on a background thread holds the stepping thread's CUDA calls up: the longest gap
    between small copy+sync rounds on this thread while another thread makes pinned arenas (the old way:
    register a fresh mapping; the new way: `staging.Arena`, pages populated first)."""
    import threading

    import torch

    from fastrecord import staging

    x = torch.zeros(1 << 20, device="cuda")
    torch.cuda.synchronize()
    r: dict[str, Any] = {}

    def gaps(make: Any) -> dict[str, float]:
        done = threading.Event()
        th = threading.Thread(target=lambda: (make(), done.set()))
        worst, t_prev, t0 = 0.0, time.perf_counter(), time.perf_counter()
        th.start()
        while not done.is_set():
            x.add_(1)
            float(x[0])  # a device-to-host read: waits for the queue, as a step's flags read does
            now = time.perf_counter()
            worst, t_prev = max(worst, now - t_prev), now
        th.join()
        return dict(make=time.perf_counter() - t0, longest_gap=worst)

    def old() -> None:
        mm, buf, fd = _mapping(nbytes)
        _register(buf)
        del buf
        _unmap(mm, fd)

    r["register_fresh (before)"] = gaps(old)
    r["Arena(pin=True) (after)"] = gaps(lambda: staging.Arena(nbytes, pin=True).close())
    return r


def piece_copy(nbytes: int) -> dict[str, Any]:
    import numpy as np
    import torch

    from fastrecord import staging

    src = torch.full((nbytes,), 7, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    r: dict[str, Any] = {}
    pinned = staging.Arena(nbytes + 4096, pin=True)
    fresh = staging.Arena(nbytes + 4096, pin=False)
    warm = staging.Arena(nbytes + 4096, pin=False)
    warm.buffer.fill(0)
    for name, a in (("pinned", pinned), ("unpinned_fresh", fresh), ("unpinned_populated", warm)):
        dst = torch.from_numpy(a.buffer[:nbytes])
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        r[name] = time.perf_counter() - t0
        r[name + "_gb_per_s"] = nbytes / r[name] / 1e9
        assert int(np.asarray(a.buffer[nbytes - 1])) == 7
    for a in (pinned, fresh, warm):
        a.close()
    return r


def piece_yuv(envs: int, steps: int, size: int) -> dict[str, Any]:
    import torch

    r: dict[str, Any] = {}
    buf = torch.randint(0, 255, (steps, envs, size, size, 3), dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    from fastrecord.video import yuv

    part = buf[:, :8].transpose(0, 1)
    t0 = time.perf_counter()
    yuv.rgb_to_yuv420p(part)
    torch.cuda.synchronize()
    r["yuv_first"] = time.perf_counter() - t0
    r["yuv_second"] = _t(lambda: (yuv.rgb_to_yuv420p(part), torch.cuda.synchronize()))
    return r


def piece_encoders(n: int) -> dict[str, Any]:
    from fastrecord.video.pool import EncoderProcessPool

    r: dict[str, Any] = {}
    t0 = time.perf_counter()
    pool = EncoderProcessPool(max_processes=n)
    pool.start(n)
    pool.wait_started()
    r["popen_all"] = time.perf_counter() - t0
    for p in pool._all:
        p.process.call("map_arena.__name__.__len__")  # any call: answered once the process imported its module
    r["all_answered"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    pool.close()
    r["close"] = time.perf_counter() - t0
    return r


def piece_codec() -> dict[str, Any]:
    t0 = time.perf_counter()
    import av  # noqa: F401

    r: dict[str, Any] = {"import_av": time.perf_counter() - t0}
    from fastrecord.video.encode import VideoSettings, check_video_settings, resolve_codec

    t0 = time.perf_counter()
    r["codec"] = resolve_codec("auto")
    r["resolve_auto"] = time.perf_counter() - t0
    r["check_settings"] = _t(lambda: check_video_settings(VideoSettings(codec="auto")))
    return r


def piece_recorder(envs: int, steps: int, size: int, device: str) -> dict[str, Any]:
    """A fresh recorder's first reset (cProfile's top functions) and the wall time of each of its first
    ``2 * steps`` steps (the two first batch ends included), on the bench's batched source."""
    import cProfile
    import tempfile

    import torch

    from benchmarks.profiling import cprofile_top
    from fastrecord import RecordEpisode
    from fastrecord.testing import gradient_clips, make_bank, source_env

    src = source_env(make_bank(gradient_clips(2, steps + 1, size, size), 2), envs, device)
    r: dict[str, Any] = {}
    t0 = time.perf_counter()
    env = RecordEpisode(src, tempfile.mkdtemp(prefix="probe-rec-"), save_trajectory=False)
    r["construct"] = time.perf_counter() - t0
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    env.reset(seed=list(range(envs)))
    prof.disable()
    r["first_reset"] = time.perf_counter() - t0
    r["first_reset_top"] = cprofile_top(prof, 15)
    action = torch.zeros(envs, 3, device=src.device)
    walls = []
    for _ in range(2 * steps):
        t0 = time.perf_counter()
        _, _, term, trunc, _ = env.step(action)
        if bool((term | trunc).all()):
            env.reset(seed=list(range(envs)))
        walls.append(time.perf_counter() - t0)
    r["step_ms"] = [round(1000 * w, 1) for w in walls]
    t0 = time.perf_counter()
    env.recorder.wait_until_done()
    r["drain"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    env.close()
    r["close"] = time.perf_counter() - t0
    return r


def piece_evalclose(envs: int, size: int, render: str) -> dict[str, Any]:
    """`make_eval_envs`' CPU branch (PickCube-v1, every env's video): ``envs.close()`` after 45 steps, split
    into the recorder's close (episodes in progress flushed, encoders drained, files closed) and the vector
    env's (the sub-env processes)."""
    import tempfile

    import gymnasium as gym

    from fastrecord import make_eval_envs
    from fastrecord.recorder import EpisodeRecorder
    from fastrecord.system import use_lavapipe_if_no_gpu

    use_lavapipe_if_no_gpu()
    split: dict[str, float] = {}

    def timed(cls: Any, name: str) -> None:
        orig = getattr(cls, name)

        def f(self: Any, *args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return orig(self, *args, **kwargs)
            finally:
                split[f"{cls.__name__}.{name}"] = time.perf_counter() - t

        setattr(cls, name, f)

    timed(EpisodeRecorder, "close")
    timed(gym.vector.AsyncVectorEnv, "close")
    kw = dict(obs_mode="state", control_mode="pd_joint_delta_pos", render_mode="rgb_array", render_backend=render,
              max_episode_steps=20, human_render_camera_configs=dict(width=size, height=size))
    vec = make_eval_envs("PickCube-v1", envs, "physx_cpu", kw, dict(obs_horizon=2),
                         video_dir=tempfile.mkdtemp(prefix="probe-eval-"))
    vec.reset(seed=0)
    for _ in range(45):
        vec.step(vec.action_space.sample())
    t0 = time.perf_counter()
    vec.close()
    return dict(close=time.perf_counter() - t0, split=split)


def run_piece(name: str, a: argparse.Namespace) -> dict[str, Any]:
    nbytes = a.num_envs * (a.steps + 1) * a.size * a.size * 3 // 2
    if name == "arena":
        return piece_arena(nbytes)
    if name == "evalclose":
        return piece_evalclose(a.eval_envs, a.eval_size, "gpu" if a.device == "cuda" else "cpu")
    if name == "recorder":
        return piece_recorder(a.num_envs, a.steps, a.size, a.device)
    if name == "stall":
        return piece_stall(nbytes)
    if name == "copy":
        return piece_copy(nbytes)
    if name == "yuv":
        return piece_yuv(a.num_envs, a.steps + 1, a.size)
    if name == "encoders":
        return piece_encoders(a.encoders)
    return piece_codec()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--num-envs", type=int, default=128)
    p.add_argument("--size", type=int, default=512)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--encoders", type=int, default=16)
    p.add_argument("--device", default="cuda")
    p.add_argument("--eval-envs", type=int, default=16)
    p.add_argument("--eval-size", type=int, default=512)
    p.add_argument("--pieces", default=",".join(PIECES))
    p.add_argument("--piece", default=None)  # in the child: the one piece to run
    p.add_argument("--json", default=None)
    a = p.parse_args()
    if a.piece:
        print(json.dumps(run_piece(a.piece, a)))
        return
    res: dict[str, Any] = {}
    for name in a.pieces.split(","):
        cmd = [sys.executable, "-m", "benchmarks.probe_coldstart", "--piece", name, "--num-envs", str(a.num_envs),
               "--size", str(a.size), "--steps", str(a.steps), "--encoders", str(a.encoders),
               "--device", a.device, "--eval-envs", str(a.eval_envs), "--eval-size", str(a.eval_size)]
        t0 = time.perf_counter()
        p2 = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if p2.returncode:
            res[name] = {"error": p2.stderr[-2000:]}
        else:
            res[name] = json.loads(p2.stdout.strip().splitlines()[-1])
        res[name]["process_seconds"] = time.perf_counter() - t0
        print(name, json.dumps(res[name]), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
