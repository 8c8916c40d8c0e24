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
from kernels_pallas.moe.quantized_weights import HALF_BLOCK_FORMATS, QuantizedExpertWeights, half_views

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


@pytest.mark.skipif(INTERPRET, reason="select='prmt' is inline PTX: compiled CUDA kernels only")
@pytest.mark.parametrize("fmt", ["rocmfp2_mix", "rocmfp3_mix"])
def test_prmt_decode_is_bit_identical_to_the_canonical_decode(rng, fmt):
  st = adversarial_storage(fmt, SHAPE, rng)
  w = QuantizedExpertWeights.from_storage(fmt, st, SHAPE)
  want = formats.get(fmt).dequantize(**st).astype(jnp.bfloat16)
  got = decode.decode_stack(w, jnp.bfloat16, tiling=decode.Tiling(32, 128, 4, select="prmt"))
  np.testing.assert_array_equal(bits(got), bits(want))


def prmt(a, b, sel) -> np.ndarray:
  """PTX prmt.b32 (default mode), emulated: result byte i is byte (nibble i of sel) of the 8 bytes b:a."""
  table = np.stack([a, b], axis=-1).astype(np.uint32).view(np.uint8).reshape(*np.shape(a), 8)
  nib = (sel.astype(np.uint32)[..., None] >> (4 * np.arange(4, dtype=np.uint32))) & 7
  return np.take_along_axis(table, nib.astype(np.int64), axis=-1).view(np.uint32)[..., 0]


@pytest.mark.parametrize("fmt", ["rocmfp2_mix", "rocmfp3_mix"])
def test_prmt_inputs_pick_the_half_block_values(rng, fmt):
  # What the inline PTX of select='prmt' computes, emulated on its jnp operands, against dequantize_halves' bits
  st = adversarial_storage(fmt, SHAPE, rng)
  s = half_views(fmt, st)
  module = HALF_BLOCK_FORMATS[fmt]
  planes = [s[n] for n in module.HALF_VIEWS]
  want = bits(module.dequantize_halves(*planes, s["scales"], s["books"], s["mode"],
                                       jnp.bfloat16))
  asm, ins = decode.prmt_inputs(fmt, planes, s["scales"], s["books"], s["mode"])
  sel, *rest = (np.asarray(a).astype(np.int64).astype(np.uint32) for a in ins)
  got = prmt(rest[0], rest[1], sel)
  if fmt == "rocmfp3_mix":
    got = np.where(rest[4] != 0, prmt(rest[2], rest[3], sel), got)
  assert "prmt.b32" in asm and want.shape == sel.shape
  np.testing.assert_array_equal((got & 0xFFFF).astype(np.uint16), want)
  assert len(np.unique(want)) > 64  # many distinct values: a wrong byte order would show


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
  with pytest.raises(ValueError, match="select='prmt' runs inline PTX"):
    decode.decode_stack(w, tiling=decode.Tiling(32, 128, 4, select="prmt"), interpret=True)
  with pytest.raises(ValueError, match="select must be"):
    decode.decode_stack(w, tiling=decode.Tiling(32, 128, 4, select="lut"), interpret=True)
