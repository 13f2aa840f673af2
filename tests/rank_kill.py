"""``python -m fastrecord`` for torchrun in tests, with one rank killed at a chosen point (deterministic).

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/rank_kill.py record ...

The rank ``KILL_RANK`` (an environment variable) kills itself with SIGKILL (no cleanup; its helper processes
left as a crash leaves them) as soon as its first episode is committed (its row in the results file: every
output holds it), blocking its stepping thread until then, so that it holds 1 episode however loaded the
machine is. Other ranks, and every rank without ``KILL_RANK``, run the command unchanged.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "src"))  # this checkout's fastrecord


def kill_after_first_commit() -> None:
    from fastrecord.sinks.results import ResultsSink

    original = ResultsSink.episodes_ended

    def episodes_ended(self: ResultsSink, ended: list) -> None:
        original(self, ended)
        if any(ev.episode_id is not None for ev in ended):
            while self.run.committed < 1:  # the HDF5 writers publish in the background
                time.sleep(0.005)
                self._drain()
            os.kill(os.getpid(), signal.SIGKILL)

    ResultsSink.episodes_ended = episodes_ended  # type: ignore[method-assign]


if __name__ == "__main__":
    if os.environ.get("KILL_RANK") is not None and os.environ.get("KILL_RANK") == os.environ.get("RANK"):
        kill_after_first_commit()
    from fastrecord.commands.cli import entry

    entry()  # reads sys.argv, as python -m fastrecord does
