"""mars train --recipe dhr (the default) end to end: DHR's DeepLabv3+ with its logits at stride 4,
the loss on the logits' grid (DHR train.py:325: the labels resized by F.interpolate's nearest rule,
source floor(i * in / out)), the pixel count taken on that grid, 66,100 planned steps on VOC
train_aug, the memory model of its network, and mars predict on its checkpoint (the EMA teacher,
the CRF on upstream's denormalised bytes)."""
from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mars_plugin.commands.train import _Run, _step
from mars_plugin.commands.train_settings import TrainSettings
from mars_plugin.networks.deeplab import build_model

from test_train import C, _tree

R18 = dict(backbone="resnet18")  # the dhr recipe's deeplabv3+dhr, on ResNet-18 (tests)


def _pick(t: torch.Tensor, size) -> torch.Tensor:
    # F.interpolate(mode="nearest") read plainly: output i takes input floor(i * in / out)
    iy = np.floor(np.arange(size[0]) * (t.shape[-2] / size[0])).astype(int)
    ix = np.floor(np.arange(size[1]) * (t.shape[-1] / size[1])).astype(int)
    return t[..., iy[:, None], ix[None, :]]


def test_the_logits_grid_is_traced_without_drawing_random_numbers():
    from mars_plugin.commands.train_dhr import logits_size

    s = TrainSettings(num_classes=3, **R18)
    net = build_model(**s.model).eval()
    for H, W in [(32, 32), (33, 47), (48, 40)]:
        state = torch.get_rng_state()
        size = logits_size(s.model, (H, W))
        assert torch.equal(state, torch.get_rng_state())
        # DHR's network: stride 4 as ceil(ceil(H / 2) / 2) (stem conv and max pool each round up)
        assert size == (-(-(-(-H // 2)) // 2), -(-(-(-W // 2)) // 2))
        with torch.no_grad():
            assert tuple(net(torch.zeros(1, 3, H, W)).shape[-2:]) == size
    assert logits_size(dict(s.model, arch="deeplabv3+"), (33, 47)) == (33, 47)  # RS+EPM's: at the input


def _run(s: TrainSettings, seed: int = 0):
    from mars_plugin.commands.train import _build

    run = _Run(s, None, None, 0, 1, torch.device("cpu"), False, 10)
    _build(run)
    run.net = run.model
    run.model.eval()  # running statistics, no dropout: the reference below sees the same network
    return run


def _batch(H=33, W=38, seed=0, biased=False):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, C + 1, (2, H, W), generator=g)
    y[:, :3] = 255  # ignored rows: counted out on either grid
    y[0, 10:20, 5:9] = 255
    if biased:
        y[1, 12:30, 10:30] = 254
    rgb = torch.randint(0, 256, (2, H, W, 3), generator=g, dtype=torch.uint8)
    return {"image": torch.randn(2, 3, H, W, generator=g), "label": y, "rgb": rgb,
            "classes": torch.ones(2, C, dtype=torch.bool)}


def _sgd_reference(model, loss_of, lr):
    """One plain SGD step (no momentum history yet, no decay: the recipe's groups at step 0)."""
    model = copy.deepcopy(model)
    model.zero_grad()
    loss_of(model).backward()
    with torch.no_grad():
        return {n: p - lr * p.grad if p.grad is not None else p for n, p in model.named_parameters()}


@pytest.mark.parametrize("loss_grid", ["logits", "input"])
def test_ce_is_summed_on_the_recipes_grid_over_the_count_there(loss_grid):
    s = TrainSettings(num_classes=C, loss="ce", lr=0.01, weight_decay=0.0, lr_mults=(1, 1, 1, 1),
                      loss_grid=None if loss_grid == "logits" else "input", **R18)
    assert s.loss_grid == loss_grid
    run = _run(s)
    batch = _batch()
    y = batch["label"]
    before = copy.deepcopy(run.model)
    total, count = _step(run, 0, [batch])

    def loss_of(model):
        logits = model(batch["image"])
        assert logits.shape[-2:] == (9, 10)  # DHR's stride-4 grid of 33 x 38
        if loss_grid == "logits":  # DHR train.py:325: labels to the logits, nearest
            target = _pick(y, logits.shape[-2:])
        else:  # the crop: logits up-sampled bilinearly
            logits, target = F.interpolate(logits, size=y.shape[-2:], mode="bilinear", align_corners=False), y
        n = (target != 255).sum()
        ref_total = F.cross_entropy(logits, target, ignore_index=255, reduction="sum")
        assert float(count) == n and float(total) == pytest.approx(float(ref_total.detach()), rel=1e-5)
        return ref_total / n

    want = _sgd_reference(before, loss_of, 0.01)
    for name, p in run.model.named_parameters():
        torch.testing.assert_close(p, want[name], rtol=1e-4, atol=1e-7, msg=name)


def test_mars_takes_dhrs_grid_with_the_teacher_at_the_crop():
    from mars_plugin.adapters.training_hook import MARSTrainingHook

    s = TrainSettings(num_classes=C, refine=None, **R18)
    run = _run(s)
    assert (run.hook.match, run.hook.loss.reduction) == ("labels_nearest", "sum")
    assert _run(s.replace(loss_grid="input")).hook.match == "logits"  # the crop's grid: as before recipes
    batch = _batch(biased=True)
    teacher = copy.deepcopy(run.hook.teacher.module)
    student = copy.deepcopy(run.model)
    total, count = _step(run, 0, [batch])
    assert float(count) == (_pick(batch["label"], (9, 10)) != 255).sum()
    ref = MARSTrainingHook(student, momentum=s.ema, match="labels_nearest", reduction="sum")
    ref.teacher.module.load_state_dict(teacher.state_dict())
    with torch.no_grad():
        want = ref(batch["image"], student(batch["image"]), batch["label"], batch["classes"])
    assert float(total) == pytest.approx(float(want), rel=1e-5)


def test_an_output_off_the_grid_is_one_line():
    from mars_plugin.commands.train_dhr import check_logits

    s = TrainSettings(num_classes=C, **R18)
    y = torch.zeros(2, 33, 38, dtype=torch.long)
    check_logits(s, torch.zeros(2, C + 1, 9, 10), y)
    with pytest.raises(ValueError, match=r"deeplabv3\+dhr resnet18 gives logits \(33, 38\).*expected logits \(9, 10\)"):
        check_logits(s, torch.zeros(2, C + 1, 33, 38), y)
    with pytest.raises(ValueError, match="an output of type list"):
        check_logits(s, [torch.zeros(2, C + 1, 9, 10)], y)


def test_the_default_recipe_plans_66100_steps_on_voc_train_aug(tmp_path):
    """What the loop will run, before anything is built: 100 epochs of 10,582 // 16 steps."""
    from mars_plugin.commands.train import _place
    from mars_plugin.commands.train_settings import missing_piece

    s = TrainSettings(num_classes=20, device="cpu", max_bytes=None)
    assert missing_piece(s) is None and (s.arch, s.backbone, s.loss_grid) == ("deeplabv3+dhr", "resnet101", "logits")
    assert _place(s, tmp_path, None, 10582).iterations == 66100
    assert _place(s.replace(batch_size=8), tmp_path, None, 10582).iterations == 132200


def test_the_memory_model_traces_dhrs_network():
    from mars_plugin.networks import memory

    dhr = {"arch": "deeplabv3+dhr", "backbone": "resnet101", "output_stride": 8, "num_classes": 20}
    v3 = dict(dhr, arch="deeplabv3+")
    # the trace sees DHR's own network (its 1x1 classifier, no up-sampling to the input)
    assert memory._weights(memory._key(dhr)) != memory._weights(memory._key(v3))
    assert memory._forward_per_pixel(memory._key(dhr), False) != memory._forward_per_pixel(memory._key(v3), False)
    need = memory.train_memory_bytes(dhr, 512, 16, amp=True, device="cuda")
    assert 10 * 2 ** 30 < need < 60 * 2 ** 30  # a step of the recipe fits one 80 GB GPU
    assert memory.inference_memory_bytes(dhr, 500, 375, scales=(1.0, 0.5, 1.5, 2.0), crf_labels=21) > 0
    with pytest.raises(ValueError, match=r"deeplabv3\+dhr resnet101 at output stride 8.*--max-memory"):
        memory.check_train_budget(2 ** 30, "cpu", crop=512, batch_size=16, **dhr)


@pytest.mark.slow
def test_train_the_default_recipe_then_predict_with_the_teacher_and_upstream_bytes(tmp_path, monkeypatch):
    """`mars train` with nothing but a ResNet-18 and a small crop overridden, 2 steps; `mars
    predict` on its checkpoint then runs the EMA teacher's weights and gives the CRF the
    network input turned back to bytes (DHR produce_wss_masks.py), not the file's."""
    from mars_plugin import cli
    from mars_plugin.commands import predict as predict_mod
    from mars_plugin.formats.files import read_image
    from mars_plugin.networks import inference
    from mars_plugin.networks.deeplab import normalize
    from mars_plugin.networks.seg_checkpoint import load_checkpoint

    tree = _tree(tmp_path / "t", n=4)
    run = tmp_path / "run"
    assert cli.main(["train", "--images", str(tree / "images"), "--labels", str(tree / "debiased"), "--out", str(run),
                     "--num-classes", str(C), "--backbone", "resnet18", "--iterations", "2", "--batch-size", "2",
                     "--crop", "40", "--min-size", "32", "--max-size", "48", "--workers", "0", "--no-progress"]) == 0
    ck = load_checkpoint(run / "checkpoint.pt")
    assert ck["recipe"] == "dhr" and ck["model"]["arch"] == "deeplabv3+dhr" and ck["settings"]["loss_grid"] == "logits"
    assert ck["settings"]["overrides"] == ["backbone", "iterations", "batch_size", "crop", "min_size", "max_size"]
    teacher, student = ck["teacher"], ck["student"]
    assert any(not torch.equal(teacher[k], student[k]) for k in teacher)  # the EMA lags the student

    nets, crf_images = [], []
    real_fuse, real_crf = predict_mod.multiscale_probs_dhr, inference.dense_crf

    def fuse(model, *a, **k):
        nets.append({k_: v.clone() for k_, v in model.state_dict().items()})
        return real_fuse(model, *a, **k)

    def crf(probs, images, *a, **k):
        crf_images.append(images.clone().cpu())
        return real_crf(probs, images, *a, **k)

    monkeypatch.setattr(predict_mod, "multiscale_probs_dhr", fuse)
    monkeypatch.setattr(inference, "dense_crf", crf)
    one = tmp_path / "one"
    one.mkdir()
    (one / "s0.png").write_bytes((tree / "images" / "s0.png").read_bytes())
    assert cli.main(["predict", "--model", str(run / "checkpoint.pt"), "--images", str(one), "--out",
                     str(tmp_path / "pred"), "--device", "cpu", "--no-progress"]) == 0
    assert nets and all(torch.equal(nets[0][k], teacher[k]) for k in teacher)
    assert any(not torch.equal(nets[0][k], student[k]) for k in student)
    rgb = torch.from_numpy(read_image(one / "s0.png"))[None]
    want = inference.denormalized_bytes(normalize(rgb))
    assert crf_images and torch.equal(crf_images[0], want) and not torch.equal(crf_images[0], rgb)
    rec = json.loads((tmp_path / "pred" / ".mars-run.json").read_text())["settings"]
    assert rec["model"]["which"] == "teacher" and rec["crf_image"] == "denormalized" and rec["fuse_at"] == "logits"


def test_logits_at_the_input_train_as_before_recipes():
    """RS+EPM's network (--arch deeplabv3+, the README's demo world) has its logits at the crop:
    the dhr grid is the crop's, and the step (CRF teacher included) is bit for bit the one of the
    hook mars train built before recipes (match='logits')."""
    from mars_plugin.adapters.training_hook import MARSTrainingHook

    s = TrainSettings(num_classes=C, arch="deeplabv3+", output_stride=16, **R18)
    runs = [_run(s), _run(s)]
    old = runs[1].hook
    runs[1].hook = MARSTrainingHook(runs[1].model, momentum=s.ema, match="logits", refine=s.refine,
                                    crf_params=s.crf_params, reduction="sum")
    runs[1].hook.teacher.module.load_state_dict(old.teacher.module.state_dict())
    batch = _batch(H=32, W=32, biased=True)
    (t0, c0), (t1, c1) = (_step(r, 0, [batch]) for r in runs)
    assert runs[0].hook.match == "labels_nearest" and float(c0) == float(c1) == (batch["label"] != 255).sum()
    assert float(t0) == float(t1)
    for (n, a), b in zip(runs[0].model.state_dict().items(), runs[1].model.state_dict().values()):
        assert torch.equal(a, b), n
