"""The ``mars`` command line's work (``mars_plugin/cli.py`` parses and dispatches to these).

* ``centroids.py``, ``debias.py``, ``evaluate.py``, ``report.py`` -- the folder jobs of ``mars
  centroids``, ``debias``, ``evaluate``, ``report`` and their command-line bodies (the equations
  are in :mod:`mars_plugin.method`); what several commands share: ``inputs.py`` (input checks),
  ``label_formats.py`` (WSSS label formats, image-level labels, class names), ``errors.py``
  (errors, summaries), ``distributed.py`` (torchrun helpers); ``cli_parser.py`` -- every
  command's flags.
* ``train.py`` / ``predict.py`` -- ``mars train`` / ``mars predict`` (the paper's second step).
* ``reproduce.py`` (+ ``reproduce_plan.py``, ``reproduce_report.py``, ``reproduce_train.py``,
  ``references.py``) -- ``mars reproduce``.
* ``demo.py`` -- ``mars demo``; ``plots.py`` its figures and the report's.
* ``run_record.py`` -- resumable runs: what was made from what, and the run lock.
* ``metrics.py`` -- mIoU as VOC computes it (``mars evaluate``); ``cli_types.py`` -- flag types.
"""
