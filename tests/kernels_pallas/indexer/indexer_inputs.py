"""Shared input builder for the indexer kernel tests."""

import jax
import jax.numpy as jnp
import numpy as np

INTERPRET = jax.default_backend() == "cpu"


def make_inputs(seed, T, Hi, c, R, dtype=jnp.float32):
  """Random q [T, Hi, c], w [T, Hi] (signed, like weights_proj · scale), keys [R, c]: continuous values, so tied
  scores are improbable."""
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((T, Hi, c)), jnp.float32).astype(dtype)
  w = jnp.asarray(rng.standard_normal((T, Hi)) * (c ** -0.5 * Hi ** -0.5), jnp.float32)
  keys = jnp.asarray(rng.standard_normal((R, c)), jnp.float32).astype(dtype)
  return q, w, keys
