"""features_job and `mars features`: images -> <stem>.npy -> select_centroids, resume, errors,
sizes, ModelExtractor, the command-line functions."""
import argparse
import os

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image

from mars_plugin import select_centroids
from mars_plugin.adapters.uss.extractor import FeatureExtractor, ModelExtractor, imagenet_preprocess
from mars_plugin.commands.features import add_features_arguments, features_job, run_features
from mars_plugin.adapters.uss.stego import STEGOExtractor
from mars_plugin.formats.files import read_features
from mars_plugin.runs.errors import JobError

from test_leopart import leopart_net, prefixed
from test_stego import FakeDictConfig, lightning_ckpt, stego_state_dict

SIZES = {"a": (40, 56), "b": (40, 56), "c": (48, 32), "d": (40, 56), "e": (33, 45)}


def write_images(folder, sizes=SIZES, seed=0):
    """Two-region images (left red-ish, right blue-ish) with matching pseudo labels."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    labels = {}
    for i, (stem, (h, w)) in enumerate(sizes.items()):
        img = rng.integers(0, 40, (h, w, 3)).astype(np.uint8)
        img[:, : w // 2, 0] += 200
        img[:, w // 2 :, 2] += 200
        Image.fromarray(img).save(folder / (f"{stem}.png" if i % 2 else f"{stem}.jpg"), quality=95)
        lab = np.zeros((h, w), dtype=np.int64)
        lab[:, : w // 2] = 1 + i % 2
        labels[stem] = torch.from_numpy(lab)
    return labels


@pytest.fixture(scope="module")
def stego():
    return STEGOExtractor.from_state_dict(stego_state_dict(), res=32)


@pytest.fixture()
def images(tmp_path):
    return tmp_path / "images", write_images(tmp_path / "images")


def test_stego_folder_to_centroids(tmp_path, images, stego):
    img_dir, labels = images
    out = tmp_path / "features"
    s = features_job(stego, img_dir, out, batch_size=2, progress=False)
    assert (s.done, s.existing, s.failed) == (5, 0, [])
    assert sorted(p for p in os.listdir(out) if not p.startswith(".mars-run")) == [f"{k}.npy" for k in sorted(SIZES)]
    for stem, (h, w) in SIZES.items():
        arr = np.load(out / f"{stem}.npy", allow_pickle=False)
        assert arr.dtype == np.float16 and arr.shape == (16, *stego.grid_size(h, w))
    assert np.load(out / "a.npy").shape == (16, 4, 6) and np.load(out / "c.npy").shape == (16, 6, 4)
    # the written features feed the MARS core directly
    pairs = [(read_features(out / f"{stem}.npy"), labels[stem]) for stem in sorted(SIZES)]
    V = select_centroids(pairs, num_classes=2, k_fg=1, k_bg=1)
    assert V.num_images == 5 and bool(V.valid[1]) and bool(V.valid[2]) and V.centroids.shape == (3, 16)


def test_batching_does_not_change_the_features(tmp_path, images, stego):
    img_dir, _ = images
    features_job(stego, img_dir, tmp_path / "b1", batch_size=1, progress=False)
    features_job(stego, img_dir, tmp_path / "b3", batch_size=3, progress=False)
    for stem in SIZES:
        a = np.load(tmp_path / "b1" / f"{stem}.npy").astype(np.float32)
        b = np.load(tmp_path / "b3" / f"{stem}.npy").astype(np.float32)
        np.testing.assert_allclose(a, b, atol=2e-3)
    # one image by hand
    rgb = torch.from_numpy(np.array(Image.open(img_dir / "b.png").convert("RGB"))).permute(2, 0, 1)
    ref = stego(rgb[None])[0].numpy().astype(np.float16)
    np.testing.assert_array_equal(np.load(tmp_path / "b1" / "b.npy"), ref)


def test_resume_skips_existing_files(tmp_path, images, stego):
    img_dir, _ = images
    out = tmp_path / "features"
    features_job(stego, img_dir, out, progress=False)
    before = {p: os.stat(out / p).st_mtime_ns for p in os.listdir(out)}
    want_d = np.load(out / "d.npy")
    os.remove(out / "c.npy")
    (out / "d.npy").write_bytes(b"sentinel")  # an output changed since it was recorded: computed again
    s = features_job(stego, img_dir, out, progress=False)
    assert (s.done, s.existing, s.redone) == (2, 3, 1)
    np.testing.assert_allclose(np.load(out / "d.npy"), want_d, atol=1e-3)  # batched with others: rounding
    assert os.stat(out / "a.npy").st_mtime_ns == before["a.npy"]
    assert np.load(out / "c.npy").shape == (16, 6, 4)
    assert not [p for p in os.listdir(out) if p.startswith(".tmp")]


def _truncated_png() -> bytes:
    import io

    buf = io.BytesIO()
    Image.fromarray(np.full((40, 56, 3), 90, np.uint8)).save(buf, format="PNG")
    return buf.getvalue()[:60]  # a valid header, the pixels cut off


BAD_IMAGES = {
    "not-a-jpeg": ("broken.jpg", lambda: b"\xff\xd8 not really a jpeg"),
    "empty": ("broken.png", lambda: b""),
    "truncated": ("broken.png", _truncated_png),
    "decompression-bomb": ("broken.png", lambda: __import__("test_cli_errors").bomb_png()),
}


@pytest.mark.parametrize("kind", sorted(BAD_IMAGES))
def test_bad_image_stop_and_skip(tmp_path, images, stego, kind):
    """`mars features` keeps the --on-error contract: stop names the file, skip names and counts
    it and writes every other image."""
    img_dir, _ = images
    name, data = BAD_IMAGES[kind]
    (img_dir / name).write_bytes(data())
    with pytest.raises(JobError, match=rf"broken: .*{name.replace('.', '[.]')}"):
        features_job(stego, img_dir, tmp_path / "stop", progress=False)
    s = features_job(stego, img_dir, tmp_path / "skip", on_error="skip", progress=False)
    assert s.done == 5 and [stem for stem, _ in s.failed] == ["broken"], s.failed
    assert not (tmp_path / "skip" / "broken.npy").exists() and (tmp_path / "skip" / "e.npy").is_file()


def test_two_images_with_one_stem(tmp_path, images, stego):
    img_dir, _ = images
    Image.new("RGB", (8, 8)).save(img_dir / "a.png")
    with pytest.raises(JobError, match=r"a: several images share this stem \(a.jpg, a.png\)"):
        features_job(stego, img_dir, tmp_path / "x", progress=False)
    s = features_job(stego, img_dir, tmp_path / "y", on_error="skip", progress=False)
    assert s.done == 4 and s.failed[0][0] == "a"


def test_output_size_image_and_stride(tmp_path, images, stego):
    img_dir, _ = images
    features_job(stego, img_dir, tmp_path / "full", output_size="image", progress=False)
    features_job(stego, img_dir, tmp_path / "s4", stride=4, progress=False)
    features_job(stego, img_dir, tmp_path / "fixed", output_size=(10, 12), progress=False)
    for stem, (h, w) in SIZES.items():
        assert np.load(tmp_path / "full" / f"{stem}.npy").shape == (16, h, w)
        assert np.load(tmp_path / "s4" / f"{stem}.npy").shape == (16, -(-h // 4), -(-w // 4))
        assert np.load(tmp_path / "fixed" / f"{stem}.npy").shape == (16, 10, 12)
    with pytest.raises(ValueError, match="either output_size or stride"):
        features_job(stego, img_dir, tmp_path / "z", output_size="image", stride=2, progress=False)
    with pytest.raises(ValueError, match="output_size"):
        features_job(stego, img_dir, tmp_path / "z", output_size="grid", progress=False)


def test_fp16_autocast_close_to_fp32(tmp_path, images, stego):
    img_dir, _ = images
    features_job(stego, img_dir, tmp_path / "f32", progress=False)
    features_job(stego, img_dir, tmp_path / "f16", fp16=True, progress=False)
    a = np.load(tmp_path / "f32" / "a.npy").astype(np.float32)
    b = np.load(tmp_path / "f16" / "a.npy").astype(np.float32)
    assert np.abs(a - b).max() < 0.05


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 5, 4, stride=4)

    def forward(self, x):
        return {"tokens": self.conv(x).flatten(2).transpose(1, 2), "hw": self.conv(x).shape[-2:]}


def test_model_extractor_with_a_toy_model(tmp_path, images):
    img_dir, _ = images
    torch.manual_seed(0)
    toy = Toy()
    ex = ModelExtractor(toy, lambda out: out["tokens"].transpose(1, 2).unflatten(2, tuple(out["hw"])),
                        preprocess=imagenet_preprocess(32))
    assert isinstance(ex, FeatureExtractor)
    img = torch.randint(0, 256, (2, 3, 40, 56), dtype=torch.uint8)
    x = F.interpolate(img.float() / 255, size=(32, 32), mode="bilinear", align_corners=False, antialias=True)
    x = (x - torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)) / torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    with torch.no_grad():
        torch.testing.assert_close(ex(img), toy.conv(x))
    s = features_job(ex, img_dir, tmp_path / "toy", stride=8, progress=False)
    assert s.done == 5 and np.load(tmp_path / "toy" / "e.npy").shape == (5, 5, 6)
    bad = ModelExtractor(toy, lambda out: out["tokens"])
    with pytest.raises(ValueError, match=r"\(B, D, h, w\)"):
        bad(img)
    with pytest.raises(TypeError):
        ModelExtractor(lambda x: x)


def test_plain_callable_extractor(tmp_path, images):
    img_dir, _ = images

    def mean_color(images, output_size=None):
        f = images.float().mean(dim=(2, 3), keepdim=True)
        return f.expand(-1, -1, *(output_size or (1, 1)))

    s = features_job(mean_color, img_dir, tmp_path / "mc", batch_size=4, progress=False)
    assert s.done == 5 and np.load(tmp_path / "mc" / "b.npy").shape == (3, 1, 1)


def test_non_finite_float16_is_an_error(tmp_path, images):
    img_dir, _ = images

    def huge(images, output_size=None):
        return torch.full((images.shape[0], 2, 1, 1), 1e6)

    with pytest.raises(JobError, match="not finite in float16"):
        features_job(huge, img_dir, tmp_path / "h", progress=False)


def parse(argv):
    p = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_features_arguments(p)
    return p, p.parse_args(argv)


def test_cli_stego_needs_trust_then_writes(tmp_path, images, capsys):
    img_dir, _ = images
    ckpt = tmp_path / "cocostuff27_vit_base_5.ckpt"
    torch.save(lightning_ckpt(stego_state_dict(), {"n_classes": 27, "cfg": FakeDictConfig(dim=16)}), ckpt)
    base = ["--uss", "stego", "--checkpoint", str(ckpt), "--images", str(img_dir), "--out", str(tmp_path / "f"),
            "--res", "32", "--no-progress"]
    _, args = parse(base)
    with pytest.raises(PermissionError, match="--trust-pickle"):
        run_features(args)
    _, args = parse(base + ["--trust-pickle", "--batch-size", "3", "--stride", "8"])
    s = run_features(args)
    assert s.done == 5 and np.load(tmp_path / "f" / "a.npy").shape == (16, 5, 7)
    assert "STEGO on DINO ViT-S/8" in capsys.readouterr().out
    _, args = parse(base + ["--trust-pickle", "--no-flip", "--no-normalize", "--interpolation", "bilinear",
                            "--batch-size", "3", "--stride", "8"])
    # Other flags into the same --out would mix two models' features: refused, naming them.
    with pytest.raises(JobError, match=r"other settings \(model.flip: None -> False; model.interpolation"):
        run_features(args)
    _, args = parse(base + ["--trust-pickle", "--batch-size", "2", "--stride", "8"])  # batch size: same result
    s = run_features(args)
    assert (s.done, s.existing) == (0, 5)


def test_cli_leopart_and_help(tmp_path, images, capsys):
    img_dir, _ = images
    ckpt = tmp_path / "leopart_vits16.ckpt"
    torch.save(prefixed(leopart_net(hidden=32, out=24), "model."), ckpt)
    _, args = parse(["--uss", "leopart", "--checkpoint", str(ckpt), "--images", str(img_dir),
                     "--out", str(tmp_path / "lp"), "--res", "32", "--head", "--full-size", "--no-progress"])
    s = run_features(args)
    f = np.load(tmp_path / "lp" / "c.npy").astype(np.float32)
    assert s.done == 5 and f.shape == (24, 48, 32)
    np.testing.assert_allclose(np.linalg.norm(f, axis=0), 1.0, atol=5e-3)
    # Leopart takes --flip too (off by default, as its evaluation)
    _, args = parse(["--uss", "leopart", "--checkpoint", str(ckpt), "--images", str(img_dir),
                     "--out", str(tmp_path / "lp2"), "--res", "32", "--flip", "--no-progress"])
    assert run_features(args).done == 5 and "flip averaging on" in capsys.readouterr().out
    p, _ = parse(["--uss", "stego", "--checkpoint", "x", "--images", "y", "--out", "z"])
    text = p.format_help()
    for flag in ("--uss", "--checkpoint", "--device", "--batch-size", "--fp16", "--res", "--no-flip", "--head",
                 "--trust-pickle", "--stride", "--full-size", "--on-error", "--no-progress", "--normalize",
                 "--backbone", "--heads", "--scales", "--flip", "--dhr"):
        assert flag in text
    assert "default: 8" in text and "default: cpu" in text
    with pytest.raises(SystemExit):
        parse(["--uss", "stego", "--checkpoint", "x", "--images", "y", "--out", "z", "--stride", "4", "--full-size"])


def test_empty_folder_and_bad_arguments(tmp_path, stego):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no images"):
        features_job(stego, tmp_path / "empty", tmp_path / "o", progress=False)
    with pytest.raises(ValueError, match="absent: no such folder"):
        features_job(stego, tmp_path / "absent", tmp_path / "o", progress=False)
    with pytest.raises(ValueError, match="on_error"):
        features_job(stego, tmp_path / "empty", tmp_path / "o", on_error="ignore")
    with pytest.raises(ValueError, match="batch_size"):
        features_job(stego, tmp_path / "empty", tmp_path / "o", batch_size=0)


def test_mars_features_then_mars_centroids_through_the_cli(tmp_path, images, capsys):
    """`mars features` writes what `mars centroids` reads, through the real console entry point."""
    from PIL import Image as PILImage

    from mars_plugin.cli import main
    from mars_plugin.method.selection import DebiasedCentroids

    img_dir, _ = images
    ckpt = tmp_path / "leopart_vits16.ckpt"
    torch.save(prefixed(leopart_net(hidden=32, out=24), "model."), ckpt)
    assert main(["features", "--uss", "leopart", "--checkpoint", str(ckpt), "--images", str(img_dir),
                 "--out", str(tmp_path / "feats"), "--res", "32", "--head", "--no-progress"]) == 0
    labels = tmp_path / "labels"
    labels.mkdir()
    rng = np.random.default_rng(0)
    for p in sorted(img_dir.iterdir()):
        w, h = PILImage.open(p).size
        lab = rng.integers(0, 3, size=(h, w)).astype(np.uint8)
        PILImage.fromarray(lab, mode="L").save(labels / f"{p.stem}.png")
    assert main(["centroids", "--features", str(tmp_path / "feats"), "--labels", str(labels), "--num-classes", "2",
                 "--out", str(tmp_path / "V.pt"), "--no-progress"]) == 0
    V = DebiasedCentroids.load(tmp_path / "V.pt")
    assert V.dim == 24 and V.num_images == len(list(img_dir.iterdir())) and bool(V.valid[1:].all())


def test_stems_limit_the_images_and_a_missing_one_is_named(tmp_path, images, stego):
    img_dir, _ = images
    full, part = tmp_path / "full", tmp_path / "part"
    features_job(stego, img_dir, full, progress=False)
    s = features_job(stego, img_dir, part, progress=False, stems=["c", "a"])
    assert s.done == 2 and sorted(p.stem for p in part.glob("*.npy")) == ["a", "c"]
    for stem in ("a", "c"):
        assert torch.equal(read_features(part / f"{stem}.npy"), read_features(full / f"{stem}.npy"))
    s = features_job(stego, img_dir, tmp_path / "other", progress=False, stems=["b", "zz"], on_error="skip")
    assert s.done == 1 and [f for f, _ in s.failed] == ["zz"] and "no image of this id" in s.failed[0][1]
    # none of the ids asked for has an image: the wrong folder, one error before any work
    with pytest.raises(ValueError, match="none of the 1 ids asked for has an image here"):
        features_job(stego, img_dir, tmp_path / "third", progress=False, stems=["zz"])
    assert not (tmp_path / "third").exists()
    with pytest.raises(ValueError, match="not a plain file name"):
        features_job(stego, img_dir, tmp_path / "fourth", progress=False, stems=["../a"])


def test_size_batches_compute_each_item_of_a_failing_batch_alone():
    # mars features and mars predict: one bad image fails alone, the rest of its batch is written.
    from mars_plugin.runs.size_batches import SizeBatches

    calls, written, failed = [], [], []

    def compute(batch):
        calls.append(list(batch))
        if "bad" in batch:
            raise ValueError("too small")
        return [x.upper() for x in batch]

    b = SizeBatches(3, compute, lambda batch, out: written.extend(out), lambda item, e: failed.append((item, str(e))))
    for key, item in [((4, 4), "a"), ((4, 4), "bad"), ((8, 8), "c"), ((4, 4), "d"), ((8, 8), "e")]:
        b.add(key, item)
    b.flush()
    assert calls == [["a", "bad", "d"], ["a"], ["bad"], ["d"], ["c", "e"]]
    assert written == ["A", "D", "C", "E"] and failed == [("bad", "too small")]


def test_size_batches_a_failing_write_is_not_retried_per_item():
    from mars_plugin.runs.size_batches import SizeBatches

    calls = []

    def write(batch, out):
        raise OSError("disk full")

    def failed(item, e):
        pytest.fail("not an image's fault")

    b = SizeBatches(2, lambda batch: calls.append(list(batch)), write, failed)
    b.add(1, "a")
    with pytest.raises(OSError, match="disk full"):
        b.add(1, "b")
    assert calls == [["a", "b"]]
