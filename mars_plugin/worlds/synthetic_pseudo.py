"""The simulated WSSS pseudo labels of the synthetic world (see
:mod:`mars_plugin.worlds.synthetic_scenes`): the problematic classes spill into their own context
near the object (the bias MARS removes), every class region gets boundary noise, and some images
an ignore band along their object boundaries, like IRNet's ``ir_label``.

Every function draws from the generator it is given, in a fixed order: the world of a seed is
the same bit for bit.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from mars_plugin.formats.files import IGNORE_VALUE

from mars_plugin.worlds.synthetic import CLASS_NAMES, OWN_CONTEXT

__all__ = [
    "simulated_pseudo_labels",
]


def _dilate(mask: torch.Tensor, r: int) -> torch.Tensor:
    """(N, H, W) bool -> dilation by a (2r+1) square."""
    if r <= 0:
        return mask
    return F.max_pool2d(mask[:, None].float(), 2 * r + 1, stride=1, padding=r)[:, 0] > 0.5


def _erode(mask: torch.Tensor, r: int) -> torch.Tensor:
    if r <= 0:
        return mask
    return ~_dilate(~mask, r)


def _gauss_matrix(n: int, sigma: float, offset: float = 0.0) -> torch.Tensor:
    """(n, n) smoothing matrix: row i = sum_j exp(-(i - j - offset)^2 / 2 sigma^2) / (sigma sqrt(2 pi)).

    ``offset`` > 0 smears mass towards larger indices (downwards for rows)."""
    i = torch.arange(n, dtype=torch.float32)
    d = i[:, None] - i[None, :] - offset
    return torch.exp(-0.5 * (d / sigma) ** 2) / (sigma * math.sqrt(2 * math.pi))


def _leak(g: torch.Generator, gt: torch.Tensor, kinds: torch.Tensor, leak_rate: float,
          leak_spread: float) -> torch.Tensor:
    """The pseudo labels with the problematic classes spilled into their own context nearby."""
    n, H, W = gt.shape
    S = float(W)
    pseudo = gt.clone()
    leaks = torch.rand(n, generator=g) < leak_rate
    rough = F.interpolate(torch.randn(n, 1, max(1, H // 8), max(1, W // 8), generator=g), size=(H, W),
                          mode="bilinear", align_corners=False)[:, 0]
    sx, sy = leak_spread * S, 0.5 * leak_spread * S
    kx = _gauss_matrix(W, sx)  # horizontal smear (context is horizontal: rails, sea)
    ky = _gauss_matrix(H, sy, offset=0.5 * sy)  # vertical smear, towards the bottom (under the object)
    for c, ctx in OWN_CONTEXT.items():
        obj = (gt == c).float()
        # Gaussian smear of the object: ~0.5 on its border, decaying over the band width; an
        # object fully surrounded by context spills ~sx horizontally and ~sy (mostly downwards).
        field = torch.einsum("ij,njk,lk->nil", ky, obj, kx)
        band = (field > 0.03) & (field * (1.0 + 0.35 * rough) > 0.08)  # ragged, but only near the object
        leak = band & (kinds == ctx) & leaks[:, None, None]
        pseudo = pseudo.masked_fill(leak, c)
    return pseudo


def _move_boundaries(g: torch.Generator, pseudo: torch.Tensor, radius: int, erode_rate: float,
                     dilate_rate: float) -> torch.Tensor:
    """Every class region of an image eroded, kept or dilated by ``radius`` pixels (0: none)."""
    if radius <= 0:
        return pseudo
    n, H, W = pseudo.shape
    C = len(CLASS_NAMES) - 1
    u = torch.rand(n, C, generator=g)
    op = torch.where(u < erode_rate, 0, torch.where(u >= 1.0 - dilate_rate, 2, 1))  # 0 erode, 1 keep, 2 dilate
    # Ragged edges: a smooth random field decides which stretches of the boundary move.
    accept = F.interpolate(torch.randn(n, 1, max(1, H // 4), max(1, W // 4), generator=g), size=(H, W),
                           mode="bilinear", align_corners=False)[:, 0] > -0.4
    for c in range(1, C + 1):
        region = pseudo == c
        grow = _dilate(region, radius) & (pseudo == 0) & accept & (op[:, c - 1] == 2)[:, None, None]
        shrink = region & ~_erode(region, radius) & accept & (op[:, c - 1] == 0)[:, None, None]
        pseudo = pseudo.masked_fill(grow, c).masked_fill(shrink, 0)
    return pseudo


def _ignore_band(g: torch.Generator, pseudo: torch.Tensor, ignore_rate: float) -> torch.Tensor:
    """The inner border of the objects set to the ignore value, in some images."""
    if ignore_rate <= 0:
        return pseudo
    has_ignore = torch.rand(pseudo.shape[0], generator=g) < ignore_rate
    lab = pseudo.float()[:, None]
    hi = F.max_pool2d(lab, 3, stride=1, padding=1)[:, 0]
    lo = -F.max_pool2d(-lab, 3, stride=1, padding=1)[:, 0]
    edge = (hi != lo) & (pseudo > 0) & has_ignore[:, None, None]  # inner border of the objects
    return pseudo.masked_fill(edge, IGNORE_VALUE)


def simulated_pseudo_labels(g: torch.Generator, gt: torch.Tensor, kinds: torch.Tensor, *, leak_rate: float,
                            leak_spread: float, boundary_noise: int, erode_rate: float, dilate_rate: float,
                            ignore_rate: float) -> torch.Tensor:
    """(N, H, W) int64 pseudo labels from the ground truth ``gt`` and the region ``kinds`` (both
    (N, H, W)): leaks, then boundary noise, then ignore bands (the arguments of
    :func:`~mars_plugin.worlds.synthetic_scenes.make_world`, already checked)."""
    pseudo = _leak(g, gt, kinds, leak_rate, leak_spread)
    pseudo = _move_boundaries(g, pseudo, boundary_noise, erode_rate, dilate_rate)
    return _ignore_band(g, pseudo, ignore_rate)
