"""Confusion matrix and SEAM's IoU/FP/FN against hand-computed and plain-loop references."""
import math

import numpy as np
import pytest
import torch

from mars_plugin.commands.metrics import confusion_matrix, format_scores_table, segmentation_scores


def test_hand_computed_example():
    gt = torch.tensor([[0, 1, 1, 2], [2, 2, 255, 0]])
    pred = torch.tensor([[0, 1, 2, 2], [2, 255, 1, -1]])
    cm = confusion_matrix(pred, gt, 2)
    # rows gt 0..2, cols pred 0..2 + "no class"; gt 255 skipped; pred -1 -> background.
    expected = np.array([[2, 0, 0, 0], [0, 1, 1, 0], [0, 0, 2, 1]])
    assert np.array_equal(cm, expected)
    s = segmentation_scores(cm)
    # class 1: T=2, P=1, TP=1 -> IoU 1/2, FP 0, FN 1/2
    assert s["iou"][1] == pytest.approx(0.5) and s["fp"][1] == 0 and s["fn"][1] == pytest.approx(0.5)
    # class 2: T=3, P=3, TP=2 -> union 4: IoU 2/4, FP 1/4, FN 1/4
    assert s["iou"][2] == pytest.approx(0.5) and s["fp"][2] == pytest.approx(0.25) and s["fn"][2] == pytest.approx(0.25)
    assert s["miou"] == pytest.approx((1.0 + 0.5 + 0.5) / 3)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_against_plain_loops(seed):
    rng = np.random.default_rng(seed)
    C = 4
    gt = rng.integers(0, C + 1, size=(3, 11, 13))
    gt[rng.random(gt.shape) < 0.1] = 255
    pred = rng.integers(-1, C + 1, size=gt.shape)
    pred[rng.random(gt.shape) < 0.05] = 255
    cm = confusion_matrix(torch.from_numpy(pred), torch.from_numpy(gt), C)
    s = segmentation_scores(cm)
    keep = gt != 255
    p = np.where(pred == -1, 0, pred)[keep]
    g = gt[keep]
    ious = []
    for c in range(C + 1):
        T = int((g == c).sum())
        P = int((p == c).sum())
        TP = int(((g == c) & (p == c)).sum())
        union = T + P - TP
        if union == 0:
            assert math.isnan(s["iou"][c])
            continue
        assert s["iou"][c] == pytest.approx(TP / union, abs=1e-12)
        assert s["fp"][c] == pytest.approx((P - TP) / union, abs=1e-12)
        assert s["fn"][c] == pytest.approx((T - TP) / union, abs=1e-12)
        ious.append(TP / union)
    assert s["miou"] == pytest.approx(np.mean(ious))


def test_absent_class_is_nan_and_left_out_of_miou():
    gt = torch.zeros(4, 4, dtype=torch.long)
    gt[:2] = 1
    s = segmentation_scores(confusion_matrix(gt.clone(), gt, 3))
    assert s["present"] == [True, True, False, False]
    assert math.isnan(s["iou"][3]) and s["miou"] == pytest.approx(1.0)


def test_sums_over_images_equal_one_matrix():
    rng = np.random.default_rng(5)
    gt = torch.from_numpy(rng.integers(0, 3, size=(4, 6, 6)))
    pred = torch.from_numpy(rng.integers(0, 3, size=(4, 6, 6)))
    total = sum(confusion_matrix(pred[i], gt[i], 2) for i in range(4))
    assert np.array_equal(total, confusion_matrix(pred, gt, 2))


def test_errors_name_arguments():
    with pytest.raises(ValueError, match="pred and gt"):
        confusion_matrix(torch.zeros(2, 2), torch.zeros(2, 3), 1)
    with pytest.raises(ValueError, match="gt"):
        confusion_matrix(torch.zeros(2, 2), torch.full((2, 2), 7), 2)
    with pytest.raises(ValueError, match="num_classes"):
        confusion_matrix(torch.zeros(2, 2), torch.zeros(2, 2), 0)
    with pytest.raises(ValueError, match="cm"):
        segmentation_scores(np.zeros((3, 5)))


def test_table_has_a_row_per_class_and_miou():
    s = segmentation_scores(confusion_matrix(torch.tensor([0, 1]), torch.tensor([0, 1]), 1))
    t = format_scores_table(["background", "boat"], {"a": s, "b": s})
    lines = t.splitlines()
    assert len(lines) == 2 + 2 + 1 and lines[-1].startswith("| mIoU | 100.0")
    assert "a IoU" in lines[0] and "b FN" in lines[0]
