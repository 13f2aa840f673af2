"""fastrecord's benchmarks (`fastrecord bench`): recording throughput against ManiSkill's RecordEpisode, in one run, on the same frames.

Examples:
    fastrecord bench                                        # CPU-sized run: 8 envs x 64x64, 10-step episodes
    fastrecord bench --config configs/bench_h200.yaml       # the README's table: 128 envs x 512x512 on a GPU
    fastrecord bench --num-envs 32 --skip maniskill,realenv --json bench.json

Frames come from a batched source env (`fastrecord.testing.BatchedDoubleEnv` with a clip ``bank``:
ManiSkill's batched-env contract, frames on the device, one gather a render) that replays clips rendered
by a real ManiSkill task (``content: maniskill``) or synthetic gradients (``content: gradient``), so both
recorders see identical frames and the source costs almost nothing. Phases (each can be skipped with ``--skip``):

  ceiling   one encoder process's frames/s (x workers = the ceiling), and all workers measured together
  quality   PSNR against the source frames and parallel frames/s for each ``sweep`` setting
  maniskill ManiSkill's RecordEpisode video path (to_numpy + tile_images every step, one tiled video)
  fastrecord  fastrecord.RecordEpisode (device ring buffer + per-env MP4) flat out: env-frames/s, the
            stepping thread's own time per step, memory per batch (flat?), dropped frames, PSNR
  keepup    the same with a simulated step time so encoders keep up: bare loop vs recorded loop
  realenv   a real ManiSkill env (CPU simulation, GPU rendering where CUDA is present): bare vs recorded
  micro     device time of the ring write and of the yuv420p conversion
  staggered per-env episode lengths drawn by the env, partial resets of the finished envs
  coldstart fresh processes recording their first episodes: set-up seconds, rate from construction, close, memory
  cpueval   make_eval_envs' CPU branch: videos with and without the overlay beside a step+render loop
  imageobs  trajectories with rgb observations, no video: fastrecord beside ManiSkill's wrapper, on an idle
            machine and beside ``imageobs_busy_cores`` spinning processes (a busy one)

Output: a readable table on stdout and everything in JSON (``--json``).

This folder lives in the source checkout, outside the installed package; ``fastrecord bench`` finds it
there. Without the command: ``PYTHONPATH=src python -m benchmarks.bench --config configs/bench_cpu.yaml``.
Modules: `benchmarks.config` (BenchConfig and the flags), `benchmarks.bench` (runner and table),
`benchmarks.phases_encode` (ceiling, quality, micro), `benchmarks.phases_record` (maniskill, fastrecord,
keepup), `benchmarks.phases_realenv`, `benchmarks.paths` (staggered, coldstart, cpueval),
`benchmarks.imageobs`, `benchmarks.memory` and `benchmarks.profiling` (probes), `benchmarks.load` (a
competing CPU load). Scripts beside them:
``profile_step.py`` (the recorder's per-step cost), ``bench_whole.py`` (whole commands launch to exit, record,
eval and replay against ManiSkill's ways, with where the seconds go; its jobs in ``whole_children.py``),
``probe_startup.py`` (one env's start against N env processes'), ``probe_coldstart.py`` (a fresh
recording process's pieces: pinning, the first conversion, encoders, close), ``bench_replay.py`` (replay speed against
ManiSkill's tool), ``bench_shards.py`` (torchrun world sizes), ``bench_gpu.sh`` (a run on the GPU machine).
"""
