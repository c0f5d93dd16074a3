"""The ``mars`` command line's work (``mars_plugin/cli.py`` parses and dispatches to these).

* ``centroids.py``, ``debias.py``, ``evaluate.py``, ``report.py`` -- the folder jobs of ``mars
  centroids``, ``debias``, ``evaluate``, ``report`` and their command-line bodies (the equations
  are in :mod:`mars_plugin.method`); what several commands share: ``inputs.py`` (input checks),
  ``label_formats.py`` (WSSS label formats, image-level labels, class names), ``errors.py``
  (errors, summaries), ``distributed.py`` (torchrun helpers); ``cli_parser.py`` -- every
  command's flags.
* ``train.py`` / ``predict.py`` -- ``mars train`` / ``mars predict`` (the paper's second step).
* ``features.py`` -- ``mars features`` (the folder job around a USS extractor).
* ``reproduce.py`` (+ ``reproduce_state.py``, ``reproduce_plan.py``, ``reproduce_report.py``,
  ``reproduce_train.py``, ``references.py``) -- ``mars reproduce``.
* ``demo.py`` -- ``mars demo``; its figures and the report's: ``label_images.py`` (labels in
  colour, overlays), ``panel_grids.py`` (panel rows, grids, legends), ``bar_charts.py`` (IoU bars).
* ``run_record.py`` -- resumable runs: what was made from what (``identities.py``: what identifies
  an input), and ``run_lock.py``, one run at a time.
* ``sample_trees.py`` -- ``mars sample``: small trees in each codebase's layout (random-weight
  model files), for trying every command without downloads.
* ``metrics.py`` -- mIoU as VOC computes it (``mars evaluate``); ``cli_types.py`` -- flag types.
"""
