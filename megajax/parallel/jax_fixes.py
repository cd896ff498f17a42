"""A mend of a jax 0.10 fault megajax meets, applied once where it is imported (``models/moe.py``).

``jax.lax.ragged_dot`` under ``jax.vmap`` (a mixture of experts' grouped GEMMs inside the pipeline stages' vmaps):
the batching rule gives the primitive batch dimensions as numpy integers, and the dense expansion that lowers it on
CPUs and GPUs (``_ragged_dot_general_impl``) passes them to ``jax.vmap`` as ``in_axes``, which refuses them
(``vmap in_axes must be an int ... got (np.int64(0), 0)``, jax 0.10.2). The mend makes the dimensions the
expansion reads Python integers; the values are the same, so the program is.
"""

from __future__ import annotations

from jax._src.lax import lax as _lax  # the private helper the expansion reads (no public equivalent)

_prefix_dims = _lax._ragged_dot_prefix_dims


def _int_prefix_dims(mode, rank, ragged_dim, batch, contract):
    return [int(d) for d in _prefix_dims(mode, rank, ragged_dim, batch, contract)]


if getattr(_prefix_dims, "__name__", "") == "_ragged_dot_prefix_dims":  # once
    _lax._ragged_dot_prefix_dims = _int_prefix_dims
