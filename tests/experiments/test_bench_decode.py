"""experiments/bench_decode.py: every variant it times decodes V4-Flash's MIX stacks to bf16 with the canonical
decode's bits (small shapes, Pallas in interpret mode), and its bit check tells when a decode is wrong."""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import bench_decode as bd


@pytest.mark.parametrize("name", list(bd.WEIGHTS))
def test_variants_decode_to_bf16_with_the_canonical_bits(name):
  fmt, unpack, _, shape = bd.WEIGHTS[name]
  fmt_name = fmt.__name__.rsplit(".", 1)[-1]
  storage = bd.random_storage(jax.random.key(zlib.crc32(name.encode())), fmt, shape)
  mode, scales = np.asarray(storage["mode"]), np.asarray(storage["scales"])
  assert set(np.unique(mode)) == {0, 1} and (scales[mode == 0] & 0x80).any()  # flagged bytes must decode to 0
  outs = {n: f(storage) for n, f in bd.variants(fmt_name, fmt, unpack, shape, True).items()}
  assert set(outs) == {"canonical", "halves", "tiles_16x128_w4", "kernel_16x128_w4", "write"}
  assert all(o.shape == shape and o.dtype == jnp.bfloat16 for o in outs.values())
  w = np.asarray(outs["canonical"], np.float32)
  assert (w != 0).mean() > 0.5 and (np.signbit(w) & (w == 0)).any()  # real values, and -0.0 too
  for n in ("halves", "tiles_16x128_w4", "kernel_16x128_w4"):
    assert bd.same_bits(outs[n], outs["canonical"]), n
  # The check can fail: the codebook experts' books swapped change only those experts' weights.
  swapped = dict(storage, books=storage["books"][:, ::-1])
  got = np.asarray(bd.variants(fmt_name, fmt, unpack, shape, True)["halves"](swapped), np.float32)
  assert not bd.same_bits(got, outs["canonical"]) and bd.same_bits(got[mode == 0], w[mode == 0])
