"""IoU bar charts for MARS figures: one bar per class and series, tick labels that never overlap.
matplotlib draws them (Agg canvas only, never pyplot, imported lazily: not before a function
needs it). Every file is written through :func:`mars_plugin.formats.files.atomic_write` and is
byte-for-byte deterministic (no timestamps, no software version).
"""
from __future__ import annotations

import math
import numbers
import os
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from mars_plugin.formats.files import atomic_write

from mars_plugin.pictures.label_images import _check_indices, _describe, _to_numpy

__all__ = [
    "bar_chart_figure",
    "tick_label_boxes",
    "save_iou_bar_chart",
]

PathLike = Union[str, os.PathLike]

# Matplotlib's tab10, spelled out so that chart colours never depend on rcParams.
_SERIES_COLORS = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
    "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf",
)


# --------------------------------------------------------------------------- bar charts


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


def _check_names(class_names: Any) -> List[str]:
    """The class names as a non-empty list of str."""
    if isinstance(class_names, (str, bytes)) or not isinstance(class_names, Sequence):
        raise ValueError(f"class_names must be a sequence of str, got {_describe(class_names)}")
    names = [str(c) for c in class_names]
    if not names:
        raise ValueError("class_names must not be empty")
    return names


def _check_series(series: Any, n: int) -> Dict[str, np.ndarray]:
    """``{name: (n,) float64}`` in legend order; NaN allowed (an absent class), inf refused."""
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
    return table


def _check_texts(title: Any, ylabel: Any, note: Any, tick_notes: Any, dpi: Any, n: int) -> None:
    """Refuse a title, y label, note or tick notes that are not str, and a dpi under 10."""
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


def _y_range(table: Dict[str, np.ndarray], idx: List[int], ymax: Any) -> Tuple[float, float]:
    """(ymin, ymax) of the y axis: 0 or 1.15 x the lowest value, and ``ymax`` checked, or by
    default 1.15 x the largest value (room for value labels), 1 when none is positive."""
    finite = np.concatenate([a[idx][np.isfinite(a[idx])] for a in table.values()])
    if ymax is None:
        top = float(finite.max()) if finite.size else 0.0
        ymax = top * 1.15 if top > 0 else 1.0
    elif isinstance(ymax, bool) or not isinstance(ymax, numbers.Real) or not math.isfinite(ymax) or ymax <= 0:
        raise ValueError(f"ymax must be a positive finite number, got {_describe(ymax)}")
    ymin = min(0.0, float(finite.min()) * 1.15) if finite.size else 0.0
    return ymin, ymax


def _draw_bars(ax: Any, table: Dict[str, np.ndarray], idx: List[int], ymin: float, ymax: float,
               value_labels: bool, value_format: str) -> None:
    """One bar per class and series (a group per class), its value above it or "n/a"."""
    k, m = len(table), len(idx)
    group = 0.8
    width = group / k
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


def _style_axes(ax: Any, labels: List[str], bold: List[bool], ymin: float, ymax: float, ylabel: str,
                title: str) -> List[Any]:
    """Ticks (``bold``: highlighted ones), limits, titles, grid and legend; returns the tick labels."""
    m = len(labels)
    ax.set_xticks(np.arange(m, dtype=np.float64))
    ticks = ax.set_xticklabels(labels, fontsize=8)
    for t, b in zip(ticks, bold):
        if b:
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
    return ticks


def _lay_out(fig: Any, ax: Any, notes: List[str]) -> bool:
    """Place the notes and tighten the layout; whether the tick labels are then clear of each other."""
    import textwrap
    import warnings

    # The note under the tick labels, wrapped to the figure width (~7 pt characters).
    chars = max(40, int(fig.get_figwidth() * 72 / 4.2))
    ax.set_xlabel("\n".join(textwrap.fill(t, chars) for t in notes), fontsize=7, color="0.3",
                  loc="left") if notes else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tight_layout's "not compatible" chatter
        fig.tight_layout()
    return not _boxes_overlap(tick_label_boxes(fig))


def _fit_tick_labels(fig: Any, ax: Any, ticks: List[Any], notes: List[str], fig_h: float, dpi: int) -> None:
    """Turn the tick labels by 0, 45 or 90 degrees, the first that keeps them apart, then make
    room under the axes and widen the figure while they still overlap."""
    for rotation in (0, 45, 90):
        for t in ticks:
            t.set_rotation(rotation)
            t.set_rotation_mode("anchor" if rotation else "default")
            t.set_horizontalalignment("right" if rotation else "center")
            t.set_verticalalignment("center" if rotation == 90 else "top")
        if _lay_out(fig, ax, notes):
            break
    # Room under the axes for turned labels: grow the figure by the labels' height.
    label_h = max(b.height for b in tick_label_boxes(fig)) / dpi
    if label_h > 0.8:
        fig.set_size_inches(fig.get_figwidth(), fig_h + label_h - 0.5)
        _lay_out(fig, ax, notes)
    for _ in range(12):  # still overlapping at 90 degrees: widen (labels do not scale)
        if not _boxes_overlap(tick_label_boxes(fig)):
            break
        fig.set_size_inches(fig.get_figwidth() * 1.25, fig.get_figheight())
        _lay_out(fig, ax, notes)


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
    names = _check_names(class_names)
    n = len(names)
    table = _check_series(series, n)
    hl = set(_check_indices(highlight, "highlight", n, unique=False))
    idx = list(range(n)) if order is None else _check_indices(order, "order", n, unique=True)
    if not idx:
        raise ValueError("order must select at least one class, got an empty sequence")
    _check_texts(title, ylabel, note, tick_notes, dpi, n)
    ymin, ymax = _y_range(table, idx, ymax)

    try:
        import matplotlib
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("save_iou_bar_chart needs matplotlib: pip install matplotlib") from e

    fig_w = max(6.0, 1.2 + len(idx) * (0.28 * len(table) + 0.35))
    fig_h = 4.4
    labels = [_wrap_name(names[i]) + (" *" if i in hl else "") + (f"\n{tick_notes[i]}" if tick_notes else "")
              for i in idx]
    with matplotlib.rc_context({"svg.hashsalt": "mars", "font.family": "DejaVu Sans"}):
        fig = Figure(figsize=(fig_w, fig_h), dpi=dpi)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot(1, 1, 1)
        _draw_bars(ax, table, idx, ymin, ymax, value_labels, value_format)
        ticks = _style_axes(ax, labels, [i in hl for i in idx], ymin, ymax, ylabel, title)
        notes = [t for t in (note, highlight_note if hl else None) if t]
        _fit_tick_labels(fig, ax, ticks, notes, fig_h, dpi)
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
