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

The world's vocabulary and container are in :mod:`mars_plugin.worlds.synthetic`, the simulated
pseudo labels in :mod:`mars_plugin.worlds.synthetic_pseudo`.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch
import torch.nn.functional as F

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
from mars_plugin.worlds.synthetic_pseudo import simulated_pseudo_labels

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
# the generator's stages (each draws from the one generator ``g``: the stages run in a fixed
# order, and so do the draws inside each, so a seed gives the same world bit for bit)


@dataclass(frozen=True)
class _WorldSpec:
    """The checked arguments of :func:`make_world` (``n`` is ``num_images``)."""

    n: int
    size: int
    dim: int
    stride: int
    seed: int
    leak_rate: float
    noise: float
    boundary_noise: int
    erode_rate: float
    dilate_rate: float
    overlap: float
    shift: float
    leak_spread: float
    context_bias: float
    two_class_rate: float
    ignore_rate: float


@dataclass(frozen=True)
class _Layout:
    """Every image's scene before its objects: the classes of its two object slots (slot 1: 0
    for none), its horizon row, the height of its bottom strip and its (N, H, W) region kinds."""

    primary: torch.Tensor
    second: torch.Tensor
    horizon: torch.Tensor
    strip_h: torch.Tensor
    kinds: torch.Tensor


def _col(t: torch.Tensor) -> torch.Tensor:
    """(N,) -> (N, 1, 1), to broadcast a per-image value over (N, H, W)."""
    return t[:, None, None]


def _grid(size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Pixel rows (1, H, 1) and columns (1, 1, W) as float32."""
    yy = torch.arange(size, dtype=torch.float32)[None, :, None]
    xx = torch.arange(size, dtype=torch.float32)[None, None, :]
    return yy, xx


def _check_world(num_images: Any, *, size: Any, dim: Any, stride: Any, seed: Any, leak_rate: Any, noise: Any,
                 boundary_noise: Any, erode_rate: Any, dilate_rate: Any, overlap: Any, shift: Any,
                 leak_spread: Any, context_bias: Any, two_class_rate: Any, ignore_rate: Any) -> _WorldSpec:
    """Validate :func:`make_world`'s arguments, in the order of its signature."""
    n = _int(num_images, "num_images", 1)
    size = _int(size, "size", _MIN_SIZE)
    stride = _int(stride, "stride", 1)
    if size % stride:
        raise ValueError(f"size must be divisible by stride, got size={size}, stride={stride}")
    dim = _int(dim, "dim", len(KIND_NAMES) + len(_GROUPS))
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
    return _WorldSpec(
        n=n, size=size, dim=dim, stride=stride, seed=seed, leak_rate=leak_rate, noise=noise,
        boundary_noise=boundary_noise, erode_rate=erode_rate, dilate_rate=dilate_rate,
        overlap=_real(overlap, "overlap", 0.0, 1.0, high_open=True), shift=_real(shift, "shift", 0.0),
        leak_spread=_real(leak_spread, "leak_spread", 0.0, low_open=True),
        context_bias=_real(context_bias, "context_bias", 0.0, 1.0),
        two_class_rate=_real(two_class_rate, "two_class_rate", 0.0, 1.0),
        ignore_rate=_real(ignore_rate, "ignore_rate", 0.0, 1.0),
    )


def _scene_classes(g: torch.Generator, spec: _WorldSpec) -> Tuple[torch.Tensor, torch.Tensor]:
    """The class of each image's object slots: (primary (N,), second (N,), 0 for none)."""
    n, C = spec.n, len(CLASS_NAMES) - 1
    primary = (torch.arange(n) % C + 1)[torch.randperm(n, generator=g)]  # balanced classes
    two = torch.rand(n, generator=g) < spec.two_class_rate
    second = _pick_other(g, _NON_PROBLEMATIC, primary)
    dup = torch.rand(n, generator=g) < 0.25  # a second instance of the same class
    return primary, torch.where(two, second, torch.where(dup, primary, torch.zeros_like(primary)))


def _scene_layout(g: torch.Generator, spec: _WorldSpec) -> _Layout:
    """Sky, ground (a problematic class mostly on its own context), bottom strip and wall."""
    n, S = spec.n, float(spec.size)
    primary, second = _scene_classes(g, spec)
    ground = torch.tensor(_GROUNDS)[torch.randint(len(_GROUNDS), (n,), generator=g)]
    on_own = torch.rand(n, generator=g) < spec.context_bias
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

    yy, xx = _grid(spec.size)
    kinds = torch.where(yy < _col(horizon), torch.tensor(SKY), _col(ground)).expand(n, spec.size, spec.size).clone()
    kinds = torch.where(yy >= S - _col(strip_h), _col(strip_ctx), kinds)
    in_wall_cols = torch.where(_col(wall_left), xx < _col(wall_w), xx >= S - _col(wall_w))
    wall = _col(has_wall) & in_wall_cols & (yy < _col(horizon)) & (yy >= _col(horizon - wall_h))
    kinds = kinds.masked_fill(wall, WALL)
    return _Layout(primary=primary, second=second, horizon=horizon, strip_h=strip_h, kinds=kinds)


def _object_box(g: torch.Generator, spec: _WorldSpec, layout: _Layout, cls: torch.Tensor,
                cx0: Optional[torch.Tensor]) -> Tuple[torch.Tensor, ...]:
    """(w, h, cx, cy) of the objects of one slot, (N,) each; ``cx0``: slot 0's centres (None for
    slot 0 itself)."""
    n, S, C = spec.n, float(spec.size), len(CLASS_NAMES) - 1
    safe = cls.clamp_min(1)
    wlo = torch.tensor([0.0] + [_WIDTH[c][0] for c in range(1, C + 1)])[safe]
    whi = torch.tensor([0.0] + [_WIDTH[c][1] for c in range(1, C + 1)])[safe]
    alo = torch.tensor([0.0] + [_ASPECT[c][0] for c in range(1, C + 1)])[safe]
    ahi = torch.tensor([0.0] + [_ASPECT[c][1] for c in range(1, C + 1)])[safe]
    w = (_uniform(g, wlo, whi, n) * S).clamp_min(3.0)
    h = (w * _uniform(g, alo, ahi, n)).clamp(3.0, 0.6 * S)
    if cx0 is None:
        cx = _uniform(g, w / 2, S - w / 2, n)
    else:  # on the other half of the image, to limit occlusion
        left = cx0 >= S / 2
        lo = torch.where(left, w / 2, (w / 2).clamp_min(S / 2))
        hi = torch.where(left, (S - w / 2).clamp_max(S / 2), S - w / 2)
        cx = _uniform(g, lo, torch.maximum(lo, hi), n)
    # Ground objects stand on the ground (bottom between the horizon and the strip); birds fly.
    horizon, ground_bottom = layout.horizon, S - layout.strip_h
    b_lo = horizon + 0.25 * (ground_bottom - horizon)
    bottom = _uniform(g, b_lo, ground_bottom - 1, n)
    cy_ground = bottom - h / 2
    cy_sky = _uniform(g, h / 2 + 1, torch.maximum(h / 2 + 1, horizon - h / 2 - 1), n)
    return w, h, cx, torch.where(cls == BIRD, cy_sky, cy_ground)


def _object_mask(g: torch.Generator, spec: _WorldSpec, w: torch.Tensor, h: torch.Tensor, cx: torch.Tensor,
                 cy: torch.Tensor) -> torch.Tensor:
    """(N, H, W) bool: an ellipse, a rounded rectangle or a blob in each box."""
    n = spec.n
    yy, xx = _grid(spec.size)
    shape = torch.randint(3, (n,), generator=g)  # 0 ellipse, 1 rounded rectangle, 2 blob
    lobes = torch.randint(3, 6, (n,), generator=g).float()
    amp = _uniform(g, 0.12, 0.25, n)
    phase = _uniform(g, 0.0, 2 * math.pi, n)
    dx = (xx + 0.5 - _col(cx)) / _col(w / 2)
    dy = (yy + 0.5 - _col(cy)) / _col(h / 2)
    r2 = dx**2 + dy**2
    ellipse = r2 <= 1.0
    rect = dx**4 + dy**4 <= 1.0
    theta = torch.atan2(dy, dx)
    blob = r2.sqrt() <= 1.0 + _col(amp) * torch.sin(_col(lobes) * theta + _col(phase))
    return torch.where(_col(shape == 0), ellipse, torch.where(_col(shape == 1), rect, blob))


def _object_colour(g: torch.Generator, spec: _WorldSpec, safe: torch.Tensor) -> torch.Tensor:
    """(N, 3) per-instance RGB, one of its class's palette."""
    choice = torch.rand(spec.n, generator=g)
    rgb = torch.zeros(spec.n, 3)
    for c in range(1, len(CLASS_NAMES)):
        pal = torch.tensor(_OBJECT_RGB[c], dtype=torch.float32)
        rgb = torch.where((safe == c)[:, None], pal[(choice * len(pal)).long().clamp_max(len(pal) - 1)], rgb)
    return rgb


def _paint_objects(g: torch.Generator, spec: _WorldSpec, layout: _Layout) -> Tuple[torch.Tensor, torch.Tensor, list]:
    """Slot 0's object always, slot 1's (a second class / instance) painted on top: (kinds,
    slot_map (N, H, W), -1 outside the objects, and per slot (rgb, cy, h, class))."""
    kinds = layout.kinds
    slot_map = torch.full((spec.n, spec.size, spec.size), -1, dtype=torch.long)
    slot_rgb = []
    cx0 = None
    for slot, cls in enumerate((layout.primary, layout.second)):
        safe = cls.clamp_min(1)
        w, h, cx, cy = _object_box(g, spec, layout, cls, cx0)
        if slot == 0:
            cx0 = cx
        m = _object_mask(g, spec, w, h, cx, cy) & _col(cls > 0)
        kinds = torch.where(m, _col(_NUM_CONTEXTS - 1 + safe), kinds)
        slot_map = slot_map.masked_fill(m, slot)
        slot_rgb.append((_object_colour(g, spec, safe), cy, h, cls))
    return kinds, slot_map, slot_rgb


def _embeddings(g: torch.Generator, spec: _WorldSpec, kinds: torch.Tensor, protos: torch.Tensor) -> torch.Tensor:
    """(N, D, H/stride, W/stride) USS-like features of the region kinds."""
    # Per-pixel prototype + N(0, noise^2) per dimension, averaged over stride x stride cells: the
    # mean of the prototypes is the kind fractions times the prototypes, and the mean of stride^2
    # i.i.d. Gaussians is N(0, (noise / stride)^2), drawn directly at cell resolution.
    n, dim, stride = spec.n, spec.dim, spec.stride
    frac = F.avg_pool2d(F.one_hot(kinds, len(KIND_NAMES)).permute(0, 3, 1, 2).float(), stride)  # (N, K, h, w)
    h_f, w_f = spec.size // stride, spec.size // stride
    features = torch.einsum("nkhw,kd->ndhw", frac, protos)
    features = features + (spec.noise / stride) * torch.randn(n, dim, h_f, w_f, generator=g)
    features = features + (spec.shift / math.sqrt(dim)) * torch.randn(n, dim, 1, 1, generator=g)
    return features.contiguous()


def _context_texture(kinds: torch.Tensor, horizon: torch.Tensor, phase: torch.Tensor) -> torch.Tensor:
    """(N, H, W) brightness pattern of the contexts: sky gradient, waves, rails, bricks."""
    yy, xx = _grid(kinds.shape[-1])
    ph = _col(phase)
    tex = torch.zeros(kinds.shape)
    tex = torch.where(kinds == SKY, 25.0 * yy / _col(horizon.clamp_min(1)) - 10.0, tex)
    tex = torch.where(kinds == SEA, 22.0 * torch.sin(2 * math.pi * yy / 3.5 + 1.5 * torch.sin(2 * math.pi * xx / 16 + ph)), tex)
    tex = torch.where(kinds == RAIL, torch.where(torch.remainder(xx + 5 * ph, 5.0) < 2.0, -35.0, 10.0)
                      + torch.where(torch.remainder(yy - _col(horizon), 6.0) < 1.0, 50.0, 0.0), tex)
    return torch.where(kinds == WALL, torch.where((torch.remainder(yy, 4.0) < 1.0)
                                                  | (torch.remainder(xx + 4 * torch.remainder(torch.floor(yy / 4), 2), 8.0) < 1.0),
                                                  55.0, 0.0), tex)


def _paint_rgb(g: torch.Generator, spec: _WorldSpec, kinds: torch.Tensor, horizon: torch.Tensor,
               slot_map: torch.Tensor, slot_rgb: list) -> torch.Tensor:
    """(N, H, W, 3) uint8 images: textured contexts, shaded objects, grain."""
    n, C = spec.n, len(CLASS_NAMES) - 1
    yy, _ = _grid(spec.size)
    phase = _uniform(g, 0.0, 2 * math.pi, n)
    base = torch.tensor(_CONTEXT_RGB + [(0, 0, 0)] * C, dtype=torch.float32)[kinds]  # (N, H, W, 3)
    tex = _context_texture(kinds, horizon, phase)
    grain = torch.randn(n, spec.size, spec.size, generator=g)
    amp = torch.tensor([4.0, 6.0, 12.0, 22.0, 8.0, 6.0] + [5.0] * C)[kinds]
    rgb = base + (tex + amp * grain)[..., None]
    for slot, (col_rgb, cy, h, cls) in enumerate(slot_rgb):
        m = slot_map == slot
        rel = (yy + 0.5 - _col(cy)) / _col(h / 2)  # -1 top .. 1 bottom of the object
        obj = col_rgb[:, None, None, :] * (1.0 - 0.12 * rel)[..., None]
        obj = torch.where(((_col(cls) == TRAIN) & (rel > -0.6) & (rel < -0.15))[..., None], obj * 0.35, obj)  # windows
        obj = torch.where(((_col(cls) == PERSON) & (rel < -0.6))[..., None], torch.tensor(_SKIN, dtype=torch.float32), obj)
        obj = torch.where(((_col(cls) == BOAT) & (rel > 0.35))[..., None], obj * 0.55, obj)  # hull
        rgb = torch.where(m[..., None], obj + 5.0 * grain[..., None], rgb)
    return rgb.round().clamp(0, 255).to(torch.uint8)


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
    spec = _check_world(num_images, size=size, dim=dim, stride=stride, seed=seed, leak_rate=leak_rate, noise=noise,
                        boundary_noise=boundary_noise, erode_rate=erode_rate, dilate_rate=dilate_rate,
                        overlap=overlap, shift=shift, leak_spread=leak_spread, context_bias=context_bias,
                        two_class_rate=two_class_rate, ignore_rate=ignore_rate)
    C = len(CLASS_NAMES) - 1
    g = torch.Generator().manual_seed(spec.seed)
    protos = _prototypes(g, spec.dim, spec.overlap)
    layout = _scene_layout(g, spec)
    kinds, slot_map, slot_rgb = _paint_objects(g, spec, layout)
    gt = (kinds - (_NUM_CONTEXTS - 1)).clamp_min(0)
    image_classes = torch.zeros(spec.n, C, dtype=torch.bool)
    for c in range(1, C + 1):
        image_classes[:, c - 1] = (gt == c).flatten(1).any(1)
    pseudo = simulated_pseudo_labels(g, gt, kinds, leak_rate=spec.leak_rate, leak_spread=spec.leak_spread,
                                     boundary_noise=spec.boundary_noise, erode_rate=spec.erode_rate,
                                     dilate_rate=spec.dilate_rate, ignore_rate=spec.ignore_rate)
    features = _embeddings(g, spec, kinds, protos)
    images = _paint_rgb(g, spec, kinds, layout.horizon, slot_map, slot_rgb)
    return SyntheticWorld(
        images=images, gt=gt, pseudo=pseudo, features=features, image_classes=image_classes, kinds=kinds,
        class_names=CLASS_NAMES, kind_names=KIND_NAMES, problematic=PROBLEMATIC,
        stems=[f"syn_{i:06d}" for i in range(spec.n)], prototypes=protos, stride=spec.stride,
    )
