"""mars train --recipe seam and mars predict on its checkpoint: SEAM's segmentation codebase as
it runs (YudeWang/semantic-segmentation-codebase a40f6c6, experiment/seamv1-pseudovoc): the
lr of each group at each step is train.py's poly over max_itr + 1, every BatchNorm trains its
statistics while no BatchNorm weight moves, conv1a trains, the crops are seam_augment's, the
logits are at the crop, and predict fuses and refines as test.py (mean logits then softmax,
the one-iteration CRF on float32-denormalised bytes). The network is the WR38 DeepLabv1 at a
sixteenth of its width (``width_div``), on crops of 40."""
from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
import torch.nn as nn

import mars_plugin.networks.deeplabv1 as dv1
import mars_plugin.networks.seam_data as seam_data
import mars_plugin.networks.seg_data as seg_data
from mars_plugin.commands import train as train_mod
from mars_plugin.commands.train_settings import TrainSettings, missing_piece
from mars_plugin.networks.deeplabv1 import DeepLabV1WR38, seam_param_groups, seam_poly_lr
from mars_plugin.networks.recipes import get_recipe
from mars_plugin.networks.seg_checkpoint import load_checkpoint

from test_train import C, _tree

T = 2  # steps
GROUPS = ("backbone_weight", "backbone_bias", "head_weight", "head_bias")


@pytest.fixture
def tiny(monkeypatch):
    """build_model("deeplabv1-wr38", ...) builds the network at width 1/16 (train, memory, predict)."""
    def build(backbone, num_classes, output_stride=None):
        assert backbone == "wr38" and output_stride in (None, 8)
        return DeepLabV1WR38(num_classes, width_div=16)

    monkeypatch.setattr(dv1, "build_deeplabv1_wr38", build)


def _train(tmp_path, monkeypatch, loss="mars"):
    """Two steps of the seam recipe; what the student saw at each forward, the lr of each group
    at each step, the augmentations called."""
    tree = _tree(tmp_path / "t", n=4, size=36)
    seen, lrs, augs = [], [], []
    real_forward, real_set_lr, real_seam_aug = DeepLabV1WR38.forward, train_mod._set_lr, seam_data.seam_augment_window

    def forward(self, x):
        y = real_forward(self, x)
        if torch.is_grad_enabled() and x.device.type != "meta":  # the student (not the teacher, not the memory trace)
            bns = [m for m in self.modules() if isinstance(m, nn.BatchNorm2d)]
            drops = [m for m in self.modules() if isinstance(m, (nn.Dropout, nn.Dropout2d))]
            seen.append({"bn_train": all(m.training for m in bns), "drop_train": all(m.training for m in drops),
                         "conv1a_grad": self.backbone.conv1a.weight.requires_grad,
                         "n": x.shape[0], "in": tuple(x.shape[-2:]), "out": tuple(y.shape[-2:])})
        return y

    def set_lr(opt, base_lrs, s, step, total):
        real_set_lr(opt, base_lrs, s, step, total)
        lrs.append((step, total, {g["name"]: (g["lr"], g["weight_decay"], len(g["params"])) for g in opt.param_groups}))

    def seam_aug(*a, **k):
        augs.append(a[2])
        return real_seam_aug(*a, **k)

    def dhr_aug(*a, **k):
        raise AssertionError("DHR's augmentation ran for the seam recipe")

    monkeypatch.setattr(DeepLabV1WR38, "forward", forward)
    monkeypatch.setattr(train_mod, "_set_lr", set_lr)
    # the crops mars train takes (seg_data.train_sample): SEAM's, never DHR's
    monkeypatch.setattr(seam_data, "seam_augment_window", seam_aug)
    monkeypatch.setattr(seg_data, "_augment_window", dhr_aug)
    res = train_mod.train(tree / "images", tree / ("debiased" if loss == "mars" else "pseudo"), tmp_path / "run", C,
                          recipe="seam", loss=loss, iterations=T, batch_size=6, crop=40, workers=0, device="cpu",
                          progress=False, log_every=1)
    return res, seen, lrs, augs


def test_seam_recipe_trains_as_train_py(tmp_path, monkeypatch, tiny):
    res, seen, lrs, augs = _train(tmp_path, monkeypatch)
    r = get_recipe("seam")
    # the lr of each group at each step: train.py's adjust_lr over max_itr + 1; conv parameters only
    fresh = DeepLabV1WR38(C, width_div=16)
    want_groups = {g["name"]: len(g["params"]) for g in seam_param_groups(fresh, r.lr, r.weight_decay)}
    assert [t for t, _, _ in lrs] == list(range(T)) and all(total == T for _, total, _ in lrs)
    for step, _, groups in lrs:
        assert {n: g[2] for n, g in groups.items()} == want_groups
        for name, (lr, wd, _) in groups.items():
            i = GROUPS.index(name)
            assert lr == pytest.approx(seam_poly_lr(r.lr * r.lr_mults[i], step, T), rel=1e-12), (step, name)
            assert wd == (r.weight_decay if r.decay[i] else 0.0), (step, name)
    assert lrs[-1][2]["head_bias"][0] > 0  # over T + 1: the last step's lr is not 0
    # every student forward: BatchNorm on batch statistics, dropout on, conv1a trainable, logits at the crop
    # batch 6 over bn_batch 5: two replicas of 3 (DataParallel's chunks), each step
    assert [s["n"] for s in seen] == [3, 3] * T
    for s in seen:
        assert s["bn_train"] and s["drop_train"] and s["conv1a_grad"], s
        assert s["in"] == s["out"] == (40, 40), s
    # the crops are SEAM's augmentation with the recipe's numbers
    assert len(augs) == 6 * T and all(isinstance(a, seam_data.SeamAugmentation) for a in augs)
    assert augs[0] == seam_data.SeamAugmentation(crop=40, scale=(0.5, 1.5), hsv=(10, 10, 10), flip=0.5)
    # BatchNorm statistics moved, its weights did not; conv1a was trained
    ck = load_checkpoint(res["checkpoint"])
    torch.manual_seed(0)  # train's seed: the same initial network
    init = DeepLabV1WR38(C, width_div=16).state_dict()
    st = ck["student"]
    bn_names = [n for n, m in fresh.named_modules() if isinstance(m, nn.BatchNorm2d)]
    assert bn_names
    for n in bn_names:
        assert torch.equal(st[f"{n}.weight"], init[f"{n}.weight"]) and torch.equal(st[f"{n}.bias"], init[f"{n}.bias"])
        assert not torch.equal(st[f"{n}.running_mean"], init[f"{n}.running_mean"]), n
        assert int(st[f"{n}.num_batches_tracked"]) == T
    assert not torch.equal(st["backbone.conv1a.weight"], init["backbone.conv1a.weight"])
    assert ck["recipe"] == "seam" and ck["model"]["arch"] == "deeplabv1-wr38"


def test_replicas_forward_is_data_parallel_on_one_device():
    """10 images as upstream's 2-GPU DataParallel: each half through the network on its own
    (BatchNorm on its 5 images), the first half's running statistics kept, the second's dropped."""
    torch.manual_seed(0)
    net = dv1.seam_train_mode(DeepLabV1WR38(2, width_div=16).double())
    for m in net.modules():
        if isinstance(m, (nn.Dropout, nn.Dropout2d)):
            m.eval()  # the same dropout draws are not the point here
    momenta = [m.momentum for m in net.modules() if isinstance(m, nn.BatchNorm2d)]
    x = torch.randn(10, 3, 24, 24, dtype=torch.float64)
    first, second, whole = copy.deepcopy(net), copy.deepcopy(net), copy.deepcopy(net)
    want = torch.cat([first(x[:5]), second(x[5:])])
    got = dv1.seam_replicas_forward(net, x, 5)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert float((got - whole(x)).detach().abs().max()) > 1e-6  # one BatchNorm batch of 10 is another computation
    for k, v in first.state_dict().items():  # the first replica's statistics, counted once
        assert torch.equal(net.state_dict()[k], v), k
    assert [m.momentum for m in net.modules() if isinstance(m, nn.BatchNorm2d)] == momenta
    got.sum().backward()  # the graph of both halves is intact
    assert net.cls_conv.weight.grad is not None
    calls = []
    assert dv1.seam_replicas_forward(lambda t: calls.append(t.shape[0]) or t, x[:5], 5).shape[0] == 5
    assert calls == [5]  # B <= bn_batch: one call


def test_seam_recipe_is_wired_whole():
    s = TrainSettings(num_classes=2, recipe="seam")
    assert (s.arch, s.backbone, s.output_stride, s.bn) == ("deeplabv1-wr38", "wr38", 8, "train")
    assert missing_piece(s) is None and missing_piece(s.replace(weights="wr38.params")) is None
    # one definition of the groups: the recipe's multipliers and decay are seam_param_groups'
    r = get_recipe("seam")
    net = DeepLabV1WR38(2, width_div=16)
    for g in seam_param_groups(net, 1.0, 1.0):
        i = GROUPS.index(g["name"])
        assert (g["lr_mult"], g["weight_decay"] > 0) == (r.lr_mults[i], r.decay[i]), g["name"]
    assert s.augmentation == seam_data.SeamAugmentation(crop=448)  # config.py's numbers
    # SEAM's BatchNorm scheme on another network is not SEAM's groups: still refused
    assert "SEAM's scheme" in missing_piece(s.replace(arch="deeplabv2", backbone="resnet101"))


def test_memory_trace_runs_the_network_as_mars_train_does(monkeypatch, tiny):
    from mars_plugin.networks import memory

    called = []
    real = dv1.seam_train_mode
    monkeypatch.setattr(dv1, "seam_train_mode", lambda m: called.append(m) or real(m))
    key = memory._key({"arch": "deeplabv1-wr38", "backbone": "wr38", "output_stride": 8, "num_classes": C})
    peak, kept = memory._train_per_pixel.__wrapped__(key, False, False)
    assert 0 < kept <= peak and len(called) == 1
    # the trace of WR38's train() override alone (BatchNorm frozen) keeps less than mars train does
    monkeypatch.setattr(dv1, "seam_train_mode", lambda m: m)
    assert memory._train_per_pixel.__wrapped__(key, False, False)[1] < kept


def test_seam_checkpoint_predicts_as_test_py(tmp_path, monkeypatch, tiny):
    from mars_plugin.cli import main
    from mars_plugin.formats.files import read_image, write_image
    from mars_plugin.networks import inference
    from mars_plugin.networks.deeplab import normalize
    from mars_plugin.networks.seg_checkpoint import save_checkpoint

    torch.manual_seed(0)
    net = DeepLabV1WR38(2, width_div=16)
    with torch.no_grad():  # non-trivial running statistics, so eval mode matters
        for m in net.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_var.uniform_(0.5, 2.0)
    save_checkpoint(tmp_path / "ck.pt", {"model": net.config, "iteration": 1, "student": net.state_dict(),
                                         "teacher": None, "settings": {}, "recipe": "seam"})
    d = tmp_path / "im"
    d.mkdir()
    write_image(d / "a.png", np.random.default_rng(0).integers(0, 256, size=(24, 32, 3), dtype=np.uint8))
    seen = []
    real = inference.dense_crf

    def spy(probs, images, params, **k):
        seen.append((probs.clone(), images.clone(), dict(params), k["valid"].clone()))
        return real(probs, images, params, **k)

    monkeypatch.setattr(inference, "dense_crf", spy)
    assert main(["predict", "--model", str(tmp_path / "ck.pt"), "--images", str(d), "--out", str(tmp_path / "out"),
                 "--no-progress"]) == 0
    probs, crf_bytes, params, valid = seen[0]
    x = normalize(torch.from_numpy(read_image(d / "a.png"))[None])
    net.eval()
    scaled = dv1.seam_scaled_inputs(np.ascontiguousarray(x[0].permute(1, 2, 0).numpy()), dv1.TEST_SCALES)
    want = dv1.seam_multiscale_logits(net, scaled, (24, 32), flip=True)
    torch.testing.assert_close(probs[0], want, rtol=0, atol=1e-6)
    assert torch.equal(crf_bytes[0], torch.from_numpy(dv1.seam_crf_image(x[0])))
    assert params == {**params, **dv1.SEAM_CRF} and bool(valid.all())  # every class: no threshold
    rec = json.loads((tmp_path / "out" / ".mars-run.json").read_text())["settings"]
    r = get_recipe("seam")
    assert rec["fuse_at"] == "seam" and rec["crf"] == r.crf == "seam-seg" and rec["crf_image"] == "denormalized"
    assert tuple(rec["scales"]) == r.test_scales and rec["flip"] is True and rec["model"]["which"] == "student"
