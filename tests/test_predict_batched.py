"""`mars predict`'s computation on a batch equals it image by image, and runs batched: the
network once per scale for the whole batch and its mirrors (networks/inference.py), one CRF
call for the batch, everything on the probabilities' device until the labels."""
import pytest
import torch
from test_predict import Net, _images, _normalize

from mars_plugin.networks import inference
from mars_plugin.networks.inference import DEFAULT_SCALES, multiscale_probs, multiscale_probs_dhr, predict_labels
from _spies import Spy


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("fuse", [multiscale_probs, multiscale_probs_dhr])
@pytest.mark.parametrize("flip", [True, False])
def test_one_network_call_per_scale_for_the_batch_equal_per_image(fuse, flip):
    model = Net(5).eval()
    x = _normalize(_images(3, 26, 37))
    spy = Spy(model)
    got = fuse(spy, x, DEFAULT_SCALES, flip)
    assert spy.batches == [6 if flip else 3] * len(DEFAULT_SCALES)
    for i in range(3):
        torch.testing.assert_close(got[i:i + 1], fuse(model, x[i:i + 1], DEFAULT_SCALES, flip), rtol=0, atol=1e-6)
    assert float((got[0] - got[1]).abs().max()) > 1e-2  # the images differ: a mix-up would show


@pytest.mark.parametrize("crf", ["mars", "none"])
def test_predict_labels_of_a_batch_equal_per_image_with_one_crf_call(crf, monkeypatch):
    model = Net(4).eval()
    rgb = _images(4, 24, 30, seed=2)
    x = _normalize(rgb)
    calls = []
    real = inference.dense_crf

    def spy(probs, *args, **kwargs):
        calls.append(tuple(probs.shape))
        return real(probs, *args, **kwargs)

    monkeypatch.setattr(inference, "dense_crf", spy)
    got = predict_labels(model, x, rgb, crf=crf, crf_image="denormalized")
    assert calls == ([(4, 4, 24, 30)] if crf == "mars" else [])  # one CRF call for the 4 images
    for i in range(4):
        assert torch.equal(got[i:i + 1], predict_labels(model, x[i:i + 1], rgb[i:i + 1], crf=crf,
                                                        crf_image="denormalized")), i
