"""The segmentation networks of ``mars train`` / ``mars predict``: DeepLabv3+ and DeepLabv2
(``deeplab.py``) on ResNet (``resnet.py``), their checkpoint format (``seg_checkpoint.py``) and
training data pipeline with DHR's augmentation (``seg_data.py``), and their labels for a batch of
images: multi-scale + flip softmax, then the CRF (``inference.py``), and the memory both take,
checked against ``--max-memory`` before any work (``memory.py``); the recipe of each codebase that
trains them, one frozen record per Table 2 row, each field citing its upstream line
(``recipes.py``, its fields' checks in ``recipe_checks.py``)."""
