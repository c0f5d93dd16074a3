"""The figures of ``mars demo`` and ``mars report`` (Pillow, and matplotlib's Agg canvas for the
bar charts), each file written atomically and byte for byte deterministic.

* ``label_images.py`` -- labels in colour (the VOC palette), overlays on the image.
* ``panel_grids.py`` -- panel rows, grids and legends.
* ``bar_charts.py`` -- the per-class IoU bar charts.
* ``html_report.py`` -- ``report.html``: the static page, its data file, its CSP and escaping
  (its script: ``html_page.js``).
* ``report_thumbnails.py`` -- the page's thumbnails (at most 160 px on the longer side).
"""
