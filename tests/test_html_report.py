"""``report.html`` (issue 43) without a browser: the page's structure and CSP, its data file, the
escaping of hostile class names and stems, thumbnails at most THUMB_SIDE, atomic and repeatable
writes, the centroid ranking from the centroids file (and files written before it was stored)."""
from __future__ import annotations

import base64
import hashlib
import html
import json
import re

import numpy as np
import pytest
import torch

PIL_Image = pytest.importorskip("PIL.Image")

from mars_plugin.commands.report import report_job  # noqa: E402
from mars_plugin.commands.report_html import HtmlExtras  # noqa: E402
from mars_plugin.formats.files import write_image, write_label  # noqa: E402
from mars_plugin.method.selection import DebiasedCentroids, select_centroids  # noqa: E402
from mars_plugin.pictures import html_report  # noqa: E402
from mars_plugin.pictures.report_thumbnails import THUMB_SIDE  # noqa: E402

HOSTILE = "<img src=x onerror=alert(1)>"
QUOTED_STEM = "it's \"q\" <i onclick=x>q"
NAMES = ["background", HOSTILE, "boat", "bird"]


def make_folders(root, n=5, h=40, w=300, seed=0):
    """Labels with classes 1..3 (class c marked biased in a share growing with the image), an
    image wider than THUMB_SIDE, ground truth; stem 1 is :data:`QUOTED_STEM`."""
    g = torch.Generator().manual_seed(seed)
    stems = [QUOTED_STEM if i == 1 else f"img_{i}" for i in range(n)]
    for i, stem in enumerate(stems):
        y = torch.zeros(h, w, dtype=torch.long)
        y[5:30, 10:100], y[5:30, 120:200], y[5:30, 210:290] = 1, 2, 3
        d = y.clone()
        d[5:5 + 5 * i, 10:100] = -1  # class 1: image i has i/5 of its pixels marked biased
        write_label(root / "labels" / f"{stem}.png", y)
        write_label(root / "debiased" / f"{stem}.png", d)
        write_label(root / "gt" / f"{stem}.png", y)
        write_image(root / "images" / f"{stem}.png", torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8))
    return stems


def _data(out):
    text = (out / html_report.DATA_NAME).read_text(encoding="utf-8")
    assert text.startswith("window.MARS_REPORT = ") and text.endswith(";\n")
    return json.loads(text[len("window.MARS_REPORT = "):-2])


@pytest.fixture
def report(tmp_path):
    root = tmp_path / "w"
    stems = make_folders(root)
    out = tmp_path / "rep"
    report_job(root / "labels", root / "debiased", root / "images", out, class_names=NAMES, progress=False,
               html=HtmlExtras(gt_dir=root / "gt"))
    return root, out, stems


def test_page_is_small_self_contained_and_its_csp_allows_only_its_own_script(report):
    _, out, _ = report
    page = (out / "report.html").read_text(encoding="utf-8")
    assert len(page) < 20_000
    csp = html.unescape(re.search(r'http-equiv="Content-Security-Policy" content="([^"]+)"', page).group(1))
    digest = base64.b64encode(hashlib.sha256(html_report.SCRIPT.encode()).digest()).decode()
    assert f"'sha256-{digest}'" in csp and "unsafe-inline" not in csp.split("script-src")[1].split(";")[0]
    assert "default-src 'none'" in csp
    # nothing fetched from anywhere: no URL with a scheme, one inline script (the hashed one)
    assert not re.search(r"(src|href)=\"(https?:)?//", page)
    inline = re.findall(r"<script>(.*?)</script>", page, re.S)
    assert inline == [html_report.SCRIPT]
    assert f'<script src="{html_report.DATA_NAME}"></script>' in page


def test_data_lists_classes_images_and_shares(report):
    root, out, stems = report
    d = _data(out)
    assert d["num_images"] == len(stems) and d["has_gt"] is True
    assert [c["name"] for c in d["classes"]] == [HOSTILE, "boat", "bird"]  # most marked biased first
    c1 = d["classes"][0]
    assert c1["images"] == 5 and c1["pixels"] == 5 * 25 * 90 and c1["removed"] == sum(5 * i * 90 for i in range(5))
    assert [s for s, _ in d["images"]] == sorted(stems)  # the report's order
    assert dict(d["images"])["img_2"][0] == [1, 25 * 90, 10 * 90]


def test_hostile_class_name_and_quoted_stem_never_reach_html_unescaped(report, tmp_path, monkeypatch):
    root, out, _ = report
    check = _hostile_check(root, tmp_path / "again", HOSTILE)
    assert check()
    # the check flips when the escape door is removed: it can fail
    monkeypatch.setattr(html_report, "escape", lambda s: str(s))
    assert not check()


def _hostile_check(root, out, title):
    """A check that the title (a hostile name) and the data are in the files only escaped."""
    def check() -> bool:
        report_job(root / "labels", root / "debiased", root / "images", out, class_names=NAMES, progress=False,
                   html=HtmlExtras(title=title))
        page = (out / "report.html").read_text(encoding="utf-8")
        data = (out / html_report.DATA_NAME).read_text(encoding="utf-8")
        return "<img" not in page and "&lt;img src=x onerror=alert(1)&gt;" in page and "<" not in data
    return check


def test_script_json_escapes_what_could_end_a_script():
    text = html_report.script_json({"a": "</script><!--\u2028&", "n": float("nan")})
    assert "<" not in text and ">" not in text and "&" not in text and "\u2028" not in text
    assert json.loads(text) == {"a": "</script><!--\u2028&", "n": None}


def test_thumbnails_are_bounded_and_named_by_position(report):
    _, out, stems = report
    thumbs = sorted(p.relative_to(out).as_posix() for p in (out / "thumbs").rglob("*") if p.is_file())
    assert len(thumbs) == 4 * len(stems) and thumbs[0] == "thumbs/000/000000_debiased.png"
    for p in (out / "thumbs").rglob("*.*"):
        with PIL_Image.open(p) as im:
            assert max(im.size) <= THUMB_SIDE and im.size == (THUMB_SIDE, round(40 * THUMB_SIDE / 300))
    with PIL_Image.open(out / "thumbs/000/000004_debiased.png") as im:  # biased pixels in their colour
        from mars_plugin.pictures.label_images import BIASED_COLOR
        assert (np.asarray(im.convert("RGB")) == np.array(BIASED_COLOR, np.uint8)).all(-1).any()


def test_rerun_writes_the_same_files_and_leaves_no_temporary(report):
    root, out, _ = report
    before = {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    report_job(root / "labels", root / "debiased", root / "images", out, class_names=NAMES, progress=False,
               html=HtmlExtras(gt_dir=root / "gt"))
    after = {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert after == before and not [n for n in after if ".tmp-" in n]


def test_a_failed_page_write_leaves_the_previous_report_whole(report, monkeypatch):
    root, out, _ = report
    before = (out / "report.html").read_bytes(), (out / "report.json").read_bytes()

    def boom(data):
        raise OSError("disk full")

    monkeypatch.setattr(html_report, "page_files", boom)
    with pytest.raises(OSError, match="disk full"):
        report_job(root / "labels", root / "debiased", root / "images", out, class_names=NAMES, progress=False)
    assert ((out / "report.html").read_bytes(), (out / "report.json").read_bytes()) == before
    assert not list(out.glob(".tmp-*"))


def _centroids(tmp_path):
    g = torch.Generator().manual_seed(0)
    samples = []
    for _ in range(6):
        y = torch.zeros(8, 8, dtype=torch.long)
        y[2:6, 2:6] = 1
        samples.append((torch.randn(4, 8, 8, generator=g), y))
    return select_centroids(samples, 1, alpha=0.5, backend="torch")


def test_centroid_ranking_is_stored_drawn_and_old_files_still_load(tmp_path):
    V = _centroids(tmp_path)
    d = V.class_distances(1)
    assert d.numel() == int(V.num_candidates[1]) and bool((d[:-1] >= d[1:]).all())
    assert float(d[int(V.num_selected[1]) - 1]) == pytest.approx(float(V.cut_distance[1]))
    V.save(tmp_path / "V.pt")
    assert torch.equal(DebiasedCentroids.load(tmp_path / "V.pt").class_distances(1), d)
    from mars_plugin.commands.report_html import _centroid_ranking

    r = _centroid_ranking(V, 1)
    assert r["candidates"] == d.numel() and r["kept"] == int(V.num_selected[1]) and len(r["distances"]) == d.numel()
    # a file written before the distances were stored: the counts and the cut, no bars
    state = V.state_dict()
    state.pop("candidate_distances")
    torch.save(state, tmp_path / "old.pt")
    old = DebiasedCentroids.load(tmp_path / "old.pt")
    assert old.candidate_distances is None and _centroid_ranking(old, 1)["distances"] == []


def test_an_image_that_cannot_be_decoded_is_skipped_or_stops_by_on_error(tmp_path):
    from mars_plugin.runs.errors import JobError

    root = tmp_path / "w"
    make_folders(root, n=3)
    data = (root / "images" / "img_0.png").read_bytes()  # nothing marked biased: in no overlay, only thumbnails
    (root / "images" / "img_0.png").write_bytes(data[: len(data) // 2])  # the header probe passes, the pixels do not
    out = tmp_path / "rep"
    _, s = report_job(root / "labels", root / "debiased", root / "images", out, class_names=NAMES, progress=False,
                      num_examples=1, per_class=0, on_error="skip")
    assert [f for f, _ in s.failed] == ["img_0"] and not list(out.rglob("000000_*"))
    assert (out / "report.html").is_file() and len(list(out.rglob("000001_*"))) == 3
    with pytest.raises(JobError, match="img_0"):
        report_job(root / "labels", root / "debiased", root / "images", tmp_path / "rep2", class_names=NAMES,
                   progress=False, num_examples=1, per_class=0)


def test_the_page_script_has_no_html_sink():
    """One door: the script reaches the DOM through textContent and setAttribute only; a sink
    that parses a string as HTML or code is refused here."""
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "Function(",
                 "setTimeout(\"", "srcdoc"):
        assert sink not in html_report.SCRIPT, sink


def test_mars_report_gt_and_centroids_flags_fill_the_scores_and_the_ranking(tmp_path, capsys):
    from mars_plugin.cli import main

    root = tmp_path / "w"
    make_folders(root, n=3)
    _centroids(tmp_path).save(tmp_path / "V.pt")
    names = tmp_path / "names.json"
    names.write_text(json.dumps(NAMES))
    argv = ["report", "--labels", str(root / "labels"), "--debiased", str(root / "debiased"), "--images",
            str(root / "images"), "--class-names", str(names), "--no-progress"]
    assert main(argv + ["--out", str(tmp_path / "rep"), "--gt", str(root / "gt"), "--centroids", str(tmp_path / "V.pt")]) == 0
    d = _data(tmp_path / "rep")
    c1 = d["classes"][0]
    assert d["has_gt"] and c1["iou_pseudo"] == 1.0 and c1["iou"] == pytest.approx(1 - c1["removed"] / c1["pixels"])
    assert c1["centroids"]["distances"] and d["classes"][1]["centroids"] is None  # V.pt has class 1 only
    # bad flags: one line naming the flag, exit 2, nothing written
    for flag, value, words in (("--gt", str(tmp_path / "none"), "--gt"), ("--centroids", str(names), "--centroids")):
        assert main(argv + ["--out", str(tmp_path / "bad"), flag, value]) == 2
        assert words in capsys.readouterr().err and not (tmp_path / "bad").exists()
