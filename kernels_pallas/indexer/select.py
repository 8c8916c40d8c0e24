"""Exact top-k ids without a sort: a Pallas-Triton radix selection of the k-th largest score, then one pass that
keeps what is above it.

    radix_topk_ids(scores [T, R], nvis [T], k) -> int32 [T, k]      # the contract of reference.finish_topk

`jax.lax.top_k` sorts every row (on a GPU a segmented radix sort of the whole [T, R] block), although the indexer
only needs the SET of the k best rows: attention takes them in ascending id order (docs/upstream.md §3). Here one
program owns `select_rows` queries and streams their visible scores in [select_rows, select_cols] tiles:
  1. scores become order-preserving int32 keys (a < b iff key(a) < key(b), and −0.0 below +0.0: lax.top_k ranks
     them so too); the digits below are those of key + 2^31, the unsigned view;
  2. the k-th largest key is built 2 bits at a time from the top (16 passes over the scores): a pass counts, per
     query, the keys at or above each of the 3 candidates prefix | d·2^shift and keeps the largest digit d that
     still has k keys at or above it; the count above the chosen range rides along, so after the last pass the
     number of keys strictly above the threshold is known without another pass;
  3. one pass keeps the keys above the threshold, plus as many keys equal to it as k still needs, lower ids first
     (lax.top_k's tie rule), and scatters their ids to ascending slots (a running count plus an in-tile cumsum).
Only the visible prefix of each query is read: with more than k visible rows the threshold is finite, and the
invisible −inf keys can change neither a count at a candidate above it nor the kept set. Queries that see <= k
rows get identity ids, as in `finish_topk`. The indexer's scores are finite where visible; outside that contract
the two differ: a visible −inf that makes the k best is a real id here and −1 in `finish_topk`, and NaN is not
handled.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

I32 = jnp.int32
DIGIT_BITS = 2  # 16 passes of 3 compares beat 8 of 15 on the H200 (BENCHMARKS.md, indexer top-k)
INT_MIN = -(1 << 31)


def _i32(u: int) -> int:
  """The int32 with the bits of the uint32 `u` (a digit shifted into the sign bit)."""
  u &= 0xFFFFFFFF
  return u - (1 << 32) if u >= 1 << 31 else u


def order_keys(scores) -> jax.Array:
  """int32 keys in the total order of the f32 scores: a non-negative float's bits are already ordered; a negative
  one's magnitude bits are flipped so that a larger magnitude sorts lower (−0.0 becomes −1, below +0.0's 0)."""
  bits = jax.lax.bitcast_convert_type(scores.astype(jnp.float32), I32)
  return jnp.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


def _kernel(s_ref, nvis_ref, o_ref, *, T: int, k: int, block_q: int, block_r: int, interpret: bool):
  q0 = pl.program_id(0) * block_q
  rows = q0 + jnp.arange(block_q, dtype=I32)
  nvis = plt.load(nvis_ref.at[pl.ds(q0, block_q)], mask=rows < T, other=0)
  n_tiles = (jnp.max(nvis) + block_r - 1) // block_r  # only the tile's visible prefix is read

  def keys_of(j):
    cols = j * block_r + jnp.arange(block_r, dtype=I32)
    live = cols[None, :] < nvis[:, None]
    x = plt.load(s_ref.at[pl.ds(q0, block_q), pl.ds(j * block_r, block_r)], mask=live, other=0.0)
    return jnp.where(live, order_keys(x), INT_MIN), cols  # INT_MIN: unsigned 0, below every candidate

  n_digits = (1 << DIGIT_BITS) - 1

  def digit_pass(p, carry):
    prefix, above = carry  # the threshold's unsigned bits found so far; keys above the current candidate range
    shift = 32 - DIGIT_BITS * (p + 1)
    digit = (lambda d: _i32(d << shift)) if isinstance(shift, int) else (lambda d: jnp.int32(d) << shift)
    cands = [(prefix | digit(d)) ^ INT_MIN for d in range(1, n_digits + 1)]  # signed compare values

    # Per lane, two 16-bit counters in one int32 (a lane sees one key per tile): one row sum per pass, not per tile.
    def count(j, lanes):
      key, _ = keys_of(j)
      hits = [(key >= c[:, None]).astype(I32) for c in cands] + [0]
      return tuple(n + hits[2 * i] + (hits[2 * i + 1] << 16) for i, n in enumerate(lanes))

    lanes = jax.lax.fori_loop(0, n_tiles, count, (jnp.zeros((block_q, block_r), I32),) * ((n_digits + 1) // 2))
    counts = [jnp.sum((lanes[i // 2] >> (16 * (i % 2))) & 0xFFFF, axis=1) for i in range(n_digits)]
    # Counts fall as the digit grows, so the number of digits with k keys at or above is the largest such digit.
    best = sum((n >= k).astype(I32) for n in counts)
    above = sum(jnp.where(best + 1 == d, n, 0) for d, n in enumerate(counts, 1)) + jnp.where(best == n_digits,
                                                                                              above, 0)
    return prefix | (best << shift), above

  # Unrolled on a GPU (what ran on the H200); a loop in interpret mode, where XLA would compile 16 copies of it.
  carry = (jnp.zeros((block_q,), I32),) * 2
  if interpret:
    carry = jax.lax.fori_loop(0, 32 // DIGIT_BITS, digit_pass, carry)
  else:
    for p in range(32 // DIGIT_BITS):
      carry = digit_pass(p, carry)
  prefix, above = carry
  threshold = prefix ^ INT_MIN
  need = k - above  # keys equal to the threshold still to keep, lowest ids first

  def keep_tile(j, carry):
    kept, ties = carry
    key, cols = keys_of(j)
    tied = (key == threshold[:, None]).astype(I32)
    keep = (key > threshold[:, None]) | ((tied == 1) & (ties[:, None] + jnp.cumsum(tied, axis=1) <= need[:, None]))
    keep_i = keep.astype(I32)
    # Dropped keys aim at the spare column k: interpret mode writes masked lanes back with their old value.
    slot = jnp.where(keep, kept[:, None] + jnp.cumsum(keep_i, axis=1) - 1, k)
    ids = jnp.broadcast_to(cols[None, :], (block_q, block_r))
    plt.store(o_ref.at[rows[:, None], slot], ids, mask=keep & (rows < T)[:, None])
    return kept + jnp.sum(keep_i, axis=1), ties + jnp.sum(tied, axis=1)

  jax.lax.fori_loop(0, n_tiles, keep_tile, (jnp.zeros((block_q,), I32), jnp.zeros((block_q,), I32)))


def radix_topk_ids(scores, nvis, k: int, *, block_q: int, block_r: int, num_warps: int, num_stages: int,
                   interpret: bool = False) -> jax.Array:
  """int32 [T, k]: the ids of each query's k best scores (ties: lower id first) in ascending order, −1 padded;
  identity ids 0..nvis−1 where nvis <= k (scores not read). Same result as `finish_topk` for finite visible
  scores; scores past a query's nvis (<= R) are never read. block_q / block_r: the [queries, rows] tile of one
  program's passes."""
  T, R = scores.shape
  slot = jnp.arange(k, dtype=I32)[None, :]
  identity = jnp.where(slot < nvis[:, None], slot, -1)
  if R <= k or T == 0:  # every query sees <= R <= k rows
    return identity
  if -(-R // block_r) > 0xFFFF:
    raise ValueError(f"radix_topk_ids: {R} rows in tiles of {block_r} overflow its 16-bit lane counters; "
                     f"use block_r >= {1 << (-(-R // 0xFFFF) - 1).bit_length()}")
  selected = nvis > k
  kernel = functools.partial(_kernel, T=T, k=k, block_q=block_q, block_r=block_r, interpret=interpret)
  picked = pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((T, k + 1), I32), grid=(pl.cdiv(T, block_q),), interpret=interpret,
      name="indexer_radix_select",
      compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
  )(scores.astype(jnp.float32), jnp.where(selected, nvis, 0).astype(I32))  # nvis 0: nothing read, nothing kept
  return jnp.where(selected[:, None], picked[:, :k], identity)
