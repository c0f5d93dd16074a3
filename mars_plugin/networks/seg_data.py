"""Training data of ``mars train``: images, (debiased) labels, image-level classes, augmentation.

The augmentation is the one the MARS authors' own segmentation trainer runs (shjo-april/DHR
train.py:366-371 at 94d5189, ``train_transform = 'RandomResize,RandomHFlip,ColorJitter,
Normalize,RandomCrop'``), with its numbers:

* RandomResize: the longer side becomes a random integer in [320, 640] (``min_image``,
  ``max_image``; tools/transforms.py ``RandomResize``), the image bicubic, the label nearest;
* RandomHFlip: p = 0.5;
* ColorJitter: brightness, contrast, saturation 0.3 and hue 0.1 (``b/c/s/h_factor``), as
  torchvision's ``ColorJitter`` on a PIL image does it (the four in a random order; the factors
  uniform in [1 - 0.3, 1 + 0.3] and [-0.1, 0.1]; PIL's ImageEnhance and an HSV hue shift);
* Normalize with the ImageNet mean and std, then RandomCrop of 512 x 512: a larger image is
  cropped at a random place, a smaller one is placed at a random place in the crop; the padding
  is exactly 0 after normalisation (:func:`train_sample`; the crop's bytes hold the rounded mean
  colour there) and 255 (ignore) in the label.

Which images a step sees and how each is augmented depend only on the seed and the sample's
*position* in the run (step * batch + index in the batch): a resumed run and a run on N
processes (torchrun, each taking its slice of the global batch) see exactly the same crops as
one uninterrupted process.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from mars_plugin.formats.files import BIASED_VALUE, IGNORE_VALUE, find_image, read_image, read_label

__all__ = ["Augmentation", "augment", "train_sample", "TrainFolder", "StepSampler", "SampleError", "check_train_label", "IMAGENET_MEAN",
           "IMAGENET_STD", "normalize"]

#: ImageNet statistics of the backbones' inputs (RGB in [0, 1]), as DHR tools/transforms.py:10-11.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
#: The padding colour of a crop's bytes (the network's input is 0 there: :func:`train_sample`).
_PAD_RGB = tuple(int(round(255 * m)) for m in IMAGENET_MEAN)
#: Where a crop holds its image: (top, left, height, width); the rest is padding.
Window = Tuple[int, int, int, int]


def normalize(rgb: torch.Tensor) -> torch.Tensor:
    """(B, H, W, 3) uint8 RGB -> (B, 3, H, W) float normalised with the ImageNet mean and std."""
    x = rgb.permute(0, 3, 1, 2).float().div_(255.0)
    mean = torch.tensor(IMAGENET_MEAN, device=x.device).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD, device=x.device).view(1, 3, 1, 1)
    return x.sub_(mean).div_(std)


@dataclass(frozen=True)
class Augmentation:
    """The numbers of the augmentation (defaults: DHR train.py:366-371)."""

    crop: int = 512
    min_size: int = 320
    max_size: int = 640
    flip: bool = True
    brightness: float = 0.3
    contrast: float = 0.3
    saturation: float = 0.3
    hue: float = 0.1

    def __post_init__(self) -> None:
        for name in ("crop", "min_size", "max_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 8:
                raise ValueError(f"{name} must be an integer >= 8, got {v!r}")
        if self.min_size > self.max_size:
            raise ValueError(f"min_size must be <= max_size, got {self.min_size} > {self.max_size}")
        for name, hi in (("brightness", 1.0), ("contrast", 1.0), ("saturation", 1.0), ("hue", 0.5)):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not 0.0 <= v <= hi:
                raise ValueError(f"{name} must be in [0, {hi}], got {v!r}")


def _jitter(im, aug: Augmentation, rng: np.random.Generator):
    """torchvision's ColorJitter on a PIL image: the four adjustments in a random order."""
    from PIL import Image, ImageEnhance

    for k in rng.permutation(4):
        if k == 0 and aug.brightness > 0:
            im = ImageEnhance.Brightness(im).enhance(rng.uniform(1 - aug.brightness, 1 + aug.brightness))
        elif k == 1 and aug.contrast > 0:
            im = ImageEnhance.Contrast(im).enhance(rng.uniform(1 - aug.contrast, 1 + aug.contrast))
        elif k == 2 and aug.saturation > 0:
            im = ImageEnhance.Color(im).enhance(rng.uniform(1 - aug.saturation, 1 + aug.saturation))
        elif k == 3 and aug.hue > 0:
            # torchvision's adjust_hue on PIL: shift H (a byte) with wrap-around in HSV space.
            h, s, v = im.convert("HSV").split()
            shift = np.uint8(int(rng.uniform(-aug.hue, aug.hue) * 255) % 256)
            h = Image.fromarray((np.asarray(h, dtype=np.uint8) + shift).astype(np.uint8), "L")
            im = Image.merge("HSV", (h, s, v)).convert("RGB")
    return im


def augment(rgb: np.ndarray, label: np.ndarray, aug: Augmentation, rng: np.random.Generator
            ) -> Tuple[np.ndarray, np.ndarray]:
    """One training sample: (H, W, 3) uint8 RGB and (H, W) uint8 label -> (crop, crop, 3) uint8
    RGB (the mean colour's bytes where padded) and (crop, crop) uint8 label (255 where padded).
    Deterministic for the generator. The network's input is :func:`train_sample`'s."""
    return _augment_window(rgb, label, aug, rng)[:2]


def _augment_window(rgb: np.ndarray, label: np.ndarray, aug: Augmentation, rng: np.random.Generator
                    ) -> Tuple[np.ndarray, np.ndarray, Window]:
    """:func:`augment`'s crop, and the window of the crop the image fills (the rest is padding)."""
    from PIL import Image

    im = Image.fromarray(rgb, "RGB")
    lab = Image.fromarray(label, "L")
    w, h = im.size
    side = int(rng.integers(aug.min_size, aug.max_size + 1))
    scale = side / max(w, h)  # the longer side becomes `side` (DHR's Resize.resize)
    size = (max(1, int(round(w * scale))), max(1, int(round(h * scale))))
    if size != (w, h):
        im = im.resize(size, Image.BICUBIC)
        lab = lab.resize(size, Image.NEAREST)
    if aug.flip and rng.random() < 0.5:
        im = im.transpose(Image.FLIP_LEFT_RIGHT)
        lab = lab.transpose(Image.FLIP_LEFT_RIGHT)
    im = _jitter(im, aug, rng)
    img = np.asarray(im, dtype=np.uint8)
    lab_a = np.asarray(lab, dtype=np.uint8)
    # RandomCrop (DHR tools/transforms.py RandomCrop.get_random_boxes): a random window of a larger
    # side, a random place in the crop for a smaller one.
    H, W = lab_a.shape
    c = aug.crop
    out_img = np.empty((c, c, 3), np.uint8)
    out_img[:] = _PAD_RGB
    out_lab = np.full((c, c), IGNORE_VALUE, np.uint8)
    ch, cw = min(c, H), min(c, W)
    sy = int(rng.integers(0, H - c + 1)) if H > c else 0
    sx = int(rng.integers(0, W - c + 1)) if W > c else 0
    dy = int(rng.integers(0, c - H + 1)) if H < c else 0
    dx = int(rng.integers(0, c - W + 1)) if W < c else 0
    out_img[dy:dy + ch, dx:dx + cw] = img[sy:sy + ch, sx:sx + cw]
    out_lab[dy:dy + ch, dx:dx + cw] = lab_a[sy:sy + ch, sx:sx + cw]
    return out_img, out_lab, (dy, dx, ch, cw)


def train_sample(rgb: np.ndarray, label: np.ndarray, aug: object, rng: np.random.Generator
                 ) -> Tuple[torch.Tensor, np.ndarray, np.ndarray]:
    """One training sample of ``aug``'s kind: (H, W, 3) uint8 RGB and (H, W) uint8 label ->
    the network's input (3, crop, crop) float32, the crop's (crop, crop, 3) uint8 RGB (the
    teacher's CRF sees it) and its (crop, crop) uint8 label (255 where padded).

    :class:`Augmentation` (DHR's) and :class:`~mars_plugin.networks.seam_data.SeamAugmentation`
    (SEAM's) normalise first and crop after, so the padding of the input is **exactly 0**
    (DHR ``tools/transforms.py:219``, ``np.zeros`` after ``Normalize``, in the order of
    ``train.py:370``; SEAM ``lib/datasets/transform.py`` RandomCrop, likewise), not the
    normalised mean bytes (+0.0056 / -0.0049 / +0.0082); the image itself is normalised as
    :func:`normalize`. deeplab-pytorch's: its own
    :func:`~mars_plugin.networks.deeplab_pytorch.train_sample` (BGR minus its mean, unrounded)."""
    from mars_plugin.networks.seam_data import SeamAugmentation, seam_augment_window

    if isinstance(aug, Augmentation):
        rgb_c, lab_c, (top, left, h, w) = _augment_window(rgb, label, aug, rng)
    elif isinstance(aug, SeamAugmentation):
        rgb_c, lab_c, (top, left, h, w) = seam_augment_window(rgb, label, aug, rng)
    else:
        from mars_plugin.networks.deeplab_pytorch import train_sample as deeplab_sample

        image, rgb_c, lab_c = deeplab_sample(rgb, label, aug, rng)
        return torch.from_numpy(image), rgb_c, lab_c
    image = normalize(torch.from_numpy(np.ascontiguousarray(rgb_c))[None])[0]
    pad = torch.ones(image.shape[-2:], dtype=torch.bool)
    pad[top:top + h, left:left + w] = False
    image[:, pad] = 0.0  # upstream pads the normalised image with zeros
    return image, rgb_c, lab_c


def check_train_label(label: np.ndarray, path: os.PathLike, num_classes: int, allow_biased: bool) -> None:
    """A training label (H, W) holds only 0..C, 255 (ignore) and, where ``allow_biased``
    (``--loss mars``), 254 (biased); else a ValueError naming the file, the value and the flag."""
    C = int(num_classes)
    bad = (label > C) & (label != IGNORE_VALUE) & ((label != BIASED_VALUE) | (not allow_biased))
    if bad.any():
        v = int(label[bad][0])
        if v == BIASED_VALUE:
            raise ValueError(f"{os.fspath(path)}: holds biased pixels ({BIASED_VALUE}) but --loss ce trains on labels "
                             "without them (give the pseudo labels, or --loss mars for debiased labels)")
        raise ValueError(f"{os.fspath(path)}: holds the value {v}; expected 0..{C} (--num-classes {C}), "
                         f"{BIASED_VALUE} (biased) or {IGNORE_VALUE} (ignore)")


class SampleError(ValueError):
    """A training sample that could not be read, raised by :meth:`TrainFolder.__getitem__` with
    one line naming the id and the file. In a DataLoader worker process torch re-raises it in
    the main process with the worker's whole traceback as the message: :meth:`message_of`
    recovers the one line."""

    @staticmethod
    def message_of(e: BaseException) -> str:
        """The one-line message of a SampleError, raised here or re-raised from a worker."""
        text = str(e)
        # torch's re-raise ends with the worker's traceback, whose last line is
        # "<module>.SampleError: <our line>"; raised in this process, the text is the line itself.
        tag = f"{SampleError.__name__}: "
        if tag in text:
            text = text.rsplit(tag, 1)[1]
        return " ".join(text.split())


def epoch_order(num: int, seed: int, epoch: int) -> np.ndarray:
    """The order of the images in one epoch (a permutation of 0..num-1, fixed by seed and epoch)."""
    return np.random.default_rng([seed, epoch, 0x5E6]).permutation(num)


class TrainFolder(Dataset):
    """Samples by position in the run: ``ds[p]`` is the p-th sample a run of this seed sees.

    Args:
        images_dir, labels_dir: ``<stem>.jpg|png`` images and ``<stem>.png`` labels (0..C, 255
            ignore, 254 biased for debiased labels).
        stems: the images to train on.
        classes: {stem: [1-based class ids]}; an image missing from it takes the classes of its
            label (254 and 255 not counted).
        allow_biased: whether a label may hold 254 (MARS); plain CE trains on pseudo labels.
        image_paths: {stem: image file} (default: :func:`find_image` in ``images_dir``): the
            files :mod:`mars_plugin.commands.train_data` checked before step 1.

    A sample that cannot be read (a file changed during the run) raises :class:`SampleError`
    naming its id and file.

    ``aug``: an :class:`Augmentation` (DHR's, ImageNet RGB normalisation) or a
    :class:`~mars_plugin.networks.deeplab_pytorch.DeeplabAugmentation` (its ``train_sample``: BGR
    minus the caffe mean).

    Each item is a dict: ``image`` (3, crop, crop) float normalised, ``rgb`` (crop, crop, 3)
    uint8 (the teacher's CRF sees it), ``label`` (crop, crop) long with 254 kept, ``classes`` (C,)
    bool, ``position`` int.
    """

    def __init__(self, images_dir: os.PathLike, labels_dir: os.PathLike, stems: Sequence[str], num_classes: int,
                 aug: Augmentation, seed: int, classes: Optional[Dict[str, List[int]]] = None,
                 allow_biased: bool = True, image_paths: Optional[Mapping[str, Path]] = None) -> None:
        if not stems:
            raise ValueError("no images to train on")
        self.images_dir, self.labels_dir = Path(images_dir), Path(labels_dir)
        self.stems = list(stems)
        self.num_classes = int(num_classes)
        self.aug = aug
        self.seed = int(seed)
        self.classes = classes or {}
        self.allow_biased = allow_biased
        self.image_paths = dict(image_paths) if image_paths is not None else None
        self._order: Tuple[int, Optional[np.ndarray]] = (-1, None)

    def __len__(self) -> int:  # positions are unbounded; one epoch's worth for DataLoader's sake
        return len(self.stems)

    def stem_at(self, position: int) -> str:
        n = len(self.stems)
        epoch = position // n
        if self._order[0] != epoch:
            self._order = (epoch, epoch_order(n, self.seed, epoch))
        return self.stems[int(self._order[1][position % n])]

    def read(self, stem: str) -> Tuple[np.ndarray, np.ndarray, List[int]]:
        """The image, the label bytes and the image's classes, checked."""
        lpath = self.labels_dir / f"{stem}.png"
        label = read_label(lpath, biased_value=None).numpy()
        ipath = self.image_paths[stem] if self.image_paths is not None else find_image(self.images_dir, stem)
        rgb = read_image(ipath)
        if rgb.shape[:2] != label.shape:
            raise ValueError(f"{lpath}: label is {label.shape[0]}x{label.shape[1]} but its image is "
                             f"{rgb.shape[0]}x{rgb.shape[1]} (H x W, {ipath.name})")
        check_train_label(label, lpath, self.num_classes, self.allow_biased)
        C = self.num_classes
        if stem in self.classes:
            cls = self.classes[stem]
        else:
            cls = [int(v) for v in np.unique(label) if 0 < v <= C]
        return rgb, label.astype(np.uint8), cls

    def __getitem__(self, position: int) -> Dict[str, object]:
        position = int(position)
        stem = self.stem_at(position)
        try:
            rgb, label, cls = self.read(stem)
        except Exception as e:  # noqa: BLE001 -- any failure to read a sample is that sample's, named
            raise SampleError(f"{stem}: {' '.join(str(e).split()) or type(e).__name__}") from None
        image, rgb_c, lab_c = train_sample(rgb, label, self.aug, np.random.default_rng([self.seed, position]))
        multi_hot = torch.zeros(self.num_classes, dtype=torch.bool)
        if cls:
            multi_hot[torch.tensor(cls) - 1] = True
        rgb_t = torch.from_numpy(np.ascontiguousarray(rgb_c))
        return {"image": image, "rgb": rgb_t, "label": torch.from_numpy(lab_c.astype(np.int64)),
                "classes": multi_hot, "position": position}


class StepSampler(Sampler):
    """The positions of this process's share of each global batch, from ``start`` to ``stop``
    steps: step t's global batch is positions t*B .. t*B+B-1, and rank r of W takes the r-th
    of W equal slices of it."""

    def __init__(self, start: int, stop: int, batch_size: int, rank: int = 0, world: int = 1) -> None:
        if batch_size % world:
            raise ValueError(f"--batch-size {batch_size} must be a multiple of the number of processes ({world})")
        self.start, self.stop, self.B, self.rank, self.world = start, stop, batch_size, rank, world

    def __iter__(self) -> Iterator[List[int]]:
        b = self.B // self.world
        for t in range(self.start, self.stop):
            first = t * self.B + self.rank * b
            yield list(range(first, first + b))

    def __len__(self) -> int:
        return max(0, self.stop - self.start)
