"""``mars sample``: a small sample tree in a WSSS codebase's own layout, to try every command offline.

The images, ground truth, pseudo labels and USS-like features are the built-in synthetic world
(:mod:`mars_plugin.worlds.synthetic_scenes`: boat pseudo labels leak into the sea, train into the rail), with
its six classes written as their PASCAL VOC ids (boat 4, train 19, dog 12, car 7, person 15,
bird 3: the trees are VOC-shaped, ``--num-classes 20``), or, in ``dhr-coco`` (DHR's COCO 2014
tree, what ``mars reproduce --data COCO2014`` reads), as their COCO ids (boat 9, train 7, dog
17, car 3, person 1, bird 15; ``--num-classes 80``, domain ``train``). The labels and tag
files are written by the adapters' own writers in the codebase's layout (:data:`LAYOUTS`), and
the CAMs in each codebase's own CAM files and folder (smooth maps of the pseudo labels' regions:
``mars crf`` refines them on the images). ``weights/`` holds
random-weight models in the files ``mars features`` reads: a tiny STEGO (DINO ViT-Ti/8 +
heads) as DHR's two files and as a Lightning-like ``.ckpt`` that loads with
``weights_only=True``, and a tiny DINOv2 (ViT-Ti/14) with DHR's CAUSE heads. Random weights:
the features they give mean nothing, the commands run exactly as on real files. Everything
takes a few seconds and a few MB.
"""
from __future__ import annotations

import json
import os
import shlex
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Dict, List, Tuple, Union

import numpy as np
import torch

from mars_plugin.commands.sample_settings import TREES, SampleSettings
from mars_plugin.formats.files import atomic_write, write_features, write_image, write_label

__all__ = ["TREES", "LAYOUTS", "VOC_IDS", "COCO_IDS", "DHR_DATA", "class_ids", "image_ids", "write_sample_tree",
           "sample_commands", "describe", "CHEAP_TRAIN"]

#: Where each tree keeps what (relative to ``--out``): images, ground truth, pseudo labels,
#: image-level tags (a file or an xml folder), the synthetic world's features and the CAMs in
#: the folder where the codebase writes them (IRNet step/make_cam.py ``result/cam``, AdvCAM
#: obtain_CAM_masking.py ``result/cam_adv_mask``, SEAM infer_SEAM.py ``--out_cam``, RS+EPM
#: infer_rsepm.py ``experiments/predictions/<tag>/<domain>``, DHR produce_wss_masks.py
#: ``experiments/results/<data>/<tag>@<checkpoint>/<domain>`` with its default tag).
LAYOUTS: Dict[str, Dict[str, str]] = {
    "dhr": dict(images="VOC2012/train_aug/image", gt="VOC2012/train_aug/mask", pseudo="WSS/VOC2012/RSEPM/train_aug",
                tags="VOC2012/train_aug/xml", features="VOC2012/train_aug/SYNTHETIC",
                cams="experiments/results/VOC2012/ResNet-101@VOC2012@DeepLabv3+@DHR@last/train_aug"),
    # DHR's COCO 2014 tree: the same layout under COCO2014/, domain train (DHR's README,
    # "Preparing datasets"; mars_plugin.commands.reproduce.default_domain)
    "dhr-coco": dict(images="COCO2014/train/image", gt="COCO2014/train/mask", pseudo="WSS/COCO2014/RSEPM/train",
                     tags="COCO2014/train/xml", features="COCO2014/train/SYNTHETIC",
                     cams="experiments/results/COCO2014/ResNet-101@COCO2014@DeepLabv3+@DHR@last/train"),
    "irnet": dict(images="JPEGImages", gt="SegmentationClassAug", pseudo="result/sem_seg",
                  tags="voc12/cls_labels.npy", features="features", cams="result/cam"),
    "advcam": dict(images="JPEGImages", gt="SegmentationClassAug", pseudo="result/sem_seg",
                   tags="voc12/cls_labels.npy", features="features", cams="result/cam_adv_mask"),
    "seam": dict(images="JPEGImages", gt="SegmentationClassAug", pseudo="out_rw", tags="voc12/cls_labels.npy",
                 features="features", cams="out_cam"),
    "rsepm": dict(images="VOC2012/train_aug/image", gt="VOC2012/train_aug/mask",
                  pseudo="experiments/pseudo-labels/sample/train", tags="VOC2012/train_aug/xml", features="features",
                  cams="experiments/predictions/sample/train"),
}
#: The synthetic world's class ids (boat, train, dog, car, person, bird) as VOC's.
VOC_IDS = (0, 4, 19, 12, 7, 15, 3)
#: The same classes as COCO 2014's ids (``COCO_CLASSES`` order: person 1, car 3, train 7, boat 9,
#: bird 15, dog 17).
COCO_IDS = (0, 9, 7, 17, 3, 1, 15)
#: DHR's ``--data`` of its trees (the others are VOC-shaped: their model files say VOC2012 too).
DHR_DATA = {"dhr": "VOC2012", "dhr-coco": "COCO2014"}
_WIDTH, _DIM = 192, 16  # ViT-Ti; STEGO's code dimension


def class_ids(tree: str) -> Tuple[int, ...]:
    """The world's class ids in ``tree``: COCO's in the COCO tree, VOC's elsewhere."""
    return COCO_IDS if tree == "dhr-coco" else VOC_IDS


def image_ids(tree: str, n: int) -> List[str]:
    """The ``n`` image ids of ``tree``, in its dataset's form: VOC's ``2007_000001`` (IRNet
    stores them as 2007000001), COCO 2014's ``COCO_train2014_000000000001``."""
    if tree == "dhr-coco":
        return [f"COCO_train2014_{i + 1:012d}" for i in range(n)]
    return [f"2007_{i + 1:06d}" for i in range(n)]


def _data(tree: str) -> str:
    return DHR_DATA.get(tree, "VOC2012")


def _relabel(label: torch.Tensor, ids: Tuple[int, ...]) -> torch.Tensor:
    lut = torch.arange(256)
    lut[: len(ids)] = torch.tensor(ids)
    return lut[label.long()]


def _random_vit(patch: int, seed: int, dinov2: bool = False) -> Dict[str, torch.Tensor]:
    from mars_plugin.adapters.uss.vit import DinoViT

    g = torch.Generator().manual_seed(seed)
    vit = DinoViT(patch, _WIDTH, 1, num_patches=16, layer_scale=dinov2, mask_token=dinov2)
    sd = {}
    for k, v in vit.state_dict().items():
        base = 1.0 if k.endswith(("norm1.weight", "norm2.weight", "norm.weight")) else 0.0
        sd[k] = base + 0.1 * torch.randn(v.shape, generator=g)
    return sd


def _save(obj, path: Path) -> None:
    atomic_write(path, lambda tmp: torch.save(obj, tmp))


def _write_weights(folder: Path, seed: int, data: str = "VOC2012") -> None:
    """Random STEGO (DHR's two files and a Lightning-like .ckpt) and DINOv2 + DHR's CAUSE heads,
    the heads named for DHR's ``data`` (``STEGO_<data>.pt``, ``CAUSE_<data>.pt``)."""
    from mars_plugin.adapters.uss.cause_decoder import CAUSESegment

    g = torch.Generator().manual_seed(seed + 1)
    dino = _random_vit(8, seed)
    heads = {"cluster1": {"0.weight": torch.randn(_DIM, _WIDTH, 1, 1, generator=g) / 14,
                          "0.bias": torch.zeros(_DIM)},
             "cluster2": {"0.weight": torch.randn(_WIDTH, _WIDTH, 1, 1, generator=g) / 14,
                          "0.bias": torch.zeros(_WIDTH),
                          "2.weight": torch.randn(_DIM, _WIDTH, 1, 1, generator=g) / 14, "2.bias": torch.zeros(_DIM)}}
    _save(dino, folder / "dino_tiny_random.pth")
    _save(heads, folder / f"STEGO_{data}.pt")
    state = {"net.model." + k: v for k, v in dino.items()}
    state.update({f"net.{h}.{k}": v for h, sd in heads.items() for k, v in sd.items()})
    # A Lightning checkpoint of plain values only: it loads with torch.load(weights_only=True)
    _save({"epoch": 0, "global_step": 0, "pytorch-lightning_version": "1.4.9", "state_dict": state,
           "hyper_parameters": {"dim": _DIM}}, folder / "stego_tiny_random.ckpt")
    torch.manual_seed(seed + 2)
    segment = CAUSESegment(_WIDTH)
    with torch.no_grad():
        segment.head_ema.query_pos.normal_(0, 0.1)  # zeros in a fresh module
    _save(_random_vit(14, seed + 3, dinov2=True), folder / "dinov2_tiny_random.pth")
    _save({"decoder": segment.state_dict(), "codebook": torch.randn(16, _WIDTH, generator=g)},
          folder / f"CAUSE_{data}.pt")


def _xml(path: Path, gt: torch.Tensor, names) -> None:
    """A VOC annotation: the image size and one object (name, box) per class of ``gt``."""
    root = ET.Element("annotation")
    size = ET.SubElement(root, "size")
    for k, v in (("width", gt.shape[1]), ("height", gt.shape[0]), ("depth", 3)):
        ET.SubElement(size, k).text = str(v)
    for c in sorted(set(gt.unique().tolist()) - {0, 255}):
        ys, xs = torch.nonzero(gt == c, as_tuple=True)
        obj = ET.SubElement(root, "object")
        ET.SubElement(obj, "name").text = names[c]
        box = ET.SubElement(obj, "bndbox")
        for k, v in (("xmin", xs.min()), ("ymin", ys.min()), ("xmax", xs.max()), ("ymax", ys.max())):
            ET.SubElement(box, k).text = str(int(v) + 1)
    atomic_write(path, lambda tmp: ET.ElementTree(root).write(tmp))


def _class_maps(pseudo: torch.Tensor, classes: List[int], size: int) -> np.ndarray:
    """(K, H, W) float32 CAM-like maps in [0, 1], one per class of ``classes`` (the image's
    tags): its pseudo-label region blurred (sigma size/16) and divided by its maximum + 1e-5, as
    IRNet normalises its CAMs. They keep the pseudo labels' leaks (boat into sea, train into
    rail) and have no edges, which the dense CRF finds in the image."""
    from scipy.ndimage import gaussian_filter

    maps = [gaussian_filter((pseudo == c).numpy().astype(np.float32), size / 16, mode="nearest") for c in classes]
    maps = np.stack(maps) if maps else np.zeros((0,) + tuple(pseudo.shape), np.float32)
    return (maps / (maps.max(axis=(1, 2), keepdims=True) + 1e-5)).astype(np.float32)


def _write_cams(tree: str, path: Path, ids: List[int], maps: np.ndarray) -> None:
    """One image's CAM file at ``path`` in ``tree``'s own format (what its adapter's
    ``load_cams`` reads): ``maps`` (K, H, W) in [0, 1] of the class ids ``ids`` (VOC's 1..20 or
    COCO's 1..80, without background). The pickled formats are written as the codebases write
    them; reading them back needs ``--trust-pickle``."""
    import pickle

    keys0 = np.asarray(ids, dtype=np.int64) - 1  # the codebases' 0-based class indices
    if tree in ("irnet", "advcam"):  # step/make_cam.py:44-56: torch keys and stride-4 cam, numpy high_res
        H, W = maps.shape[1:]
        strided = torch.nn.functional.interpolate(torch.from_numpy(maps)[None], ((H - 1) // 4 + 1, (W - 1) // 4 + 1),
                                                  mode="bilinear", align_corners=False)[0]
        strided /= strided.amax(dim=(1, 2), keepdim=True) + 1e-5
        obj = {"keys": torch.from_numpy(keys0), "cam": strided, "high_res": maps}
        atomic_write(path, lambda tmp: np.save(tmp, obj, allow_pickle=True))
    elif tree == "seam":  # infer_SEAM.py:80-85: {0-based class index: (H, W) map}
        obj = {int(k): m for k, m in zip(keys0, maps)}
        atomic_write(path, lambda tmp: np.save(tmp, obj, allow_pickle=True))
    elif tree == "rsepm":  # infer_rsepm.py:122-134: keys [0, class + 1, ...], seeds without background
        obj = {"keys": np.pad(keys0 + 1, (1, 0), mode="constant"), "seed": maps}

        def dump(tmp: str) -> None:
            with open(tmp, "wb") as f:
                pickle.dump(obj, f)

        atomic_write(path, dump)
    else:  # DHR produce_wss_masks.py:39-48: the softmax of background and classes (> 0.05), numpy
        scores = np.concatenate([1 - maps.max(0, initial=0)[None], maps])
        probs = np.exp(8 * scores)
        probs /= probs.sum(0, keepdims=True)
        keep = probs.reshape(len(probs), -1).max(1) > 0.05
        obj = {"keys": np.concatenate([[0], ids]).astype(np.int64)[keep], "masks": probs[keep].astype(np.float16)}
        _save(obj, path)


def write_sample_tree(tree: str, out: Union[str, os.PathLike], *, num_images: int = 8, size: int = 64,
                      seed: int = 0) -> Dict[str, Path]:
    """Write the sample tree ``tree`` (one of :data:`TREES`) into ``out``, a new or empty folder
    (the arguments are :class:`~mars_plugin.commands.sample_settings.SampleSettings`' fields).

    Returns the paths of :data:`LAYOUTS` (absolute) plus ``root`` and ``weights``.
    """
    return _write_tree(SampleSettings(tree=tree, num_images=num_images, size=size, seed=seed), out)


def _write_tree(s: SampleSettings, out: Union[str, os.PathLike]) -> Dict[str, Path]:
    """:func:`write_sample_tree` on checked settings (also ``mars sample``'s)."""
    import shutil
    import tempfile

    final = Path(out)
    if final.exists() and (not final.is_dir() or any(final.iterdir())):
        raise ValueError(f"--out {final}: exists and is not an empty folder; give a new one")
    final.parent.mkdir(parents=True, exist_ok=True)
    # Written in a temporary folder beside --out and renamed at the end: an interrupted run
    # leaves no half tree (which a second run would refuse as a used folder).
    root = Path(tempfile.mkdtemp(prefix=".tmp-sample-", dir=final.parent))
    try:
        _write(s.tree, root, s.num_images, s.size, s.seed)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(root, 0o777 & ~umask)  # mkdtemp's folder is private (0700)
        if final.is_dir():
            final.rmdir()
        os.replace(root, final)
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    return {"root": final, "weights": final / "weights", **{k: final / v for k, v in LAYOUTS[s.tree].items()}}


def _write(tree: str, root: Path, num_images: int, size: int, seed: int) -> None:
    """The files of :func:`write_sample_tree` under ``root``."""
    import importlib

    from mars_plugin.adapters.wsss._common import COCO_CLASSES, VOC_CLASSES
    from mars_plugin.commands.demo import WORLD_NOISE
    from mars_plugin.worlds.synthetic_scenes import make_world

    world = make_world(num_images, size=size, seed=seed, **WORLD_NOISE)
    ids = image_ids(tree, num_images)
    lut, names = (COCO_IDS, COCO_CLASSES) if tree == "dhr-coco" else (VOC_IDS, VOC_CLASSES)
    gt = [_relabel(y, lut) for y in world.gt]
    pseudo = [(i, _relabel(y, lut)) for i, y in zip(ids, world.pseudo)]
    paths = {k: root / v for k, v in LAYOUTS[tree].items()}
    from mars_plugin.commands.crf_job import CAM_EXTENSIONS

    cam_ext = CAM_EXTENSIONS["dhr" if tree in DHR_DATA else tree]
    for i, stem in enumerate(ids):
        write_image(paths["images"] / f"{stem}.jpg", world.images[i])
        # the image's tags as the world's class indices, in the order of the codebase's ids
        # (upstream's keys are np.nonzero of the tag vector: ascending)
        tags = sorted((c for c in world.gt[i].unique().tolist() if 0 < c < 255), key=lambda c: lut[c])
        _write_cams(tree, paths["cams"] / f"{stem}{cam_ext}", [lut[c] for c in tags],
                    _class_maps(world.pseudo[i], tags, size))
        write_label(paths["gt"] / f"{stem}.png", gt[i])
        if tree in DHR_DATA:  # DHR's own dataset stores its features as fp16 .pt tensors
            _save(world.features[i].half().clone(), paths["features"] / f"{stem}.pt")
        else:
            write_features(paths["features"] / f"{stem}.npy", world.features[i])
        if paths["tags"].suffix != ".npy":
            _xml(paths["tags"] / f"{stem}.xml", gt[i], names)
    adapter = importlib.import_module(f"mars_plugin.adapters.wsss.{'dhr' if tree in DHR_DATA else tree}")
    if tree in DHR_DATA:
        layout = adapter.DHRLayout(root, _data(tree))
        text = json.dumps({"names": list(names), "ignore": 255})  # DHR's <data>.json
        atomic_write(layout.dataset_json, lambda tmp: Path(tmp).write_text(text))
        adapter.write_masks(pseudo, layout, "RSEPM", paths["pseudo"].name)
    else:  # the codebase's PNG mode (IRNet, AdvCAM, SEAM grayscale, RS+EPM palette)
        adapter.write_debiased(pseudo, paths["pseudo"])
    if paths["tags"].suffix == ".npy":  # voc12/cls_labels.npy: IRNet/AdvCAM int ids, SEAM's strings
        hot = {}
        for stem, y in zip(ids, gt):
            v = np.zeros(20, np.float32)
            v[[c - 1 for c in set(y.unique().tolist()) - {0, 255}]] = 1
            hot[stem if tree == "seam" else np.int32(int(stem.replace("_", "")))] = v
        atomic_write(paths["tags"], lambda tmp: np.save(tmp, hot, allow_pickle=True))
        atomic_write(paths["tags"].parent / "train_aug.txt", lambda tmp: Path(tmp).write_text("\n".join(ids) + "\n"))
    _write_weights(root / "weights", seed, _data(tree))


#: ``mars reproduce --train`` at a size that runs in about a minute on 2 CPU cores (the defaults,
#: the authors' 30,000 steps of 16 512x512 crops on ResNet-101, take hours there); the README quotes it.
CHEAP_TRAIN = ("--train --train-backbone resnet18 --iterations 10 --train-batch-size 2 --crop 48 --min-size 40 "
               "--max-size 56 --loader-workers 0")


def sample_commands(tree: str, out: Union[str, os.PathLike]) -> List[str]:
    """The commands to try next on the sample tree ``tree`` written into ``out``, in order."""
    r = Path(out)
    p = {k: str(r / v) for k, v in LAYOUTS[tree].items()}
    w = r / "weights"
    q = shlex.quote
    pickle = " --trust-pickle" if p["tags"].endswith(".npy") else ""  # cls_labels.npy is a pickle
    dhr, data = tree in DHR_DATA, _data(tree)
    domain = Path(p["images"]).parent.name  # DHR's domain: train_aug (VOC), train (COCO)
    feats = r / data / domain / "STEGO" if dhr else r / "features_stego"
    debiased = {"dhr": r / "MARS/VOC2012/debiased/train_aug", "dhr-coco": r / "MARS/COCO2014/debiased/train",
                "irnet": r / "result/sem_seg_mars", "advcam": r / "result/sem_seg_mars", "seam": r / "out_rw_mars",
                "rsepm": r / "experiments/pseudo-labels/sample@MARS/train"}[tree]
    # DHR's dataset json names the classes; the other codebases keep VOC's names in their code
    names = f" --class-names {q(str(r / data / f'{data}.json'))}" if dhr else ""
    num_classes = 80 if tree == "dhr-coco" else 20
    cmds = []
    if dhr:
        cmds.append(f"mars features --uss stego --backbone {q(str(w / 'dino_tiny_random.pth'))} --heads "
                    f"{q(str(w / f'STEGO_{data}.pt'))} --dhr --format pt --images {q(p['images'])} --out {q(str(feats))}")
    else:
        cmds.append(f"mars features --uss stego --checkpoint {q(str(w / 'stego_tiny_random.ckpt'))} --images "
                    f"{q(p['images'])} --out {q(str(feats))}")
    common = f"--labels {q(p['pseudo'])} --wsss {'dhr' if dhr else tree} --image-labels {q(p['tags'])}{pickle}"
    cmds += [
        f"mars centroids --features {q(p['features'])} {common} --num-classes {num_classes} "
        f"--out {q(str(r / 'centroids.pt'))}",
        f"mars debias --features {q(p['features'])} {common} --centroids {q(str(r / 'centroids.pt'))} "
        f"--images {q(p['images'])} --out {q(str(debiased))}",
        f"mars evaluate --pred {q(str(debiased))} --gt {q(p['gt'])} --num-classes {num_classes}{names}",
        f"mars report --labels {q(p['pseudo'])} --debiased {q(str(debiased))} --images {q(p['images'])} "
        f"--out {q(str(r / 'report'))}{names}",
    ]
    # `mars crf` on the tree's CAMs (its codebase's rule and CRF), into the folder where the
    # codebase puts what its CRF step makes (IRNet/AdvCAM result/ir_label, DHR's WSS masks)
    crf_out = {"dhr": r / "WSS/VOC2012/DHR/train_aug", "dhr-coco": r / "WSS/COCO2014/DHR/train",
               "irnet": r / "result/ir_label", "advcam": r / "result/ir_label", "seam": r / "out_cam_crf",
               "rsepm": r / "experiments/pseudo-labels/sample@CRF/train"}[tree]
    cmds += [  # --trust-pickle: every codebase's CAM file is a pickle (DHR's .pt holds numpy arrays)
        f"mars crf --cams {q(p['cams'])} --wsss {'dhr' if dhr else tree} --trust-pickle --images {q(p['images'])} "
        f"--out {q(str(crf_out))}",
        f"mars evaluate --pred {q(str(crf_out))} --gt {q(p['gt'])} --num-classes {num_classes}{names}",
    ]
    if dhr:
        base = f"mars reproduce --root {q(str(r))}" + (f" --data {data}" if data != "VOC2012" else "") + \
            f" --pseudo {q(p['pseudo'])}"
        stego = f"{base} --backbone {q(str(w / 'dino_tiny_random.pth'))} --heads {q(str(w / f'STEGO_{data}.pt'))} "
        cmds.append(f"{stego}--out {q(str(r / 'reproduce_stego'))}")
        if tree == "dhr":  # the cheap second step on the VOC tree (the README's line); COCO's is the same flags
            cmds.append(f"{stego}--out {q(str(r / 'reproduce_stego'))} {CHEAP_TRAIN}")
        cmds.append(f"{base} --uss cause --backbone {q(str(w / 'dinov2_tiny_random.pth'))} --heads "
                    f"{q(str(w / f'CAUSE_{data}.pt'))} --out {q(str(r / 'reproduce_cause'))}")
    return cmds


def describe(tree: str, out: Union[str, os.PathLike]) -> Tuple[str, ...]:
    """What ``mars sample`` prints: where things are, then the commands to try."""
    r = Path(out)
    lay = LAYOUTS[tree]
    which = "COCO 2014's class ids, in DHR's COCO layout" if tree == "dhr-coco" else \
        "VOC's class ids, in that codebase's layout"
    lines = [f"sample {tree} tree -> {r}: the synthetic world (boat and train pseudo labels leak into sea and rail) "
             f"with {which}:"]
    lines += [f"  {k:<9}{r / v}" for k, v in lay.items()]
    lines.append(f"  {'weights':<9}{r / 'weights'} (random weights: tiny STEGO as DHR's two files and as a "
                 "weights-only .ckpt, tiny DINOv2 + DHR's CAUSE heads)")
    lines.append("  (the cams are smooth maps of the pseudo labels' regions, in the codebase's own CAM files: "
                 "`mars crf` below refines them)")
    lines.append("try next:")
    lines += [f"  {c}" for c in sample_commands(tree, out)]
    return tuple(lines)


def run_sample_command(args: Any) -> None:
    """``mars sample``: :class:`SampleSettings` from the parsed flags, the tree, then the commands to try on it."""
    _write_tree(SampleSettings.from_args(args), args.out)
    print("\n".join(describe(args.tree, args.out)))
