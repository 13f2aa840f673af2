"""How a fresh process can have its first staging memory pinned and its encoders answering sooner (issue 27,
item 3: a fresh process at >= 90% of a warm one). Each case runs in a fresh interpreter on the GPU machine:

    PYTHONPATH=src python -m benchmarks.probe_pinning --gib 2.4 --json probe.json

Cases: ``system`` (transparent huge pages for shared memory, reserved huge pages, cores); ``one`` an arena of
``--gib`` populated and pinned as `fastrecord.staging.Arena` does; ``two`` two at once (what the recorder's
first reset asks for); ``pieces`` one mapping populated and registered in ``--piece-mib`` pieces in order (when
the first piece is ready, and the whole); ``huge`` one arena with ``MADV_HUGEPAGE`` (where shmem THP is
``advise``); ``span`` a device-to-host copy into a range that crosses two separately registered pieces (does it
work, at what speed, against a copy inside one piece); ``encoders`` 16 encoder processes started until each
answers, alone, beside two arenas being pinned, and beside them with the encoders at the caller's priority.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

CASES = ("system", "one", "two", "pieces", "huge", "span", "encoders")


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError as e:
        return f"unreadable: {e}"


def case_system(a: argparse.Namespace) -> dict[str, Any]:
    return dict(
        shmem_enabled=_read("/sys/kernel/mm/transparent_hugepage/shmem_enabled"),
        thp_enabled=_read("/sys/kernel/mm/transparent_hugepage/enabled"),
        nr_hugepages=_read("/proc/sys/vm/nr_hugepages"),
        cores=len(os.sched_getaffinity(0)),
        kernel=os.uname().release,
    )


def _cuda() -> Any:
    import torch

    torch.cuda.init()
    torch.empty(1, device="cuda")
    return torch


def _register(torch: Any, addr: int, nbytes: int) -> None:
    err = torch.cuda.cudart().cudaHostRegister(addr, nbytes, 0)
    assert int(getattr(err, "value", err)) == 0, err


def case_one(a: argparse.Namespace, count: int = 1) -> dict[str, Any]:
    _cuda()
    from fastrecord.staging import Arena

    size = int(a.gib * 2**30)
    done: list[float] = []
    t0 = time.perf_counter()

    def make() -> None:
        arena = Arena(size, pin=True)
        assert arena.pinned
        done.append(time.perf_counter() - t0)

    threads = [threading.Thread(target=make) for _ in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return dict(count=count, ready_s=sorted(round(d, 3) for d in done))


def _mapping(size: int) -> tuple[Any, Any]:
    import numpy as np

    fd = os.memfd_create("probe", os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    return mm, np.frombuffer(mm, dtype=np.uint8)


def case_pieces(a: argparse.Namespace) -> dict[str, Any]:
    torch = _cuda()
    from fastrecord.staging import populate

    size = int(a.gib * 2**30) // 2**20 * 2**20
    piece = a.piece_mib * 2**20
    mm, buf = _mapping(size)
    t0 = time.perf_counter()
    ready = []
    for lo in range(0, size, piece):
        part = buf[lo:lo + piece]
        populate(part)
        _register(torch, part.ctypes.data, part.nbytes)
        ready.append(round(time.perf_counter() - t0, 3))
    return dict(piece_mib=a.piece_mib, pieces=len(ready), first_s=ready[0], all_s=ready[-1],
                every=ready[:: max(1, len(ready) // 8)])


def case_huge(a: argparse.Namespace) -> dict[str, Any]:
    torch = _cuda()
    from fastrecord.staging import populate

    size = int(a.gib * 2**30) // (2 * 2**20) * 2 * 2**20
    mm, buf = _mapping(size)
    advised = True
    try:
        mm.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError) as e:
        advised = f"{type(e).__name__}: {e}"
    t0 = time.perf_counter()
    populate(buf)
    t1 = time.perf_counter()
    _register(torch, buf.ctypes.data, buf.nbytes)
    t2 = time.perf_counter()
    huge_kb = None
    for line in _read("/proc/meminfo").splitlines():
        if line.startswith("ShmemHugePages"):
            huge_kb = line.split()[1]
    return dict(advised=advised, populate_s=round(t1 - t0, 3), register_s=round(t2 - t1, 3), shmem_huge_kb=huge_kb)


def case_span(a: argparse.Namespace) -> dict[str, Any]:
    torch = _cuda()
    from fastrecord.staging import populate

    piece = 256 * 2**20
    mm, buf = _mapping(2 * piece)
    populate(buf)
    _register(torch, buf[:piece].ctypes.data, piece)
    _register(torch, buf[piece:].ctypes.data, piece)
    n = 128 * 2**20
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
    out: dict[str, Any] = {}
    for name, lo in (("inside", 0), ("across", piece - n // 2)):
        dst = torch.from_numpy(buf[lo:lo + n])
        best = 1e9
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        ok = bool(torch.equal(dst[:: 4096].cuda(), src[:: 4096]))
        out[name] = dict(gb_s=round(n / best / 1e9, 1), equal=ok)
    return out


def case_encoders(a: argparse.Namespace) -> dict[str, Any]:
    from fastrecord.video.pool import EncoderProcessPool

    pinning = a.with_pinning
    t0 = time.perf_counter()
    threads = []
    if pinning:
        _cuda()
        from fastrecord.staging import Arena

        t0 = time.perf_counter()
        threads = [threading.Thread(target=Arena, args=(int(a.gib * 2**30), True)) for _ in range(2)]
        for t in threads:
            t.start()
    pool = EncoderProcessPool()
    pool.start(16)
    pool.wait_started()
    encs = list(pool._all)
    for e in encs:
        e.ready.wait(30)
    t_ready = time.perf_counter() - t0
    for t in threads:
        t.join()
    t_pinned = time.perf_counter() - t0
    pool.close()
    return dict(with_pinning=pinning, nice=os.environ.get("FASTRECORD_BACKGROUND_NICE", "default"),
                all_answered_s=round(t_ready, 3), arenas_pinned_s=round(t_pinned, 3) if pinning else None)


def run(name: str, a: argparse.Namespace) -> dict[str, Any]:
    if name == "two":
        return case_one(a, 2)
    return globals()[f"case_{name}"](a)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=2.4)
    p.add_argument("--piece-mib", type=int, default=256)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--case", default=None)  # in the child
    p.add_argument("--with-pinning", action="store_true")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    if a.case:
        print(json.dumps(run(a.case, a)))
        return
    results: dict[str, Any] = {}
    jobs: list[tuple[str, list[str], dict[str, str]]] = []
    for name in a.cases.split(","):
        base = [sys.executable, "-m", "benchmarks.probe_pinning", "--case", name, "--gib", str(a.gib),
                "--piece-mib", str(a.piece_mib)]
        if name == "encoders":
            jobs += [("encoders_alone", base, {}), ("encoders_beside_pinning", [*base, "--with-pinning"], {}),
                     ("encoders_beside_pinning_nice0", [*base, "--with-pinning"], {"FASTRECORD_BACKGROUND_NICE": "0"})]
        elif name == "pieces":
            jobs += [("pieces_256", base, {}),
                     ("pieces_64", [*base[:-1], "64"], {})]
        else:
            jobs.append((name, base, {}))
    for label, cmd, extra in jobs:
        t0 = time.perf_counter()
        p2 = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, **extra})
        lines = [ln for ln in p2.stdout.splitlines() if ln.startswith("{")]
        results[label] = json.loads(lines[-1]) if lines and p2.returncode == 0 else dict(
            error=p2.stderr[-1500:], returncode=p2.returncode)
        results[label]["process_s"] = round(time.perf_counter() - t0, 2)
        print(label, json.dumps(results[label]), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
