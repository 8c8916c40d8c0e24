"""kernels_pallas/moe/gate_up_mix_decoder.py: the FP2-MIX gate/up with a decoding warpgroup, against the exact
reference and gate_up_wgmma's kernel (interpret mode on CPU with the race detector; compiled on an H200)."""

import jax.numpy as jnp
import numpy as np
import pytest

from ds4jax.metrics import nmse
from kernels_pallas.moe import QuantizedExpertWeights, dequantize_to_dense, gate_up, routing
from kernels_pallas.moe.gate_up_mix_decoder import gate_up_mix_decoder
from kernels_pallas.moe.gate_up_wgmma import Tiling, gate_up_wgmma, mix_stack
from tests.kernels_pallas.moe.test_moe_gate_up_wgmma import E, LIMIT, assert_no_races, interpret, mix_storage, problem


def test_gate_up_mix_decoder_matches_the_reference_and_the_one_warpgroup_decode(rng):
  # ~80 rows per expert in 128-row tiles (a partial second block), 2 N tiles, D = 512: 8 K steps over rings of 2 x
  # slots, 4 code slots and 2 decoded slots, on 6 SMs (several units each). Expert 0's storage is uniform (mode 0).
  D_ = 512
  x, w1, w3, ids = problem(rng, 160, 4, inter=128, d=D_)
  st1, st3 = mix_storage(rng, w1.shape), mix_storage(rng, w3.shape)
  q1, q3 = (QuantizedExpertWeights.from_storage("rocmfp2_mix", st, (E, 128, D_)) for st in (st1, st3))
  r = routing.route(ids, E, 32)
  t = Tiling(wg_rows=64, block_n=64, stages=2, mma_rows=128)
  h = gate_up_mix_decoder(x, mix_stack(st1), mix_stack(st3), r, swiglu_limit=LIMIT, tiling=t, num_sms=6,
                          interpret=interpret())
  assert_no_races(h)
  ref = gate_up.gate_up_reference(x, dequantize_to_dense(q1).w, dequantize_to_dense(q3).w, r, swiglu_limit=LIMIT)
  n = int(r.num_rows[0])
  assert float(jnp.mean(jnp.abs(ref[:n]))) > 0.1
  assert nmse(h[:n].astype(jnp.float32), ref[:n]) <= 2e-5
  one = gate_up_wgmma(x, mix_stack(st1), mix_stack(st3), r, swiglu_limit=LIMIT, tiling=t, num_sms=6,
                      interpret=interpret())
  np.testing.assert_array_equal(np.asarray(h[:n]).view(np.uint16), np.asarray(one[:n]).view(np.uint16))


def test_gate_up_mix_decoder_refuses_rings_that_do_not_divide_the_steps(rng):
  x, w1, w3, ids = problem(rng, 8, 2, inter=64, d=256)  # 4 K steps
  st1, st3 = mix_storage(rng, w1.shape), mix_storage(rng, w3.shape)
  r = routing.route(ids, E, 32)
  with pytest.raises(ValueError, match="divide"):
    gate_up_mix_decoder(x, mix_stack(st1), mix_stack(st3), r, swiglu_limit=LIMIT, tiling=Tiling(block_n=64, stages=3))
