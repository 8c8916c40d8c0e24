"""experiments/bench_decode.py: its lookup and per-half-block decodes are bit-identical to each MIX format's canonical
decode, and the check can tell when they are not."""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ds4jax.quant import ue4m3
from experiments import bench_decode as bd


@pytest.mark.parametrize("name", list(bd.WEIGHTS))
def test_lookup_decode_is_bit_identical(name):
  fmt, uniform_level, unpack, _, shape = bd.WEIGHTS[name]
  storage = bd.random_storage(jax.random.key(zlib.crc32(name.encode())), fmt, shape)
  mode, scales = np.asarray(storage["mode"]), np.asarray(storage["scales"])
  assert set(np.unique(mode)) == {0, 1}
  assert (scales[mode == 0] & 0x80).any()  # uniform experts see flagged bytes: they must decode to 0
  w = np.asarray(fmt.dequantize(**storage))
  lookup = bd.lookup_decode(unpack(storage), storage["scales"],
                            bd.lookup_table(storage["books"], storage["mode"], uniform_level))
  assert bd.same_bits(lookup, w)
  assert bd.same_bits(bd.per_half_decode(unpack(storage), storage["scales"], storage["books"], storage["mode"],
                                         uniform_level), w)
  assert (w != 0).mean() > 0.5 and np.isfinite(w).all() and (np.signbit(w) & (w == 0)).any()  # -0.0 too
  # The check can fail: a table that scales the uniform experts by the low 7 bits (the codebook experts' rule)
  # gives their flagged bytes nonzero values.
  def wrong_table(books, mode, level):
    meta = jnp.arange(256, dtype=jnp.int32)
    codes = jnp.arange(books.shape[-1], dtype=jnp.int32)
    uniform = level(codes)[None, None, :] * ue4m3.decode(meta & 0x7F)[None, :, None]
    return jnp.where((mode != 0)[:, None, None], bd.lookup_table(books, mode, level), uniform)
  got = np.asarray(bd.lookup_decode(unpack(storage), storage["scales"],
                                    wrong_table(storage["books"], storage["mode"], uniform_level)))
  differs = got != w
  assert differs.any() and not differs[mode != 0].any()  # only uniform experts change
  assert not bd.same_bits(got, w)
  # ... and one that swaps the books of the codebook experts is caught too.
  swapped = bd.per_half_decode(unpack(storage), storage["scales"], storage["books"][:, ::-1], storage["mode"],
                               uniform_level)
  assert not bd.same_bits(swapped, w) and bd.same_bits(np.asarray(swapped)[mode == 0], w[mode == 0])


def test_variants_decode_to_bf16():
  fmt, uniform_level, unpack, _, shape = bd.WEIGHTS["gate_up (rocmfp2_mix)"]
  storage = bd.random_storage(jax.random.key(1), fmt, shape)
  outs = {n: f(storage) for n, f in bd.variants("rocmfp2_mix", fmt, uniform_level, unpack, shape, True).items()}
  assert all(o.shape == shape and o.dtype == jnp.bfloat16 for o in outs.values())
  assert {n for n in outs if n.startswith("tiles_")} == {"tiles_16x128_w4"}  # the Pallas decode, interpreted
  for name in ("lookup", "per_half", "tiles_16x128_w4"):
    assert bd.same_bits(outs[name], outs["canonical"]), name
