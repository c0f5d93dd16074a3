"""The CRF's bytes at inference: upstream's denormalised image (crf_image="denormalized").

DHR tools/transforms.py ``Denormalize.__call__`` (what produce_wss_masks.py:59 gives its CRF):
    image = (image * self.std) + self.mean
    image = (image * 255).astype(np.uint8)
with mean/std the ImageNet lists of tools/transforms.py:10-11. The reference below is that
reading in plain numpy, on the float32 images of ``normalize``.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from mars_plugin.commands.predict import predict_job
from mars_plugin.formats.files import write_image
from mars_plugin.networks import inference
from mars_plugin.networks.deeplab import normalize
from mars_plugin.networks.inference import denormalized_bytes, predict_labels

MEAN = [0.485, 0.456, 0.406]
STD = [0.229, 0.224, 0.225]


def _upstream_reading(x: torch.Tensor) -> np.ndarray:
    out = []
    for img in x.numpy():  # (3, H, W) float32, as DHR's loader gives it
        img = img.transpose((1, 2, 0))
        img = (img * STD) + MEAN
        out.append((img * 255).astype(np.uint8))
    return np.stack(out)


def _all_bytes(seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    rgb = rng.integers(0, 256, size=(2, 16, 24, 3), dtype=np.uint8)
    rgb[0].reshape(-1, 3)[:256] = np.arange(256, dtype=np.uint8)[:, None]  # every byte value, every channel
    return rgb


def test_bytes_equal_upstream_reading_and_some_are_one_below_the_file():
    rgb = _all_bytes()
    x = normalize(rgb)
    got = denormalized_bytes(x)
    assert got.dtype == torch.uint8 and got.shape == (2, 16, 24, 3)
    want = _upstream_reading(x)
    np.testing.assert_array_equal(got.numpy(), want)
    diff = rgb.astype(int) - got.numpy().astype(int)
    assert set(np.unique(diff)) <= {0, 1}  # truncation: never above the file, at most one below
    assert 0.05 < (diff == 1).mean() < 0.6, (diff == 1).mean()


def _spy_crf(monkeypatch):
    seen = []
    real = inference.dense_crf

    def spy(probs, images, *a, **k):
        seen.append(images.clone())
        return real(probs, images, *a, **k)

    monkeypatch.setattr(inference, "dense_crf", spy)
    return seen


class _Net(torch.nn.Module):
    def forward(self, x):  # three classes from the colour channels: a CRF with work to do
        return x * 3


def test_predict_labels_gives_the_crf_the_chosen_bytes(monkeypatch):
    seen = _spy_crf(monkeypatch)
    rgb = torch.from_numpy(_all_bytes(1))
    x = normalize(rgb)
    predict_labels(_Net(), x, rgb, scales=(1.0,), flip=False, crf_image="denormalized")
    predict_labels(_Net(), x, rgb, scales=(1.0,), flip=False)  # "file", the default
    assert torch.equal(seen[0], torch.from_numpy(_upstream_reading(x)))
    assert torch.equal(seen[1], rgb)
    with pytest.raises(ValueError, match="crf_image must be one of .* got 'bytes'"):
        predict_labels(_Net(), x, rgb, crf_image="bytes")


def test_predict_job_records_and_uses_crf_image(monkeypatch, tmp_path):
    seen = _spy_crf(monkeypatch)
    rgb = _all_bytes(2)[0]
    (tmp_path / "im").mkdir()
    write_image(tmp_path / "im" / "a.png", rgb)
    s = predict_job(_Net(), tmp_path / "im", tmp_path / "out", scales=(1.0,), flip=False, crf_image="denormalized",
                    progress=False, max_bytes=None)
    assert s.done == 1
    assert torch.equal(seen[0][0].cpu(), torch.from_numpy(_upstream_reading(normalize(rgb[None]))[0]))
    assert '"crf_image": "denormalized"' in (tmp_path / "out" / ".mars-run.json").read_text()
    with pytest.raises(ValueError, match="crf_image must be one of"):
        predict_job(_Net(), tmp_path / "im", tmp_path / "out2", crf_image="raw", progress=False)
