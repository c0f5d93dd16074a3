"""Colour legends under overlay grids, and bar charts whose tick labels never overlap."""
from __future__ import annotations

import math

import numpy as np
import pytest

PIL_Image = pytest.importorskip("PIL.Image")

from mars_plugin.formats.files import voc_palette  # noqa: E402
from mars_plugin.pictures.bar_charts import bar_chart_figure, save_iou_bar_chart, tick_label_boxes  # noqa: E402
from mars_plugin.pictures.label_images import BIASED_COLOR  # noqa: E402
from mars_plugin.pictures.panel_grids import (  # noqa: E402
    GRID_MARGIN,
    ROW_GAP,
    SWATCH,
    class_legend,
    legend_strip,
    overlay_grid,
    save_overlay_grid,
)

PALETTE = np.asarray(voc_palette(256), dtype=np.uint8).reshape(256, 3)
VOC = ["background", "aeroplane", "bicycle", "bird", "boat", "bottle", "bus", "car", "cat", "chair", "cow",
       "diningtable", "dog", "horse", "motorbike", "person", "pottedplant", "sheep", "sofa", "train", "tvmonitor"]
LONG = [f"a rather long class name number {i} with several words" for i in range(14)] + [
    "supercalifragilisticexpialidocious_without_any_spaces_at_all"]


def _count(arr, rgb):
    return int((arr == np.array(rgb, dtype=np.uint8)).all(-1).sum())


# --------------------------------------------------------------------------- legends


def test_class_legend_uses_the_label_colours():
    names = ["background", "boat", "train"]
    entries = class_legend(names)
    assert [e[0] for e in entries] == names + ["removed (biased)", "ignore"]
    assert [e[1] for e in entries[:3]] == [tuple(int(v) for v in PALETTE[c]) for c in range(3)]
    assert entries[3][1] == BIASED_COLOR and entries[4][1] == (224, 224, 192)
    assert class_legend(names, [2, 1], biased=False, ignore=False) == [("train", tuple(PALETTE[2].tolist())),
                                                                       ("boat", tuple(PALETTE[1].tolist()))]
    with pytest.raises(ValueError, match="classes must hold class indices in 0..2"):
        class_legend(names, [3])


def test_legend_strip_draws_every_swatch_and_wraps():
    entries = class_legend(VOC)
    strip = legend_strip(entries, 300)
    arr = np.asarray(strip)
    assert strip.width == 300 and strip.height % (SWATCH + 4) == 0 and strip.height > SWATCH + 4  # wrapped
    for name, rgb in entries:
        if rgb != (0, 0, 0):  # black would also match the outlines and the text
            assert _count(arr, rgb) >= (SWATCH - 2) ** 2, name
    one_line = legend_strip([("a", (10, 200, 30))], 300)
    assert one_line.height == SWATCH + 4


@pytest.mark.parametrize("bad, match", [
    ([], "non-empty"), ("boat", "non-empty"), ([("boat", (1, 2))], r"legend\[0\]"),
    ([("boat", (1, 2, 300))], r"legend\[0\]"), ([(3, (1, 2, 3))], r"legend\[0\]"),
])
def test_legend_strip_rejects_bad_entries(bad, match):
    with pytest.raises(ValueError, match=match):
        legend_strip(bad, 200)


def test_overlay_grid_with_legend_grows_by_the_strip(tmp_path):
    rng = np.random.default_rng(0)
    img = rng.integers(0, 256, (16, 20, 3), dtype=np.uint8)
    lab = np.zeros((16, 20), np.int64)
    lab[4:10, 5:12] = 2
    rows = [("boat: x", [("image", img), ("label", lab)])]
    plain = overlay_grid(rows, scale=2)
    legend = class_legend(["background", "boat", "train"])
    withl = overlay_grid(rows, scale=2, legend=legend)
    strip = legend_strip(legend, plain.width - 2 * GRID_MARGIN)
    assert withl.size == (plain.width, plain.height + ROW_GAP + strip.height)
    assert np.array_equal(np.asarray(withl)[: plain.height - GRID_MARGIN], np.asarray(plain)[: plain.height - GRID_MARGIN])
    save_overlay_grid(tmp_path / "g.png", rows, scale=2, legend=dict(legend))
    with PIL_Image.open(tmp_path / "g.png") as im:
        assert im.size == withl.size
        assert _count(np.asarray(im.convert("RGB")), BIASED_COLOR) >= (SWATCH - 2) ** 2
    with pytest.raises(ValueError, match="legend"):
        save_overlay_grid(tmp_path / "h.png", rows, legend=[("x", "red")])
    assert not (tmp_path / "h.png").exists()


# --------------------------------------------------------------------------- tick labels


def _no_overlap(fig):
    boxes = tick_label_boxes(fig)
    w, h = fig.canvas.get_width_height()
    for i, a in enumerate(boxes):
        assert a.x0 >= -1 and a.x1 <= w + 1 and a.y0 >= -1, f"tick label {i} outside the figure"
        for j in range(i + 1, len(boxes)):
            b = boxes[j]
            ox = min(a.x1, b.x1) - max(a.x0, b.x0)
            oy = min(a.y1, b.y1) - max(a.y0, b.y0)
            assert not (ox > 1 and oy > 1), f"tick labels {i} and {j} overlap: {a} and {b}"
    return boxes


@pytest.mark.slow
@pytest.mark.parametrize("names, k", [(VOC, 4), (VOC, 1), (LONG, 1), (LONG[:4], 4), (VOC[:3], 4)])
def test_tick_labels_do_not_overlap(names, k):
    pytest.importorskip("matplotlib")
    n = len(names)
    series = {f"series {s}": list(np.linspace(1.0, 95.0, n) + s) for s in range(k)}
    fig = bar_chart_figure(names, series, "t", highlight=[1], note="what the values mean " * 8,
                           tick_notes=[f"{1000 * i:,} px" for i in range(n)])
    boxes = _no_overlap(fig)
    assert len(boxes) == n
    # every label is drawn in full: the wrapped name and its note are in the text
    texts = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    assert all(t.endswith(f"{1000 * i:,} px") for i, t in enumerate(texts))


def test_the_overlap_check_sees_overlaps():
    """The check above is not vacuous: 21 VOC names, unturned, in a 6-inch figure overlap."""
    mpl = pytest.importorskip("matplotlib")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 4))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ax.set_xticks(range(21))
    ax.set_xticklabels(VOC)
    with pytest.raises(AssertionError, match="overlap"):
        _no_overlap(fig)
    del mpl


def test_chart_width_grows_with_the_classes(tmp_path):
    pytest.importorskip("matplotlib")
    few = bar_chart_figure(VOC[:4], {"s": [1.0, 2.0, 3.0, 4.0]}, "t")
    many = bar_chart_figure(VOC, {"s": list(range(21))}, "t")
    assert many.get_figwidth() > few.get_figwidth()
    save_iou_bar_chart(tmp_path / "c.png", LONG, {"s": list(range(len(LONG)))}, "t", note="n")
    with PIL_Image.open(tmp_path / "c.png") as im:
        assert im.size[0] > 600


@pytest.mark.parametrize("kwargs, match", [
    (dict(note=3), "note must be a str"),
    (dict(tick_notes=["a"]), "tick_notes must be 3 str"),
    (dict(tick_notes="abc"), "tick_notes must be 3 str"),
])
def test_bar_chart_rejects_bad_notes(tmp_path, kwargs, match):
    pytest.importorskip("matplotlib")
    with pytest.raises(ValueError, match=match):
        save_iou_bar_chart(tmp_path / "x.png", VOC[:3], {"s": [1.0, 2.0, math.nan]}, "t", **kwargs)
    assert not (tmp_path / "x.png").exists()
