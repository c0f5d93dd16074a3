"""The ``mars`` command line's work, one module per command, each with its settings and flags
beside it (``<command>_settings.py``: the settings record, ``HELP``, ``DESCRIPTION`` and
``add_arguments``); ``command_table.py`` lists the commands (``COMMANDS``: the flags module, the
runner, torchrun), from which ``cli_parser.py`` builds the parser and :mod:`mars_plugin.cli`
dispatches. The equations are in :mod:`mars_plugin.method`.

The commands:

* ``features.py`` -- ``mars features`` (the folder job around a USS extractor of
  :mod:`mars_plugin.adapters.uss`); its settings record and flags in ``features_settings.py``.
* ``centroids.py``, ``debias.py``, ``evaluate.py``, ``report.py`` -- ``mars centroids``,
  ``debias``, ``evaluate`` (mIoU as VOC computes it: ``metrics.py``), ``report``; their settings records and flags in
  ``centroids_settings.py``, ``debias_settings.py``, ``evaluate_settings.py``,
  ``report_settings.py``; ``report_html.py``: what ``report.html`` shows and its thumbnails
  (written by the I/O workers).
* ``train.py`` / ``predict.py`` -- ``mars train`` / ``mars predict`` (the paper's second step, on
  :mod:`mars_plugin.networks`); ``train_data.py``: what a training run reads, checked before
  step 1 and recorded with its checkpoint; ``train_settings.py``: the run's settings record and
  flags; ``train_dhr.py``: the loss grid (the dhr recipe's, on DHR's stride-4 logits);
  ``recipe_uses.py``: which recipe uses which setting (an override its run would not read is refused);
  ``predict_settings.py``: predict's settings record and flags; ``predict_recipe.py``: predict's
  settings from the checkpoint's recipe; ``predict_memory.py``: each image against the memory
  budget, from its header, before any work.
* ``reproduce.py`` -- ``mars reproduce``, with ``reproduce_settings.py`` (its settings record,
  checked once, and its flags), ``reproduce_command.py`` (the command line's run and lines),
  ``reproduce_state.py`` (its record),
  ``reproduce_plan.py`` (the plan both ``--dry-run`` and the run check first) with
  ``reproduce_checks.py`` (its checks of every input), ``reproduce_report.py`` (``report.md``),
  ``reproduce_train.py`` (``--train``) and ``references.py`` (the yardstick's WSS folders).
* ``demo.py`` -- ``mars demo`` (settings and flags: ``demo_settings.py``; its figures and the report's are in
  :mod:`mars_plugin.pictures`).
* ``crf_job.py`` -- ``mars crf``: the dense CRF over a folder of a codebase's CAMs (its
  adapter's ``load_cams`` and ``crf_input``) or of probability maps, batched on the device;
  ``crf_settings.py``: its settings record and flags.
* ``sample_trees.py`` -- ``mars sample`` (settings and flags: ``sample_settings.py``): small trees in each
  codebase's layout (random-weight model files), for trying every command without downloads.

What they share here: ``command_table.py`` (the commands), ``cli_parser.py`` (the parser),
``cli_flags.py`` (the flag groups several commands share), ``cli_types.py`` (the flags' parsers
and bounds, which the records check too), ``job_settings.py`` (the one check of a job's ``settings=``),
``flag_language.py`` (library errors in the flags' words), ``inputs.py`` (input checks), ``label_formats.py`` (WSSS label formats, image-level
labels, class names), ``metrics.py`` (mIoU). The run machinery every command uses (errors and
``--on-error``, the run record and its lock, input identities, torchrun, batches by size,
``--io-workers``) is :mod:`mars_plugin.runs`.
"""
