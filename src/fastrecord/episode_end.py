"""What the recorder reads and decides when episodes end, as functions of what it holds: the flags it reads from
the device buffer in one transfer (`read_ended`), which episodes its keep filter keeps (`keep_mask`), and the
`fastrecord.episode.EpisodeEnded` every sink hears of each (`ended_events`).

`fastrecord.recorder.EpisodeRecorder.finalize` calls them in that order, before and around the kept episodes' one
copy to the host.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from fastrecord.episode import EpisodeEnded, KeepFilter

ENDED_FLAGS = ("success", "terminated", "truncated", "fail")  # the last step's flags an ended episode reports


def read_ended(buf: Any, rows: np.ndarray, returns: Any = None) -> dict[str, Any]:
    """What the keep filter and the `EpisodeEnded` events of ``rows`` need from ``buf`` (an
    `fastrecord.buffer.EpisodeBuffer`), on the host: ``lengths``, ``last`` (each of `ENDED_FLAGS` the env reports,
    at the last step), ``once`` (success at any step, where success is recorded) and ``returns`` (``returns``: every
    env's running return, or None).

    Call it before the episodes' frames are queued: the reads wait for the device work queued so far, which must not
    yet include the (large) gather of the frames."""
    lengths = buf.cursor[rows].copy()
    extra = {} if returns is None else {"returns": returns}  # every env's (tiny): no index to the device
    # one transfer for every flag the events and the keep filter need
    got = buf.read_rows(rows, last=list(ENDED_FLAGS), whole=["success"], extra=extra)
    last = {n: np.asarray(got[n]).reshape(len(rows)).astype(bool) for n in ENDED_FLAGS if n in got}
    once = None
    if "whole/success" in got:
        flags = np.asarray(got["whole/success"]).reshape(len(rows), -1).astype(bool)
        steps = np.arange(flags.shape[1])
        once = (flags & (steps[None] >= 1) & (steps[None] <= lengths[:, None])).any(axis=1)
    returned = np.asarray(got["returns"], dtype=np.float64)[rows] if "returns" in got else np.zeros(len(rows))
    return dict(lengths=lengths, last=last, once=once, returns=returned)


def keep_mask(keep: KeepFilter, rows: np.ndarray, ended: Mapping[str, Any], recorded: Mapping[str, Any],
              last_info: Mapping[str, Any] | None, num_envs: int, unbatched: bool) -> np.ndarray:
    """Which of ``rows`` the filter ``keep`` keeps. ``ended``: `read_ended`'s; ``recorded``: the buffer's fields
    (what the env reports); ``last_info``: the env's last info (a callable filter gets each env's slice of it, the
    whole of it where the env is ``unbatched`` or a value is not per env)."""
    if keep == "all":
        return np.ones(len(rows), dtype=bool)
    if callable(keep):
        from fastrecord.envs import to_numpy

        info = last_info or {}
        out = []
        for e in rows:
            final = {}
            for k, v in info.items():
                a = to_numpy(v) if not isinstance(v, Mapping) else v
                per_env = isinstance(a, np.ndarray) and a.ndim >= 1 and a.shape[0] == num_envs and not unbatched
                final[k] = a[e] if per_env else a
            out.append(bool(keep(final)))
        return np.asarray(out, dtype=bool)
    if "success" not in recorded and not (keep == "failure" and "fail" in recorded):
        raise ValueError(
            f"keep={keep!r} needs info['success'] from the env, which this env does not report; "
            "use keep='all' or a callable"
        )
    if keep == "success_once":
        return np.asarray(ended["once"], dtype=bool)
    last = ended["last"]
    if keep == "success":
        return np.asarray(last["success"])
    # failure: the env reports fail at the end, or it did not succeed
    failed = last.get("fail", np.zeros(len(rows), dtype=bool))
    return np.asarray(failed | ~last["success"] if "success" in last else failed)


def ended_events(rows: np.ndarray, keep: np.ndarray, first_id: int, ended: Mapping[str, Any], seeds: np.ndarray,
                 frames_ok: np.ndarray, metas: Sequence[Mapping[str, Any] | None]) -> list[EpisodeEnded]:
    """The `EpisodeEnded` of each of ``rows`` (the kept ones get ids ``first_id, first_id + 1, ...``), from
    `read_ended`'s ``ended`` and each env's seed, whether every frame was captured, and its episode's meta."""
    last, once, ids = ended["last"], ended["once"], iter(range(first_id, first_id + int(keep.sum())))

    def flag(name: str, i: int) -> bool | None:
        return bool(last[name][i]) if name in last else None

    return [
        EpisodeEnded(
            env_idx=e,
            episode_id=next(ids) if keep[i] else None,
            length=int(ended["lengths"][i]),
            seed=int(seeds[e]),
            episode_return=float(ended["returns"][i]),
            success=flag("success", i),
            success_once=None if once is None else bool(once[i]),
            fail=flag("fail", i),
            terminated=flag("terminated", i),
            truncated=flag("truncated", i),
            has_frames=bool(frames_ok[e]),
            meta=dict(metas[e] or {}),
        )
        for i, e in enumerate(rows.tolist())
    ]
