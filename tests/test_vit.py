"""The DINO ViT of the USS extractors: keys, variant detection, position-embedding interpolation,
forward pass against a transcription of DINO's, strict loading and checkpoint opening."""
import math
import sys
import types

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from mars_plugin.adapters.uss.preprocess import as_float_images
from mars_plugin.adapters.uss.vit import DinoViT, heads_for_width
from mars_plugin.adapters.uss.vit_weights import load_checkpoint, vit_from_state_dict, vit_state_dict_keys


def random_vit(patch=16, dim=384, depth=2, num_patches=196, seed=0):
    torch.manual_seed(seed)
    m = DinoViT(patch, dim, depth, num_patches=num_patches)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("norm1.weight") or name.endswith("norm2.weight") or name == "norm.weight":
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.05 * torch.randn_like(p))
    return m.eval()


# The key list of DINO's / timm's VisionTransformer with 2 blocks, written out by hand.
DINO_KEYS_DEPTH2 = [
    "cls_token", "pos_embed", "patch_embed.proj.weight", "patch_embed.proj.bias",
    "blocks.0.norm1.weight", "blocks.0.norm1.bias", "blocks.0.attn.qkv.weight", "blocks.0.attn.qkv.bias",
    "blocks.0.attn.proj.weight", "blocks.0.attn.proj.bias", "blocks.0.norm2.weight", "blocks.0.norm2.bias",
    "blocks.0.mlp.fc1.weight", "blocks.0.mlp.fc1.bias", "blocks.0.mlp.fc2.weight", "blocks.0.mlp.fc2.bias",
    "blocks.1.norm1.weight", "blocks.1.norm1.bias", "blocks.1.attn.qkv.weight", "blocks.1.attn.qkv.bias",
    "blocks.1.attn.proj.weight", "blocks.1.attn.proj.bias", "blocks.1.norm2.weight", "blocks.1.norm2.bias",
    "blocks.1.mlp.fc1.weight", "blocks.1.mlp.fc1.bias", "blocks.1.mlp.fc2.weight", "blocks.1.mlp.fc2.bias",
    "norm.weight", "norm.bias",
]


def test_state_dict_keys_equal_dino_and_timm():
    m = DinoViT(16, 384, 2)
    assert list(m.state_dict()) == DINO_KEYS_DEPTH2
    assert vit_state_dict_keys(2) == DINO_KEYS_DEPTH2
    shapes = {k: tuple(v.shape) for k, v in m.state_dict().items()}
    assert shapes["pos_embed"] == (1, 197, 384) and shapes["cls_token"] == (1, 1, 384)
    assert shapes["patch_embed.proj.weight"] == (384, 3, 16, 16)
    assert shapes["blocks.0.attn.qkv.weight"] == (1152, 384) and shapes["blocks.0.mlp.fc1.weight"] == (1536, 384)
    assert all(isinstance(b.norm1, nn.LayerNorm) and b.norm1.eps == 1e-6 for b in m.blocks) and m.norm.eps == 1e-6


@pytest.mark.parametrize("patch,dim,depth,heads", [(8, 384, 1, 6), (16, 384, 3, 6), (8, 768, 1, 12), (16, 768, 2, 12)])
def test_variant_read_from_shapes(patch, dim, depth, heads):
    n = (224 // patch) ** 2
    src = DinoViT(patch, dim, depth, num_patches=n)
    m = vit_from_state_dict(src.state_dict())
    assert (m.patch_size, m.embed_dim, m.depth, m.num_heads) == (patch, dim, depth, heads)
    assert m.pos_embed.shape == (1, n + 1, dim)
    assert heads_for_width(dim) == heads


def test_heads_unknown_width_needs_explicit_heads():
    sd = DinoViT(16, 128, 1, num_heads=2, num_patches=4).state_dict()
    with pytest.raises(ValueError, match="num_heads"):
        vit_from_state_dict(sd)
    assert vit_from_state_dict(sd, num_heads=2).num_heads == 2


def test_missing_and_unexpected_keys_are_named():
    sd = random_vit(depth=2).state_dict()
    bad = dict(sd)
    del bad["blocks.1.mlp.fc2.bias"]
    with pytest.raises(ValueError, match=r"missing keys \['blocks\.1\.mlp\.fc2\.bias'\]"):
        vit_from_state_dict(bad)
    bad = dict(sd, **{"head.weight": torch.zeros(10, 384)})
    with pytest.raises(ValueError, match=r"unexpected keys \['head\.weight'\]"):
        vit_from_state_dict(bad)
    bad = dict(sd)
    del bad["patch_embed.proj.weight"]
    with pytest.raises(ValueError, match="patch_embed.proj.weight"):
        vit_from_state_dict(bad)
    bad = {k: v for k, v in sd.items() if not k.startswith("blocks.0.")}
    with pytest.raises(ValueError, match=r"blocks \[0\] are missing"):
        vit_from_state_dict(bad)
    bad = dict(sd, **{"norm.weight": torch.ones(5)})
    with pytest.raises(ValueError, match="norm.weight"):
        vit_from_state_dict(bad)


# ------------------------------------------------------------------------------------------
# position embedding
# ------------------------------------------------------------------------------------------


def dino_interpolate_pos_encoding(pos_embed, patch_size, x, w, h):
    """DINO vision_transformer.py:174-194, transcribed statement by statement (DINO's names:
    ``w`` is the image height because prepare_tokens unpacks ``B, nc, w, h = x.shape``)."""
    npatch = x.shape[1] - 1
    N = pos_embed.shape[1] - 1
    if npatch == N and w == h:
        return pos_embed
    class_pos_embed = pos_embed[:, 0]
    patch_pos_embed = pos_embed[:, 1:]
    dim = x.shape[-1]
    w0 = w // patch_size
    h0 = h // patch_size
    w0, h0 = w0 + 0.1, h0 + 0.1
    patch_pos_embed = F.interpolate(
        patch_pos_embed.reshape(1, int(math.sqrt(N)), int(math.sqrt(N)), dim).permute(0, 3, 1, 2),
        scale_factor=(w0 / math.sqrt(N), h0 / math.sqrt(N)),
        mode="bicubic",
    )
    assert int(w0) == patch_pos_embed.shape[-2] and int(h0) == patch_pos_embed.shape[-1]
    patch_pos_embed = patch_pos_embed.permute(0, 2, 3, 1).view(1, -1, dim)
    return torch.cat((class_pos_embed.unsqueeze(0), patch_pos_embed), dim=1)


def _cubic_weights(t, A=-0.75):
    """Keys' cubic convolution weights of the 4 taps at offsets -1, 0, 1, 2 (PyTorch's A = -0.75)."""
    def near(x):  # |x| <= 1
        return ((A + 2) * x - (A + 3)) * x * x + 1

    def far(x):  # 1 < |x| < 2
        return ((A * x - 5 * A) * x + 8 * A) * x - 4 * A

    return [far(t + 1), near(t), near(1 - t), far(2 - t)]


def _bicubic_axis(a, axis, scale):
    """Resample one axis of a numpy array like upsample_bicubic2d(align_corners=False) with a
    given scale factor: out = floor(n * scale), src = (i + 0.5) / scale - 0.5, borders clamped."""
    n = a.shape[axis]
    out_n = int(math.floor(n * scale))
    a = np.moveaxis(a, axis, 0)
    res = np.zeros((out_n,) + a.shape[1:], dtype=np.float64)
    for i in range(out_n):
        src = (i + 0.5) / scale - 0.5
        i0 = math.floor(src)
        ws = _cubic_weights(src - i0)
        for k, wk in zip(range(-1, 3), ws):
            res[i] += wk * a[min(max(i0 + k, 0), n - 1)]
    return np.moveaxis(res, 0, axis)


@pytest.mark.parametrize("patch,H,W", [(16, 48, 80), (16, 64, 32), (8, 40, 56), (8, 37, 61), (16, 224, 224), (8, 96, 96)])
def test_pos_embedding_interpolation_is_dinos(patch, H, W):
    m = random_vit(patch=patch, depth=1, num_patches=(224 // patch) ** 2)
    x = torch.zeros(1, 1 + (H // patch) * (W // patch), m.embed_dim)
    ours = m.interpolate_pos_encoding(x.shape[1] - 1, H, W)
    ref = dino_interpolate_pos_encoding(m.pos_embed, patch, x, H, W)  # DINO: (x, w=rows, h=cols)
    torch.testing.assert_close(ours, ref, rtol=0, atol=0)
    # ... and against a hand-written bicubic with DINO's scale factors (+0.1 included)
    N = m.pos_embed.shape[1] - 1
    side = int(math.sqrt(N))
    grid = m.pos_embed[0, 1:].detach().double().numpy().reshape(side, side, -1)
    if (H // patch) ** 2 == N and H == W:
        hand = grid
    else:
        hand = _bicubic_axis(grid, 0, (H // patch + 0.1) / math.sqrt(N))
        hand = _bicubic_axis(hand, 1, (W // patch + 0.1) / math.sqrt(N))
    assert hand.shape[:2] == (H // patch, W // patch)
    np.testing.assert_allclose(ours[0, 1:].detach().numpy(), hand.reshape(-1, m.embed_dim), atol=2e-6)
    torch.testing.assert_close(ours[0, 0], m.pos_embed[0, 0])


def test_plus_point_one_matters():
    """Sampling with the +0.1 scale factor is not the same as resizing to the target size."""
    m = random_vit(patch=16, depth=1)
    ours = m.interpolate_pos_encoding(3 * 5, 48, 80)
    grid = m.pos_embed[:, 1:].reshape(1, 14, 14, -1).permute(0, 3, 1, 2)
    by_size = F.interpolate(grid, size=(3, 5), mode="bicubic").permute(0, 2, 3, 1).reshape(1, 15, -1)
    assert not torch.allclose(ours[:, 1:], by_size, atol=1e-4)


# ------------------------------------------------------------------------------------------
# forward
# ------------------------------------------------------------------------------------------


def dino_forward_tokens(m, x):
    """DINO's prepare_tokens + blocks + norm (vision_transformer.py:68-113, 196-214), written
    with explicit attention (softmax(q k^T * scale) v) and DINO's reshapes."""
    B, nc, w, h = x.shape
    t = m.patch_embed.proj(x).flatten(2).transpose(1, 2)
    t = torch.cat((m.cls_token.expand(B, -1, -1), t), dim=1)
    t = t + dino_interpolate_pos_encoding(m.pos_embed, m.patch_size, t, w, h)
    for blk in m.blocks:
        y = blk.norm1(t)
        Bq, N, C = y.shape
        heads = m.num_heads
        qkv = blk.attn.qkv(y).reshape(Bq, N, 3, heads, C // heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        attn = ((q @ k.transpose(-2, -1)) * (C // heads) ** -0.5).softmax(dim=-1)
        y = blk.attn.proj((attn @ v).transpose(1, 2).reshape(Bq, N, C))
        t = t + y
        z = blk.mlp.fc2(F.gelu(blk.mlp.fc1(blk.norm2(t))))
        t = t + z
    return F.layer_norm(t, (t.shape[-1],), m.norm.weight, m.norm.bias, eps=1e-6)


@pytest.mark.parametrize("patch,dim,H,W", [(16, 384, 48, 80), (8, 768, 40, 24), (8, 384, 41, 30)])
def test_forward_equals_dino(patch, dim, H, W):
    m = random_vit(patch=patch, dim=dim, depth=2, num_patches=(224 // patch) ** 2, seed=1)
    x = torch.randn(2, 3, H, W)
    with torch.no_grad():
        ours = m.forward_tokens(x)
        ref = dino_forward_tokens(m, x)
        fmap = m.patch_tokens(x)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5)
    h, w = H // patch, W // patch
    assert ours.shape == (2, 1 + h * w, dim) and fmap.shape == (2, dim, h, w)
    # patch (i, j) of the map is token 1 + i * w + j, row-major as DINO's flatten
    torch.testing.assert_close(fmap[:, :, 1, 2], ours[:, 1 + 1 * w + 2])


def test_images_smaller_than_a_patch_are_refused():
    m = random_vit(depth=1)
    with pytest.raises(ValueError, match="smaller than one 16-pixel patch"):
        m.patch_tokens(torch.zeros(1, 3, 8, 32))


def test_as_float_images():
    u = torch.randint(0, 256, (1, 3, 4, 5), dtype=torch.uint8)
    torch.testing.assert_close(as_float_images(u), u.float() / 255)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        as_float_images(u.float())
    with pytest.raises(ValueError, match=r"\(B, 3, H, W\)"):
        as_float_images(torch.zeros(3, 4, 5))


# ------------------------------------------------------------------------------------------
# checkpoints
# ------------------------------------------------------------------------------------------


class Hyper:
    """A stand-in for omegaconf's DictConfig: any class makes a checkpoint need unpickling."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


def test_load_checkpoint_weights_only_and_trust(tmp_path):
    sd = {"a": torch.arange(3.0)}
    p = tmp_path / "plain.ckpt"
    torch.save({"state_dict": sd, "epoch": 3}, p)
    assert torch.equal(load_checkpoint(p)["state_dict"]["a"], sd["a"])

    q = tmp_path / "pickled.ckpt"
    torch.save({"state_dict": sd, "hyper_parameters": {"cfg": Hyper(dim=70)}}, q)
    with pytest.raises(PermissionError, match=r"Hyper.*trust_pickle=True"):
        load_checkpoint(q)
    obj = load_checkpoint(q, trust_pickle=True)
    assert obj["hyper_parameters"]["cfg"].dim == 70 and torch.equal(obj["state_dict"]["a"], sd["a"])


def test_trusted_checkpoint_with_uninstalled_module_loads_its_tensors(tmp_path):
    # A class from a package that is not installed here (like omegaconf for STEGO's checkpoints).
    mod = types.ModuleType("not_installed_cfg")

    class DictConfig:
        def __init__(self, content):
            self._content = content

    DictConfig.__module__ = "not_installed_cfg"
    DictConfig.__qualname__ = "DictConfig"
    mod.DictConfig = DictConfig
    sys.modules["not_installed_cfg"] = mod
    try:
        p = tmp_path / "lightning.ckpt"
        torch.save({"state_dict": {"w": torch.ones(2)}, "hyper_parameters": {"cfg": DictConfig({"dim": 70})}}, p)
    finally:
        del sys.modules["not_installed_cfg"]
    with pytest.raises(PermissionError, match="not_installed_cfg.DictConfig"):
        load_checkpoint(p)
    obj = load_checkpoint(p, trust_pickle=True)
    assert torch.equal(obj["state_dict"]["w"], torch.ones(2))


def test_unreadable_checkpoint(tmp_path):
    p = tmp_path / "junk.ckpt"
    p.write_bytes(b"not a checkpoint at all")
    with pytest.raises(ValueError, match="cannot read"):
        load_checkpoint(p)
    with pytest.raises(FileNotFoundError):
        load_checkpoint(tmp_path / "absent.ckpt")


@pytest.mark.filterwarnings("ignore:Detected pickle protocol 4")
def test_trusted_checkpoint_stubs_dict_and_list_subclasses(tmp_path):
    """Lightning's AttributeDict is a dict subclass; list subclasses and plain objects pickle
    their contents differently again: all must unpickle when their package is missing."""
    mod = types.ModuleType("not_installed_pl")

    class AttributeDict(dict):
        pass

    class Tags(list):
        pass

    class Cfg:
        def __init__(self):
            self.x = 1

    for cls in (AttributeDict, Tags, Cfg):
        cls.__module__, cls.__qualname__ = "not_installed_pl", cls.__name__
        setattr(mod, cls.__name__, cls)
    sys.modules["not_installed_pl"] = mod
    try:
        for proto in (2, 4):
            hp = AttributeDict(lr=0.1, tags=Tags([1, 2]), cfg=Cfg())
            torch.save({"state_dict": {"w": torch.ones(2)}, "hyper_parameters": hp}, tmp_path / f"pl{proto}.ckpt",
                       pickle_protocol=proto)
    finally:
        del sys.modules["not_installed_pl"]
    for proto in (2, 4):
        obj = load_checkpoint(tmp_path / f"pl{proto}.ckpt", trust_pickle=True)
        assert torch.equal(obj["state_dict"]["w"], torch.ones(2))
        assert obj["hyper_parameters"]["lr"] == 0.1
