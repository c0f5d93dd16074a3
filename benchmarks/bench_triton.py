"""The permutohedral lattice's filter, torch vs the Triton kernels
(mars_plugin/engines/permutohedral_triton.py), on the dense CRF's own lattices of a batch of
natural images (position d=2 and bilateral d=5, preset mars, normalised as the CRF uses them),
``filter(q, add_to=energy, scale=compat)`` as the mean field calls it; and the dense CRF of the
whole batch both ways (10 iterations). On CUDA it also checks that the compiled kernels give the
torch CPU filter's bits on small lattices (as the tests check it under the interpreter).

    python benchmarks/bench_triton.py [--device cuda] [--batch 16] [--size 512x512] [--repeats 10]
    python benchmarks/bench_triton.py --smoke   # CPU, Triton's interpreter, tiny sizes: equality only

Times are the median of ``--repeats`` calls after a warm-up (kernels compiled), synchronised.
``--smoke`` checks that both paths run and agree; the interpreter's times say nothing about a GPU,
so it prints none.
"""
import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def _timed(fn, dev, repeats):
    import torch

    def sync():
        if dev == "cuda":
            torch.cuda.synchronize()
    fn()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _cpu_bits(make_image_fn, device, shapes=((48, 64), (40, 56))):
    """The Triton kernels on ``device`` (on a GPU: compiled) against the torch CPU filter on the
    same lattices (the dense CRF's of two images, built on the CPU and moved): the bit-equality
    the CPU tests check under Triton's interpreter, here with the compiled kernels."""
    import copy

    import torch

    import mars_plugin.engines.permutohedral as perm
    from mars_plugin.engines import crf_lattices

    cpu = torch.device("cpu")
    sizes = [H * W for H, W in shapes]
    rgbs = [torch.from_numpy(make_image_fn(H, W, s)) for s, (H, W) in enumerate(shapes)]
    seg = crf_lattices._segments(sizes, cpu)
    print(f"\nTriton on {device} vs torch on the CPU, the same lattices (2 images {shapes[0][1]}x{shapes[0][0]} and "
          f"{shapes[1][1]}x{shapes[1][0]} built on the CPU), filter(q, add_to, scale=10)")
    print("| kernel | labels | same bits | max abs diff |")
    print("| --- | --- | --- | --- |")
    for name, feats in (("position", crf_lattices._features(shapes, 3.0, None, 1.0, cpu)),
                        ("bilateral", crf_lattices._features(shapes, 80.0, rgbs, 13.0, cpu))):
        lat = crf_lattices._lattice(feats, seg)
        gpu = copy.copy(lat)
        gpu._splat, gpu._slice = lat._splat.to(device), lat._slice.to(device)
        gpu._blur = [(a.to(device), b.to(device)) for a, b in lat._blur]
        for L in (1, 4, 21, 81):
            g = torch.Generator().manual_seed(L)
            q, base = torch.softmax(torch.randn(sum(sizes), L, generator=g), 1), torch.randn(sum(sizes), L, generator=g)
            perm.USE_TRITON = False
            want = lat.filter(q, add_to=base.clone(), scale=10.0)
            perm.USE_TRITON = True
            got = gpu.filter(q.to(device), add_to=base.to(device), scale=10.0).cpu()
            perm.USE_TRITON = None
            same = torch.equal(got.view(torch.int32), want.view(torch.int32))
            print(f"| {name} | {L} | {'yes' if same else 'no'} | {float((got - want).abs().max()):.2g} |", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--size", default="512x512", help="HxW")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--smoke", action="store_true", help="the CPU under TRITON_INTERPRET=1, 2 images 16x20")
    args = ap.parse_args(argv)
    if args.smoke:
        # Before the kernels are decorated (and run); the torch mean field, not numba's, so that
        # the CRF goes through the lattice filter on the CPU too.
        os.environ["TRITON_INTERPRET"] = "1"
        os.environ["MARS_NO_NUMBA"] = "1"
        args.device, args.batch, args.size, args.repeats = "cpu", 2, "16x20", 1
    import numpy as np
    import torch
    from bench_crf import natural_image, smooth_probs

    import mars_plugin.engines.permutohedral as perm
    from mars_plugin.engines import crf_lattices
    from mars_plugin.engines.crf import dense_crf
    from mars_plugin.engines.crf_params import CRF_PRESETS

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    dev = torch.device(args.device)
    H, W = (int(x) for x in args.size.split("x"))
    B = args.batch
    p = dict(CRF_PRESETS["mars"])
    imgs = [natural_image(H, W, s) for s in range(B)]
    shapes = ((H, W),) * B
    rgbs = [torch.from_numpy(i).to(dev) for i in imgs]
    segments = crf_lattices._segments([H * W] * B, dev)
    N = B * H * W
    kernels = [("position (d=2)", p["gaussian_compat"],
                crf_lattices._lattice(crf_lattices._features(shapes, p["gaussian_sxy"], None, 1.0, dev), segments)),
               ("bilateral (d=5)", p["bilateral_compat"],
                crf_lattices._lattice(crf_lattices._features(shapes, p["bilateral_sxy"], rgbs, p["bilateral_srgb"],
                                                             dev), segments))]
    timing = not args.smoke
    print(f"lattice filter on {dev}, {B} images {W}x{H} (N = {N:,}), filter(q, add_to, scale) as the mean field "
          f"calls it; {'median of %d calls' % args.repeats if timing else 'smoke: equality only, no times'}")
    print("| kernel | lattice points | labels | torch ms | Triton ms | torch / Triton | max abs diff | same bits |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, compat, lat in kernels:
        for L in (4, 21):
            q = torch.softmax(torch.randn(N, L, generator=torch.Generator().manual_seed(L)), 1).to(dev)
            base = torch.randn(N, L, generator=torch.Generator().manual_seed(L + 1)).to(dev)
            out, ms = {}, {}
            for on in (False, True):
                perm.USE_TRITON = on
                out[on] = lat.filter(q, add_to=base.clone(), scale=float(compat))
                if timing:
                    spare = base.clone()
                    ms[on] = 1e3 * _timed(lambda: lat.filter(q, add_to=spare, scale=float(compat)), args.device,
                                          args.repeats)
            perm.USE_TRITON = None
            diff = float((out[True] - out[False]).abs().max())
            same = bool(torch.equal(out[True].view(torch.int32), out[False].view(torch.int32)))
            t = (f"{ms[False]:.2f} | {ms[True]:.2f} | {ms[False] / ms[True]:.2f}x" if timing else "- | - | -")
            print(f"| {name} | {lat.num_lattice_points:,} | {L} | {t} | {diff:.2g} | {'yes' if same else 'no'} |",
                  flush=True)
            if args.smoke and not same:
                raise SystemExit("the Triton filter differs from the torch CPU filter: they must give the same bits")
    del kernels
    if timing:
        _cpu_bits(natural_image, dev)
    else:
        _cpu_bits(natural_image, dev, ((9, 12), (7, 10)))

    L = 4
    params = p if timing else dict(p, iterations=2)
    probs = torch.from_numpy(np.stack([smooth_probs(L, H, W, s) for s in range(B)])).to(dev)
    images = torch.from_numpy(np.stack(imgs)).to(dev)
    print(f"\ndense CRF, batch {B} of {W}x{H}, {L} labels, preset mars ({params['iterations']} iterations), on {dev}")
    print("| filter | s per batch | images/s | max abs diff of Q | same labels |")
    print("| --- | --- | --- | --- | --- |")
    res = {}
    for on in (False, True):
        perm.USE_TRITON = on
        crf_lattices.clear_lattice_cache()  # each path builds (and normalises) its own position lattice
        res[on] = dense_crf(probs, images, params)
        t = _timed(lambda: dense_crf(probs, images, params), args.device, max(1, args.repeats // 3)) if timing else None
        diff = float((res[on] - res[False]).abs().max())
        agree = float((res[on].argmax(1) == res[False].argmax(1)).float().mean())
        rate = f"{t:.3f} | {B / t:.1f}" if timing else "- | -"
        print(f"| {'Triton' if on else 'torch'} | {rate} | {diff:.2g} | {100 * agree:.3f} % |", flush=True)
    perm.USE_TRITON = None
    if args.smoke and not torch.equal(res[True].view(torch.int32), res[False].view(torch.int32)):
        raise SystemExit("the dense CRF with the Triton filter differs from the torch one on the CPU")
    return 0


if __name__ == "__main__":
    sys.exit(main())
