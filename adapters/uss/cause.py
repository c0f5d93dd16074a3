"""CAUSE features (Kim et al., Pattern Recognition 2024) as DHR computes them, for MARS, from DHR's
heads file or from CAUSE's own release.

DHR (shjo-april/DHR @ 94d5189, the MARS authors' follow-up) trains with CAUSE features on a
DINOv2 backbone. What it computes, read from its code (file:line of that commit):

* ``CAUSE`` (``core/uss/models.py:115-150``) holds ``backbone = DINOv2(arch, 14)`` (l. 119; the
  torch.hub ``dinov2_vit?14`` model, l. 78-84) and ``segment = Segment_TR(D, 90, 322**2 // 14**2)``
  (l. 125: 529 queries). The heads file ``weights/CAUSE_<dataset>.pt`` is ``{'decoder': ...,
  'codebook': ...}``: ``segment.load_state_dict(checkpoint['decoder'])`` (default ``strict=True``)
  and ``segment.head_ema.codebook = checkpoint['codebook']`` (l. 127-129), a plain attribute,
  not a parameter. ``pe`` is a copy of ``head_ema.query_pos`` (l. 131).
* ``forward`` (l. 143-150): ``z = backbone.forward_features(images)[:, 1:, :]``, the tokens after
  DINOv2's final LayerNorm without [CLS] (l. 102-113); ``pe = interpolate_pe(pe, fh * fw)``
  (``core/uss/utils.py:7-8``: ``F.interpolate(pe.T[None], N, mode='linear')``, align_corners
  False, so the 529 rows are resampled linearly to N rows); ``segment.head_ema(z, (fh, fw), pe)``.
* ``Segment_TR`` (``core/uss/layers.py:84-92``) holds only ``head_ema``, a ``CauseDecoder``
  (l. 68-82): ``query_pos`` (529, D) and ``tr = TRDecoder(D, 90)`` (l. 36-66): ``self_attn`` and
  ``multihead_attn`` = ``nn.MultiheadAttention(D, 1, dropout=0.0)`` in (N, B, D) layout,
  ``linear1`` (D -> 2048), ``linear2`` (2048 -> D), ``norm1..3`` = ``nn.LayerNorm(D)`` (eps
  1e-5), ``f1`` = ``Conv2d(D, 90, 1)``, ``f2`` = ``Sequential(Conv2d(D, D, 1), ReLU, Conv2d(D,
  90, 1))``.
* ``CauseDecoder.forward`` (l. 77-82): the target is ``vqt(z, codebook)``: each token replaced by
  the codebook row of largest cosine similarity (``layers.py:20-34``: both sides
  ``F.normalize``-d, ``argmax``, which takes the first row on ties); memory = z; pos = pe.
* ``TRDecoder.forward`` (l. 52-66), post-norm, no dropout in the layer:
  ``t = norm1(tgt + self_attn(q=tgt+pe, k=tgt+pe, v=tgt))``;
  ``t = norm2(t + multihead_attn(q=t+pe, k=z, v=z))`` (no positional term on the key);
  ``t = norm3(t + linear2(relu(linear1(t))))``; ``u = z + t`` (the *unquantised* tokens added
  after the last norm, l. 62); nothing else is normalised; the code is ``f1(u) + f2(u)`` on the
  (B, D, fh, fw) map (tokens row-major, ``transform``, l. 5-11), a (B, 90, fh, fw) map (l. 63-65,
  82).
* DHR's features: ``inference(model, Normalize(image))`` (``produce_uss_features.py:12,17,32-34``,
  ``core/uss/__init__.py:54-74``), i.e. :func:`~mars_plugin.adapters.uss.multiscale.multiscale` on the
  full-resolution image, not L2-normalised: ``CAUSEExtractor.from_files(b, h, **DHR_SETTINGS)``.

The decoder modules are in :mod:`mars_plugin.adapters.uss.cause_decoder`; reading the heads,
from DHR's file or from CAUSE's own release, in :mod:`mars_plugin.adapters.uss.cause_files`.

What we do differently: our modules run attention in (B, N, D) layout (``batch_first=True``; the
state-dict keys do not depend on it) and without the attention-weight output DHR discards, so the
numbers agree to float32 rounding; the quantisation always runs in float32 (also under fp16
autocast, where near ties could otherwise flip). Our backbone drops DINOv2's register tokens as
well as [CLS] (``patch_token_sequence``); DHR's ``[:, 1:]`` would keep registers, but DHR's hub
models have none. ``patch_size`` is the backbone's (14 for DINOv2); the queries are resampled to
any token count, as in DHR.
"""
from __future__ import annotations

import os
from typing import Any, Mapping, Optional, Sequence, Union

import torch
import torch.nn as nn

from mars_plugin.adapters.uss.cause_decoder import CAUSESegment
from mars_plugin.adapters.uss.cause_files import _decoder_from_state_dict, _read_heads
from mars_plugin.adapters.uss.code_extractor import CodeExtractor, load_tensor_file, what_is
from mars_plugin.adapters.uss.multiscale import DHR_SETTINGS
from mars_plugin.adapters.uss.vit import DinoViT, describe_vit
from mars_plugin.adapters.uss.vit_weights import vit_from_state_dict

__all__ = [
    "CAUSEExtractor",
    "DHR_SETTINGS",
]

PathLike = Union[str, os.PathLike]


class CAUSEExtractor(CodeExtractor):
    """CAUSE's 90-d code for whole images: (B, 3, H, W) -> (B, dim, h, w).

    Args:
        backbone: the DINOv2 ViT: an ``nn.Module`` with ``patch_size``, ``embed_dim`` and
            ``patch_token_sequence(x) -> (B, N, D)`` (final-LayerNorm patch tokens, row-major).
        segment: a :class:`CAUSESegment` of width D (the backbone's).
        codebook: (K, D) float tensor, CAUSE's concept codebook (kept as a non-persistent buffer, so
            it follows ``.to(device)`` but ``state_dict()`` holds only ``backbone.*`` and
            ``segment.*``, as DHR keeps it outside the decoder's state dict).
        res: None (default: the image's own resolution, each side rounded to the nearest patch
            multiple; with ``scales``, the image exactly as it is, as DHR feeds it) or the shorter
            side fed to the network.
        scales: None (one scale) or DHR's multi-scale inference at these scales of the base image
            (:func:`~mars_plugin.adapters.uss.multiscale.multiscale`); the first sets the output grid.
        flip_average: average with the horizontally flipped image's code, flipped back (default;
            DHR's ``hflip=True``).
        normalize: L2-normalise each pixel's code after the final resize (default; DHR does not).
        interpolation: the resize to ``res`` (``"bilinear"`` default, or ``"nearest"``).

    ``CAUSEExtractor.from_files(backbone, heads, **DHR_SETTINGS)`` reproduces DHR's features.
    """

    def __init__(
        self,
        backbone: nn.Module,
        segment: CAUSESegment,
        codebook: torch.Tensor,
        *,
        res: Optional[int] = None,
        scales: Optional[Sequence[float]] = None,
        flip_average: bool = True,
        normalize: bool = True,
        interpolation: str = "bilinear",
    ):
        super().__init__()
        if not isinstance(backbone, nn.Module) or not callable(getattr(backbone, "patch_token_sequence", None)):
            raise TypeError(f"backbone must be an nn.Module with patch_token_sequence(x) -> (B, N, D) (the DINOv2 "
                            f"DinoViT), got {type(backbone).__name__}")
        patch, width = getattr(backbone, "patch_size", None), getattr(backbone, "embed_dim", None)
        if not isinstance(patch, int) or patch < 1 or not isinstance(width, int) or width < 1:
            raise TypeError(f"backbone must have integer patch_size and embed_dim, got {patch!r} and {width!r}")
        if not isinstance(segment, CAUSESegment):
            raise TypeError(f"segment must be a CAUSESegment (DHR's Segment_TR), got {type(segment).__name__}")
        if segment.width != width:
            raise ValueError(f"segment is {segment.width} wide but the backbone is {width} wide")
        if not isinstance(codebook, torch.Tensor) or not codebook.is_floating_point():
            raise TypeError(f"codebook must be a float (K, D) tensor, got {what_is(codebook) if not isinstance(codebook, torch.Tensor) else codebook.dtype}")
        if codebook.ndim != 2 or codebook.shape[0] < 1 or codebook.shape[1] != width:
            raise ValueError(f"codebook must be (K, {width}) with K >= 1 (D = the backbone width), "
                             f"got shape {tuple(codebook.shape)}")
        if not torch.isfinite(codebook).all():
            raise ValueError("codebook holds NaN or infinite values")
        self._set_inputs(patch, res=res, flip_average=flip_average, normalize=normalize,
                         interpolation=interpolation, scales=scales)
        self.backbone = backbone
        self.segment = segment
        self.register_buffer("codebook", codebook.detach().float().clone(), persistent=False)
        self.eval()

    # -- construction ----------------------------------------------------------------------

    @classmethod
    def from_files(cls, backbone: PathLike, heads: PathLike, **kwargs: Any) -> "CAUSEExtractor":
        """CAUSE from its files: the DINOv2 backbone weights and the heads, in DHR's or CAUSE's form.

        ``backbone``: a flat state dict of DINOv2 weights (the torch.hub model's ``state_dict()``,
        or CAUSE's ``checkpoint/dinov2_vit_base_14.pth``), built and loaded strictly by
        :func:`~mars_plugin.adapters.uss.vit_weights.vit_from_state_dict` (variant from the shapes); it must
        be a DINOv2 model with 14-pixel patches, as DHR's ``DINOv2(arch, 14)``
        (``core/uss/models.py:119``). DINO v1, iBOT, MSN and MAE backbones are refused.

        ``heads``, told apart by what is on disk:

        1. DHR's ``CAUSE_<dataset>.pt``, ``{'decoder': Segment_TR state dict (keys head_ema.*),
           'codebook': (K, D) tensor}`` (``core/uss/models.py:127-129``); other top-level keys are
           not read, as in DHR.
        2. CAUSE's release folder ``CAUSE/<dataset>/<baseline>/<num_codebook>/`` holding
           ``segment_tr.pth``: the state dict of CAUSE's whole ``Segment_TR``
           (``modules/segment.py:27-47``: ``head.*``, ``projection_head.f.*``, ``head_ema.*``,
           ``projection_head_ema.f.*``, ``linear.f.*``, no ``module.`` prefix), of which the EMA
           head ``head_ema.*`` is what CAUSE's inference runs (``test_tr.py:26-28``) and what we
           build; the codebook is ``modular.npy`` in
           ``CAUSE/<dataset>/modularity/<baseline>/<num_codebook>/`` (where CAUSE's scripts read
           it, ``utils/utils.py:54-62``) or beside ``segment_tr.pth``. ``cluster_tr.pth`` is not
           read: it holds CAUSE's ``Cluster`` (``segment_module.py:92-110``), the cluster probe
           used for CAUSE's own evaluation and a copy of the codebook, not needed for the features.
        3. That ``segment_tr.pth`` file itself, its codebook found as in 2.

        Only releases for DINOv2 ViT/14 are read: a folder named for another baseline
        (``dino_vit_base_8``, ...) or a ``head_ema.query_pos`` of other than 529 = 322**2 // 14**2
        rows (CAUSE's 320**2 // 8**2 = 1600 or 320**2 // 16**2 = 400 for its other backbones) is
        refused.

        The decoder is loaded strictly (a missing, unexpected or mis-shaped key is a ValueError
        naming the key and the file), its sizes read from the shapes (90 channels, 529 queries, FFN
        2048 in DHR's and CAUSE's files); the codebook must be a finite float (K, D) with D the
        backbone's width (errors name the file and the shapes). ``.pt``/``.pth`` files are opened
        with ``torch.load(map_location="cpu", weights_only=True)`` only and ``.npy`` files with
        ``np.load(allow_pickle=False)`` only: a file holding pickled Python objects is refused
        with a PermissionError and never unpickled (there is no trust option). Keyword arguments
        go to the constructor.

        Shapes: the codebook (K, D), the decoder's ``head_ema.query_pos`` (529, D).
        """
        bname = os.fspath(backbone)
        bsd = load_tensor_file(backbone, "DINOv2 backbone file")
        if not isinstance(bsd, Mapping) or not all(isinstance(k, str) for k in bsd):
            raise ValueError(f"{bname}: the DINOv2 backbone file must hold a flat state dict, got {what_is(bsd)}")
        not_tensors = sorted(k for k, v in bsd.items() if not isinstance(v, torch.Tensor))
        if not_tensors:
            raise ValueError(f"{bname}: the DINOv2 backbone file must map names to tensors; {not_tensors[:5]} are "
                             f"not tensors")
        model = vit_from_state_dict(bsd, what=f"{bname} (DINOv2 backbone)")
        if model.patch_size != 14 or not model.is_dinov2:
            raise ValueError(f"{bname}: DHR's CAUSE runs on a DINOv2 ViT with 14-pixel patches "
                             f"(core/uss/models.py:74-119); this file holds a {describe_vit(model)}")
        decoder, codebook, what = _read_heads(heads, model.embed_dim, bname)
        segment = _decoder_from_state_dict(decoder, model.embed_dim, what)
        return cls(model, segment, codebook, **kwargs)

    # -- properties ------------------------------------------------------------------------

    @property
    def dim(self) -> int:
        return self.segment.dim

    @property
    def patch_size(self) -> int:
        return int(self.backbone.patch_size)

    def describe(self) -> str:
        net = describe_vit(self.backbone) if isinstance(self.backbone, DinoViT) else type(self.backbone).__name__
        size = "full resolution" if self.res is None else f"shorter side {self.res}, {self.interpolation} resize"
        scales = "" if self.scales is None else f"scales {', '.join(f'{s:g}' for s in self.scales)}, "
        return (
            f"CAUSE on {net}, codebook of {self.codebook.shape[0]}, decoder to dim {self.dim}; {size}, "
            f"{scales}flip averaging {'on' if self.flip_average else 'off'}, "
            f"L2 normalisation {'on' if self.normalize else 'off'}"
        )

    # -- computation -----------------------------------------------------------------------

    def code(self, x: torch.Tensor) -> torch.Tensor:
        """CAUSE's code of normalised images whose sides are multiples of the patch (14).

        Shapes: (B, 3, H, W) -> (B, dim, H / 14, W / 14); DHR's ``CAUSE.forward``
        (``core/uss/models.py:143-150``).
        """
        p = self.patch_size
        if not isinstance(x, torch.Tensor) or x.ndim != 4:
            raise ValueError(f"x must be a normalised (B, 3, H, W) batch, got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        self._check_patch_multiple(x)
        grid = (x.shape[-2] // p, x.shape[-1] // p)
        z = self.backbone.patch_token_sequence(x)
        if z.ndim != 3 or z.shape[0] != x.shape[0] or z.shape[1] != grid[0] * grid[1] or z.shape[2] != self.segment.width:
            raise ValueError(f"backbone.patch_token_sequence gave {tuple(z.shape)} for a {tuple(x.shape)} batch; "
                             f"expected ({x.shape[0]}, {grid[0] * grid[1]}, {self.segment.width})")
        return self.segment(z, grid, self.codebook)
