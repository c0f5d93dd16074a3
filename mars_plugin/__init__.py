"""mars-plugin: MARS (Jo et al., ICCV 2023), model-agnostic biased object removal for WSSS.

Three calls between the pseudo-label and segmentation stages of any WSSS codebase::

    V = select_centroids(zip(features, pseudo_labels), num_classes=20)      # Eq. 1-3, once
    y_db = debias_labels(F_i, Y_i, V, classes_i, image=img_i)                # Eq. 4-5, per image
    y_co, w = complement_labels(y_db, teacher(x).softmax(1), classes)        # Eq. 6, per step
    loss = WCELoss()(student(x), y_co, w)                                    # Eq. 7
"""
# First, before torch loads libgomp: in the mars command, OpenMP threads sleep at a barrier
# instead of spinning (mars_plugin/_wait_policy.py acts when imported); as a library, nothing.
from mars_plugin import _wait_policy  # noqa: F401
# Then, in the mars command, a Ctrl-C while torch imports ends with one line, not a traceback.
from mars_plugin import _interrupt  # noqa: F401
from mars_plugin.method.centroids import ImageCentroids, image_centroids
from mars_plugin.method.complement import complement_labels
from mars_plugin.engines.crf import DenseCRF, dense_crf
from mars_plugin.method.debias import BIASED, DebiasResult, debias_labels, debiased_similarity
from mars_plugin.method.ema import EMATeacher
from mars_plugin.engines.kmeans import batched_kmeans, kmeans
from mars_plugin.engines.local_crf import local_crf
from mars_plugin.method.losses import WCELoss, weighted_cross_entropy
from mars_plugin.method.selection import DebiasedCentroids, select_centroids

__version__ = "0.1.0"

__all__ = [
    "BIASED",
    "DebiasResult",
    "DebiasedCentroids",
    "DenseCRF",
    "EMATeacher",
    "ImageCentroids",
    "WCELoss",
    "batched_kmeans",
    "complement_labels",
    "debias_labels",
    "debiased_similarity",
    "dense_crf",
    "image_centroids",
    "kmeans",
    "local_crf",
    "select_centroids",
    "weighted_cross_entropy",
]
