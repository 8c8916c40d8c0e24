"""UE4M3: the unsigned 7-bit scale byte of the ROCmFP2/ROCmFP3 formats and their MIX variants (docs/formats.md §4).

A byte e in 0..0x7E has exp = e >> 3 and mant = e & 7:

    exp == 0 → mant · 2^-10              (0, 2^-10, …, 7 · 2^-10)
    exp >= 1 → (8 + mant) · 2^(exp - 11)  (8 · 2^-10 … 14 · 2^4 = 224)

so the 127 values increase strictly with the byte and every one is a normal float32 (or 0) with at most 4 significant
bits. Bytes above 0x7E (0x7F, and anything with bit 7 set) are invalid: upstream decodes them to 0 and its validation
rejects them. `decode` follows upstream (0) because jit cannot raise on values; `check_scale_bytes` rejects them on the
host. The formats use bit 7 of their scale bytes as a flag (fp2s sign, MIX codebook select), so they mask it off first.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

MAX_BYTE = 0x7E
NUM_VALUES = MAX_BYTE + 1  # valid bytes 0..0x7E


def _values_f64() -> np.ndarray:
  e = np.arange(NUM_VALUES)
  exp, mant = e >> 3, e & 7
  return np.where(exp == 0, mant, 8 + mant) * np.exp2(np.maximum(exp, 1) - 11.0)


VALUES = _values_f64()  # float64 [127]: value of byte e at index e (encoder table; exact in float32 too)


def decode(scale_bytes) -> jnp.ndarray:
  """Exact float32 value of each UE4M3 byte (any int dtype); bytes > 0x7E give 0 like upstream. Pure jnp.

  Built without a table gather (Pallas-Triton lowers no gathers): an integer significand 0..15 times 2^(max(exp,1) - 11)
  made from its float32 bits. Both factors and the product are exact, so no rounding mode or fma can change the result.
  """
  e = jnp.asarray(scale_bytes).astype(jnp.int32)
  exp, mant = e >> 3, e & 7
  significand = jnp.where(exp == 0, mant, 8 + mant).astype(jnp.float32)
  # Exponent field (max(exp, 1) - 11) + 127 ≥ 117: a normal float32 with zero mantissa, i.e. exactly that power of two.
  pow2 = lax.bitcast_convert_type((jnp.maximum(exp, 1) + (127 - 11)) << 23, jnp.float32)
  return jnp.where(e <= MAX_BYTE, significand * pow2, jnp.float32(0))


def check_scale_bytes(scale_bytes, name: str = "scale", *, flag_bit7: bool = False) -> np.ndarray:
  """Host-side check that every byte is a valid UE4M3 scale; returns the bytes as a numpy uint8 array.

  With `flag_bit7`, bit 7 is a format flag (fp2s sign, MIX codebook select) and only the low 7 bits must be ≤ 0x7E.
  """
  arr = np.asarray(scale_bytes)
  if arr.dtype != np.uint8:
    raise TypeError(f"{name}: UE4M3 scales must be raw uint8 bytes, got dtype {arr.dtype}")
  bad = (arr & 0x7F if flag_bit7 else arr) > MAX_BYTE
  if bad.any():
    first = tuple(int(i) for i in np.argwhere(bad)[0])
    what = "low 7 bits 0x7F" if flag_bit7 else "a value above 0x7E"
    raise ValueError(f"{name}: invalid UE4M3 scale byte 0x{int(arr[first]):02X} at index {first} of shape {arr.shape} "
                     f"({what}; {int(bad.sum())} of {arr.size} bytes are invalid)")
  return arr


def nearest_byte(x) -> np.ndarray:
  """Numpy: the byte whose value is nearest to each x ≥ 0 (ties to the smaller byte), clamped to 0..0x7E."""
  x = np.asarray(x, np.float64)
  if np.any(~np.isfinite(x)) or np.any(x < 0):
    raise ValueError("nearest_byte: scales must be finite and non-negative")
  hi = np.clip(np.searchsorted(VALUES, x), 1, MAX_BYTE)  # VALUES[hi - 1] < x ≤ VALUES[hi], or clamped
  lo = hi - 1
  return np.where(x - VALUES[lo] <= VALUES[hi] - x, lo, hi).astype(np.uint8)
