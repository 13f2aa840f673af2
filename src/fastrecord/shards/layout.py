"""Where a sharded run stands and where its files go: the rank of this process (`rank_info`), the
episode rule (global episode ``g`` belongs to rank ``g % world_size`` and is reset with seed
``base_seed + g``), the shard folders ``DIR/NAME.shards/rank{r:05d}/``, the manifest's sharding entry,
and what a shard folder has committed (`committed_global_indices`).
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastrecord.sinks.maniskill_h5.layout import read_json
from fastrecord.sinks.results import RESULTS_SUFFIX, read_results

SHARDS_SUFFIX = ".shards"  # DIR/NAME.shards/ holds the shards of run NAME
RULE = "g % world_size"  # the episode -> rank rule, as written in the manifest
_RANK_DIR = re.compile(r"^rank(\d{5,})$")


# ---------------------------------------------------------------------------------------------- ranks
@dataclass(frozen=True)
class RankInfo:
    """Where this process stands in a (possibly distributed) run."""

    rank: int  # global rank, 0 .. world_size-1
    world_size: int  # number of processes in the run
    local_rank: int  # rank on this host (picks the device: cuda:local_rank)
    local_world_size: int  # processes on this host (shares the CPU cores)

    @property
    def distributed(self) -> bool:
        """Launched as part of a multi-process run (torchrun sets WORLD_SIZE, also to 1)."""
        return self.world_size > 1 or "WORLD_SIZE" in os.environ


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer; torchrun sets it, unset it or "
                         f"launch with torchrun") from None


def rank_info() -> RankInfo:
    """The rank and world of this process: ``torch.distributed`` if it is initialised, else torchrun's
    environment variables ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``LOCAL_WORLD_SIZE``, else 0 of 1."""
    rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    # a process group exists only where torch.distributed was imported: not imported here for the asking (the CLI
    # asks before its imports, and `fastrecord record` starts its sub-envs then: torch's import cost them 0.9 s on
    # the 2-core machine)
    dist: Any = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    # without torchrun's LOCAL_* variables (another launcher): one host is assumed
    local_rank, local_world = _env_int("LOCAL_RANK", rank), _env_int("LOCAL_WORLD_SIZE", world)
    if not (0 <= rank < world) or not (0 <= local_rank < max(local_world, 1)):
        raise ValueError(f"rank {rank} of world size {world} (local rank {local_rank} of {local_world}) is not a valid "
                         f"place in a run; launch with torchrun, or unset RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE")
    return RankInfo(rank, world, local_rank, max(local_world, 1))


def default_workers(info: RankInfo | None = None, cap: int = 16) -> int:
    """Encoder processes for one rank: the usable cores (`fastrecord.options.usable_cores`: the affinity
    mask's) divided by the ranks on this host, at least 1, at most ``cap``."""
    from fastrecord.options import usable_cores

    info = info or rank_info()
    return max(1, min(cap, usable_cores(info.local_world_size)))


# ---------------------------------------------------------------------------------------------- episodes
def _check_world(world_size: int) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be an integer >= 1 (torchrun's --nproc-per-node x --nnodes)")


def owner(g: int, world_size: int) -> int:
    """The rank that records global episode ``g``: ``g % world_size``."""
    _check_world(world_size)
    if g < 0:
        raise ValueError(f"global episode index g={g} must be >= 0")
    return g % world_size


def episodes_of(rank: int, world_size: int, total: int) -> range:
    """Rank ``rank``'s global episodes out of ``total``, in increasing order: ``range(rank, total, world_size)``."""
    _check_world(world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is outside 0..{world_size - 1} (world_size={world_size})")
    return range(rank, total, world_size)


def episode_seed(base_seed: int, g: int) -> int:
    """The reset seed of global episode ``g``: ``base_seed + g``."""
    return int(base_seed) + int(g)


def episode_meta(g: int, rank: int) -> dict[str, int]:
    """The JSON fields a shard's episode entry and results row carry: ``global_index`` and ``source_rank``."""
    return {"global_index": int(g), "source_rank": int(rank)}


# ---------------------------------------------------------------------------------------------- paths
def shards_root(run_dir: str | Path, name: str) -> Path:
    """``DIR/NAME.shards``: the folder of run ``NAME``'s shards."""
    return Path(run_dir) / f"{name}{SHARDS_SUFFIX}"


def shard_dir(run_dir: str | Path, name: str, rank: int) -> Path:
    """``DIR/NAME.shards/rank{rank:05d}``: the output folder of rank ``rank``'s shard (a run named ``NAME``)."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"rank={rank!r} must be an integer >= 0")
    return shards_root(run_dir, name) / f"rank{rank:05d}"


def list_shards(run_dir: str | Path, name: str) -> dict[int, Path]:
    """{rank: shard folder} of every shard folder on disk (also of ranks beyond today's world size)."""
    root = shards_root(run_dir, name)
    if not root.is_dir():
        return {}
    found = {int(m.group(1)): p for p in root.iterdir() if p.is_dir() and (m := _RANK_DIR.match(p.name))}
    return dict(sorted(found.items()))


def sharding_options(world_size: int, base_seed: int, total: int) -> dict[str, Any]:
    """The ``options["sharding"]`` entry of a sharded run's manifest."""
    return dict(world_size=int(world_size), base_seed=int(base_seed), total=int(total), rule=RULE,
                shards=f"NAME{SHARDS_SUFFIX}/rank{{rank:05d}}")


# ---------------------------------------------------------------------------------------------- reading shards
def global_index_of(entry: dict[str, Any], source: str | Path, alternative: str = "") -> int:
    """``entry["global_index"]`` (an episode entry of ``source``: a ``NAME.json`` or results file), checked:
    an integer >= 0, else a ValueError naming the file, the value and the fix (``alternative``: another
    way out, e.g. ", or move the shard out"), where a hand-edited or foreign file would otherwise stop a
    merge or a resume with a TypeError."""
    g = entry.get("global_index")
    if isinstance(g, bool) or not isinstance(g, int) or g < 0:
        shown = {k: entry[k] for k in ("episode_id", "episode_seed") if k in entry}
        raise ValueError(
            f"{source} has an episode entry with global_index={g!r} ({shown}); it must be the episode's "
            f"index in the run, an integer >= 0 (its episode_seed minus the run's --seed). Fix that entry{alternative}"
        )
    return g


def results_rows(shard: str | Path, name: str) -> list[dict[str, Any]]:
    """The rows of a shard folder's ``NAME.results.jsonl`` (none when it is missing or unreadable; a torn
    last line, from a crash mid-write, is skipped)."""
    try:
        rows = read_results(Path(shard) / f"{name}{RESULTS_SUFFIX}")
    except OSError:
        return []
    return [row for row in rows if isinstance(row, dict)]


def committed_global_indices(shard: str | Path, name: str) -> set[int]:
    """The global episodes a shard folder has finished for good: those its ``NAME.json`` lists, and those
    its results file says ended and were not kept (``keep`` dropped them: recording them again would
    drop them again). Without a trajectory (``save_trajectory=False``), every episode with a results row
    (a kept episode's row is written once its video is on disk)."""
    shard = Path(shard)
    doc = read_json(shard / f"{name}.json")
    if doc is None and (shard / f"{name}.json").exists():
        raise ValueError(f"{shard / (name + '.json')} cannot be read (not a JSON object), so which global episodes "
                         f"{shard} holds is unknown; fastrecord consolidate {shard / (name + '.h5')} rebuilds it from "
                         f"its part files if it has some, else restore it from a copy or move {shard} away")
    done: set[int] = set()
    if doc is not None:
        done |= {global_index_of(e, shard / f"{name}.json") for e in doc.get("episodes", [])
                 if isinstance(e, dict) and "global_index" in e}
    for row in results_rows(shard, name):
        if "global_index" in row and (doc is None or row.get("episode_id") is None):
            done.add(global_index_of(row, shard / f"{name}{RESULTS_SUFFIX}"))
    return done

