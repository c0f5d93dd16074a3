"""RS+EPM (Jo et al., RecurSeed and EdgePredictMix) adapter: read its seed pickles, P-mode pseudo
masks and xml image tags (PASCAL VOC 2012 and MS COCO 2014), write debiased masks where its
segmentation dataset reads them.

Upstream references are ``file:line`` of shjo-april/RecurSeed_and_EdgePredictMix at commit
df538e2 (the MARS paper's own baseline; MARS's repository has not released code).

Recipe
------
RS+EPM's data layout is ``<root>/<domain>/{image,xml,mask}/`` (``core/abc_modules.py:66-71``)
and its outputs live under ``./experiments/`` (``convert_seed_to_pseudo_masks.py:48-50``). Point
at the pseudo masks ``experiments/pseudo-labels/<tag>/train/`` and the tags ``<root>/train_aug/xml``
(VOC) or ``<root>/train/xml`` (COCO, ``dataset="coco"``). Then the three calls::

    from mars_plugin import select_centroids, debias_labels
    from mars_plugin.adapters.wsss import rsepm
    masks = "experiments/pseudo-labels/<tag>/train"
    tags = rsepm.load_image_labels("../VOC2012/train_aug/xml")            # no pickle
    V = select_centroids(((feat(i), y) for i, y in rsepm.load_pseudo_labels(masks)),
                         num_classes=rsepm.NUM_CLASSES)                   # COCO: COCO_NUM_CLASSES
    debiased = ((i, debias_labels(feat(i), y, V, tags[i], image=rgb(i)))
                for i, y in rsepm.load_pseudo_labels(masks))
    rsepm.write_debiased(debiased, rsepm.pseudo_label_dir("./experiments/", "<tag>@MARS"))

(``feat(i)``/``rgb(i)``: your feature and image readers.) Without the PNG masks, build them from
the seed pickles: ``rsepm.cams_to_label(rsepm.load_cams(p, trust_pickle=True), image=rgb)``.

Segmentation stage: RS+EPM has not released its DeepLab training script (``README.md:95-96``:
"The whole code and commands are under review and will release soon."). Its segmentation dataset
is ``core/datasets.py:116-130`` ``Dataset_For_Segmentation(root_dir, domain, transform,
tag=..., name=..., mask_dir='./experiments/')``, which reads
``<mask_dir>pseudo-labels/<tag>/train/<id>.png`` (``core/datasets.py:121-122``) with
``Image.open`` (``core/abc_modules.py:103-109``) and ``np.asarray(mask, dtype=np.int64)``
(``tools/ai/augment_utils.py:358-359``): pass ``tag='<tag>@MARS'`` and 254 reaches the loop
unchanged. In your training loop (any DeepLab loop on that dataset), replace the
``nn.CrossEntropyLoss(ignore_index=255)(logits, masks)`` line by::

    hook = MARSTrainingHook(model, refine="crf")          # once; from mars_plugin.adapters import MARSTrainingHook
    loss = hook(images, logits, masks, classes, images_rgb=rgb)  # classes: (B, C) multi-hot from tags
    loss.backward(); optimizer.step(); hook.update(model)

``rgb`` is the batch as (B, H, W, 3) uint8 RGB at the masks' size, before the dataset's
normalisation: the dense CRF refines the teacher on it, as the paper does. Save
``hook.state_dict()`` with the model and load it on resume (``hook.load_state_dict``).

``Dataset_For_Segmentation.__getitem__`` returns only (image, mask); to get ``classes``, wrap it
so that it also returns ``tags[self.image_names[index].replace('.jpg', '')]`` (the id rule of
``core/abc_modules.py:124``). docs/adapters.md, "The training hook in your own loop", has the
whole loop on these files, run as written by tests/test_recipes.py.

Formats (verified upstream)
---------------------------
* RS+EPM seeds ``experiments/predictions/<tag>/<domain>/<id>.pkl`` (``infer_rsepm.py:117-134``):
  a pickle of ``{'keys': int64 array [0, c1+1, ...], 'seed': (K, H, W) float32}``, ``keys``
  already padded with a leading 0 (``np.pad(nonzero + 1, (1, 0))``), ``seed`` the max-normalised
  foreground maps of the image's classes only (no background), so ``len(keys) == len(seed) + 1``.
* DeepLab-stage seeds (``infer_seg.py:111-127``): ``keys`` = every class id 0..C (background
  included) whose softmax reaches 0.05 somewhere, ``seed`` their softmax maps:
  ``len(keys) == len(seed)``.
* Pseudo masks: ``experiments/pseudo-labels/<tag>/<domain>/<id>.png``, ``domain`` ``train`` for
  ``train_aug`` (``convert_seed_to_pseudo_masks.py:48-50``), P-mode PNGs whose palette is the
  dataset json's colours, (224, 224, 192) at 255 and black elsewhere
  (``convert_seed_to_pseudo_masks.py:135-137``, ``tools/general/cv_utils.py:204-214``). Those
  colours are the VOC bit-interleaved colour map for VOC and COCO alike, so our writer's
  :func:`mars_plugin.formats.files.voc_palette` gives the same colours for every class id and for 255;
  only the unused entries (21/81..254) differ, and they never change the pixel values.
* Image tags: one VOC-style xml per image in ``<root>/<domain>/xml/`` for VOC *and* COCO 2014
  (RS+EPM ships COCO converted to that layout). ``core/abc_modules.py:111-121`` reads them with
  ``read_xml(keep_difficult=True)``: difficult objects count; objects whose clamped box has zero
  width or height are dropped (``tools/general/xml_utils.py:26-32``); names map through
  ``data/VOC.json`` / ``data/COCO.json`` ``class_dict`` (``core/datasets.py:83-85``; COCO: 81
  contiguous ids with background, names such as ``"traffic light"``).
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
    COCO_CLASSES,
    VOC_CLASSES,
    check_biased_value,
    check_map_size,
    file_error,
    checked_labels,
    iter_label_dir,
    load_pickle,
    multi_hot,
    write_label_dir,
)

__all__ = [
    "NAME",
    "CLASS_NAMES",
    "COCO_CLASSES",
    "NUM_CLASSES",
    "COCO_NUM_CLASSES",
    "LABEL_MODE",
    "BG_GAMMA",
    "CRF_PARAMS",
    "crf_input",
    "crf_label",
    "class_names",
    "num_classes",
    "pseudo_label_dir",
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

NAME = "rsepm"
#: ``data/VOC.json`` ``class_names``: background first, 21 entries.
CLASS_NAMES: Tuple[str, ...] = VOC_CLASSES
# COCO_CLASSES (imported from _common and exported here): ``data/COCO.json`` ``class_names``,
# background first, 81 contiguous entries (COCO 2014).
#: Foreground classes C (VOC); labels are 0..C.
NUM_CLASSES = 20
#: Foreground classes of COCO 2014.
COCO_NUM_CLASSES = 80
#: RS+EPM writes P-mode PNGs with a palette (``convert_seed_to_pseudo_masks.py:135-137``).
LABEL_MODE = "P"
#: Default background exponent: bg = (1 - max seed)^2 (``convert_seed_to_pseudo_masks.py:173``,
#: ``core/refinements/densecrf.py:27-29``).
BG_GAMMA = 2.0
#: The ``'deeplab'`` CRF of ``convert_seed_to_pseudo_masks.py:77-84`` in ``mars_plugin.engines.crf_params`` keys
#: (pos = Gaussian, bi = bilateral; ``core/refinements/densecrf.py:40-45``).
#: The MARS authors' setting, which is this package's default preset.
CRF_PARAMS: Dict[str, float] = dict(CRF_PRESETS["mars"])

_DATASETS = {"voc": CLASS_NAMES, "coco": COCO_CLASSES}


def class_names(dataset: str = "voc") -> Tuple[str, ...]:
    """Class names, background first, of ``dataset`` (``"voc"`` or ``"coco"``, any case, as the
    repository's ``--dataset VOC|COCO``)."""
    key = str(dataset).lower()
    if key not in _DATASETS:
        raise ValueError(f"dataset must be 'voc' or 'coco' (RS+EPM's --dataset VOC|COCO), got {dataset!r}")
    return _DATASETS[key]


def num_classes(dataset: str = "voc") -> int:
    """C, the number of foreground classes: 20 (VOC) or 80 (COCO)."""
    return len(class_names(dataset)) - 1


def pseudo_label_dir(experiments_dir: PathLike, tag: str, domain: str = "train") -> Path:
    """``<experiments_dir>/pseudo-labels/<tag>/<domain>/``: where RS+EPM writes its masks
    (``convert_seed_to_pseudo_masks.py:48-50``; ``train_aug`` is stored as ``train``) and where
    ``Dataset_For_Segmentation(tag=tag)`` reads them (``core/datasets.py:121-122``)."""
    domain = "train" if domain == "train_aug" else domain
    return Path(experiments_dir) / "pseudo-labels" / tag / domain


# --------------------------------------------------------------------------- pseudo labels
def load_pseudo_labels(path_or_dir: PathLike, *, ids: Optional[Sequence[str]] = None) -> Iterator[Tuple[str, torch.Tensor]]:
    """(id, (H, W) long mask) from ``experiments/pseudo-labels/<tag>/train/`` (or one PNG).

    The P-mode palette indices are the class ids (0 background, 1..C, 255 ignore), returned as
    stored, as ``np.asarray(Image.open(p), dtype=np.int64)`` upstream.
    """
    p = Path(path_or_dir)
    if p.is_file():
        if ids is not None:
            raise ValueError(f"ids can only be given with a folder, got the file {p}")
        yield from iter_label_dir(p.parent, ids=[p.stem])
        return
    if not p.is_dir():
        raise ValueError(f"{p}: no such file or folder of RS+EPM pseudo masks (experiments/pseudo-labels/<tag>/train/)")
    yield from iter_label_dir(p, ids=ids)


# --------------------------------------------------------------------------- seeds
def normalize_cams(obj: Mapping[str, Any], *, name: Optional[str] = None) -> Dict[str, Any]:
    """An in-memory RS+EPM ``{'keys', 'seed'}`` dict -> the normalised dict of :func:`load_cams`."""
    what = name or "seed dict"
    if not isinstance(obj, Mapping) or "keys" not in obj or "seed" not in obj:
        raise ValueError(f"{what}: an RS+EPM prediction is a dict with 'keys' and 'seed', got {type(obj).__name__}"
                         + (f" with keys {sorted(map(str, obj))}" if isinstance(obj, Mapping) else ""))
    k = obj["keys"]
    keys = np.asarray(k.cpu() if isinstance(k, torch.Tensor) else k).reshape(-1)
    s = obj["seed"]
    seed = np.asarray(s.detach().cpu() if isinstance(s, torch.Tensor) else s)
    if keys.size and not np.issubdtype(keys.dtype, np.integer):
        raise ValueError(f"{what}: 'keys' must be integer class ids, got {keys.dtype}")
    if seed.ndim != 3 or not np.issubdtype(seed.dtype, np.floating):
        raise ValueError(f"{what}: 'seed' must be a float (K, H, W) array, got {seed.dtype} {seed.shape}")
    check_map_size(seed.shape, what)
    K = seed.shape[0]
    raw = torch.from_numpy(keys.astype(np.int64))
    if keys.shape[0] == K + 1:
        if keys[0] != 0:
            raise ValueError(f"{what}: padded keys must start with 0 (background), got {keys.tolist()}")
        kind, label_ids, with_bg = "rsepm", raw[1:], False
    elif keys.shape[0] == K:
        kind, label_ids, with_bg = "deeplab", raw, True
    else:
        raise ValueError(
            f"{what}: len(keys) must be len(seed) + 1 (RS+EPM seeds, infer_rsepm.py) or len(seed) "
            f"(DeepLab stage, infer_seg.py), got {keys.shape[0]} keys and {K} maps"
        )
    if label_ids.numel() and (int(label_ids.min()) < 0 or int(label_ids.max()) > 254):
        raise ValueError(f"{what}: class ids must lie in 0..254, got {keys.tolist()}")
    return {
        "id": name,
        "keys": label_ids,
        "cam": torch.from_numpy(seed.astype(np.float32)),
        "includes_background": with_bg,
        "kind": kind,
        "size": tuple(seed.shape[1:]),
        "raw_keys": raw,
    }


def load_cams(path: PathLike, *, trust_pickle: bool = False) -> Dict[str, Any]:
    """One RS+EPM prediction ``experiments/predictions/<tag>/<domain>/<id>.pkl``.

    A plain pickle: ``trust_pickle=True`` is required (PermissionError otherwise). Both layouts:

    * RS+EPM seeds (``infer_rsepm.py:125-134``): ``keys`` [0, c+1, ...], ``seed`` (K, H, W)
      without background -> ``kind="rsepm"``, ``includes_background=False``.
    * DeepLab-stage predictions (``infer_seg.py:114-127``): ``len(keys) == len(seed)``, channels
      are softmax maps of class ids 0..C (0 = background when present) -> ``kind="deeplab"``,
      ``includes_background=True``.

    Returns a dict: ``id`` (file stem); ``keys`` (K,) long label id of every ``cam`` channel
    (1-based class ids, 0 for a background channel), in the file's order; ``cam`` (K, H, W)
    float32; ``includes_background``; ``kind``; ``size`` (H, W); ``raw_keys`` as stored.
    """
    obj = load_pickle(path, trust_pickle=trust_pickle, what="RS+EPM prediction (.pkl)")
    try:
        return normalize_cams(obj, name=Path(path).stem)
    except ValueError as e:
        raise file_error(path, Path(path).stem, e) from None


def iter_cams(
    folder: PathLike, *, ids: Optional[Sequence[str]] = None, trust_pickle: bool = False
) -> Iterator[Tuple[str, Dict[str, Any]]]:
    """(id, :func:`load_cams` dict) for every ``.pkl`` of a folder (sorted), or for ``ids``."""
    folder = Path(folder)
    stems = list(ids) if ids is not None else list_stems(folder, (".pkl",))
    for stem in stems:
        yield stem, load_cams(stem_path(folder, stem, ".pkl"), trust_pickle=trust_pickle)


def cams_to_label(
    cams: Mapping[str, Any],
    *,
    bg_gamma: Optional[float] = BG_GAMMA,
    bg_threshold: Optional[float] = None,
    image: Any = None,
    crf_backend: str = "torch",
) -> torch.Tensor:
    """(H, W) long mask from a :func:`load_cams` dict (or a raw ``{'keys', 'seed'}`` dict),
    following ``convert_seed_to_pseudo_masks.py:109-137``:

    * fewer than two keys in the file -> all background (``:111,132-133``);
    * RS+EPM seeds: a background map is stacked first: the constant ``bg_threshold`` when given,
      else ``(1 - max_k seed_k)^bg_gamma`` (default gamma 2; that priority is
      ``core/refinements/densecrf.py:21-31``);
    * DeepLab-stage predictions already hold their classes' softmax (upstream sets
      ``bg_gamma=None`` for them, ``:22-23``): no background is added, ``bg_*`` are unused;
    * with ``image`` ((H, W, 3) uint8 RGB of the seed's size), the dense CRF of
      ``convert_seed_to_pseudo_masks.py:77-84`` (:data:`CRF_PARAMS`, with
      :func:`mars_plugin.engines.crf.dense_crf`; ``crf_backend="pydensecrf"`` runs pydensecrf itself) runs
      on those probabilities first: upstream's default ``--mode crf``. Without ``image``, the argmax of the
      unnormalised scores (upstream's non-CRF mode, ``:125-128``, when ``bg_threshold`` is given);
    * argmax over channels (ties to the first), mapped through the keys (``:130-131``).
    """
    prepared = crf_input(cams, bg_gamma=bg_gamma, bg_threshold=bg_threshold)
    if image is None or not prepared["maps"]:
        return crf_label(prepared)
    from mars_plugin.engines.crf import dense_crf

    return crf_label(prepared, [dense_crf(np.ascontiguousarray(prepared["maps"][0].numpy()), image, CRF_PARAMS,
                                          backend=crf_backend)])


def crf_input(cams: Mapping[str, Any], *, bg_gamma: Optional[float] = BG_GAMMA,
              bg_threshold: Optional[float] = None) -> Dict[str, Any]:
    """The CRF's input by ``convert_seed_to_pseudo_masks.py:109-124``, before the CRF (see
    :func:`cams_to_label`): the probabilities [background, seeds] of RS+EPM seeds, a DeepLab
    stage's channels as they are.

    Returns ``{"kind": "probs", "maps": [(L, H, W) float32 probabilities] (empty for fewer than
    two labels: all background), "ids": (L,) label id of each channel, "size": (H, W)}``; give it
    with the CRF's marginals of ``maps`` (or None: no CRF) to :func:`crf_label`."""
    c = normalize_cams(cams) if not (isinstance(cams, Mapping) and "includes_background" in cams) else cams
    keys = torch.as_tensor(c["keys"]).long().cpu().numpy()
    cam = torch.as_tensor(c["cam"]).float().cpu().numpy()
    if cam.ndim != 3 or cam.shape[0] != keys.shape[0]:
        raise ValueError(f"cam must be (K, H, W) with K = len(keys) = {keys.shape[0]}, got {cam.shape}")
    n_raw = keys.shape[0] + (0 if c["includes_background"] else 1)
    if n_raw <= 1:
        return {"kind": "probs", "maps": [], "ids": np.zeros(1, dtype=np.int64), "size": tuple(cam.shape[1:])}
    if c["includes_background"]:
        probs, ids = cam, keys
    else:
        if bg_threshold is not None:
            bg = np.full((1,) + cam.shape[1:], float(bg_threshold), dtype=np.float32)
        elif bg_gamma is not None:
            bg = np.power(1 - np.max(cam, axis=0, keepdims=True), float(bg_gamma))
        else:
            raise ValueError("RS+EPM seeds have no background channel: give bg_gamma (default 2.0) or bg_threshold")
        probs = np.concatenate([bg, cam], axis=0)
        ids = np.concatenate([[0], keys])
    return {"kind": "probs", "maps": [torch.from_numpy(np.ascontiguousarray(probs))], "ids": ids,
            "size": tuple(cam.shape[1:])}


#: The label after the CRF (the argmax through the ids): :func:`mars_plugin.adapters.wsss._common.argmax_label`.
crf_label = argmax_label


# --------------------------------------------------------------------------- image tags, lists
def _tags_from_xml(xml_path: Path, names: Tuple[str, ...]) -> List[int]:
    try:
        root = ET.parse(os.fspath(xml_path)).getroot()
    except (OSError, ET.ParseError) as e:
        raise ValueError(f"{xml_path}: cannot read the xml annotation ({e})") from e

    def num(el: Optional[ET.Element], field: str) -> int:
        node = el.find(field) if el is not None else None
        if node is None or node.text is None:
            raise ValueError(f"{xml_path}: missing <{field}>")
        try:
            return int(node.text.strip().split(".")[0])
        except ValueError:
            raise ValueError(f"{xml_path}: <{field}> must be a number, got {node.text!r}") from None

    size = root.find("size")
    width, height = num(size, "width"), num(size, "height")
    out: List[int] = []
    for obj in root.findall("object"):  # direct <object>s only; <part><name> is not a tag
        node = obj.find("name")
        if node is None or node.text is None:
            raise ValueError(f"{xml_path}: an <object> without <name>")
        name = node.text.strip()
        box = obj.find("bndbox")
        if box is None:
            raise ValueError(f"{xml_path}: object {name!r} has no <bndbox>")
        # xml_utils.py:26-32: clamp to the image, drop boxes of zero width or height.
        x0, x1 = (max(min(num(box, f), width - 1), 0) for f in ("xmin", "xmax"))
        y0, y1 = (max(min(num(box, f), height - 1), 0) for f in ("ymin", "ymax"))
        if x1 - x0 == 0 or y1 - y0 == 0:
            continue
        if name not in names or name == names[0]:
            raise ValueError(f"{xml_path}: unknown class {name!r} (expected one of the {len(names) - 1} class names)")
        out.append(names.index(name))
    return out


def load_image_labels(
    path: PathLike, *, dataset: str = "voc", ids: Optional[Sequence[str]] = None, trust_pickle: bool = False
) -> Dict[str, torch.Tensor]:
    """{id: (C,) bool multi-hot} from RS+EPM's xml tags (index k is class k+1; C = 20 or 80).

    ``path``: the ``xml/`` folder of a domain (``<root>/train_aug/xml``), or the domain folder
    holding it. Read as ``core/abc_modules.py:111-121`` does: difficult objects are kept,
    zero-size boxes dropped, names looked up in ``data/VOC.json`` / ``data/COCO.json`` (an
    unknown name raises ValueError, where upstream raises KeyError). No pickle involved:
    ``trust_pickle`` is accepted, and ignored, so that every adapter takes the same call.
    """
    names = class_names(dataset)
    p = Path(path)
    if (p / "xml").is_dir():
        p = p / "xml"
    if not p.is_dir():
        raise ValueError(f"{p}: not a folder of xml annotations")
    stems = list(ids) if ids is not None else list_stems(p, (".xml",))
    out = {}
    for s in stems:
        xp = stem_path(p, s, ".xml")
        if not xp.is_file():
            raise ValueError(f"missing annotation {xp}")
        out[s] = multi_hot(_tags_from_xml(xp, names), len(names) - 1)
    return out


def load_image_list(path: PathLike) -> List[str]:
    """Image ids of a domain. RS+EPM has no list files: it lists ``<root>/<domain>/image/`` and
    strips ``.jpg`` (``core/abc_modules.py:71,124``). ``path`` is that domain folder or its
    ``image/`` folder (ids sorted; upstream uses ``os.listdir`` order), or a text file with one id
    (or ``<dir>/<id>.jpg``) per line."""
    p = Path(path)
    if p.is_dir():
        img = p / "image" if (p / "image").is_dir() else p
        return sorted(f.name[: -len(".jpg")] for f in img.iterdir() if f.is_file() and f.name.endswith(".jpg"))
    try:
        lines = p.read_text().splitlines()
    except OSError as e:
        raise ValueError(f"{p}: cannot read image list ({e})") from e
    return [os.path.splitext(os.path.basename(t.split()[0]))[0] for t in lines if t.strip()]


# --------------------------------------------------------------------------- writing


def write_debiased(
    labels: Iterable[Tuple[str, Any]],
    out_dir: PathLike,
    *,
    biased_value: int = BIASED_VALUE,
    dry_run: bool = False,
    dataset: str = "voc",
) -> List[Path]:
    """Write ``<out_dir>/<id>.png`` per (id, (H, W) mask with -1 = biased): P mode with the VOC
    palette, like RS+EPM's masks.

    Use ``out_dir = pseudo_label_dir('./experiments/', '<tag>@MARS')`` and
    ``Dataset_For_Segmentation(..., tag='<tag>@MARS')`` (``core/datasets.py:121-122``): biased
    pixels arrive in the loop as ``biased_value`` = 254, which
    :class:`mars_plugin.adapters.training_hook.MARSTrainingHook` maps to -1 and fills from its EMA
    teacher; a plain ``CrossEntropyLoss(ignore_index=255)`` cannot take them. Values other than
    -1, 0..C and 255 are refused (ValueError; C = 20, or 80 with ``dataset="coco"``). Atomic
    writes; ``dry_run=True`` checks the labels, writes nothing and returns the paths.
    """
    C = num_classes(dataset)
    v = check_biased_value(biased_value, C)
    hint = "" if C == COCO_NUM_CLASSES else " (COCO masks: pass dataset='coco')"
    return write_label_dir(checked_labels(labels, C, hint), out_dir, mode=LABEL_MODE, biased_value=v, dry_run=dry_run)
