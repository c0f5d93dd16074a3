"""Panel rows and grids for MARS figures: titled panels side by side, captioned rows, a class
legend strip, saved as PNG. Pillow draws them; it is not imported before a function needs it.
Every file is written through :func:`mars_plugin.formats.files.atomic_write` and is byte-for-byte
deterministic. Labels and images follow :mod:`mars_plugin.pictures.label_images`.
"""
from __future__ import annotations

import math
import numbers
import os
from typing import Any, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from mars_plugin.formats.files import IGNORE_VALUE, atomic_write

from mars_plugin.pictures.label_images import (
    _PALETTE,
    BIASED_COLOR,
    _check_image,
    _check_indices,
    _check_label,
    _check_scale,
    _describe,
    _to_numpy,
    colorize_label,
)

__all__ = [
    "PANEL_GAP",
    "TITLE_BAND",
    "CAPTION_BAND",
    "ROW_GAP",
    "GRID_MARGIN",
    "SWATCH",
    "overlay_row",
    "overlay_grid",
    "save_overlay_grid",
    "class_legend",
    "legend_strip",
]

PathLike = Union[str, os.PathLike]
Panel = Tuple[str, Any]

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
