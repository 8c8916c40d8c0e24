"""Bit planes: small codes packed several per byte along the last axis, least-significant bits first.

A plane of `bits`-bit codes (bits = 1, 2, 4 or 8) stores code x[..., j] in byte j // per at bit offset
bits · (j % per), per = 8 // bits. ds4jax's ROCmFP layouts are built from such planes because they unpack with ops
that Pallas-Triton lowers (broadcast, shift, mask, reshape of a trailing power-of-two axis): no gathers and no
concatenation of more than two tensors (pallas-notes §3). `unpack` and `repeat_last` are the in-kernel halves;
`pack` and `unpack_np` are numpy helpers.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

_BITS = (1, 2, 4, 8)


def _per_byte(bits: int) -> int:
  if bits not in _BITS:
    raise ValueError(f"bit planes hold 1-, 2-, 4- or 8-bit codes, got bits={bits}")
  return 8 // bits


def unpack(packed, bits: int) -> jnp.ndarray:
  """uint8 [..., n] → int32 codes [..., n · 8/bits], lowest bits first. Pure jnp, usable inside Pallas kernels."""
  per = _per_byte(bits)
  b = jnp.asarray(packed).astype(jnp.int32)
  shifts = lax.broadcasted_iota(jnp.int32, (1,) * b.ndim + (per,), b.ndim) * bits
  codes = (b[..., None] >> shifts) & ((1 << bits) - 1)  # [..., n, per]: code j of byte i at [i, j]
  return codes.reshape(*b.shape[:-1], b.shape[-1] * per)


def iota_last(n: int, ndim: int) -> jnp.ndarray:
  """int32 0..n-1 along the last of `ndim` axes, the others of size 1 (broadcasts against [..., n])."""
  return lax.broadcasted_iota(jnp.int32, (1,) * (ndim - 1) + (n,), ndim - 1)


def repeat_last(x, times: int) -> jnp.ndarray:
  """[..., n] → [..., n · times], each element repeated `times` times (broadcast + reshape, no gather)."""
  x = jnp.asarray(x)
  return jnp.broadcast_to(x[..., None], (*x.shape, times)).reshape(*x.shape[:-1], x.shape[-1] * times)


def pack(codes, bits: int) -> np.ndarray:
  """Numpy: codes [..., n] (each < 2^bits, n a multiple of 8/bits) → uint8 [..., n · bits/8]."""
  per = _per_byte(bits)
  c = np.asarray(codes)
  if c.shape[-1] % per:
    raise ValueError(f"pack: {bits}-bit codes need a last dim that is a multiple of {per}, got shape {c.shape}")
  if c.size and (c.min() < 0 or c.max() >= 1 << bits):
    raise ValueError(f"pack: {bits}-bit codes must lie in [0, {(1 << bits) - 1}], got [{c.min()}, {c.max()}]")
  c = c.astype(np.uint8).reshape(*c.shape[:-1], c.shape[-1] // per, per)
  out = np.zeros(c.shape[:-1], np.uint8)
  for j in range(per):
    out |= c[..., j] << np.uint8(bits * j)
  return out


def unpack_np(packed, bits: int) -> np.ndarray:
  """Numpy twin of `unpack`: uint8 [..., n] → uint8 codes [..., n · 8/bits]."""
  per = _per_byte(bits)
  b = np.asarray(packed, np.uint8)
  shifts = (bits * np.arange(per)).astype(np.uint8)
  return ((b[..., None] >> shifts) & np.uint8((1 << bits) - 1)).reshape(*b.shape[:-1], b.shape[-1] * per)
