"""``report.html``'s cost (issue 43): ``mars report`` (``report_job``) on synthetic folders of 1,000
and 10,000 images, 64x48 pixels, three classes, a random share of class 1 marked biased; the
seconds per image of the whole job (counting, the charts, the thumbnails, the page), of the
thumbnails alone, and the folder's size: ``report.html``, ``report_data.js``, ``thumbs/``.

The machine is shared: the load before and after is printed with the rows.

    python benchmarks/bench_html_report.py [--images 1000 10000] [--io-workers 0 2]
"""
import argparse
import os
import shutil
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _machine import machine_line  # noqa: E402


def make_folder(root: str, n: int, h: int = 48, w: int = 64) -> None:
    """``root/{labels,debiased,images}``: n images with three class boxes, some of class 1 biased."""
    from mars_plugin.formats.files import write_image, write_label

    g = torch.Generator().manual_seed(0)
    for i in range(n):
        y = torch.zeros(h, w, dtype=torch.long)
        y[4:40, 2:20], y[4:40, 22:40], y[4:40, 42:62] = 1, 2, 3
        d = y.clone()
        d[4:4 + int(torch.randint(0, 36, (1,), generator=g)), 2:20] = -1
        stem = f"img_{i:06d}"
        write_label(os.path.join(root, "labels", f"{stem}.png"), y)
        write_label(os.path.join(root, "debiased", f"{stem}.png"), d)
        write_image(os.path.join(root, "images", f"{stem}.png"),
                    torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8))


def folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def run(n: int, io_workers: int, tmp: str) -> str:
    from mars_plugin.commands import report_html
    from mars_plugin.commands.report import report_job

    root, out = os.path.join(tmp, f"in{n}"), os.path.join(tmp, f"out{n}_{io_workers}")
    if not os.path.isdir(root):
        make_folder(root, n)
    spent = {"thumbs": 0.0}
    write = report_html.write_report_thumbnails

    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return write(*a, **k)
        finally:
            spent["thumbs"] += time.perf_counter() - t

    report_html.write_report_thumbnails = timed
    try:
        t0 = time.perf_counter()
        report_job(os.path.join(root, "labels"), os.path.join(root, "debiased"), os.path.join(root, "images"), out,
                   class_names=["background", "boat", "train", "bird"], progress=False,
                   html=report_html.HtmlExtras(io_workers=io_workers))
        total = time.perf_counter() - t0
    finally:
        report_html.write_report_thumbnails = write
    page, data = (os.path.getsize(os.path.join(out, f)) for f in ("report.html", "report_data.js"))
    thumbs = folder_bytes(os.path.join(out, "thumbs"))
    row = (f"| {n:,} | {io_workers} | {total:.1f} | {1000 * total / n:.2f} | {1000 * spent['thumbs'] / n:.2f} | "
           f"{page / 1024:.1f} KB | {data / 1024:.0f} KB | {thumbs / 2**20:.1f} MB | {folder_bytes(out) / 2**20:.1f} MB |")
    shutil.rmtree(out)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, nargs="+", default=[1000, 10000])
    p.add_argument("--io-workers", type=int, nargs="+", default=[0, 2])
    a = p.parse_args()
    print(machine_line(), f"load before: {os.getloadavg()[0]:.1f}")
    print("| images | io workers | job s | ms/image (job) | ms/image (thumbnails) | report.html | report_data.js "
          "| thumbs/ | folder |")
    print("|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for n in a.images:
            for w in a.io_workers:
                print(run(n, w, tmp), flush=True)
    print(f"load after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
