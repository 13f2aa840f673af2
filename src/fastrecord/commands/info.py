"""`fastrecord info`: what recorded runs hold, without opening a viewer.

Examples:
    fastrecord info recordings/trajectory.h5        # one run
    fastrecord info recordings                      # every run in the folder (NAME.h5, NAME.fastrecord.json, parts)
    fastrecord info recordings --json               # the same, as JSON: {"runs": [...]}

For each run: env id, observation mode, control mode, sim backend, episodes, success rate, episode
lengths (min/mean/max steps), observation and action keys with their per-step shapes and dtypes, the
other recorded fields, file sizes (trajectory, parts, a sharded run's ``NAME.shards/``, videos, also
those in the shard folders), the run's status from its manifest ``NAME.fastrecord.json`` and any
``NAME.h5.parts/`` a crash left. A ``NAME.h5`` that links into files that are not there (copied without
its parts or shards) is one error naming them and the fix (``fastrecord consolidate``). Bad episodes
(non-finite states, actions, rewards or non-image observations; dataset lengths that disagree with
``elapsed_steps``) are listed as ``problems`` and the exit status is 1; image observations are not read. Reads
fastrecord's files and those of ManiSkill's ``RecordEpisode`` (no manifest: status ``unknown``).
Nothing is written.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
from pathlib import Path
from typing import Any

import h5py

from fastrecord.sinks.base import MANIFEST_SUFFIX, read_manifest
from fastrecord.sinks.maniskill_h5 import (
    GROWING_NAME,
    PART_PATTERN,
    TrajectoryFile,
    check_episode,
    check_links,
    sibling_paths,
)


def find_runs(path: Path) -> list[Path]:
    """The ``NAME.h5`` of each run at ``path``: the file itself, or every run in a folder (found by its
    ``.h5``, its manifest or its parts folder, so a run a crash left without ``NAME.h5`` is listed too)."""
    if not path.exists():
        raise ValueError(f"{str(path)!r} does not exist; pass a NAME.h5 trajectory or a folder of recordings")
    if path.is_file():
        if path.suffix != ".h5":
            raise ValueError(f"{str(path)!r} is not a .h5 trajectory file; pass a NAME.h5 or a folder of recordings")
        return [path]
    from fastrecord.sinks.formats import run_names

    names = run_names(path)  # by the files that mark a run (`fastrecord.sinks.formats.RunFile.marks_run`)
    if not names:
        raise ValueError(f"{str(path)!r} holds no recorded run (no NAME.h5, NAME{MANIFEST_SUFFIX} or NAME.h5.parts/); "
                         f"pass the folder a recording wrote (e.g. recordings)")
    return [path / f"{n}.h5" for n in sorted(names)]


def _leaves(group: h5py.Group, prefix: str = "") -> dict[str, h5py.Dataset]:
    out: dict[str, h5py.Dataset] = {}
    for k, v in group.items():
        if isinstance(v, h5py.Group):
            out.update(_leaves(v, f"{prefix}{k}/"))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _spec(d: h5py.Dataset) -> dict[str, Any]:
    """Per-step shape (the leading time axis dropped) and dtype."""
    return {"shape": list(d.shape[1:]), "dtype": str(d.dtype)}


def _size(p: Path) -> int:
    if p.is_dir():
        return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
    return p.stat().st_size if p.exists() else 0


def _pid_alive(pid: Any) -> bool | None:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, TypeError, ValueError, OverflowError):
        return None
    return True


def _status(manifest: dict[str, Any]) -> str:
    """The manifest's status; a ``recording`` run on this host whose process is gone was killed."""
    status = manifest.get("status", "unknown") if manifest else "unknown"
    if (
        status == "recording"
        and manifest.get("host") == socket.gethostname()
        and _pid_alive(manifest.get("pid")) is False
    ):
        return "recording (not closed: its process is gone; crashed or killed)"
    return status


def _parts(h5_path: Path) -> dict[str, Any] | None:
    """The ``NAME.h5.parts/`` folder: complete part files, the ones ``NAME.h5`` links to, leftovers."""
    parts_dir = sibling_paths(h5_path)[1]
    if not parts_dir.is_dir():
        return None
    complete = sorted(p.name for p in parts_dir.iterdir() if PART_PATTERN.match(p.name))
    linked: set[str] = set()
    if h5_path.exists():
        try:
            with h5py.File(h5_path, "r") as f:
                for k in f:
                    link = f.get(k, getlink=True)
                    if isinstance(link, h5py.ExternalLink):
                        linked.add(Path(link.filename).name)
        except OSError:
            pass
    return {
        "dir": parts_dir.name,
        "complete": len(complete),
        "indexed": len(linked & set(complete)),
        "unindexed": sorted(
            set(complete) - linked
        ),  # complete parts NAME.h5 does not list yet: consolidate recovers them
        "temporary": sorted(p.name for p in parts_dir.iterdir() if not PART_PATTERN.match(p.name) and
                            p.name != GROWING_NAME),
        # the self-contained copy the close swaps in, grown while recording (a kill leaves it: recovery removes it)
        "copy_bytes": (parts_dir / GROWING_NAME).stat().st_size if (parts_dir / GROWING_NAME).exists() else None,
        "bytes": _size(parts_dir),
    }


def _listed_videos(folder: Path, manifest: dict[str, Any]) -> list[Path]:
    return [folder / f for f in manifest.get("files", []) if str(f).endswith(".mp4") and (folder / f).exists()]


def _videos(h5_path: Path, manifest: dict[str, Any], single_run: bool) -> list[Path]:
    """The run's videos: those its manifest lists and, for a sharded run, those its join linked next to
    ``NAME.h5`` (its results rows name them) and those of its shard folders the join did not link (each shard's
    manifest, else its MP4s): each file once; for a file without a manifest (ManiSkill's), the MP4s of its
    folder when it is the only run there."""
    from fastrecord.shards import list_shards
    from fastrecord.sinks.runfiles import results_videos

    folder, name = h5_path.parent, h5_path.stem
    videos = _listed_videos(folder, manifest) if manifest else (sorted(folder.glob("*.mp4")) if single_run else [])
    joined = [folder / f for f in results_videos(folder, name) if f.endswith(".mp4") and (folder / f).exists()]
    videos += [v for v in joined if v not in videos]
    seen = {(st.st_dev, st.st_ino) for st in (v.stat() for v in videos)}
    for shard in list_shards(folder, name).values():
        shard_manifest = read_manifest(shard / f"{name}{MANIFEST_SUFFIX}")
        for v in _listed_videos(shard, shard_manifest) if shard_manifest else sorted(shard.glob("*.mp4")):
            if (v.stat().st_dev, v.stat().st_ino) not in seen:  # not one the join linked next to NAME.h5
                videos.append(v)
    return videos


def _shards_bytes(h5_path: Path) -> int:
    """Bytes of a sharded run's ``NAME.shards/`` other than its videos (counted with the videos)."""
    from fastrecord.shards import shards_root

    root = shards_root(h5_path.parent, h5_path.stem)
    if not root.is_dir():
        return 0
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file() and f.suffix != ".mp4")


def _open(h5_path: Path, json_path: Path) -> TrajectoryFile:
    """The trajectory pair, read leniently (a file without ``env_info`` is still described); a pair that
    cannot be read at all is a ValueError naming the file."""
    try:
        meta = json.loads(json_path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{json_path.name} is missing: a trajectory is a NAME.h5 + NAME.json pair") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"{str(json_path)!r} cannot be read as JSON ({e}); the file is corrupt or truncated") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("episodes"), list) or not all(
            isinstance(ep, dict) and "episode_id" in ep for ep in meta["episodes"]):
        raise ValueError(f"{str(json_path)!r} is not ManiSkill trajectory metadata (it needs 'episodes', a list of "
                         f"entries with 'episode_id'); pass a file written by fastrecord or mani_skill's RecordEpisode")
    try:
        h5 = h5py.File(h5_path, "r")
    except OSError as e:
        raise ValueError(f"{str(h5_path)!r} is not a readable HDF5 file ({e}); the file is corrupt, truncated or "
                         f"of another format") from None
    try:
        check_links(h5, h5_path)
    except ValueError:
        h5.close()
        raise
    return TrajectoryFile(h5_path, json_path, h5, meta)


def describe_run(h5_path: Path, single_run: bool = True) -> dict[str, Any]:
    """Everything `fastrecord info` reports about one run, as a JSON-able dict. Raises ValueError when
    the trajectory cannot be read (a folder reports that run's error and goes on)."""
    name = h5_path.stem
    manifest = read_manifest(h5_path.with_name(name + MANIFEST_SUFFIX))
    json_path = h5_path.with_suffix(".json")
    videos = _videos(h5_path, manifest, single_run)
    parts = _parts(h5_path)
    run: dict[str, Any] = {
        "name": name, "path": str(h5_path), "status": _status(manifest),
        "recorder": f"fastrecord {manifest.get('fastrecord')}" if manifest else None,
        "parts": parts,
        "files": {
            "h5_bytes": _size(h5_path), "json_bytes": _size(json_path), "parts_bytes": parts["bytes"] if parts else 0,
            "shards_bytes": _shards_bytes(h5_path),
            "videos": len(videos), "videos_bytes": sum(_size(v) for v in videos),
        },
    }
    run["files"]["total_bytes"] = sum(v for k, v in run["files"].items() if k.endswith("_bytes"))
    run["outputs"] = _agreement(h5_path, manifest)
    if not h5_path.exists() and manifest.get("options", {}).get("save_trajectory") is False and not parts:
        return run  # a run of videos, results or a LeRobot dataset only
    if not h5_path.exists():
        hint = (
            f" (the parts are there: fastrecord consolidate {h5_path} rebuilds it)"
            if parts and parts["complete"]
            else ""
        )
        run["error"] = f"{h5_path.name} is missing{hint}"
        return run
    try:
        traj = _open(h5_path, json_path)
    except ValueError as e:
        if not (run["outputs"] or {}).get("damage"):
            raise
        run["error"] = f"{h5_path.name} cannot be opened: {str(e).split('. ')[0]} (see damage)"
        return run
    try:
        run.update(_describe_episodes(traj, h5_path.name, json_path.name))
    finally:
        traj.close()
    return run


def _describe_episodes(traj: TrajectoryFile, h5_name: str, json_name: str) -> dict[str, Any]:
    """`describe_run`'s part read from an open trajectory pair: the task, the episodes and their success,
    the recorded fields of the first episode, the problems `check_episode` finds ("error" where the pair
    disagrees)."""
    run: dict[str, Any] = {}
    env_info, episodes = traj.meta.get("env_info") or {}, traj.episodes
    kwargs = env_info.get("env_kwargs") or {}
    missing = [ep["episode_id"] for ep in episodes if f"traj_{ep['episode_id']}" not in traj.h5]
    if missing:
        run["error"] = (f"{len(missing)} episodes listed in {json_name} have no group in {h5_name} "
                        f"(first: traj_{missing[0]}); the pair is incomplete")
        episodes = [ep for ep in episodes if ep["episode_id"] not in set(missing)]
    successes = [traj.recorded_success(ep) for ep in episodes]
    known = [s for s in successes if s is not None]
    lengths = [int(ep["elapsed_steps"]) for ep in episodes if "elapsed_steps" in ep]
    control = sorted({str(ep["control_mode"]) for ep in episodes if ep.get("control_mode")})
    run.update(
        env_id=env_info.get("env_id"),
        obs_mode=kwargs.get("obs_mode"),  # None: the task's default
        control_mode=control[0] if len(control) == 1 else (control or kwargs.get("control_mode")),
        sim_backend=kwargs.get("sim_backend"),
        max_episode_steps=env_info.get("max_episode_steps"),
        source_type=traj.meta.get("source_type"),
        episodes=len(episodes),
        successes=sum(known) if known else None,
        success_rate=(sum(known) / len(known)) if known else None,
        episode_length={"min": min(lengths), "mean": statistics.fmean(lengths), "max": max(lengths)}
        if lengths
        else None,
        steps=sum(lengths),
    )
    observations: dict[str, Any] = {}
    actions = None
    other: dict[str, Any] = {}
    if episodes:
        group = traj.group(episodes[0])
        for key, d in _leaves(group).items():
            if key.startswith("obs/") or key == "obs":
                observations[key[4:] if key.startswith("obs/") else key] = _spec(d)
            elif key == "actions":
                actions = _spec(d)
            else:
                other[key] = _spec(d)
    run.update(observations=observations, actions=actions, other_fields=other)
    run["problems"] = [p.as_dict() for ep in episodes for p in check_episode(traj.group(ep), ep)]
    return run


def _agreement(h5_path: Path, manifest: dict[str, Any]) -> dict[str, Any] | None:
    """Whether the run's outputs agree with each other and its manifest (`fastrecord.sinks.reconcile`):
    the episodes its results file commits, ``damage`` (files deleted, truncated or added: one line each,
    naming the file and the fix) and ``uncommitted`` (episodes some outputs hold past the commit log: a
    stopped run's, which a resume or ``fastrecord consolidate`` discards). None for a run without a
    manifest (ManiSkill's files) and a run recording now."""
    from fastrecord.shards import lock_held
    from fastrecord.sinks.reconcile import episode_ranges, inspect_run

    folder, name = h5_path.parent, h5_path.stem
    if not manifest or lock_held(folder, name):
        return None
    state = inspect_run(folder, name)
    beyond = {k: episode_ranges(v) for k, v in state.beyond().items()} if not state.problems else {}
    return {"committed": state.committed, "damage": state.problems, "uncommitted": beyond}


def describe(path: str | Path) -> list[dict[str, Any]]:
    """One dict per run at ``path`` (a NAME.h5 or a folder); a folder's unreadable run gets ``error``."""
    p = Path(path)
    runs = find_runs(p)
    if p.is_file():
        return [describe_run(runs[0])]
    out = []
    for h5 in runs:
        try:
            out.append(describe_run(h5, single_run=len(runs) == 1))
        except ValueError as e:
            out.append({"name": h5.stem, "path": str(h5), "error": str(e)})
    return out


# ---------------------------------------------------------------------------------------------- text
def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _shape(spec: dict[str, Any]) -> str:
    return f"[{', '.join(map(str, spec['shape']))}] {spec['dtype']}"


def _parts_line(parts: dict[str, Any]) -> str:
    """The ``parts:`` line of `format_run`: what ``NAME.h5.parts/`` holds."""
    text = f"  parts: {parts['dir']}/ holds {parts['complete']} complete part files "
    text += f"({parts['indexed']} listed in the index)"
    if parts["unindexed"]:
        text += f"; {len(parts['unindexed'])} not indexed yet"
    if parts["temporary"]:
        text += f"; {len(parts['temporary'])} unfinished"
    if parts.get("copy_bytes") is not None:
        text += f"; the close's self-contained copy grown to {_bytes(parts['copy_bytes'])}"
    return text


def format_run(run: dict[str, Any]) -> str:
    lines = [run["path"]]
    if "env_id" in run:
        rate = (
            "" if run["success_rate"] is None else f", {run['successes']} successful ({100 * run['success_rate']:.1f}%)"
        )
        control = run["control_mode"] if not isinstance(run["control_mode"], list) else ", ".join(run["control_mode"])
        lines.append(
            f"  env: {run['env_id'] or 'unknown'}   obs mode: {run['obs_mode'] or 'task default'}   control mode: "
            f"{control or 'task default'}   sim backend: {run['sim_backend'] or 'default'}"
        )
        lines.append(f"  episodes: {run['episodes']}{rate}")
        if run["episode_length"]:
            el = run["episode_length"]
            lines.append(f"  episode length: min {el['min']}, mean {el['mean']:.1f}, max {el['max']} steps "
                         f"({run['steps']} steps in all; max_episode_steps {run['max_episode_steps']})")
        if run["observations"]:
            width = max(len(k) for k in run["observations"])
            lines.append("  observations (per step):")
            lines += [f"    {k:<{width}}  {_shape(v)}" for k, v in run["observations"].items()]
        if run["actions"]:
            lines.append(f"  actions (per step): {_shape(run['actions'])}")
        if run["other_fields"]:
            top = sorted({k.split("/")[0] for k in run["other_fields"]})
            lines.append(f"  also recorded: {', '.join(top)}")
    f = run.get("files")
    if f:
        video = f", {f['videos']} videos {_bytes(f['videos_bytes'])}" if f["videos"] else ", no videos"
        parts_size = f", parts {_bytes(f['parts_bytes'])}" if f["parts_bytes"] else ""
        shards = f", shards {_bytes(f['shards_bytes'])}" if f.get("shards_bytes") else ""
        lines.append(f"  size: {_bytes(f['total_bytes'])} (h5 {_bytes(f['h5_bytes'])}, json {_bytes(f['json_bytes'])}"
                     f"{parts_size}{shards}{video})")
    if "status" in run:
        who = f" by {run['recorder']}" if run.get("recorder") else ""
        lines.append(f"  status: {run['status']}{who}")
    parts = run.get("parts")
    if parts:
        lines.append(_parts_line(parts))
        if run.get("status") != "recording":
            lines.append(f"    left by a run that did not close: `fastrecord consolidate {run['path']}` makes one "
                         f"self-contained file, or resume the run (--if-exists resume)")
    elif "status" in run:
        lines.append("  parts: none")
    problems = run.get("problems")
    if problems:
        bad = len({p["episode"] for p in problems})
        shown = "; ".join(f"{p['episode']}: {p['field']} {p['problem']}" for p in problems[:8])
        more = f"; and {len(problems) - 8} more" if len(problems) > 8 else ""
        lines.append(f"  problems: {shown}{more} ({bad} of {run['episodes']} episodes bad; re-record them, or replay "
                     f"the others: fastrecord replay --count)")
    outputs = run.get("outputs")
    if outputs:
        if outputs["damage"]:
            lines += [f"  damage: {d}" for d in outputs["damage"]]
        else:
            lines.append(f"  outputs: {outputs['committed']} episodes committed; every output and the manifest agree")
        if outputs["uncommitted"]:
            held = "; ".join(f"{k}: {v}" for k, v in outputs["uncommitted"].items())
            lines.append(f"  not committed: {held} (the run stopped before every output held them; a resume or "
                         f"`fastrecord consolidate {run['path']}` discards them)")
    if run.get("error"):
        lines.append(f"  error: {run['error']}")
    return "\n".join(lines)


def configure_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="a NAME.h5 trajectory, or a folder: every run in it")
    p.add_argument("--json", action="store_true", help="print JSON ({\"runs\": [...]}) instead of text")


def main_from_args(args: argparse.Namespace) -> int:
    runs = describe(args.path)
    if args.json:
        print(json.dumps({"runs": runs}, indent=2))
    else:
        print("\n\n".join(format_run(r) for r in runs))
    return 1 if any(r.get("error") or r.get("problems") or (r.get("outputs") or {}).get("damage") for r in runs) else 0
