"""LeRobot's statistics, as LeRobot 0.4.x computes them, per episode while recording and aggregated.

A LeRobot dataset carries, for every non-string feature, ``min``, ``max``, ``mean``, ``std``, ``count``
and the quantiles ``q01``, ``q10``, ``q50``, ``q90``, ``q99`` (policies that normalize with quantiles,
pi0.5, read them): per episode in meta/episodes' ``stats/<feature>/<stat>`` columns, and aggregated over
the dataset in meta/stats.json (LeRobot's edit tools rebuild stats.json from the episodes' columns).

`episode_stats` follows LeRobot 0.4.4's ``compute_stats.compute_episode_stats`` step by step, the same
numpy operations on the same dtypes (its results equal LeRobot's, tests/test_lerobot_stats.py compares):

- a column of T rows: ``RunningQuantileStats`` fed once: min/max (in the column's dtype: integers stay
  integers, booleans booleans), mean and mean of squares (``np.mean``), std from their difference,
  quantiles from a 5000-bin histogram per dimension between min - 1e-10 and max + 1e-10, interpolated in
  the bin; an episode of one row gets its quantiles as its mean. The bookkeeping columns are LeRobot's
  values: ``timestamp`` as frame_index / fps in float64 (LeRobot keeps Python floats), the indices int64.
- a camera: LeRobot's sample of frames (``sample_indices``: all of a short episode, about T**0.75 of a
  long one, at least 100), each downsampled by an integer stride when a side reaches 300 pixels
  (``auto_downsample_height_width``), then per channel over every pixel, scaled to [0, 1], shape
  [3, 1, 1]; ``count`` is the number of sampled frames. The histogram is built from the 256 pixel
  values' counts (the same bins as ``np.histogram``, without sorting millions of pixels). One
  deliberate difference: ``std`` is the pixels' true standard deviation. LeRobot 0.4.4 squares the uint8
  pixels in uint8 (``batch**2`` wraps at 256), so its own image std is wrong, mostly 0.

`aggregate_stats` is LeRobot's ``aggregate_stats``: min/max element-wise, means weighted by count,
variances combined (within plus between episodes), quantiles the count-weighted mean of the episodes'.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

QUANTILES = (0.01, 0.10, 0.50, 0.90, 0.99)  # LeRobot's DEFAULT_QUANTILES
QUANTILE_KEYS = tuple(f"q{int(q * 100):02d}" for q in QUANTILES)  # q01 q10 q50 q90 q99
STAT_NAMES = ("min", "max", "mean", "std", "count", *QUANTILE_KEYS)
BINS = 5000  # LeRobot's num_quantile_bins


# ---------------------------------------------------------------------------------------------- columns
def _quantiles(hists: Sequence[np.ndarray], edges: Sequence[np.ndarray], count: int) -> dict[str, np.ndarray]:
    """LeRobot's ``RunningQuantileStats._compute_quantiles`` (``_compute_single_quantile`` per dimension:
    the bin where the cumulative count reaches q * count, interpolated in it), the cumulative counts
    summed once per dimension rather than once per quantile (the same values)."""
    out: dict[str, list] = {key: [] for key in QUANTILE_KEYS}
    for hist, e in zip(hists, edges, strict=True):
        cumsum = np.cumsum(hist)
        for key, q in zip(QUANTILE_KEYS, QUANTILES, strict=True):
            target = q * count
            idx = np.searchsorted(cumsum, target)
            if idx == 0:
                value = e[0]
            elif idx >= len(cumsum):
                value = e[-1]
            else:
                before = cumsum[idx - 1]
                inside = cumsum[idx] - before
                value = e[idx] if inside == 0 else e[idx] + (target - before) / inside * (e[idx + 1] - e[idx])
            out[key].append(value)
    return {key: np.array(v) for key, v in out.items()}


def _bins(values: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Each value's bin of ``np.histogram(values, bins=edges)`` ([e_i, e_i+1), the last one closed), sorted;
    values outside the edges dropped."""
    idx = np.searchsorted(edges, values, side="right") - 1
    idx[values == edges[-1]] = BINS - 1
    return np.sort(idx[(idx >= 0) & (idx < BINS)])


def _quantiles_of_bins(bins: Sequence[np.ndarray], edges: Sequence[np.ndarray], count: int) -> dict[str, np.ndarray]:
    """`_quantiles` of the histograms whose values' sorted bins are ``bins``, without building them: the
    bin where the cumulative count first reaches q * count is the ceil(q * count)-th smallest value's, the
    count before it and in it are counts of sorted bins (exact integers, as LeRobot's float cumsum holds
    them); the same arithmetic on the same types then. An episode's columns take a few ms, not 5000-bin
    sums per dimension and quantile."""
    out: dict[str, list] = {key: [] for key in QUANTILE_KEYS}
    for b, e in zip(bins, edges, strict=True):
        for key, q in zip(QUANTILE_KEYS, QUANTILES, strict=True):
            target = q * count
            k = math.ceil(target)
            if k > len(b):
                value = e[-1]
            else:
                idx = int(b[k - 1]) if k > 0 else 0
                if idx == 0:
                    value = e[0]
                else:
                    before = np.float64(np.searchsorted(b, idx, side="left"))
                    inside = np.float64(np.searchsorted(b, idx, side="right")) - before
                    value = e[idx] + (target - before) / inside * (e[idx + 1] - e[idx])
            out[key].append(value)
    return {key: np.array(v) for key, v in out.items()}


def vector_stats(column: np.ndarray) -> dict[str, np.ndarray]:
    """LeRobot's statistics of a column ``[T]`` or ``[T, D]`` over its rows (``get_feature_stats(axis=0)``):
    arrays of shape [D] ([1] for a 1-D column), ``count`` [T]."""
    x = np.ascontiguousarray(column)
    x = x.reshape(len(x), -1)
    n = x.shape[0]
    if n < 2:  # LeRobot's _compute_basic_stats: quantiles are the mean
        mean = np.mean(x, axis=0)
        out = {"min": np.min(x, axis=0), "max": np.max(x, axis=0), "mean": mean, "std": np.std(x, axis=0),
               "count": np.array([n])}
        return {**out, **{k: mean.copy() for k in QUANTILE_KEYS}}
    lo, hi = np.min(x, axis=0), np.max(x, axis=0)
    mean = np.mean(x, axis=0)
    squares = np.mean(x**2, axis=0)
    std = np.sqrt(np.maximum(0, squares - mean**2))
    counted = x.view(np.uint8) if x.dtype == np.bool_ else x  # np.histogram converts booleans so
    edges = [np.linspace(lo[i] - 1e-10, hi[i] + 1e-10, BINS + 1) for i in range(x.shape[1])]
    bins = [_bins(counted[:, i], edges[i]) for i in range(x.shape[1])]
    return {"min": lo.copy(), "max": hi.copy(), "mean": mean, "std": std, "count": np.array([n]),
            **_quantiles_of_bins(bins, edges, n)}


# ---------------------------------------------------------------------------------------------- cameras
def sample_indices(length: int) -> list[int]:
    """LeRobot's ``compute_stats.sample_indices``: the frames of an episode its image statistics read."""
    lo, hi, power = 100, 10_000, 0.75
    lo = min(lo, length)
    num = max(lo, min(int(length**power), hi))
    return np.round(np.linspace(0, length - 1, num)).astype(int).tolist()


def _downsample(frames: np.ndarray) -> np.ndarray:
    """LeRobot's ``auto_downsample_height_width`` on ``[N, H, W, C]`` frames."""
    height, width = frames.shape[1], frames.shape[2]
    if max(width, height) < 300:
        return frames
    step = int(width / 150) if width > height else int(height / 150)
    return frames[:, ::step, ::step]


def sampled_frames(frames: np.ndarray) -> np.ndarray:
    """The frames of a camera's ``[T, H, W, C]`` that LeRobot's image statistics read (`sample_indices`,
    then `_downsample`); ``frames`` itself (no copy) where that is every frame at full size."""
    frames = np.asarray(frames)
    picked = sample_indices(len(frames))
    if picked != list(range(len(frames))):
        frames = frames[picked]
    return _downsample(frames)


def image_stats(frames: np.ndarray, sampled: bool = False) -> dict[str, np.ndarray]:
    """LeRobot's statistics of a camera's ``[T, H, W, C]`` uint8 frames (``sampled``: already
    `sampled_frames`' result): per channel, in [0, 1], shape [C, 1, 1]; ``count``: the frames sampled
    (see the module docstring)."""
    picked = np.asarray(frames) if sampled else sampled_frames(frames)
    n, channels = picked.shape[0], picked.shape[-1]
    values = np.arange(256, dtype=np.float64)
    counts = np.stack([np.bincount(picked[..., c].ravel(), minlength=256) for c in range(channels)]).astype(np.float64)
    pixels = counts[0].sum()
    present = counts > 0
    lo = np.array([values[p].min() for p in present])
    hi = np.array([values[p].max() for p in present])
    mean = (counts * values).sum(1) / pixels
    std = np.sqrt(np.maximum(0.0, (counts * values**2).sum(1) / pixels - mean**2))
    edges = [np.linspace(lo[c] - 1e-10, hi[c] + 1e-10, BINS + 1) for c in range(channels)]
    hists = []
    for c in range(channels):  # np.histogram's bins: [e_i, e_i+1), the last one closed
        idx = np.searchsorted(edges[c], values, side="right") - 1
        idx[values == edges[c][-1]] = BINS - 1
        inside = (idx >= 0) & (idx < BINS)
        hists.append(np.bincount(idx[inside], weights=counts[c][inside], minlength=BINS))
    out = {"min": lo, "max": hi, "mean": mean, "std": std, **_quantiles(hists, edges, int(pixels))}
    return {**{k: (np.asarray(v, dtype=np.float64) / 255.0).reshape(channels, 1, 1) for k, v in out.items()},
            "count": np.array([n])}


# ---------------------------------------------------------------------------------------------- episodes
def episode_stats(cols: Mapping[str, np.ndarray], images: Mapping[str, np.ndarray], fps: float,
                  sampled: bool = False) -> dict[str, dict[str, list]]:
    """Every feature's statistics of one episode, as JSON-ready lists (``.tolist()``: integers stay
    integers, booleans booleans). ``timestamp`` from frame_index / ``fps`` in float64, as LeRobot.
    ``sampled``: ``images`` are the cameras' `sampled_frames` already."""
    out = {}
    for key, column in cols.items():
        if key == "timestamp":
            column = np.asarray(cols["frame_index"]) / fps
        out[key] = listed(vector_stats(column))
    for key, frames in images.items():
        out[key] = listed(image_stats(frames, sampled))
    return out


def listed(stats: Mapping[str, np.ndarray]) -> dict[str, list]:
    return {k: np.asarray(v).tolist() for k, v in stats.items()}


def aggregate_stats(per_episode: Sequence[Mapping[str, Mapping[str, Any]]]) -> dict[str, dict[str, Any]]:
    """LeRobot's ``aggregate_stats`` over the episodes' statistics (each ``{feature: {stat: list}}``):
    JSON-ready lists, min/max in their feature's type."""
    out: dict[str, dict[str, Any]] = {}
    for key in dict.fromkeys(k for s in per_episode for k in s):
        items = [s[key] for s in per_episode if key in s]
        means = np.stack([np.asarray(i["mean"], dtype=np.float64) for i in items])
        variances = np.stack([np.asarray(i["std"], dtype=np.float64) ** 2 for i in items])
        counts = np.stack([np.asarray(i["count"]) for i in items])
        total = counts.sum(axis=0)
        while counts.ndim < means.ndim:
            counts = np.expand_dims(counts, axis=-1)
        mean = (means * counts).sum(axis=0) / total
        var = ((variances + (means - mean) ** 2) * counts).sum(axis=0) / total
        agg = {"min": np.min(np.stack([np.asarray(i["min"]) for i in items]), axis=0),
               "max": np.max(np.stack([np.asarray(i["max"]) for i in items]), axis=0),
               "mean": mean, "std": np.sqrt(var), "count": total}
        for q in QUANTILE_KEYS:
            if all(q in i for i in items):
                agg[q] = (np.stack([np.asarray(i[q], dtype=np.float64) for i in items]) * counts).sum(axis=0) / total
        out[key] = listed(agg)
    return out


def flat_stats(stats: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """``{feature: {stat: v}}`` -> ``{"stats/<feature>/<stat>": v}`` (meta/episodes' columns)."""
    return {f"stats/{k}/{s}": v for k, d in stats.items() for s, v in d.items()}


def unflat_stats(row: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for col, v in row.items():
        if col.startswith("stats/") and v is not None:
            feature, stat = col[len("stats/"):].rsplit("/", 1)
            out.setdefault(feature, {})[stat] = v
    return out
