"""Leopart embeddings (Ziegler & Asano, CVPR 2022; MkuuWaUjinga/leopart @ 7835701) for MARS.

What Leopart computes, read from its code (file:line of that commit):

* The network (``src/vit.py:117-298``) is DINO's ViT plus a projection head and prototypes:
  ``projection_head`` = ``Linear(D, hidden)``, GELU, [``Linear(hidden, hidden)``, GELU] x
  (n - 2), ``Linear(hidden, out)`` (l. 145-156; keys ``projection_head.0/2/4`` for the trained
  ``n_layers_projection_head: 3``, ``projection_hidden_dim: 2048``, ``projection_feat_dim: 256``,
  ``experiments/configs/*.yml``), and ``prototypes`` = ``Linear(out, K, bias=False)`` (l. 164).
  ``forward_head`` L2-normalises the head output (l. 240-245).
* Training (``src/leopart.py:113-154``) is a Lightning module with ``self.model`` (the student)
  and ``self.teacher``: its checkpoints hold ``state_dict`` keys ``model.*`` and ``teacher.*``.
* The evaluation loads "ours" weights with ``get_backbone_weights`` (``experiments/utils.py:
  368-433``): ``torch.load``, ``["state_dict"]`` if present, keep keys starting with ``model``,
  strip the prefix found in front of ``cls_token`` (l. 436-447), drop every key containing
  ``head`` or ``prototypes`` (l. 430-433). The released ``leopart_vits16.ckpt`` /
  ``leopart_vitb8.ckpt`` are flat dicts loaded as ``{".".join(k.split(".")[1:]): v}`` (README,
  "full ckpt" = backbone + projection head): one leading prefix component.
* The embedding evaluated (overclustering ``experiments/overcluster/sup_overcluster.py:179-189``,
  fully unsupervised segmentation ``experiments/utils.py:310-329``) is the backbone's
  ``forward_backbone(imgs)[:, 1:]``, the normed patch tokens (D = 384 or 768), on images resized
  to ``size_crops: 448`` squared (bilinear ``T.Resize((448, 448))``, ImageNet normalisation,
  ``sup_overcluster.py:64-66``). (The evaluation then standardises and PCA-reduces the tokens of
  the whole dataset; MARS's K-means on L2-normalised pixels needs neither.)

``head=True`` gives the L2-normalised 256-d projection instead (the space Leopart's clustering
loss trains). The 448 x 448 resize does not keep the aspect ratio; the (h, w) = (448/p, 448/p)
grid still covers the whole image, and the MARS core resizes it to each label bilinearly.

Leopart's evaluation neither flips nor uses several scales; ``flip_average=True`` and
``scales=...`` (DHR's multi-scale inference, :mod:`mars_plugin.adapters.uss.multiscale`) are offered
so that Leopart embeddings can be computed the way DHR computes STEGO's; both are off by default.
"""
from __future__ import annotations

import os
import re
from typing import Any, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

from mars_plugin.adapters.uss.code_extractor import CodeExtractor
from mars_plugin._checks import MAX_RES

from mars_plugin.adapters.uss.multiscale import nearest_patch_size
from mars_plugin.adapters.uss.vit import DinoViT, describe_vit
from mars_plugin.adapters.uss.vit_weights import (
    load_checkpoint,
    select_prefix,
    state_dict_of,
    vit_from_state_dict,
)

__all__ = ["LeopartExtractor", "leopart_backbone_prefix"]

PathLike = Union[str, os.PathLike]


def leopart_backbone_prefix(sd: Mapping[str, Any], prefix: Optional[str] = None) -> str:
    """The key prefix of the student backbone: ``prefix`` if given; else ``"model."`` when a
    ``model.cls_token`` exists (Lightning checkpoints, next to ``teacher.``), else the single
    prefix found in front of a ``cls_token`` key (``experiments/utils.py:436-447``)."""
    if prefix is not None:
        if not any(k.startswith(prefix) for k in sd):
            raise ValueError(f"no key starts with the prefix {prefix!r} (keys start with {sorted(sd)[:5]})")
        return prefix
    found = sorted(k[: -len("cls_token")] for k in sd if k.endswith("cls_token"))
    if "model." in found:
        return "model."
    if len(found) == 1:
        return found[0]
    if not found:
        raise ValueError(f"no 'cls_token' key: not a ViT checkpoint (keys start with {sorted(sd)[:5]})")
    raise ValueError(f"several ViTs in the checkpoint (prefixes {found}); choose one with prefix=")


def _projection_head(sd: Mapping[str, torch.Tensor], what: str) -> nn.Module:
    """Leopart's projection head from its ``projection_head.*`` weights (``src/vit.py:145-156``)."""
    if "weight" in sd and not any(k[0].isdigit() for k in sd):  # n_layers_projection_head == 1
        w = sd["weight"]
        head = nn.Linear(int(w.shape[1]), int(w.shape[0]))
        head.load_state_dict(dict(sd))
        return head
    idx = sorted({int(m.group(1)) for k in sd for m in [re.match(r"^(\d+)\.", k)] if m})
    want = list(range(0, 2 * len(idx), 2))
    if not idx or idx != want:
        raise ValueError(f"{what}: projection_head layers {idx}; expected Linear layers at {want or [0, 2, 4]}")
    layers: List[nn.Module] = []
    for j, i in enumerate(idx):
        w = sd.get(f"{i}.weight")
        if w is None or f"{i}.bias" not in sd or w.ndim != 2:
            raise ValueError(f"{what}: projection_head.{i} must be a Linear layer with weight and bias")
        if j:
            layers.append(nn.GELU())
        layers.append(nn.Linear(int(w.shape[1]), int(w.shape[0])))
    head = nn.Sequential(*layers)
    try:
        head.load_state_dict(dict(sd), strict=True)
    except RuntimeError as e:
        raise ValueError(f"{what}: projection_head: {e}") from e
    return head


class LeopartExtractor(CodeExtractor):
    """Leopart's patch embeddings: (B, 3, H, W) -> (B, D, res/p, res/p).

    Args:
        model: the fine-tuned DINO ViT (Leopart's ``model`` without head and prototypes).
        projection_head: Leopart's projection head, needed for ``head=True``.
        head: embed with the projection head (256-d, L2-normalised as ``forward_head`` does)
            instead of the backbone tokens (D-d, what Leopart's evaluation clusters; default).
        res: square input side (448, Leopart's evaluation); a multiple of the patch. None: the
            image's own resolution (each side rounded to the nearest patch multiple; with
            ``scales``, the image exactly as it is).
        normalize: L2-normalise each embedding after the final resize; None (default) follows
            Leopart: normalised with the head, raw backbone tokens without.
        interpolation: ``"bilinear"`` (torchvision's default in ``T.Resize``) or ``"nearest"``.
        flip_average: average with the embeddings of the horizontally flipped image, flipped
            back (off by default: Leopart's evaluation does not flip).
        scales: None (one scale) or DHR's multi-scale inference at these scales of the base
            image (:func:`~mars_plugin.adapters.uss.multiscale.multiscale`); the first sets the grid.
    """

    def __init__(
        self,
        model: DinoViT,
        projection_head: Optional[nn.Module] = None,
        *,
        head: bool = False,
        res: Optional[int] = 448,
        normalize: Optional[bool] = None,
        interpolation: str = "bilinear",
        flip_average: bool = False,
        scales: Optional[Sequence[float]] = None,
    ):
        super().__init__()
        if res is not None and (
            isinstance(res, bool) or not isinstance(res, int) or res < model.patch_size or res % model.patch_size
            or res > MAX_RES
        ):
            raise ValueError(f"res must be None (the image's own resolution) or a positive multiple of the patch size "
                             f"{model.patch_size} up to {MAX_RES}, got {res!r}")
        if head and projection_head is None:
            raise ValueError("head=True needs Leopart's projection head, and none was given (the checkpoint has no "
                             "'projection_head.*' weights)")
        # Leopart's res is a square side, so it must also be a multiple of the patch (checked above).
        self._set_inputs(model.patch_size, res=res, flip_average=flip_average,
                         normalize=bool(head) if normalize is None else normalize, interpolation=interpolation,
                         scales=scales)
        self.model = model
        self.projection_head = projection_head
        self.head = bool(head)
        self.eval()

    @classmethod
    def from_state_dict(
        cls, sd: Mapping[str, torch.Tensor], *, prefix: Optional[str] = None, what: str = "Leopart state dict", **kwargs
    ) -> "LeopartExtractor":
        """From a Leopart state dict: Lightning (``model.*`` + ``teacher.*``: the student
        ``model.*`` is used), a released flat dict (one leading prefix), or a bare backbone.

        Backbone: keys under the prefix without ``head``/``prototypes`` (as
        ``get_backbone_weights``), loaded strictly: a missing or unexpected key is an error naming
        it. The projection head is read only when ``head=True``.
        """
        p = leopart_backbone_prefix(sd, prefix)
        net = select_prefix(sd, p)
        backbone_sd = {k: v for k, v in net.items() if "head" not in k and "prototypes" not in k}
        backbone = vit_from_state_dict(backbone_sd, what=f"{what} ({p or 'no prefix'}* backbone)")
        head_sd = select_prefix(net, "projection_head.")
        projection_head = None
        if kwargs.get("head"):
            if not head_sd:
                raise ValueError(f"{what}: head=True but there are no '{p}projection_head.*' weights")
            projection_head = _projection_head(head_sd, what)
            if _in_features(projection_head) != backbone.embed_dim:
                raise ValueError(f"{what}: the projection head takes {_in_features(projection_head)} features but the "
                                 f"backbone is {backbone.embed_dim} wide")
        return cls(backbone, projection_head, **kwargs)

    @classmethod
    def from_checkpoint(
        cls, path: PathLike, *, trust_pickle: bool = False, prefix: Optional[str] = None, **kwargs
    ) -> "LeopartExtractor":
        """From ``leopart_vits16.ckpt`` / ``leopart_vitb8.ckpt`` or a Leopart Lightning checkpoint.

        Flat dicts of tensors load with ``weights_only=True``; a Lightning checkpoint whose
        hyper-parameters are pickled objects needs ``trust_pickle=True``.
        """
        obj = load_checkpoint(path, trust_pickle=trust_pickle, what="Leopart checkpoint")
        sd = state_dict_of(obj, path, "Leopart checkpoint")
        return cls.from_state_dict(sd, prefix=prefix, what=os.fspath(path), **kwargs)

    @property
    def patch_size(self) -> int:
        return self.model.patch_size

    @property
    def dim(self) -> int:
        if self.head:
            last = [m for m in self.projection_head.modules() if isinstance(m, nn.Linear)][-1]
            return int(last.out_features)
        return self.model.embed_dim

    def describe(self) -> str:
        what = f"projection head ({self.dim}-d)" if self.head else f"backbone tokens ({self.dim}-d)"
        size = "full resolution" if self.res is None else f"input {self.res}x{self.res} ({self.interpolation})"
        scales = "" if self.scales is None else f", scales {', '.join(f'{s:g}' for s in self.scales)}"
        return (
            f"Leopart {describe_vit(self.model)}, {what}; {size}{scales}, "
            f"flip averaging {'on' if self.flip_average else 'off'}, L2 normalisation {'on' if self.normalize else 'off'}"
        )

    def input_size(self, height: int, width: int) -> Tuple[int, int]:
        """Base input size: ``(res, res)``; with ``res=None`` the image's own size (with
        ``scales``) or each side rounded to the nearest patch multiple (one scale)."""
        if self.res is not None:
            return self.res, self.res
        if self.scales is not None:
            return height, width
        return nearest_patch_size(height, width, self.patch_size)

    def code(self, x: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) normalised images, sides multiples of the patch -> (B, D, H/p, W/p): the
        backbone's normed patch tokens (``forward_backbone(x)[:, 1:]``) or, with ``head``, the
        L2-normalised projection (``forward_head``, ``src/vit.py:240-245``)."""
        self._check_patch_multiple(x)
        p = self.patch_size
        tokens = self.model.forward_tokens(x)[:, 1:]
        if self.head:
            tokens = F.normalize(self.projection_head(tokens).float(), dim=-1)
        return rearrange(tokens, "b (h w) d -> b d h w", h=x.shape[-2] // p, w=x.shape[-1] // p)


def _in_features(head: nn.Module) -> int:
    return int([m for m in head.modules() if isinstance(m, nn.Linear)][0].in_features)
