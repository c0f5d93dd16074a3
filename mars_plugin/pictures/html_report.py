"""``report.html``: one static page that opens from the file system, offline, to look through
what MARS removed, class by class (issue 43).

Three files, written by :func:`write_html_page` into the report's folder:

* ``report.html``: a few kilobytes, whatever the number of images: the layout, the page's own
  style and script (:data:`SCRIPT`), and a Content-Security-Policy that lets no other script run
  (``script-src 'self'`` and the sha256 of :data:`SCRIPT`; no ``'unsafe-inline'``, so an inline
  handler that reached the DOM would not run either);
* ``report_data.js``: the per-class and per-image data, one compact JSON value assigned to
  ``window.MARS_REPORT``. A ``<script src>`` and not a ``.json`` file: Chromium refuses
  ``fetch``/XHR of ``file://`` URLs, a same-folder script it loads;
* the thumbnails (:mod:`mars_plugin.pictures.report_thumbnails`), loaded lazily, a page of the
  gallery at a time.

Nothing in the data runs as code: the script puts every class name and stem into the DOM with
``textContent`` or ``setAttribute``; the server side writes text into HTML only through
:func:`escape` and JSON into a script only through :func:`script_json`.
"""
from __future__ import annotations

import base64
import hashlib
import html
import json
import math
from pathlib import Path
from typing import Any, Dict, Mapping

from mars_plugin.formats.files import atomic_write

__all__ = ["SCRIPT", "STYLE", "escape", "script_json", "csp", "page_html", "write_html_page", "page_files", "DATA_NAME", "PAGE_NAME"]

PAGE_NAME = "report.html"
DATA_NAME = "report_data.js"
#: The page's script: read once, its hash goes into the CSP of every page written.
SCRIPT = (Path(__file__).with_name("html_page.js")).read_text(encoding="utf-8")

STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:16px;color:#222;background:#fff}
h1{font-size:20px;margin:0 0 4px} h2{font-size:16px;margin:20px 0 6px}
table{border-collapse:collapse} th,td{border:1px solid #ccc;padding:2px 6px;vertical-align:middle}
th{background:#eee;font-weight:600;text-align:left} td.n{text-align:right;font-variant-numeric:tabular-nums}
.rank{display:flex;align-items:flex-end;gap:1px;height:30px}
.rank span{display:inline-block;width:3px} .rank .kept{background:#1f77b4} .rank .cut{background:#e377c2}
.note{color:#555;font-size:12px} .stem{font-family:monospace;word-break:break-all}
#gallery{display:flex;flex-wrap:wrap;gap:10px}
.card{border:1px solid #ccc;padding:4px;max-width:680px}
.strip{display:flex;gap:2px} .strip img{width:160px;height:auto;image-rendering:pixelated;background:#eee}
figure{display:inline-block;margin:6px} figure img{max-width:620px}
nav a{margin:0 6px}
"""

_BODY = """<h1 id="title"></h1>
<p id="summary" class="note"></p>
<noscript>This page needs its own script (report_data.js beside it); the same numbers are in report.json.</noscript>
<h2>Classes</h2>
<table id="classes"></table>
<h2>Gallery</h2>
<p class="note">Per image: the image, its pseudo label, the debiased label (pixels marked biased in
magenta) and the ground truth where given, in the palette of the label PNGs.</p>
<nav><label>class <select id="filter"></select></label>
<a id="prev" href="#">previous</a><span id="pageinfo"></span><a id="next" href="#">next</a></nav>
<div id="gallery"></div>
<h2>Figures</h2>
<div id="figures"></div>
"""


def escape(text: Any) -> str:
    """Any text from the data (a class name from a user's JSON, a stem from a file name) as HTML
    text or attribute value: ``& < > " '`` escaped (the one door for server-side HTML)."""
    return html.escape(str(text), quote=True)


def script_json(value: Any) -> str:
    """``value`` as JSON safe inside a script: ``< > &`` and U+2028/U+2029 escaped, so no
    ``</script>`` or ``<!--`` can end or change the script; NaN and infinities become null."""
    text = json.dumps(_finite(value), ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    for ch, esc in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"), ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):
        text = text.replace(ch, esc)
    return text


def _finite(value: Any) -> Any:
    """NaN/inf (a class never labelled, no ground truth) -> None, recursively."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def csp(script: str = "") -> str:
    """The page's Content-Security-Policy: nothing from elsewhere; images and scripts from the
    report's folder; inline, only the style and the script whose sha256 this is."""
    digest = base64.b64encode(hashlib.sha256((script or SCRIPT).encode("utf-8")).digest()).decode("ascii")
    return (f"default-src 'none'; img-src 'self' data:; style-src 'unsafe-inline'; "
            f"script-src 'self' 'sha256-{digest}'; base-uri 'none'; form-action 'none'")


def page_html(title: str) -> str:
    """``report.html``'s text: the same few kilobytes for 10 images or 100,000."""
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">\n'
            f'<meta http-equiv="Content-Security-Policy" content="{escape(csp(SCRIPT))}">\n'
            f'<meta name="viewport" content="width=device-width,initial-scale=1">\n'
            f"<title>{escape(title)}</title>\n<style>{STYLE}</style></head>\n<body>\n{_BODY}"
            f'<script src="{DATA_NAME}"></script>\n<script>{SCRIPT}</script>\n</body></html>\n')


def write_html_page(out: Path, data: Mapping[str, Any]) -> Dict[str, int]:
    """``report_data.js`` then ``report.html`` written into ``out``, each atomically (a reader
    never sees half a file; the data first, so a new page never meets old data's absence).

    ``data``: ``title``, ``num_images``, ``has_gt``, ``share_definition``, ``paper`` (str or
    None), ``classes`` (list of dicts: ``id``, ``name``, ``images``, ``pixels``, ``removed``,
    ``share``, ``iou``, ``fp``, ``fn``, ``iou_pseudo``, ``paper_rs``, ``paper_mars``,
    ``centroids``), ``images`` (list of ``[stem, [[class id, pixels, removed], ...]]``, the
    thumbnails' index being the position) and ``figures`` (``[caption, relative path]``).
    Returns the bytes of each file."""
    files = page_files(data)
    for name, text in files.items():  # the data first
        atomic_write(Path(out) / name, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
    return {name: len(text.encode("utf-8")) for name, text in files.items()}


def page_files(data: Mapping[str, Any]) -> Dict[str, str]:
    """``{DATA_NAME: text, PAGE_NAME: text}``, the data first (see :func:`write_html_page`)."""
    return {DATA_NAME: f"window.MARS_REPORT = {script_json(dict(data))};\n",
            PAGE_NAME: page_html(str(data.get("title", "MARS report")))}
