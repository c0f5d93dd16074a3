"""USS feature extractors ("works with any model"): the ViT backbones (``vit.py``, DINO and
DINOv2 in ``dinov2.py``), STEGO (``stego.py``), Leopart (``leopart.py``), CAUSE (``cause.py``,
on ``code_extractor.py``), DHR's multi-scale inference (``multiscale.py``) and
:func:`load_extractor` / :class:`ModelExtractor` (``extractor.py``); the ``mars features`` folder job
lives in the command layer (``commands/features.py``)."""
