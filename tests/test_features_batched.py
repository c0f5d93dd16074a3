"""DHR's multi-scale + flip features of a batch of same-size images in one network call per scale
(adapters/uss/multiscale.py ``multiscale_batch``), equal to one image at a time: the function, the
extractors that call it, and the files ``mars features --dhr`` writes at --batch-size 1 and 4."""
import numpy as np
import pytest
import torch
from test_multiscale import random_image, stego_parts, tiny_vit

from mars_plugin.adapters.uss.extractor import DHR_SCALES, DHR_SETTINGS, ModelExtractor, imagenet_preprocess
from mars_plugin.adapters.uss.multiscale import multiscale, multiscale_batch
from mars_plugin.adapters.uss.stego import STEGOExtractor
from mars_plugin.formats.files import read_features, write_image
from _spies import Spy

ATOL = 1e-6  # float32 on the CPU: a larger batch only changes how the matrix products tile


@torch.no_grad()
@pytest.mark.parametrize("flip", [True, False])
@pytest.mark.parametrize("size", [(37, 53), (40, 24)])
def test_batch_equals_one_image_at_a_time(size, flip):
    vit = tiny_vit(8)
    images = torch.stack([random_image(*size, seed=s) for s in range(3)])
    spy = Spy(vit.patch_tokens)
    out = multiscale_batch(spy, images, DHR_SCALES, flip=flip, patch=8)
    # one call per scale, the 3 images and (flip) their 3 mirrors together
    assert spy.batches == [6 if flip else 3] * len(DHR_SCALES)
    assert out.shape[0] == 3 and out.dtype == torch.float32
    for i in range(3):
        one = multiscale(vit.patch_tokens, images[i], DHR_SCALES, flip=flip, patch=8)
        assert out.shape[1:] == one.shape
        torch.testing.assert_close(out[i], one, rtol=0, atol=ATOL)
    # the images are not interchangeable: a mix-up of the batch would show
    assert float((out[0] - out[1]).abs().max()) > 1e-2


@torch.no_grad()
def test_one_image_batch_is_multiscale_bit_for_bit():
    vit = tiny_vit(14)
    image = random_image(29, 61, seed=3)
    assert torch.equal(multiscale_batch(vit.patch_tokens, image[None], (1.0, 0.5), True, 14)[0],
                       multiscale(vit.patch_tokens, image, (1.0, 0.5), True, 14))


@torch.no_grad()
def test_extractors_run_one_call_per_scale_for_the_batch():
    vit, c1, c2 = stego_parts()
    ex = STEGOExtractor(vit, c1, c2, **DHR_SETTINGS)
    spy = Spy(ex.code)
    ex.code = spy
    u8 = torch.randint(0, 256, (3, 3, 37, 53), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    out = ex(u8)
    assert spy.batches == [6] * len(DHR_SCALES)
    for i in range(3):
        torch.testing.assert_close(out[i:i + 1], ex(u8[i:i + 1]), rtol=0, atol=ATOL)
    mx = ModelExtractor(vit, preprocess=imagenet_preprocess(), flip_average=True, scales=(1.0, 0.5), patch_size=8)
    mspy = Spy(mx._map)
    mx._map = mspy
    both = mx(u8)
    assert mspy.batches == [6, 6]
    torch.testing.assert_close(both[2:], mx(u8[2:]), rtol=0, atol=ATOL)


def test_batch_argument_errors():
    vit = tiny_vit(8)
    with pytest.raises(ValueError, match=r"\(B, 3, H, W\)"):
        multiscale_batch(vit.patch_tokens, random_image(40, 56), (1.0,))
    with pytest.raises(TypeError, match="floating"):
        multiscale_batch(vit.patch_tokens, torch.zeros(2, 3, 16, 16, dtype=torch.uint8), (1.0,))
    with pytest.raises(TypeError, match="fn must be callable"):
        multiscale_batch(None, torch.zeros(2, 3, 16, 16))


def test_mars_features_dhr_files_equal_at_batch_1_and_4(tmp_path):
    """`mars features --dhr` over 5 images of 2 sizes: the files of --batch-size 1 and 4 are equal
    (float16 files: to one float16 step of the largest value)."""
    from mars_plugin.cli import main

    assert main(["sample", "--tree", "dhr", "--out", str(tmp_path / "tree"), "--num-images", "2",
                 "--size", "32"]) == 0
    weights = tmp_path / "tree" / "weights"
    images = tmp_path / "images"
    images.mkdir()
    rng = np.random.default_rng(0)
    for i, (h, w) in enumerate([(37, 53), (37, 53), (40, 24), (37, 53), (40, 24)]):
        write_image(images / f"im{i}.png", rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
    outs = {}
    for b in (1, 4):
        outs[b] = tmp_path / f"b{b}"
        assert main(["features", "--uss", "stego", "--backbone", str(weights / "dino_tiny_random.pth"),
                     "--heads", str(weights / "STEGO_VOC2012.pt"), "--dhr", "--images", str(images),
                     "--out", str(outs[b]), "--batch-size", str(b), "--no-progress"]) == 0
    for i in range(5):
        a = read_features(outs[1] / f"im{i}.npy").float()
        c = read_features(outs[4] / f"im{i}.npy").float()
        assert a.shape == c.shape
        step = 2.0 ** (np.floor(np.log2(float(a.abs().max()))) - 10)  # one float16 ulp at the largest value
        torch.testing.assert_close(c, a, rtol=0, atol=step)


def test_attention_goes_to_sdpa_without_a_mask_and_with_contiguous_heads(monkeypatch):
    """What keeps torch's fused kernels (flash, memory-efficient) eligible on a GPU: no explicit
    mask, no dropout, the head dimension contiguous (stride 1), q/k/v in the autocast dtype."""
    import mars_plugin.adapters.uss.vit as vit_module

    seen = []
    real = vit_module.F.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        seen.append((args, kwargs, [t.stride(-1) for t in (q, k, v)], {t.dtype for t in (q, k, v)}))
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(vit_module.F, "scaled_dot_product_attention", spy)
    vit = tiny_vit(8, depth=2)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        multiscale_batch(vit.patch_tokens, torch.stack([random_image(24, 32), random_image(24, 32, seed=1)]),
                         (1.0, 0.5), True, 8)
    assert len(seen) == 2 * 2  # 2 blocks x 2 scales: one call per block per scale for the whole batch
    for args, kwargs, strides, dtypes in seen:
        assert args == () and kwargs == {} and strides == [1, 1, 1] and dtypes == {torch.bfloat16}


def test_vit_flops_count_equals_torch_flop_counter(monkeypatch):
    """benchmarks/bench_multiscale.vit_flops (the docs' FLOPs per image) against torch's own count
    of the same forward, attention written out as matrix products so the counter sees them."""
    import os
    import sys

    from torch.utils.flop_counter import FlopCounterMode

    import mars_plugin.adapters.uss.vit as vit_module

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    from bench_multiscale import vit_flops

    def math_attention(q, k, v):
        return torch.softmax(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5, dim=-1) @ v

    monkeypatch.setattr(vit_module.F, "scaled_dot_product_attention", math_attention)
    vit = tiny_vit(8, width=64, depth=2)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        multiscale_batch(vit.patch_tokens, torch.randn(1, 3, 45, 61), DHR_SCALES, True, 8)
    total, rows = vit_flops(45, 61, 64, 2, 8)
    assert counter.get_total_flops() == total
    assert [n for _, _, n, _, _ in rows] == [12 * 16 + 1, 6 * 8 + 1, 9 * 12 + 1, 3 * 4 + 1]
