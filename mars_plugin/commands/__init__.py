"""The ``mars`` command line's work, one module per command (``mars_plugin/cli.py`` parses the
flags with ``cli_parser.py`` and ``cli_types.py`` and dispatches to these); the equations are in
:mod:`mars_plugin.method`.

The commands:

* ``features.py`` -- ``mars features`` (the folder job around a USS extractor of
  :mod:`mars_plugin.adapters.uss`).
* ``centroids.py``, ``debias.py``, ``evaluate.py``, ``report.py`` -- ``mars centroids``,
  ``debias``, ``evaluate`` (mIoU as VOC computes it: ``metrics.py``), ``report``.
* ``train.py`` / ``predict.py`` -- ``mars train`` / ``mars predict`` (the paper's second step, on
  :mod:`mars_plugin.networks`); ``train_data.py``: what a training run reads, checked before
  step 1 and recorded with its checkpoint; ``train_settings.py``: the run's settings record;
  ``train_dhr.py``: the loss grid (the dhr recipe's, on DHR's stride-4 logits);
  ``predict_recipe.py``: predict's settings from the checkpoint's recipe; ``predict_memory.py``:
  each image against the memory budget, from its header, before any work.
* ``reproduce.py`` -- ``mars reproduce``, with ``reproduce_settings.py`` (its settings record,
  checked once), ``reproduce_state.py`` (its record),
  ``reproduce_plan.py`` (the plan both ``--dry-run`` and the run check first) with
  ``reproduce_checks.py`` (its checks of every input), ``reproduce_report.py`` (``report.md``),
  ``reproduce_train.py`` (``--train``) and ``references.py`` (the yardstick's WSS folders).
* ``demo.py`` -- ``mars demo`` (its figures and the report's are in :mod:`mars_plugin.pictures`).
* ``crf_job.py`` -- ``mars crf``: the dense CRF over a folder of a codebase's CAMs (its
  adapter's ``load_cams`` and ``crf_input``) or of probability maps, batched on the device;
  ``crf_settings.py``: its settings record and flags.
* ``sample_trees.py`` -- ``mars sample``: small trees in each codebase's layout (random-weight
  model files), for trying every command without downloads.

What they share here: ``cli_parser.py`` and ``cli_types.py`` (the flags), ``inputs.py`` (input
checks), ``label_formats.py`` (WSSS label formats, image-level labels, class names),
``metrics.py`` (mIoU). The run machinery every command uses (errors and ``--on-error``, the run
record and its lock, input identities, torchrun, batches by size, ``--io-workers``) is
:mod:`mars_plugin.runs`.
"""
