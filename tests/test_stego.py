"""STEGO extractor: checkpoint layout, code = cluster1 + cluster2, flip averaging, sizes."""
import pytest
import torch
import torch.nn.functional as F

from mars_plugin.adapters.stego import STEGOExtractor, stego_input_size
from mars_plugin.adapters.vit import IMAGENET_MEAN, IMAGENET_STD, DinoViT


def stego_state_dict(patch=8, width=384, depth=1, dim=16, nonlinear=True, seed=0):
    """A random ``LitUnsupervisedSegmenter.state_dict()`` (DINO featurizer + probes + decoder)."""
    g = torch.Generator().manual_seed(seed)
    vit = DinoViT(patch, width, depth, num_patches=(224 // patch) ** 2)
    sd = {}
    for k, v in vit.state_dict().items():
        base = 1.0 if k.endswith(("norm1.weight", "norm2.weight")) or k == "norm.weight" else 0.0
        sd["net.model." + k] = base + 0.05 * torch.randn(v.shape, generator=g)
    sd["net.cluster1.0.weight"] = 0.05 * torch.randn(dim, width, 1, 1, generator=g)
    sd["net.cluster1.0.bias"] = 0.05 * torch.randn(dim, generator=g)
    if nonlinear:
        sd["net.cluster2.0.weight"] = 0.05 * torch.randn(width, width, 1, 1, generator=g)
        sd["net.cluster2.0.bias"] = 0.05 * torch.randn(width, generator=g)
        sd["net.cluster2.2.weight"] = 0.05 * torch.randn(dim, width, 1, 1, generator=g)
        sd["net.cluster2.2.bias"] = 0.05 * torch.randn(dim, generator=g)
    # the rest of LitUnsupervisedSegmenter (src/train_segmentation.py:73-78), ignored by the extractor
    sd["train_cluster_probe.clusters"] = torch.randn(27, dim, generator=g)
    sd["cluster_probe.clusters"] = torch.randn(27, dim, generator=g)
    sd["linear_probe.weight"] = torch.randn(27, dim, 1, 1, generator=g)
    sd["linear_probe.bias"] = torch.randn(27, generator=g)
    sd["decoder.weight"] = torch.randn(width, dim, 1, 1, generator=g)
    sd["decoder.bias"] = torch.randn(width, generator=g)
    return sd


def lightning_ckpt(sd, hyper=None):
    return {"epoch": 4, "global_step": 5000, "pytorch-lightning_version": "1.4.9", "state_dict": sd,
            "optimizer_states": [], "lr_schedulers": [],
            "hyper_parameters": hyper if hyper is not None else {"n_classes": 27, "cfg": {"dim": 16}}}


class FakeDictConfig:
    """Stands for omegaconf.DictConfig in STEGO's hyper_parameters."""

    def __init__(self, **content):
        self.content = content


@pytest.fixture(scope="module")
def sd():
    return stego_state_dict()


@pytest.fixture(scope="module")
def stego(sd):
    return STEGOExtractor.from_state_dict(sd, res=32)


def manual_code(ex, img_u8, size):
    """STEGO by hand: nearest resize, ImageNet norm, feat -> cluster1 + cluster2 (1x1 convs as matmuls)."""
    x = F.interpolate(img_u8.float() / 255, size=size, mode="nearest-exact")
    x = (x - torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)) / torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    feat = ex.model.patch_tokens(x)
    c1, a, b = ex.cluster1[0], ex.cluster2[0], ex.cluster2[2]

    def conv1x1(conv, t):
        return torch.einsum("oi,bihw->bohw", conv.weight[:, :, 0, 0], t) + conv.bias.view(1, -1, 1, 1)

    return conv1x1(c1, feat) + conv1x1(b, torch.relu(conv1x1(a, feat)))


def test_checkpoint_layout_and_keys(sd, stego):
    assert stego.dim == 16 and stego.patch_size == 8 and stego.model.embed_dim == 384
    assert set(stego.state_dict()) == {k[len("net."):] for k in sd if k.startswith("net.")}
    assert "ViT-S/8" in stego.describe() and "nonlinear" in stego.describe()


def test_input_size_rule():
    assert stego_input_size(375, 500, 320, 8) == (320, 424)     # VOC landscape: 426.7 -> 53 patches
    assert stego_input_size(500, 375, 320, 16) == (432, 320)    # 426.7 / 16 = 26.7 -> 27 patches
    assert stego_input_size(320, 320, 320, 8) == (320, 320)
    assert stego_input_size(10, 1000, 16, 8) == (16, 1600)
    assert stego_input_size(40, 56, 32, 8) == (32, 48)          # 44.8 / 8 = 5.6 -> 6 patches


@torch.no_grad()
def test_flip_average_equals_manual(stego):
    g = torch.Generator().manual_seed(1)
    img = torch.randint(0, 256, (2, 3, 40, 56), dtype=torch.uint8, generator=g)
    size = stego.input_size(40, 56)
    c = manual_code(stego, img, size)
    c_flip = manual_code(stego, img.flip(3), size).flip(3)
    ref = F.normalize((c + c_flip) / 2, dim=1)
    out = stego(img)
    assert out.shape == (2, 16, 4, 6) and stego.grid_size(40, 56) == (4, 6)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    # without flip averaging: the code of the image alone
    stego.flip_average = False
    try:
        torch.testing.assert_close(stego(img), F.normalize(c, dim=1), rtol=1e-4, atol=1e-5)
    finally:
        stego.flip_average = True
    # without normalisation: the raw averaged code
    stego.normalize = False
    try:
        torch.testing.assert_close(stego(img), (c + c_flip) / 2, rtol=1e-4, atol=1e-5)
    finally:
        stego.normalize = True


@torch.no_grad()
def test_output_size_is_bilinear_upsampling_then_normalisation(stego):
    img = torch.randint(0, 256, (1, 3, 40, 56), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    stego.normalize = False
    try:
        grid = stego(img)
    finally:
        stego.normalize = True
    up = stego(img, output_size=(40, 56))
    assert up.shape == (1, 16, 40, 56)
    ref = F.normalize(F.interpolate(grid, size=(40, 56), mode="bilinear", align_corners=False), dim=1)
    torch.testing.assert_close(up, ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(up.norm(dim=1), torch.ones(1, 40, 56), rtol=0, atol=1e-5)


@torch.no_grad()
def test_uint8_and_float_input_agree(stego):
    img = torch.randint(0, 256, (1, 3, 33, 47), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(stego(img), stego(img.float() / 255), rtol=1e-5, atol=1e-6)


def test_linear_projection_and_vit_base16():
    sd = stego_state_dict(patch=16, width=768, depth=1, dim=8, nonlinear=False)
    ex = STEGOExtractor.from_state_dict(sd, res=32, interpolation="bilinear")
    assert ex.cluster2 is None and ex.dim == 8 and "ViT-B/16" in ex.describe()
    out = ex(torch.randint(0, 256, (1, 3, 48, 64), dtype=torch.uint8))
    assert out.shape == (1, 8, 2, 3)  # 48x64 -> 32x43 -> 32x48 -> (2, 3)


def test_lightning_checkpoint_weights_only(tmp_path, sd):
    p = tmp_path / "stego.ckpt"
    torch.save(lightning_ckpt(sd), p)
    ex = STEGOExtractor.from_checkpoint(p, res=32)  # no trust needed: plain dicts and tensors
    img = torch.randint(0, 256, (1, 3, 32, 40), dtype=torch.uint8)
    torch.testing.assert_close(ex(img), STEGOExtractor.from_state_dict(sd, res=32)(img))


def test_lightning_checkpoint_with_objects_needs_trust(tmp_path, sd):
    p = tmp_path / "cocostuff27_like.ckpt"
    torch.save(lightning_ckpt(sd, {"n_classes": 27, "cfg": FakeDictConfig(dim=16, model_type="vit_small")}), p)
    with pytest.raises(PermissionError, match=r"FakeDictConfig.*trust_pickle=True \(CLI: --trust-pickle\)"):
        STEGOExtractor.from_checkpoint(p)
    ex = STEGOExtractor.from_checkpoint(p, trust_pickle=True, res=32)
    assert ex.dim == 16


def test_missing_backbone_key_is_named(tmp_path, sd):
    bad = dict(sd)
    del bad["net.model.blocks.0.attn.qkv.bias"]
    with pytest.raises(ValueError, match=r"missing keys \['blocks\.0\.attn\.qkv\.bias'\]"):
        STEGOExtractor.from_state_dict(bad)
    bad = dict(sd)
    del bad["net.cluster1.0.bias"]
    with pytest.raises(ValueError, match="cluster1.0.bias"):
        STEGOExtractor.from_state_dict(bad)
    bad = dict(sd, **{"net.extra.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="net.extra.weight"):
        STEGOExtractor.from_state_dict(bad)
    with pytest.raises(ValueError, match="net.model"):
        STEGOExtractor.from_state_dict({"backbone.cls_token": torch.zeros(1, 1, 384)})
    bad = dict(sd, **{"net.cluster1.0.weight": torch.zeros(16, 768, 1, 1)})
    with pytest.raises(ValueError, match="768 channels"):
        STEGOExtractor.from_state_dict(bad)


def test_bad_arguments(sd):
    with pytest.raises(ValueError, match="interpolation"):
        STEGOExtractor.from_state_dict(sd, interpolation="cubic")
    with pytest.raises(ValueError, match="res"):
        STEGOExtractor.from_state_dict(sd, res=4)
    ex = STEGOExtractor.from_state_dict(sd, res=32)
    with pytest.raises(TypeError, match="output_size"):
        ex(torch.zeros(1, 3, 32, 32), output_size=5)
