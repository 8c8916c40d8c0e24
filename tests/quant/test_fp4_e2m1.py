"""FP4 E2M1, two nibbles per byte, per-32 UE8M0 scales (ds4jax.quant.fp4_e2m1)."""

import jax
import numpy as np
import pytest

from ds4jax.quant import fp4_e2m1, ue8m0

# Most tests run the jitted function: eager jnp compiles every op separately for each new shape, which is slow.
dequantize_jit = jax.jit(fp4_e2m1.dequantize)
TABLE = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float64)


def assert_bits_equal(actual, expected):
  actual = np.asarray(actual, np.float32)
  expected = np.asarray(expected, np.float32)
  assert actual.shape == expected.shape, (actual.shape, expected.shape)
  np.testing.assert_array_equal(actual.view(np.uint32), expected.view(np.uint32))


def oracle(packed, scale_bytes):
  """Independent numpy dequantization: table lookup, low nibble first, float64 product with 2^(byte - 127)."""
  b = packed.view(np.uint8)
  nibbles = np.empty(b.shape[:-1] + (2 * b.shape[-1],), np.uint8)
  nibbles[..., 0::2] = b & 0xF
  nibbles[..., 1::2] = b >> 4
  s = np.repeat(scale_bytes.astype(np.int64) - 127, 32, axis=-1)
  return (TABLE[nibbles] * np.ldexp(1.0, s)).astype(np.float32)


def random_weight(rng, shape):
  w = rng.standard_normal(shape)
  w *= np.exp2(rng.uniform(-12, 12, size=shape[:-1] + (1,)))
  w *= np.exp2(rng.uniform(-4, 4, size=shape[-1]))
  return w.astype(np.float32)


# --- hand-built bytes -------------------------------------------------------------------------------------------------

# 16 bytes and their 32 values worked out by hand, (low nibble, high nibble) per byte. Nibble bit 3 is the sign.
HAND_BYTES = [0x21, 0x9F, 0x70, 0x8C, 0x43, 0xE5, 0xD6, 0xBA, 0x00, 0x11, 0x88, 0xF7, 0x7F, 0x2A, 0xA2, 0x65]
HAND_VALUES = [
    0.5, 1.0,  # 0x21: 1 → 0.5, 2 → 1
    -6.0, -0.5,  # 0x9F: F → -6, 9 → -0.5
    0.0, 6.0,  # 0x70
    -2.0, -0.0,  # 0x8C: C → -2, 8 → -0
    1.5, 2.0,  # 0x43
    3.0, -4.0,  # 0xE5: 5 → 3, E → -4
    4.0, -3.0,  # 0xD6
    -1.0, -1.5,  # 0xBA: A → -1, B → -1.5
    0.0, 0.0,  # 0x00
    0.5, 0.5,  # 0x11
    -0.0, -0.0,  # 0x88
    6.0, -6.0,  # 0xF7
    -6.0, 6.0,  # 0x7F
    -1.0, 1.0,  # 0x2A
    1.0, -1.0,  # 0xA2
    3.0, 4.0,  # 0x65
]


@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
def test_dequantize_hand_built_bytes(dtype):
  packed = np.array([HAND_BYTES * 2, HAND_BYTES * 2], np.uint8).view(dtype)  # [2, 32] → in = 64, two scale blocks
  scale = np.array([[127, 129],  # ×1, ×4
                    [126, 128]], np.uint8)  # ×0.5, ×2
  v = np.array(HAND_VALUES, np.float32)
  expected = np.stack([np.concatenate([v * 1, v * 4]), np.concatenate([v * 0.5, v * 2])])
  assert expected[0, 1] == 1.0 and expected[0, 33] == 4.0 and expected[1, 2] == -3.0 and expected[1, 34] == -12.0
  assert_bits_equal(dequantize_jit(packed, scale), expected)  # bitwise, so the -0.0 entries keep their sign
  if dtype is np.uint8:
    assert_bits_equal(fp4_e2m1.dequantize(packed, scale), expected)  # eager, on numpy inputs


def test_decode_nibbles_matches_table():
  assert_bits_equal(jax.jit(fp4_e2m1.decode_nibbles)(np.arange(16)), TABLE)
  assert_bits_equal(fp4_e2m1.E2M1_VALUES, TABLE)


# --- random inputs ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(64, 16), (7, 48), (3, 5, 112)])  # packed shapes; the last has a batch dim
def test_jit_matches_numpy_oracle_bit_exact(rng, shape):
  packed = rng.integers(-128, 128, size=shape, dtype=np.int8)
  scale = rng.integers(100, 150, size=fp4_e2m1.scale_shape(shape), dtype=np.uint8)
  expected = oracle(packed, scale)
  assert_bits_equal(dequantize_jit(packed, scale), expected)


@pytest.mark.parametrize("shape", [(64, 64), (5, 96), (3, 9, 128)])
def test_quantize_round_trip_nearest_value(rng, shape):
  w = random_weight(rng, shape)
  packed, scale = fp4_e2m1.quantize(w)
  assert packed.dtype == np.int8 and packed.shape == shape[:-1] + (shape[-1] // 2,)
  assert scale.dtype == np.uint8 and scale.shape == shape[:-1] + (shape[-1] // 32,)
  back = np.asarray(dequantize_jit(packed, scale)).astype(np.float64)

  e_full = np.repeat(scale.astype(np.int64) - 127, 32, axis=-1)
  w64 = w.astype(np.float64)
  err = np.abs(back - w64)
  # Nearest representable value: no other of the 16 candidates · 2^e is closer.
  candidates = TABLE[:, None] * np.ldexp(1.0, e_full.reshape(-1))[None, :]
  best = np.min(np.abs(candidates - w64.reshape(-1)[None, :]), axis=0).reshape(shape)
  np.testing.assert_array_equal(err, best)
  # And the analytic bound: half the gap between neighbours is ≤ 0.25·|w| above 1·2^e, ≤ 0.25·2^e below.
  assert np.all(err <= np.maximum(0.25 * np.abs(w64), np.ldexp(0.25, e_full)))

  # Smallest power-of-two scale with amax ≤ 6·2^e.
  e = scale.astype(np.int64) - 127
  amax = np.abs(w64).reshape(*shape[:-1], -1, 32).max(axis=-1)
  assert np.all(amax <= np.ldexp(6.0, e)) and np.all(amax > np.ldexp(6.0, e - 1))


def test_dequantize_quantize_idempotent(rng):
  shape = (40, 64)  # packed
  packed = rng.integers(-128, 128, size=shape, dtype=np.int8)
  scale = rng.integers(110, 140, size=fp4_e2m1.scale_shape(shape), dtype=np.uint8)
  w = np.asarray(dequantize_jit(packed, scale))
  packed2, scale2 = fp4_e2m1.quantize(w)
  assert_bits_equal(dequantize_jit(packed2, scale2), w)


def test_quantize_ties_round_to_even_mantissa():
  # 2.5 lies halfway between 2 and 3 → 2; 5 between 4 and 6 → 4; 0.75 between 0.5 and 1 → 1; 0.25 → 0.
  # Block amax is 6, so the scale is 2^0.
  w = np.zeros((1, 32), np.float32)
  w[0, :6] = [2.5, 5.0, 0.75, -0.25, 6.0, -3.5]
  packed, scale = fp4_e2m1.quantize(w)
  assert scale[0, 0] == 127
  np.testing.assert_array_equal(np.asarray(dequantize_jit(packed, scale))[0, :6], [2, 4, 1, -0.0, 6, -4])


# --- rejections -------------------------------------------------------------------------------------------------------


def test_rejects_in_dim_not_multiple_of_32(rng):
  packed = rng.integers(-128, 128, size=(4, 8), dtype=np.int8)  # in = 16
  with pytest.raises(ValueError, match="in = 16 values per row, which is not a multiple of the 32"):
    fp4_e2m1.dequantize(packed, np.full((4, 1), 127, np.uint8))
  with pytest.raises(ValueError, match="multiple of 32"):
    fp4_e2m1.quantize(rng.standard_normal((4, 48)).astype(np.float32))


def test_rejects_wrong_scale_shape(rng):
  packed = rng.integers(-128, 128, size=(4, 32), dtype=np.int8)  # in = 64 → scale [4, 2]
  with pytest.raises(ValueError, match=r"\(4, 32\) needs a scale of shape \(4, 2\), got \(4, 4\)"):
    fp4_e2m1.dequantize(packed, np.full((4, 4), 127, np.uint8))
  with pytest.raises(ValueError, match=r"needs a scale of shape \(4, 2\), got \(2, 2\)"):
    dequantize_jit(packed, np.full((2, 2), 127, np.uint8))


def test_rejects_wrong_dtypes(rng):
  packed = rng.integers(-128, 128, size=(4, 16), dtype=np.int8)
  with pytest.raises(TypeError, match="int8 or uint8"):
    fp4_e2m1.dequantize(packed.astype(np.int32), np.full((4, 1), 127, np.uint8))
  with pytest.raises(TypeError, match="uint8"):
    fp4_e2m1.dequantize(packed, np.full((4, 1), 127, np.int8))


def test_nan_scale_byte_rejected_on_host(rng):
  scale = rng.integers(100, 150, size=(6, 4), dtype=np.uint8)
  scale[4, 3] = 0xFF
  with pytest.raises(ValueError, match=r"expert.w1.scale: corrupted scale byte 0xFF at index \(4, 3\)"):
    ue8m0.check_scale_bytes(scale, name="expert.w1.scale")
  packed = rng.integers(-128, 128, size=(6, 64), dtype=np.int8)
  out = np.asarray(dequantize_jit(packed, scale))
  assert np.all(np.isnan(out[4, 96:])) and not np.any(np.isnan(out[:4]))


def test_quantize_near_float32_top_stays_finite():
  """3.3e38 scales to 3.88 · 2^126, which rounds to 4 · 2^126 = 2^128 (inf): it takes the code below, 3."""
  w = np.array([[3.3e38, -3.3e38, 3.4e38, 1.0e38] + [0.0] * 28], np.float32)
  packed, scale = fp4_e2m1.quantize(w)
  np.testing.assert_array_equal(oracle(packed, scale)[0, :4].astype(np.float64),
                                [3 * 2.0**126, -3 * 2.0**126, 3 * 2.0**126, 1 * 2.0**126])
