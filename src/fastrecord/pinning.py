"""Page-locking host memory for CUDA (`cudaHostRegister`), for the staging arenas (`fastrecord.staging`): the pages
faulted in first by several threads (`populate`), then registered, whole or one piece at a time.

Imports only the standard library and numpy at import time (torch lazily): encoder processes import `staging`.
"""

from __future__ import annotations

import os
import threading

import numpy as np

MiB = 1024**2


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


POPULATE_THREADS = 8  # threads that fault an arena's pages in before it is pinned (at most the usable cores)
_POPULATE_MIN_BYTES = 64 * MiB  # smaller arenas are pinned as they are


def populate(buffer: np.ndarray, threads: int | None = None) -> None:
    """Fault every page of ``buffer`` in (writing zeros) from several threads at once. Pinning faults the
    pages of a fresh mapping in one by one on one thread, which is most of its cost (about 0.7 s per GB);
    numpy's fill releases the GIL, so the threads zero their parts in parallel."""
    k = max(1, min(POPULATE_THREADS if threads is None else threads, len(os.sched_getaffinity(0))))
    step = _round_up(-(-buffer.nbytes // k), 4096)
    parts = [buffer[i : i + step] for i in range(0, buffer.nbytes, step)]
    workers = [threading.Thread(target=p.fill, args=(0,), name="fastrecord-populate") for p in parts[1:]]
    for t in workers:
        t.start()
    parts[0].fill(0)
    for t in workers:
        t.join()


def register(buffer: np.ndarray, populate_threads: int | None = None) -> bool:
    """Page-lock ``buffer`` for CUDA (a whole arena, or one piece of it: `fastrecord.staging.Arena.pin_pieces`), its
    pages faulted in by `populate` first where it is large (``populate_threads``: `populate`'s); False where CUDA
    is missing or refuses it (unpinned memory still works, only slower)."""
    try:
        import torch

        if not torch.cuda.is_available():
            return False
        if buffer.nbytes >= _POPULATE_MIN_BYTES:
            populate(buffer, populate_threads)
        err = torch.cuda.cudart().cudaHostRegister(buffer.ctypes.data, buffer.nbytes, 0)
        return int(getattr(err, "value", err)) == 0
    except Exception:  # noqa: BLE001 - unpinned memory still works, only slower
        return False


def unregister(address: int) -> None:
    """Undo `register` of the memory at ``address`` (errors ignored: the mapping goes next)."""
    try:
        import torch

        torch.cuda.cudart().cudaHostUnregister(address)
    except Exception:  # noqa: BLE001
        pass
