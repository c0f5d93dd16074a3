"""Every ViT extractor bounds the patch tokens of its network input (issue 22, class 3): STEGO's
``res`` rule on an image of extreme aspect ratio (1x250 at res 320 is a 320x80000 input),
DINOv2 / CAUSE / Leopart at the image's own resolution, and DHR's multi-scale inference at 2.0.
An image over ``max_tokens`` (default MAX_TOKENS) is refused before any work with the image
size, the input it would build and the bound; ``mars features`` names the file and
``--on-error skip`` skips it.

The extractors are tiny random-weight models; the bound is lowered on the instance so that the
images stay small (on code without the bound they run, quickly, and the tests fail).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from mars_plugin.adapters.uss.cause import CAUSEExtractor
from mars_plugin.adapters.uss.cause_decoder import CAUSESegment
from mars_plugin.adapters.uss.code_extractor import CodeExtractor
from mars_plugin.adapters.uss.dinov2 import DINOv2Extractor
from mars_plugin.adapters.uss.leopart import LeopartExtractor
from mars_plugin.adapters.uss.multiscale import DHR_SETTINGS, multiscale
from mars_plugin.adapters.uss.stego import STEGOExtractor
from mars_plugin.adapters.uss.vit import MAX_TOKENS, DinoViT


def _stego(**kw):
    from test_stego import stego_state_dict

    return STEGOExtractor.from_state_dict(stego_state_dict(width=192, dim=8), **kw)


def _dinov2(**kw):
    torch.manual_seed(0)
    return DINOv2Extractor(DinoViT(14, 64, 1, 2, num_patches=16, layer_scale=True, mask_token=True), **kw)


def _cause(**kw):
    from test_cause import dhr_decoder_sd, random_codebook, tiny_backbone

    seg = CAUSESegment(32)
    seg.load_state_dict(dhr_decoder_sd(32), strict=True)
    return CAUSEExtractor(tiny_backbone(32), seg, random_codebook(7, 32), **kw)


def _leopart(**kw):
    from test_leopart import leopart_net

    return LeopartExtractor.from_state_dict(leopart_net(width=192), **kw)


# kind -> (extractor, bound, an image over it, the input it builds, an image under it)
KINDS = {
    "stego-res": (lambda: _stego(res=32), 100, (4, 40), "32x320 input, 160 patch tokens of 8", (24, 30)),
    "dinov2-native": (lambda: _dinov2(), 64, (28, 700), "28x700 input, 100 patch tokens of 14", (28, 42)),
    "cause-native": (lambda: _cause(), 64, (28, 700), "28x700 input, 100 patch tokens of 14", (28, 42)),
    "leopart-native": (lambda: _leopart(res=None), 64, (32, 800), "32x800 input, 100 patch tokens of 16", (32, 48)),
    "stego-dhr-2.0": (lambda: _stego(**DHR_SETTINGS), 100, (16, 160), "scale 2 turns the 16x160 image into a "
                      "32x320 input, 160 patch tokens of 8", (12, 14)),
    "dinov2-dhr-2.0": (lambda: _dinov2(**DHR_SETTINGS), 64, (14, 350), "scale 2 turns the 14x350 image into a "
                       "28x700 input, 100 patch tokens of 14", (14, 21)),
    "cause-dhr-2.0": (lambda: _cause(**DHR_SETTINGS), 64, (14, 350), "28x700 input, 100 patch tokens of 14", (14, 21)),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_an_input_over_max_tokens_is_refused_before_any_work(kind):
    make, bound, (H, W), says, (h, w) = KINDS[kind]
    ex = make()
    ex.max_tokens = bound
    calls = []
    real = ex.code
    ex.code = lambda x: calls.append(tuple(x.shape)) or real(x)
    img = torch.randint(0, 256, (1, 3, H, W), dtype=torch.uint8)
    with pytest.raises(ValueError) as e:
        ex(img)
    msg = str(e.value)
    assert says in msg and f"max_tokens = {bound}" in msg and f"{H}x{W}" in msg, msg
    assert calls == []  # refused before the network saw anything
    with pytest.raises(ValueError, match="max_tokens"):
        ex.check_input_size(H, W)
    out = ex(torch.randint(0, 256, (1, 3, h, w), dtype=torch.uint8))  # under the bound it runs
    assert out.ndim == 4 and bool(torch.isfinite(out).all())


DEFAULTS = {"stego-res320": _stego, "dinov2-native": _dinov2, "leopart-native": lambda: _leopart(res=None),
            "stego-dhr-2.0": lambda: _stego(**DHR_SETTINGS), "cause-dhr-2.0": lambda: _cause(**DHR_SETTINGS)}


@pytest.mark.parametrize("kind, size", [
    ("stego-res320", (1, 250)),  # the case: res 320 builds a 320x80000 input, 400,000 tokens
    ("stego-res320", (10, 4000)),
    ("dinov2-native", (14 * 400, 14 * 400)),
    ("leopart-native", (16 * 400, 16 * 400)),
    ("stego-dhr-2.0", (8 * 200, 8 * 200)),
    ("cause-dhr-2.0", (14 * 200, 14 * 200)),
])
def test_the_default_bound_refuses_extreme_inputs(kind, size):
    ex = DEFAULTS[kind]()
    assert ex.max_tokens == MAX_TOKENS == 131072
    with pytest.raises(ValueError, match=r"more than max_tokens = 131,072") as e:
        ex.check_input_size(*size)
    assert f"{size[0]}x{size[1]}" in str(e.value)


def test_stego_res_rule_names_the_input_it_would_build():
    with pytest.raises(ValueError) as e:
        _stego().check_input_size(1, 250)
    assert str(e.value).startswith("an image of 1x250 would reach the network as a 320x80000 input, 400,000 patch "
                                   "tokens of 8 pixels (res=320 brings the shorter side to about 320")


def test_multiscale_checks_every_scale_first():
    calls = []

    def fn(x):
        calls.append(tuple(x.shape))
        return torch.zeros(x.shape[0], 2, x.shape[2] // 8, x.shape[3] // 8)

    with pytest.raises(ValueError, match=r"scale 1.5 turns the 16x64 image into a 24x96 input, 36 patch tokens of 8 "
                                         r"pixels, more than max_tokens = 20"):
        multiscale(fn, torch.zeros(3, 16, 64), (1.0, 1.5), True, 8, max_tokens=20)
    assert calls == []  # not even the first scale ran


def test_mars_features_names_the_file_and_skip_skips_it(tmp_path, capsys, monkeypatch):
    from test_stego import dhr_files, stego_state_dict

    from mars_plugin.cli import main

    b, h = dhr_files(tmp_path, stego_state_dict(width=192, dim=8))
    images = tmp_path / "images"
    images.mkdir()
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (24, 30, 3)).astype(np.uint8)).save(images / "fine.png")
    Image.fromarray(rng.integers(0, 256, (4, 40, 3)).astype(np.uint8)).save(images / "sliver.png")
    monkeypatch.setattr(CodeExtractor, "max_tokens", 100, raising=False)
    args = ["features", "--uss", "stego", "--backbone", str(b), "--heads", str(h), "--res", "32",
            "--images", str(images), "--no-progress"]
    capsys.readouterr()
    assert main(args + ["--out", str(tmp_path / "stop")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "sliver" in err and "32x320 input" in err and "max_tokens = 100" in err, err
    assert main(args + ["--out", str(tmp_path / "skip"), "--on-error", "skip"]) == 1
    err = capsys.readouterr().err
    assert str(images / "sliver.png") in err and "max_tokens = 100" in err, err
    assert sorted(p.name for p in (tmp_path / "skip").iterdir() if not p.name.startswith(".mars-run")) == ["fine.npy"]
