"""UE8M0: the unsigned exponent-only scale byte of DeepSeek's FP8 and FP4 weights (safetensors dtype F8_E8M0).

A byte b in 0..254 means 2^(b - 127); b = 0xFF is NaN and never valid in a checkpoint.

Byte 0 means 2^-127, which is SUBNORMAL in float32. `decode` builds every value from its bits, so it is exact for all
bytes, 0 included (jnp.ldexp / jnp.exp2 return 0.0 there on CPU). But XLA on CPU and TPU treats subnormal operands
and results as zero: `x * decode(0)` would be 0 even where the product is a normal number (448 · 2^-127 ≈ 2^-118.2).
So arithmetic goes through `apply_scale`, which never uses a subnormal operand: for byte 0 it multiplies by 0.5 and
then by 2^-126. The result is exact whenever it is a normal float32. Results below 2^-126 stay exact in numpy, but
backends that flush subnormals give ±0 there. Real checkpoints never come close to that range.

Byte values cannot be checked under jit, so `check_scale_bytes` runs on the host (numpy). Loaders call it once per
tensor. The jnp functions stay pure: an unchecked 0xFF byte decodes to NaN.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

BIAS = 127
NAN_BYTE = 0xFF
MIN_EXPONENT = -BIAS  # byte 0
MAX_EXPONENT = 254 - BIAS  # byte 254

_F32_NAN_BITS = 0x7FC00000
_F32_TWO_POW_MINUS_127_BITS = 0x00400000  # subnormal: mantissa bit 22, i.e. 2^22 · 2^-149


def check_scale_bytes(scale_bytes, name: str = "scale") -> np.ndarray:
  """Host-side check: the array must be uint8 and hold no 0xFF (NaN) byte. Returns it as a numpy array."""
  arr = np.asarray(scale_bytes)
  if arr.dtype != np.uint8:
    raise TypeError(f"{name}: UE8M0 scales must be raw uint8 bytes, got dtype {arr.dtype}")
  bad = arr == NAN_BYTE
  if bad.any():
    first = tuple(int(i) for i in np.argwhere(bad)[0])
    raise ValueError(f"{name}: corrupted scale byte 0xFF at index {first} of shape {arr.shape} "
                     f"({int(bad.sum())} of {arr.size} bytes are 0xFF, which is NaN in UE8M0)")
  return arr


def decode(scale_bytes) -> jnp.ndarray:
  """Exact float32 value 2^(b - 127) of each byte, built from its bits (0 → subnormal 2^-127, 0xFF → NaN).

  Do not multiply by this where b can be 0; use `apply_scale` (see the module docstring).
  """
  b = jnp.asarray(scale_bytes).astype(jnp.int32)
  # A float32 with exponent field b and zero mantissa is exactly 2^(b - 127) for b in 1..254.
  bits = jnp.where(b == 0, _F32_TWO_POW_MINUS_127_BITS, b << 23)
  bits = jnp.where(b == NAN_BYTE, _F32_NAN_BITS, bits)
  return lax.bitcast_convert_type(bits.astype(jnp.int32), jnp.float32)


def apply_scale(values, scale_bytes) -> jnp.ndarray:
  """values · 2^(b - 127), elementwise (shapes broadcast). Every operand is a normal float32 (see module docstring)."""
  values = jnp.asarray(values, jnp.float32)
  b = jnp.asarray(scale_bytes).astype(jnp.int32)
  normal = lax.bitcast_convert_type(jnp.clip(b, 1, 254) << 23, jnp.float32)  # 2^(max(b, 1) - 127), never subnormal
  out = (values * jnp.where(b == 0, 0.5, 1.0).astype(jnp.float32)) * normal
  return jnp.where(b == NAN_BYTE, jnp.float32(jnp.nan), out)


def block_exponent(amax, limit: float) -> np.ndarray:
  """Smallest integer e with amax ≤ limit · 2^e, clamped to [-127, 127]; e = 0 where amax == 0 (any scale is exact).

  Numpy only (used by the encoders). Computed in float64 and then corrected, so powers of two land exactly.
  """
  amax = np.asarray(amax, np.float64)
  if not np.all(np.isfinite(amax)) or np.any(amax < 0):
    raise ValueError("block_exponent: amax must be finite and non-negative")
  positive = amax > 0
  safe = np.where(positive, amax, limit)
  e = np.ceil(np.log2(safe / limit)).astype(np.int64)
  # log2 can be off by one ulp near powers of two; fix both directions with exact ldexp comparisons.
  e = np.where(np.ldexp(limit, e) < safe, e + 1, e)
  e = np.where(np.ldexp(limit, e - 1) >= safe, e - 1, e)
  e = np.where(positive, e, 0)
  return np.clip(e, MIN_EXPONENT, MAX_EXPONENT).astype(np.int32)


def encode(exponents) -> np.ndarray:
  """Exponents in [-127, 127] → UE8M0 bytes (uint8)."""
  e = np.asarray(exponents)
  if e.size and (e.min() < MIN_EXPONENT or e.max() > MAX_EXPONENT):
    raise ValueError(f"UE8M0 exponents must lie in [{MIN_EXPONENT}, {MAX_EXPONENT}], got [{e.min()}, {e.max()}]")
  return (e.astype(np.int32) + BIAS).astype(np.uint8)
