"""WSSS pseudo-label formats, one module per upstream codebase, each reading that repository's
outputs exactly as it writes them: IRNet (``irnet.py``), SEAM (``seam.py``), AdvCAM
(``advcam.py``), RS+EPM (``rsepm.py``), DHR (``dhr.py``, its data tree in ``dhr_layout.py``);
``_common.py`` what they share."""
