"""select_centroids never holds the caller's memory past the next ``next()``.

A reader that refills one buffer per image (a DataLoader-like generator writing in place)
yields the same tensor or array object every time. Every image kept in a batch until the batch
is full must be the image as it was when it was yielded: the result of such a stream must
equal, bit for bit, the result of the same images as fresh tensors.
"""
import numpy as np
import pytest
import torch

from mars_plugin.engines import kmeans_compiled
from mars_plugin.method.centroids import ImageCentroids
from mars_plugin.method.selection import select_centroids

from test_select_centroids import assert_same_result, random_pair

BACKENDS = ["torch"] + (["compiled"] if kmeans_compiled.available() else [])
CLASS_SETS = [(0, 1, 2), (0, 3), (2, 4), (0, 1, 4, 5), (0,), (1, 3), (0, 2, 5)]


def _same_size_pairs(seed, n=9, label_dtype=np.int64, feature_dtype=np.float32):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        f, y = random_pair(rng, h=10, w=8, classes=CLASS_SETS[i % len(CLASS_SETS)])
        out.append((f.astype(feature_dtype), y.astype(label_dtype)))
    return out


def _one_buffer_torch(pairs):
    """Yield every pair through the same two tensors, overwritten in place."""
    f_buf = torch.empty(pairs[0][0].shape, dtype=torch.from_numpy(pairs[0][0]).dtype)
    y_buf = torch.empty(pairs[0][1].shape, dtype=torch.from_numpy(pairs[0][1]).dtype)
    for f, y in pairs:
        f_buf.copy_(torch.from_numpy(f))
        y_buf.copy_(torch.from_numpy(y))
        yield f_buf, y_buf


def _one_buffer_numpy(pairs):
    f_buf, y_buf = np.empty_like(pairs[0][0]), np.empty_like(pairs[0][1])
    for f, y in pairs:
        f_buf[...] = f
        y_buf[...] = y
        yield f_buf, y_buf


def _fresh(pairs):
    return [(torch.from_numpy(f.copy()), torch.from_numpy(y.copy())) for f, y in pairs]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reader", [_one_buffer_torch, _one_buffer_numpy])
@pytest.mark.parametrize("label_dtype,feature_dtype", [(np.int64, np.float32), (np.uint8, np.float32),
                                                       (np.int32, np.float16), (np.float32, np.float64)])
@pytest.mark.slow
@pytest.mark.parametrize("batch_size", [1, 4, 64])
def test_one_buffer_stream_equals_fresh_tensors(backend, reader, label_dtype, feature_dtype, batch_size):
    if backend == "compiled" and feature_dtype == np.float64:
        pytest.skip("float64 features run the torch path (auto); compiled is float32")
    pairs = _same_size_pairs(3, label_dtype=label_dtype, feature_dtype=feature_dtype)
    kw = dict(num_classes=5, batch_size=batch_size, backend=backend)
    ref = select_centroids(_fresh(pairs), **kw)
    got = select_centroids(reader(pairs), **kw)
    assert_same_result(got, ref, atol=0)
    # The buffers were really reused: the stream must differ from its last image repeated.
    last = select_centroids([_fresh(pairs)[-1]] * len(pairs), **kw)
    assert not torch.equal(last.num_candidates, ref.num_candidates)


def test_views_of_one_caller_array_are_copied_only_when_held():
    # Slices of one (N, D, H, W) array refilled between yields: each slice is a view of memory
    # the caller overwrites, so it is copied when held, and the result is the fresh one.
    pairs = _same_size_pairs(5)
    big_f = np.empty((2,) + pairs[0][0].shape, dtype=np.float32)
    big_y = np.empty((2,) + pairs[0][1].shape, dtype=np.int64)

    def stream():
        for i, (f, y) in enumerate(pairs):
            big_f[i % 2], big_y[i % 2] = f, y
            yield torch.from_numpy(big_f)[i % 2], torch.from_numpy(big_y)[i % 2]

    assert_same_result(select_centroids(stream(), num_classes=5, batch_size=5),
                       select_centroids(_fresh(pairs), num_classes=5, batch_size=5), atol=0)


def test_one_image_centroids_object_mutated_in_place():
    # Precomputed centroids through one ImageCentroids whose tensors are overwritten in place.
    rng = np.random.default_rng(8)
    fresh = [ImageCentroids({c: torch.tensor(rng.normal(size=(1, 5)), dtype=torch.float32) for c in (1, 2, 3)},
                            torch.tensor(rng.normal(size=(2, 5)), dtype=torch.float32)) for _ in range(6)]
    buf = ImageCentroids({c: v.clone() for c, v in fresh[0].fg.items()}, fresh[0].bg.clone())

    def stream():
        for ic in fresh:
            buf.bg.copy_(ic.bg)
            for c, v in ic.fg.items():
                buf.fg[c].copy_(v)
            yield buf

    assert_same_result(select_centroids(stream(), num_classes=3), select_centroids(fresh, num_classes=3), atol=0)
