"""The per-label counts the folder jobs take on every file (issue 32: on a GPU host they bound
`mars debias`' rate): classes present, the values check, and the per-class biased counts, each
equal to a plain reference on random labels and the edge cases (empty, all ignore, ids past a
byte, negative ids, other integer dtypes)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from mars_plugin.commands.debias import _removed_per_class
from mars_plugin.commands.inputs import check_label_values
from mars_plugin.formats.files import classes_in_label


def random_label(seed, values=(0, 1, 3, 7, 255), shape=(23, 31), dtype=torch.int64):
    rng = np.random.default_rng(seed)
    return torch.from_numpy(rng.choice(np.array(values), size=shape)).to(dtype)


def ref_classes(label, ignore):
    return sorted({int(v) for v in label.flatten().tolist() if v > 0 and v != ignore})


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("values", [(0, 1, 3, 7, 255), (0, 2, 254), (255,), (0,), (-1, 0, 4, 255),
                                    (0, 70000, 5), (0, 1, 2 ** 40)])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8])
def test_classes_in_label_equals_the_reference(seed, values, dtype):
    if dtype == torch.uint8 and any(v < 0 or v > 255 for v in values):
        pytest.skip("not representable")
    if dtype == torch.int32 and any(abs(v) >= 2 ** 31 for v in values):
        pytest.skip("not representable")
    label = random_label(seed, values, dtype=dtype)
    assert classes_in_label(label, 255) == ref_classes(label, 255)
    assert classes_in_label(label, 0) == ref_classes(label, 0)


def test_classes_in_label_empty_and_float():
    assert classes_in_label(torch.zeros(0, 5, dtype=torch.long)) == []
    assert classes_in_label(torch.tensor([[0.0, 2.0], [255.0, 2.0]])) == [2]


def ref_removed(label, debiased, ignore):
    out = {}
    for y, d in zip(label.flatten().tolist(), debiased.flatten().tolist()):
        if y > 0 and y != ignore:
            n, r = out.get(y, (0, 0))
            out[y] = (n + 1, r + (d == -1))
    return out


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("values", [(0, 1, 3, 7, 255), (255,), (0,), (-1, 0, 4, 255), (0, 2, 9)])
def test_removed_per_class_equals_the_reference(seed, values):
    label = random_label(seed, values)
    debiased = label.clone()
    biased = (label > 0) & (label != 255) & (torch.rand(label.shape, generator=torch.Generator().manual_seed(seed)) < .4)
    debiased[biased] = -1
    assert _removed_per_class(label, debiased, 255) == ref_removed(label, debiased, 255)
    assert _removed_per_class(label, debiased, 0) == ref_removed(label, debiased, 0)
    assert _removed_per_class(label[:0], debiased[:0], 255) == {}


@pytest.mark.parametrize("values, C, match", [
    ((0, 1, 3, 255), 3, None),
    ((255,), 2, None),
    ((0, 1, 4, 255), 3, "holds class 4 but --num-classes is 3"),
    ((0, 1, 254, 255), 20, "holds 254, the biased-pixel byte"),
    ((-2, 0, 1, 255), 3, "holds class -2 but --num-classes is 3"),
])
def test_check_label_values(values, C, match):
    label = random_label(0, values, shape=(40, 40))
    if match is None:
        check_label_values(label, "x.png", C, 255)
    else:
        with pytest.raises(ValueError, match=match):
            check_label_values(label, "x.png", C, 255)
    check_label_values(label[:0], "x.png", C, 255)  # an empty map holds nothing wrong


# --------------------------------------------------------------------------------------------
# all_finite: the sum first, then value by value
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), float("-inf"), "both infs"])
def test_all_finite_equals_isfinite(dtype, bad):
    from mars_plugin._checks import all_finite

    f = torch.randn(7, 9, 11).to(dtype)
    if bad == "both infs":
        f[0, 0, 0], f[3, 4, 5] = float("inf"), float("-inf")
    elif bad is not None:
        f[2, 3, 4] = bad
    assert all_finite(f) == bool(torch.isfinite(f).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_all_finite_when_the_sum_overflows(dtype):
    """Finite values whose sum overflows are finite all the same (the value-by-value check)."""
    from mars_plugin._checks import all_finite

    f = torch.full((1000,), torch.finfo(dtype).max, dtype=dtype)
    assert not bool(torch.isfinite(f.sum())) and all_finite(f) is True
    f[10] = float("nan")
    assert all_finite(f) is False
    assert all_finite(torch.zeros(0)) is True and all_finite(torch.ones(3, dtype=torch.long)) is True
