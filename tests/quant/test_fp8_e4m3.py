"""FP8 E4M3 + 128×128 UE8M0 block scales (ds4jax.quant.fp8_e4m3), and the shared UE8M0 helper."""

import jax
import ml_dtypes
import numpy as np
import pytest

from ds4jax.quant import fp8_e4m3, ue8m0

E4M3 = ml_dtypes.float8_e4m3fn
# Most tests run the jitted function: eager jnp compiles every op separately for each new shape, which is slow.
dequantize_jit = jax.jit(fp8_e4m3.dequantize, static_argnames="block")


def assert_bits_equal(actual, expected):
  """Bitwise float32 equality: tells -0.0 from 0.0 and never tolerates rounding."""
  actual = np.asarray(actual, np.float32)
  expected = np.asarray(expected, np.float32)
  assert actual.shape == expected.shape, (actual.shape, expected.shape)
  np.testing.assert_array_equal(actual.view(np.uint32), expected.view(np.uint32))


def random_codes(rng, shape):
  """Random float8_e4m3fn codes, NaN bytes (0x7F, 0xFF) excluded."""
  b = rng.integers(0, 256, size=shape, dtype=np.uint8)
  b[(b & 0x7F) == 0x7F] = 0x38  # 1.0
  return b.view(E4M3)


def oracle(codes, scale_bytes, block):
  """Independent numpy dequantization: float64 product of the fp8 value and 2^(byte - 127), exact."""
  out_dim, in_dim = codes.shape
  s = scale_bytes[np.arange(out_dim)[:, None] // block, np.arange(in_dim)[None, :] // block]
  return (codes.astype(np.float64) * np.ldexp(1.0, s.astype(np.int64) - 127)).astype(np.float32)


def random_weight(rng, shape):
  """Gaussian weights with row and column magnitudes spread over many octaves, so blocks get different scales."""
  w = rng.standard_normal(shape)
  w *= np.exp2(rng.uniform(-12, 12, size=shape[:-1] + (1,)))
  w *= np.exp2(rng.uniform(-4, 4, size=shape[-1]))
  return w.astype(np.float32)


# --- hand-built bytes -------------------------------------------------------------------------------------------------


def test_dequantize_hand_built_bytes():
  # e4m3fn: sign | 4 exponent bits (bias 7) | 3 mantissa bits.
  # 0x38 = 1.0, 0x40 = 2.0, 0xB8 = -1.0, 0x3C = 1.5, 0x30 = 0.5, 0x7E = 448 (1.75·2^8), 0x01 = 2^-9 (subnormal),
  # 0x00 = 0, 0xC0 = -2.0, 0x44 = 3.0 (1.5·2), 0xBC = -1.5.
  codes = np.array([[0x38, 0x40, 0xB8, 0x3C],
                    [0x30, 0x7E, 0x01, 0x00],
                    [0xC0, 0x38, 0x44, 0xBC]], np.uint8).view(E4M3)
  # block = 2: scale [ceil(3/2), ceil(4/2)] = [2, 2]; 127 → ×1, 128 → ×2, 126 → ×0.5, 130 → ×8.
  scale = np.array([[127, 128],
                    [126, 130]], np.uint8)
  expected = np.array([[1.0, 2.0, -2.0, 3.0],
                       [0.5, 448.0, 0.00390625, 0.0],
                       [-1.0, 0.5, 24.0, -12.0]], np.float32)
  assert_bits_equal(fp8_e4m3.dequantize(codes, scale, block=2), expected)
  assert_bits_equal(dequantize_jit(codes, scale, block=2), expected)


def test_dequantize_default_block_hand_built():
  # [130, 129] with 128-blocks: scale [2, 2]; the last row/column are partial blocks with their own scale.
  codes = np.zeros((130, 129), np.uint8)
  codes[0, 0] = 0x38  # 1.0, block (0, 0)
  codes[127, 128] = 0x40  # 2.0, block (0, 1)
  codes[128, 127] = 0xB8  # -1.0, block (1, 0)
  codes[129, 128] = 0x3C  # 1.5, block (1, 1)
  scale = np.array([[127, 128], [126, 131]], np.uint8)  # ×1, ×2, ×0.5, ×16
  out = np.asarray(dequantize_jit(codes.view(E4M3), scale))
  assert out.shape == (130, 129)
  assert (out[0, 0], out[127, 128], out[128, 127], out[129, 128]) == (1.0, 4.0, -0.5, 24.0)
  assert np.count_nonzero(out) == 4


# --- random inputs: exactness, round trips ----------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(256, 384), (130, 260), (512, 100), (1, 129)])
def test_jit_matches_numpy_oracle_bit_exact(rng, shape):
  codes = random_codes(rng, shape)
  scale = rng.integers(100, 150, size=fp8_e4m3.scale_shape(shape), dtype=np.uint8)
  expected = oracle(codes, scale, 128)
  assert_bits_equal(dequantize_jit(codes, scale), expected)


def test_leading_batch_dims(rng):
  codes = random_codes(rng, (3, 200, 130))
  scale = rng.integers(110, 140, size=(3, 2, 2), dtype=np.uint8)
  out = np.asarray(dequantize_jit(codes, scale))
  for k in range(3):
    assert_bits_equal(out[k], oracle(codes[k], scale[k], 128))


@pytest.mark.parametrize("shape", [(256, 256), (300, 200), (3, 130, 257)])
def test_quantize_round_trip_error_bound(rng, shape):
  w = random_weight(rng, shape)
  codes, scale = fp8_e4m3.quantize(w)
  assert codes.dtype == E4M3 and scale.dtype == np.uint8
  assert scale.shape == fp8_e4m3.scale_shape(shape)
  back = np.asarray(dequantize_jit(codes, scale))

  # Per-element bound: half an fp8 ulp, i.e. 2^-4 relative for normals, 2^-10 · scale in the fp8 subnormal range.
  e = scale.astype(np.int64) - 127
  e_full = np.repeat(np.repeat(e, 128, axis=-2)[..., :shape[-2], :], 128, axis=-1)[..., :shape[-1]]
  bound = np.maximum(np.abs(w.astype(np.float64)) * 2.0**-4, np.ldexp(2.0**-10, e_full))
  err = np.abs(back.astype(np.float64) - w)
  assert np.all(err <= bound), f"max err/bound {np.max(err / bound)}"
  assert np.max(err / bound) > 0.1  # the bound is not vacuous

  # The scale is the smallest power of two that fits the block: amax ≤ 448·s and amax > 448·s/2.
  *lead, out_dim, in_dim = shape
  pad = [(0, 0)] * len(lead) + [(0, -out_dim % 128), (0, -in_dim % 128)]
  amax = np.abs(np.pad(w, pad)).reshape(*lead, scale.shape[-2], 128, scale.shape[-1], 128).max(axis=(-3, -1))
  assert np.all(amax <= np.ldexp(448.0, e))
  assert np.all(amax > np.ldexp(448.0, e - 1))


def test_partial_block_scale_sees_only_real_rows(rng):
  # The last block row holds 2 real rows of tiny values; its scale must follow them, not the full block rows above.
  w = rng.standard_normal((130, 200)).astype(np.float32)
  w[128:] *= 2.0**-20
  codes, scale = fp8_e4m3.quantize(w)
  assert scale.shape == (2, 2)
  assert np.all(scale[1] < scale[0] - 15)
  back = np.asarray(dequantize_jit(codes, scale))
  np.testing.assert_allclose(back[128:], w[128:], rtol=2**-4, atol=0)


def test_dequantize_quantize_idempotent(rng):
  # Exact fp8 values re-encode exactly, even though quantize may pick a smaller block scale.
  shape = (300, 260)
  codes = random_codes(rng, shape)
  scale = rng.integers(110, 140, size=fp8_e4m3.scale_shape(shape), dtype=np.uint8)
  w = np.asarray(dequantize_jit(codes, scale))
  codes2, scale2 = fp8_e4m3.quantize(w)
  assert_bits_equal(dequantize_jit(codes2, scale2), w)


def test_real_checkpoint_scale_shapes():
  assert fp8_e4m3.scale_shape((512, 4096)) == (4, 32)  # attn.wkv
  assert fp8_e4m3.scale_shape((4096, 2048)) == (32, 16)  # shared_experts.w2
  assert fp8_e4m3.scale_shape((32768, 1024)) == (256, 8)  # attn.wq_b
  assert fp8_e4m3.scale_shape((300, 129)) == (3, 2)  # ceil division


# --- rejections -------------------------------------------------------------------------------------------------------


def test_rejects_wrong_scale_shape(rng):
  codes = random_codes(rng, (130, 260))
  with pytest.raises(ValueError, match=r"\(130, 260\).*needs a scale of shape \(2, 3\), got \(1, 2\)"):
    fp8_e4m3.dequantize(codes, np.full((1, 2), 127, np.uint8))  # floor division is wrong
  with pytest.raises(ValueError, match="needs a scale of shape"):
    dequantize_jit(codes, np.full((2, 3, 1), 127, np.uint8))
  with pytest.raises(ValueError, match="at least 2-D"):
    fp8_e4m3.dequantize(codes[0], np.full((3,), 127, np.uint8))


def test_rejects_wrong_dtypes(rng):
  codes = random_codes(rng, (4, 4))
  with pytest.raises(TypeError, match="float8_e4m3fn"):
    fp8_e4m3.dequantize(codes.astype(np.float32), np.full((1, 1), 127, np.uint8))
  with pytest.raises(TypeError, match="uint8"):
    fp8_e4m3.dequantize(codes, np.full((1, 1), 127, np.int32))


def test_quantize_rejects_bad_input():
  with pytest.raises(ValueError, match="non-finite"):
    fp8_e4m3.quantize(np.array([[1.0, np.inf]], np.float32))
  with pytest.raises(ValueError, match="at least 2-D"):
    fp8_e4m3.quantize(np.ones(4, np.float32))


def test_nan_scale_byte_rejected_on_host_and_nan_under_jit(rng):
  codes = random_codes(rng, (256, 256))
  scale = rng.integers(100, 150, size=(2, 2), dtype=np.uint8)
  scale[1, 0] = 0xFF
  with pytest.raises(ValueError, match=r"corrupted scale byte 0xFF at index \(1, 0\)"):
    ue8m0.check_scale_bytes(scale)
  # dequantize itself stays pure: the corrupted block is NaN, the others are untouched.
  out = np.asarray(dequantize_jit(codes, scale))
  assert np.all(np.isnan(out[128:, :128]))
  assert not np.any(np.isnan(out[:128])) and not np.any(np.isnan(out[128:, 128:]))


# --- UE8M0 ------------------------------------------------------------------------------------------------------------


def test_ue8m0_decode_exact_for_every_byte():
  b = np.arange(256, dtype=np.uint8)
  expected = np.ldexp(np.float32(1.0), np.arange(255) - 127).astype(np.float32)  # numpy keeps the subnormal 2^-127
  assert expected[0] == 2.0**-127 and expected[0] > 0
  decoded = np.asarray(jax.jit(ue8m0.decode)(b))
  assert_bits_equal(decoded[:255], expected)
  assert np.isnan(decoded[255])


def test_ue8m0_apply_scale_byte_zero_is_exact_under_jit(rng):
  # XLA on CPU flushes subnormal operands, so x · 2^-127 needs care. 448 · 2^-127 is a normal float32.
  x = np.array([448.0, 3.0, -2.0, 2.5], np.float32)  # results ≥ 2^-126: normal
  out = np.asarray(jax.jit(ue8m0.apply_scale)(x, np.zeros(4, np.uint8)))
  assert_bits_equal(out, (x.astype(np.float64) * 2.0**-127).astype(np.float32))
  assert np.all(out != 0)
  # All other bytes against a float64 oracle, on random fp8 values, where the result is a normal float32.
  codes = random_codes(rng, (255, 64)).astype(np.float32)
  b = np.repeat(np.arange(255, dtype=np.uint8)[:, None], 64, axis=1)
  expected = codes.astype(np.float64) * np.ldexp(1.0, b.astype(np.int64) - 127)
  got = np.asarray(jax.jit(ue8m0.apply_scale)(codes, b)).astype(np.float64)
  normal = (np.abs(expected) >= 2.0**-126) & (np.abs(expected) <= np.finfo(np.float32).max)
  assert normal.sum() > 10000
  np.testing.assert_array_equal(got[normal], expected[normal])


def test_ue8m0_block_exponent_and_encode():
  amax = np.array([448.0, 448.0 * 2.0**-5, 448.0 * (1 + 2.0**-20), 447.0, 1e-45, 0.0, 3e38])
  e = ue8m0.block_exponent(amax, 448.0)
  np.testing.assert_array_equal(e, [0, -5, 1, 0, -127, 0, 120])
  np.testing.assert_array_equal(ue8m0.encode(e), [127, 122, 128, 127, 0, 127, 247])
  with pytest.raises(ValueError, match="exponents must lie in"):
    ue8m0.encode(np.array([128]))


def test_check_scale_bytes_accepts_good_and_rejects_dtype(rng):
  good = rng.integers(0, 255, size=(7, 5), dtype=np.uint8)
  assert ue8m0.check_scale_bytes(good) is not None
  with pytest.raises(TypeError, match="raw uint8"):
    ue8m0.check_scale_bytes(good.astype(np.int16))


def test_quantize_near_float32_top_stays_finite():
  """3.3e38 scales to 248.3 · 2^120, which rounds to 256 · 2^120 = 2^128 (inf): it takes the code below, 240."""
  w = np.array([[3.3e38, -3.3e38, 3.4e38, 1.0e38] + [0.0] * 124], np.float32)
  codes, scale = fp8_e4m3.quantize(w)
  value = codes.astype(np.float64)[0, :4] * np.ldexp(1.0, int(scale[0, 0]) - 127)
  np.testing.assert_array_equal(value, [240 * 2.0**120, -240 * 2.0**120, 240 * 2.0**120, 72 * 2.0**120])
