"""The Mosaic GPU (sm_90) grouped gate/up against the exact reference: in Mosaic GPU's interpret mode on CPU (which
simulates the warpgroups, the TMA copies and their barriers) and compiled on an H100/H200.

The routes cover what the work list can hold: experts with more rows than one row tile (several items each), an
item that only the first warpgroup's half covers, empty experts, masked routes (−1), and fewer SMs than units (each
SM loops). bf16 operands, bf16 h: the tolerance is bf16's rounding of h (NMSE ≤ 2e-5, measured ~3e-6).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from ds4jax.metrics import nmse
from kernels_pallas.moe import gate_up, routing
from kernels_pallas.moe.gate_up_wgmma import ROW_ALIGN, Tiling, gate_up_wgmma, gather_rows

ON_GPU = jax.default_backend() == "gpu"
LIMIT = 3.0
E, D, I = 8, 128, 256


def interpret():
  return None if ON_GPU else plgpu.InterpretGPUParams()


def problem(rng, S, K, *, mask_every=0, empty=()):
  x = jnp.asarray(rng.standard_normal((S, D)), jnp.bfloat16)
  w1, w3 = (jnp.asarray(2.0 / np.sqrt(D) * rng.standard_normal((E, I, D)), jnp.bfloat16) for _ in range(2))
  experts = np.setdiff1d(np.arange(E), empty)
  ids = np.stack([rng.permutation(experts)[:K] for _ in range(S)]).astype(np.int32)
  if mask_every:
    ids.reshape(-1)[mask_every - 1::mask_every] = -1
  return x, w1, w3, jnp.asarray(ids)


def check(x, w1, w3, ids, t: Tiling, num_sms: int):
  r = routing.route(ids, E, t.block_m)
  h = gate_up_wgmma(x, w1, w3, r, swiglu_limit=LIMIT, tiling=t, num_sms=num_sms, interpret=interpret())
  ref = gate_up.gate_up_reference(x, w1, w3, r, swiglu_limit=LIMIT)
  n = int(r.num_rows[0])
  assert float(jnp.mean(jnp.abs(ref[:n]))) > 0.1  # real values, both clamps reached below
  assert float(jnp.max(jnp.abs(ref[:n]))) >= 0.99 * LIMIT * LIMIT / (1 + np.exp(-LIMIT))
  err = nmse(h[:n].astype(jnp.float32), ref[:n])
  assert err <= 2e-5, err
  return r


@pytest.mark.parametrize("stages,in_flight", [(2, 0), (3, 1)])
def test_gate_up_wgmma_matches_reference(rng, stages, in_flight):
  # 80 tokens × top-3 over 7 experts (expert 5 empty, every 7th route masked): ~30 rows per expert, under one
  # warpgroup's 64, so the second warpgroup of every item stores nothing.
  x, w1, w3, ids = problem(rng, 80, 3, mask_every=7, empty=(5,))
  r = check(x, w1, w3, ids, Tiling(wg_rows=64, block_n=128, block_k=64, stages=stages, mma_in_flight=in_flight),
            num_sms=3)
  assert int(r.group_sizes[5]) == 0 and int(r.num_rows[0]) < 80 * 3


def test_gate_up_wgmma_several_items_per_expert(rng):
  # 300 tokens × top-4 over 8 experts: ~150 rows per expert, row tile 128 → a full item (both warpgroups) and
  # a second item that ends in the first warpgroup's half.
  x, w1, w3, ids = problem(rng, 300, 4)
  r = check(x, w1, w3, ids, Tiling(wg_rows=64, block_n=128, block_k=64, stages=2), num_sms=5)
  assert int(r.num_items[0]) > E


def test_gather_rows_aligns_each_expert(rng):
  x, _, _, ids = problem(rng, 40, 3, mask_every=5, empty=(2,))
  r = routing.route(ids, E, 128)
  xa, starts = gather_rows(x, r)
  sizes, offsets = np.asarray(r.group_sizes), np.asarray(r.group_offsets)
  xs = np.asarray(x)[np.asarray(r.token_of_row)]
  first = 0
  for e in range(E):
    assert first % ROW_ALIGN == 0
    np.testing.assert_array_equal(np.asarray(xa[first:first + sizes[e]]), xs[offsets[e]:offsets[e + 1]])
    pad = -(-sizes[e] // ROW_ALIGN) * ROW_ALIGN
    assert not np.any(np.asarray(xa[first + sizes[e]:first + pad], np.float32))
    first += pad
  items = np.asarray(r.item_expert)[:int(r.num_items[0])]
  assert np.all(np.asarray(starts)[:len(items)] % ROW_ALIGN == 0)
  assert xa.shape[0] % ROW_ALIGN == 0 and xa.shape[0] >= first + r.block_m


def test_gate_up_wgmma_rejects_bad_input(rng):
  x, w1, w3, ids = problem(rng, 16, 2)
  r = routing.route(ids, E, 64)
  with pytest.raises(ValueError, match="row tile 64"):
    gate_up_wgmma(x, w1, w3, r, swiglu_limit=LIMIT, tiling=Tiling(wg_rows=64))
  r = routing.route(ids, E, 128)
  with pytest.raises(ValueError, match="bf16/f16"):
    gate_up_wgmma(x.astype(jnp.float32), w1, w3, r, swiglu_limit=LIMIT)
  with pytest.raises(ValueError, match="decode MIX experts first"):
    gate_up_wgmma(x, w1.astype(jnp.float32), w3, r, swiglu_limit=LIMIT)
