"""STEGO extractor: checkpoint layout, code = cluster1 + cluster2, flip averaging, sizes; DHR's
two-file layout (from_files) and `mars features --backbone --heads --dhr`."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mars_plugin.adapters.uss.multiscale import DHR_SCALES, DHR_SETTINGS
from mars_plugin.adapters.uss.stego import STEGOExtractor, stego_input_size
from mars_plugin.adapters.uss.preprocess import IMAGENET_MEAN, IMAGENET_STD
from mars_plugin.adapters.uss.vit import DinoViT


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
    """STEGO by hand: nearest resize, ImageNet norm, feat -> cluster1 + cluster2 (1x1 convs as matmuls).
    ``size=None``: ``img_u8`` is already a normalised float batch whose sides are patch multiples."""
    if size is None:
        x = img_u8
    else:
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


# -- DHR's two files: DINO's backbone + STEGO_<dataset>.pt (core/uss/models.py:8-72 @ 94d5189) ------


def dhr_files(tmp_path, sd, name="STEGO_VOC2012.pt", backbone=None, heads=None):
    """Write DHR's layout: DINO's flat backbone state dict, and {'cluster1', 'cluster2'} state dicts
    of the Sequential heads (saved as nn.Module.state_dict() gives them, OrderedDicts)."""
    flat = {k[len("net.model."):]: v for k, v in sd.items() if k.startswith("net.model.")}
    width, dim = sd["net.cluster1.0.weight"].shape[1], sd["net.cluster1.0.weight"].shape[0]
    c1 = torch.nn.Sequential(torch.nn.Conv2d(width, dim, 1))
    c2 = torch.nn.Sequential(torch.nn.Conv2d(width, width, 1), torch.nn.ReLU(), torch.nn.Conv2d(width, dim, 1))
    c1.load_state_dict({k[len("net.cluster1."):]: v for k, v in sd.items() if k.startswith("net.cluster1.")})
    c2.load_state_dict({k[len("net.cluster2."):]: v for k, v in sd.items() if k.startswith("net.cluster2.")})
    b, h = tmp_path / "dino_vitbase8_pretrain.pth", tmp_path / name
    torch.save(flat if backbone is None else backbone(flat), b)
    hd = {"cluster1": c1.state_dict(), "cluster2": c2.state_dict()}
    torch.save(hd if heads is None else heads(hd), h)
    return b, h


def dhr_normalize(rgb):
    """DHR's tools/transforms.py:235-254 Normalize, in numpy float32 as written there."""
    image = np.asarray(rgb, dtype=np.float32)
    h, w, c = image.shape
    out = np.zeros((c, h, w), np.float32)
    for i in range(3):
        out[i] = (image[..., i] / 255. - IMAGENET_MEAN[i]) / IMAGENET_STD[i]
    return torch.from_numpy(out)


def test_from_files_equals_a_stego_built_from_the_same_tensors(tmp_path, sd):
    from test_multiscale import reference

    b, h = dhr_files(tmp_path, sd)
    ex = STEGOExtractor.from_files(b, h, **DHR_SETTINGS)
    direct = STEGOExtractor.from_state_dict(sd, **DHR_SETTINGS)
    assert ex.dim == 16 and ex.cluster2 is not None and ex.res is None and ex.scales == DHR_SCALES
    assert not ex.normalize and ex.flip_average
    assert {k: v.shape for k, v in ex.state_dict().items()} == {k: v.shape for k, v in direct.state_dict().items()}
    assert all(torch.equal(v, direct.state_dict()[k]) for k, v in ex.state_dict().items())
    img = torch.randint(0, 256, (1, 3, 21, 27), dtype=torch.uint8, generator=torch.Generator().manual_seed(9))
    out = ex(img)
    assert torch.equal(out, direct(img))
    # and DHR's inference(STEGO, Normalize(image)), written out in test_multiscale.reference
    ref = reference(lambda x: manual_code(ex, x, None), dhr_normalize(img[0].permute(1, 2, 0).numpy()),
                    DHR_SCALES, True, 8)
    assert out.shape == (1, 16, 6, 7)  # 21x27 at 2.0 -> 42x54 -> 48x56
    torch.testing.assert_close(out[0], ref, rtol=0, atol=1e-4)


def test_from_files_is_strict_and_names_file_and_key(tmp_path, sd):
    def drop(key):
        return lambda d: {k: v for k, v in d.items() if k != key}

    b, h = dhr_files(tmp_path, sd, backbone=drop("blocks.0.attn.qkv.bias"))
    with pytest.raises(ValueError, match=r"dino_vitbase8_pretrain\.pth.*missing keys \['blocks\.0\.attn\.qkv\.bias'\]"):
        STEGOExtractor.from_files(b, h)
    b, h = dhr_files(tmp_path, sd, backbone=lambda d: dict(d, **{"head.weight": torch.zeros(3, 384)}))
    with pytest.raises(ValueError, match=r"dino_vitbase8_pretrain\.pth.*unexpected keys \['head\.weight'\]"):
        STEGOExtractor.from_files(b, h)
    b, h = dhr_files(tmp_path, sd, backbone=lambda d: {"state_dict": d, "epoch": 3})
    with pytest.raises(ValueError, match=r"dino_vitbase8_pretrain\.pth.*\['epoch', 'state_dict'\] are not tensors"):
        STEGOExtractor.from_files(b, h)
    b, h = dhr_files(tmp_path, sd, heads=lambda d: {"cluster1": d["cluster1"]})
    with pytest.raises(ValueError, match=r"STEGO_VOC2012\.pt: .*no key\(s\) \['cluster2'\]"):
        STEGOExtractor.from_files(b, h)
    b, h = dhr_files(tmp_path, sd, heads=lambda d: dict(d, cluster1=drop("0.bias")(d["cluster1"])))
    with pytest.raises(ValueError, match=r"STEGO_VOC2012\.pt \['cluster1'\]: missing key\(s\) \['0\.bias'\]"):
        STEGOExtractor.from_files(b, h)
    b, h = dhr_files(tmp_path, sd, heads=lambda d: dict(d, cluster2=dict(d["cluster2"], **{"4.bias": torch.zeros(16)})))
    with pytest.raises(ValueError, match=r"\['cluster2'\]: unexpected key\(s\) \['4\.bias'\]"):
        STEGOExtractor.from_files(b, h)
    wide = {"0.weight": torch.zeros(16, 768, 1, 1), "0.bias": torch.zeros(16)}
    b, h = dhr_files(tmp_path, sd, heads=lambda d: dict(d, cluster1=wide))
    with pytest.raises(ValueError, match=r"\['cluster1'\]: 0\.weight takes 768 channels but the backbone .* is 384 wide"):
        STEGOExtractor.from_files(b, h)
    b, h = dhr_files(tmp_path, sd, heads=lambda d: dict(d, cluster1={"0.weight": torch.zeros(16, 384, 3, 3),
                                                                     "0.bias": torch.zeros(16)}))
    with pytest.raises(ValueError, match=r"\['cluster1'\].*1x1 convolution"):
        STEGOExtractor.from_files(b, h)
    narrow = {"0.weight": torch.zeros(70, 384, 1, 1), "0.bias": torch.zeros(70),
              "2.weight": torch.zeros(16, 70, 1, 1), "2.bias": torch.zeros(16)}
    b, h = dhr_files(tmp_path, sd, heads=lambda d: dict(d, cluster2=narrow))
    with pytest.raises(ValueError, match=r"\['cluster2'\]: Conv2d 384->70, ReLU, Conv2d 70->16; expected 384->384"):
        STEGOExtractor.from_files(b, h)
    b, h = dhr_files(tmp_path, sd, heads=lambda d: [d["cluster1"]])
    with pytest.raises(ValueError, match=r"STEGO_VOC2012\.pt: .*must be a dict"):
        STEGOExtractor.from_files(b, h)
    with pytest.raises(FileNotFoundError, match="absent.pt"):
        STEGOExtractor.from_files(b, tmp_path / "absent.pt")
    # extra top-level keys of the heads file are not read, as in DHR (checkpoint['cluster1'/'cluster2'] only)
    b, h = dhr_files(tmp_path, sd, heads=lambda d: dict(d, epoch=torch.tensor(3)))
    assert STEGOExtractor.from_files(b, h).dim == 16


def _touch(path):
    """What a malicious pickle would run: leaves a marker file."""
    open(path, "w").close()
    return {}


class Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (_touch, (self.marker,))


def test_pickled_objects_in_dhr_files_are_refused_and_never_run(tmp_path, sd):
    import pickle

    proof = tmp_path / "proof"
    pickle.loads(pickle.dumps(Payload(str(proof))))  # the payload does run when unpickled...
    assert proof.exists()
    marker = tmp_path / "ran"
    b, h = dhr_files(tmp_path, sd, heads=lambda d: dict(d, meta=Payload(str(marker))))
    with pytest.raises(PermissionError, match=r"STEGO_VOC2012\.pt: .*_touch.*nothing in it was run"):
        STEGOExtractor.from_files(b, h)
    b, h = dhr_files(tmp_path, sd, name="heads_ok.pt", backbone=lambda d: dict(d, meta=Payload(str(marker))))
    with pytest.raises(PermissionError, match=r"dino_vitbase8_pretrain\.pth: .*weights_only=True"):
        STEGOExtractor.from_files(b, h)
    assert not marker.exists()  # ...but never here


def test_cli_backbone_heads_dhr_writes_dhr_features(tmp_path, sd, capsys):
    from PIL import Image

    from mars_plugin.adapters.uss.extractor import load_extractor
    from mars_plugin.cli import main
    from test_multiscale import reference

    b, h = dhr_files(tmp_path, sd)
    images = tmp_path / "images"
    images.mkdir()
    rng = np.random.default_rng(3)
    sizes = {"a": (21, 27), "b": (16, 24), "c": (30, 18)}
    for stem, (hh, ww) in sizes.items():
        Image.fromarray(rng.integers(0, 256, (hh, ww, 3)).astype(np.uint8)).save(images / f"{stem}.png")
    out = tmp_path / "features"
    assert main(["features", "--uss", "stego", "--backbone", str(b), "--heads", str(h), "--dhr",
                 "--images", str(images), "--out", str(out), "--no-progress", "--batch-size", "2"]) == 0
    said = capsys.readouterr().out
    assert "full resolution, scales 2, 1, 1.5, 0.5, flip averaging on, L2 normalisation off" in said
    ex = STEGOExtractor.from_files(b, h)
    for stem, (hh, ww) in sizes.items():
        rgb = np.array(Image.open(images / f"{stem}.png").convert("RGB"))
        ref = reference(lambda x: manual_code(ex, x, None), dhr_normalize(rgb), DHR_SCALES, True, 8).numpy()
        got = np.load(out / f"{stem}.npy", allow_pickle=False)
        assert got.dtype == np.float16 and got.shape == ref.shape == (16, -(-2 * hh // 8), -(-2 * ww // 8))
        np.testing.assert_allclose(got.astype(np.float32), ref, rtol=1e-3, atol=1e-4)
    # explicit flags win over --dhr
    for kw, attr, want in [({"flip_average": False}, "flip_average", False), ({"normalize": True}, "normalize", True),
                           ({"res": 32}, "res", 32), ({"scales": (1.0,)}, "scales", (1.0,))]:
        assert getattr(load_extractor("stego", backbone=b, heads=h, dhr=True, **kw), attr) == want
    # exactly one of the two forms
    base = ["features", "--uss", "stego", "--images", str(images), "--out", str(tmp_path / "x"), "--no-progress"]
    for extra, msg in [(["--checkpoint", str(b), "--backbone", str(b), "--heads", str(h)], "not both"),
                       (["--backbone", str(b)], "got only --backbone"),
                       ([], "no model files"),
                       (["--backbone", str(b), "--heads", str(h), "--trust-pickle"], "weights_only=True")]:
        assert main(base + extra) == 2
        assert msg in capsys.readouterr().err
    leo = ["features", "--uss", "leopart", "--backbone", str(b), "--heads", str(h), "--images", str(images),
           "--out", str(tmp_path / "y"), "--no-progress"]
    assert main(leo) == 2 and "Leopart reads one --checkpoint" in capsys.readouterr().err
    for bad in (["--scales", "2,x"], ["--scales", "2,0"], ["--res", "big"]):
        with pytest.raises(SystemExit):
            main(base + ["--backbone", str(b), "--heads", str(h)] + bad)
