"""Shared test set-up: CPU jax (deviceless GPU compiles need it) and helpers."""

import os

# Must precede the first import of jax: the CUDA plugin's start-up check fails
# on a machine without a GPU otherwise, and no H100 topology can be made.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np


def max_relative_error(actual, expected) -> float:
  """Worst, over the leaves of two pytrees, of max|a - e| / max|e| (the
  normwise error of each leaf, so that exact zeros do not divide)."""
  actual_leaves = jax.tree.leaves(actual)
  expected_leaves = jax.tree.leaves(expected)
  assert jax.tree.structure(actual) == jax.tree.structure(expected)
  worst = 0.0
  for a, e in zip(actual_leaves, expected_leaves):
    if jax.dtypes.issubdtype(getattr(e, "dtype", np.float32),
                             jax.dtypes.prng_key):
      a, e = jax.random.key_data(a), jax.random.key_data(e)
    a = np.asarray(a, np.float64)
    e = np.asarray(e, np.float64)
    assert a.shape == e.shape
    if e.size == 0:
      continue
    scale = max(float(np.max(np.abs(e))), np.finfo(np.float32).tiny)
    worst = max(worst, float(np.max(np.abs(a - e))) / scale)
  return worst
