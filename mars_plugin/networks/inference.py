"""A segmentation network's labels for a batch of images: multi-scale + flip softmax, then the CRF.

The paper evaluates its network "with multi-scale inference and CRF with conventional settings"
(Sec. 4.1), and its MARS masks (what DHR trains on) are those predictions on train_aug. MARS's
own code is not released (shjo-april/MARS: README only, "heavily borrowed from RS+EPM"), so each
step follows the authors' released evaluators: RS+EPM (shjo-april/RecurSeed_and_EdgePredictMix
at df538e2: ``infer_seg.py`` writes the averaged softmax, ``convert_seed_to_pseudo_masks.py``
applies the CRF) and DHR (shjo-april/DHR at 94d5189: ``produce_wss_masks.py``, the
``apply_ms`` of ``core/networks.py``). Where the two differ, RS+EPM's is taken (the MARS code
base); the difference is named below.

Per image of H x W pixels (:func:`multiscale_probs`, then :func:`labels_from_probs`):

1. **Scales** (default ``1.0, 0.5, 1.5, 2.0``: RS+EPM ``infer_seg.py:75``, DHR
   ``core/networks.py:94`` ``apply_ms(scales=[1.0, 0.5, 1.5, 2.0])``). The normalised image is
   resized to ``(int(H * s), int(W * s))`` (truncated, ``tools/ai/torch_utils.py:37-38``) with
   bilinear interpolation, ``align_corners=False`` (RS+EPM ``torch_utils.resize``, ``:28``;
   DHR's ``resize`` defaults to ``align_corners=True``, ``tools/torch_utils.py:45``); a size
   equal to the input is not resampled (``:44``).
2. **Flip** (default on: ``hflip=True``, ``infer_seg.py:107``, DHR ``apply_ms(hflip=True)``):
   the scaled image and its mirror go through the network as one batch
   (``core/networks.py:244``), the mirror's output is flipped back (``:258``).
3. **Softmax, then mean**: logits at the scaled input's size (RS+EPM's ``forward(same=True)``
   upsamples them bilinearly, ``align_corners=False``, ``core/networks.py:223-224``; a network
   whose logits are smaller is upsampled the same way here) -> softmax over the classes
   (``:254``) -> bilinear resize to the image's size (``:255``) -> the **mean of the
   probabilities** over every scale and flip (``torch.mean(torch.stack(pred_masks))``,
   ``:262``; DHR the same, ``core/networks.py:127``). Not logits, not a sum, not a max.
   RS+EPM averages at the size of the first scale's output and resizes that to H x W
   (``infer_seg.py:111``); here every map is resized to H x W before the mean, which is the
   same computation whenever the first scale is 1.0 (the default). DHR averages at the
   network's own output grid (stride 4 for DeepLabv3+) and upsamples the mean with
   ``align_corners=True`` (``core/networks.py:109-127``): :func:`multiscale_probs_dhr`, which
   ``mars predict`` runs for DHR's own network (``deeplabv3+dhr``, whose method ``apply_ms`` is).
4. **CRF** (``crf="mars"``, the default): the dense CRF of :func:`mars_plugin.engines.crf.dense_crf`
   with RS+EPM's ``crf_dict['deeplab']`` (``convert_seed_to_pseudo_masks.py:77-84``: 10
   iterations, Gaussian sxy 1 compat 3, bilateral sxy 67 srgb 3 compat 4; DHR's
   ``DenseCRF(for_seg=True)`` defaults, ``core/refinements/densecrf.py:10``,
   ``produce_wss_masks.py:115``), on the unary ``-log(p)`` of the mean probabilities
   (``unary_from_softmax``, ``core/refinements/densecrf.py:33``) and the image's RGB bytes,
   **over the classes whose probability exceeds** ``class_threshold`` = 0.05 somewhere in the
   image (DHR, the MARS authors' step-2 code: ``> args.threshold``, ``produce_wss_masks.py:42``,
   0.05 at ``:136``, compared in float32; RS+EPM ``infer_seg.py:114`` has ``>= 0.05``, which
   differs only for a probability exactly at the threshold; 0 keeps every class): the other classes are not labels of that image's CRF at all (``seed = pred_mask[0,
   class_mask]``, ``infer_seg.py:119``); the probabilities are not renormalised. The label is
   the argmax of the CRF's marginals mapped back to its class id (``:130-131``). ``"psa"``:
   PSA/SEAM's setting (:data:`mars_plugin.engines.crf_params.CRF_PRESETS`); ``"none"``: the argmax of the mean
   probabilities over every class. Two edge cases where upstream is not followed: RS+EPM writes
   background when at most one class exceeds the threshold (``:111,133``), which turns an image
   that one foreground class fills into background; here a single class is that class (DHR's
   ``apply_crf`` does the same). When no class exceeds it (possible beyond 20 classes), every
   class takes part (upstream would fail on an empty CRF).

**The CRF's image** (``crf_image``): upstream gives the CRF the normalised image turned back to
bytes by truncation, not the file's bytes: DHR ``produce_wss_masks.py:59`` ``denorm_fn(image)``,
``tools/transforms.py:268-270`` ``image = (image * self.std) + self.mean; image = (image *
255).astype(np.uint8)`` (RS+EPM the same, ``tools/ai/augment_utils.py:382-383``). The float32
normalised image meets the mean and std as Python lists, so numpy computes in float64; the
truncation makes 13-30% of the RGB values of a photograph one below the file's, which changed
0.3-0.5% of the CRF's labels on the photographs tried. :func:`denormalized_bytes` computes those
bytes; ``crf_image="denormalized"`` (the ``dhr`` recipe's) gives them to the CRF, ``"file"`` (the
default) the file's bytes. deeplab-pytorch (``main.py:481`` after ``libs/datasets/base.py:110``)
gives its CRF ``image.astype(np.uint8)`` of the *mean-subtracted* BGR floats: numpy's cast on
x86-64 truncates toward zero and wraps negatives modulo 256 (-3.7 -> 253), which
:func:`mean_subtracted_bytes` computes (``crf_image="mean-subtracted"``, the
``deeplab-pytorch`` recipe's; the channel order does not change the CRF, whose colour kernel
weighs the three channels alike). It predicts with MSC's max of the logits over scales 1, 0.5
and 0.75 (``libs/models/msc.py:41-47``), no flip, the max upsampled bilinearly to the image
then the softmax: :func:`multiscale_probs_max`. DHR stores the kept probabilities as float16 before its CRF
(``produce_wss_masks.py:45``); RS+EPM (and here) keep float32.

``mars predict`` runs this over a folder of images (the folder job: ``commands/predict.py``).
"""
from __future__ import annotations

from typing import Callable, Dict, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from mars_plugin._checks import check_real_param, check_scales, describe
from mars_plugin.engines.crf import dense_crf
from mars_plugin.engines.crf_params import CRF_PRESETS, DEFAULT_MAX_BYTES, check_crf_params
# ImageNet's statistics: RS+EPM's and DHR's Normalize/Denormalize (DHR tools/transforms.py:10-11)
from mars_plugin.networks.deeplab import IMAGENET_MEAN, IMAGENET_STD

__all__ = [
    "DEFAULT_SCALES",
    "CLASS_THRESHOLD",
    "CRF_CHOICES",
    "multiscale_probs",
    "multiscale_probs_dhr",
    "multiscale_probs_max",
    "half_dtype",
    "check_finite_probs",
    "labels_from_probs",
    "predict_labels",
    "CRF_IMAGES",
    "denormalized_bytes",
    "mean_subtracted_bytes",
    "crf_rgb",
]

#: RS+EPM ``infer_seg.py:75`` and DHR ``core/networks.py:94``: the order matters only for
#: RS+EPM's grid (see the module docstring, step 3).
DEFAULT_SCALES: Tuple[float, ...] = (1.0, 0.5, 1.5, 2.0)
#: A class takes part in an image's CRF when its mean probability exceeds this somewhere
#: (RS+EPM ``infer_seg.py:114``; DHR ``produce_wss_masks.py:136``).
CLASS_THRESHOLD = 0.05
#: ``--crf``: a preset of :data:`mars_plugin.engines.crf_params.CRF_PRESETS`, or none.
CRF_CHOICES = ("mars", "psa", "none")
#: ``crf_image``: the bytes the CRF compares (module docstring): the file's, or upstream's
#: denormalised normalised image, or deeplab-pytorch's wrapped cast of its mean-subtracted input.
CRF_IMAGES = ("file", "denormalized", "mean-subtracted")


def _resize(x: torch.Tensor, size: Tuple[int, int]) -> torch.Tensor:
    """Bilinear, ``align_corners=False``; no resampling at the same size (RS+EPM
    ``tools/ai/torch_utils.py:28-47``)."""
    if tuple(x.shape[-2:]) == tuple(size):
        return x
    return F.interpolate(x, size=size, mode="bilinear", align_corners=False)


def _check_network_input(images: object) -> None:
    """``images`` as the fusions take them: a float (B, 3, H, W) tensor, else a ValueError
    (shape) or TypeError (dtype) naming what it got."""
    if not isinstance(images, torch.Tensor) or images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"images must be a (B, 3, H, W) tensor, got {describe(images)}")
    if not images.is_floating_point():
        raise TypeError(f"images must be float (normalised as the network takes them), got {images.dtype}")


def _scaled_size(height: int, width: int, scale: float) -> Tuple[int, int]:
    """``(int(H * s), int(W * s))`` (RS+EPM truncates, ``tools/ai/torch_utils.py:37-38``); a side
    that truncates to 0 is a ValueError naming it."""
    h, w = int(height * scale), int(width * scale)
    if h < 1 or w < 1:
        raise ValueError(f"a {height}x{width} image at scale {scale:g} is {h}x{w} pixels: too small for this "
                         f"scale (scales must keep at least one pixel per side)")
    return h, w


def _logits_of(model: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, flip: bool, half: torch.dtype,
               fp16: bool) -> torch.Tensor:
    """The logits of one scaled batch (with ``flip``, the image and its mirror in one batch:
    RS+EPM core/networks.py:244, DHR's ``apply_ms``), checked to be (2B or B, L, h, w)."""
    if flip:
        x = torch.cat([x, x.flip(-1)])
    with torch.autocast(x.device.type, dtype=half, enabled=bool(fp16)):
        logits = model(x)
    if not isinstance(logits, torch.Tensor) or logits.ndim != 4 or logits.shape[0] != x.shape[0]:
        raise ValueError(f"the network must return (B, L, h, w) logits with B = {x.shape[0]}, got "
                         f"{describe(logits)}")
    return logits


def check_finite_probs(total: torch.Tensor, half: torch.dtype, fp16: bool) -> None:
    """Fused probabilities (or their sum) that are not finite are a ValueError, saying why under
    ``fp16`` (``half``: the autocast type it ran under): every fusion's last check."""
    if not bool(torch.isfinite(total).all()):
        why = f" under {str(half)[6:]} autocast (--fp16): its activations overflow; run without --fp16" if fp16 else ""
        raise ValueError(f"the network's output holds NaN or Inf{why}")


@torch.no_grad()
def multiscale_probs(model: Callable[[torch.Tensor], torch.Tensor], images: torch.Tensor,
                     scales: Sequence[float] = DEFAULT_SCALES, flip: bool = True, *,
                     fp16: bool = False) -> torch.Tensor:
    """The mean softmax of ``model`` over ``scales`` and (``flip``) horizontal flips: steps 1-3
    of the module docstring.

    Shapes:
        images: (B, 3, H, W) float, as the network takes them (normalised).
        model(x): (B', L, h, w) logits for (B', 3, h', w') inputs; logits of another size than
            the input are upsampled to it (bilinear, ``align_corners=False``) before the softmax.
        returns: (B, L, H, W) float32 probabilities on ``images``' device (each pixel sums to 1).

    Args:
        fp16: run ``model`` under half-precision autocast (:func:`half_dtype`: bfloat16, or
            float16 on a GPU without bfloat16); the softmax and the mean are float32.

    Probabilities that are not finite (a network whose float16 activations overflowed, as a
    randomly initialised ResNet-101 does: measured on an H200) are a ValueError.
    """
    _check_network_input(images)
    scales = check_scales(scales)
    B, _, H, W = images.shape
    half = half_dtype(images.device)
    total: Optional[torch.Tensor] = None
    for s in scales:
        size = _scaled_size(H, W, s)
        logits = _logits_of(model, _resize(images, size), flip, half, fp16)
        p = _resize(torch.softmax(_resize(logits.float(), size), dim=1), (H, W))
        if flip:
            p = p[:B] + p[B:].flip(-1)
        total = p if total is None else total.add_(p)
    assert total is not None
    check_finite_probs(total, half, fp16)  # one check (one GPU sync) for every scale
    return total.div_(len(scales) * (2 if flip else 1))


@torch.no_grad()
def multiscale_probs_dhr(model: Callable[[torch.Tensor], torch.Tensor], images: torch.Tensor,
                         scales: Sequence[float] = DEFAULT_SCALES, flip: bool = True, *,
                         fp16: bool = False) -> torch.Tensor:
    """DHR's ``apply_ms`` (core/networks.py:91-127 at 94d5189, a method of its ``DeepLabv3plus``):
    the mean softmax fused on the network's own grid, what ``mars predict`` runs for
    ``deeplabv3+dhr`` networks.

    Against :func:`multiscale_probs` (RS+EPM's): every resize is bilinear with
    ``align_corners=True`` (DHR ``tools/torch_utils.py:45``), the scaled image included; each
    scale's softmax (of logits as the network returns them, stride 4) is resized to the **first
    scale's logits' grid** (``size = output_dict['logits'].shape[2:]`` of the first scale,
    ``:104``), the probabilities are averaged there (``torch.mean(torch.stack(pred_masks))``,
    ``:127``) and only the mean is resized to H x W. A size equal to the target is not resampled.
    Shapes and arguments as :func:`multiscale_probs`.
    """
    _check_network_input(images)
    scales = check_scales(scales)
    B, _, H, W = images.shape
    half = half_dtype(images.device)
    grid: Optional[Tuple[int, int]] = None
    total: Optional[torch.Tensor] = None
    for s in scales:
        logits = _logits_of(model, _resize_corners(images, _scaled_size(H, W, s)), flip, half, fp16)
        if grid is None:
            grid = (int(logits.shape[-2]), int(logits.shape[-1]))
        p = _resize_corners(torch.softmax(logits.float(), dim=1), grid)
        if flip:
            p = p[:B] + p[B:].flip(-1)
        total = p if total is None else total.add_(p)
    assert total is not None and grid is not None
    check_finite_probs(total, half, fp16)
    return _resize_corners(total.div_(len(scales) * (2 if flip else 1)), (H, W)).contiguous()


@torch.no_grad()
def multiscale_probs_max(model: Callable[[torch.Tensor], torch.Tensor], images: torch.Tensor,
                         scales: Sequence[float] = (1.0, 0.5, 0.75), flip: bool = False, *,
                         fp16: bool = False) -> torch.Tensor:
    """deeplab-pytorch's inference (main.py's test with its ``MSC``, libs/models/msc.py:28-47):
    the network (an ``MSC``'s ``base``) on the image at ``scales[0]`` and on the image resized by
    ``F.interpolate(scale_factor=s, bilinear, align_corners=False)`` for every other scale; those
    logits resized bilinearly to the first's size, the pixel-wise max, upsampled bilinearly
    (``align_corners=False``) to the image, then the softmax. With ``scales`` (1, 0.5, 0.75) it
    is ``softmax(upsample(MSC(base).eval()(x)))``. Shapes and arguments as
    :func:`multiscale_probs`; no flip (upstream has none: ``flip=True`` is refused)."""
    if flip:
        raise ValueError("flip: the max of the scales' logits (deeplab-pytorch's MSC) has no flip; use flip=False "
                         "(--no-flip)")
    if not isinstance(images, torch.Tensor) or images.ndim != 4 or images.shape[1] != 3 or \
            not images.is_floating_point():
        raise ValueError(f"images must be a float (B, 3, H, W) tensor, got {describe(images)}")
    scales = check_scales(scales)
    base = getattr(model, "base", model)  # an MSC: its own scales are replaced by ``scales``
    H, W = images.shape[-2:]
    with torch.autocast(images.device.type, dtype=half_dtype(images.device), enabled=bool(fp16)):
        every = [base(images if s == 1.0 else F.interpolate(images, scale_factor=s, mode="bilinear",
                                                            align_corners=False)) for s in scales]
    size = tuple(every[0].shape[-2:])
    every = [every[0]] + [F.interpolate(t, size=size, mode="bilinear", align_corners=False) for t in every[1:]]
    fused = torch.max(torch.stack(every), dim=0)[0]
    fused = fused.float() if fused.dtype in (torch.float16, torch.bfloat16) else fused
    probs = torch.softmax(F.interpolate(fused, size=(H, W), mode="bilinear", align_corners=False), dim=1)
    check_finite_probs(probs, half_dtype(images.device), fp16)
    return probs


def _resize_corners(x: torch.Tensor, size: Tuple[int, int]) -> torch.Tensor:
    """DHR's ``torch_utils.resize``: bilinear, ``align_corners=True``, none at the same size."""
    if tuple(x.shape[-2:]) == tuple(size):
        return x
    return F.interpolate(x, size=tuple(size), mode="bilinear", align_corners=True)


def half_dtype(device: torch.device) -> torch.dtype:
    """The autocast type of ``fp16=True``: bfloat16 (float32's range: no overflow where float16
    gives Inf, as ``mars train`` uses it), float16 on a GPU without bfloat16 (before Ampere)."""
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return torch.float16
    return torch.bfloat16


def _crf_params(crf: Optional[str]) -> Optional[Dict[str, float]]:
    if crf is None or crf == "none":
        return None
    if crf not in CRF_PRESETS:
        raise ValueError(f"crf must be one of {CRF_CHOICES}, got {crf!r}")
    return check_crf_params(crf)


def labels_from_probs(probs: torch.Tensor, images: torch.Tensor, crf: Optional[str] = "mars",
                      class_threshold: float = CLASS_THRESHOLD, *,
                      max_bytes: Optional[int] = DEFAULT_MAX_BYTES) -> torch.Tensor:
    """Labels from mean probabilities: step 4 of the module docstring.

    Shapes:
        probs: (B, L, H, W) probabilities (:func:`multiscale_probs`).
        images: (B, H, W, 3) uint8 RGB (the CRF's colours; unused with ``crf="none"``).
        returns: (B, H, W) int64 class ids 0..L-1 on ``probs``' device.

    Args:
        crf: ``"mars"`` (RS+EPM's DeepLab setting), ``"psa"``, or ``"none"`` / None (argmax).
        class_threshold: a class takes part in an image's CRF when its probability exceeds
            this somewhere in the image (``>``, DHR ``produce_wss_masks.py:42``; 0: every class).
        max_bytes: the CRF's memory budget (:func:`mars_plugin.engines.crf.dense_crf`'s; ``mars
            predict``'s ``--max-memory``).
    """
    params = _crf_params(crf)
    class_threshold = check_real_param(class_threshold, "class_threshold", 0.0, 1.0)
    if not isinstance(probs, torch.Tensor) or probs.ndim != 4:
        raise ValueError(f"probs must be a (B, L, H, W) tensor, got {describe(probs)}")
    if params is None:
        return probs.argmax(1)
    # (B, L): the labels of each image's CRF. DHR produce_wss_masks.py:42 keeps a class strictly
    # above the threshold (a float32 comparison, as torch makes it with a Python float); 0 keeps all
    keys = probs.amax(dim=(2, 3)) > class_threshold if class_threshold > 0 else torch.ones(
        probs.shape[:2], dtype=torch.bool, device=probs.device)
    keys[~keys.any(1)] = True  # no class exceeds it: all take part (upstream fails here)
    q = dense_crf(probs, images, params, valid=keys, max_bytes=max_bytes)
    # Labels left out have Q = 0 and the kept ones sum to 1: the argmax is a kept class.
    return q.argmax(1)


def denormalized_bytes(images: torch.Tensor, mean: Sequence[float] = IMAGENET_MEAN,
                       std: Sequence[float] = IMAGENET_STD) -> torch.Tensor:
    """The bytes upstream's CRF sees: normalised images turned back by truncation.

    DHR ``tools/transforms.py:268-270`` (``Denormalize``, used by ``produce_wss_masks.py:59``):
    ``((x * std) + mean) * 255`` then ``astype(np.uint8)``, where ``std`` and ``mean`` are Python
    lists, so numpy promotes the float32 image to float64; the same operations in the same order
    here, in float64, truncated toward zero (values below 0 or above 255 do not occur for an
    image normalised from bytes; they are clamped rather than wrapped).

    Shapes:
        images: (B, 3, H, W) float, normalised as ``(rgb / 255 - mean) / std`` (the network's input).
        returns: (B, H, W, 3) uint8 RGB on ``images``' device.
    """
    if not isinstance(images, torch.Tensor) or images.ndim != 4 or images.shape[1] != 3 or \
            not images.is_floating_point():
        raise ValueError(f"images must be a float (B, 3, H, W) tensor of normalised images, got {describe(images)}")
    x = images.detach().permute(0, 2, 3, 1).to(torch.float64)
    m = torch.tensor([float(v) for v in mean], dtype=torch.float64, device=x.device)
    s = torch.tensor([float(v) for v in std], dtype=torch.float64, device=x.device)
    return ((x * s + m) * 255).trunc_().clamp_(0, 255).to(torch.uint8)


def mean_subtracted_bytes(images: torch.Tensor) -> torch.Tensor:
    """deeplab-pytorch's CRF bytes (``main.py:481``): its network input, BGR minus the caffe mean
    (:func:`mars_plugin.networks.deeplab_pytorch.normalize`), cast to uint8 as numpy does on
    x86-64: truncated toward zero, then wrapped modulo 256 (a negative value v in (-256, 0]
    becomes 256 + trunc(v) unless trunc(v) is 0).

    Shapes:
        images: (B, 3, H, W) float BGR minus the mean (the network's input).
        returns: (B, H, W, 3) uint8, the channels in RGB order (the CRF weighs them alike).
    """
    if not isinstance(images, torch.Tensor) or images.ndim != 4 or images.shape[1] != 3 or \
            not images.is_floating_point():
        raise ValueError(f"images must be a float (B, 3, H, W) tensor of mean-subtracted images, got "
                         f"{describe(images)}")
    t = images.detach().flip(1).permute(0, 2, 3, 1).trunc().to(torch.int64)
    return torch.remainder(t, 256).to(torch.uint8)


def crf_rgb(rgb: torch.Tensor, images: torch.Tensor, crf_image: str = "file") -> torch.Tensor:
    """The (B, H, W, 3) uint8 bytes the CRF compares: the file's ``rgb`` (``"file"``),
    :func:`denormalized_bytes` of the normalised ``images`` (``"denormalized"``, DHR's) or
    :func:`mean_subtracted_bytes` of them (``"mean-subtracted"``, deeplab-pytorch's)."""
    if crf_image not in CRF_IMAGES:
        raise ValueError(f"crf_image must be one of {CRF_IMAGES}, got {crf_image!r}")
    if crf_image == "mean-subtracted":
        return mean_subtracted_bytes(images)
    return rgb if crf_image == "file" else denormalized_bytes(images)


def predict_labels(model: Callable[[torch.Tensor], torch.Tensor], images: torch.Tensor, rgb: torch.Tensor,
                   scales: Sequence[float] = DEFAULT_SCALES, flip: bool = True, crf: Optional[str] = "mars",
                   class_threshold: float = CLASS_THRESHOLD, *, fp16: bool = False,
                   crf_image: str = "file") -> torch.Tensor:
    """:func:`multiscale_probs` then :func:`labels_from_probs`: (B, H, W) int64 labels of
    (B, 3, H, W) normalised ``images`` whose RGB bytes are ``rgb`` (B, H, W, 3) uint8; the CRF
    compares ``rgb`` (``crf_image="file"``) or upstream's :func:`denormalized_bytes` of
    ``images`` (``"denormalized"``)."""
    if crf_image not in CRF_IMAGES:  # before the network runs
        raise ValueError(f"crf_image must be one of {CRF_IMAGES}, got {crf_image!r}")
    probs = multiscale_probs(model, images, scales, flip, fp16=fp16)
    return labels_from_probs(probs, crf_rgb(rgb, images, crf_image).to(probs.device), crf, class_threshold)
