"""Folder jobs behind the ``mars`` command line: centroids, debias, evaluate, report.

Each job reads the disk layout of :mod:`mars_plugin.formats.files`, streams one image at a time, shows a
progress bar, writes every output atomically, and treats a bad input file according to
``on_error``: ``"stop"`` raises a :class:`JobError` naming the file, ``"skip"`` reports it and
goes on (the summary lists every skipped file).

Under torch.distributed (``torchrun``) each job works on its strided shard of the images;
:mod:`mars_plugin.commands.distributed` lets the ranks meet and learn that one of them failed
(no-ops in one process). Errors and summaries: :mod:`mars_plugin.commands.errors`.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import pickle
import re
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from mars_plugin._checks import (
    MAX_BATCH_SIZE,
    MAX_EXAMPLES,
    MAX_K,
    MAX_PER_CLASS,
    MAX_WORKERS,
    check_class_names,
    check_fraction,
    check_ignore_byte,
    check_int_param,
    check_num_classes,
    check_real_param,
    check_seed,
)
from mars_plugin.engines.crf_memory import check_crf_image
from mars_plugin.engines.crf_params import DEFAULT_MAX_BYTES, check_crf_backend, check_crf_params
from mars_plugin.method.debias import check_pseudo_label, debiased_similarity, mark_biased, refine_mask
from mars_plugin.formats.files import (
    BIASED_VALUE,
    FEATURE_EXTENSIONS,
    IGNORE_VALUE,
    classes_in_label,
    feature_shape,
    find_features,
    find_image,
    list_stems,
    read_features,
    read_image,
    read_label,
    stem_path,
    write_label,
)
from mars_plugin.commands.distributed import _dist_ready, _free, _rank_world, resolve_device, share_error, sync_group
from mars_plugin.commands.errors import FILE_ERRORS, JobError, JobSummary, _check_on_error, _fail, one_line
from mars_plugin.commands.metrics import confusion_matrix, segmentation_scores
from mars_plugin.method.selection import DebiasedCentroids, select_centroids

__all__ = [
    "LabelFormat",
    "label_format",
    "read_image_labels",
    "centroids_job",
    "debias_job",
    "evaluate_job",
    "report_job",
    "load_centroids",
    "check_job_params",
]

def no_valid_pixel(label: torch.Tensor, path: os.PathLike, ignore_index: int) -> Optional[str]:
    """The warning for a label map of which every pixel is ``ignore_index`` (None otherwise).

    One such label is a warning, not a per-file failure: a WSSS method may leave an image it is
    unsure of entirely ignored, the file is valid and contributes nothing, and stopping a long
    run on it would be wrong. A whole set of them is an error (see :func:`check_any_valid`)."""
    if bool((label != ignore_index).any()):
        return None
    return f"{os.fspath(path)}: every pixel is --ignore-index {ignore_index} (no valid pixel)"


def check_any_valid(folder: os.PathLike, stems: Sequence[str], flag: str, ignore_index: int) -> None:
    """Read the labels of ``stems`` in ``folder`` until one has a valid pixel (usually the
    first); when none has, a :class:`JobError` naming the folder, before any work: a set of
    labels with no valid pixel at all (all ``ignore_index``: the wrong folder or the wrong
    ``--ignore-index``) has nothing to give. Unreadable files are left to the per-file read."""
    read = 0
    for stem in stems:
        try:
            label = read_label(Path(folder) / f"{stem}.png", biased_value=None)
        except Exception:  # noqa: BLE001 -- reported, with its file, by the per-file read
            continue
        read += 1
        if bool((label != ignore_index).any()):
            return
    if read:
        raise JobError(f"{flag} {folder}: no label has a valid pixel (every pixel of all {read} read is "
                       f"--ignore-index {ignore_index}); is it the right folder and --ignore-index?")


def check_label_values(label: torch.Tensor, path: os.PathLike, num_classes: int, ignore_index: int,
                       flag: str = "--num-classes") -> None:
    """A pseudo label (read raw) holds only 0..C and ``ignore_index``; the error names the file,
    the flag that set C, and 254 when a debiased label was passed as a pseudo label."""
    vals = label[label != ignore_index]
    if not vals.numel():
        return
    hi, lo = int(vals.max()), int(vals.min())
    if hi <= num_classes and lo >= 0:
        return
    if num_classes < BIASED_VALUE and bool((vals == BIASED_VALUE).any()):
        raise ValueError(f"{os.fspath(path)}: holds {BIASED_VALUE}, the biased-pixel byte of debiased labels, "
                         f"where a pseudo label of 0..{num_classes} (and --ignore-index {ignore_index}) was expected")
    bad = hi if hi > num_classes else lo
    raise ValueError(f"{os.fspath(path)}: holds class {bad} but {flag} is {num_classes} "
                     f"(labels are 0..{num_classes} and --ignore-index {ignore_index})")


def check_features(feats: torch.Tensor, path: os.PathLike, dim: Optional[int], dim_from: str) -> None:
    """Features are finite and of embedding size ``dim`` (None: any); the error names the file."""
    if not bool(torch.isfinite(feats).all()):
        raise ValueError(f"{os.fspath(path)}: features hold NaN or infinite values")
    if dim is not None and int(feats.shape[0]) != dim:
        raise ValueError(f"{os.fspath(path)}: features have embedding size D={int(feats.shape[0])}, expected "
                         f"D={dim} ({dim_from})")


def _common_dim(features_dir: Path, stems: Sequence[str]) -> Optional[Tuple[int, str]]:
    """The most common embedding size D among the stems' feature files (.npy headers, or .pt
    tensors mapped without reading their data, see :func:`~mars_plugin.formats.files.feature_shape`),
    and the first file that has it; missing, clashing or unreadable files are left for the
    per-file read to report."""
    first: Dict[int, str] = {}
    count: Dict[int, int] = {}
    for stem in stems:
        try:
            p = find_features(features_dir, stem)
            shape = feature_shape(p)
        except Exception:  # noqa: BLE001 -- reported, with its file, by the per-file read
            continue
        if len(shape) == 3:
            d = int(shape[0])
            count[d] = count.get(d, 0) + 1
            first.setdefault(d, p.name)
    if not count:
        return None
    d = max(count, key=lambda k: (count[k], -list(first).index(k)))
    return d, f"as most feature files, e.g. {first[d]}"


def _check_out_file(out: os.PathLike, flag: str) -> None:
    """Fail before the work, not after it, when the output file ``out`` cannot be written."""
    p = Path(out)
    if p.is_dir():
        raise JobError(f"{flag} {p}: is a folder; expected a file name")
    parent = p.parent if str(p.parent) else Path(".")
    probe = parent
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise JobError(f"{flag} {p}: {probe} is not a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise JobError(f"{flag} {p}: folder {probe} is not writable")


def _check_out_dir(out: os.PathLike, flag: str) -> None:
    """Create the output folder ``out``, or fail with one line naming ``flag``."""
    p = Path(out)
    if p.exists() and not p.is_dir():
        raise JobError(f"{flag} {p}: exists and is not a folder")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise JobError(f"{flag} {p}: cannot create the folder ({e.strerror or one_line(e)})") from None
    if not os.access(p, os.W_OK | os.X_OK):
        raise JobError(f"{flag} {p}: folder is not writable")


def load_centroids(path: os.PathLike, flag: str = "--centroids") -> DebiasedCentroids:
    """:meth:`DebiasedCentroids.load` with one-line errors that name the file and ``flag``: a
    missing file, random bytes, a torch file of another structure, a pickle that would need
    unpickling (refused: the file may come from anyone)."""
    p = os.fspath(path)
    if not os.path.exists(p):
        raise JobError(f"{flag} {p}: no such file")
    if not os.path.isfile(p):
        raise JobError(f"{flag} {p}: not a file")
    try:
        with warnings.catch_warnings():  # torch warns about foreign pickle protocols: the error says it
            warnings.simplefilter("ignore")
            V = DebiasedCentroids.load(p)
        if V.centroids.ndim != 2 or V.valid.shape[0] != V.centroids.shape[0]:
            raise ValueError(f"centroids of shape {tuple(V.centroids.shape)} and valid of {tuple(V.valid.shape)}")
    except Exception as e:  # noqa: BLE001 -- any failure to read it is the same user error
        if isinstance(e, pickle.UnpicklingError) or "weights only" in str(e).lower():
            # torch's safe loader: "Unsupported global" is a pickled Python object; anything
            # else (random bytes, a plain pickle) is not a tensor file at all.
            why = ("it would need unpickling Python objects, which mars refuses" if "unsupported global" in
                   str(e).lower() else "unreadable as a file of tensors")
        elif isinstance(e, KeyError):
            why = f"no {e.args[0]!r} entry"
        else:
            why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            why = why.replace(repr(p), "").strip(" :") or type(e).__name__
        raise JobError(f"{flag} {p}: not a centroid file written by 'mars centroids' ({why[:200]})") from None
    return V


#: The numeric parameters of the jobs (and of ``mars reproduce``), each with its check: the
#: bounds of their flags (:mod:`mars_plugin.commands.cli_types`), for callers of the Python functions.
_PARAM_CHECKS = {
    "alpha": lambda v, n: check_fraction(v, n),
    "k_fg": lambda v, n: check_int_param(v, n, 1, MAX_K),
    "k_bg": lambda v, n: check_int_param(v, n, 1, MAX_K),
    "seed": lambda v, n: check_seed(v, n),
    "batch_size": lambda v, n: check_int_param(v, n, 1, MAX_BATCH_SIZE),
    "feature_batch_size": lambda v, n: check_int_param(v, n, 1, MAX_BATCH_SIZE),
    "workers": lambda v, n: check_int_param(v, n, 1, MAX_WORKERS),
    "num_examples": lambda v, n: check_int_param(v, n, 0, MAX_EXAMPLES),
    "per_class": lambda v, n: check_int_param(v, n, 0, MAX_PER_CLASS),
    "spill_mb": lambda v, n: check_real_param(v, n, 0.0, float("inf")),  # 0: spill every batch
    "threshold": lambda v, n: check_real_param(v, n, 0.0, 1.0, high_open=True),  # >= 1 keeps no pixel
    "num_classes": lambda v, n: check_num_classes(v, n),
}


def check_job_params(**params: Any) -> Dict[str, Any]:
    """Each keyword (``alpha``, ``k_fg``, ``k_bg``, ``seed``, ``batch_size``,
    ``feature_batch_size``, ``workers``, ``num_examples``, ``per_class``, ``spill_mb``,
    ``threshold``, ``num_classes``) checked against its bounds, scikit-learn style (the error
    names the parameter, its value and the range); returns them converted."""
    return {name: _PARAM_CHECKS[name](value, name) for name, value in params.items()}


def _progress(it, total: int, desc: str, enabled: bool):
    if not enabled:
        return it
    from tqdm.auto import tqdm

    return tqdm(it, total=total, desc=desc, unit="img")


def read_image_labels(path: Optional[os.PathLike], num_classes: int) -> Optional[Dict[str, List[int]]]:
    """Image-level labels from a JSON file ``{stem: [1-based class ids]}`` (None: no file).

    Without a file, every job derives an image's classes from its pseudo label.
    """
    num_classes = check_num_classes(num_classes)
    if path is None:
        return None
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--image-labels {p}: cannot read image labels as JSON {{stem: [class ids]}} ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"--image-labels {p}: must be a JSON object {{stem: [class ids]}}, got {type(data).__name__}")
    out: Dict[str, List[int]] = {}
    for stem, ids in data.items():
        if not isinstance(ids, list) or not all(isinstance(i, int) and 1 <= i <= num_classes for i in ids):
            raise ValueError(f"--image-labels {p}: the classes of {stem!r} must be a list of class ids in "
                             f"1..{num_classes}, got {ids!r}")
        out[str(stem)] = sorted(set(ids))
    return out


def _stems(labels_dir: os.PathLike, skip_suffixes: Sequence[str] = (), flag: str = "--labels") -> List[str]:
    _check_folder(labels_dir, flag)
    stems = [s for s in list_stems(labels_dir, (".png",)) if not any(s.endswith(x) for x in skip_suffixes)]
    if not stems:
        raise JobError(f"{flag} {labels_dir}: no .png label files in this folder")
    return stems


# --------------------------------------------------------------------------------------------
# input folders, checked once before any work: a mistyped or wrong folder is one line, not one
# failure per image (and, with --on-error skip, an empty output folder)
# --------------------------------------------------------------------------------------------


def _check_folder(folder: os.PathLike, flag: str) -> Path:
    p = Path(folder)
    if not p.exists():
        raise JobError(f"{flag} {p}: no such folder")
    if not p.is_dir():
        raise JobError(f"{flag} {p}: not a folder")
    return p


def check_input_folder(folder: os.PathLike, flag: str, stems: Sequence[str], extensions: Sequence[str],
                       what: str, of: str = "labels") -> None:
    """``folder`` (given as ``flag``) exists and holds a file for at least one of ``stems``
    (``<stem><ext>`` for one of ``extensions``); else a :class:`JobError` of one line, before any
    work. A stem without its file is a per-file failure later; no stem with one is the wrong
    folder (a typo, the images given as the features, ...)."""
    p = _check_folder(folder, flag)
    have = set(list_stems(p, extensions))
    if not have:
        raise JobError(f"{flag} {p}: no {what} files ({', '.join(extensions)}) in this folder")
    if stems and not any(s in have for s in stems):
        raise JobError(f"{flag} {p}: none of the {len(stems)} {of} has its {what} file here (<stem>"
                       f"{'/'.join(extensions)}, e.g. {stems[0]}{extensions[0]}); is it the right folder?")


#: A label map's values are class ids (at most this many foreground classes when C is unknown:
#: COCO's 80 in the 81-class form, 90 in the 91-id form) and the ignore and biased bytes.
_MAX_LABEL_CLASS = 90


def _label_like(path: Path, num_classes: Optional[int]) -> Optional[str]:
    """How the file at ``path`` looks like a label map rather than a photograph (None: it does
    not): a one-channel (P or L) PNG of at most 32 distinct values, all class ids 0..C, 254 or
    255, and at least one foreground class."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            if im.format != "PNG" or im.mode not in ("P", "L"):
                return None
            values = np.unique(np.asarray(im))
            mode = im.mode
    except Exception:  # noqa: BLE001 -- an unreadable file is reported by the per-file read
        return None
    top = _MAX_LABEL_CLASS if num_classes is None else num_classes
    fg = values[(values > 0) & (values < BIASED_VALUE)]
    if len(values) > 32 or not fg.size or int(fg.max()) > top:
        return None
    shown = ", ".join(str(int(v)) for v in values[:8]) + (", ..." if len(values) > 8 else "")
    return f"{path.name}: a {mode}-mode PNG of the values {shown}"


def check_images_folder(images_dir: os.PathLike, stems: Sequence[str], *, flag: str = "--images",
                        labels_dir: Optional[os.PathLike] = None, num_classes: Optional[int] = None,
                        of: str = "labels") -> None:
    """:func:`check_input_folder` for RGB images, and not a folder of label maps: the labels'
    own folder, or one whose first images (up to 8) all look like label PNGs
    (:func:`_label_like`: the pseudo labels or the ground truth given by mistake, which the CRF
    would otherwise read as colours and silently change the result)."""
    from mars_plugin.formats.files import IMAGE_EXTENSIONS

    check_input_folder(images_dir, flag, stems, IMAGE_EXTENSIONS, "image", of)
    p = Path(images_dir)
    if labels_dir is not None and Path(labels_dir).is_dir() and p.resolve() == Path(labels_dir).resolve():
        raise JobError(f"{flag} {p}: is the --labels folder; give the folder of the RGB images")
    looked: List[str] = []
    for stem in stems:
        try:
            path = find_image(p, stem)
        except ValueError:
            continue
        why = _label_like(path, num_classes)
        if why is None:
            return
        looked.append(why)
        if len(looked) == 8:
            break
    if looked:
        raise JobError(f"{flag} {p}: holds label maps, not RGB images ({len(looked)} of {len(looked)} looked at are "
                       f"class-id PNGs, e.g. {looked[0]}); give the folder of the photographs")


def _only(found: List[str], wanted: Optional[Sequence[str]]) -> List[str]:
    """The stems of ``found`` (a folder's listing) that are in ``wanted`` (None: all), in order."""
    if wanted is None:
        return found
    keep = set(wanted)
    return [s for s in found if s in keep]


WSSS_ADAPTERS = ("irnet", "advcam", "seam", "rsepm", "dhr")


@dataclass
class LabelFormat:
    """How a WSSS repository stores labels: PNG mode of its outputs, sibling files to skip,
    and how its image-level label file is read (through ``mars_plugin.adapters.wsss.<name>``)."""

    name: Optional[str] = None
    mode: str = "P"
    skip_suffixes: Tuple[str, ...] = ()
    dataset: str = "voc"
    trust_pickle: bool = False

    def image_labels(self, path: Optional[os.PathLike], num_classes: int) -> Optional[Dict[str, List[int]]]:
        if path is None:
            return None
        if self.name is None:
            return read_image_labels(path, num_classes)
        import inspect

        adapter = _adapter(self.name)
        kwargs: Dict[str, Any] = {"trust_pickle": self.trust_pickle}
        if "dataset" in inspect.signature(adapter.load_image_labels).parameters:
            kwargs["dataset"] = self.dataset
        multi_hot = adapter.load_image_labels(path, **kwargs)
        return {str(k): [int(i) + 1 for i in torch.nonzero(v).flatten().tolist()] for k, v in multi_hot.items()}


def _adapter(name: str):
    import importlib

    if name not in WSSS_ADAPTERS:
        raise ValueError(f"wsss must be one of {WSSS_ADAPTERS}, got {name!r}")
    return importlib.import_module(f"mars_plugin.adapters.wsss.{name}")


def label_format(wsss: Optional[str] = None, *, dataset: str = "voc", trust_pickle: bool = False) -> LabelFormat:
    """The :class:`LabelFormat` of a WSSS repository (None: this package's own layout)."""
    if wsss is None:
        return LabelFormat(trust_pickle=trust_pickle, dataset=dataset)
    adapter = _adapter(wsss)
    skip = ("_palette",) if wsss in ("irnet", "advcam") else ()
    return LabelFormat(wsss, adapter.LABEL_MODE, skip, dataset, trust_pickle)


# --------------------------------------------------------------------------------------------
# centroids
# --------------------------------------------------------------------------------------------


def _centroid_samples(
    stems: Sequence[str], features_dir: Path, labels_dir: Path, image_labels, num_classes: int,
    ignore_index: int, on_error: str, summary: JobSummary, progress: bool, yielded: List[str],
) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
    """Checked (features, label) pairs; every check that :func:`select_centroids` would make
    on a sample is made here first, so that a bad file is named and ``on_error`` applies.
    ``yielded`` receives the stem of each pair, in order."""
    ref = _common_dim(features_dir, stems)
    dim, dim_from = ref if ref is not None else (None, "")
    for stem in _progress(stems, len(stems), "centroids", progress):
        try:
            feat_path = find_features(features_dir, stem)
            feats = read_features(feat_path)
            check_features(feats, feat_path, dim, dim_from)
            label_path = labels_dir / f"{stem}.png"
            label = read_label(label_path, biased_value=None)
            check_label_values(label, label_path, num_classes, ignore_index)
            empty = no_valid_pixel(label, label_path, ignore_index)
            if image_labels is not None:
                if stem not in image_labels:
                    raise ValueError(f"{stem!r} has no entry in the --image-labels file")
                # Pseudo-label classes the image-level labels deny are not trusted: ignore them.
                allowed = torch.tensor([0, ignore_index] + image_labels[stem])
                label = torch.where(torch.isin(label, allowed), label, torch.full_like(label, ignore_index))
        except FILE_ERRORS as e:
            _fail(stem, e, on_error, summary)
            continue
        summary.done += 1
        if empty is not None:
            summary.warnings.append((stem, empty))
        yielded.append(stem)
        yield feats, label


def _translate_samples_error(e: Exception, yielded: Sequence[str], summary: JobSummary) -> JobError:
    """A :func:`select_centroids` error names ``samples[i]``: name the file instead (the checks
    of :func:`_centroid_samples` should leave none but this is the safety net)."""
    msg = one_line(e)
    m = re.match(r"samples\[(\d+)\]:?\s*", msg)
    if m and int(m.group(1)) < len(yielded):
        return JobError(f"{yielded[int(m.group(1))]}: {msg[m.end():]}")
    if msg.startswith("samples is empty"):
        why = f" ({len(summary.failed)} skipped)" if summary.failed else ""
        return JobError(f"no image of --features/--labels could be used{why}")
    if msg.startswith("samples: "):
        return JobError(msg[len("samples: "):].replace("pseudo_label", "pseudo label"))
    return JobError(msg)


def centroids_job(
    features_dir: os.PathLike,
    labels_dir: os.PathLike,
    num_classes: int,
    out: os.PathLike,
    *,
    image_labels: Optional[os.PathLike] = None,
    alpha: float = 0.4,
    k_fg: int = 2,
    k_bg: int = 2,
    seed: int = 0,
    batch_size: int = 64,
    ignore_index: int = IGNORE_VALUE,
    on_error: str = "stop",
    progress: bool = True,
    fmt: Optional[LabelFormat] = None,
    device: str = "cpu",
    spill_dir: Optional[os.PathLike] = None,
    spill_mb: float = 1024,
    backend: str = "auto",
    stems: Optional[Sequence[str]] = None,
) -> Tuple[DebiasedCentroids, JobSummary]:
    """Stream every (features, pseudo label) pair of two folders into :func:`select_centroids`
    and save the result to ``out`` (a ``.pt`` file, written atomically). ``device`` runs the
    K-means (``"auto"``: this rank's GPU when CUDA is available, else the CPU); ``spill_dir``,
    ``spill_mb`` and ``backend`` are passed to :func:`select_centroids`.

    ``fmt`` (see :func:`label_format`) reads a WSSS repository's own folders and image-label
    file. Under torch.distributed (e.g. ``torchrun``), each rank reads its strided shard of the
    images and rank 0 writes ``out``; every rank returns the same centroids. ``stems``: only
    these of the folder's labels (e.g. ``mars reproduce``'s ids whose tags could be read).

    Resume (:mod:`mars_plugin.commands.run_record`): ``out`` holds the record of what made it (a
    ``"run"`` entry: the settings, and a digest of the ids, of every feature file and pseudo
    label (name, size, mtime) and of the tags). When ``out`` exists, was made with the same
    settings from the same inputs, it is kept (``existing`` in the summary: its image count); a
    change of any input computes it again; other settings (``alpha``, ``k_fg``, ``k_bg``,
    ``seed``, the folders, C...) are refused. ``device``, ``backend``, ``batch_size`` and the
    spill options are not recorded (they change the result by float rounding at most). One run
    at a time per ``out`` (a lock, ``.<name>.lock`` beside it).
    """
    _check_on_error(on_error)
    num_classes = check_num_classes(num_classes)
    ignore_index = check_ignore_byte(ignore_index, num_classes=num_classes)
    p = check_job_params(alpha=alpha, k_fg=k_fg, k_bg=k_bg, seed=seed, batch_size=batch_size, spill_mb=spill_mb)
    alpha, k_fg, k_bg, seed, batch_size, spill_mb = (p[k] for k in ("alpha", "k_fg", "k_bg", "seed", "batch_size",
                                                                    "spill_mb"))
    _check_out_file(out, "--out")
    fmt = fmt or LabelFormat()
    stems = _only(_stems(labels_dir, fmt.skip_suffixes), stems)
    check_input_folder(features_dir, "--features", stems, FEATURE_EXTENSIONS, "feature")
    check_any_valid(labels_dir, stems, "--labels", ignore_index)
    labels = fmt.image_labels(image_labels, num_classes)
    rank, world = _rank_world()
    from mars_plugin.commands.run_record import CentroidsRecord, broadcast_object

    # The settings that shape the result; the folders are not among them: each file read is
    # recorded by its identity (a moved or copied tree is the same run).
    record = CentroidsRecord(out, {"num_classes": num_classes, "alpha": alpha, "k_fg": k_fg, "k_bg": k_bg,
                                   "seed": seed, "ignore_index": ignore_index, "wsss": fmt.name})
    error, kept = None, None
    group = sync_group()  # the ranks meet here however late rank 0 comes (24 h, not torchrun's 30 min)
    if rank == 0:
        try:
            kept = record.open(stems, features_dir, labels_dir, labels, on_error)
        except Exception as e:  # noqa: BLE001 -- raised on every rank just below
            error = e
    try:
        share_error(error, group)  # a refusal on rank 0 (another run, other settings) stops every rank
        kept = broadcast_object(kept, group)
    finally:
        _free(group)
    try:
        if kept is not None:  # made from these inputs with these settings: keep it
            V = load_centroids(out, "--out")
            return V, JobSummary(existing=V.num_images, failed=[tuple(f) for f in kept] if rank == 0 else [])
        stems = stems[rank::world]
        summary = JobSummary()
        yielded: List[str] = []
        samples = _centroid_samples(stems, Path(features_dir), Path(labels_dir), labels, num_classes, ignore_index,
                                    on_error, summary, progress, yielded)
        dev = resolve_device(device)
        try:
            V = select_centroids(
                samples, num_classes, alpha=alpha, k_fg=k_fg, k_bg=k_bg, seed=seed, batch_size=batch_size,
                ignore_index=ignore_index, device=dev, spill_dir=spill_dir, spill_mb=spill_mb,
                backend=backend,
            ).to("cpu")
        except (ValueError, TypeError) as e:
            if "samples" not in str(e):
                raise
            raise _translate_samples_error(e, yielded, summary) from None
        failed = [list(f) for f in summary.failed]
        if _dist_ready():  # the record lists every rank's skipped files
            import torch.distributed as dist

            got: List[Any] = [None] * world
            dist.all_gather_object(got, failed)
            failed = [f for g in got for f in g]
        if rank == 0:
            record.save(V, failed)
        return V, summary
    finally:
        record.close()


# --------------------------------------------------------------------------------------------
# debias
# --------------------------------------------------------------------------------------------

_WORKER: Dict[str, Any] = {}


def _debias_init(config: Dict[str, Any]) -> None:
    """Set up a worker. The centroids come as tensors in ``config``, so no worker re-reads the
    file (which may have changed or gone since the run began). An error here is kept and
    raised, as a :class:`JobError`, by the worker's first batch: a pool whose initializer
    raises would print a traceback per worker (and ``multiprocessing.Pool`` respawns them
    forever)."""
    _WORKER.clear()
    if config["workers"] > 1:
        _ignore_sigint()
    try:
        # One thread per worker process: N workers use N cores instead of fighting over them.
        if config["workers"] > 1:
            torch.set_num_threads(1)
        _WORKER.update(config)
        _WORKER["centroids"] = config["centroids"].to(config["device"])
    except Exception as e:  # noqa: BLE001 -- reported by _debias_batch, see above
        _WORKER["init_error"] = f"a --workers process failed to start: {one_line(e)}"


def _ignore_sigint() -> None:
    """In a worker process: Ctrl-C (SIGINT, sent by the terminal to every process of the
    command) is for the parent, which stops the workers; a worker that raised
    KeyboardInterrupt would print a traceback of its own."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _start_workers(submit):
    """``submit()`` (which starts the worker processes) with SIGINT blocked in this thread, so
    that the workers start with it blocked (the mask is inherited): a Ctrl-C while a worker is
    still importing, before :func:`_ignore_sigint`, would print its traceback. Here the signal
    waits and reaches this process as soon as the workers have started."""
    import signal

    if not hasattr(signal, "pthread_sigmask"):
        return submit()
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        return submit()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _debias_check_init() -> None:
    if "init_error" in _WORKER:
        raise JobError(_WORKER["init_error"])


def _debias_read(stem: str) -> Dict[str, Any]:
    """One image's inputs, checked, and its soft mask M_hat (Eq. 4) on the job's device."""
    cfg = _WORKER
    V: DebiasedCentroids = cfg["centroids"]
    feat_path = find_features(cfg["features_dir"], stem)
    feats = read_features(feat_path)
    check_features(feats, feat_path, V.dim, f"as --centroids {cfg['centroids_path']}")
    feats = feats.to(cfg["device"])
    label_path = Path(cfg["labels_dir"]) / f"{stem}.png"
    label = read_label(label_path, biased_value=None)
    check_label_values(label, label_path, V.num_classes, cfg["ignore_index"],
                       flag=f"the number of classes of --centroids {cfg['centroids_path']}")
    if cfg["image_labels"] is not None:
        if stem not in cfg["image_labels"]:
            raise ValueError(f"{stem!r} has no entry in the --image-labels file")
        classes = cfg["image_labels"][stem]
    else:
        classes = [c for c in classes_in_label(label, cfg["ignore_index"]) if c <= V.num_classes]
    # Eq. 5's checks before the batch's CRF, so that a bad file fails alone.
    label = check_pseudo_label(label, V, ignore_index=cfg["ignore_index"])
    item = {"stem": stem, "label": label,
            "similarity": debiased_similarity(feats, V, classes, size=tuple(label.shape))}
    if cfg["refine"] == "crf":
        image = read_image(find_image(cfg["images_dir"], stem))
        if image.shape[:2] != tuple(label.shape):
            raise ValueError(f"image {image.shape[1]}x{image.shape[0]} and pseudo label "
                             f"{label.shape[1]}x{label.shape[0]} (width x height) differ in size")
        # this image's CRF edges (standard deviations for its size, its memory) fail it alone
        check_crf_image(cfg["crf_params"], *label.shape, 2, name="--crf-params",
                        max_bytes=DEFAULT_MAX_BYTES if cfg["crf_backend"] == "torch" else None)
        item["image"] = torch.from_numpy(image).to(cfg["device"])
    return item


def _debias_batch(stems: Sequence[str]) -> List[Tuple[str, str, Optional[str], Dict[int, Tuple[int, int]], str]]:
    """Debias a batch of images (one CRF call on the job's device), every one of ``stems``
    (the caller left out those whose output is current); returns (stem, "done"|"failed", error
    message, {class: (pixels, removed)}, digest of the label written) for each."""
    from mars_plugin.commands.identities import array_digest

    _debias_check_init()
    cfg = _WORKER
    results: List[Tuple[str, str, Optional[str], Dict[int, Tuple[int, int]], str]] = []
    items = []
    for stem in stems:
        try:
            items.append(_debias_read(stem))
        except FILE_ERRORS as e:
            results.append((stem, "failed", one_line(e), {}, ""))
    if not items:
        return results
    sims = [it["similarity"] for it in items]
    if cfg["refine"] == "crf":
        masks = refine_mask(sims, [it["image"] for it in items], cfg["crf_params"], cfg["crf_backend"])
    else:
        masks = [m > cfg["threshold"] for m in sims]
    for it, mask in zip(items, masks):
        y = mark_biased(it["label"], mask.cpu(), cfg["centroids"], ignore_index=cfg["ignore_index"])
        write_label(stem_path(cfg["out_dir"], it["stem"], ".png"), y, mode=cfg["mode"])
        # "done" with a message: written, with a warning (see no_valid_pixel)
        empty = no_valid_pixel(it["label"], Path(cfg["labels_dir"]) / f"{it['stem']}.png", cfg["ignore_index"])
        results.append((it["stem"], "done", empty, _removed_per_class(it["label"], y, cfg["ignore_index"]),
                        array_digest(y)))
    return results


def _removed_per_class(label: torch.Tensor, debiased: torch.Tensor, ignore_index: int) -> Dict[int, Tuple[int, int]]:
    """{class id: (pixels in the pseudo label, of them marked biased)} of one image, counted on
    the label just written (no re-read)."""
    label, debiased = label.cpu(), debiased.cpu()
    fg = (label > 0) & (label != ignore_index)
    ids = label[fg]
    if not ids.numel():
        return {}
    n = int(ids.max()) + 1
    pixels = torch.bincount(ids, minlength=n)
    removed = torch.bincount(label[fg & (debiased == -1)], minlength=n)
    return {c: (int(pixels[c]), int(removed[c])) for c in range(1, n) if int(pixels[c])}


def debias_job(
    features_dir: os.PathLike,
    labels_dir: os.PathLike,
    centroids: os.PathLike,
    out_dir: os.PathLike,
    *,
    images_dir: Optional[os.PathLike] = None,
    refine: str = "crf",
    threshold: float = 0.5,
    image_labels: Optional[os.PathLike] = None,
    workers: int = 1,
    batch_size: int = 8,
    device: str = "cpu",
    ignore_index: int = IGNORE_VALUE,
    crf_params: Union[None, str, Mapping[str, Any]] = None,
    crf_backend: str = "torch",
    on_error: str = "stop",
    progress: bool = True,
    fmt: Optional[LabelFormat] = None,
    stems: Optional[Sequence[str]] = None,
) -> JobSummary:
    """Write one debiased label PNG per pseudo label (biased pixels as 254, see
    :data:`mars_plugin.formats.files.BIASED_VALUE`).

    Images are debiased ``batch_size`` at a time on ``device`` (``cpu``, ``cuda``, ``cuda:N``,
    ``auto``): Eq. 4 per image, then one dense-CRF call for the batch
    (:func:`mars_plugin.method.debias.refine_mask`; images of any sizes), then Eq. 5. ``crf_params`` is
    a preset name or a dict (:data:`mars_plugin.engines.crf_params.CRF_PRESETS`). Resumable
    (:mod:`mars_plugin.commands.run_record`): ``out_dir/.mars-run.json`` records the settings (the
    folders, the ``centroids`` path, ``refine`` and its parameters, the PNG mode; other settings
    are refused) and each rank's journal what each label was made from (its features, pseudo
    label, image, tags, and the centroids' content): a label whose inputs are unchanged is
    skipped, any other is computed again (all of them when the centroids changed). Outputs are
    written atomically, so an existing file is always complete; one run at a time per
    ``out_dir`` (a lock). ``workers`` > 1 runs batches in that many processes (one thread each);
    outputs do not depend on ``workers`` or ``batch_size``. Under torch.distributed each rank
    debiases its strided shard. ``fmt`` writes in a WSSS repository's PNG mode (see
    :func:`label_format`). ``stems``: only these of the folder's labels.
    """
    _check_on_error(on_error)
    if refine not in ("crf", "threshold"):
        raise ValueError(f"refine must be 'crf' or 'threshold', got {refine!r}")
    if refine == "crf" and images_dir is None:
        raise ValueError("refine='crf' needs images_dir (the RGB images); or use refine='threshold'")
    p = check_job_params(threshold=threshold, workers=workers, batch_size=batch_size)
    threshold, workers, batch_size = p["threshold"], p["workers"], p["batch_size"]
    check_ignore_byte(ignore_index)
    params = check_crf_params(crf_params)
    check_crf_backend(crf_backend)
    dev = resolve_device(device)
    fmt = fmt or LabelFormat()
    stems = _only(_stems(labels_dir, fmt.skip_suffixes), stems)
    check_input_folder(features_dir, "--features", stems, FEATURE_EXTENSIONS, "feature")
    if refine == "crf":
        check_images_folder(images_dir, stems, labels_dir=labels_dir)
    check_any_valid(labels_dir, stems, "--labels", ignore_index)
    rank, world = _rank_world()
    stems = stems[rank::world]
    V = load_centroids(centroids)
    ignore_index = check_ignore_byte(ignore_index, num_classes=V.num_classes)
    _check_out_dir(out_dir, "--out")
    config = dict(
        centroids=V, centroids_path=os.fspath(centroids), features_dir=os.fspath(features_dir), labels_dir=os.fspath(labels_dir),
        images_dir=None if images_dir is None else os.fspath(images_dir), out_dir=os.fspath(out_dir), refine=refine,
        threshold=threshold, ignore_index=ignore_index, crf_params=params, crf_backend=crf_backend,
        image_labels=fmt.image_labels(image_labels, V.num_classes), mode=fmt.mode, device=str(dev), workers=workers,
    )
    from mars_plugin.commands.run_record import FolderRecord

    crf = refine == "crf"
    # The settings that shape a label; the folders and the centroid file are not among them:
    # each file read is recorded by its identity (a moved or copied tree is the same run).
    record = FolderRecord(out_dir, "debias", {
        "refine": refine, "threshold": None if crf else threshold, "crf_params": params if crf else None,
        "crf_backend": crf_backend if crf else None, "ignore_index": ignore_index, "wsss": fmt.name,
        "mode": fmt.mode}, rank=rank)
    error = None
    group = sync_group()  # the ranks meet here however late rank 0 comes (24 h, not torchrun's 30 min)
    if rank == 0:
        try:
            record.open()
        except Exception as e:  # noqa: BLE001 -- raised on every rank just below
            error = e
    try:
        share_error(error, group)  # a refusal on rank 0 (another run, other settings) stops every rank
    finally:
        _free(group)
    try:
        return _debias_folder(record, config, stems, batch_size, workers, on_error, progress, rank)
    finally:
        record.close()


def _debias_folder(record, config: Dict[str, Any], stems: Sequence[str], batch_size: int, workers: int,
                   on_error: str, progress: bool, rank: int) -> JobSummary:
    """:func:`debias_job` once the folder's record is open: which labels are current, then the
    others, each recorded as it is written."""
    from mars_plugin.commands.identities import centroids_digest, file_id
    from mars_plugin.commands.run_record import OutputIds

    summary = JobSummary()
    if rank == 0:
        record.write_settings()
    record.load()
    features_dir, labels_dir, images_dir = config["features_dir"], config["labels_dir"], config["images_dir"]
    out_dir, refine = config["out_dir"], config["refine"]
    # What each label is made from, taken before anything is read (a file changed while the run
    # reads it is then seen as changed next time).
    feature_id, tags = OutputIds(features_dir), config["image_labels"]
    v_id = centroids_digest(config["centroids"].state_dict())
    todo, inputs, again = [], {}, set()

    def found(find, *args):
        try:
            return find(*args)
        except (ValueError, OSError):  # missing or clashing: the read names it
            return None

    for stem in stems:
        inputs[stem] = {"features": feature_id(found(find_features, features_dir, stem)),
                        "label": file_id(Path(labels_dir) / f"{stem}.png"),
                        "image": file_id(found(find_image, images_dir, stem)) if refine == "crf" else None,
                        "tags": None if tags is None else tags.get(stem), "centroids": v_id}
        kept, exists = record.current(stem, stem_path(out_dir, stem, ".png"), inputs[stem])
        if kept:
            summary.existing += 1
        else:
            todo.append(stem)
            if exists:
                again.add(stem)
    batches = [todo[i:i + batch_size] for i in range(0, len(todo), batch_size)]

    def consume(results) -> None:
        for stem, status, err, counts, content in _progress((r for batch in results for r in batch), len(todo),
                                                            "debias", progress):
            if status == "done":
                record.add(stem, stem_path(out_dir, stem, ".png"), inputs[stem], content)
                summary.done += 1
                summary.redone += stem in again
                if err is not None:
                    summary.warnings.append((stem, err))
                for c, (n, r) in counts.items():
                    summary.pixels[c] = summary.pixels.get(c, 0) + n
                    summary.removed[c] = summary.removed.get(c, 0) + r
            else:
                if on_error == "stop":
                    raise JobError(f"{stem}: {err}")
                summary.failed.append((stem, err or ""))

    if workers == 1:
        _debias_init(config)
        consume(map(_debias_batch, batches))
        return summary
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    # spawn, not fork: forking a process whose torch already started OpenMP threads can hang.
    # A ProcessPoolExecutor, not a multiprocessing.Pool: when a worker dies the executor is
    # "broken" and every pending result raises, where a Pool replaces the worker and waits
    # forever for the result the dead one held.
    pool = ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"), initializer=_debias_init,
                               initargs=(config,))
    try:
        consume(_start_workers(lambda: pool.map(_debias_batch, batches)))
    except BrokenProcessPool:
        raise JobError(f"a --workers process died (killed, out of memory, or crashed); "
                       f"{summary.done} images were written and a new run resumes after them") from None
    finally:
        # Do not wait for batches nobody will read (an error stops the run).
        pool.shutdown(wait=True, cancel_futures=True)
    return summary


# --------------------------------------------------------------------------------------------
# evaluate
# --------------------------------------------------------------------------------------------


def evaluate_job(
    pred_dir: os.PathLike,
    gt_dir: os.PathLike,
    num_classes: int,
    *,
    ignore_index: int = IGNORE_VALUE,
    on_error: str = "stop",
    progress: bool = True,
    stems: Optional[Sequence[str]] = None,
) -> Tuple[Dict[str, object], JobSummary]:
    """SEAM-style IoU/FP/FN over every ground-truth PNG of ``gt_dir`` and its prediction
    (or over ``stems`` only: e.g. the images that have a pseudo label, when ``gt_dir`` holds
    the masks of the whole split).

    A prediction pixel of 254 (biased, in a debiased label) counts as background;
    ``ignore_index`` in a prediction counts as "no class". Any other value above C, in a
    prediction or the ground truth, is a bad file (named, ``on_error`` applies). Returns the scores of
    :func:`mars_plugin.commands.metrics.segmentation_scores` plus ``confusion`` and ``num_images``.
    """
    _check_on_error(on_error)
    num_classes = check_num_classes(num_classes)
    ignore_index = check_ignore_byte(ignore_index, num_classes=num_classes)
    if stems is None:
        stems = _stems(gt_dir, flag="--gt")
    else:
        stems = [stem_path(gt_dir, s, ".png").stem for s in stems]  # refuses unsafe ids
        if not stems:
            raise ValueError("stems is empty: nothing to evaluate")
        check_input_folder(gt_dir, "--gt", stems, (".png",), "ground-truth", of="images")
    check_input_folder(pred_dir, "--pred", stems, (".png",), "prediction", of="ground-truth masks")
    summary = JobSummary()
    cm = None
    for stem in _progress(stems, len(stems), "evaluate", progress):
        try:
            pred_path = Path(pred_dir) / f"{stem}.png"
            if not pred_path.is_file():
                raise ValueError(f"missing prediction {pred_path}")
            pred = read_label(pred_path, biased_value=None)
            # 254 in a prediction is a biased pixel of a debiased label: background (see above).
            check_label_values(pred.masked_fill(pred == BIASED_VALUE, 0), pred_path, num_classes, ignore_index)
            pred = pred.masked_fill(pred == BIASED_VALUE, -1)
            gt_path = Path(gt_dir) / f"{stem}.png"
            gt = read_label(gt_path, biased_value=None)
            check_label_values(gt, gt_path, num_classes, ignore_index)
            empty = no_valid_pixel(gt, gt_path, ignore_index)
            if pred.shape != gt.shape:
                raise ValueError(f"prediction {pred_path} {tuple(pred.shape)} and ground truth {tuple(gt.shape)} "
                                 "differ in size")
            m = confusion_matrix(pred, gt, num_classes, ignore_index=ignore_index)
        except FILE_ERRORS as e:
            _fail(stem, e, on_error, summary)
            continue
        cm = m if cm is None else cm + m
        summary.done += 1
        if empty is not None:
            summary.warnings.append((stem, empty))
    if cm is None:
        raise JobError("no image could be evaluated")
    if len(summary.warnings) == summary.done:
        raise JobError(f"--gt {gt_dir}: no ground-truth mask has a valid pixel (every pixel of all {summary.done} "
                       f"evaluated is --ignore-index {ignore_index}): nothing to score; is it the right folder?")
    scores = segmentation_scores(cm)
    scores["confusion"] = cm.tolist()
    scores["num_images"] = summary.done
    return scores, summary


# --------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------


#: What ``share_removed`` means, written on the chart and into ``report.json``.
SHARE_DEFINITION = ("share of the class's pseudo-label pixels that MARS marked biased, over the whole set: "
                    "removed pixels of class c / pixels labelled c in the pseudo labels (all images summed)")


def _px(n: int) -> str:
    """A pixel count in a few characters: 950 px, 12.3k px, 4.5M px."""
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= div:
            return f"{n / div:.1f}{unit} px"
    return f"{n} px"


def report_job(
    labels_dir: os.PathLike,
    debiased_dir: os.PathLike,
    images_dir: os.PathLike,
    out_dir: os.PathLike,
    *,
    class_names: Optional[Sequence[str]] = None,
    num_examples: int = 8,
    per_class: int = 2,
    ignore_index: int = IGNORE_VALUE,
    on_error: str = "stop",
    progress: bool = True,
) -> Tuple[Dict[str, object], JobSummary]:
    """Which classes were biased: per-class share of pseudo-label pixels marked biased.

    Writes into ``out_dir``:

    * ``report.json``: per class its pseudo-label ``pixels``, ``removed`` pixels,
      ``share_removed`` (removed / pixels, over the whole set: :data:`SHARE_DEFINITION`) and
      ``pixel_share`` (its share of all foreground pseudo-label pixels, so that a small class
      is seen as small); the ``ranking`` by ``share_removed``; the ``most_changed`` images; and
      ``per_class_examples``;
    * ``biased_share.png``: bar chart, classes ranked, each with its pixel count under its name
      and the definition of the share under the chart;
    * ``most_changed.png``: overlays of the ``num_examples`` images with the largest share of
      removed foreground pixels (none when 0);
    * ``per_class.png``: for each class in ranking order (the first :data:`MAX_GRID_CLASSES`),
      its ``per_class`` images with the largest share of that class's pixels removed (ties: more
      removed pixels first), only images where some were removed (none when 0).

    Both overlay grids carry a colour legend (class name -> colour, removed, ignore); their
    panels are at most :data:`PANEL_SIDE` pixels on the longer side. One run at a time writes
    into ``out_dir`` (a lock, :class:`~mars_plugin.commands.run_lock.RunLock`); holding it, the run
    removes the ``.tmp-*`` files a killed run left there.
    """
    _check_on_error(on_error)
    p = check_job_params(num_examples=num_examples, per_class=per_class)
    num_examples, per_class = p["num_examples"], p["per_class"]
    if class_names is not None:
        class_names = check_class_names(class_names)
    ignore_index = check_ignore_byte(ignore_index, num_classes=None if class_names is None else len(class_names) - 1)
    stems = _stems(debiased_dir, flag="--debiased")
    check_input_folder(labels_dir, "--labels", stems, (".png",), "pseudo-label", of="debiased labels")
    check_images_folder(images_dir, stems, labels_dir=labels_dir, of="debiased labels")
    summary = JobSummary()
    total: Dict[int, int] = {}
    removed: Dict[int, int] = {}
    per_image: List[Tuple[float, str]] = []
    max_class = BIASED_VALUE - 1 if class_names is None else len(class_names) - 1
    flag = "the labels' range" if class_names is None else f"--class-names ({len(class_names)} names)"
    per_class_images: Dict[int, List[Tuple[float, int, int, str]]] = {}  # c -> (share, removed, pixels, stem)
    for stem in _progress(stems, len(stems), "report", progress):
        try:
            y_path = Path(labels_dir) / f"{stem}.png"
            y = read_label(y_path, biased_value=None)
            check_label_values(y, y_path, max_class, ignore_index, flag=flag)
            d = read_label(Path(debiased_dir) / f"{stem}.png")
            if y.shape != d.shape:
                raise ValueError(f"pseudo label {tuple(y.shape)} and debiased label {tuple(d.shape)} differ in size")
            _probe_image(find_image(images_dir, stem), tuple(y.shape))
        except FILE_ERRORS as e:
            _fail(stem, e, on_error, summary)
            continue
        counts = _removed_per_class(y, d, ignore_index)  # the same count as debias prints
        for c, (t_c, r_c) in counts.items():
            total[c] = total.get(c, 0) + t_c
            removed[c] = removed.get(c, 0) + r_c
            if r_c:
                per_class_images.setdefault(c, []).append((r_c / t_c, r_c, t_c, stem))
        fg_pixels = sum(t for t, _ in counts.values())
        if fg_pixels:
            per_image.append((sum(r for _, r in counts.values()) / fg_pixels, stem))
        summary.done += 1
    if not total:
        raise JobError(f"--labels {labels_dir}: no foreground pixel in any pseudo label read ({summary.done}): "
                       "nothing to report")
    num_classes = max(total)
    if class_names is None:
        class_names = ["background"] + [f"class {c}" for c in range(1, num_classes + 1)]
    if len(class_names) < num_classes + 1:
        raise ValueError(f"--class-names has {len(class_names)} names but labels reach class {num_classes}")
    share = [float("nan")] + [removed.get(c, 0) / total[c] if c in total else float("nan") for c in range(1, num_classes + 1)]
    ranking = sorted((c for c in range(1, num_classes + 1) if c in total), key=lambda c: -share[c])
    per_image.sort(key=lambda t: (-t[0], t[1]))
    examples = per_image[:num_examples]
    class_examples = {c: sorted(per_class_images.get(c, []), key=lambda t: (-t[0], -t[1], t[3]))[:per_class]
                      for c in ranking}
    all_fg = sum(total.values())

    out = Path(out_dir)
    _check_out_dir(out, "--out")
    from mars_plugin.commands.run_lock import LOCK_NAME, RunLock, remove_stale_tmp

    # One run at a time writes here; holding the lock, the .tmp-* files a killed run left are
    # stale: remove them.
    lock = RunLock(out / LOCK_NAME, f"--out {out}", "mars report").acquire()
    remove_stale_tmp(out)
    # Every output is written to a temporary file first and renamed at the end, report.json
    # last: a failure never leaves a chart without its report.json.
    staged: Dict[str, str] = {}

    def stage(name: str) -> str:
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=Path(name).suffix, dir=out)
        os.close(fd)
        staged[name] = tmp
        return tmp

    try:
        _report_outputs(stage, class_names, num_classes, share, total, ranking, examples, class_examples,
                        images_dir, labels_dir, debiased_dir, on_error, summary)
        report = {
            "share_definition": SHARE_DEFINITION,
            "classes": {class_names[c]: {"id": c, "pixels": total.get(c, 0), "removed": removed.get(c, 0),
                                         "share_removed": share[c], "pixel_share": total.get(c, 0) / all_fg}
                        for c in range(1, num_classes + 1) if c in total},
            "ranking": [class_names[c] for c in ranking],
            "most_changed": [{"stem": s, "share_removed": f} for f, s in examples],
            "per_class_examples": {class_names[c]: [{"stem": s, "share_removed": f, "removed": r, "pixels": t}
                                                    for f, r, t, s in class_examples[c]] for c in ranking},
            "num_images": summary.done,
        }
        Path(stage("report.json")).write_text(json.dumps(report, indent=2))
        umask = os.umask(0)
        os.umask(umask)
        for name in sorted(staged, key=lambda n: n == "report.json"):  # report.json last
            os.chmod(staged[name], 0o666 & ~umask)
            os.replace(staged[name], out / name)
    finally:
        for tmp in staged.values():
            if os.path.exists(tmp):
                os.unlink(tmp)
        lock.release()
    return report, summary


def _probe_image(path: Path, shape: Tuple[int, int]) -> None:
    """Open an image's header (not its pixels): refuses a file PIL cannot identify, a
    decompression bomb, and an image whose size differs from the label's."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            w, h = im.size
    except Exception as e:  # noqa: BLE001 -- any failure to open it is a bad file
        raise ValueError(f"{path}: cannot read image ({one_line(e)})") from None
    if (h, w) != shape:
        raise ValueError(f"image {path} {w}x{h} and pseudo label {shape[1]}x{shape[0]} (width x height) differ in size")


#: Longest side of a panel in the report's overlay grids. Photographs (VOC/COCO: 500-640 px) are
#: shrunk to it and small images are enlarged up to 3x towards it: at three times a 500 px photo,
#: a VOC per-class grid (20 classes x 2 rows x 4 panels) was 271 megapixels, past PIL's
#: decompression-bomb limit for anyone opening it.
PANEL_SIDE = 256
#: per_class.png shows the classes with the largest share removed first, at most this many (all
#: of them stay in report.json): 80 COCO classes of two rows each would be a grid no one reads.
MAX_GRID_CLASSES = 24


def _fit_panel(img: np.ndarray, y: torch.Tensor, d: torch.Tensor) -> Tuple[np.ndarray, torch.Tensor, torch.Tensor]:
    """Shrink an image and its two label maps to at most :data:`PANEL_SIDE` on the longer side
    (bilinear for the image, nearest for the labels); smaller images are returned as they are."""
    H, W = y.shape
    f = PANEL_SIDE / max(H, W)
    if f >= 1:
        return img, y, d
    from PIL import Image

    size = (max(1, round(W * f)), max(1, round(H * f)))
    small = np.asarray(Image.fromarray(img).resize(size, Image.BILINEAR))

    def nearest(t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.interpolate(t[None, None].float(), size=size[::-1], mode="nearest")[0, 0].to(t.dtype)

    return small, nearest(y), nearest(d)


def _report_outputs(stage, class_names, num_classes, share, total, ranking, examples, class_examples,
                    images_dir, labels_dir, debiased_dir, on_error, summary) -> None:
    """The chart and the overlays of :func:`report_job`, each written to ``stage(name)``."""
    from mars_plugin.commands import bar_charts, label_images, panel_grids
    bar_charts.save_iou_bar_chart(
        stage("biased_share.png"), list(class_names[1 : num_classes + 1]),
        {"pixels marked biased (% of the class's pseudo-label pixels)": [100 * s for s in share[1:]]},
        title=f"Which classes were biased (MARS), {summary.done} images", ylabel="marked biased (%)",
        order=[c - 1 for c in ranking],
        note=f"Share = {SHARE_DEFINITION}. Under each name: its pseudo-label pixels (a small class can rank "
             f"high on few pixels).",
        tick_notes=[_px(total.get(c, 0)) for c in range(1, num_classes + 1)],
    )
    panels: Dict[str, Tuple[List[Tuple[str, Any]], set]] = {}  # stem -> (panels, classes in its pseudo label)
    bad: set = set()

    def overlay(stem: str, caption: str) -> Optional[Tuple[str, Any]]:
        if stem in bad:
            return None
        if stem not in panels:
            try:
                img = read_image(find_image(images_dir, stem))
            except FILE_ERRORS as e:  # a truncated image passes the header probe
                bad.add(stem)
                _fail(stem, e, on_error, summary)
                return None
            y = read_label(Path(labels_dir) / f"{stem}.png", biased_value=None)
            d = read_label(Path(debiased_dir) / f"{stem}.png")
            img, y, d = _fit_panel(img, y, d)
            panels[stem] = ([
                ("image", img), ("pseudo label", label_images.blend(img, y)),
                ("removed pixels", label_images.removed_mask_image(img, y, d)), ("debiased label", label_images.blend(img, d)),
            ], {c for c in torch.unique(y).tolist() if 0 < c <= num_classes})
        return caption, panels[stem][0]

    def save_grid(name: str, captioned: List[Tuple[str, str]]) -> None:
        rows = [(stem, row) for stem, caption in captioned if (row := overlay(stem, caption)) is not None]
        if rows:  # legend: background, the classes drawn, removed, ignore
            shown = sorted(set().union(*(panels[s][1] for s, _ in rows)))
            side = max(max(np.asarray(p).shape[:2]) for _, (_, row) in rows for _, p in row)
            panel_grids.save_overlay_grid(stage(name), [row for _, row in rows], scale=max(1, min(3, PANEL_SIDE // side)),
                                          legend=panel_grids.class_legend(list(class_names), [0] + shown))

    save_grid("most_changed.png", [(stem, f"{stem}: {100 * frac:.0f}% of its foreground pixels removed")
                                   for frac, stem in examples])
    save_grid("per_class.png", [(stem, f"{class_names[c]}: {stem}: {100 * f:.0f}% of its {class_names[c]} "
                                       f"pixels removed ({r} of {t})")
                                for c in ranking[:MAX_GRID_CLASSES] for f, r, t, stem in class_examples[c]])
