"""What deferring the unused imports (`fastrecord.deferred`) saves a fresh process, and a whole command.

Two measurements, each alternating the two ways in fresh interpreters (the order flips every repetition; whole-process
times move by tens of percent between runs on shared machines, so compare the medians of one run):

1. ``import torch, sapien, mani_skill.envs, av``: as Python does it, and after ``fastrecord.deferred.install()``.
2. The whole ``fastrecord`` command, launch to exit (default: the README's main job, ``fastrecord record PickCube-v1``,
   into a temporary folder), with ``FASTRECORD_DEFER_IMPORTS=0`` and as a user gets it.

    python -m benchmarks.probe_deferred --reps 5
    python -m benchmarks.probe_deferred --reps 3 --skip-command --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

IMPORTS = "import torch, sapien, mani_skill.envs, av"
CHILD = (
    "import time; t = time.perf_counter()\n"
    "{install}"
    f"{IMPORTS}\n"
    "import sys; from fastrecord.deferred import is_deferred\n"
    "left = sorted(m for m in ('matplotlib.pyplot', 'requests') if is_deferred(sys.modules.get(m)))\n"
    "print(f'{{time.perf_counter() - t:.3f}} {{\",\".join(left) or \"-\"}}')\n"
)
WAYS = {"python": "", "deferred": "from fastrecord.deferred import install; install()\n"}
COMMAND = ["record", "PickCube-v1"]  # the README's main job


def time_imports(way: str) -> tuple[float, str]:
    out = subprocess.run([sys.executable, "-c", CHILD.format(install=WAYS[way])], capture_output=True, text=True,
                         check=True).stdout.split()
    return float(out[0]), out[1]


def import_profile(way: str) -> dict[str, float]:
    """``-X importtime``'s self times of one fresh import, summed by top-level package (seconds)."""
    err = subprocess.run([sys.executable, "-X", "importtime", "-c", CHILD.format(install=WAYS[way])],
                         capture_output=True, text=True, check=True).stderr
    by_package: dict[str, float] = {}
    for line in err.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        own, _, name = line.split(":", 1)[1].split("|")
        package = name.strip().split(".")[0]
        by_package[package] = by_package.get(package, 0.0) + int(own) / 1e6
    return by_package


def time_command(way: str, args: list[str]) -> float:
    env = dict(os.environ)
    if way == "python":
        env["FASTRECORD_DEFER_IMPORTS"] = "0"
    out = tempfile.mkdtemp(prefix="probe-deferred-")
    try:
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "fastrecord", *args, "--output-dir", out], env=env, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return time.perf_counter() - t
    finally:
        shutil.rmtree(out, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--skip-command", action="store_true", help="time the imports only")
    p.add_argument("--command", default=" ".join(COMMAND), help="the fastrecord command timed whole (no --output-dir)")
    p.add_argument("--importtime", action="store_true",
                   help="also print each way's -X importtime self seconds by package (one import each)")
    p.add_argument("--json", help="write the samples here")
    a = p.parse_args()
    samples: dict[str, dict[str, list[float]]] = {"imports": {w: [] for w in WAYS}, "command": {w: [] for w in WAYS}}
    order = list(WAYS)
    for rep in range(a.reps):
        for way in order if rep % 2 == 0 else order[::-1]:
            seconds, left = time_imports(way)
            samples["imports"][way].append(seconds)
            print(f"imports  rep {rep} {way:9s} {seconds:6.2f} s  deferred after the imports: {left}", flush=True)
    if a.importtime:
        profiles = {way: import_profile(way) for way in order}
        packages = sorted(set().union(*profiles.values()), key=lambda k: -max(pr.get(k, 0.0) for pr in profiles.values()))
        print("-X importtime self seconds by package: " + " | ".join(f"{w} {sum(pr.values()):.2f} total"
                                                                   for w, pr in profiles.items()))
        for package in packages[:25]:
            print(f"  {package:24s} " + "  ".join(f"{w} {profiles[w].get(package, 0.0):6.3f}" for w in order))
    if not a.skip_command:
        for rep in range(a.reps):
            for way in order if rep % 2 == 0 else order[::-1]:
                seconds = time_command(way, a.command.split())
                samples["command"][way].append(seconds)
                print(f"command  rep {rep} {way:9s} {seconds:6.2f} s  fastrecord {a.command}", flush=True)
    for what, ways in samples.items():
        if not ways["python"]:
            continue
        py, de = statistics.median(ways["python"]), statistics.median(ways["deferred"])
        print(f"{what:8s} median: as Python imports {py:.2f} s, deferred {de:.2f} s: {py - de:+.2f} s saved "
              f"({de / py:.2f}x the time)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(samples, f, indent=1)


if __name__ == "__main__":
    main()
