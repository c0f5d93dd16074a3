"""mars_plugin.densecrf.utils gives pydensecrf's utils arrays bit for bit (values, dtype,
shape, memory order) for float32 and float64 inputs of any number of dimensions."""
import numpy as np
import pytest

from mars_plugin.densecrf import utils

ref = pytest.importorskip("pydensecrf.utils")


def _same(ours: np.ndarray, theirs: np.ndarray) -> None:
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
    assert ours.flags.c_contiguous == theirs.flags.c_contiguous
    np.testing.assert_array_equal(ours, theirs)
    assert ours.tobytes() == theirs.tobytes()  # -0.0 and NaN payloads too


def _softmax(shape, dtype, seed=0):
    x = np.random.default_rng(seed).normal(size=shape) * 4
    e = np.exp(x - x.max(0))
    p = (e / e.sum(0)).astype(dtype)
    p.flat[0] = 0  # clipped
    return p


@pytest.mark.filterwarnings("ignore:divide by zero")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(3, 7), (4, 5, 6), (2, 3, 4, 5)])
@pytest.mark.parametrize("scale, clip", [(None, 1e-5), (0.7, 1e-5), (None, None), (1.0, 1e-3), (0.3, None)])
def test_unary_from_softmax(dtype, shape, scale, clip):
    sm = _softmax(shape, dtype)
    _same(utils.unary_from_softmax(sm, scale=scale, clip=clip), ref.unary_from_softmax(sm, scale=scale, clip=clip))


@pytest.mark.parametrize("zero_unsure", [True, False])
@pytest.mark.parametrize("gt_prob", [0.5, 0.7, np.float32(0.9)])
@pytest.mark.parametrize("shape", [(9,), (4, 6), (2, 3, 4)])
def test_unary_from_labels(zero_unsure, gt_prob, shape):
    n = 4
    labels = np.random.default_rng(1).integers(0, n + 1 if zero_unsure else n, shape)
    _same(utils.unary_from_labels(labels, n, gt_prob, zero_unsure), ref.unary_from_labels(labels, n, gt_prob, zero_unsure))


@pytest.mark.parametrize("sdims, shape", [((3,), (7,)), ((3, 5), (6, 8)), ((1.5, 2, 80), (3, 4, 5)),
                                          ((np.float64(0.3), 7), (5, 9)), ((2,), (4, 3))])
def test_create_pairwise_gaussian(sdims, shape):
    _same(utils.create_pairwise_gaussian(sdims, shape), ref.create_pairwise_gaussian(sdims, shape))


@pytest.mark.parametrize("dtype", [np.uint8, np.float32, np.float64])
@pytest.mark.parametrize("case", ["rgb", "channels first", "gray", "volume", "one schan"])
def test_create_pairwise_bilateral(dtype, case):
    rng = np.random.default_rng(2)
    sdims, schan, shape, chdim = {
        "rgb": ((80, 60), (13, 11, 7.5), (6, 7, 3), 2),
        "channels first": ((3, 3), (13, 0.3), (2, 5, 4), 0),
        "gray": ((5, 5), (0.7,), (6, 5), -1),
        "volume": ((2, 3, 4), (10, 20), (3, 4, 5, 2), 3),
        "one schan": ((9, 9), 13, (4, 5, 3), 2),
    }[case]
    img = (rng.uniform(0, 255, shape)).astype(dtype)
    _same(utils.create_pairwise_bilateral(sdims, schan, img, chdim=chdim),
          ref.create_pairwise_bilateral(sdims, schan, img, chdim=chdim))


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_the_deprecated_names():
    sm = _softmax((3, 4, 5), np.float32) + np.float32(1e-3)
    labels = np.random.default_rng(3).integers(0, 4, (4, 5))
    _same(utils.softmax_to_unary(sm), ref.softmax_to_unary(sm))
    _same(utils.softmax_to_unary(sm, 0.8), ref.softmax_to_unary(sm, 0.8))
    _same(utils.compute_unary(labels, 3), ref.compute_unary(labels, 3))


def test_bad_probabilities_are_refused():
    with pytest.raises(ValueError, match="gt_prob: got 1.0; expected a probability in"):
        utils.unary_from_labels(np.zeros(4, int), 3, 1.0)
    with pytest.raises(ValueError, match="scale: got 0; expected a value in"):
        utils.unary_from_softmax(np.ones((2, 3), np.float32) / 2, scale=0)
