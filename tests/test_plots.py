"""Tests for mars_plugin.commands.{label_images,panel_grids,bar_charts}: label colours, overlays, panel grids and bar charts."""
from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

PIL_Image = pytest.importorskip("PIL.Image")

from mars_plugin.formats.files import voc_palette  # noqa: E402
from mars_plugin.pictures.bar_charts import save_iou_bar_chart  # noqa: E402
from mars_plugin.pictures.label_images import (  # noqa: E402
    BIASED_COLOR,
    blend,
    colorize_label,
    removed_mask_image,
)
from mars_plugin.pictures.panel_grids import (  # noqa: E402
    CAPTION_BAND,
    GRID_MARGIN,
    PANEL_GAP,
    ROW_GAP,
    TITLE_BAND,
    overlay_grid,
    overlay_row,
    save_overlay_grid,
)

PALETTE = np.asarray(voc_palette(256), dtype=np.uint8).reshape(256, 3)
NAMES = ["background", "aeroplane", "boat", "train", "diningtable", "pottedplant"]
SERIES = {
    "WSSS pseudo": [80.1, 70.2, 45.3, 50.0, math.nan, 30.3],
    "debiased": [81.0, 72.0, 60.5, 64.0, math.nan, 35.0],
    "plain CE": [82.0, 73.0, 50.0, 55.0, math.nan, 33.0],
    "MARS": [83.0, 75.0, 66.0, 68.0, math.nan, 40.0],
}


def rand_image(h=16, w=20, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def rand_label(h=16, w=20, seed=0, extra=(255, -1)):
    rng = np.random.default_rng(seed + 100)
    values = np.array(list(range(0, 21)) + list(extra))
    return rng.choice(values, size=(h, w)).astype(np.int64)


def no_temp_files(folder):
    return [f for f in os.listdir(folder) if f.startswith(".tmp-")] == []


def png_size(path):
    with PIL_Image.open(path) as im:
        im.load()
        return im.size, im.mode


# --------------------------------------------------------------------------- colorize_label


def test_colorize_label_maps_every_value():
    values = np.array([list(range(0, 22)) + [254, 255, -1]])
    rgb = colorize_label(values)
    assert rgb.shape == (1, values.shape[1], 3) and rgb.dtype == np.uint8
    for j, v in enumerate(values[0]):
        want = BIASED_COLOR if v == -1 else tuple(PALETTE[v])
        assert tuple(rgb[0, j]) == tuple(want), v
    assert tuple(rgb[0, -2]) == (224, 224, 192)  # ignore: the VOC off-white


def test_colorize_label_accepts_tensors_and_integral_floats():
    lab = rand_label()
    ref = colorize_label(lab)
    np.testing.assert_array_equal(colorize_label(torch.from_numpy(lab)), ref)
    np.testing.assert_array_equal(colorize_label(lab.astype(np.float32)), ref)
    np.testing.assert_array_equal(colorize_label(lab.astype(np.int16)), ref)


def test_biased_color_is_not_a_palette_colour():
    assert not (PALETTE == np.array(BIASED_COLOR, dtype=np.uint8)).all(1).any()


@pytest.mark.parametrize(
    "bad, match",
    [
        (np.zeros((2, 3, 4), dtype=np.int64), r"label must be an \(H, W\)"),
        (np.array([[0, 256]]), "label values"),
        (np.array([[0, -2]]), "label values"),
        (np.array([[0.5, 1.0]]), "label must hold integer"),
        (np.array([[True, False]]), "label must be an integer"),
        ("not an array", "label must be"),
    ],
)
def test_colorize_label_rejects_bad_labels(bad, match):
    with pytest.raises(ValueError, match=match):
        colorize_label(bad)


# --------------------------------------------------------------------------- blend


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.5, 1.0])
def test_blend_matches_numpy(alpha):
    img, lab = rand_image(), rand_label()
    lab[0, :5] = 0
    out = blend(img, lab, alpha)
    assert out.shape == img.shape and out.dtype == np.uint8
    col = np.where(lab[..., None] == -1, np.array(BIASED_COLOR), PALETTE[np.clip(lab, 0, 255)]).astype(np.float64)
    want = np.rint((1 - alpha) * img.astype(np.float64) + alpha * col).astype(np.uint8)
    bg = lab == 0
    want[bg] = img[bg]
    np.testing.assert_array_equal(out, want)
    # background untouched; every other pixel lies between the image and its colour
    np.testing.assert_array_equal(out[bg], img[bg])
    lo = np.minimum(img, col.astype(np.uint8))
    hi = np.maximum(img, col.astype(np.uint8))
    assert ((out >= lo) & (out <= hi)).all()


def test_blend_rejects_bad_inputs():
    img, lab = rand_image(), rand_label()
    with pytest.raises(ValueError, match="image and label must have the same height and width"):
        blend(img, lab[:-1])
    with pytest.raises(ValueError, match=r"image must be an \(H, W, 3\) uint8"):
        blend(img.astype(np.float32), lab)
    with pytest.raises(ValueError, match=r"image must be an \(H, W, 3\) uint8"):
        blend(img[..., :2], lab)
    with pytest.raises(ValueError, match="alpha"):
        blend(img, lab, alpha=1.5)


# --------------------------------------------------------------------------- removed_mask_image


def test_removed_mask_image_highlights_exactly_the_removed_pixels():
    h, w = 24, 30
    rng = np.random.default_rng(3)
    img = rand_image(h, w, seed=3)
    img[0, 0] = BIASED_COLOR  # an image pixel that already is magenta must not look removed
    pseudo = rng.choice([0, 0, 2, 4, 15, 255], size=(h, w)).astype(np.int64)
    pseudo[0, 0] = 0
    debiased = pseudo.copy()
    drop = rng.random((h, w)) < 0.4
    debiased[drop] = -1  # also on background and ignore pixels: those are not "removed"
    out = removed_mask_image(img, torch.from_numpy(pseudo), debiased)
    assert out.shape == img.shape and out.dtype == np.uint8

    removed = (pseudo > 0) & (pseudo != 255) & (debiased == -1)
    assert removed.any() and (~removed).any()
    is_highlight = (out == np.array(BIASED_COLOR, dtype=np.uint8)).all(-1)
    np.testing.assert_array_equal(is_highlight, removed)

    kept = (debiased > 0) & (debiased != 255)
    tinted = np.rint(0.65 * img + 0.35 * PALETTE[np.clip(debiased, 0, 255)]).astype(np.uint8)
    np.testing.assert_array_equal(out[kept], tinted[kept])
    rest = ~removed & ~kept
    np.testing.assert_array_equal(out[rest], np.rint(0.4 * img[rest]).astype(np.uint8))


def test_removed_mask_image_rejects_mismatched_sizes():
    img, lab = rand_image(), rand_label()
    with pytest.raises(ValueError, match="image and pseudo"):
        removed_mask_image(img, lab[:, :-2], lab)
    with pytest.raises(ValueError, match="image and debiased"):
        removed_mask_image(img, lab, lab[:-1])
    with pytest.raises(ValueError, match="debiased values"):
        removed_mask_image(img, lab, np.full_like(lab, -5))


# --------------------------------------------------------------------------- overlay_row / grid


@pytest.mark.parametrize("scale", [1, 3])
def test_overlay_row_size_and_pixels(scale):
    h, w = 12, 10
    img, lab = rand_image(h, w), rand_label(h, w)
    row = overlay_row(img, [("pseudo label", lab), ("removed pixels", removed_mask_image(img, lab, lab)),
                            ("MARS prediction", torch.from_numpy(lab))], scale=scale)
    n = 4
    assert row.mode == "RGB"
    assert row.size == (n * w * scale + (n - 1) * PANEL_GAP, h * scale + TITLE_BAND)
    arr = np.asarray(row)
    # first panel: the image, nearest-neighbour up-scaled, under the title band
    big = np.repeat(np.repeat(img, scale, 0), scale, 1)
    np.testing.assert_array_equal(arr[TITLE_BAND:, : w * scale], big)
    # second panel: the colourised label
    x0 = w * scale + PANEL_GAP
    big = np.repeat(np.repeat(colorize_label(lab), scale, 0), scale, 1)
    np.testing.assert_array_equal(arr[TITLE_BAND:, x0 : x0 + w * scale], big)
    # titles are drawn (the band is not blank white) when the panels are wide enough for text
    if scale == 3:
        assert (arr[:TITLE_BAND, : w * scale] != 255).any()


def test_overlay_row_without_image_and_long_titles():
    lab = rand_label(8, 8)
    row = overlay_row(None, [("a very long title that cannot fit in a small panel at all", lab)], scale=2)
    assert row.size == (16, 16 + TITLE_BAND)


def test_overlay_row_rejects_bad_inputs():
    img, lab = rand_image(), rand_label()
    with pytest.raises(ValueError, match="panels must be a non-empty"):
        overlay_row(img, [])
    with pytest.raises(ValueError, match=r"panels\[1\].*same height and width"):
        overlay_row(img, [("ok", lab), ("small", lab[:-1])])
    with pytest.raises(ValueError, match=r"panels\[0\]"):
        overlay_row(img, [("float", img.astype(np.float32))])
    with pytest.raises(ValueError, match=r"panels\[0\] must be a \(title, array\) pair"):
        overlay_row(img, [lab])
    with pytest.raises(ValueError, match="scale"):
        overlay_row(img, [("ok", lab)], scale=0)


def test_save_overlay_grid_size_atomic_and_deterministic(tmp_path):
    h, w = 16, 20
    img, lab = rand_image(h, w), rand_label(h, w)
    db = lab.copy()
    db[lab == 2] = -1
    rows = [
        ("boat: syn_000012", [("image", img), ("pseudo label", lab), ("removed pixels", removed_mask_image(img, lab, db)),
                              ("MARS prediction", blend(img, lab))]),
        ("train: syn_000003", [("image", img), ("pseudo label", lab)]),
    ]
    path = tmp_path / "sub" / "grid.png"
    save_overlay_grid(path, rows, scale=3)
    size, mode = png_size(path)
    row_h = TITLE_BAND + h * 3
    assert mode == "RGB"
    assert size == (4 * w * 3 + 3 * PANEL_GAP + 2 * GRID_MARGIN,
                    2 * (CAPTION_BAND + row_h) + ROW_GAP + 2 * GRID_MARGIN)
    assert overlay_grid(rows, scale=3).size == size
    assert no_temp_files(path.parent)
    first = path.read_bytes()
    save_overlay_grid(path, rows, scale=3)
    assert path.read_bytes() == first


def test_save_overlay_grid_rejects_bad_rows(tmp_path):
    with pytest.raises(ValueError, match="rows must be a non-empty"):
        save_overlay_grid(tmp_path / "g.png", [])
    with pytest.raises(ValueError, match=r"rows\[0\].*panels must be a non-empty"):
        save_overlay_grid(tmp_path / "g.png", [("empty", [])])
    img = rand_image()
    with pytest.raises(ValueError, match=r"rows\[1\] \('bad'\).*same height and width"):
        save_overlay_grid(tmp_path / "g.png", [("ok", [("image", img)]), ("bad", [("a", img), ("b", img[:-1])])])
    assert os.listdir(tmp_path) == []


# --------------------------------------------------------------------------- bar charts


@pytest.mark.slow
def test_bar_chart_png_with_nan_highlight_and_deterministic_bytes(tmp_path):
    pytest.importorskip("matplotlib")
    a, b = tmp_path / "a.png", tmp_path / "b.png"
    save_iou_bar_chart(a, NAMES, SERIES, "Per-class IoU", highlight=[2, 3])
    save_iou_bar_chart(b, NAMES, SERIES, "Per-class IoU", highlight=[2, 3])
    assert a.read_bytes() == b.read_bytes()
    with PIL_Image.open(a) as im:
        assert im.format == "PNG"
        arr = np.asarray(im.convert("RGB"))
        assert b"Software" not in a.read_bytes()
    assert arr.shape[0] > 200 and arr.shape[1] > 400
    assert len(np.unique(arr.reshape(-1, 3), axis=0)) > 10  # not a blank picture
    # the series colours (tab10 blue and red) are drawn
    for colour in [(0x1F, 0x77, 0xB4), (0xD6, 0x27, 0x28)]:
        assert (arr == np.array(colour, dtype=np.uint8)).all(-1).sum() > 100
    assert sorted(os.listdir(tmp_path)) == ["a.png", "b.png"]
    # a different input gives a different picture
    save_iou_bar_chart(b, NAMES, SERIES, "Per-class IoU", highlight=[2])
    assert a.read_bytes() != b.read_bytes()


def test_bar_chart_single_ranked_series(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "share.png"
    share = np.array([2.0, 35.1, 28.4, 1.2, 5.5])
    order = list(np.argsort(-share))
    save_iou_bar_chart(path, NAMES[1:], {"share marked biased": torch.from_numpy(share)},
                       "Share of pseudo-label pixels marked biased", ylabel="share (%)", order=order,
                       highlight=(1, 2), value_labels=False)
    (w, h), _ = png_size(path)
    assert w > 300 and h > 200
    # all-NaN series and a subset order are accepted too
    save_iou_bar_chart(path, NAMES, {"x": [math.nan] * 6}, "empty", order=[3, 1])
    assert no_temp_files(tmp_path)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(series={"MARS": [1.0, 2.0]}), r"series\['MARS'\] must hold one value per class \(6"),
        (dict(series={}), "series must be a non-empty"),
        (dict(class_names=[]), "class_names must not be empty"),
        (dict(series={"MARS": [1, 2, 3, 4, 5, math.inf]}), r"series\['MARS'\] holds infinite"),
        (dict(series={"MARS": ["a"] * 6}), r"series\['MARS'\] must be 6 numbers"),
        (dict(highlight=[6]), "highlight must hold class indices in 0..5"),
        (dict(order=[0, 0]), "order must not repeat"),
        (dict(order=[]), "order must select at least one"),
        (dict(ymax=-1.0), "ymax"),
    ],
)
def test_bar_chart_rejects_bad_inputs(tmp_path, kwargs, match):
    pytest.importorskip("matplotlib")
    args = dict(class_names=NAMES, series=SERIES, title="t")
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        save_iou_bar_chart(tmp_path / "x.png", **args)
    assert os.listdir(tmp_path) == []


def test_no_pyplot_state(tmp_path):
    """The charts never go through pyplot, so no global figure is left behind."""
    pytest.importorskip("matplotlib")
    import sys

    save_iou_bar_chart(tmp_path / "c.png", NAMES, SERIES, "t")
    if "matplotlib.pyplot" in sys.modules:
        assert sys.modules["matplotlib.pyplot"].get_fignums() == []
