"""Video encodings for a LeRobot dataset: encode speed, file size, quality and random-access decoding.

Training reads random frames: LeRobot's loader opens the episode's video file at each item, seeks to the
key frame before the frame's timestamp and decodes forward to it (``decode_video_frames_torchvision`` with
pyav; torchcodec does the same seek-and-decode in C++). The keyframe interval (GOP) bounds that work. This
script encodes the same frames (a ManiSkill PickCube-v1 sensor camera, a seeded random policy, episodes
joined into one file as fastrecord's dataset files are) with each encoding, and prints per encoding:

- encode frames/s (one encoder thread, as fastrecord's encoder processes run one per core),
- bytes per frame, PSNR against the rendered frames,
- random-access decoding, pyav the way LeRobot's pyav backend reads (open, seek to the key frame at or
  before the timestamp, decode forward to it, every decoded frame converted to RGB), and with a decoder
  kept open and only the asked frame converted (the work torchcodec does behind LeRobot's decoder cache;
  torchcodec's own wheels need CUDA's libnvrtc, absent on the machine this was written on): frames/s and
  the time per frame relative to LeRobot's own default encoding (libsvtav1, crf 30, g=2, preset 12, yuv420p).

    python benchmarks/bench_lerobot_video.py                      # 256x256, 4 episodes of 50 steps (~1 min)
    python benchmarks/bench_lerobot_video.py --size 512 --queries 300
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import av
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from fastrecord.system import use_lavapipe_if_no_gpu

use_lavapipe_if_no_gpu()  # before SAPIEN creates a renderer

from fastrecord.sinks.lerobot.video import concat_mp4  # noqa: E402
from fastrecord.testing import psnr  # noqa: E402
from fastrecord.video import VideoSettings  # noqa: E402
from fastrecord.video.encode import encode_here  # noqa: E402

# (label, settings): LeRobot's default first (the reference of the ratios)
ENCODINGS = [
    ("libsvtav1 crf30 g2 (LeRobot's default)", VideoSettings(codec="libsvtav1", crf=30, gop=2, preset="12")),
    ("libx264 ultrafast crf23 (no g: 250)", VideoSettings(codec="libx264", crf=23)),
    ("libx264 ultrafast crf23 g2", VideoSettings(codec="libx264", crf=23, gop=2)),
    ("libx264 ultrafast crf23 g5", VideoSettings(codec="libx264", crf=23, gop=5)),
    ("libx264 ultrafast crf23 g10", VideoSettings(codec="libx264", crf=23, gop=10)),
    ("libx264 veryfast crf23 g2", VideoSettings(codec="libx264", crf=23, gop=2, preset="veryfast")),
]


def render_episodes(size: int, episodes: int, steps: int) -> list[np.ndarray]:
    """``episodes`` episodes of ``steps`` sensor frames [T, size, size, 3] of PickCube-v1 (CPU, lavapipe)."""
    import gymnasium as gym
    import mani_skill.envs  # noqa: F401 - registers the tasks

    env = gym.make("PickCube-v1", obs_mode="rgb", sim_backend="physx_cpu", sensor_configs=dict(width=size, height=size))
    out = []
    for ep in range(episodes):
        obs, _ = env.reset(seed=ep)
        frames = []
        for _ in range(steps):
            frames.append(np.asarray(obs["sensor_data"]["base_camera"]["rgb"])[0])
            obs, *_ = env.step(env.action_space.sample())
        out.append(np.stack(frames).astype(np.uint8))
    env.close()
    return out


def random_access(path: Path, times: list[float]) -> tuple[float, list[np.ndarray]]:
    """Seconds to read one frame at each of ``times`` as LeRobot's pyav backend does (a new reader per
    item, every decoded frame converted to RGB), and the frames."""
    got = []
    t0 = time.perf_counter()
    for ts in times:
        with av.open(str(path)) as c:
            stream = c.streams.video[0]
            c.seek(int(ts / stream.time_base), stream=stream, backward=True, any_frame=False)
            for frame in c.decode(stream):
                img = frame.to_ndarray(format="rgb24")
                if frame.time >= ts - 1e-4:
                    got.append(img)
                    break
    return time.perf_counter() - t0, got


def cached_access(path: Path, times: list[float]) -> float:
    """Seconds to read one frame at each of ``times`` the way torchcodec does it for LeRobot (a decoder kept
    open across items, LeRobot's decoder cache; seek to the key frame, decode forward, only the asked frame
    converted to RGB): the decode work a keyframe interval sets, without the per-item open."""
    t0 = time.perf_counter()
    with av.open(str(path)) as c:
        stream = c.streams.video[0]
        for ts in times:
            c.seek(int(ts / stream.time_base), stream=stream, backward=True, any_frame=False)
            for frame in c.decode(stream):
                if frame.time >= ts - 1e-4:
                    frame.to_ndarray(format="rgb24")
                    break
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=int, default=256)
    p.add_argument("--episodes", type=int, default=4)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--queries", type=int, default=200, help="random frames read per encoding")
    p.add_argument("--fps", type=int, default=20)
    args = p.parse_args()
    eps = render_episodes(args.size, args.episodes, args.steps)
    every = np.concatenate(eps)
    rng = random.Random(0)
    picks = [rng.randrange(len(every)) for _ in range(args.queries)]
    print(f"{len(eps)} episodes x {args.steps} frames, {args.size}x{args.size}, {args.queries} random frames read\n")
    print(f"{'encoding':40s} {'encode f/s':>10s} {'KiB/frame':>9s} {'PSNR':>5s} {'pyav f/s':>8s} "
          f"{'time vs LeRobot':>15s}"
          f" {'cached f/s':>10s} {'time vs LeRobot':>15s}")
    ref = ref_cached = None
    with tempfile.TemporaryDirectory() as tmp:
        for label, s in ENCODINGS:
            s = VideoSettings(**{**s.__dict__, "fps": args.fps})
            folder = Path(tmp) / label.split()[0] / str(s.gop) / s.preset
            folder.mkdir(parents=True)
            t0 = time.perf_counter()
            parts = [encode_here(folder / f"ep{i}.mp4", e, s, "rgb24") for i, e in enumerate(eps)]
            enc = len(every) / (time.perf_counter() - t0)
            joined = folder / "file-000.mp4"
            concat_mp4(parts, joined)
            size = joined.stat().st_size / len(every) / 1024
            seconds, frames = random_access(joined, [i / args.fps for i in picks])
            quality = psnr(np.stack(frames), every[picks])
            rate = len(picks) / seconds
            cached = len(picks) / cached_access(joined, [i / args.fps for i in picks])
            ref, ref_cached = ref or rate, ref_cached or cached
            print(f"{label:40s} {enc:10.0f} {size:9.2f} {quality:5.1f} {rate:8.0f} {ref / rate:14.2f}x {cached:10.0f} "
                  f"{ref_cached / cached:14.2f}x", flush=True)


if __name__ == "__main__":
    main()
