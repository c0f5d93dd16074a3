"""The mars command line end to end on a tiny world written to a temp dir."""
import json

import numpy as np
import pytest
import torch
from PIL import Image

from mars_plugin import DebiasedCentroids, debias_labels, select_centroids
from mars_plugin.cli import main
from mars_plugin.commands.cli_parser import build_parser
from mars_plugin.formats.files import BIASED_VALUE, read_features, read_label, voc_palette
from mars_plugin.worlds.synthetic import write_world
from mars_plugin.worlds.synthetic_scenes import make_world


@pytest.fixture(scope="module")
def world_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("world")
    world = make_world(20, size=32, dim=16, seed=3)
    write_world(world, root)
    return root, world


def _centroids(root, out, extra=()):
    return main(["centroids", "--features", str(root / "features"), "--labels", str(root / "labels"),
                 "--num-classes", "6", "--out", str(out), "--no-progress", *extra])


def _copy_world(root, dest):
    """A copy of the world's input folders, to damage."""
    for sub in ("features", "labels", "images"):
        (dest / sub).mkdir(parents=True)
        for p in (root / sub).iterdir():
            (dest / sub / p.name).write_bytes(p.read_bytes())
    return dest


def _debias(root, V, out, extra=()):
    return main(["debias", "--features", str(root / "features"), "--labels", str(root / "labels"),
                 "--centroids", str(V), "--images", str(root / "images"), "--out", str(out), "--no-progress", *extra])


def test_help_lists_every_command_and_defaults(capsys):
    parser = build_parser()
    for cmd in ("demo", "centroids", "debias", "evaluate", "report"):
        with pytest.raises(SystemExit) as e:
            parser.parse_args([cmd, "--help"])
        assert e.value.code == 0
        assert "default" in capsys.readouterr().out


def test_centroids_equals_the_library_on_the_same_files(world_dir, tmp_path):
    root, world = world_dir
    assert _centroids(root, tmp_path / "V.pt") == 0
    V = DebiasedCentroids.load(tmp_path / "V.pt")
    stems = world.stems
    ref = select_centroids(((read_features(root / "features" / f"{s}.npy"),
                             read_label(root / "labels" / f"{s}.png", biased_value=None)) for s in stems), 6)
    torch.testing.assert_close(V.centroids, ref.centroids)
    assert torch.equal(V.valid, ref.valid) and V.num_images == len(stems)


def test_centroids_device_and_spill_options(world_dir, tmp_path, capsys):
    root, _ = world_dir
    assert _centroids(root, tmp_path / "a.pt") == 0
    # auto falls back to the CPU without CUDA; cpu is the default: all three files agree
    assert _centroids(root, tmp_path / "b.pt", ["--device", "cpu", "--batch-size", "3"]) == 0
    assert _centroids(root, tmp_path / "c.pt", ["--device", "auto"]) == 0
    a = DebiasedCentroids.load(tmp_path / "a.pt")
    for other in ("b.pt", "c.pt"):
        torch.testing.assert_close(DebiasedCentroids.load(tmp_path / other).centroids, a.centroids, atol=1e-6, rtol=0)
    spill = tmp_path / "spill"
    spill.mkdir()
    assert _centroids(root, tmp_path / "s.pt", ["--spill-dir", str(spill), "--spill-mb", "0"]) == 0
    torch.testing.assert_close(DebiasedCentroids.load(tmp_path / "s.pt").centroids, a.centroids, atol=1e-6, rtol=0)
    assert list(spill.iterdir()) == []
    capsys.readouterr()
    assert _centroids(root, tmp_path / "d.pt", ["--device", "gpu0"]) == 2
    assert "device must be cpu, cuda, cuda:N or auto, got 'gpu0'" in capsys.readouterr().err
    assert not (tmp_path / "d.pt").exists()
    if not torch.cuda.is_available():
        assert _centroids(root, tmp_path / "e.pt", ["--device", "cuda"]) == 2
        assert "CUDA is not available" in capsys.readouterr().err


def test_centroids_backend_option(world_dir, tmp_path, capsys, monkeypatch):
    root, _ = world_dir
    assert _centroids(root, tmp_path / "torch.pt", ["--backend", "torch"]) == 0
    ref = DebiasedCentroids.load(tmp_path / "torch.pt")
    monkeypatch.setenv("MARS_NO_NUMBA", "1")
    capsys.readouterr()
    # without numba, asking for the compiled kernel is an error, and auto falls back to torch
    assert _centroids(root, tmp_path / "none.pt", ["--backend", "compiled"]) == 2
    assert "--backend compiled needs numba" in capsys.readouterr().err
    assert not (tmp_path / "none.pt").exists()
    assert _centroids(root, tmp_path / "auto.pt") == 0
    assert torch.equal(DebiasedCentroids.load(tmp_path / "auto.pt").centroids, ref.centroids)
    monkeypatch.delenv("MARS_NO_NUMBA")
    pytest.importorskip("numba")
    assert _centroids(root, tmp_path / "compiled.pt", ["--backend", "compiled"]) == 0
    got = DebiasedCentroids.load(tmp_path / "compiled.pt")
    assert torch.equal(got.valid, ref.valid) and torch.equal(got.num_candidates, ref.num_candidates)
    torch.testing.assert_close(got.centroids, ref.centroids, atol=1e-5, rtol=0)


def test_debias_writes_voc_pngs_equal_to_the_library_and_resumes(world_dir, tmp_path):
    root, world = world_dir
    _centroids(root, tmp_path / "V.pt")
    V = DebiasedCentroids.load(tmp_path / "V.pt")
    out = tmp_path / "db"
    assert _debias(root, tmp_path / "V.pt", out, ["--refine", "threshold"]) == 0
    files = sorted(out.glob("*.png"))
    assert [f.stem for f in files] == world.stems
    saw_biased = False
    for f in files:
        with Image.open(f) as im:
            assert im.mode == "P" and im.getpalette()[: 3 * 256] == voc_palette()
            raw = np.array(im)
        feats = read_features(root / "features" / f"{f.stem}.npy")
        label = read_label(root / "labels" / f"{f.stem}.png", biased_value=None)
        classes = [int(c) for c in torch.unique(label).tolist() if 0 < c < 255]
        expected = debias_labels(feats, label, V, classes, refine="threshold")
        assert torch.equal(read_label(f), expected)
        saw_biased |= bool((raw == BIASED_VALUE).any())
        assert bool(((raw == 255) == (label.numpy() == 255)).all())
    assert saw_biased, "the biased world must produce some biased (254) pixels"

    # Resume: delete one output; only that one is written again, the others keep their mtime.
    victim = files[3]
    keep = files[5]
    mtime = keep.stat().st_mtime_ns
    victim.unlink()
    from mars_plugin.commands.debias import debias_job

    s = debias_job(root / "features", root / "labels", tmp_path / "V.pt", out, refine="threshold", progress=False)
    assert (s.done, s.existing, s.failed) == (1, len(files) - 1, [])
    assert victim.is_file() and keep.stat().st_mtime_ns == mtime
    assert not [p for p in out.iterdir() if p.name.startswith(".tmp-")]


@pytest.mark.slow
def test_two_workers_and_crf_equal_one_worker(world_dir, tmp_path):
    root, _ = world_dir
    _centroids(root, tmp_path / "V.pt")
    assert _debias(root, tmp_path / "V.pt", tmp_path / "w1", ["--workers", "1"]) == 0
    assert _debias(root, tmp_path / "V.pt", tmp_path / "w2", ["--workers", "2"]) == 0
    for f in sorted((tmp_path / "w1").glob("*.png")):
        assert np.array_equal(np.array(Image.open(f)), np.array(Image.open(tmp_path / "w2" / f.name)))


@pytest.mark.slow
def test_crf_debias_equals_the_library_for_any_batch_size_and_preset(world_dir, tmp_path):
    root, world = world_dir
    _centroids(root, tmp_path / "V.pt")
    V = DebiasedCentroids.load(tmp_path / "V.pt")
    assert _debias(root, tmp_path / "V.pt", tmp_path / "b1", ["--batch-size", "1"]) == 0
    assert _debias(root, tmp_path / "V.pt", tmp_path / "b7", ["--batch-size", "7", "--device", "auto"]) == 0
    assert _debias(root, tmp_path / "V.pt", tmp_path / "psa", ["--crf-params", "psa"]) == 0
    assert _debias(root, tmp_path / "V.pt", tmp_path / "json", ["--crf-params", '{"iterations": 3}']) == 0
    differs = 0
    for i, stem in enumerate(world.stems):
        feats = read_features(root / "features" / f"{stem}.npy")
        label = read_label(root / "labels" / f"{stem}.png", biased_value=None)
        classes = [int(c) for c in torch.unique(label).tolist() if 0 < c < 255]
        img = world.images[i]
        for out, params in (("b1", "mars"), ("b7", "mars"), ("psa", "psa"), ("json", {"iterations": 3})):
            expected = debias_labels(feats, label, V, classes, image=img, crf_params=params)
            assert torch.equal(read_label(tmp_path / out / f"{stem}.png"), expected), (out, stem)
        differs += not torch.equal(read_label(tmp_path / "psa" / f"{stem}.png"), read_label(tmp_path / "b1" / f"{stem}.png"))
    assert differs, "the two presets should not give identical labels on every image"


@pytest.mark.parametrize("bad", ["potts", '{"sigma": 2}', "{nope"])
def test_debias_bad_crf_params_is_one_clear_error(world_dir, tmp_path, capsys, bad):
    root, _ = world_dir
    _centroids(root, tmp_path / "V.pt")
    if bad == "{nope":
        with pytest.raises(SystemExit):
            _debias(root, tmp_path / "V.pt", tmp_path / "x", ["--crf-params", bad])
        assert "--crf-params" in capsys.readouterr().err
        return
    assert _debias(root, tmp_path / "V.pt", tmp_path / "x", ["--crf-params", bad]) == 2
    # the message names the flag, not the Python parameter (crf_params)
    err = capsys.readouterr().err
    assert "--crf-params" in err and "crf_params" not in err


def test_a_bad_image_in_a_crf_batch_fails_alone(world_dir, tmp_path, capsys):
    root, world = world_dir
    bad = _copy_world(root, tmp_path / "bad")
    small = world.stems[4]
    img_path = next((bad / "images").glob(f"{small}.*"))
    with Image.open(img_path) as im:
        im.crop((0, 0, 20, 32)).save(img_path)
    _centroids(root, tmp_path / "V.pt")
    assert _debias(bad, tmp_path / "V.pt", tmp_path / "skip", ["--on-error", "skip", "--batch-size", "8"]) == 1
    err = capsys.readouterr().err  # skipped files are listed on stderr
    assert small in err and "differ in size" in err
    assert {p.stem for p in (tmp_path / "skip").glob("*.png")} == set(world.stems) - {small}


def test_corrupt_png_and_missing_features_are_named_and_on_error_decides(world_dir, tmp_path, capsys):
    root, world = world_dir
    bad = _copy_world(root, tmp_path / "bad")
    broken, orphan = world.stems[2], world.stems[7]
    (bad / "labels" / f"{broken}.png").write_bytes(b"not a png at all")
    (bad / "features" / f"{orphan}.npy").unlink()
    _centroids(root, tmp_path / "V.pt")

    assert _debias(bad, tmp_path / "V.pt", tmp_path / "stop") == 2
    err = capsys.readouterr().err
    assert broken in err and "error" in err

    assert _debias(bad, tmp_path / "V.pt", tmp_path / "skip", ["--on-error", "skip"]) == 1
    err = capsys.readouterr().err  # skipped files are listed on stderr
    assert broken in err and orphan in err and f"{orphan}.npy" in err
    written = {p.stem for p in (tmp_path / "skip").glob("*.png")}
    assert written == set(world.stems) - {broken, orphan}

    assert _centroids(bad, tmp_path / "V2.pt") == 2
    assert _centroids(bad, tmp_path / "V3.pt", ["--on-error", "skip"]) == 1
    assert DebiasedCentroids.load(tmp_path / "V3.pt").num_images == len(world.stems) - 2


def test_evaluate_equals_a_hand_computed_confusion_matrix(world_dir, tmp_path, capsys):
    root, world = world_dir
    assert main(["evaluate", "--pred", str(root / "labels"), "--gt", str(root / "gt"), "--num-classes", "6",
                 "--json", str(tmp_path / "s.json"), "--no-progress",
                 "--class-names", str(root / "classes.json")]) == 0
    table = capsys.readouterr().out
    got = json.loads((tmp_path / "s.json").read_text())
    # By hand: the world's own tensors; pseudo 255 counts as "no class", never as a prediction.
    n = 6 + 1
    cm = np.zeros((n, n + 1), dtype=np.int64)
    for i in range(len(world.stems)):
        g = world.gt[i].numpy().ravel()
        p = world.pseudo[i].numpy().ravel()
        for gv, pv in zip(g, p):
            cm[gv, pv if pv <= 6 else n] += 1
    assert got["confusion"] == cm.tolist()
    tp = np.diag(cm[:, :n])
    T, P = cm.sum(1), cm[:, :n].sum(0)
    for c in range(n):
        assert got["iou"][c] == pytest.approx(tp[c] / (T[c] + P[c] - tp[c]))
        assert got["fp"][c] == pytest.approx((P[c] - tp[c]) / (T[c] + P[c] - tp[c]))
        assert got["fn"][c] == pytest.approx((T[c] - tp[c]) / (T[c] + P[c] - tp[c]))
    assert "boat" in table and "mIoU" in table


@pytest.mark.slow
def test_report_ranks_the_problematic_classes_first(tmp_path):
    # The demo's image size: at 32 px the (now larger) birds span one or two 4x4 feature cells,
    # mixed with the sky, and a threshold-refined report rightly removes many of their pixels.
    root = tmp_path / "world64"
    world = make_world(20, size=64, dim=16, seed=3)
    write_world(world, root)
    _centroids(root, tmp_path / "V.pt")
    _debias(root, tmp_path / "V.pt", tmp_path / "db", ["--refine", "threshold"])
    assert main(["report", "--labels", str(root / "labels"), "--debiased", str(tmp_path / "db"), "--images",
                 str(root / "images"), "--out", str(tmp_path / "rep"), "--class-names", str(root / "classes.json"),
                 "--no-progress"]) == 0
    rep = json.loads((tmp_path / "rep" / "report.json").read_text())
    present = [world.class_names[c] for c in world.problematic if world.class_names[c] in rep["classes"]]
    assert present and set(rep["ranking"][: len(present)]) == set(present)
    for name in ("biased_share.png", "most_changed.png"):
        with Image.open(tmp_path / "rep" / name) as im:
            assert im.size[0] > 100 and im.size[1] > 100


def test_tiny_demo_writes_everything_and_its_world_feeds_the_commands(tmp_path):
    from mars_plugin.commands.demo import run_demo

    out = tmp_path / "demo"
    m = run_demo(out=str(out), num_train=16, num_val=6, size=32, epochs=1, refine="threshold", progress=False)
    for name in ("metrics.json", "iou_per_class.png", "overlays.png", "centroids.pt"):
        assert (out / name).is_file()
    saved = json.loads((out / "metrics.json").read_text())
    assert set(saved["scores"]) == {"(a) WSSS pseudo", "(b) debiased", "(c) plain CE", "(d) MARS"}
    assert saved["scores"] == json.loads(json.dumps(m["scores"]))
    w = out / "world"  # written split: world/train (centroids, training) and world/val (the table)
    assert _centroids(w / "train", tmp_path / "V.pt") == 0
    assert _debias(w / "val", tmp_path / "V.pt", tmp_path / "db", ["--refine", "threshold"]) == 0
    assert main(["evaluate", "--pred", str(tmp_path / "db"), "--gt", str(w / "val" / "gt"), "--num-classes", "6",
                 "--no-progress"]) == 0


def test_wsss_irnet_folders_through_the_cli(world_dir, tmp_path, capsys):
    """--wsss irnet: L-mode labels with _palette.png siblings, pickled cls_labels.npy (opt-in)."""
    root, world = world_dir
    wl = tmp_path / "irnet"
    (wl / "ir_label").mkdir(parents=True)
    cls = {}
    for i, stem in enumerate(world.stems):
        Image.fromarray(world.pseudo[i].numpy().astype(np.uint8), mode="L").save(wl / "ir_label" / f"{stem}.png")
        Image.fromarray(np.zeros((4, 4), np.uint8), mode="P").save(wl / "ir_label" / f"{stem}_palette.png")
        cls[stem] = world.image_classes[i].numpy().astype(np.float32)
    # IRNet's cls_labels.npy has VOC's 20 classes; the tiny world has 6: pad with zeros.
    np.save(wl / "cls_labels.npy", {k: np.concatenate([v, np.zeros(14, np.float32)]) for k, v in cls.items()})
    args = ["--features", str(root / "features"), "--labels", str(wl / "ir_label"), "--wsss", "irnet",
            "--image-labels", str(wl / "cls_labels.npy"), "--no-progress"]
    # Unpickling needs the opt-in, and the error says how.
    assert main(["centroids", *args, "--num-classes", "20", "--out", str(tmp_path / "V.pt")]) == 2
    assert "--trust-pickle" in capsys.readouterr().err
    assert main(["centroids", *args, "--num-classes", "20", "--out", str(tmp_path / "V.pt"), "--trust-pickle"]) == 0
    V = DebiasedCentroids.load(tmp_path / "V.pt")
    assert V.num_images == len(world.stems)  # the _palette siblings were skipped
    assert main(["debias", *args, "--centroids", str(tmp_path / "V.pt"), "--out", str(tmp_path / "db"),
                 "--refine", "threshold", "--trust-pickle"]) == 0
    outs = sorted((tmp_path / "db").glob("*.png"))
    assert [p.stem for p in outs] == world.stems
    for p in outs:
        with Image.open(p) as im:
            assert im.mode == "L"  # IRNet reads labels with imageio: grayscale, not palette


def test_debias_job_refuses_bad_batch_size_and_device(world_dir, tmp_path):
    from mars_plugin.commands.debias import debias_job

    root, _ = world_dir
    _centroids(root, tmp_path / "V.pt")
    args = (root / "features", root / "labels", tmp_path / "V.pt", tmp_path / "x")
    with pytest.raises(ValueError, match="batch_size"):
        debias_job(*args, images_dir=root / "images", batch_size=0, progress=False)
    with pytest.raises(ValueError, match="device"):
        debias_job(*args, images_dir=root / "images", device="gpu7", progress=False)
    with pytest.raises(ValueError, match="crf_backend"):
        debias_job(*args, images_dir=root / "images", crf_backend="c", progress=False)
