"""`mars predict` (mars_plugin.commands.predict): multi-scale + flip inference against a plain loop written
from the definition, the CRF step against dense_crf per image, the label files (P mode, VOC
palette), resume, bad files, bad flags, bad checkpoints, DHR's WSS layout, `mars evaluate` on the
output, and two torchrun ranks against one process."""
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image

from mars_plugin.engines.crf import dense_crf
from mars_plugin.formats.files import voc_palette
from mars_plugin.commands.predict import predict_job
from mars_plugin.networks.inference import (CLASS_THRESHOLD, DEFAULT_SCALES, labels_from_probs, multiscale_probs,
                                            predict_labels)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One torch thread: these tiny convolutions gain nothing from more, and on a busy machine
    two threads per process made them 50x slower (restored after the module)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class Net(nn.Module):
    """A tiny network whose classes follow the colours (random weights, large enough to vary
    across the image); ``stride=2`` gives logits at half the input size, as a network that does
    not upsample them itself."""

    def __init__(self, labels: int = 4, stride: int = 1, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.a = nn.Conv2d(3, 8, 3, padding=1)
        self.b = nn.Conv2d(8, labels, 3, padding=1, stride=stride)
        for p in self.parameters():
            p.data = torch.randn(p.shape, generator=g) * 1.5
        self.stride = stride

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _images(n, h, w, seed=0):
    """(n, H, W, 3) uint8: smooth colour blobs (so that the classes form regions) and noise."""
    r = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    out = []
    for _ in range(n):
        img = np.zeros((h, w, 3))
        for c in range(3):
            fx, phase, fy = r.uniform(0.1, 0.4), r.uniform(0, 6), r.uniform(0.1, 0.4)
            img[..., c] = 128 + 100 * np.sin(xx * fx + phase) * np.cos(yy * fy)
        out.append(np.clip(img + r.normal(0, 8, img.shape), 0, 255).astype(np.uint8))
    return torch.from_numpy(np.stack(out))


def _normalize(rgb):
    """(B, H, W, 3) uint8 -> (B, 3, H, W) float, roughly zero-centred (the tests' stand-in for
    ImageNet's)."""
    return rgb.permute(0, 3, 1, 2).float().div(255).sub(0.5).div(0.25)


def _reference_probs(model, image, scales, flip):
    """One (3, H, W) normalised image, written from the definition: for every scale and flip,
    bilinear resize (align_corners=False) to (int(H s), int(W s)), the network, its logits resized
    to that input, softmax, flipped back, resized to H x W; the mean of all of them."""
    H, W = image.shape[-2:]
    maps = []
    for s in scales:
        size = (int(H * s), int(W * s))
        x = image[None]
        if size != (H, W):
            x = F.interpolate(x, size=size, mode="bilinear", align_corners=False)
        for f in ([False, True] if flip else [False]):
            xi = x.flip(-1) if f else x
            with torch.no_grad():
                logits = model(xi)
            if tuple(logits.shape[-2:]) != size:
                logits = F.interpolate(logits, size=size, mode="bilinear", align_corners=False)
            p = torch.softmax(logits, 1)
            if f:
                p = p.flip(-1)
            if size != (H, W):
                p = F.interpolate(p, size=(H, W), mode="bilinear", align_corners=False)
            maps.append(p[0])
    return torch.stack(maps).mean(0)


@pytest.mark.parametrize("scales,flip,stride", [
    (DEFAULT_SCALES, True, 1), (DEFAULT_SCALES, False, 1), ((0.5, 1.25), True, 1), ((1.0,), True, 2),
    (DEFAULT_SCALES, True, 2)])
def test_multiscale_probs_equal_a_loop_from_the_definition(scales, flip, stride):
    torch.manual_seed(0)
    model = Net(5, stride=stride).eval()
    x = _normalize(_images(3, 26, 37))
    got = multiscale_probs(model, x, scales, flip)
    want = torch.stack([_reference_probs(model, xi, scales, flip) for xi in x])
    assert got.shape == (3, 5, 26, 37) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    # the reference itself is not trivial: scales and flips each change the result
    assert not torch.allclose(want, torch.stack([_reference_probs(model, xi, (1.0,), False) for xi in x]), atol=1e-3)


def test_fp16_runs_the_network_in_half_and_returns_float32():
    from mars_plugin.networks.inference import half_dtype

    seen = []

    class Spy(Net):
        def forward(self, x):
            y = super().forward(x)
            seen.append(y.dtype)
            return y

    model = Spy(4).eval()
    x = _normalize(_images(2, 24, 32))
    got = multiscale_probs(model, x, fp16=True)
    assert got.dtype == torch.float32 and set(seen) == {half_dtype(x.device)} == {torch.bfloat16}
    torch.testing.assert_close(got, multiscale_probs(model, x), atol=5e-2, rtol=0)


@pytest.mark.parametrize("fp16", [False, True])
def test_a_network_whose_output_is_not_finite_is_refused(fp16):
    class Overflow(Net):
        def forward(self, x):
            y = super().forward(x)
            return y.masked_fill(y > 0, float("inf"))  # what float16 does to large activations

    x = _normalize(_images(1, 24, 32))
    with pytest.raises(ValueError, match="NaN or Inf" + (" under bfloat16 autocast" if fp16 else "")):
        multiscale_probs(Overflow(4).eval(), x, fp16=fp16)


def _probs_with_absent_classes(seed=0):
    """(3, 5, 24, 30) probabilities in which image 0 has class 4 below the threshold everywhere,
    image 1 only class 2 above it, image 2 every class: the CRF label sets differ per image."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 5, 24, 30, generator=g) * 2
    logits[0, 4] -= 8  # never reaches 0.05
    logits[1] = torch.randn(5, 24, 30, generator=g) - 12
    logits[1, 2] = 5.0  # class 2 fills image 1
    return torch.softmax(logits, 1)


@pytest.mark.parametrize("crf", ["none", "mars", "psa"])
@pytest.mark.parametrize("threshold", [CLASS_THRESHOLD, 0.0, 0.5])
def test_labels_equal_dense_crf_per_image_on_the_kept_classes(crf, threshold):
    probs = _probs_with_absent_classes()
    rgb = _images(3, 24, 30, seed=1)
    got = labels_from_probs(probs, rgb, crf, threshold)
    assert got.shape == (3, 24, 30) and got.dtype == torch.int64
    for i in range(3):
        p = probs[i]
        if crf == "none":
            want = p.argmax(0)
        else:
            keys = torch.nonzero(p.amax(dim=(1, 2)) >= threshold)[:, 0]
            if keys.numel() == 0:
                keys = torch.arange(p.shape[0])
            q = dense_crf(p[keys], rgb[i], crf)
            want = keys[q.argmax(0)]
        assert torch.equal(got[i], want), (crf, threshold, i)
    if crf != "none" and threshold == CLASS_THRESHOLD:
        assert torch.equal(got[1], torch.full((24, 30), 2))  # one class kept: that class (not background)
        assert not bool((got[0] == 4).any())


def _below_threshold_argmax():
    """(1, 21, 24, 30): VOC's 21 labels; class 20 has 0.049 and the other 20 share the rest
    (0.04755 each): class 20 is the argmax of every pixel but a corner without reaching 0.05."""
    p = torch.full((1, 21, 24, 30), 0.0)
    p[0, :20] = (1 - 0.049) / 20
    p[0, 20] = 0.049
    p[0, :, :2, :2] = 0.5 / 20  # a corner where class 3 reaches 0.5: the one class kept
    p[0, 3, :2, :2] = 0.5
    return p


@pytest.mark.parametrize("crf", ["mars", "psa"])
def test_a_class_below_the_threshold_is_no_label_of_the_crf(crf):
    """Upstream's subset matters: class 20, the argmax of the image but never 0.05, is not a
    label of its CRF; over every class (threshold 0) it is."""
    probs = _below_threshold_argmax()
    rgb = _images(1, 24, 30, seed=1)
    assert bool((labels_from_probs(probs, rgb, "none") == 20).any())
    kept = labels_from_probs(probs, rgb, crf, CLASS_THRESHOLD)
    every = labels_from_probs(probs, rgb, crf, 0.0)
    assert not bool((kept == 20).any()) and bool((every == 20).any())
    keys = torch.nonzero(probs[0].amax(dim=(1, 2)) >= CLASS_THRESHOLD)[:, 0]
    assert keys.tolist() == [3] and bool((kept == 3).all())


def test_when_no_class_reaches_the_threshold_every_class_takes_part():
    """Beyond 20 classes every probability can stay below 0.05 (upstream's CRF would get no
    label): the CRF then runs over every class."""
    g = torch.Generator().manual_seed(2)
    probs = torch.softmax(torch.randn(1, 30, 24, 24, generator=g) * 0.1, 1)  # all about 1/30
    assert float(probs.max()) < CLASS_THRESHOLD
    rgb = _images(1, 24, 24, seed=4)
    got = labels_from_probs(probs, rgb, "mars")
    assert torch.equal(got[0], dense_crf(probs[0], rgb[0], "mars").argmax(0))


def test_predict_labels_is_multiscale_then_labels():
    model = Net(4).eval()
    rgb = _images(2, 24, 24, seed=3)
    x = _normalize(rgb)
    want = labels_from_probs(multiscale_probs(model, x), rgb, "mars")
    assert torch.equal(predict_labels(model, x, rgb), want)
    assert len(want.unique()) > 1  # the test images give several classes


@pytest.mark.parametrize("bad,match", [
    (dict(scales=()), "at least one scale"), (dict(scales=(0.0,)), r"scales\[0\]"), (dict(scales="1"), "scales"),
    (dict(crf="dense"), "crf must be one of"), (dict(class_threshold=1.5), "class_threshold"),
])
def test_bad_arguments_name_the_parameter(bad, match):
    model = Net(3).eval()
    rgb = _images(1, 24, 24)
    x = _normalize(rgb)
    with pytest.raises((ValueError, TypeError), match=match):
        predict_labels(model, x, rgb, **bad)


# --------------------------------------------------------------------------------------------
# the folder job
# --------------------------------------------------------------------------------------------

SIZES = [(24, 32), (32, 24), (24, 32), (40, 28), (24, 32)]


def _write_images(folder: Path, sizes=SIZES, seed=0):
    folder.mkdir(parents=True, exist_ok=True)
    stems = []
    for i, (h, w) in enumerate(sizes):
        img = _images(1, h, w, seed=seed + i)[0].numpy()
        Image.fromarray(img).save(folder / f"im{i}.png")
        stems.append(f"im{i}")
    return stems


def test_job_writes_p_mode_pngs_with_the_voc_palette_equal_to_predict_labels(tmp_path):
    stems = _write_images(tmp_path / "images")
    model = Net(4).eval()
    s = predict_job(model, tmp_path / "images", tmp_path / "out", batch_size=2, preprocess=_normalize,
                    progress=False)
    assert (s.done, s.existing, s.failed) == (5, 0, [])
    for i, stem in enumerate(stems):
        with Image.open(tmp_path / "out" / f"{stem}.png") as im:
            assert im.mode == "P" and im.size == (SIZES[i][1], SIZES[i][0])
            assert im.getpalette()[:3 * 256] == voc_palette()[:3 * 256]
            got = torch.from_numpy(np.asarray(im).astype(np.int64))
        rgb = torch.from_numpy(np.array(Image.open(tmp_path / "images" / f"{stem}.png")))[None]
        want = predict_labels(model, _normalize(rgb), rgb)[0]
        assert torch.equal(got, want), stem


# --------------------------------------------------------------------------------------------
# the command line, on mars train checkpoints of DeepLabv3+ ResNet-18 with random weights
# --------------------------------------------------------------------------------------------

REPO = Path(__file__).resolve().parents[1]


def _checkpoint(path: Path, num_classes: int, seed: int = 0, teacher: bool = True) -> Path:
    """A mars train checkpoint (seg_checkpoint's layout) of a random DeepLabv3+ ResNet-18 whose
    classifier is scaled up, so that its softmax is peaked and its labels vary."""
    from mars_plugin.networks.deeplab import build_model
    from mars_plugin.networks.seg_checkpoint import save_checkpoint

    def weights(s):
        torch.manual_seed(s)
        state = build_model("deeplabv3+", "resnet18", num_classes, 16).state_dict()
        state["decoder.classifier.4.weight"] *= 400
        return state

    save_checkpoint(path, {"model": {"arch": "deeplabv3+", "backbone": "resnet18", "output_stride": 16,
                                     "num_classes": num_classes},
                           "iteration": 10, "student": weights(seed),
                           "teacher": weights(seed + 1) if teacher else None})
    return path


class World:
    def __init__(self, root: Path):
        from mars_plugin.formats.files import write_label

        self.root = root
        self.images = root / "images"
        self.stems = _write_images(self.images)
        self.gt = root / "gt"
        self.gt.mkdir()
        r = np.random.default_rng(0)
        for stem, (h, w) in zip(self.stems, SIZES):
            write_label(self.gt / f"{stem}.png", torch.from_numpy(r.integers(0, 4, (h, w))))
        self.ck = _checkpoint(root / "mars.pt", 3)
        self.ce = _checkpoint(root / "ce.pt", 3, teacher=False)

    def argv(self, out, *more, images=None, model=None):
        return ["predict", "--model", str(model or self.ck), "--images", str(images or self.images), "--out",
                str(out), "--no-progress", *more]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return World(tmp_path_factory.mktemp("predict"))


def _run(argv, capsys):
    """(exit status, stdout, stderr) of ``mars`` in this process; argparse's exits included."""
    from mars_plugin.cli import main

    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def _reference_labels(ck: Path, which: str, image: Path, **kw) -> torch.Tensor:
    from mars_plugin.networks.deeplab import normalize
    from mars_plugin.networks.seg_checkpoint import model_from_checkpoint

    model, _ = model_from_checkpoint(ck, which)
    rgb = torch.from_numpy(np.array(Image.open(image).convert("RGB")))[None]
    return predict_labels(model, normalize(rgb), rgb, **kw)[0]


def _read(path: Path) -> torch.Tensor:
    with Image.open(path) as im:
        assert im.mode == "P" and im.getpalette()[:768] == voc_palette()[:768]
        return torch.from_numpy(np.asarray(im).astype(np.int64))


@pytest.mark.slow
@pytest.mark.parametrize("which", ["student", "teacher"])
def test_predict_then_evaluate(world, tmp_path, capsys, which):
    out = tmp_path / "pred"
    code, said, err = _run(world.argv(out, "--which", which), capsys)
    assert code == 0, err
    assert said.strip() == f"predictions -> {out}: 5 written, 0 skipped"
    got = {stem: _read(out / f"{stem}.png") for stem in world.stems}
    for stem in world.stems:
        assert torch.equal(got[stem], _reference_labels(world.ck, which, world.images / f"{stem}.png")), stem
    assert len(torch.cat([g.flatten() for g in got.values()]).unique()) > 1
    code, said, err = _run(["evaluate", "--pred", str(out), "--gt", str(world.gt), "--num-classes", "3",
                            "--no-progress"], capsys)
    assert code == 0 and "5 evaluated" in said, err


@pytest.mark.slow
def test_flags_reach_the_computation(world, tmp_path, capsys):
    out = tmp_path / "pred"
    more = ["--scales", "1,0.75", "--no-flip", "--crf", "psa", "--class-threshold", "0.2", "--batch-size", "2"]
    code, _, err = _run(world.argv(out, *more), capsys)
    assert code == 0, err
    for stem in world.stems:
        want = _reference_labels(world.ck, "student", world.images / f"{stem}.png", scales=(1.0, 0.75), flip=False,
                                 crf="psa", class_threshold=0.2)
        assert torch.equal(_read(out / f"{stem}.png"), want), stem


@pytest.mark.slow
def test_a_rerun_keeps_finished_files_and_refuses_other_settings(world, tmp_path, capsys):
    out = tmp_path / "pred"
    assert _run(world.argv(out, "--crf", "none"), capsys)[0] == 0
    times = {p.name: p.stat().st_mtime_ns for p in out.glob("*.png")}
    code, said, _ = _run(world.argv(out, "--crf", "none"), capsys)
    assert code == 0 and said.strip() == f"predictions -> {out}: 0 written, 5 already done, 0 skipped"
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*.png")} == times
    (out / "im3.png").unlink()  # a run killed before im3
    code, said, _ = _run(world.argv(out, "--crf", "none"), capsys)
    assert code == 0 and said.strip() == f"predictions -> {out}: 1 written, 4 already done, 0 skipped"
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*.png") if p.name != "im3.png"} == \
        {k: v for k, v in times.items() if k != "im3.png"}
    code, _, err = _run(world.argv(out, "--crf", "mars"), capsys)  # other settings into the same folder
    assert code == 2 and err.count("\n") == 1 and "other settings" in err and "crf" in err, err


def _corrupt(world, tmp_path):
    import shutil

    images = shutil.copytree(world.images, tmp_path / "images")
    (images / "im2.png").write_bytes(b"\x89PNG\r\n\x1a\n but no image")
    return images


def test_a_corrupt_image_stops_with_its_name(world, tmp_path, capsys):
    out = tmp_path / "pred"
    code, _, err = _run(world.argv(out, "--crf", "none", images=_corrupt(world, tmp_path)), capsys)
    assert code == 2 and err.count("\n") == 1 and err.startswith("mars predict: error: im2: "), err
    assert "im2.png" in err and not (out / "im2.png").exists()


def test_a_corrupt_image_is_skipped_and_named(world, tmp_path, capsys):
    out = tmp_path / "pred"
    code, said, err = _run(world.argv(out, "--crf", "none", "--on-error", "skip",
                                      images=_corrupt(world, tmp_path)), capsys)
    assert code == 1 and "4 written, 1 skipped" in said
    assert re.search(r"^  im2: .*im2\.png", err, re.M), err
    assert sorted(p.stem for p in out.glob("*.png")) == ["im0", "im1", "im3", "im4"]


@pytest.mark.parametrize("more,flag", [
    (["--scales", "0"], "--scales"), (["--scales", "1,x"], "--scales"), (["--scales", "1,9"], "--scales"),
    (["--batch-size", "0"], "--batch-size"), (["--class-threshold", "1.5"], "--class-threshold"),
    (["--class-threshold", "nan"], "--class-threshold"), (["--crf", "dense"], "--crf"), (["--which", "ema"], "--which"),
    (["--on-error", "ignore"], "--on-error"), (["--device", "cuda:7"], "--device"), (["--device", "gpu"], "--device"),
    (["--root", "."], "--root"), (["--method", "MARS"], "--method"), (["--domain", "val"], "--domain"),
])
def test_bad_flags_are_one_line_naming_the_flag(world, tmp_path, capsys, more, flag):
    if flag == "--device" and torch.cuda.is_available():
        pytest.skip("a machine with CUDA")
    code, _, err = _run(world.argv(tmp_path / "pred", *more), capsys)
    last = err.strip().splitlines()[-1]
    assert code == 2 and flag in last and "Traceback" not in err, err
    assert not (tmp_path / "pred").exists() or not any((tmp_path / "pred").glob("*.png"))


def test_images_without_out_is_one_line(world, capsys):
    code, _, err = _run(["predict", "--model", str(world.ck), "--images", str(world.images)], capsys)
    assert code == 2 and err.count("\n") == 1 and "--out" in err, err


def _not_a_checkpoint(kind: str, path: Path) -> Path:
    if kind == "bytes":
        path.write_bytes(os.urandom(256))
    elif kind == "state_dict":  # ImageNet backbone weights given as --model
        torch.save({"conv1.weight": torch.zeros(2, 3, 1, 1)}, path)
    elif kind == "pickle":
        import pickle

        path.write_bytes(pickle.dumps({"format": "mars-train/1", "model": World}))
    elif kind == "missing":
        pass
    return path


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
@pytest.mark.parametrize("kind,says", [("bytes", "not a readable mars train checkpoint"),
                                       ("state_dict", "not a mars train checkpoint"),
                                       ("pickle", "not a readable mars train checkpoint"),
                                       ("missing", "no such file")])
def test_a_file_that_is_no_checkpoint_is_one_line(world, tmp_path, capsys, kind, says):
    bad = _not_a_checkpoint(kind, tmp_path / "bad.pt")
    code, _, err = _run(world.argv(tmp_path / "pred", model=bad), capsys)
    assert code == 2 and err.count("\n") == 1 and err.startswith(f"mars predict: error: --model {bad}"), err
    assert says in err and not (tmp_path / "pred").exists()


def test_a_ce_checkpoint_has_no_teacher(world, tmp_path, capsys):
    code, _, err = _run(world.argv(tmp_path / "pred", "--which", "teacher", model=world.ce), capsys)
    assert code == 2 and err.count("\n") == 1 and "holds no teacher" in err and "--which student" in err, err
    assert _run(world.argv(tmp_path / "pred", "--crf", "none", model=world.ce), capsys)[0] == 0


# --------------------------------------------------------------------------------------------
# DHR's tree: <root>/WSS/<data>/<method>/<domain>/
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dhr(tmp_path_factory, world):
    root = tmp_path_factory.mktemp("dhr")
    for domain, n in (("train_aug", 3), ("validation", 2)):
        folder = root / "VOC2012" / domain / "image"
        folder.mkdir(parents=True)
        for i in range(n):
            Image.fromarray(_images(1, 24 + 8 * i, 32, seed=10 + i)[0].numpy()).save(folder / f"2007_00{i}.jpg")
    return root, _checkpoint(world.root / "voc.pt", 20, seed=3)


@pytest.mark.slow
@pytest.mark.parametrize("domain", [None, "validation"])
def test_root_and_method_write_dhr_wss_masks(dhr, capsys, domain):
    from mars_plugin.adapters.wsss.dhr import load_pseudo_labels
    from mars_plugin.adapters.wsss.dhr_layout import DHRLayout

    root, ck = dhr
    argv = ["predict", "--model", str(ck), "--root", str(root), "--method", "MARS", "--crf", "none",
            "--no-progress"] + ([] if domain is None else ["--domain", domain])
    code, said, err = _run(argv, capsys)
    assert code == 0, err
    domain = domain or "train_aug"
    layout = DHRLayout(root, "VOC2012")
    folder = layout.wss_dir("MARS", domain)
    assert folder == root / "WSS" / "VOC2012" / "MARS" / domain and f"predictions -> {folder}:" in said
    ids = sorted(layout.ids(domain, tagged_only=False))
    masks = dict(load_pseudo_labels(folder, ids=ids))  # how DHR's adapter reads --wss masks
    assert sorted(masks) == ids
    for i in ids:
        image = layout.image_dir(domain) / f"{i}.jpg"
        assert torch.equal(masks[i], _reference_labels(ck, "student", image, crf="none"))
        assert _read(folder / f"{i}.png").shape == masks[i].shape


def test_method_refuses_a_network_of_other_classes_than_the_dataset(dhr, world, capsys):
    root, _ = dhr
    code, _, err = _run(["predict", "--model", str(world.ck), "--root", str(root), "--method", "MARS3",
                         "--no-progress"], capsys)
    assert code == 2 and err.count("\n") == 1 and "--model" in err and "3 classes" in err, err
    assert not (root / "WSS" / "VOC2012" / "MARS3").exists()


def test_root_without_method_or_out_is_one_line(dhr, capsys):
    root, ck = dhr
    code, _, err = _run(["predict", "--model", str(ck), "--root", str(root)], capsys)
    assert code == 2 and err.count("\n") == 1 and "--method" in err and "--out" in err, err


# --------------------------------------------------------------------------------------------
# torchrun: two gloo ranks write what one process writes
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_torchrun_two_ranks_write_what_one_process_writes(world, tmp_path, capsys):
    from test_distributed import _free_port
    from test_features_distributed import _env

    one, two = tmp_path / "one", tmp_path / "two"
    # --batch-size 1: the ranks' batches differ from one process's (a conv over another batch
    # size may round differently); per image the work is the same.
    more = ["--batch-size", "1", "--threads", "1"]
    assert _run(world.argv(one, *more), capsys)[0] == 0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(_free_port()), "--tee", "3", "-m", "mars_plugin.cli", *world.argv(two, *more)]
    res = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = sorted(re.findall(r"^\[default(\d)\]:predict rank (\d)/2: (\d+) written, (\d+) skipped -> (.*)$",
                              res.stdout, re.M))
    assert lines == [("0", "0", "3", "0", str(two)), ("1", "1", "2", "0", str(two))], res.stdout
    names = sorted(p.name for p in one.iterdir() if not p.name.startswith(".mars-run"))
    assert sorted(p.name for p in two.iterdir() if not p.name.startswith(".mars-run")) == names
    for name in names:
        assert torch.equal(_read(two / name), _read(one / name)), name


def test_ctrl_c_is_one_line_and_exit_130(world, tmp_path, capsys, monkeypatch):
    import mars_plugin.commands.predict as P

    def interrupt(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(P, "predict_job", interrupt)
    code, _, err = _run(world.argv(tmp_path / "pred"), capsys)
    # stopped before its --out exists: nothing to resume, and the line says so (issue 41)
    assert code == 130 and err == "mars predict: interrupted; nothing was written\n"
