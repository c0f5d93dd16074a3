"""DHR (Jo et al., ECCV 2024, "Dual Features-Driven Hierarchical Rebalancing") adapter: the MARS
authors' follow-up, whose ``train.py`` trains on MARS masks by default (``--wss MARS``,
``train.py:366``). Names DHR's folders, reads its tags, masks and predictions, and writes WSS
masks DHR can train on and debiased labels for the MARS training hook.

Upstream references are ``file:line`` of shjo-april/DHR at commit 94d5189; RS+EPM references
(``rsepm``) are shjo-april/RecurSeed_and_EdgePredictMix at df538e2. The recipe (RS+EPM pseudo
labels -> ``mars features/centroids/debias`` -> MARS masks -> ``train.py --wss MARS``) is in
docs/adapters.md, "DHR: RS+EPM pseudo labels -> MARS -> DHR train.py --wss MARS".

DHR's data tree, :class:`DHRLayout` (which names every path), the tag reader :func:`read_tags` and
the image listing :func:`load_image_list` are in :mod:`mars_plugin.adapters.wsss.dhr_layout`; this
module uses them and, as every WSSS adapter, offers them under its own name.

What DHR does with 255, and why a biased pixel must become 255 (not 254)
--------------------------------------------------------------------------
DHR's ignore byte is 255, partly hard-coded: the prototype functions skip only 255
(``train.py:122,149``), the crop pads masks with 255 (``tools/transforms.py:176,223``), the loss
ignores ``dataset.ignore`` (``train.py:95``). A 254 in a WSS mask is none of these: a feature
cell whose majority is 254 makes a prototype of "class 254" (``train.py:146-155``), which then goes
through the class mapping at ``train.py:291,318`` (an index 254 into 21 classes) and, had it
reached the loss, ``CrossEntropyLoss`` raises ``IndexError: Target 254 is out of bounds``
(CPU; a device-side assert on CUDA). So :func:`write_masks` writes -1 (biased) as 255 by default
(``biased="refuse"`` makes -1 an error instead) and refuses every value but 0..C and 255.
Note that 255 inside the image is not simply ignored by DHR: step 1 overwrites the crop with
confident CAM seeds (``train.py:255-261``) and step 3 assigns the whole crop box from its
rebalanced prototypes (``train.py:318-322``); only the crop padding stays 255 for the loss. A
biased pixel written as 255 is therefore excluded from DHR's prototypes and relabelled by DHR.
:func:`write_debiased` (254) is for a training loop with
:class:`mars_plugin.adapters.MARSTrainingHook`, never for ``--wss``.

USS patch size
--------------
``produce_uss_vectors(f_us, mask, patch_size=14)`` (``train.py:129-155``) uses ``patch_size``
only to pad the mask's size up to a multiple of it before a nearest resize (``:133-137``); the
cell windows come from the feature grid itself (``pw, ph = iw // fw, ih // fh``, ``:139-146``).
STEGO's ViT-B/8 features (``core/uss/models.py:39-53``: DINO ViT-B/8, 70-d codes) therefore run
as is: for a 512 crop, 14 stretches the mask to 518 and the cells are taken on the stretched
mask at the same relative positions, so their bounds move by 1-2 pixels of the crop (computed
for grids of 37 to 128 cells); ``patch_size=8`` there would make that resize the identity. No other line of
``train.py`` depends on the feature size or dimension.

Not runnable as released
------------------------
DHR's ``train.py`` at 94d5189 stops on its first batch whatever the masks: ``args.dataset``
(``train.py:291,318``) is never defined (the parser, ``train.py:361-373``, has no ``dataset``;
``AttributeError``), and ``collate`` stacks the per-image USS features (``train.py:37``), whose
(h, w) follow each image's own size (``produce_uss_features.py:32-34``), so a batch of images of
different sizes fails in ``torch.stack``. The files this module writes are the files its readers
read; running its training needs those lines fixed upstream.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from mars_plugin._checks import MAX_NUM_CLASSES, RESERVED_REASON, check_num_classes
from mars_plugin.engines.crf_params import CRF_PRESETS
from mars_plugin.formats.files import BIASED_VALUE, check_stem, list_stems, stem_path

from mars_plugin.adapters.wsss._common import (
    argmax_label,
    check_biased_value,
    check_map_size,
    checked_labels,
    file_error,
    iter_label_dir,
    multi_hot,
    write_label_dir,
)
from mars_plugin.adapters.wsss.dhr_layout import CLASS_NAMES, IGNORE, DHRLayout, load_image_list, read_tags
from mars_plugin.adapters.uss.vit_weights import load_checkpoint

__all__ = [
    "NAME",
    "CLASS_NAMES",
    "NUM_CLASSES",
    "LABEL_MODE",
    "IGNORE",
    "CRF_PARAMS",
    "crf_input",
    "crf_label",
    "PROB_THRESHOLD",
    "DHRLayout",
    "read_tags",
    "load_pseudo_labels",
    "normalize_cams",
    "load_cams",
    "iter_cams",
    "cams_to_label",
    "load_image_labels",
    "load_image_list",
    "write_masks",
    "write_debiased",
]

PathLike = Union[str, os.PathLike]

NAME = "dhr"
#: Foreground classes C (VOC); labels are 0..C.
NUM_CLASSES = 20
#: WSS masks and DHR's predictions are P-mode PNGs (``produce_wss_masks.py:73-75``).
LABEL_MODE = "P"
#: ``DenseCRF(for_seg=True)`` with its defaults (``core/refinements/densecrf.py:10``,
#: ``train.py:99``, ``produce_wss_masks.py:115``): the package's ``"mars"`` preset.
CRF_PARAMS: Dict[str, float] = dict(CRF_PRESETS["mars"])
#: Classes whose softmax reaches this somewhere are kept in the prediction ``.pt``
#: (``produce_wss_masks.py:42,136``).
PROB_THRESHOLD = 0.05

_BIASED_MODES = ("ignore", "refuse")


# --------------------------------------------------------------------------- tags, ids
def _json_beside_xml(xml_dir: Path) -> Optional[DHRLayout]:
    """The layout of ``<root>/<data>/<domain>/xml`` when ``<root>/<data>/<data>.json`` exists."""
    data_dir = xml_dir.resolve().parent.parent
    if (data_dir / f"{data_dir.name}.json").is_file():
        return DHRLayout(data_dir.parent, data_dir.name)
    return None


def load_image_labels(
    path: Union[PathLike, DHRLayout],
    *,
    domain: str = "train_aug",
    class_names: Optional[Sequence[str]] = None,
    ids: Optional[Sequence[str]] = None,
    trust_pickle: bool = False,
) -> Dict[str, torch.Tensor]:
    """{id: (C,) bool multi-hot} of DHR's xml tags (index k is class k+1), read with
    :func:`read_tags` and mapped like ``core/datasets.py:7-12,96-97`` (a ``background`` tag
    sets nothing).

    ``path``: a :class:`DHRLayout` (tags of ``layout.xml_dir(domain)`` for every image id,
    names from ``layout.class_names()``), or an ``xml/`` folder, or the domain folder holding
    it (every ``.xml``, sorted). Class names: ``class_names`` when given; else the dataset
    json ``<root>/<data>/<data>.json`` found two levels above the ``xml/`` folder; else VOC's.
    An unknown name is a ValueError naming the file (upstream: a KeyError).

    Images without any tag get an all-False vector; DHR itself drops them
    (``reject_empty_tags``, ``core/datasets.py:48-61``; :meth:`DHRLayout.ids`). No pickle
    involved: ``trust_pickle`` is accepted, and ignored, so that every adapter takes one call.
    """
    if isinstance(path, DHRLayout):
        xml = path.xml_dir(domain)
        names = tuple(class_names) if class_names is not None else path.class_names()
        stems = list(ids) if ids is not None else path.ids(domain, tagged_only=False, sort=True)
    else:
        xml = Path(path)
        if (xml / "xml").is_dir():
            xml = xml / "xml"
        if not xml.is_dir():
            raise ValueError(f"{xml}: not a folder of xml annotations (DHR: <root>/<data>/<domain>/xml)")
        if class_names is not None:
            names = tuple(class_names)
        else:
            layout = _json_beside_xml(xml)
            names = layout.class_names() if layout is not None else CLASS_NAMES
        stems = list(ids) if ids is not None else list_stems(xml, (".xml",))
    if len(names) < 2 or names[0] != "background":
        raise ValueError(f"class_names must be background first, then the C classes, got {list(names)[:3]}...")
    index = {n: k for k, n in enumerate(names)}
    C = len(names) - 1
    out = {}
    for s in stems:
        xp = xml / f"{check_stem(s)}.xml"
        if not xp.is_file():
            raise ValueError(f"{xp}: missing annotation ({'a folder' if xp.is_dir() else 'no such file'})")
        found = []
        for n in read_tags(xp):
            if n not in index:
                raise ValueError(f"{xp}: unknown class {n!r} (expected one of the {C} class names"
                                 + (", unstripped as DHR reads them)" if n.strip() in index else ")"))
            if index[n] > 0:  # core/datasets.py:96-97: the background entry is dropped
                found.append(index[n])
        out[s] = multi_hot(found, C)
    return out


# --------------------------------------------------------------------------- masks
def load_pseudo_labels(path_or_dir: PathLike, *, ids: Optional[Sequence[str]] = None) -> Iterator[Tuple[str, torch.Tensor]]:
    """(id, (H, W) long mask) of a WSS folder ``<root>/WSS/<data>/<method>/<domain>/``
    (:meth:`DHRLayout.wss_dir`; e.g. ``method="RSEPM"``), of DHR's predictions, or one PNG.

    The palette indices are the class ids (0 background, 1..C, 255 ignore), returned as stored,
    as ``np.asarray(Image.open(p), dtype=np.int64)`` (``core/datasets.py:39``,
    ``tools/transforms.py:252-253``). Sorted ids, or exactly ``ids`` in their order.
    """
    p = Path(path_or_dir)
    if p.is_file():
        if ids is not None:
            raise ValueError(f"ids can only be given with a folder, got the file {p}")
        yield from iter_label_dir(p.parent, ids=[p.stem], skip_suffixes=())
        return
    if not p.is_dir():
        raise ValueError(f"{p}: no such file or folder of DHR masks (<root>/WSS/<data>/<method>/<domain>/)")
    yield from iter_label_dir(p, ids=ids, skip_suffixes=())


def _check_num_classes(num_classes: Any, what: str = "num_classes") -> int:
    if isinstance(num_classes, bool) or not isinstance(num_classes, (int, np.integer)):
        raise ValueError(f"{what} must be an integer C in 1..{MAX_NUM_CLASSES} ({RESERVED_REASON}), got {num_classes!r}")
    return check_num_classes(int(num_classes), what)


def _target(layout_or_dir: Union[DHRLayout, PathLike], method: str, domain: str,
            num_classes: Optional[int]) -> Tuple[Path, int, Optional[DHRLayout]]:
    if isinstance(layout_or_dir, DHRLayout):
        layout = layout_or_dir
        layout.ignore_value()  # a json whose ignore is not 255 is refused before anything is written
        C = len(layout.class_names(None if num_classes is None else _check_num_classes(num_classes))) - 1
        return layout.wss_dir(method, domain), C, layout
    if not isinstance(layout_or_dir, (str, os.PathLike)):
        raise ValueError(f"layout_or_dir must be a DHRLayout or a folder, got {type(layout_or_dir).__name__}")
    return Path(layout_or_dir), _check_num_classes(NUM_CLASSES if num_classes is None else num_classes), None


def write_masks(
    items: Iterable[Tuple[str, Any]],
    layout_or_dir: Union[DHRLayout, PathLike],
    method: str = "MARS",
    domain: str = "train_aug",
    *,
    num_classes: Optional[int] = None,
    biased: str = "ignore",
    check_sizes: bool = True,
    dry_run: bool = False,
) -> List[Path]:
    """Write WSS masks where ``train.py --wss <method>`` reads them: ``<id>.png`` per (id,
    (H, W) integer label) in ``layout.wss_dir(method, domain)`` (or in the folder given),
    P mode with the VOC palette, atomically, so that DHR's ``Image.open`` +
    ``np.asarray(..., np.int64)`` (``core/datasets.py:39``, ``tools/transforms.py:252-253``)
    reads the class ids back.

    Values: 0..C and 255 are written as they are. -1 (biased, as :func:`mars_plugin.debias_labels`
    returns it) becomes 255 with ``biased="ignore"`` (default): DHR cannot take 254 (see the
    module docstring: a "class 254" prototype and an out-of-range target); ``biased="refuse"``
    makes -1 a ValueError. Anything else (254 included) is a ValueError naming the id.

    C: from a layout, its class names (json, or VOC's 20 without one; ``num_classes`` must
    agree); for a folder, ``num_classes`` (default 20). ``method``/``domain`` apply to a layout
    only. With a layout and ``check_sizes``, each mask must have its image's size (read from
    the ``.jpg`` header when the image exists): DHR resizes and crops image and mask together
    (``tools/transforms.py:93-101,211-227``). An id that is not a plain file name is refused
    (:func:`mars_plugin.formats.files.check_stem`), in a dry run too. ``dry_run=True`` checks
    everything, writes nothing and returns the paths.
    """
    if biased not in _BIASED_MODES:
        raise ValueError(f"biased must be one of {_BIASED_MODES}, got {biased!r}")
    out, C, layout = _target(layout_or_dir, method, domain, num_classes)
    hint = f" (DHR's WSS masks hold 0..{C} and 255; 254 debiased labels are read back with files.read_label, 254 -> -1)"

    def checked() -> Iterator[Tuple[str, torch.Tensor]]:
        for stem, t in checked_labels(items, C, hint):
            check_stem(stem)
            if biased == "refuse" and bool((t == -1).any()):
                raise ValueError(f"label of {stem} holds -1 (biased) and biased='refuse'; pass biased='ignore' "
                                 "to write them as 255, DHR's ignore")
            if layout is not None and check_sizes:
                _check_size(layout.image_dir(domain) / f"{stem}.jpg", t.shape, stem)
            yield stem, t

    return write_label_dir(checked(), out, mode=LABEL_MODE, biased_value=IGNORE, dry_run=dry_run)


def _check_size(image_path: Path, shape: Tuple[int, ...], stem: str) -> None:
    if not image_path.is_file():
        return
    from PIL import Image

    try:
        with Image.open(image_path) as im:  # the header only
            w, h = im.size
    except OSError as e:
        raise ValueError(f"{image_path}: cannot read the image size ({e})") from e
    if (h, w) != tuple(shape):
        raise ValueError(f"label of {stem} is {tuple(shape)} (H, W) but {image_path} is ({h}, {w}); DHR resizes "
                         "and crops image and mask together, so the mask needs the image's size")


def write_debiased(
    labels: Iterable[Tuple[str, Any]],
    out_dir: PathLike,
    *,
    biased_value: int = BIASED_VALUE,
    dry_run: bool = False,
    num_classes: int = NUM_CLASSES,
) -> List[Path]:
    """Write debiased labels ``<out_dir>/<id>.png`` per (id, (H, W) mask with -1 = biased), P
    mode with the VOC palette, biased pixels as ``biased_value`` (254), as
    :func:`mars_plugin.adapters.wsss.rsepm.write_debiased`.

    For a training loop with :class:`mars_plugin.adapters.MARSTrainingHook` (which maps 254 to
    -1 and fills it from its EMA teacher), **not** for DHR's ``--wss``: DHR cannot take 254 (use
    :func:`write_masks`). Values other than -1, 0..C and 255 are refused. Atomic writes;
    ``dry_run=True`` checks the labels, writes nothing and returns the paths.
    """
    C = _check_num_classes(num_classes)
    v = check_biased_value(biased_value, C)
    return write_label_dir(checked_labels(labels, C), out_dir, mode=LABEL_MODE, biased_value=v, dry_run=dry_run)


# --------------------------------------------------------------------------- predictions (.pt)
def normalize_cams(obj: Mapping[str, Any], *, name: Optional[str] = None) -> Dict[str, Any]:
    """An in-memory DHR ``{'keys', 'masks'}`` dict -> the normalised dict of :func:`load_cams`."""
    what = name or "prediction dict"
    if not isinstance(obj, Mapping) or "keys" not in obj or "masks" not in obj:
        raise ValueError(f"{what}: a DHR prediction is a dict with 'keys' and 'masks' (produce_wss_masks.py:48), got "
                         + (f"keys {sorted(map(str, obj))}" if isinstance(obj, Mapping) else type(obj).__name__))
    k, m = obj["keys"], obj["masks"]
    keys = np.asarray(k.cpu() if isinstance(k, torch.Tensor) else k).reshape(-1)
    masks = np.asarray(m.detach().cpu() if isinstance(m, torch.Tensor) else m)
    if keys.size and not np.issubdtype(keys.dtype, np.integer):
        raise ValueError(f"{what}: 'keys' must be integer class ids, got {keys.dtype}")
    if masks.ndim != 3 or not np.issubdtype(masks.dtype, np.floating):
        raise ValueError(f"{what}: 'masks' must be a float (K, H, W) array, got {masks.dtype} {masks.shape}")
    check_map_size(masks.shape, what)
    if keys.shape[0] != masks.shape[0]:
        raise ValueError(f"{what}: len(keys) must equal len(masks) (one softmax map per class), got "
                         f"{keys.shape[0]} keys and {masks.shape[0]} maps")
    if keys.size and (int(keys.min()) < 0 or int(keys.max()) > 253):
        raise ValueError(f"{what}: class ids must lie in 0..253, got {keys.tolist()}")
    return {
        "id": name,
        "keys": torch.from_numpy(keys.astype(np.int64)),
        "cam": torch.from_numpy(masks.astype(np.float32)),
        "includes_background": True,  # softmax maps of class ids; nothing is added (for_seg=True)
        "kind": "dhr",
        "size": tuple(masks.shape[1:]),
        "raw_keys": torch.from_numpy(keys.astype(np.int64)),
    }


def load_cams(path: PathLike, *, trust_pickle: bool = False) -> Dict[str, Any]:
    """One DHR prediction ``./experiments/results/<data>/<tag>@<ckpt>/<domain>/<id>.pt``
    (``produce_wss_masks.py:41-48``): ``{'keys': int64 (K,), 'masks': fp16 (K, H, W)}``, the
    softmax of the K classes (background 0 included when it reaches 0.05) of the multi-scale
    DeepLab prediction. The CRF step deletes it (``produce_wss_masks.py:77``): keep it by
    stopping after the inference step.

    Read with ``torch.load(weights_only=True)`` (:func:`mars_plugin.adapters.uss.vit_weights.load_checkpoint`);
    DHR's own files hold numpy arrays, which that loader refuses: then ``trust_pickle=True`` is
    required (PermissionError otherwise; a file torch cannot read at all is a ValueError).

    Returns a dict: ``id`` (file stem); ``keys`` (K,) long class id of every ``cam`` channel;
    ``cam`` (K, H, W) float32; ``includes_background`` True (nothing is added); ``kind``
    ``"dhr"``; ``size`` (H, W); ``raw_keys`` as stored.
    """
    obj = load_checkpoint(path, trust_pickle=trust_pickle, what="DHR prediction (.pt)")
    try:
        return normalize_cams(obj, name=Path(path).stem)
    except ValueError as e:
        raise file_error(path, Path(path).stem, e) from None


def iter_cams(
    folder: PathLike, *, ids: Optional[Sequence[str]] = None, trust_pickle: bool = False
) -> Iterator[Tuple[str, Dict[str, Any]]]:
    """(id, :func:`load_cams` dict) for every ``.pt`` of a folder (sorted), or for ``ids``."""
    folder = Path(folder)
    stems = list(ids) if ids is not None else list_stems(folder, (".pt",))
    for stem in stems:
        yield stem, load_cams(stem_path(folder, stem, ".pt"), trust_pickle=trust_pickle)


def cams_to_label(cams: Mapping[str, Any], *, image: Any = None, crf_backend: str = "torch") -> torch.Tensor:
    """(H, W) long mask from a :func:`load_cams` dict (or a raw ``{'keys', 'masks'}`` dict), as
    ``produce_wss_masks.py:56-71``:

    * with ``image`` ((H', W', 3) uint8 RGB), the maps are resized to it when their size
      differs (bilinear, ``align_corners=True``: ``tools/torch_utils.py:45``,
      ``produce_wss_masks.py:64-67``), then the dense CRF of ``DenseCRF(for_seg=True)``
      (:data:`CRF_PARAMS`; the stored probabilities are the unary, nothing is added) runs on
      them (``crf_backend="pydensecrf"`` runs pydensecrf itself); upstream passes the
      de-normalised tensor (``tools/transforms.py:259-271``), which can differ from the file's
      RGB by one grey level;
    * without ``image``, the argmax of the stored probabilities (no CRF);
    * argmax over channels (ties to the first), mapped through ``keys`` (``:70-71``).

    A prediction without any class (K = 0) is a ValueError (upstream's argmax fails on it).
    """
    rgb = None
    if image is not None:
        rgb = np.asarray(image)
        if rgb.ndim != 3 or rgb.shape[2] != 3:
            raise ValueError(f"image must be (H, W, 3) RGB, got shape {rgb.shape}")
    prepared = crf_input(cams, image_size=None if rgb is None else tuple(rgb.shape[:2]))
    if rgb is None:
        return crf_label(prepared)
    from mars_plugin.engines.crf import dense_crf

    return crf_label(prepared, [dense_crf(np.ascontiguousarray(prepared["maps"][0].numpy()), rgb, CRF_PARAMS,
                                          backend=crf_backend)])


def crf_input(cams: Mapping[str, Any], *, image_size: Optional[Tuple[int, int]] = None) -> Dict[str, Any]:
    """The CRF's input by ``produce_wss_masks.py:56-67``, before the CRF (see :func:`cams_to_label`):
    the stored probabilities, resized to ``image_size`` (H, W) when given and different
    (bilinear, ``align_corners=True``).

    Returns ``{"kind": "probs", "maps": [(L, H, W) float32 probabilities], "ids": (L,) class id of
    each channel, "size": (H, W)}``; give it with the CRF's marginals of ``maps`` (or None: no
    CRF) to :func:`crf_label`."""
    c = normalize_cams(cams) if not (isinstance(cams, Mapping) and "includes_background" in cams) else cams
    keys = torch.as_tensor(c["keys"]).long().cpu()
    cam = torch.as_tensor(c["cam"]).float().cpu()
    if cam.ndim != 3 or cam.shape[0] != keys.shape[0]:
        raise ValueError(f"cam must be (K, H, W) with K = len(keys) = {keys.shape[0]}, got {tuple(cam.shape)}")
    if keys.numel() == 0:
        raise ValueError(f"{c.get('id') or 'prediction'}: no class in the prediction (K = 0)")
    if image_size is not None and tuple(image_size) != tuple(cam.shape[1:]):
        cam = torch.nn.functional.interpolate(cam[None], size=tuple(image_size), mode="bilinear",
                                              align_corners=True)[0]
    return {"kind": "probs", "maps": [cam], "ids": keys.numpy(), "size": tuple(cam.shape[1:])}


#: The mask after the CRF, the argmax through the keys (``produce_wss_masks.py:70-71``):
#: :func:`mars_plugin.adapters.wsss._common.argmax_label`.
crf_label = argmax_label
