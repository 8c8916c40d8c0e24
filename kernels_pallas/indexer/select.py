"""Exact top-k ids without a sort: radix selection of the k-th largest score, then one pass that keeps what is above.

    radix_topk_ids(scores [T, R], nvis [T], k) -> int32 [T, k]      # the contract of reference.finish_topk

`jax.lax.top_k` sorts every row (on a GPU a segmented radix sort of the whole [T, R] block), although the indexer
only needs the SET of the k best rows: attention takes them in ascending id order (docs/upstream.md §3). Here:
  1. scores become order-preserving uint32 keys in IEEE total order (a < b iff key(a) < key(b), and −0.0 below
     +0.0: lax.top_k ranks them so too);
  2. the k-th largest key is built digit by digit from the top, `digit_bits` bits per pass: each pass counts, per
     query, the keys at or above each candidate digit and keeps the largest digit that still has k keys above;
  3. one pass keeps the keys above that threshold, plus as many keys equal to it as k still needs, lower ids first
     (lax.top_k's tie rule), and writes their ids in ascending order.
The ids are exactly `finish_topk`'s (the indexer's scores are finite, −inf where invisible; NaN is not handled).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

I32 = jnp.int32
U32 = jnp.uint32


def order_keys(scores) -> jax.Array:
  """uint32 keys in the total order of the f32 scores: flip every bit of negatives, the sign bit of the rest."""
  bits = jax.lax.bitcast_convert_type(scores.astype(jnp.float32), U32)
  negative = (bits >> 31) == 1
  return jnp.where(negative, ~bits, bits | U32(0x80000000))


def kth_largest_key(keys, k: int, digit_bits: int = 4) -> jax.Array:
  """[T] uint32: the k-th largest of each row of `keys` [T, R] (k <= R), digit by digit from the top."""
  if 32 % digit_bits:
    raise ValueError(f"digit_bits must divide 32, got {digit_bits}")
  digits = jnp.arange(1, 1 << digit_bits, dtype=U32)
  prefix = jnp.zeros(keys.shape[:1], U32)
  for shift in range(32 - digit_bits, -1, -digit_bits):
    candidates = prefix[:, None] | (digits[None, :] << shift)                                   # [T, 2^d − 1]
    at_or_above = jnp.sum(keys[:, :, None] >= candidates[:, None, :], axis=1, dtype=I32)     # [T, 2^d − 1]
    # The counts fall as the digit grows, so the number of digits that keep k keys at or above them is the
    # largest such digit (digit 0 always does: the invariant).
    best = jnp.sum(at_or_above >= k, axis=1, dtype=I32).astype(U32)
    prefix = prefix | (best << shift)
  return prefix


def radix_topk_ids(scores, nvis, k: int, digit_bits: int = 4) -> jax.Array:
  """int32 [T, k]: the ids of each query's k best scores (ties: lower id first) in ascending order, −1 padded;
  identity ids 0..nvis−1 where nvis <= k (scores not read). Same contract and result as `finish_topk`."""
  T, R = scores.shape
  slot = jnp.arange(k, dtype=I32)[None, :]
  identity = jnp.where(slot < nvis[:, None], slot, -1)
  if R <= k:  # every query sees <= R <= k rows
    return identity
  keys = order_keys(scores)
  t = kth_largest_key(keys, k, digit_bits)[:, None]
  above, tied = keys > t, keys == t
  need = k - jnp.sum(above, axis=1, dtype=I32)[:, None]
  keep = above | (tied & (jnp.cumsum(tied, axis=1, dtype=I32) <= need))
  rank = jnp.where(keep, jnp.cumsum(keep, axis=1, dtype=I32) - 1, k)  # exactly k kept: ranks 0 .. k−1
  ids = jnp.broadcast_to(jnp.arange(R, dtype=I32), (T, R))
  picked = jnp.full((T, k + 1), -1, I32).at[jnp.arange(T)[:, None], rank].set(ids, mode="drop")[:, :k]
  return jnp.where((nvis <= k)[:, None], identity, picked)
