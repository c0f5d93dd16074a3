"""Generated data: the synthetic world of ``mars demo`` (``synthetic.py``: its names, the world
container and its writer; ``synthetic_scenes.py``: the scenes and embeddings generated for a
seed; ``synthetic_pseudo.py``: their simulated WSSS pseudo labels)."""
