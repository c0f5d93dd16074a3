"""What ``mars train`` reads, checked before step 1 and recorded with the run.

The other resumable commands record every input's identity and compare it on the next run
(:mod:`mars_plugin.runs.run_record`); ``mars train`` does the same for its data:

* :func:`list_train_files`: the ids (the label stems, or the ``stems`` asked for), exactly one
  image per id (``a.jpg`` beside ``a.png`` is refused, as ``mars predict`` and ``mars features``
  refuse it: :func:`mars_plugin.commands.inputs.list_images` lists them), an image for every
  label.
* :func:`data_record`: the run's data: both folders (resolved), each id's image and label
  identity (:func:`~mars_plugin.runs.identities.file_id`: name, size, mtime) and the image
  labels the teacher may use. The whole record is kept inside ``checkpoint.pt`` (a JSON string,
  read back weights-only), so the weights and the data they were trained on are replaced by one
  rename and can never disagree; ``train.json`` gets its digests (:func:`data_summary`).
* :func:`open_run` (rank 0, before the network is built): a checkpoint in ``--out`` of other
  settings or other data is refused with one line naming what changed (:func:`data_diff`: the
  first differing ids), unless ``restart`` (``--restart``) asks to train again from step 0 (the
  earlier run's files move to ``--out/.mars-stale/<UTC time>-<run id>/``). A
  moved folder whose files kept their identities (``mv``, ``cp -a``) is the same data.
* :func:`check_train_files`: every file the run will read, read once before step 1 (the
  same :meth:`~mars_plugin.networks.seg_data.TrainFolder.read` the steps use): decodable, label
  and image of one size, label values 0..C, 255 and (``--loss mars``) 254; labels with nothing
  to learn (every pixel 254 or 255) and ``--loss mars`` on labels without a single 254 (the
  pseudo labels given as the debiased ones) are refused. Skipped on a resume whose data
  identity is the recorded one: those files passed it when the run started.
* :func:`out_lock`: one run per ``--out`` (rank 0 holds its lock for the whole run);
  :func:`trim_log`: a resumed run's log keeps the lines of the steps it keeps.
* :func:`command_inputs`: the command line's data flags (``--root``'s folders, tags and names),
  with its quiet defaults made explicit: C is inferred (:func:`infer_num_classes`) or asked
  for, never silently 20. ``--loss mars`` without image labels is a warning
  (:func:`image_labels_warning`), printed by ``train`` once its checks passed.
"""
from __future__ import annotations

import json
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

from mars_plugin._checks import MAX_NUM_CLASSES
from mars_plugin.formats.files import BIASED_VALUE, IGNORE_VALUE, atomic_write, list_stems
from mars_plugin.runs.errors import JobError, one_line
from mars_plugin.runs.identities import file_id, json_digest, roles_digest
from mars_plugin.runs.io_pipeline import reading_threads
from mars_plugin.runs.output_aside import OutputAside
from mars_plugin.runs.run_lock import LOCK_NAME, RunLock, remove_stale_tmp
# The settings whose change makes a checkpoint in --out belong to another run (the ids, folders
# and files are compared by data_diff, which names them): the settings record's.
from mars_plugin.commands.train_settings import RUN_KEYS

__all__ = ["CHECKPOINT_NAME", "LOG_NAME", "SETTINGS_NAME", "TrainFiles", "list_train_files", "data_record",
           "data_summary", "data_diff", "check_train_files", "open_run", "infer_num_classes",
           "command_inputs", "image_labels_warning", "trim_log", "out_lock"]

CHECKPOINT_NAME = "checkpoint.pt"
LOG_NAME = "log.jsonl"
SETTINGS_NAME = "train.json"
#: What a run leaves in ``--out``, moved aside together by ``--restart`` (:func:`open_run`).
EARLIER_RUN_NAMES = (CHECKPOINT_NAME, LOG_NAME, SETTINGS_NAME)


#: How many ids a refusal names.
_SHOWN = 3


@dataclass(frozen=True)
class TrainFiles:
    """The files of a run: ``image_paths`` {stem: image file}, in training order (sorted)."""

    images: Path
    labels: Path
    image_paths: Dict[str, Path]

    @property
    def stems(self) -> List[str]:
        return list(self.image_paths)

    def label_path(self, stem: str) -> Path:
        return self.labels / f"{stem}.png"


def _few(ids: Sequence[str]) -> str:
    return ", ".join(ids[:_SHOWN]) + (", ..." if len(ids) > _SHOWN else "")


def list_train_files(images: os.PathLike, labels: os.PathLike, stems: Optional[Sequence[str]] = None) -> TrainFiles:
    """The ids and files of a run (see the module docstring); a ValueError or JobError of one
    line naming the flag otherwise."""
    from mars_plugin.commands.inputs import list_images

    images, labels = Path(images), Path(labels)
    for folder, flag in ((images, "--images"), (labels, "--labels")):
        if not folder.is_dir():
            raise ValueError(f"{flag} {folder}: not a folder")
    all_stems = list_stems(labels, (".png",))
    if stems is None:
        stems = all_stems
    else:
        missing = sorted(set(stems) - set(all_stems))
        if missing:
            raise ValueError(f"--labels {labels}: no label for {len(missing)} image(s), e.g. {missing[:3]}")
    if not stems:
        raise ValueError(f"--labels {labels}: no .png label files in this folder")
    items, clashes = list_images(images, "--images")
    clash = [s for s in stems if s in clashes]
    if clash:
        raise JobError(f"--images {images}: {len(clash)} id(s) have several images ({clash[0]}: "
                       f"{', '.join(clashes[clash[0]])}" + (f"; also {_few(clash[1:])}" if len(clash) > 1 else "")
                       + "): the run would train on one of them; rename all but one")
    have = dict(items)
    no_image = [s for s in stems if s not in have]
    if no_image:
        raise ValueError(f"--images {images}: no image for {len(no_image)} label(s), e.g. {no_image[:3]}")
    return TrainFiles(images, labels, {s: have[s] for s in stems})


def data_record(files: TrainFiles, image_labels: Optional[Mapping[str, Sequence[int]]]) -> Dict[str, Any]:
    """The run's data, JSON-able: ``{"images", "labels"}`` (resolved folders), ``"files"``
    {stem: [image identity, label identity]} and ``"image_labels"`` ({stem: sorted class ids}
    of the run's ids, or None: each label's own classes). Taken before any file is read: a
    file changed while the run reads it is seen as changed next time."""
    return {
        "images": os.fspath(files.images.resolve()),
        "labels": os.fspath(files.labels.resolve()),
        "files": {s: [file_id(p), file_id(files.label_path(s))] for s, p in files.image_paths.items()},
        "image_labels": None if image_labels is None else
        {s: sorted(int(c) for c in image_labels[s]) for s in files.image_paths if s in image_labels},
    }


def data_summary(record: Mapping[str, Any]) -> Dict[str, Any]:
    """What ``train.json`` says of the data: the folders, the number of ids and digests of the
    identities and the image labels (the whole record is in the checkpoint)."""
    il = record["image_labels"]
    return {"images": record["images"], "labels": record["labels"], "ids": len(record["files"]),
            "files": roles_digest(record["files"]), "image_labels": None if il is None else json_digest(il)}


def data_diff(old: Mapping[str, Any], new: Mapping[str, Any]) -> List[str]:
    """What differs between two data records, a phrase each (empty: the same data): changed
    image or label files (with the folders, when they differ), added or removed ids, other
    image labels; each names its first few ids."""
    of, nf = old.get("files") or {}, new["files"]
    out: List[str] = []
    for i, (flag, key, what) in enumerate((("--images", "images", "image"), ("--labels", "labels", "label"))):
        changed = [s for s in nf if s in of and of[s][i] != nf[s][i]]
        if changed:
            where = f" (folder {old.get(key)} -> {new[key]})" if old.get(key) != new[key] else ""
            out.append(f"{flag}: {len(changed)} of {len(nf)} {what} files changed{where}, e.g. {_few(changed)}")
    added = [s for s in nf if s not in of]
    removed = [s for s in of if s not in nf]
    if added:
        out.append(f"{len(added)} id(s) added, e.g. {_few(added)}")
    if removed:
        out.append(f"{len(removed)} id(s) removed, e.g. {_few(removed)}")
    oi, ni = old.get("image_labels"), new.get("image_labels")
    if oi != ni:
        if oi is None or ni is None:
            out.append(f"--image-labels: {'none' if oi is None else 'given'} -> {'none' if ni is None else 'given'}")
        else:
            keys = sorted(k for k in set(oi) | set(ni) if oi.get(k) != ni.get(k))
            out.append(f"--image-labels: the classes of {len(keys)} id(s) differ, e.g. {keys[0]}: "
                       f"{oi.get(keys[0])} -> {ni.get(keys[0])}")
    return out


def check_train_files(dataset: Any, num_classes: int, loss: str, *, workers: int = 1,
                      progress: bool = True, require_biased: bool = True) -> None:
    """Read every sample of ``dataset`` (a :class:`~mars_plugin.networks.seg_data.TrainFolder`)
    once, with threads (decoding releases the GIL: ``workers`` or torch's CPU threads, whichever
    is more; nothing else runs yet) and a progress bar; a JobError of
    one line naming the first bad file (in id order), or the label folder when the labels as a
    whole cannot train (see the module docstring)."""
    import torch

    from mars_plugin.commands.inputs import _progress

    C = int(num_classes)
    stems = list(dataset.stems)

    def one(stem: str) -> Tuple[Optional[str], int, int]:
        try:
            _, label, _ = dataset.read(stem)
        except Exception as e:  # noqa: BLE001 -- any failure to read a file is that file's, named
            return one_line(e), 0, 0
        return None, int((label == BIASED_VALUE).sum()), int((label <= C).sum())

    biased = learnable = 0
    # the threads read under this run's bound (--max-memory), as this thread would
    pool = reading_threads(max(1, int(workers), torch.get_num_threads()), "mars-check")
    try:
        for err, b, n in _progress(pool.map(one, stems), len(stems), "check data", progress):
            if err is not None:
                raise JobError(f"{err} (checked before step 1)")
            biased += b
            learnable += n
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    labels = dataset.labels_dir
    if not learnable:
        raise JobError(f"--labels {labels}: every pixel of all {len(stems)} labels is {BIASED_VALUE} (biased) or "
                       f"{IGNORE_VALUE} (ignore): no class 0..{C} to learn from; is it the right folder?")
    if loss == "mars" and require_biased and not biased:
        raise JobError(f"--labels {labels}: --loss mars, but none of the {len(stems)} labels holds a biased pixel "
                       f"({BIASED_VALUE}): pseudo labels, not debiased ones? Give mars debias's --out, or --loss ce to "
                       "train plain CE on these labels")


def _recorded_data(ck: Mapping[str, Any]) -> Optional[Dict[str, Any]]:
    """The data record a checkpoint holds (None: written without one, by an older mars train)."""
    try:
        rec = json.loads(ck["data"])
    except (KeyError, TypeError, ValueError):
        return None
    return rec if isinstance(rec, dict) and isinstance(rec.get("files"), dict) else None


def open_run(out: Path, settings: Mapping[str, Any], record: Mapping[str, Any], *, restart: bool,
             check: Callable[[], None], aside: Optional[OutputAside] = None) -> Optional[Dict[str, Any]]:
    """Rank 0, holding ``out``'s lock, before the network is built: the checkpoint to resume
    (on the CPU), or None to train from step 0.

    A checkpoint of other settings or other data is a JobError naming what differs (the
    checkpoint, the log and ``train.json`` are left as they are). Without a checkpoint, or with
    ``restart``, ``check()`` (:func:`check_train_files`) runs first; then ``restart`` moves the
    earlier run's checkpoint, log and ``train.json`` into ``aside`` (default: a new one of
    ``out``), ``out/.mars-stale/<UTC time>-<run id>/``: none of them is deleted, and a restart
    killed before its first checkpoint leaves none of the earlier run's beside its own.
    ``train.json`` (the settings and :func:`data_summary`) is written last, so that it never
    names data the checkpoint did not see."""
    from mars_plugin.networks.seg_checkpoint import load_checkpoint

    ck_path = out / CHECKPOINT_NAME
    ck = None
    if ck_path.is_file() and not restart:
        ck = load_checkpoint(ck_path, map_location="cpu")
        again = "give another --out, or --restart to train again from step 0"
        old = ck.get("settings", {})
        diff = [k for k in RUN_KEYS if old.get(k) != settings.get(k)]
        if diff:
            raise JobError(f"--out {out}: holds a checkpoint of another run (differs in "
                           + ", ".join(f"{k}: {old.get(k)!r} -> {settings.get(k)!r}" for k in diff) + f"); {again}")
        step = int(ck.get("iteration", 0))
        recorded = _recorded_data(ck)
        if recorded is None:
            raise JobError(f"--out {out}: holds a checkpoint (step {step}) without a record of the data it was trained "
                           f"on (written by an older mars train); {again}")
        changes = data_diff(recorded, record)
        if changes:
            raise JobError(f"--out {out}: holds a checkpoint (step {step}) trained on other data ("
                           + "; ".join(changes[:4]) + f"); {again}")
    else:
        check()
        if restart:
            aside = aside if aside is not None else OutputAside(out, f"--out {out}")
            for name in EARLIER_RUN_NAMES:
                if os.path.lexists(out / name):
                    aside.move(name)
    text = json.dumps({**settings, "data": data_summary(record)}, indent=2)
    atomic_write(out / SETTINGS_NAME, lambda tmp: Path(tmp).write_text(text))
    return ck


def trim_log(path: Path, step: int) -> None:
    """Keep the log lines of steps <= ``step`` (a resumed run writes the later ones again)."""
    if not path.is_file():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if int(json.loads(line)["iteration"]) <= step:
                keep.append(line)
        except (ValueError, KeyError, TypeError):
            continue
    atomic_write(path, lambda tmp: Path(tmp).write_text("".join(k + "\n" for k in keep)))


@contextmanager
def out_lock(out: Path, rank: int) -> Iterator[None]:
    """One run per ``--out``: a second one (another shell, a scheduler retrying) would interleave
    checkpoints and log lines of two runs. Rank 0 holds the lock for the whole run; the lock
    ends with its process, and a folder made only for a run refused here is removed again."""
    if rank != 0:
        yield
        return
    made_out = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    lock = RunLock(out / LOCK_NAME, f"--out {out}", "mars train")
    try:
        lock.acquire()
    except BaseException:
        _remove_if_empty(out, made_out)
        raise
    try:
        remove_stale_tmp(out)
        yield
    finally:
        lock.release()
        _remove_if_empty(out, made_out)


def _remove_if_empty(out: Path, made: bool) -> None:
    """Remove ``out`` if this run made it and left nothing in it (a refused or failed start)."""
    if made:
        try:
            out.rmdir()
        except OSError:
            pass


def command_inputs(args: Any) -> Tuple[Path, int, Optional[List[str]], Optional[Dict[str, List[int]]], List[str]]:
    """``mars train``'s data flags resolved: (images folder, C, class names, image labels, notes).

    ``--root`` gives the images, the xml tags (unless ``--image-labels``) and the class names
    (DHR's dataset json, or VOC's). ``notes``: lines for stderr (C inferred from partial
    evidence), printed by :func:`~mars_plugin.commands.train.train` once its checks passed."""
    from mars_plugin.commands.label_formats import _class_names, read_image_labels

    names = _class_names(args.class_names)
    images = args.images
    image_labels = None
    notes: List[str] = []
    if args.root is not None:
        from mars_plugin.adapters.wsss.dhr import load_image_labels
        from mars_plugin.adapters.wsss.dhr_layout import DHRLayout

        layout = DHRLayout(args.root, args.data)
        images = images or layout.image_dir(args.domain)
        # DHR's dataset json, or VOC's names where DHR knows them without it (then C is inferred).
        known = (Path(args.root) / args.data / f"{args.data}.json").is_file() or \
            (args.num_classes is None and args.data == "VOC2012")
        if names is None and known:
            names = list(layout.class_names())
        if args.image_labels is None:
            xml = layout.xml_dir(args.domain)
            if not xml.is_dir():
                raise ValueError(f"--root {args.root}: no xml folder {xml} for the image-level tags "
                                 "(or give --image-labels)")
            hot = load_image_labels(xml, class_names=names)
            image_labels = {s: [int(i) + 1 for i in h.nonzero().flatten().tolist()] for s, h in hot.items()}
    if images is None:
        raise ValueError("--images: required without --root")
    num_classes = args.num_classes
    if num_classes is None:
        num_classes, note = infer_num_classes(names, args.image_labels)
        notes += [f"note: {note}"] if note else []
    elif names is not None and len(names) != num_classes + 1:
        raise ValueError(f"--class-names {args.class_names}: {len(names)} names for --num-classes {num_classes} "
                         f"(expected {num_classes + 1}, background first)")
    if args.image_labels is not None:
        image_labels = read_image_labels(args.image_labels, num_classes)
    return Path(images), num_classes, names, image_labels, notes


def infer_num_classes(names: Optional[Sequence[str]], image_labels: Optional[os.PathLike]) -> Tuple[int, Optional[str]]:
    """C when ``--num-classes`` is not given, and a note when it is inferred from partial
    evidence: the class names (``--class-names``, DHR's dataset with ``--root``), else the
    largest class id of the ``--image-labels`` file; else a ValueError asking for it (never a
    silent 20, which trains 20 classes on a 6-class dataset)."""
    from mars_plugin.commands.label_formats import read_image_labels

    if names is not None:
        return len(names) - 1, None
    if image_labels is not None:
        tags = read_image_labels(image_labels, MAX_NUM_CLASSES) or {}
        top = max((max(v) for v in tags.values() if v), default=0)
        if top:
            return top, (f"--num-classes {top}: the largest class id in --image-labels {image_labels} (give "
                         "--num-classes if the dataset has more classes)")
    raise ValueError("--num-classes: not given, and nothing to infer it from (--class-names, --root's dataset, "
                     "--image-labels); give C, the number of foreground classes (VOC: 20, COCO: 80)")


def image_labels_warning(loss: str, image_labels: Optional[Mapping[str, Any]]) -> Optional[str]:
    """The warning for ``--loss mars`` without image labels (None otherwise)."""
    if loss != "mars" or image_labels is not None:
        return None
    return ("no --image-labels: the teacher fills the biased pixels (254) of an image only with the classes left in "
            "its label, so a class whose pixels were all marked biased is lost for that image; give --image-labels "
            "(mars reproduce writes image_labels.json; with --root the xml tags are read)")
