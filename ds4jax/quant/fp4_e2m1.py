"""FP4 E2M1 with per-32 UE8M0 scales: DeepSeek-V4's routed-expert weight format (docs/formats.md §3).

A weight [out, in] is stored as int8 (safetensors I8; uint8 is accepted too) [out, in/2], two values per byte: the LOW
nibble is the even (first) element, the high nibble the odd one. `.scale` is UE8M0 bytes [out, in/32]:

    W[i, j] = E2M1_VALUES[nibble(i, j)] · 2^(scale[i, j // 32] - 127)

Nibble bit 3 is the sign, bits 2..1 the exponent e, bit 0 the mantissa m. Leading batch dims (e.g. stacked experts
[E, out, in/2]) are allowed.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
import ml_dtypes
import numpy as np

from ds4jax.quant import ue8m0

BLOCK = 32  # values per scale byte, along `in`
MAX_CODE = 6.0
E2M1_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def scale_shape(packed_shape) -> tuple[int, ...]:
  """Scale shape [..., out, in/32] for packed codes [..., out, in/2]; rejects `in` not a multiple of 32."""
  packed_shape = tuple(packed_shape)
  if len(packed_shape) < 2:
    raise ValueError(f"FP4 packed weights must be at least 2-D [..., out, in/2], got shape {packed_shape}")
  in_dim = 2 * packed_shape[-1]
  if in_dim % BLOCK:
    raise ValueError(f"FP4 packed weight of shape {packed_shape} holds in = {in_dim} values per row, "
                     f"which is not a multiple of the {BLOCK}-value scale block")
  return (*packed_shape[:-1], in_dim // BLOCK)


def decode_nibbles(nibbles) -> jnp.ndarray:
  """E2M1 codes 0..15 (any int dtype) → float32 values, equal to E2M1_VALUES[nibbles].

  Arithmetic instead of a table gather, because gathers are awkward in Pallas kernels. With e = bits 2..1 and
  m = bit 0: e == 0 gives m · 0.5 (subnormal: 0, 0.5), else (2 + m) · 2^(e-1) · 0.5 (1, 1.5, 2, 3, 4, 6).
  """
  n = jnp.asarray(nibbles).astype(jnp.int32)
  e = (n >> 1) & 3
  m = n & 1
  twice = jnp.where(e == 0, m, (2 + m) << jnp.maximum(e - 1, 0))  # 2 · |value|, an integer
  magnitude = twice.astype(jnp.float32) * 0.5
  # Apply the sign by a multiply, not a negation: Pallas-Triton lowers `-x` as `0 - x`, which turns -0.0
  # into +0.0, while a multiply by -1 keeps -0.0 (nibble 8) in XLA and in kernels alike.
  return magnitude * (1.0 - 2.0 * ((n & 8) != 0).astype(jnp.float32))


def unpack(packed) -> jnp.ndarray:
  """[..., out, in/2] bytes → int32 nibbles [..., out, in], low nibble first.

  Each value reads its own byte (a repeat) and shifts by its parity, rather than stacking the two nibble arrays: XLA
  fuses a repeat into the decode that follows, so a dense weight goes from bytes to bf16 in one pass. A stack was
  written out as int32 first, 8 bytes per weight (BENCHMARKS.md, "The dense FP4 decode in one pass")."""
  b = jnp.repeat(jnp.asarray(packed).astype(jnp.int32) & 0xFF, 2, axis=-1)  # the mask undoes int8's sign extension
  odd = lax.broadcasted_iota(jnp.int32, b.shape, b.ndim - 1) & 1
  return (b >> (4 * odd)) & 0xF


def dequantize(packed, scale_bytes) -> jnp.ndarray:
  """float32 W [..., out, in] from packed int8/uint8 codes [..., out, in/2] and UE8M0 bytes [..., out, in/32].

  Pure jnp (works eagerly on numpy inputs and under jit). Byte values are not checked here: run
  `ue8m0.check_scale_bytes` on the host when loading.
  """
  p = jnp.asarray(packed)
  s = jnp.asarray(scale_bytes)
  if np.dtype(p.dtype) not in (np.dtype(np.int8), np.dtype(np.uint8)):
    raise TypeError(f"FP4 packed weight must be int8 or uint8, got dtype {p.dtype}")
  if np.dtype(s.dtype) != np.uint8:
    raise TypeError(f"FP4 scale must be raw UE8M0 bytes (uint8), got dtype {s.dtype}")
  want = scale_shape(p.shape)
  if tuple(s.shape) != want:
    raise ValueError(f"FP4 packed weight of shape {tuple(p.shape)} needs a scale of shape {want}, "
                     f"got {tuple(s.shape)}")
  values = decode_nibbles(unpack(p))
  return ue8m0.apply_scale(values, jnp.repeat(s, BLOCK, axis=-1))


def pack(nibbles) -> np.ndarray:
  """Numpy: nibbles [..., out, in] (0..15, `in` even) → int8 [..., out, in/2], even element in the low nibble."""
  n = np.asarray(nibbles).astype(np.uint8)
  if n.shape[-1] % 2 or np.any(n > 15):
    raise ValueError(f"pack needs nibbles 0..15 with an even last dim, got shape {n.shape}")
  return (n[..., 0::2] | (n[..., 1::2] << 4)).view(np.int8)


def quantize(w) -> tuple[np.ndarray, np.ndarray]:
  """Numpy encoder: float weights [..., out, in] → (int8 packed codes [..., out, in/2], uint8 scales [..., out, in/32]).

  Each 32-value block gets the smallest power-of-two scale with amax ≤ 6 · scale; values round to the nearest E2M1
  value, ties to even mantissa (ml_dtypes' float4_e2m1fn cast). Non-float32 input is first cast to float32.
  """
  w = np.asarray(w)
  if not np.issubdtype(w.dtype, np.floating) and w.dtype != ml_dtypes.bfloat16:
    raise TypeError(f"quantize expects a float array, got dtype {w.dtype}")
  w = w.astype(np.float32)
  if w.ndim < 2 or w.shape[-1] % BLOCK:
    raise ValueError(f"FP4 quantize needs a weight [..., out, in] with in a multiple of {BLOCK}, got shape {w.shape}")
  if w.size == 0:
    raise ValueError(f"cannot quantize an empty weight of shape {w.shape}")
  if not np.all(np.isfinite(w)):
    raise ValueError(f"cannot quantize non-finite weights (first at index {tuple(np.argwhere(~np.isfinite(w))[0])})")
  blocks = w.reshape(*w.shape[:-1], w.shape[-1] // BLOCK, BLOCK)
  exponent = ue8m0.block_exponent(np.abs(blocks).max(axis=-1), MAX_CODE)
  # Exact scaling (see fp8_e4m3.quantize), then one rounding into E2M1. float4_e2m1fn's bit pattern, one value per
  # byte, is exactly our nibble code (bit 3 sign, then e, m).
  x = np.ldexp(blocks.astype(np.float64), -exponent[..., None]).astype(np.float32)
  nibbles = x.astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
  # As in fp8_e4m3.quantize: a code rounded up past float32's top steps one code toward zero.
  value = np.ldexp(nibbles.view(ml_dtypes.float4_e2m1fn).astype(np.float64), exponent[..., None])
  nibbles = nibbles - (np.abs(value) > np.finfo(np.float32).max).astype(np.uint8)
  return pack(nibbles.reshape(w.shape)), ue8m0.encode(exponent)
