"""``mars train``: the paper's second step, a segmentation network trained on debiased labels
with the EMA teacher, the CRF-refined complement and the weighted CE (Sec. 3.4, Eq. 6-7).

One step (``loss="mars"``): the student predicts the batch; :class:`MARSTrainingHook` lets the
EMA teacher predict it too, refines the teacher's probabilities with the dense CRF on the
batch (on the device; ``refine="crf"``, the paper's R), fills the biased pixels (254) with the
teacher's label restricted to the image's classes, and weighs them by its certainty (WCE);
SGD steps; the teacher follows by EMA (0.999). ``loss="ce"`` trains plain CE on the given
labels (the baseline: the WSSS method's pseudo labels as they are).

The optimisation is the MARS authors' own segmentation trainer's (shjo-april/DHR train.py at
94d5189, lines 197-207 and 366-371): SGD, momentum 0.9, weight decay 4e-5, learning rate 1e-3 for
the backbone and 10x for the new layers (weights and biases alike), poly decay with power 0.9
over the iterations, batch 16 of 512 x 512 crops, EMA 0.999; the augmentation is in
:mod:`mars_plugin.networks.seg_data`.

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
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from mars_plugin._checks import check_int_param, check_num_classes, check_real_param, check_seed
from mars_plugin.formats.files import BIASED_VALUE, IGNORE_VALUE, atomic_write
from mars_plugin.commands.run_lock import LOCK_NAME, RunLock, remove_stale_tmp
from mars_plugin.commands.train_data import (CHECKPOINT_NAME, LOG_NAME, check_train_files, data_record,
                                             image_labels_warning, list_train_files, open_run)
from mars_plugin.networks.seg_checkpoint import load_checkpoint, save_checkpoint
from mars_plugin.networks.seg_data import Augmentation, SampleError, StepSampler, TrainFolder

__all__ = ["train", "TRAIN_DEFAULTS", "CHECKPOINT_NAME", "LOG_NAME", "poly_lr"]

#: The defaults of ``mars train`` and where they come from (DHR train.py:366-371 at 94d5189).
TRAIN_DEFAULTS: Dict[str, Any] = dict(
    arch="deeplabv3+", backbone="resnet101", loss="mars", refine="crf", crf_params="mars",
    iterations=30000, batch_size=16, crop=512, min_size=320, max_size=640, lr=1e-3, momentum=0.9,
    weight_decay=4e-5, ema=0.999, poly_power=0.9, seed=0,
)


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
    num_classes: int,
    *,
    image_labels: Optional[Dict[str, List[int]]] = None,
    arch: str = TRAIN_DEFAULTS["arch"],
    backbone: str = TRAIN_DEFAULTS["backbone"],
    output_stride: Optional[int] = None,
    weights: Optional[Union[str, os.PathLike]] = None,
    loss: str = TRAIN_DEFAULTS["loss"],
    refine: Optional[str] = TRAIN_DEFAULTS["refine"],
    crf_params: Union[str, Mapping[str, Any]] = TRAIN_DEFAULTS["crf_params"],
    iterations: int = TRAIN_DEFAULTS["iterations"],
    batch_size: int = TRAIN_DEFAULTS["batch_size"],
    crop: int = TRAIN_DEFAULTS["crop"],
    min_size: int = TRAIN_DEFAULTS["min_size"],
    max_size: int = TRAIN_DEFAULTS["max_size"],
    lr: float = TRAIN_DEFAULTS["lr"],
    momentum: float = TRAIN_DEFAULTS["momentum"],
    weight_decay: float = TRAIN_DEFAULTS["weight_decay"],
    ema: float = TRAIN_DEFAULTS["ema"],
    poly_power: float = TRAIN_DEFAULTS["poly_power"],
    seed: int = TRAIN_DEFAULTS["seed"],
    bn: Optional[str] = None,
    optimizer: str = "sgd",
    amp: bool = True,
    device: str = "auto",
    workers: int = 2,
    save_every: int = 1000,
    log_every: int = 10,
    stems: Optional[List[str]] = None,
    class_names: Optional[List[str]] = None,
    progress: bool = True,
    restart: bool = False,
    notes: Sequence[str] = (),
    require_biased: bool = True,
    on_step: Optional[Callable[[int], None]] = None,
    max_bytes: Union[None, str, int] = "auto",
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
        image_labels: {stem: [1-based class ids]} the teacher may fill biased pixels with;
            default: the classes of each label (a class whose pixels were all marked biased is
            then not offered: ``mars reproduce`` writes ``image_labels.json``).
        arch, backbone, output_stride: see :func:`mars_plugin.networks.deeplab.build_model` (None: the
            arch's upstream stride, 16 for DeepLabv3+, 8 for DeepLabv2).
        weights: a torchvision-layout ImageNet ResNet file (read weights-only); None: random init.
        loss: ``"mars"`` (EMA teacher + complement + WCE) or ``"ce"`` (plain CE, the baseline).
        refine: the teacher's refinement with ``loss="mars"``: ``"crf"`` (the paper's), None.
        bn: the backbone's and head's BatchNorm: ``"train"`` (batch statistics; DeepLabv3+'s
            default, as RS+EPM and DHR train it), ``"frozen"`` (running statistics and affine
            weights fixed; DeepLabv2's default, as deeplab-pytorch's ``freeze_bn``, main.py:206-208
            at 4219467) or ``"sync"`` (SyncBatchNorm over the torchrun processes, CUDA only).
            Without batch statistics (frozen), N processes compute exactly the step of one.
        optimizer: ``"sgd"`` (DHR's: momentum, weight decay) or ``"adamw"`` (betas 0.9/0.999,
            the same groups, decoupled weight decay): not the paper's, but a network trained from
            random initialisation (no ``weights``) on a small set learns in far fewer steps.
        amp: mixed precision on CUDA (ignored on the CPU).
        device: ``"auto"`` (CUDA if available; under torchrun the process's ``LOCAL_RANK``), ``"cpu"``,
            ``"cuda"``, ``"cuda:N"``.
        workers: data-loading processes per training process (0: in the main process).
        stems: train on these images only (default: every label in ``labels``).
        restart: train from step 0, removing a checkpoint and log in ``out`` (once the files
            passed their check).
        require_biased: with ``loss="mars"``, refuse labels without a single biased pixel (254), the
            sign of pseudo labels given for debiased ones; False where the labels are known to be
            ``mars debias``'s output (``mars reproduce --train``), which may mark nothing biased.
        notes: lines printed on stderr (``mars train: <line>``) once the checks passed, before
            step 1, with the warning of ``loss="mars"`` without ``image_labels``.
        on_step: called with the number of steps done after each step (and its checkpoint, if
            one was due): progress hooks, tests.
        max_bytes: the memory budget of one process (``--max-memory``): ``"auto"`` (80% of the
            device's memory), bytes, or None (no limit); a step that needs more
            (:func:`mars_plugin.networks.memory.train_memory_bytes`) is refused before any work.

    Returns:
        {"checkpoint": path, "iterations": done, "resumed_from": step, "loss": last logged loss}
    """
    from mars_plugin.adapters.training_hook import MARSTrainingHook
    from mars_plugin.networks.deeplab import build_model, load_backbone_weights, param_groups
    from mars_plugin.commands.errors import JobError
    from mars_plugin.commands.distributed import _free, _rank_world, resolve_device, share_error, sync_group
    from mars_plugin.commands.inputs import check_out_apart  # before any work: an output is never an input

    check_out_apart(out, "--out", {"--images": images, "--labels": labels, "--weights": weights})
    num_classes = check_num_classes(num_classes)
    if loss not in ("mars", "ce"):
        raise ValueError(f"loss must be 'mars' or 'ce', got {loss!r}")
    if refine not in (None, "crf", "none"):
        raise ValueError(f"refine must be 'crf' or None, got {refine!r}")
    refine = None if refine in (None, "none") else refine
    iterations = check_int_param(iterations, "iterations", 1)
    batch_size = check_int_param(batch_size, "batch_size", 1)
    save_every = check_int_param(save_every, "save_every", 1)
    log_every = check_int_param(log_every, "log_every", 1)
    workers = check_int_param(workers, "workers", 0, 64)
    seed = check_seed(seed)
    lr = check_real_param(lr, "lr", 0.0, 10.0, low_open=True)
    momentum = check_real_param(momentum, "momentum", 0.0, 1.0, high_open=True)
    weight_decay = check_real_param(weight_decay, "weight_decay", 0.0, 1.0)
    ema = check_real_param(ema, "ema", 0.0, 1.0)
    poly_power = check_real_param(poly_power, "poly_power", 0.0, 10.0)
    aug = Augmentation(crop=crop, min_size=min_size, max_size=max_size)
    if bn is None:
        bn = "frozen" if arch == "deeplabv2" else "train"
    if optimizer not in ("sgd", "adamw"):
        raise ValueError(f"optimizer must be 'sgd' or 'adamw', got {optimizer!r}")
    if bn not in ("train", "frozen", "sync"):
        raise ValueError(f"bn must be 'train', 'frozen' or 'sync', got {bn!r}")

    images, labels, out = Path(images), Path(labels), Path(out)
    files = list_train_files(images, labels, stems)
    stems = files.stems

    rank, world = _rank_world()
    dev = resolve_device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) if world > 1 else torch.cuda.current_device())
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    use_amp = bool(amp) and dev.type == "cuda"
    if bn == "sync" and dev.type != "cuda":
        raise ValueError("bn='sync' (SyncBatchNorm) runs on CUDA only; on the CPU use bn='train' or 'frozen'")

    from mars_plugin.networks.deeplab import DEFAULT_OUTPUT_STRIDE
    from mars_plugin.networks.memory import check_train_budget

    output_stride = int(DEFAULT_OUTPUT_STRIDE.get(arch, 16) if output_stride is None else output_stride)
    check_train_budget(max_bytes, dev, arch=arch, backbone=backbone, output_stride=output_stride,
                       num_classes=num_classes, crop=aug.crop, batch_size=batch_size, world=world, amp=use_amp,
                       loss=loss, refine=refine, crf_params=crf_params, optimizer=optimizer, bn=bn)
    settings = dict(arch=arch, backbone=backbone, output_stride=output_stride, num_classes=num_classes,
                    loss=loss, refine=refine if loss == "mars" else None,
                    crf_params=crf_params if (loss == "mars" and refine) else None, iterations=iterations,
                    batch_size=batch_size, crop=aug.crop, min_size=aug.min_size, max_size=aug.max_size, lr=lr,
                    momentum=momentum, weight_decay=weight_decay, ema=ema if loss == "mars" else None,
                    poly_power=poly_power, seed=seed, bn=bn, optimizer=optimizer,
                    weights=os.path.basename(weights) if weights else None,
                    stems=len(stems), images=str(images), labels=str(labels), amp=use_amp, world_size=world)
    # One run per --out: a second one (another shell, a scheduler retrying) would interleave
    # checkpoints and log lines of two runs. Rank 0 holds the lock for the whole run; the lock
    # ends with its process, and a folder made only for a run refused here is removed again.
    lock, made_out = None, False
    if rank == 0:
        made_out = not out.exists()
        out.mkdir(parents=True, exist_ok=True)
        lock = RunLock(out / LOCK_NAME, f"--out {out}", "mars train")
        try:
            lock.acquire()
        except BaseException:
            _remove_if_empty(out, made_out)
            raise
        remove_stale_tmp(out)
    try:
        ck_path = out / CHECKPOINT_NAME
        ds = TrainFolder(images, labels, stems, num_classes, aug, seed, classes=image_labels,
                         allow_biased=(loss == "mars"), image_paths=files.image_paths)
        # Rank 0 compares the data and settings with the checkpoint's, or checks every file; the
        # other ranks wait for its decision (a refusal reaches them all).
        record = data_record(files, image_labels) if rank == 0 else None
        ck, err, group = None, None, sync_group()
        if rank == 0:
            try:
                ck = open_run(out, settings, record, restart=restart, check=lambda: check_train_files(
                    ds, num_classes, loss, workers=workers, progress=progress, require_biased=require_biased))
            except Exception as e:  # noqa: BLE001 -- shared with the other ranks, then raised
                err = e
        try:
            share_error(err, group)
        finally:
            _free(group)
        if rank != 0 and ck_path.is_file():
            ck = load_checkpoint(ck_path)
        notes = [*notes, *([f"warning: {w}"] if (w := image_labels_warning(loss, image_labels)) else [])]
        if rank == 0 and notes:
            print("\n".join(f"mars train: {n}" for n in notes), file=sys.stderr, flush=True)
        torch.manual_seed(seed)  # the random initialisation of the new layers (and of everything without --weights)
        model = build_model(arch=arch, backbone=backbone, num_classes=num_classes, output_stride=output_stride)
        if weights is not None:
            load_backbone_weights(model, weights)
        if bn == "frozen":
            for m in model.modules():
                if isinstance(m, nn.modules.batchnorm._BatchNorm):
                    for p in m.parameters():
                        p.requires_grad_(False)
        elif bn == "sync" and world > 1:
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        model.to(dev)
        hook = None
        if loss == "mars":
            # match="logits": the loss and the CRF work on the label grid with the crop's RGB (the
            # network's logits are already at the input size).
            # reduction="sum": divided by the global pixel count below (the same gradient on any
            # number of processes).
            hook = MARSTrainingHook(model, momentum=ema, match="logits", refine=refine, crf_params=crf_params,
                                    biased_value=BIASED_VALUE, ignore_index=IGNORE_VALUE, reduction="sum")
        groups = param_groups(model, lr, weight_decay)
        for g in groups:
            # DHR train.py:200-205 (the trainer whose numbers these are): backbone weights and biases
            # at lr, the new layers' at 10 lr, all with weight decay (param_groups' defaults are
            # PuzzleCAM's 1/2/10/20 with undecayed biases).
            g["lr_mult"] = 1.0 if g["name"].startswith("backbone") else 10.0
            g["lr"], g["weight_decay"] = lr * g["lr_mult"], weight_decay
        if optimizer == "sgd":
            opt = torch.optim.SGD(groups, lr=lr, momentum=momentum, weight_decay=weight_decay)
        else:
            opt = torch.optim.AdamW(groups, lr=lr, weight_decay=weight_decay)
        base_lrs = [g["lr"] for g in opt.param_groups]
        # bfloat16 where the GPU has it (Ampere and later): float32's range, so neither the student's
        # loss nor the teacher's eval-mode forward (running statistics, large activations early on)
        # overflows, and no loss scaling is needed; float16 with a GradScaler on older cards.
        amp_dtype = torch.bfloat16 if use_amp and torch.cuda.is_bf16_supported() else torch.float16
        scaler = torch.amp.GradScaler("cuda", enabled=use_amp and amp_dtype == torch.float16)

        start = 0
        if ck is not None:
            model.load_state_dict(ck["student"])
            if hook is not None:
                if ck.get("teacher") is None:
                    raise JobError(f"{ck_path}: holds no teacher")
                hook.teacher.module.load_state_dict(ck["teacher"])
            opt.load_state_dict(ck["optimizer"])
            if ck.get("scaler"):
                scaler.load_state_dict(ck["scaler"])
            start = int(ck["iteration"])
            ck = None  # the weights are in the model now

        net: nn.Module = model
        if world > 1:
            from torch.nn.parallel import DistributedDataParallel as DDP

            net = DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None)

        def save(step: int) -> None:
            if rank != 0:
                return
            save_checkpoint(ck_path, {
                "model": {"arch": arch, "backbone": backbone, "output_stride": output_stride,
                          "num_classes": num_classes},
                "iteration": step, "student": model.state_dict(),
                "teacher": hook.teacher.module.state_dict() if hook is not None else None,
                "optimizer": opt.state_dict(), "scaler": scaler.state_dict(), "settings": settings,
                "class_names": list(class_names) if class_names else None, "data": data_json,
            })

        data_json = json.dumps(record, sort_keys=True) if rank == 0 else None
        if rank == 0:
            _trim_log(out / LOG_NAME, start)
        if start >= iterations:
            return {"checkpoint": ck_path, "iterations": start, "resumed_from": start, "loss": None}

        loader = torch.utils.data.DataLoader(ds, batch_sampler=StepSampler(start, iterations, batch_size, rank, world),
                                             num_workers=workers, pin_memory=dev.type == "cuda",
                                             persistent_workers=False)
        bar = None
        if progress and rank == 0:
            from tqdm.auto import tqdm

            bar = tqdm(total=iterations, initial=start, desc=f"train ({loss})", unit="step", dynamic_ncols=True)
        t0 = time.perf_counter()
        last_loss = None
        net.train()
        _set_bn_mode(model, bn)
        for step, batch in zip(range(start, iterations), _reported(loader, start)):
            for g, base in zip(opt.param_groups, base_lrs):
                g["lr"] = poly_lr(base, step, iterations, poly_power)
            torch.manual_seed(_step_seed(seed, step, rank))
            x = batch["image"].to(dev, non_blocking=True)
            y = batch["label"].to(dev, non_blocking=True)
            # The global count of pixels the loss averages over (biased ones included: the teacher fills them).
            count = _all_reduce_sum((y != IGNORE_VALUE).sum().double())
            with torch.autocast(dev.type, dtype=amp_dtype, enabled=use_amp):
                logits = net(x)
                if hook is not None:
                    total = hook(x, logits, y, batch["classes"].to(dev), images_rgb=batch["rgb"].to(dev))
                else:
                    total = F.cross_entropy(logits.float(), y, ignore_index=IGNORE_VALUE, reduction="sum")
            # DDP averages the gradients over the processes: scale by their number so that the
            # gradient is the global sum over the global count.
            loss_t = total.float() * world / count.clamp_min(1).float()
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss_t).backward()
            scaler.step(opt)
            scaler.update()
            if hook is not None:
                hook.update(model)
            done = step + 1
            if done % log_every == 0 or done == iterations:
                g_loss = _all_reduce_sum(total.detach().double().clone()) / count.clamp_min(1)
                last_loss = float(g_loss)
                if not math.isfinite(last_loss) and not use_amp:
                    raise JobError(f"the loss is {last_loss} at step {done}: lower --lr")
                if rank == 0:
                    el = time.perf_counter() - t0
                    eta = el / (done - start) * (iterations - done)
                    rec = {"iteration": done, "loss": round(last_loss, 6), "lr": opt.param_groups[0]["lr"],
                           "elapsed_s": round(el, 3), "eta_s": round(eta, 1)}
                    with open(out / LOG_NAME, "a") as f:
                        f.write(json.dumps(rec) + "\n")
                    if bar is not None:
                        bar.set_postfix(loss=f"{last_loss:.4f}")
            if done % save_every == 0 or done == iterations:
                save(done)
            if bar is not None:
                bar.update(1)
            if on_step is not None:
                on_step(done)
        if bar is not None:
            bar.close()
        return {"checkpoint": ck_path, "iterations": iterations, "resumed_from": start, "loss": last_loss}
    finally:
        if lock is not None:
            lock.release()
            _remove_if_empty(out, made_out)


def _reported(loader: Any, start: int) -> Iterator[Dict[str, Any]]:
    """The batches of ``loader``; a sample that could not be read (a file changed after the
    check before step 1), in a worker process or this one, ends the run with one line naming it."""
    from mars_plugin.commands.errors import JobError

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


def _remove_if_empty(out: Path, made: bool) -> None:
    """Remove ``out`` if this run made it and left nothing in it (a refused or failed start)."""
    if made:
        try:
            out.rmdir()
        except OSError:
            pass


def _set_bn_mode(model: nn.Module, bn: str) -> None:
    """Frozen BatchNorm stays in eval mode (running statistics) while the rest trains."""
    if bn == "frozen":
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.eval()


def _trim_log(path: Path, step: int) -> None:
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


def run_train_command(args: Any) -> Dict[str, Any]:
    """``mars train``'s arguments -> :func:`train` (the inputs resolved by
    :func:`~mars_plugin.commands.train_data.command_inputs`)."""
    from mars_plugin.commands.distributed import _rank_world
    from mars_plugin.commands.train_data import command_inputs

    images, num_classes, names, image_labels, notes = command_inputs(args)
    res = train(
        images, args.labels, args.out, num_classes, image_labels=image_labels, arch=args.arch,
        backbone=args.backbone, output_stride=args.output_stride, weights=args.weights, loss=args.loss,
        refine=args.refine, crf_params=args.crf_params, iterations=args.iterations, batch_size=args.batch_size,
        crop=args.crop, min_size=args.min_size, max_size=args.max_size, lr=args.lr, momentum=args.momentum,
        weight_decay=args.weight_decay, ema=args.ema, seed=args.seed, bn=args.bn, optimizer=args.optimizer,
        amp=not args.no_amp, device=args.device,
        workers=args.workers, save_every=args.save_every, log_every=args.log_every, class_names=names,
        progress=not args.no_progress, restart=args.restart, notes=notes,
        max_bytes="auto" if args.max_memory is None else int(args.max_memory * 2 ** 30),
    )
    res["rank"] = _rank_world()[0]
    return res
