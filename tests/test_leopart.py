"""Leopart extractor: Lightning (model./teacher.) and released flat checkpoints, backbone tokens
or projection head, strict backbone loading."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from mars_plugin.adapters.uss.leopart import LeopartExtractor, leopart_backbone_prefix
from mars_plugin.adapters.uss.preprocess import IMAGENET_MEAN, IMAGENET_STD
from mars_plugin.adapters.uss.vit import DinoViT


def leopart_net(patch=16, width=384, depth=1, hidden=64, out=256, protos=10, seed=0):
    """Keys of Leopart's VisionTransformer (src/vit.py:117-164): backbone, projection_head.{0,2,4}, prototypes."""
    g = torch.Generator().manual_seed(seed)
    vit = DinoViT(patch, width, depth, num_patches=(224 // patch) ** 2)
    sd = {}
    for k, v in vit.state_dict().items():
        base = 1.0 if k.endswith(("norm1.weight", "norm2.weight")) or k == "norm.weight" else 0.0
        sd[k] = base + 0.05 * torch.randn(v.shape, generator=g)
    for i, (a, b) in zip((0, 2, 4), ((width, hidden), (hidden, hidden), (hidden, out))):
        sd[f"projection_head.{i}.weight"] = 0.1 * torch.randn(b, a, generator=g)
        sd[f"projection_head.{i}.bias"] = 0.1 * torch.randn(b, generator=g)
    sd["prototypes.weight"] = torch.randn(protos, out, generator=g)
    return sd


def prefixed(sd, prefix):
    return {prefix + k: v for k, v in sd.items()}


@pytest.fixture(scope="module")
def student():
    return leopart_net(seed=0)


@pytest.fixture(scope="module")
def teacher():
    return leopart_net(seed=1)


def manual_tokens(sd, img_u8, res, patch=16):
    """forward_backbone(x)[:, 1:] of a ViT loaded with only the backbone keys, on a 448-style resize."""
    vit = DinoViT(patch, 384, 1, num_patches=(224 // patch) ** 2)
    vit.load_state_dict({k: v for k, v in sd.items() if "head" not in k and "prototypes" not in k})
    x = F.interpolate(img_u8.float() / 255, size=(res, res), mode="bilinear", align_corners=False, antialias=True)
    x = (x - torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)) / torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    with torch.no_grad():
        return vit.forward_tokens(x)[:, 1:]


IMG = torch.randint(0, 256, (2, 3, 40, 52), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))


def test_lightning_checkpoint_uses_the_student(tmp_path, student, teacher):
    ckpt = {"state_dict": {**prefixed(student, "model."), **prefixed(teacher, "teacher.")}, "epoch": 1,
            "hyper_parameters": {"arch": "vit-small", "patch_size": 16, "projection_feat_dim": 256}}
    p = tmp_path / "leopart_lightning.ckpt"
    torch.save(ckpt, p)
    ex = LeopartExtractor.from_checkpoint(p, res=64)
    out = ex(IMG)
    assert out.shape == (2, 384, 4, 4) and ex.grid_size(40, 52) == (4, 4)
    ref = manual_tokens(student, IMG, 64).transpose(1, 2).reshape(2, 384, 4, 4)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    other = manual_tokens(teacher, IMG, 64).transpose(1, 2).reshape(2, 384, 4, 4)
    assert not torch.allclose(out, other, atol=1e-3)
    assert not ex.normalize  # raw tokens, as Leopart's evaluation


@pytest.mark.parametrize("prefix", ["model.", "student."])
def test_released_flat_checkpoint(tmp_path, student, prefix):
    p = tmp_path / "leopart_vits16.ckpt"
    torch.save(prefixed(student, prefix), p)  # one leading component, README: ".".join(k.split(".")[1:])
    ex = LeopartExtractor.from_checkpoint(p, res=64)
    ref = manual_tokens(student, IMG, 64).transpose(1, 2).reshape(2, 384, 4, 4)
    torch.testing.assert_close(ex(IMG), ref, rtol=1e-4, atol=1e-5)


def test_projection_head_embedding(student):
    ex = LeopartExtractor.from_state_dict(prefixed(student, "model."), head=True, res=64)
    assert ex.dim == 256 and ex.normalize
    assert isinstance(ex.projection_head, nn.Sequential) and len(ex.projection_head) == 5
    out = ex(IMG)
    assert out.shape == (2, 256, 4, 4)
    tok = manual_tokens(student, IMG, 64)

    def lin(i, t):
        return t @ student[f"projection_head.{i}.weight"].T + student[f"projection_head.{i}.bias"]

    emb = F.normalize(lin(4, F.gelu(lin(2, F.gelu(lin(0, tok))))), dim=-1)  # forward_head
    torch.testing.assert_close(out, emb.transpose(1, 2).reshape(2, 256, 4, 4), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out.norm(dim=1), torch.ones(2, 4, 4), rtol=0, atol=1e-5)
    up = ex(IMG, output_size=(40, 52))
    assert up.shape == (2, 256, 40, 52)
    torch.testing.assert_close(up.norm(dim=1), torch.ones(2, 40, 52), rtol=0, atol=1e-5)


def test_single_linear_head(student):
    sd = {k: v for k, v in student.items() if not k.startswith("projection_head")}
    sd["projection_head.weight"] = torch.randn(32, 384)
    sd["projection_head.bias"] = torch.randn(32)
    ex = LeopartExtractor.from_state_dict(sd, head=True, res=32)
    assert isinstance(ex.projection_head, nn.Linear) and ex(IMG[:1]).shape == (1, 32, 2, 2)


def test_vit_base8_variant():
    sd = leopart_net(patch=8, width=768, depth=1, hidden=32, out=16)
    ex = LeopartExtractor.from_state_dict(prefixed(sd, "model."), res=32)
    assert "ViT-B/8" in ex.describe() and ex(IMG[:1]).shape == (1, 768, 4, 4)


def test_missing_backbone_key_fails_loudly(student):
    bad = prefixed(student, "model.")
    del bad["model.blocks.0.norm2.weight"]
    with pytest.raises(ValueError, match=r"missing keys \['blocks\.0\.norm2\.weight'\]"):
        LeopartExtractor.from_state_dict(bad)
    bad = prefixed(student, "model.")
    bad["model.pos_drop.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"unexpected keys \['pos_drop\.weight'\]"):
        LeopartExtractor.from_state_dict(bad)


def test_head_requested_without_head_weights(student):
    backbone_only = {k: v for k, v in student.items() if "head" not in k and "prototypes" not in k}
    assert LeopartExtractor.from_state_dict(backbone_only, res=32).dim == 384  # bare backbone, no prefix
    with pytest.raises(ValueError, match="projection_head"):
        LeopartExtractor.from_state_dict(backbone_only, head=True)


def test_prefix_detection(student, teacher):
    both = {**prefixed(student, "model."), **prefixed(teacher, "teacher.")}
    assert leopart_backbone_prefix(both) == "model."
    assert leopart_backbone_prefix(prefixed(student, "backbone.")) == "backbone."
    assert leopart_backbone_prefix(student) == ""
    assert leopart_backbone_prefix(both, "teacher.") == "teacher."
    two = {**prefixed(student, "a."), **prefixed(teacher, "b.")}
    with pytest.raises(ValueError, match="prefix="):
        leopart_backbone_prefix(two)
    with pytest.raises(ValueError, match="cls_token"):
        leopart_backbone_prefix({"x.weight": torch.zeros(1)})


def test_res_must_be_a_multiple_of_the_patch(student):
    with pytest.raises(ValueError, match="multiple of the patch size 16"):
        LeopartExtractor.from_state_dict(student, res=100)


def test_lightning_checkpoint_with_objects_needs_trust(tmp_path, student):
    class AttributeDict(dict):
        pass

    AttributeDict.__qualname__ = "AttributeDict"
    globals()["AttributeDict"] = AttributeDict
    try:
        p = tmp_path / "leopart_pl.ckpt"
        torch.save({"state_dict": prefixed(student, "model."), "hyper_parameters": AttributeDict(arch="vit-small")}, p)
    finally:
        del globals()["AttributeDict"]
    with pytest.raises(PermissionError, match="trust_pickle"):
        LeopartExtractor.from_checkpoint(p)
    assert LeopartExtractor.from_checkpoint(p, trust_pickle=True, res=32).dim == 384
