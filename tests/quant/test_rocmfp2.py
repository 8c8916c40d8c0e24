"""ROCmFP2 (ds4jax.quant.rocmfp2): hand-built blocks, fp2s, rejections."""

import jax
import numpy as np
import pytest

from ds4jax.quant import rocmfp2
from rocmfp_oracle import assert_bits_equal

dequantize_jit = jax.jit(rocmfp2.dequantize)

# qs bytes, 2-bit codes least-significant pair first. Codes → levels {-1, 0, 1, 2}[code]:
#   0xE4 = 11 10 01 00 → codes 0, 1, 2, 3 → -1, 0, 1, 2       0x1B = 00 01 10 11 → codes 3, 2, 1, 0 → 2, 1, 0, -1
#   0x00 → codes 0 → -1 ×4                                     0xFF → codes 3 → 2 ×4
#   0x55 → codes 1 → 0 ×4                                      0xAA → codes 2 → 1 ×4
#   0x27 = 00 10 01 11 → codes 3, 1, 2, 0 → 2, 0, 1, -1        0xD8 = 11 01 10 00 → codes 0, 2, 1, 3 → -1, 1, 0, 2
QS = [0xE4, 0x1B, 0x00, 0xFF, 0x55, 0xAA, 0x27, 0xD8]
LEVELS = [-1, 0, 1, 2, 2, 1, 0, -1, -1, -1, -1, -1, 2, 2, 2, 2,  # half-block 0 (qs[0..3]) uses e[0]
          0, 0, 0, 0, 1, 1, 1, 1, 2, 0, 1, -1, -1, 1, 0, 2]  # half-block 1 (qs[4..7]) uses e[1]


def test_hand_block():
  # Row 0: e = 0x40 (1.0), 0x48 (exp 9, mant 0: 8 · 2^-2 = 2.0).
  # Row 1: e = 0x40, 0xC8 = fp2s | 0x48: half-block 1 uses {1, 0, -1, -2}[code] = -level, times 2.0.
  # Row 2: e = 0x03 (3 · 2^-10, subnormal range), 0x7E (224).
  blocks = np.array([[QS + [0x40, 0x48]], [QS + [0x40, 0xC8]], [QS + [0x03, 0x7E]]], np.uint8)  # [3 rows, 1, 10]
  expected = np.array([
      [-1, 0, 1, 2, 2, 1, 0, -1, -1, -1, -1, -1, 2, 2, 2, 2,
       0, 0, 0, 0, 2, 2, 2, 2, 4, 0, 2, -2, -2, 2, 0, 4],
      [-1, 0, 1, 2, 2, 1, 0, -1, -1, -1, -1, -1, 2, 2, 2, 2,
       0, 0, 0, 0, -2, -2, -2, -2, -4, 0, -2, 2, 2, -2, 0, -4],
      [-3 / 1024, 0, 3 / 1024, 6 / 1024, 6 / 1024, 3 / 1024, 0, -3 / 1024,
       -3 / 1024, -3 / 1024, -3 / 1024, -3 / 1024, 6 / 1024, 6 / 1024, 6 / 1024, 6 / 1024,
       0, 0, 0, 0, 224, 224, 224, 224, 448, 0, 224, -224, -224, 224, 0, 448],
  ], np.float32)
  assert np.array_equal(expected[0], np.array(LEVELS, np.float32) * np.repeat([1.0, 2.0], 16))
  codes, scales = rocmfp2.from_blocks(blocks)
  np.testing.assert_array_equal(codes[0], QS)
  np.testing.assert_array_equal(scales, [[0x40, 0x48], [0x40, 0xC8], [0x03, 0x7E]])
  assert_bits_equal(dequantize_jit(codes, scales), expected)  # bitwise: the fp2s zeros are +0.0, not -0.0
  assert_bits_equal(rocmfp2.dequantize(codes, scales), expected)  # eager on numpy inputs
  rocmfp2.check(codes, scales)


def test_zero_scale_and_invalid_low_bits_decode_to_signed_zero():
  codes = np.array([QS], np.uint8)
  # 0x00 is the valid scale 0; 0xFF has low bits 0x7F, invalid: upstream decodes it to 0 (check rejects it).
  scales = np.array([[0x00, 0xFF]], np.uint8)
  out = np.asarray(dequantize_jit(codes, scales))
  assert np.all(out == 0)
  np.testing.assert_array_equal(np.signbit(out[0]), np.array(LEVELS) * np.repeat([1, -1], 16) < 0)  # level · ±0
  with pytest.raises(ValueError, match=r"invalid UE4M3 scale byte 0xFF at index \(0, 1\)"):
    rocmfp2.check(codes, scales)


def test_fp2s_picks_the_codebook_sign(rng):
  # Half-block 0 holds -1, -0.5 and 0.5 (plus random picks of {-1, -0.5, 0, 0.5}): exactly 0.5 · {-2, -1, 0, 1}, the
  # fp2s book, and no scale of {-1, 0, 1, 2} fits. Half-block 1 holds 1, -0.5 and 0.5: exactly 0.5 · {-1, 0, 1, 2}.
  w = np.concatenate([rng.choice([-1.0, -0.5, 0.0, 0.5], 16), rng.choice([-0.5, 0.0, 0.5, 1.0], 16)])
  w[[0, 1, 2, 16, 17, 18]] = [-1.0, -0.5, 0.5, 1.0, -0.5, 0.5]
  w = rng.permutation(w.reshape(2, 16), axis=1).reshape(1, 32).astype(np.float32)
  codes, scales = rocmfp2.quantize(w)
  np.testing.assert_array_equal(scales, [[0xB8, 0x38]])  # 0x38 = 0.5; 0xB8 = fp2s | 0x38
  assert_bits_equal(dequantize_jit(codes, scales), w)
  codes_off, scales_off = rocmfp2.quantize(w, fp2s=False)
  assert not np.any(scales_off & 0x80)
  back_off = np.asarray(dequantize_jit(codes_off, scales_off))
  assert ((back_off - w)[0, :16] ** 2).sum() > 0.1 and np.array_equal(back_off[0, 16:], w[0, 16:])


def test_fp2s_never_hurts(rng):
  w = rng.standard_normal((16, 128)).astype(np.float32)
  on = np.asarray(dequantize_jit(*rocmfp2.quantize(w)))
  off = np.asarray(dequantize_jit(*rocmfp2.quantize(w, fp2s=False)))
  err_on = ((on - w) ** 2).reshape(-1, 16).sum(1)
  err_off = ((off - w) ** 2).reshape(-1, 16).sum(1)
  assert np.all(err_on <= err_off * (1 + 1e-6)) and err_on.sum() < err_off.sum()


def test_rejects_bad_arrays(rng):
  codes = rng.integers(0, 256, size=(4, 16), dtype=np.uint8)  # in = 64
  scales = rng.integers(0, 0x7F, size=(4, 4), dtype=np.uint8)
  rocmfp2.check(codes, scales)
  with pytest.raises(ValueError, match=r"scales of shape \(4, 4\) need codes of shape \(4, 16\), got \(4, 8\)"):
    rocmfp2.dequantize(codes[:, :8], scales)
  with pytest.raises(ValueError, match=r"must have shape \(4, 16\), got \(4, 12\)"):
    rocmfp2.check(codes[:, :12], scales)
  with pytest.raises(ValueError, match="multiple of 32, got in = 48"):
    rocmfp2.dequantize(codes[:, :12], scales[:, :3])
  with pytest.raises(TypeError, match="codes must be uint8, got dtype int8"):
    dequantize_jit(codes.view(np.int8), scales)
  with pytest.raises(TypeError, match="must have dtype uint8, got int32"):
    rocmfp2.check(codes, scales.astype(np.int32))
  with pytest.raises(ValueError, match="multiple of 32, got in = 48"):
    rocmfp2.quantize(rng.standard_normal((4, 48)).astype(np.float32))
  with pytest.raises(ValueError, match="at least 2-D"):
    rocmfp2.quantize(rng.standard_normal(64).astype(np.float32))
  with pytest.raises(TypeError, match="float array"):
    rocmfp2.quantize(np.ones((2, 32), np.int32))
  w = rng.standard_normal((2, 32)).astype(np.float32)
  w[1, 7] = np.inf
  with pytest.raises(ValueError, match=r"non-finite weights \(first at index \(1, 7\)\)"):
    rocmfp2.quantize(w)
  with pytest.raises(ValueError, match=r"blocks must be uint8 \[..., out, in/32, 10\]"):
    rocmfp2.from_blocks(np.zeros((2, 3, 14), np.uint8))
