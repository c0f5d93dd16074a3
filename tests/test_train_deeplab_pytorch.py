"""mars train --recipe deeplab-pytorch and mars predict on its checkpoint, against a plain reading
of deeplab-pytorch's main.py (4219467): MSC(DeepLabV2), BatchNorm frozen and in no SGD group, the
three groups' poly lr recomputed every 10 steps, iter_size accumulation, a mean CE per MSC output
on labels resized by PIL nearest, its augmentation and BGR mean input; predict with the max of
the scales' logits, no flip, and the CRF on the mean-subtracted bytes as numpy casts them."""
import copy
import json

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from mars_plugin.commands.train_settings import TrainSettings, missing_piece
from mars_plugin.networks import deeplab_pytorch as dlpt
from mars_plugin.networks.deeplab import build_model
from mars_plugin.networks.deeplabv2 import MSC

from test_train import C, _tree

TINY = dict(recipe="deeplab-pytorch", backbone="resnet50", crop=32, batch_size=2, device="cpu", workers=0)


def _bn_params(model):
    return {id(p) for m in model.modules() if isinstance(m, nn.BatchNorm2d) for p in m.parameters()}


def test_missing_piece_names_none_of_deeplab_pytorchs_pieces(tmp_path):
    w = tmp_path / "w.pth"
    assert missing_piece(TrainSettings(num_classes=C, weights=str(w), **TINY)) is None
    assert isinstance(TrainSettings(num_classes=C, **TINY).augmentation, dlpt.DeeplabAugmentation)


@pytest.mark.parametrize("total", [30, 20000])
def test_lr_of_each_group_is_poly_lr_recomputed_every_10_steps_and_bn_in_no_group(total):
    from mars_plugin.commands.train import _optimizer, _set_lr

    s = TrainSettings(num_classes=C, iterations=total, **TINY)
    torch.manual_seed(0)
    model = MSC(build_model(**s.model))
    opt = _optimizer(s, model)
    # main.py's three groups: layer convs (x1, decayed), ASPP weights (x10, decayed), biases (x20, not)
    assert [g["name"] for g in opt.param_groups] == ["1x", "10x", "20x"]
    assert [g["weight_decay"] for g in opt.param_groups] == [5e-4, 5e-4, 0.0]
    grouped = [p for g in opt.param_groups for p in g["params"]]
    assert not ({id(p) for p in grouped} & _bn_params(model))
    assert len(grouped) == len([m for m in model.modules() if isinstance(m, nn.Conv2d)]) + 4  # + ASPP biases
    base = [g["lr"] for g in opt.param_groups]
    assert base == [2.5e-4, 2.5e-3, 5e-3]
    for step in (0, 9, 10, 11, 19, 20):
        _set_lr(opt, base, s, step, total)
        for g, mult in zip(opt.param_groups, (1, 10, 20)):
            assert g["lr"] == pytest.approx(dlpt.poly_lr(2.5e-4 * mult, step + 1, total), rel=1e-12), (step, g["name"])
    _set_lr(opt, base, s, 10, total)
    assert opt.param_groups[0]["lr"] < 2.5e-4  # the first change is at step 10 (iteration 11)
    _set_lr(opt, base, s, 9, total)
    assert opt.param_groups[0]["lr"] == 2.5e-4


def _capture(monkeypatch):
    """The batches each step of mars train sees (copied), and the BatchNorm modes of the student."""
    import mars_plugin.commands.train as tr

    seen, real = [], tr._step

    def step(run, t, batches):
        bn = [m.training for m in run.model.modules() if isinstance(m, nn.BatchNorm2d)]
        seen.append(([copy.deepcopy(dict(b)) for b in batches], bn, run.model.training))
        return real(run, t, batches)

    monkeypatch.setattr(tr, "_step", step)
    return seen


def _upstream_reference(s, steps, total):
    """main.py's loop on the same batches: MSC(DeepLabV2) in train mode with BN frozen, SGD
    over get_params' groups, PolynomialLR, msc_loss / iter_size per batch, one step per iter_size."""
    torch.manual_seed(s.seed)
    model = MSC(build_model(**s.model))
    model.train()
    model.base.freeze_bn()
    for p in model.parameters():  # BN is in no group: nothing changes it
        p.requires_grad_(id(p) not in _bn_params(model))
    groups = dlpt.param_groups(model, s.lr, s.weight_decay)
    opt = torch.optim.SGD(groups, lr=s.lr, momentum=0.9)
    for t, batches in enumerate(steps):
        for g in groups:
            g["lr"] = dlpt.poly_lr(s.lr * g["lr_mult"], t + 1, total)
        opt.zero_grad()
        for b in batches:
            dlpt.msc_loss(model(b["image"]), b["label"], iter_size=s.iter_size).backward()
        opt.step()
    return model


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = _tree(tmp_path_factory.mktemp("dlpt_tree"), n=4, size=36)
    mp = pytest.MonkeyPatch()
    try:
        seen = _capture(mp)
        from mars_plugin.commands.train import train

        s = TrainSettings(num_classes=C, loss="ce", iterations=2, iter_size=2, lr=1e-3, **TINY)
        res = train(root / "images", root / "pseudo", root / "out", settings=s, progress=False)
    finally:
        mp.undo()
    return root, s, res, seen


def test_a_ce_step_equals_main_py_on_the_same_batches(trained):
    root, s, res, seen = trained
    assert [len(b) for b, _, _ in seen] == [2, 2]  # iter_size 2: two batches of 2 per optimizer step
    for _, bn_modes, training in seen:  # the student trains, its BatchNorm in eval mode (freeze_bn)
        assert training and not any(bn_modes)
    ck = torch.load(res["checkpoint"], weights_only=True)
    assert ck["model"]["msc_scales"] == [0.5, 0.75] and all(k.startswith("base.") for k in ck["student"])
    ref = _upstream_reference(s, [b for b, _, _ in seen], 2).state_dict()
    torch.manual_seed(s.seed)
    init = MSC(build_model(**s.model)).state_dict()
    moved = 0
    for k, v in ck["student"].items():
        torch.testing.assert_close(v, ref[k], rtol=1e-4, atol=1e-6, msg=k)
        if "bn" in k:
            assert torch.equal(v, init[k]), k  # frozen: statistics and affine weights unchanged
        moved += int(not torch.equal(v, init[k]))
    assert moved > 0


def test_the_loss_logged_is_main_py_iter_loss(trained):
    root, s, res, seen = trained
    log = [json.loads(line) for line in (root / "out" / "log.jsonl").read_text().splitlines()]
    assert log[-1]["iteration"] == 2
    model = _upstream_reference(s, [seen[0][0]], 2)  # after step 1; main.py's iter_loss of step 2
    with torch.no_grad():
        iter_loss = sum(float(dlpt.msc_loss(model(b["image"]), b["label"], iter_size=2)) for b in seen[1][0])
    assert log[-1]["loss"] == pytest.approx(iter_loss, rel=1e-4)


def test_the_batches_are_deeplab_pytorchs_augmentation_and_bgr_mean_input(trained):
    from mars_plugin.formats.files import read_image, read_label

    root, s, res, seen = trained
    aug = dlpt.DeeplabAugmentation(crop=32)
    for batches, _, _ in seen:
        for b in batches:
            for i, pos in enumerate(b["position"].tolist()):
                stem = sorted(p.stem for p in (root / "pseudo").glob("*.png"))
                rgb = None
                for st in stem:  # the sample's file: the one whose crop matches its label draw
                    rgb_f = read_image(root / "images" / f"{st}.png")
                    lab_f = read_label(root / "pseudo" / f"{st}.png", biased_value=None).numpy()
                    x, y = dlpt.augment_bgr(rgb_f, lab_f, aug, np.random.default_rng([s.seed, pos]))
                    if np.array_equal(y, b["label"][i].numpy()) and np.array_equal(x, b["image"][i].numpy()):
                        rgb = dlpt.augment(rgb_f, lab_f, aug, np.random.default_rng([s.seed, pos]))[0]
                assert rgb is not None, pos  # the network's input is augment_bgr's, unrounded
                assert np.array_equal(b["rgb"][i].numpy(), rgb)  # the teacher's CRF sees augment's bytes


def test_mars_loss_refines_once_at_the_crop_then_pil_nearest_to_each_output(monkeypatch):
    import mars_plugin.adapters.training_hook as th
    from mars_plugin.adapters.training_hook import MARSTrainingHook
    from mars_plugin.method.losses import weighted_cross_entropy

    torch.manual_seed(0)
    model = MSC(build_model("deeplabv2", "resnet50", C)).train()
    model.base.freeze_bn()
    hook = MARSTrainingHook(model, match="labels_nearest", label_resize=dlpt.resize_labels_nearest, reduction="sum")
    x = torch.randn(2, 3, 32, 32)
    y = torch.randint(0, C + 1, (2, 32, 32))
    y[:, :3] = 255
    classes = torch.ones(2, C, dtype=torch.bool)
    outs = model(x)
    assert [tuple(o.shape[-2:]) for o in outs] == [(5, 5), (3, 3), (4, 4), (5, 5)]
    # without biased pixels the MARS loss is main.py's CE, each output over its own pixels
    torch.testing.assert_close(dlpt.msc_step_loss(outs, y, hook=hook, images=x, classes=classes),
                               dlpt.msc_loss(outs, y), rtol=1e-6, atol=0)
    y[:, 10:20, 5:25] = 254
    grids, real = [], th.complement_labels
    monkeypatch.setattr(th, "complement_labels", lambda yy, *a, **k: grids.append(tuple(yy.shape)) or real(yy, *a, **k))
    got = dlpt.msc_step_loss(outs, y, hook=hook, images=x, classes=classes)
    assert grids == [(2, 32, 32)]  # once, at the crop's size
    with torch.no_grad():
        t = F.interpolate(hook.teacher(x), size=(32, 32), mode="bilinear", align_corners=False).softmax(1)
    y_co, w = real(torch.where(y == 254, -1, y), t, classes)
    want = 0
    for o in outs:
        yo, wo = dlpt.resize_labels_nearest(y_co, o.shape[-2:]), dlpt.resize_labels_nearest(w, o.shape[-2:])
        n = (dlpt.resize_labels_nearest(y, o.shape[-2:]) != 255).sum()
        want = want + weighted_cross_entropy(o, yo, wo, reduction="sum") / n
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


def test_max_logit_fusion_is_msc_eval_upsampled_then_softmax():
    from mars_plugin.networks.inference import multiscale_probs_max

    torch.manual_seed(0)
    model = MSC(build_model("deeplabv2", "resnet50", C)).double().eval()
    x = torch.randn(1, 3, 37, 45, dtype=torch.float64)
    with torch.no_grad():
        want = F.interpolate(model(x), size=(37, 45), mode="bilinear", align_corners=False).softmax(1)
    assert torch.equal(multiscale_probs_max(model, x, (1.0, 0.5, 0.75)), want)
    assert not torch.equal(multiscale_probs_max(model, x, (1.0, 0.5)), want)
    with pytest.raises(ValueError, match="flip"):
        multiscale_probs_max(model, x, (1.0,), flip=True)


def test_mean_subtracted_bytes_are_numpys_uint8_cast_of_the_bgr_input():
    from mars_plugin.networks.inference import crf_rgb, mean_subtracted_bytes

    rgb = np.random.default_rng(0).integers(0, 256, (2, 9, 11, 3), dtype=np.uint8)
    rgb[0, 0, 0] = (0, 0, 0)  # every channel below its mean: negatives wrap
    x = dlpt.normalize(rgb)
    # main.py:481: image.astype(np.uint8) of the (H, W, 3) BGR floats (numpy 2 on x86-64 wraps)
    bgr = x.numpy().transpose(0, 2, 3, 1)
    want = np.stack([(np.trunc(b).astype(np.int64) % 256).astype(np.uint8) for b in bgr])[..., ::-1]
    got = mean_subtracted_bytes(x).numpy()
    assert np.array_equal(got, want)
    assert got[0, 0, 0].tolist() == [256 - 122, 256 - 116, 256 - 104]  # -122.675 -> -122 -> 134 ...
    assert torch.equal(crf_rgb(torch.from_numpy(rgb), x, "mean-subtracted"), torch.from_numpy(got))


def test_predict_on_the_checkpoint_infers_as_main_py(trained, monkeypatch):
    import mars_plugin.commands.predict as pr
    from mars_plugin.commands.cli_parser import build_parser
    from mars_plugin.commands.predict import run_predict
    from mars_plugin.formats.files import read_image, read_label
    from mars_plugin.networks.inference import labels_from_probs
    from mars_plugin.networks.seg_checkpoint import model_from_checkpoint

    root, s, res, _ = trained
    out = root / "pred"
    args = build_parser().parse_args(["predict", "--model", str(res["checkpoint"]), "--images", str(root / "images"),
                                      "--out", str(out), "--no-progress"])
    inputs, crf_images = [], []
    fuse, labels_of = pr.multiscale_probs_max, pr.labels_from_probs
    monkeypatch.setattr(pr, "multiscale_probs_max", lambda m, x, *a, **k: inputs.append(x.clone()) or fuse(m, x, *a, **k))
    monkeypatch.setattr(pr, "labels_from_probs", lambda p, im, *a, **k: crf_images.append(im.clone()) or
                        labels_of(p, im, *a, **k))
    run_predict(args)
    assert len(inputs) == len(crf_images) == 1  # both 36 x 40 images in one batch
    record = json.loads((out / ".mars-run.json").read_text())
    rec = record.get("settings", record)
    assert (rec["fuse_at"], rec["flip"], rec["crf_image"], rec["scales"]) == ("max-logits", False, "mean-subtracted",
                                                                                 [1.0, 0.5, 0.75])
    model, meta = model_from_checkpoint(res["checkpoint"], None)
    assert isinstance(model, MSC) and meta["which"] == "student"
    for i, stem in enumerate(sorted(p.stem for p in (root / "images").glob("*.png"))):
        rgb = read_image(root / "images" / f"{stem}.png")
        x = dlpt.normalize(rgb[None])
        assert torch.equal(inputs[0][i:i + 1], x)  # the caffe BGR mean input
        with torch.no_grad():  # main.py: MSC's max, upsampled, softmax; the CRF on image.astype(np.uint8)
            probs = F.interpolate(model(x), size=rgb.shape[:2], mode="bilinear", align_corners=False).softmax(1)
        bgr = x[0].numpy().transpose(1, 2, 0)
        crf_bytes = torch.from_numpy((np.trunc(bgr).astype(np.int64) % 256).astype(np.uint8)[..., ::-1].copy())
        assert torch.equal(crf_images[0][i], crf_bytes)
        want = labels_from_probs(probs, crf_bytes[None], "mars", 0.0)[0]
        assert torch.equal(read_label(out / f"{stem}.png", biased_value=None), want), stem


@pytest.mark.slow
def test_two_gloo_processes_equal_one_process_with_per_output_counts(tmp_path):
    """torchrun, 2 CPU processes, each half of the global batch of 4: each output's pixel count is
    global, so the MARS step is one process's on the whole batch (frozen BN), to float rounding."""
    import subprocess
    import sys

    from PIL import Image

    from mars_plugin import cli
    from mars_plugin.networks.seg_checkpoint import load_checkpoint
    from test_distributed import _free_port
    from test_train import _env

    root = _tree(tmp_path / "tree", n=4, size=36)
    for i, p in enumerate(sorted((root / "debiased").glob("*.png"))):  # the halves' label counts differ
        lab = np.array(Image.open(p))
        lab[: 2 + 6 * i] = 255
        Image.fromarray(lab).save(p)

    def args(out):
        return ["train", "--recipe", "deeplab-pytorch", "--images", str(root / "images"), "--labels",
                str(root / "debiased"), "--out", str(out), "--num-classes", str(C), "--backbone", "resnet50",
                "--iterations", "2", "--batch-size", "4", "--iter-size", "1", "--crop", "32", "--lr", "1e-3",
                "--workers", "0", "--log-every", "1", "--no-progress", "--device", "cpu"]

    assert cli.main(args(tmp_path / "one")) == 0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port()),
           "-m", "mars_plugin.cli", *args(tmp_path / "two")]
    res = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    a, b = load_checkpoint(tmp_path / "one" / "checkpoint.pt"), load_checkpoint(tmp_path / "two" / "checkpoint.pt")
    for k in a["student"]:
        torch.testing.assert_close(a["student"][k], b["student"][k], rtol=1e-4, atol=1e-6, msg=k)
    la = [json.loads(x)["loss"] for x in (tmp_path / "one" / "log.jsonl").read_text().splitlines()]
    lb = [json.loads(x)["loss"] for x in (tmp_path / "two" / "log.jsonl").read_text().splitlines()]
    np.testing.assert_allclose(la, lb, rtol=1e-4)


def test_memory_estimates_trace_the_msc_network():
    from mars_plugin.networks.memory import inference_memory_bytes, train_memory_bytes

    plain = {"arch": "deeplabv2", "backbone": "resnet50", "output_stride": 8, "num_classes": C}
    msc = {**plain, "msc_scales": [0.5, 0.75]}
    assert train_memory_bytes(msc, 64, 2, bn="frozen") > train_memory_bytes(plain, 64, 2, bn="frozen")
    assert inference_memory_bytes(msc, 64, 64, scales=(1.0,), flip=False) > 0  # MSC in eval mode, traced


def test_weights_are_read_by_deeplab_pytorchs_reader(tmp_path):
    """--weights of the recipe's format (a caffe-converted file: backbone keys, an fc, no ASPP) is
    loaded into MSC's base; frozen BatchNorm keeps the file's statistics through training."""
    from mars_plugin.commands.train import train

    root = _tree(tmp_path / "tree", n=2, size=36)
    torch.manual_seed(5)
    state = {k: v + 0.01 * torch.rand_like(v) if k.endswith("running_mean") else v
             for k, v in build_model("deeplabv2", "resnet50", C).state_dict().items() if not k.startswith("aspp.")}
    state["fc.weight"] = torch.zeros(91, 2048, 1, 1)
    torch.save(state, tmp_path / "deeplabv1_resnet101-coco.pth")
    res = train(root / "images", root / "pseudo", tmp_path / "out", C, loss="ce", iterations=1,
                weights=str(tmp_path / "deeplabv1_resnet101-coco.pth"), progress=False, **TINY)
    student = torch.load(res["checkpoint"], weights_only=True)["student"]
    bn = [k for k in state if k.endswith("running_mean")]
    assert bn and all(torch.equal(student["base." + k], state[k]) for k in bn)
