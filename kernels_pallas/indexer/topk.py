"""Indexer top-k: per query the ids of its k best visible compressed rows, sorted ascending, −1 padded.

    topk(q, w, keys, q_start=, k=512) → int32 [T, k]

Queries are processed in blocks of `config.query_block` (lax.map): a block is scored by the Pallas kernel
(scoring.py) into a [query_block, R] f32 array and reduced in XLA (`jax.lax.top_k`, or without a sort by a radix
selection kernel, select.py: `config.selection`), so no [T, R] array ever exists (T = 8192, R = 32K: 128 MiB per
1024-query block instead of 1 GiB). A block whose queries all see <= k rows skips the kernel (lax.cond) and emits
identity ids; inside a scored block such queries are overridden with identity ids too, so they never depend on scores
(Lucebox: "tokens that see <= 512 rows use identity indices").
The ascending order is the direct handoff (docs/upstream.md §3): attention consumes rows in physical order, the
order the mask path rebuilds (handoff.py), so both paths reduce in the same order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.indexer.config import Config, default_platform, is_pow2
from kernels_pallas.indexer.reference import finish_topk, n_visible
from kernels_pallas.indexer.scoring import as_q_start, check_inputs, scores
from kernels_pallas.indexer.select import radix_topk_ids

I32 = jnp.int32


def identity_ids(nvis, k: int) -> jax.Array:
  """[T, k]: 0..nvis−1 then −1 (the answer for a query that sees <= k rows)."""
  slot = jnp.arange(k, dtype=I32)[None, :]
  return jnp.where(slot < nvis[:, None], slot, -1)


def topk(q, w, keys, *, q_start, k: int, ratio: int = 4, config: Config | None = None,
         interpret: bool = False) -> jax.Array:
  """int32 [T, k]: for each query the ids of its k best visible rows (ties: lower id first), sorted ascending,
  then −1; queries that see <= k rows get 0..n_visible−1 then −1. Arguments as `scoring.scores`; k must be a
  power of two."""
  check_inputs(q, w, keys, ratio)
  if not is_pow2(k):
    raise ValueError(f"k must be a power of two, got {k!r}")
  T, Hi, c = q.shape
  R = keys.shape[0]
  if config is None:
    config = Config.default(T, R, Hi, c, platform=default_platform())
  config.validate()
  qs = as_q_start(q_start)[0]
  if T == 0:
    return jnp.zeros((0, k), I32)
  nvis_all = n_visible(qs, T, R, ratio)
  if R == 0 or (isinstance(q_start, int) and (q_start + T) // ratio <= k):
    return identity_ids(nvis_all, k)  # statically known: nobody needs scores

  qb = min(config.query_block, T)
  nb = -(-T // qb)
  pad = nb * qb - T
  q = q.astype(config.dtype)  # round once, outside the loop (the kernel reads q once per row tile)
  if pad:
    q = jnp.pad(q, ((0, pad), (0, 0), (0, 0)))
    w = jnp.pad(w, ((0, pad), (0, 0)))
  keys = keys.astype(config.dtype)

  def block(args):
    b, qb_, wb_ = args
    start = qs + b * qb
    nvis = n_visible(start, qb, R, ratio)
    last_real = jnp.minimum(qb, T - b * qb) - 1
    needs_scores = nvis[last_real] > k

    def scored():
      s = scores(qb_, wb_, keys, q_start=start, ratio=ratio, config=config, interpret=interpret)
      if config.selection == "radix":
        return radix_topk_ids(s, nvis, k, block_q=config.select_rows, block_r=config.select_cols,
                              num_warps=config.select_warps, num_stages=1, interpret=interpret)
      return finish_topk(s, nvis, k)

    return jax.lax.cond(needs_scores, scored, lambda: identity_ids(nvis, k))

  out = jax.lax.map(block, (jnp.arange(nb, dtype=I32), q.reshape(nb, qb, Hi, c), w.reshape(nb, qb, Hi)))
  return out.reshape(nb * qb, k)[:T]
