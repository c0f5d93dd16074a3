"""``mars train``: the paper's second step, a segmentation network trained on debiased labels
with the EMA teacher, the CRF-refined complement and the weighted CE (Sec. 3.4, Eq. 6-7).

One step (``loss="mars"``): the student predicts the batch; :class:`MARSTrainingHook` lets the
EMA teacher predict it too, refines the teacher's probabilities with the dense CRF on the
batch (on the device; ``refine="crf"``, the paper's R), fills the biased pixels (254) with the
teacher's label restricted to the image's classes, and weighs them by its certainty (WCE);
SGD steps; the teacher follows by EMA (0.999). ``loss="ce"`` trains plain CE on the given
labels (the baseline: the WSSS method's pseudo labels as they are).

The settings are a :class:`~mars_plugin.commands.train_settings.TrainSettings` record: a recipe
(:mod:`mars_plugin.networks.recipes`; ``dhr`` by default, the MARS authors' own trainer,
shjo-april/DHR train.py at 94d5189: SGD, momentum 0.9, weight decay 4e-5, lr 1e-3 for the backbone
and 10x for the new layers, poly 0.9 over 100 epochs, batch 16 of 512 x 512 crops) with single
fields overridden. The stages: :func:`_place` (device, memory), :func:`_open_data` (resume or
check the files), :func:`_build` (network, teacher, optimizer), :func:`_resume`, :func:`_loop` /
:func:`_step` (``iter_size`` batches per step, the lr of each group by the recipe's poly),
:func:`_save`.

Exactly resumable and the same on any number of processes: a step's images, their augmentation
and the random numbers of dropout depend only on the seed, the step and the sample's position,
the learning rate only on the step; the loss of a step is the sum over the global batch's
non-ignored pixels divided by their global count (the count is summed over the processes), so
a 2-process DDP step computes the same gradient as one process on the same global batch.
Checkpoints (:mod:`mars_plugin.networks.seg_checkpoint`) hold student, teacher, optimizer, AMP scaler
and the step.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn

from mars_plugin.formats.files import BIASED_VALUE, IGNORE_VALUE
from mars_plugin.commands.train_data import (CHECKPOINT_NAME, LOG_NAME, check_train_files, data_record, out_lock, trim_log,
                                             image_labels_warning, list_train_files, open_run)
from mars_plugin.commands.train_settings import TRAIN_DEFAULTS, TrainSettings
from mars_plugin.networks import deeplab_pytorch as dlpt  # the deeplab-pytorch recipe's pieces
from mars_plugin.networks.recipes import poly_factor
from mars_plugin.networks.seg_checkpoint import load_checkpoint, save_checkpoint
from mars_plugin.networks.seg_data import SampleError, StepSampler, TrainFolder
from mars_plugin.runs.output_aside import OutputAside

__all__ = ["train", "TrainSettings", "TRAIN_DEFAULTS", "CHECKPOINT_NAME", "LOG_NAME", "poly_lr"]


def poly_lr(base: float, step: int, iterations: int, power: float = 0.9) -> float:
    """The learning rate of (0-based) ``step``: ``base * (1 - step / iterations) ** power``
    (DHR tools/schedulers.py PolyLR, applied before the step)."""
    return base * (1.0 - step / iterations) ** power


def _step_seed(seed: int, step: int, rank: int) -> int:
    # Dropout's random numbers of one step on one process: fixed by (seed, step, rank), so that a
    # resumed run draws what the uninterrupted one drew. (Networks with dropout are then equal
    # to one process in distribution only; without dropout, bit for bit.)
    return (seed * 1_000_003 + step * 1_009 + rank) % (2 ** 63)


def _all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(x)
    return x


def train(
    images: Union[str, os.PathLike],
    labels: Union[str, os.PathLike],
    out: Union[str, os.PathLike],
    num_classes: Optional[int] = None,
    *,
    settings: Optional[TrainSettings] = None,
    image_labels: Optional[Dict[str, List[int]]] = None,
    stems: Optional[List[str]] = None,
    class_names: Optional[List[str]] = None,
    progress: bool = True,
    restart: bool = False,
    notes: Sequence[str] = (),
    require_biased: bool = True,
    on_step: Optional[Callable[[int], None]] = None,
    **fields: Any,
) -> Dict[str, Any]:
    """Train a DeepLab network on a folder of images and (debiased) labels; see the module docstring.

    Args:
        images, labels: folders of ``<stem>.jpg|png`` and ``<stem>.png`` (0..C, 255 ignore; 254
            biased with ``loss="mars"``).
        out: the run's folder: ``checkpoint.pt`` (every ``save_every`` steps and at the end,
            with the record of the data: :mod:`mars_plugin.commands.train_data`), ``log.jsonl``
            (one JSON object per ``log_every`` steps), ``train.json`` (settings, data digests).
            A checkpoint of the same settings and data there is resumed; of other settings or
            data (another folder's files, a file changed, other image labels), refused.
            Every file is read once before step 1 (skipped on a resume of the same data).
        num_classes: C (foreground classes); the network has C + 1 outputs.
        settings: the run's :class:`~mars_plugin.commands.train_settings.TrainSettings` (its
            docstring says each field); or ``num_classes`` and its fields as keywords
            (``fields``: ``recipe="dhr"``, ``arch``, ``lr``, ``epochs``, ...), checked by it.
        image_labels: {stem: [1-based class ids]} the teacher may fill biased pixels with;
            default: the classes of each label (a class whose pixels were all marked biased is
            then not offered: ``mars reproduce`` writes ``image_labels.json``).
        stems: train on these images only (default: every label in ``labels``).
        restart: train from step 0, moving the checkpoint, log and ``train.json`` in ``out``
            into ``out/.mars-stale/<UTC time>-<run id>/`` (once the files passed their check).
        require_biased: with ``loss="mars"``, refuse labels without a single biased pixel (254), the
            sign of pseudo labels given for debiased ones; False where the labels are known to be
            ``mars debias``'s output (``mars reproduce --train``), which may mark nothing biased.
        notes: lines printed on stderr (``mars train: <line>``) once the checks passed, before
            step 1, with the warning of ``loss="mars"`` without ``image_labels``.
        on_step: called with the number of steps done after each step (and its checkpoint, if
            one was due): progress hooks, tests.

    Returns:
        {"checkpoint": path, "iterations": done, "resumed_from": step, "loss": last logged loss,
        "aside": the earlier run's files ``restart`` moved, "aside_dir": where in ``out`` or None}
    """
    from mars_plugin.commands.inputs import check_out_apart  # before any work: an output is never an input
    from mars_plugin.commands.job_settings import own_record

    own_record("train", TrainSettings, settings)
    weights = settings.weights if settings is not None else fields.get("weights")
    check_out_apart(out, "--out", {"--images": images, "--labels": labels, "--weights": weights})
    s = _settings(num_classes, settings, fields)
    images, labels, out = Path(images), Path(labels), Path(out)
    files = list_train_files(images, labels, stems)
    run = _place(s, out, class_names, len(files.stems))
    identity = s.record(amp=run.use_amp, iterations=run.iterations, stems=len(files.stems), images=str(images),
                        labels=str(labels), world_size=run.world)
    with out_lock(out, run.rank):
        ds = TrainFolder(images, labels, files.stems, s.num_classes, s.augmentation, s.seed, classes=image_labels,
                         allow_biased=(s.loss == "mars"), image_paths=files.image_paths)
        ck = _open_data(run, ds, files, image_labels, identity, restart=restart, progress=progress,
                        require_biased=require_biased)
        notes = [*notes, *([f"warning: {w}"] if (w := image_labels_warning(s.loss, image_labels)) else [])]
        if run.rank == 0 and notes:
            print("\n".join(f"mars train: {n}" for n in notes), file=sys.stderr, flush=True)
        _build(run)
        start = _resume(run, ck)
        if run.rank == 0:
            trim_log(out / LOG_NAME, start)
        res = {"checkpoint": run.ck_path, "resumed_from": start, "aside": list(run.aside.moved),
               "aside_dir": run.aside.where if run.aside.moved else None}
        if start >= run.iterations:
            return {**res, "iterations": start, "loss": None}
        return {**res, "iterations": run.iterations, "loss": _loop(run, ds, start, progress=progress, on_step=on_step)}


def _settings(num_classes: Optional[int], settings: Optional[TrainSettings], fields: Mapping[str, Any]) -> TrainSettings:
    """The API's arguments -> one checked record (a record, or ``num_classes`` and fields)."""
    if settings is None:
        return TrainSettings(num_classes=num_classes, **fields)  # type: ignore[arg-type]
    if fields:
        raise TypeError(f"settings given: give {', '.join(sorted(fields))} in it (settings.replace(...)), not beside it")
    if num_classes is not None and num_classes != settings.num_classes:
        raise ValueError(f"num_classes is {num_classes} but settings.num_classes is {settings.num_classes}")
    return settings


@dataclass
class _Run:
    """One process's state of a run: where it runs, and (once built) the network, its teacher hook
    and the optimizer; the stages below fill it in turn."""

    s: TrainSettings
    out: Path
    class_names: Optional[List[str]]
    rank: int
    world: int
    dev: torch.device
    use_amp: bool
    iterations: int
    data_json: Optional[str] = None
    identity: Dict[str, Any] = field(default_factory=dict)
    aside: Any = None  # the OutputAside of --restart (rank 0 moves the earlier run's files into it)
    model: Any = None
    net: Any = None
    hook: Any = None
    opt: Any = None
    scaler: Any = None
    amp_dtype: Any = None
    base_lrs: List[float] = field(default_factory=list)

    @property
    def ck_path(self) -> Path:
        return self.out / CHECKPOINT_NAME


def _place(s: TrainSettings, out: Path, class_names: Optional[List[str]], num_images: int) -> _Run:
    """Stage 1: what this build can train (a recipe's piece another branch brings is a
    NotImplementedError naming it), the iterations, the process's rank and device, AMP, and the
    memory check of one step (before anything is built)."""
    from mars_plugin.runs.distributed import _rank_world, resolve_device
    from mars_plugin.commands.train_settings import missing_piece
    from mars_plugin.networks.memory import check_train_budget

    missing = missing_piece(s)
    if missing is not None:
        raise NotImplementedError(f"mars train: {missing}; not in this build yet")
    iterations = s.iterations_for(num_images)

    rank, world = _rank_world()
    dev = resolve_device(s.device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) if world > 1 else torch.cuda.current_device())
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    use_amp = s.amp and dev.type == "cuda"
    if s.bn == "sync" and dev.type != "cuda":
        raise ValueError("bn='sync' (SyncBatchNorm) runs on CUDA only; on the CPU use bn='train' or 'frozen'")
    check_train_budget(s.max_bytes, dev, arch=s.arch, backbone=s.backbone, output_stride=s.output_stride,
                       num_classes=s.num_classes, crop=s.crop, batch_size=s.batch_size, world=world, amp=use_amp,
                       loss=s.loss, refine=s.refine, crf_params=s.crf_params, optimizer=s.optimizer, bn=s.bn,
                       msc_scales=s.spec.msc_scales)
    return _Run(s, out, list(class_names) if class_names else None, rank, world, dev, use_amp, iterations)


def _open_data(run: _Run, ds: TrainFolder, files: Any, image_labels: Optional[Mapping[str, Any]],
               identity: Dict[str, Any], *, restart: bool, progress: bool, require_biased: bool) -> Optional[Dict]:
    """Stage 2: rank 0 compares the data and settings with the checkpoint's, or checks every
    file; the other ranks wait for its decision (a refusal reaches them all). The checkpoint to
    resume, or None."""
    from mars_plugin.runs.distributed import _free, share_error, sync_group

    s = run.s
    record = data_record(files, image_labels) if run.rank == 0 else None
    ck, err, group = None, None, sync_group()
    run.aside = OutputAside(run.out, f"--out {run.out}")
    if run.rank == 0:
        try:
            ck = open_run(run.out, identity, record, restart=restart, aside=run.aside, check=lambda: check_train_files(
                ds, s.num_classes, s.loss, workers=s.workers, progress=progress, require_biased=require_biased))
        except Exception as e:  # noqa: BLE001 -- shared with the other ranks, then raised
            err = e
    try:
        share_error(err, group)
    finally:
        _free(group)
    if run.rank != 0 and run.ck_path.is_file():
        ck = load_checkpoint(run.ck_path)
    run.identity = identity
    run.data_json = json.dumps(record, sort_keys=True) if run.rank == 0 else None
    return ck


def _build(run: _Run) -> None:
    """Stage 3: the network (random init, then ``weights``), its BatchNorm mode, the EMA teacher
    hook with ``loss="mars"``, the optimizer over DHR's groups and the AMP scaler."""
    from mars_plugin.adapters.training_hook import MARSTrainingHook
    from mars_plugin.commands.train_dhr import hook_match
    from mars_plugin.networks.deeplab import build_model, load_backbone_weights

    s = run.s
    torch.manual_seed(s.seed)  # the random initialisation of the new layers (and of everything without --weights)
    model = build_model(**s.model)
    if s.spec.msc_scales:  # deeplab-pytorch trains MSC(DeepLabV2): a loss on every scale and their max
        from mars_plugin.networks.deeplabv2 import MSC

        model = MSC(model, s.spec.msc_scales)
    if s.weights is not None:
        load_backbone_weights(model, s.weights)
    if s.bn == "frozen":
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                for p in m.parameters():
                    p.requires_grad_(False)
    elif s.bn == "sync" and run.world > 1:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.momentum = s.spec.bn_momentum  # the statistics' update, as the recipe's layers (DHR: torch's 0.1)
    model.to(run.dev)
    if s.loss == "mars":
        # match: the recipe's loss grid (train_dhr.hook_match); the CRF works on the crop's grid with
        # its RGB either way. MSC (deeplab-pytorch): the teacher completes the labels once at the
        # crop's size, then labels and weights go to each output's grid by PIL nearest, as main.py
        # resizes its labels. reduction="sum": divided by the global pixel count in _step.
        match, resize = ("labels_nearest", dlpt.resize_labels_nearest) if s.spec.msc_scales else (hook_match(s), None)
        run.hook = MARSTrainingHook(model, momentum=s.ema, match=match, refine=s.refine, crf_params=s.crf_params,
                                    biased_value=BIASED_VALUE, ignore_index=IGNORE_VALUE, reduction="sum",
                                    label_resize=resize)
    run.model = model
    run.opt = _optimizer(s, model)
    run.base_lrs = [g["lr"] for g in run.opt.param_groups]
    # bfloat16 where the GPU has it (Ampere and later): float32's range, so neither the student's
    # loss nor the teacher's eval-mode forward (running statistics, large activations early on)
    # overflows, and no loss scaling is needed; float16 with a GradScaler on older cards.
    run.amp_dtype = torch.bfloat16 if run.use_amp and torch.cuda.is_bf16_supported() else torch.float16
    run.scaler = torch.amp.GradScaler("cuda", enabled=run.use_amp and run.amp_dtype == torch.float16)


def _optimizer(s: TrainSettings, model: nn.Module) -> torch.optim.Optimizer:
    """SGD (or AdamW) over the recipe's four groups, each at ``lr * lr_mults[g]``, decayed where
    ``decay[g]`` (DHR train.py:200-205: 1/1/10/10, all decayed; deeplab-pytorch main.py:166-177:
    1/1/10/20, head bias undecayed); ``nesterov`` as the recipe. The groups:
    :func:`~mars_plugin.commands.recipe_uses.param_groups_of` (the empty ones left out)."""
    from mars_plugin.commands.recipe_uses import param_groups_of

    groups, index = param_groups_of(s, model)
    for g in groups:
        i = index[g["name"]]
        g["lr_mult"] = s.lr_mults[i]
        g["lr"], g["weight_decay"] = s.lr * g["lr_mult"], s.weight_decay if s.decay[i] else 0.0
    if s.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=s.lr, momentum=s.momentum, weight_decay=s.weight_decay,
                               nesterov=s.spec.nesterov)
    return torch.optim.AdamW(groups, lr=s.lr, weight_decay=s.weight_decay)


def _resume(run: _Run, ck: Optional[Mapping[str, Any]]) -> int:
    """Stage 4: the checkpoint's student, teacher, optimizer and scaler into the built run (then
    DDP around the student); the step to start from (0 without a checkpoint)."""
    from mars_plugin.runs.errors import JobError

    start = 0
    if ck is not None:
        run.model.load_state_dict(ck["student"])
        if run.hook is not None:
            if ck.get("teacher") is None:
                raise JobError(f"{run.ck_path}: holds no teacher")
            run.hook.teacher.module.load_state_dict(ck["teacher"])
        run.opt.load_state_dict(ck["optimizer"])
        if ck.get("scaler"):
            run.scaler.load_state_dict(ck["scaler"])
        start = int(ck["iteration"])
    run.net = run.model
    if run.world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        run.net = DDP(run.model, device_ids=[run.dev.index] if run.dev.type == "cuda" else None)
    return start


def _loop(run: _Run, ds: TrainFolder, start: int, *, progress: bool,
          on_step: Optional[Callable[[int], None]]) -> Optional[float]:
    """Stage 5: steps ``start..iterations``, each of ``iter_size`` batches (a log line every
    ``log_every``, a checkpoint every ``save_every`` and at the end); the last logged loss."""
    s, k, T = run.s, run.s.iter_size, run.iterations
    # the loader draws batches ("micro-steps"), iter_size of them per optimizer step
    sampler = StepSampler(start * k, T * k, s.batch_size, run.rank, run.world)
    loader = torch.utils.data.DataLoader(ds, batch_sampler=sampler, num_workers=s.workers,
                                         pin_memory=run.dev.type == "cuda", persistent_workers=False)
    bar = None
    if progress and run.rank == 0:
        from tqdm.auto import tqdm

        bar = tqdm(total=T, initial=start, desc=f"train ({s.loss})", unit="step", dynamic_ncols=True)
    t0 = time.perf_counter()
    last_loss = None
    run.net.train()
    _set_bn_mode(run.model, s.bn)
    batches = _reported(loader, start * k)
    for step in range(start, T):
        total, count = _step(run, step, [next(batches) for _ in range(k)])
        done = step + 1
        if done % s.log_every == 0 or done == T:
            last_loss = _log(run, done, total, count, time.perf_counter() - t0, done - start)
            if bar is not None:
                bar.set_postfix(loss=f"{last_loss:.4f}")
        if done % s.save_every == 0 or done == T:
            _save(run, done)
        if bar is not None:
            bar.update(1)
        if on_step is not None:
            on_step(done)
    if bar is not None:
        bar.close()
    return last_loss


def _step(run: _Run, step: int, batches: Sequence[Mapping[str, Any]]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Stage 6: one optimizer step on this process's slices of ``iter_size`` batches; (their
    summed loss, the global count of pixels the loss averages over). The gradients of the
    batches add up, each loss divided by the count of all of them: the step of one batch
    ``iter_size`` times as large (with frozen BatchNorm exactly)."""
    from mars_plugin.commands.train_dhr import ce_loss_sum, check_logits, loss_labels
    from mars_plugin.networks.deeplabv1 import seam_replicas_forward  # SEAM's train.py: DataParallel on 2 GPUs

    s, dev = run.s, run.dev
    _set_lr(run.opt, run.base_lrs, s, step, run.iterations)
    torch.manual_seed(_step_seed(s.seed, step, run.rank))
    ys = [b["label"].to(dev, non_blocking=True) for b in batches]
    # The global count of pixels the loss averages over, on the loss grid (biased ones included: the
    # teacher fills them); MSC (deeplab-pytorch): each batch's loss is already a sum of per-output
    # means, averaged over the batches.
    count = (torch.tensor(float(len(ys)), dtype=torch.float64, device=dev) if s.spec.msc_scales else
             _all_reduce_sum(sum((loss_labels(s, y) != IGNORE_VALUE).sum().double() for y in ys)))
    run.opt.zero_grad(set_to_none=True)
    total_all = torch.zeros((), dtype=torch.float64, device=dev)
    for batch, y in zip(batches, ys):
        x = batch["image"].to(dev, non_blocking=True)
        with torch.autocast(dev.type, dtype=run.amp_dtype, enabled=run.use_amp):
            logits = run.net(x) if s.recipe != "seam" else seam_replicas_forward(run.net, x, s.spec.bn_batch)
            if s.spec.msc_scales:  # MSC's outputs each meet the labels on their own grid
                total = dlpt.msc_step_loss(logits, y, hook=run.hook, images=x, classes=batch["classes"].to(dev),
                                           images_rgb=batch["rgb"].to(dev), all_reduce=_all_reduce_sum)
            else:
                check_logits(s, logits, y)
                total = (ce_loss_sum(s, logits, y) if run.hook is None else
                         run.hook(x, logits, y, batch["classes"].to(dev), images_rgb=batch["rgb"].to(dev)))
        # DDP averages the gradients over the processes: scale by their number so that the
        # gradient is the global sum over the global count.
        run.scaler.scale(total.float() * run.world / count.clamp_min(1).float()).backward()
        total_all += total.detach().double()
    run.scaler.step(run.opt)
    run.scaler.update()
    if run.hook is not None:
        run.hook.update(run.model)
    return total_all, count


def _set_lr(opt: torch.optim.Optimizer, base_lrs: Sequence[float], s: TrainSettings, step: int, total: int) -> None:
    """Each group's lr at (0-based) ``step`` of ``total``: its initial lr times the recipe's poly
    factor (:func:`~mars_plugin.networks.recipes.poly_factor`: recomputed every ``lr_step`` steps)."""
    factor = poly_factor(s, step, total)
    for g, base in zip(opt.param_groups, base_lrs):
        g["lr"] = base * factor


def _log(run: _Run, done: int, total: torch.Tensor, count: torch.Tensor, elapsed: float, steps: int) -> float:
    """The global batch's loss of step ``done``; rank 0 appends its ``log.jsonl`` line. A loss that
    is not finite (in float32) ends the run."""
    from mars_plugin.runs.errors import JobError

    loss = float(_all_reduce_sum(total.detach().double().clone()) / count.clamp_min(1))
    if not math.isfinite(loss) and not run.use_amp:
        raise JobError(f"the loss is {loss} at step {done}: lower --lr")
    if run.rank == 0:
        eta = elapsed / steps * (run.iterations - done)
        rec = {"iteration": done, "loss": round(loss, 6), "lr": run.opt.param_groups[0]["lr"],
               "elapsed_s": round(elapsed, 3), "eta_s": round(eta, 1)}
        with open(run.out / LOG_NAME, "a") as f:
            f.write(json.dumps(rec) + "\n")
    return loss


def _save(run: _Run, step: int) -> None:
    """Stage 7 (rank 0): the checkpoint of step ``step``: the network's arguments, student,
    teacher, optimizer, scaler, the settings record, class names and the data record."""
    if run.rank != 0:
        return
    save_checkpoint(run.ck_path, {
        "recipe": run.s.recipe, "iteration": step,
        "model": {**run.s.model, **({"msc_scales": list(run.s.spec.msc_scales)} if run.s.spec.msc_scales else {})}, "student": run.model.state_dict(),
        "teacher": run.hook.teacher.module.state_dict() if run.hook is not None else None,
        "optimizer": run.opt.state_dict(), "scaler": run.scaler.state_dict(), "settings": run.identity,
        "class_names": run.class_names, "data": run.data_json,
    })


def _reported(loader: Any, start: int) -> Iterator[Dict[str, Any]]:
    """The batches of ``loader``; a sample that could not be read (a file changed after the
    check before step 1), in a worker process or this one, ends the run with one line naming it."""
    from mars_plugin.runs.errors import JobError

    step = start
    it = iter(loader)
    while True:
        try:
            batch = next(it)
        except StopIteration:
            return
        except SampleError as e:
            raise JobError(f"{SampleError.message_of(e)} (read for step {step + 1}: the file changed after the "
                           "check before step 1)") from None
        step += 1
        yield batch


def _set_bn_mode(model: nn.Module, bn: str) -> None:
    """Frozen BatchNorm stays in eval mode (running statistics) while the rest trains; SEAM's
    network trains as its train.py leaves it (:func:`~mars_plugin.networks.deeplabv1.seam_train_mode`)."""
    if getattr(model, "arch", None) == "deeplabv1-wr38":  # undo WR38's train() override, never run upstream
        from mars_plugin.networks.deeplabv1 import seam_train_mode

        seam_train_mode(model)
    if bn == "frozen":
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.eval()


def run_train_command(args: Any) -> Any:
    """``mars train``'s arguments -> :class:`TrainSettings` -> :func:`train` (the inputs resolved
    by :func:`~mars_plugin.commands.train_data.command_inputs`); rank 0 says what it trained.
    Returns an empty :class:`~mars_plugin.commands.command_table.CommandResult` (exit 0): the
    run has no job summary (train()'s dict is not one)."""
    from mars_plugin.runs.distributed import _rank_world
    from mars_plugin.commands.train_data import command_inputs
    from mars_plugin.runs.errors import JobError

    images, num_classes, names, image_labels, notes = command_inputs(args)
    settings = TrainSettings.from_args(args, num_classes)
    try:
        res = train(images, args.labels, args.out, settings=settings, image_labels=image_labels, class_names=names,
                    progress=not args.no_progress, restart=args.restart, notes=notes)
    except NotImplementedError as e:  # a recipe's piece this build lacks: one line on the command line
        raise JobError(str(e).removeprefix("mars train: ")) from None
    if _rank_world()[0] == 0:
        print(f"train ({args.loss}) -> {res['checkpoint']}: {res['iterations']} steps"
              + (f", resumed at {res['resumed_from']}" if res["resumed_from"] else "")
              + (f", last loss {res['loss']:.4f}" if res["loss"] is not None else "")
              + (f"; the earlier run's {', '.join(res['aside'])} moved to {res['aside_dir']}" if res["aside"] else ""))
    from mars_plugin.commands.command_table import CommandResult

    return CommandResult()
