"""Joining episode videos into one LeRobot video file without re-encoding.

Each episode's frames are encoded on their own (in fastrecord's encoder processes, in parallel); a
dataset file is then those MP4s' packets one after the other in one MP4 (a remux: no decode, no
encode), each episode's timestamps shifted to start where the previous one ended. Every episode starts
with a key frame, so every frame decodes, and the shift is returned as the episode's
``from_timestamp`` / ``to_timestamp`` (LeRobot's reader seeks ``from_timestamp + frame_index / fps``).
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Sequence
from pathlib import Path

import av


def concat_mp4(segments: Sequence[Path], out: Path) -> list[tuple[float, float]]:
    """Write ``segments`` (MP4s of one codec and size) one after the other into ``out`` (through a
    temporary file and an atomic rename); returns each segment's (from, to) time in seconds in ``out``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    spans: list[tuple[float, float]] = []
    try:
        with av.open(str(tmp), "w", format="mp4") as container:
            ostream = None
            end_pts = 0  # where the next segment's first frame goes, in the stream's time base
            last_dts = None
            time_base = None
            for path in segments:
                with av.open(str(path)) as src:
                    stream = src.streams.video[0]
                    packets = [p for p in src.demux(stream) if p.dts is not None]
                    if not packets:
                        raise ValueError(f"{path} holds no video packets")
                    if ostream is None:
                        ostream = container.add_stream_from_template(stream, opaque=True)
                        time_base = stream.time_base
                    elif stream.time_base != time_base:
                        raise ValueError(
                            f"{path}: time base {stream.time_base} differs from the first video's {time_base}"
                        )
                    first_pts = min(p.pts for p in packets)
                    shift = end_pts - first_pts
                    if last_dts is not None:  # decode order stays increasing (encoders with B-frames start below 0)
                        shift = max(shift, last_dts + 1 - min(p.dts for p in packets))
                    seg_end = max(p.pts + (p.duration or 0) for p in packets)
                    last_dts = max(p.dts for p in packets) + shift
                    for p in packets:
                        p.pts += shift
                        p.dts += shift
                        p.stream = ostream
                        container.mux(p)
                    spans.append((float((first_pts + shift) * time_base), float((seg_end + shift) * time_base)))
                    end_pts = seg_end + shift
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return spans


def split_mp4(src: Path, spans: Sequence[tuple[float, float]], outs: Sequence[Path]) -> None:
    """Cut the episodes at ``spans`` (their (from, to) times in seconds, as `concat_mp4` returned them) out
    of the dataset video ``src`` into ``outs`` (one MP4 each, its first frame at time 0) without
    re-encoding, in one pass over ``src``: the inverse of `concat_mp4` (each episode starts with a key
    frame, and its packets follow one another in the file)."""
    if len(spans) != len(outs):
        raise ValueError(f"split_mp4: {len(spans)} spans but {len(outs)} outputs")
    with av.open(str(src)) as container:
        stream = container.streams.video[0]
        tb = stream.time_base
        ticks = sorted((round(a / tb), round(b / tb), Path(o)) for (a, b), o in zip(spans, outs, strict=True))
        got: dict[Path, list[tuple[av.Packet, int, int]]] = {o: [] for _, _, o in ticks}  # (packet, pts, dts) in out
        starts = [a for a, _, _ in ticks]
        for p in container.demux(stream):
            if p.dts is None or p.pts is None:
                continue
            j = bisect.bisect_right(starts, p.pts) - 1
            if j >= 0 and p.pts < ticks[j][1]:
                first = ticks[j][0]
                got[ticks[j][2]].append((p, p.pts - first, p.dts - first))
        for a, b, out in ticks:
            if not got[out]:
                raise ValueError(
                    f"{src} holds no video packets between {float(a * tb):.4f} s and {float(b * tb):.4f} s "
                    f"(an episode's from/to_timestamp in meta/episodes): the dataset's video and metadata disagree"
                )
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
            try:
                with av.open(str(tmp), "w", format="mp4") as dst:
                    ostream = dst.add_stream_from_template(stream, opaque=True)
                    for p, pts, dts in got.pop(out):
                        p.pts, p.dts = pts, dts
                        p.stream = ostream
                        dst.mux(p)
                os.replace(tmp, out)
            finally:
                tmp.unlink(missing_ok=True)
