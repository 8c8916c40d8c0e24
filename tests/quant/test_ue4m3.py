"""UE4M3 scale bytes (ds4jax.quant.ue4m3)."""

import jax
import numpy as np
import pytest

from ds4jax.quant import ue4m3
from rocmfp_oracle import assert_bits_equal, ue4m3_value

# Worked out by hand from exp = e >> 3, mant = e & 7: exp 0 → mant · 2^-10, else (8 + mant) · 2^(exp - 11).
HAND_TABLE = {
    0x00: 0.0,
    0x01: 2.0**-10,  # subnormal-style bytes 0x01..0x07: mant · 2^-10
    0x02: 2 * 2.0**-10,
    0x03: 3 * 2.0**-10,
    0x04: 4 * 2.0**-10,
    0x05: 5 * 2.0**-10,
    0x06: 6 * 2.0**-10,
    0x07: 7 * 2.0**-10,
    0x08: 8 * 2.0**-10,  # exp 1: (8 + 0) · 2^-10, continues the subnormal steps
    0x0F: 15 * 2.0**-10,
    0x10: 0.015625,  # exp 2: 8 · 2^-9
    0x38: 0.5,  # exp 7: 8 · 2^-4
    0x40: 1.0,  # exp 8: 8 · 2^-3
    0x41: 1.125,  # 9 · 2^-3
    0x4C: 3.0,  # exp 9, mant 4: 12 · 2^-2
    0x78: 128.0,  # exp 15: 8 · 2^4
    0x7D: 208.0,  # 13 · 2^4
    0x7E: 224.0,  # 14 · 2^4, the largest valid byte
    0x7F: 0.0,  # invalid: upstream decodes to 0
    0x80: 0.0,
    0xC0: 0.0,
    0xFF: 0.0,
}


def test_decode_hand_table():
  b = np.array(list(HAND_TABLE), np.uint8)
  expected = np.array(list(HAND_TABLE.values()), np.float32)
  assert_bits_equal(jax.jit(ue4m3.decode)(b), expected)
  assert_bits_equal(ue4m3.decode(b), expected)  # eager on numpy input


def test_all_values_exact_increasing_and_match_oracle():
  values = np.asarray(jax.jit(ue4m3.decode)(np.arange(256)))
  oracle = np.array([ue4m3_value(e) for e in range(256)])
  np.testing.assert_array_equal(values.astype(np.float64), oracle)  # float32 holds every value exactly
  np.testing.assert_array_equal(ue4m3.VALUES, oracle[:127])
  assert np.all(np.diff(ue4m3.VALUES) > 0) and ue4m3.VALUES[0] == 0 and ue4m3.VALUES[-1] == 224
  mant, _ = np.frexp(ue4m3.VALUES[1:])
  assert np.all(mant * 16 == np.round(mant * 16))  # at most 4 significant bits: products with BF16 stay exact


def test_decode_any_int_dtype_and_shape(rng):
  b = rng.integers(0, 0x7F, size=(3, 5, 7))
  expected = ue4m3.VALUES[b].astype(np.float32)
  for dtype in (np.uint8, np.int32, np.int64):
    assert_bits_equal(jax.jit(ue4m3.decode)(b.astype(dtype)), expected)


def test_check_scale_bytes_rejects_with_index_and_value(rng):
  b = rng.integers(0, 0x7F, size=(4, 6), dtype=np.uint8)
  assert ue4m3.check_scale_bytes(b) is not None
  b[2, 5] = 0x7F
  with pytest.raises(ValueError, match=r"w1 scales: invalid UE4M3 scale byte 0x7F at index \(2, 5\) of shape \(4, 6\)"):
    ue4m3.check_scale_bytes(b, "w1 scales")
  b[2, 5] = 0x93  # bit 7 set
  with pytest.raises(ValueError, match=r"0x93 at index \(2, 5\)"):
    ue4m3.check_scale_bytes(b)
  # As a flag, bit 7 is fine; the low 7 bits still must not be 0x7F.
  ue4m3.check_scale_bytes(b, flag_bit7=True)
  b[0, 1] = 0xFF
  with pytest.raises(ValueError, match=r"0xFF at index \(0, 1\).*low 7 bits 0x7F"):
    ue4m3.check_scale_bytes(b, flag_bit7=True)
  with pytest.raises(TypeError, match="uint8"):
    ue4m3.check_scale_bytes(b.astype(np.int32))


def test_nearest_byte(rng):
  x = rng.uniform(0, 250, size=1000)
  got = ue4m3.nearest_byte(x)
  dist = np.abs(ue4m3.VALUES[None, :] - x[:, None])
  np.testing.assert_array_equal(np.abs(ue4m3.VALUES[got] - x), dist.min(axis=1))
  assert ue4m3.nearest_byte(0.0) == 0 and ue4m3.nearest_byte(1e9) == 0x7E
  with pytest.raises(ValueError):
    ue4m3.nearest_byte(-1.0)
