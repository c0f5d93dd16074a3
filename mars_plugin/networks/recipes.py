"""Step 2 as each row of the paper's Table 2 ran it: one frozen :class:`Recipe` per upstream
codebase, every field citing the upstream file and line it was read from.

* ``dhr``: the RS+EPM row (DeepLabv3+ R101) with the MARS authors' own trainer, public only as
  DHR's ``train.py`` (shjo-april/DHR@94d5189), without DHR's own losses (not MARS).
* ``deeplab-pytorch``: the IRNet and AdvCAM rows (DeepLabv2 R101, kazuto1011/deeplab-pytorch
  @4219467, ``configs/voc12.yaml`` + ``main.py``).
* ``seam``: the SEAM row (DeepLabv1 on a wide ResNet-38, YudeWang/semantic-segmentation-codebase
  ``experiment/seamv1-pseudovoc``).

A recipe is data: :data:`RECIPES` holds them, :func:`get_recipe` looks one up,
:func:`with_overrides` changes single fields (validated, the changed names returned so that a
run can record them), :func:`iterations_for_epochs` turns DHR's epochs into iterations and
:func:`poly_factor` is the one definition of the three codebases' poly learning rate.
``tests/test_recipe_fields.py`` holds every field to its cited upstream line.

Where upstream is ambiguous or surprising (each is also said at the field):

* DHR's CRF and deeplab-pytorch's CRF are one setting (``CRF_PRESETS["mars"]``); SEAM's codebase
  tests with its own (``"seam-seg"``: one iteration, bilateral 32/13/10).
* deeplab-pytorch gives its CRF ``image.astype(np.uint8)`` of the *mean-subtracted* BGR floats
  (``main.py:481`` after ``libs/datasets/base.py:110``), not the file's bytes: negative values
  wrap modulo 256 as numpy 2 does on x86-64 (the C cast is undefined: other platforms may
  differ); hence ``crf_image = "mean-subtracted"``. It predicts with MSC's max of the logits
  over scales 1, 0.5 and 0.75 (``msc.py:41-47``), no flip.
* SEAM's ``train.py`` never calls ``.train()``, so WR38's ``train()`` override
  (``resnet38d.py:192-214``: BatchNorm in eval, ``conv1a`` frozen) never runs while training:
  every BatchNorm trains its statistics (momentum 0.0003) and ``conv1a`` is in the optimizer.
  The groups hold convolutions only, so no BatchNorm weight or bias is ever updated. With
  ``GPUS = 2`` and ``nn.DataParallel``, each replica's BatchNorm sees 5 of the 10 images.
* SEAM's loop (``train.py:83-123``) runs ``max_itr`` steps only where the dataset fills the
  epochs it plans (``max_itr * batch // len + 1``): exact for VOC train_aug (10,582 images,
  1,058 steps an epoch, 19 epochs, stopped at 20,000 in the last); on other sizes it stops
  short, or takes one extra step per epoch left after ``max_itr``. Its poly rate divides by
  ``max_itr + 1`` (``train.py:139``); deeplab-pytorch recomputes the rate every 10 steps
  (``LR_DECAY``), DHR every step.
* deeplab-pytorch has no backbone bias (its ResNet convolutions have ``bias=False``): the
  "backbone bias" group is empty, recorded as x1 decayed like the weights; its BatchNorm is in
  no group and frozen.
* Table 2's IRNet row says R50, but deeplab-pytorch builds and initialises only its R101
  (``configs/voc12.yaml``); which network IRNet's row trained is not stated. The recipe is
  deeplab-pytorch's own.
* DHR's ``train.py`` never wraps the model in ``DistributedDataParallel``: its multi-process
  mode would train unsynchronised replicas. Its README trains on one GPU (``--gpus 0``), which
  the recipe follows (``bn_batch`` 16).
"""
from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Any, Dict, List, Mapping, Optional, Tuple

from mars_plugin._checks import check_int_param, describe
from mars_plugin.networks.recipe_checks import CHOICES, META_FIELDS, check_bool, check_field

__all__ = [
    "Recipe",
    "RECIPES",
    "RECIPE_NAMES",
    "DEFAULT_RECIPE",
    "get_recipe",
    "with_overrides",
    "iterations_for_epochs",
    "poly_factor",
    "recipe_to_dict",
    "recipe_from_dict",
    "CHOICES",
]

@dataclasses.dataclass(frozen=True)
class Recipe:
    """One codebase's segmentation training and inference, field by field (validated on
    construction; ``sources`` maps each field to ``"path:line"`` or ``"path:first-last"`` in
    ``upstream``).

    The lr of group g at optimizer step t (0-based) of T is
    ``lr * lr_mults[g] * poly_factor(self, t, T)``; the four groups are backbone weights,
    backbone biases, head weights, head biases (``decay[g]``: weight decay applies). A step
    averages ``iter_size`` batches of ``batch_size`` (global, over every process); the schedule
    is ``epochs`` (:func:`iterations_for_epochs` of the data) or ``iterations``, never both.

    The string fields' choices are :data:`CHOICES`. Some meanings:

    * ``normalization``: ``"imagenet-rgb"``: RGB / 255, minus torchvision's ImageNet mean, over
      its std; ``"caffe-bgr"``: BGR bytes minus deeplab-pytorch's mean (no std).
    * ``augmentation`` names the codebase's pipeline; ``augmentation_params`` its settings.
    * ``loss_grid``: ``"logits"``: labels resized (nearest) to the logits' grid; ``"input"``:
      logits upsampled to the crop inside the network.
    * ``msc_scales``: extra input scales of deeplab-pytorch's MSC: in training, a loss on the
      logits of scale 1, of each extra scale and on their pixel-wise max.
    * ``test_scales`` are fused by ``test_fusion`` (with ``test_flip``, each scale's flip too);
      ``"max-logits"`` takes the max at the first scale's logit size, as MSC in eval mode.
    * ``crf_image``: the bytes the CRF sees: ``"denormalized"``: the normalised network input
      turned back to bytes by truncation; ``"file"``: the file's; ``"mean-subtracted"``:
      deeplab-pytorch's BGR minus its mean, cast to bytes (negatives wrap modulo 256).
    * ``class_threshold``: a class whose fused probability never exceeds it anywhere in the
      image is left out before the CRF (DHR); None keeps every class."""

    name: str
    rows: Tuple[str, ...]
    upstream: str
    # network
    arch: str
    backbone: str
    output_stride: int
    init_weights: str
    weights_format: str
    # data
    normalization: str
    augmentation: str
    crop: int
    augmentation_params: Tuple[Tuple[str, Any], ...]
    # optimizer
    optimizer: str
    lr: float
    momentum: float
    nesterov: bool
    weight_decay: float
    lr_mults: Tuple[float, float, float, float]
    decay: Tuple[bool, bool, bool, bool]
    #: the backbone's BatchNorm statistics
    bn: str
    bn_momentum: float
    # schedule
    batch_size: int
    iter_size: int
    epochs: Optional[int]
    iterations: Optional[int]
    drop_last: bool
    poly_power: float
    lr_step: int
    # loss
    loss_grid: str
    msc_scales: Tuple[float, ...]
    # inference
    predict_weights: str
    test_scales: Tuple[float, ...]
    test_flip: bool
    crf: str
    crf_image: str
    class_threshold: Optional[float]
    sources: Mapping[str, str]
    # -- beyond the shared contract --
    #: the head's BatchNorm statistics (``bn`` is the backbone's; "none": the head has none)
    bn_head: str = "train"
    #: whether the optimizer holds the BatchNorm weights and biases
    bn_affine: str = "trained"
    #: the images each training BatchNorm's batch statistics see (the batch one process or one
    #: DataParallel replica holds); None where no BatchNorm trains
    bn_batch: Optional[int] = None
    #: poly's denominator is ``T + poly_max_offset`` (SEAM: 1)
    poly_max_offset: int = 0
    #: the EMA decay of the weights ``predict_weights = "ema"`` predicts with (None: no EMA)
    ema_decay: Optional[float] = None
    #: how the test scales (and flips) are fused: the mean of the softmaxes (DHR), the max of
    #: the logits (deeplab-pytorch's MSC), the softmax of the mean logits (SEAM)
    test_fusion: str = "mean-softmax"

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, check_field(f.name, getattr(self, f.name)))
        if (self.epochs is None) == (self.iterations is None):
            raise ValueError(f"recipe {self.name!r}: exactly one of epochs and iterations must be set, got "
                             f"epochs={self.epochs!r}, iterations={self.iterations!r}")
        if self.predict_weights == "ema" and self.ema_decay is None:
            raise ValueError(f"recipe {self.name!r}: predict_weights 'ema' needs ema_decay, got None")
        unknown = sorted(set(self.sources) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise ValueError(f"recipe {self.name!r}: sources names unknown fields {unknown}")


# -- the recipes -------------------------------------------------------------------------------

def _cited(**fields: Any) -> Recipe:
    """A recipe from ``field=(value, "path:line")`` pairs (the meta fields given plainly)."""
    values, sources = {}, {}
    for k, v in fields.items():
        if k in META_FIELDS:
            values[k] = v
        else:
            values[k], sources[k] = v
    return Recipe(sources=sources, **values)


_DHR = "shjo-april/DHR@94d5189"
_DLPT = "kazuto1011/deeplab-pytorch@4219467"
_SEAM = "YudeWang/semantic-segmentation-codebase@a40f6c6"
_SEAM_CFG = "experiment/seamv1-pseudovoc/config.py"
_SEAM_TRAIN = "experiment/seamv1-pseudovoc/train.py"
_SEAM_TEST = "experiment/seamv1-pseudovoc/test.py"

RECIPES: Mapping[str, Recipe] = MappingProxyType({
    # DHR's train.py defaults (train.py:364-371) and what its trainer does with them.
    "dhr": _cited(
        name="dhr", rows=("RS+EPM R101",), upstream=_DHR,
        arch=("deeplabv3+dhr", "train.py:84"),
        backbone=("resnet101", "train.py:366"),
        output_stride=(8, "core/networks.py:137 + core/networks.py:74"),
        init_weights=("resnet101-5d3b4d8f.pth", "core/backbones/resnet/model.py:10"),
        weights_format=("torchvision", "core/backbones/resnet/model.py:10"),
        normalization=("imagenet-rgb", "tools/transforms.py:10-11 + tools/transforms.py:236"),
        augmentation=("dhr", "train.py:370"),
        crop=(512, "train.py:367"),
        augmentation_params=((("min_image", 320), ("max_image", 640), ("brightness", 0.3), ("contrast", 0.3),
                              ("saturation", 0.3), ("hue", 0.1), ("hflip", 0.5)),
                             "train.py:369 + tools/transforms.py:133"),
        optimizer=("sgd", "train.py:200"),
        lr=(1e-3, "train.py:368"),
        momentum=(0.9, "train.py:368"),
        nesterov=(False, "train.py:368"),
        weight_decay=(4e-5, "train.py:368"),
        lr_mults=((1.0, 1.0, 10.0, 10.0), "train.py:202-205"),
        decay=((True, True, True, True), "train.py:202-205"),
        bn=("train", "core/layers.py:12"),
        bn_momentum=(0.1, "core/layers.py:12"),
        bn_batch=(16, "train.py:367"),
        bn_head=("train", "core/layers.py:36"),
        bn_affine=("trained", "core/layers.py:24"),
        batch_size=(16, "train.py:367"),
        iter_size=(1, "tools/trainers.py:125-127"),
        epochs=(100, "train.py:367"),
        iterations=(None, "train.py:211"),
        drop_last=(True, "train.py:193"),
        poly_power=(0.9, "train.py:210"),
        lr_step=(1, "tools/optimizers.py:16"),
        poly_max_offset=(0, "tools/schedulers.py:37"),
        loss_grid=("logits", "train.py:325"),
        msc_scales=((), "train.py:224"),
        predict_weights=("ema", "tools/trainers.py:186 + train.py:166"),
        ema_decay=(0.999, "train.py:368"),
        test_scales=((1.0, 0.5, 1.5, 2.0), "core/networks.py:94 + produce_wss_masks.py:39"),
        test_flip=(True, "core/networks.py:94"),
        test_fusion=("mean-softmax", "core/networks.py:127"),
        crf=("mars", "core/refinements/densecrf.py:10 + produce_wss_masks.py:115"),
        crf_image=("denormalized", "produce_wss_masks.py:59 + tools/transforms.py:270"),
        class_threshold=(0.05, "produce_wss_masks.py:136"),
    ),
    # deeplab-pytorch's configs/voc12.yaml and main.py (train, test, crf).
    "deeplab-pytorch": _cited(
        name="deeplab-pytorch", rows=("IRNet R50", "AdvCAM R101"), upstream=_DLPT,
        arch=("deeplabv2", "configs/voc12.yaml:31"),
        backbone=("resnet101", "configs/voc12.yaml:32"),
        output_stride=(8, "libs/models/deeplabv2.py:41"),
        init_weights=("deeplabv1_resnet101-coco.pth", "configs/voc12.yaml:34"),
        weights_format=("deeplab-pytorch", "main.py:152"),
        normalization=("caffe-bgr", "libs/datasets/voc.py:51 + libs/datasets/base.py:110"),
        augmentation=("deeplab-pytorch", "main.py:122"),
        crop=(321, "configs/voc12.yaml:27"),
        augmentation_params=((("scales", (0.5, 0.75, 1.0, 1.25, 1.5)), ("hflip", 0.5)),
                             "configs/voc12.yaml:11 + libs/datasets/base.py:100"),
        optimizer=("sgd", "configs/voc12.yaml:47"),
        lr=(2.5e-4, "configs/voc12.yaml:45"),
        momentum=(0.9, "configs/voc12.yaml:46"),
        nesterov=(False, "main.py:180-181"),
        weight_decay=(5e-4, "configs/voc12.yaml:49"),
        lr_mults=((1.0, 1.0, 10.0, 20.0), "main.py:166 + main.py:171 + main.py:176"),
        decay=((True, True, True, False), "main.py:167 + main.py:172 + main.py:177"),
        bn=("frozen", "main.py:208"),
        bn_momentum=(1 - 0.999, "libs/models/resnet.py:43"),  # as upstream computes it
        bn_affine=("fixed", "main.py:53 + main.py:60 + main.py:66"),
        bn_batch=(None, "main.py:208"),
        bn_head=("none", "libs/models/deeplabv2.py:27"),
        batch_size=(5, "configs/voc12.yaml:38"),
        iter_size=(2, "configs/voc12.yaml:41"),
        epochs=(None, "configs/voc12.yaml:40"),
        iterations=(20000, "configs/voc12.yaml:40"),
        drop_last=(False, "main.py:131-136"),
        poly_power=(0.9, "configs/voc12.yaml:48"),
        lr_step=(10, "configs/voc12.yaml:44"),
        poly_max_offset=(0, "libs/utils/lr_scheduler.py:20"),
        loss_grid=("logits", "main.py:235"),
        msc_scales=((0.5, 0.75), "libs/models/__init__.py:38"),
        predict_weights=("student", "main.py:335"),
        ema_decay=(None, "main.py:282"),
        test_scales=((1.0, 0.5, 0.75), "libs/models/msc.py:41 + libs/models/__init__.py:38"),
        test_flip=(False, "main.py:372"),
        test_fusion=("max-logits", "libs/models/msc.py:42 + libs/models/msc.py:47"),
        crf=("mars", "configs/voc12.yaml:53-58"),
        crf_image=("mean-subtracted", "main.py:481 + libs/datasets/base.py:110"),
        class_threshold=(None, "main.py:385"),
    ),
    # SEAM's segmentation codebase, experiment/seamv1-pseudovoc (config.py, train.py, test.py).
    "seam": _cited(
        name="seam", rows=("SEAM WR38",), upstream=_SEAM,
        arch=("deeplabv1-wr38", f"{_SEAM_CFG}:29"),
        backbone=("wr38", f"{_SEAM_CFG}:30"),
        output_stride=(8, " + ".join(f"lib/net/backbone/resnet38d.py:{n}"  # every block's stride
                                     for n in (130, 132, 136, 140, 147, 151, 153))),
        init_weights=("ilsvrc-cls_rna-a1_cls1000_ep-0001.params", "lib/net/backbone/resnet38d.py:7"),
        weights_format=("wr38", "lib/net/backbone/resnet38d.py:270"),
        normalization=("imagenet-rgb", f"{_SEAM_CFG}:19-20 + lib/datasets/VOCDataset.py:65"),
        augmentation=("seam", f"{_SEAM_TRAIN}:40 + lib/datasets/BaseDataset.py:79-80"),
        crop=(448, f"{_SEAM_CFG}:21"),
        augmentation_params=((("scale", (0.5, 1.5)), ("hsv", (10, 10, 10)), ("hflip", 0.5)), f"{_SEAM_CFG}:22-26"),
        optimizer=("sgd", f"{_SEAM_TRAIN}:71"),
        lr=(0.001, f"{_SEAM_CFG}:35"),
        momentum=(0.9, f"{_SEAM_CFG}:36"),
        nesterov=(False, f"{_SEAM_TRAIN}:78-80"),
        weight_decay=(0.0005, f"{_SEAM_CFG}:37"),
        lr_mults=((1.0, 2.0, 10.0, 20.0), f"{_SEAM_TRAIN}:73-76"),
        decay=((True, False, True, False), f"{_SEAM_TRAIN}:73-76"),
        bn=("train", f"{_SEAM_CFG}:33"),
        bn_head=("train", "lib/net/deeplabv1.py:22"),
        bn_momentum=(0.0003, f"{_SEAM_CFG}:38 + lib/net/backbone/resnet38d.py:8"),
        bn_batch=(5, f"{_SEAM_CFG}:40 + {_SEAM_CFG}:13 + {_SEAM_TRAIN}:64"),
        bn_affine=("fixed", "lib/net/deeplabv1.py:59"),
        batch_size=(10, f"{_SEAM_CFG}:40"),
        iter_size=(1, f"{_SEAM_TRAIN}:96-99"),
        epochs=(None, f"{_SEAM_CFG}:43"),
        iterations=(20000, f"{_SEAM_CFG}:43"),
        drop_last=(True, f"{_SEAM_TRAIN}:49"),
        poly_power=(0.9, f"{_SEAM_CFG}:39"),
        lr_step=(1, f"{_SEAM_TRAIN}:90"),
        poly_max_offset=(1, f"{_SEAM_TRAIN}:139"),
        loss_grid=("input", "lib/net/deeplabv1.py:53"),
        msc_scales=((), f"{_SEAM_TRAIN}:96"),
        predict_weights=("student", f"{_SEAM_TRAIN}:132"),
        ema_decay=(None, f"{_SEAM_TRAIN}:132"),
        test_scales=((0.5, 0.75, 1.0, 1.25, 1.5, 1.75), f"{_SEAM_CFG}:46"),
        test_flip=(True, f"{_SEAM_CFG}:47"),
        test_fusion=("mean-logits", f"{_SEAM_TEST}:88"),
        crf=("seam-seg", "lib/utils/DenseCRF.py:20-22 + experiment/seamv1-pseudovoc/test.py:94"),
        crf_image=("denormalized", f"{_SEAM_TEST}:93 + lib/utils/imutils.py:50-53"),
        class_threshold=(None, f"{_SEAM_TEST}:97"),
    ),
})
RECIPE_NAMES = tuple(RECIPES)
DEFAULT_RECIPE = "dhr"


def get_recipe(name: str) -> Recipe:
    """The recipe called ``name`` (one of :data:`RECIPE_NAMES`)."""
    if not isinstance(name, str) or name not in RECIPES:
        raise ValueError(f"recipe must be one of {list(RECIPE_NAMES)}, got {name!r}")
    return RECIPES[name]


def with_overrides(recipe: Recipe, **fields: Any) -> Tuple[Recipe, List[str]]:
    """``recipe`` with single fields replaced, each checked as the recipe checks it, and the
    names of the fields given (in the recipe's field order), for the run to record. Their
    ``sources`` entries become ``"override"``. Setting ``iterations`` clears ``epochs`` and the
    other way round, unless both are given. The meta fields (name, rows, upstream, sources)
    cannot be overridden."""
    if not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be a Recipe, got {describe(recipe)}")
    names = [f.name for f in dataclasses.fields(Recipe)]
    for key in fields:
        if key not in names:
            raise ValueError(f"{key!r} is not a recipe field; expected some of "
                             f"{[n for n in names if n not in META_FIELDS]}")
        if key in META_FIELDS:
            raise ValueError(f"recipe field {key!r} says where the recipe comes from and cannot be overridden")
    new = dict(fields)
    if "iterations" in fields and "epochs" not in fields and fields["iterations"] is not None:
        new["epochs"] = None
    if "epochs" in fields and "iterations" not in fields and fields["epochs"] is not None:
        new["iterations"] = None
    sources = dict(recipe.sources)
    sources.update({k: "override" for k in new})
    return dataclasses.replace(recipe, sources=sources, **new), [n for n in names if n in fields]


def iterations_for_epochs(num_images: int, epochs: int, global_batch: int, drop_last: bool = True,
                          world: int = 1) -> int:
    """Optimizer steps of ``epochs`` passes over ``num_images``, as DHR counts them
    (``tools/trainers.py:54``: ``len(train_loader) * max_epochs``).

    One process: ``len(DataLoader)`` is ``num_images // global_batch`` with ``drop_last`` (else
    the ceiling). ``world`` processes (DHR ``train.py:188,193``): each rank's
    ``DistributedSampler(drop_last=True)`` holds ``num_images // world`` images (without
    ``drop_last``: the ceiling, padded by repeats) and its loader batches them by
    ``global_batch // world`` (``global_batch`` must be a multiple of ``world``, DHR
    ``train.py:65``). 10,582 images at 16 on one process: 661 per epoch, 66,100 in 100."""
    num_images = check_int_param(num_images, "num_images", 1)
    epochs = check_int_param(epochs, "epochs", 1)
    global_batch = check_int_param(global_batch, "global_batch", 1)
    world = check_int_param(world, "world", 1)
    check_bool(drop_last, "drop_last")
    if global_batch % world:
        raise ValueError(f"global_batch ({global_batch}) must be a multiple of world ({world}): each of the "
                         f"{world} processes takes global_batch // world images")
    per_rank = num_images // world if drop_last else -(-num_images // world)
    local = global_batch // world
    per_epoch = per_rank // local if drop_last else -(-per_rank // local)
    if per_epoch == 0:
        raise ValueError(f"num_images ({num_images}) makes no full batch of {global_batch} with drop_last "
                         f"(over {world} process(es)): an epoch would have no iteration")
    return per_epoch * epochs


def poly_factor(recipe: Recipe, step: int, total: int) -> float:
    """The factor of the initial learning rates at optimizer step ``step`` (0-based) of
    ``total``: ``(1 - s / (total + poly_max_offset)) ** poly_power`` with ``s`` the last multiple
    of ``lr_step`` at or below ``step`` (DHR: every step, ``tools/schedulers.py:37``;
    deeplab-pytorch: every 10, ``libs/utils/lr_scheduler.py:23-29``; SEAM: ``total + 1``,
    ``train.py:139``)."""
    step = check_int_param(step, "step", 0)
    total = check_int_param(total, "total", 1)
    s = step - step % recipe.lr_step
    return max(0.0, 1.0 - s / (total + recipe.poly_max_offset)) ** recipe.poly_power


def recipe_to_dict(recipe: Recipe) -> Dict[str, Any]:
    """The recipe as plain Python (tuples to lists, the sources to a dict): what a checkpoint
    or a run record stores (JSON and ``torch.load(weights_only=True)`` read it)."""
    def plain(v: Any) -> Any:
        if isinstance(v, (tuple, list)):
            return [plain(x) for x in v]
        if isinstance(v, Mapping):
            return {k: plain(x) for k, x in v.items()}
        return v
    return {f.name: plain(getattr(recipe, f.name)) for f in dataclasses.fields(recipe)}


def recipe_from_dict(data: Mapping[str, Any]) -> Recipe:
    """The recipe :func:`recipe_to_dict` wrote, checked again (a missing or unknown key is an
    error naming it)."""
    if not isinstance(data, Mapping):
        raise TypeError(f"a stored recipe must be a dict, got {describe(data)}")
    names = {f.name for f in dataclasses.fields(Recipe)}
    unknown, missing = sorted(set(data) - names), sorted(_REQUIRED - set(data))
    if unknown or missing:
        raise ValueError(f"stored recipe: unknown fields {unknown}, missing fields {missing}")
    return Recipe(**dict(data))


_REQUIRED = frozenset(f.name for f in dataclasses.fields(Recipe) if f.default is dataclasses.MISSING)
