"""mars-plugin: MARS (Jo et al., ICCV 2023), model-agnostic biased object removal for WSSS.

Three calls between the pseudo-label and segmentation stages of any WSSS codebase::

    V = select_centroids(zip(features, pseudo_labels), num_classes=20)      # Eq. 1-3, once
    y_db = debias_labels(F_i, Y_i, V, classes_i, image=img_i)                # Eq. 4-5, per image
    y_co, w = complement_labels(y_db, teacher(x).softmax(1), classes)        # Eq. 6, per step
    loss = WCELoss()(student(x), y_co, w)                                    # Eq. 7
"""
# First, before torch loads libgomp: in the mars command, OpenMP threads sleep at a barrier
# instead of spinning (mars_plugin/_wait_policy.py acts when imported); as a library, nothing.
from . import _wait_policy  # noqa: F401
from .centroids import ImageCentroids, image_centroids
from .complement import complement_labels
from .crf import DenseCRF, dense_crf
from .debias import BIASED, DebiasResult, debias_labels, debiased_similarity
from .ema import EMATeacher
from .kmeans import batched_kmeans, kmeans
from .local_crf import local_crf
from .losses import WCELoss, weighted_cross_entropy
from .selection import DebiasedCentroids, select_centroids

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
