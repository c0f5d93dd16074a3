"""Images per second of ``mars predict``'s computation: multi-scale + flip inference of a DeepLab
network (random weights, :func:`mars_plugin.networks.deeplab.build_model`) and the dense CRF.

Times :func:`mars_plugin.networks.inference.multiscale_probs` (the network over ``--scales`` and flips) and
:func:`mars_plugin.networks.inference.labels_from_probs` (the CRF over the classes reaching 0.05) on
``--images`` generated photographs of ``--size`` (HxW or one side), ``--batch`` at a time; the
median of ``--repeats`` runs after a warm-up. File reading and PNG writing are not timed (a few
ms per VOC image). A randomly initialised network gives an almost uniform softmax (no class
reaches 0.05, so every image's CRF would run over all C + 1 classes), and scaled up it still
spreads over most classes; a trained network's VOC image holds background and one or two
objects. So the CRF gets the network's probabilities with all but ``--classes-per-image``
classes (background and random others) scaled down by 1e-4 and renormalised (not timed): the
CRF's cost grows with the classes it runs over (printed).

    python benchmarks/bench_predict.py --device cuda --arch deeplabv3+ --backbone resnet101 --size 512 \\
        --batch 8 --images 32 [--fp16]
    python benchmarks/bench_predict.py --smoke                                               # seconds, CPU

The network's FLOPs per image over the scales and flips are counted once by torch's
``FlopCounterMode`` on the meta device (no compute) and printed with the TFLOP/s the timed runs
reach. ``--channels-last`` puts the network's weights and inputs in NHWC (cuDNN's fast layout for
half-precision convolutions on tensor cores; the same numbers to rounding): compare with and
without it on a GPU.
"""
import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _machine import machine_line  # noqa: E402
from bench_crf import natural_image  # noqa: E402

from mars_plugin.networks import deeplab_pytorch  # noqa: E402
from mars_plugin.networks.deeplab import build_model, normalize  # noqa: E402
from mars_plugin.networks.inference import CLASS_THRESHOLD, labels_from_probs, multiscale_probs  # noqa: E402


def _size(text: str):
    if "x" in text:
        h, w = (int(t) for t in text.lower().split("x"))
        return h, w
    return int(text), int(text)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def network_flops(arch, backbone, num_classes, output_stride, H, W, scales, flip) -> int:
    """FLOPs (2 per multiply-add, torch's FlopCounterMode) of the network over one H x W image's
    scales (``int(side * s)``, as multiscale_probs) and flips, counted on the meta device."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        net = build_model(arch, backbone, num_classes, output_stride).eval()
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            for s in scales:
                net(torch.empty(2 if flip else 1, 3, int(H * s), int(W * s)))
    return counter.get_total_flops()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="deeplabv3+", choices=("deeplabv3+", "deeplabv2"))
    ap.add_argument("--backbone", default="resnet101", choices=("resnet18", "resnet50", "resnet101"))
    ap.add_argument("--output-stride", type=int, default=None, help="8 or 16 (default: the arch's)")
    ap.add_argument("--num-classes", type=int, default=20, help="C (VOC: 20)")
    ap.add_argument("--size", default="512", help="image size HxW, or one side (default 512)")
    ap.add_argument("--scales", default="1,0.5,1.5,2", help="comma-separated (mars predict's default)")
    ap.add_argument("--no-flip", action="store_true")
    ap.add_argument("--crf", default="mars", choices=("mars", "psa", "none"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=None,
                    help="images per forward pass and per CRF call (default: 8 on CUDA, 1 on the CPU)")
    ap.add_argument("--images", type=int, default=None, help="images per timed run (default: 4 per batch)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--fp16", action="store_true",
                    help="the network under half-precision autocast (mars predict --fp16: bfloat16)")
    ap.add_argument("--logit-std", type=float, default=3.0,
                    help="scale the random network's logits to this standard deviation (0: as they are)")
    ap.add_argument("--classes-per-image", type=int, default=3,
                    help="classes of each image's CRF (background + random others; 0: the network's own)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--channels-last", action="store_true", help="the network's weights and inputs in NHWC")
    ap.add_argument("--smoke", action="store_true",
                    help="seconds: ResNet-18, 64x64, 2 images, one repeat (checks that it runs)")
    args = ap.parse_args(argv)
    cuda = args.device.startswith("cuda")
    if args.smoke:
        # deeplabv2 is deeplab-pytorch's MSRA ResNet-50/101 only
        small = "resnet18" if args.arch == "deeplabv3+" else "resnet50"
        args.backbone, args.size, args.images, args.repeats = small, "64", 2, 1
        args.batch = args.batch or 2
    args.batch = args.batch or (8 if cuda else 1)
    args.images = args.images or 4 * args.batch
    if args.threads:
        torch.set_num_threads(args.threads)
    H, W = _size(args.size)
    scales = tuple(float(s) for s in args.scales.split(","))
    flip = not args.no_flip
    dev = torch.device(args.device)
    torch.manual_seed(0)
    model = build_model(args.arch, args.backbone, args.num_classes, args.output_stride).to(dev).eval()
    # deeplabv2's input: BGR minus the caffe mean (deeplab-pytorch's base.py)
    prep = deeplab_pytorch.normalize if args.arch == "deeplabv2" else normalize
    rgb = torch.from_numpy(np.stack([natural_image(H, W, i) for i in range(args.images)]))
    batches = [rgb[i:i + args.batch].to(dev) for i in range(0, args.images, args.batch)]
    g = torch.Generator().manual_seed(1)
    L = args.num_classes + 1
    keep = torch.zeros(args.batch, L, dtype=torch.bool)
    keep[:, 0] = True
    for i in range(args.batch):
        keep[i, 1 + torch.randperm(L - 1, generator=g)[: max(args.classes_per_image - 1, 0)]] = True
    scale = 1.0
    if args.logit_std > 0:
        with torch.no_grad():
            scale = args.logit_std / float(model(prep(batches[0][:1])).float().std())

    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)

    def net(x):
        if args.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return model(x) * scale

    def run():
        """(network seconds, CRF seconds, classes per image's CRF)."""
        t_net = t_crf = 0.0
        kept = []
        for b in batches:
            _sync(args.device)
            t0 = time.perf_counter()
            probs = multiscale_probs(net, prep(b), scales, flip, fp16=args.fp16)
            _sync(args.device)
            t_net += time.perf_counter() - t0
            if args.classes_per_image > 0:  # not timed: stands for a trained network's softmax
                probs = probs * torch.where(keep[: len(b)].to(dev), 1.0, 1e-4)[:, :, None, None]
                probs = probs / probs.sum(1, keepdim=True)
            _sync(args.device)
            t1 = time.perf_counter()
            labels_from_probs(probs, b, args.crf)
            _sync(args.device)
            t_crf += time.perf_counter() - t1
            n_kept = (probs.amax(dim=(2, 3)) >= CLASS_THRESHOLD).sum(1)
            kept += torch.where(n_kept == 0, probs.shape[1], n_kept).tolist()  # none: all take part
        return t_net, t_crf, kept

    run()  # warm-up (cuDNN's algorithm choice, the allocator, the CRF's lattice code)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    times = [run() for _ in range(args.repeats)]
    t_net = statistics.median(t[0] for t in times)
    t_crf = statistics.median(t[1] for t in times)
    kept = times[0][2]
    n = args.images
    print(machine_line("cuda" if dev.type == "cuda" else "cpu"))
    print(f"mars predict: {args.arch} {args.backbone} OS {model.config['output_stride']}, C = {args.num_classes}, "
          f"random weights (logit std {args.logit_std:g}), {n} images {H}x{W}, batch {args.batch}, scales "
          f"{','.join(f'{s:g}' for s in scales)}, flip {flip}, fp16 {args.fp16}, crf {args.crf}; median of "
          f"{args.repeats}")
    print("| part | s / image | images / s |")
    print("| --- | --- | --- |")
    for name, t in (("network (multi-scale + flip)", t_net), (f"CRF ({args.crf})", t_crf),
                    ("total", t_net + t_crf)):
        print(f"| {name} | {t / n:.4f} | {n / t:.2f} |" if t > 0 else f"| {name} | 0 | - |")
    flops = network_flops(args.arch, args.backbone, args.num_classes, args.output_stride, H, W, scales, flip)
    print(f"network FLOPs per image over the scales and flips: {flops / 1e12:.3g} TFLOP; reached "
          f"{flops * n / t_net / 1e12:.3g} TFLOP/s{' (NHWC)' if args.channels_last else ''}; 100 images/s would "
          f"need {100 * flops / 1e12:.3g} TFLOP/s for the network alone")
    if args.crf != "none":
        print(f"classes per image's CRF (reaching {CLASS_THRESHOLD}): {min(kept)}..{max(kept)} of "
              f"{args.num_classes + 1}")
    if dev.type == "cuda":
        print(f"peak GPU memory: {torch.cuda.max_memory_allocated(dev) / 2 ** 30:.2f} GiB")


if __name__ == "__main__":
    main()
