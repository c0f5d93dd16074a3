"""The numerical engines under the method: K-means (torch, and compiled with numba), the dense
CRF (torch on any device, compiled on the CPU, pydensecrf as the reference), the permutohedral
lattice it filters on, and the windowed CRF. Nothing here knows MARS's equations or files.

* ``kmeans.py`` / ``kmeans_compiled.py`` -- batched K-means (Eq. 1's clustering).
* ``crf.py`` -- :func:`dense_crf` / :class:`DenseCRF`: the dense CRF's entry points, inputs and unaries.
* ``crf_params.py`` -- its presets (``mars``, ``psa``), backends and parameter checks.
* ``crf_memory.py`` -- its memory model and budget (``max_bytes``, :func:`check_crf_image`).
* ``crf_lattices.py`` -- its two kernels' lattices and the kept position-kernel lattices.
* ``crf_mean_field.py`` -- its mean field per backend (torch, compiled, pydensecrf).
* ``crf_compiled.py`` -- the CPU dense CRF compiled with numba.
* ``crf_terms.py`` -- the general dense CRF (any pairwise terms, normalisations and label
  compatibilities), under the pydensecrf drop-in :mod:`mars_plugin.densecrf`.
* ``crf_exact.py`` -- its compiled filter and softmax in pydensecrf's float32 order (Q bit for bit).
* ``permutohedral.py`` -- the permutohedral lattice (Adams et al. 2010) in torch.
* ``permutohedral_lift.py`` -- its lifting: points onto the hyperplane, their simplices and weights.
* ``lattice_concat.py`` -- images' lattices joined into their batch's, without building it again.
* ``permutohedral_triton.py`` -- its filter as fused Triton kernels (CUDA; the ``gpu`` extra).
* ``local_crf.py`` -- the windowed approximation of the dense CRF.
"""
