"""The expert-stack decode kernel (kernels_pallas/moe/decode.py) against the canonical decode, bit for bit, on
adversarial bytes (every code pattern, invalid scale bytes, MIX experts in modes 0, 1 and 255, -0.0 levels): in
interpret mode on CPU and compiled on a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from test_moe_quantized import INTERPRET, adversarial_storage
from ds4jax import features
from ds4jax.quant import formats
from kernels_pallas.moe import decode
from kernels_pallas.moe.quantized_weights import QuantizedExpertWeights

SHAPE = (3, 64, 256)  # three experts: modes 0, 1 and 255
TILING = decode.Tiling(block_n=32, block_k=128, num_warps=4)


def bits(a) -> np.ndarray:
  a = np.asarray(a)
  return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


@pytest.mark.parametrize("fmt,dtype", [("rocmfp2_mix", "bfloat16"), ("rocmfp3_mix", "bfloat16"),
                                       ("rocmfp2_mix", "float32"), ("rocmfp3_mix", "float32"),
                                       ("fp4_e2m1", "bfloat16")])
def test_decode_is_bit_identical_to_the_canonical_decode(rng, fmt, dtype):
  st = adversarial_storage(fmt, SHAPE, rng)
  w = QuantizedExpertWeights.from_storage(fmt, st, SHAPE)
  want = formats.get(fmt).dequantize(**st).astype(dtype)
  got = decode.decode_stack(w, jnp.dtype(dtype), tiling=TILING, interpret=INTERPRET)
  assert got.dtype == want.dtype and got.shape == SHAPE
  assert np.count_nonzero(np.asarray(want, np.float32)) > want.size // 2  # mostly real values, not zeros
  if fmt == "rocmfp3_mix":
    assert np.any(bits(want) == np.array(0x8000 if dtype == "bfloat16" else 0x80000000, bits(want).dtype))  # -0.0
  np.testing.assert_array_equal(bits(got), bits(want))


@pytest.mark.parametrize("fmt,out_view", [("rocmfp2_mix", (4, 4)), ("rocmfp3_mix", (2, 2, 4)), ("fp4_e2m1", ())])
def test_mix_formats_run_the_half_block_kernel(rng, fmt, out_view):
  """The MIX formats take the half-block kernel (its output is a view of half-blocks), the others the tile loader
  ([E, N, K] as is): one pallas_call, one program per [block_n, block_k] tile."""
  w = QuantizedExpertWeights.from_storage(fmt, adversarial_storage(fmt, SHAPE, rng), SHAPE)
  run = lambda w: decode.decode_stack(w, jnp.bfloat16, tiling=TILING, interpret=True)
  name = f"moe_decode_{fmt}" if out_view else "moe_dequantize_tiles"
  assert features.pallas_calls(run, w) == [(name, (3, 2, 2))]
  (call,) = [e for e in features.traced_eqns(run, w) if e.primitive.name == "pallas_call"]
  assert call.outvars[0].aval.shape == ((3, 64, 16, *out_view) if out_view else SHAPE)


def test_decode_rejects_tiles_that_do_not_divide_the_stack(rng):
  st = adversarial_storage("rocmfp2_mix", SHAPE, rng)
  w = QuantizedExpertWeights.from_storage("rocmfp2_mix", st, SHAPE)
  with pytest.raises(ValueError, match="K=256 is not a multiple of block_k=512"):
    decode.decode_stack(w, tiling=decode.Tiling(32, 512, 4), interpret=True)
