"""mars train --recipe: the recipe's fields as defaults, single flags as recorded overrides,
epochs counted as DHR counts them, the lr of each group at each step, iter_size accumulation,
and a resume refused when the recipe changed."""
import copy
import json

import pytest
import torch
import torch.nn as nn

from mars_plugin.commands.cli_parser import build_parser
from mars_plugin.commands.train_settings import TrainSettings

from test_train import C, _tree

SMALL = dict(arch="deeplabv3+", backbone="resnet18")


def _args(*extra):
    return build_parser().parse_args(["train", "--images", "i", "--labels", "l", "--out", "o", *extra])


def test_dhr_by_default_runs_100_epochs_66100_steps_on_voc_train_aug():
    s = TrainSettings.from_args(_args(), 20)
    assert (s.recipe, s.arch, s.output_stride, s.epochs, s.iterations) == ("dhr", "deeplabv3+dhr", 8, 100, None)
    assert s.iterations_for(10582) == 66100  # 10,582 // 16 = 661 per epoch
    assert TrainSettings.from_args(_args("--epochs", "2"), 20).iterations_for(10582) == 1322
    assert TrainSettings.from_args(_args("--epochs", "1", "--batch-size", "10"), 20).iterations_for(10582) == 1058
    assert TrainSettings.from_args(_args("--iterations", "7"), 20).iterations_for(10582) == 7


def test_epochs_and_iterations_together_are_refused():
    with pytest.raises(SystemExit):
        _args("--epochs", "2", "--iterations", "5")
    with pytest.raises(ValueError, match="epochs and iterations: give one"):
        TrainSettings(num_classes=2, epochs=2, iterations=5)


def test_single_flags_override_single_fields_and_are_recorded():
    s = TrainSettings.from_args(_args("--lr", "0.01", "--arch", "deeplabv3+", "--iter-size", "3"), 20)
    assert s.overrides == ("arch", "iter_size", "lr")
    rec = s.record()
    assert rec["recipe"] == "dhr" and rec["overrides"] == ["arch", "iter_size", "lr"]
    assert rec["sources"]["lr"] == "override" and rec["sources"]["momentum"] == "train.py:368"
    assert (rec["lr"], rec["momentum"], rec["weight_decay"], rec["iter_size"]) == (0.01, 0.9, 4e-5, 3)
    assert json.loads(json.dumps(rec)) == rec
    assert TrainSettings.from_record(rec) == s  # the overrides come back as overrides
    # a recipe's own value given is recorded as given
    assert TrainSettings(num_classes=2, lr=1e-3).overrides == ("lr",)


def _groups_lr(recipe, steps, total=50, **kw):
    from mars_plugin.commands.train import _optimizer, _set_lr
    from mars_plugin.networks.deeplab import build_model

    backbone = "resnet50" if kw.get("arch") == "deeplabv2" else "resnet18"  # deeplab-pytorch's ResNets: 50, 101
    s = TrainSettings(num_classes=2, recipe=recipe, backbone=backbone, **kw)
    opt = _optimizer(s, build_model(**s.model))
    base = [g["lr"] for g in opt.param_groups]
    out = {}
    for t in steps:
        _set_lr(opt, base, s, t, total)
        # deeplab-pytorch's own groups (main.py's 1x/10x/20x) by the recipe's group names
        alias = {"1x": "backbone_weight", "10x": "head_weight", "20x": "head_bias"}
        out[t] = {alias.get(g["name"], g["name"]): (g["lr"], g["weight_decay"]) for g in opt.param_groups}
    return out


@pytest.mark.parametrize("recipe, arch, lr, mults, decay, wd, lr_step, offset", [
    # DHR train.py:200-205, 368: 1/1/10/10 all decayed, every step
    ("dhr", "deeplabv3+", 1e-3, (1, 1, 10, 10), (1, 1, 1, 1), 4e-5, 1, 0),
    # deeplab-pytorch main.py:166-177, voc12.yaml: 1/1/10/20, head bias undecayed, every 10 steps
    ("deeplab-pytorch", "deeplabv2", 2.5e-4, (1, 1, 10, 20), (1, 1, 1, 0), 5e-4, 10, 0),
    # SEAM train.py:73-76, 139: 1/2/10/20, biases undecayed, over max_itr + 1
    ("seam", "deeplabv2", 1e-3, (1, 2, 10, 20), (1, 0, 1, 0), 5e-4, 1, 1),
])
def test_the_lr_of_each_group_at_chosen_steps(recipe, arch, lr, mults, decay, wd, lr_step, offset):
    T = 50
    steps = (0, 1, 9, 10, 11, 25, 49)
    got = _groups_lr(recipe, steps, T, arch=arch)
    names = ("backbone_weight", "backbone_bias", "head_weight", "head_bias")
    for t in steps:
        s = t - t % lr_step
        factor = (1 - s / (T + offset)) ** 0.9
        for name, m, d in zip(names, mults, decay):
            if name in got[t]:  # deeplab-pytorch's ResNet has no bias: its group is empty
                assert got[t][name][0] == pytest.approx(lr * m * factor, rel=1e-12), (t, name)
                assert got[t][name][1] == (wd if d else 0.0), (t, name)


def test_iter_size_accumulation_equals_one_big_batch():
    """Two batches of 2 accumulated = one batch of 4 (frozen BatchNorm: nothing depends on the split)."""
    from mars_plugin.commands.train import _Run, _step

    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 3, 1)).double()
    net[1].eval()
    x = torch.randn(4, 3, 6, 6, dtype=torch.float64)
    y = torch.randint(0, 3, (4, 6, 6))
    y[0, :2] = 255  # ignored pixels: the counts of the two halves differ
    s = TrainSettings(num_classes=2, iter_size=2, **SMALL)

    def one_step(batches):
        model = copy.deepcopy(net)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
        run = _Run(s, None, None, 0, 1, torch.device("cpu"), False, 10, model=model, net=model, opt=opt,
                   scaler=torch.amp.GradScaler("cuda", enabled=False), amp_dtype=torch.float16,
                   base_lrs=[0.1])
        total, count = _step(run, 0, batches)
        return model.state_dict(), float(total), float(count)

    big = one_step([{"image": x, "label": y}])
    split = one_step([{"image": x[:2], "label": y[:2]}, {"image": x[2:], "label": y[2:]}])
    assert big[1:] == pytest.approx(split[1:], rel=1e-12)
    for k in big[0]:
        torch.testing.assert_close(big[0][k], split[0][k], rtol=0, atol=1e-12, msg=k)


def test_a_resume_is_refused_when_the_recipe_changed(tmp_path):
    from mars_plugin.runs.errors import JobError
    from mars_plugin.commands.train_data import CHECKPOINT_NAME, open_run
    from mars_plugin.networks.seg_checkpoint import save_checkpoint

    dhr = TrainSettings(num_classes=2, **SMALL)
    save_checkpoint(tmp_path / CHECKPOINT_NAME, {"model": dhr.model, "iteration": 1, "student": {},
                                                 "settings": dhr.record(), "recipe": "dhr"})
    other = TrainSettings(num_classes=2, recipe="deeplab-pytorch", **SMALL, output_stride=8)
    with pytest.raises(JobError, match=r"another run \(differs in recipe: 'dhr' -> 'deeplab-pytorch'"):
        open_run(tmp_path, other.record(), {"files": {}}, restart=False, check=lambda: None)


@pytest.mark.slow
def test_the_checkpoint_and_train_json_carry_the_recipe(tmp_path):
    from mars_plugin import cli
    from mars_plugin.networks.seg_checkpoint import load_checkpoint

    tree = _tree(tmp_path / "t", n=4)
    out = tmp_path / "run"
    assert cli.main(["train", "--images", str(tree / "images"), "--labels", str(tree / "pseudo"), "--out", str(out),
                     "--num-classes", str(C), "--loss", "ce", "--arch", "deeplabv3+", "--backbone", "resnet18",
                     "--iterations", "1", "--batch-size", "2", "--crop", "32", "--min-size", "28", "--max-size", "40",
                     "--lr", "0.002", "--workers", "0", "--no-progress"]) == 0
    ck = load_checkpoint(out / "checkpoint.pt")
    assert ck["recipe"] == "dhr" and ck["settings"]["recipe"] == "dhr"
    assert ck["settings"]["predict_weights"] == "ema" and ck["settings"]["test_scales"] == [1.0, 0.5, 1.5, 2.0]
    assert ck["settings"]["output_stride"] == 8 == ck["model"]["output_stride"]  # the recipe's stride
    assert ck["settings"]["overrides"] == ["arch", "backbone", "iterations", "batch_size", "crop", "min_size",
                                           "max_size", "lr"]
    assert json.loads((out / "train.json").read_text())["overrides"] == ck["settings"]["overrides"]


def test_a_piece_this_build_lacks_is_named():
    from mars_plugin.commands.train_settings import missing_piece

    assert missing_piece(TrainSettings(num_classes=2)) is None  # dhr: every piece is in this build
    assert missing_piece(TrainSettings(num_classes=2, recipe="deeplab-pytorch")) is None
    assert missing_piece(TrainSettings(num_classes=2, **SMALL)) is None
