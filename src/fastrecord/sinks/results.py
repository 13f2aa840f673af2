"""Per-episode results of a run: ``NAME.results.jsonl``, one row per finished episode, and its summary.

Every recorder writes it (the wrapper, ``make_eval_envs``, ``fastrecord record`` and ``replay``), also
when it keeps no trajectory and only some videos: an evaluation wants its failures counted too. A row::

    {"episode_id": 3, "env_idx": 1, "seed": 7, "success": true, "success_once": true, "terminated": true,
     "truncated": false, "length": 42, "return": 0.0, "video": "3_env1_success.mp4"}

``episode_id`` is the id in ``NAME.h5``/``NAME.json`` and in the video name (null: not kept);
``success`` is the flag at the last step (null if the env reports none), ``success_once`` at any step;
``terminated``/``truncated`` are the last step's flags (both false: the episode was ended from outside,
e.g. in progress at ``close()``); ``return`` is the sum of the rewards; ``video`` is the path relative to
the output folder (the first piece with ``max_steps_per_video``; null: no video).

Rows are appended in the order episodes finish, each flushed at once, so a crash keeps the rows so far;
a kept episode's row is written when its video is on disk (its actual name: a taken name gets ``_1``).
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
from typing import Any

import numpy as np
import torch

from fastrecord.episode import EpisodeData
from fastrecord.sinks.base import RunDirectory, Sink

RESULTS_SUFFIX = ".results.jsonl"
Z95 = 1.959963984540054  # the standard normal's 97.5% quantile: a two-sided 95% interval


class ResultsSink(Sink):
    """Owns: ``NAME.results.jsonl`` (append-only), the running return of every env, the rows of this run
    (`rows`) and the queue of rows waiting for their video.

    The recorder calls `start` when envs begin episodes, `step` with every step's rewards and `finished`
    for every episode that ends (kept or not); kept episodes reach it through ``submit`` like any sink
    (it needs nothing from them). It is the recorder's last sink, so the videos are done before its own
    ``wait_until_done``/``close`` write the last rows.
    """

    wants_frames = False
    wants_datasets = False

    def __init__(self, videos: Any = None) -> None:
        self.videos = videos  # the recorder's Mp4Sink, or None
        self.rows: list[dict[str, Any]] = []  # every row of this run, in finish order (written or waiting)
        self.path: Path | None = None
        self._file: Any = None
        self._waiting: deque[tuple[dict[str, Any], str | None]] = deque()  # (row, video stem it waits for)
        self._returns: torch.Tensor | None = None
        self._video_id = 0

    def open(self, run: RunDirectory) -> None:
        super().open(run)
        self.path = run.path(RESULTS_SUFFIX)
        self._file = open(self.path, "a", encoding="utf-8")  # resume: rows go on after the earlier run's
        run.add_file(self.path)
        self._video_id = run.counters.get("next_video_id", 0)

    # -------------------------------------------------------------- stepping thread (recorder hooks)
    def start(self, env_idx: np.ndarray) -> None:
        """Episodes of ``env_idx`` begin: their returns start at 0."""
        if self._returns is not None:
            self._returns[torch.as_tensor(np.asarray(env_idx), device=self._returns.device)] = 0

    def step(self, rew: torch.Tensor, restart: np.ndarray | None) -> None:
        """Add a step's rewards ``[N]`` (``restart`` envs were auto-reset instead: theirs start at 0)."""
        rew = torch.as_tensor(rew).reshape(-1)
        if self._returns is None:
            self._returns = torch.zeros(rew.shape[0], dtype=torch.float64, device=rew.device)
        self._returns += rew.to(self._returns.device, torch.float64)
        if restart is not None and restart.any():
            self._returns[torch.as_tensor(np.flatnonzero(restart), device=self._returns.device)] = 0

    def read(self, rows: np.ndarray, buffer: Any) -> dict[str, Any]:
        """What the rows of the episodes of ``rows`` need from the recorder's ``buffer``, on the host.

        The recorder calls this before it queues the episodes' frames: the reads wait for the device
        work queued so far, which must not yet include the (large) gather of the frames."""
        lengths = buffer.cursor[rows].copy()
        extra = {} if self._returns is None else {"returns": self._returns[torch.as_tensor(rows, device=self._returns.device)]}
        # one transfer for every flag the rows and the keep filter need (each read used to wait on its own sync)
        got = buffer.read_rows(rows, last=["success", "terminated", "truncated", "fail"], whole=["success"], extra=extra)
        last = {n: got[n] for n in ("success", "terminated", "truncated", "fail") if n in got}
        once = None
        if "whole/success" in got:
            flags = np.asarray(got["whole/success"]).reshape(len(rows), -1).astype(bool)
            steps = np.arange(flags.shape[1])
            once = (flags & (steps[None] >= 1) & (steps[None] <= lengths[:, None])).any(axis=1)
        returns = got["returns"] if "returns" in got else np.zeros(len(rows))
        return dict(lengths=lengths, last=last, once=once, returns=returns)

    def finished(self, rows: np.ndarray, kept: np.ndarray, first_id: int, ended: dict[str, Any], seeds: np.ndarray,
                 frames_ok: np.ndarray, extra: Sequence[dict[str, Any] | None] | None = None) -> None:
        """Episodes of ``rows`` ended (``kept`` mask; kept ones got ids ``first_id, first_id + 1, ...``);
        ``ended`` is what `read` took from the buffer before the episodes were queued. ``extra``: more
        fields per row (a sharded run's ``global_index``/``source_rank``)."""
        lengths, last, once, returns = ended["lengths"], ended["last"], ended["once"], ended["returns"]
        tiled_video = None
        if self.videos is not None and self.videos.layout != "per_env":
            now = self.run.counters.get("next_video_id", 0)
            tiled_video = str(self._video_id) if now > self._video_id else None  # this batch's tiled video
            self._video_id = now
        ids = iter(range(first_id, first_id + int(kept.sum())))

        def flag(name: str, i: int) -> bool | None:
            return bool(np.asarray(last[name]).reshape(len(rows))[i]) if name in last else None

        for i, e in enumerate(rows.tolist()):
            episode_id = next(ids) if kept[i] else None
            success = flag("success", i)
            row = dict(episode_id=episode_id, env_idx=int(e), seed=int(seeds[e]), success=success,
                       success_once=None if once is None else bool(once[i]), terminated=flag("terminated", i),
                       truncated=flag("truncated", i), length=int(lengths[i]), **{"return": float(returns[i])},
                       video=None)
            if extra is not None and extra[i]:
                row.update(extra[i])
            stem = None
            if episode_id is not None and self.videos is not None and frames_ok[e]:
                if tiled_video is not None:
                    stem = tiled_video
                elif self.videos.layout == "per_env":
                    tag = "" if success is None else ("_success" if success else "_failure")
                    stem = f"{episode_id}_env{e}{tag}"
            self.rows.append(row)
            self._waiting.append((row, stem))
        self._drain()

    def submit(self, episodes: Sequence[EpisodeData]) -> None:
        pass  # rows come from `finished`, which sees the episodes that are not kept too

    # -------------------------------------------------------------- writing
    def _video_name(self, stem: str) -> str | None:
        """The name of the file written for the video meant to be ``stem.mp4``; None while not on disk."""
        path = self.videos.written(stem)
        return path.name if path is not None else None

    def _drain(self, final: bool = False) -> None:
        """Write the rows whose video is on disk (all of them when ``final``), in finish order."""
        wrote = False
        while self._waiting:
            row, stem = self._waiting[0]
            if stem is not None:
                name = self._video_name(stem)
                if name is None and not final:
                    break
                row["video"] = name
            self._waiting.popleft()
            self._file.write(json.dumps(row) + "\n")
            wrote = True
        if wrote:
            self._file.flush()

    def raise_if_failed(self) -> None:
        if self._waiting and self._file is not None:
            self._drain()

    def wait_until_done(self) -> None:
        # the recorder waits for its sinks in order: the videos are on disk by now
        if self._file is not None:
            self._drain(final=True)

    def close(self) -> None:
        if self._file is not None and not self._file.closed:
            self._drain(final=True)
            self._file.close()


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
    mean_return: float


def summarize(rows: Sequence[dict[str, Any]]) -> ResultsSummary:
    n = len(rows)
    has = n > 0 and all(r.get("success") is not None for r in rows)
    return ResultsSummary(
        episodes=n,
        successes=sum(bool(r["success"]) for r in rows) if has else None,
        success_once=sum(bool(r.get("success_once")) for r in rows) if has else None,
        mean_length=float(np.mean([r["length"] for r in rows])) if n else 0.0,
        mean_return=float(np.mean([r["return"] for r in rows])) if n else 0.0,
    )


def rate_text(name: str, k: int, n: int) -> str:
    """``success 0.62 [0.48, 0.74] (31/50)``: the rate, its Wilson 95% interval and the counts."""
    lo, hi = wilson_interval(k, n)
    return f"{name} {k / n if n else 0.0:.2f} [{lo:.2f}, {hi:.2f}] ({k}/{n})"


def summary_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The results part of a run's printed summary."""
    s = summarize(rows)
    if s.successes is None:
        rates = "success not reported by the env"
    else:
        rates = f"{rate_text('success', s.successes, s.episodes)}, {rate_text('success_once', s.success_once, s.episodes)}"
    return [f"results of {s.episodes} episode{'s' if s.episodes != 1 else ''}: {rates}",
            f"mean length {s.mean_length:.1f} steps, mean return {s.mean_return:.3f}"]


def results_of(env: Any) -> ResultsSink:
    """The `ResultsSink` of the fastrecord recorder in an env stack (``make_eval_envs``' envs too)."""
    cur = env
    while cur is not None:
        rec = getattr(cur, "recorder", None)
        if rec is not None and getattr(rec, "results", None) is not None:
            return rec.results
        cur = getattr(cur, "_env", None) or getattr(cur, "env", None)
    raise ValueError("no fastrecord recorder in this env stack; wrap the env with fastrecord.RecordEpisode")
