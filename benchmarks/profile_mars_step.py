"""Where the time of one MARS training step goes (GPU): the student's forward + backward, the
teacher's forward, the complement's preparation, the dense CRF on the teacher (its lattice
builds and its mean field), the WCE; then torch.profiler's top operations of the CRF call.

    python benchmarks/profile_mars_step.py [--batch 16 --size 512 --labels 4] [--device cuda]
"""
import argparse
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _machine import machine_line  # noqa: E402
from bench_crf import natural_image  # noqa: E402

from mars_plugin.method.complement import complement_labels  # noqa: E402
from mars_plugin.engines.crf import dense_crf  # noqa: E402
from mars_plugin.engines.crf_params import CRF_PRESETS  # noqa: E402
from mars_plugin.networks.deeplab import build_model  # noqa: E402
from mars_plugin.networks.seg_data import normalize  # noqa: E402


def timed(fn, dev, reps=5):
    out = fn()
    ts = []
    for _ in range(reps):
        if dev == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        if dev == "cuda":
            torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts)), out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--labels", type=int, default=4, help="labels each image allows (background + classes)")
    ap.add_argument("--backbone", default="resnet101")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    dev, B, S, C = args.device, args.batch, args.size, 20
    print(machine_line(dev))
    torch.manual_seed(0)
    net = build_model("deeplabv3+", args.backbone, C).to(dev)
    teacher = build_model("deeplabv3+", args.backbone, C).to(dev).eval()
    rgb = torch.stack([torch.from_numpy(natural_image(S, S, b)) for b in range(B)]).to(dev)
    x = normalize(rgb)
    y = torch.randint(0, 3, (B, S, S), device=dev)
    y[torch.rand(B, S, S, device=dev) < 0.2] = -1
    classes = torch.zeros(B, C, dtype=torch.bool)
    for b in range(B):
        classes[b, torch.randperm(C)[: args.labels - 1]] = True
    amp = dict(device_type=dev, dtype=torch.bfloat16, enabled=dev == "cuda")
    rows = []

    def student():
        with torch.autocast(**amp):
            out = net(x)
        loss = torch.nn.functional.cross_entropy(out.float(), y.clamp_min(0))
        loss.backward()
        return out

    rows.append(("student forward + backward (CE)",) + (timed(student, dev)[0],))

    def teach():
        with torch.no_grad(), torch.autocast(**amp):
            return teacher(x)

    t, t_logits = timed(teach, dev)
    rows.append(("teacher forward", t))
    probs = t_logits.float().softmax(1)
    rows.append(("complement, argmax teacher", timed(lambda: complement_labels(y, probs, classes), dev)[0]))
    rows.append(("complement, CRF teacher", timed(lambda: complement_labels(y, probs, classes, refine="crf", image=rgb),
                                                  dev)[0]))
    L = args.labels
    p = probs[:, :L].double() + 1e-3  # a random teacher can put all mass outside these labels
    p = p / p.sum(1, keepdim=True)
    rows.append((f"dense_crf alone, {B} x {S}x{S}, {L} labels, float64 input",
                 timed(lambda: dense_crf(p, rgb, CRF_PRESETS["mars"]), dev)[0]))
    pf = p.float()
    rows.append(("dense_crf alone, float32 input", timed(lambda: dense_crf(pf, rgb, CRF_PRESETS["mars"]), dev)[0]))
    rows.append(("dense_crf, 5 iterations", timed(lambda: dense_crf(pf, rgb, dict(CRF_PRESETS["mars"], iterations=5)),
                                                   dev)[0]))
    # The CRF's two parts: building the two lattices (the position lattice is kept between calls
    # when small; cleared here, as a training batch of 16 x 512 x 512 is past the kept size) and
    # the mean field's iterations (the total minus the builds).
    from mars_plugin.engines.crf_lattices import (_features, _gaussian_lattice, _lattice, _segments,
                                                  clear_lattice_cache)

    prm = CRF_PRESETS["mars"]
    shapes = tuple((S, S) for _ in range(B))
    seg = _segments([S * S] * B, torch.device(dev))
    rgbs = list(rgb)

    def builds():
        clear_lattice_cache()
        _gaussian_lattice(shapes, prm["gaussian_sxy"], torch.device(dev))
        return _lattice(_features(shapes, prm["bilateral_sxy"], rgbs, prm["bilateral_srgb"], torch.device(dev)), seg)

    t_build, bil = timed(builds, dev)
    rows.append((f"  the two torch lattice builds ({bil.num_lattice_points:,} bilateral points)", t_build))
    rows.append(("  one bilateral filter at L = %d" % L,
                 timed(lambda: bil.filter(torch.rand(B * S * S, L, device=dev)), dev)[0]))
    half = torch.nn.functional.interpolate(pf, scale_factor=0.5, mode="bilinear", align_corners=False)
    rgb_half = torch.nn.functional.interpolate(rgb.permute(0, 3, 1, 2).float(), scale_factor=0.5, mode="bilinear",
                                               align_corners=False).round().clamp(0, 255).byte().permute(0, 2, 3, 1)
    rows.append((f"dense_crf at half size ({S // 2}x{S // 2})",
                 timed(lambda: dense_crf(half, rgb_half.contiguous(), CRF_PRESETS["mars"]), dev)[0]))
    print("| part | s (median of 5) |")
    print("| --- | --- |")
    for name, t in rows:
        print(f"| {name} | {t:.4f} |")
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
    with profile(activities=acts) as prof:
        dense_crf(pf, rgb, CRF_PRESETS["mars"])
        if dev == "cuda":
            torch.cuda.synchronize()
    key = "cuda_time_total" if dev == "cuda" else "cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=50))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=12, max_name_column_width=50))


if __name__ == "__main__":
    main()
