"""CAUSE extractor (DHR's CAUSE on DINOv2): the decoder against a reference written from DHR's
core/uss/layers.py with explicit ops, DHR's heads-file layout and its strict loading, the
quantisation's tie rule, multi-scale inference, and `mars features --uss cause`."""
import math
import re
import pickle

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import mars_plugin.adapters.uss.cause_files as cause_files_mod
from mars_plugin.adapters.uss.cause import CAUSEExtractor
from mars_plugin.adapters.uss.cause_decoder import CAUSESegment, quantize_cosine, resample_queries
from mars_plugin.adapters.uss.multiscale import DHR_SCALES, DHR_SETTINGS, multiscale
from mars_plugin.adapters.uss.preprocess import normalize_imagenet
from mars_plugin.adapters.uss.vit import DinoViT

PATCH = 14
#: float32 against the float64 reference: PyTorch computes the linear resampling's source
#: coordinate in float32 (as in DHR, the same F.interpolate call), about 500 +- 3e-5 for 529 queries,
#: so the positional term is off by ~1e-4 for unit-scale queries; the rest is ordinary rounding.
#: In float64 the code is checked against the reference at 1e-5.
ATOL = 2e-4


def tiny_backbone(width=32, seed=0, heads=2, patch=PATCH):
    torch.manual_seed(seed)
    # A DINOv2-format ViT (LayerScale, mask token), the backbone CAUSE runs on.
    vit = DinoViT(patch, width, 1, num_heads=heads, num_patches=16, layer_scale=True, mask_token=True)
    with torch.no_grad():
        for name, p in vit.named_parameters():
            base = 1.0 if name.endswith(("norm1.weight", "norm2.weight")) or name == "norm.weight" else 0.0
            p.copy_(base + 0.1 * torch.randn_like(p))
    return vit.eval()


def dhr_decoder_sd(width, out=90, queries=529, hidden=2048, seed=1):
    """checkpoint['decoder'] as DHR's Segment_TR(width, out, queries).state_dict() names it, written
    from core/uss/layers.py:36-92 (nn.MultiheadAttention's in_proj/out_proj, Linear, LayerNorm, 1x1 convs)."""
    g = torch.Generator().manual_seed(seed)
    D = width
    shapes = {"head_ema.query_pos": (queries, D)}
    for attn in ("self_attn", "multihead_attn"):
        shapes.update({f"head_ema.tr.{attn}.in_proj_weight": (3 * D, D), f"head_ema.tr.{attn}.in_proj_bias": (3 * D,),
                       f"head_ema.tr.{attn}.out_proj.weight": (D, D), f"head_ema.tr.{attn}.out_proj.bias": (D,)})
    shapes.update({"head_ema.tr.linear1.weight": (hidden, D), "head_ema.tr.linear1.bias": (hidden,),
                   "head_ema.tr.linear2.weight": (D, hidden), "head_ema.tr.linear2.bias": (D,)})
    for i in (1, 2, 3):
        shapes.update({f"head_ema.tr.norm{i}.weight": (D,), f"head_ema.tr.norm{i}.bias": (D,)})
    shapes.update({"head_ema.tr.f1.weight": (out, D, 1, 1), "head_ema.tr.f1.bias": (out,),
                   "head_ema.tr.f2.0.weight": (D, D, 1, 1), "head_ema.tr.f2.0.bias": (D,),
                   "head_ema.tr.f2.2.weight": (out, D, 1, 1), "head_ema.tr.f2.2.bias": (out,)})
    sd = {}
    for k, shape in shapes.items():
        t = torch.randn(shape, generator=g)
        if k.endswith("norm1.weight") or k.endswith("norm2.weight") or k.endswith("norm3.weight"):
            t = 1.0 + 0.1 * t
        elif k.endswith("weight") and len(shape) > 1:
            t = t / math.sqrt(shape[1])  # unit-variance outputs: logits of order one, so the softmax is not uniform
        elif k != "head_ema.query_pos":
            t = 0.1 * t
        sd[k] = t
    return sd


def random_codebook(k, width, seed=2):
    return torch.randn(k, width, generator=torch.Generator().manual_seed(seed))


def build(width=32, codebook=None, sd=None, **kwargs):
    sd = dhr_decoder_sd(width) if sd is None else sd
    seg = CAUSESegment(width)
    seg.load_state_dict(sd, strict=True)
    cb = random_codebook(7, width) if codebook is None else codebook
    return CAUSEExtractor(tiny_backbone(width), seg, cb, **kwargs), sd, cb


# -- the reference: DHR's CAUSE.forward, op by op, in float64 -----------------------------------


def ref_resample(q, n):
    """F.interpolate(q.T[None], n, mode='linear'), align_corners False, written out."""
    n_in = q.shape[0]
    out = torch.empty(n, q.shape[1], dtype=q.dtype)
    for i in range(n):
        src = max((i + 0.5) * n_in / n - 0.5, 0.0)
        i0 = int(math.floor(src))
        i1 = min(i0 + 1, n_in - 1)
        lam = src - i0
        out[i] = (1 - lam) * q[i0] + lam * q[i1]
    return out


def ref_quantize(z, codebook):
    """vqt: per token the row of largest cosine similarity, the first one on ties."""
    out = torch.empty_like(z)
    for b in range(z.shape[0]):
        for n in range(z.shape[1]):
            sims = [float(z[b, n] @ c) / (float(z[b, n].norm()) * float(c.norm())) for c in codebook]
            best = max(range(len(sims)), key=lambda k: sims[k])  # max() keeps the first maximum
            out[b, n] = codebook[best]
    return out


def ref_layer_norm(x, w, b, eps=1e-5):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * w + b


def ref_attention(sd, name, q_in, k_in, v_in):
    """One-head nn.MultiheadAttention: softmax(q k^T / sqrt(D)) v, then out_proj."""
    W, bias = sd[f"{name}.in_proj_weight"], sd[f"{name}.in_proj_bias"]
    D = q_in.shape[-1]
    q = q_in @ W[:D].T + bias[:D]
    k = k_in @ W[D:2 * D].T + bias[D:2 * D]
    v = v_in @ W[2 * D:].T + bias[2 * D:]
    a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(D), dim=-1)
    return (a @ v) @ sd[f"{name}.out_proj.weight"].T + sd[f"{name}.out_proj.bias"]


def ref_conv1x1(w, b, x):
    return torch.einsum("oi,bihw->bohw", w[:, :, 0, 0], x) + b.view(1, -1, 1, 1)


def ref_decoder(z, grid, sd, codebook, variant=None, out_dtype=torch.float32):
    """z (B, N, D) -> (B, out, h, w): core/uss/models.py:143-150 and layers.py:52-82 op by op.
    ``variant`` swaps in a plausible misreading, to show the comparison can tell them apart."""
    sd = {k[len("head_ema."):]: v.double() for k, v in sd.items()}
    t_sd = {k[len("tr."):]: v for k, v in sd.items() if k.startswith("tr.")}
    z, codebook = z.double(), codebook.double()
    pe = ref_resample(sd["query_pos"], z.shape[1])
    tgt = ref_quantize(z, codebook)
    self_v = tgt + pe if variant == "pe_on_value" else tgt
    t = ref_layer_norm(tgt + ref_attention(t_sd, "self_attn", tgt + pe, tgt + pe, self_v), t_sd["norm1.weight"], t_sd["norm1.bias"])
    key = z + pe if variant == "pe_on_key" else z
    t = ref_layer_norm(t + ref_attention(t_sd, "multihead_attn", t + pe, key, z), t_sd["norm2.weight"], t_sd["norm2.bias"])
    ffn = torch.relu(t @ t_sd["linear1.weight"].T + t_sd["linear1.bias"]) @ t_sd["linear2.weight"].T + t_sd["linear2.bias"]
    t = ref_layer_norm(t + ffn, t_sd["norm3.weight"], t_sd["norm3.bias"])
    u = (tgt if variant == "add_quantised" else z) + t
    h, w = grid
    if variant == "grid_transposed":
        u = u.reshape(z.shape[0], w, h, z.shape[2]).permute(0, 3, 2, 1)
    else:
        u = u.reshape(z.shape[0], h, w, z.shape[2]).permute(0, 3, 1, 2)
    f2 = ref_conv1x1(t_sd["f2.2.weight"], t_sd["f2.2.bias"], torch.relu(ref_conv1x1(t_sd["f2.0.weight"], t_sd["f2.0.bias"], u)))
    return (ref_conv1x1(t_sd["f1.weight"], t_sd["f1.bias"], u) + f2).to(out_dtype)


def ref_code(ex, sd, codebook, x, variant=None, out_dtype=torch.float32):
    with torch.no_grad():
        z = ex.backbone.forward_tokens(x)[:, 1:]  # DHR: forward_features(images)[:, 1:, :]
    return ref_decoder(z, (x.shape[2] // PATCH, x.shape[3] // PATCH), sd, codebook, variant, out_dtype)


def normalised(h, w, b=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    return normalize_imagenet(torch.rand(b, 3, h, w, generator=g))


# -- tests -----------------------------------------------------------------------------------


def test_decoder_keys_and_shapes_are_dhrs():
    sd = dhr_decoder_sd(32)
    ours = CAUSESegment(32).state_dict()
    assert {k: tuple(v.shape) for k, v in ours.items()} == {k: tuple(v.shape) for k, v in sd.items()}
    ex, _, _ = build()
    assert ex.dim == 90 and ex.patch_size == 14
    # the codebook follows .to() but is not a state-dict entry, as DHR keeps it outside the decoder
    assert "codebook" not in ex.state_dict() and "codebook" in dict(ex.named_buffers())
    assert set(ex.state_dict()) == {"backbone." + k for k in ex.backbone.state_dict()} | {"segment." + k for k in sd}


@pytest.mark.parametrize("hw", [(28, 42), (42, 28), (56, 70)])
def test_code_equals_reference(hw):
    ex, sd, cb = build()
    x = normalised(*hw, b=2, seed=hw[1])
    got = ex.code(x)
    assert got.shape == (2, 90, hw[0] // 14, hw[1] // 14)
    # float32: rounding only (see ATOL)
    ref = ref_code(ex, sd, cb, x)
    torch.testing.assert_close(got, ref, rtol=0, atol=ATOL)
    # float64 throughout (same backbone tokens on both sides): equal to 1e-5 absolute, with room to spare
    ex64, x64 = ex.double(), x.double()
    torch.testing.assert_close(ex64.code(x64).double(), ref_code(ex64, sd, cb, x64, out_dtype=torch.float64),
                               rtol=0, atol=1e-5)


@pytest.mark.parametrize("variant", ["pe_on_value", "pe_on_key", "add_quantised", "grid_transposed"])
def test_reference_tells_the_misreadings_apart(variant):
    """Where the positional term goes, which tokens come back after norm3 and the token order all
    change the code by far more than the 1e-5 tolerance, so test_code_equals_reference checks them."""
    ex, sd, cb = build()
    x = normalised(28, 42, seed=11)
    assert (ref_code(ex, sd, cb, x, variant) - ex.code(x)).abs().max() > 1e-2


@pytest.mark.parametrize("n", [1, 6, 12, 529, 1000])
def test_resample_queries_is_1d_linear(n):
    q = torch.randn(529, 8, generator=torch.Generator().manual_seed(n), dtype=torch.float64)
    torch.testing.assert_close(resample_queries(q, n), ref_resample(q, n), rtol=0, atol=1e-12)
    if n == 529:
        assert torch.equal(resample_queries(q, n), q)


def test_quantisation_ties_take_the_first_row():
    """Two rows in the same direction (one twice the other) tie exactly in cosine; DHR's argmax
    (core/uss/layers.py:28) takes the first, and the target is that row itself, so it matters."""
    ex, sd, _ = build()
    x = normalised(28, 42, seed=5)
    with torch.no_grad():
        z = ex.backbone.patch_token_sequence(x)
    g = torch.Generator().manual_seed(3)
    cb = torch.cat([z[0, 1:2], torch.randn(2, 32, generator=g), 2 * z[0, 1:2], z[0, 4:5], torch.randn(1, 32, generator=g),
                    0.5 * z[0, 4:5]])  # rows 0 and 3 tie, rows 4 and 6 tie
    sims = F.normalize(z[0], dim=-1) @ F.normalize(cb, dim=-1).T
    assert sims[1, 0] == sims[1, 3] and sims[4, 4] == sims[4, 6]  # an exact tie, or the test says nothing
    q = quantize_cosine(z, cb)
    assert torch.equal(q[0, 1], cb[0]) and torch.equal(q[0, 4], cb[4])
    torch.testing.assert_close(q.double(), ref_quantize(z.double(), cb.double()), rtol=0, atol=0)
    ex2 = CAUSEExtractor(ex.backbone, ex.segment, cb, flip_average=False, normalize=False)
    got = ex2.code(x)
    torch.testing.assert_close(got, ref_code(ex2, sd, cb, x), rtol=0, atol=ATOL)
    # the last row winning instead would change the code
    swapped = cb[[3, 1, 2, 0, 6, 5, 4]]
    assert (ref_code(ex2, sd, swapped, x) - got).abs().max() > 1e-3


def test_code_refuses_sides_not_multiple_of_14():
    ex, _, _ = build()
    with pytest.raises(ValueError, match=r"multiples of the patch 14, got \(28, 40\)"):
        ex.code(normalised(28, 40))
    with pytest.raises(ValueError, match=r"\(B, 3, H, W\)"):
        ex.code(normalised(28, 42)[0])


def test_forward_single_scale_flip_and_normalize():
    ex, sd, cb = build()
    img = torch.randint(0, 256, (2, 3, 30, 40), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
    out = ex(img)
    # res=None, no scales: each side to the nearest multiple of 14 (30 -> 28, 40 -> 42), bilinear
    x = F.interpolate(img.float() / 255, size=(28, 42), mode="bilinear", align_corners=False, antialias=True)
    x = normalize_imagenet(x)
    ref = (ref_code(ex, sd, cb, x) + ref_code(ex, sd, cb, x.flip(3)).flip(3)) / 2
    torch.testing.assert_close(out, F.normalize(ref, dim=1), rtol=0, atol=ATOL)
    assert ex.grid_size(30, 40) == (2, 3)
    up = ex(img, output_size=(7, 9))
    torch.testing.assert_close(up, F.normalize(F.interpolate(ref, size=(7, 9), mode="bilinear", align_corners=False), dim=1),
                               rtol=0, atol=ATOL)


def test_forward_with_scales_is_multiscale_of_code():
    from test_multiscale import reference

    ex, sd, cb = build(**DHR_SETTINGS)
    img = torch.randint(0, 256, (1, 3, 20, 31), dtype=torch.uint8, generator=torch.Generator().manual_seed(6))
    out = ex(img)
    x = normalize_imagenet(img.float() / 255)[0]
    assert out.shape == (1, 90, 3, 5)  # 20x31 at 2.0 -> 40x62 -> 42x70
    assert torch.equal(out[0], multiscale(ex.code, x, DHR_SCALES, True, 14))
    ref = reference(lambda t: ref_code(ex, sd, cb, t), x, DHR_SCALES, True, 14)
    torch.testing.assert_close(out[0], ref, rtol=0, atol=ATOL)


def test_constructor_checks():
    ex, sd, cb = build()
    with pytest.raises(ValueError, match=r"codebook must be \(K, 32\).*got shape \(7, 31\)"):
        CAUSEExtractor(ex.backbone, ex.segment, cb[:, :31])
    with pytest.raises(ValueError, match=r"segment is 64 wide but the backbone is 32 wide"):
        CAUSEExtractor(ex.backbone, CAUSESegment(64), random_codebook(7, 32))
    with pytest.raises(TypeError, match="patch_token_sequence"):
        CAUSEExtractor(torch.nn.Linear(2, 2), ex.segment, cb)
    with pytest.raises(ValueError, match="res must be None"):
        CAUSEExtractor(ex.backbone, ex.segment, cb, res=10)
    with pytest.raises(ValueError, match="NaN"):
        CAUSEExtractor(ex.backbone, ex.segment, torch.full((7, 32), float("nan")))


# -- DHR's files --------------------------------------------------------------------------------

WIDTH = 192  # a width vit_from_state_dict knows (ViT-Ti, 3 heads)


def dhr_files(tmp_path, backbone=None, heads=None, patch=PATCH, name="CAUSE_VOC2012.pt"):
    vit = tiny_backbone(WIDTH, heads=3, patch=patch)
    dec = dhr_decoder_sd(WIDTH)
    cb = random_codebook(7, WIDTH)
    b, h = tmp_path / "dinov2_vitt14.pth", tmp_path / name
    flat = dict(vit.state_dict())
    torch.save(flat if backbone is None else backbone(flat), b)
    hd = {"decoder": dec, "codebook": cb}
    torch.save(hd if heads is None else heads(hd), h)
    return b, h, vit, dec, cb


def test_from_files_equals_the_reference(tmp_path):
    b, h, vit, dec, cb = dhr_files(tmp_path)
    ex = CAUSEExtractor.from_files(b, h, **DHR_SETTINGS)
    assert ex.dim == 90 and ex.res is None and ex.scales == DHR_SCALES and not ex.normalize and ex.flip_average
    assert torch.equal(ex.codebook, cb)
    assert all(torch.equal(v, dec[k]) for k, v in ex.segment.state_dict().items())
    x = normalised(28, 42, seed=8)
    torch.testing.assert_close(ex.code(x), ref_code(ex, dec, cb, x), rtol=0, atol=ATOL)
    assert "CAUSE on DINOv2 ViT-Ti/14" in ex.describe() and "codebook of 7" in ex.describe()


def test_from_files_is_strict_and_names_file_and_key(tmp_path):
    def drop(key):
        return lambda d: dict(d, decoder={k: v for k, v in d["decoder"].items() if k != key})

    b, h, *_ = dhr_files(tmp_path, heads=drop("head_ema.tr.norm3.bias"))
    with pytest.raises(ValueError, match=r"CAUSE_VOC2012\.pt \['decoder'\].*missing key\(s\) \['head_ema\.tr\.norm3\.bias'\]"):
        CAUSEExtractor.from_files(b, h)
    b, h, *_ = dhr_files(tmp_path, heads=lambda d: dict(d, decoder=dict(d["decoder"], **{"head.query_pos": torch.zeros(3)})))
    with pytest.raises(ValueError, match=r"\['decoder'\].*unexpected key\(s\) \['head\.query_pos'\]"):
        CAUSEExtractor.from_files(b, h)
    bad = {"head_ema.tr.f2.2.weight": torch.zeros(90, 100, 1, 1)}
    b, h, *_ = dhr_files(tmp_path, heads=lambda d: dict(d, decoder=dict(d["decoder"], **bad)))
    with pytest.raises(ValueError, match=r"CAUSE_VOC2012\.pt \['decoder'\].*head_ema\.tr\.f2\.2\.weight"):
        CAUSEExtractor.from_files(b, h)
    b, h, *_ = dhr_files(tmp_path, heads=lambda d: {"decoder": d["decoder"]})
    with pytest.raises(ValueError, match=r"CAUSE_VOC2012\.pt: .*no key\(s\) \['codebook'\]"):
        CAUSEExtractor.from_files(b, h)
    b, h, *_ = dhr_files(tmp_path, heads=lambda d: {"codebook": d["codebook"], "head_ema": d["decoder"]})
    with pytest.raises(ValueError, match=r"no key\(s\) \['decoder'\]"):
        CAUSEExtractor.from_files(b, h)
    b, h, *_ = dhr_files(tmp_path, heads=lambda d: dict(d, codebook=torch.zeros(7, 768)))
    with pytest.raises(ValueError, match=r"\['codebook'\]: must be \(K, 192\).*got shape \(7, 768\)"):
        CAUSEExtractor.from_files(b, h)
    b, h, *_ = dhr_files(tmp_path, heads=lambda d: dict(d, codebook=torch.zeros(7, 192, dtype=torch.long)))
    with pytest.raises(ValueError, match=r"\['codebook'\]: must be a float"):
        CAUSEExtractor.from_files(b, h)
    b, h, *_ = dhr_files(tmp_path, heads=lambda d: [d["decoder"]])
    with pytest.raises(ValueError, match=r"CAUSE_VOC2012\.pt: .*must be a dict"):
        CAUSEExtractor.from_files(b, h)
    b, h, *_ = dhr_files(tmp_path, backbone=lambda d: {k: v for k, v in d.items() if k != "norm.bias"})
    with pytest.raises(ValueError, match=r"dinov2_vitt14\.pth.*missing keys \['norm\.bias'\]"):
        CAUSEExtractor.from_files(b, h)
    b, h, *_ = dhr_files(tmp_path, patch=16)
    with pytest.raises(ValueError, match=r"dinov2_vitt14\.pth: DHR's CAUSE runs on a DINOv2 ViT with 14-pixel patches"):
        CAUSEExtractor.from_files(b, h)
    # a DINO v1 file of patch 14 (no LayerScale, no mask token) is not a DINOv2 backbone
    v1 = {k: v for k, v in DinoViT(PATCH, WIDTH, 1, num_patches=16).state_dict().items()}
    torch.save(v1, b)
    with pytest.raises(ValueError, match=r"runs on a DINOv2 ViT.*this file holds a ViT-Ti/14"):
        CAUSEExtractor.from_files(b, h)
    # other top-level keys are not read, as in DHR (checkpoint['decoder'/'codebook'] only)
    b, h, *_ = dhr_files(tmp_path, heads=lambda d: dict(d, epoch=torch.tensor(3)))
    with pytest.raises(FileNotFoundError, match="absent.pt"):
        CAUSEExtractor.from_files(b, tmp_path / "absent.pt")
    assert CAUSEExtractor.from_files(b, h).dim == 90


def test_pickled_objects_in_heads_file_are_refused_and_never_run(tmp_path):
    from test_stego import Payload  # touches a file when unpickled

    proof = tmp_path / "proof"
    pickle.loads(pickle.dumps(Payload(str(proof))))  # the payload does run when unpickled...
    assert proof.exists()
    marker = tmp_path / "ran"
    b, h, *_ = dhr_files(tmp_path, heads=lambda d: dict(d, meta=Payload(str(marker))))
    with pytest.raises(PermissionError, match=r"CAUSE_VOC2012\.pt: .*_touch.*nothing in it was run"):
        CAUSEExtractor.from_files(b, h)
    b, h, *_ = dhr_files(tmp_path, name="ok.pt", backbone=lambda d: dict(d, meta=Payload(str(marker))))
    with pytest.raises(PermissionError, match=r"dinov2_vitt14\.pth: .*weights_only=True"):
        CAUSEExtractor.from_files(b, h)
    assert not marker.exists()  # ...but never here


def test_cli_uss_cause_writes_dhr_features(tmp_path, capsys):
    from PIL import Image

    from mars_plugin.adapters.uss.extractor import load_extractor
    from mars_plugin.cli import main

    b, h, *_ = dhr_files(tmp_path)
    images = tmp_path / "images"
    images.mkdir()
    rng = np.random.default_rng(3)
    sizes = {"a": (21, 27), "b": (16, 30)}
    for stem, (hh, ww) in sizes.items():
        Image.fromarray(rng.integers(0, 256, (hh, ww, 3)).astype(np.uint8)).save(images / f"{stem}.png")
    out = tmp_path / "features"
    assert main(["features", "--uss", "cause", "--backbone", str(b), "--heads", str(h), "--dhr",
                 "--images", str(images), "--out", str(out), "--no-progress", "--batch-size", "2"]) == 0
    said = capsys.readouterr().out
    assert "CAUSE on DINOv2" in said and "scales 2, 1, 1.5, 0.5, flip averaging on, L2 normalisation off" in said
    ex = CAUSEExtractor.from_files(b, h, **DHR_SETTINGS)
    for stem, (hh, ww) in sizes.items():
        rgb = torch.from_numpy(np.array(Image.open(images / f"{stem}.png").convert("RGB"))).permute(2, 0, 1)[None]
        want = ex(rgb)[0].numpy().astype(np.float16)
        got = np.load(out / f"{stem}.npy", allow_pickle=False)
        assert got.shape == want.shape == (90, -(-2 * hh // 14), -(-2 * ww // 14))
        np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="--checkpoint"):
        load_extractor("cause", tmp_path / "x.ckpt")
    with pytest.raises(ValueError, match="--head is a Leopart option"):
        load_extractor("cause", backbone=b, heads=h, head=True)


def test_from_files_with_the_real_vit_loader(tmp_path):
    b, h, vit, dec, cb = dhr_files(tmp_path)
    ex = CAUSEExtractor.from_files(b, h)
    x = normalised(28, 42, seed=9)
    torch.testing.assert_close(ex.code(x), ref_code(ex, dec, cb, x), rtol=0, atol=ATOL)


@pytest.mark.parametrize("uss", ["cause", "dinov2"])
def test_features_written_as_pt_feed_mars_centroids(tmp_path, uss):
    """`mars features --uss cause|dinov2 --format pt` writes what `mars centroids` reads."""
    from PIL import Image

    from mars_plugin.cli import main
    from mars_plugin.formats.files import write_label
    from mars_plugin.method.selection import DebiasedCentroids

    b, h, *_ = dhr_files(tmp_path)
    images, labels, feats = tmp_path / "images", tmp_path / "labels", tmp_path / "features"
    images.mkdir()
    rng = np.random.default_rng(5)
    for i in range(4):
        Image.fromarray(rng.integers(0, 256, (28, 42, 3)).astype(np.uint8)).save(images / f"im{i}.png")
        y = torch.zeros(28, 42, dtype=torch.long)
        y[:, 21:] = 1 + i % 2
        write_label(labels / f"im{i}.png", y)
    files = ["--backbone", str(b)] + (["--heads", str(h)] if uss == "cause" else [])
    assert main(["features", "--uss", uss, *files, "--dhr", "--format", "pt", "--images", str(images),
                 "--out", str(feats), "--no-progress"]) == 0
    assert sorted(p.name for p in feats.iterdir() if not p.name.startswith(".mars-run")) == [f"im{i}.pt"
                                                                                          for i in range(4)]
    assert main(["centroids", "--features", str(feats), "--labels", str(labels), "--num-classes", "2",
                 "--out", str(tmp_path / "V.pt"), "--no-progress"]) == 0
    V = DebiasedCentroids.load(tmp_path / "V.pt")
    assert V.centroids.shape == (3, 90 if uss == "cause" else WIDTH) and bool(V.valid[1:].all())


# -- CAUSE's own release: CAUSE/<dataset>/<baseline>/<num_codebook>/segment_tr.pth + modularity/.../modular.npy

#: n_classes of CAUSE's pascalvoc (loader/dataloader.py:26) and its projection_dim default
#: (train_front_door_tr.py:338): the sizes of the modules of Segment_TR we do not build.
N_CLASSES, PROJECTION_DIM = 21, 2048


def release_segment_sd(dec, seed=5):
    """segment_tr.pth as CAUSE writes it: segment.state_dict() of its whole Segment_TR
    (modules/segment.py:27-47, saved unwrapped by train_front_door_tr.py:208,292-300), in its
    registration order: head (the student), projection_head, head_ema, projection_head_ema, linear."""
    g = torch.Generator().manual_seed(seed)
    student = {"head." + k[len("head_ema."):]: torch.randn(v.shape, generator=g) for k, v in dhr_decoder_sd(WIDTH, seed=seed).items()}
    proj = lambda m: {f"{m}.f.weight": torch.randn(PROJECTION_DIM, 90, 1, 1, generator=g),  # noqa: E731
                      f"{m}.f.bias": torch.randn(PROJECTION_DIM, generator=g)}
    return {**student, **proj("projection_head"), **dec, **proj("projection_head_ema"),
            "linear.f.weight": torch.randn(N_CLASSES, 90, 1, 1, generator=g), "linear.f.bias": torch.randn(N_CLASSES, generator=g)}


def release_files(tmp_path, segment=None, codebook=None, where=("upstream",), baseline="dinov2_vit_base_14",
                  dataset="pascalvoc", num_codebook="2048"):
    """A tiny CAUSE release in CAUSE's layout (utils/utils.py:54-62, fine_tuning_tr.py:254-264) and
    DHR's CAUSE_<dataset>.pt holding the same EMA head and codebook. Returns (backbone file,
    release folder, DHR file, codebook)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    b, h, vit, dec, cb = dhr_files(tmp_path)
    folder = tmp_path / "CAUSE" / dataset / baseline / num_codebook
    folder.mkdir(parents=True)
    sd = release_segment_sd(dec)
    torch.save(sd if segment is None else segment(sd), folder / "segment_tr.pth")
    # CAUSE's Cluster (segment_module.py:92-110): the codebook copy and the cluster probe; never read
    torch.save({"codebook": cb, "cluster_probe": torch.randn(N_CLASSES, 90)}, folder / "cluster_tr.pth")
    arr = cb.numpy() if codebook is None else codebook(cb.numpy())
    for w in where:
        d = tmp_path / "CAUSE" / dataset / "modularity" / baseline / num_codebook if w == "upstream" else folder
        d.mkdir(parents=True, exist_ok=True)
        np.save(d / "modular.npy", arr)  # train_mediator.py:105
    return b, folder, h, cb


def same_features(ex, ref):
    img = torch.randint(0, 256, (2, 3, 30, 40), dtype=torch.uint8, generator=torch.Generator().manual_seed(12))
    return torch.equal(ex(img), ref(img)) and torch.equal(ex.code(normalised(28, 42)), ref.code(normalised(28, 42)))


def test_release_key_names_are_causes():
    """The keys we write for segment_tr.pth are those of CAUSE's Segment_TR: head and head_ema are
    the same Decoder (modules/segment.py:38,44), whose keys are DHR's CauseDecoder's."""
    sd = release_segment_sd(dhr_decoder_sd(WIDTH))
    head = sorted(k for k in sd if k.startswith("head_ema."))
    assert head == sorted(CAUSESegment(WIDTH).state_dict())
    assert sorted(k for k in sd if k.startswith("head.")) == sorted("head." + k[len("head_ema."):] for k in head)
    assert sorted(set(sd) - set(head) - {k for k in sd if k.startswith("head.")}) == sorted(cause_files_mod._RELEASE_EXTRA_KEYS)


@pytest.mark.slow
@pytest.mark.parametrize("form", ["folder", "segment_file", "beside", "both"])
def test_release_forms_give_the_dhr_forms_features_exactly(tmp_path, form):
    where = {"beside": ("beside",), "both": ("upstream", "beside")}.get(form, ("upstream",))
    b, folder, h, cb = release_files(tmp_path, where=where)
    heads = folder / "segment_tr.pth" if form == "segment_file" else folder
    ex = CAUSEExtractor.from_files(b, heads, **DHR_SETTINGS)
    ref = CAUSEExtractor.from_files(b, h, **DHR_SETTINGS)
    assert torch.equal(ex.codebook, ref.codebook) and torch.equal(ex.codebook, cb)
    assert all(torch.equal(v, ref.segment.state_dict()[k]) for k, v in ex.segment.state_dict().items())
    assert same_features(ex, ref)
    # ...and not because everything is equal to everything: another codebook changes them
    other = CAUSEExtractor(ref.backbone, ref.segment, random_codebook(7, WIDTH, seed=9), **DHR_SETTINGS)
    assert not same_features(other, ref)


def test_release_with_a_relative_folder(tmp_path, monkeypatch):
    b, folder, h, _ = release_files(tmp_path)
    monkeypatch.chdir(folder)
    assert same_features(CAUSEExtractor.from_files(b, "."), CAUSEExtractor.from_files(b, h))


def test_release_missing_codebook_names_where_it_looked(tmp_path):
    b, folder, _, _ = release_files(tmp_path, where=())
    upstream = tmp_path / "CAUSE" / "pascalvoc" / "modularity" / "dinov2_vit_base_14" / "2048" / "modular.npy"
    with pytest.raises(FileNotFoundError, match=rf"modular\.npy was not found; looked for {re.escape(str(upstream))}"
                                                 rf".* and {re.escape(str(folder / 'modular.npy'))}"):
        CAUSEExtractor.from_files(b, folder)


def test_release_codebooks_that_differ_are_refused(tmp_path):
    b, folder, _, _ = release_files(tmp_path, where=("upstream",))
    np.save(folder / "modular.npy", random_codebook(7, WIDTH, seed=4).numpy())
    with pytest.raises(ValueError, match=r"are both CAUSE codebooks .* and they differ"):
        CAUSEExtractor.from_files(b, folder)


@pytest.mark.parametrize("bad, message", [
    (lambda a: np.zeros((7, 768), np.float32), r"must be \(K, 192\), D = the width of the backbone in .*dinov2_vitt14\.pth; got shape \(7, 768\)"),
    (lambda a: a[0], r"must be \(K, 192\).*got shape \(192,\)"),
    (lambda a: a[None], r"must be \(K, 192\).*got shape \(1, 7, 192\)"),
    (lambda a: np.zeros((0, 192), np.float32), r"must be \(K, 192\).*got shape \(0, 192\)"),
    (lambda a: np.where(np.arange(7)[:, None] == 3, np.nan, a).astype(np.float32), r"holds 192 NaN or infinite value\(s\) of 1344"),
    (lambda a: np.full_like(a, np.inf), r"holds 1344 NaN or infinite"),
    (lambda a: a.astype(np.int64), r"must be a float \(K, D\) array, got dtype int64"),
])
def test_release_codebook_checks_name_the_file_and_shapes(tmp_path, bad, message):
    b, folder, _, _ = release_files(tmp_path, codebook=bad)
    with pytest.raises(ValueError, match=r"modularity.dinov2_vit_base_14.2048.modular\.npy: .*" + message):
        CAUSEExtractor.from_files(b, folder)


def test_release_codebook_in_other_float_types(tmp_path):
    b, folder, h, cb = release_files(tmp_path, codebook=lambda a: a.astype(">f8"))  # big-endian float64
    ex = CAUSEExtractor.from_files(b, folder)
    assert torch.equal(ex.codebook, cb)


def test_release_pickles_are_refused_and_never_run(tmp_path):
    from test_stego import Payload  # touches a file when unpickled

    marker = tmp_path / "ran"
    # segment_tr.pth holding a pickled object
    b, folder, _, _ = release_files(tmp_path, segment=lambda sd: dict(sd, meta=Payload(str(marker))))
    with pytest.raises(PermissionError, match=r"segment_tr\.pth: .*_touch.*nothing in it was run"):
        CAUSEExtractor.from_files(b, folder)
    with pytest.raises(PermissionError, match=r"segment_tr\.pth: .*_touch"):
        CAUSEExtractor.from_files(b, folder / "segment_tr.pth")
    # modular.npy as an object array (np.save needs allow_pickle for it) and as a plain pickle
    b, folder, _, _ = release_files(tmp_path / "npy", where=("beside",))
    np.save(folder / "modular.npy", np.array([Payload(str(marker))], dtype=object), allow_pickle=True)
    with pytest.raises(PermissionError, match=r"modular\.npy: this codebook file holds pickled Python objects.*"
                                              r"allow_pickle=False.*nothing in it was run"):
        CAUSEExtractor.from_files(b, folder)
    with open(folder / "modular.npy", "wb") as f:
        pickle.dump(Payload(str(marker)), f)
    with pytest.raises(PermissionError, match=r"modular\.npy: this codebook file holds pickled"):
        CAUSEExtractor.from_files(b, folder)
    assert not marker.exists()
    pickle.loads(pickle.dumps(Payload(str(marker))))  # the payload does run when unpickled
    assert marker.exists()
    (folder / "modular.npy").write_text("not an array")
    with pytest.raises(ValueError, match=r"modular\.npy: cannot read CAUSE's codebook with np\.load \(not a \.npy file"):
        CAUSEExtractor.from_files(b, folder)


def test_heads_neither_form_is_one_clear_error(tmp_path):
    b, folder, h, _ = release_files(tmp_path)
    both = r"Expected \(1\) DHR's CAUSE_<dataset>\.pt.*\(2\) CAUSE's release folder.*segment_tr\.pth.*\(3\) that segment_tr\.pth file"
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=rf"empty: not CAUSE heads in either form; found an empty folder\. {both}"):
        CAUSEExtractor.from_files(b, empty)
    # one level too high: the folder holds the <num_codebook> folder
    with pytest.raises(ValueError, match=rf"dinov2_vit_base_14: not CAUSE heads .*found a folder holding \['2048/'\]\. {both}"):
        CAUSEExtractor.from_files(b, folder.parent)
    mlp = tmp_path / "mlp"
    mlp.mkdir()
    torch.save({}, mlp / "segment_mlp.pth")
    with pytest.raises(ValueError, match=r"\['segment_mlp\.pth'\] \(a CAUSE-MLP release; CAUSEExtractor reads CAUSE-TR"):
        CAUSEExtractor.from_files(b, mlp)
    torch.save({"state_dict": {"w": torch.zeros(2)}}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match=rf"other\.pt: not CAUSE heads .*found a dict with keys \['state_dict'\]\. {both}"):
        CAUSEExtractor.from_files(b, tmp_path / "other.pt")
    with pytest.raises(ValueError, match=r"cluster_tr\.pth: this is CAUSE's cluster_tr\.pth .*pass segment_tr\.pth"):
        CAUSEExtractor.from_files(b, folder / "cluster_tr.pth")
    with pytest.raises(FileNotFoundError, match=r"CAUSE heads file or folder .*absent does not exist"):
        CAUSEExtractor.from_files(b, tmp_path / "absent")


def test_release_with_module_prefix_is_refused(tmp_path):
    """CAUSE saves the unwrapped Segment_TR (train_front_door_tr.py:208), so a 'module.' file is not
    one of its files, and CAUSE's strict=False loader would skip every key of it."""
    b, folder, _, _ = release_files(tmp_path, segment=lambda sd: {"module." + k: v for k, v in sd.items()})
    with pytest.raises(ValueError, match=r"segment_tr\.pth: keys start with 'module\.'.*DistributedDataParallel"):
        CAUSEExtractor.from_files(b, folder)


def test_release_is_strict_and_names_file_and_key(tmp_path):
    def without(key):
        return lambda sd: {k: v for k, v in sd.items() if k != key}

    b, folder, _, _ = release_files(tmp_path / "a", segment=without("linear.f.bias"))
    with pytest.raises(ValueError, match=r"segment_tr\.pth does not match CAUSE's Segment_TR .*missing key\(s\) \['linear\.f\.bias'\]"):
        CAUSEExtractor.from_files(b, folder)
    b, folder, _, _ = release_files(tmp_path / "b", segment=lambda sd: dict(sd, **{"cluster_probe": torch.zeros(2)}))
    with pytest.raises(ValueError, match=r"segment_tr\.pth does not match .*unexpected key\(s\) \['cluster_probe'\]"):
        CAUSEExtractor.from_files(b, folder)
    b, folder, _, _ = release_files(tmp_path / "c", segment=without("head_ema.tr.norm3.bias"))
    with pytest.raises(ValueError, match=r"segment_tr\.pth does not match the EMA head .*missing key\(s\) \['head_ema\.tr\.norm3\.bias'\]"):
        CAUSEExtractor.from_files(b, folder)
    bad = {"head_ema.tr.f2.2.weight": torch.zeros(90, 100, 1, 1)}
    b, folder, _, _ = release_files(tmp_path / "d", segment=lambda sd: dict(sd, **bad))
    with pytest.raises(ValueError, match=r"segment_tr\.pth \(backbone width 192\).*head_ema\.tr\.f2\.2\.weight"):
        CAUSEExtractor.from_files(b, folder)
    b, folder, _, _ = release_files(tmp_path / "e", segment=lambda sd: dict(sd, **{"head_ema.query_pos": torch.zeros(529, 768)}))
    with pytest.raises(ValueError, match=r"segment_tr\.pth: 'head_ema\.query_pos' has shape \(529, 768\), expected \(Q, 192\)"):
        CAUSEExtractor.from_files(b, folder)


@pytest.mark.parametrize("baseline, message", [
    ("dino_vit_base_8", r"CAUSE's release for dino_vit_base_8 \(DINO ViT-B/8\); CAUSEExtractor runs on DINOv2"),
    ("dino_vit_small_16", r"release for dino_vit_small_16 \(DINO ViT-S/16\)"),
    ("mae_vit_base_16", r"release for mae_vit_base_16 \(MAE ViT-B/16\)"),
])
def test_release_for_another_backbone_is_refused_by_its_folder(tmp_path, baseline, message):
    b, folder, _, _ = release_files(tmp_path, baseline=baseline)
    for heads in (folder, folder / "segment_tr.pth"):
        with pytest.raises(ValueError, match=r"segment_tr\.pth: this is .*" + message):
            CAUSEExtractor.from_files(b, heads)


@pytest.mark.parametrize("queries, message", [
    (1600, r"has 1600 rows = 320\*\*2 // 8\*\*2: CAUSE trained it for a backbone with 8-pixel patches"),
    (400, r"has 400 rows = 320\*\*2 // 16\*\*2: CAUSE trained it for a backbone with 16-pixel patches"),
    (100, r"has 100 rows; CAUSE's DINOv2 release has 529 = 322\*\*2 // 14\*\*2"),
])
def test_release_for_another_backbone_is_refused_by_its_queries(tmp_path, queries, message):
    """A DINO ViT-B/8 release has the DINOv2 ViT-B/14 release's width (768): only the query count
    (train_front_door_tr.py:349) tells them apart once the folder is renamed."""
    q = {"head_ema.query_pos": torch.randn(queries, WIDTH)}
    b, folder, _, _ = release_files(tmp_path, segment=lambda sd: dict(sd, **q), baseline="renamed")
    with pytest.raises(ValueError, match=r"segment_tr\.pth: 'head_ema\.query_pos' " + message):
        CAUSEExtractor.from_files(b, folder)


def test_cli_features_from_a_cause_release_folder(tmp_path, capsys):
    from PIL import Image

    from mars_plugin.cli import main

    b, folder, h, _ = release_files(tmp_path)
    images, out = tmp_path / "images", tmp_path / "features"
    images.mkdir()
    rng = np.random.default_rng(7)
    sizes = {"a": (21, 27), "b": (16, 30)}
    for stem, (hh, ww) in sizes.items():
        Image.fromarray(rng.integers(0, 256, (hh, ww, 3)).astype(np.uint8)).save(images / f"{stem}.png")
    assert main(["features", "--uss", "cause", "--backbone", str(b), "--heads", str(folder), "--images", str(images),
                 "--out", str(out), "--no-progress"]) == 0
    assert "CAUSE on DINOv2 ViT-Ti/14" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".mars-run")) == ["a.npy", "b.npy"]
    ex = CAUSEExtractor.from_files(b, h)  # DHR's file holding the same weights, the CLI's defaults
    for stem in sizes:
        rgb = torch.from_numpy(np.array(Image.open(images / f"{stem}.png").convert("RGB"))).permute(2, 0, 1)[None]
        got = np.load(out / f"{stem}.npy", allow_pickle=False)
        want = ex(rgb)[0].numpy().astype(got.dtype)
        assert got.shape == want.shape and got.shape[0] == 90
        np.testing.assert_array_equal(got, want)
