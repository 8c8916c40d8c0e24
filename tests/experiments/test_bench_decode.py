"""experiments/bench_decode.py: its lookup decode is bit-identical to each MIX format's canonical decode."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import bench_decode as bd


@pytest.mark.parametrize("name", list(bd.WEIGHTS))
def test_lookup_decode_is_bit_identical(name):
  fmt, k, uniform_level, unpack, _, shape = bd.WEIGHTS[name]
  storage = bd.random_storage(jax.random.key(int(np.random.SeedSequence().entropy % 2**31)), fmt, shape)
  assert set(np.unique(np.asarray(storage["mode"]))) == {0, 1}
  assert (np.asarray(storage["scales"]) > 0x7E).any()  # invalid / flagged bytes take part
  assert bd.bit_identical(fmt, k, uniform_level, unpack, storage)
  w = np.asarray(fmt.dequantize(**storage))
  assert (w != 0).mean() > 0.5 and np.isfinite(w).all()
  # The check can fail: a table that takes the uniform experts' scale from the low 7 bits (the codebook experts'
  # rule) decodes flagged bytes of uniform experts to nonzero values.
  wrong = lambda b, m, lv: bd.lookup_table(b, jnp.ones_like(m), lv)
  got = bd.lookup_decode(unpack(storage), storage["scales"], wrong(storage["books"], storage["mode"], uniform_level))
  assert not np.array_equal(np.asarray(got), w)


def test_variants_decode_to_bf16():
  fmt, k, uniform_level, unpack, _, shape = bd.WEIGHTS["gate_up (rocmfp2_mix)"]
  storage = bd.random_storage(jax.random.key(1), fmt, shape)
  outs = {n: f(storage) for n, f in bd.variants(fmt, k, uniform_level, unpack).items()}
  assert all(o.shape == shape and o.dtype == jnp.bfloat16 for o in outs.values())
  assert np.array_equal(np.asarray(outs["canonical"], np.float32), np.asarray(outs["lookup"], np.float32))
