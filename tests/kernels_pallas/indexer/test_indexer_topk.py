"""Indexer top-k (kernels_pallas/indexer/topk.py): exact equality with topk_reference on random inputs (ties
improbable), the output convention (ascending, −1 tail, identity for queries that see <= k rows), agreement with
ds4jax.indexer's best-first selection, the query-block memory bound and input checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ds4jax.features import pallas_calls
from kernels_pallas.indexer import Config, n_visible, scores_reference, topk, topk_reference
from indexer_inputs import INTERPRET, make_inputs


def cfg(bq=16, br=16, qb=32, **kw):
  return Config(block_q=bq, block_r=br, num_warps=4, num_stages=1, query_block=qb, **kw)


def check_convention(ids, q_start, R, k, ratio=4):
  """Every row: the first min(k, nvis) slots hold distinct visible ids in ascending order, the rest −1; identity
  when nvis <= k."""
  ids = np.asarray(ids)
  T = ids.shape[0]
  assert ids.shape == (T, k) and ids.dtype == np.int32
  nvis = np.minimum((q_start + np.arange(T) + 1) // ratio, R)
  for t in range(T):
    m = min(k, nvis[t])
    assert (ids[t, m:] == -1).all(), t
    head = ids[t, :m]
    assert (np.diff(head) > 0).all() and (head >= 0).all() and (head < nvis[t]).all(), t
    if nvis[t] <= k:
      np.testing.assert_array_equal(head, np.arange(m))


@pytest.mark.parametrize("T,Hi,c,R,q_start,k,bq,br,qb", [
    (50, 3, 16, 40, 0, 8, 16, 16, 32),       # from 0: identity rows (nvis <= 8) then scored rows; T % qb != 0
    (40, 2, 32, 100, 250, 16, 16, 32, 16),   # every query scored; R not a tile multiple
    (24, 2, 16, 90, 280, 128, 16, 32, 16),   # k > every query's visible rows: identity + −1 only
    (9, 2, 16, 32751, 130995, 64, 16, 512, 16),  # short chunk deep in a 128K prefill
])
def test_topk_matches_reference(T, Hi, c, R, q_start, k, bq, br, qb):
  q, w, keys = make_inputs(T + R + k, T, Hi, c, R)
  got = topk(q, w, keys, q_start=q_start, k=k, config=cfg(bq, br, qb), interpret=INTERPRET)
  want = topk_reference(q, w, keys, q_start=q_start, k=k)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  check_convention(got, q_start, R, k)


def test_radix_selection_gives_the_same_ids_as_the_sort():
  """config.selection="radix" (select.py) through the scoring kernel: the reference's ids, bit for bit, including
  the identity rows of a block that starts from position 0."""
  T, Hi, c, R, q_start, k = 50, 3, 16, 40, 0, 8
  q, w, keys = make_inputs(T + R + k, T, Hi, c, R)
  got = topk(q, w, keys, q_start=q_start, k=k, config=cfg(selection="radix"), interpret=INTERPRET)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(topk_reference(q, w, keys, q_start=q_start, k=k)))
  check_convention(got, q_start, R, k)
  with pytest.raises(ValueError, match="selection"):
    cfg(selection="heap").validate()


def test_topk_same_set_as_ds4jax_indexer():
  """Sorted, the picks equal what ds4jax.indexer.Indexer.__call__ returns best-first (lax.top_k of the scores)."""
  T, Hi, c, R, q_start, k = 32, 4, 32, 64, 120, 16
  q, w, keys = make_inputs(11, T, Hi, c, R)
  got = np.asarray(topk(q, w, keys, q_start=q_start, k=k, config=cfg(16, 32), interpret=INTERPRET))
  vals, idx = jax.lax.top_k(scores_reference(q, w, keys, q_start=q_start), k)
  best_first = np.where(np.isneginf(np.asarray(vals)), -1, np.asarray(idx))
  nvis = np.asarray(n_visible(q_start, T, R, 4))
  assert (nvis > k).sum() > 10  # most queries really select
  for t in range(T):
    want = sorted(i for i in best_first[t] if i >= 0)
    np.testing.assert_array_equal(got[t, :len(want)], want)
    assert (got[t, len(want):] == -1).all()


def test_topk_ties_prefer_lower_ids():
  """All-equal scores (one key repeated): the k lowest visible ids win, as with lax.top_k."""
  T, Hi, c, R, k = 16, 2, 16, 64, 8
  q, w, keys = make_inputs(12, T, Hi, c, R)
  keys = jnp.broadcast_to(keys[:1], (R, c))
  got = np.asarray(topk(q, w, keys, q_start=200, k=k, config=cfg(16, 16), interpret=INTERPRET))
  np.testing.assert_array_equal(got, np.broadcast_to(np.arange(k), (T, k)))


def test_identity_does_not_depend_on_scores():
  """NaN keys poison every score; queries that see <= k rows still get identity ids."""
  T, Hi, c, R, k = 40, 2, 16, 32, 4
  q, w, keys = make_inputs(13, T, Hi, c, R)
  keys = keys.at[1].set(jnp.nan)
  got = np.asarray(topk(q, w, keys, q_start=0, k=k, config=cfg(16, 16), interpret=INTERPRET))
  nvis = np.asarray(n_visible(0, T, R, 4))
  small = nvis <= k
  assert small.sum() >= 15 and (~small).sum() >= 15
  ident = np.where(np.arange(k)[None, :] < nvis[small, None], np.arange(k)[None, :], -1)
  np.testing.assert_array_equal(got[small], ident)


def test_all_identity_skips_the_kernel():
  """A static q_start where every query sees <= k rows runs no kernel; a traced one runs it under lax.cond."""
  T, Hi, c, R, k = 16, 2, 16, 64, 32
  q, w, keys = make_inputs(14, T, Hi, c, R)
  f_static = lambda q, w, kk: topk(q, w, kk, q_start=100, k=k, config=cfg(), interpret=INTERPRET)
  assert pallas_calls(f_static, q, w, keys) == []
  f_traced = lambda q, w, kk, s: topk(q, w, kk, q_start=s, k=k, config=cfg(), interpret=INTERPRET)
  assert [n for n, _ in pallas_calls(f_traced, q, w, keys, jnp.int32(100))] == ["indexer_scores"]
  want = topk_reference(q, w, keys, q_start=100, k=k)
  np.testing.assert_array_equal(np.asarray(f_static(q, w, keys)), np.asarray(want))
  np.testing.assert_array_equal(np.asarray(jax.jit(f_traced)(q, w, keys, jnp.int32(100))), np.asarray(want))


def _max_2d_elems(jaxpr):
  """The largest number of elements of any intermediate in `jaxpr` and its sub-jaxprs."""
  best = 0
  for eqn in jaxpr.eqns:
    for v in eqn.outvars:
      shape = getattr(v.aval, "shape", ())
      best = max(best, int(np.prod(shape)) if shape else 1)
    for p in eqn.params.values():
      for sub in p if isinstance(p, (tuple, list)) else [p]:
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          best = max(best, _max_2d_elems(sub.jaxpr))
        elif isinstance(sub, jax.extend.core.Jaxpr):
          best = max(best, _max_2d_elems(sub))
  return best


def test_no_tokens_by_rows_array():
  """With query_block 32 over 256 queries and 512 rows, no intermediate reaches [T, R] (only [32, R] + slack)."""
  T, Hi, c, R, k = 256, 2, 16, 512, 16
  q, w, keys = make_inputs(15, T, Hi, c, R)
  jaxpr = jax.make_jaxpr(lambda q, w, kk: topk(q, w, kk, q_start=1800, k=k, config=cfg(16, 64, 32),
                                               interpret=INTERPRET))(q, w, keys).jaxpr
  assert 32 * R <= _max_2d_elems(jaxpr) <= 2 * 32 * R + 64


def test_traced_q_start_matches():
  T, Hi, c, R, k = 30, 2, 16, 80, 8
  q, w, keys = make_inputs(16, T, Hi, c, R)
  f = jax.jit(lambda q, w, kk, s: topk(q, w, kk, q_start=s, k=k, config=cfg(16, 32, 16), interpret=INTERPRET))
  for s in (0, 33, 290):
    np.testing.assert_array_equal(np.asarray(f(q, w, keys, jnp.int32(s))),
                                  np.asarray(topk_reference(q, w, keys, q_start=s, k=k)))
  assert f._cache_size() == 1


@pytest.mark.parametrize("bad,match", [("k3", "power of two"), ("k0", "power of two"), ("c", "keys shape"),
                                       ("Hi", "w shape"), ("T", "w shape")])
def test_topk_rejects_bad_inputs(bad, match):
  q, w, keys = make_inputs(17, 8, 2, 16, 16)
  k = {"k3": 3, "k0": 0}.get(bad, 4)
  if bad == "c":
    keys = jnp.zeros((16, 32))
  elif bad == "Hi":
    w = jnp.zeros((8, 3))
  elif bad == "T":
    w = w[:5]
  with pytest.raises(ValueError, match=match):
    topk(q, w, keys, q_start=40, k=k, interpret=INTERPRET)


def test_topk_no_rows():
  q, w, keys = make_inputs(18, 6, 2, 16, 0)
  got = topk(q, w, keys, q_start=1000, k=8, interpret=INTERPRET)
  np.testing.assert_array_equal(np.asarray(got), -np.ones((6, 8), np.int32))


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(T=st.integers(1, 40), Hi=st.integers(1, 3), R=st.integers(1, 90), q_start=st.integers(0, 400),
       logk=st.integers(0, 5), ratio=st.sampled_from([1, 2, 4]), seed=st.integers(0, 2**16))
def test_topk_hypothesis(T, Hi, R, q_start, logk, ratio, seed):
  k = 1 << logk
  q, w, keys = make_inputs(seed, T, Hi, 16, R)
  got = topk(q, w, keys, q_start=q_start, k=k, ratio=ratio, config=cfg(16, 32, 16), interpret=INTERPRET)
  np.testing.assert_array_equal(np.asarray(got),
                                np.asarray(topk_reference(q, w, keys, q_start=q_start, k=k, ratio=ratio)))
  check_convention(got, q_start, R, k, ratio)
