"""IRNet adapter on fixtures written exactly as jiwoon-ahn/irn writes them (commit a2ece00).

* result/cam/<id>.npy: step/make_cam.py:55-56, ``np.save`` of a dict with torch ``keys``/``cam``
  and numpy ``high_res``.
* voc12/cls_labels.npy: voc12/make_cls_labels.py:22-28, ``np.save`` of {np.int32: float32 (20,)}.
* result/ir_label, result/sem_seg: ``imageio.imwrite`` of uint8 = a grayscale PNG (PIL 'L' here).
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from PIL import Image

from mars_plugin import debias_labels, select_centroids
from mars_plugin.adapters.wsss import irnet
from mars_plugin.formats.files import read_label

IDS = ["2007_000032", "2007_000039", "2008_000123", "2011_003276"]
H, W = 13, 18  # not multiples of 4: strided size is ceil(H/4), ceil(W/4)


# --------------------------------------------------------------------------- fixtures

def strided(n: int) -> int:
    return (n - 1) // 4 + 1  # misc/imutils.py:173-174


def save_cam_like_make_cam(folder, name, label_vec, rng):
    """np.save(<cam_out_dir>/<name>.npy, {"keys": valid_cat, "cam": strided_cam.cpu(), "high_res": ...numpy()})."""
    label = torch.from_numpy(label_vec)
    valid_cat = torch.nonzero(label)[:, 0]
    K = valid_cat.numel()
    strided_cam = torch.from_numpy(rng.random((K, strided(H), strided(W))).astype(np.float32))
    highres_cam = torch.from_numpy(rng.random((K, H, W)).astype(np.float32))
    # values exactly at the thresholds: the repo's argmax sends ties to background
    highres_cam[:, 0, :4] = torch.tensor([0.30, 0.05, 0.35, 0.15])
    np.save(os.path.join(folder, name + ".npy"),
            {"keys": valid_cat, "cam": strided_cam.cpu(), "high_res": highres_cam.cpu().numpy()})
    return valid_cat, strided_cam, highres_cam.numpy()


def label_vec(*class_ids):
    v = np.zeros(20, np.float32)
    for c in class_ids:
        v[c - 1] = 1.0
    return v


CLASSES = {"2007_000032": (4,), "2007_000039": (4, 15), "2008_000123": (4,), "2011_003276": (4, 15)}


@pytest.fixture()
def repo(tmp_path):
    rng = np.random.default_rng(0)
    cam_dir = tmp_path / "result" / "cam"
    ir_dir = tmp_path / "result" / "ir_label"
    cam_dir.mkdir(parents=True)
    ir_dir.mkdir(parents=True)
    (tmp_path / "voc12").mkdir()
    saved = {}
    cls = {}
    for name in IDS:
        vec = label_vec(*CLASSES[name])
        saved[name] = save_cam_like_make_cam(str(cam_dir), name, vec, rng)
        cls[np.int32(int(name.replace("_", "")))] = vec
        conf = rng.choice(np.array([0, 4, 15, 255], np.uint8), size=(H, W))
        Image.fromarray(conf).save(ir_dir / f"{name}.png")  # what imageio.imwrite(uint8) writes
    np.save(str(tmp_path / "voc12" / "cls_labels.npy"), cls)
    (tmp_path / "voc12" / "train_aug.txt").write_text("".join(n + "\n" for n in IDS))
    return tmp_path, saved


# --------------------------------------------------------------------------- the repo's rule, in numpy

def repo_rule(keys0, cams, fg_thres, bg_thres, crf=None):
    """step/cam_to_ir_label.py:23-40 without the dataset plumbing; ``crf(idx, n)`` stands for
    misc/imutils.py crf_inference_label."""
    keys = np.pad(np.asarray(keys0) + 1, (1, 0), mode="constant")
    fg_conf_cam = np.argmax(np.pad(cams, ((1, 0), (0, 0), (0, 0)), mode="constant", constant_values=fg_thres), axis=0)
    if crf is not None:
        fg_conf_cam = crf(fg_conf_cam, keys.shape[0])
    fg_conf = keys[fg_conf_cam]
    bg_conf_cam = np.argmax(np.pad(cams, ((1, 0), (0, 0), (0, 0)), mode="constant", constant_values=bg_thres), axis=0)
    if crf is not None:
        bg_conf_cam = crf(bg_conf_cam, keys.shape[0])
    bg_conf = keys[bg_conf_cam]
    conf = fg_conf.copy()
    conf[fg_conf == 0] = 255
    conf[bg_conf + fg_conf == 0] = 0
    return conf.astype(np.uint8)


# --------------------------------------------------------------------------- tests

def test_constants():
    assert irnet.NAME == "irnet"
    assert irnet.NUM_CLASSES == 20 and len(irnet.CLASS_NAMES) == 21 and irnet.CLASS_NAMES[0] == "background"
    assert irnet.CLASS_NAMES[4] == "boat" and irnet.CLASS_NAMES[15] == "person"
    assert irnet.LABEL_MODE == "L"
    assert (irnet.CONF_FG_THRES, irnet.CONF_BG_THRES, irnet.SEM_SEG_BG_THRES) == (0.30, 0.05, 0.25)


def test_pickles_refused_without_trust(repo):
    root, _ = repo
    with pytest.raises(PermissionError, match="trust_pickle"):
        irnet.load_cams(root / "result" / "cam" / f"{IDS[0]}.npy")
    with pytest.raises(PermissionError, match="trust_pickle"):
        irnet.load_image_labels(root / "voc12" / "cls_labels.npy")


def test_load_cams_equals_what_make_cam_saved(repo):
    root, saved = repo
    for name in IDS:
        d = irnet.load_cams(root / "result" / "cam" / f"{name}.npy", trust_pickle=True)
        keys0, cam, high_res = saved[name]
        assert d["keys"].dtype == torch.long and torch.equal(d["keys"], keys0 + 1)
        assert d["keys"].tolist() == list(CLASSES[name])
        assert d["cam"].shape == (len(CLASSES[name]), strided(H), strided(W)) and torch.equal(d["cam"], cam)
        assert isinstance(d["high_res"], torch.Tensor) and np.array_equal(d["high_res"].numpy(), high_res)


def test_load_cams_accepts_numpy_inside_and_rejects_bad_dicts(tmp_path):
    p = tmp_path / "x.npy"
    np.save(str(p), {"keys": np.array([3, 14]), "cam": np.ones((2, 4, 5), np.float32), "high_res": None})
    d = irnet.load_cams(p, trust_pickle=True)
    assert d["keys"].tolist() == [4, 15] and d["cam"].dtype == torch.float32 and d["high_res"] is None
    np.save(str(p), {"keys": torch.tensor([3]), "cam": torch.ones(2, 4, 5)})
    with pytest.raises(ValueError, match="K = 1"):
        irnet.load_cams(p, trust_pickle=True)
    np.save(str(p), {"keys": torch.tensor([20]), "cam": torch.ones(1, 4, 5)})
    with pytest.raises(ValueError, match="0..19"):
        irnet.load_cams(p, trust_pickle=True)
    np.save(str(p), np.zeros(3))
    with pytest.raises(ValueError, match="dict"):
        irnet.load_cams(p, trust_pickle=True)


@pytest.mark.parametrize("thres", [None, (0.35, 0.15), (0.5, 0.5)])
def test_cams_to_label_is_the_repo_rule(repo, thres):
    root, saved = repo
    for name in IDS:
        d = irnet.load_cams(root / "result" / "cam" / f"{name}.npy", trust_pickle=True)
        keys0, _, high_res = saved[name]
        fg, bg = thres if thres else (0.30, 0.05)
        got = irnet.cams_to_label(d) if thres is None else irnet.cams_to_label(d, conf_fg=fg, conf_bg=bg)
        want = repo_rule(keys0.numpy(), high_res, fg, bg)
        assert got.dtype == torch.long and got.shape == (H, W)
        np.testing.assert_array_equal(got.numpy(), want)
        if thres is None:
            assert got[0, 0] == 255 and got[0, 1] == 0  # cam == threshold -> background side
            assert set(np.unique(want).tolist()) >= {0, 255}


def test_cams_to_label_with_crf_is_crf_inference_label(repo):
    pytest.importorskip("pydensecrf")
    import pydensecrf.densecrf as dcrf
    from pydensecrf.utils import unary_from_labels

    def crf_inference_label(img, labels, t=10, n_labels=21, gt_prob=0.7):  # misc/imutils.py:156-170
        h, w = img.shape[:2]
        d = dcrf.DenseCRF2D(w, h, n_labels)
        d.setUnaryEnergy(unary_from_labels(labels, n_labels, gt_prob=gt_prob, zero_unsure=False))
        d.addPairwiseGaussian(sxy=3, compat=3)
        d.addPairwiseBilateral(sxy=50, srgb=5, rgbim=np.ascontiguousarray(np.copy(img)), compat=10)
        q = d.inference(t)
        return np.argmax(np.array(q).reshape((n_labels, h, w)), axis=0)

    root, saved = repo
    img = np.random.default_rng(1).integers(0, 256, (H, W, 3), dtype=np.uint8)
    for name in IDS:
        d = irnet.load_cams(root / "result" / "cam" / f"{name}.npy", trust_pickle=True)
        keys0, _, high_res = saved[name]
        want = repo_rule(keys0.numpy(), high_res, 0.30, 0.05, crf=lambda idx, n: crf_inference_label(img, idx, n_labels=n))
        np.testing.assert_array_equal(irnet.cams_to_label(d, image=img).numpy(), want)
        np.testing.assert_array_equal(irnet.cams_to_label(d, image=img, crf_backend="pydensecrf").numpy(), want)
        np.testing.assert_array_equal(irnet.cams_to_label(d, image=img, crf=False).numpy(),
                                      repo_rule(keys0.numpy(), high_res, 0.30, 0.05))
    with pytest.raises(ValueError, match="image"):
        irnet.cams_to_label(d, crf=True)


def test_cams_to_label_checks_its_input(repo):
    root, _ = repo
    d = irnet.load_cams(root / "result" / "cam" / f"{IDS[0]}.npy", trust_pickle=True)
    with pytest.raises(ValueError, match="1-based"):
        irnet.cams_to_label({**d, "keys": torch.tensor([0])})  # IRNet's raw 0-based keys (aeroplane = 0)
    with pytest.raises(ValueError, match="high_res"):
        irnet.cams_to_label({**d, "high_res": None})
    with pytest.raises(ValueError, match="conf_bg"):
        irnet.cams_to_label(d, conf_fg=0.1, conf_bg=0.2)


def test_load_image_labels_decodes_ids_and_values(repo):
    root, _ = repo
    raw = np.load(str(root / "voc12" / "cls_labels.npy"), allow_pickle=True).item()
    assert all(isinstance(k, np.int32) for k in raw)  # the fixture is in IRNet's format
    labels = irnet.load_image_labels(root / "voc12" / "cls_labels.npy", trust_pickle=True)
    assert sorted(labels) == sorted(IDS)
    for name in IDS:
        t = labels[name]
        assert t.dtype == torch.bool and t.shape == (20,)
        assert (torch.nonzero(t)[:, 0] + 1).tolist() == list(CLASSES[name])


def test_load_image_list(repo, tmp_path):
    root, _ = repo
    assert irnet.load_image_list(root / "voc12" / "train_aug.txt") == IDS
    p = tmp_path / "seg_aug.txt"
    p.write_text("/JPEGImages/2007_000032.jpg /SegmentationClassAug/2007_000032.png\n\n2007_000039\n")
    assert irnet.load_image_list(p) == ["2007_000032", "2007_000039"]
    with pytest.raises(ValueError, match="cannot read"):
        irnet.load_image_list(tmp_path / "missing.txt")


def test_load_pseudo_labels_keeps_255(repo):
    root, _ = repo
    folder = root / "result" / "ir_label"
    got = dict(irnet.load_pseudo_labels(folder))
    assert sorted(got) == IDS
    for name in IDS:
        raw = np.asarray(Image.open(folder / f"{name}.png"))
        assert got[name].dtype == torch.long and np.array_equal(got[name].numpy(), raw)
    assert any((t == 255).any() for t in got.values())
    assert [n for n, _ in irnet.load_pseudo_labels(folder, ids=IDS[::-1])] == IDS[::-1]
    [(n, t)] = list(irnet.load_pseudo_labels(folder / f"{IDS[1]}.png"))
    assert n == IDS[1] and torch.equal(t, got[IDS[1]])


def test_write_debiased_round_trip_and_dry_run(tmp_path):
    y = torch.tensor([[0, 4, -1, 255], [15, -1, 0, 20]])
    out = tmp_path / "deb"
    paths = irnet.write_debiased([("2007_000032", y)], out, dry_run=True)
    assert paths == [out / "2007_000032.png"] and not out.exists()
    paths = irnet.write_debiased([("2007_000032", y)], out)
    assert paths == [out / "2007_000032.png"] and sorted(os.listdir(out)) == ["2007_000032.png"]
    with Image.open(paths[0]) as im:
        assert im.mode == "L"
        arr = np.asarray(im)
    assert arr.tolist() == [[0, 4, 254, 255], [15, 254, 0, 20]]
    assert torch.equal(read_label(paths[0]), y)
    with pytest.raises(ValueError, match="21"):
        irnet.write_debiased([("a", torch.tensor([[21]]))], out)
    with pytest.raises(ValueError, match="biased_value"):
        irnet.write_debiased([("a", y)], out, biased_value=15)


def make_world(rng_seed=0):
    """USS-like features: background and 'sea' share one prototype; boat labels leak into sea."""
    g = torch.Generator().manual_seed(rng_seed)
    D = 8
    protos = torch.linalg.qr(torch.randn(D, D, generator=g))[0].T[:3]  # orthonormal: bg/sea, boat, person
    feats, labels, truth = {}, {}, {}
    for n, name in enumerate(IDS):
        f = protos[0][:, None, None] + 0.05 * torch.randn(D, H, W, generator=g)
        y = torch.zeros(H, W, dtype=torch.long)
        t = torch.zeros(H, W, dtype=torch.bool)
        y[3:10, 2:14] = 4
        f[:, 3:10, 2:9] = protos[1][:, None, None] + 0.05 * torch.randn(D, 7, 7, generator=g)
        t[3:10, 9:14] = True  # labelled boat, looks like the background of the other images
        if 15 in CLASSES[name]:
            y[0:3, 12:18] = 15
            f[:, 0:3, 12:18] = protos[2][:, None, None] + 0.05 * torch.randn(D, 3, 6, generator=g)
        feats[name], labels[name], truth[name] = f, y, t
    return feats, labels, truth


def test_three_calls_on_irnet_files(repo, tmp_path):
    root, _ = repo
    feats, world_labels, truth = make_world()
    sem_seg = root / "result" / "sem_seg"
    sem_seg.mkdir()
    for name, y in world_labels.items():  # make_sem_seg_labels.py:51: imageio.imsave of uint8
        Image.fromarray(y.numpy().astype(np.uint8)).save(sem_seg / f"{name}.png")

    ids = irnet.load_image_list(root / "voc12" / "train_aug.txt")
    labels = dict(irnet.load_pseudo_labels(sem_seg, ids=ids))
    classes = irnet.load_image_labels(root / "voc12" / "cls_labels.npy", trust_pickle=True)
    V = select_centroids(((feats[i], labels[i]) for i in ids), num_classes=irnet.NUM_CLASSES)
    assert V.valid[4] and V.valid[15]
    debiased = {i: debias_labels(feats[i], labels[i], V, classes[i], refine="threshold") for i in ids}
    out = tmp_path / "sem_seg_mars"
    paths = irnet.write_debiased(debiased.items(), out)
    assert [p.name for p in paths] == [f"{i}.png" for i in ids]

    for i in ids:
        assert torch.equal(debiased[i] == -1, truth[i])  # exactly the leaked 'sea' pixels
        # IRNet reads labels with imageio.imread (voc12/dataloader.py:232); for a grayscale PNG
        # that is the pixel array PIL gives.
        arr = np.asarray(Image.open(out / f"{i}.png"))
        assert arr.dtype == np.uint8 and arr.shape == (H, W)
        np.testing.assert_array_equal(arr == 254, truth[i].numpy())
        np.testing.assert_array_equal(arr[~truth[i].numpy()], world_labels[i].numpy()[~truth[i].numpy()])
        try:
            import imageio.v2 as imageio
        except ImportError:
            continue
        np.testing.assert_array_equal(imageio.imread(out / f"{i}.png"), arr)


@pytest.mark.parametrize("module", ["irnet", "advcam", "seam", "rsepm"])
@pytest.mark.parametrize("stem", ["../x", "a/b", "", ".", "..", "a\0b"])
def test_write_debiased_refuses_ids_that_are_not_file_names(tmp_path, module, stem):
    """Every adapter's writer: nothing is written outside (or inside) out_dir for such an id,
    in a dry run either."""
    import importlib

    mod = importlib.import_module(f"mars_plugin.adapters.wsss.{module}")
    out = tmp_path / "out" / "deeper"
    for dry_run in (True, False):
        with pytest.raises(ValueError, match="not a plain file name"):
            mod.write_debiased([(stem, torch.zeros(2, 2, dtype=torch.long))], out, dry_run=dry_run)
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == []
