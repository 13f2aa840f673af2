"""How a replay spreads its episodes over envs and processes when the caller does not say.

Imports neither torch nor ManiSkill: the CLI reads these numbers to guess, before its own heavy imports,
whether a replay will fork processes (`fastrecord.commands.cli`), and `ReplayConfig`'s help texts name them.
"""

from __future__ import annotations

MANY_CORES = 8  # from this many cores on, a replay of CPU-simulated envs runs several worker processes by default
ENVS_PER_WORKER = 4  # envs one process holds (their renders submitted together); more go to sub-processes of one env
# sub-envs a process steps where a replay draws them in one process (`fastrecord.replay.mirrored`, --vector async): a
# replay step's physics is light (run ahead while the group draws), and fewer processes make their envs sooner: on the
# H100 (2026-12-06, profile_replay, 96 episodes, 16 envs) four a process started 1.2 s sooner than two and looped in
# 7.03 s against 7.61 s; 16 envs in 4 processes made in 2.95 s against 8.4 s in 16 (probe_make_contention)
SUBENVS_PER_PROCESS = 4
GPU_DEFAULT_ENVS = 64  # episodes replayed side by side in GPU simulation unless num_envs says otherwise


def subenvs_per_process(num_envs: int) -> int:
    """Sub-envs a process steps where a replay draws ``num_envs`` envs in one process: at most
    `SUBENVS_PER_PROCESS`, over the fewest processes that takes, as many to each as keeps the last from being nearly
    empty where one number can (5 envs: 3 and 2, not 4 and 1; `fastrecord.packed.process_sizes` fills the others
    first)."""
    processes = -(-num_envs // SUBENVS_PER_PROCESS)
    return max(1, -(-num_envs // max(1, processes)))


def default_workers(num_envs: int | None, episodes: int, gpu_sim: bool, gpu_render: bool = False) -> int:
    """The number of worker processes of a replay whose ``workers`` option is not given.

    CPU simulation on a machine of ``MANY_CORES`` cores or more: the envs (``num_envs``, None: one per
    core) split into workers of ``ENVS_PER_WORKER`` envs where they render on a GPU, else one env per
    worker; at most one worker per core and one per episode. Each worker steps, renders and records its
    envs in its own process, and no observation crosses a process boundary before the HDF5 writer.
    Measured on a 16-core machine with one GPU (96 PickCube episodes, 16 envs): 4 workers of 4 envs
    21.7-26.0 s, 8 of 2 21.9-23.0 s, 16 of 1 26.1 s, 2 of 8 25.3 s, one process 34.9-39.2 s; fewer
    processes also start their envs sooner (16 processes making envs together: 6-10 s; 4: 3 s). On the
    CPU (lavapipe renders each env with the cores it finds) one env per worker. Fewer cores (where every
    process competes for the same one or two), GPU simulation (one batched env already runs every env in
    one process, on one GPU) or under torchrun (the ranks are the workers): one process.
    Cores are the usable ones (`fastrecord.options.usable_cores`: the affinity mask's, shared by torchrun's
    ranks on the host), not every core of the machine.
    """
    from fastrecord.options import usable_cores

    cores = usable_cores()
    if gpu_sim or cores < MANY_CORES:
        return 1
    per_worker = ENVS_PER_WORKER if gpu_render else 1
    return max(1, min(-(-(num_envs or cores) // per_worker), cores, episodes))
