"""IRNet adapter (Ahn et al., CVPR 2019; github.com/jiwoon-ahn/irn, read at commit a2ece00).

What IRNet writes, and what this module reads (file:line at that commit):

* ``result/cam/<id>.npy`` (``--cam_out_dir``, run_sample.py:58), written by step/make_cam.py:55-56
  as ``np.save(path, {"keys": valid_cat, "cam": strided_cam.cpu(), "high_res": highres_cam})``:
  a **pickled dict**. ``keys`` is a torch int64 tensor of the image's 0-based foreground class
  ids (``torch.nonzero(label)[:, 0]``, make_cam.py:46; background excluded), ``cam`` a torch
  float tensor (K, ceil(H/4), ceil(W/4)) (misc/imutils.py:173-174), ``high_res`` a numpy float32
  array (K, H, W); both max-normalised per class (make_cam.py:49, 52). Reading it needs
  ``allow_pickle`` and torch: :func:`load_cams` with ``trust_pickle=True``.
* ``result/ir_label/<id>.png`` (step/cam_to_ir_label.py:42-43, ``imageio.imwrite`` of uint8, i.e.
  a grayscale 'L' PNG): 0 background, 1..20 classes, 255 uncertain. :func:`cams_to_label`
  reproduces its rule.
* ``result/sem_seg/<id>.png`` (step/make_sem_seg_labels.py:51, ``imageio.imsave`` of uint8,
  grayscale): 0..20, no 255; the random walk over IRN's class boundaries (``sem_seg_bg_thres``
  0.25, run_sample.py:52) is **not** reproduced here (it needs the trained IRN). These are the
  pseudo labels a segmentation network is trained on (``--infer_list voc12/train_aug.txt``,
  run_sample.py:18-20).
* ``voc12/cls_labels.npy`` (voc12/make_cls_labels.py:22-28): ``np.save`` of a **pickled dict**
  {np.int32 2007000032: float32 (20,) multi-hot}; :func:`load_image_labels`.
* ``voc12/train_aug.txt``: one id ``2007_000032`` per line; :func:`load_image_list`. IRNet's own
  reader ``np.loadtxt(path, dtype=np.int32)`` (voc12/dataloader.py:60) relies on Python's
  ``int("2007_000032")`` accepting the underscore and fails on numpy >= 1.23 ("could not convert
  string '2007_000032' to int32"); ours reads the strings.

Label PNG mode: **'L'**. IRNet reads labels with ``imageio.imread`` (voc12/dataloader.py:232,
step/eval_sem_seg.py:14), which returns an (H, W, 3) RGB array for a palette ('P') PNG (checked
with imageio 2.38); a grayscale PNG comes back as the (H, W) class ids.

Recipe (IRNet has no segmentation stage of its own: its README says to train DeepLab or Mask
R-CNN on the pseudo labels, e.g. torchvision's)::

    from mars_plugin import select_centroids, debias_labels
    from mars_plugin.adapters.wsss import irnet
    # 1. centroids from the pseudo labels and your USS features (D, h, w) per image id
    labels = dict(irnet.load_pseudo_labels("result/sem_seg"))
    V = select_centroids(((features[i], y) for i, y in labels.items()), num_classes=irnet.NUM_CLASSES)
    # 2. debias and write where the segmentation training reads its labels
    classes = irnet.load_image_labels("voc12/cls_labels.npy", trust_pickle=True)
    irnet.write_debiased(((i, debias_labels(features[i], y, V, classes[i], image=rgb[i]))
                          for i, y in labels.items()), "result/sem_seg_mars")
    # 3. train on result/sem_seg_mars/<id>.png: replace the line
    #        loss = nn.CrossEntropyLoss(ignore_index=255)(logits, labels)
    #    by  loss = hook(images, logits, labels, cls, images_rgb=rgb)  with
    #    hook = MARSTrainingHook(model, refine="crf") (the paper's CRF teacher; rgb: the (B, H, W, 3)
    #    uint8 images before normalisation; from mars_plugin.adapters import MARSTrainingHook),
    #    call hook.update(model) after optimizer.step(), and save hook.state_dict() with the model:
    #    the whole loop, with its checkpoints and resume, is in docs/adapters.md, "The training
    #    hook in your own loop", run as written by tests/test_recipes.py.

Debiased labels hold **254** for the biased pixels (-1 in memory). Plain cross-entropy with
``ignore_index=255`` would take 254 as a class id (and fail on 21 classes): train on them only
through ``MARSTrainingHook``, which maps 254 to -1 and fills those pixels from its EMA teacher.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from mars_plugin.formats.files import BIASED_VALUE, IGNORE_VALUE

from mars_plugin._checks import check_num_classes

from mars_plugin.engines.crf_params import CRF_PRESETS
from mars_plugin.adapters.wsss._common import (
    VOC_CLASSES,
    read_image_list,
    check_biased_value,
    check_map_size,
    checked_labels,
    decode_voc_id,
    iter_label_dir,
    load_pickled_npy,
    write_label_dir,
)

__all__ = [
    "NAME",
    "CLASS_NAMES",
    "NUM_CLASSES",
    "LABEL_MODE",
    "CONF_FG_THRES",
    "CONF_BG_THRES",
    "SEM_SEG_BG_THRES",
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

NAME = "irnet"
#: VOC class names, background first (IRNet's voc12/dataloader.py:13-18 CAT_LIST, plus background).
CLASS_NAMES: Tuple[str, ...] = VOC_CLASSES
#: Foreground classes (labels are 0..20, 255 ignore).
NUM_CLASSES = 20
#: PNG mode of IRNet's label files (grayscale, ``imageio.imwrite`` of uint8).
LABEL_MODE = "L"

#: ``--conf_fg_thres`` / ``--conf_bg_thres`` (run_sample.py:35-36).
CONF_FG_THRES = 0.30
CONF_BG_THRES = 0.05
#: ``--sem_seg_bg_thres`` (run_sample.py:52), used by the random walk only (not reproduced).
SEM_SEG_BG_THRES = 0.25
#: ``crf_inference_label`` (misc/imutils.py:156-170): unary_from_labels(gt_prob=0.7,
#: zero_unsure=False) and the CRF preset ``irnet`` (Gaussian sxy 3 compat 3, bilateral sxy 50
#: srgb 5 compat 10, 10 iterations), one table for this adapter and ``mars crf --crf irnet``.
CRF_PARAMS: Dict[str, float] = {"gt_prob": 0.7, **CRF_PRESETS["irnet"]}

PathLike = Union[str, os.PathLike]


# --------------------------------------------------------------------------- pseudo labels

def load_pseudo_labels(
    path_or_dir: PathLike, *, ids: Optional[Sequence[str]] = None
) -> Iterator[Tuple[str, torch.Tensor]]:
    """(image id, (H, W) long label) for IRNet's ``ir_label`` or ``sem_seg`` PNGs.

    ``path_or_dir`` is a folder of ``<id>.png`` (sorted order; ``<id>_palette.png`` colour
    copies are skipped) or one PNG. With ``ids``, exactly those images are read, in that order.
    Values are returned as stored: 0..20, 255 = ignore (uncertain in ``ir_label``).
    """
    return _load_pseudo_labels(path_or_dir, ids)


def _load_pseudo_labels(path_or_dir: PathLike, ids: Optional[Sequence[str]]) -> Iterator[Tuple[str, torch.Tensor]]:
    p = Path(path_or_dir)
    if p.is_file():
        if ids is not None:
            raise ValueError(f"ids=... selects images of a folder, but {p} is a single file")
        return iter_label_dir(p.parent, ids=[p.stem])
    if not p.is_dir():
        raise ValueError(f"{p}: no such label folder or PNG file")
    return iter_label_dir(p, ids=None if ids is None else list(ids))


# --------------------------------------------------------------------------- CAMs

def _to_tensor(x: Any, name: str, path: str) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(x))
    raise ValueError(f"{path}: {name!r} must be a torch tensor or a numpy array, got {type(x).__name__}")


def _as_float(t: torch.Tensor, name: str, path: str) -> torch.Tensor:
    if not t.is_floating_point():
        raise ValueError(f"{path}: {name!r} must be a float array, got {t.dtype}")
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def parse_cam_dict(obj: Any, path: str = "<cams>", *, num_classes: int = NUM_CLASSES) -> Dict[str, Any]:
    """Validate an IRNet-style CAM dict and return it with 1-based keys (see :func:`load_cams`)."""
    num_classes = check_num_classes(num_classes)
    if not isinstance(obj, Mapping) or "keys" not in obj or "cam" not in obj:
        got = sorted(map(str, obj.keys())) if isinstance(obj, Mapping) else type(obj).__name__
        raise ValueError(f"{path}: expected an IRNet-format CAM dict with 'keys', 'cam' (and 'high_res'), got {got}")
    keys = _to_tensor(obj["keys"], "keys", path)
    if keys.ndim != 1 or keys.is_floating_point() or keys.dtype == torch.bool:
        raise ValueError(f"{path}: 'keys' must be a 1-D integer array of 0-based class ids, got {keys.dtype} {tuple(keys.shape)}")
    keys = keys.long()
    if keys.numel() and (int(keys.min()) < 0 or int(keys.max()) >= num_classes):
        raise ValueError(f"{path}: 'keys' must hold 0-based class ids in 0..{num_classes - 1}, got {keys.tolist()}")
    K = keys.numel()
    cam = _as_float(_to_tensor(obj["cam"], "cam", path), "cam", path)
    if cam.ndim != 3 or cam.shape[0] != K:
        raise ValueError(f"{path}: 'cam' must be (K, h, w) with K = {K} keys, got {tuple(cam.shape)}")
    check_map_size(cam.shape, f"{path}: 'cam'")
    high_res = obj.get("high_res")
    if high_res is not None:
        high_res = _as_float(_to_tensor(high_res, "high_res", path), "high_res", path)
        if high_res.ndim != 3 or high_res.shape[0] != K:
            raise ValueError(f"{path}: 'high_res' must be (K, H, W) with K = {K} keys, got {tuple(high_res.shape)}")
        check_map_size(high_res.shape, f"{path}: 'high_res'")
    return {"keys": keys + 1, "cam": cam, "high_res": high_res}


def load_cams(path: PathLike, *, trust_pickle: bool = False) -> Dict[str, Any]:
    """One ``result/cam/<id>.npy`` of step/make_cam.py:55-56.

    The file is a pickled dict, so it is only opened with ``trust_pickle=True`` (otherwise
    ``PermissionError``). Torch tensors and numpy arrays are both accepted inside.

    Returns:
        ``{"keys": (K,) long, 1-based class ids (IRNet's keys + 1), "cam": (K, h, w) float
        tensor (stride 4), "high_res": (K, H, W) float tensor or None}``.
    """
    obj = load_pickled_npy(path, trust_pickle=trust_pickle, what="CAM dict (IRNet step/make_cam.py)")
    return parse_cam_dict(obj, os.fspath(path))


def _check_thresholds(conf_fg: float, conf_bg: float) -> Tuple[float, float]:
    for name, v in (("conf_fg", conf_fg), ("conf_bg", conf_bg)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v):
            raise ValueError(f"{name} must be a finite number, got {v!r}")
    if conf_bg > conf_fg:
        raise ValueError(f"conf_bg ({conf_bg}) must not exceed conf_fg ({conf_fg}): pixels between them become 255")
    return float(conf_fg), float(conf_bg)


def _label_unary(labels: np.ndarray, n_labels: int, gt_prob: float) -> torch.Tensor:
    """misc/imutils.py:156-170 ``crf_inference_label``'s unary: ``unary_from_labels(labels,
    n_labels, gt_prob, zero_unsure=False)`` as an (n_labels, H, W) float32 energy."""
    from mars_plugin.engines.crf import unary_from_labels

    return unary_from_labels(torch.from_numpy(labels), n_labels, gt_prob, zero_unsure=False)


def crf_input(cams: Mapping[str, Any], *, conf_fg: float = CONF_FG_THRES, conf_bg: float = CONF_BG_THRES,
              gt_prob: float = CRF_PARAMS["gt_prob"], num_classes: int = NUM_CLASSES,
              unaries: bool = True) -> Dict[str, Any]:
    """The CRF's input by cam_to_ir_label.py's rule (shared by IRNet and AdvCAM), before the CRF:
    the two thresholded argmax maps (``conf_fg``, ``conf_bg``, cam_to_ir_label.py:27-35) and
    their label unaries (``crf_inference_label``, misc/imutils.py:156-170, ``gt_prob``).

    Returns ``{"kind": "unary", "maps": [(L, H, W) float32 energy of the fg side, of the bg
    side] (empty when L < 2: no CRF, nothing but background), "idx": the two (H, W) argmax
    maps, "ids": (L,) label id of each channel (0 first), "size": (H, W)}``; give it with the
    CRF's marginals of ``maps`` (or None: no CRF) to :func:`crf_label`. :func:`cams_to_label`
    is the two with the CRF of :data:`CRF_PARAMS` per image; ``mars crf`` batches the CRF.
    ``unaries=False``: ``maps`` stays empty (for the rule without a CRF, which needs none)."""
    conf_fg, conf_bg = _check_thresholds(conf_fg, conf_bg)
    if not isinstance(cams, Mapping) or "keys" not in cams or cams.get("high_res") is None:
        raise ValueError("cams must be the dict of load_cams(...) with 'keys' and a 'high_res' array")
    keys1 = torch.as_tensor(cams["keys"]).long().reshape(-1)
    if keys1.numel() and (int(keys1.min()) < 1 or int(keys1.max()) > num_classes):
        raise ValueError(
            f"cams['keys'] must be 1-based class ids 1..{num_classes} as load_cams returns them "
            f"(IRNet's own 0-based keys + 1), got {keys1.tolist()}"
        )
    hr = cams["high_res"]
    hr = hr.detach().cpu().numpy() if isinstance(hr, torch.Tensor) else np.asarray(hr)
    if hr.ndim != 3 or hr.shape[0] != keys1.numel():
        raise ValueError(f"cams['high_res'] must be (K, H, W) with K = {keys1.numel()} keys, got {hr.shape}")
    keys = np.pad(keys1.numpy(), (1, 0), mode="constant")  # cam_to_ir_label.py:24
    n_labels = keys.shape[0]
    # cam_to_ir_label.py:27-30 / 32-35: the background row is the constant threshold
    idx = [np.argmax(np.pad(hr, ((1, 0), (0, 0), (0, 0)), mode="constant", constant_values=t), axis=0)
           for t in (conf_fg, conf_bg)]
    # n_labels < 2: nothing but background, and unary_from_labels would divide by zero
    maps = [_label_unary(i, n_labels, gt_prob) for i in idx] if n_labels >= 2 and unaries else []
    return {"kind": "unary", "maps": maps, "idx": idx, "ids": keys, "size": tuple(hr.shape[1:])}


def crf_label(prepared: Mapping[str, Any], marginals: Optional[Sequence[Any]] = None) -> torch.Tensor:
    """(H, W) long confident label of cam_to_ir_label.py:38-40 from :func:`crf_input`'s dict and
    the CRF's (L, H, W) marginals of its ``maps`` (None: the argmax maps as they are, no CRF)."""
    keys = prepared["ids"]
    idx = list(prepared["idx"])
    if marginals is not None and prepared["maps"]:
        idx = [torch.as_tensor(q).argmax(0).cpu().numpy() for q in marginals]
    elif marginals is not None:  # no CRF to run: nothing but background
        idx = [np.zeros(i.shape, dtype=np.int64) for i in idx]
    fg_conf, bg_conf = keys[idx[0]], keys[idx[1]]
    conf = fg_conf.copy()  # cam_to_ir_label.py:38-40
    conf[fg_conf == 0] = IGNORE_VALUE
    conf[bg_conf + fg_conf == 0] = 0
    return torch.from_numpy(conf.astype(np.int64))


def confident_label(
    cams: Mapping[str, Any],
    *,
    conf_fg: float,
    conf_bg: float,
    image: Any = None,
    crf: Optional[bool] = None,
    crf_params: Optional[Mapping[str, float]] = None,
    num_classes: int = NUM_CLASSES,
    crf_backend: str = "torch",
) -> torch.Tensor:
    """The confident-fg/bg rule of cam_to_ir_label.py (shared by IRNet and AdvCAM): :func:`crf_input`,
    the CRF per image, :func:`crf_label`; see :func:`cams_to_label`."""
    if crf is None:
        crf = image is not None
    params = dict(CRF_PARAMS)
    if crf:
        if image is None:
            raise ValueError("crf=True needs the RGB image (H, W, 3) uint8: pass image=..., or crf=False")
        for k, v in (crf_params or {}).items():
            if k not in params:
                raise ValueError(f"crf_params has the unknown key {k!r}; expected some of {sorted(params)}")
            params[k] = v
    prepared = crf_input(cams, conf_fg=conf_fg, conf_bg=conf_bg, gt_prob=params["gt_prob"], num_classes=num_classes,
                         unaries=crf)
    if not crf:
        return crf_label(prepared)
    from mars_plugin.engines.crf import dense_crf_from_unary, image_to_hwc_uint8

    rgb = image_to_hwc_uint8(image, "image", prepared["size"])
    crf_params_only = {k: v for k, v in params.items() if k != "gt_prob"}
    return crf_label(prepared, [dense_crf_from_unary(u, rgb, crf_params_only, backend=crf_backend)
                                for u in prepared["maps"]])


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
    """IRNet's ``ir_label`` from a CAM dict (step/cam_to_ir_label.py:23-40).

    Reproduced exactly: the background row is the constant threshold padded in front of
    ``high_res`` and argmax-ed (ties go to background, so a cam must *exceed* the threshold),
    keys padded with 0; this once with ``conf_fg`` (0.30) and once with ``conf_bg`` (0.05); a
    pixel is its class where confident fg, 0 where background for both, 255 in between.

    The CRF step (``crf_inference_label`` on each argmax map, misc/imutils.py:156-170, with
    :data:`CRF_PARAMS` and pydensecrf's ``unary_from_labels`` as IRNet calls them, computed by
    :func:`mars_plugin.engines.crf.dense_crf_from_unary`) runs when ``image`` is given (``crf=None``) and
    needs the full-resolution RGB image as IRNet reads it (``imageio.imread`` of the JPEG:
    (H, W, 3) uint8). ``crf=False`` gives the thresholds alone; ``crf=True`` without an image is
    an error.

    Args:
        cams: the dict of :func:`load_cams` (1-based ``keys``, ``high_res`` (K, H, W)).
        crf_params: overrides of :data:`CRF_PARAMS`.
        crf_backend: ``"torch"`` or ``"pydensecrf"`` (upstream's own library; the ``crf`` extra).

    Returns:
        (H, W) long: 0 background, 1..20 classes, 255 uncertain.
    """
    return confident_label(cams, conf_fg=conf_fg, conf_bg=conf_bg, image=image, crf=crf, crf_params=crf_params,
                           crf_backend=crf_backend)


# --------------------------------------------------------------------------- image labels and lists

def parse_image_labels(obj: Any, path: str = "<cls_labels>", *, num_classes: int = NUM_CLASSES) -> Dict[str, torch.Tensor]:
    """{decoded id: (C,) bool} from a cls_labels dict (np.int32 or str keys, (C,) 0/1 values)."""
    num_classes = check_num_classes(num_classes)
    if not isinstance(obj, Mapping):
        raise ValueError(f"{path}: expected a dict {{image id: ({num_classes},) multi-hot}}, got {type(obj).__name__}")
    out: Dict[str, torch.Tensor] = {}
    for key, value in obj.items():
        name = decode_voc_id(key)
        arr = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
        if arr.shape != (num_classes,):
            raise ValueError(f"{path}: the label of {name} must have shape ({num_classes},), got {arr.shape}")
        if not np.all((arr == 0) | (arr == 1)):
            raise ValueError(f"{path}: the label of {name} must be multi-hot (0/1), got {arr.tolist()}")
        out[name] = torch.from_numpy(arr == 1)
    return out


def load_image_labels(path: PathLike = "voc12/cls_labels.npy", *, trust_pickle: bool = False) -> Dict[str, torch.Tensor]:
    """IRNet's ``voc12/cls_labels.npy`` (voc12/make_cls_labels.py:22-28) -> {'2007_000032': (20,) bool}.

    The file is ``np.save`` of a dict, i.e. a pickle: it is only opened with
    ``trust_pickle=True``. Keys are np.int32 like 2007000032 (decoded to '2007_000032'), values
    float32 (20,) multi-hot with index k = class k+1. Works on numpy 1 and 2.
    """
    obj = load_pickled_npy(path, trust_pickle=trust_pickle, what="image-label dict (cls_labels.npy)")
    return parse_image_labels(obj, os.fspath(path))


def load_image_list(path: PathLike) -> List[str]:
    """Image ids of a list file such as ``voc12/train_aug.txt`` (one ``2007_000032`` per line).

    The first whitespace-separated field of each non-empty line is taken, without folder or
    extension, so deeplab-style lines (``/JPEGImages/2007_000032.jpg /SegmentationClassAug/...``)
    give the same ids. Ids stay strings (IRNet's ``np.loadtxt(dtype=np.int32)`` breaks on
    numpy >= 1.23).
    """
    return read_image_list(path)


# --------------------------------------------------------------------------- writing


def write_debiased(
    labels: Iterable[Tuple[str, Any]],
    out_dir: PathLike,
    *,
    biased_value: int = BIASED_VALUE,
    dry_run: bool = False,
) -> List[Path]:
    """Write ``<out_dir>/<id>.png`` per (id, debiased label), grayscale ('L') as IRNet writes
    labels, atomically; -1 (biased) is stored as ``biased_value`` (254), 255 stays ignore.

    IRNet-side readers (``imageio.imread``, voc12/dataloader.py:232) get the bytes back
    unchanged. Train on them only through ``MARSTrainingHook`` (adapters/training_hook.py),
    which maps 254 to -1; a plain ``CrossEntropyLoss(ignore_index=255)`` would see class 254.
    ``dry_run=True`` checks the labels, writes nothing and returns the paths.
    """
    v = check_biased_value(biased_value, NUM_CLASSES)
    return write_label_dir(checked_labels(labels, NUM_CLASSES), out_dir, mode=LABEL_MODE, biased_value=v, dry_run=dry_run)
