"""Memory bounded by construction (issue 30, class 10): ``mars predict`` and ``mars train`` check
their memory against one budget, ``--max-memory GIB``, before any work.

* ``mars predict``: an image whose prediction needs more than the budget is refused from its
  header alone (a 12000x12000 PNG of one colour is a small file), by name, with the numbers and
  the flag, before the network runs on any image; with ``--on-error skip`` it is skipped and
  named, and the other images are written; a larger ``--max-memory`` lets a moderate image
  through; the CRF's check takes the same budget.
* ``mars train``: a ``--crop`` / ``--batch-size`` whose step needs more is refused before step 1
  (before the network is built), naming both flags and ``--max-memory``.
* The model (:mod:`mars_plugin.networks.memory`) bounds the peak RSS growth measured in a fresh
  process (small sizes, CPU), and is not far above it (at most 4x).
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from mars_plugin.cli import main
from mars_plugin.networks import memory
from mars_plugin.networks.memory import inference_memory_bytes, train_memory_bytes

R18 = {"arch": "deeplabv3+", "backbone": "resnet18", "output_stride": 16, "num_classes": 3}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _checkpoint(path: Path) -> Path:
    from mars_plugin.networks.deeplab import build_model
    from mars_plugin.networks.seg_checkpoint import save_checkpoint

    torch.manual_seed(0)
    save_checkpoint(path, {"model": dict(R18), "iteration": 1,
                           "student": build_model("deeplabv3+", "resnet18", 3, 16).state_dict(), "teacher": None})
    return path


def _image(path: Path, h: int, w: int, colour=(90, 140, 200)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (w, h), colour).save(path, compress_level=1)
    return path


@pytest.fixture(scope="module")
def huge(tmp_path_factory):
    """A 12000x12000 PNG of one colour: 2 MB on disk, 432 MB of RGB, far more to predict."""
    path = _image(tmp_path_factory.mktemp("huge") / "huge.png", 12000, 12000)
    assert path.stat().st_size < 4 << 20
    return path


@pytest.fixture
def folder(tmp_path, huge):
    """Two small images and the 12000x12000 one."""
    images = tmp_path / "images"
    _image(images / "a.png", 40, 48)
    _image(images / "b.png", 48, 40, (10, 200, 30))
    os.symlink(huge, images / "huge.png")
    return tmp_path, images, _checkpoint(tmp_path / "net.pt")


def _no_forward(monkeypatch, allowed=()):
    """Fail the test if the network runs on an image of a side not in ``allowed``."""
    from mars_plugin.networks import deeplab

    real = deeplab._SegNet.forward

    def forward(self, x):
        if x.device.type == "meta":  # the memory model's trace: shapes only
            return real(self, x)
        assert max(x.shape[-2:]) < 1000, f"the network ran on a {tuple(x.shape)} input"
        assert not allowed or x.shape[-1] in allowed, f"the network ran on {tuple(x.shape)}"
        return real(self, x)

    monkeypatch.setattr(deeplab._SegNet, "forward", forward)


def _predict(images, out, ck, *extra):
    return main(["predict", "--model", str(ck), "--images", str(images), "--out", str(out), "--crf", "none",
                 "--scales", "1", "--no-progress", *extra])


@pytest.mark.slow
def test_a_huge_image_is_refused_by_name_before_any_work(folder, monkeypatch, capsys):
    root, images, ck = folder
    calls = []
    from mars_plugin.networks import deeplab

    real = deeplab._SegNet.forward
    monkeypatch.setattr(deeplab._SegNet, "forward",
                        lambda self, x: real(self, x) if x.device.type == "meta" else calls.append(x.shape) or 1 / 0)
    # the default budget (80% of this machine's memory: 720 GiB at scales 1 and 2 are beyond any)
    # and a stated one both refuse it
    for i, extra in enumerate((("--scales", "1,2"), ("--max-memory", "8"))):
        assert _predict(images, root / f"out{i}", ck, *extra) == 2
        err = capsys.readouterr().err
        assert calls == [], "the network ran before the refusal"
        assert "huge" in err and str(images / "huge.png") in err, err
        assert "12000x12000 image needs about" in err and "--max-memory" in err, err
        assert len(err.strip().splitlines()) == 1, err
    assert "more than --max-memory 8.00 GiB" in err, err
    assert not list(root.glob("out*/*.png"))


def test_skip_names_the_huge_image_and_writes_the_others(folder, monkeypatch, capsys):
    root, images, ck = folder
    _no_forward(monkeypatch)
    assert _predict(images, root / "out", ck, "--max-memory", "2", "--on-error", "skip") == 1
    err = capsys.readouterr().err
    assert sorted(p.name for p in (root / "out").glob("*.png")) == ["a.png", "b.png"]
    assert "huge" in err and "needs about" in err and "--max-memory 2.00 GiB" in err, err


@pytest.mark.slow
def test_max_memory_lets_a_moderate_image_through(tmp_path, monkeypatch, capsys):
    images = tmp_path / "images"
    _image(images / "m.png", 300, 400)
    ck = _checkpoint(tmp_path / "net.pt")
    need = inference_memory_bytes(R18, 300, 400, scales=(1.0,))
    small = f"{need * 0.9 / 2 ** 30:.3f}"
    assert _predict(images, tmp_path / "out", ck, "--max-memory", small) == 2
    err = capsys.readouterr().err
    assert "300x400 image needs about" in err and f"--max-memory {float(small):.2f} GiB" in err, err
    assert "at most about" in err, err  # the size that fits
    assert _predict(images, tmp_path / "out", ck, "--max-memory", f"{need * 1.1 / 2 ** 30:.3f}") == 0
    assert Image.open(tmp_path / "out" / "m.png").size == (400, 300)


def test_the_crf_takes_the_same_budget(tmp_path, monkeypatch):
    """One flag: the CRF's max_bytes in predict is --max-memory, and its memory is in the model."""
    from mars_plugin.networks import inference

    images = tmp_path / "images"
    _image(images / "m.png", 30, 40)
    ck = _checkpoint(tmp_path / "net.pt")
    seen = []
    real = inference.dense_crf
    monkeypatch.setattr(inference, "dense_crf", lambda *a, **k: seen.append(k.get("max_bytes")) or real(*a, **k))
    assert main(["predict", "--model", str(ck), "--images", str(images), "--out", str(tmp_path / "out"), "--crf",
                 "mars", "--scales", "1", "--no-progress", "--max-memory", "1.5"]) == 0
    assert seen == [int(1.5 * 2 ** 30)]
    many = dict(R18, num_classes=60)  # where the CRF, not the network, makes the peak
    assert inference_memory_bytes(many, 300, 400, flip=False, crf_labels=61, crf_params="mars") > \
        inference_memory_bytes(many, 300, 400, flip=False)


def test_a_batch_holds_only_what_fits(tmp_path, monkeypatch):
    """Four images of one size with --batch-size 4 under a budget for two: batches of at most two."""
    from mars_plugin.networks import deeplab

    images = tmp_path / "images"
    for i in range(4):
        _image(images / f"{i}.png", 64, 64, (i * 40, 100, 50))
    ck = _checkpoint(tmp_path / "net.pt")
    two = inference_memory_bytes(R18, 64, 64, scales=(1.0,), batch=2)
    assert inference_memory_bytes(R18, 64, 64, scales=(1.0,), batch=4) > two
    seen = []
    real = deeplab._SegNet.forward

    def forward(self, x):
        if x.device.type != "meta":
            seen.append(x.shape[0])
        return real(self, x)

    monkeypatch.setattr(deeplab._SegNet, "forward", forward)
    assert _predict(images, tmp_path / "out", ck, "--batch-size", "4", "--max-memory", f"{two / 2 ** 30:.6f}") == 0
    assert seen and max(seen) <= 4, seen  # 2 images and their mirrors
    assert len(list((tmp_path / "out").glob("*.png"))) == 4


@pytest.mark.slow
def test_train_refuses_a_step_over_the_budget_before_step_1(tmp_path, monkeypatch, capsys):
    from mars_plugin.networks import deeplab

    images, labels = tmp_path / "images", tmp_path / "labels"
    for i in range(2):
        _image(images / f"{i}.png", 40, 40)
        labels.mkdir(exist_ok=True)
        Image.fromarray(np.zeros((40, 40), np.uint8)).save(labels / f"{i}.png")
    real = deeplab.build_model

    def build(*a, **k):  # the memory model builds it on the meta device (no memory): only that
        if torch.empty(0).device.type != "meta":
            pytest.fail("built the network")
        return real(*a, **k)

    monkeypatch.setattr(deeplab, "build_model", build)
    base = ["train", "--images", str(images), "--labels", str(labels), "--out", str(tmp_path / "run"),
            "--num-classes", "3", "--arch", "deeplabv3+", "--output-stride", "16", "--backbone", "resnet18", "--loss", "ce", "--iterations", "1", "--workers", "0",
            "--no-progress", "--device", "cpu"]
    # the default budget (80% of this machine's memory; ResNet-101 at 4096 x 16 needs terabytes)
    assert main(base + ["--backbone", "resnet101", "--crop", "4096", "--batch-size", "16"]) == 2
    err = capsys.readouterr().err
    assert "--crop 4096 --batch-size 16" in err and "resnet101" in err and "--max-memory" in err, err
    # the case on its 24 GB machine
    assert main(base + ["--backbone", "resnet101", "--crop", "2048", "--batch-size", "4", "--max-memory", "22"]) == 2
    err = capsys.readouterr().err
    assert "--crop 2048 --batch-size 4" in err and "needs about" in err and "--max-memory 22.00 GiB" in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "run").exists()
    need = train_memory_bytes(R18, 256, 4, loss="ce", refine=None)
    budget = f"{need * 0.8 / 2 ** 30:.4f}"
    assert main(base + ["--crop", "256", "--batch-size", "4", "--max-memory", budget]) == 2
    err = capsys.readouterr().err
    assert "--crop 256 --batch-size 4" in err and f"more than --max-memory {float(budget):.2f} GiB" in err, err
    assert "--batch-size 3 or --crop 224 fits" in err or " fits; " in err, err


@pytest.mark.slow
def test_train_under_the_budget_runs(tmp_path):
    from mars_plugin.commands.train import train

    images, labels = tmp_path / "images", tmp_path / "labels"
    for i in range(2):
        _image(images / f"{i}.png", 40, 40)
        labels.mkdir(exist_ok=True)
        label = np.eye(40, dtype=np.uint8)
        label[:5, 20:] = 254  # debiased labels: --loss mars refuses labels without a biased pixel
        Image.fromarray(label).save(labels / f"{i}.png")
    need = train_memory_bytes(R18, 32, 2, loss="mars")
    kw = dict(arch="deeplabv3+", output_stride=16, backbone="resnet18", iterations=1, batch_size=2, crop=32, min_size=32, max_size=48, workers=0,
              device="cpu", progress=False)
    with pytest.raises(ValueError, match="--crop 32 --batch-size 2: .* more than --max-memory"):
        train(images, labels, tmp_path / "run", 3, max_bytes=need - 1, **kw)
    assert train(images, labels, tmp_path / "run", 3, max_bytes=need, **kw)["iterations"] == 1


# ---------------------------------------------------------------------------------- the model bounds peak memory
_MEASURE = textwrap.dedent("""
    import json, sys, torch
    torch.set_num_threads(1)
    from mars_plugin.networks.deeplab import build_model
    from mars_plugin.networks.inference import multiscale_probs

    def status(key):  # kB in /proc/self/status
        return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(key + ":")) * 1024

    cfg, H, W, scales = json.loads(sys.argv[1])
    torch.manual_seed(0)
    m = build_model(cfg["arch"], cfg["backbone"], cfg["num_classes"], cfg["output_stride"]).eval()
    multiscale_probs(m, torch.randn(1, 3, 40, 40), (1.0,), True)  # load the kernels' code first
    x = torch.randn(1, 3, H, W)
    with open("/proc/self/clear_refs", "w") as f:  # reset the peak RSS (VmHWM) to the current RSS
        f.write("5")
    before = status("VmRSS")
    multiscale_probs(m, x, scales, True).argmax(1)
    print(status("VmHWM") - before)
""")


@pytest.mark.parametrize("cfg,H,W,scales", [
    ({"arch": "deeplabv3+", "backbone": "resnet18", "output_stride": 16, "num_classes": 4}, 256, 192, [1.0, 0.5, 1.5]),
    ({"arch": "deeplabv2", "backbone": "resnet50", "output_stride": 8, "num_classes": 4}, 256, 192, [1.0, 0.5, 1.5]),
    ({"arch": "deeplabv3+", "backbone": "resnet50", "output_stride": 16, "num_classes": 20}, 240, 320, [1.0]),
])
@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="measures peak RSS with Linux's /proc")
def test_the_model_bounds_the_measured_peak(cfg, H, W, scales):
    """Peak RSS growth (Linux's VmHWM, reset first: ru_maxrss would start at the parent's peak)
    of multi-scale + flip inference in a fresh process (the weights already resident) against
    the model less the weights' share: at most the model, at least a quarter."""
    import json

    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", _MEASURE, json.dumps([cfg, H, W, scales])], capture_output=True,
                         text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr
    grow = int(out.stdout.split()[-1])
    model = inference_memory_bytes(cfg, H, W, scales=scales, flip=True)
    model -= memory._slack("cpu") * memory._weights(memory._key(cfg))[0]
    assert grow <= model <= 4 * grow, (grow / 2 ** 20, model / 2 ** 20)


@pytest.mark.slow
def test_the_model_grows_with_every_setting():
    """More pixels, scales, batch, classes, a deeper backbone, a finer stride: more memory;
    half precision: less. A check that the trace sees each architecture."""
    base = inference_memory_bytes(R18, 200, 200)
    assert inference_memory_bytes(R18, 400, 400) > 1.5 * base  # the weights are the same
    assert inference_memory_bytes(R18, 200, 200, scales=(1.0, 2.0)) > base
    assert inference_memory_bytes(R18, 200, 200, batch=2) > base
    assert inference_memory_bytes(dict(R18, num_classes=20), 200, 200) > base
    assert inference_memory_bytes(dict(R18, backbone="resnet50"), 200, 200) > base
    assert inference_memory_bytes(dict(R18, output_stride=8), 200, 200) > base
    assert inference_memory_bytes(dict(R18, arch="deeplabv2", backbone="resnet50", output_stride=8), 200, 200) != \
        inference_memory_bytes(dict(R18, backbone="resnet50", output_stride=8), 200, 200)
    t = train_memory_bytes(R18, 256, 4, loss="ce", refine=None)
    assert train_memory_bytes(R18, 256, 4, loss="mars", refine=None) > t  # the teacher
    assert train_memory_bytes(R18, 256, 4, loss="mars", refine="crf") > train_memory_bytes(R18, 256, 4, loss="mars",
                                                                                            refine=None)
    assert train_memory_bytes(R18, 256, 8, loss="ce", refine=None) > t
    assert train_memory_bytes(R18, 256, 4, loss="ce", refine=None, amp=True) < t


def test_debias_takes_the_same_flag_for_its_crf(tmp_path, capsys):
    """``mars debias --max-memory`` is the CRF's max_bytes: an image over it is refused naming the flag."""
    from mars_plugin.worlds.synthetic import write_world
    from mars_plugin.worlds.synthetic_scenes import make_world

    root = tmp_path / "world"
    write_world(make_world(4, size=32, dim=16, seed=3), root)
    common = ["--features", str(root / "features"), "--labels", str(root / "labels"), "--no-progress"]
    assert main(["centroids", *common, "--num-classes", "6", "--out", str(tmp_path / "V.pt")]) == 0
    debias = ["debias", *common, "--centroids", str(tmp_path / "V.pt"), "--images", str(root / "images")]
    assert main([*debias, "--out", str(tmp_path / "small"), "--max-memory", "0.0001"]) == 2  # about 100 KB
    err = capsys.readouterr().err
    assert "needs about" in err and "more than --max-memory = 0.00 GiB" in err and "larger --max-memory GIB" in err, err
    assert main([*debias, "--out", str(tmp_path / "db"), "--max-memory", "1"]) == 0
    assert len(list((tmp_path / "db").glob("*.png"))) == 4
