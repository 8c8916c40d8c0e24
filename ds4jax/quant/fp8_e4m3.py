"""FP8 E4M3 with 128×128 UE8M0 block scales: DeepSeek-V4's dense weight format (docs/formats.md §2).

A weight [out, in] is stored as float8_e4m3fn (safetensors F8_E4M3) plus `.scale` [ceil(out/128), ceil(in/128)] of UE8M0
bytes (F8_E8M0):

    W[i, j] = fp8[i, j] · 2^(scale[i // 128, j // 128] - 127)

Dims need not be multiples of 128: the last block row/column is partial and its scale covers only the rows/columns
that exist (ceil division, as in the real checkpoint: `attn.wkv` [512, 4096] has scale [4, 32]). Leading batch dims
(e.g. stacked layers) are allowed: the blocks tile the last two axes.
"""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from ds4jax.quant import ue8m0

BLOCK = 128
MAX_CODE = 448.0  # largest finite float8_e4m3fn


def scale_shape(weight_shape, block: int = BLOCK) -> tuple[int, ...]:
  """Shape of the scale tensor for a weight of shape [..., out, in]: [..., ceil(out/block), ceil(in/block)]."""
  weight_shape = tuple(weight_shape)
  if len(weight_shape) < 2:
    raise ValueError(f"FP8 block-scaled weights must be at least 2-D [..., out, in], got shape {weight_shape}")
  *lead, out_dim, in_dim = weight_shape
  return (*lead, -(-out_dim // block), -(-in_dim // block))


def _check(weight_shape, weight_dtype, scale_shape_, scale_dtype, block: int) -> None:
  """Static checks only (shapes and dtypes), so that they also run under jit."""
  if not isinstance(block, int) or block <= 0:
    raise ValueError(f"block must be a positive int, got {block!r}")
  if np.dtype(weight_dtype) != np.dtype(ml_dtypes.float8_e4m3fn):
    raise TypeError(f"FP8 weight must have dtype float8_e4m3fn, got {weight_dtype}")
  if np.dtype(scale_dtype) != np.uint8:
    raise TypeError(f"FP8 scale must be raw UE8M0 bytes (uint8), got dtype {scale_dtype}")
  want = scale_shape(weight_shape, block)
  if tuple(scale_shape_) != want:
    raise ValueError(f"FP8 weight of shape {tuple(weight_shape)} with {block}x{block} blocks needs a scale of shape "
                     f"{want}, got {tuple(scale_shape_)}")


def dequantize(weight_fp8, scale_bytes, block: int = BLOCK) -> jnp.ndarray:
  """float32 W [..., out, in] from fp8 codes [..., out, in] and UE8M0 bytes [..., ceil(out/block), ceil(in/block)].

  Pure jnp (works eagerly on numpy inputs and under jit). Byte values are not checked here (jit cannot raise on
  values): run `ue8m0.check_scale_bytes` on the host when loading.
  """
  w = jnp.asarray(weight_fp8)
  s = jnp.asarray(scale_bytes)
  _check(w.shape, w.dtype, s.shape, s.dtype, block)
  out_dim, in_dim = w.shape[-2:]
  # Expand each scale byte over its block, then cut the partial last block down to the real size.
  s = jnp.repeat(s, block, axis=-2)[..., :out_dim, :]
  s = jnp.repeat(s, block, axis=-1)[..., :in_dim]
  return ue8m0.apply_scale(w.astype(jnp.float32), s)


def quantize(w, block: int = BLOCK) -> tuple[np.ndarray, np.ndarray]:
  """Numpy encoder: float weights [..., out, in] → (float8_e4m3fn codes, uint8 UE8M0 scale bytes).

  Each block gets the smallest power-of-two scale with amax ≤ 448 · scale; codes are round-to-nearest-even.
  Non-float32 input is first cast to float32.
  """
  w = np.asarray(w)
  if not np.issubdtype(w.dtype, np.floating) and w.dtype != ml_dtypes.bfloat16:
    raise TypeError(f"quantize expects a float array, got dtype {w.dtype}")
  w = w.astype(np.float32)
  sshape = scale_shape(w.shape, block)
  if w.size == 0:
    raise ValueError(f"cannot quantize an empty weight of shape {w.shape}")
  if not np.all(np.isfinite(w)):
    raise ValueError(f"cannot quantize non-finite weights (first at index {tuple(np.argwhere(~np.isfinite(w))[0])})")
  *lead, out_dim, in_dim = w.shape
  rows, cols = sshape[-2:]
  # Zero padding does not change a block's amax, and lets every block be a full block×block tile.
  pad = [(0, 0)] * len(lead) + [(0, rows * block - out_dim), (0, cols * block - in_dim)]
  tiles = np.pad(w, pad).reshape(*lead, rows, block, cols, block)
  exponent = ue8m0.block_exponent(np.abs(tiles).max(axis=(-3, -1)), MAX_CODE)
  e_full = np.repeat(np.repeat(exponent, block, axis=-2)[..., :out_dim, :], block, axis=-1)[..., :in_dim]
  # w · 2^-e is exact in float64 and again in float32 (values ≤ 448; only far-subnormal ones round, and those are 0
  # in fp8 anyway). ml_dtypes goes through float32 itself, so casting from float32 rounds only once.
  x = np.ldexp(w.astype(np.float64), -e_full).astype(np.float32)
  codes = x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
  # Within 2^-4 of float32's top a code can round up to one whose value overflows: take the next code toward zero
  # (e4m3fn's magnitude grows with the byte). The sign bit is untouched.
  over = np.abs(np.ldexp(codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64), e_full)) > np.finfo(np.float32).max
  return (codes - over.astype(np.uint8)).view(ml_dtypes.float8_e4m3fn), ue8m0.encode(exponent)
