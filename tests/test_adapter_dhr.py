"""DHR adapter on tiny trees in DHR's own layout (shjo-april/DHR @94d5189).

Fixtures are written the way DHR's tree holds them: ``<root>/VOC2012/<domain>/{image,xml}``,
the dataset json ``<root>/VOC2012/VOC2012.json`` (``names``, ``ignore``), WSS masks under
``<root>/WSS/VOC2012/<method>/<domain>/`` written like ``produce_wss_masks.py:73-75`` (P mode,
``cv_utils.get_colors`` palette), prediction ``.pt`` files like ``produce_wss_masks.py:48``.
Masks are read back the way DHR reads them: from the DHR checkout, the relative path
``../WSS/<data>/<wss>/<domain>/`` (core/datasets.py:89), ``Image.open`` (:39) and
``np.asarray(..., dtype=np.int64)`` (tools/transforms.py:252-253). Tags are checked against a
plain re-implementation of ``tools/xml_utils.py:6-9``.
"""
from __future__ import annotations

import json
import os
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from mars_plugin import debias_labels, select_centroids
from mars_plugin.adapters.wsss import dhr, rsepm
from mars_plugin.formats.files import read_label

H, W = 12, 16
ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "adapters.md"


# ----------------------------------------------------------------------------- upstream-shaped fixtures
def _get_colors(num_classes, ignore_index=255):
    """tools/cv_utils.py:55-76 for VOC: bit-interleaved colours, black, (224, 224, 192) at 255."""
    colors = []
    for i in range(num_classes):
        r = g = b = 0
        c = i
        for j in range(8):
            r |= ((c >> 0) & 1) << (7 - j)
            g |= ((c >> 1) & 1) << (7 - j)
            b |= ((c >> 2) & 1) << (7 - j)
            c >>= 3
        colors.append([r, g, b])
    while len(colors) < ignore_index:
        colors.append([0, 0, 0])
    colors.append([224, 224, 192])
    return np.asarray(colors, dtype=np.uint8)


def _save_dhr_mask(path, mask, num_classes=21):
    """produce_wss_masks.py:73-75 (putpalette of the (256, 3) colours; flat for current Pillow)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    image = Image.fromarray(mask.astype(np.uint8)).convert("P")
    image.putpalette(_get_colors(num_classes).tobytes())
    image.save(path)


def _xml(path, objects, width=W, height=H):
    """(name, difficult, (xmin, ymin, xmax, ymax)) objects; a person gets a <part><name>."""
    path.parent.mkdir(parents=True, exist_ok=True)
    objs = "".join(
        f"<object><name>{n}</name><difficult>{d}</difficult>"
        f"<bndbox><xmin>{b[0]}</xmin><ymin>{b[1]}</ymin><xmax>{b[2]}</xmax><ymax>{b[3]}</ymax></bndbox>"
        + ("<part><name>head</name><bndbox><xmin>1</xmin><ymin>1</ymin><xmax>3</xmax><ymax>3</ymax></bndbox></part>"
           if n == "person" else "")
        + "</object>"
        for n, d, b in objects
    )
    path.write_text(f"<annotation><size><width>{width}</width><height>{height}</height><depth>3</depth></size>"
                    f"{objs}</annotation>")


def _jpg(path, h=H, w=W, seed=0):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(path)


def _upstream_read_tags(path):
    """tools/xml_utils.py:6-9, as written there."""
    root = ET.parse(path).getroot()
    tags = [obj.find("name").text for obj in root.findall("object")]
    return list(np.unique(tags))


def _dhr_read_mask(dhr_checkout, data, wss, domain, image_name):
    """core/datasets.py:39,89 + tools/transforms.py:252-253, from the DHR checkout (cwd)."""
    old = os.getcwd()
    os.chdir(dhr_checkout)
    try:
        mask_dir = f"../WSS/{data}/{wss}/{domain}/"
        mask = Image.open(mask_dir + image_name.replace(".jpg", ".png"))
        return mask.mode, np.asarray(mask, dtype=np.int64), mask
    finally:
        os.chdir(old)


def _tree(tmp_path, tags, *, json_names=None, ignore=255):
    """<root>/DHR (the checkout), <root>/VOC2012/train_aug/{image,xml}, optional VOC2012.json."""
    root = tmp_path / "root"
    (root / "DHR").mkdir(parents=True)
    layout = dhr.DHRLayout(root)
    for k, (i, objs) in enumerate(tags.items()):
        _jpg(layout.image_dir() / f"{i}.jpg", seed=k)
        _xml(layout.xml_dir() / f"{i}.xml", objs)
    if json_names is not None:
        layout.dataset_json.write_text(json.dumps({"names": list(json_names), "ignore": ignore}))
    return layout


# ----------------------------------------------------------------------------- layout
def test_layout_paths(tmp_path):
    L = dhr.DHRLayout(tmp_path)
    assert L.root == tmp_path and L.data == "VOC2012"
    assert L.image_dir("train_aug") == tmp_path / "VOC2012" / "train_aug" / "image"
    assert L.mask_dir("validation") == tmp_path / "VOC2012" / "validation" / "mask"
    assert L.xml_dir("train_aug") == tmp_path / "VOC2012" / "train_aug" / "xml"
    assert L.uss_dir("train_aug") == tmp_path / "VOC2012" / "train_aug" / "STEGO"
    assert L.uss_dir("train_aug", "CAUSE") == tmp_path / "VOC2012" / "train_aug" / "CAUSE"
    assert L.wss_dir("MARS", "train_aug") == tmp_path / "WSS" / "VOC2012" / "MARS" / "train_aug"
    assert L.dataset_json == tmp_path / "VOC2012" / "VOC2012.json"
    c = dhr.DHRLayout(str(tmp_path), "COCO2014")
    assert isinstance(c.root, Path) and c.wss_dir("DHR", "train") == tmp_path / "WSS" / "COCO2014" / "DHR" / "train"
    assert c.dataset_json == tmp_path / "COCO2014" / "COCO2014.json"
    with pytest.raises(ValueError, match="not a plain file name"):
        dhr.DHRLayout(tmp_path, "../VOC2012")
    with pytest.raises(ValueError, match="not a plain file name"):
        L.wss_dir("MARS/../x")
    with pytest.raises(ValueError, match="root must be a path"):
        dhr.DHRLayout(3)
    with pytest.raises(Exception):  # frozen
        L.data = "x"


def test_ids_in_listdir_order_and_empty_tags_rejected(tmp_path):
    names = [f"2007_{n:06d}" for n in (63, 32, 901, 39, 5, 777, 123, 68, 2, 450, 11, 300)]
    tags = {n: [("dog", 0, (1, 1, 9, 9))] for n in names}
    tags[names[3]] = []  # no object: reject_empty_tags drops it (core/datasets.py:48-61)
    L = _tree(tmp_path, tags)
    listed = [f[:-4] for f in os.listdir(L.image_dir())]
    assert L.ids("train_aug", tagged_only=False) == listed
    assert L.ids("train_aug") == [n for n in listed if n != names[3]]
    assert L.ids("train_aug", sort=True) == sorted(set(names) - {names[3]})
    assert dhr.load_image_list(L.domain_dir("train_aug")) == listed
    assert dhr.load_image_list(L.image_dir(), sort=True) == sorted(names)
    lst = tmp_path / "ids.txt"
    lst.write_text("2007_000032\n\n/image/2007_000039.jpg x\n")
    assert dhr.load_image_list(lst) == ["2007_000032", "2007_000039"]
    # DHR lists every entry of image/ and would open it as an image: refused, named
    (L.image_dir() / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match="notes.txt"):
        L.ids("train_aug")
    (L.image_dir() / "notes.txt").unlink()
    (L.image_dir() / "sub.jpg").mkdir()
    with pytest.raises(ValueError, match="sub.jpg"):
        dhr.load_image_list(L.image_dir())
    (L.image_dir() / "sub.jpg").rmdir()
    # an id with no xml, for the tag filter
    _jpg(L.image_dir() / "2007_999999.jpg")
    with pytest.raises(ValueError, match="2007_999999.xml"):
        L.ids("train_aug")


# ----------------------------------------------------------------------------- tags
def test_tags_read_like_xml_utils_difficult_and_zero_box_kept(tmp_path):
    xml = tmp_path / "VOC2012" / "train_aug" / "xml"
    objs = [("person", 1, (2, 2, 6, 9)), ("aeroplane", 0, (1, 1, 10, 8)), ("cat", 0, (4, 2, 4, 9)),
            ("aeroplane", 0, (3, 3, 5, 5)), ("dog", 0, (40, 2, 50, 9))]
    _xml(xml / "2007_000032.xml", objs)
    p = xml / "2007_000032.xml"
    assert dhr.read_tags(p) == _upstream_read_tags(p) == ["aeroplane", "cat", "dog", "person"]
    out = dhr.load_image_labels(tmp_path / "VOC2012" / "train_aug")  # the domain folder, or its xml/
    t = out["2007_000032"]
    assert t.dtype == torch.bool and t.shape == (20,)
    expected = [dhr.CLASS_NAMES.index(n) - 1 for n in ("aeroplane", "cat", "dog", "person")]
    assert torch.nonzero(t).flatten().tolist() == sorted(expected)
    # RS+EPM's reader drops the zero-width cat and the box beyond the image (xml_utils.py:26-32 there)
    r = rsepm.load_image_labels(xml)["2007_000032"]
    assert torch.nonzero(t & ~r).flatten().tolist() == sorted([dhr.CLASS_NAMES.index("cat") - 1,
                                                                 dhr.CLASS_NAMES.index("dog") - 1])
    # a background tag sets nothing (core/datasets.py:96-97); unknown or unstripped names are errors
    _xml(xml / "bg.xml", [("background", 0, (1, 1, 5, 5)), ("sheep", 0, (1, 1, 5, 5))])
    assert torch.nonzero(dhr.load_image_labels(xml, ids=["bg"])["bg"]).flatten().tolist() == [16]
    _xml(xml / "ws.xml", [(" dog ", 0, (1, 1, 5, 5))])
    with pytest.raises(ValueError, match=r"ws\.xml.*' dog '.*unstripped"):
        dhr.load_image_labels(xml, ids=["ws"])
    _xml(xml / "bad.xml", [("unicorn", 0, (1, 1, 5, 5))])
    with pytest.raises(ValueError, match=r"bad\.xml.*unicorn"):
        dhr.load_image_labels(xml, ids=["bad"])
    (xml / "broken.xml").write_text("<annotation><object>")
    with pytest.raises(ValueError, match=r"broken\.xml"):
        dhr.read_tags(xml / "broken.xml")
    (xml / "noname.xml").write_text("<annotation><object><bndbox/></object></annotation>")
    with pytest.raises(ValueError, match=r"noname\.xml.*<name>"):
        dhr.read_tags(xml / "noname.xml")
    with pytest.raises(ValueError, match="missing annotation"):
        dhr.load_image_labels(xml, ids=["nope"])


def test_image_labels_from_a_layout_and_its_json(tmp_path):
    names = ["background", "cat", "dog", "traffic light"]
    L = _tree(tmp_path, {"a": [("traffic light", 0, (1, 1, 5, 5))], "b": [("cat", 1, (1, 1, 5, 5)), ("dog", 0, (0, 0, 0, 0))],
                         "c": []}, json_names=names)
    assert L.class_names() == tuple(names) and L.class_names(3) == tuple(names)
    want = {"a": [2], "b": [0, 1], "c": []}
    for got in (dhr.load_image_labels(L), dhr.load_image_labels(L.xml_dir())):  # the json is found beside xml/
        assert set(got) == set(want)
        for i, idx in want.items():
            assert got[i].shape == (3,) and torch.nonzero(got[i]).flatten().tolist() == idx
    # explicit names win over the json
    got = dhr.load_image_labels(L.xml_dir(), class_names=["background", "dog", "cat", "traffic light", "x"])
    assert torch.nonzero(got["b"]).flatten().tolist() == [0, 1] and got["b"].shape == (4,)
    with pytest.raises(ValueError, match=r"VOC2012\.json.*4 names.*num_classes=20"):
        L.class_names(20)


def test_dataset_json_checks(tmp_path):
    L = dhr.DHRLayout(tmp_path)
    assert L.class_names() == dhr.CLASS_NAMES and L.class_names(20) == dhr.CLASS_NAMES and L.ignore_value() == 255
    with pytest.raises(ValueError, match="no dataset json found.*21 names.*num_classes=80"):
        L.class_names(80)
    with pytest.raises(ValueError, match=r"COCO2014\.json: no dataset json"):
        dhr.DHRLayout(tmp_path, "COCO2014").class_names()
    L.dataset_json.parent.mkdir(parents=True)
    for bad, msg in (({"names": ["background", "a"]}, r"no \['ignore'\]"),
                     ({"names": ["a", "background"], "ignore": 255}, "must start with 'background'"),
                     ({"names": ["background", "a", "a"], "ignore": 255}, "repeats"),
                     ({"names": "background", "ignore": 255}, "list of strings"),
                     ([1, 2], "must be an object")):
        L.dataset_json.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=msg) as e:
            L.class_names()
        assert "VOC2012.json" in str(e.value)
    L.dataset_json.write_text("{not json")
    with pytest.raises(ValueError, match=r"VOC2012\.json: cannot read"):
        L.class_names()
    L.dataset_json.write_text(json.dumps({"names": list(dhr.CLASS_NAMES), "ignore": 0}))
    with pytest.raises(ValueError, match=r"'ignore' is 0.*255"):
        L.ignore_value()
    with pytest.raises(ValueError, match=r"'ignore' is 0"):
        dhr.write_masks([("a", torch.zeros(2, 2, dtype=torch.long))], L, dry_run=True)


# ----------------------------------------------------------------------------- masks
def test_load_pseudo_labels_of_a_wss_folder(tmp_path):
    rng = np.random.default_rng(7)
    L = dhr.DHRLayout(tmp_path)
    saved = {}
    for n in ("2007_000039", "2007_000032"):
        m = rng.integers(0, 21, (H, W)).astype(np.uint8)
        m[0, :3] = 255
        _save_dhr_mask(L.wss_dir("RSEPM") / f"{n}.png", m)
        saved[n] = m
    got = list(dhr.load_pseudo_labels(L.wss_dir("RSEPM")))
    assert [n for n, _ in got] == ["2007_000032", "2007_000039"]
    for n, y in got:
        assert y.dtype == torch.long
        np.testing.assert_array_equal(y.numpy(), saved[n])
    assert [n for n, _ in dhr.load_pseudo_labels(L.wss_dir("RSEPM"), ids=["2007_000039"])] == ["2007_000039"]
    (n, y), = dhr.load_pseudo_labels(L.wss_dir("RSEPM") / "2007_000039.png")
    assert n == "2007_000039" and np.array_equal(y.numpy(), saved[n])
    with pytest.raises(ValueError, match="missing label"):
        list(dhr.load_pseudo_labels(L.wss_dir("RSEPM"), ids=["nope"]))
    with pytest.raises(ValueError, match="no such file or folder"):
        list(dhr.load_pseudo_labels(tmp_path / "absent"))


def test_write_masks_round_trip_read_the_dhr_way(tmp_path):
    L = _tree(tmp_path, {"2007_000032": [("dog", 0, (1, 1, 9, 9))], "2007_000039": [("cat", 0, (1, 1, 9, 9))]})
    rng = np.random.default_rng(1)
    ys = {}
    for n in ("2007_000032", "2007_000039"):
        y = torch.from_numpy(rng.integers(0, 21, (H, W)))
        y[0, :4] = torch.tensor([-1, 255, 20, 0])
        y[rng.random((H, W)) < 0.2] = -1
        ys[n] = y
    paths = dhr.write_masks(ys.items(), L, "MARS", "train_aug")
    assert paths == [L.wss_dir("MARS", "train_aug") / f"{n}.png" for n in ys]
    pal = _get_colors(21)
    for n, y in ys.items():
        mode, back, im = _dhr_read_mask(L.root / "DHR", "VOC2012", "MARS", "train_aug", f"{n}.jpg")
        assert mode == "P" and back.dtype == np.int64
        expected = y.numpy().copy()
        expected[expected == -1] = 255  # biased -> DHR's ignore
        np.testing.assert_array_equal(back, expected)
        written = np.asarray(im.getpalette()[: 3 * 256], dtype=np.uint8).reshape(-1, 3)
        np.testing.assert_array_equal(written[:21], pal[:21])  # class colours as get_colors
        np.testing.assert_array_equal(written[255], pal[255])
        # DHR's loss takes the file as it is (train.py:95) ...
        torch.nn.CrossEntropyLoss(ignore_index=255)(torch.zeros(1, 21, H, W), torch.from_numpy(back)[None])
    # ... and would not take a 254 (why write_masks maps -1 to 255, not to 254)
    with pytest.raises(IndexError, match="254"):
        torch.nn.CrossEntropyLoss(ignore_index=255)(torch.zeros(1, 21, H, W), torch.full((1, H, W), 254))


def test_write_masks_refusals(tmp_path):
    L = _tree(tmp_path, {"a": [("dog", 0, (1, 1, 9, 9))]})
    out = L.wss_dir("MARS")
    y = torch.zeros(H, W, dtype=torch.long)
    y[0, 0] = -1
    with pytest.raises(ValueError, match="biased='refuse'"):
        dhr.write_masks([("a", y)], L, biased="refuse")
    assert not out.exists()
    (p,) = dhr.write_masks([("a", y.clamp(min=0))], L, biased="refuse")  # no -1: fine
    assert p.is_file()
    p.unlink()
    for bad in (254, 21, -2, 256):
        z = y.clone()
        z[1, 1] = bad
        with pytest.raises(ValueError, match=rf"label of a holds \[{bad}\].*0\.\.20 or 255"):
            dhr.write_masks([("a", z)], L)
    with pytest.raises(ValueError, match="integer"):
        dhr.write_masks([("a", y.float())], L)
    with pytest.raises(ValueError, match="biased must be"):
        dhr.write_masks([("a", y)], L, biased="keep")
    # a mask that is not its image's size: named with the image
    with pytest.raises(ValueError, match=r"\(6, 8\).*a\.jpg.*\(12, 16\)"):
        dhr.write_masks([("a", torch.zeros(6, 8, dtype=torch.long))], L)
    assert dhr.write_masks([("a", torch.zeros(6, 8, dtype=torch.long))], L, check_sizes=False, dry_run=True)
    assert not any(out.glob("*.png"))
    # unsafe ids: refused in a dry run too, nothing written anywhere
    for stem in ("../x", "a/b", "", ".", "..", "a\0b"):
        for dry_run in (True, False):
            with pytest.raises(ValueError, match="not a plain file name"):
                dhr.write_masks([(stem, torch.zeros(2, 2, dtype=torch.long))], L, dry_run=dry_run)
            with pytest.raises(ValueError, match="not a plain file name"):
                dhr.write_debiased([(stem, torch.zeros(2, 2, dtype=torch.long))], tmp_path / "deb", dry_run=dry_run)
    assert not (tmp_path / "deb").exists() and not any(out.glob("*")) and not (tmp_path / "root" / "WSS" / "x.png").exists()
    # dry run: paths, no files
    assert dhr.write_masks([("a", y)], L, dry_run=True) == [out / "a.png"] and not (out / "a.png").exists()
    # a plain folder with another class count; the json's count rules for a layout
    (q,) = dhr.write_masks([("c", torch.tensor([[80, -1]]))], tmp_path / "coco", num_classes=80)
    assert np.asarray(Image.open(q), dtype=np.int64).tolist() == [[80, 255]]
    with pytest.raises(ValueError, match="0..20 or 255"):
        dhr.write_masks([("c", torch.tensor([[80]]))], tmp_path / "coco")
    with pytest.raises(ValueError, match="num_classes=80"):
        dhr.write_masks([("a", y)], L, num_classes=80)
    with pytest.raises(ValueError, match="layout_or_dir"):
        dhr.write_masks([("a", y)], 3)


def test_write_debiased_like_rsepm(tmp_path):
    y = torch.tensor([[0, 5, -1], [255, 20, -1]])
    (p,) = dhr.write_debiased([("2007_000032", y)], tmp_path / "dhr")
    (q,) = rsepm.write_debiased([("2007_000032", y)], tmp_path / "rsepm")
    assert p.read_bytes() == q.read_bytes()  # one format for both of the authors' repositories
    assert Image.open(p).mode == dhr.LABEL_MODE == "P"
    np.testing.assert_array_equal(np.asarray(Image.open(p), dtype=np.int64), [[0, 5, 254], [255, 20, 254]])
    assert torch.equal(read_label(p), y)
    for bad_value in (3, 20, 256, True):
        with pytest.raises(ValueError, match="biased_value"):
            dhr.write_debiased([("x", y)], tmp_path / "dhr", biased_value=bad_value)
    with pytest.raises(ValueError, match="expected -1"):
        dhr.write_debiased([("x", torch.tensor([[0, 21]]))], tmp_path / "dhr")
    (r,) = dhr.write_debiased([("x", torch.tensor([[0, 80, -1]]))], tmp_path / "coco", num_classes=80)
    assert np.asarray(Image.open(r), dtype=np.int64).tolist() == [[0, 80, 254]]
    with pytest.raises(ValueError, match="num_classes"):
        dhr.write_debiased([("x", y)], tmp_path / "dhr", num_classes=254)
    assert dhr.write_debiased([("z", y)], tmp_path / "dry", dry_run=True) == [tmp_path / "dry" / "z.png"]
    assert not (tmp_path / "dry").exists()


# ----------------------------------------------------------------------------- predictions
def _prediction(path, rng, num_classes=21, present=(0, 7, 15), h=H, w=W):
    """produce_wss_masks.py:39-48: softmax of all classes, keys = classes reaching 0.05, fp16 maps."""
    logits = rng.standard_normal((num_classes, h, w)).astype(np.float32) * 0.5
    logits[[c for c in range(num_classes) if c not in present]] -= 20.0
    e = np.exp(logits - logits.max(0, keepdims=True))
    pred_mask = e / e.sum(0, keepdims=True)
    class_mask = pred_mask.reshape(num_classes, -1).max(1) > 0.05
    class_keys = np.nonzero(class_mask)[0]
    masks = pred_mask[class_mask].astype(np.float16)
    torch.save({"keys": class_keys, "masks": masks}, path)
    return class_keys, masks


def test_load_cams_needs_opt_in_for_dhr_numpy_files(tmp_path):
    keys, masks = _prediction(tmp_path / "2007_000032.pt", np.random.default_rng(2))
    assert keys.tolist() == [0, 7, 15]
    with pytest.raises(PermissionError, match="trust_pickle"):
        dhr.load_cams(tmp_path / "2007_000032.pt")
    c = dhr.load_cams(tmp_path / "2007_000032.pt", trust_pickle=True)
    assert c["id"] == "2007_000032" and c["kind"] == "dhr" and c["includes_background"] is True
    assert c["keys"].dtype == torch.long and c["keys"].tolist() == [0, 7, 15] and c["size"] == (H, W)
    np.testing.assert_array_equal(c["cam"].numpy(), masks.astype(np.float32))
    # tensors only: read with weights_only=True, no opt-in needed
    torch.save({"keys": torch.from_numpy(keys), "masks": torch.from_numpy(masks)}, tmp_path / "t.pt")
    assert torch.equal(dhr.load_cams(tmp_path / "t.pt")["cam"], c["cam"])
    assert [s for s, _ in dhr.iter_cams(tmp_path, trust_pickle=True)] == ["2007_000032", "t"]
    (tmp_path / "junk.pt").write_bytes(b"not a torch file")
    with pytest.raises(ValueError, match=r"junk\.pt"):
        dhr.load_cams(tmp_path / "junk.pt", trust_pickle=True)
    for bad, msg in (({"keys": torch.tensor([0, 1])}, "'keys' and 'masks'"),
                     ({"keys": torch.tensor([0, 1]), "masks": torch.zeros(3, 2, 2)}, "2 keys and 3 maps"),
                     ({"keys": torch.tensor([0.5]), "masks": torch.zeros(1, 2, 2)}, "integer"),
                     ({"keys": torch.tensor([300]), "masks": torch.zeros(1, 2, 2)}, "0..253"),
                     ({"keys": torch.tensor([0]), "masks": torch.zeros(2, 2)}, r"\(K, H, W\)")):
        torch.save(bad, tmp_path / "bad.pt")
        with pytest.raises(ValueError, match=msg):
            dhr.load_cams(tmp_path / "bad.pt")


def test_cams_to_label_argmax_through_keys(tmp_path):
    rng = np.random.default_rng(3)
    keys, masks = _prediction(tmp_path / "p.pt", rng)
    ref = keys[np.argmax(masks.astype(np.float32), axis=0)]
    out = dhr.cams_to_label(dhr.load_cams(tmp_path / "p.pt", trust_pickle=True))
    assert out.dtype == torch.long and out.shape == (H, W)
    np.testing.assert_array_equal(out.numpy(), ref)
    assert set(np.unique(ref)) == {0, 7, 15}
    np.testing.assert_array_equal(dhr.cams_to_label({"keys": keys, "masks": masks}).numpy(), ref)  # raw dict
    with pytest.raises(ValueError, match="K = 0"):
        dhr.cams_to_label({"keys": np.zeros(0, np.int64), "masks": np.zeros((0, 2, 2), np.float16)})
    with pytest.raises(ValueError, match=r"\(H, W, 3\)"):
        dhr.cams_to_label({"keys": keys, "masks": masks}, image=np.zeros((H, W), np.uint8))


def test_cams_to_label_with_image_is_dhr_crf(tmp_path):
    """produce_wss_masks.py:56-71 with DenseCRF(for_seg=True) (core/refinements/densecrf.py)."""
    dcrf = pytest.importorskip("pydensecrf.densecrf")
    from pydensecrf.utils import unary_from_softmax

    rng = np.random.default_rng(4)
    keys, masks = _prediction(tmp_path / "p.pt", rng, h=H // 2, w=W // 2)  # smaller than the image
    img = rng.integers(0, 256, (H, W, 3), dtype=np.uint8)
    up = torch.nn.functional.interpolate(torch.from_numpy(masks.astype(np.float32))[None], (H, W), mode="bilinear",
                                         align_corners=True)[0].numpy()  # tools/torch_utils.py:45 defaults
    d = dcrf.DenseCRF2D(W, H, len(keys))
    d.setUnaryEnergy(np.ascontiguousarray(unary_from_softmax(up)))
    d.addPairwiseGaussian(sxy=1, compat=3)
    d.addPairwiseBilateral(sxy=67, srgb=3, rgbim=np.ascontiguousarray(img), compat=4)
    ref = keys[np.argmax(np.array(d.inference(10)).reshape((len(keys), H, W)), axis=0)]
    c = dhr.load_cams(tmp_path / "p.pt", trust_pickle=True)
    np.testing.assert_array_equal(dhr.cams_to_label(c, image=img, crf_backend="pydensecrf").numpy(), ref)
    np.testing.assert_array_equal(dhr.cams_to_label(c, image=img).numpy(), ref)


def test_module_constants():
    assert dhr.NAME == "dhr" and dhr.NUM_CLASSES == 20 and dhr.LABEL_MODE == "P" and dhr.IGNORE == 255
    assert dhr.CLASS_NAMES[0] == "background" and len(dhr.CLASS_NAMES) == 21
    # core/refinements/densecrf.py:10 defaults
    assert dhr.CRF_PARAMS == {"iterations": 10, "gaussian_sxy": 1, "gaussian_compat": 3, "bilateral_sxy": 67,
                              "bilateral_srgb": 3, "bilateral_compat": 4}
    for name in ("load_pseudo_labels", "load_cams", "cams_to_label", "load_image_labels", "load_image_list",
                 "write_debiased"):
        assert callable(getattr(dhr, name)) and callable(getattr(rsepm, name))


# ----------------------------------------------------------------------------- the recipe
def _dhr_fixture(tmp_path, rng):
    """A DHR tree: images, xml, RS+EPM masks in WSS/VOC2012/RSEPM/train_aug, STEGO .pt features."""
    names = ["2007_000032", "2007_000039", "2007_000063", "2007_000068"]
    L = _tree(tmp_path, {n: [(dhr.CLASS_NAMES[(1, 19)[k % 2]], 0, (4, 3, 12, 9))] for k, n in enumerate(names)},
              json_names=dhr.CLASS_NAMES)
    L.uss_dir("train_aug").mkdir(parents=True)
    for k, n in enumerate(names):
        c = (1, 19)[k % 2]
        m = np.zeros((H, W), np.uint8)
        m[3:9, 4:12] = c
        m[-1, :] = 255
        _save_dhr_mask(L.wss_dir("RSEPM") / f"{n}.png", m)
        # produce_uss_features.py:34: torch.save(f_us.half().cpu(), path)
        torch.save(torch.from_numpy(rng.standard_normal((8, H // 2, W // 2)).astype(np.float32)).half(),
                   L.uss_dir("train_aug") / f"{n}.pt")
    return L, names


def test_recipe_calls_on_a_dhr_tree(tmp_path):
    """RS+EPM masks -> centroids on DHR's .pt features -> debias -> write_debiased (254) and
    write_masks (255), read back as DHR reads its WSS masks."""
    rng = np.random.default_rng(8)
    L, names = _dhr_fixture(tmp_path, rng)
    ids = L.ids("train_aug", sort=True)
    assert ids == sorted(names)
    feat = {i: torch.load(L.uss_dir("train_aug") / f"{i}.pt", weights_only=True).float() for i in ids}
    tags = dhr.load_image_labels(L)
    V = select_centroids(((feat[i], y) for i, y in dhr.load_pseudo_labels(L.wss_dir("RSEPM"), ids=ids)),
                         num_classes=dhr.NUM_CLASSES)
    debiased = dict((i, debias_labels(feat[i], y, V, tags[i], refine="threshold"))
                    for i, y in dhr.load_pseudo_labels(L.wss_dir("RSEPM"), ids=ids))
    assert sum(int((y == -1).sum()) for y in debiased.values()) > 0
    deb_dir = L.root / "MARS" / "VOC2012" / "debiased" / "train_aug"
    dhr.write_debiased(debiased.items(), deb_dir)
    # the shortcut block of the docs, as written
    block = _doc_block("MARS-debiased")
    exec(compile(block.replace("<root>", str(L.root)), str(DOC), "exec"), {})
    for i in ids:
        orig = np.asarray(Image.open(L.wss_dir("RSEPM") / f"{i}.png"), dtype=np.int64)
        mode, back, _ = _dhr_read_mask(L.root / "DHR", "VOC2012", "MARS-debiased", "train_aug", f"{i}.jpg")
        biased = debiased[i].numpy() == -1
        assert mode == "P" and not (back == 254).any()
        np.testing.assert_array_equal(back[biased], 255)
        np.testing.assert_array_equal(back[~biased], orig[~biased])


def _doc_block(marker: str) -> str:
    """The python block of the docs' DHR section that contains ``marker``."""
    text = DOC.read_text()
    start = text.index("## DHR: RS+EPM pseudo labels -> MARS -> DHR train.py --wss MARS")
    section = text[start:text.index("\n## ", start + 1)]
    blocks = [b for b in re.findall(r"```python\n(.*?)```", section, flags=re.S) if marker in b]
    assert len(blocks) == 1, marker
    return blocks[0]


@pytest.mark.slow
def test_own_loop_runs_on_dhr_files(tmp_path, monkeypatch):
    """The docs' own training loop with the DHR set-up lines in place of its three."""
    rng = np.random.default_rng(9)
    L, names = _dhr_fixture(tmp_path, rng)
    deb_dir = L.root / "MARS" / "VOC2012" / "debiased" / "train_aug"
    ys = {}
    for i, (n, y) in enumerate(dhr.load_pseudo_labels(L.wss_dir("RSEPM"))):
        y = y.clone()
        y[(torch.rand(H, W, generator=torch.Generator().manual_seed(i)) < 0.2) & (y > 0) & (y < 255)] = -1
        y[2, 5] = -1
        ys[n] = y
    dhr.write_debiased(ys.items(), deb_dir)
    text = DOC.read_text()
    start = text.index("### The training hook in your own loop")
    loop = re.findall(r"```python\n(.*?)```", text[start:text.index("\n### ", start + 1)], flags=re.S)[0]
    setup = _doc_block("dhr.load_image_labels(layout)").replace("<root>", str(L.root))
    lines = loop.split("\n")
    first = next(k for k, line in enumerate(lines) if line.startswith("labels = "))
    assert [line.split(" =")[0] for line in lines[first : first + 3]] == ["labels", "classes", "image_dir"]
    scope: dict = {}
    monkeypatch.chdir(tmp_path)
    exec(compile("\n".join(lines[:first] + [setup] + lines[first + 3 :]), str(DOC), "exec"), scope)
    assert torch.isfinite(scope["loss"]) and set(scope["labels"]) == set(names)
    assert any((y == 254).any() for y in scope["labels"].values())  # the stored 254 reached the hook
    for n in names:
        assert scope["classes"][n].tolist() == dhr.load_image_labels(L.xml_dir())[n].tolist()


def test_cli_wsss_dhr_reads_tags_and_json(tmp_path):
    """``mars centroids --wsss dhr --image-labels <xml>``: tags through this adapter."""
    from mars_plugin import cli
    from mars_plugin.commands import label_formats
    rng = np.random.default_rng(10)
    L, names = _dhr_fixture(tmp_path, rng)
    assert "dhr" in label_formats.WSSS_ADAPTERS
    got = label_formats.label_format("dhr").image_labels(L.xml_dir(), 20)
    assert got == {n: [(1, 19)[k % 2]] for k, n in enumerate(names)}
    feats = tmp_path / "npy"
    feats.mkdir()
    for n in names:  # .npy features: the .pt reader of `mars centroids` lives on another branch
        np.save(feats / f"{n}.npy", torch.load(L.uss_dir() / f"{n}.pt", weights_only=True).numpy())
    out = tmp_path / "V.pt"
    code = cli.main(["centroids", "--features", str(feats), "--labels", str(L.wss_dir("RSEPM")), "--wsss", "dhr",
                     "--image-labels", str(L.xml_dir()), "--num-classes", "20", "--out", str(out), "--no-progress"])
    assert code == 0 and out.is_file()
