"""mars train: the step against a loop written from the definitions, resume to the same weights,
2 gloo processes = 1 process on the same global batch, the command line and its errors."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mars_plugin import cli
from mars_plugin.formats.files import write_image, write_label
from mars_plugin.networks.seg_checkpoint import load_checkpoint, model_from_checkpoint
from mars_plugin.commands.train import CHECKPOINT_NAME, LOG_NAME, poly_lr, train

from test_distributed import _free_port

REPO = Path(__file__).resolve().parents[1]
C = 4
TINY = dict(arch="deeplabv3+", output_stride=16, backbone="resnet18", iterations=4, batch_size=4, crop=32, min_size=28, max_size=40, workers=0,
            progress=False, log_every=1)


def _tree(root: Path, n: int = 6, size: int = 36):
    """Images, pseudo labels (two blobs of two classes) and debiased labels (some blob pixels 254)."""
    for i in range(n):
        r = np.random.default_rng(i)
        img = r.integers(0, 256, (size, size + 4, 3), dtype=np.uint8)
        lab = np.zeros((size, size + 4), np.int64)
        c1, c2 = 1 + i % C, 1 + (i + 1) % C
        lab[4:16, 5:20] = c1
        lab[20:30, 10:30] = c2
        img[lab == c1] = (200, 30, 30)
        lab[0, :] = 255
        deb = lab.copy()
        deb[20:30, 10:16] = 254
        write_image(root / "images" / f"s{i}.png", img)
        write_label(root / "pseudo" / f"s{i}.png", torch.from_numpy(lab))
        write_label(root / "debiased" / f"s{i}.png", torch.from_numpy(deb))
    return root


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    return _tree(tmp_path_factory.mktemp("train_tree"))


def _states_equal(a, b, atol=0.0):
    assert a.keys() == b.keys()
    for k in a:
        if a[k].is_floating_point():
            torch.testing.assert_close(a[k], b[k], atol=atol, rtol=0, msg=k)
        else:
            assert torch.equal(a[k], b[k]), k


def test_poly_lr_is_dhr_polylr():
    assert poly_lr(1e-3, 0, 100) == 1e-3
    assert poly_lr(1e-3, 50, 100) == pytest.approx(1e-3 * 0.5 ** 0.9)
    assert poly_lr(1e-3, 100, 100) == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["ce", "mars"])
def test_one_step_equals_a_loop_from_the_definitions(tree, tmp_path, loss):
    """The first step's weights equal those of a loop written from the paper/DHR: the same crops,
    CE (or complement with the CRF-refined EMA teacher + WCE) as the mean over non-ignored pixels,
    SGD with DHR's groups at the poly rate of step 0, and the EMA update."""
    from mars_plugin.method.complement import complement_labels
    from mars_plugin.networks.deeplab import build_model
    from mars_plugin.method.losses import weighted_cross_entropy
    from mars_plugin.networks.seg_data import Augmentation, TrainFolder

    labels = tree / ("pseudo" if loss == "ce" else "debiased")
    out = tmp_path / "run"
    train(tree / "images", labels, out, C, loss=loss, **dict(TINY, iterations=1))
    ck = load_checkpoint(out / CHECKPOINT_NAME)

    torch.manual_seed(0)
    net = build_model("deeplabv3+", "resnet18", C)
    teacher = build_model("deeplabv3+", "resnet18", C)
    teacher.load_state_dict(net.state_dict())
    teacher.eval()
    stems = sorted(p.stem for p in labels.iterdir())
    ds = TrainFolder(tree / "images", labels, stems, C, Augmentation(crop=32, min_size=28, max_size=40), 0)
    items = [ds[p] for p in range(4)]
    x = torch.stack([it["image"] for it in items])
    y = torch.stack([it["label"] for it in items])
    torch.manual_seed((0 * 1_000_003 + 0 * 1_009 + 0) % (2 ** 63))
    net.train()
    logits = net(x)
    if loss == "ce":
        ref_loss = F.cross_entropy(logits, y, ignore_index=255)
    else:
        yb = torch.where(y == 254, torch.full_like(y, -1), y)
        with torch.no_grad():
            probs = teacher(x).softmax(1)
        y_co, w = complement_labels(yb, probs, torch.stack([it["classes"] for it in items]), refine="crf",
                                    image=torch.stack([it["rgb"] for it in items]))
        ref_loss = weighted_cross_entropy(logits, y_co, w)
    backbone = [p for n, p in net.named_parameters() if n.startswith("backbone.")]
    head = [p for n, p in net.named_parameters() if not n.startswith("backbone.")]
    opt = torch.optim.SGD([{"params": backbone, "lr": 1e-3}, {"params": head, "lr": 1e-2}], lr=1e-3, momentum=0.9,
                          weight_decay=4e-5)
    opt.zero_grad()
    ref_loss.backward()
    opt.step()
    _states_equal(ck["student"], net.state_dict(), atol=2e-6)
    if loss == "mars":
        with torch.no_grad():
            for t, s in zip(teacher.state_dict().values(), net.state_dict().values()):
                if t.is_floating_point():
                    t.mul_(0.999).add_(s, alpha=0.001)
                else:
                    t.copy_(s)
        _states_equal(ck["teacher"], teacher.state_dict(), atol=2e-6)
    else:
        assert ck["teacher"] is None
    log = [json.loads(line) for line in (out / LOG_NAME).read_text().splitlines()]
    assert log[0]["iteration"] == 1 and log[0]["loss"] == pytest.approx(float(ref_loss.detach()), rel=1e-5)


class _Stop(Exception):
    pass


@pytest.mark.slow
def test_interrupted_run_resumes_to_the_same_weights(tree, tmp_path):
    """Stopped after step 3 (last checkpoint at 2), run again: student, teacher, optimizer and
    the log equal an uninterrupted run's."""
    args = dict(TINY, iterations=5, save_every=2)
    train(tree / "images", tree / "debiased", tmp_path / "whole", C, **args)

    def stop(done):
        if done == 3:
            raise _Stop

    with pytest.raises(_Stop):
        train(tree / "images", tree / "debiased", tmp_path / "cut", C, on_step=stop, **args)
    mid = load_checkpoint(tmp_path / "cut" / CHECKPOINT_NAME)
    assert mid["iteration"] == 2
    res = train(tree / "images", tree / "debiased", tmp_path / "cut", C, **args)
    assert res["resumed_from"] == 2 and res["iterations"] == 5
    a, b = load_checkpoint(tmp_path / "whole" / CHECKPOINT_NAME), load_checkpoint(tmp_path / "cut" / CHECKPOINT_NAME)
    for key in ("student", "teacher"):
        _states_equal(a[key], b[key])
    assert a["optimizer"]["state"].keys() == b["optimizer"]["state"].keys()
    for k in a["optimizer"]["state"]:
        assert torch.equal(a["optimizer"]["state"][k]["momentum_buffer"], b["optimizer"]["state"][k]["momentum_buffer"])
    la = [json.loads(x)["loss"] for x in (tmp_path / "whole" / LOG_NAME).read_text().splitlines()]
    lb = [json.loads(x)["loss"] for x in (tmp_path / "cut" / LOG_NAME).read_text().splitlines()]
    assert la == lb and len(la) == 5
    # a finished run is kept, not trained again
    again = train(tree / "images", tree / "debiased", tmp_path / "cut", C, **args)
    assert again["resumed_from"] == 5


@pytest.mark.slow
def test_a_checkpoint_of_other_settings_is_refused(tree, tmp_path):
    train(tree / "images", tree / "debiased", tmp_path / "o", C, **dict(TINY, iterations=1))
    from mars_plugin.runs.errors import JobError

    with pytest.raises(JobError, match=r"lr: 0\.001 -> 0\.01"):
        train(tree / "images", tree / "debiased", tmp_path / "o", C, **dict(TINY, iterations=1, lr=0.01))


@pytest.mark.slow
def test_a_second_run_into_the_same_out_is_refused_naming_the_holder(tree, tmp_path, capsys):
    from mars_plugin.runs.run_lock import LOCK_NAME, RunLock

    out = tmp_path / "o"
    out.mkdir()
    held = RunLock(out / LOCK_NAME, f"--out {out}", "mars train").acquire()
    try:
        capsys.readouterr()
        assert cli.main(_cli_args(tree, out)) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(
            f"mars train: error: --out {out} is in use by another run (pid {os.getpid()} on host "), err
        assert not (out / CHECKPOINT_NAME).exists() and not (out / LOG_NAME).exists()
    finally:
        held.release()
    assert cli.main(_cli_args(tree, out)) == 0  # the lock ended with its holder
    assert (out / CHECKPOINT_NAME).is_file() and not (out / LOCK_NAME).exists()


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def _cli_args(tree, out, extra=()):
    return ["train", "--images", str(tree / "images"), "--labels", str(tree / "debiased"), "--out", str(out),
            "--num-classes", str(C), "--arch", "deeplabv2", "--bn", "frozen", "--backbone", "resnet50", "--iterations", "3",
            "--batch-size", "4", "--crop", "32", "--min-size", "28", "--max-size", "40", "--workers", "0",
            "--log-every", "1", "--no-progress", *extra]


@pytest.mark.slow
def test_two_gloo_processes_equal_one_process(tree, tmp_path):
    """torchrun, 2 CPU processes, each half of the global batch of 4 (DeepLabv2, frozen BN as
    deeplab-pytorch): the same weights and losses as one process, to float rounding."""
    one = tmp_path / "one"
    assert cli.main(_cli_args(tree, one)) == 0
    two = tmp_path / "two"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port()),
           "-m", "mars_plugin.cli", *_cli_args(tree, two, ("--device", "cpu"))]
    res = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    a, b = load_checkpoint(one / CHECKPOINT_NAME), load_checkpoint(two / CHECKPOINT_NAME)
    _states_equal(a["student"], b["student"], atol=1e-5)
    _states_equal(a["teacher"], b["teacher"], atol=1e-5)
    la = [json.loads(x)["loss"] for x in (one / LOG_NAME).read_text().splitlines()]
    lb = [json.loads(x)["loss"] for x in (two / LOG_NAME).read_text().splitlines()]
    np.testing.assert_allclose(la, lb, rtol=1e-4)
    assert json.loads((two / "train.json").read_text())["world_size"] == 2


@pytest.mark.slow
def test_cli_trains_and_the_checkpoint_rebuilds_the_network(tree, tmp_path, capsys):
    out = tmp_path / "c"
    # deeplabv3+: plain CE compares logits at the crop's size; deeplabv2's are at stride 8 as upstream
    # returns them (deeplab-pytorch's loss on the logits' grid is networks/deeplab_pytorch.msc_loss)
    arch = ("--arch", "deeplabv3+", "--backbone", "resnet18")
    assert cli.main(_cli_args(tree, out, ("--loss", "ce", "--labels", str(tree / "pseudo"), *arch))) == 0
    assert "train (ce) ->" in capsys.readouterr().out
    model, meta = model_from_checkpoint(out / CHECKPOINT_NAME)
    assert meta["model"] == {"arch": "deeplabv3+", "backbone": "resnet18", "output_stride": 8, "num_classes": C}  # dhr's
    assert meta["iteration"] == 3
    with pytest.raises(ValueError, match="holds no teacher"):
        model_from_checkpoint(out / CHECKPOINT_NAME, which="teacher")
    assert model(torch.zeros(1, 3, 24, 24)).shape == (1, C + 1, 24, 24)


@pytest.mark.parametrize("extra,says", [
    (("--loss", "ce"), "holds biased pixels (254) but --loss ce"),
    (("--num-classes", "2"), "holds the value 3; expected 0..2"),
    (("--lr", "0"), "argument --lr: expected a finite number in (0, 10], got 0"),
    (("--iterations", "0"), "argument --iterations: expected an integer in 1..10000000, got 0"),
    (("--images", "/nonexistent"), "--images /nonexistent: not a folder"),
    (("--batch-size", "3", "--bn", "sync"), "CUDA only"),
])
def test_cli_errors_are_one_line_naming_the_flag(tree, tmp_path, capsys, extra, says):
    usage = says.startswith("argument")
    with pytest.raises(SystemExit) if usage else _nothing():
        rc = cli.main(_cli_args(tree, tmp_path / "e", extra))
        assert rc == 2
    err = capsys.readouterr().err
    assert says in err, err
    if not usage:
        assert len(err.strip().splitlines()) == 1, err


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


@pytest.mark.slow
def test_reproduce_train_runs_the_second_step_on_dhr_tree(tmp_path, capsys):
    """mars reproduce --train on a sample DHR tree (a copy of train_aug as validation): the
    network is trained on the debiased labels with the xml tags, the validation split is predicted
    and scored, the training split's MARS masks are written; run again, everything is kept."""
    import shutil

    from mars_plugin.commands.sample_trees import write_sample_tree

    root = tmp_path / "s"
    write_sample_tree("dhr", root, num_images=6, size=32, seed=0)
    shutil.copytree(root / "VOC2012" / "train_aug", root / "VOC2012" / "validation")
    out = tmp_path / "rep"
    argv = ["reproduce", "--root", str(root), "--pseudo", str(root / "WSS/VOC2012/RSEPM/train_aug"),
            "--backbone", str(root / "weights/dino_tiny_random.pth"), "--heads", str(root / "weights/STEGO_VOC2012.pt"),
            "--out", str(out), "--no-progress", "--train", "--train-backbone", "resnet18", "--iterations", "2",
            "--train-batch-size", "2", "--crop", "32", "--min-size", "28", "--max-size", "40", "--loader-workers", "0"]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "mIoU of the trained network on validation" in text, text
    ck = load_checkpoint(out / "train" / CHECKPOINT_NAME)
    assert ck["iteration"] == 2 and ck["settings"]["loss"] == "mars" and ck["teacher"] is not None
    # the dhr recipe but for the flags given; predicted as mars predict predicts its checkpoint
    assert ck["recipe"] == "dhr" and ck["model"]["arch"] == "deeplabv3+dhr" and ck["settings"]["overrides"] == [
        "backbone", "iterations", "batch_size", "crop", "min_size", "max_size"]
    for d in ("masks", "val_pred"):
        rec = json.loads((out / d / ".mars-run.json").read_text())["settings"]
        assert rec["model"]["which"] == "teacher" and rec["crf_image"] == "denormalized", rec
    scores = json.loads((out / "scores_trained.json").read_text())
    assert len(scores["iou"]) == 21 and scores["iterations"] == 2
    stems = sorted(p.stem for p in (root / "VOC2012/train_aug/image").iterdir())
    assert sorted(p.stem for p in (out / "masks").glob("*.png")) == stems
    assert sorted(p.stem for p in (out / "val_pred").glob("*.png")) == stems
    before = {p: p.stat().st_mtime_ns for p in (out / "masks").glob("*.png")}
    assert cli.main(argv) == 0
    assert {p: p.stat().st_mtime_ns for p in (out / "masks").glob("*.png")} == before
    assert load_checkpoint(out / "train" / CHECKPOINT_NAME)["iteration"] == 2
