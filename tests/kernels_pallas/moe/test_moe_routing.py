"""Routing metadata (kernels_pallas/moe/routing.py): sort by expert, counts/offsets, inverse permutation, and the
compact / dense work lists, checked against numpy on concrete and random routings."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernels_pallas.moe import routing

_route = jax.jit(routing.route, static_argnums=(1, 2))
_dense = jax.jit(routing.dense_work_items)


def check_routing(ids: np.ndarray, E: int, bm: int):
  S, K = ids.shape
  R = S * K
  r = _route(jnp.asarray(ids, jnp.int32), E, bm)
  r_np = jax.tree.map(np.asarray, r)
  flat = ids.reshape(-1)
  valid = (flat >= 0) & (flat < E)
  n = int(valid.sum())
  assert int(r_np.num_rows[0]) == n

  # Every unmasked route appears exactly once among the first n rows, masked ones after them.
  order = r_np.route_of_row
  assert sorted(order.tolist()) == list(range(R))
  assert sorted(order[:n].tolist()) == np.flatnonzero(valid).tolist()
  assert not valid[order[n:]].any()

  # Rows are grouped by expert, in token order within an expert (stable sort).
  sizes = np.bincount(flat[valid], minlength=E)
  np.testing.assert_array_equal(r_np.group_sizes, sizes)
  np.testing.assert_array_equal(r_np.group_offsets, np.concatenate([[0], np.cumsum(sizes)]))
  for e in range(E):
    lo, hi = r_np.group_offsets[e], r_np.group_offsets[e + 1]
    assert (flat[order[lo:hi]] == e).all()
    assert (np.diff(order[lo:hi]) > 0).all()
  np.testing.assert_array_equal(r_np.token_of_row[:n], order[:n] // K)
  assert (r_np.token_of_row[n:] == 0).all()

  # Inverse permutation.
  inv = r_np.row_of_route.reshape(-1)
  assert (inv[~valid] == -1).all()
  np.testing.assert_array_equal(order[inv[valid]], np.flatnonzero(valid))

  # Compact work list: the valid prefix equals the numpy reference, the rest is padding.
  ref = routing.routing_reference(np.where(valid.reshape(S, K), ids, -1), E, bm)
  T = int(r_np.num_items[0])
  assert r_np.max_items == routing.max_work_items(R, E, bm) >= T
  items = list(zip(r_np.item_expert[:T].tolist(), r_np.item_start[:T].tolist(), r_np.item_end[:T].tolist()))
  assert items == ref["items"]
  assert (r_np.item_expert[T:] == -1).all() and (r_np.item_start[T:] >= r_np.item_end[T:]).all()
  assert {e for e, _, _ in items} == {e for e in range(E) if sizes[e]}  # empty experts have no items
  covered = np.zeros(R, int)
  for e, s, end in items:
    assert r_np.group_offsets[e] <= s < end == r_np.group_offsets[e + 1]
    covered[s:min(s + bm, end)] += 1
  np.testing.assert_array_equal(covered, (np.arange(R) < n).astype(int))  # every row exactly once

  # Dense work list: every expert x ceil(R / bm) tiles; the non-empty ones are exactly the compact items.
  de, ds, dend, dcount = (np.asarray(a) for a in _dense(r))
  assert int(dcount[0]) == len(de) == E * -(-R // bm)
  dense_items = [(e, s, x) for e, s, x in zip(de.tolist(), ds.tolist(), dend.tolist()) if s < x]
  assert dense_items == items
  return r_np


@pytest.mark.parametrize("S,K,E,bm", [(1, 1, 1, 16), (9, 3, 8, 16), (16, 6, 16, 32), (37, 4, 5, 16), (64, 6, 16, 64)])
def test_route_random(rng, S, K, E, bm):
  ids = np.stack([rng.permutation(E)[:K] if K <= E else rng.integers(0, E, K) for _ in range(S)]).astype(np.int32)
  ids.reshape(-1)[4::5] = -1  # every 5th route masked
  check_routing(ids, E, bm)


def test_route_all_to_one_expert_and_empty_experts():
  ids = np.full((13, 3), 5, np.int32)  # duplicates inside a token are allowed
  r = check_routing(ids, 8, 16)
  assert r.group_sizes.tolist() == [0, 0, 0, 0, 0, 39, 0, 0]
  assert int(r.num_items[0]) == 3  # 39 rows in tiles of 16: the last tile is partial


def test_route_all_masked():
  ids = np.full((6, 2), -1, np.int32)
  r = check_routing(ids, 4, 16)
  assert int(r.num_items[0]) == 0 and (r.row_of_route == -1).all()


def test_route_out_of_range_ids_are_dropped_on_device():
  ids = np.array([[0, 9], [-7, 1]], np.int32)  # jit cannot raise: out-of-range ids behave like masked routes
  r = _route(jnp.asarray(ids), 4, 16)
  assert int(r.num_rows[0]) == 2
  assert np.asarray(r.row_of_route).tolist() == [[0, -1], [-1, 1]]


def test_max_work_items_bound_is_reached():
  # E - 1 experts with one row each and one expert with the rest: every tile but one is a 1-row tile.
  E, bm, R = 8, 16, 7 + 16 * 3 + 1
  ids = np.concatenate([np.arange(E - 1), np.full(R - (E - 1), E - 1)]).astype(np.int32).reshape(-1, 1)
  r = check_routing(ids, E, bm)
  assert int(r.num_items[0]) == (E - 1) + 4 == routing.max_work_items(R, E, bm)


def test_route_lowers_without_a_loop():
  # on a GPU a while loop (searchsorted's default method) runs as a chain of small launches before every MoE kernel
  ids = jnp.zeros((64, 2), jnp.int32)
  assert "stablehlo.while" not in jax.jit(lambda i: routing.route(i, 16, 8)).lower(ids).as_text()


def test_check_routes():
  routing.check_routes(np.array([[0, 3], [-1, 2]]), 4)
  with pytest.raises(ValueError, match=r"route_ids\[1, 0\] = 4 is out of range"):
    routing.check_routes(np.array([[0, 3], [4, 2]]), 4)
  with pytest.raises(ValueError, match=r"= -2 is out of range"):
    routing.check_routes(np.array([[0, -2]]), 4)
  with pytest.raises(ValueError, match="must be integers"):
    routing.check_routes(np.array([[0.0, 1.0]]), 4)
  with pytest.raises(ValueError, match=r"must be \[S, K\]"):
    routing.check_routes(np.array([0, 1]), 4)
  jax.jit(lambda i: routing.check_routes(i, 1) or i)(jnp.array([[5]]))  # tracers: nothing to check


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(S=st.integers(1, 40), K=st.integers(1, 6), E=st.sampled_from([1, 3, 8, 16]), bm=st.sampled_from([16, 32]),
       p_mask=st.sampled_from([0.0, 0.2, 1.0]), seed=st.integers(0, 2**31 - 1))
def test_route_hypothesis(S, K, E, bm, p_mask, seed):
  g = np.random.default_rng(seed)
  ids = g.integers(0, E, (S, K)).astype(np.int32)
  ids[g.uniform(size=(S, K)) < p_mask] = -1
  check_routing(ids, E, bm)
