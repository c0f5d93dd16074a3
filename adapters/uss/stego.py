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

DHR's STEGO (shjo-april/DHR @ 94d5189, the MARS authors' follow-up) is the same network stored
in two files, read by :meth:`STEGOExtractor.from_files`:

* the backbone is DINO's release file ``dino_vitbase8_pretrain.pth``, a flat state dict with
  DINO's keys loaded strictly into ``vit_base(8, num_classes=0)`` (``core/uss/models.py:11-14``),
  so it holds exactly the backbone's keys;
* the heads file ``weights/STEGO_<dataset>.pt`` is ``{'cluster1': ..., 'cluster2': ...}``, the
  state dicts of ``Sequential(Conv2d(768, 70, 1))`` and ``Sequential(Conv2d(768, 768, 1), ReLU,
  Conv2d(768, 70, 1))`` (``core/uss/models.py:48-53,62-66``, ``dim=70`` l. 40), each loaded with
  ``load_state_dict``'s default ``strict=True``; other top-level keys are not read;
* ``forward`` = ``cluster1(feat) + cluster2(feat)`` on the last block's normed patch tokens
  (``core/uss/models.py:28-37,68-72``; ``get_intermediate_feat(image)[0][0][:, 1:]``), i.e.
  :meth:`STEGOExtractor.code`;
* DHR's features come from :func:`~mars_plugin.adapters.uss.multiscale.multiscale` on the
  full-resolution image, not L2-normalised: ``from_files(b, h, **DHR_SETTINGS)``.
"""
from __future__ import annotations

import os
from typing import Mapping, Optional, Sequence, Union

import torch
import torch.nn as nn

from mars_plugin.adapters.uss.code_extractor import CodeExtractor, load_tensor_file, stego_input_size, what_is
from mars_plugin.adapters.uss.multiscale import DHR_SETTINGS
from mars_plugin.adapters.uss.vit import DinoViT, describe_vit
from mars_plugin.adapters.uss.vit_weights import (
    load_checkpoint,
    select_prefix,
    state_dict_of,
    vit_from_state_dict,
)

__all__ = ["STEGOExtractor", "stego_input_size", "DHR_SETTINGS"]

PathLike = Union[str, os.PathLike]


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


class STEGOExtractor(CodeExtractor):
    """STEGO's code for whole images: (B, 3, H, W) -> (B, dim, h, w).

    The submodules carry STEGO's own names (``model``, ``cluster1``, ``cluster2``), so
    ``state_dict()`` has exactly the checkpoint's ``net.*`` keys.

    Args:
        model: the DINO ViT backbone.
        cluster1: ``Sequential(Conv2d(D, dim, 1))``, STEGO's linear projection.
        cluster2: ``Sequential(Conv2d(D, D, 1), ReLU, Conv2d(D, dim, 1))`` or None (a model trained
            with ``projection_type: linear``).
        res: shorter image side fed to the network (320, STEGO's evaluation); None: the image's
            own resolution (each side rounded to the nearest patch multiple; with ``scales``, the
            image exactly as it is, as DHR feeds it).
        flip_average: average the code of the image and of its horizontal flip, flipped back
            (STEGO's evaluation, default; DHR's ``hflip=True``).
        normalize: L2-normalise each pixel's code after the final resize (default; STEGO's
            cluster probe does the same; DHR does not).
        interpolation: ``"nearest"`` (STEGO's ``T.Resize(res, Image.NEAREST)``) or ``"bilinear"``;
            the resize to ``res`` only (the scales are always bilinear, as DHR's).
        scales: None (one scale, the behaviour above) or DHR's multi-scale inference
            (:func:`~mars_plugin.adapters.uss.multiscale.multiscale`) at these scales of the base
            image (the ``res``-resized one, or the image itself when ``res=None``); the first
            scale sets the output grid. ``DHR_SCALES`` = (2.0, 1.0, 1.5, 0.5).

    ``STEGOExtractor.from_files(backbone, heads, **DHR_SETTINGS)`` reproduces DHR's features.
    """

    def __init__(
        self,
        model: DinoViT,
        cluster1: nn.Module,
        cluster2: Optional[nn.Module] = None,
        *,
        res: Optional[int] = 320,
        flip_average: bool = True,
        normalize: bool = True,
        interpolation: str = "nearest",
        scales: Optional[Sequence[float]] = None,
    ):
        super().__init__()
        self._set_inputs(model.patch_size, res=res, flip_average=flip_average, normalize=normalize,
                         interpolation=interpolation, scales=scales)
        self.model = model
        self.cluster1 = cluster1
        self.cluster2 = cluster2
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
        they need ``trust_pickle=True`` (see :func:`mars_plugin.adapters.uss.vit_weights.load_checkpoint`);
        omegaconf need not be installed. Keyword arguments go to the constructor.
        """
        obj = load_checkpoint(path, trust_pickle=trust_pickle, what="STEGO checkpoint")
        sd = state_dict_of(obj, path, "STEGO checkpoint")
        return cls.from_state_dict(sd, what=f"{os.fspath(path)}", **kwargs)

    @classmethod
    def from_files(cls, backbone: PathLike, heads: PathLike, **kwargs) -> "STEGOExtractor":
        """DHR's STEGO from its two files: DINO's ``dino_vitbase8_pretrain.pth`` and ``STEGO_<dataset>.pt``.

        ``backbone``: a flat state dict with DINO's keys, loaded strictly as DHR does
        (``core/uss/models.py:11-14``, ``strict=True``): a missing or unexpected key, or a shape
        mismatch, is a ValueError naming the key and the file. The variant (ViT-B/8 for DHR) is
        read from the shapes. ``heads``: ``{'cluster1': {'0.weight', '0.bias'}, 'cluster2':
        {'0.weight', '0.bias', '2.weight', '2.bias'}}`` (``core/uss/models.py:48-53``), checked
        key by key and shape by shape (1x1 convolutions, ``cluster1`` and ``cluster2`` taking the
        backbone's width, ``cluster2``'s hidden width equal to it, both giving the same dim).
        Other top-level keys of the heads file are not read, as in DHR.

        Both files are opened with ``torch.load(map_location="cpu", weights_only=True)`` only:
        DHR's files are plain state dicts, so a file holding pickled Python objects is refused
        with a PermissionError and never unpickled (there is no trust option here). Keyword
        arguments go to the constructor; ``**DHR_SETTINGS`` gives DHR's inference.
        """
        bsd = load_tensor_file(backbone, "DINO backbone file")
        if not isinstance(bsd, Mapping) or not all(isinstance(k, str) for k in bsd):
            raise ValueError(f"{os.fspath(backbone)}: the DINO backbone file must hold a flat state dict (DINO's "
                             f"dino_vitbase8_pretrain.pth), got {what_is(bsd)}")
        not_tensors = sorted(k for k, v in bsd.items() if not isinstance(v, torch.Tensor))
        if not_tensors:
            raise ValueError(f"{os.fspath(backbone)}: the DINO backbone file must map names to tensors; "
                             f"{not_tensors[:5]} are not tensors (a training checkpoint? DHR loads the released "
                             f"backbone weights alone, strictly)")
        model = vit_from_state_dict(bsd, what=f"{os.fspath(backbone)} (DINO backbone)")
        hobj = load_tensor_file(heads, "STEGO heads file")
        hname = os.fspath(heads)
        if not isinstance(hobj, Mapping):
            raise ValueError(f"{hname}: the STEGO heads file must be a dict with 'cluster1' and 'cluster2', got "
                             f"{what_is(hobj)}")
        missing = [k for k in ("cluster1", "cluster2") if k not in hobj]
        if missing:
            raise ValueError(f"{hname}: the STEGO heads file has no key(s) {missing} (keys: {sorted(map(str, hobj))[:8]}); "
                             f"DHR's STEGO_<dataset>.pt holds 'cluster1' and 'cluster2' (core/uss/models.py:51-53)")
        parts = {}
        for name, layers in (("cluster1", ("0",)), ("cluster2", ("0", "2"))):
            sd = hobj[name]
            what = f"{hname} ['{name}']"
            if not isinstance(sd, Mapping):
                raise ValueError(f"{what}: must be a state dict, got {what_is(sd)}")
            want = {f"{i}.{t}" for i in layers for t in ("weight", "bias")}
            unexpected = sorted(set(map(str, sd)) - want)
            if unexpected:
                raise ValueError(f"{what}: unexpected key(s) {unexpected}; expected {sorted(want)}")
            for k, v in sd.items():
                if not isinstance(v, torch.Tensor):
                    raise ValueError(f"{what}: {k!r} is a {type(v).__name__}, not a tensor")
            parts[name] = [_conv(sd, i, what) for i in layers]
        width = model.embed_dim
        (c1,), (a, b) = parts["cluster1"], parts["cluster2"]
        if c1.in_channels != width:
            raise ValueError(f"{hname} ['cluster1']: 0.weight takes {c1.in_channels} channels but the backbone in "
                             f"{os.fspath(backbone)} is {width} wide")
        if (a.in_channels, a.out_channels, b.in_channels, b.out_channels) != (width, width, width, c1.out_channels):
            raise ValueError(
                f"{hname} ['cluster2']: Conv2d {a.in_channels}->{a.out_channels}, ReLU, Conv2d "
                f"{b.in_channels}->{b.out_channels}; expected {width}->{width}, ReLU, {width}->{c1.out_channels} "
                f"(backbone width {width}, cluster1 dim {c1.out_channels})"
            )
        return cls(model, nn.Sequential(c1), nn.Sequential(a, nn.ReLU(), b), **kwargs)

    # -- properties ------------------------------------------------------------------------

    @property
    def dim(self) -> int:
        return int(self.cluster1[0].out_channels)

    @property
    def patch_size(self) -> int:
        return self.model.patch_size

    def describe(self) -> str:
        proj = "nonlinear" if self.cluster2 is not None else "linear"
        return f"STEGO on DINO {describe_vit(self.model)}, {proj} projection to dim {self.dim}; {self.settings_text()}"

    # -- computation -----------------------------------------------------------------------

    def code(self, x: torch.Tensor) -> torch.Tensor:
        """STEGO's code of already normalised images whose sides are multiples of the patch:
        ``cluster1(feat) + cluster2(feat)`` (``src/modules.py:108-111``, dropout off)."""
        self._check_patch_multiple(x)
        feat = self.model.patch_tokens(x)
        out = self.cluster1(feat)
        if self.cluster2 is not None:
            out = out + self.cluster2(feat)
        return out
