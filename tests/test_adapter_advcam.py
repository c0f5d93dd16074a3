"""AdvCAM adapter on fixtures written exactly as jbeomlee93/AdvCAM writes them (commit 2650fcd),
read back as kazuto1011/deeplab-pytorch (commit 4219467) reads its training labels.

* result/cam_adv_mask/<id>.npy: obtain_CAM_masking.py:159-160 (IRNet's dict format).
* result/ir_label and result/sem_seg: ``<id>.png`` by ``imageio.imwrite`` of uint8 (grayscale)
  plus ``<id>_palette.png`` (P mode with AdvCAM's palette), step/cam_to_ir_label.py:53-57.
* voc12/cls_labels.npy: np.save of {np.int32: float32 (20,)}; voc12/train_aug.txt.
* deeplab-pytorch: ``np.asarray(Image.open(label_path), dtype=np.int32)`` (libs/datasets/voc.py:85)
  and the PIL NEAREST resize of its augmentation (libs/datasets/base.py:71).
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from PIL import Image

from mars_plugin import debias_labels, select_centroids
from mars_plugin.adapters.wsss import advcam
from mars_plugin.formats.files import read_label

IDS = ["2007_000032", "2007_000039", "2008_000123", "2011_003276"]
H, W = 14, 19
CLASSES = {"2007_000032": (4,), "2007_000039": (4, 15), "2008_000123": (4,), "2011_003276": (4, 15)}
PALETTE = [0, 0, 0, 128, 0, 0, 0, 128, 0, 128, 128, 0, 0, 0, 128, 128, 0, 128, 0, 128, 128, 128, 128, 128,
           64, 0, 0, 192, 0, 0, 64, 128, 0, 192, 128, 0, 64, 0, 128, 192, 0, 128, 64, 128, 128, 192, 128, 128,
           0, 64, 0, 128, 64, 0, 0, 192, 0, 128, 192, 0, 0, 64, 128, 128, 64, 128, 0, 192, 128, 128, 192, 128,
           64, 64, 0, 192, 64, 0, 64, 192, 0, 192, 192, 0]  # step/cam_to_ir_label.py:14-17


def strided(n):
    return (n - 1) // 4 + 1


def label_vec(ids):
    v = np.zeros(20, np.float32)
    v[[c - 1 for c in ids]] = 1.0
    return v


def write_label_like_advcam(folder, name, conf):
    """step/cam_to_ir_label.py:53-57: a palette copy, then imageio.imwrite(<name>.png, uint8)."""
    out = Image.fromarray(conf.astype(np.uint8))
    out.putpalette(PALETTE)  # an 'L' image with a palette becomes 'P', as Image.fromarray(..., mode='P')
    out.save(os.path.join(folder, name + "_palette.png"))
    Image.fromarray(conf.astype(np.uint8)).save(os.path.join(folder, name + ".png"))


@pytest.fixture()
def repo(tmp_path):
    rng = np.random.default_rng(0)
    cam_dir = tmp_path / "result" / "cam_adv_mask"
    ir_dir = tmp_path / "result" / "ir_label"
    for d in (cam_dir, ir_dir, tmp_path / "voc12"):
        d.mkdir(parents=True)
    saved, cls = {}, {}
    for name in IDS:
        label = torch.from_numpy(label_vec(CLASSES[name]))
        valid_cat = torch.nonzero(label)[:, 0]  # obtain_CAM_masking.py:128
        K = valid_cat.numel()
        strided_cam = torch.from_numpy(rng.random((K, strided(H), strided(W))).astype(np.float32))
        highres_cam = torch.from_numpy(rng.random((K, H, W)).astype(np.float32))
        highres_cam[:, 0, :2] = torch.tensor([0.35, 0.15])  # exactly AdvCAM's thresholds
        np.save(os.path.join(cam_dir, name + ".npy"),
                {"keys": valid_cat, "cam": strided_cam.cpu(), "high_res": highres_cam.cpu().numpy()})
        saved[name] = (valid_cat, strided_cam, highres_cam.numpy())
        cls[np.int32(int(name.replace("_", "")))] = label_vec(CLASSES[name])
        write_label_like_advcam(str(ir_dir), name, rng.choice(np.array([0, 4, 15, 255]), size=(H, W)))
    np.save(str(tmp_path / "voc12" / "cls_labels.npy"), cls)
    (tmp_path / "voc12" / "train_aug.txt").write_text("\n".join(IDS) + "\n")
    return tmp_path, saved


def repo_rule(keys0, cams, fg_thres, bg_thres):
    """step/cam_to_ir_label.py:29-51 (CRF left out)."""
    keys = np.pad(np.asarray(keys0) + 1, (1, 0), mode="constant")
    fg_conf = keys[np.argmax(np.pad(cams, ((1, 0), (0, 0), (0, 0)), mode="constant", constant_values=fg_thres), axis=0)]
    bg_conf = keys[np.argmax(np.pad(cams, ((1, 0), (0, 0), (0, 0)), mode="constant", constant_values=bg_thres), axis=0)]
    conf = fg_conf.copy()
    conf[fg_conf == 0] = 255
    conf[bg_conf + fg_conf == 0] = 0
    return conf


def test_constants():
    assert advcam.NAME == "advcam" and advcam.NUM_CLASSES == 20 and advcam.LABEL_MODE == "L"
    assert advcam.CLASS_NAMES[0] == "background" and len(advcam.CLASS_NAMES) == 21
    assert (advcam.CONF_FG_THRES, advcam.CONF_BG_THRES) == (0.35, 0.15)
    assert advcam.CRF_PARAMS["bilateral_srgb"] == 5 and advcam.CRF_PARAMS["gt_prob"] == 0.7


def test_pickles_refused_without_trust(repo):
    root, _ = repo
    with pytest.raises(PermissionError, match="trust_pickle"):
        advcam.load_cams(root / "result" / "cam_adv_mask" / f"{IDS[0]}.npy")
    with pytest.raises(PermissionError, match="trust_pickle"):
        advcam.load_image_labels(root / "voc12" / "cls_labels.npy")


def test_load_cams_and_the_repo_rule(repo):
    root, saved = repo
    for name in IDS:
        d = advcam.load_cams(root / "result" / "cam_adv_mask" / f"{name}.npy", trust_pickle=True)
        keys0, cam, high_res = saved[name]
        assert torch.equal(d["keys"], keys0 + 1) and torch.equal(d["cam"], cam)
        assert np.array_equal(d["high_res"].numpy(), high_res)
        got = advcam.cams_to_label(d)  # AdvCAM's defaults 0.35 / 0.15
        np.testing.assert_array_equal(got.numpy(), repo_rule(keys0.numpy(), high_res, 0.35, 0.15))
        assert got[0, 0] == 255 and got[0, 1] == 0  # ties go to the background row
        np.testing.assert_array_equal(advcam.cams_to_label(d, conf_fg=0.30, conf_bg=0.05).numpy(),
                                      repo_rule(keys0.numpy(), high_res, 0.30, 0.05))


def test_image_labels_and_lists(repo, tmp_path):
    root, _ = repo
    labels = advcam.load_image_labels(root / "voc12" / "cls_labels.npy", trust_pickle=True)
    assert sorted(labels) == IDS
    assert all((torch.nonzero(labels[n])[:, 0] + 1).tolist() == list(CLASSES[n]) for n in IDS)
    assert advcam.load_image_list(root / "voc12" / "train_aug.txt") == IDS
    seg = tmp_path / "train_aug_deeplab.txt"  # deeplab-pytorch's ImageSets/SegmentationAug format
    seg.write_text("".join(f"/JPEGImages/{n}.jpg /SegmentationClassAug/{n}.png\n" for n in IDS))
    assert advcam.load_image_list(seg) == IDS


def test_palette_siblings_skipped(repo):
    root, _ = repo
    folder = root / "result" / "ir_label"
    assert len(list(folder.glob("*_palette.png"))) == len(IDS)
    with Image.open(folder / f"{IDS[0]}_palette.png") as im:
        assert im.mode == "P"
    got = dict(advcam.load_pseudo_labels(folder))
    assert sorted(got) == IDS
    for n in IDS:
        np.testing.assert_array_equal(got[n].numpy(), np.asarray(Image.open(folder / f"{n}.png")))
    assert any((t == 255).any() for t in got.values())


def test_write_debiased_round_trip_and_dry_run(tmp_path):
    y = torch.tensor([[0, 4, -1], [255, -1, 15]])
    out = tmp_path / "SegmentationClassAug_MARS"
    assert advcam.write_debiased([("2007_000032", y)], out, dry_run=True) == [out / "2007_000032.png"]
    assert not out.exists()
    [p] = advcam.write_debiased([("2007_000032", y)], out)
    assert sorted(os.listdir(out)) == ["2007_000032.png"]
    with Image.open(p) as im:
        assert im.mode == advcam.LABEL_MODE == "L"
    assert np.asarray(Image.open(p), dtype=np.int32).tolist() == [[0, 4, 254], [255, 254, 15]]
    assert torch.equal(read_label(p), y)
    [p] = advcam.write_debiased([("x", y)], out, biased_value=200)
    assert np.asarray(Image.open(p)).tolist() == [[0, 4, 200], [255, 200, 15]]


def test_three_calls_read_back_by_deeplab_pytorch(repo, tmp_path):
    root, _ = repo
    g = torch.Generator().manual_seed(0)
    D = 8
    protos = torch.linalg.qr(torch.randn(D, D, generator=g))[0].T[:3]  # bg/sea, boat, person
    sem_seg = root / "result" / "sem_seg"
    sem_seg.mkdir()
    feats, truth, world = {}, {}, {}
    for name in IDS:
        f = protos[0][:, None, None] + 0.05 * torch.randn(D, H, W, generator=g)
        y = np.zeros((H, W), np.uint8)
        y[4:11, 1:15] = 4
        f[:, 4:11, 1:8] = protos[1][:, None, None] + 0.05 * torch.randn(D, 7, 7, generator=g)
        t = np.zeros((H, W), bool)
        t[4:11, 8:15] = True  # boat label leaking into the sea
        if 15 in CLASSES[name]:
            y[0:3, 13:19] = 15
            f[:, 0:3, 13:19] = protos[2][:, None, None] + 0.05 * torch.randn(D, 3, 6, generator=g)
        write_label_like_advcam(str(sem_seg), name, y)  # make_sem_seg_labels.py:59-62
        feats[name], truth[name], world[name] = f, t, y

    ids = advcam.load_image_list(root / "voc12" / "train_aug.txt")
    labels = dict(advcam.load_pseudo_labels(sem_seg))
    assert sorted(labels) == sorted(ids)  # *_palette.png never reach the core
    classes = advcam.load_image_labels(root / "voc12" / "cls_labels.npy", trust_pickle=True)
    V = select_centroids(((feats[i], labels[i]) for i in ids), num_classes=advcam.NUM_CLASSES)
    debiased = ((i, debias_labels(feats[i], labels[i], V, classes[i], refine="threshold")) for i in ids)
    out = tmp_path / "VOC2012" / "SegmentationClassAug_MARS"
    paths = advcam.write_debiased(debiased, out)
    assert [p.name for p in paths] == [f"{i}.png" for i in ids]

    for i in ids:
        label = np.asarray(Image.open(out / f"{i}.png"), dtype=np.int32)  # libs/datasets/voc.py:85
        np.testing.assert_array_equal(label == 254, truth[i])
        np.testing.assert_array_equal(label[~truth[i]], world[i][~truth[i]])
        # base.py:71 resizes with PIL NEAREST for the scale augmentation: 254 stays 254
        small = np.asarray(Image.fromarray(label).resize((W // 2, H // 2), resample=Image.NEAREST), dtype=np.int64)
        assert set(np.unique(small).tolist()) <= {0, 4, 15, 254} and (small == 254).any()
