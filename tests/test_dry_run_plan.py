"""``mars reproduce --dry-run`` predicts every refusal of the real run (issue 30, class 5).

Both call one plan (:func:`mars_plugin.commands.reproduce_plan.plan_reproduce`): each broken tree
below (``mars sample --tree dhr``, then one corruption) is named by the dry run (exit 1, the
offending id or flag in its output) and refused by the real run before any stage writes
anything; and over a list of corruptions, benign ones included, the dry run says "no mismatch"
exactly when the real run does not refuse.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mars_plugin import cli
from mars_plugin.commands.sample_trees import write_sample_tree

STEM = "2007_000003"
DOM = "VOC2012/train_aug"
PSEUDO = "WSS/VOC2012/RSEPM/train_aug"


@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    return write_sample_tree("dhr", tmp_path_factory.mktemp("sample") / "tree", num_images=4, size=32)["root"]


def _set_pixel(path: Path, value: int) -> None:
    """One pixel of a label PNG set to ``value``, the file's mode (and palette) kept."""
    with Image.open(path) as im:
        a, mode, palette = np.array(im), im.mode, im.getpalette()
    a[0, 0] = value
    out = Image.fromarray(a, mode=mode)
    if mode == "P":
        out.putpalette(palette)
    out.save(path)


def _reference(r: Path) -> Path:
    """A reference folder (WSS/VOC2012/MARS) copied from the pseudo labels; its STEM mask."""
    shutil.copytree(r / "WSS/VOC2012/RSEPM", r / "WSS/VOC2012/MARS")
    return r / "WSS/VOC2012/MARS/train_aug" / f"{STEM}.png"


def _val_split(r: Path) -> Path:
    """A validation split of two images and their masks; its folder."""
    val = r / "VOC2012/validation"
    for sub, ext in (("image", ".jpg"), ("mask", ".png")):
        (val / sub).mkdir(parents=True)
        for s in ("2007_000001", "2007_000002"):
            shutil.copy(r / DOM / sub / f"{s}{ext}", val / sub / f"{s}{ext}")
    return val


def _dup_image(r: Path) -> None:
    with Image.open(r / DOM / "image" / f"{STEM}.jpg") as im:
        im.save(r / DOM / "image" / f"{STEM}.png")


#: name: (corruption of the tree, extra flags, what the dry run and the refusal must name)
REFUSED = {
    "reference mask holds 254": (lambda r: _set_pixel(_reference(r), 254), [], f"{STEM} ("),
    "reference mask holds class 30": (lambda r: _set_pixel(_reference(r), 30), [], "holds 30"),
    "ground-truth mask holds class 30": (lambda r: _set_pixel(r / DOM / "mask" / f"{STEM}.png", 30), [],
                                         "holds class 30"),
    "pseudo label holds 254": (lambda r: _set_pixel(r / PSEUDO / f"{STEM}.png", 254), [], "holds 254"),
    "a.jpg and a.png": (_dup_image, [], f"{STEM}.jpg and {STEM}.png"),
    "a --heads file that is no model": (lambda r: (r / "weights/STEGO_VOC2012.pt").write_bytes(b"not torch"), [],
                                        "STEGO_VOC2012.pt"),
    "--backbone without --heads": (lambda r: None, ["--no-heads"], "--heads"),
    "missing --weights file (--train)": (lambda r: None, ["--train", "--weights", "{root}/no_such_resnet.pth"],
                                         "no_such_resnet.pth"),
    "validation mask holds class 30 (--train)": (
        lambda r: _set_pixel(_val_split(r) / "mask/2007_000002.png", 30), ["--train"], "2007_000002"),
    "validation image without its mask (--train)": (
        lambda r: (_val_split(r) / "mask/2007_000001.png").unlink(), ["--train"], "2007_000001"),
}


def _tree(sample: Path, tmp_path: Path, corrupt) -> Path:
    r = tmp_path / "tree"
    shutil.copytree(sample, r)
    corrupt(r)
    return r


def _argv(r: Path, out: Path, extra, features: bool) -> list:
    argv = ["reproduce", "--root", str(r), "--pseudo", str(r / PSEUDO), "--out", str(out), "--no-progress",
            "--refine", "threshold"]
    if features:
        argv += ["--features", str(r / DOM / "SYNTHETIC")]
    else:
        argv += ["--backbone", str(r / "weights/dino_tiny_random.pth")]
        if "--no-heads" not in extra:
            argv += ["--heads", str(r / "weights/STEGO_VOC2012.pt")]
    if "--train" in extra:  # the cheapest training: one step of a small network on 32 px crops
        argv += ["--iterations", "1", "--train-batch-size", "2", "--crop", "32", "--min-size", "32", "--max-size",
                 "48", "--train-backbone", "resnet18", "--loader-workers", "0", "--no-masks"]
    return argv + [a.replace("{root}", str(r)) for a in extra if a != "--no-heads"]


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_dry_run_names_what_the_real_run_refuses_before_any_work(sample, tmp_path, capsys, case):
    corrupt, extra, named = REFUSED[case]
    r = _tree(sample, tmp_path, corrupt)
    assert cli.main(_argv(r, tmp_path / "dry", extra, features=False) + ["--dry-run"]) == 1
    said = capsys.readouterr().out.split("mismatch(es)")[-1]
    assert named in said, said
    out = tmp_path / "out"
    assert cli.main(_argv(r, out, extra, features=False)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and named in err[0], err
    assert err[0].split("error: ", 1)[1].split(" (and ")[0] in said  # the same line as the dry run's
    # Refused before any stage: nothing of the run's was written.
    assert not (out / "features").exists() and not (out / "image_labels.json").exists()
    assert not (out / "centroids.pt").exists() and not (out / "train").exists()


def test_dry_run_names_an_image_without_a_pseudo_label(sample, tmp_path, capsys):
    def extra_image(r):
        with Image.open(r / DOM / "image" / f"{STEM}.jpg") as im:
            im.save(r / DOM / "image" / "2007_000099.jpg")

    r = _tree(sample, tmp_path, extra_image)
    assert cli.main(_argv(r, tmp_path / "dry", [], features=True) + ["--dry-run"]) == 0
    said = capsys.readouterr().out
    assert "1 image(s)" in said and "no pseudo label" in said and "2007_000099" in said


def test_dry_run_lists_the_train_stages(sample, tmp_path, capsys):
    r = _tree(sample, tmp_path, _val_split)
    argv = [a for a in _argv(r, tmp_path / "dry", ["--train"], features=True) if a != "--no-masks"]
    assert cli.main(argv + ["--dry-run"]) == 0
    said = capsys.readouterr().out
    stages = [line[1:].split("]")[0] for line in said.splitlines() if line.startswith("[")]
    assert stages == ["features", "centroids", "debias", "evaluate", "report", "train", "predict validation",
                      "masks train_aug"], said
    assert "predicts the 2 images of" in said


#: Corruptions for the property, benign ones included: (corruption, extra flags)
PROPERTY = {
    "none": (lambda r: None, []),
    "an image without a pseudo label": (lambda r: shutil.copy(r / DOM / "image" / f"{STEM}.jpg",
                                                              r / DOM / "image" / "2007_000099.jpg"), []),
    "an unused xml is broken": (lambda r: (r / DOM / "xml" / "2007_000099.xml").write_text("<"), []),
    "a reference of another domain": (lambda r: (r / "WSS/VOC2012/DHR/validation").mkdir(parents=True), []),
    "pseudo label holds class 30": (lambda r: _set_pixel(r / PSEUDO / f"{STEM}.png", 30), []),
    "mask holds 254": (lambda r: _set_pixel(r / DOM / "mask" / f"{STEM}.png", 254), []),
    "reference mask holds 254": (lambda r: _set_pixel(_reference(r), 254), []),
    "a.jpg and a.png": (_dup_image, []),
    "a.pt and a.npy features": (lambda r: np.save(r / DOM / "SYNTHETIC" / f"{STEM}.npy",
                                                  np.zeros((4, 4, 4), np.float32)), []),
    "a mask is gone": (lambda r: (r / DOM / "mask" / f"{STEM}.png").unlink(), []),
    "--train, a good validation split": (_val_split, ["--train"]),
    "--train, a validation image of another size": (
        lambda r: Image.new("RGB", (40, 32)).save(_val_split(r) / "image/2007_000001.jpg"), ["--train"]),
}


@pytest.mark.parametrize("case", sorted(PROPERTY))
def test_dry_run_says_ok_exactly_when_the_real_run_does_not_refuse(sample, tmp_path, capsys, case):
    corrupt, extra = PROPERTY[case]
    r = _tree(sample, tmp_path, corrupt)
    dry = cli.main(_argv(r, tmp_path / "dry", extra, features=True) + ["--dry-run"])
    said = capsys.readouterr().out
    real = cli.main(_argv(r, tmp_path / "out", extra, features=True))
    err = capsys.readouterr().err
    assert dry in (0, 1) and real in (0, 2), (dry, real, err)
    assert (dry == 0) == (real == 0), f"dry run exit {dry}, real run exit {real}: {said}\n{err}"
    if real:
        assert err.split("error: ", 1)[1].split(" (and ")[0].strip() in said


def test_under_on_error_skip_a_files_problem_is_skipped_and_a_flags_still_stops(sample, tmp_path, capsys):
    r = _tree(sample, tmp_path, lambda r: _set_pixel(r / PSEUDO / f"{STEM}.png", 254))
    skip = ["--on-error", "skip"]
    assert cli.main(_argv(r, tmp_path / "dry", [], features=True) + skip + ["--dry-run"]) == 1
    assert STEM in capsys.readouterr().out
    # The stages skip the file and name it (exit 1), as before the plan.
    assert cli.main(_argv(r, tmp_path / "out", [], features=True) + skip) == 1
    assert STEM in capsys.readouterr().err
    assert sorted(p.stem for p in (tmp_path / "out" / "debiased").glob("*.png")) == [
        "2007_000001", "2007_000002", "2007_000004"]
    # A flag's problem is no file to skip: refused whatever --on-error says, before any stage.
    extra = ["--train", "--weights", str(r / "no_such_resnet.pth")]
    assert cli.main(_argv(r, tmp_path / "out2", extra, features=True) + skip) == 2
    assert "no_such_resnet.pth" in capsys.readouterr().err
    assert not (tmp_path / "out2" / "centroids.pt").exists()
