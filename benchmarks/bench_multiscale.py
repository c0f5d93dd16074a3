"""Time and memory of DHR's multi-scale inference, per scale and whole, for a STEGO-shaped model.

The model is STEGO's (a DINO ViT with random weights plus random cluster1/cluster2 heads to 70
dims, :meth:`STEGOExtractor.code`): ViT-B/8 (width 768, depth 12, 12 heads; DHR's backbone) or
ViT-S/8 (``--arch s8``, width 384, 6 heads, for a quick CPU run). The image is one normalised
500x375 (W x H) image, a VOC landscape size. Rows:

* one per scale (0.5, 1.0, 1.5, 2.0): ``multiscale(code, image, (scale,), flip=True)``: the
  resize to ``scaled_size`` (int(side * scale) rounded up to the patch), the batch of 2 (image +
  flip) through the model, the flip back and the average;
* DHR's whole inference: ``multiscale(code, image, DHR_SCALES)``, scales 2.0, 1.0, 1.5, 0.5.

With ``--batches 1,8``, a second table: DHR's whole inference on B same-size images at once
(:func:`multiscale_batch`, what ``mars features --dhr --batch-size B`` runs on a batch: one network
call per scale for the B images and their mirrors), images/s and the TFLOP/s it reaches by
:func:`vit_flops` (the count per image: every matrix product of the 12 blocks, attention's
N^2 terms included, times 2 for the flip). On CUDA the script first runs one block's attention
restricted to the fused kernels (flash for fp16, memory-efficient for fp32) and says whether
they took it: a layout or mask that forced the math kernel would fail there.

Time: median [min-max] of ``--repeats`` runs after a warm-up (CUDA: one run of the same row,
synchronised; CPU: one 224x224 batch of 2, enough to start torch's thread pool without doubling
the minutes a CPU run takes). Memory: CUDA ``torch.cuda.max_memory_allocated`` during the row
minus what was allocated before it (the weights); CPU: growth of the process's peak resident set
(``resource.getrusage(...).ru_maxrss``, a high-water mark) over its value after the model was
built and warmed up, with the rows run smallest first so that each one's peak shows (the whole
inference row then shows the largest peak so far, not its own: its peak is that of its 2.0 scale
plus the small sums).

    python benchmarks/bench_multiscale.py [--model stego|dinov2|cause] [--device cpu|cuda] [--arch b8|s8|s14|b14|l14|g14] [--repeats 3]
                                          [--size 500x375] [--fp16] [--batches 1,8]
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

from mars_plugin.adapters.uss.multiscale import DHR_SCALES, multiscale, multiscale_batch, scaled_size  # noqa: E402
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


def vit_flops(height: int, width: int, width_d: int, depth: int, patch: int, scales=DHR_SCALES, flip: bool = True,
              mlp_ratio: int = 4):
    """Floating-point operations (2 per multiply-add) of a ViT's forward over DHR's inference of one
    ``height`` x ``width`` image: per scale, N = tokens + [CLS]; per block 2N(3D^2 + D^2 + 2 r D^2)
    for qkv, proj and the MLP, plus 4 N^2 D for q k^T and the weighted sum of v; plus the patch
    embedding; times 2 with the flip. The heads, softmax, norms and resizes are left out (under 1%).
    Returns (total, [(scale, (h, w), N, linear, attention)])."""
    total, rows = 0, []
    for s in scales:
        sh, sw = scaled_size(height, width, s, patch)
        n = (sh // patch) * (sw // patch) + 1
        lin = depth * 2 * n * (4 + 2 * mlp_ratio) * width_d ** 2
        att = depth * 4 * n * n * width_d
        emb = 2 * (n - 1) * 3 * patch * patch * width_d
        k = 2 if flip else 1
        rows.append((s, (sh, sw), n, k * lin, k * att))
        total += k * (lin + att + emb)
    return total, rows


def _vit_of(model: nn.Module) -> DinoViT:
    """The extractor's ViT (STEGO's ``model``, CAUSE's ``backbone``, ...)."""
    return next(m for m in model.modules() if isinstance(m, DinoViT))


def check_fused_attention(model: nn.Module, device: torch.device, fp16: bool) -> str:
    """One attention call of the first block restricted to the fused kernel (flash for fp16,
    memory-efficient for fp32): the kernel's name if it ran, else why not."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = SDPBackend.FLASH_ATTENTION if fp16 else SDPBackend.EFFICIENT_ATTENTION
    vit = _vit_of(model)
    blocks = vit.blocks
    x = torch.randn(2, 1 + 47 * 63, vit.embed_dim, device=device)
    try:
        with torch.inference_mode(), torch.autocast(device.type, dtype=torch.float16, enabled=fp16), \
                sdpa_kernel([backend]):
            blocks[0].attn(x)
        return f"{backend.name} took the attention"
    except RuntimeError as e:
        return f"{backend.name} refused it: {str(e).splitlines()[0]}"


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
    ap.add_argument("--batches", default="", help="comma-separated batch sizes for the batched table, e.g. 1,8")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    try:
        W, H = (int(v) for v in args.size.lower().split("x"))
    except ValueError:
        ap.error(f"--size must be WxH, got {args.size!r}")
    try:
        batches = [int(b) for b in args.batches.split(",") if b.strip()]
    except ValueError:
        ap.error(f"--batches must be comma-separated integers such as 1,8, got {args.batches!r}")
    if any(b < 1 for b in batches):
        ap.error(f"--batches must be integers >= 1, got {args.batches!r}")
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
    if batches:
        batched_table(model, device, batches, H, W, args, ctx, PATCH, rss0)


def batched_table(model, device, batches, H, W, args, ctx, patch, rss0) -> None:
    """DHR's whole inference on B same-size images in one multiscale_batch call: images/s, TFLOP/s."""
    vit = _vit_of(model)
    flops, per_scale = vit_flops(H, W, vit.embed_dim, vit.depth, patch)
    print()
    print(f"ViT forward FLOPs per image (DHR scales + flip, {W}x{H}): {flops / 1e12:.3g} TFLOP ("
          + "; ".join(f"scale {s:g}: {n:,} tokens, linear {lin / 1e12:.3g} + attention {att / 1e12:.3g}"
                      for s, _, n, lin, att in per_scale) + ")")
    if device.type == "cuda":
        print(f"fused attention check: {check_fused_attention(model, device, args.fp16)}")
    print()
    print("| batch | s per batch, median [min-max] | images/s | TFLOP/s | peak MB |")
    print("| --- | --- | --- | --- | --- |")
    g = torch.Generator().manual_seed(1)
    for b in batches:
        images = normalize_imagenet(torch.rand(b, 3, H, W, generator=g)).to(device)

        def run():
            with torch.inference_mode(), ctx:
                return multiscale_batch(model.code, images, DHR_SCALES, flip=True, patch=patch)

        med, lo, hi, mem = measure(run, device, args.repeats, True, rss0)
        print(f"| {b} | {med:.3g} [{lo:.3g}-{hi:.3g}] | {b / med:.1f} | {b * flops / med / 1e12:.3g} | {mem:,.0f} |",
              flush=True)


if __name__ == "__main__":
    main()
