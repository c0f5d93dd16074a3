"""What a weight file lacks against a network: the one comparison every weights reader of
:mod:`mars_plugin.networks` makes (torchvision's ImageNet files, deeplab-pytorch's
caffe-converted files, WR38's), so that each names missing, unexpected and mis-shaped keys the
same way in its one-line error."""
from __future__ import annotations

from typing import Iterable, List, Mapping, Optional

import torch

__all__ = ["check_weight_values", "some_keys", "state_mismatch"]


def some_keys(keys: List[str], n: int = 4) -> str:
    """The first ``n`` of ``keys`` and how many more: a message's short list."""
    return ", ".join(keys[:n]) + (f", ... {len(keys) - n} more" if len(keys) > n else "")


def state_mismatch(state: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor],
                   required: Optional[Iterable[str]] = None) -> List[str]:
    """The ways ``state`` (a file's tensors) does not fit ``expected`` (a network's state dict),
    each a message part: ``"N missing (...)"``, ``"N unexpected (...)"``, ``"N of another
    shape (...)"``; empty when it fits.

    ``required``: the keys the file must hold (default: every expected key but BatchNorm's
    ``num_batches_tracked``, which older files lack).
    """
    if required is None:
        required = [k for k in expected if not k.endswith("num_batches_tracked")]
    missing = [k for k in required if k not in state]
    unexpected = [k for k in state if k not in expected]
    mismatched = [f"{k} {tuple(state[k].shape)} != {tuple(expected[k].shape)}"
                  for k in expected if k in state and state[k].shape != expected[k].shape]
    parts = []
    if missing:
        parts.append(f"{len(missing)} missing ({some_keys(missing)})")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected ({some_keys(unexpected)})")
    if mismatched:
        parts.append(f"{len(mismatched)} of another shape ({some_keys(mismatched, 3)})")
    return parts


def check_weight_values(state: Mapping[str, torch.Tensor], path: str) -> None:
    """Every weight of a file (BatchNorm's counters aside) floating and finite, else a
    ValueError naming the file and the key: a damaged file is refused before anything loads."""
    for k, v in state.items():
        if k.endswith("num_batches_tracked"):
            continue
        if not v.is_floating_point():
            raise ValueError(f"{path}: {k} has dtype {v.dtype}, expected floating weights")
        if not torch.isfinite(v).all():
            raise ValueError(f"{path}: {k} holds non-finite values (a damaged weight file)")
