"""DINOv2 in adapters/uss/vit.py (and vit_weights.py) and the DINOv2 extractor (adapters/uss/dinov2.py), against a reference
written here from DINOv2's code (facebookresearch/dinov2 @ b8931f7: models/vision_transformer.py
prepare_tokens_with_masks / interpolate_pos_encoding / get_intermediate_layers, layers/block.py,
layers/layer_scale.py, layers/swiglu_ffn.py, hub/backbones.py) with plain float64 operations:
patch embedding by reshaping, LayerNorm by its formula, attention as softmax(q k^T / sqrt(d)) v,
exact GELU by erf, LayerScale as a product, and the bicubic position-embedding resize computed
by hand (Keys' A=-0.75 sampled with the offset scale factor; PIL's antialiased A=-0.5 filter for
the registers models' size-based, antialiased resize)."""
import math

import numpy as np
import pytest
import torch

from mars_plugin.adapters.uss.dinov2 import DINOv2Extractor
from mars_plugin.adapters.uss.extractor import DHR_SCALES, DHR_SETTINGS, load_extractor
from mars_plugin.adapters.uss.preprocess import normalize_imagenet
from mars_plugin.adapters.uss.vit import (
    DinoViT,
    describe_vit,
    heads_for_width,
    swiglu_hidden,
)
from mars_plugin.adapters.uss.vit_weights import vit_from_state_dict

TOL = 1e-5
GRID = 37  # 518 / 14: the stored position grid of every released DINOv2 model


def dinov2_state_dict(width=64, depth=2, heads=2, registers=0, swiglu=False, seed=0, grid=GRID):
    """A random DINOv2-layout flat state dict (released key names), gammas and norms away from 1."""
    g = torch.Generator().manual_seed(seed)
    m = DinoViT(14, width, depth, heads, num_patches=grid * grid, layer_scale=True, num_register_tokens=registers,
                mask_token=True, ffn="swiglu" if swiglu else "mlp")
    sd = {}
    for k, v in m.state_dict().items():
        base = 1.0 if k.endswith(("norm1.weight", "norm2.weight", "norm.weight")) else 0.0
        scale = 0.3 if k.endswith("gamma") else 0.1
        sd[k] = base + scale * torch.randn(v.shape, generator=g) + (0.5 if k.endswith("gamma") else 0.0)
    return sd


# ------------------------------------------------------------------------------------------
# the reference
# ------------------------------------------------------------------------------------------


def _keys_cubic(t, A=-0.75):
    """Weights of the taps at -1, 0, 1, 2 for a fractional position t (upsample_bicubic2d)."""
    near = lambda x: ((A + 2) * x - (A + 3)) * x * x + 1  # noqa: E731
    far = lambda x: ((A * x - 5 * A) * x + 8 * A) * x - 4 * A  # noqa: E731
    return [far(t + 1), near(t), near(1 - t), far(2 - t)]


def bicubic_scale_axis(a, axis, scale):
    """align_corners=False bicubic along one axis with a given scale factor, no antialias:
    out = floor(n * scale), source = (i + 0.5) / scale - 0.5, borders clamped."""
    n = a.shape[axis]
    a = np.moveaxis(a, axis, 0)
    out = np.zeros((int(math.floor(n * scale)),) + a.shape[1:])
    for i in range(out.shape[0]):
        src = (i + 0.5) / scale - 0.5
        i0 = math.floor(src)
        for k, wk in zip(range(-1, 3), _keys_cubic(src - i0)):
            out[i] += wk * a[min(max(i0 + k, 0), n - 1)]
    return np.moveaxis(out, 0, axis)


def _pil_cubic(x, a=-0.5):
    x = abs(x)
    if x < 1:
        return ((a + 2) * x - (a + 3)) * x * x + 1
    if x < 2:
        return (((x - 5) * x + 8) * x - 4) * a
    return 0.0


def bicubic_antialias_axis(a, axis, out_n):
    """Antialiased bicubic resize to ``out_n`` along one axis (PIL's filter, as PyTorch's
    antialias=True): support 2 * scale when shrinking, normalised weights."""
    n = a.shape[axis]
    scale = n / out_n
    support, inv = (2 * scale, 1 / scale) if scale >= 1 else (2.0, 1.0)
    a = np.moveaxis(a, axis, 0)
    out = np.zeros((out_n,) + a.shape[1:])
    for i in range(out_n):
        c = scale * (i + 0.5)
        lo, hi = max(int(c - support + 0.5), 0), min(int(c + support + 0.5), n)
        ws = [_pil_cubic((j - c + 0.5) * inv) for j in range(lo, hi)]
        for j, wj in zip(range(lo, hi), ws):
            out[i] += wj / sum(ws) * a[j]
    return np.moveaxis(out, 0, axis)


def reference_pos(pos, h, w, square, offset, antialias, force=False):
    """(1, 1 + h*w, D) float64: DINOv2's interpolate_pos_encoding with honest names (h rows)."""
    n = pos.shape[1] - 1
    if h * w == n and square and not force:
        return pos
    side = int(round(math.sqrt(n)))
    grid = pos[0, 1:].numpy().reshape(side, side, -1)
    if offset:
        assert not antialias
        grid = bicubic_scale_axis(bicubic_scale_axis(grid, 0, (h + offset) / side), 1, (w + offset) / side)
    else:
        assert antialias
        grid = bicubic_antialias_axis(bicubic_antialias_axis(grid, 0, h), 1, w)
    assert grid.shape[:2] == (h, w)
    return torch.cat([pos[:, :1], torch.from_numpy(grid).reshape(1, h * w, -1)], dim=1)


def layer_norm(x, weight, bias, eps=1e-6):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * weight + bias


def reference_tokens(sd, x, heads, offset=None, antialias=None, keep_all=False):
    """(B, h*w, D) float64: the normed last-block patch tokens, [CLS] and registers dropped
    (``keep_all``: all of them, (B, 1 + R + h*w, D), [CLS] then the registers)."""
    sd = {k: v.double() for k, v in sd.items()}
    regs = sd.get("register_tokens")
    r = 0 if regs is None else regs.shape[1]
    if offset is None:  # hub/backbones.py: _reg models 0.0 + antialias, plain ones 0.1
        offset, antialias = (0.0, True) if r else (0.1, False)
    x = x.double()
    B, C, H, W = x.shape
    wp = sd["patch_embed.proj.weight"]
    D, p = wp.shape[0], wp.shape[-1]
    h, w = H // p, W // p
    patches = x.reshape(B, C, h, p, w, p).permute(0, 2, 4, 1, 3, 5).reshape(B, h * w, C * p * p)
    t = patches @ wp.reshape(D, -1).T + sd["patch_embed.proj.bias"]
    t = torch.cat([sd["cls_token"].expand(B, 1, D), t], dim=1)
    t = t + reference_pos(sd["pos_embed"], h, w, H == W, offset, antialias)
    if regs is not None:  # after the position embedding, right after [CLS]
        t = torch.cat([t[:, :1], regs.expand(B, r, D), t[:, 1:]], dim=1)
    depth = 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("blocks."))
    dh = D // heads
    for i in range(depth):
        b = lambda name: sd[f"blocks.{i}.{name}"]  # noqa: E731
        y = layer_norm(t, b("norm1.weight"), b("norm1.bias"))
        qkv = (y @ b("attn.qkv.weight").T + b("attn.qkv.bias")).reshape(B, -1, 3, heads, dh)
        q, k, v = (qkv[:, :, j].transpose(1, 2) for j in range(3))
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(dh), dim=-1)
        y = (att @ v).transpose(1, 2).reshape(B, -1, D) @ b("attn.proj.weight").T + b("attn.proj.bias")
        t = t + y * b("ls1.gamma")
        y = layer_norm(t, b("norm2.weight"), b("norm2.bias"))
        if f"blocks.{i}.mlp.w12.weight" in sd:
            hid = y @ b("mlp.w12.weight").T + b("mlp.w12.bias")
            a, g = hid[..., : hid.shape[-1] // 2], hid[..., hid.shape[-1] // 2:]
            y = (a * torch.sigmoid(a) * g) @ b("mlp.w3.weight").T + b("mlp.w3.bias")
        else:
            hid = y @ b("mlp.fc1.weight").T + b("mlp.fc1.bias")
            hid = 0.5 * hid * (1 + torch.erf(hid / math.sqrt(2)))
            y = hid @ b("mlp.fc2.weight").T + b("mlp.fc2.bias")
        t = t + y * b("ls2.gamma")
    t = layer_norm(t, sd["norm.weight"], sd["norm.bias"])
    return t if keep_all else t[:, 1 + r:]


def reference_map(sd, x, heads):
    """(B, D, h, w) float32 of reference_tokens: DINOv2's get_intermediate_layers(reshape=True)."""
    p = sd["patch_embed.proj.weight"].shape[-1]
    t = reference_tokens(sd, x, heads)
    return t.reshape(x.shape[0], x.shape[2] // p, x.shape[3] // p, -1).permute(0, 3, 1, 2).float()


# ------------------------------------------------------------------------------------------
# the ViT
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("registers", [0, 4])
@pytest.mark.parametrize("size", [(28, 42), (42, 70), (70, 28)])
def test_forward_equals_reference(registers, size):
    sd = dinov2_state_dict(registers=registers, seed=registers + size[0])
    m = vit_from_state_dict(sd, num_heads=2)
    assert (m.layer_scale, m.num_register_tokens, m.mask_token is not None, m.ffn) == (True, registers, True, "mlp")
    assert (m.interpolate_offset, m.interpolate_antialias) == ((0.0, True) if registers else (0.1, False))
    x = torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        seq = m.patch_token_sequence(x)
        fmap = m.patch_tokens(x)
        tokens = m.forward_tokens(x)
    ref = reference_tokens(sd, x, heads=2)
    h, w = size[0] // 14, size[1] // 14
    assert seq.shape == (2, h * w, 64) and fmap.shape == (2, 64, h, w) and tokens.shape == (2, 1 + registers + h * w, 64)
    err = float((seq.double() - ref).abs().max())
    assert err <= TOL, err
    assert float(ref.abs().max()) > 0.5  # not trivially small
    # the whole sequence too: [CLS], then the registers (the patch tokens alone cannot tell their place)
    err_all = float((tokens.double() - reference_tokens(sd, x, heads=2, keep_all=True)).abs().max())
    assert err_all <= TOL, err_all
    torch.testing.assert_close(fmap[:, :, 1, w - 1], seq[:, 1 * w + w - 1])  # row-major, as DINOv2's reshape


def test_swiglu_mlp_of_vit_g():
    assert swiglu_hidden(1536) == 4096 and heads_for_width(1536) == 24  # 6144 * 2 / 3 = 4096, 1536 / 64
    assert swiglu_hidden(64) == 176  # int(256 * 2 / 3) = 170 -> next multiple of 8
    sd = dinov2_state_dict(swiglu=True, seed=3)
    assert sd["blocks.0.mlp.w12.weight"].shape == (352, 64) and sd["blocks.1.mlp.w3.weight"].shape == (64, 176)
    m = vit_from_state_dict(sd, num_heads=2)
    assert m.ffn == "swiglu" and "SwiGLU" in describe_vit(m)
    x = torch.randn(1, 3, 42, 56, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        err = float((m.patch_token_sequence(x).double() - reference_tokens(sd, x, heads=2)).abs().max())
    assert err <= TOL, err


@pytest.mark.parametrize("registers", [0, 4])
def test_stored_grid_on_a_square_518_image_is_used_unchanged(registers):
    sd = dinov2_state_dict(depth=1, registers=registers, seed=5)
    m = vit_from_state_dict(sd, num_heads=2)
    assert m.interpolate_pos_encoding(GRID * GRID, 518, 518) is m.pos_embed
    # the path matters for the 0.1 offset: resampling the grid would not give it back
    forced = reference_pos(sd["pos_embed"].double(), GRID, GRID, True, 0.1, False, force=True)
    assert float((forced - sd["pos_embed"].double()).abs().max()) > 1e-3
    x = torch.randn(1, 3, 518, 518, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        err = float((m.patch_token_sequence(x).double() - reference_tokens(sd, x, heads=2)).abs().max())
    assert err <= TOL, err


def test_offset_and_antialias_make_a_difference_and_can_be_overridden():
    sd = dinov2_state_dict(depth=1, registers=4, seed=7)
    auto = vit_from_state_dict(sd, num_heads=2)
    plain = vit_from_state_dict(sd, num_heads=2, interpolate_offset=0.1, interpolate_antialias=False)
    a, b = auto.interpolate_pos_encoding(6, 28, 42), plain.interpolate_pos_encoding(6, 28, 42)
    assert float((a - b).detach().abs().max()) > 1e-3
    ref = reference_pos(sd["pos_embed"].double(), 2, 3, False, 0.1, False)
    assert float((b.detach().double() - ref).abs().max()) <= TOL


def test_detection_and_description():
    m = DinoViT(14, 768, 1, num_patches=4, layer_scale=True, num_register_tokens=4, mask_token=True)
    assert describe_vit(m).startswith("DINOv2 ViT-B/14 with 4 registers (1 blocks, width 768, 12 heads)")
    sd = m.state_dict()
    assert sd["register_tokens"].shape == (1, 4, 768) and sd["mask_token"].shape == (1, 768)
    assert {"blocks.0.ls1.gamma", "blocks.0.ls2.gamma"} <= set(sd)
    back = vit_from_state_dict(sd)
    assert (back.num_heads, back.num_register_tokens, back.interpolate_offset, back.interpolate_antialias) == \
        (12, 4, 0.0, True)
    plain = vit_from_state_dict({k: v for k, v in sd.items() if k != "register_tokens"})
    assert describe_vit(plain).startswith("DINOv2 ViT-B/14 (1 blocks")
    assert (plain.interpolate_offset, plain.interpolate_antialias) == (0.1, False)
    v1 = DinoViT(16, 384, 1, num_patches=4)
    assert not v1.is_dinov2 and describe_vit(v1) == "ViT-S/16 (1 blocks, width 384, 6 heads)"
    assert "ls1" not in str(list(v1.state_dict()))


def test_strict_loading_names_missing_and_unexpected_keys():
    sd = dinov2_state_dict(depth=2, registers=4)
    bad = {k: v for k, v in sd.items() if k != "blocks.0.ls1.gamma"}
    with pytest.raises(ValueError, match=r"missing keys \['blocks\.0\.ls1\.gamma'\]"):
        vit_from_state_dict(bad, num_heads=2)
    bad = dict(sd, **{"blocks.1.attn.q_norm.weight": torch.ones(64)})
    with pytest.raises(ValueError, match=r"unexpected keys \['blocks\.1\.attn\.q_norm\.weight'\]"):
        vit_from_state_dict(bad, num_heads=2)
    bad = {k: v for k, v in sd.items() if k != "blocks.1.mlp.fc2.bias"}
    with pytest.raises(ValueError, match=r"does not match a DINOv2 ViT-64/14 with 4 registers.*fc2\.bias"):
        vit_from_state_dict(bad, num_heads=2)
    bad = dict(sd, register_tokens=torch.zeros(1, 4, 32))
    with pytest.raises(ValueError, match=r"register_tokens must be \(1, R, 64\), got \(1, 4, 32\)"):
        vit_from_state_dict(bad, num_heads=2)


def test_sides_must_be_multiples_of_the_patch():
    m = vit_from_state_dict(dinov2_state_dict(depth=1), num_heads=2)
    with pytest.raises(ValueError, match=r"multiples of the patch 14, got 30x42"):
        m.patch_tokens(torch.zeros(1, 3, 30, 42))


# ------------------------------------------------------------------------------------------
# the extractor
# ------------------------------------------------------------------------------------------


def dhr_normalize(rgb_u8):
    """DHR's Normalize (tools/transforms.py:235-254) then ToTensor: (x / 255 - mean) / std, float32."""
    x = torch.from_numpy(rgb_u8).permute(2, 0, 1).float()[None] / 255
    return normalize_imagenet(x)[0]


def test_from_files_with_dhr_settings_equals_reference(tmp_path):
    from test_multiscale import reference

    sd = dinov2_state_dict(registers=4, seed=11)
    f = tmp_path / "dinov2_vits14_reg4_pretrain.pth"
    torch.save(sd, f)
    ex = DINOv2Extractor.from_files(f, num_heads=2, **DHR_SETTINGS)
    assert ex.patch_size == 14 and ex.dim == 64
    assert "DINOv2 ViT-64/14 with 4 registers" in ex.describe() and "scales 2, 1, 1.5, 0.5" in ex.describe()
    rgb = np.random.default_rng(0).integers(0, 256, (17, 23, 3)).astype(np.uint8)
    out = ex(torch.from_numpy(rgb).permute(2, 0, 1)[None])
    ref = reference(lambda x: reference_map(sd, x, 2), dhr_normalize(rgb), DHR_SCALES, True, 14)
    assert out.shape == (1, 64, *ex.grid_size(17, 23)) and ex.grid_size(17, 23) == (3, 4)  # 34x46 -> 42x56
    err = float((out[0] - ref).abs().max())
    assert err <= 1e-4, err
    # one scale at the native size: each side to the nearest multiple of 14, bilinear
    one = DINOv2Extractor.from_files(f, num_heads=2)
    assert (one.res, one.flip_average, one.normalize, one.scales) == (None, False, False, None)
    assert one.input_size(17, 23) == (14, 28) and one.grid_size(17, 23) == (1, 2)


def test_from_files_refuses_pickles_v1_and_bad_files(tmp_path):
    from test_stego import Payload  # touches a file when unpickled

    sd = dinov2_state_dict(depth=1)
    p = tmp_path / "pickled.pth"
    marker = tmp_path / "ran"
    torch.save(dict(sd, meta=Payload(str(marker))), p)
    with pytest.raises(PermissionError, match=r"pickled\.pth: .*weights_only=True"):
        DINOv2Extractor.from_files(p, num_heads=2)
    assert not marker.exists()
    v1 = tmp_path / "dino_vits16.pth"
    torch.save(DinoViT(16, 384, 1, num_patches=4).state_dict(), v1)
    with pytest.raises(ValueError, match=r"dino_vits16\.pth .*DINO v1 ViT-S/16"):
        DINOv2Extractor.from_files(v1)
    nested = tmp_path / "nested.pth"
    torch.save({"model": sd}, nested)
    with pytest.raises(ValueError, match="must map names to tensors"):
        DINOv2Extractor.from_files(nested, num_heads=2)


def test_cli_dinov2_dhr_writes_pt_features(tmp_path, capsys):
    from PIL import Image

    from mars_plugin.cli import main
    from test_multiscale import reference

    sd = dinov2_state_dict(width=384, depth=1, heads=6, seed=13)  # a released width: heads from the width
    f = tmp_path / "dinov2_vits14_pretrain.pth"
    torch.save(sd, f)
    images = tmp_path / "images"
    images.mkdir()
    rng = np.random.default_rng(4)
    sizes = {"a": (15, 22), "b": (20, 13)}
    for stem, (hh, ww) in sizes.items():
        Image.fromarray(rng.integers(0, 256, (hh, ww, 3)).astype(np.uint8)).save(images / f"{stem}.png")
    out = tmp_path / "features"
    assert main(["features", "--uss", "dinov2", "--backbone", str(f), "--dhr", "--format", "pt",
                 "--images", str(images), "--out", str(out), "--no-progress"]) == 0
    said = capsys.readouterr().out
    assert "DINOv2 ViT-S/14 (1 blocks, width 384, 6 heads) patch tokens" in said
    assert "full resolution, scales 2, 1, 1.5, 0.5, flip averaging on, L2 normalisation off" in said
    for stem, (hh, ww) in sizes.items():
        rgb = np.array(Image.open(images / f"{stem}.png").convert("RGB"))
        ref = reference(lambda x: reference_map(sd, x, 6), dhr_normalize(rgb), DHR_SCALES, True, 14)
        got = torch.load(out / f"{stem}.pt", map_location="cpu", weights_only=True)
        assert got.dtype == torch.float16 and got.shape == ref.shape == (384, -(-2 * hh // 14), -(-2 * ww // 14))
        np.testing.assert_allclose(got.float().numpy(), ref.numpy(), rtol=1e-3, atol=1e-4)
    # the options and the errors of the dinov2 form
    assert load_extractor("dinov2", backbone=f, dhr=True, normalize=True).normalize is True
    assert load_extractor("dinov2", backbone=f, res=28).res == 28
    base = ["features", "--uss", "dinov2", "--images", str(images), "--out", str(tmp_path / "x"), "--no-progress"]
    for extra, msg in [([], "reads one --backbone"), (["--checkpoint", str(f)], "reads one --backbone"),
                       (["--backbone", str(f), "--heads", str(f)], "without --checkpoint or --heads"),
                       (["--backbone", str(f), "--trust-pickle"], "weights_only=True"),
                       (["--backbone", str(f), "--head"], "Leopart options")]:
        assert main(base + extra) == 2
        assert msg in capsys.readouterr().err
