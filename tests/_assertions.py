"""Assertions shared by the test modules."""
import numpy as np
import torch


def assert_close(a, b, atol=0.0):
    """Same shape and values within atol (numpy; avoids torch.testing's slow first call)."""
    a = a.detach().cpu().numpy() if isinstance(a, torch.Tensor) else np.asarray(a)
    b = b.detach().cpu().numpy() if isinstance(b, torch.Tensor) else np.asarray(b)
    assert a.shape == b.shape, (a.shape, b.shape)
    if a.dtype == bool or b.dtype == bool or np.issubdtype(a.dtype, np.integer):
        assert a.dtype == b.dtype, (a.dtype, b.dtype)
        np.testing.assert_array_equal(a, b)
    else:
        np.testing.assert_allclose(a, b, atol=atol, rtol=0)
