"""Generated data: the synthetic world of ``mars demo`` (``synthetic.py``) and the sample trees of
``mars sample`` in each codebase's layout (``sample_trees.py``)."""
