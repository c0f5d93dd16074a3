"""The numerical engines under the method: K-means (torch, and compiled with numba), the dense
CRF (torch on any device, compiled on the CPU, pydensecrf as the reference), the permutohedral
lattice it filters on, and the windowed CRF. Nothing here knows MARS's equations or files.

* ``kmeans.py`` / ``kmeans_compiled.py`` -- batched K-means (Eq. 1's clustering).
* ``crf.py`` -- :func:`dense_crf` / :class:`DenseCRF`, its presets (``mars``, ``psa``) and backends.
* ``crf_compiled.py`` -- the CPU dense CRF compiled with numba.
* ``permutohedral.py`` -- the permutohedral lattice (Adams et al. 2010) in torch.
* ``local_crf.py`` -- the windowed approximation of the dense CRF.
"""
