"""USS feature extractors ("works with any model"): the ViT backbones (``vit.py``, read from
checkpoints by ``vit_weights.py``, fed by ``preprocess.py``; DINO and DINOv2 in ``dinov2.py``),
STEGO (``stego.py``), Leopart (``leopart.py``), CAUSE (``cause.py``, its decoder in
``cause_decoder.py`` and its heads files in ``cause_files.py``, on ``code_extractor.py``), DHR's
multi-scale inference (``multiscale.py``) and :func:`load_extractor` / :class:`ModelExtractor`
(``extractor.py``); the ``mars features`` folder job lives in the command layer
(``mars_plugin/commands/features.py``)."""
