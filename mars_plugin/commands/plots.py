"""Figures for MARS runs: coloured labels, "removed pixels" overlays, panel grids, IoU bar charts.

Conventions (the same as :mod:`mars_plugin.formats.files`):

* labels are (H, W) integer maps: 0 = background, 1..C = classes, 255 = ignore, -1 = biased
  (pixels MARS removed from a pseudo label); every id 0..255 is drawn with its PASCAL VOC colour
  (:func:`mars_plugin.formats.files.voc_palette`), so ignore is the VOC off-white (224, 224, 192) and -1
  is :data:`BIASED_COLOR` (bright magenta, a colour the VOC map never produces);
* images are (H, W, 3) uint8 RGB; torch tensors are accepted anywhere an array is and are
  copied to the CPU;
* every file is written through :func:`mars_plugin.formats.files.atomic_write` and is byte-for-byte
  deterministic: the same input gives the same PNG (no timestamps, no software version).

Pillow draws the panels and grids; matplotlib (Agg canvas only, never pyplot, imported lazily)
draws the bar charts. Neither is imported before a function needs it.
"""
from __future__ import annotations

import math
import numbers
import os
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from mars_plugin.formats.files import IGNORE_VALUE, atomic_write, voc_palette

__all__ = [
    "BIASED_COLOR",
    "PANEL_GAP",
    "TITLE_BAND",
    "CAPTION_BAND",
    "ROW_GAP",
    "GRID_MARGIN",
    "colorize_label",
    "blend",
    "removed_mask_image",
    "overlay_row",
    "overlay_grid",
    "save_overlay_grid",
    "class_legend",
    "legend_strip",
    "bar_chart_figure",
    "tick_label_boxes",
    "save_iou_bar_chart",
]

PathLike = Union[str, os.PathLike]
Panel = Tuple[str, Any]

#: RGB colour of biased (-1) pixels; no VOC palette entry has a channel above 224, so it is unique.
BIASED_COLOR: Tuple[int, int, int] = (255, 0, 255)
#: Pixels between two panels of a row.
PANEL_GAP = 4
#: Height in pixels of the title strip above each panel of a row.
TITLE_BAND = 16
#: Height in pixels of the caption strip above each row of a grid.
CAPTION_BAND = 18
#: Pixels between two rows of a grid.
ROW_GAP = 8
#: White border around a whole grid.
GRID_MARGIN = 6
#: Side in pixels of a colour swatch of a legend strip; one legend line is this tall plus 4.
SWATCH = 12

_BACKGROUND = (255, 255, 255)
_TEXT = (0, 0, 0)
_PALETTE = np.asarray(voc_palette(256), dtype=np.uint8).reshape(256, 3)
# Matplotlib's tab10, spelled out so that chart colours never depend on rcParams.
_SERIES_COLORS = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
    "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf",
)


# --------------------------------------------------------------------------- input checks


def _describe(x: Any) -> str:
    if isinstance(x, (torch.Tensor, np.ndarray)):
        return f"{type(x).__name__} of shape {tuple(x.shape)} and dtype {x.dtype}"
    return f"{type(x).__name__} {x!r}"[:200]


def _to_numpy(x: Any, name: str) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    if isinstance(x, np.ndarray):
        return x
    if isinstance(x, (list, tuple)):
        try:
            return np.asarray(x)
        except ValueError as e:
            raise ValueError(f"{name} must be an array or tensor, got {_describe(x)}") from e
    raise ValueError(f"{name} must be a numpy array or torch tensor, got {_describe(x)}")


def _check_label(x: Any, name: str) -> np.ndarray:
    """An (H, W) int64 label with values in {-1, 0..255}."""
    arr = _to_numpy(x, name)
    if arr.ndim != 2:
        raise ValueError(f"{name} must be an (H, W) label map, got {_describe(arr)}")
    if arr.dtype == np.bool_ or not (np.issubdtype(arr.dtype, np.integer) or np.issubdtype(arr.dtype, np.floating)):
        raise ValueError(f"{name} must be an integer label map, got {_describe(arr)}")
    if np.issubdtype(arr.dtype, np.floating):
        if not np.all(np.isfinite(arr)) or not np.all(arr == np.round(arr)):
            raise ValueError(f"{name} must hold integer class ids, got non-integer values ({_describe(arr)})")
    lab = arr.astype(np.int64)
    if lab.size and (lab.min() < -1 or lab.max() > 255):
        raise ValueError(
            f"{name} values must be -1 (biased), 0..255 (class ids, {IGNORE_VALUE} = ignore), "
            f"got the range [{int(lab.min())}, {int(lab.max())}]"
        )
    return lab


def _check_image(x: Any, name: str) -> np.ndarray:
    """An (H, W, 3) uint8 RGB image: channels last is required (never guessed: a 3x3 image
    reads both ways), and H, W >= 1."""
    arr = _to_numpy(x, name)
    if arr.ndim != 3 or arr.shape[2] != 3 or arr.dtype != np.uint8:
        hint = (" (channels first? the plots take channels last: image.permute(1, 2, 0) or "
                "np.moveaxis(image, 0, -1))" if arr.ndim == 3 and arr.shape[0] == 3 else "")
        raise ValueError(f"{name} must be an (H, W, 3) uint8 RGB image, got {_describe(arr)}{hint}")
    if arr.shape[0] < 1 or arr.shape[1] < 1:
        raise ValueError(f"{name} must have at least one pixel, got {_describe(arr)}")
    return arr


def _check_same_size(a: np.ndarray, a_name: str, b: np.ndarray, b_name: str) -> None:
    if a.shape[:2] != b.shape[:2]:
        raise ValueError(
            f"{a_name} and {b_name} must have the same height and width, got "
            f"{tuple(a.shape[:2])} and {tuple(b.shape[:2])}"
        )


def _check_fraction(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 <= float(value) <= 1.0:
        raise ValueError(f"{name} must be a number in [0, 1], got {_describe(value)}")
    return float(value)


def _check_scale(value: Any, name: str = "scale") -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {_describe(value)}")
    return int(value)


def _mix(a: np.ndarray, b: np.ndarray, alpha: float) -> np.ndarray:
    """round((1 - alpha) * a + alpha * b) as uint8 (float64 arithmetic, round half to even)."""
    out = (1.0 - alpha) * a.astype(np.float64) + alpha * b.astype(np.float64)
    return np.clip(np.rint(out), 0, 255).astype(np.uint8)


# --------------------------------------------------------------------------- label images


def colorize_label(label: Any) -> np.ndarray:
    """RGB picture of a label map.

    Args:
        label: (H, W) integer tensor or array; -1 = biased, 0..255 = class ids (0 background,
            255 ignore). Float arrays are accepted when they hold integers.

    Returns:
        (H, W, 3) uint8: VOC palette colour of each id (255 -> (224, 224, 192)), and
        :data:`BIASED_COLOR` for -1.
    """
    lab = _check_label(label, "label")
    rgb = _PALETTE[np.where(lab < 0, 0, lab)]
    rgb[lab == -1] = BIASED_COLOR
    return rgb


def blend(image: Any, label: Any, alpha: float = 0.5) -> np.ndarray:
    """The image with the label's colours laid over it.

    Args:
        image: (H, W, 3) uint8 RGB.
        label: (H, W) label as in :func:`colorize_label`.
        alpha: weight of the label colour in [0, 1].

    Returns:
        (H, W, 3) uint8: background (0) pixels are the image unchanged; every other pixel is
        ``round((1 - alpha) * image + alpha * colorize_label(label))``.
    """
    img = _check_image(image, "image")
    lab = _check_label(label, "label")
    _check_same_size(img, "image", lab, "label")
    alpha = _check_fraction(alpha, "alpha")
    out = _mix(img, colorize_label(lab), alpha)
    bg = lab == 0
    out[bg] = img[bg]
    return out


def removed_mask_image(
    image: Any,
    pseudo: Any,
    debiased: Any,
    *,
    dim: float = 0.4,
    tint: float = 0.35,
) -> np.ndarray:
    """Which pseudo-label pixels MARS removed, over a darkened image.

    Args:
        image: (H, W, 3) uint8 RGB.
        pseudo: (H, W) WSSS pseudo label (0 background, 1..C, 255 ignore).
        debiased: (H, W) debiased label of the same image, -1 on biased pixels.
        dim: brightness kept by the pixels that are not foreground any more, in [0, 1].
        tint: weight of the class colour on kept foreground pixels, in [0, 1].

    Returns:
        (H, W, 3) uint8 where

        * removed pixels (``pseudo`` in 1..254 and ``debiased == -1``) are exactly
          :data:`BIASED_COLOR`;
        * kept foreground pixels (``debiased`` in 1..254) are the full-brightness image tinted
          with their class colour: ``round((1 - tint) * image + tint * colour)``;
        * every other pixel is the image darkened to ``round(dim * image)``.

        With ``dim < 1`` or ``tint > 0`` no other pixel can equal :data:`BIASED_COLOR`
        (VOC colours stay below 225 per channel).
    """
    img = _check_image(image, "image")
    ps = _check_label(pseudo, "pseudo")
    db = _check_label(debiased, "debiased")
    _check_same_size(img, "image", ps, "pseudo")
    _check_same_size(img, "image", db, "debiased")
    dim = _check_fraction(dim, "dim")
    tint = _check_fraction(tint, "tint")

    out = np.clip(np.rint(img.astype(np.float64) * dim), 0, 255).astype(np.uint8)
    kept = (db > 0) & (db != IGNORE_VALUE)
    if kept.any():
        out[kept] = _mix(img[kept], _PALETTE[db[kept]], tint)
    removed = (ps > 0) & (ps != IGNORE_VALUE) & (db == -1)
    out[removed] = BIASED_COLOR
    return out


# --------------------------------------------------------------------------- panel rows and grids


def _font(size: int):
    """PIL's default font at ``size`` pixels (its fixed-size bitmap font on builds without FreeType)."""
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)
    except (TypeError, ImportError, OSError):  # Pillow < 10.1 or no FreeType
        return ImageFont.load_default()


def _fit_text(draw, text: str, font, width: int) -> str:
    """``text`` shortened with an ellipsis until it fits in ``width`` pixels."""
    if draw.textlength(text, font=font) <= width:
        return text
    while text and draw.textlength(text + "...", font=font) > width:
        text = text[:-1]
    return text + "..." if text else ""


def _panel_rgb(x: Any, name: str) -> np.ndarray:
    """An RGB panel: (H, W, 3) uint8 as is, (H, W) labels through :func:`colorize_label`."""
    arr = _to_numpy(x, name)
    if arr.ndim == 2:
        return colorize_label(_check_label(arr, name))
    return _check_image(arr, name)


def _check_panels(panels: Any, name: str) -> List[Tuple[str, Any]]:
    if isinstance(panels, (str, bytes)) or not isinstance(panels, Sequence):
        raise ValueError(f"{name} must be a list of (title, array) pairs, got {_describe(panels)}")
    out = []
    for i, p in enumerate(panels):
        if not (isinstance(p, (tuple, list)) and len(p) == 2 and isinstance(p[0], str)):
            raise ValueError(f"{name}[{i}] must be a (title, array) pair with a str title, got {_describe(p)}")
        out.append((p[0], p[1]))
    return out


def overlay_row(
    image: Optional[Any],
    panels: Sequence[Panel],
    scale: int = 3,
    *,
    image_title: str = "image",
) -> "PIL.Image.Image":  # noqa: F821
    """One row of equally sized panels, each with a short title above it.

    Typical use: ``overlay_row(img, [("pseudo label", pseudo), ("removed", removed_mask_image(img,
    pseudo, db)), ("MARS", pred)])`` -> "image | pseudo label | removed | MARS".

    Args:
        image: (H, W, 3) uint8 RGB drawn as the first panel, titled ``image_title``; ``None``
            for a row of ``panels`` only.
        panels: non-empty list of ``(title, array)``; an array is an (H, W, 3) uint8 RGB image
            or an (H, W) label (drawn with :func:`colorize_label`). All panels, and ``image``,
            must have the same (H, W).
        scale: integer nearest-neighbour up-scaling of every panel (64x64 images become
            192x192 at the default 3).
        image_title: title of the ``image`` panel.

    Returns:
        RGB ``PIL.Image`` of width ``n * W * scale + (n - 1) * PANEL_GAP`` and height
        ``TITLE_BAND + H * scale``, n = number of panels including ``image``; titles use the
        PIL default font, left-aligned, shortened with "..." when wider than a panel.
    """
    from PIL import Image, ImageDraw

    scale = _check_scale(scale)
    items = _check_panels(panels, "panels")
    if not items:
        raise ValueError("panels must be a non-empty list of (title, array) pairs, got an empty list")
    rgbs: List[Tuple[str, np.ndarray]] = []
    if image is not None:
        rgbs.append((image_title, _check_image(image, "image")))
    for i, (title, arr) in enumerate(items):
        rgb = _panel_rgb(arr, f"panels[{i}] ({title!r})")
        if rgbs and rgb.shape != rgbs[0][1].shape:
            first = "image" if image is not None else "panels[0]"
            raise ValueError(
                f"panels[{i}] ({title!r}) must have the same height and width as {first}, got "
                f"{tuple(rgb.shape[:2])} and {tuple(rgbs[0][1].shape[:2])}"
            )
        rgbs.append((title, rgb))

    h, w = rgbs[0][1].shape[:2]
    pw, ph = w * scale, h * scale
    n = len(rgbs)
    canvas = Image.new("RGB", (n * pw + (n - 1) * PANEL_GAP, TITLE_BAND + ph), _BACKGROUND)
    draw = ImageDraw.Draw(canvas)
    font = _font(11)
    for k, (title, rgb) in enumerate(rgbs):
        x0 = k * (pw + PANEL_GAP)
        big = np.repeat(np.repeat(rgb, scale, axis=0), scale, axis=1)
        canvas.paste(Image.fromarray(np.ascontiguousarray(big)), (x0, TITLE_BAND))
        draw.text((x0 + 1, 2), _fit_text(draw, title, font, pw - 2), fill=_TEXT, font=font)
    return canvas


def _check_rows(rows: Any) -> List[Tuple[str, List[Panel]]]:
    if isinstance(rows, (str, bytes)) or not isinstance(rows, Sequence):
        raise ValueError(f"rows must be a list of (caption, panels) pairs, got {_describe(rows)}")
    if not rows:
        raise ValueError("rows must be a non-empty list of (caption, panels) pairs, got an empty list")
    out = []
    for i, r in enumerate(rows):
        if not (isinstance(r, (tuple, list)) and len(r) == 2 and isinstance(r[0], str)):
            raise ValueError(f"rows[{i}] must be a (caption, panels) pair with a str caption, got {_describe(r)}")
        out.append((r[0], r[1]))
    return out


LegendEntry = Tuple[str, Tuple[int, int, int]]


def class_legend(
    class_names: Sequence[str],
    classes: Optional[Sequence[int]] = None,
    *,
    biased: bool = True,
    ignore: bool = True,
) -> List[LegendEntry]:
    """Legend entries ``(name, (r, g, b))`` for :func:`legend_strip`: the VOC colour of each class.

    Args:
        class_names: names of the label ids, background first (id = position).
        classes: the ids to list (default: all of ``class_names``), in this order.
        biased: append ``("removed (biased)", BIASED_COLOR)``, the colour of -1 pixels.
        ignore: append ``("ignore", (224, 224, 192))``, the colour of 255.
    """
    if isinstance(class_names, (str, bytes)) or not isinstance(class_names, Sequence):
        raise ValueError(f"class_names must be a sequence of str, got {_describe(class_names)}")
    ids = list(range(len(class_names))) if classes is None else _check_indices(classes, "classes", len(class_names),
                                                                              unique=True)
    out: List[LegendEntry] = [(str(class_names[c]), tuple(int(v) for v in _PALETTE[c])) for c in ids]
    if biased:
        out.append(("removed (biased)", BIASED_COLOR))
    if ignore:
        out.append(("ignore", tuple(int(v) for v in _PALETTE[IGNORE_VALUE])))
    return out


def _check_legend(entries: Any) -> List[LegendEntry]:
    if isinstance(entries, Mapping):
        entries = list(entries.items())
    if isinstance(entries, (str, bytes)) or not isinstance(entries, Sequence) or not entries:
        raise ValueError(f"legend must be a non-empty list of (name, (r, g, b)) pairs, got {_describe(entries)}")
    out = []
    for i, e in enumerate(entries):
        ok = isinstance(e, (tuple, list)) and len(e) == 2 and isinstance(e[0], str)
        rgb = tuple(e[1]) if ok and isinstance(e[1], (tuple, list, np.ndarray)) else ()
        if not ok or len(rgb) != 3 or not all(isinstance(v, numbers.Integral) and 0 <= v <= 255 for v in rgb):
            raise ValueError(f"legend[{i}] must be a (name, (r, g, b)) pair with 0..255 integers, got {_describe(e)}")
        out.append((e[0], tuple(int(v) for v in rgb)))
    return out


def legend_strip(entries: Any, width: int) -> "PIL.Image.Image":  # noqa: F821
    """A colour legend: one swatch (``SWATCH`` px, black outline) and its name per entry, laid
    out left to right and wrapped onto as many lines as ``width`` needs.

    Args:
        entries: non-empty list of ``(name, (r, g, b))`` (e.g. :func:`class_legend`) or a dict.
        width: width of the strip in pixels (>= 40).

    Returns:
        RGB ``PIL.Image`` of size ``(width, lines * (SWATCH + 4))``; a name wider than a line
        is shortened with "...".
    """
    from PIL import Image, ImageDraw

    items = _check_legend(entries)
    width = _check_scale(width, "width")
    if width < 40:
        raise ValueError(f"width must be >= 40 pixels, got {width}")
    font = _font(11)
    probe = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    line_h = SWATCH + 4
    placed = []  # (line, x, name, rgb)
    line, x = 0, 0
    for name, rgb in items:
        text = _fit_text(probe, name, font, width - SWATCH - 6)
        w = SWATCH + 4 + int(math.ceil(probe.textlength(text, font=font))) + 12
        if x > 0 and x + w > width:
            line, x = line + 1, 0
        placed.append((line, x, text, rgb))
        x += w
    canvas = Image.new("RGB", (width, (line + 1) * line_h), _BACKGROUND)
    draw = ImageDraw.Draw(canvas)
    for ln, x0, text, rgb in placed:
        y0 = ln * line_h + 2
        draw.rectangle([x0, y0, x0 + SWATCH - 1, y0 + SWATCH - 1], fill=rgb, outline=_TEXT)
        draw.text((x0 + SWATCH + 4, y0), text, fill=_TEXT, font=font)
    return canvas


def overlay_grid(
    rows: Sequence[Tuple[str, Sequence[Panel]]],
    scale: int = 3,
    *,
    legend: Any = None,
) -> "PIL.Image.Image":  # noqa: F821
    """Several :func:`overlay_row` rows stacked, each under its own caption.

    Args:
        rows: non-empty list of ``(caption, panels)``, e.g. ``("boat: syn_000012", [("image",
            img), ("pseudo label", pseudo), ...])``; ``panels`` as in :func:`overlay_row` (with
            no separate image). Rows may differ in panel count and size; they are left-aligned.
        scale: nearest-neighbour up-scaling of every panel.
        legend: ``None``, or the entries of a :func:`legend_strip` drawn under the last row
            (e.g. :func:`class_legend`), so that every colour of the panels has a name.

    Returns:
        RGB ``PIL.Image`` of width ``max(row widths) + 2 * GRID_MARGIN`` and height
        ``sum(CAPTION_BAND + row heights) + (len(rows) - 1) * ROW_GAP + 2 * GRID_MARGIN``, plus
        ``ROW_GAP`` and the legend strip's height when there is a legend.
    """
    from PIL import Image, ImageDraw

    scale = _check_scale(scale)
    checked = _check_rows(rows)
    images = []
    for i, (caption, panels) in enumerate(checked):
        try:
            images.append(overlay_row(None, panels, scale))
        except ValueError as e:
            raise ValueError(f"rows[{i}] ({caption!r}): {e}") from e
    width = max(im.width for im in images) + 2 * GRID_MARGIN
    height = sum(CAPTION_BAND + im.height for im in images) + (len(images) - 1) * ROW_GAP + 2 * GRID_MARGIN
    strip = None
    if legend is not None:
        strip = legend_strip(legend, max(40, width - 2 * GRID_MARGIN))
        width = max(width, strip.width + 2 * GRID_MARGIN)
        height += ROW_GAP + strip.height
    canvas = Image.new("RGB", (width, height), _BACKGROUND)
    draw = ImageDraw.Draw(canvas)
    font = _font(13)
    y = GRID_MARGIN
    for (caption, _), im in zip(checked, images):
        draw.text((GRID_MARGIN, y + 1), _fit_text(draw, caption, font, width - 2 * GRID_MARGIN), fill=_TEXT, font=font)
        y += CAPTION_BAND
        canvas.paste(im, (GRID_MARGIN, y))
        y += im.height + ROW_GAP
    if strip is not None:
        canvas.paste(strip, (GRID_MARGIN, y))
    return canvas


def save_overlay_grid(path: PathLike, rows: Sequence[Tuple[str, Sequence[Panel]]], scale: int = 3, *,
                      legend: Any = None) -> None:
    """Write :func:`overlay_grid` of ``rows`` (with its ``legend``) as a PNG at ``path``,
    atomically and deterministically."""
    grid = overlay_grid(rows, scale, legend=legend)
    atomic_write(path, lambda tmp: grid.save(tmp, format="PNG"))


# --------------------------------------------------------------------------- bar charts


def _check_indices(values: Any, name: str, n: int, *, unique: bool) -> List[int]:
    if isinstance(values, (str, bytes)) or not isinstance(values, (Sequence, np.ndarray, torch.Tensor)):
        raise ValueError(f"{name} must be a sequence of class indices, got {_describe(values)}")
    out = []
    for v in (values.tolist() if isinstance(values, (np.ndarray, torch.Tensor)) else values):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or not 0 <= v < n:
            raise ValueError(f"{name} must hold class indices in 0..{n - 1} (positions in class_names), got {v!r}")
        out.append(int(v))
    if unique and len(set(out)) != len(out):
        raise ValueError(f"{name} must not repeat a class index, got {out}")
    return out


def _wrap_name(name: str, width: int = 14, max_lines: int = 3) -> str:
    """A class name on at most ``max_lines`` lines of about ``width`` characters (long words are
    broken; a name longer than that ends in "...")."""
    import textwrap

    lines: List[str] = []
    for part in name.split("\n"):
        lines += textwrap.wrap(part, width, break_long_words=True, break_on_hyphens=True) or [""]
    if len(lines) > max_lines:
        lines = lines[:max_lines]
        lines[-1] = lines[-1][: max(1, width - 3)] + "..."
    return "\n".join(lines)


def _boxes_overlap(boxes: Sequence[Any], pad: float = 1.0) -> bool:
    """Whether any two (x0, y0, x1, y1) display boxes overlap by more than ``pad`` pixels."""
    for i in range(len(boxes)):
        a = boxes[i]
        for b in boxes[i + 1 :]:
            if min(a.x1, b.x1) - max(a.x0, b.x0) > pad and min(a.y1, b.y1) - max(a.y0, b.y0) > pad:
                return True
    return False


def tick_label_boxes(fig: Any) -> List[Any]:
    """Display-space bounding boxes (matplotlib ``Bbox``, pixels) of the x tick labels of the
    first axes of ``fig``, as drawn by its renderer: what a test checks for overlaps."""
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[0]
    return [t.get_window_extent(renderer) for t in ax.get_xticklabels() if t.get_text()]


def bar_chart_figure(
    class_names: Sequence[str],
    series: Mapping[str, Sequence[float]],
    title: str,
    ylabel: str = "IoU (%)",
    highlight: Sequence[int] = (),
    *,
    order: Optional[Sequence[int]] = None,
    value_labels: bool = True,
    value_format: str = "{:.1f}",
    ymax: Optional[float] = None,
    highlight_note: Optional[str] = "* highlighted classes",
    note: Optional[str] = None,
    tick_notes: Optional[Sequence[str]] = None,
    dpi: int = 120,
) -> Any:
    """The matplotlib ``Figure`` (Agg canvas, laid out) that :func:`save_iou_bar_chart` writes;
    see there for the arguments. Tick labels never overlap: names are wrapped, turned by 0, 45
    or 90 degrees, whichever is the first whose rendered boxes do not overlap, and the figure is
    widened until they do not."""
    if isinstance(class_names, (str, bytes)) or not isinstance(class_names, Sequence):
        raise ValueError(f"class_names must be a sequence of str, got {_describe(class_names)}")
    names = [str(c) for c in class_names]
    if not names:
        raise ValueError("class_names must not be empty")
    n = len(names)
    if not isinstance(series, Mapping) or not series:
        raise ValueError(f"series must be a non-empty dict {{name: {n} values}}, got {_describe(series)}")
    table: Dict[str, np.ndarray] = {}
    for key, vals in series.items():
        label = f"series[{key!r}]"
        if isinstance(vals, (str, bytes)):
            raise ValueError(f"{label} must be {n} numbers (one per class), got {_describe(vals)}")
        try:
            arr = np.asarray(_to_numpy(vals, label) if isinstance(vals, torch.Tensor) else vals, dtype=np.float64)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{label} must be {n} numbers (one per class), got {_describe(vals)}") from e
        if arr.shape != (n,):
            raise ValueError(
                f"{label} must hold one value per class ({n}, as class_names), got shape {arr.shape}"
            )
        if np.isinf(arr).any():
            raise ValueError(f"{label} holds infinite values; use NaN for an absent class")
        table[str(key)] = arr
    hl = set(_check_indices(highlight, "highlight", n, unique=False))
    idx = list(range(n)) if order is None else _check_indices(order, "order", n, unique=True)
    if not idx:
        raise ValueError("order must select at least one class, got an empty sequence")
    if not isinstance(title, str):
        raise ValueError(f"title must be a str, got {_describe(title)}")
    if not isinstance(ylabel, str):
        raise ValueError(f"ylabel must be a str, got {_describe(ylabel)}")
    if note is not None and not isinstance(note, str):
        raise ValueError(f"note must be a str or None, got {_describe(note)}")
    if tick_notes is not None:
        if isinstance(tick_notes, (str, bytes)) or not isinstance(tick_notes, Sequence) or len(tick_notes) != n \
                or not all(isinstance(t, str) for t in tick_notes):
            raise ValueError(f"tick_notes must be {n} str (one per class, as class_names), got {_describe(tick_notes)}")
    if isinstance(dpi, bool) or not isinstance(dpi, numbers.Integral) or dpi < 10:
        raise ValueError(f"dpi must be an integer >= 10, got {_describe(dpi)}")
    finite = np.concatenate([a[idx][np.isfinite(a[idx])] for a in table.values()])
    if ymax is None:
        top = float(finite.max()) if finite.size else 0.0
        ymax = top * 1.15 if top > 0 else 1.0
    elif isinstance(ymax, bool) or not isinstance(ymax, numbers.Real) or not math.isfinite(ymax) or ymax <= 0:
        raise ValueError(f"ymax must be a positive finite number, got {_describe(ymax)}")
    ymin = min(0.0, float(finite.min()) * 1.15) if finite.size else 0.0

    try:
        import matplotlib
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("save_iou_bar_chart needs matplotlib: pip install matplotlib") from e
    import textwrap
    import warnings

    k = len(table)
    m = len(idx)
    group = 0.8
    width = group / k
    fig_w = max(6.0, 1.2 + m * (0.28 * k + 0.35))
    fig_h = 4.4
    labels = [_wrap_name(names[i]) + (" *" if i in hl else "") + (f"\n{tick_notes[i]}" if tick_notes else "")
              for i in idx]
    with matplotlib.rc_context({"svg.hashsalt": "mars", "font.family": "DejaVu Sans"}):
        fig = Figure(figsize=(fig_w, fig_h), dpi=dpi)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot(1, 1, 1)
        x = np.arange(m, dtype=np.float64)
        label_size = 7 if k * m <= 48 else 6
        for s, (key, arr) in enumerate(table.items()):
            vals = arr[idx]
            pos = x - group / 2 + (s + 0.5) * width
            ok = np.isfinite(vals)
            ax.bar(pos[ok], vals[ok], width=width * 0.92, color=_SERIES_COLORS[s % len(_SERIES_COLORS)],
                   label=key, zorder=2)
            for p, v, good in zip(pos, vals, ok):
                if not good:
                    ax.text(p, 0, "n/a", ha="center", va="bottom", rotation=90, fontsize=label_size,
                            color="0.45", zorder=3)
                elif value_labels:
                    ax.text(p, max(v, 0.0) + 0.01 * (ymax - ymin), value_format.format(v), ha="center",
                            va="bottom", rotation=90, fontsize=label_size, zorder=3)
        ax.set_xticks(x)
        ticks = ax.set_xticklabels(labels, fontsize=8)
        for t, i in zip(ticks, idx):
            if i in hl:
                t.set_fontweight("bold")
        ax.set_xlim(-0.6, m - 0.4)
        ax.set_ylim(ymin, ymax)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(axis="y", color="0.88", zorder=0)
        ax.set_axisbelow(True)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False, fontsize=8)
        notes = [t for t in (note, highlight_note if hl else None) if t]

        def layout() -> bool:
            # The note under the tick labels, wrapped to the figure width (~7 pt characters).
            chars = max(40, int(fig.get_figwidth() * 72 / 4.2))
            ax.set_xlabel("\n".join(textwrap.fill(t, chars) for t in notes), fontsize=7, color="0.3",
                          loc="left") if notes else None
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # tight_layout's "not compatible" chatter
                fig.tight_layout()
            return not _boxes_overlap(tick_label_boxes(fig))

        for rotation in (0, 45, 90):
            for t in ticks:
                t.set_rotation(rotation)
                t.set_rotation_mode("anchor" if rotation else "default")
                t.set_horizontalalignment("right" if rotation else "center")
                t.set_verticalalignment("center" if rotation == 90 else "top")
            if layout():
                break
        # Room under the axes for turned labels: grow the figure by the labels' height.
        label_h = max(b.height for b in tick_label_boxes(fig)) / dpi
        if label_h > 0.8:
            fig.set_size_inches(fig.get_figwidth(), fig_h + label_h - 0.5)
            layout()
        for _ in range(12):  # still overlapping at 90 degrees: widen (labels do not scale)
            if not _boxes_overlap(tick_label_boxes(fig)):
                break
            fig.set_size_inches(fig.get_figwidth() * 1.25, fig.get_figheight())
            layout()
    return fig


def save_iou_bar_chart(
    path: PathLike,
    class_names: Sequence[str],
    series: Mapping[str, Sequence[float]],
    title: str,
    ylabel: str = "IoU (%)",
    highlight: Sequence[int] = (),
    *,
    order: Optional[Sequence[int]] = None,
    value_labels: bool = True,
    value_format: str = "{:.1f}",
    ymax: Optional[float] = None,
    highlight_note: Optional[str] = "* highlighted classes",
    note: Optional[str] = None,
    tick_notes: Optional[Sequence[str]] = None,
    dpi: int = 120,
) -> None:
    """Grouped bar chart, one group per class and one bar per series, written as a PNG.

    Serves per-class IoU tables ("WSSS pseudo", "debiased", "plain CE", "MARS") as well as a
    single ranked series (e.g. the share of pseudo-label pixels marked biased per class).

    Args:
        path: output PNG path (written atomically; same input -> same bytes).
        class_names: the C class names (non-empty); long names are wrapped onto up to 3 lines.
        series: non-empty ``{name: C values}`` in legend order; NaN means "class absent": no
            bar, "n/a" written in its slot. Infinite values are refused.
        title: chart title.
        ylabel: y-axis label.
        highlight: class indices (positions in ``class_names``) whose tick labels are bold and
            marked with "*"; ``highlight_note`` explains the mark under the chart.
        order: class indices to draw, left to right (a permutation or a subset; default: all in
            the given order). ``highlight`` always refers to the original positions.
        value_labels: write each value (``value_format``) above its bar.
        ymax: top of the y axis; default: 1.15 x the largest value (room for value labels), and
            1 when every value is NaN or <= 0.
        highlight_note: text under the chart when ``highlight`` is not empty; ``None`` for none.
        note: text under the chart (wrapped), e.g. what the values mean; ``None`` for none.
        tick_notes: one short str per class drawn on a line under its name (e.g. a pixel count).
        dpi: resolution of the PNG.

    The figure is as wide as the classes need: tick labels are turned (0, 45 or 90 degrees)
    and the figure widened until their rendered boxes do not overlap (:func:`bar_chart_figure`).
    """
    fig = bar_chart_figure(
        class_names, series, title, ylabel, highlight, order=order, value_labels=value_labels,
        value_format=value_format, ymax=ymax, highlight_note=highlight_note, note=note, tick_notes=tick_notes,
        dpi=dpi,
    )

    def write(tmp: str) -> None:
        fig.savefig(tmp, format="png", dpi=dpi, metadata={"Software": None}, facecolor="white")

    atomic_write(path, write)
