"""The figures of ``mars demo`` and ``mars report`` (Pillow, and matplotlib's Agg canvas for the
bar charts), each file written atomically and byte for byte deterministic.

* ``label_images.py`` -- labels in colour (the VOC palette), overlays on the image.
* ``panel_grids.py`` -- panel rows, grids and legends.
* ``bar_charts.py`` -- the per-class IoU bar charts.
"""
