"""WorkerPool: bounded queue, ordered single worker, errors re-raised in the caller, idempotent close."""

from __future__ import annotations

import threading
import time

import pytest

from fastrecord.workers import WorkerError, WorkerPool


def test_runs_every_job_in_order_with_one_worker():
    seen = []
    with WorkerPool(seen.append, num_workers=1, max_pending=2) as pool:
        for i in range(50):
            pool.submit(i)
    assert seen == list(range(50))


def test_backpressure_blocks_the_producer_instead_of_dropping():
    gate = threading.Event()
    done = []

    def slow(job):
        gate.wait()
        done.append(job)

    pool = WorkerPool(slow, num_workers=1, max_pending=2)
    pool.submit(0)  # taken by the worker, which waits at the gate
    time.sleep(0.05)
    pool.submit(1)
    pool.submit(2)  # queue full now
    t = threading.Thread(target=pool.submit, args=(3,))
    t.start()
    t.join(timeout=0.2)
    assert t.is_alive()  # the producer waits
    gate.set()
    t.join(timeout=5)
    pool.close()
    assert sorted(done) == [0, 1, 2, 3]


def test_errors_are_raised_in_the_caller():
    def fail_on_3(job):
        if job == 3:
            raise KeyError("bad job 3")

    pool = WorkerPool(fail_on_3, num_workers=2, max_pending=4)
    for i in range(5):
        pool.submit(i)
    with pytest.raises(WorkerError, match="KeyError: 'bad job 3'") as info:
        pool.wait_until_done()
    assert isinstance(info.value.__cause__, KeyError)
    with pytest.raises(WorkerError):
        pool.submit(6)
    with pytest.raises(WorkerError):
        pool.close()
    pool.close()  # idempotent: nothing more to raise


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_workers=0 must be >= 1"):
        WorkerPool(print, num_workers=0)


def test_backpressure_wait_is_counted():
    def slow(job):
        time.sleep(0.05)

    with WorkerPool(slow, num_workers=1, max_pending=1) as pool:
        for i in range(4):
            pool.submit(i)
        pool.wait_until_done()
        assert pool.blocked_seconds > 0.03
