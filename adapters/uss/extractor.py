"""USS feature extractors on tensors: images in, (B, D, h, w) per-pixel embeddings out.

MARS needs per-pixel embeddings F of an unsupervised segmentation model for every image. Any
object with ``__call__(images, output_size=None) -> (B, D, h, w)`` (the :class:`FeatureExtractor`
protocol) can fill a feature folder with ``features_job`` (the ``mars features`` command, in the
command layer: ``commands/features.py``):

* :class:`~mars_plugin.adapters.uss.stego.STEGOExtractor` and
  :class:`~mars_plugin.adapters.uss.leopart.LeopartExtractor` read the released checkpoints
  (``from_checkpoint``);
* :class:`ModelExtractor` wraps any ``nn.Module`` with a function turning its output into a
  (B, D, h, w) map (pytorch-grad-cam's ``reshape_transform`` idea), e.g. for a timm/HF ViT::

      ModelExtractor(vit, lambda out: rearrange(out[:, 1:], "b (h w) d -> b d h w", h=28),
                     preprocess=imagenet_preprocess(448))

* :func:`load_extractor` builds a STEGO, Leopart, DINOv2 or CAUSE extractor from its files,
  with the options of ``mars features``.

Every extractor also runs DHR's multi-scale, flip-averaged inference (``scales=``, see
:func:`multiscale`, re-exported here from :mod:`mars_plugin.adapters.uss.multiscale`).
"""
from __future__ import annotations

import os
from typing import Any, Callable, Dict, Optional, Protocol, Sequence, Tuple, Union, runtime_checkable

import torch
import torch.nn as nn
import torch.nn.functional as F

from mars_plugin._checks import check_scales
from mars_plugin.adapters.uss.multiscale import DHR_SCALES, DHR_SETTINGS, multiscale, multiscale_batch
from mars_plugin.adapters.uss.preprocess import (
    as_float_images,
    check_output_size,
    normalize_imagenet,
    resize_features,
    resize_images,
)

__all__ = [
    "FeatureExtractor",
    "ModelExtractor",
    "imagenet_preprocess",
    "load_extractor",
    "multiscale",
    "DHR_SCALES",
    "DHR_SETTINGS",
    "USS_MODELS",
    "USS_NAMES",
    "uss_names_text",
]

PathLike = Union[str, os.PathLike]
#: The USS models :func:`load_extractor` builds: ``--uss`` value -> the model's name. ``--help``
#: and ``mars features``/``mars reproduce``'s choices are read from here, so a new model is named
#: everywhere by adding it once.
USS_NAMES: Dict[str, str] = {"stego": "STEGO", "leopart": "Leopart", "dinov2": "DINOv2", "cause": "CAUSE"}
USS_MODELS = tuple(USS_NAMES)


def uss_names_text(conjunction: str = "or") -> str:
    """The registry's model names for help texts: ``STEGO, Leopart, DINOv2 or CAUSE``."""
    names = list(USS_NAMES.values())
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} {conjunction} {names[-1]}"


@runtime_checkable
class FeatureExtractor(Protocol):
    """Anything that maps a batch of same-size RGB images to per-pixel embeddings.

    ``images``: (B, 3, H, W), uint8 0..255 or float 0..1. ``output_size``: None (the model's own
    grid) or (h, w). Returns (B, D, h, w) float.
    """

    def __call__(self, images: torch.Tensor, output_size: Optional[Tuple[int, int]] = None) -> torch.Tensor:
        ...


def imagenet_preprocess(size: Optional[Union[int, Tuple[int, int]]] = None, interpolation: str = "bilinear") -> Callable:
    """A ``preprocess`` for :class:`ModelExtractor`: optional resize (an int is a square side),
    then ImageNet mean/std normalisation, on float [0, 1] images."""
    target = (size, size) if isinstance(size, int) else size

    def preprocess(x: torch.Tensor) -> torch.Tensor:
        if target is not None:
            x = resize_images(x, target, interpolation)
        return normalize_imagenet(x)

    return preprocess


class ModelExtractor(nn.Module):
    """Any ``nn.Module`` as a feature extractor.

    ``model(preprocess(x))`` runs on float [0, 1] images (uint8 input is divided by 255; with
    ``preprocess=None`` the model sees exactly that), then ``output_transform`` maps its output
    (a tensor, tuple, dict, tokens...) to (B, D, h, w). With ``output_size`` the map is resized
    bilinearly; ``normalize=True`` L2-normalises every pixel's vector after that.

    ``flip_average=True`` averages with the map of the horizontally flipped batch, flipped back.
    ``scales`` (with ``patch_size``, the model's patch: its output grid must be the input's
    sides / patch) runs :func:`multiscale_batch` (:func:`multiscale` of each image, one model call
    per scale for the batch) on ``preprocess(x)``, which must then
    normalise the image (``imagenet_preprocess``), as DHR's inference expects.
    """

    def __init__(
        self,
        model: nn.Module,
        output_transform: Callable[[Any], torch.Tensor] = lambda out: out,
        preprocess: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
        *,
        normalize: bool = False,
        flip_average: bool = False,
        scales: Optional[Sequence[float]] = None,
        patch_size: Optional[int] = None,
    ):
        super().__init__()
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not callable(output_transform):
            raise TypeError("output_transform must be callable")
        if preprocess is not None and not callable(preprocess):
            raise TypeError("preprocess must be callable or None")
        if scales is not None and (isinstance(patch_size, bool) or not isinstance(patch_size, int) or patch_size < 1):
            raise ValueError(f"scales needs patch_size, the model's patch (an integer >= 1), got {patch_size!r}")
        self.model = model
        self.output_transform = output_transform
        self.preprocess = preprocess
        self.normalize = bool(normalize)
        self.flip_average = bool(flip_average)
        self.scales = None if scales is None else check_scales(scales)
        self.patch_size = patch_size
        self.eval()

    def describe(self) -> str:
        return f"{type(self.model).__name__} through ModelExtractor"

    def _map(self, x: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) preprocessed images -> (B, D, h, w), checked."""
        f = self.output_transform(self.model(x))
        if not isinstance(f, torch.Tensor) or f.ndim != 4 or f.shape[0] != x.shape[0]:
            got = f"shape {tuple(f.shape)}" if isinstance(f, torch.Tensor) else type(f).__name__
            raise ValueError(
                f"output_transform must return a (B, D, h, w) tensor with B = {x.shape[0]} images, got {got}"
            )
        return f

    @torch.no_grad()
    def forward(self, images: torch.Tensor, output_size: Optional[Tuple[int, int]] = None) -> torch.Tensor:
        """(B, 3, H, W) uint8 or float [0, 1] RGB -> (B, D, h, w) float32."""
        output_size = check_output_size(output_size)
        x = as_float_images(images)
        if self.preprocess is not None:
            x = self.preprocess(x)
        if self.scales is not None:
            f = multiscale_batch(self._map, x, self.scales, self.flip_average, self.patch_size)
        elif self.flip_average:
            c, c_flip = self._map(torch.cat([x, x.flip(3)], dim=0)).float().chunk(2, dim=0)
            f = (c + c_flip.flip(3)) / 2
        else:
            f = self._map(x)
        f = resize_features(f, output_size)
        if self.normalize:
            f = F.normalize(f, dim=1)
        return f


# --------------------------------------------------------------------------------------------
# an extractor from its model files
# --------------------------------------------------------------------------------------------


def load_extractor(
    uss: str,
    checkpoint: Optional[PathLike] = None,
    *,
    backbone: Optional[PathLike] = None,
    heads: Optional[PathLike] = None,
    trust_pickle: bool = False,
    res: Optional[Union[int, str]] = None,
    flip_average: Optional[bool] = None,
    head: bool = False,
    normalize: Optional[bool] = None,
    interpolation: Optional[str] = None,
    prefix: Optional[str] = None,
    scales: Optional[Sequence[float]] = None,
    dhr: bool = False,
) -> nn.Module:
    """A STEGO, Leopart, DINOv2 or CAUSE extractor from its files, with the options of ``mars features``.

    Files: one ``checkpoint`` (STEGO's or Leopart's ``.ckpt``), or for STEGO as DHR stores it
    ``backbone`` (DINO's ``dino_vitbase8_pretrain.pth``) and ``heads`` (``STEGO_<dataset>.pt``),
    read by :meth:`~mars_plugin.adapters.uss.stego.STEGOExtractor.from_files` (weights only, so
    ``trust_pickle`` does not apply to them); CAUSE as DHR stores it, always two files: ``backbone``
    (DINOv2 weights) and ``heads`` (DHR's ``CAUSE_<dataset>.pt``, or CAUSE's own release folder
    ``CAUSE/<dataset>/dinov2_vit_base_14/2048/`` or its ``segment_tr.pth``), read by
    :meth:`~mars_plugin.adapters.uss.cause.CAUSEExtractor.from_files` (defaults: native resolution,
    bilinear, flip on, L2 normalisation on). None means the model's default: res 320 / 448,
    interpolation nearest / bilinear, L2 normalisation on for STEGO and for the Leopart head, off
    for Leopart backbone tokens, flip averaging on for STEGO and off for Leopart, one scale.
    ``res="native"``: the image's own resolution. ``dhr=True`` fills the options left None with
    :data:`DHR_SETTINGS` (native resolution, ``DHR_SCALES``, flip, no L2 normalisation).
    DINOv2 reads one ``backbone`` (``dinov2_vitb14_pretrain.pth``...,
    :meth:`~mars_plugin.adapters.uss.dinov2.DINOv2Extractor.from_files`); its defaults: native
    resolution, bilinear, no flip, no L2 normalisation.
    """
    if uss not in USS_MODELS:
        raise ValueError(f"uss must be one of {USS_MODELS}, got {uss!r}")
    _check_model_files(uss, checkpoint, backbone, heads, trust_pickle, head, prefix)
    if dhr:  # DHR's settings fill only what the caller left unset
        res = "native" if res is None else res
        scales = DHR_SETTINGS["scales"] if scales is None else scales
        flip_average = DHR_SETTINGS["flip_average"] if flip_average is None else flip_average
        normalize = DHR_SETTINGS["normalize"] if normalize is None else normalize
    kw = _extractor_options(res, interpolation, flip_average, scales)
    if uss == "dinov2":
        from mars_plugin.adapters.uss.dinov2 import DINOv2Extractor

        if normalize is not None:
            kw["normalize"] = normalize
        return DINOv2Extractor.from_files(backbone, **kw)
    if uss == "cause":
        from mars_plugin.adapters.uss.cause import CAUSEExtractor

        if head or prefix is not None:
            raise ValueError(f"{'--head' if head else '--prefix'} is a Leopart option; CAUSE's embedding is its code")
        if normalize is not None:
            kw["normalize"] = normalize
        return CAUSEExtractor.from_files(backbone, heads, **kw)
    if uss == "stego":
        # Exactly one of checkpoint and the two files was given (checked).
        return _stego_extractor(checkpoint, backbone, heads, trust_pickle, head, prefix, normalize, kw)
    from mars_plugin.adapters.uss.leopart import LeopartExtractor

    kw.update(head=head, normalize=normalize)
    return LeopartExtractor.from_checkpoint(checkpoint, trust_pickle=trust_pickle, prefix=prefix, **kw)


def _check_model_files(uss: str, checkpoint: Optional[PathLike], backbone: Optional[PathLike],
                       heads: Optional[PathLike], trust_pickle: bool, head: bool, prefix: Optional[str]) -> None:
    """Refuse files (and file options) the model ``uss`` does not read: exactly one ``checkpoint``
    or the two files ``backbone`` and ``heads`` (DINOv2: ``backbone`` alone)."""
    if uss == "dinov2":
        if backbone is None or checkpoint is not None or heads is not None:
            raise ValueError("--uss dinov2 reads one --backbone FILE (DINOv2's dinov2_vitb14_pretrain.pth...), "
                             "without --checkpoint or --heads")
        if trust_pickle:
            raise ValueError("--trust-pickle does not apply to --uss dinov2: the backbone file is a plain state "
                             "dict, always read with weights_only=True")
        if head or prefix is not None:
            raise ValueError("--head and --prefix are Leopart options")
    two_files = backbone is not None or heads is not None
    if checkpoint is not None and two_files:
        raise ValueError("give either --checkpoint FILE or --backbone FILE --heads FILE, not both")
    if uss == "cause" and not two_files:  # DHR stores CAUSE only as two files
        raise ValueError("--uss cause reads two files: --backbone DINOv2 weights --heads CAUSE_<dataset>.pt (DHR's) or "
                         "CAUSE's release folder CAUSE/<dataset>/dinov2_vit_base_14/2048/, "
                         "not --checkpoint")
    if checkpoint is None and not two_files:
        raise ValueError("no model files: give --checkpoint FILE (STEGO or Leopart .ckpt), or for DHR's STEGO "
                         "--backbone dino_vitbase8_pretrain.pth --heads STEGO_<dataset>.pt")
    if two_files and uss != "dinov2":  # dinov2's one --backbone was checked above
        if uss == "leopart":
            raise ValueError("--backbone/--heads are DHR's two STEGO or CAUSE files; Leopart reads one --checkpoint")
        if backbone is None or heads is None:
            raise ValueError(f"--backbone and --heads go together (DINO's backbone file and DHR's STEGO_<dataset>.pt); "
                             f"got only {'--backbone' if heads is None else '--heads'}")
        if trust_pickle:
            raise ValueError("--trust-pickle applies to --checkpoint; --backbone and --heads are plain state dicts, "
                             "always read with weights_only=True")


def _extractor_options(res: Optional[Union[int, str]], interpolation: Optional[str], flip_average: Optional[bool],
                       scales: Optional[Sequence[float]]) -> Dict[str, Any]:
    """The keywords of every extractor's constructor that the caller set (None: the model's default)."""
    if isinstance(res, str) and res != "native":
        raise ValueError(f"res must be an integer or 'native', got {res!r}")
    kw: Dict[str, Any] = {}
    if res is not None:
        kw["res"] = None if res == "native" else res
    if interpolation is not None:
        kw["interpolation"] = interpolation
    if flip_average is not None:
        kw["flip_average"] = flip_average
    if scales is not None:
        kw["scales"] = scales
    return kw


def _stego_extractor(checkpoint: Optional[PathLike], backbone: Optional[PathLike], heads: Optional[PathLike],
                     trust_pickle: bool, head: bool, prefix: Optional[str], normalize: Optional[bool],
                     kw: Dict[str, Any]) -> nn.Module:
    """STEGO from its ``checkpoint``, or (``checkpoint`` None) from DHR's two files."""
    from mars_plugin.adapters.uss.stego import STEGOExtractor

    if head:
        raise ValueError("--head is a Leopart option; STEGO's embedding is its code")
    if prefix is not None:
        raise ValueError("--prefix is a Leopart option; STEGO checkpoints always store the model under 'net.'")
    if normalize is not None:
        kw["normalize"] = normalize
    if checkpoint is None:
        return STEGOExtractor.from_files(backbone, heads, **kw)
    return STEGOExtractor.from_checkpoint(checkpoint, trust_pickle=trust_pickle, **kw)
