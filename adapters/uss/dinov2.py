"""DINOv2 patch-token features (Oquab et al., 2023; facebookresearch/dinov2 @ b8931f7) for MARS.

DHR (shjo-april/DHR @ 94d5189, the MARS authors' follow-up) computes USS features on DINOv2:
its ``DINOv2`` module (``core/uss/models.py:74-100``) loads ``dinov2_vit{s,b,l,g}14`` from
``torch.hub`` (the plain models, no registers) and returns
``get_intermediate_layers(image, n=1, reshape=True)[0]`` (l. 97-100): the last block's tokens
after the final LayerNorm, [CLS] and registers dropped, as a (B, D, H/14, W/14) map. CAUSE
(l. 115-) sits on the same backbone. The network itself is
:class:`~mars_plugin.adapters.uss.vit.DinoViT` with DINOv2's parts (LayerScale, registers, mask
token, ViT-g's SwiGLU), read from the released ``dinov2_vit*14*_pretrain.pth`` flat state dict
by :func:`~mars_plugin.adapters.uss.vit_weights.vit_from_state_dict`; see that module for the upstream
lines and the per-variant position-embedding interpolation (offset 0.1 without registers,
offset 0 with antialias for the ``_reg`` models, ``dinov2/hub/backbones.py``).

:class:`DINOv2Extractor` has STEGO's interface (``from_files`` / ``code`` / ``forward`` /
``patch_size``; :class:`~mars_plugin.adapters.uss.stego.STEGOExtractor`) and its options: ``res``,
``scales`` (DHR's :func:`~mars_plugin.adapters.uss.multiscale.multiscale`), ``flip_average``,
``normalize``. ``DINOv2Extractor.from_files(backbone, **DHR_SETTINGS)`` equals DHR's
``inference(DINOv2, Normalize(image))`` (``core/uss/__init__.py:54-74``).
"""
from __future__ import annotations

import os
from typing import Mapping, Optional, Sequence, Union

import torch

from mars_plugin.adapters.uss.code_extractor import CodeExtractor, load_tensor_file, what_is
from mars_plugin.adapters.uss.vit import DinoViT, describe_vit
from mars_plugin.adapters.uss.vit_weights import vit_from_state_dict

__all__ = ["DINOv2Extractor"]

PathLike = Union[str, os.PathLike]


class DINOv2Extractor(CodeExtractor):
    """DINOv2's normed last-block patch tokens for whole images: (B, 3, H, W) -> (B, D, h, w).

    ``state_dict()`` has the backbone's keys under ``model.``.

    Args:
        model: a DINOv2 :class:`~mars_plugin.adapters.uss.vit.DinoViT` (patch 14).
        res: shorter image side fed to the network (each side rounded to the patch, aspect kept,
            as :func:`~mars_plugin.adapters.uss.stego.stego_input_size`); None (default): the
            image's own resolution (each side rounded to the nearest multiple of 14; with
            ``scales``, the image exactly as it is, as DHR feeds it).
        flip_average: average with the map of the horizontally flipped image, flipped back
            (default off; DHR's ``hflip=True``).
        normalize: L2-normalise each pixel's vector after the final resize (default off; DHR
            saves its features as they are).
        interpolation: ``"bilinear"`` (default, antialiased like PIL) or ``"nearest"``: the
            resize to ``res`` or to the nearest patch multiple only (the scales are always
            bilinear, as DHR's).
        scales: None (one scale) or DHR's multi-scale inference at these scales of the base
            image; the first scale sets the output grid (``DHR_SCALES`` = (2.0, 1.0, 1.5, 0.5)).
    """

    def __init__(
        self,
        model: DinoViT,
        *,
        res: Optional[int] = None,
        flip_average: bool = False,
        normalize: bool = False,
        interpolation: str = "bilinear",
        scales: Optional[Sequence[float]] = None,
    ):
        super().__init__()
        if not isinstance(model, DinoViT):
            raise TypeError(f"model must be a DinoViT, got {type(model).__name__}")
        self._set_inputs(model.patch_size, res=res, flip_average=flip_average, normalize=normalize,
                         interpolation=interpolation, scales=scales)
        self.model = model
        self.eval()

    # -- construction ----------------------------------------------------------------------

    @classmethod
    def from_state_dict(
        cls, sd: Mapping[str, torch.Tensor], *, what: str = "DINOv2 state dict", num_heads: Optional[int] = None,
        **kwargs,
    ) -> "DINOv2Extractor":
        """From a flat DINOv2 state dict (the released ``dinov2_vit*14*_pretrain.pth`` layout),
        loaded strictly by :func:`~mars_plugin.adapters.uss.vit_weights.vit_from_state_dict` (a missing or
        unexpected key is a ValueError naming it). ``num_heads``: only for widths other than the
        released ones (384/6, 768/12, 1024/16, 1536/24). A DINO v1 state dict (no LayerScale,
        registers or mask token) is refused. Keyword arguments go to the constructor."""
        model = vit_from_state_dict(sd, num_heads=num_heads, what=what)
        if not model.is_dinov2:
            raise ValueError(
                f"{what}: this is a DINO v1 {describe_vit(model)} (no 'blocks.N.ls1.gamma', 'mask_token' or "
                f"'register_tokens'); DINOv2's release files hold them. DINO v1 backbones are read by STEGO/Leopart"
            )
        return cls(model, **kwargs)

    @classmethod
    def from_files(cls, backbone: PathLike, *, num_heads: Optional[int] = None, **kwargs) -> "DINOv2Extractor":
        """From DINOv2's release file (``dinov2_vitb14_pretrain.pth``, ``dinov2_vits14_reg4_pretrain.pth``...).

        The file must hold a flat state dict of tensors; it is opened with
        ``torch.load(map_location="cpu", weights_only=True)`` only: a file holding pickled Python
        objects is refused with a PermissionError and never unpickled. The variant (width,
        depth, registers, SwiGLU) is read from the keys and shapes, and the weights are loaded
        strictly (``dinov2/hub/backbones.py:58``, ``strict=True``). Keyword arguments go to the
        constructor; ``**DHR_SETTINGS`` gives DHR's inference.
        """
        sd = load_tensor_file(backbone, "DINOv2 backbone file")
        name = os.fspath(backbone)
        if not isinstance(sd, Mapping) or not all(isinstance(k, str) for k in sd):
            raise ValueError(f"{name}: the DINOv2 backbone file must hold a flat state dict (DINOv2's "
                             f"dinov2_vitb14_pretrain.pth), got {what_is(sd)}")
        not_tensors = sorted(k for k, v in sd.items() if not isinstance(v, torch.Tensor))
        if not_tensors:
            raise ValueError(f"{name}: the DINOv2 backbone file must map names to tensors; {not_tensors[:5]} are "
                             f"not tensors (a training checkpoint? the released backbone files are flat state dicts)")
        return cls.from_state_dict(sd, what=f"{name} (DINOv2 backbone)", num_heads=num_heads, **kwargs)

    # -- properties ------------------------------------------------------------------------

    @property
    def dim(self) -> int:
        return self.model.embed_dim

    @property
    def patch_size(self) -> int:
        return self.model.patch_size

    def describe(self) -> str:
        size = "full resolution" if self.res is None else f"shorter side {self.res}, {self.interpolation} resize"
        scales = "" if self.scales is None else f"scales {', '.join(f'{s:g}' for s in self.scales)}, "
        return (
            f"{describe_vit(self.model)} patch tokens, dim {self.dim}; {size}, {scales}"
            f"flip averaging {'on' if self.flip_average else 'off'}, "
            f"L2 normalisation {'on' if self.normalize else 'off'}"
        )

    # -- computation -----------------------------------------------------------------------

    def code(self, x: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) normalised images, sides multiples of 14 -> (B, D, H/14, W/14): DHR's
        ``DINOv2.forward`` (``core/uss/models.py:97-100``)."""
        self._check_patch_multiple(x)
        return self.model.patch_tokens(x)
