"""An inference-only DINO Vision Transformer whose state dict is DINO's (and timm's).

Building one from a checkpoint (variant from the weight shapes, strict loading) is
:mod:`mars_plugin.adapters.uss.vit_weights`; the image preprocessing the extractors share is
:mod:`mars_plugin.adapters.uss.preprocess`.

The two unsupervised segmentation models MARS reads embeddings from both sit on DINO's ViT:

* STEGO (mhamilton723/STEGO) builds ``dino.vision_transformer.vit_small/vit_base`` (its
  ``src/dino/vision_transformer.py`` is DINO's file with a qkv return added), then reads the
  normalised output tokens of the last block (``get_intermediate_feat(img, n=1)``,
  ``src/dino/vision_transformer.py:225-237``: ``self.norm(x)`` after the last block, the same
  tensor as :meth:`DinoViT.forward_tokens`).
* Leopart (MkuuWaUjinga/leopart) fine-tunes the same network (``src/vit.py``, "adapted from"
  DINO) and evaluates ``forward_backbone(x)[:, 1:]`` (``src/vit.py:260-272``), again the normed
  last-block tokens.

So one module serves both. It is written from DINO's ``vision_transformer.py``
(facebookresearch/dino @ 7c446df), not copied; line numbers below refer to that file:

* patch embedding: ``Conv2d(3, D, kernel=stride=patch)``, flattened row-major (l. 126-131);
* ``[CLS]`` token prepended, then the (interpolated) position embedding added (l. 196-207);
* blocks: ``x + attn(norm1(x))``, ``x + mlp(norm2(x))``, MLP = fc1-GELU-fc2 (l. 49-113), scaled
  dot-product attention with ``head_dim ** -0.5`` (l. 68-92), LayerNorm eps 1e-6 (l. 243-254);
* a final LayerNorm (l. 156, 209-214).

No dropout, no drop-path: this module only runs inference.

DINOv2 (facebookresearch/dinov2 @ b8931f7; DHR's ``DINOv2``/``CAUSE``, ``core/uss/models.py:74-100``,
``torch.hub.load('facebookresearch/dinov2', 'dinov2_vit{s,b,l,g}14')``) is the same network with
four additions, each switched on by a constructor argument and detected from the weight names by
:func:`~mars_plugin.adapters.uss.vit_weights.vit_from_state_dict` (file:line below are of that commit):

* LayerScale: ``x + ls1(attn(norm1(x)))``, ``x + ls2(mlp(norm2(x)))`` with ``ls(y) = y * gamma``
  (``dinov2/layers/block.py:72,84,89-94,112-113``, ``layers/layer_scale.py:34``); every hub
  model has it (``init_values=1.0``, ``hub/backbones.py:23``): ``layer_scale=True``.
* Register tokens (the ``_reg`` models): ``(1, R, D)`` learned tokens inserted right after
  [CLS] *after* the position embedding was added, so they get none
  (``models/vision_transformer.py:214-233``): ``num_register_tokens=R``.
* ``mask_token`` (1, D), used only with masks in training (l. 169, 217-218): loaded, never used.
* ViT-g's SwiGLU MLP ``w3(silu(a) * b)`` with ``a, b = w12(x).chunk(2)`` and hidden width
  ``(int(4 D * 2 / 3) + 7) // 8 * 8`` (``layers/swiglu_ffn.py:30-34,66``): ``ffn="swiglu"``.

Its ``interpolate_pos_encoding`` (``models/vision_transformer.py:180-212``) generalises DINO's:
an ``interpolate_offset`` (0.1 = DINO's +0.1) in the scale factor, or, when the offset is 0,
resizing to the target size; and an ``interpolate_antialias`` flag. The hub builds the plain
models with offset 0.1 and no antialias (``hub/backbones.py:27-28``) but the ``_reg`` models with
``interpolate_antialias=True, interpolate_offset=0.0`` (``hub/backbones.py:107-108,122-123,
137-138,153-154``): :func:`~mars_plugin.adapters.uss.vit_weights.vit_from_state_dict` picks those per variant. The tokens DHR reads
are ``get_intermediate_layers(x, n=1, reshape=True)`` (l. 299-323): the final LayerNorm of the
last block with [CLS] and the registers dropped, :meth:`DinoViT.patch_token_sequence`.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

__all__ = [
    "MAX_TOKENS",
    "DinoViT",
    "heads_for_width",
    "describe_vit",
    "swiglu_hidden",
]

#: The most patch tokens one network input may hold (the extractors' ``max_tokens``). A
#: 500x375 VOC image gives 2,120 at STEGO's res 320 and 11,750 at DHR's scale 2.0 with an
#: 8-pixel patch; a 1500x1000 photo at scale 2.0 gives 93,750. Attention grows with the
#: square: an image of extreme aspect ratio (1x250 at res 320 is a 320x80000 input, 400,000
#: tokens) is refused, naming the sizes, instead of running for many minutes.
MAX_TOKENS = 1 << 17

#: Attention heads of the DINO/Leopart variants by width: vit_tiny 192/3, vit_small 384/6,
#: vit_base 768/12 (DINO ``vision_transformer.py:236-254``), vit_large 1024/16 (Leopart
#: ``src/vit.py:363-367``; DINOv2's too), DINOv2's vit_giant2 1536/24 (dinov2
#: ``models/vision_transformer.py:341-396``). The head count is not visible in any weight shape.
_HEADS_BY_WIDTH = {192: 3, 384: 6, 768: 12, 1024: 16, 1536: 24}

#: ``ffn`` of :class:`DinoViT`: DINO's fc1-GELU-fc2 MLP, or DINOv2 ViT-g's SwiGLU.
FFN_KINDS = ("mlp", "swiglu")


def heads_for_width(width: int) -> int:
    """Number of attention heads of the DINO/DINOv2 variant of this width (64 channels per head)."""
    if width in _HEADS_BY_WIDTH:
        return _HEADS_BY_WIDTH[width]
    raise ValueError(
        f"cannot tell the number of attention heads of a ViT of width {width}: DINO/Leopart ViTs are "
        f"{', '.join(f'{w} ({h} heads)' for w, h in _HEADS_BY_WIDTH.items())}; pass num_heads= explicitly"
    )


class _Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int, qkv_bias: bool = True):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"width {dim} is not divisible by {num_heads} heads")
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # DINO l. 80-92: qkv -> (3, B, heads, N, head_dim), softmax(q k^T * head_dim^-0.5) v.
        q, k, v = rearrange(self.qkv(x), "b n (three h d) -> three b h n d", three=3, h=self.num_heads)
        y = F.scaled_dot_product_attention(q, k, v)  # default scale = head_dim ** -0.5, as DINO
        return self.proj(rearrange(y, "b h n d -> b n (h d)"))


class _Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()  # exact (erf) GELU, nn.GELU's default as in DINO
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def swiglu_hidden(dim: int, mlp_ratio: float = 4.0) -> int:
    """Hidden width of DINOv2's SwiGLU MLP for width ``dim``: ``(int(dim * ratio * 2 / 3) + 7) // 8 * 8``
    (``dinov2/layers/swiglu_ffn.py:66``; 4096 for ViT-g's 1536)."""
    return (int(int(dim * mlp_ratio) * 2 / 3) + 7) // 8 * 8


class _SwiGLU(nn.Module):
    """DINOv2 ViT-g's MLP: ``w3(silu(a) * b)``, ``a, b = w12(x).chunk(2)`` (``layers/swiglu_ffn.py:30-34``;
    xformers' fused ``SwiGLU`` splits ``w12`` the same way, first half gated)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w12 = nn.Linear(dim, 2 * hidden)
        self.w3 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.w12(x).chunk(2, dim=-1)
        return self.w3(F.silu(a) * b)


class _LayerScale(nn.Module):
    """DINOv2's LayerScale: ``x * gamma`` per channel (``layers/layer_scale.py:34``)."""

    def __init__(self, dim: int):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


class _Block(nn.Module):
    def __init__(self, dim: int, num_heads: int, hidden: int, qkv_bias: bool, eps: float,
                 layer_scale: bool = False, ffn: str = "mlp"):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=eps)
        self.attn = _Attention(dim, num_heads, qkv_bias)
        self.norm2 = nn.LayerNorm(dim, eps=eps)
        self.mlp = _SwiGLU(dim, hidden) if ffn == "swiglu" else _Mlp(dim, hidden)
        # DINO v1 blocks have no LayerScale, and no ls1/ls2 keys: the modules exist only for DINOv2.
        if layer_scale:
            self.ls1 = _LayerScale(dim)
            self.ls2 = _LayerScale(dim)
        self.layer_scale = bool(layer_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.layer_scale:  # dinov2 layers/block.py:89-94,112-113
            x = x + self.ls1(self.attn(self.norm1(x)))
            return x + self.ls2(self.mlp(self.norm2(x)))
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class _PatchEmbed(nn.Module):
    def __init__(self, patch_size: int, in_chans: int, dim: int):
        super().__init__()
        self.patch_size = patch_size
        self.proj = nn.Conv2d(in_chans, dim, kernel_size=patch_size, stride=patch_size)


class DinoViT(nn.Module):
    """DINO's (and DINOv2's) VisionTransformer for inference, state-dict compatible with DINO,
    timm and DINOv2's released ``dinov2_vit*14*_pretrain.pth``.

    Args:
        patch_size: 8 or 16 for the released DINO/STEGO/Leopart models, 14 for DINOv2.
        embed_dim: width D (384 ViT-S, 768 ViT-B, 1024 ViT-L, 1536 DINOv2 ViT-g).
        depth: number of blocks (12 for every released DINO model; DINOv2 L 24, g 40).
        num_heads: attention heads (default: from the width, 64 channels per head).
        mlp_hidden: hidden width of the MLP (default 4 * D, DINO's ``mlp_ratio=4``; with
            ``ffn="swiglu"``: :func:`swiglu_hidden`).
        num_patches: patches of the stored position embedding (196 = (224/16)^2, 784 = (224/8)^2,
            DINOv2's 1369 = (518/14)^2).
        qkv_bias: DINO's and DINOv2's variants use ``qkv_bias=True``.
        in_chans: image channels (3).
        eps: LayerNorm epsilon (1e-6 in DINO's ``vit_small``/``vit_base`` and in DINOv2).
        layer_scale: DINOv2's LayerScale after attention and MLP (keys ``blocks.N.ls{1,2}.gamma``).
        num_register_tokens: DINOv2's registers (4 in the ``_reg`` models; key ``register_tokens``).
        mask_token: hold DINOv2's ``mask_token`` (1, D) parameter (loaded, not used at inference).
        ffn: ``"mlp"`` (fc1-GELU-fc2) or ``"swiglu"`` (DINOv2 ViT-g, keys ``mlp.w12``/``mlp.w3``).
        interpolate_offset: added to the patch grid in the position-embedding scale factor (0.1:
            DINO v1 and the plain DINOv2 models); 0 resizes to the grid size instead (DINOv2 ``_reg``).
        interpolate_antialias: antialias the bicubic position-embedding resize (DINOv2 ``_reg``).

    A model with LayerScale, registers or a mask token is a DINOv2 one (:attr:`is_dinov2`): as
    DINOv2's ``PatchEmbed`` (``layers/patch_embed.py:72-73``) it refuses image sides that are not
    multiples of the patch, where DINO v1's convolution silently drops the remainder.
    """

    def __init__(
        self,
        patch_size: int = 16,
        embed_dim: int = 384,
        depth: int = 12,
        num_heads: Optional[int] = None,
        mlp_hidden: Optional[int] = None,
        num_patches: int = 196,
        qkv_bias: bool = True,
        in_chans: int = 3,
        eps: float = 1e-6,
        *,
        layer_scale: bool = False,
        num_register_tokens: int = 0,
        mask_token: bool = False,
        ffn: str = "mlp",
        interpolate_offset: float = 0.1,
        interpolate_antialias: bool = False,
    ):
        super().__init__()
        side = math.isqrt(num_patches)
        if side * side != num_patches:
            raise ValueError(f"num_patches must be a square (the position grid), got {num_patches}")
        if ffn not in FFN_KINDS:
            raise ValueError(f"ffn must be one of {FFN_KINDS}, got {ffn!r}")
        if isinstance(num_register_tokens, bool) or not isinstance(num_register_tokens, int) or num_register_tokens < 0:
            raise ValueError(f"num_register_tokens must be an integer >= 0, got {num_register_tokens!r}")
        if isinstance(interpolate_offset, bool) or not isinstance(interpolate_offset, (int, float)) \
                or not math.isfinite(interpolate_offset) or interpolate_offset < 0:
            raise ValueError(f"interpolate_offset must be a finite number >= 0, got {interpolate_offset!r}")
        if not isinstance(interpolate_antialias, bool):
            raise TypeError(f"interpolate_antialias must be True or False, got {interpolate_antialias!r}")
        self.patch_size = int(patch_size)
        self.embed_dim = int(embed_dim)
        self.num_heads = int(num_heads) if num_heads is not None else heads_for_width(embed_dim)
        self.layer_scale = bool(layer_scale)
        self.num_register_tokens = int(num_register_tokens)
        self.ffn = ffn
        self.interpolate_offset = float(interpolate_offset)
        self.interpolate_antialias = interpolate_antialias
        self.patch_embed = _PatchEmbed(patch_size, in_chans, embed_dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, num_patches + 1, embed_dim))
        # Registered only when the checkpoint has them, so that strict loading still names them.
        self.register_tokens = (
            nn.Parameter(torch.zeros(1, num_register_tokens, embed_dim)) if num_register_tokens else None
        )
        self.mask_token = nn.Parameter(torch.zeros(1, embed_dim)) if mask_token else None
        if mlp_hidden is not None:
            hidden = int(mlp_hidden)
        else:
            hidden = swiglu_hidden(embed_dim) if ffn == "swiglu" else 4 * embed_dim
        self.blocks = nn.ModuleList(
            _Block(embed_dim, self.num_heads, hidden, qkv_bias, eps, layer_scale, ffn) for _ in range(depth)
        )
        self.norm = nn.LayerNorm(embed_dim, eps=eps)
        self.eval()

    @property
    def is_dinov2(self) -> bool:
        """True for a model with DINOv2's LayerScale, registers or mask token."""
        return self.layer_scale or self.num_register_tokens > 0 or self.mask_token is not None

    @property
    def depth(self) -> int:
        return len(self.blocks)

    def interpolate_pos_encoding(self, num_tokens: int, height: int, width: int) -> torch.Tensor:
        """The (1, 1 + num_tokens, D) position embedding for an image of ``height`` x ``width`` pixels.

        DINO ``vision_transformer.py:174-194`` (identical in STEGO ``src/dino/vision_transformer.py``
        and Leopart ``src/vit.py:183-203``), generalised by DINOv2
        (``models/vision_transformer.py:180-212``). Both unpack ``B, nc, w, h = x.shape``
        (DINO l. 197, DINOv2 l. 215), so their ``w`` is the image *height* and their first scale
        factor acts on rows; with honest names the computation is:

        * unchanged when the token count equals the stored grid's and the image is square;
        * else, with ``offset = interpolate_offset`` > 0 (DINO's fixed +0.1 against
          floating-point error, DINO issue #8; DINOv2's plain models), the stored
          ``sqrt(N) x sqrt(N)`` grid is resized by ``F.interpolate(..., scale_factor=((height //
          patch + offset) / sqrt(N), (width // patch + offset) / sqrt(N)), mode="bicubic")``:
          align_corners False and, because a scale factor is given, PyTorch samples with that
          factor (not the ratio of the sizes);
        * with ``offset == 0`` (DINOv2's ``_reg`` models) it is resized to ``size=(height //
          patch, width // patch)`` instead (DINOv2 l. 195-203);
        * ``antialias=interpolate_antialias`` (off for DINO v1 and the plain DINOv2 models).

        The resize runs in float32 and is cast back to the embedding's dtype (DINOv2 l. 181,186,212).
        """
        pos = self.pos_embed
        n_stored = pos.shape[1] - 1
        if num_tokens == n_stored and height == width:
            return pos
        p = self.patch_size
        gh, gw = height // p, width // p
        side = int(math.sqrt(n_stored))
        grid = rearrange(pos[:, 1:].float(), "1 (gh gw) d -> 1 d gh gw", gh=side, gw=side)
        offset = self.interpolate_offset
        if offset:
            # (gh + 0.1) / side is the same float as DINO v1's (gh + 0.1) / math.sqrt(N): side is exact.
            how: Dict[str, Any] = {"scale_factor": ((gh + offset) / side, (gw + offset) / side)}
        else:
            how = {"size": (gh, gw)}
        grid = F.interpolate(grid, mode="bicubic", antialias=self.interpolate_antialias, **how)
        if grid.shape[-2:] != (gh, gw):  # DINO l. 192 and DINOv2 l. 210 assert the same
            raise RuntimeError(
                f"position-embedding interpolation gave a {tuple(grid.shape[-2:])} grid for a "
                f"{(gh, gw)} patch grid"
            )
        patch_pos = rearrange(grid, "1 d gh gw -> 1 (gh gw) d").to(pos.dtype)
        return torch.cat([pos[:, :1], patch_pos], dim=1)

    def prepare_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) -> (B, 1 + R + h*w, D): patches, [CLS] first, plus position embedding,
        then the R register tokens (DINOv2 ``_reg`` models, none otherwise) right after [CLS]."""
        if x.ndim != 4:
            raise ValueError(f"images must be (B, C, H, W), got shape {tuple(x.shape)}")
        _, _, height, width = x.shape
        if height < self.patch_size or width < self.patch_size:
            raise ValueError(f"images of {height}x{width} pixels are smaller than one {self.patch_size}-pixel patch")
        if self.is_dinov2 and (height % self.patch_size or width % self.patch_size):
            raise ValueError(f"DINOv2 needs image sides that are multiples of the patch {self.patch_size}, "
                             f"got {height}x{width} (dinov2 layers/patch_embed.py:72-73 asserts the same)")
        t = rearrange(self.patch_embed.proj(x), "b d h w -> b (h w) d")
        t = torch.cat([self.cls_token.expand(t.shape[0], -1, -1).to(t.dtype), t], dim=1)
        t = t + self.interpolate_pos_encoding(t.shape[1] - 1, height, width).to(t.dtype)
        if self.register_tokens is not None:  # after the position embedding: registers get none
            regs = self.register_tokens.expand(t.shape[0], -1, -1).to(t.dtype)
            t = torch.cat([t[:, :1], regs, t[:, 1:]], dim=1)
        return t

    def forward_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """(B, 1 + R + N, D) tokens after the final LayerNorm: [CLS], the R registers (DINOv2
        ``_reg`` models only), then the patches row by row.

        Equals DINO's ``get_intermediate_layers(x, n=1)[0]`` (l. 225-233), STEGO's
        ``get_intermediate_feat(x, n=1)[0][0]``, Leopart's ``forward_backbone(x)`` and DINOv2's
        ``self.norm`` of its last block's output (``models/vision_transformer.py:273-283,311-312``).
        """
        t = self.prepare_tokens(x)
        for blk in self.blocks:
            t = blk(t)
        return self.norm(t)

    def patch_token_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """(B, h*w, D): the normed last-block patch tokens, row by row, [CLS] and registers dropped.

        DINOv2's ``get_intermediate_layers(x, n=1)[0]`` with ``norm=True``
        (``models/vision_transformer.py:311-314``), what DHR's ``DINOv2`` and ``CAUSE`` read.
        """
        return self.forward_tokens(x)[:, 1 + self.num_register_tokens:]

    def patch_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """(B, D, H // patch, W // patch): the normed patch tokens as a feature map.

        STEGO's ``image_feat`` for ``dino_feat_type="feat"`` (``src/modules.py:93-97``); DINOv2's
        ``get_intermediate_layers(x, n=1, reshape=True)[0]`` (l. 315-320), DHR's ``DINOv2.forward``.
        """
        h, w = x.shape[-2] // self.patch_size, x.shape[-1] // self.patch_size
        return rearrange(self.patch_token_sequence(x), "b (h w) d -> b d h w", h=h, w=w)

    forward = patch_tokens

    def extra_repr(self) -> str:
        return describe_vit(self)


def describe_vit(vit: DinoViT) -> str:
    """'ViT-S/8 (12 blocks, width 384, 6 heads)', 'DINOv2 ViT-B/14 with 4 registers (12 blocks, ...)'."""
    name = {192: "Ti", 384: "S", 768: "B", 1024: "L", 1536: "g"}.get(vit.embed_dim, f"{vit.embed_dim}")
    s = f"ViT-{name}/{vit.patch_size}"
    if vit.is_dinov2:
        s = f"DINOv2 {s}"
        if vit.num_register_tokens:
            s += f" with {vit.num_register_tokens} register{'s' if vit.num_register_tokens > 1 else ''}"
    if vit.ffn == "swiglu":
        s += ", SwiGLU MLP"
    return s + f" ({vit.depth} blocks, width {vit.embed_dim}, {vit.num_heads} heads)"
