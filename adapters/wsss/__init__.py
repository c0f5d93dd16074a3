"""WSSS pseudo-label formats, one module per upstream codebase, each reading that repository's
outputs exactly as it writes them: IRNet (``irnet.py``), SEAM (``seam.py``), AdvCAM
(``advcam.py``), RS+EPM (``rsepm.py``), DHR (``dhr.py``); ``_common.py`` what they share."""
