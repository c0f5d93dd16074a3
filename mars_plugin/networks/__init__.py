"""The segmentation networks of ``mars train`` / ``mars predict``: DeepLabv3+ (``deeplab.py``,
its entry point ``build_model``; DHR's DeepLabv3+ as it is: ``deeplab_dhr.py``) on ResNet
(``resnet.py``), deeplab-pytorch's DeepLabv2 with its
MSC wrapper and weight reader (``deeplabv2.py``) on its MSRA ResNet (``msra_resnet.py``) and its
training pieces (``deeplab_pytorch.py``: augmentation, normalisation, SGD groups, poly lr, MSC
loss), their checkpoint format (``seg_checkpoint.py``) and
training data pipeline with DHR's augmentation (``seg_data.py``), and their labels for a batch of
images: multi-scale + flip softmax, then the CRF (``inference.py``), and the memory both take,
checked against ``--max-memory`` before any work (``memory.py``); the recipe of each codebase that
trains them, one frozen record per Table 2 row, each field citing its upstream line
(``recipes.py``, its fields' checks in ``recipe_checks.py``). The SEAM row's DeepLabv1 on the
wide ResNet-38 (``deeplabv1.py``, ``wide_resnet38.py``) and its codebase's augmentation
(``seam_data.py``). What a weight file lacks against a network, for every reader (``weight_files.py``)."""
