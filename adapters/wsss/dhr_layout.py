"""DHR's data tree: :class:`DHRLayout` names its folders under DHR's ``--root``, :func:`read_tags`
reads a VOC-style xml as DHR does, :func:`load_image_list` lists a domain's image ids in DHR's order.
What DHR does with these files is in :mod:`mars_plugin.adapters.wsss.dhr`.

Upstream references are ``file:line`` of shjo-april/DHR at commit 94d5189; RS+EPM references
(``rsepm``) are shjo-april/RecurSeed_and_EdgePredictMix at df538e2.

Data tree (verified upstream)
-----------------------------
``root`` is DHR's ``--root`` (``../`` by default, ``train.py:365``: the folder *above* the DHR
checkout, ``README.md:80-138``). :class:`DHRLayout` names every path:

* ``<root>/<data>/<domain>/{image,mask,xml}/``: images ``<id>.jpg``, ground-truth masks
  ``<id>.png``, VOC-style tags ``<id>.xml`` (``core/datasets.py:28-30,37-40``). VOC2012 domains
  are ``train_aug`` and ``validation`` (RS+EPM's layout; ``README.md:128-138``).
* ``<root>/<data>/<data>.json``: the dataset json (``train.py:80``), not in the repository (it
  comes with DHR's dataset downloads, ``README.md:58-78``). DHR reads two keys:
  ``names`` (class names, background first for VOC) and ``ignore`` (the ignore byte);
  ``tools/data_utils.py:6-14``. Nothing else (the palette is computed, ``tools/cv_utils.py:55-76``).
* Image ids: ``os.listdir(<domain>/image/)`` (``tools/io_utils.py:25-27``: *unsorted*, every
  entry, no extension filter), ``.jpg`` stripped (``core/datasets.py:33,37``). Any other entry in
  ``image/`` breaks DHR (it is opened as an image and looked up as ``<name>.xml``);
  :meth:`DHRLayout.ids` refuses it, naming it. Training and validation then drop the images
  whose xml has no object (``reject_empty_tags``, ``core/datasets.py:34,48-61,67``).
* Tags: ``tools/xml_utils.py:6-9`` ``read_tags``: the ``<name>`` text of every direct
  ``<object>``, de-duplicated (``np.unique``: sorted), **no** filtering: difficult objects and
  zero-size boxes count, names are not stripped. (RS+EPM's reader drops zero-size boxes and
  strips names, ``rsepm._tags_from_xml``; use this module's reader for DHR's tree.) Names map
  through the json's ``names``, and ``background`` is dropped from the multi-hot
  (``core/datasets.py:7-12,96-97``).
* WSS masks: ``../WSS/<data>/<method>/<domain>/<id>.png`` (``core/datasets.py:66,89``) -- a
  path **relative to the working directory**, not to ``--root``. DHR runs from its checkout with
  ``--root ../``, so that is ``<root>/WSS/<data>/<method>/<domain>/``
  (:meth:`DHRLayout.wss_dir`); with another ``--root`` the masks are still read from
  ``<cwd>/../WSS/``. (The README's tree, ``README.md:90-102``, stops at ``<method>/``; the code
  adds ``<domain>/``.) Read with ``Image.open`` (``core/datasets.py:39``), resized with NEAREST
  (``tools/transforms.py:50,99``), turned into ``np.asarray(mask, dtype=np.int64)``
  (``tools/transforms.py:252-253``): the stored palette indices are the class ids, and a mask
  must have its image's size (image and mask are resized and cropped together,
  ``tools/transforms.py:93-101,211-227``).
* USS features: ``<root>/<data>/<domain>/<USS>/<id>.pt`` (``core/datasets.py:90,94``), one
  ``torch.save`` of an fp16 (C, h, w) tensor per image (``produce_uss_features.py:26,33-34,49``).
* DHR's own predictions: ``./experiments/results/<data>/<tag>@<checkpoint>/<domain>/<id>.png``
  (P mode, ``produce_wss_masks.py:73-75,96``), through a temporary ``<id>.pt`` of
  ``{'keys': int64 (K,), 'masks': fp16 (K, H, W)}`` (the softmax of every class reaching 0.05,
  ``produce_wss_masks.py:41-48,136``) that the CRF step deletes (``:56-77``).
"""
from __future__ import annotations

import json
import os
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

from mars_plugin._checks import MAX_NUM_CLASSES, RESERVED_REASON
from mars_plugin.formats.files import IGNORE_VALUE, check_stem

from mars_plugin.adapters.wsss._common import VOC_CLASSES

__all__ = [
    "CLASS_NAMES",
    "IGNORE",
    "DHRLayout",
    "read_tags",
    "load_image_list",
]

PathLike = Union[str, os.PathLike]

#: VOC 2012's 21 names, background first: what the VOC2012.json ``names`` hold.
CLASS_NAMES: Tuple[str, ...] = VOC_CLASSES
#: DHR's ignore byte: hard-coded at ``train.py:122,149`` and ``tools/transforms.py:176``.
IGNORE = IGNORE_VALUE


# --------------------------------------------------------------------------- the data tree
@dataclass(frozen=True)
class DHRLayout:
    """DHR's folders under ``root`` (its ``--root``) for dataset ``data`` (its ``--data``).

    Paths only; nothing is read until a method needs it. ``domain`` is ``train_aug`` or
    ``validation`` for VOC2012 (``train``/``validation`` for DHR's other sets).
    """

    root: Path
    data: str = "VOC2012"

    def __post_init__(self) -> None:
        if not isinstance(self.root, (str, os.PathLike)):
            raise ValueError(f"root must be a path (DHR's --root), got {type(self.root).__name__}")
        object.__setattr__(self, "root", Path(self.root))
        check_stem(self.data)

    # ---- paths
    def domain_dir(self, domain: str) -> Path:
        """``<root>/<data>/<domain>/`` (``core/datasets.py:28-31``)."""
        return self.root / self.data / check_stem(domain)

    def image_dir(self, domain: str = "train_aug") -> Path:
        """``<root>/<data>/<domain>/image/``: ``<id>.jpg`` (``core/datasets.py:28``)."""
        return self.domain_dir(domain) / "image"

    def mask_dir(self, domain: str = "train_aug") -> Path:
        """``<root>/<data>/<domain>/mask/``: ground-truth ``<id>.png`` (``core/datasets.py:29``)."""
        return self.domain_dir(domain) / "mask"

    def xml_dir(self, domain: str = "train_aug") -> Path:
        """``<root>/<data>/<domain>/xml/``: tags ``<id>.xml`` (``core/datasets.py:30``)."""
        return self.domain_dir(domain) / "xml"

    def uss_dir(self, domain: str = "train_aug", uss: str = "STEGO") -> Path:
        """``<root>/<data>/<domain>/<uss>/``: fp16 ``<id>.pt`` (C, h, w) USS features
        (``core/datasets.py:90``, ``produce_uss_features.py:49``; ``--uss``)."""
        return self.domain_dir(domain) / check_stem(uss)

    def wss_dir(self, method: str = "MARS", domain: str = "train_aug") -> Path:
        """``<root>/WSS/<data>/<method>/<domain>/``: the masks ``train.py --wss <method>`` reads,
        as ``../WSS/...`` from DHR's working directory (``core/datasets.py:89``)."""
        return self.root / "WSS" / self.data / check_stem(method) / check_stem(domain)

    @property
    def dataset_json(self) -> Path:
        """``<root>/<data>/<data>.json`` (``train.py:80``)."""
        return self.root / self.data / f"{self.data}.json"

    # ---- the json
    def _json(self) -> Optional[Dict[str, Any]]:
        p = self.dataset_json
        if not p.is_file():
            return None
        try:
            d = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{p}: cannot read the dataset json ({e})") from e
        if not isinstance(d, dict):
            raise ValueError(f"{p}: the dataset json must be an object with 'names' and 'ignore', got {type(d).__name__}")
        missing = [k for k in ("names", "ignore") if k not in d]
        if missing:  # tools/data_utils.py:11-12 reads both
            raise ValueError(f"{p}: the dataset json has no {missing} (DHR reads 'names' and 'ignore', tools/data_utils.py:11-12)")
        # Checked with the json, not only by ignore_value(): whoever reads the names (mars
        # reproduce, load_image_labels) must refuse the json that write_masks refuses.
        v = d["ignore"]
        if isinstance(v, bool) or not isinstance(v, int) or v != IGNORE:
            raise ValueError(f"{p}: 'ignore' is {v!r}; DHR's train.py also treats 255 as ignore "
                             "(train.py:122,149; tools/transforms.py:176), so only 255 is consistent")
        return d

    def class_names(self, num_classes: Optional[int] = None) -> Tuple[str, ...]:
        """Class names, background first: the json's ``names`` when the json exists, else VOC's
        21 names (only for ``data="VOC2012"``; any other set needs its json).

        ``num_classes`` (C, foreground classes), when given, must match: a json with another
        count is a ValueError naming it. A json whose first name is not ``background`` is
        refused: MARS labels are 0 = background, 1..C (DHR's sets without background are not
        supported here); so is one of more than 254 names (C <= 253: 254 and 255 are the biased
        and ignore bytes), and one whose ``ignore`` is not 255 (see :meth:`ignore_value`).
        """
        d = self._json()
        if d is None:
            if self.data != "VOC2012":
                raise ValueError(f"{self.dataset_json}: no dataset json; DHR reads the class names of {self.data!r} "
                                 "from it (train.py:80); only VOC2012's are known without it")
            names: Tuple[str, ...] = CLASS_NAMES
            where = "VOC's class names (no dataset json found)"
        else:
            raw = d["names"]
            if not isinstance(raw, list) or not raw or not all(isinstance(n, str) for n in raw):
                raise ValueError(f"{self.dataset_json}: 'names' must be a non-empty list of strings, got {raw!r:.80}")
            if len(set(raw)) != len(raw):
                raise ValueError(f"{self.dataset_json}: 'names' repeats a name")
            if raw[0] != "background":
                raise ValueError(f"{self.dataset_json}: 'names' must start with 'background' (MARS labels are "
                                 f"0 = background, 1..C), got {raw[0]!r}")
            if len(raw) - 1 > MAX_NUM_CLASSES:
                raise ValueError(f"{self.dataset_json}: 'names' holds {len(raw)} names = background + {len(raw) - 1} "
                                 f"classes, but {RESERVED_REASON}")
            names = tuple(raw)
            where = f"{self.dataset_json} 'names'"
        if num_classes is not None and len(names) - 1 != num_classes:
            raise ValueError(f"{where}: {len(names)} names = background + {len(names) - 1} classes, "
                             f"but num_classes={num_classes}")
        return names

    def ignore_value(self) -> int:
        """The json's ``ignore`` (255 without a json). Anything but 255 is a ValueError: DHR
        itself hard-codes 255 next to it (``train.py:122,149``, ``tools/transforms.py:176``)."""
        d = self._json()  # refuses any other 'ignore'
        return IGNORE if d is None else int(d["ignore"])

    # ---- ids
    def ids(self, domain: str = "train_aug", *, tagged_only: bool = True, sort: bool = False) -> List[str]:
        """Image ids of ``domain`` in DHR's order: ``os.listdir(image_dir)`` (unsorted,
        ``tools/io_utils.py:25-27``) with ``.jpg`` stripped (``core/datasets.py:37``).

        ``tagged_only`` (default) keeps only ids whose xml names an object, as DHR's training
        and validation datasets do (``reject_empty_tags``, ``core/datasets.py:34,48-61,67``);
        ``False`` gives every image (``produce_uss_features.py:50``; the ``test`` domain has no
        xml). ``sort=True`` sorts them. Anything in ``image/`` that is not a ``<id>.jpg`` file
        is a ValueError naming it: DHR would open it as an image.
        """
        ids = load_image_list(self.image_dir(domain), sort=sort)
        if tagged_only:
            xml = self.xml_dir(domain)
            ids = [i for i in ids if read_tags(xml / f"{i}.xml")]
        return ids


# --------------------------------------------------------------------------- tags, ids
def read_tags(xml_path: PathLike) -> List[str]:
    """Sorted unique object names of one VOC-style xml, as ``tools/xml_utils.py:6-9``: every
    direct ``<object>``'s ``<name>`` text, difficult or not, whatever its box, unstripped.

    Shape: a list of K <= #objects names. An unreadable file, or an object without a name, is a
    ValueError naming the file (upstream: an exception from ElementTree or ``None.text``). Any
    failure of the parser counts: besides OSError and ParseError, an unknown ``encoding=`` in the
    declaration raises LookupError and a bad byte for a known one UnicodeDecodeError.
    """
    p = os.fspath(xml_path)
    try:
        root = ET.parse(p).getroot()
    except Exception as e:  # noqa: BLE001 -- whatever the parser raises, the file is unreadable
        why = str(e) if isinstance(e, (OSError, ET.ParseError)) else f"{type(e).__name__}: {e}"
        raise ValueError(f"{p}: cannot read the xml annotation ({why})") from e
    names = []
    for obj in root.findall("object"):  # direct <object>s only; a <part><name> is not a tag
        node = obj.find("name")
        if node is None or node.text is None:
            raise ValueError(f"{p}: an <object> without a <name> text")
        names.append(node.text)
    return sorted(set(names))  # == list(np.unique(names)) for strings


def load_image_list(path: PathLike, *, sort: bool = False) -> List[str]:
    """Image ids of a DHR domain: ``path`` is the domain folder or its ``image/`` folder, listed
    as DHR lists it (``os.listdir``, ``tools/io_utils.py:25-27``; ``sort=True`` sorts), ``.jpg``
    stripped (``core/datasets.py:37``); or a text file with one id (or ``<dir>/<id>.jpg``) per
    line, in its order.

    Shape: a list of N ids. A folder entry that is not a ``<id>.jpg`` file is a ValueError
    naming it (DHR would open it as an image and fail on ``<name>.xml``).
    """
    p = Path(path)
    if p.is_dir():
        img = p / "image" if (p / "image").is_dir() else p
        ids = []
        for name in os.listdir(img):
            if not (name.endswith(".jpg") and (img / name).is_file()) or ".jpg" in name[:-4]:
                # core/datasets.py:37 replaces every '.jpg'; 'a.jpg.jpg' would be id 'a'
                raise ValueError(f"{img / name}: DHR reads every entry of {img} as an image <id>.jpg "
                                 "(tools/io_utils.py:25-27, core/datasets.py:33-40); move it out of that folder")
            ids.append(name[: -len(".jpg")])
        return sorted(ids) if sort else ids
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise ValueError(f"{p}: cannot read the image list ({e})") from e
    return [os.path.splitext(os.path.basename(t.split()[0]))[0] for t in lines if t.strip()]
