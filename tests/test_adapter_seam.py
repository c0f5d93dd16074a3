"""SEAM adapter on fixtures written in SEAM's own formats (YudeWang/SEAM @3212261).

Every fixture is made the way the upstream script makes it: ``np.save`` of int-keyed CAM dicts
(infer_SEAM.py:79-85), ``{0: bg, c+1: p}`` CRF dicts (infer_SEAM.py:98-112), grayscale out_rw
PNGs (infer_aff.py:154-156), a str-keyed ``cls_labels.npy`` (voc12/make_cls_labels.py:18-22) and
a ``train_aug.txt`` list. The label rules are re-implemented here in plain numpy.
"""
import numpy as np
import pytest
import torch
from PIL import Image

from mars_plugin import debias_labels, select_centroids
from mars_plugin.adapters.wsss import seam
H, W = 12, 16


def _norm_cam(rng, labels):
    """SEAM's per-class max normalisation of a (20, H, W) score map (infer_SEAM.py:72-77)."""
    sum_cam = rng.random((20, H, W)).astype(np.float32) * labels.reshape(20, 1, 1)
    sum_cam[sum_cam < 0] = 0
    cam_max = np.max(sum_cam, (1, 2), keepdims=True)
    cam_min = np.min(sum_cam, (1, 2), keepdims=True)
    sum_cam[sum_cam < cam_min + 1e-5] = 0
    return (sum_cam - cam_min - 1e-5) / (cam_max - cam_min + 1e-5)


def _cam_fixture(tmp_path, rng, classes=(4, 14)):
    """out_cam/<name>.npy exactly as infer_SEAM.py:79-85 writes it; returns (path, dict, norm_cam, labels)."""
    labels = np.zeros(20, np.float32)
    labels[list(classes)] = 1
    norm_cam = _norm_cam(rng, labels)
    cam_dict = {}
    for i in range(20):
        if labels[i] > 1e-5:
            cam_dict[i] = norm_cam[i]
    d = tmp_path / "out_cam"
    d.mkdir(exist_ok=True)
    p = d / "2007_000032.npy"
    np.save(p, cam_dict)
    return p, cam_dict, norm_cam, labels


def _crf_fixture(tmp_path, rng, cam_dict, alpha=4):
    """A CRF dict {0: bg, key+1: prob} as infer_SEAM.py:98-104 stores it (probabilities summing to 1)."""
    v = rng.random((len(cam_dict) + 1, H, W)).astype(np.float32) + 0.01
    v /= v.sum(0, keepdims=True)
    crf = {0: v[0]}
    for i, key in enumerate(cam_dict.keys()):
        crf[key + 1] = v[i + 1]
    d = tmp_path / ("out_crf_%.1f" % alpha)
    d.mkdir(exist_ok=True)
    p = d / "2007_000032.npy"
    np.save(p, crf)
    return p, crf


def test_pickles_refused_without_opt_in(tmp_path):
    rng = np.random.default_rng(0)
    p, *_ = _cam_fixture(tmp_path, rng)
    with pytest.raises(PermissionError, match="trust_pickle"):
        seam.load_cams(p)
    cls = tmp_path / "cls_labels.npy"
    np.save(cls, {"2007_000032": np.zeros(20, np.float32)})
    with pytest.raises(PermissionError, match="trust_pickle"):
        seam.load_image_labels(cls)
    with pytest.raises(PermissionError, match="trust_pickle"):
        list(seam.iter_cams(p.parent))


def test_load_cams_equals_saved_cam_dict(tmp_path):
    rng = np.random.default_rng(1)
    p, cam_dict, _, _ = _cam_fixture(tmp_path, rng)
    c = seam.load_cams(p, trust_pickle=True)
    assert c["kind"] == "cam" and c["includes_background"] is False
    assert c["id"] == "2007_000032" and c["size"] == (H, W)
    assert c["keys"].dtype == torch.long and c["keys"].tolist() == [5, 15]  # 0-based 4, 14 -> ids 5, 15
    assert c["cam"].dtype == torch.float32 and c["cam"].shape == (2, H, W)
    for j, k in enumerate(cam_dict):
        np.testing.assert_array_equal(c["cam"][j].numpy(), cam_dict[k])
    (stem, c2), = list(seam.iter_cams(p.parent, trust_pickle=True))
    assert stem == "2007_000032" and torch.equal(c2["cam"], c["cam"])


def test_load_cams_crf_dict_auto_and_explicit(tmp_path):
    rng = np.random.default_rng(2)
    _, cam_dict, _, _ = _cam_fixture(tmp_path, rng)
    p, crf = _crf_fixture(tmp_path, rng, cam_dict)
    c = seam.load_cams(p, trust_pickle=True)
    assert c["kind"] == "crf" and c["includes_background"] is True
    assert c["keys"].tolist() == [0, 5, 15]
    for j, k in enumerate(crf):
        np.testing.assert_array_equal(c["cam"][j].numpy(), crf[k])
    # explicit kinds override the detection
    assert seam.load_cams(p, trust_pickle=True, kind="crf")["keys"].tolist() == [0, 5, 15]
    forced = seam.load_cams(p, trust_pickle=True, kind="cam")
    assert forced["keys"].tolist() == [1, 6, 16] and forced["includes_background"] is False


def test_cams_to_label_threshold_rule_equals_infer_seam(tmp_path):
    """Default = infer_SEAM.py:87-90 (--out_cam_pred): argmax over [0.26, all 20 norm_cams]."""
    rng = np.random.default_rng(3)
    p, cam_dict, norm_cam, labels = _cam_fixture(tmp_path, rng, classes=(2, 7, 11))
    bg_score = [np.ones_like(norm_cam[0]) * 0.26]
    ref = np.argmax(np.concatenate((bg_score, norm_cam)), 0)
    c = seam.load_cams(p, trust_pickle=True)
    out = seam.cams_to_label(c)
    assert out.dtype == torch.long and out.shape == (H, W)
    np.testing.assert_array_equal(out.numpy(), ref)
    assert set(np.unique(ref)) - {0} <= {3, 8, 12} and len(np.unique(ref)) > 1
    # evaluation.py:28-33 (--type npy --t): same rule, absent classes at 0 instead of -1
    for t in (0.1, 0.26, 0.5):
        tensor = np.zeros((21, H, W), np.float32)
        for key in cam_dict:
            tensor[key + 1] = cam_dict[key]
        tensor[0] = t
        np.testing.assert_array_equal(seam.cams_to_label(c, bg_threshold=t).numpy(), np.argmax(tensor, 0))
    # a raw upstream dict works too
    np.testing.assert_array_equal(seam.cams_to_label(cam_dict).numpy(), ref)


@pytest.mark.parametrize("alpha", [4, 6, 24])
def test_cams_to_label_alpha_rule(tmp_path, alpha):
    """bg = (1 - max cam)^alpha (infer_SEAM.py:94, infer_aff.py:100), argmax without CRF/RW."""
    rng = np.random.default_rng(4)
    p, cam_dict, _, _ = _cam_fixture(tmp_path, rng)
    v = np.array(list(cam_dict.values()))
    bg = np.power(1 - np.max(v, axis=0, keepdims=True), alpha)
    idx = np.argmax(np.concatenate((bg, v), axis=0), 0)
    ref = np.array([0] + [k + 1 for k in cam_dict])[idx]
    out = seam.cams_to_label(seam.load_cams(p, trust_pickle=True), bg_alpha=alpha)
    np.testing.assert_array_equal(out.numpy(), ref)


def test_cams_to_label_crf_dict_is_argmax(tmp_path):
    rng = np.random.default_rng(5)
    _, cam_dict, _, _ = _cam_fixture(tmp_path, rng)
    p, crf = _crf_fixture(tmp_path, rng, cam_dict)
    keys = np.array(list(crf.keys()))
    ref = keys[np.argmax(np.array(list(crf.values())), 0)]
    np.testing.assert_array_equal(seam.cams_to_label(seam.load_cams(p, trust_pickle=True)).numpy(), ref)


def test_cams_to_label_with_image_runs_seam_crf(tmp_path):
    """image= runs SEAM's crf_inference (tool/imutils.py:220-237) on [(1-max)^alpha, cams]."""
    dcrf = pytest.importorskip("pydensecrf.densecrf")
    from pydensecrf.utils import unary_from_softmax

    rng = np.random.default_rng(6)
    p, cam_dict, _, _ = _cam_fixture(tmp_path, rng)
    img = rng.integers(0, 256, (H, W, 3), dtype=np.uint8)
    v = np.array(list(cam_dict.values()))
    probs = np.concatenate((np.power(1 - np.max(v, axis=0, keepdims=True), 4), v), axis=0)
    d = dcrf.DenseCRF2D(W, H, probs.shape[0])
    d.setUnaryEnergy(np.ascontiguousarray(unary_from_softmax(probs)))
    d.addPairwiseGaussian(sxy=3, compat=3)
    d.addPairwiseBilateral(sxy=80, srgb=13, rgbim=np.copy(img), compat=10)
    q = np.array(d.inference(10)).reshape((probs.shape[0], H, W))
    ref = np.array([0, 5, 15])[np.argmax(q, 0)]
    out = seam.cams_to_label(seam.load_cams(p, trust_pickle=True), bg_alpha=4, image=img)
    np.testing.assert_array_equal(out.numpy(), ref)
    out = seam.cams_to_label(seam.load_cams(p, trust_pickle=True), bg_alpha=4, image=img, crf_backend="pydensecrf")
    np.testing.assert_array_equal(out.numpy(), ref)


def test_empty_cam_dict_needs_size(tmp_path):
    p = tmp_path / "x.npy"
    np.save(p, {})
    c = seam.load_cams(p, trust_pickle=True)
    assert c["size"] is None and c["keys"].numel() == 0
    with pytest.raises(ValueError, match="size"):
        seam.cams_to_label(c)
    assert torch.equal(seam.cams_to_label(c, size=(3, 4)), torch.zeros(3, 4, dtype=torch.long))


def test_bad_cam_dicts_rejected(tmp_path):
    for bad in ({"a": np.zeros((2, 2), np.float32)}, {25: np.zeros((2, 2), np.float32)},
                {1: np.zeros((2, 2), np.float32), 2: np.zeros((3, 2), np.float32)}):
        p = tmp_path / "bad.npy"
        np.save(p, bad)
        with pytest.raises(ValueError):
            seam.load_cams(p, trust_pickle=True)


def test_load_pseudo_labels_out_rw_grayscale(tmp_path):
    rng = np.random.default_rng(7)
    d = tmp_path / "out_rw"
    d.mkdir()
    saved = {}
    for name in ("2007_000032", "2007_000039"):
        res = rng.integers(0, 21, (H, W)).astype(np.uint8)  # infer_aff.py:154
        res[0, 0] = 255
        Image.fromarray(res).save(d / f"{name}.png")  # scipy.misc.imsave of uint8 -> L-mode PNG
        saved[name] = res
    assert Image.open(d / "2007_000032.png").mode == "L"
    got = dict(seam.load_pseudo_labels(d))
    assert sorted(got) == sorted(saved)
    for name, res in saved.items():
        assert got[name].dtype == torch.long
        np.testing.assert_array_equal(got[name].numpy(), res)
    assert [n for n, _ in seam.load_pseudo_labels(d, ids=["2007_000039"])] == ["2007_000039"]
    (n, y), = list(seam.load_pseudo_labels(d / "2007_000032.png"))
    assert n == "2007_000032" and int(y[0, 0]) == 255


def test_image_labels_from_cls_labels_npy(tmp_path):
    d = {}
    for name, cls in (("2007_000032", [0, 14]), ("2010_005582", [4]), ("2007_000039", [19])):
        lab = np.zeros(20, np.float32)
        lab[cls] = 1.0
        d[name] = lab
    p = tmp_path / "cls_labels.npy"
    np.save(p, d)  # voc12/make_cls_labels.py:22, str keys
    out = seam.load_image_labels(p, trust_pickle=True)
    assert set(out) == set(d)
    for name, lab in d.items():
        assert out[name].dtype == torch.bool and out[name].shape == (20,)
        np.testing.assert_array_equal(out[name].numpy(), lab > 0)
    sub = seam.load_image_labels(p, trust_pickle=True, ids=["2007_000039"])
    assert list(sub) == ["2007_000039"]
    with pytest.raises(ValueError, match="no image labels"):
        seam.load_image_labels(p, trust_pickle=True, ids=["2099_000000"])


def test_image_labels_from_xml_like_make_cls_labels(tmp_path):
    """voc12/data.py:23-36: every <name> that is a class counts, difficult included, parts not."""
    ann = tmp_path / "Annotations"
    ann.mkdir()
    (ann / "2007_000032.xml").write_text(
        "<annotation><filename>2007_000032.jpg</filename>"
        "<object><name>aeroplane</name><difficult>0</difficult></object>"
        "<object><name>person</name><difficult>1</difficult>"
        "<part><name>head</name></part></object></annotation>"
    )
    out = seam.load_image_labels(ann)
    assert torch.nonzero(out["2007_000032"]).flatten().tolist() == [0, 14]


def test_load_image_list_seam_and_plain(tmp_path):
    p = tmp_path / "train_aug.txt"
    p.write_text("/JPEGImages/2007_000032.jpg /SegmentationClassAug/2007_000032.png\n"
                 "/JPEGImages/2007_000039.jpg /SegmentationClassAug/2007_000039.png\n\n")
    assert seam.load_image_list(p) == ["2007_000032", "2007_000039"]
    q = tmp_path / "trainaug.txt"
    q.write_text("2007_000032\n2007_000039\n")
    assert seam.load_image_list(q) == ["2007_000032", "2007_000039"]


def test_write_debiased_round_trip_and_dry_run(tmp_path):
    y = torch.tensor([[0, 5, -1], [255, 15, -1]])
    out = tmp_path / "out_rw_mars"
    paths = seam.write_debiased([("2007_000032", y)], out, dry_run=True)
    assert paths == [out / "2007_000032.png"] and not out.exists()
    paths = seam.write_debiased([("2007_000032", y)], out)
    assert paths == [out / "2007_000032.png"]
    im = Image.open(paths[0])
    assert im.mode == seam.LABEL_MODE == "L"
    arr = np.array(im)  # how ssc's VOCDataset.load_pseudo_segmentation reads it (VOCDataset.py:77)
    np.testing.assert_array_equal(arr, [[0, 5, 254], [255, 15, 254]])
    seam.write_debiased([("a", y)], out, biased_value=253)
    assert np.array(Image.open(out / "a.png"))[0, 2] == 253
    for bad_value in (0, 20, 300, 2.5):
        with pytest.raises(ValueError, match="biased_value"):
            seam.write_debiased([("b", y)], out, biased_value=bad_value)
    for bad in (torch.tensor([[0, 21]]), torch.tensor([[0.0, 1.0]]), torch.tensor([[-2, 1]])):
        with pytest.raises(ValueError, match="label of b"):
            seam.write_debiased([("b", bad)], out, dry_run=True)
    assert not (out / "b.png").exists()


def test_module_constants():
    assert seam.NAME == "seam" and seam.NUM_CLASSES == 20
    assert seam.CLASS_NAMES[0] == "background" and len(seam.CLASS_NAMES) == 21
    assert seam.BG_THRESHOLD == 0.26 and seam.CRF_ALPHAS == (4, 24) and seam.AFF_ALPHA == 6


def test_three_calls_on_seam_fixtures(tmp_path):
    """list + cls_labels + out_rw -> select_centroids -> debias_labels -> write_debiased, read back
    as ssc's VOCDataset reads the pseudo GT."""
    rng = np.random.default_rng(8)
    names = ["2007_000032", "2007_000039", "2007_000063", "2007_000068"]
    (tmp_path / "train_aug.txt").write_text(
        "".join(f"/JPEGImages/{n}.jpg /SegmentationClassAug/{n}.png\n" for n in names))
    rw = tmp_path / "out_rw"
    rw.mkdir()
    cls = {}
    feats = {}
    for i, n in enumerate(names):
        c = 1 + (i % 2) * 3  # classes 1 and 4
        lab = np.zeros((H, W), np.uint8)
        lab[3:9, 4:12] = c
        lab[0, :] = 255
        Image.fromarray(lab).save(rw / f"{n}.png")
        v = np.zeros(20, np.float32)
        v[c - 1] = 1
        cls[n] = v
        feats[n] = torch.from_numpy(rng.standard_normal((8, H // 2, W // 2)).astype(np.float32))
    np.save(tmp_path / "cls_labels.npy", cls)

    ids = seam.load_image_list(tmp_path / "train_aug.txt")
    tags = seam.load_image_labels(tmp_path / "cls_labels.npy", trust_pickle=True, ids=ids)
    V = select_centroids(((feats[n], y) for n, y in seam.load_pseudo_labels(rw, ids=ids)),
                         num_classes=seam.NUM_CLASSES, k_fg=2, k_bg=2)
    debiased = ((n, debias_labels(feats[n], y, V, tags[n], refine="threshold"))
                for n, y in seam.load_pseudo_labels(rw, ids=ids))
    paths = seam.write_debiased(debiased, tmp_path / "out_rw_mars")
    assert [p.stem for p in paths] == ids
    removed = 0
    for n, p in zip(ids, paths):
        back = np.array(Image.open(p))  # ssc VOCDataset.py:77
        orig = np.array(Image.open(rw / f"{n}.png"))
        assert back.shape == orig.shape and Image.open(p).mode == "L"
        assert set(np.unique(back)) <= {0, 1, 4, 254, 255}
        keep = back != 254
        np.testing.assert_array_equal(back[keep], orig[keep])  # only foreground may become 254
        assert np.all(orig[~keep] > 0) and np.all(orig[~keep] != 255)
        removed += int((~keep).sum())
    assert removed > 0  # random features: some foreground pixels are unlike every centroid
