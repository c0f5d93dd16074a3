"""One segmentation training step with plain CE vs with MARS (complement + WCE + EMA update).

A small DeepLab-like network (the demo's TinySegNet at width 64) on a batch of --batch images
of --size x --size (generated natural-looking RGB, bench_crf.natural_image); times the median
of --steps steps after 2 warm-up steps, and the ratio to plain CE: MARS with the argmax teacher,
with the teacher refined by the dense CRF (refine="crf", batched on the device) and by the
windowed local CRF; with --reference also by pydensecrf (CPU, one image at a time).

    python benchmarks/bench_train_step.py [--steps 5] [--batch 16 --size 512] [--device cuda]
"""
import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _machine import machine_line  # noqa: E402
from bench_crf import natural_image  # noqa: E402

from mars_plugin.adapters.training_hook import MARSTrainingHook  # noqa: E402
from mars_plugin.commands.demo import TinySegNet  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--size", type=int, default=320)
    ap.add_argument("--classes", type=int, default=20)
    ap.add_argument("--reference", action="store_true", help="also time the pydensecrf-refined teacher (slow)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    dev = args.device
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch, 3, args.size, args.size, generator=g).to(dev)
    y = torch.randint(0, args.classes + 1, (args.batch, args.size, args.size), generator=g)
    y[torch.rand(y.shape, generator=g) < 0.2] = 254  # biased pixels
    y = y.to(dev)
    classes = torch.rand(args.batch, args.classes, generator=g) < 0.15
    classes[:, 0] = True
    rgb = torch.stack([torch.from_numpy(natural_image(args.size, args.size, b)) for b in range(args.batch)]).to(dev)

    def run(kind):
        torch.manual_seed(0)
        net = TinySegNet(args.classes + 1, width=64).to(dev)
        opt = torch.optim.SGD(net.parameters(), lr=1e-3, momentum=0.9)
        refine = {"mars+crf": "crf", "mars+crf (pydensecrf)": "crf", "mars+local_crf": "local_crf"}.get(kind)
        backend = "pydensecrf" if "pydensecrf" in kind else "torch"
        hook = MARSTrainingHook(net, refine=refine, crf_backend=backend) if kind != "plain" else None
        img = rgb
        target = torch.where(y == 254, torch.zeros_like(y), y)
        times = []
        for step in range(args.steps + 2):
            if dev == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            logits = net(x)
            if hook is None:
                loss = F.cross_entropy(logits, target, ignore_index=255)
            else:
                loss = hook(x, logits, y, classes.to(dev), images_rgb=img if refine else None)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if hook is not None:
                hook.update(net)
            if dev == "cuda":
                torch.cuda.synchronize()
            if step >= 2:
                times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2]

    print(machine_line(dev))
    print(f"batch {args.batch} x 3 x {args.size} x {args.size}, {args.classes + 1} classes, TinySegNet width 64")
    base = run("plain")
    print("| step | s/step | ratio to plain CE |")
    print("| --- | --- | --- |")
    print(f"| plain CE | {base:.4f} | 1.00 |")
    kinds = ["mars", "mars+crf", "mars+local_crf"] + (["mars+crf (pydensecrf)"] if args.reference else [])
    for k in kinds:
        t = run(k)
        print(f"| {k} (teacher fwd + complement + WCE + EMA) | {t:.4f} | {t / base:.2f} |", flush=True)


if __name__ == "__main__":
    main()
