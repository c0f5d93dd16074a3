"""The paper's method, one module per step (Jo et al., ICCV 2023, Sec. 3); the public API is
re-exported by :mod:`mars_plugin`.

* ``centroids.py`` -- Eq. 1: per image and class, K-means centroids of the labelled pixels.
* ``centroid_pixels.py`` -- the pixels of a batch grouped by (image, class) for that K-means.
* ``selection.py`` -- Eq. 2-3: the debiased centroids (the top-alpha farthest from the other
  images' background centroids).
* ``selection_stream.py`` -- its stream of samples: batches clustered, the running state, spilling.
* ``debias.py`` -- Eq. 4-5: similarity to the debiased centroids, CRF, biased pixels -> -1.
* ``complement.py`` -- Eq. 6: the EMA teacher fills the biased pixels, with its certainty.
* ``losses.py`` -- Eq. 7: the certainty-weighted cross-entropy (WCE).
* ``ema.py`` -- Sec. 3.4: the EMA teacher.

These use the engines (:mod:`mars_plugin.engines`) and never the commands.
"""
