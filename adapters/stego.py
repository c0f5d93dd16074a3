"""STEGO embeddings (Hamilton et al., ICLR 2022; mhamilton723/STEGO @ eb4d6b5) for MARS.

What STEGO computes, read from its code (file:line of that commit):

* ``LitUnsupervisedSegmenter`` (``src/train_segmentation.py:53-110``) holds ``self.net =
  DinoFeaturizer(dim, cfg)`` (l. 68-69) and probes; ``forward`` returns ``self.net(x)[1]``, the
  *code* (l. 108-110). The Lightning checkpoint's ``state_dict`` therefore stores the featurizer
  under ``net.``: ``net.model.*`` (the DINO ViT, ``src/modules.py:27-29``, ``num_classes=0`` so
  no head weights), ``net.cluster1.0.*`` (``Conv2d(n_feats, dim, 1)``, l. 73-75) and, for
  ``projection_type: "nonlinear"`` (the training default, ``src/configs/train_config.yml:34``),
  ``net.cluster2.0.*`` / ``net.cluster2.2.*`` (``Conv2d(n_feats, n_feats, 1)``, ReLU,
  ``Conv2d(n_feats, dim, 1)``, l. 77-81). ``dim`` is ``cluster1.0.weight.shape[0]``.
* ``DinoFeaturizer.forward`` (``src/modules.py:83-118``): the image sides must be multiples of
  the patch (l. 86-87); ``feat`` = the normed last-block tokens (``get_intermediate_feat(img,
  n=1)``, ``dino_feat_type: "feat"``, train_config l. 33) without [CLS], as a (B, D, h, w) map
  (l. 93-97); ``code = cluster1(dropout(feat)) + cluster2(dropout(feat))`` (l. 108-111). At
  evaluation the model is in eval mode, so the ``Dropout2d`` is the identity.
* Evaluation (``src/eval_segmentation.py:124-128``, same in ``src/demo_segmentation.py:62-66``):
  ``code = (net(img)[1] + net(img.flip(3))[1].flip(3)) / 2``, then ``F.interpolate(code,
  label_size, mode="bilinear", align_corners=False)``; the cluster probe then L2-normalises the
  up-sampled code (``ClusterLookup.forward``, ``src/modules.py:146-149``).
* Preprocessing (``src/utils.py:165-183``): ``T.Resize(res, Image.NEAREST)`` (shorter side to
  ``res``, *nearest* interpolation), ``T.CenterCrop(res)``, ``ToTensor``, ImageNet
  normalisation; ``res: 320`` at evaluation (``src/configs/eval_config.yml:4``).

What we do differently, and why: MARS needs embeddings for the whole image, aligned with its
pseudo label, so there is no centre crop. The whole image is resized so that its shorter side is
about ``res`` and both sides are multiples of the patch (each side ``round(side * res / shorter /
patch) * patch``, aspect kept up to half a patch), the code is computed there, and the core later
resizes the (h, w) code to the label bilinearly: the label grid stays aligned with the image.
``interpolation="nearest"`` keeps STEGO's resize; ``"bilinear"`` is offered for smoother input.
"""
from __future__ import annotations

import math
import os
from typing import Mapping, Optional, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from .vit import (
    INTERPOLATIONS,
    DinoViT,
    as_float_images,
    check_output_size,
    describe_vit,
    load_checkpoint,
    normalize_imagenet,
    resize_features,
    resize_images,
    select_prefix,
    state_dict_of,
    vit_from_state_dict,
)

__all__ = ["STEGOExtractor", "stego_input_size"]

PathLike = Union[str, os.PathLike]


def stego_input_size(height: int, width: int, res: int, patch: int) -> Tuple[int, int]:
    """The network input size for an image: shorter side ~ ``res``, both sides multiples of ``patch``.

    Each side becomes ``floor(side * res / min(H, W) / patch + 0.5) * patch`` (at least one patch).
    """
    if height < 1 or width < 1:
        raise ValueError(f"image size must be positive, got {height}x{width}")
    s = res / min(height, width)

    def side(n: int) -> int:
        return max(patch, int(math.floor(n * s / patch + 0.5)) * patch)

    return side(height), side(width)


def _conv(sd: Mapping[str, torch.Tensor], prefix: str, what: str) -> nn.Conv2d:
    w, b = sd.get(prefix + ".weight"), sd.get(prefix + ".bias")
    if w is None or b is None:
        missing = [k for k in (prefix + ".weight", prefix + ".bias") if k not in sd]
        raise ValueError(f"{what}: missing key(s) {missing}")
    if w.ndim != 4 or tuple(w.shape[2:]) != (1, 1):
        raise ValueError(f"{what}: {prefix}.weight must be a 1x1 convolution (out, in, 1, 1), got {tuple(w.shape)}")
    conv = nn.Conv2d(int(w.shape[1]), int(w.shape[0]), 1)
    try:
        conv.load_state_dict({"weight": w, "bias": b})
    except RuntimeError as e:
        raise ValueError(f"{what}: {prefix}: {e}") from e
    return conv


class STEGOExtractor(nn.Module):
    """STEGO's code for whole images: (B, 3, H, W) -> (B, dim, h, w).

    The submodules carry STEGO's own names (``model``, ``cluster1``, ``cluster2``), so
    ``state_dict()`` has exactly the checkpoint's ``net.*`` keys.

    Args:
        model: the DINO ViT backbone.
        cluster1: ``Sequential(Conv2d(D, dim, 1))``, STEGO's linear projection.
        cluster2: ``Sequential(Conv2d(D, D, 1), ReLU, Conv2d(D, dim, 1))`` or None (a model trained
            with ``projection_type: linear``).
        res: shorter image side fed to the network (320, STEGO's evaluation).
        flip_average: average the code of the image and of its horizontal flip, flipped back
            (STEGO's evaluation, default).
        normalize: L2-normalise each pixel's code after the final resize (default; STEGO's
            cluster probe does the same).
        interpolation: ``"nearest"`` (STEGO's ``T.Resize(res, Image.NEAREST)``) or ``"bilinear"``.
    """

    def __init__(
        self,
        model: DinoViT,
        cluster1: nn.Module,
        cluster2: Optional[nn.Module] = None,
        *,
        res: int = 320,
        flip_average: bool = True,
        normalize: bool = True,
        interpolation: str = "nearest",
    ):
        super().__init__()
        if interpolation not in INTERPOLATIONS:
            raise ValueError(f"interpolation must be one of {INTERPOLATIONS}, got {interpolation!r}")
        if isinstance(res, bool) or not isinstance(res, int) or res < model.patch_size:
            raise ValueError(f"res must be an integer >= the patch size {model.patch_size}, got {res!r}")
        self.model = model
        self.cluster1 = cluster1
        self.cluster2 = cluster2
        self.res = res
        self.flip_average = bool(flip_average)
        self.normalize = bool(normalize)
        self.interpolation = interpolation
        self.eval()

    # -- construction ----------------------------------------------------------------------

    @classmethod
    def from_state_dict(cls, sd: Mapping[str, torch.Tensor], *, what: str = "STEGO state dict", **kwargs) -> "STEGOExtractor":
        """From a STEGO ``state_dict`` (keys ``net.model.*``, ``net.cluster1.0.*``, ...; the
        ``net.`` level alone is accepted too). Probes, decoder and losses are ignored; any other
        ``net.*`` key, a missing backbone key or a shape mismatch is an error naming the key."""
        if any(k.startswith("net.") for k in sd):
            net = select_prefix(sd, "net.")
        else:
            net = dict(sd)
        if not any(k.startswith("model.") for k in net):
            raise ValueError(
                f"{what}: no 'net.model.*' keys; expected a DINO-based STEGO checkpoint (LitUnsupervisedSegmenter with "
                f"arch 'dino'), got keys {sorted(sd)[:8]}"
            )
        backbone = vit_from_state_dict(select_prefix(net, "model."), what=f"{what} (net.model.*)")
        extra = sorted(k for k in net if not k.startswith(("model.", "cluster1.", "cluster2.")))
        if extra:
            raise ValueError(f"{what}: unexpected key(s) {['net.' + k for k in extra[:8]]} in STEGO's DinoFeaturizer")
        c1 = _conv(net, "cluster1.0", what)
        if c1.in_channels != backbone.embed_dim:
            raise ValueError(
                f"{what}: net.cluster1.0 takes {c1.in_channels} channels but the backbone is {backbone.embed_dim} wide"
            )
        cluster1 = nn.Sequential(c1)
        unknown1 = sorted(k for k in net if k.startswith("cluster1.") and not k.startswith("cluster1.0."))
        unknown2 = sorted(k for k in net if k.startswith("cluster2.") and not k.startswith(("cluster2.0.", "cluster2.2.")))
        if unknown1 or unknown2:
            raise ValueError(f"{what}: unexpected key(s) {['net.' + k for k in unknown1 + unknown2]}")
        cluster2 = None
        if any(k.startswith("cluster2.") for k in net):
            a, b = _conv(net, "cluster2.0", what), _conv(net, "cluster2.2", what)
            if a.in_channels != backbone.embed_dim or a.out_channels != b.in_channels or b.out_channels != c1.out_channels:
                raise ValueError(
                    f"{what}: net.cluster2 is {a.in_channels}->{a.out_channels}->{b.in_channels}->{b.out_channels}; "
                    f"expected {backbone.embed_dim}->{backbone.embed_dim}->{backbone.embed_dim}->{c1.out_channels}"
                )
            cluster2 = nn.Sequential(a, nn.ReLU(), b)
        return cls(backbone, cluster1, cluster2, **kwargs)

    @classmethod
    def from_checkpoint(cls, path: PathLike, *, trust_pickle: bool = False, **kwargs) -> "STEGOExtractor":
        """From a STEGO Lightning ``.ckpt`` (e.g. ``cocostuff27_vit_base_5.ckpt``, ``potsdam_test.ckpt``).

        The released checkpoints keep an omegaconf ``DictConfig`` in ``hyper_parameters``, so
        they need ``trust_pickle=True`` (see :func:`mars_plugin.adapters.vit.load_checkpoint`);
        omegaconf need not be installed. Keyword arguments go to the constructor.
        """
        obj = load_checkpoint(path, trust_pickle=trust_pickle, what="STEGO checkpoint")
        sd = state_dict_of(obj, path, "STEGO checkpoint")
        return cls.from_state_dict(sd, what=f"{os.fspath(path)}", **kwargs)

    # -- properties ------------------------------------------------------------------------

    @property
    def dim(self) -> int:
        return int(self.cluster1[0].out_channels)

    @property
    def patch_size(self) -> int:
        return self.model.patch_size

    def describe(self) -> str:
        proj = "nonlinear" if self.cluster2 is not None else "linear"
        return (
            f"STEGO on DINO {describe_vit(self.model)}, {proj} projection to dim {self.dim}; shorter side {self.res}, "
            f"{self.interpolation} resize, flip averaging {'on' if self.flip_average else 'off'}, "
            f"L2 normalisation {'on' if self.normalize else 'off'}"
        )

    def input_size(self, height: int, width: int) -> Tuple[int, int]:
        """Network input size for an image of ``height`` x ``width`` (see :func:`stego_input_size`)."""
        return stego_input_size(height, width, self.res, self.patch_size)

    def grid_size(self, height: int, width: int) -> Tuple[int, int]:
        """(h, w) of the code for an image of ``height`` x ``width`` with ``output_size=None``."""
        h, w = self.input_size(height, width)
        return h // self.patch_size, w // self.patch_size

    # -- computation -----------------------------------------------------------------------

    def code(self, x: torch.Tensor) -> torch.Tensor:
        """STEGO's code of already normalised images whose sides are multiples of the patch:
        ``cluster1(feat) + cluster2(feat)`` (``src/modules.py:108-111``, dropout off)."""
        p = self.patch_size
        if x.shape[-2] % p or x.shape[-1] % p:
            raise ValueError(f"image sides must be multiples of the patch {p}, got {tuple(x.shape[-2:])}")
        feat = self.model.patch_tokens(x)
        out = self.cluster1(feat)
        if self.cluster2 is not None:
            out = out + self.cluster2(feat)
        return out

    @torch.no_grad()
    def forward(self, images: torch.Tensor, output_size: Optional[Tuple[int, int]] = None) -> torch.Tensor:
        """(B, 3, H, W) uint8 or float [0, 1] RGB -> (B, dim, h, w) float32.

        (h, w) is the patch grid of the resized input (:meth:`grid_size`) or ``output_size``
        (bilinear, align_corners=False, as STEGO up-samples its code).
        """
        output_size = check_output_size(output_size)
        x = as_float_images(images)
        x = resize_images(x, self.input_size(*x.shape[-2:]), self.interpolation)
        x = normalize_imagenet(x)
        if self.flip_average:
            both = self.code(torch.cat([x, x.flip(3)], dim=0)).float()
            c, c_flip = both.chunk(2, dim=0)
            code = (c + c_flip.flip(3)) / 2
        else:
            code = self.code(x).float()
        code = resize_features(code, output_size)
        if self.normalize:
            code = F.normalize(code, dim=1)
        return code
