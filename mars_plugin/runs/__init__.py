"""The machinery every folder job and every run shares, under the commands of
:mod:`mars_plugin.commands`: nothing here knows MARS's equations or a command's flags.

* ``errors.py`` -- ``JobError``, ``JobSummary`` and ``--on-error``: a bad file fails alone, by name.
* ``run_record.py`` -- resumable runs: what each output was made from, and which outputs are current.
* ``identities.py`` -- what identifies an input (files, arrays, centroids, a model's weight files).
* ``resume_ledger.py`` -- a folder job's resume bookkeeping: each output kept, made again or
  made, and recorded.
* ``run_lock.py`` -- one run at a time per output folder.
* ``output_aside.py`` -- an output taken out of its folder (an input gone, ``--restart``): moved into
  ``.mars-stale/<UTC time>-<run id>/``, never deleted, never overwriting.
* ``distributed.py`` -- torchrun: rank, device, the ranks' meeting points.
* ``size_batches.py`` -- images of one size in one forward pass.
* ``io_pipeline.py`` -- ``--io-workers``: the files read ahead and written behind in threads while
  the device computes.
* ``worker_processes.py`` -- ``--workers``: the one door to worker processes, which leave Ctrl-C
  to the command and die with it.
"""
