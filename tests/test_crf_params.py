"""Dense-CRF parameters at their edges (issue 22, class 4), as a family: every key of
``crf_params`` times every kind of bad value (0, negative, NaN, inf, beyond float32, rounding to 0
in float32, a string, a bool, None, a list; iterations above MAX_ITERATIONS or fractional;
weights above MAX_COMPAT; standard deviations so small that the lattice's float32 coordinates
overflow for this image size). Each is refused before any work with a message naming the key
and the value (on the command line ``--crf-params "key"``); the standard deviations' message
also gives the smallest value that works for the image size, and that value works.
"""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from mars_plugin.engines.crf import dense_crf
from mars_plugin.engines.crf_memory import check_crf_image
from mars_plugin.engines.crf_params import CRF_PRESETS, MAX_COMPAT, MAX_ITERATIONS, check_crf_params

H, W = 20, 30
KEYS = ["iterations", "gaussian_sxy", "gaussian_compat", "bilateral_sxy", "bilateral_srgb", "bilateral_compat"]
STDS = ["gaussian_sxy", "bilateral_sxy", "bilateral_srgb"]

POSITIVE = r"must be a positive number, got "
FLOAT32 = r"must be a positive number that float32 holds"
COMMON = {
    "zero": (0, POSITIVE + "0"),
    "negative": (-3, POSITIVE + "-3"),
    "nan": (float("nan"), POSITIVE + "nan"),
    "inf": (float("inf"), POSITIVE + "inf"),
    "minus-inf": (float("-inf"), POSITIVE + "-inf"),
    "beyond-float32": (1e39, FLOAT32),
    "zero-in-float32": (1e-50, FLOAT32),
    "string": ("3", POSITIVE + "'3'"),
    "bool": (True, POSITIVE + "True"),
    "none": (None, POSITIVE + "None"),
    "list": ([3], POSITIVE + r"\[3\]"),
}
SPECIAL = {
    ("iterations", "far-too-many"): (10 ** 6, r"must be at most 100 .*got 1000000"),
    ("iterations", "one-too-many"): (MAX_ITERATIONS + 1, r"must be at most 100 .*got 101"),
    ("iterations", "fraction"): (2.5, r"must be an integer, got 2.5"),
    ("gaussian_compat", "huge-weight"): (1e31, r"must be at most 1e\+30"),
    ("bilateral_compat", "huge-weight"): (1e36, r"must be at most 1e\+30"),
}
TINY = {key: 1e-9 for key in STDS}  # x / sxy, rgb / srgb beyond the lattice's float32 coordinates

CASES = [(k, kind) for k in KEYS for kind in COMMON] + list(SPECIAL) + [(k, "overflowing") for k in STDS]


def _value(key, kind):
    if kind in COMMON:
        return COMMON[kind][0]
    if kind == "overflowing":
        return TINY[key]
    return SPECIAL[(key, kind)][0]


def _match(key, kind):
    if kind in COMMON:
        return COMMON[kind][1]
    if kind == "overflowing":
        return rf"= 1e-09 is too small for a {H}x{W} image: .* would overflow the lattice's float32 coordinates"
    return SPECIAL[(key, kind)][1]


def _image():
    rng = np.random.default_rng(0)
    return rng.integers(0, 256, (H, W, 3)).astype(np.uint8), torch.rand(2, H, W).softmax(0)


@pytest.mark.parametrize("key, kind", CASES)
def test_refused_before_any_work_naming_key_and_value(key, kind):
    value = _value(key, kind)
    with pytest.raises(ValueError) as e:
        check_crf_image({key: value}, H, W, 2)  # what dense_crf checks first, no image needed
    msg = str(e.value)
    assert msg.startswith(f"crf_params[{key!r}]") and re.search(_match(key, kind), msg), msg


# (code without the bound would run 10^6 or 10^39 iterations: those two are checked above only)
@pytest.mark.parametrize("key, kind", [c for c in CASES if c not in (("iterations", "far-too-many"),
                                                                     ("iterations", "beyond-float32"))])
def test_dense_crf_refuses_them(key, kind):
    img, probs = _image()
    with pytest.raises(ValueError) as e:
        dense_crf(probs, img, {key: _value(key, kind)})
    assert str(e.value).startswith(f"crf_params[{key!r}]") and re.search(_match(key, kind), str(e.value))


@pytest.mark.parametrize("key", STDS)
@pytest.mark.parametrize("size", [(H, W), (1, 2), (375, 500), (3000, 4000)])
def test_the_smallest_standard_deviation_named_is_right(key, size):
    h, w = size
    with pytest.raises(ValueError) as e:
        check_crf_image({key: 1e-12}, h, w, 2, max_bytes=None)
    smallest = float(re.search(r"the smallest that works for this image size.* is ([0-9.e+-]+)$", str(e.value))[1])
    check_crf_image({key: smallest}, h, w, 2, max_bytes=None)  # works
    with pytest.raises(ValueError, match="too small"):
        check_crf_image({key: smallest * 0.99}, h, w, 2, max_bytes=None)
    if (h, w) == (H, W):  # and the CRF runs at that value, with finite marginals
        img, probs = _image()
        q = dense_crf(probs, img, {key: smallest})
        assert bool(torch.isfinite(q).all()) and torch.allclose(q.sum(0), torch.ones(H, W), atol=1e-5)


def test_the_presets_and_their_neighbourhood_pass():
    for preset in CRF_PRESETS:
        check_crf_image(preset, 4000, 3000, 21, max_bytes=None)
    check_crf_params({"iterations": MAX_ITERATIONS, "gaussian_compat": MAX_COMPAT, "bilateral_srgb": 0.01})
    img, probs = _image()
    q = dense_crf(probs, img, {"gaussian_sxy": 1e-3, "bilateral_sxy": 1e-3, "bilateral_srgb": 1e-3})
    assert bool(torch.isfinite(q).all())


def test_the_pydensecrf_backend_is_guarded_too():
    pytest.importorskip("pydensecrf")
    img, probs = _image()
    with pytest.raises(ValueError, match=r"crf_params\['bilateral_srgb'\] = 1e-09 is too small"):
        dense_crf(probs, img, {"bilateral_srgb": 1e-9}, backend="pydensecrf")


# ------------------------------------------------------------------------------------------
# the command line: --crf-params JSON
# ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from mars_plugin.cli import main
    from mars_plugin.worlds.synthetic import write_world
    from mars_plugin.worlds.synthetic_scenes import make_world

    root = tmp_path_factory.mktemp("crfparams")
    w = make_world(3, size=24, dim=16, seed=3)
    write_world(w, root / "w")
    assert main(["centroids", "--features", str(root / "w/features"), "--labels", str(root / "w/labels"),
                 "--num-classes", "6", "--out", str(root / "V.pt"), "--no-progress"]) == 0
    return root


@pytest.mark.parametrize("text, key, says", [
    ('{"bilateral_srgb": 1e-9}', "bilateral_srgb", "is too small for a 24x24 image"),
    ('{"gaussian_sxy": 1e-9}', "gaussian_sxy", "is too small for a 24x24 image"),
    ('{"bilateral_sxy": 1e-9}', "bilateral_sxy", "is too small for a 24x24 image"),
    ('{"iterations": 101}', "iterations", "must be at most 100"),
    ('{"gaussian_compat": 1e39}', "gaussian_compat", "float32 holds"),
    ('{"bilateral_compat": 1e31}', "bilateral_compat", "at most 1e+30"),
    ('{"bilateral_srgb": NaN}', "bilateral_srgb", "got nan"),
    ('{"gaussian_sxy": Infinity}', "gaussian_sxy", "got inf"),
    ('{"iterations": "10"}', "iterations", "got '10'"),
])
def test_mars_debias_names_the_flag_and_the_key(world, tmp_path, capsys, text, key, says):
    from mars_plugin.cli import main

    capsys.readouterr()
    rc = main(["debias", "--features", str(world / "w/features"), "--labels", str(world / "w/labels"),
               "--centroids", str(world / "V.pt"), "--images", str(world / "w/images"), "--out", str(tmp_path / "o"),
               "--no-progress", "--crf-params", text])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert f'--crf-params "{key}"' in err and says in err, err  # the flag and the JSON key, as _flag_names writes them
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").glob("*.png"))
    if "too small" in says:  # a fact of the image's size: that file fails, named, and skip skips it
        assert err.startswith("mars debias: error: syn_"), err
        rc = main(["debias", "--features", str(world / "w/features"), "--labels", str(world / "w/labels"),
                   "--centroids", str(world / "V.pt"), "--images", str(world / "w/images"),
                   "--out", str(tmp_path / "s"), "--no-progress", "--crf-params", text, "--on-error", "skip"])
        err = capsys.readouterr().err
        assert rc == 1 and err.count(f'--crf-params "{key}"') == 3, err
