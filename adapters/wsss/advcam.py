"""AdvCAM adapter (Lee et al., CVPR 2021; github.com/jbeomlee93/AdvCAM, read at commit 2650fcd),
with its segmentation stage, DeepLab-v2 of github.com/kazuto1011/deeplab-pytorch (commit 4219467).

AdvCAM is built on IRNet's code and keeps its formats (file:line at those commits):

* ``result/cam_adv_mask/<id>.npy`` (``--cam_out_dir``, obtain_CAM_masking.py:47 and
  run_sample.py:68), written by obtain_CAM_masking.py:159-160 in IRNet's format: a **pickled
  dict** ``{"keys": valid_cat (torch int64, 0-based foreground ids, :128), "cam": (K, ceil(H/4),
  ceil(W/4)) torch float, "high_res": (K, H, W) numpy float32}``, both max-normalised
  (:156-157). :func:`load_cams` with ``trust_pickle=True``.
* ``result/ir_label/<id>.png`` (step/cam_to_ir_label.py:56-57, ``imageio.imwrite`` of uint8:
  grayscale 0..20 + 255) from the same rule as IRNet (:29-51) but with AdvCAM's thresholds
  ``conf_fg_thres`` **0.35** and ``conf_bg_thres`` **0.15** (run_sample.py:45-46, not IRNet's
  0.30/0.05); :func:`cams_to_label`.
* ``result/sem_seg/<id>.png`` (step/make_sem_seg_labels.py:62, grayscale 0..20): the random walk
  on ``cam ** 1.5`` (:42) with ``sem_seg_bg_thres`` 0.25 (run_sample.py:62); not reproduced
  here. With ``get_mask_quality.sh`` (``--infer_list`` default voc12/train_aug.txt,
  run_sample.py:28) these are the pseudo labels DeepLab is trained on.
* Every label folder also holds ``<id>_palette.png`` colour copies (P mode, 'palette' of
  cam_to_ir_label.py:14-17; written at :53-55 and make_sem_seg_labels.py:59-61):
  :func:`load_pseudo_labels` skips them.
* ``voc12/cls_labels.npy`` (byte-identical to IRNet's) and ``voc12/train_aug.txt``:
  :func:`load_image_labels`, :func:`load_image_list`.

deeplab-pytorch reads training labels in ``VOCAug._load_data`` (libs/datasets/voc.py:78-86):
the label path is the second field of ``ImageSets/SegmentationAug/train_aug.txt`` under the VOC
root (:72-74, :82) and the file is read with ``np.asarray(Image.open(label_path),
dtype=np.int32)`` (:85), which returns the stored bytes for a grayscale or a palette PNG alike;
augmentation resizes it with PIL NEAREST (libs/datasets/base.py:71) and pads with
``ignore_label`` 255 (:87), so 254 survives. We write **'L'**, as AdvCAM writes its ``<id>.png``.

Recipe::

    from mars_plugin import select_centroids, debias_labels
    from mars_plugin.adapters.wsss import advcam
    # 1. centroids from AdvCAM's pseudo labels and your USS features (D, h, w) per id
    labels = dict(advcam.load_pseudo_labels("result/sem_seg"))          # skips *_palette.png
    V = select_centroids(((features[i], y) for i, y in labels.items()), num_classes=advcam.NUM_CLASSES)
    # 2. debias, write next to SegmentationClassAug
    classes = advcam.load_image_labels("voc12/cls_labels.npy", trust_pickle=True)
    advcam.write_debiased(((i, debias_labels(features[i], y, V, classes[i], image=rgb[i]))
                           for i, y in labels.items()), "<VOC2012>/SegmentationClassAug_MARS")
    # 3. deeplab-pytorch: in ImageSets/SegmentationAug/train_aug.txt, second field
    #    /SegmentationClassAug/<id>.png -> /SegmentationClassAug_MARS/<id>.png, then the main.py
    #    edits of docs/adapters.md, "AdvCAM + kazuto1011/deeplab-pytorch" (checked at 4219467):
    #    L157-158 (criterion and criterion.to(device)) -> hook = MARSTrainingHook(model,
    #    refine="crf", match="logits"), the classes and the BGR mean; L222/L225 keep the ids;
    #    L231-236 -> the RGB uint8 batch (mean added back, BGR -> RGB) and iter_loss = hook(...,
    #    images_rgb=rgb); after L247 hook.update(model); the teacher saved as checkpoint_<n>_mars.pth
    #    beside each checkpoint_<n>.pth and loaded when MARS_RESUME names one.
    #    tests/test_recipes.py applies exactly those lines to a loop of main.py's shape and runs it.

``MARSTrainingHook`` (``from mars_plugin.adapters import MARSTrainingHook``) sums the MARS loss
over every logit map of MSC's training output: ``[logits] + logits_pyramid + [logits_max]``
(libs/models/msc.py:45) with the pyramid in the order of its scales [0.5, 0.75]
(libs/models/__init__.py:38), i.e. [1x, 0.5x, 0.75x, max], as deeplab-pytorch sums its CE over
them; its EMA teacher runs in eval mode, where MSC returns the max map alone (msc.py:46-47).
DeepLab-v2 predicts at stride 8, so the CRF teacher takes ``match="logits"``: the logits are
upsampled to the labels and the CRF refines the teacher at the crop's size. Debiased labels hold
**254** for biased pixels; the unmodified ``CrossEntropyLoss`` (21 classes) would fail on them:
train through ``MARSTrainingHook``, which maps 254 to -1.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from mars_plugin.formats.files import BIASED_VALUE

from mars_plugin.adapters.wsss._common import VOC_CLASSES, check_biased_value, checked_labels, load_pickled_npy, write_label_dir
from mars_plugin.adapters.wsss import irnet as _irn
__all__ = [
    "NAME",
    "CLASS_NAMES",
    "NUM_CLASSES",
    "LABEL_MODE",
    "CONF_FG_THRES",
    "CONF_BG_THRES",
    "SEM_SEG_BG_THRES",
    "SEM_SEG_CAM_POWER",
    "CRF_PARAMS",
    "crf_input",
    "crf_label",
    "load_pseudo_labels",
    "load_cams",
    "cams_to_label",
    "load_image_labels",
    "load_image_list",
    "write_debiased",
]

NAME = "advcam"
CLASS_NAMES: Tuple[str, ...] = VOC_CLASSES
NUM_CLASSES = 20
#: PNG mode of AdvCAM's ``<id>.png`` labels (``imageio.imwrite`` of uint8); deeplab-pytorch reads
#: either mode with ``np.asarray(Image.open(p))``.
LABEL_MODE = "L"

#: run_sample.py:45-46 of AdvCAM (IRNet's defaults were 0.30 / 0.05).
CONF_FG_THRES = 0.35
CONF_BG_THRES = 0.15
#: run_sample.py:62; random walk only (not reproduced).
SEM_SEG_BG_THRES = 0.25
#: make_sem_seg_labels.py:42 raises the strided cams to this power before the random walk.
SEM_SEG_CAM_POWER = 1.5
#: misc/imutils.py:156-170, unchanged from IRNet.
CRF_PARAMS: Dict[str, float] = dict(_irn.CRF_PARAMS)

PathLike = Union[str, os.PathLike]


def load_pseudo_labels(
    path_or_dir: PathLike, *, ids: Optional[Sequence[str]] = None
) -> Iterator[Tuple[str, torch.Tensor]]:
    """(image id, (H, W) long label) for AdvCAM's ``ir_label`` or ``sem_seg`` PNGs.

    A folder (sorted ``<id>.png``; the ``<id>_palette.png`` colour copies AdvCAM writes beside
    each label are skipped) or one PNG; ``ids`` selects images in that order. Values as stored:
    0..20, 255 = ignore.
    """
    return _irn._load_pseudo_labels(path_or_dir, ids)


def load_cams(path: PathLike, *, trust_pickle: bool = False) -> Dict[str, Any]:
    """One ``result/cam_adv_mask/<id>.npy`` (obtain_CAM_masking.py:159-160), refused without
    ``trust_pickle=True`` (it is a pickle).

    Returns:
        ``{"keys": (K,) long 1-based class ids, "cam": (K, h, w) float tensor (stride 4),
        "high_res": (K, H, W) float tensor or None}``.
    """
    obj = load_pickled_npy(path, trust_pickle=trust_pickle, what="CAM dict (AdvCAM obtain_CAM_masking.py)")
    return _irn.parse_cam_dict(obj, os.fspath(path))


def cams_to_label(
    cams: Mapping[str, Any],
    *,
    conf_fg: float = CONF_FG_THRES,
    conf_bg: float = CONF_BG_THRES,
    image: Any = None,
    crf: Optional[bool] = None,
    crf_params: Optional[Mapping[str, float]] = None,
    crf_backend: str = "torch",
) -> torch.Tensor:
    """AdvCAM's ``ir_label`` (step/cam_to_ir_label.py:29-51): IRNet's rule with 0.35 / 0.15.

    Background = a constant threshold row padded before ``high_res``, argmax (ties ->
    background), keys padded with 0; once with ``conf_fg``, once with ``conf_bg``; class where
    confident fg, 0 where background for both, 255 in between. With ``image`` (the (H, W, 3)
    uint8 RGB image) the ``crf_inference_label`` step (misc/imutils.py:156-170, gt_prob 0.7,
    Gaussian 3/3, bilateral 50/5/10, 10 iterations) runs on both argmax maps as AdvCAM does;
    ``crf=False`` skips it, ``crf=True`` without an image is an error.

    Returns:
        (H, W) long: 0 background, 1..20 classes, 255 uncertain.
    """
    return _irn.confident_label(cams, conf_fg=conf_fg, conf_bg=conf_bg, image=image, crf=crf, crf_params=crf_params,
                                crf_backend=crf_backend)


def crf_input(cams: Mapping[str, Any], *, conf_fg: float = CONF_FG_THRES, conf_bg: float = CONF_BG_THRES,
              gt_prob: float = CRF_PARAMS["gt_prob"]) -> Dict[str, Any]:
    """:func:`mars_plugin.adapters.wsss.irnet.crf_input` (the CRF's input before the CRF) with
    AdvCAM's thresholds 0.35 / 0.15."""
    return _irn.crf_input(cams, conf_fg=conf_fg, conf_bg=conf_bg, gt_prob=gt_prob)


#: :func:`mars_plugin.adapters.wsss.irnet.crf_label`: AdvCAM's rule after the CRF is IRNet's.
crf_label = _irn.crf_label


def load_image_labels(path: PathLike = "voc12/cls_labels.npy", *, trust_pickle: bool = False) -> Dict[str, torch.Tensor]:
    """AdvCAM's ``voc12/cls_labels.npy`` (IRNet's file) -> {'2007_000032': (20,) bool}.

    A pickled dict {np.int32 2007000032: float32 (20,)}: opened only with ``trust_pickle=True``.
    """
    obj = load_pickled_npy(path, trust_pickle=trust_pickle, what="image-label dict (cls_labels.npy)")
    return _irn.parse_image_labels(obj, os.fspath(path))


def load_image_list(path: PathLike) -> List[str]:
    """Ids of ``voc12/train_aug.txt`` (one id per line) or of deeplab-pytorch's
    ``ImageSets/SegmentationAug/train_aug.txt`` (``/JPEGImages/<id>.jpg /SegmentationClassAug/<id>.png``)."""
    return _irn.load_image_list(path)


def write_debiased(
    labels: Iterable[Tuple[str, Any]],
    out_dir: PathLike,
    *,
    biased_value: int = BIASED_VALUE,
    dry_run: bool = False,
) -> List[Path]:
    """Write ``<out_dir>/<id>.png`` per (id, debiased label): grayscale ('L'), -1 as
    ``biased_value`` (254), 255 ignore, atomically; no ``_palette.png`` copies.

    deeplab-pytorch reads them unchanged (``np.asarray(Image.open(p), dtype=np.int32)``,
    libs/datasets/voc.py:85) once its list points at ``out_dir``. Train on them only through
    ``MARSTrainingHook`` (adapters/training_hook.py, maps 254 to -1). ``dry_run=True`` checks
    the labels, writes nothing and returns the paths.
    """
    v = check_biased_value(biased_value, NUM_CLASSES)
    return write_label_dir(checked_labels(labels, NUM_CLASSES), out_dir, mode=LABEL_MODE, biased_value=v, dry_run=dry_run)
