"""Where a replay worker's recorder start goes on the GPU machine (issue 27).

On the H100 (2026-12-07 09:45) each of the default replay's 4 workers took 1.7-1.9 s from its envs made
(``vector_env_made``) to its recorder made (``recorder_made``); on the 2-core CPU machine 0.05 s. This runs what a
worker runs, `fastrecord replay IN --workers 1 --vector sync --num-envs 4 --obs-mode rgb --no-video` (4 PickCube-v1
envs drawn in one group on the GPU), in ``--procs`` processes at once (4: as the workers), each with the recorder's
construction profiled (cProfile, its top entries by cumulative time) and where torch's CUDA is first initialised
(its stack; not its duration):

    python benchmarks/probe_recorder_start.py --procs 4
"""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def child(traj: str, out: str) -> None:
    """One replay in this process, its recorder's construction profiled."""
    import cProfile
    import pstats
    import traceback

    t0 = time.perf_counter()
    import torch

    import fastrecord.record as record

    real_init = torch.cuda._lazy_init
    reported = []

    def lazy_init() -> None:
        # where torch's CUDA is first initialised, once: this patch sees the calls made through the module attribute
        # (torch's own nested ones), not callers that imported `_lazy_init` by name, so it times nothing
        if not torch.cuda.is_initialized() and not reported:
            reported.append(True)
            print(f"[{os.getpid()}] torch's CUDA being initialised at +{time.perf_counter() - t0:.2f} s, under:\n"
                  + "".join(traceback.format_stack(limit=14)[:-1]), flush=True)
        return real_init()

    torch.cuda._lazy_init = lazy_init
    real = record.RecordVectorEpisode.__init__

    def profiled(self, *args, **kwargs) -> None:
        prof = cProfile.Profile()
        t = time.perf_counter()
        prof.enable()
        try:
            real(self, *args, **kwargs)
        finally:
            prof.disable()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(28)
            print(f"[{os.getpid()}] the recorder made at +{t - t0:.2f} s in {time.perf_counter() - t:.2f} s\n"
                  + text.getvalue()[:7000], flush=True)

    record.RecordVectorEpisode.__init__ = profiled
    from fastrecord.commands.cli import main

    main(["replay", traj, "--workers", "1", "--vector", "sync", "--num-envs", "4", "--obs-mode", "rgb", "--no-video",
          "--output-dir", out, "--quiet"])
    print(f"[{os.getpid()}] replay done at +{time.perf_counter() - t0:.2f} s", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--procs", type=int, default=4)
    p.add_argument("--child", nargs=2, metavar=("TRAJ", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(*args.child)
        return
    work = Path(tempfile.mkdtemp(prefix="probe_recorder_"))
    for where in (work, Path.cwd()):  # what one fsync of a small new file costs on this disk (the run files sync)
        t = time.perf_counter()
        for i in range(10):
            with open(where / f".fsync_probe_{i}", "wb") as f:
                f.write(b"x" * 4096)
                f.flush()
                os.fsync(f.fileno())
            os.unlink(where / f".fsync_probe_{i}")
        print(f"fsync of a 4 KiB file in {where}: {(time.perf_counter() - t) * 100:.1f} ms each (10)", flush=True)
    subprocess.run([sys.executable, "-m", "fastrecord", "record", "PickCube-v1", "--num-envs", "1", "--episodes", "8",
                    "--max-episode-steps", "20", "--no-video", "--output-dir", str(work / "in")],
                   check=True, stdout=subprocess.DEVNULL)
    procs = [subprocess.Popen([sys.executable, __file__, "--child", str(work / "in" / "trajectory.h5"),
                               str(work / f"out{i}")]) for i in range(args.procs)]
    for proc in procs:
        proc.wait()


if __name__ == "__main__":
    main()
