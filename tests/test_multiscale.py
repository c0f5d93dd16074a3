"""DHR's multi-scale, flip-averaged inference (adapters/uss/multiscale.py) against a plain reference
written here from DHR's ``inference`` (core/uss/__init__.py:54-74 @ 94d5189): one scale at a
time, the flip as a separate forward call, sizes by DHR's own while loops. Plus the extractors'
``scales`` option (STEGO, Leopart, ModelExtractor) and ``res=None``."""
import math

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from mars_plugin.adapters.uss.extractor import DHR_SCALES, DHR_SETTINGS, ModelExtractor, imagenet_preprocess, multiscale
from mars_plugin.adapters.uss.leopart import LeopartExtractor
from mars_plugin._checks import check_scales
from mars_plugin.adapters.uss.multiscale import nearest_patch_size, scaled_size
from mars_plugin.adapters.uss.stego import STEGOExtractor
from mars_plugin.adapters.uss.preprocess import normalize_imagenet, resize_images
from mars_plugin.adapters.uss.vit import DinoViT

TOL = 1e-4


def tiny_vit(patch=8, width=32, depth=2, heads=2, seed=0):
    """A random-weight DINO ViT (position grid 224/patch squared, so it is interpolated)."""
    g = torch.Generator().manual_seed(seed)
    m = DinoViT(patch, width, depth, num_heads=heads, num_patches=(224 // patch) ** 2)
    with torch.no_grad():
        for name, p in m.named_parameters():
            base = 1.0 if name.endswith(("norm1.weight", "norm2.weight")) or name == "norm.weight" else 0.0
            p.copy_(base + 0.1 * torch.randn(p.shape, generator=g))
    return m.eval()


def dhr_size(ih, iw, scale, patch):
    """core/uss/__init__.py:56-58, written as DHR writes it."""
    sh, sw = int(ih * scale), int(iw * scale)
    while sw % patch != 0:
        sw += 1
    while sh % patch != 0:
        sh += 1
    return sh, sw


@torch.no_grad()
def reference(fn, image, scales, flip, patch):
    """DHR's inference, one forward call per image and per flip, sizes from dhr_size."""
    ih, iw = image.shape[1:]
    maps = []
    for scale in scales:
        sh, sw = dhr_size(ih, iw, scale, patch)
        x = image[None]
        if (sh, sw) != (ih, iw):
            x = F.interpolate(x, size=(sh, sw), mode="bilinear", align_corners=False)
        f = fn(x)[0]
        if flip:
            f_flip = fn(x.flip(-1))[0].flip(-1)
            f = (f + f_flip) / 2
        maps.append(f)
    grid = maps[0].shape[1:]
    total = torch.zeros_like(maps[0])
    for f in maps:
        if f.shape[1:] != grid:
            f = F.interpolate(f[None], size=tuple(grid), mode="bilinear", align_corners=False)[0]
        total = total + f
    return total / len(scales)


def random_image(h, w, seed=0):
    """A normalised (3, h, w) image with some structure (a gradient plus noise)."""
    g = torch.Generator().manual_seed(seed)
    u8 = (torch.rand(1, 3, h, w, generator=g) * 200 + torch.linspace(0, 55, w)).to(torch.uint8)
    return normalize_imagenet(u8.float() / 255)[0]


MAX_ERR = {}


@torch.no_grad()
@pytest.mark.parametrize("patch", [8, 14])
@pytest.mark.parametrize("size", [(37, 53), (40, 56), (29, 61)])
@pytest.mark.parametrize("flip", [True, False])
def test_multiscale_equals_reference(patch, size, flip):
    vit = tiny_vit(patch)
    image = random_image(*size, seed=size[0])
    out = multiscale(vit.patch_tokens, image, DHR_SCALES, flip=flip, patch=patch)
    ref = reference(vit.patch_tokens, image, DHR_SCALES, flip, patch)
    grid = tuple(s // patch for s in dhr_size(*size, 2.0, patch))
    assert out.shape == (32, *grid) and out.dtype == torch.float32
    err = float((out - ref).abs().max())
    MAX_ERR[(patch, size, flip)] = err
    assert err <= TOL, err
    assert float(ref.abs().max()) > 0.1  # the maps are not trivially small


@torch.no_grad()
def test_scales_in_another_order_first_sets_the_grid():
    vit = tiny_vit(8)
    image = random_image(37, 53, seed=3)
    for scales in [(0.5, 2.0, 1.0), (1.5, 1.0), (1.0,), (3.0, 0.25)]:
        out = multiscale(vit.patch_tokens, image, scales, flip=True, patch=8)
        ref = reference(vit.patch_tokens, image, scales, True, 8)
        assert out.shape[1:] == tuple(s // 8 for s in dhr_size(37, 53, scales[0], 8))
        torch.testing.assert_close(out, ref, rtol=0, atol=TOL)
    # the order of the later scales does not matter beyond rounding, the first one does
    a = multiscale(vit.patch_tokens, image, (1.0, 2.0, 0.5), patch=8)
    b = multiscale(vit.patch_tokens, image, (1.0, 0.5, 2.0), patch=8)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    assert multiscale(vit.patch_tokens, image, (2.0, 1.0), patch=8).shape != a.shape


def test_scaled_size_rounds_up_like_dhr():
    # by hand: 375 * 1.5 = 562.5 -> 562 -> 568; 500 * 0.5 = 250 -> 256; 37 * 0.5 = 18.5 -> 18 -> 24
    assert scaled_size(375, 500, 2.0, 8) == (752, 1000)
    assert scaled_size(375, 500, 1.5, 8) == (568, 752)
    assert scaled_size(375, 500, 0.5, 8) == (192, 256)
    assert scaled_size(37, 53, 0.5, 8) == (24, 32)
    assert scaled_size(37, 53, 1.0, 14) == (42, 56)
    assert scaled_size(40, 56, 1.0, 8) == (40, 56)
    for h, w in [(37, 53), (375, 500), (1, 9), (333, 1)]:
        for s in (2.0, 1.0, 1.5, 0.5, 0.7, 1 / 3, 1.1):
            for p in (8, 14, 16):
                if int(h * s) >= 1 and int(w * s) >= 1:
                    assert scaled_size(h, w, s, p) == dhr_size(h, w, s, p)
    with pytest.raises(ValueError, match=r"scale 0.5 turns the image height 1 into 0.5 pixels"):
        scaled_size(1, 40, 0.5, 8)
    assert nearest_patch_size(37, 53, 8) == (40, 56) and nearest_patch_size(35, 3, 8) == (32, 8)


@torch.no_grad()
def test_scale_one_on_an_exact_multiple_is_not_resized():
    seen = []

    def spy(x):
        seen.append(x.clone())
        return x[:, :1, ::8, ::8]

    image = random_image(40, 56, seed=4)
    out = multiscale(spy, image, (1.0,), flip=False, patch=8)
    assert torch.equal(seen[0][0], image)  # bit for bit: no interpolation ran
    assert torch.equal(out, image[:1, ::8, ::8])
    seen.clear()
    multiscale(spy, image, (1.0,), flip=True, patch=8)
    assert seen[0].shape == (2, 3, 40, 56) and torch.equal(seen[0][1], image.flip(-1))  # one batch of 2
    seen.clear()
    multiscale(spy, random_image(37, 53), (1.0,), flip=False, patch=8)
    assert seen[0].shape == (1, 3, 40, 56)  # not a multiple: rounded up and resized


def test_bad_arguments_are_named():
    vit = tiny_vit(8)
    image = random_image(40, 56)
    with pytest.raises(ValueError, match=r"expected \(2, D, 10, 14\), the 4-pixel patch grid"):
        multiscale(vit.patch_tokens, image, (1.0,), patch=4)
    with pytest.raises(ValueError, match="fn must return a"):
        multiscale(lambda x: x.mean(), image, (1.0,), patch=8)
    with pytest.raises(ValueError, match="at least one scale"):
        multiscale(vit.patch_tokens, image, [], patch=8)
    for bad, err in [((0.0,), ValueError), ((1.0, -2.0), ValueError), ((float("nan"),), ValueError),
                     ((float("inf"),), ValueError), ("2,1", TypeError), ((True,), TypeError), (2.0, TypeError)]:
        with pytest.raises(err, match="scales"):
            multiscale(vit.patch_tokens, image, bad, patch=8)
    with pytest.raises(ValueError, match="patch"):
        multiscale(vit.patch_tokens, image, (1.0,), patch=0)
    with pytest.raises(TypeError, match="patch"):
        multiscale(vit.patch_tokens, image, (1.0,), patch=8.0)
    with pytest.raises(ValueError, match=r"\(3, H, W\)"):
        multiscale(vit.patch_tokens, image[None], (1.0,))
    with pytest.raises(TypeError, match="floating"):
        multiscale(vit.patch_tokens, (image * 50).to(torch.uint8), (1.0,))
    with pytest.raises(TypeError, match="flip"):
        multiscale(vit.patch_tokens, image, (1.0,), flip=1)
    with pytest.raises(TypeError, match="fn must be callable"):
        multiscale(None, image)
    with pytest.raises(ValueError, match="too small for this scale"):
        multiscale(vit.patch_tokens, random_image(1, 16), (0.5,), patch=8)
    assert check_scales([2, 1.5]) == (2.0, 1.5)


# -- the extractors' scales option --------------------------------------------------------------


def conv1x1(conv, t):
    return torch.einsum("oi,bihw->bohw", conv.weight[:, :, 0, 0], t) + conv.bias.view(1, -1, 1, 1)


def stego_parts(width=32, dim=6, seed=0):
    g = torch.Generator().manual_seed(seed + 10)
    vit = tiny_vit(8, width=width, seed=seed)
    c1 = nn.Sequential(nn.Conv2d(width, dim, 1))
    c2 = nn.Sequential(nn.Conv2d(width, width, 1), nn.ReLU(), nn.Conv2d(width, dim, 1))
    with torch.no_grad():
        for p in list(c1.parameters()) + list(c2.parameters()):
            p.copy_(0.2 * torch.randn(p.shape, generator=g))
    return vit, c1, c2


def stego_code_by_hand(vit, c1, c2):
    def code(x):
        feat = vit.patch_tokens(x)
        return conv1x1(c1[0], feat) + conv1x1(c2[2], torch.relu(conv1x1(c2[0], feat)))
    return code


@torch.no_grad()
def test_stego_dhr_settings_equal_reference_on_the_full_image():
    vit, c1, c2 = stego_parts()
    ex = STEGOExtractor(vit, c1, c2, **DHR_SETTINGS)
    u8 = torch.randint(0, 256, (2, 3, 37, 53), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    out = ex(u8)
    assert out.shape == (2, 6, *ex.grid_size(37, 53)) and ex.grid_size(37, 53) == (10, 14)
    code = stego_code_by_hand(vit, c1, c2)
    for i in range(2):
        ref = reference(code, normalize_imagenet(u8[i:i + 1].float() / 255)[0], DHR_SCALES, True, 8)
        torch.testing.assert_close(out[i], ref, rtol=0, atol=TOL)
    assert "full resolution, scales 2, 1, 1.5, 0.5" in ex.describe() and "L2 normalisation off" in ex.describe()
    # output_size then L2 normalisation still apply after the multi-scale sum
    ex.normalize = True
    up = ex(u8, output_size=(37, 53))
    torch.testing.assert_close(up, F.normalize(F.interpolate(out, size=(37, 53), mode="bilinear",
                                                             align_corners=False), dim=1), rtol=0, atol=1e-5)


@torch.no_grad()
def test_stego_scales_apply_to_the_res_resized_image_and_res_none_single_scale():
    vit, c1, c2 = stego_parts(seed=1)
    code = stego_code_by_hand(vit, c1, c2)
    u8 = torch.randint(0, 256, (1, 3, 45, 61), dtype=torch.uint8, generator=torch.Generator().manual_seed(6))
    ex = STEGOExtractor(vit, c1, c2, res=24, scales=(1.0, 0.5), flip_average=False, normalize=False)
    base = F.interpolate(u8.float() / 255, size=(24, 32), mode="nearest-exact")  # 45x61 -> shorter side 24
    ref = reference(code, normalize_imagenet(base)[0], (1.0, 0.5), False, 8)
    torch.testing.assert_close(ex(u8)[0], ref, rtol=0, atol=TOL)
    # res=None without scales: the image's own size, each side to the nearest patch multiple
    one = STEGOExtractor(vit, c1, c2, res=None, flip_average=False, normalize=False)
    assert one.input_size(45, 61) == (48, 64) and one.grid_size(45, 61) == (6, 8)
    x = normalize_imagenet(F.interpolate(u8.float() / 255, size=(48, 64), mode="nearest-exact"))
    torch.testing.assert_close(one(u8), code(x), rtol=0, atol=TOL)
    with pytest.raises(ValueError, match="res must be None"):
        STEGOExtractor(vit, c1, c2, res=4)
    with pytest.raises(ValueError, match="scales"):
        STEGOExtractor(vit, c1, c2, scales=())


@torch.no_grad()
def test_leopart_flip_and_scales():
    vit = tiny_vit(8, seed=2)
    u8 = torch.randint(0, 256, (2, 3, 37, 53), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))
    x = normalize_imagenet(resize_images(u8.float() / 255, (32, 32), "bilinear"))
    lp = LeopartExtractor(vit, res=32, flip_average=True)
    flip_ref = (vit.patch_tokens(x) + vit.patch_tokens(x.flip(3)).flip(3)) / 2
    torch.testing.assert_close(lp(u8), flip_ref, rtol=0, atol=TOL)
    plain = LeopartExtractor(vit, res=32)
    torch.testing.assert_close(plain(u8), vit.patch_tokens(x), rtol=0, atol=TOL)
    ms = LeopartExtractor(vit, res=None, scales=(1.5, 1.0, 0.5), flip_average=True)
    out = ms(u8)
    assert out.shape == (2, 32, *ms.grid_size(37, 53)) and ms.grid_size(37, 53) == (7, 10)
    for i in range(2):
        ref = reference(vit.patch_tokens, normalize_imagenet(u8[i:i + 1].float() / 255)[0], (1.5, 1.0, 0.5), True, 8)
        torch.testing.assert_close(out[i], ref, rtol=0, atol=TOL)


@torch.no_grad()
def test_model_extractor_scales():
    vit = tiny_vit(14, seed=3)  # a patch-14 model, as CAUSE's DINOv2
    ex = ModelExtractor(vit, preprocess=imagenet_preprocess(None), scales=(1.0, 2.0), flip_average=True, patch_size=14)
    u8 = torch.randint(0, 256, (1, 3, 30, 44), dtype=torch.uint8, generator=torch.Generator().manual_seed(8))
    ref = reference(vit.patch_tokens, normalize_imagenet(u8.float() / 255)[0], (1.0, 2.0), True, 14)
    torch.testing.assert_close(ex(u8)[0], ref, rtol=0, atol=TOL)
    with pytest.raises(ValueError, match="patch_size"):
        ModelExtractor(vit, scales=(1.0,))


def test_dhr_settings_are_one_read_only_place():
    assert dict(DHR_SETTINGS) == {"res": None, "scales": (2.0, 1.0, 1.5, 0.5), "flip_average": True,
                                  "normalize": False}
    with pytest.raises(TypeError):
        DHR_SETTINGS["res"] = 320  # type: ignore[index]


def test_report_max_error(capsys):
    """Prints the largest |multiscale - reference| seen above (run with -s to read it)."""
    if MAX_ERR:
        worst = max(MAX_ERR.values())
        with capsys.disabled():
            print(f"\nmultiscale vs reference: max abs error {worst:.3g} over {len(MAX_ERR)} cases")
        assert math.isfinite(worst)
