"""RS+EPM adapter on fixtures written in RS+EPM's own formats
(shjo-april/RecurSeed_and_EdgePredictMix @df538e2).

Fixtures are made the way the upstream scripts make them: padded ``{'keys', 'seed'}`` pickles
(infer_rsepm.py:119-134), DeepLab-stage pickles with len(keys) == len(seed) (infer_seg.py:113-127),
P-mode masks with the dataset json palette (convert_seed_to_pseudo_masks.py:135-137 and
tools/general/cv_utils.py:204-214), and VOC-style xml tags for VOC and COCO 2014. The label rule
is re-implemented here in plain numpy.
"""
import pickle

import numpy as np
import pytest
import torch
from PIL import Image

from mars_plugin import debias_labels, select_centroids
from mars_plugin.adapters.wsss import rsepm
H, W = 12, 16


def _bitmap_colors(n):
    """The colours of data/VOC.json and data/COCO.json color_dict (the VOC bit-interleaved map)."""
    out = []
    for i in range(n):
        r = g = b = 0
        c = i
        for j in range(8):
            r |= ((c >> 0) & 1) << (7 - j)
            g |= ((c >> 1) & 1) << (7 - j)
            b |= ((c >> 2) & 1) << (7 - j)
            c >>= 3
        out.append((r, g, b))
    return out


def _upstream_palette(num_classes):
    """cv_utils.get_colors(data_dict) then [..., ::-1]: RGB, class colours, black, 255 = (224, 224, 192)."""
    colors = _bitmap_colors(num_classes)
    while len(colors) <= 255:
        colors.append((0, 0, 0))
    colors[255] = (224, 224, 192)
    return np.asarray(colors, dtype=np.uint8)


def _save_upstream_mask(path, mask, num_classes=21):
    image = Image.fromarray(mask.astype(np.uint8)).convert("P")
    # upstream passes the (256, 3) array itself; current Pillow wants it flat
    image.putpalette(_upstream_palette(num_classes).tobytes())
    image.save(path)


def _seed_pickle(path, rng, class_mask):
    """infer_rsepm.py:119-134: seed of the tagged classes, keys padded with a leading 0."""
    pred = rng.random((len(class_mask), H, W)).astype(np.float32)
    seed = pred / (pred.reshape(len(class_mask), -1).max(1)[:, None, None] + 1e-5)  # torch_utils.normalize
    seed = seed[np.asarray(class_mask) == 1]
    class_keys = np.nonzero(class_mask)[0]
    class_keys = np.pad(class_keys + 1, (1, 0), "constant")
    with open(path, "wb") as fh:
        pickle.dump({"keys": class_keys, "seed": seed}, fh)
    return class_keys, seed


def _deeplab_pickle(path, rng, num_classes=21, present=(0, 7, 15)):
    """infer_seg.py:113-127: softmax of all classes, keys = classes reaching 0.05."""
    logits = rng.standard_normal((num_classes, H, W)).astype(np.float32) * 0.3
    logits[[c for c in range(num_classes) if c not in present]] -= 20.0
    e = np.exp(logits - logits.max(0, keepdims=True))
    pred_mask = e / e.sum(0, keepdims=True)
    class_mask = np.max(pred_mask.reshape(num_classes, H * W), axis=1) >= 0.05
    class_keys = np.nonzero(class_mask)[0]
    seed = pred_mask[class_mask, :, :]
    with open(path, "wb") as fh:
        pickle.dump({"keys": class_keys, "seed": seed}, fh)
    return class_keys, seed


def _xml(path, objects, width=W, height=H):
    """A VOC-style annotation as RS+EPM's xml_utils reads it: (name, difficult, (x0, y0, x1, y1))."""
    objs = "".join(
        f"<object><name>{n}</name><difficult>{d}</difficult>"
        f"<bndbox><xmin>{b[0]}</xmin><ymin>{b[1]}</ymin><xmax>{b[2]}</xmax><ymax>{b[3]}</ymax></bndbox>"
        + ("<part><name>head</name><bndbox><xmin>1</xmin><ymin>1</ymin><xmax>3</xmax><ymax>3</ymax></bndbox></part>"
           if n == "person" else "")
        + "</object>"
        for n, d, b in objects
    )
    path.write_text(f"<annotation><size><width>{width}</width><height>{height}</height><depth>3</depth></size>{objs}</annotation>")


def _ref_label(keys, seed, gamma=2.0, bg_th=None):
    """convert_seed_to_pseudo_masks.py:109-133 without CRF, in numpy."""
    if len(keys) <= 1:
        return np.zeros((H, W), np.uint8)
    if bg_th is not None:
        probmap = np.concatenate([np.ones((1, H, W), np.float32) * bg_th, seed], 0)
    elif gamma is not None:
        probmap = np.concatenate([np.power(1 - np.max(seed, axis=0, keepdims=True), gamma), seed], 0)
    else:
        probmap = seed
    return keys[np.argmax(probmap, axis=0)]


def test_pickles_refused_without_opt_in(tmp_path):
    p = tmp_path / "2007_000032.pkl"
    _seed_pickle(p, np.random.default_rng(0), np.eye(20, dtype=np.float32)[4])
    with pytest.raises(PermissionError, match="trust_pickle"):
        rsepm.load_cams(p)
    with pytest.raises(PermissionError, match="trust_pickle"):
        list(rsepm.iter_cams(tmp_path))


def test_load_cams_padded_seed_pickle(tmp_path):
    rng = np.random.default_rng(1)
    p = tmp_path / "2007_000032.pkl"
    cm = np.zeros(20, np.float32)
    cm[[4, 14]] = 1
    keys, seed = _seed_pickle(p, rng, cm)
    assert keys.tolist() == [0, 5, 15] and seed.shape == (2, H, W)
    c = rsepm.load_cams(p, trust_pickle=True)
    assert c["kind"] == "rsepm" and c["includes_background"] is False
    assert c["keys"].dtype == torch.long and c["keys"].tolist() == [5, 15]
    assert c["raw_keys"].tolist() == [0, 5, 15] and c["size"] == (H, W) and c["id"] == "2007_000032"
    np.testing.assert_array_equal(c["cam"].numpy(), seed)
    (stem, c2), = list(rsepm.iter_cams(tmp_path, trust_pickle=True))
    assert stem == "2007_000032" and torch.equal(c2["cam"], c["cam"])


def test_load_cams_deeplab_stage_pickle(tmp_path):
    rng = np.random.default_rng(2)
    p = tmp_path / "2007_000039.pkl"
    keys, seed = _deeplab_pickle(p, rng)
    assert keys.tolist() == [0, 7, 15] and len(keys) == len(seed)
    c = rsepm.load_cams(p, trust_pickle=True)
    assert c["kind"] == "deeplab" and c["includes_background"] is True
    assert c["keys"].tolist() == [0, 7, 15]
    np.testing.assert_array_equal(c["cam"].numpy(), seed)


@pytest.mark.parametrize("classes", [[4, 14], [0], [2, 7, 11, 19]])
def test_cams_to_label_padded_equals_upstream_rule(tmp_path, classes):
    rng = np.random.default_rng(3)
    cm = np.zeros(20, np.float32)
    cm[classes] = 1
    keys, seed = _seed_pickle(tmp_path / "a.pkl", rng, cm)
    c = rsepm.load_cams(tmp_path / "a.pkl", trust_pickle=True)
    out = rsepm.cams_to_label(c)
    assert out.dtype == torch.long and out.shape == (H, W)
    np.testing.assert_array_equal(out.numpy(), _ref_label(keys, seed, gamma=2.0))
    np.testing.assert_array_equal(rsepm.cams_to_label(c, bg_gamma=1.0).numpy(), _ref_label(keys, seed, gamma=1.0))
    np.testing.assert_array_equal(rsepm.cams_to_label(c, bg_threshold=0.3).numpy(),
                                  _ref_label(keys, seed, bg_th=0.3))
    # raw upstream dict works too
    np.testing.assert_array_equal(rsepm.cams_to_label({"keys": keys, "seed": seed}).numpy(), _ref_label(keys, seed))


def test_cams_to_label_no_class_is_background(tmp_path):
    keys, seed = _seed_pickle(tmp_path / "e.pkl", np.random.default_rng(4), np.zeros(20, np.float32))
    assert keys.tolist() == [0] and seed.shape == (0, H, W)
    out = rsepm.cams_to_label(rsepm.load_cams(tmp_path / "e.pkl", trust_pickle=True))
    assert torch.equal(out, torch.zeros(H, W, dtype=torch.long))


def test_cams_to_label_deeplab_stage_plain_argmax(tmp_path):
    rng = np.random.default_rng(5)
    keys, seed = _deeplab_pickle(tmp_path / "d.pkl", rng)
    c = rsepm.load_cams(tmp_path / "d.pkl", trust_pickle=True)
    ref = _ref_label(keys, seed, gamma=None)  # 'MS' tags: bg_gamma = None (convert...py:22-23)
    np.testing.assert_array_equal(rsepm.cams_to_label(c).numpy(), ref)
    assert set(np.unique(ref)) == {0, 7, 15}
    # bg_* do not apply to DeepLab-stage predictions
    np.testing.assert_array_equal(rsepm.cams_to_label(c, bg_threshold=0.99).numpy(), ref)
    # a single key -> all background (convert_seed_to_pseudo_masks.py:111,132-133)
    one = {"keys": np.array([7]), "seed": seed[1:2]}
    assert torch.equal(rsepm.cams_to_label(one), torch.zeros(H, W, dtype=torch.long))


def test_cams_to_label_with_image_runs_rsepm_crf(tmp_path):
    """image= runs core/refinements/densecrf.py with the 'deeplab' params of convert...py:77-84."""
    dcrf = pytest.importorskip("pydensecrf.densecrf")
    from pydensecrf.utils import unary_from_softmax

    rng = np.random.default_rng(6)
    cm = np.zeros(20, np.float32)
    cm[[4, 14]] = 1
    keys, seed = _seed_pickle(tmp_path / "c.pkl", rng, cm)
    img = rng.integers(0, 256, (H, W, 3), dtype=np.uint8)
    probmap = np.concatenate([np.power(1 - np.max(seed, axis=0, keepdims=True), 2.0), seed], 0)
    d = dcrf.DenseCRF2D(W, H, 3)
    d.setUnaryEnergy(np.ascontiguousarray(unary_from_softmax(probmap)))
    d.addPairwiseGaussian(sxy=1, compat=3)
    d.addPairwiseBilateral(sxy=67, srgb=3, rgbim=np.ascontiguousarray(img), compat=4)
    q = np.array(d.inference(10)).reshape((3, H, W))
    ref = keys[np.argmax(q, axis=0)]
    out = rsepm.cams_to_label(rsepm.load_cams(tmp_path / "c.pkl", trust_pickle=True), image=img)
    np.testing.assert_array_equal(out.numpy(), ref)
    out = rsepm.cams_to_label(rsepm.load_cams(tmp_path / "c.pkl", trust_pickle=True), image=img, crf_backend="pydensecrf")
    np.testing.assert_array_equal(out.numpy(), ref)


def test_bad_pickles_rejected(tmp_path):
    for bad in ({"seed": np.zeros((1, 2, 2), np.float32)},
                {"keys": np.array([0, 1, 2, 3]), "seed": np.zeros((1, 2, 2), np.float32)},
                {"keys": np.array([3, 5]), "seed": np.zeros((1, 2, 2), np.float32)},
                [1, 2]):
        p = tmp_path / "bad.pkl"
        with open(p, "wb") as fh:
            pickle.dump(bad, fh)
        with pytest.raises(ValueError):
            rsepm.load_cams(p, trust_pickle=True)


def test_load_pseudo_labels_p_mode_palette(tmp_path):
    rng = np.random.default_rng(7)
    d = rsepm.pseudo_label_dir(tmp_path / "experiments", "ResNet50@VOC@RS+EPM@Official", "train_aug")
    assert d == tmp_path / "experiments" / "pseudo-labels" / "ResNet50@VOC@RS+EPM@Official" / "train"
    d.mkdir(parents=True)
    saved = {}
    for n in ("2007_000032", "2007_000039"):
        m = rng.integers(0, 21, (H, W)).astype(np.uint8)
        m[0, 0] = 255
        _save_upstream_mask(d / f"{n}.png", m)
        saved[n] = m
    assert Image.open(d / "2007_000032.png").mode == "P"
    got = dict(rsepm.load_pseudo_labels(d))
    assert sorted(got) == sorted(saved)
    for n, m in saved.items():
        np.testing.assert_array_equal(got[n].numpy(), m)
    assert [n for n, _ in rsepm.load_pseudo_labels(d, ids=["2007_000039"])] == ["2007_000039"]


def test_image_labels_voc_xml_difficult_kept_zero_boxes_dropped(tmp_path):
    xml = tmp_path / "train_aug" / "xml"
    xml.mkdir(parents=True)
    _xml(xml / "2007_000032.xml", [("aeroplane", 0, (1, 1, 10, 8)), ("person", 1, (2, 2, 6, 9))])
    # a box clamped to zero width (xmin beyond the image) is dropped, as xml_utils.py:26-32
    _xml(xml / "2007_000039.xml", [("tvmonitor", 0, (3, 3, 9, 9)), ("dog", 0, (40, 2, 50, 9)),
                                   ("cat", 0, (4.0, 2, 4, 9))])
    out = rsepm.load_image_labels(tmp_path / "train_aug")  # the domain folder, or its xml/
    assert set(out) == {"2007_000032", "2007_000039"}
    assert torch.nonzero(out["2007_000032"]).flatten().tolist() == [0, 14]  # difficult person kept
    assert torch.nonzero(out["2007_000039"]).flatten().tolist() == [19]
    assert out["2007_000032"].dtype == torch.bool and out["2007_000032"].shape == (20,)
    assert list(rsepm.load_image_labels(xml, ids=["2007_000039"])) == ["2007_000039"]
    _xml(xml / "bad.xml", [("unicorn", 0, (1, 1, 5, 5))])
    with pytest.raises(ValueError, match="unicorn"):
        rsepm.load_image_labels(xml, ids=["bad"])


def test_coco_81_classes(tmp_path):
    assert len(rsepm.COCO_CLASSES) == 81 and rsepm.COCO_CLASSES[0] == "background"
    assert rsepm.num_classes("COCO") == rsepm.COCO_NUM_CLASSES == 80 and rsepm.num_classes("VOC") == 20
    assert rsepm.COCO_CLASSES.index("traffic light") == 10 and rsepm.COCO_CLASSES[80] == "toothbrush"
    xml = tmp_path / "train" / "xml"
    xml.mkdir(parents=True)
    _xml(xml / "COCO_train2014_000000000009.xml",
         [("traffic light", 0, (1, 1, 5, 5)), ("toothbrush", 0, (2, 2, 8, 8)), ("person", 0, (0, 0, 9, 9))])
    tags = rsepm.load_image_labels(xml, dataset="coco")
    t = tags["COCO_train2014_000000000009"]
    assert t.shape == (80,) and torch.nonzero(t).flatten().tolist() == [0, 9, 79]
    with pytest.raises(ValueError, match="traffic light"):
        rsepm.load_image_labels(xml)  # VOC names do not include it
    # a COCO seed pickle with the last class, its mask written and read back
    cm = np.zeros(80, np.float32)
    cm[[9, 79]] = 1
    keys, seed = _seed_pickle(tmp_path / "c.pkl", np.random.default_rng(9), cm)
    assert keys.tolist() == [0, 10, 80]
    y = rsepm.cams_to_label(rsepm.load_cams(tmp_path / "c.pkl", trust_pickle=True))
    np.testing.assert_array_equal(y.numpy(), _ref_label(keys, seed))
    y[0, 0] = -1
    with pytest.raises(ValueError, match="dataset='coco'"):
        rsepm.write_debiased([("COCO_train2014_000000000009", y)], tmp_path / "out", dry_run=True)
    (p,) = rsepm.write_debiased([("COCO_train2014_000000000009", y)], tmp_path / "out", dataset="coco")
    back = np.asarray(Image.open(p), dtype=np.int64)
    assert back[0, 0] == 254 and set(np.unique(back)) <= {0, 10, 80, 254}
    with pytest.raises(ValueError):
        rsepm.class_names("ade20k")


def test_load_image_list_domain_folder(tmp_path):
    img = tmp_path / "train_aug" / "image"
    img.mkdir(parents=True)
    for n in ("2007_000039", "2007_000032"):
        (img / f"{n}.jpg").write_bytes(b"")
    (img / "notes.txt").write_text("x")
    assert rsepm.load_image_list(tmp_path / "train_aug") == ["2007_000032", "2007_000039"]
    assert rsepm.load_image_list(img) == ["2007_000032", "2007_000039"]
    lst = tmp_path / "ids.txt"
    lst.write_text("2007_000032\n\n2007_000039\n")
    assert rsepm.load_image_list(lst) == ["2007_000032", "2007_000039"]


def test_write_debiased_round_trip_and_dry_run(tmp_path):
    y = torch.tensor([[0, 5, -1], [255, 20, -1]])
    out = rsepm.pseudo_label_dir(tmp_path, "tag@MARS")
    assert rsepm.write_debiased([("2007_000032", y)], out, dry_run=True) == [out / "2007_000032.png"]
    assert not out.exists()
    (p,) = rsepm.write_debiased([("2007_000032", y)], out)
    im = Image.open(p)
    assert im.mode == rsepm.LABEL_MODE == "P"
    pal = np.asarray(im.getpalette()[: 3 * 256], dtype=np.uint8).reshape(-1, 3)
    ref = _upstream_palette(21)
    np.testing.assert_array_equal(pal[:21], ref[:21])  # class colours as RS+EPM writes them
    np.testing.assert_array_equal(pal[255], ref[255])  # ignore colour (224, 224, 192)
    back = np.asarray(Image.open(p), dtype=np.int64)  # abc_modules.get_mask + augment_utils.Normalize
    np.testing.assert_array_equal(back, [[0, 5, 254], [255, 20, 254]])
    for bad_value in (3, 20, 256, True):
        with pytest.raises(ValueError, match="biased_value"):
            rsepm.write_debiased([("x", y)], out, biased_value=bad_value)
    with pytest.raises(ValueError, match="expected -1"):
        rsepm.write_debiased([("x", torch.tensor([[0, 21]]))], out, dry_run=True)
    assert not (out / "x.png").exists()


def test_module_constants():
    assert rsepm.NAME == "rsepm" and rsepm.NUM_CLASSES == 20 and rsepm.BG_GAMMA == 2.0
    assert rsepm.CLASS_NAMES[0] == "background" and len(rsepm.CLASS_NAMES) == 21


def test_three_calls_on_rsepm_fixtures(tmp_path):
    """xml tags + P-mode masks -> select_centroids -> debias_labels -> write_debiased, read back
    as Dataset_For_Segmentation(tag=...) reads them."""
    rng = np.random.default_rng(8)
    root = tmp_path / "VOC2012"
    (root / "train_aug" / "image").mkdir(parents=True)
    (root / "train_aug" / "xml").mkdir(parents=True)
    masks = rsepm.pseudo_label_dir(tmp_path / "experiments", "RS+EPM")
    masks.mkdir(parents=True)
    feats = {}
    names = ["2007_000032", "2007_000039", "2007_000063", "2007_000068"]
    for i, n in enumerate(names):
        c = (1, 19)[i % 2]
        (root / "train_aug" / "image" / f"{n}.jpg").write_bytes(b"")
        _xml(root / "train_aug" / "xml" / f"{n}.xml", [(rsepm.CLASS_NAMES[c], 0, (4, 3, 12, 9))])
        m = np.zeros((H, W), np.uint8)
        m[3:9, 4:12] = c
        m[-1, :] = 255
        _save_upstream_mask(masks / f"{n}.png", m)
        feats[n] = torch.from_numpy(rng.standard_normal((8, H // 2, W // 2)).astype(np.float32))

    ids = rsepm.load_image_list(root / "train_aug")
    tags = rsepm.load_image_labels(root / "train_aug", ids=ids)
    V = select_centroids(((feats[n], y) for n, y in rsepm.load_pseudo_labels(masks, ids=ids)),
                         num_classes=rsepm.NUM_CLASSES)
    debiased = ((n, debias_labels(feats[n], y, V, tags[n], refine="threshold"))
                for n, y in rsepm.load_pseudo_labels(masks, ids=ids))
    out = rsepm.pseudo_label_dir(tmp_path / "experiments", "RS+EPM@MARS")
    paths = rsepm.write_debiased(debiased, out)
    assert [p.stem for p in paths] == ids
    removed = 0
    for n, p in zip(ids, paths):
        # core/datasets.py:121-122 + abc_modules.py:103-109 + augment_utils.py:358-359
        back = np.asarray(Image.open(str(out) + "/" + n + ".png"), dtype=np.int64)
        orig = np.asarray(Image.open(masks / f"{n}.png"), dtype=np.int64)
        assert Image.open(p).mode == "P" and back.shape == orig.shape
        keep = back != 254
        np.testing.assert_array_equal(back[keep], orig[keep])
        assert np.all(orig[~keep] > 0) and np.all(orig[~keep] != 255)
        removed += int((~keep).sum())
    assert removed > 0
