"""Per-episode results of a run: ``NAME.results.jsonl``, one row per finished episode, and its summary.

Every recorder writes it (the wrapper, ``make_eval_envs``, ``fastrecord record`` and ``replay``), also
when it keeps no trajectory and only some videos: an evaluation wants its failures counted too. A row::

    {"episode_id": 3, "env_idx": 1, "seed": 7, "success": true, "success_once": true, "terminated": true,
     "truncated": false, "length": 42, "return": 0.0, "video": "3_env1_success.mp4"}

``episode_id`` is the id in ``NAME.h5``/``NAME.json`` and in the video name (null: not kept);
``success`` is the flag at the last step (null if the env reports none), ``success_once`` at any step;
``terminated``/``truncated`` are the last step's flags (both false: the episode was ended from outside,
e.g. in progress at ``close()``); ``return`` is the sum of the rewards; ``video`` is the path relative to
the output folder (the first piece with ``max_steps_per_video``; null: no video). The file is strict
JSON: a NaN or infinite value (a ``return`` of NaN rewards) is written as null, and the row then has
``"non_finite": ["return"]`` naming the fields.

Rows are appended in the order episodes finish, each flushed at once, so a crash keeps the rows so far.
A kept episode's row is written once every output holds it for good (`Sink.committed`: its HDF5 part
listed, its videos on disk (their actual names: a taken name gets ``_1``), its LeRobot part committed):
the row is the episode's commit, and the rows of a run are its commit log. A resumed run keeps exactly
the episodes with a row and discards the rest from every output (`fastrecord.sinks.reconcile`); a row
of an episode that is not kept is written once the kept ones before it are.
`wilson_interval` and `summary_lines` make the printed summary of ``record``, ``replay`` and
``scripts/evaluate.py``.
"""

from __future__ import annotations

import json
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from fastrecord.episode import EpisodeData, EpisodeEnded
from fastrecord.sinks.base import RESULTS_SUFFIX, RunDirectory, Sink
from fastrecord.sinks.runfiles import append_line

if TYPE_CHECKING:
    from fastrecord.sinks.mp4 import Mp4Sink

Z95 = 1.959963984540054  # the standard normal's 97.5% quantile: a two-sided 95% interval


class ResultsSink(Sink):
    """Owns: ``NAME.results.jsonl`` (append-only), the rows of this run (`rows`) and the queue of rows
    waiting for their video.

    A row is made from every `EpisodeEnded` (``episodes_ended``: kept or not); a kept episode's ``video``
    is the file the video sink (``videos``, an `Mp4Sink`, or None) wrote for it. It is the recorder's
    last sink, so the videos are done before its own ``wait_until_done``/``close`` write the last rows.
    """

    wants_frames = False
    wants_datasets = False

    def __init__(self, videos: Mp4Sink | None = None, outputs: Sequence[Sink] = ()) -> None:
        self.videos = videos
        self.outputs = list(outputs)  # the sinks whose commit a kept episode's row waits for (videos among them)
        self.rows: list[dict[str, Any]] = []  # every row of this run, in finish order (written or waiting)
        self.path: Path | None = None
        self._file: Any = None
        self._waiting: deque[tuple[dict[str, Any], str | None]] = deque()  # (row, video name it waits for)

    def open(self, run: RunDirectory) -> None:
        super().open(run)
        self.path = run.path(RESULTS_SUFFIX)
        # resume: rows go on after the earlier run's; unbuffered, each row one write (`_append`)
        self._file = open(self.path, "ab", buffering=0)  # noqa: SIM115 (open for the sink's life; close closes)
        run.add_file(self.path)

    def submit(self, episodes: Sequence[EpisodeData]) -> None:
        pass  # rows come from `episodes_ended`, which sees the episodes that are not kept too

    def episodes_ended(self, ended: Sequence[EpisodeEnded]) -> None:
        for ev in ended:
            row = results_row(ev)
            video = None
            if ev.episode_id is not None and self.videos is not None:  # kept
                video = self.videos.take_video_name(ev.episode_id)
            self.rows.append(row)
            self._waiting.append((row, video))
        self._drain()

    # -------------------------------------------------------------- writing
    def _drain(self, final: bool = False, wait: bool | None = None) -> None:
        """Write the rows of the episodes every output has committed, in finish order, up to the first
        that is not (``final``: the rows after it are dropped, and so are their episodes: a resumed run
        records them again). When the commit log advanced, every output's ``after_commit`` (``wait``: by default
        ``final``, i.e. from ``wait_until_done``/``close``)."""
        wait = final if wait is None else wait
        committed = None
        errors: list[BaseException] = []
        while self._waiting:
            row, video = self._waiting[0]
            eid = row.get("episode_id")
            if eid is not None:
                if not all(s.committed(eid) for s in self.outputs):
                    break
                if video is not None:
                    assert self.videos is not None  # the name came from self.videos
                    path = self.videos.written(video)
                    row["video"] = None if path is None else path.name
                committed = eid + 1
            self._append(row)
            self._waiting.popleft()
        if final and self._waiting:
            self._waiting.clear()
        if committed is not None:
            self.run.committed = committed
            self.run.set_counter("episodes", committed)
            for s in self.outputs:  # every output hears of it, even after another one failed; the first error
                try:
                    s.after_commit(committed, wait=wait)
                except BaseException as e:  # noqa: BLE001 - raised below, once each output heard
                    errors.append(e)
        if errors:
            raise errors[0]

    def _append(self, row: dict[str, Any]) -> None:
        """Append ``row`` as one line (`runfiles.append_line`): a write that fails part way (a full disk) is undone,
        so the next drain writes the row once (a row twice would end the commit log there)."""
        append_line(self._file, (json.dumps(row, allow_nan=False) + "\n").encode())

    def raise_if_failed(self) -> None:
        if self._waiting and self._file is not None and not self._file.closed:
            self._drain()

    def wait_until_done(self) -> None:
        # the recorder waits for its sinks in order: the other outputs are done by now
        if self._file is not None and not self._file.closed:
            self._drain(final=True)

    def commit_before_close(self) -> None:
        """The recorder's close, after every other sink's ``wait_until_done``: the last rows written, and
        the outputs told with ``wait=False``: they finish their files in their own ``close`` (LeRobot's last
        file group), which the recorder runs side by side (`fastrecord.recorder.EpisodeRecorder.close`)."""
        if self._file is not None and not self._file.closed:
            self._drain(final=True, wait=False)

    def close(self) -> None:
        if self._file is not None and not self._file.closed:
            self._drain(final=True)
            self._file.close()


def results_row(ev: EpisodeEnded) -> dict[str, Any]:
    """The results row of a finished episode (``video`` still None), strict JSON (`finite_row`)."""
    row = dict(episode_id=ev.episode_id, env_idx=ev.env_idx, seed=ev.seed, success=ev.success,
               success_once=ev.success_once, terminated=ev.terminated, truncated=ev.truncated, length=ev.length,
               **{"return": float(ev.episode_return)}, video=None)
    row.update(ev.meta)
    return finite_row(row)


def finite_row(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` with every NaN or infinite number (also inside lists and mappings) replaced by null, and, if
    there were any, ``"non_finite": [the keys that held them]``: JSON has no NaN, and strict parsers
    (``jq``, JavaScript, ``json.loads(..., parse_constant=...)``) refuse it."""
    bad: list[str] = []

    def clean(value: Any, key: str) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            bad.append(key)
            return None
        if isinstance(value, dict):
            return {k: clean(v, key) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [clean(v, key) for v in value]
        return value

    out = {k: clean(v, k) for k, v in row.items()}
    if bad:
        out["non_finite"] = sorted(set(bad))
    return out


# ---------------------------------------------------------------------------------------------- reading
def read_results(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a ``NAME.results.jsonl`` (a torn last line, from a crash mid-write, is skipped)."""
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass
    return rows


def wilson_interval(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (95% by default); ``(0, 1)`` when ``n == 0``."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre = p + z * z / (2 * n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    den = 1 + z * z / n
    return max(0.0, (centre - half) / den), min(1.0, (centre + half) / den)


@dataclass
class ResultsSummary:
    episodes: int  # rows summarised
    successes: int | None  # rows with success at the last step (None: the env reports no success)
    success_once: int | None  # rows with success at any step
    mean_length: float
    mean_return: float  # over the rows with a finite return (NaN: none has one)
    non_finite_returns: int = 0  # rows whose return was NaN or infinite (null in the file)


def summarize(rows: Sequence[dict[str, Any]]) -> ResultsSummary:
    n = len(rows)
    finite = [r["return"] for r in rows if r.get("return") is not None]
    has = n > 0 and all(r.get("success") is not None for r in rows)
    return ResultsSummary(
        episodes=n,
        successes=sum(bool(r["success"]) for r in rows) if has else None,
        success_once=sum(bool(r.get("success_once")) for r in rows) if has else None,
        mean_length=float(np.mean([r["length"] for r in rows])) if n else 0.0,
        mean_return=(float(np.mean(finite)) if finite else float("nan")) if n else 0.0,
        non_finite_returns=n - len(finite),
    )


def rate_text(name: str, k: int, n: int) -> str:
    """``success 0.62 [0.48, 0.74] (31/50)``: the rate, its Wilson 95% interval and the counts."""
    lo, hi = wilson_interval(k, n)
    return f"{name} {k / n if n else 0.0:.2f} [{lo:.2f}, {hi:.2f}] ({k}/{n})"


def summary_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The results part of a run's printed summary."""
    s = summarize(rows)
    if s.successes is None or s.success_once is None:  # both None together (the env reports no success)
        rates = "success not reported by the env"
    else:
        rates = (
            f"{rate_text('success', s.successes, s.episodes)}, {rate_text('success_once', s.success_once, s.episodes)}"
        )
    return [f"results of {s.episodes} episode{'s' if s.episodes != 1 else ''}: {rates}",
            f"mean length {s.mean_length:.1f} steps, mean return {s.mean_return:.3f}"
            + (f" ({s.non_finite_returns} non-finite, left out)" if s.non_finite_returns else "")]


def results_of(env: Any) -> ResultsSink:
    """The `ResultsSink` of the fastrecord recorder in an env stack (``make_eval_envs``' envs too)."""
    cur = env
    while cur is not None:
        rec = getattr(cur, "recorder", None)
        if rec is not None and getattr(rec, "results", None) is not None:
            return rec.results
        cur = getattr(cur, "_env", None) or getattr(cur, "env", None)
    raise ValueError("no fastrecord recorder in this env stack; wrap the env with fastrecord.RecordEpisode")
