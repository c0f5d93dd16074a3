"""Time and memory of DHR's multi-scale inference, per scale and whole, for a STEGO-shaped model.

The model is STEGO's (a DINO ViT with random weights plus random cluster1/cluster2 heads to 70
dims, :meth:`STEGOExtractor.code`): ViT-B/8 (width 768, depth 12, 12 heads; DHR's backbone) or
ViT-S/8 (``--arch s8``, width 384, 6 heads, for a quick CPU run). The image is one normalised
500x375 (W x H) image, a VOC landscape size. Rows:

* one per scale (0.5, 1.0, 1.5, 2.0): ``multiscale(code, image, (scale,), flip=True)``: the
  resize to ``scaled_size`` (int(side * scale) rounded up to the patch), the batch of 2 (image +
  flip) through the model, the flip back and the average;
* DHR's whole inference: ``multiscale(code, image, DHR_SCALES)``, scales 2.0, 1.0, 1.5, 0.5.

Time: median [min-max] of ``--repeats`` runs after a warm-up (CUDA: one run of the same row,
synchronised; CPU: one 224x224 batch of 2, enough to start torch's thread pool without doubling
the minutes a CPU run takes). Memory: CUDA ``torch.cuda.max_memory_allocated`` during the row
minus what was allocated before it (the weights); CPU: growth of the process's peak resident set
(``resource.getrusage(...).ru_maxrss``, a high-water mark) over its value after the model was
built and warmed up, with the rows run smallest first so that each one's peak shows (the whole
inference row then shows the largest peak so far, not its own: its peak is that of its 2.0 scale
plus the small sums).

    python benchmarks/bench_multiscale.py [--model stego|dinov2|cause] [--device cpu|cuda] [--arch b8|s8|s14|b14|l14|g14] [--repeats 3]
                                          [--size 500x375] [--fp16]
"""
import argparse
import os
import resource
import statistics
import sys
import time

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _machine import machine_line  # noqa: E402

from mars_plugin.adapters.uss.multiscale import DHR_SCALES, multiscale, scaled_size  # noqa: E402
from mars_plugin.adapters.uss.stego import STEGOExtractor  # noqa: E402
from mars_plugin.adapters.uss.preprocess import normalize_imagenet  # noqa: E402
from mars_plugin.adapters.uss.vit import DinoViT  # noqa: E402


#: --model: (architectures {name: (width, depth, heads)}, patch). STEGO is DHR's ViT-B/8 + 70-d
#: heads; DINOv2 the plain tokens; CAUSE DINOv2 + the decoder to 90 dims with a 2048-row codebook.
#: g14 is DINOv2 ViT-g (SwiGLU MLP, 40 blocks), the backbone DHR's produce_uss_features.py defaults to.
MODELS = {
    "stego": ({"b8": (768, 12, 12), "s8": (384, 12, 6)}, 8),
    "dinov2": ({"s14": (384, 12, 6), "b14": (768, 12, 12), "l14": (1024, 24, 16), "g14": (1536, 40, 24)}, 14),
    "cause": ({"s14": (384, 12, 6), "b14": (768, 12, 12), "l14": (1024, 24, 16), "g14": (1536, 40, 24)}, 14),
}
DIM = 70  # DHR's STEGO code: 70 dims (core/uss/models.py:40)
CODEBOOK = 2048
ROW_SCALES = (0.5, 1.0, 1.5, 2.0)


def _random_(module: nn.Module) -> nn.Module:
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.02)
    return module


def build(model: str, arch: str, device: torch.device) -> nn.Module:
    """A random-weight extractor with a ``code(x)`` of the model's real size."""
    archs, patch = MODELS[model]
    width, depth, heads = archs[arch]
    torch.manual_seed(0)
    if model == "stego":
        vit = _random_(DinoViT(patch, width, depth, heads, num_patches=(224 // patch) ** 2))
        c1 = nn.Sequential(nn.Conv2d(width, DIM, 1))
        c2 = nn.Sequential(nn.Conv2d(width, width, 1), nn.ReLU(), nn.Conv2d(width, DIM, 1))
        return STEGOExtractor(vit, c1, c2).to(device).eval()
    vit = _random_(DinoViT(patch, width, depth, heads, num_patches=37 * 37, layer_scale=True, mask_token=True,
                           ffn="swiglu" if arch == "g14" else "mlp"))
    if model == "dinov2":
        from mars_plugin.adapters.uss.dinov2 import DINOv2Extractor

        return DINOv2Extractor(vit).to(device).eval()
    from mars_plugin.adapters.uss.cause import CAUSEExtractor
    from mars_plugin.adapters.uss.cause_decoder import CAUSESegment

    seg = _random_(CAUSESegment(width))
    return CAUSEExtractor(vit, seg, torch.randn(CODEBOOK, width)).to(device).eval()


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(run, device: torch.device, repeats: int, warm_up: bool, rss0: float):
    """(median s, min s, max s, peak MB) of ``run()``."""
    if warm_up:
        run()
        sync(device)
    if device.type == "cuda":
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        run()
        sync(device)
        times.append(time.perf_counter() - t)
    if device.type == "cuda":
        mem = (torch.cuda.max_memory_allocated(device) - base) / 2**20
    else:
        mem = peak_rss_mb() - rss0
    return statistics.median(times), min(times), max(times), mem


def _loadavg() -> str:
    try:
        with open("/proc/loadavg") as fh:
            return fh.read().strip()
    except OSError:
        return "n/a"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--model", choices=sorted(MODELS), default="stego",
                    help="stego (DINO ViT-B/8 + heads, DHR's STEGO), dinov2 (plain tokens) or cause (DINOv2 + decoder)")
    ap.add_argument("--arch", default=None,
                    help="stego: b8 (default) or s8; dinov2/cause: s14, b14 (default), l14 or g14")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--size", default="500x375", help="image W x H")
    ap.add_argument("--fp16", action="store_true", help="float16 autocast (CUDA)")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    try:
        W, H = (int(v) for v in args.size.lower().split("x"))
    except ValueError:
        ap.error(f"--size must be WxH, got {args.size!r}")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA GPU")

    archs, PATCH = MODELS[args.model]
    arch = args.arch or ("b8" if args.model == "stego" else "b14")
    if arch not in archs:
        ap.error(f"--arch for --model {args.model} must be one of {sorted(archs)}, got {arch!r}")
    load_before = _loadavg()
    model = build(args.model, arch, device)
    g = torch.Generator().manual_seed(0)
    image = normalize_imagenet(torch.rand(1, 3, H, W, generator=g))[0].to(device)
    ctx = torch.autocast(device.type, dtype=torch.float16, enabled=args.fp16)

    def runner(scales):
        def run():
            with torch.inference_mode(), ctx:
                return multiscale(model.code, image, scales, flip=True, patch=PATCH)
        return run

    if device.type == "cpu":  # one small batch starts the thread pool; the rows then skip their warm-up
        with torch.inference_mode():
            model.code(torch.zeros(2, 3, 224, 224))
    rss0 = peak_rss_mb()
    weights_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    started = time.perf_counter()

    rows = []
    for s in ROW_SCALES:
        sh, sw = scaled_size(H, W, s, PATCH)
        tokens = (sh // PATCH) * (sw // PATCH)
        med, lo, hi, mem = measure(runner((s,)), device, args.repeats, device.type == "cuda", rss0)
        rows.append((f"{s:g}", f"{sh} x {sw}", 2, f"{tokens:,}", med, lo, hi, mem))
    med, lo, hi, mem = measure(runner(DHR_SCALES), device, args.repeats, device.type == "cuda", rss0)
    total = sum((scaled_size(H, W, s, PATCH)[0] // PATCH) * (scaled_size(H, W, s, PATCH)[1] // PATCH)
                for s in DHR_SCALES)
    rows.append(("DHR " + ", ".join(f"{s:g}" for s in DHR_SCALES), "all four", "4 x 2", f"{total:,} (sum)",
                 med, lo, hi, mem))

    print(machine_line(args.device))
    print(f"/proc/loadavg before: {load_before}; after: {_loadavg()}")
    print(f"model: {model.describe()} (random weights); image {W}x{H}; {'fp16 autocast' if args.fp16 else 'fp32'}; "
          f"weights {weights_mb:.0f} MB; repeats {args.repeats}; whole script {time.perf_counter() - started:.0f} s")
    mem_name = "peak CUDA MB above weights" if device.type == "cuda" else "peak RSS growth MB"
    print()
    print(f"| scale | input H x W | batch | tokens per image | time s, median [min-max] | {mem_name} |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, size, batch, tokens, med, lo, hi, mem in rows:
        print(f"| {name} | {size} | {batch} | {tokens} | {med:.3g} [{lo:.3g}-{hi:.3g}] | {mem:,.0f} |")


if __name__ == "__main__":
    main()
