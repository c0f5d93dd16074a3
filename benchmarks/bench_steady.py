"""Wall time of `mars` commands when other processes share the cores, per OpenMP wait setting.

Each command runs in a fresh process (`python -m mars_plugin.cli ...`, as a user runs it; torch's
import and the data reading are inside the clock), on generated data in a temporary folder:

* ``demo``: ``mars demo --num-train 64 --num-val 16 --epochs 3 --size 32 --no-world`` (training
  of a small network: many small torch operations);
* ``debias``: ``mars debias`` of --images 500x375 images (the dense CRF, default backend), and
  ``debias-pydensecrf``: the same with ``--crf-backend pydensecrf`` (the reference);
* ``centroids``: ``mars centroids`` (the compiled K-means when numba is there) and
  ``centroids-torch``: the same with ``--backend torch`` (the batched torch K-means).

Settings (the environment of the command):

* ``default``: what `mars` does (OMP_WAIT_POLICY=PASSIVE unless the user set OMP_WAIT_POLICY or
  GOMP_SPINCOUNT);
* ``spin300k``: GOMP_SPINCOUNT=300000, libgomp's own default (`mars` before it set the policy);
* ``spin10k``: GOMP_SPINCOUNT=10000 (spin about 0.1 ms, then sleep);
* ``threads1``: ``--threads 1``.

Load: --busy N starts N processes running ``while 1: pass`` for the measurements of that level
(0 = only what else runs on the machine); the load average is printed with every row. Rounds
interleave everything (round, then busy level, then command, then setting), so that the
machine's own load hits every setting alike; the ratio is each run over the ``spin300k`` run of
the same round, command and level, median [range].

    python benchmarks/bench_steady.py [--busy 0,1] [--rounds 3] [--commands demo,debias,...]
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

SETTINGS = {
    "default": ({}, []),
    "spin300k": ({"GOMP_SPINCOUNT": "300000"}, []),
    "spin10k": ({"GOMP_SPINCOUNT": "10000"}, []),
    "threads1": ({}, ["--threads", "1"]),
}


def busy_processes(n: int):
    """n CPU-bound processes (kill them with stop_busy)."""
    return [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(n)]


def stop_busy(procs) -> None:
    for p in procs:
        p.kill()
        p.wait()


def command_env(extra=None):
    """The environment of a measured command: this checkout first on PYTHONPATH, and no
    OpenMP wait variable of the caller's (each setting brings its own)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])
    env.update(extra or {})
    return env


def make_data(root: str, images: int) -> None:
    from bench_debias import make_folder

    make_folder(root, images)


def commands(root: str):
    out = os.path.join(root, "out")
    data = ["--features", os.path.join(root, "features"), "--labels", os.path.join(root, "labels")]
    v = os.path.join(root, "V.pt")
    return {
        "demo": ["demo", "--num-train", "64", "--num-val", "16", "--epochs", "3", "--size", "32", "--no-world",
                 "--out", out],
        "debias": ["debias", *data, "--centroids", v, "--images", os.path.join(root, "images"), "--out", out,
                   "--no-progress"],
        "debias-pydensecrf": ["debias", *data, "--centroids", v, "--images", os.path.join(root, "images"), "--out",
                              out, "--no-progress", "--crf-backend", "pydensecrf"],
        "centroids": ["centroids", *data, "--num-classes", "4", "--out", os.path.join(out, "V.pt"), "--no-progress"],
        "centroids-torch": ["centroids", *data, "--num-classes", "4", "--out", os.path.join(out, "V.pt"),
                            "--no-progress", "--backend", "torch"],
    }


def run_once(args, env, out_dir: str) -> float:
    shutil.rmtree(out_dir, ignore_errors=True)
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "mars_plugin.cli", *args], env=env, capture_output=True, text=True,
                       cwd=os.path.dirname(out_dir))  # PYTHONPATH decides which checkout runs
    dt = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"mars {' '.join(args)} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return dt


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--busy", default="0,1", help="levels: busy processes started for the measurements")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--images", type=int, default=8, help="images of the debias and centroids commands")
    ap.add_argument("--commands", default="demo,debias,debias-pydensecrf,centroids,centroids-torch")
    ap.add_argument("--settings", default="default,spin300k,spin10k,threads1")
    args = ap.parse_args()
    levels = [int(x) for x in args.busy.split(",")]
    names = args.commands.split(",")
    settings = args.settings.split(",")
    from _machine import machine_line

    print(machine_line("cpu"))
    with tempfile.TemporaryDirectory() as root:
        make_data(root, args.images)
        env0 = command_env()
        subprocess.run([sys.executable, "-m", "mars_plugin.cli", "centroids", "--features",
                        os.path.join(root, "features"), "--labels", os.path.join(root, "labels"), "--num-classes", "4",
                        "--out", os.path.join(root, "V.pt"), "--no-progress"], env=env0, check=True,
                       capture_output=True)
        cmds = commands(root)
        for name in names:  # warm-up: numba's cache, the file system
            run_once(cmds[name], env0, os.path.join(root, "out"))
        times = {}
        loads = {}
        for r in range(args.rounds):
            for level in levels:
                procs = busy_processes(level)
                try:
                    time.sleep(1.0)
                    for name in names:
                        for s in settings:
                            extra, flags = SETTINGS[s]
                            dt = run_once(cmds[name] + flags, command_env(extra), os.path.join(root, "out"))
                            times.setdefault((name, level, s), []).append(dt)
                            loads.setdefault((name, level), []).append(os.getloadavg()[0])
                finally:
                    stop_busy(procs)
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    base = "spin300k" if "spin300k" in settings else settings[0]
    print(f"{args.rounds} rounds; s: median [min-max] wall seconds of the whole command; ratio: over {base} in the "
          "same round, median [range]; load: 1-minute load average while measuring")
    print("| command | busy processes | load | setting | s | ratio to " + base + " |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in names:
        for level in levels:
            ld = loads[(name, level)]
            for s in settings:
                t = np.array(times[(name, level, s)])
                ratio = t / np.array(times[(name, level, base)])
                print(f"| {name} | {level} | {min(ld):.1f}-{max(ld):.1f} | {s} | {np.median(t):.2f} [{t.min():.2f}-"
                      f"{t.max():.2f}] | {np.median(ratio):.2f} [{ratio.min():.2f}-{ratio.max():.2f}] |", flush=True)


if __name__ == "__main__":
    main()
