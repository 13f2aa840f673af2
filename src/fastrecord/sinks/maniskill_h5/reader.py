"""Reading ManiSkill trajectory pairs (``NAME.h5`` + ``NAME.json``): `open_trajectory` checks a pair and
returns a `TrajectoryFile`; `check_links` names the files an index of external links misses;
`check_episode` finds an episode's bad data (non-finite values, lengths that disagree) as `EpisodeProblem`s.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np


@dataclass
class TrajectoryFile:
    """A validated ManiSkill trajectory pair: the open HDF5 file and its JSON metadata."""

    h5_path: Path
    json_path: Path
    h5: Any  # h5py.File, open read-only
    meta: dict[str, Any]

    @property
    def env_info(self) -> dict[str, Any]:
        return self.meta["env_info"]

    @property
    def episodes(self) -> list[dict[str, Any]]:
        return self.meta["episodes"]

    def group(self, episode: Mapping[str, Any]) -> Any:
        """``episode``'s h5py group (``traj_<episode_id>``)."""
        return self.h5[f"traj_{episode['episode_id']}"]

    def actions(self, episode: Mapping[str, Any]) -> np.ndarray:
        return np.asarray(self.group(episode)["actions"][:], dtype=np.float32)

    def env_states(self, episode: Mapping[str, Any]) -> dict[str, Any]:
        return read_tree(self.group(episode)["env_states"])

    def recorded_success(self, episode: Mapping[str, Any]) -> bool | None:
        g = self.group(episode)
        if "success" in g and len(g["success"]):
            return bool(g["success"][-1])
        return None if "success" not in episode else bool(episode["success"])

    def close(self) -> None:
        self.h5.close()


def read_tree(group: h5py.Group) -> dict[str, Any]:
    """The datasets under ``group`` as nested dicts of numpy arrays."""
    return {k: (read_tree(v) if isinstance(v, h5py.Group) else v[:]) for k, v in group.items()}


def open_trajectory(path: str | Path) -> TrajectoryFile:
    """Open and check a trajectory pair; every problem is a ValueError naming the file and the fix."""
    h5_path = Path(path)
    if not h5_path.exists():
        raise ValueError(
            f"trajectory file {str(h5_path)!r} does not exist; pass the NAME.h5 of a recorded NAME.h5 + NAME.json pair"
        )
    if h5_path.is_dir() or h5_path.suffix != ".h5":
        raise ValueError(
            f"{str(h5_path)!r} is not a .h5 trajectory file; pass the NAME.h5 of a recorded NAME.h5 + NAME.json pair"
        )
    json_path = h5_path.with_suffix(".json")
    if not json_path.exists():
        raise ValueError(
            f"{str(json_path)!r} is missing: a ManiSkill trajectory is a NAME.h5 + NAME.json pair, and the JSON holds "
            f"the env id, env kwargs and episode seeds that {h5_path.name} needs to be replayed"
        )
    try:
        meta = json.loads(json_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{str(json_path)!r} is not valid JSON ({e.msg} at line {e.lineno}); the file is corrupt or truncated"
        ) from None
    except UnicodeDecodeError:
        raise ValueError(f"{str(json_path)!r} is not a text (JSON) file; the file is corrupt") from None
    if (
        not isinstance(meta, dict)
        or not isinstance(meta.get("env_info"), dict)
        or not isinstance(meta.get("episodes"), list)
    ):
        found = sorted(meta) if isinstance(meta, dict) else type(meta).__name__
        raise ValueError(
            f"{str(json_path)!r} is not ManiSkill trajectory metadata: it needs 'env_info' (a mapping) and 'episodes' "
            f"(a list), found {found}. Pass a file written by fastrecord or mani_skill's RecordEpisode"
        )
    if not meta["env_info"].get("env_id"):
        raise ValueError(
            f"{str(json_path)!r} has no env_info.env_id: the task to replay in is unknown; "
            "the file is not a ManiSkill trajectory"
        )
    for i, ep in enumerate(meta["episodes"]):
        missing = [k for k in ("episode_id", "episode_seed", "elapsed_steps") if k not in ep]
        if missing:
            raise ValueError(
                f"{str(json_path)!r}: episodes[{i}] lacks {missing}; the file is not a ManiSkill trajectory "
                "(or is corrupt)"
            )
    try:
        h5 = h5py.File(h5_path, "r")
    except OSError as e:
        raise ValueError(
            f"{str(h5_path)!r} is not a readable HDF5 file ({e}); the file is corrupt, truncated or of another format"
        ) from None
    try:
        check_links(h5, h5_path)
    except ValueError:
        h5.close()
        raise
    traj = TrajectoryFile(h5_path, json_path, h5, meta)
    for ep in meta["episodes"]:
        name = f"traj_{ep['episode_id']}"
        if name not in h5 or "actions" not in h5[name]:
            h5.close()
            problem = "no group" if name not in h5 else "no actions in group"
            raise ValueError(
                f"{str(h5_path)!r} has {problem} {name!r} for episode {ep['episode_id']} listed in {json_path.name}: "
                "the .h5 and .json do not belong together, or the file is not a ManiSkill trajectory"
            )
    return traj

def missing_link_targets(h5: h5py.File, h5_path: Path) -> dict[str, list[str]]:
    """{file: [top-level names]} of the external links in ``h5`` whose file is not there. HDF5 looks for a
    relative link's file next to ``h5_path``, then in the working directory; both are checked."""
    missing: dict[str, list[str]] = {}
    found: dict[str, bool] = {}
    for name in h5:
        link = h5.get(name, getlink=True)
        if not isinstance(link, h5py.ExternalLink):
            continue
        target = link.filename
        if target not in found:
            path = Path(target)
            found[target] = path.exists() if path.is_absolute() else (
                (h5_path.parent / path).exists() or path.exists())
        if not found[target]:
            missing.setdefault(target, []).append(name)
    return missing


def check_links(h5: h5py.File, h5_path: Path) -> None:
    """Raise one ValueError if ``h5`` (opened from ``h5_path``) links episodes into files that are not
    there: an index of links (a crashed run's, or a sharded run joined with links) copied without the
    folder it links into. It names the file, what is missing and the fix."""
    missing = missing_link_targets(h5, h5_path)
    if not missing:
        return
    episodes = sum(len(v) for v in missing.values())
    first = next(iter(missing))
    folder = Path(first).parts[0] if not Path(first).is_absolute() else str(Path(first).parent)
    raise ValueError(
        f"{str(h5_path)!r} is an index of links, not a self-contained file: {episodes} of its episodes link into "
        f"{len(missing)} file(s) that are not there (first: {first}). It was copied or moved without {folder}. "
        f"Where it was recorded, run `fastrecord consolidate {h5_path.name}` (one self-contained file to copy), or "
        f"copy {folder} along next to {h5_path.name}")


# ---------------------------------------------------------------------------------------------- data checks
STEP_FIELDS = ("actions", "rewards", "terminated", "truncated", "success", "fail")  # [T, ...]: one row a step
SLOT_FIELDS = ("env_states", "obs")  # [T+1, ...]: the reset slot, then one row a step


@dataclass(frozen=True)
class EpisodeProblem:
    """One thing wrong with one recorded episode: which episode, which dataset, what."""

    episode: str  # the episode's group, "traj_3"
    field: str  # the dataset's path in the group, "env_states/actors/cube"
    problem: str  # "has 12 non-finite values at steps 4-9"

    def __str__(self) -> str:
        return f"{self.episode}: {self.field} {self.problem}"

    def as_dict(self) -> dict[str, str]:
        return {"episode": self.episode, "field": self.field, "problem": self.problem}


def _datasets(group: h5py.Group, prefix: str) -> list[tuple[str, h5py.Dataset]]:
    found: list[tuple[str, h5py.Dataset]] = []
    for key, item in group.items():
        if isinstance(item, h5py.Group):
            found += _datasets(item, f"{prefix}{key}/")
        else:
            found.append((f"{prefix}{key}", item))
    return found


def _steps_text(steps: np.ndarray) -> str:
    """``steps`` (sorted row indices) as "step 4", "steps 4-9" or "12 steps between 4 and 30"."""
    first, last = int(steps[0]), int(steps[-1])
    if first == last:
        return f"step {first}"
    if last - first + 1 == len(steps):
        return f"steps {first}-{last}"
    return f"{len(steps)} steps between {first} and {last}"


def _nonfinite(name: str, data: h5py.Dataset) -> str | None:
    """What is non-finite in a float dataset (None: every value is finite); reads the whole dataset."""
    values = data[()]
    bad = ~np.isfinite(values)
    if not bad.any():
        return None
    if bad.ndim == 0:
        return "is not finite"
    per_step = bad.reshape(len(bad), -1).any(axis=1)
    return f"has {int(bad.sum())} non-finite values at {_steps_text(np.flatnonzero(per_step))}"


def check_episode(group: h5py.Group, entry: Mapping[str, Any], *, observations: bool = True,
                  images: bool = False) -> list[EpisodeProblem]:
    """What is wrong with one episode of a ManiSkill trajectory: its group ``traj_{id}`` and its entry in
    ``NAME.json``. Finds non-finite values (NaN, inf) in float datasets and lengths that disagree with
    the entry's ``elapsed_steps`` T (``actions``, ``rewards``, ``terminated``, ``truncated``, ``success``,
    ``fail``: T rows; ``env_states`` and ``obs`` leaves: T+1). Reads only what it checks: integer and
    boolean datasets (uint8 images among them) by their shape; ``obs`` only with ``observations``;
    float image leaves (``[T+1, H, W, C]``, e.g. depth) only with ``images``. An empty list: no problem."""
    # named by its entry: a group reached through an external link has its part file's name
    episode = f"traj_{entry['episode_id']}" if "episode_id" in entry else str(group.name).rsplit("/", 1)[-1]
    problems: list[EpisodeProblem] = []
    try:
        steps = int(entry["elapsed_steps"])
    except (KeyError, TypeError, ValueError):
        steps = None
        problems.append(EpisodeProblem(episode, "elapsed_steps", "is missing or not a number in the JSON entry"))
    leaves: list[tuple[str, h5py.Dataset, int]] = []  # (path, dataset, rows it should have beyond T)
    for key in group:
        item = group.get(key)
        if key in STEP_FIELDS and isinstance(item, h5py.Dataset):
            leaves.append((key, item, 0))
        elif key in SLOT_FIELDS and (key != "obs" or observations):
            pairs = [(key, item)] if isinstance(item, h5py.Dataset) else _datasets(item, f"{key}/")
            leaves += [(name, d, 1) for name, d in pairs]
    for name, data, extra in leaves:
        if steps is not None and data.ndim and len(data) != steps + extra:
            rows = "T+1" if extra else "T"
            problems.append(EpisodeProblem(episode, name, f"has {len(data)} rows, but the episode has elapsed_steps "
                                                          f"{steps} in the JSON ({rows} = {steps + extra} expected)"))
        if data.dtype.kind not in "fc" or (name.startswith("obs") and data.ndim >= 4 and not images):
            continue
        try:
            found = _nonfinite(name, data)
        except OSError as e:  # a damaged chunk: its filter or its bytes fail to read
            found = f"cannot be read ({e})"
        if found:
            problems.append(EpisodeProblem(episode, name, found))
    return problems
