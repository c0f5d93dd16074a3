"""A generator of small, fully labelled scenes that reproduce MARS's failure case on purpose.

Every image is a little outdoor scene: sky above a horizon, a ground *context* below (sea, rail,
grass or road), sometimes a second ground strip at the bottom and a wall on one side, and one or
two objects of the image's classes. Ground truth is exact. On top of it:

* **Simulated WSSS pseudo labels.** The *problematic* classes (boat, almost always on sea; train,
  almost always on rail) spill into their own context, as CAM-based pseudo labels do (Jo et al.,
  ICCV 2023, Fig. 1): the context pixels within a band around the object, smeared along the
  ground and under the object, get the object's label. Every class gets boundary noise (random
  erosion/dilation) and some objects a thin ignore (255) band, like IRNet's ``ir_label``.
* **USS-like embeddings.** One prototype per region kind (the pseudo label cannot tell the leaked
  sea from the boat, the embedding can: it is sea), with a super-category overlap (boat/train/car
  share a component, and dog/person/bird), per-pixel Gaussian noise, a per-image shift, and
  average pooling to a ViT-like patch grid of stride ``stride`` (boundary cells mix kinds).

The same contexts also appear as *plain background* (label 0) in images of other classes: sea
behind a dog, rail next to a car. That is what MARS exploits: the biased cluster of a boat image
is close to the background of all the other images.

The world's vocabulary and container are in :mod:`mars_plugin.worlds.synthetic`.
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Tuple

import torch
import torch.nn.functional as F

from mars_plugin.formats.files import IGNORE_VALUE

from mars_plugin.worlds.synthetic import (
    _NUM_CONTEXTS,
    BIRD,
    BOAT,
    CAR,
    CLASS_NAMES,
    DOG,
    GRASS,
    KIND_NAMES,
    OWN_CONTEXT,
    PERSON,
    PROBLEMATIC,
    RAIL,
    ROAD,
    SEA,
    SKY,
    TRAIN,
    WALL,
    SyntheticWorld,
)

__all__ = [
    "make_world",
]

_GROUNDS = (SEA, RAIL, GRASS, ROAD)
_NON_PROBLEMATIC = (DOG, CAR, PERSON, BIRD)
#: Super-categories: kinds of one group share a prototype component (cosine = ``overlap``).
_GROUPS: Tuple[Tuple[int, ...], ...] = (
    tuple(_NUM_CONTEXTS - 1 + c for c in (BOAT, TRAIN, CAR)),
    tuple(_NUM_CONTEXTS - 1 + c for c in (DOG, PERSON, BIRD)),
)

# Object geometry per class id (fractions of the image size): width range, height/width range.
_WIDTH = {BOAT: (0.28, 0.45), TRAIN: (0.40, 0.65), DOG: (0.20, 0.32), CAR: (0.25, 0.40), PERSON: (0.13, 0.20),
          BIRD: (0.18, 0.28)}
_ASPECT = {BOAT: (0.40, 0.60), TRAIN: (0.28, 0.40), DOG: (0.60, 0.90), CAR: (0.45, 0.60), PERSON: (2.0, 2.6),
           BIRD: (0.50, 0.80)}

# RGB: base colour of every context kind; per-instance colour choices of every class. Each class
# has its own hue family (small per-instance variation), so a small CNN can tell classes apart
# from appearance in a few epochs, as a real segmenter does from texture and shape.
_CONTEXT_RGB = [(135, 185, 235), (25, 75, 145), (115, 100, 85), (70, 145, 55), (85, 85, 90), (160, 85, 60)]
_OBJECT_RGB = {
    BOAT: [(235, 235, 228), (215, 222, 232)],
    TRAIN: [(225, 195, 40), (240, 212, 75)],
    DOG: [(140, 95, 50), (165, 112, 62)],
    CAR: [(200, 30, 30), (178, 40, 52)],
    PERSON: [(125, 60, 175), (105, 50, 150)],
    BIRD: [(40, 40, 45), (62, 56, 50)],
}
_SKIN = (225, 180, 150)
_MIN_SIZE = 16


# --------------------------------------------------------------------------------------------
# validation


def _int(value: Any, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer >= {minimum}, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value}")
    return int(value)


def _real(value: Any, name: str, low: float, high: float = math.inf, *, low_open: bool = False,
          high_open: bool = False) -> float:
    lb, hb = "(" if low_open else "[", ")" if high_open or high == math.inf else "]"
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise TypeError(f"{name} must be a finite real number in {lb}{low}, {high}{hb}, got {type(value).__name__} {value!r}")
    v = float(value)
    if (v <= low if low_open else v < low) or (v >= high if high_open else v > high):
        raise ValueError(f"{name} must lie in {lb}{low}, {high}{hb}, got {value}")
    return v


# --------------------------------------------------------------------------------------------
# helpers (all vectorised over images)


def _uniform(g: torch.Generator, lo, hi, n: int) -> torch.Tensor:
    return torch.as_tensor(lo, dtype=torch.float32) + (torch.as_tensor(hi, dtype=torch.float32)
                                                       - torch.as_tensor(lo, dtype=torch.float32)) * torch.rand(n, generator=g)


def _pick_other(g: torch.Generator, choices: Tuple[int, ...], avoid: torch.Tensor) -> torch.Tensor:
    """A uniform choice among ``choices`` per row, never equal to ``avoid`` (when avoidable)."""
    ch = torch.tensor(choices)
    r = torch.randint(len(choices), avoid.shape, generator=g)
    out = ch[r]
    same = out == avoid
    out[same] = ch[(r[same] + 1) % len(choices)]
    return out


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


def _prototypes(g: torch.Generator, dim: int, overlap: float) -> torch.Tensor:
    """(K, D) unit prototypes: orthonormal except a shared component inside each super-category."""
    k = len(KIND_NAMES)
    q = torch.linalg.qr(torch.randn(dim, k + len(_GROUPS), generator=g, dtype=torch.float64)).Q.T  # (K+G, D)
    protos = q[:k].clone()
    for j, group in enumerate(_GROUPS):
        for kind in group:
            protos[kind] = math.sqrt(1.0 - overlap) * q[kind] + math.sqrt(overlap) * q[k + j]
    return protos.float()


# --------------------------------------------------------------------------------------------
# the generator


def make_world(
    num_images: int = 300,
    *,
    size: int = 64,
    dim: int = 32,
    stride: int = 4,
    seed: int = 0,
    leak_rate: float = 0.8,
    noise: float = 0.35,
    boundary_noise: int = 1,
    erode_rate: float = 1 / 3,
    dilate_rate: float = 1 / 3,
    overlap: float = 0.5,
    shift: float = 0.2,
    leak_spread: float = 0.09,
    context_bias: float = 0.95,
    two_class_rate: float = 0.3,
    ignore_rate: float = 0.3,
) -> SyntheticWorld:
    """Generate ``num_images`` labelled scenes (see the module docstring).

    Args:
        num_images: N >= 1.
        size: image height = width, >= 16 and divisible by ``stride``.
        dim: embedding size D, >= number of region kinds + super-categories (14).
        stride: feature stride; features are (D, size/stride, size/stride) (average pooling of
            per-pixel embeddings over stride x stride cells).
        seed: everything is a deterministic function of the arguments (bitwise).
        leak_rate: probability that the pseudo label of a problematic object leaks into its
            context, in [0, 1].
        noise: standard deviation of the per-pixel Gaussian noise, per dimension, on unit-norm
            prototypes (before pooling; a cell of stride^2 pixels keeps noise / stride), >= 0.
        boundary_noise: radius in pixels of the random erosion/dilation of every pseudo-label
            region (0: none), in [0, size // 4].
        erode_rate, dilate_rate: probability that a class region of an image is eroded /
            dilated by ``boundary_noise`` (else it keeps its boundary); each in [0, 1], sum <= 1.
            CAM-based pseudo labels spill over object boundaries more often than they fall
            short, and MARS removes a spilled rim (it looks like the background) but cannot
            restore an eroded one (the teacher only fills removed pixels): with as many
            erosions as dilations, the debiased labels are one-sidedly shrunk.
        overlap: cosine between prototypes of one super-category (boat/train/car and
            dog/person/bird), in [0, 1).
        shift: norm of a random per-image shift of all embeddings, >= 0.
        leak_spread: width of the leak band as a fraction of ``size`` (Gaussian smear of the
            object along the ground; its vertical extent is half of it), > 0.
        context_bias: probability that a boat is on sea / a train on rail, in [0, 1].
        two_class_rate: probability that an image holds a second class, in [0, 1].
        ignore_rate: probability that an image's pseudo label gets an ignore band along its
            object boundaries, in [0, 1].

    Returns:
        A :class:`SyntheticWorld`.
    """
    n = _int(num_images, "num_images", 1)
    size = _int(size, "size", _MIN_SIZE)
    stride = _int(stride, "stride", 1)
    if size % stride:
        raise ValueError(f"size must be divisible by stride, got size={size}, stride={stride}")
    k_kinds = len(KIND_NAMES)
    dim = _int(dim, "dim", k_kinds + len(_GROUPS))
    seed = _int(seed, "seed", 0)
    if seed >= 2**63:
        raise ValueError(f"seed must be < 2**63, got {seed}")
    leak_rate = _real(leak_rate, "leak_rate", 0.0, 1.0)
    noise = _real(noise, "noise", 0.0)
    boundary_noise = _int(boundary_noise, "boundary_noise", 0)
    if boundary_noise > size // 4:
        raise ValueError(f"boundary_noise must be <= size // 4 = {size // 4} pixels, got {boundary_noise}")
    erode_rate = _real(erode_rate, "erode_rate", 0.0, 1.0)
    dilate_rate = _real(dilate_rate, "dilate_rate", 0.0, 1.0)
    if erode_rate + dilate_rate > 1.0 + 1e-12:
        raise ValueError(f"erode_rate + dilate_rate must be <= 1, got {erode_rate} + {dilate_rate}")
    overlap = _real(overlap, "overlap", 0.0, 1.0, high_open=True)
    shift = _real(shift, "shift", 0.0)
    leak_spread = _real(leak_spread, "leak_spread", 0.0, low_open=True)
    context_bias = _real(context_bias, "context_bias", 0.0, 1.0)
    two_class_rate = _real(two_class_rate, "two_class_rate", 0.0, 1.0)
    ignore_rate = _real(ignore_rate, "ignore_rate", 0.0, 1.0)

    C = len(CLASS_NAMES) - 1
    H = W = size
    S = float(size)
    g = torch.Generator().manual_seed(seed)
    protos = _prototypes(g, dim, overlap)

    # ---- scene layout ------------------------------------------------------------------
    primary = (torch.arange(n) % C + 1)[torch.randperm(n, generator=g)]  # balanced classes
    two = torch.rand(n, generator=g) < two_class_rate
    second = _pick_other(g, _NON_PROBLEMATIC, primary)
    dup = torch.rand(n, generator=g) < 0.25  # a second instance of the same class
    cls1 = torch.where(two, second, torch.where(dup, primary, torch.zeros_like(primary)))

    ground = torch.tensor(_GROUNDS)[torch.randint(len(_GROUNDS), (n,), generator=g)]
    on_own = torch.rand(n, generator=g) < context_bias
    other_ground = torch.zeros_like(ground)
    for c, ctx in OWN_CONTEXT.items():
        is_c = primary == c
        other_ground[is_c] = _pick_other(g, _GROUNDS, torch.full((n,), ctx))[is_c]
        ground = torch.where(is_c, torch.where(on_own, torch.full_like(ground, ctx), other_ground), ground)
    horizon = (_uniform(g, 0.30 * S, 0.50 * S, n)).round()
    has_strip = torch.rand(n, generator=g) < 0.3
    strip_h = torch.where(has_strip, _uniform(g, 0.10 * S, 0.18 * S, n).round(), torch.zeros(n))
    strip_ctx = _pick_other(g, _GROUNDS, ground)
    has_wall = torch.rand(n, generator=g) < 0.3
    wall_w = _uniform(g, 0.15 * S, 0.30 * S, n).round()
    wall_h = _uniform(g, 0.15 * S, 0.30 * S, n).round()
    wall_left = torch.rand(n, generator=g) < 0.5

    yy = torch.arange(H, dtype=torch.float32)[None, :, None]  # (1, H, 1)
    xx = torch.arange(W, dtype=torch.float32)[None, None, :]  # (1, 1, W)
    col = lambda t: t[:, None, None]  # noqa: E731
    kinds = torch.where(yy < col(horizon), torch.tensor(SKY), col(ground)).expand(n, H, W).clone()
    kinds = torch.where(yy >= S - col(strip_h), col(strip_ctx), kinds)
    in_wall_cols = torch.where(col(wall_left), xx < col(wall_w), xx >= S - col(wall_w))
    wall = col(has_wall) & in_wall_cols & (yy < col(horizon)) & (yy >= col(horizon - wall_h))
    kinds = kinds.masked_fill(wall, WALL)

    # ---- objects (slot 0 always, slot 1 for a second class / instance, painted on top) -----
    slot_map = torch.full((n, H, W), -1, dtype=torch.long)
    slot_rgb = []
    ground_bottom = S - strip_h
    cx0 = None
    for slot, cls in enumerate((primary, cls1)):
        present = cls > 0
        safe = cls.clamp_min(1)
        wlo = torch.tensor([0.0] + [_WIDTH[c][0] for c in range(1, C + 1)])[safe]
        whi = torch.tensor([0.0] + [_WIDTH[c][1] for c in range(1, C + 1)])[safe]
        alo = torch.tensor([0.0] + [_ASPECT[c][0] for c in range(1, C + 1)])[safe]
        ahi = torch.tensor([0.0] + [_ASPECT[c][1] for c in range(1, C + 1)])[safe]
        w = (_uniform(g, wlo, whi, n) * S).clamp_min(3.0)
        h = (w * _uniform(g, alo, ahi, n)).clamp(3.0, 0.6 * S)
        if slot == 0:
            cx = _uniform(g, w / 2, S - w / 2, n)
            cx0 = cx
        else:  # on the other half of the image, to limit occlusion
            left = cx0 >= S / 2
            lo = torch.where(left, w / 2, (w / 2).clamp_min(S / 2))
            hi = torch.where(left, (S - w / 2).clamp_max(S / 2), S - w / 2)
            cx = _uniform(g, lo, torch.maximum(lo, hi), n)
        # Ground objects stand on the ground (bottom between the horizon and the strip); birds fly.
        b_lo = horizon + 0.25 * (ground_bottom - horizon)
        bottom = _uniform(g, b_lo, ground_bottom - 1, n)
        cy_ground = bottom - h / 2
        cy_sky = _uniform(g, h / 2 + 1, torch.maximum(h / 2 + 1, horizon - h / 2 - 1), n)
        cy = torch.where(cls == BIRD, cy_sky, cy_ground)
        shape = torch.randint(3, (n,), generator=g)  # 0 ellipse, 1 rounded rectangle, 2 blob
        lobes = torch.randint(3, 6, (n,), generator=g).float()
        amp = _uniform(g, 0.12, 0.25, n)
        phase = _uniform(g, 0.0, 2 * math.pi, n)
        dx = (xx + 0.5 - col(cx)) / col(w / 2)
        dy = (yy + 0.5 - col(cy)) / col(h / 2)
        r2 = dx**2 + dy**2
        ellipse = r2 <= 1.0
        rect = dx**4 + dy**4 <= 1.0
        theta = torch.atan2(dy, dx)
        blob = r2.sqrt() <= 1.0 + col(amp) * torch.sin(col(lobes) * theta + col(phase))
        m = torch.where(col(shape == 0), ellipse, torch.where(col(shape == 1), rect, blob)) & col(present)
        kinds = torch.where(m, col(_NUM_CONTEXTS - 1 + safe), kinds)
        slot_map = slot_map.masked_fill(m, slot)
        # per-instance colour
        choice = torch.rand(n, generator=g)
        rgb = torch.zeros(n, 3)
        for c in range(1, C + 1):
            pal = torch.tensor(_OBJECT_RGB[c], dtype=torch.float32)
            rgb = torch.where((safe == c)[:, None], pal[(choice * len(pal)).long().clamp_max(len(pal) - 1)], rgb)
        slot_rgb.append((rgb, cy, h, cls))

    gt = (kinds - (_NUM_CONTEXTS - 1)).clamp_min(0)
    image_classes = torch.zeros(n, C, dtype=torch.bool)
    for c in range(1, C + 1):
        image_classes[:, c - 1] = (gt == c).flatten(1).any(1)

    # ---- simulated WSSS pseudo labels ------------------------------------------------------
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
        leak = band & (kinds == ctx) & col(leaks)
        pseudo = pseudo.masked_fill(leak, c)

    if boundary_noise > 0:
        u = torch.rand(n, C, generator=g)
        op = torch.where(u < erode_rate, 0, torch.where(u >= 1.0 - dilate_rate, 2, 1))  # 0 erode, 1 keep, 2 dilate
        # Ragged edges: a smooth random field decides which stretches of the boundary move.
        accept = F.interpolate(torch.randn(n, 1, max(1, H // 4), max(1, W // 4), generator=g), size=(H, W),
                               mode="bilinear", align_corners=False)[:, 0] > -0.4
        for c in range(1, C + 1):
            region = pseudo == c
            grow = _dilate(region, boundary_noise) & (pseudo == 0) & accept & col(op[:, c - 1] == 2)
            shrink = region & ~_erode(region, boundary_noise) & accept & col(op[:, c - 1] == 0)
            pseudo = pseudo.masked_fill(grow, c).masked_fill(shrink, 0)

    if ignore_rate > 0:
        has_ignore = torch.rand(n, generator=g) < ignore_rate
        lab = pseudo.float()[:, None]
        hi = F.max_pool2d(lab, 3, stride=1, padding=1)[:, 0]
        lo = -F.max_pool2d(-lab, 3, stride=1, padding=1)[:, 0]
        edge = (hi != lo) & (pseudo > 0) & col(has_ignore)  # inner border of the objects
        pseudo = pseudo.masked_fill(edge, IGNORE_VALUE)

    # ---- USS-like embeddings -----------------------------------------------------------------
    # Per-pixel prototype + N(0, noise^2) per dimension, averaged over stride x stride cells: the
    # mean of the prototypes is the kind fractions times the prototypes, and the mean of stride^2
    # i.i.d. Gaussians is N(0, (noise / stride)^2), drawn directly at cell resolution.
    frac = F.avg_pool2d(F.one_hot(kinds, k_kinds).permute(0, 3, 1, 2).float(), stride)  # (N, K, h, w)
    h_f, w_f = H // stride, W // stride
    features = torch.einsum("nkhw,kd->ndhw", frac, protos)
    features = features + (noise / stride) * torch.randn(n, dim, h_f, w_f, generator=g)
    features = features + (shift / math.sqrt(dim)) * torch.randn(n, dim, 1, 1, generator=g)
    features = features.contiguous()

    # ---- RGB ----------------------------------------------------------------------------------
    phase = _uniform(g, 0.0, 2 * math.pi, n)
    ph = col(phase)
    base = torch.tensor(_CONTEXT_RGB + [(0, 0, 0)] * C, dtype=torch.float32)[kinds]  # (N, H, W, 3)
    tex = torch.zeros(n, H, W)
    tex = torch.where(kinds == SKY, 25.0 * yy / col(horizon.clamp_min(1)) - 10.0, tex)
    tex = torch.where(kinds == SEA, 22.0 * torch.sin(2 * math.pi * yy / 3.5 + 1.5 * torch.sin(2 * math.pi * xx / 16 + ph)), tex)
    tex = torch.where(kinds == RAIL, torch.where(torch.remainder(xx + 5 * ph, 5.0) < 2.0, -35.0, 10.0)
                      + torch.where(torch.remainder(yy - col(horizon), 6.0) < 1.0, 50.0, 0.0), tex)
    tex = torch.where(kinds == WALL, torch.where((torch.remainder(yy, 4.0) < 1.0)
                                                 | (torch.remainder(xx + 4 * torch.remainder(torch.floor(yy / 4), 2), 8.0) < 1.0),
                                                 55.0, 0.0), tex)
    grain = torch.randn(n, H, W, generator=g)
    amp = torch.tensor([4.0, 6.0, 12.0, 22.0, 8.0, 6.0] + [5.0] * C)[kinds]
    rgb = base + (tex + amp * grain)[..., None]
    for slot, (col_rgb, cy, h, cls) in enumerate(slot_rgb):
        m = slot_map == slot
        rel = (yy + 0.5 - col(cy)) / col(h / 2)  # -1 top .. 1 bottom of the object
        obj = col_rgb[:, None, None, :] * (1.0 - 0.12 * rel)[..., None]
        obj = torch.where(((col(cls) == TRAIN) & (rel > -0.6) & (rel < -0.15))[..., None], obj * 0.35, obj)  # windows
        obj = torch.where(((col(cls) == PERSON) & (rel < -0.6))[..., None], torch.tensor(_SKIN, dtype=torch.float32), obj)
        obj = torch.where(((col(cls) == BOAT) & (rel > 0.35))[..., None], obj * 0.55, obj)  # hull
        rgb = torch.where(m[..., None], obj + 5.0 * grain[..., None], rgb)
    images = rgb.round().clamp(0, 255).to(torch.uint8)

    return SyntheticWorld(
        images=images, gt=gt, pseudo=pseudo, features=features, image_classes=image_classes, kinds=kinds,
        class_names=CLASS_NAMES, kind_names=KIND_NAMES, problematic=PROBLEMATIC,
        stems=[f"syn_{i:06d}" for i in range(n)], prototypes=protos, stride=stride,
    )
