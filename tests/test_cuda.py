"""The whole pipeline on CUDA equals the CPU result (skipped without a GPU)."""
import pytest
import torch

from mars_plugin import WCELoss, complement_labels, debias_labels, select_centroids

from test_end_to_end import make_world

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def _run(world, device):
    V = select_centroids(((w["features"].to(device), w["pseudo"].to(device)) for w in world), num_classes=2)
    y = torch.stack([
        debias_labels(w["features"].to(device), w["pseudo"].to(device), V, w["classes"], refine="threshold")
        for w in world
    ])
    g = torch.Generator().manual_seed(0)
    probs = torch.rand(len(world), 3, *y.shape[-2:], generator=g).softmax(1).to(device)
    y_co, cert = complement_labels(y, probs, [w["classes"] for w in world])
    logits = torch.randn(len(world), 3, *y.shape[-2:], generator=g).to(device).requires_grad_()
    loss = WCELoss()(logits, y_co, cert)
    loss.backward()
    return V, y, y_co, cert, loss, logits.grad


def test_pipeline_cuda_matches_cpu():
    world = make_world(0)
    cpu = _run(world, "cpu")
    gpu = _run(world, "cuda")
    assert gpu[0].centroids.device.type == "cuda" and gpu[1].device.type == "cuda"
    torch.testing.assert_close(gpu[0].centroids.cpu(), cpu[0].centroids, atol=1e-5, rtol=1e-5)
    assert torch.equal(gpu[0].valid.cpu(), cpu[0].valid)
    for a, b in zip(gpu[1:4], cpu[1:4]):
        assert torch.equal(a.cpu(), b) if not a.is_floating_point() else torch.allclose(a.cpu(), b, atol=1e-6)
    torch.testing.assert_close(gpu[4].cpu(), cpu[4], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gpu[5].cpu(), cpu[5], atol=1e-6, rtol=1e-5)


def test_select_on_cuda_for_cpu_features_matches_cpu():
    import numpy as np
    from test_select_centroids import assert_same_result, random_pairs

    pairs = [(torch.from_numpy(f).half(), torch.from_numpy(y)) for f, y in random_pairs(np.random.default_rng(0), n=40)]
    cpu = select_centroids(pairs, num_classes=6, batch_size=16)
    gpu = select_centroids(pairs, num_classes=6, batch_size=16, device="cuda")  # one bucket per batch on CUDA
    assert gpu.centroids.device.type == "cuda"
    assert_same_result(gpu.to("cpu"), cpu, atol=1e-5)
