"""The SEAM codebase's training augmentation (lib/datasets/transform.py, BaseDataset.py:88-98 at
a40f6c6) and its OpenCV routines against plain scalar readings of what upstream calls."""
import random

import numpy as np
import pytest

from mars_plugin.networks.seam_data import (SeamAugmentation, cv_hsv2rgb, cv_resize, cv_rgb2hsv,
                                            seam_augment, seam_augment_normalized)

f32 = np.float32


def _rgb2hsv_pixel(r, g, b):
    """OpenCV's RGB2HSV_b for one pixel, hrange 180, 12-bit fixed point (color_hsv)."""
    v, vmin = max(r, g, b), min(r, g, b)
    diff = v - vmin
    sdiv = 0 if v == 0 else int(np.rint((255 << 12) / v))
    hdiv = 0 if diff == 0 else int(np.rint((180 << 12) / (6.0 * diff)))
    s = (diff * sdiv + (1 << 11)) >> 12
    if v == r:
        h = g - b
    elif v == g:
        h = b - r + 2 * diff
    else:
        h = r - g + 4 * diff
    h = (h * hdiv + (1 << 11)) >> 12
    return (h + 180 if h < 0 else h), s, v


def _fms(a, b):
    """1 - a b with one rounding to float32 (a fused multiply-add)."""
    return f32(1.0 - float(a) * float(b))


def _hsv2rgb_pixel(h, s, v, simd):
    """OpenCV 4.x's HSV2RGB_b for one pixel: float32, times 255, truncated in the SIMD part."""
    hh = f32(h) * f32(6.0 / 180.0)
    ss, vv = f32(s) * f32(1 / 255), f32(v) * f32(1 / 255)
    sector = int(np.floor(hh))
    hh = f32(hh - f32(sector))
    tab = [vv, vv * f32(f32(1) - ss), vv * _fms(ss, hh), vv * _fms(ss, f32(f32(1) - hh))]
    b, g, r = (tab[i] for i in [(1, 3, 0), (1, 0, 2), (3, 0, 1), (0, 2, 1), (0, 1, 3), (2, 1, 0)][sector % 6])
    cast = (lambda t: int(t)) if simd else (lambda t: int(np.rint(t)))
    return tuple(min(255, max(0, cast(f32(c) * f32(255)))) for c in (r, g, b))


def test_rgb2hsv_equals_scalar_reading():
    rng = np.random.default_rng(0)
    px = np.concatenate([rng.integers(0, 256, (300, 3)), [[0, 0, 0], [255, 255, 255], [255, 0, 0], [0, 255, 0],
                                                          [0, 0, 255], [7, 7, 7], [255, 0, 1], [1, 0, 255]]])
    got = cv_rgb2hsv(px.astype(np.uint8)[None])[0]
    assert [tuple(p) for p in got] == [_rgb2hsv_pixel(*map(int, p)) for p in px]


def test_hsv2rgb_equals_scalar_reading_simd_part_and_tail():
    rng = np.random.default_rng(1)
    hsv = rng.integers(0, 256, (6, 40, 3)).astype(np.uint8)
    hsv[..., 0] %= 180
    # the last five need OpenCV's fused multiply-adds (1 - s h and 1 - s (1 - h)): without, one off
    hsv[0, :8] = [[0, 0, 90], [179, 255, 255], [60, 128, 200], [1, 90, 85], [1, 102, 75], [1, 150, 153],
                  [32, 120, 255], [33, 187, 150]]
    got = cv_hsv2rgb(hsv)
    for y in range(6):
        for x in range(40):  # 40 wide: pixels 0-31 in OpenCV's SIMD blocks, 32-39 in its scalar tail
            assert tuple(got[y, x]) == _hsv2rgb_pixel(*map(int, hsv[y, x]), simd=x < 32), (y, x)


def _cubic_taps(d, n, s):
    fx = f32((d + 0.5) / s - 0.5)
    sx = int(np.floor(fx))
    x = f32(fx - f32(sx))
    A, one = f32(-0.75), f32(1)
    w0 = ((A * (x + one) - f32(5) * A) * (x + one) + f32(8) * A) * (x + one) - f32(4) * A
    w1 = ((A + f32(2)) * x - (A + f32(3))) * x * x + one
    w2 = ((A + f32(2)) * (one - x) - (A + f32(3))) * (one - x) * (one - x) + one
    return [min(max(sx + k - 1, 0), n - 1) for k in range(4)], [w0, w1, w2, one - w0 - w1 - w2]


@pytest.mark.parametrize("scale", [0.62, 1.37])
def test_resize_equals_loop_reading(scale):
    rng = np.random.default_rng(2)
    img = rng.integers(0, 256, (7, 9, 3)).astype(np.uint8)
    oh, ow = int(round(7 * scale)), int(round(9 * scale))
    got = cv_resize(img, scale, "cubic")
    assert got.shape == (oh, ow, 3)
    for y in range(oh):
        ys, wy = _cubic_taps(y, 7, scale)
        for x in range(ow):
            xs, wx = _cubic_taps(x, 9, scale)
            for c in range(3):
                rows = [sum(f32(img[yy, xx, c]) * wx[j] for j, xx in enumerate(xs)) for yy in ys]
                v = sum(rows[i] * wy[i] for i in range(4))
                assert got[y, x, c] == min(255, max(0, int(np.rint(v)))), (y, x, c)
    lab = np.arange(63, dtype=np.uint8).reshape(7, 9)
    near = cv_resize(lab, scale, "nearest")  # source min(floor(d / s), n - 1)
    assert (near == lab[[min(int(np.floor(y / scale)), 6) for y in range(oh)]][
        :, [min(int(np.floor(x / scale)), 8) for x in range(ow)]]).all()
    row = rng.integers(0, 256, (2, 400)).astype(np.uint8)
    assert (cv_resize(row, 1.001, "cubic") == row).all()  # same size: a copy, as cv2.resize


def _plain_reading(rgb, label, aug, seed):
    """BaseDataset.__weak_augment__: HSV, flip, scale, normalise, crop, with Python's random."""
    r = random.Random(seed)
    hsv = cv_rgb2hsv(rgb).astype(int)
    dh, ds, dv = r.randint(-10, 10), r.randint(-10, 10), r.randint(-10, 10)
    hsv = np.stack([(hsv[..., 0] + dh) % 180, np.clip(hsv[..., 1] + ds, 0, 255),
                    np.clip(hsv[..., 2] + dv, 0, 255)], -1).astype(np.uint8)
    img, lab = cv_hsv2rgb(hsv), label
    if r.random() < 0.5:
        img, lab = img[:, ::-1], lab[:, ::-1]
    s = r.random() * (1.5 - 0.5) + 0.5
    img, lab = cv_resize(np.ascontiguousarray(img), s, "cubic"), cv_resize(np.ascontiguousarray(lab), s, "nearest")
    x = img.astype(np.float32)
    for k in range(3):
        x[..., k] = (x[..., k] / 255 - aug.mean[k]) / aug.std[k]
    c = aug.crop
    H, W = lab.shape
    if W > c:
        cl, il = 0, r.randrange(W - c + 1)
    else:
        cl, il = r.randrange(c - W + 1), 0
    if H > c:
        ct, it = 0, r.randrange(H - c + 1)
    else:
        ct, it = r.randrange(c - H + 1), 0
    ch, cw = min(H, c), min(W, c)
    out_x = np.zeros((c, c, 3), np.float32)
    out_x[ct:ct + ch, cl:cl + cw] = x[it:it + ch, il:il + cw]
    out_l = np.full((c, c), 255, np.uint8)
    out_l[ct:ct + ch, cl:cl + cw] = lab[it:it + ch, il:il + cw]
    return out_x, out_l


def test_augmentation_equals_plain_reading_with_pythons_random():
    rng = np.random.default_rng(3)
    rgb = rng.integers(0, 256, (12, 20, 3)).astype(np.uint8)
    label = np.arange(240, dtype=np.uint8).reshape(12, 20)  # every pixel its own id: placement shows
    aug = SeamAugmentation(crop=16)
    padded = set()
    for seed in range(12):
        want_x, want_l = _plain_reading(rgb, label, aug, seed)
        got_x, got_l = seam_augment_normalized(rgb, label, aug, random.Random(seed))
        assert np.array_equal(got_x, want_x) and np.array_equal(got_l, want_l), seed
        u8, l8 = seam_augment(rgb, label, aug, random.Random(seed))
        assert np.array_equal(l8, want_l)
        pad = want_l == 255
        assert (u8[pad] == [124, 116, 104]).all()  # round(255 * mean): upstream's 0 is not a byte
        inside = ~pad
        norm = (u8.astype(np.float32) / np.float32(255) - np.float32(aug.mean)) / np.float32(aug.std)
        assert np.array_equal(norm[inside], want_x[inside])
        padded.add(bool(pad.any()))
    assert padded == {True, False}  # both a smaller and a larger scaled image were met


def test_numpy_generator_and_bad_inputs():
    rgb = np.zeros((10, 10, 3), np.uint8)
    lab = np.zeros((10, 10), np.uint8)
    aug = SeamAugmentation(crop=8)
    a = seam_augment(rgb, lab, aug, np.random.default_rng(5))
    b = seam_augment(rgb, lab, aug, np.random.default_rng(5))
    assert all(np.array_equal(x, y) for x, y in zip(a, b)) and a[0].shape == (8, 8, 3)
    with pytest.raises(ValueError, match="label must be a uint8 array"):
        seam_augment(rgb, lab[:5], aug, random.Random(0))
    with pytest.raises(ValueError, match="rgb must be a uint8 array"):
        seam_augment(rgb.astype(np.float32), lab, aug, random.Random(0))
    with pytest.raises(TypeError, match="rng must be"):
        seam_augment(rgb, lab, aug, 0)
    with pytest.raises(ValueError, match="crop must be an integer >= 8, got 4"):
        SeamAugmentation(crop=4)


def test_against_opencv_where_installed():
    cv2 = pytest.importorskip("cv2")
    rng = np.random.default_rng(6)
    hsv = rng.integers(0, 256, (64, 77, 3)).astype(np.uint8)
    hsv[..., 0] %= 180
    assert np.array_equal(cv_hsv2rgb(hsv), cv2.cvtColor(hsv, cv2.COLOR_HSV2RGB))
    assert np.array_equal(cv_rgb2hsv(hsv), cv2.cvtColor(hsv, cv2.COLOR_RGB2HSV))
    for s in (0.55, 0.93, 1.21, 1.49):
        got, want = cv_resize(hsv, s, "cubic"), cv2.resize(hsv, None, fx=s, fy=s, interpolation=cv2.INTER_CUBIC)
        assert np.abs(got.astype(int) - want).max() <= 1 and (got == want).mean() > 0.99
        lab = hsv[..., 0]
        assert np.array_equal(cv_resize(lab, s, "nearest"),
                              cv2.resize(lab, None, fx=s, fy=s, interpolation=cv2.INTER_NEAREST))


def test_test_time_scales_resize_the_normalised_float_image():
    from mars_plugin.networks.deeplabv1 import seam_scaled_inputs

    rng = np.random.default_rng(7)
    x = rng.standard_normal((7, 9, 3)).astype(np.float32)
    outs = seam_scaled_inputs(x)
    # round(H s) x round(W s), half to even as cvRound: 3.5 -> 4, 4.5 -> 4, 15.75 -> 16
    assert [tuple(o.shape[2:]) for o in outs] == [(4, 4), (5, 7), (7, 9), (9, 11), (10, 14), (12, 16)]
    assert np.array_equal(outs[2][0].numpy().transpose(1, 2, 0), x)
    got = outs[3][0].numpy().transpose(1, 2, 0)  # 1.25: bicubic in float32, unrounded
    for y in range(9):
        ys, wy = _cubic_taps(y, 7, 1.25)
        for xx in range(11):
            xs, wx = _cubic_taps(xx, 9, 1.25)
            for c in range(3):
                rows = [sum(x[r, q, c] * wx[j] for j, q in enumerate(xs)) for r in ys]
                assert got[y, xx, c] == pytest.approx(sum(rows[i] * wy[i] for i in range(4)), abs=1e-5)
    with pytest.raises(ValueError, match="normalized must be a float32 array"):
        seam_scaled_inputs(x.astype(np.float64))
