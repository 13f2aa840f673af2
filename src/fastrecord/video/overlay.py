"""The info overlay (``info_on_video``): ManiSkill's ``put_info_on_image`` text, drawn where the video is encoded.

`Overlay` carries an episode's recorded scalars as columns (one small array per info key, one value per
step), not as per-frame Python dicts: the stepping thread only records the scalars, and the text is
formatted and drawn by `draw_overlay` in the encoder process (or the writer thread) of that video.

Text: ManiSkill's font (UbuntuSansMono, green), ``key: value`` lines with floats as ``%.3f``, scaled to the
frame (ManiSkill's 16 px from 256 px tall frames up, never below 8 px), success, fail, reward and
elapsed_steps first, at most `OVERLAY_MAX_FRACTION` of the height covered, long lines cut, a dark band
behind the text. The first frame (the reset) carries no text, as in ManiSkill.

This module imports only numpy (PIL lazily): encoder processes import it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, overload

import numpy as np

OVERLAY_FIRST = ("success", "fail", "reward", "elapsed_steps")
OVERLAY_MAX_FRACTION = 0.45
FONT_NAME = "UbuntuSansMono-Regular.ttf"  # ManiSkill's, in mani_skill/utils/visualization


def maniskill_font() -> str:
    """The path of ManiSkill's overlay font (imports ManiSkill: call it in the parent, not in encoders)."""
    import os

    from mani_skill.utils.visualization import misc

    return os.path.join(os.path.dirname(misc.__file__), FONT_NAME)


@dataclass(frozen=True)
class Overlay(Sequence[dict[str, Any]]):
    """One video's info text as columns (one value per episode step and key).

    Frame ``f`` of the video (``0 <= f < frames``) is frame ``p = offset + f`` of the episode: frame 0 is the
    reset (no text); with ``per_step`` frames a step (``render_substeps``: the substeps' frames, then the
    step's), frame ``p >= 1`` belongs to step ``t = (p - 1) // per_step + 1`` and the last of them shows
    ``{key: columns[key][t - 1]}``, the others no text (as ManiSkill draws the info on the step's frame only).
    Indexing and slicing work like the per-frame list of dicts it stands for (``overlay[f]`` -> dict,
    ``overlay[lo:hi]`` -> `Overlay`).
    """

    columns: Mapping[str, np.ndarray]  # key -> [T] values of steps 1..T
    font: str  # path of the TrueType font
    frames: int  # frames of the video this overlay covers
    offset: int = 0  # episode frame shown on the video's first frame
    per_step: int = 1  # frames of each step

    @classmethod
    def of_episode(cls, columns: Mapping[str, np.ndarray], font: str, per_step: int = 1) -> Overlay:
        steps = {len(v) for v in columns.values()}
        if len(steps) > 1:
            raise ValueError(f"overlay columns of different lengths {sorted(steps)}: one value per step for every key")
        t = steps.pop() if steps else 0
        return cls({k: np.asarray(v).reshape(t) for k, v in columns.items()}, font, t * per_step + 1, 0, per_step)

    def _step(self, p: int) -> int:
        """The step whose text episode frame ``p`` shows (0: none)."""
        if p == 0 or (p - 1) % self.per_step != self.per_step - 1:
            return 0
        return (p - 1) // self.per_step + 1

    def __len__(self) -> int:
        return self.frames

    def __bool__(self) -> bool:
        return bool(self.columns) and self.frames > 0

    @overload
    def __getitem__(self, i: int) -> dict[str, Any]: ...

    @overload
    def __getitem__(self, i: slice) -> Overlay: ...

    def __getitem__(self, i: int | slice) -> dict[str, Any] | Overlay:
        if isinstance(i, slice):
            lo, hi, step = i.indices(self.frames)
            if step != 1:
                raise ValueError(f"an Overlay slices with step 1 only, got {i}")
            return Overlay(self.columns, self.font, max(0, hi - lo), self.offset + lo, self.per_step)
        f = i + self.frames if i < 0 else i
        if not 0 <= f < self.frames:
            raise IndexError(f"overlay frame {i} of {self.frames}")
        t = self._step(self.offset + f)
        return {} if t == 0 else {k: v[t - 1].item() for k, v in self.columns.items()}

    def __iter__(self) -> Iterator[dict[str, Any]]:
        cols = {k: v.tolist() for k, v in self.columns.items()}  # python scalars, as ManiSkill formats them
        for f in range(self.frames):
            t = self._step(self.offset + f)
            yield {} if t == 0 else {k: v[t - 1] for k, v in cols.items()}


def overlay_lines(info: Mapping[str, Any], max_lines: int, max_chars: int) -> list[str]:
    keys = [k for k in OVERLAY_FIRST if k in info] + [k for k in info if k not in OVERLAY_FIRST]
    lines = []
    for k in keys[:max_lines]:
        v = info[k]
        text = f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {v}"
        lines.append(text if len(text) <= max_chars else text[: max(1, max_chars - 1)] + "~")
    return lines


class _Face:
    """One font at one size, with its glyphs' coverage masks cached: ``mask(text)`` is the line's antialiased
    coverage ``[height, width]`` float32 in 0..1, as PIL draws it at ``(0, 0)`` (anchor "la"). FreeType
    renders each character once per process rather than every line of every frame (it cost ~1 ms a line:
    8 lines made the overlay ~10 ms a 512x512 frame, more than encoding it)."""

    def __init__(self, path: str, size: int) -> None:
        from PIL import ImageFont

        self.font = ImageFont.truetype(path, size=size)
        ascent, descent = self.font.getmetrics()
        self.height = ascent + descent
        self._glyphs: dict[str, tuple[np.ndarray, int]] = {}
        self._lines: dict[str, np.ndarray] = {}
        self._lengths: dict[str, float] = {}

    def length(self, text: str) -> float:
        n = self._lengths.get(text)
        if n is None:
            n = self.font.getlength(text)
            if len(self._lengths) < 4096:
                self._lengths[text] = n
        return n

    def _glyph(self, ch: str) -> tuple[np.ndarray, int]:
        g = self._glyphs.get(ch)
        if g is None:
            from PIL import Image, ImageDraw

            advance = round(self.font.getlength(ch))
            left, _, right, _ = self.font.getbbox(ch, anchor="la")
            x0 = min(0, int(left))  # ink left of the pen (rare): kept, drawn that far left of the cell
            width = max(advance, int(np.ceil(right))) - x0
            img = Image.new("L", (max(1, width), self.height), 0)
            ImageDraw.Draw(img).text((-x0, 0), ch, fill=255, font=self.font, anchor="la")
            g = self._glyphs[ch] = (np.asarray(img, dtype=np.float32) / 255.0, x0)
        return g

    def mask(self, text: str) -> np.ndarray:
        m = self._lines.get(text)
        if m is None:
            glyphs = [self._glyph(ch) for ch in text]
            pens = [round(self.font.getlength(text[:i])) for i in range(len(text))]
            width = max([pen + x0 + g.shape[1] for (g, x0), pen in zip(glyphs, pens, strict=True)] + [1])
            m = np.zeros((self.height, width), dtype=np.float32)
            for (g, x0), pen in zip(glyphs, pens, strict=True):
                lo = pen + x0
                np.maximum(m[:, max(0, lo): lo + g.shape[1]], g[:, max(0, -lo):], out=m[:, max(0, lo): lo + g.shape[1]])
            if len(self._lines) < 4096:  # repeated lines ("success: False") are made once
                self._lines[text] = m
        return m


_fonts: dict[tuple[str, int], _Face] = {}
BAND_ALPHA = 110  # the dark band behind the text (ManiSkill's black, alpha 110 of 255)
TEXT_RGB = (0, 255, 0)


def draw_overlay(frames: np.ndarray, overlay: Any, font: str | None = None, fmt: str = "rgb24") -> np.ndarray:
    """A copy of ``frames`` with each frame's info drawn on it (``overlay``: an `Overlay`, or a per-frame sequence
    of dicts with ``font`` given). ``fmt``: "rgb24" (``[T, H, W, 3]`` uint8) or "yuv420p" (``[T, H * 3 // 2, W]``
    uint8, the layout of `fastrecord.video.yuv.Yuv420Frames`: frames converted on the GPU keep that saving).

    The picture of PIL's ``ImageDraw.text`` on a dark RGBA band alpha-composited over the frame (drawing with
    PIL for every frame is slower), computed with numpy from cached glyph masks: per pixel
    of the band, with text coverage ``m``, the band's colour is ``m * green`` and its alpha
    ``a = (110 + 145 m) / 255``, over the frame: ``band * a + frame * (1 - a)``. In yuv420p the same sum is taken
    of the planes (an affine map of RGB keeps it): luma per pixel; chroma per 2x2 block with the block's mean
    ``1 - a`` and ``m a``, which equals the RGB picture's chroma where ``a`` is even over the block (the band; at
    a glyph's edge the frame's four pixels are taken as alike)."""
    font_path = font or getattr(overlay, "font", None)
    if font_path is None:
        raise ValueError(
            "draw_overlay needs the font: pass an Overlay, or font=fastrecord.video.overlay.maniskill_font()"
        )
    if fmt not in ("rgb24", "yuv420p"):
        raise ValueError(f"draw_overlay draws on 'rgb24' or 'yuv420p' frames, got fmt={fmt!r}")
    out = np.array(frames, copy=True)
    h, w = (out.shape[1] * 2 // 3, out.shape[2]) if fmt == "yuv420p" else out.shape[1:3]
    for s, cover in _covers(overlay, font_path, h, w, len(out)):
        alpha = (BAND_ALPHA + (255 - BAND_ALPHA) * cover) / 255.0
        if fmt == "rgb24":
            band = out[s, : cover.shape[0], : cover.shape[1]].astype(np.float32) * (1.0 - alpha)[..., None]
            band += (cover * alpha)[..., None] * _GREEN
            out[s, : cover.shape[0], : cover.shape[1]] = np.clip(band + 0.5, 0, 255).astype(np.uint8)
        else:
            _composite_yuv420p(out[s], cover, alpha, h, w)
    return out


_GREEN = np.asarray(TEXT_RGB, dtype=np.float32)
# the green's offsets from black in BT.601 limited range (Y above 16, U and V about 128), as
# `fastrecord.video.yuv.rgb_to_yuv420p` converts: 255 * the G coefficients
_GREEN_YUV = (128.553, -74.203, -93.786)


def _covers(overlay: Any, font_path: str, h: int, w: int, frames: int) -> Iterator[tuple[int, np.ndarray]]:
    """Each frame with text and its band's coverage: ``(frame, [bh, bw] float32 in 0..1)``, the band being the
    ManiSkill-style rectangle (0, 0, width + 2 margin, lines * line_h + margin), ends included."""
    size = max(8, min(16, round(16 * h / 256)))
    face = _fonts.get((font_path, size))
    if face is None:
        face = _fonts[(font_path, size)] = _Face(font_path, size)
    line_h = size + max(1, size // 4)
    margin = max(2, size // 4)
    char_w = max(1.0, face.length("0"))
    max_lines = max(1, int(OVERLAY_MAX_FRACTION * h) // line_h)
    max_chars = max(4, int((w - 2 * margin) // char_w))
    for s, info in enumerate(overlay):
        if s >= frames:
            break
        if not info:
            continue
        lines = overlay_lines(info, max_lines, max_chars)
        width = int(max(face.length(t) for t in lines))
        bw, bh = min(w, width + 2 * margin + 1), min(h, len(lines) * line_h + margin + 1)
        cover = np.zeros((bh, bw), dtype=np.float32)
        for i, text in enumerate(lines):
            m = face.mask(text)
            y, x = margin // 2 + i * line_h, margin
            hh, ww = min(m.shape[0], bh - y), min(m.shape[1], bw - x)
            if hh > 0 and ww > 0:
                np.maximum(cover[y: y + hh, x: x + ww], m[:hh, :ww], out=cover[y: y + hh, x: x + ww])
        yield s, cover


def _composite_yuv420p(frame: np.ndarray, cover: np.ndarray, alpha: np.ndarray, h: int, w: int) -> None:
    """The band composited in place on one yuv420p frame ``[H * 3 // 2, W]``: the Y plane's ``H`` rows, then U's and
    V's ``H / 2 x W / 2`` pixels, each plane's rows packed two to a row of ``W``."""
    bh, bw = cover.shape
    y = frame[:h, :bw][:bh]
    ink = cover * alpha  # m a: how much of the green each pixel takes
    y[:] = np.clip((y.astype(np.float32) - 16.0) * (1.0 - alpha) + ink * _GREEN_YUV[0] + 16.5, 0, 255).astype(np.uint8)
    ch, cw = (bh + 1) // 2, (bw + 1) // 2  # the chroma blocks the band touches (a half block outside it: alpha 0)
    keep = np.ones((2 * ch, 2 * cw), dtype=np.float32)
    keep[:bh, :bw] -= alpha
    took = np.zeros((2 * ch, 2 * cw), dtype=np.float32)
    took[:bh, :bw] = ink
    keep, took = _block_mean(keep), _block_mean(took)
    q = (h // 2) * (w // 2)
    for k, green in ((0, _GREEN_YUV[1]), (1, _GREEN_YUV[2])):
        plane = frame[h:].reshape(-1)[k * q: (k + 1) * q].reshape(h // 2, w // 2)[:ch, :cw]
        plane[:] = np.clip((plane.astype(np.float32) - 128.0) * keep + took * green + 128.5, 0, 255).astype(np.uint8)


def _block_mean(a: np.ndarray) -> np.ndarray:
    """The mean of each 2x2 block of ``a`` (even sides): four strided adds (numpy's mean over the reshaped
    block axes was most of the overlay's time)."""
    return (a[0::2, 0::2] + a[1::2, 0::2] + a[0::2, 1::2] + a[1::2, 1::2]) * 0.25
