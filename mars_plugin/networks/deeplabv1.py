"""DeepLabv1 on the wide ResNet-38: the SEAM row's network, and how SEAM's segmentation codebase
trains it and infers with it.

Read from YudeWang/semantic-segmentation-codebase at a40f6c6 (``experiment/seamv1-pseudovoc``:
config.py, train.py, test.py; lib/net/deeplabv1.py; lib/utils/DenseCRF.py, imutils.py). Module
and parameter names are upstream's (``backbone.*``, ``conv_fov``, ``bn_fov``, ``conv_fov2``,
``bn_fov2``, ``cls_conv``): the key map is the identity.

Network (:class:`DeepLabV1WR38`, deeplabv1.py:13-54): the WR38 backbone
(:mod:`mars_plugin.networks.wide_resnet38`) -> its last output (4096 channels, stride 8) ->
``conv_fov`` 3x3, 512, padding = dilation = 12, no bias -> ``bn_fov`` (momentum
``TRAIN_BN_MOM`` = 0.0003, config.py:38) -> ReLU -> ``conv_fov2`` 1x1, 512, no bias -> ``bn_fov2``
-> ReLU -> ``dropout1`` (``nn.Dropout(0.5)``) -> ``cls_conv`` 1x1 to C + 1 **with a bias** ->
bilinear up-sampling to the input's size with ``align_corners=True``. Init (``__initial__``):
the three head convs' weights ``kaiming_normal_(mode='fan_out', nonlinearity='relu')``, the
head BNs weight 1 bias 0; ``cls_conv``'s bias keeps PyTorch's default init; the backbone keeps
PyTorch's defaults until :func:`~mars_plugin.networks.wide_resnet38.load_wr38_weights`.

Training (train.py), the pieces ``mars train`` calls:

* :func:`seam_param_groups` (deeplabv1.py:56-72, train.py:70-80): only ``nn.Conv2d``
  parameters are optimised, BN weights and biases never (they stay at the ImageNet values and
  1 / 0 in the head); four SGD groups lr x1 / x2 / x10 / x20, weight decay 5e-4 / 0 / 5e-4 / 0,
  the x10 / x20 ones being ``conv_fov``, ``conv_fov2``, ``cls_conv``; momentum 0.9, no Nesterov.
* :func:`seam_poly_lr` (train.py:90, 138-144): ``lr (1 - itr / (max_itr + 1)) ** 0.9`` set
  before every step, itr from 0, ``max_itr`` = ``TRAIN_ITERATION`` = 20000; batch 10
  (``TRAIN_BATCHES``), ``drop_last``.
* :func:`seam_train_mode`: the state train.py trains in. It never calls ``net.train()``, so
  WR38's ``train`` override (frozen BN, frozen ``conv1a``) never runs: every BN normalises with
  the batch's statistics and updates its running ones with momentum 0.0003, the three dropouts
  are active, and ``conv1a`` is trained (in the x1 group). Call this instead of ``.train()``.
  (Upstream runs ``nn.DataParallel`` on 2 GPUs with plain ``nn.BatchNorm2d``: each BN sees 5
  of the 10 images; one process with the batch of 10 sees 10.)
* :func:`seam_replicas_forward`: the batch of 10 as upstream's 2-GPU ``nn.DataParallel`` runs
  it, each BatchNorm on 5 images (the recipe's ``bn_batch``).
* :func:`seam_loss` (train.py:85, 96-97): ``nn.CrossEntropyLoss(ignore_index=255)``, mean over
  the labelled pixels, on the logits at the crop's size (the network up-samples them).

Inference (test.py): :func:`seam_multiscale_logits` and :func:`seam_crf_image`; see their
docstrings for how they differ from :func:`mars_plugin.networks.inference.multiscale_probs`.
"""
from __future__ import annotations

from typing import Any, Dict, List, Sequence

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from mars_plugin._checks import check_num_classes, check_real_param, describe
from mars_plugin.networks.wide_resnet38 import WideResNet38

__all__ = ["ARCH", "BACKBONE", "DeepLabV1WR38", "build_deeplabv1_wr38", "seam_param_groups", "seam_poly_lr",
           "seam_train_mode", "seam_loss", "TEST_SCALES", "seam_scaled_inputs", "seam_multiscale_logits",
           "seam_crf_image", "seam_replicas_forward", "seam_multiscale_probs", "seam_crf_bytes", "SEAM_CRF", "SEAM_MEAN",
           "SEAM_STD"]

ARCH = "deeplabv1-wr38"
BACKBONE = "wr38"
#: ``TRAIN_BN_MOM`` (config.py:38), the head BNs' momentum.
TRAIN_BN_MOM = 0.0003
#: ``TEST_MULTISCALE`` (config.py:46); ``TEST_FLIP`` True (:47).
TEST_SCALES = (0.5, 0.75, 1.0, 1.25, 1.5, 1.75)
#: ``DATA_MEAN``, ``DATA_STD`` (config.py:19-20), RGB in [0, 1].
SEAM_MEAN = (0.485, 0.456, 0.406)
SEAM_STD = (0.229, 0.224, 0.225)
#: test.py:94 ``dense_crf(prob, img, n_classes=21, n_iters=1)`` with DenseCRF.py:20-22: one
#: mean-field iteration, Gaussian sxy 3 compat 3, bilateral sxy 32 srgb 13 compat 10, over every
#: class (no class threshold), unary ``-log`` of the clipped softmax (``unary_from_softmax``).
SEAM_CRF = {"iterations": 1, "gaussian_sxy": 3, "gaussian_compat": 3, "bilateral_sxy": 32,
            "bilateral_srgb": 13, "bilateral_compat": 10}


class DeepLabV1WR38(nn.Module):
    """Upstream's ``deeplabv1`` with ``MODEL_BACKBONE='resnet38'``: x (B, 3, H, W) normalised
    RGB -> logits (B, C + 1, H, W), background first (see the module docstring).

    Args:
        num_classes: C foreground classes (upstream's ``MODEL_NUM_CLASSES`` is C + 1 = 21).
        width_div: divides the backbone's channels (a test extension; 1 is upstream's); the
            head's 512 channels are divided too.
    """

    arch = ARCH

    def __init__(self, num_classes: int, width_div: int = 1) -> None:
        super().__init__()
        self.num_classes = check_num_classes(num_classes)
        # construction order is upstream's (backbone, conv_fov, bn_fov, conv_fov2, bn_fov2,
        # dropout1, cls_conv), so the same seed draws the same random weights
        self.backbone = WideResNet38(width_div)
        mid = 512 // width_div
        self.conv_fov = nn.Conv2d(self.backbone.channels, mid, 3, 1, padding=12, dilation=12, bias=False)
        self.bn_fov = nn.BatchNorm2d(mid, momentum=TRAIN_BN_MOM, affine=True)
        self.conv_fov2 = nn.Conv2d(mid, mid, 1, 1, padding=0, bias=False)
        self.bn_fov2 = nn.BatchNorm2d(mid, momentum=TRAIN_BN_MOM, affine=True)
        self.dropout1 = nn.Dropout(0.5)
        self.cls_conv = nn.Conv2d(mid, self.num_classes + 1, 1, 1, padding=0)
        for m in (self.conv_fov, self.bn_fov, self.conv_fov2, self.bn_fov2, self.cls_conv):  # modules() order
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            else:
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)

    @property
    def from_scratch_layers(self) -> List[nn.Conv2d]:
        """The layers of the x10 / x20 groups (deeplabv1.py:30)."""
        return [self.conv_fov, self.conv_fov2, self.cls_conv]

    @property
    def config(self) -> Dict[str, Any]:
        """The arguments of :func:`mars_plugin.networks.deeplab.build_model` that rebuild it."""
        return {"arch": ARCH, "backbone": BACKBONE, "output_stride": 8, "num_classes": self.num_classes}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits (B, num_classes + 1, H, W) for images x (B, 3, H, W)."""
        if not isinstance(x, torch.Tensor) or x.ndim != 4 or x.shape[1] != 3 or not x.is_floating_point():
            raise ValueError(f"x must be a float tensor (B, 3, H, W) of normalized RGB images, got {describe(x)}")
        h, w = x.shape[-2:]
        f = F.relu(self.bn_fov(self.conv_fov(self.backbone(x)[-1])))
        f = self.dropout1(F.relu(self.bn_fov2(self.conv_fov2(f))))
        return F.interpolate(self.cls_conv(f), (h, w), mode="bilinear", align_corners=True)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.config.items())


def build_deeplabv1_wr38(backbone: str, num_classes: int, output_stride: Any = None) -> DeepLabV1WR38:
    """:func:`mars_plugin.networks.deeplab.build_model` for ``arch="deeplabv1-wr38"``: backbone
    ``"wr38"`` only, output stride 8 (fixed by the network; None means 8)."""
    if backbone != BACKBONE:
        raise ValueError(f"backbone must be 'wr38' for arch 'deeplabv1-wr38', got {backbone!r}")
    if output_stride is not None and (isinstance(output_stride, bool) or output_stride != 8):
        raise ValueError(f"output_stride must be 8 for arch 'deeplabv1-wr38' (WR38's fixed stride), "
                         f"got {output_stride!r}")
    return DeepLabV1WR38(num_classes)


def _unwrap(model: Any) -> nn.Module:
    while isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    return model


#: name, lr multiplier, weight decay? (train.py:73-76)
_GROUPS = (("backbone_weight", 1.0, True), ("backbone_bias", 2.0, False),
           ("head_weight", 10.0, True), ("head_bias", 20.0, False))


def seam_param_groups(model: nn.Module, lr: float, weight_decay: float) -> List[Dict[str, Any]]:
    """SGD groups of train.py:70-80 from ``get_parameter_groups`` (deeplabv1.py:56-72).

    Every ``nn.Conv2d`` whose parameter requires grad, in ``modules()`` order: weights of
    ``conv_fov``, ``conv_fov2``, ``cls_conv`` -> ``head_weight`` (10 lr, decayed), their bias
    (``cls_conv``'s) -> ``head_bias`` (20 lr, no decay); every other conv weight ->
    ``backbone_weight`` (lr, decayed), bias -> ``backbone_bias`` (2 lr, no decay; WR38's convs
    have none, so this group is empty and left out). BatchNorm parameters are in no group.
    Each group carries ``name`` and ``lr_mult`` like :func:`mars_plugin.networks.deeplab.param_groups`.
    """
    lr = check_real_param(lr, "lr", 0.0, float("inf"), low_open=True)
    weight_decay = check_real_param(weight_decay, "weight_decay", 0.0, float("inf"))
    net = _unwrap(model)
    if not isinstance(net, DeepLabV1WR38):
        raise TypeError(f"model must be a deeplabv1-wr38 network, got {describe(net)}")
    scratch = [id(m) for m in net.from_scratch_layers]
    buckets: Dict[str, List[nn.Parameter]] = {g[0]: [] for g in _GROUPS}
    for m in net.modules():
        if not isinstance(m, nn.Conv2d):
            continue
        part = "head" if id(m) in scratch else "backbone"
        if m.weight.requires_grad:
            buckets[f"{part}_weight"].append(m.weight)
        if m.bias is not None and m.bias.requires_grad:
            buckets[f"{part}_bias"].append(m.bias)
    return [{"params": buckets[n], "name": n, "lr_mult": mult, "lr": lr * mult,
             "weight_decay": weight_decay if decay else 0.0}
            for n, mult, decay in _GROUPS if buckets[n]]


def seam_poly_lr(base: float, iteration: int, max_iterations: int, power: float = 0.9) -> float:
    """train.py:138-139 ``adjust_lr``: ``base * (1 - iteration / (max_iterations + 1)) ** power``,
    set before step ``iteration`` (0-based); note the ``+ 1`` (the last step's lr is not 0)."""
    return base * (1.0 - iteration / (max_iterations + 1)) ** power


def seam_train_mode(model: nn.Module) -> nn.Module:
    """Put the network in the state train.py trains it in: every module in training mode (BN on
    batch statistics, dropout on) and nothing frozen, as after construction (train.py never
    calls ``train()``, so WR38's override does not run). Returns ``model``."""
    for m in model.modules():
        m.training = True
    net = _unwrap(model)
    if isinstance(net, DeepLabV1WR38):
        # undo what WR38's train() override may have frozen; train.py's network has it all trainable
        net.backbone.conv1a.weight.requires_grad_(True)
        for m in net.backbone.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.requires_grad_(True)
                m.bias.requires_grad_(True)
    return model


def seam_replicas_forward(model: nn.Module, x: torch.Tensor, bn_batch: int) -> torch.Tensor:
    """train.py's forward through ``nn.DataParallel`` (config.py ``GPUS`` 2, train.py:64), on one
    device: x (B, 3, H, W) is split as DataParallel scatters it (``x.chunk(ceil(B / bn_batch))``:
    10 -> 5 + 5), each part goes through ``model`` on its own (every BatchNorm normalises with
    its part's statistics), and the logits are concatenated in order. As DataParallel keeps
    only the first replica's buffers (it shares them with the module; the others' copies are
    dropped), only the first part updates the running statistics: the others run with momentum
    0 (the statistics unchanged) and ``num_batches_tracked`` put back. B <= ``bn_batch``: one
    call of ``model``."""
    n = -(-int(x.shape[0]) // int(bn_batch))
    if n <= 1:
        return model(x)
    parts = x.chunk(n)
    outs = [model(parts[0])]
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training
           and m.track_running_stats]
    saved = [(m.momentum, m.num_batches_tracked.clone()) for m in bns]
    try:
        for m in bns:
            m.momentum = 0.0  # running = 1 * running + 0 * batch: unchanged, without touching what autograd saved
        outs += [model(p) for p in parts[1:]]
    finally:
        with torch.no_grad():
            for m, (momentum, count) in zip(bns, saved):
                m.momentum = momentum
                m.num_batches_tracked.copy_(count)
    return torch.cat(outs)


def seam_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """train.py:85,97: cross-entropy of logits (B, C + 1, H, W) at the crop's size against
    labels (B, H, W) long, 255 ignored, mean over the other pixels."""
    return F.cross_entropy(logits, labels, ignore_index=255)


def seam_scaled_inputs(normalized: np.ndarray, scales: Sequence[float] = TEST_SCALES) -> List[torch.Tensor]:
    """test.py's inputs of one image (transform.py:170-181 ``Multiscale``): the normalised
    float32 image (H, W, 3) resized by each scale with OpenCV's bicubic (size ``round(W s) x
    round(H s)``, float32, unrounded; :func:`mars_plugin.networks.seam_data.cv_resize`) ->
    (1, 3, h_s, w_s) float32 tensors, in the order of ``scales``."""
    from mars_plugin.networks.seam_data import cv_resize

    if not (isinstance(normalized, np.ndarray) and normalized.dtype == np.float32 and normalized.ndim == 3
            and normalized.shape[2] == 3):
        raise ValueError(f"normalized must be a float32 array (H, W, 3), got {describe(normalized)}")
    return [torch.from_numpy(np.ascontiguousarray(cv_resize(normalized, float(s), "cubic").transpose(2, 0, 1)))[None]
            for s in scales]


@torch.no_grad()
def seam_multiscale_logits(model: nn.Module, scaled: Sequence[torch.Tensor], size: Sequence[int],
                           flip: bool = True) -> torch.Tensor:
    """test.py:67-88: the class probabilities (C + 1, H, W) of one image.

    ``scaled``: the normalised image at each scale of :data:`TEST_SCALES`, (1, 3, h_s, w_s)
    each (:func:`seam_scaled_inputs`; upstream: ``cv2.resize(image, None, fx=s, fy=s,
    INTER_CUBIC)`` on the **normalised float32** image, transform.py:170-181). Each goes
    through the network, and with ``flip`` its mirror too; every output is resized to ``size``
    (H, W) bilinearly with ``align_corners=True``, the mirrors flipped back; the **logits are
    averaged** over the 2 x scales maps, then one softmax.

    Differences from :func:`mars_plugin.networks.inference.multiscale_probs`: that one averages
    softmax probabilities (here logits, softmax after), resizes with ``align_corners=False``
    (here True), resizes the input bilinearly from the normalised tensor with the size truncated
    (here bicubic, rounded, done by the caller), and uses the scales 1, 0.5, 1.5, 2.
    """
    h, w = int(size[0]), int(size[1])
    outs = []
    for x in scaled:
        for flipped in ((False, True) if flip else (False,)):
            y = model(torch.flip(x, [3]) if flipped else x)
            y = F.interpolate(y, (h, w), mode="bilinear", align_corners=True)
            outs.append(torch.flip(y, [3]) if flipped else y)
    return F.softmax(torch.cat(outs, 0).mean(0, keepdim=True), dim=1)[0]


def seam_crf_image(normalized: torch.Tensor) -> np.ndarray:
    """The bytes the CRF sees (test.py:93, imutils.py:36-53 ``img_denorm``): the normalised
    float32 image (3, H, W) -> ``(x * std + mean) * 255`` in float32, clipped to [0, 255],
    **truncated** to uint8; returned (H, W, 3). Some bytes are one below the file's."""
    x = normalized.detach().cpu().numpy().astype(np.float32, copy=True)
    if x.ndim != 3 or x.shape[0] != 3:
        raise ValueError(f"normalized must be (3, H, W), got {describe(normalized)}")
    for c in range(3):
        x[c] = x[c] * np.float32(SEAM_STD[c]) + np.float32(SEAM_MEAN[c])
    x = x * np.float32(255)
    x = np.clip(x, 0, 255).astype(np.uint8)
    return np.ascontiguousarray(x.transpose(1, 2, 0))


def seam_multiscale_probs(model: nn.Module, images: torch.Tensor, scales: Sequence[float] = TEST_SCALES,
                          flip: bool = True, *, fp16: bool = False) -> torch.Tensor:
    """``mars predict``'s fusion for SEAM's network (``fuse_at="seam"``), with the interface of
    :func:`mars_plugin.networks.inference.multiscale_probs`: (B, 3, H, W) normalised images ->
    (B, C + 1, H, W) float32 probabilities, each image on its own as test.py runs it
    (:func:`seam_scaled_inputs` of its float32 (H, W, 3) array, then :func:`seam_multiscale_logits`).
    ``fp16``: the network under autocast (bfloat16; not upstream's), its logits taken in float32."""
    from mars_plugin.networks.inference import check_finite_probs, half_dtype

    if not isinstance(images, torch.Tensor) or images.ndim != 4 or images.shape[1] != 3 or \
            not images.is_floating_point():
        raise ValueError(f"images must be a float (B, 3, H, W) tensor of normalised images, got {describe(images)}")
    dev = images.device

    def net(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(dev.type, dtype=half_dtype(dev), enabled=bool(fp16)):
            return model(x).float()

    out = []
    for img in images:
        arr = img.detach().float().permute(1, 2, 0).cpu().numpy()
        scaled = [x.to(dev) for x in seam_scaled_inputs(np.ascontiguousarray(arr), scales)]
        out.append(seam_multiscale_logits(net, scaled, img.shape[-2:], flip))
    probs = torch.stack(out)
    check_finite_probs(probs, half_dtype(dev), fp16)
    return probs


def seam_crf_bytes(images: torch.Tensor) -> torch.Tensor:
    """:func:`seam_crf_image` of each of (B, 3, H, W) normalised images -> (B, H, W, 3) uint8 on
    their device: the bytes test.py's CRF sees (``crf_image="denormalized"`` for SEAM's network)."""
    return torch.stack([torch.from_numpy(seam_crf_image(x)) for x in images]).to(images.device)
