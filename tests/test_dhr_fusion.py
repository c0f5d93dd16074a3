"""multiscale_probs_dhr: DHR's apply_ms (core/networks.py:91-127 at 94d5189), the fusion mars
predict runs for deeplabv3+dhr networks.

The reference reads DHR's definition plainly, one image at a time: every resize bilinear with
align_corners=True (tools/torch_utils.py:45) and skipped at the same size, the image and its
mirror as one batch, each softmax resized to the first scale's logits' grid, the mean of the
stacked maps there, then the mean resized to the image.
"""
from __future__ import annotations

import json

import numpy as np
import torch
import torch.nn.functional as F

from mars_plugin.commands.predict import predict_job
from mars_plugin.formats.files import read_label, write_image
from mars_plugin.networks.deeplab import build_model, normalize
from mars_plugin.networks.inference import labels_from_probs, multiscale_probs, multiscale_probs_dhr

SCALES = (1.0, 0.5, 1.5, 2.0)


def _resize(x, size):
    if tuple(x.shape[-2:]) == tuple(size):
        return x
    return F.interpolate(x, size=tuple(size), mode="bilinear", align_corners=True)


def _apply_ms(model, image, scales=SCALES, hflip=True):
    size, pred = None, []
    H, W = image.shape[2:]
    for s in scales:
        x = _resize(image, (int(H * s), int(W * s)))
        if hflip:
            x = torch.cat([x, x.flip(-1)], dim=0)
        logits = model(x)
        if size is None:
            size = logits.shape[2:]
        masks = _resize(F.softmax(logits, dim=1), size)
        pred.append(masks[0])
        if hflip:
            pred.append(masks[1].flip(-1))
    return _resize(torch.mean(torch.stack(pred), dim=0)[None], (H, W))[0]


def _net():
    torch.manual_seed(0)
    net = build_model("deeplabv3+dhr", "resnet18", 3).eval()
    with torch.no_grad():  # logits large enough that the fusions visibly differ
        net.seg_decoder.classifier.weight.mul_(20)
    return net


def test_equals_dhr_apply_ms_one_image_at_a_time():
    net = _net()
    rgb = torch.randint(0, 256, (2, 37, 50, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    x = normalize(rgb)
    with torch.no_grad():
        got = multiscale_probs_dhr(net, x, SCALES, True)
        want = torch.stack([_apply_ms(net, x[b:b + 1]) for b in range(2)])
        rsepm = multiscale_probs(net, x, SCALES, True)
    assert got.shape == (2, 4, 37, 50)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-6)
    assert (got - rsepm).abs().max() > 1e-3  # RS+EPM's fusion is another computation


def test_predict_job_fuses_a_dhr_network_as_dhr(tmp_path, monkeypatch):
    from mars_plugin.commands import predict

    calls = []
    monkeypatch.setattr(predict, "multiscale_probs_dhr",
                        lambda *a, **k: calls.append(1) or multiscale_probs_dhr(*a, **k))
    net = _net()
    rgb = np.random.default_rng(2).integers(0, 256, size=(37, 50, 3), dtype=np.uint8)
    (tmp_path / "im").mkdir()
    write_image(tmp_path / "im" / "a.png", rgb)
    predict_job(net, tmp_path / "im", tmp_path / "out", crf="none", progress=False, max_bytes=None)
    x = normalize(rgb[None])
    want = labels_from_probs(multiscale_probs_dhr(net, x), torch.from_numpy(rgb[None]), crf="none")[0]
    assert torch.equal(torch.as_tensor(read_label(tmp_path / "out" / "a.png")).long(), want)
    assert calls and json.loads((tmp_path / "out" / ".mars-run.json").read_text())["settings"]["fuse_at"] == "logits"
