"""Radix top-k selection (kernels_pallas/indexer/select.py): the same ids as the sort-based `finish_topk` on scores
full of ties (few distinct levels, −0.0 beside +0.0, which lax.top_k ranks below it, −inf where rows are invisible),
at every digit width; and a wrong tie rule does not pass."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.indexer import select
from kernels_pallas.indexer.reference import finish_topk


def tied_scores(rng, T, R, levels):
  """[T, R] f32 on a few levels (so the k-th place is almost always a tie), zeros of both signs, negatives, and
  each query's invisible tail at −inf; nvis from below k to R."""
  s = rng.integers(-levels, levels + 1, (T, R)).astype(np.float32) * np.float32(0.75)
  zeros = s == 0
  s[zeros & (rng.random((T, R)) < 0.5)] = -0.0
  nvis = rng.integers(1, R + 1, T).astype(np.int32)
  nvis[::2] = R  # half the queries see every row
  s[np.arange(R)[None, :] >= nvis[:, None]] = -np.inf
  return jnp.asarray(s), jnp.asarray(nvis)


@pytest.mark.parametrize("T,R,k,levels,digit_bits", [
    (64, 200, 16, 3, 4), (32, 64, 63, 2, 4), (48, 300, 128, 40, 4), (8, 17, 16, 1, 4),  # the default digit
    (64, 200, 16, 3, 1), (32, 64, 63, 2, 2), (48, 300, 128, 40, 8),                      # the other widths
])
def test_radix_selection_equals_the_sort(rng, T, R, k, levels, digit_bits):
  s, nvis = tied_scores(rng, T, R, levels)
  want = np.asarray(finish_topk(s, nvis, k))
  got = np.asarray(jax.jit(lambda a, b: select.radix_topk_ids(a, b, k, digit_bits))(s, nvis))
  np.testing.assert_array_equal(got, want)
  assert (np.asarray(nvis) > k).sum() >= T // 2


def test_keys_keep_the_order_of_the_scores(rng):
  x = np.concatenate([rng.standard_normal(500).astype(np.float32) * 1e3, [0.0, -0.0, -np.inf, np.inf, 1e-45, -1e-45,
                                                                          3.4e38, -3.4e38]]).astype(np.float32)
  keys = np.asarray(select.order_keys(jnp.asarray(x))).astype(np.int64)
  order = np.lexsort((~np.signbit(x), x))  # by value, −0.0 before +0.0
  assert (np.diff(keys[order]) >= 0).all()
  same = (x[:, None] == x[None, :]) & (np.signbit(x)[:, None] == np.signbit(x)[None, :])  # bits, not values
  assert ((keys[:, None] == keys[None, :]) == same).all()
  assert keys[-7] < keys[-8]  # −0.0 below +0.0, as lax.top_k ranks them


def test_a_wrong_tie_rule_is_caught(rng):
  """Keeping the LAST tied ids instead of the first changes the answer on these scores: the check can fail."""
  s, nvis = tied_scores(rng, 64, 200, 3)
  k = 16
  keys = select.order_keys(s)
  t = select.kth_largest_key(keys, k)[:, None]
  above, tied = keys > t, keys == t
  need = k - jnp.sum(above, axis=1, dtype=jnp.int32)[:, None]
  last_first = jnp.cumsum(tied[:, ::-1], axis=1)[:, ::-1] <= need
  keep = above | (tied & last_first)
  wrong = jnp.where(keep, jnp.arange(200)[None, :], 10**6).sort(axis=1)[:, :k]
  want = np.asarray(finish_topk(s, nvis, k))
  rows = np.asarray(nvis) > k
  assert (np.asarray(wrong)[rows] != want[rows]).any()
  np.testing.assert_array_equal(np.asarray(select.radix_topk_ids(s, nvis, k))[rows], want[rows])
