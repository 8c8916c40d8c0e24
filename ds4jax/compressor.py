"""Gated-pooling KV compressor (docs/model.md §5): one row per complete window of `ratio` tokens.

Prefill may arrive in bands (ds4jax/prefill.py). A band at positions [s0, s0+B) is pooled from an extended input
`ext` that starts one window before a = (s0 // ratio) * ratio, the start of the window in progress:

    ext row i  <->  position a - ratio + i        (3·ratio + B rows: carried tail, then the band, then padding)

so every window that completes inside the band sees all its tokens (and CSA its previous window). The carried
tail is the 2·ratio rows of positions [a - ratio, a + ratio) of the previous band's `ext`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ds4jax.layers import F32, Linear, RMSNorm, normal
from kernels_pallas.mla.reference import apply_rope


def extend(x_tail: jnp.ndarray, x: jnp.ndarray, s0, ratio: int) -> tuple[jnp.ndarray, jnp.ndarray]:
  """(ext [3·ratio + B, D], a): the carried tail [2·ratio, D] with the band x [B, D] written at position s0."""
  m = ratio
  a = (s0 // m) * m
  ext = jnp.zeros((3 * m + x.shape[0], x.shape[1]), x.dtype).at[: 2 * m].set(x_tail.astype(x.dtype))
  return jax.lax.dynamic_update_slice(ext, x, (m + s0 - a, 0)), a


def next_tail(ext: jnp.ndarray, a, s_next, ratio: int) -> jnp.ndarray:
  """The tail the next band (starting at s_next) needs: positions [a' - ratio, a' + ratio),
  a' = s_next // ratio · ratio."""
  m = ratio
  return jax.lax.dynamic_slice(ext, ((s_next // m) * m - a, 0), (2 * m, ext.shape[1]))


def write_rows(rows: jnp.ndarray, new: jnp.ndarray, first) -> jnp.ndarray:
  """rows[first : first + len(new)] = new. The caller sizes `rows` so the slice never needs clamping."""
  return jax.lax.dynamic_update_slice(rows, new.astype(rows.dtype), (first, 0))


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

  def pool(self, ext: jnp.ndarray, first, freqs: np.ndarray, operand_dtype=F32) -> jnp.ndarray:
    """Rows of windows first, first+1, ... from `ext` (window 0 of ext is window first-1, the previous one).

    Returns [n, dim] with n = len(ext) // ratio - 1; rows of windows that are not complete in ext are garbage
    and must stay invisible (they are, by position) until a later band rewrites them. The two projections take
    `operand_dtype` operands.
    """
    m, c = self.ratio, self.dim
    nwin = ext.shape[0] // m
    kv = self.wkv(ext[: nwin * m], operand_dtype).reshape(nwin, m, -1)
    gate = self.wgate(ext[: nwin * m], operand_dtype).reshape(nwin, m, -1) + self.ape[...]
    if self.overlap:
      # Slots 0..m-1 come from the previous window (value 0, logit -inf before window 0).
      before_start = (first + jnp.arange(nwin - 1) - 1 < 0)[:, None, None]
      prev_kv = jnp.where(before_start, 0.0, kv[:-1, :, :c])
      prev_gate = jnp.where(before_start, -jnp.inf, gate[:-1, :, :c])
      kv = jnp.concatenate([prev_kv, kv[1:, :, c:]], axis=1)  # [n, 2m, c]
      gate = jnp.concatenate([prev_gate, gate[1:, :, c:]], axis=1)
    else:
      kv, gate = kv[1:], gate[1:]
    pooled = jnp.sum(jax.nn.softmax(gate, axis=1) * kv, axis=1)  # softmax over slots, per channel
    return apply_rope(self.norm(pooled), (first + jnp.arange(nwin - 1)) * m, freqs)

  def __call__(self, x: jnp.ndarray, freqs: np.ndarray) -> jnp.ndarray:
    """x: [S, hidden] (the prompt from position 0) -> [S // ratio, dim], rotated at each window start."""
    n = x.shape[0] // self.ratio
    ext, _ = extend(jnp.zeros((2 * self.ratio, x.shape[1]), x.dtype), x, 0, self.ratio)
    return self.pool(ext, 0, freqs)[:n] if n else jnp.zeros((0, self.dim), F32)

