"""ROCmFP3 (ds4jax.quant.rocmfp3): hand-built blocks, the two-plane layout, rejections."""

import jax
import numpy as np
import pytest

from ds4jax.quant import rocmfp3
from rocmfp_oracle import assert_bits_equal

dequantize_jit = jax.jit(rocmfp3.dequantize)

# 3-bit codes LSB-first across the 96 qs bits. Codes 0, 1, ..., 7 are the octal number 0o76543210 = 0xFAC688, i.e. the
# bytes 88 C6 FA; codes 7, 6, ..., 0 are 0o01234567 = 0x053977, bytes 77 39 05.
# Levels (bit 2 sign, bits 0-1 → magnitudes 0, 1, 2, 4): code 0..7 → 0, 1, 2, 4, -0, -1, -2, -4.
UP = [0x88, 0xC6, 0xFA]
DOWN = [0x77, 0x39, 0x05]
UP_LEVELS = [0.0, 1.0, 2.0, 4.0, -0.0, -1.0, -2.0, -4.0]
DOWN_LEVELS = UP_LEVELS[::-1]


def test_hand_blocks():
  # Block 0: codes 0..7 four times, e = 0x40 (1.0), 0x30 (exp 6: 8 · 2^-5 = 0.25).
  # Block 1: codes 7..0, 0..7, 7..0, 0..7, e = 0x4C (3.0), 0x05 (5 · 2^-10).
  blocks = np.array([[UP * 4 + [0x40, 0x30], DOWN + UP + DOWN + UP + [0x4C, 0x05]]], np.uint8)  # [1, 2, 14]
  s = 5 / 1024
  expected = np.array([[
      0.0, 1.0, 2.0, 4.0, -0.0, -1.0, -2.0, -4.0, 0.0, 1.0, 2.0, 4.0, -0.0, -1.0, -2.0, -4.0,
      0.0, 0.25, 0.5, 1.0, -0.0, -0.25, -0.5, -1.0, 0.0, 0.25, 0.5, 1.0, -0.0, -0.25, -0.5, -1.0,
      -12.0, -6.0, -3.0, -0.0, 12.0, 6.0, 3.0, 0.0, 0.0, 3.0, 6.0, 12.0, -0.0, -3.0, -6.0, -12.0,
      -4 * s, -2 * s, -s, -0.0, 4 * s, 2 * s, s, 0.0, 0.0, s, 2 * s, 4 * s, -0.0, -s, -2 * s, -4 * s,
  ]], np.float32)
  assert np.array_equal(expected[0, :8], UP_LEVELS) and np.array_equal(expected[0, 32:40], np.multiply(DOWN_LEVELS, 3))
  codes_lo, codes_hi, scales = rocmfp3.from_blocks(blocks)
  # The planes: bits 0-1 of codes 0..7 are 0,1,2,3,0,1,2,3 → bytes 0xE4 0xE4; bit 2 is 0,0,0,0,1,1,1,1 → byte 0xF0.
  np.testing.assert_array_equal(codes_lo[0, :8], [0xE4] * 8)
  np.testing.assert_array_equal(codes_hi[0, :4], [0xF0] * 4)
  np.testing.assert_array_equal(scales, [[0x40, 0x30, 0x4C, 0x05]])
  assert_bits_equal(dequantize_jit(codes_lo, codes_hi, scales), expected)  # bitwise: code 4 is -0.0
  rocmfp3.check(codes_lo, codes_hi, scales)
  np.testing.assert_array_equal(rocmfp3.to_blocks(codes_lo, codes_hi, scales), blocks)


def test_quantize_never_writes_negative_zero(rng):
  w = rng.standard_normal((8, 64)).astype(np.float32)
  w[:, ::5] = 0.0
  codes_lo, codes_hi, scales = rocmfp3.quantize(w)
  codes = rocmfp3.unpack_codes(codes_lo, codes_hi)
  assert not np.any(np.asarray(codes) == 4)
  out = np.asarray(dequantize_jit(codes_lo, codes_hi, scales))
  assert not np.any(np.signbit(out[:, ::5]))


def test_rejects_bad_arrays(rng):
  codes_lo = rng.integers(0, 256, size=(2, 3, 16), dtype=np.uint8)  # in = 64
  codes_hi = rng.integers(0, 256, size=(2, 3, 8), dtype=np.uint8)
  scales = rng.integers(0, 0x7F, size=(2, 3, 4), dtype=np.uint8)
  rocmfp3.check(codes_lo, codes_hi, scales)
  bad = scales.copy()
  bad[1, 2, 3] = 0x80  # plain ROCmFP3 has no flag bit
  with pytest.raises(ValueError, match=r"invalid UE4M3 scale byte 0x80 at index \(1, 2, 3\)"):
    rocmfp3.check(codes_lo, codes_hi, bad)
  with pytest.raises(ValueError, match=r"need codes_hi of shape \(2, 3, 8\), got \(2, 3, 16\)"):
    rocmfp3.dequantize(codes_lo, codes_lo, scales)
  with pytest.raises(ValueError, match=r"codes_lo must have shape \(2, 3, 16\), got \(2, 3, 8\)"):
    rocmfp3.check(codes_hi, codes_hi, scales)
  with pytest.raises(TypeError, match="scales must be uint8"):
    jax.jit(rocmfp3.dequantize)(codes_lo, codes_hi, scales.astype(np.int32))
  with pytest.raises(ValueError, match="multiple of 32, got in = 16"):
    rocmfp3.quantize(rng.standard_normal((3, 16)).astype(np.float32))
  with pytest.raises(ValueError, match=r"blocks must be uint8 \[..., out, in/32, 14\]"):
    rocmfp3.from_blocks(np.zeros((2, 3, 10), np.uint8))
