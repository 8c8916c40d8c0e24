"""Plain-jnp oracle of the indexer (f32, Precision.HIGHEST), the same math as ds4jax.indexer.Indexer.scores /
__call__ and ds4jax.compressor.visible_rows, with the kernel package's output convention for top-k:

  score[t, s] = Σ_h w[t,h] · relu(q[t,h] · k[s])    if s < (q_start + t + 1) // ratio, else −inf
  topk[t]     = ids of the k best visible rows (ties: lower id first, as lax.top_k), SORTED ASCENDING, then −1;
                a query that sees <= k rows gets the identity ids 0..n_visible−1 (then −1) without looking at
                scores.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

F32 = jnp.float32
I32 = jnp.int32
HIGHEST = jax.lax.Precision.HIGHEST


def n_visible(q_start, num_queries: int, num_rows: int, ratio: int) -> jax.Array:
  """[T] int32: how many compressed rows query t (absolute position q_start + t) sees, capped at num_rows."""
  pos = jnp.asarray(q_start, I32) + jnp.arange(num_queries, dtype=I32)
  return jnp.minimum((pos + 1) // ratio, num_rows)


def scores_reference(q, w, keys, *, q_start, ratio: int = 4) -> jax.Array:
  """f32 [T, R] scores, −inf where the row is not yet visible."""
  q, w, keys = (jnp.asarray(a).astype(F32) for a in (q, w, keys))
  T, R = q.shape[0], keys.shape[0]
  qk = jnp.einsum("thc,rc->thr", q, keys, precision=HIGHEST)
  s = jnp.einsum("th,thr->tr", w, jax.nn.relu(qk), precision=HIGHEST)
  vis = jnp.arange(R, dtype=I32)[None, :] < n_visible(q_start, T, R, ratio)[:, None]
  return jnp.where(vis, s, -jnp.inf)


def finish_topk(scores, nvis, k: int) -> jax.Array:
  """[T, R] scores (−inf = invisible) and [T] visible counts → int32 [T, k]: lax.top_k, −1 for −inf picks,
  identity ids where nvis <= k, sorted ascending with the −1 tail. Shared by the reference and the kernel path
  (this is XLA work in both)."""
  T, R = scores.shape
  kk = min(k, R)
  if kk > 0:
    vals, idx = jax.lax.top_k(scores, kk)
    idx = jnp.where(jnp.isneginf(vals), -1, idx).astype(I32)
  else:
    idx = jnp.zeros((T, 0), I32)
  if kk < k:
    idx = jnp.pad(idx, ((0, 0), (0, k - kk)), constant_values=-1)
  slot = jnp.arange(k, dtype=I32)[None, :]
  ident = jnp.where(slot < nvis[:, None], slot, -1)
  idx = jnp.where((nvis <= k)[:, None], ident, idx)
  return sort_ids(idx)


def sort_ids(idx) -> jax.Array:
  """Ascending row ids with every −1 moved to the tail."""
  big = jnp.iinfo(I32).max
  s = jnp.sort(jnp.where(idx < 0, big, idx), axis=-1)
  return jnp.where(s == big, -1, s).astype(I32)


def topk_reference(q, w, keys, *, q_start, k: int, ratio: int = 4) -> jax.Array:
  """int32 [T, k]: see the module docstring."""
  s = scores_reference(q, w, keys, q_start=q_start, ratio=ratio)
  return finish_topk(s, n_visible(q_start, s.shape[0], s.shape[1], ratio), k)
