"""Gated-pooling KV compressor (deepseek-v4.md §5): one row per complete window of `ratio` tokens."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ds4jax import rope
from ds4jax.layers import F32, Linear, RMSNorm, normal


class Compressor(nnx.Module):
  """Pools each complete window of `ratio` tokens into one `dim`-vector.

  With `overlap` (CSA, ratio 4) every entry also pools the previous window: the FIRST `dim`
  channels of wkv/wgate/ape belong to the previous window, the LAST `dim` to the current one.
  """

  def __init__(self, hidden: int, dim: int, ratio: int, overlap: bool, eps: float, *, rngs: nnx.Rngs,
               dtype=F32):
    width = (2 if overlap else 1) * dim
    self.dim, self.ratio, self.overlap = dim, ratio, overlap
    self.wkv = Linear(hidden, width, rngs=rngs, dtype=dtype)
    self.wgate = Linear(hidden, width, rngs=rngs, dtype=dtype)
    self.ape = normal(rngs, (ratio, width), 0.1, F32)  # per-slot position bias of the gate logits
    self.norm = RMSNorm(dim, eps)

  def __call__(self, x: jnp.ndarray, freqs: np.ndarray) -> jnp.ndarray:
    """x: [S, hidden] (the prompt from position 0) -> [S // ratio, dim], rotated at each window start."""
    m, c = self.ratio, self.dim
    n = x.shape[0] // m
    if n == 0:
      return jnp.zeros((0, c), F32)
    kv = self.wkv(x[: n * m]).reshape(n, m, -1)
    gate = self.wgate(x[: n * m]).reshape(n, m, -1) + self.ape[...]
    if self.overlap:
      # Slots 0..m-1 come from the previous window (value 0, logit -inf before window 0).
      prev_kv = jnp.concatenate([jnp.zeros((1, m, c), F32), kv[:-1, :, :c]], axis=0)
      prev_gate = jnp.concatenate([jnp.full((1, m, c), -jnp.inf, F32), gate[:-1, :, :c]], axis=0)
      kv = jnp.concatenate([prev_kv, kv[:, :, c:]], axis=1)  # [n, 2m, c]
      gate = jnp.concatenate([prev_gate, gate[:, :, c:]], axis=1)
    pooled = jnp.sum(jax.nn.softmax(gate, axis=1) * kv, axis=1)  # softmax over slots, per channel
    return rope.apply(self.norm(pooled), jnp.arange(n) * m, freqs)


def visible_rows(positions: jnp.ndarray, n_rows: int, ratio: int) -> jnp.ndarray:
  """[S, n_rows] bool: row w is complete, hence visible, at query position t iff w < (t+1) // ratio."""
  return jnp.arange(n_rows)[None, :] < ((positions + 1) // ratio)[:, None]
