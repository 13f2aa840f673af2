"""`fastrecord gallery`: one static HTML page of a folder's videos, to look through them in a browser.

Examples:
    fastrecord gallery recordings                  # writes recordings/gallery.html; open it in a browser
    fastrecord gallery recordings --output index.html --title "PickCube, policy v3"

The page is a single file with its CSS and JavaScript inline: no server, no network, no libraries. Videos
are linked by paths relative to the page, so the folder can be copied or zipped as it is. Each video is a
tile labelled with its episode id, env index, env id and outcome (success / failure / unknown), taken from
the run's manifest ``NAME.fastrecord.json`` and ``NAME.json`` and from fastrecord's file names
(``{episode_id}_env{env}_{success|failure}.mp4``); ManiSkill's ``{k}.mp4`` get theirs from the JSON
when the folder holds one run. Buttons filter the tiles; the filter is kept in the address
(``gallery.html#failure``, or ``gallery.html?filter=success``), so a link can open the page filtered.
"""

from __future__ import annotations

import argparse
import html
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from fastrecord.sinks.base import MANIFEST_SUFFIX, read_manifest
from fastrecord.sinks.runfiles import results_videos
from fastrecord.sinks.video_names import parse_video_name

FILTERS = ("all", "success", "failure")


@dataclass
class Tile:
    path: Path  # the video
    href: str  # its URL relative to the page
    outcome: str  # success | failure | unknown
    episode_id: int | None = None
    env_idx: int | None = None
    env_id: str | None = None
    run: str | None = None  # the run (trajectory name) it belongs to, when known
    part: int | None = None  # piece k of a split video


def _runs_of(folder: Path) -> tuple[dict[str, str], dict[str, dict]]:
    """For one folder: {video file name: run name} from the manifests, and {run name: NAME.json}."""
    owner: dict[str, str] = {}
    meta: dict[str, dict] = {}
    for m in folder.glob(f"*{MANIFEST_SUFFIX}"):
        name = m.name[: -len(MANIFEST_SUFFIX)]
        for f in [*read_manifest(m).get("files", []), *results_videos(folder, name)]:  # joined videos: the rows'
            owner[str(f)] = name
    for j in folder.glob("*.json"):
        if j.name.endswith(MANIFEST_SUFFIX) or not j.with_suffix(".h5").exists():
            continue
        try:
            doc = json.loads(j.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict) and isinstance(doc.get("episodes"), list):
            meta[j.stem] = doc
    return owner, meta


def collect(root: Path, page: Path) -> list[Tile]:
    """Every MP4 under ``root``, labelled; a file under two names (a joined video and its shard's) once."""
    tiles: list[Tile] = []
    cache: dict[Path, tuple[dict[str, str], dict[str, dict]]] = {}
    seen: set[tuple[int, int]] = set()  # a sharded run's joined video is a hard link of its shard's: shown once
    for video in sorted(root.rglob("*.mp4"), key=lambda p: (str(p.parent.relative_to(root)), _sort_key(p.stem))):
        try:
            st = video.stat()
        except OSError:  # a link to a file that is gone: listed as before, without the check
            st = None
        if st is not None and (st.st_dev, st.st_ino) in seen:
            continue
        if st is not None:
            seen.add((st.st_dev, st.st_ino))
        folder = video.parent
        if folder not in cache:
            cache[folder] = _runs_of(folder)
        owner, meta = cache[folder]
        run = owner.get(video.name)
        if run is None and len(meta) == 1:
            run = next(iter(meta))
        doc = meta.get(run) if run else None
        tile = Tile(video, quote(os.path.relpath(video, page.parent).replace(os.sep, "/")), "unknown", run=run,
                    env_id=((doc or {}).get("env_info") or {}).get("env_id"))
        name = parse_video_name(video.name)
        if name is not None and name.per_env:
            tile.episode_id, tile.env_idx, tile.part = name.number, name.env_idx, name.part
            if name.success is not None:
                tile.outcome = "success" if name.success else "failure"
        elif name is not None and doc is not None:  # ManiSkill's {k}.mp4 (and tiled videos): the JSON says
            tile.episode_id = name.number
        if tile.outcome == "unknown" and doc is not None and tile.episode_id is not None:
            ep = next((e for e in doc["episodes"] if e.get("episode_id") == tile.episode_id), None)
            if ep is not None and "success" in ep:
                tile.outcome = "success" if ep["success"] else "failure"
        tiles.append(tile)
    return tiles


def _sort_key(stem: str) -> tuple:
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", stem))


_CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 16px; background: #f4f4f6; color: #222; }
h1 { font-size: 20px; margin: 0 0 4px; }
.summary { color: #555; margin-bottom: 10px; }
.filters button { font: inherit; padding: 4px 12px; margin-right: 6px; border: 1px solid #999; border-radius: 4px;
                  background: #fff; cursor: pointer; }
.filters button.active { background: #333; color: #fff; border-color: #333; }
.grid { display: grid; grid-template-columns: repeat(auto-fill, minmax(220px, 1fr)); gap: 12px; margin-top: 12px; }
.tile { margin: 0; background: #fff; border: 3px solid #bbb; border-radius: 6px; overflow: hidden; }
.tile.success { border-color: #1e9e3e; }
.tile.failure { border-color: #d22f2f; }
.tile[hidden] { display: none; }
.tile video { display: block; width: 100%; aspect-ratio: 1 / 1; background: #203040; }
.tile figcaption { padding: 6px 8px; }
.badge { display: inline-block; padding: 1px 8px; border-radius: 10px; color: #fff;
  font-weight: 600; background: #888; }
.success .badge { background: #1e9e3e; }
.failure .badge { background: #d22f2f; }
.name { color: #666; font-size: 12px; word-break: break-all; }
.empty { color: #666; margin-top: 16px; }
"""

_JS = """
(function () {
  var FILTERS = ["all", "success", "failure"];
  var tiles = Array.prototype.slice.call(document.querySelectorAll(".tile"));
  var buttons = Array.prototype.slice.call(document.querySelectorAll(".filters button"));
  function requested() {
    var h = location.hash.replace("#", "");
    var q = new URLSearchParams(location.search).get("filter");
    var f = FILTERS.indexOf(h) >= 0 ? h : (FILTERS.indexOf(q) >= 0 ? q : "all");
    return f;
  }
  function apply(f) {
    var shown = 0;
    tiles.forEach(function (t) {
      var hide = f !== "all" && t.dataset.outcome !== f;
      t.hidden = hide;
      if (!hide) shown++;
    });
    buttons.forEach(function (b) { b.classList.toggle("active", b.dataset.filter === f); });
    document.body.dataset.filter = f;
    document.getElementById("shown").textContent = shown;
  }
  buttons.forEach(function (b) {
    b.addEventListener("click", function () { location.hash = b.dataset.filter; });
  });
  window.addEventListener("hashchange", function () { apply(requested()); });
  apply(requested());
})();
"""


def render(tiles: list[Tile], title: str) -> str:
    e = html.escape
    counts = {k: sum(t.outcome == k for t in tiles) for k in ("success", "failure", "unknown")}
    envs = sorted({t.env_id for t in tiles if t.env_id})
    items = []
    for t in tiles:
        label = []
        if t.episode_id is not None:
            label.append(f"episode {t.episode_id}")
        if t.env_idx is not None:
            label.append(f"env {t.env_idx}")
        if t.part is not None:
            label.append(f"part {t.part}")
        if t.env_id:
            label.append(t.env_id)
        items.append(
            f'<figure class="tile {t.outcome}" data-outcome="{t.outcome}" '
            f'data-episode="{"" if t.episode_id is None else t.episode_id}">'
            f'<video src="{e(t.href)}" controls muted loop playsinline preload="metadata"></video>'
            f'<figcaption><span class="badge">{t.outcome}</span> {e(" · ".join(label))}'
            f'<div class="name">{e(t.href)}{f" (run {e(t.run)})" if t.run else ""}</div></figcaption></figure>'
        )
    buttons = "".join(
        f'<button type="button" data-filter="{f}">{f} ({len(tiles) if f == "all" else counts[f]})</button>'
        for f in FILTERS
    )
    summary = (
        f"{len(tiles)} videos: {counts['success']} success, {counts['failure']} failure, {counts['unknown']} unknown"
        + (f" · {e(', '.join(envs))}" if envs else "")
        + ' · showing <span id="shown">'
        + str(len(tiles))
        + "</span>"
    )
    body = "\n".join(items) if items else '<p class="empty">no videos in this folder</p>'
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{e(title)}</title>
<style>{_CSS}</style>
</head>
<body data-filter="all">
<h1>{e(title)}</h1>
<div class="summary">{summary}</div>
<div class="filters">{buttons}</div>
<main class="grid">
{body}
</main>
<script>{_JS}</script>
</body>
</html>
"""


def write_gallery(folder: str | Path, output: str | Path | None = None, title: str | None = None) -> Path:
    """Write the gallery page of ``folder``'s videos (default ``folder/gallery.html``); returns its path."""
    root = Path(folder)
    if not root.is_dir():
        raise ValueError(
            f"{str(root)!r} is not a folder; pass the folder a recording wrote its videos to (e.g. recordings)"
        )
    page = Path(output) if output is not None else root / "gallery.html"
    if not page.is_absolute() and output is not None and page.parent == Path("."):
        page = root / page  # a bare file name goes into the folder, next to the videos
    if not page.parent.is_dir():
        raise FileNotFoundError(f"cannot write {page}: its folder {page.parent} does not exist; create it, or pass "
                                f"--output in an existing folder")
    if not os.access(page.parent, os.W_OK):
        raise PermissionError(f"cannot write {page}: its folder {page.parent} is read-only; pass --output in a folder "
                              f"you can write to (nothing was written)")
    tiles = collect(root, page)
    if not tiles:
        raise ValueError(f"{str(root)!r} holds no MP4 video, nor do its subfolders: there is nothing to show. Pass "
                         f"the folder a recording wrote its videos to, or record with videos (fastrecord record "
                         f"without --no-video; RecordEpisode(..., save_video=True)); nothing was written")
    tmp = page.with_name(page.name + ".tmp")
    tmp.write_text(render(tiles, title or f"fastrecord gallery: {root.resolve().name}"), encoding="utf-8")
    os.replace(tmp, page)
    return page


def configure_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", help="the folder whose videos (MP4s, also in subfolders) the page shows")
    p.add_argument("--output", help="the page to write; a bare file name goes into DIR (default: DIR/gallery.html)")
    p.add_argument("--title", help="the page's heading (default: the folder's name)")


def main_from_args(args: argparse.Namespace) -> int:
    page = write_gallery(args.dir, args.output, args.title)
    n = page.read_text(encoding="utf-8").count("<video ")
    print(f"gallery of {n} videos: {page}")
    return 0
