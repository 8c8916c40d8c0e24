"""Radix top-k selection kernel (kernels_pallas/indexer/select.py), in interpret mode: the same ids as the sort-based
`finish_topk` on scores full of ties (few distinct levels, −0.0 beside +0.0, which lax.top_k ranks below it, −inf
where rows are invisible, queries that see fewer than k rows), with tiles that leave partial query and row tiles;
and the data really puts ties at the k-th place, so a wrong tie rule or a dropped visible tail would not pass.

One compiled kernel per tiling: the draws share it (each interpret-mode compile costs seconds)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.indexer import select
from kernels_pallas.indexer.reference import finish_topk
from indexer_inputs import INTERPRET

T, R, K = 20, 300, 64  # T not a multiple of the 8-query tile, R not a multiple of any row tile


def tied_scores(rng, levels):
  """[T, R] f32 on a few levels (so the k-th place is almost always a tie), zeros of both signs, negatives, and
  each query's invisible tail at −inf; nvis from below k to R."""
  s = rng.integers(-levels, levels + 1, (T, R)).astype(np.float32) * np.float32(0.75)
  zeros = s == 0
  s[zeros & (rng.random((T, R)) < 0.5)] = -0.0
  nvis = rng.integers(1, R + 1, T).astype(np.int32)
  nvis[::2] = R  # half the queries see every row
  nvis[1] = K    # exactly k visible: identity
  s[np.arange(R)[None, :] >= nvis[:, None]] = -np.inf
  return jnp.asarray(s), jnp.asarray(nvis)


@functools.cache
def selector(rows, cols):
  return jax.jit(lambda s, n: select.radix_topk_ids(s, n, K, block_q=rows, block_r=cols, num_warps=4, num_stages=1,
                                                   interpret=INTERPRET))


def test_the_gpu_kernel_body_in_interpret_mode(rng, monkeypatch):
  """The body a GPU compiles (the 16 digit passes unrolled, static shifts) run by the interpreter: interpret mode
  itself loops over the passes instead, so on a CPU-only CI this is the only check of the unrolled version."""
  body = select._kernel  # pylint: disable=protected-access
  monkeypatch.setattr(select, "_kernel", lambda *refs, interpret, **kw: body(*refs, interpret=False, **kw))
  s, nvis = tied_scores(rng, 3)
  got = select.radix_topk_ids(s, nvis, K, block_q=8, block_r=64, num_warps=4, num_stages=1, interpret=True)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(finish_topk(s, nvis, K)))


@pytest.mark.parametrize("rows,cols", [(8, 64), (1, 128)])
def test_radix_selection_equals_the_sort(rng, rows, cols):
  for levels in (2, 40, 10**6):  # the k-th place tied among many, among a few, (almost) never
    s, nvis = tied_scores(rng, levels)
    want = np.asarray(finish_topk(s, nvis, K))
    np.testing.assert_array_equal(np.asarray(selector(rows, cols)(s, nvis)), want, err_msg=f"levels {levels}")
    assert (np.asarray(nvis) > K).sum() >= T // 2


def test_the_data_would_catch_a_wrong_tie_rule_or_a_dropped_tail(rng):
  """On these scores, keeping the LAST tied ids instead of the first, or ignoring the last visible tile, changes
  the answer: the equality above can fail."""
  s, nvis = tied_scores(rng, 2)
  want = np.asarray(finish_topk(s, nvis, K))
  n = np.asarray(nvis)
  rows = n > K
  keys = np.asarray(select.order_keys(s)).astype(np.int64)
  ids = np.arange(R)
  # The same ranking with ties broken toward HIGHER ids.
  last_first = np.stack([np.sort(np.lexsort((-ids, -keys[t]))[:K]) for t in range(T)])
  assert (last_first[rows] != want[rows]).any()
  short = np.asarray(finish_topk(jnp.where(jnp.arange(R)[None, :] < (n - 64)[:, None], s, -jnp.inf), nvis, K))
  assert (short[rows] != want[rows]).any()
  np.testing.assert_array_equal(np.asarray(selector(8, 64)(s, nvis))[rows], want[rows])


def test_keys_keep_the_order_of_the_scores(rng):
  x = np.concatenate([rng.standard_normal(500).astype(np.float32) * 1e3, [0.0, -0.0, -np.inf, np.inf, 1e-45, -1e-45,
                                                                          3.4e38, -3.4e38]]).astype(np.float32)
  keys = np.asarray(select.order_keys(jnp.asarray(x))).astype(np.int64)
  order = np.lexsort((~np.signbit(x), x))  # by value, −0.0 before +0.0
  assert (np.diff(keys[order]) >= 0).all()
  same = (x[:, None] == x[None, :]) & (np.signbit(x)[:, None] == np.signbit(x)[None, :])  # bits, not values
  assert ((keys[:, None] == keys[None, :]) == same).all()
  assert keys[-7] < keys[-8]  # −0.0 below +0.0, as lax.top_k ranks them


def test_too_many_row_tiles_for_the_lane_counters_is_refused():
  R = 0xFFFF * 16 + 1  # one tile past what 16-bit per-lane counters can count
  with pytest.raises(ValueError, match="overflow its 16-bit lane counters; use block_r >= 32"):
    select.radix_topk_ids(jnp.zeros((1, R), jnp.float32), jnp.full((1,), R, jnp.int32), 4, block_q=1, block_r=16,
                          num_warps=4, num_stages=1, interpret=True)
