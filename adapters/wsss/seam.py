"""SEAM (Wang et al., CVPR 2020) adapter: read SEAM's CAMs, pseudo labels and image labels, write
debiased labels where its DeepLab stage (YudeWang/semantic-segmentation-codebase) reads them.

Upstream references are ``file:line`` of YudeWang/SEAM at commit 3212261 and of
YudeWang/semantic-segmentation-codebase (``ssc``) at commit a40f6c6.

Recipe
------
Point at SEAM's outputs: the pseudo labels ``out_rw/`` (``infer_aff.py --out_rw``), the image
labels ``voc12/cls_labels.npy`` and the list ``voc12/train_aug.txt``; USS features are one
``<name>.npy`` (D, h, w) per image. Then the three calls::

    from mars_plugin import select_centroids, debias_labels
    from mars_plugin.adapters.wsss import seam
    names = seam.load_image_list("voc12/train_aug.txt")
    tags = seam.load_image_labels("voc12/cls_labels.npy", trust_pickle=True)   # your own file
    V = select_centroids(((feat(n), y) for n, y in seam.load_pseudo_labels("out_rw", ids=names)),
                         num_classes=seam.NUM_CLASSES)
    debiased = ((n, debias_labels(feat(n), y, V, tags[n], image=rgb(n)))
                for n, y in seam.load_pseudo_labels("out_rw", ids=names))
    seam.write_debiased(debiased, "out_rw_mars")        # <name>.png, L mode, biased = 254

(``feat(n)``/``rgb(n)`` stand for your feature and image readers, e.g.
``mars_plugin.formats.files.read_features`` / ``read_image``.) Without ``out_rw`` (no random walk), build
the labels from the CAM dicts: ``seam.cams_to_label(seam.load_cams(p, trust_pickle=True))``.

Then the segmentation stage, ``ssc/experiment/seamv1-pseudovoc``:

* ``config.py:27``: ``'DATA_PSEUDO_GT': '<...>/out_rw_mars'`` (the folder written above; read by
  ``ssc/lib/datasets/VOCDataset.py:74-78`` as ``np.array(Image.open(pseudo_gt_dir/<name>.png))``,
  so 254 reaches the loop unchanged).
* ``train.py`` (checked at a40f6c6; the file is tab-indented: new lines take tabs, like the
  lines they replace, or Python raises ``TabError``/``IndentationError``), the edits of docs/adapters.md, "SEAM +
  YudeWang/semantic-segmentation-codebase": after L34 import ``MARSTrainingHook`` and ``seam``
  from ``mars_plugin.adapters``; L85 ``criterion = ...`` -> ``hook =
  MARSTrainingHook(parameter_source, refine="crf")`` (the paper's CRF teacher), ``tags =
  seam.load_image_labels("../../../SEAM/voc12/cls_labels.npy", trust_pickle=True)`` (relative
  to ``experiment/seamv1-pseudovoc``, where train.py runs, with SEAM checked out beside the
  codebase), ``DATA_MEAN``/``DATA_STD`` as tensors, and the teacher loaded from
  ``<TRAIN_CKPT>_mars.pth`` on resume; L97 ``loss = criterion(...)`` -> the uint8 RGB batch
  (``((inputs * std + mean) * 255)``, channels last; ``ssc/lib/datasets/transform.py:151-168``)
  and ``loss = hook(inputs.to(device), pred1, seg_label.to(device), torch.stack([tags[n] for n
  in sample['name']]).to(device), images_rgb=rgb.to(device))`` (``device`` is ``train.py:62``);
  after L99 ``optimizer.step()``: ``hook.update(parameter_source)``; beside each checkpoint
  (L125, L132) ``<checkpoint>_mars.pth`` with the teacher and the optimizer, removed with the
  previous epoch's (L127). tests/test_recipes.py applies exactly those lines to a loop of
  train.py's shape, from that folder, and runs it.

The hook maps 254 to -1 (biased), fills those pixels from its EMA teacher and weighs them
(Eq. 6-7). Without it, plain ``CrossEntropyLoss(ignore_index=255)`` would train on 254 as a
class id and fail (254 >= 21 classes). Take the image labels from ``cls_labels.npy``, not from
``sample['category']``: that one is computed from the label file itself
(``ssc/lib/datasets/BaseDataset.py:68-70``, values >= 21 counted as background), so a class
whose pixels were all marked biased would vanish from it.

Formats (verified upstream)
---------------------------
* CAM dicts ``out_cam/<name>.npy``: ``np.save`` of ``{cls: (H, W) float32}`` with int keys 0..19
  (no background), one key per image-level class (``infer_SEAM.py:79-85``), values max-normalised
  per class (``infer_SEAM.py:72-77``).
* CRF dicts ``<out_crf>_4.0/`` and ``<out_crf>_24.0/`` (``infer_SEAM.py:31,106-112``): ``{0: bg,
  cls+1: prob}``, the CRF marginals of [(1 - max cam)^alpha, cams] (``infer_SEAM.py:92-104``).
* Pseudo labels: ``out_rw/<name>.png`` (``infer_aff.py:152-156``) and ``out_cam_pred/<name>.png``
  (``infer_SEAM.py:87-90``), written by ``scipy.misc.imsave`` from a uint8 array: grayscale (L)
  PNGs of class ids 0..20. SEAM itself never writes 255.
* Image labels ``voc12/cls_labels.npy``: ``np.save`` of a dict ``{'2007_000032': (20,) float32}``
  with str keys (``voc12/make_cls_labels.py:18-22``; the shipped file has 12031 str keys).
* Lists (``voc12/train_aug.txt``): ``/JPEGImages/<name>.jpg /SegmentationClassAug/<name>.png``
  lines (``voc12/data.py:51-57`` keeps ``split(' ')[0][-15:-4]``); ssc reads plain ``<name>``
  lines (``ssc/lib/datasets/VOCDataset.py:39-44``). Both are accepted.
"""
from __future__ import annotations

import os
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from mars_plugin.engines.crf_params import CRF_PRESETS
from mars_plugin.formats.files import BIASED_VALUE, list_stems, stem_path

from mars_plugin.adapters.wsss._common import (
    argmax_label,
    VOC_CLASSES,
    read_image_list,
    check_biased_value,
    check_map_size,
    file_error,
    checked_labels,
    decode_voc_id,
    iter_label_dir,
    load_pickled_npy,
    multi_hot,
    write_label_dir,
)

__all__ = [
    "NAME",
    "CLASS_NAMES",
    "NUM_CLASSES",
    "LABEL_MODE",
    "BG_THRESHOLD",
    "CRF_ALPHAS",
    "AFF_ALPHA",
    "CRF_PARAMS",
    "crf_input",
    "crf_label",
    "load_pseudo_labels",
    "normalize_cams",
    "load_cams",
    "iter_cams",
    "cams_to_label",
    "load_image_labels",
    "load_image_list",
    "write_debiased",
]

PathLike = Union[str, os.PathLike]

NAME = "seam"
#: VOC 2012, background first (SEAM is VOC only).
CLASS_NAMES: Tuple[str, ...] = VOC_CLASSES
#: Foreground classes C; labels are 0..C.
NUM_CLASSES = 20
#: PNG mode SEAM writes (``scipy.misc.imsave`` of uint8: grayscale); ssc reads either mode.
LABEL_MODE = "L"
#: Constant background score of ``infer_SEAM.py --out_cam_pred_alpha`` (``infer_SEAM.py:28``).
BG_THRESHOLD = 0.26
#: Exponents of the two CRF dict folders (``infer_SEAM.py:31``).
CRF_ALPHAS = (4, 24)
#: Exponent of the background before the random walk (``infer_aff.py:59,100``).
AFF_ALPHA = 6
#: SEAM's ``tool/imutils.py:220-237`` ``crf_inference`` in the keys of ``mars_plugin.engines.crf_params``.
#: The same numbers as PSA's: the "psa" preset.
CRF_PARAMS: Dict[str, float] = dict(CRF_PRESETS["psa"])


# --------------------------------------------------------------------------- pseudo labels
def load_pseudo_labels(path_or_dir: PathLike, *, ids: Optional[Sequence[str]] = None) -> Iterator[Tuple[str, torch.Tensor]]:
    """(name, (H, W) long label) from SEAM's ``out_rw/`` or ``out_cam_pred/`` PNGs (or one PNG).

    Values are returned as stored: 0 background, 1..20 classes, 255 ignore where present.
    With ``ids`` (e.g. :func:`load_image_list`), exactly those images, in that order.
    """
    p = Path(path_or_dir)
    if p.is_file():
        if ids is not None:
            raise ValueError(f"ids can only be given with a folder, got the file {p}")
        yield from iter_label_dir(p.parent, ids=[p.stem])
        return
    if not p.is_dir():
        raise ValueError(f"{p}: no such file or folder of SEAM pseudo labels (out_rw/ or out_cam_pred/)")
    yield from iter_label_dir(p, ids=ids)


# --------------------------------------------------------------------------- CAM dicts
def _looks_like_crf(arrays: List[np.ndarray], keys: List[int]) -> bool:
    # CRF marginals (infer_SEAM.py:96-104) hold key 0 (background) plus >= 1 class and sum to 1 per
    # pixel; max-normalised CAMs (infer_SEAM.py:77) practically never do.
    if 0 not in keys or len(keys) < 2:
        return False
    s = np.sum(np.stack(arrays).astype(np.float64), axis=0)
    return bool(np.all(np.abs(s - 1.0) < 1e-3))


def normalize_cams(obj: Mapping[Any, Any], *, kind: str = "auto", name: Optional[str] = None) -> Dict[str, Any]:
    """SEAM's in-memory CAM or CRF dict -> the normalised dict of :func:`load_cams`."""
    if kind not in ("auto", "cam", "crf"):
        raise ValueError(f"kind must be 'auto', 'cam' or 'crf', got {kind!r}")
    if not isinstance(obj, Mapping):
        raise TypeError(
            f"{name or 'cams'}: a SEAM CAM file holds a dict {{class index: (H, W) array}}, got {type(obj).__name__}"
        )
    keys: List[int] = []
    arrays: List[np.ndarray] = []
    for k, v in obj.items():  # insertion order = SEAM's channel order (infer_SEAM.py:80-82, 93)
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
            raise ValueError(f"{name or 'cams'}: keys must be int class indices, got {k!r}")
        a = np.asarray(v.cpu() if isinstance(v, torch.Tensor) else v)
        if a.ndim != 2 or not np.issubdtype(a.dtype, np.floating):
            raise ValueError(f"{name or 'cams'}: value of key {int(k)} must be a float (H, W) array, got {a.dtype} {a.shape}")
        check_map_size(a.shape, name or "cams")
        if arrays and a.shape != arrays[0].shape:
            raise ValueError(f"{name or 'cams'}: all maps must share one size, got {arrays[0].shape} and {a.shape}")
        keys.append(int(k))
        arrays.append(a)
    if kind == "auto":
        kind = "crf" if _looks_like_crf(arrays, keys) else "cam"
    if kind == "cam":
        if any(not 0 <= k < NUM_CLASSES for k in keys):
            raise ValueError(f"{name or 'cams'}: CAM dict keys must be 0..{NUM_CLASSES - 1} (class index, no background), got {keys}")
        label_ids = [k + 1 for k in keys]
    else:
        if any(not 0 <= k <= NUM_CLASSES for k in keys) or 0 not in keys:
            raise ValueError(f"{name or 'cams'}: CRF dict keys must hold 0 (background) and 1..{NUM_CLASSES}, got {keys}")
        label_ids = keys
    if arrays:
        cam = torch.from_numpy(np.stack(arrays).astype(np.float32))
        size: Optional[Tuple[int, int]] = tuple(arrays[0].shape)  # type: ignore[assignment]
    else:
        cam = torch.zeros(0, 0, 0)
        size = None
    return {
        "id": name,
        "keys": torch.tensor(label_ids, dtype=torch.long),
        "cam": cam,
        "includes_background": kind == "crf",
        "kind": kind,
        "size": size,
    }


def load_cams(path: PathLike, *, trust_pickle: bool = False, kind: str = "auto") -> Dict[str, Any]:
    """One SEAM ``out_cam/<name>.npy`` (CAM dict) or ``out_crf_<alpha>/<name>.npy`` (CRF dict).

    These files are pickled dicts: ``trust_pickle=True`` is required (PermissionError otherwise).

    Returns a dict:

    * ``id``: the image name (file stem).
    * ``keys``: (K,) long, the label id of every channel: class index + 1 for CAM dicts
      (``infer_SEAM.py:80-82`` stores 0-based keys), the stored key for CRF dicts (0 is their
      background channel, ``infer_SEAM.py:100-102``). Channel order is the file's key order.
    * ``cam``: (K, H, W) float32.
    * ``includes_background``: False for CAM dicts (:func:`cams_to_label` adds SEAM's background
      score), True for CRF dicts (plain argmax).
    * ``kind``: ``"cam"`` or ``"crf"``; ``kind="auto"`` calls a dict a CRF dict when it has key 0
      plus at least one class and its maps sum to 1 at every pixel (the CRF marginals); pass
      ``kind=`` to decide yourself.
    * ``size``: (H, W), or None for an empty dict (an image without classes).
    """
    obj = load_pickled_npy(path, trust_pickle=trust_pickle, what="SEAM CAM/CRF dict")
    try:
        return normalize_cams(obj, kind=kind, name=Path(path).stem)
    except ValueError as e:
        raise file_error(path, Path(path).stem, e) from None


def iter_cams(
    folder: PathLike, *, ids: Optional[Sequence[str]] = None, trust_pickle: bool = False, kind: str = "auto"
) -> Iterator[Tuple[str, Dict[str, Any]]]:
    """(name, :func:`load_cams` dict) for every ``.npy`` of a folder (sorted), or for ``ids``."""
    folder = Path(folder)
    stems = list(ids) if ids is not None else list_stems(folder, (".npy",))
    for stem in stems:
        yield stem, load_cams(stem_path(folder, stem, ".npy"), trust_pickle=trust_pickle, kind=kind)


def _as_normalized(cams: Mapping[str, Any]) -> Dict[str, Any]:
    if isinstance(cams, Mapping) and "includes_background" in cams and "cam" in cams and "keys" in cams:
        return dict(cams)
    return normalize_cams(cams)


def cams_to_label(
    cams: Mapping[str, Any],
    *,
    bg_threshold: float = BG_THRESHOLD,
    bg_alpha: Optional[float] = None,
    image: Any = None,
    size: Optional[Tuple[int, int]] = None,
    crf_backend: str = "torch",
) -> torch.Tensor:
    """(H, W) long label 0..20 from a :func:`load_cams` dict (or a raw SEAM dict), SEAM's rules.

    CAM dicts (no background channel), background score then argmax over [bg, cams]:

    * default, ``bg_alpha=None``: the constant ``bg_threshold`` = 0.26, exactly ``infer_SEAM.py
      --out_cam_pred`` (``infer_SEAM.py:28,87-90``) and ``evaluation.py --type npy --t 0.26``
      (``evaluation.py:28-33``);
    * ``bg_alpha=a``: ``(1 - max_k cam_k)^a``, the rule before SEAM's CRF (a = 4 or 24,
      ``infer_SEAM.py:31,94``) and before the random walk (a = 6, ``infer_aff.py:59,100``).

    CRF dicts (``includes_background``): plain argmax over their channels.

    ``image`` ((H, W, 3) uint8 RGB): run SEAM's ``crf_inference`` (:data:`CRF_PARAMS`) on the
    scores first, as ``infer_SEAM.py:96`` does, with :func:`mars_plugin.engines.crf.dense_crf`
    (``crf_backend="pydensecrf"`` runs pydensecrf itself, as upstream). Ties go to the first channel
    (background, then the dict's key order), as ``np.argmax`` upstream. ``size`` gives (H, W)
    for an empty dict (all background).
    """
    prepared = crf_input(cams, bg_threshold=bg_threshold, bg_alpha=bg_alpha, size=size)
    if image is None or not prepared["maps"]:
        return crf_label(prepared)
    from mars_plugin.engines.crf import dense_crf

    return crf_label(prepared, [dense_crf(np.ascontiguousarray(prepared["maps"][0].numpy()), image, CRF_PARAMS,
                                          backend=crf_backend)])


def crf_input(cams: Mapping[str, Any], *, bg_threshold: float = BG_THRESHOLD, bg_alpha: Optional[float] = None,
              size: Optional[Tuple[int, int]] = None) -> Dict[str, Any]:
    """The CRF's input by SEAM's rule, before the CRF (see :func:`cams_to_label`): the scores
    [background, cams] of a CAM dict (the background by ``bg_threshold`` or ``bg_alpha``), a CRF
    dict's channels as they are.

    Returns ``{"kind": "probs", "maps": [(L, H, W) float32 scores] (empty for a dict without a
    class: all background), "ids": (L,) label id of each channel, "size": (H, W)}``; give it
    with the CRF's marginals of ``maps`` (or None: no CRF) to :func:`crf_label`."""
    c = _as_normalized(cams)
    keys = torch.as_tensor(c["keys"]).long().cpu().numpy()
    cam = torch.as_tensor(c["cam"]).float().cpu().numpy()
    if cam.shape[0] == 0:
        hw = size if size is not None else c.get("size")
        if hw is None:
            raise ValueError("this CAM dict is empty (no class): pass size=(H, W) to get an all-background label")
        return {"kind": "probs", "maps": [], "ids": np.zeros(1, dtype=np.int64), "size": tuple(hw)}
    if cam.ndim != 3 or cam.shape[0] != keys.shape[0]:
        raise ValueError(f"cam must be (K, H, W) with K = len(keys) = {keys.shape[0]}, got {cam.shape}")
    if c["includes_background"]:
        scores, ids = cam, keys
    else:
        if bg_alpha is None:
            bg = np.full((1,) + cam.shape[1:], float(bg_threshold), dtype=np.float32)
        else:
            bg = np.power(1 - np.max(cam, axis=0, keepdims=True), float(bg_alpha))
        scores = np.concatenate([bg, cam], axis=0)
        ids = np.concatenate([[0], keys])
    return {"kind": "probs", "maps": [torch.from_numpy(np.ascontiguousarray(scores))], "ids": ids,
            "size": tuple(cam.shape[1:])}


#: The label after the CRF (the argmax through the ids): :func:`mars_plugin.adapters.wsss._common.argmax_label`.
crf_label = argmax_label


# --------------------------------------------------------------------------- image labels, lists
def _labels_from_xml(xml_path: Path) -> torch.Tensor:
    # voc12/data.py:23-36: every <name> element of the file (minidom getElementsByTagName), kept
    # when it is one of the 20 classes; difficult objects count, part names (head, hand) do not.
    try:
        root = ET.parse(os.fspath(xml_path)).getroot()
    except (OSError, ET.ParseError) as e:
        raise ValueError(f"{xml_path}: cannot read VOC annotation ({e})") from e
    names = {(el.text or "").strip() for el in root.iter("name")}
    return multi_hot([CLASS_NAMES.index(n) for n in names if n in CLASS_NAMES[1:]], NUM_CLASSES)


def load_image_labels(
    path: PathLike, *, trust_pickle: bool = False, ids: Optional[Sequence[str]] = None
) -> Dict[str, torch.Tensor]:
    """{name: (20,) bool multi-hot} (index k is class k+1).

    ``path`` is either SEAM's ``cls_labels.npy`` (a pickled dict with str keys, so
    ``trust_pickle=True`` is required; int keys like IRNet's 2007000032 are decoded too; a value
    counts where it is > 1e-5, ``infer_SEAM.py:81``), or a VOC ``Annotations/`` folder of xml
    files, read as ``voc12/make_cls_labels.py`` does (``voc12/data.py:23-36``: every ``<name>``
    that is a class, difficult objects included; no pickle involved). ``ids`` restricts the result
    (and, for a folder, the files read).
    """
    p = Path(path)
    if p.is_dir():
        stems = list(ids) if ids is not None else list_stems(p, (".xml",))
        return {s: _labels_from_xml(stem_path(p, s, ".xml")) for s in stems}
    obj = load_pickled_npy(p, trust_pickle=trust_pickle, what="SEAM cls_labels dict")
    if not isinstance(obj, Mapping):
        raise ValueError(f"{p}: cls_labels.npy must hold a dict {{name: (20,) array}}, got {type(obj).__name__}")
    out: Dict[str, torch.Tensor] = {}
    for k, v in obj.items():
        a = np.asarray(v, dtype=np.float32).reshape(-1)
        if a.shape != (NUM_CLASSES,):
            raise ValueError(f"{p}: the label of {k!r} must have {NUM_CLASSES} entries, got shape {np.shape(v)}")
        out[decode_voc_id(k)] = torch.from_numpy(a > 1e-5)
    if ids is not None:
        missing = [i for i in ids if i not in out]
        if missing:
            raise ValueError(f"{p}: no image labels for {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        out = {i: out[i] for i in ids}
    return out


def load_image_list(path: PathLike) -> List[str]:
    """Image names of a SEAM list (``/JPEGImages/x.jpg /SegmentationClassAug/x.png`` lines ->
    ``'x'``, ``voc12/data.py:51-57``) or of a plain list of names (VOC ImageSets, ssc's
    ``trainaug.txt``). Blank lines are skipped; the first token's file stem is the name (the same
    as SEAM's ``[-15:-4]`` slice for VOC names)."""
    return read_image_list(path)


# --------------------------------------------------------------------------- writing


def write_debiased(
    labels: Iterable[Tuple[str, Any]],
    out_dir: PathLike,
    *,
    biased_value: int = BIASED_VALUE,
    dry_run: bool = False,
) -> List[Path]:
    """Write ``<out_dir>/<name>.png`` per (name, (H, W) label with -1 = biased), L mode like SEAM.

    Point ssc's ``'DATA_PSEUDO_GT'`` (``experiment/seamv1-pseudovoc/config.py:27``) at
    ``out_dir``: it reads ``np.array(Image.open(<dir>/<name>.png))`` (``lib/datasets/
    VOCDataset.py:74-78``), so the training loop sees biased pixels as ``biased_value`` = 254.
    Those pixels need :class:`mars_plugin.adapters.training_hook.MARSTrainingHook` (maps 254 to -1
    and fills them from the EMA teacher); ``nn.CrossEntropyLoss(ignore_index=255)`` alone cannot
    take them. Values other than -1, 0..20 and 255 are refused (ValueError). Atomic writes;
    ``dry_run=True`` checks the labels, writes nothing and returns the paths.
    """
    v = check_biased_value(biased_value, NUM_CLASSES)
    return write_label_dir(checked_labels(labels, NUM_CLASSES), out_dir, mode=LABEL_MODE, biased_value=v, dry_run=dry_run)
