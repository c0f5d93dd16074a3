"""Issue 23's done-when, on the built-in biased world: `mars train --backbone resnet18` on the
debiased labels (MARS: EMA teacher + CRF complement + WCE), then `mars predict` + `mars evaluate`
on held-out images, beats the same with `--loss ce` on the pseudo labels for the biased classes
(boat, whose pseudo labels leak into the sea, and train, into the rails).

The README's demo-world commands at a smaller size (48 px, 160 training images) so that the two
trainings take a minute or two on a CPU."""
import json

import numpy as np
import pytest

from mars_plugin import cli
from mars_plugin.debias import debias_labels
from mars_plugin.demo import WORLD_NOISE
from mars_plugin.files import write_label
from mars_plugin.selection import select_centroids
from mars_plugin.synthetic import make_world, write_world

SIZE, NUM_TRAIN, NUM_VAL = 48, 160, 48
TRAIN_FLAGS = ["--backbone", "resnet18", "--iterations", "120", "--batch-size", "4", "--crop", str(SIZE),
               "--min-size", str(SIZE - 8), "--max-size", str(SIZE + 16), "--optimizer", "adamw", "--lr", "3e-4",
               "--weight-decay", "1e-4", "--workers", "0", "--no-progress", "--threads", "2"]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_world")
    w = make_world(NUM_TRAIN + NUM_VAL, size=SIZE, seed=0, **WORLD_NOISE)
    w.features = w.features.half().float()
    tr, va = w.subset(list(range(NUM_TRAIN))), w.subset(list(range(NUM_TRAIN, NUM_TRAIN + NUM_VAL)))
    write_world(tr, root / "train")
    write_world(va, root / "val")
    V = select_centroids(zip(tr.features, tr.pseudo), w.num_classes)
    for s, d in zip(tr.stems, debias_labels(tr.features, tr.pseudo, V, tr.image_classes, image=tr.images)):
        write_label(root / "train" / "debiased" / f"{s}.png", d)
    return root, w


def _train_predict_evaluate(root, loss, labels):
    run, pred = root / f"run_{loss}", root / f"pred_{loss}"
    assert cli.main(["train", "--images", str(root / "train/images"), "--labels", str(root / "train" / labels),
                     "--image-labels", str(root / "train/image_labels.json"), "--num-classes", "6",
                     "--loss", loss, "--out", str(run), *TRAIN_FLAGS]) == 0
    assert cli.main(["predict", "--model", str(run / "checkpoint.pt"), "--images", str(root / "val/images"),
                     "--out", str(pred), "--no-progress"]) == 0
    assert cli.main(["evaluate", "--pred", str(pred), "--gt", str(root / "val/gt"), "--num-classes", "6",
                     "--json", str(root / f"{loss}.json"), "--no-progress"]) == 0
    return json.loads((root / f"{loss}.json").read_text())


def test_mars_beats_plain_ce_on_the_biased_classes(world, capsys):
    root, w = world
    mars = _train_predict_evaluate(root, "mars", "debiased")
    ce = _train_predict_evaluate(root, "ce", "labels")
    names = w.class_names
    report = {names[c]: (round(ce["iou"][c], 3), round(mars["iou"][c], 3)) for c in range(len(names))}
    with capsys.disabled():
        print(f"\nIoU (CE, MARS) on {NUM_VAL} held-out images: {report}; "
              f"mIoU CE {ce['miou']:.3f} MARS {mars['miou']:.3f}")
    for c in w.problematic:
        assert mars["iou"][c] > ce["iou"][c], (names[c], report)
    # MARS removes what CE learns wrongly: fewer false positives on the biased classes
    assert np.mean([mars["fp"][c] for c in w.problematic]) < np.mean([ce["fp"][c] for c in w.problematic]), report
