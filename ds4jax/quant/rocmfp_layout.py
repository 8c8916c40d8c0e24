"""Block geometry shared by the ROCmFP2/ROCmFP3 formats and their MIX variants (docs/formats.md §5).

Upstream stores 32 weights per block along `in`, as two 16-weight half-blocks with one scale byte each (element j of a
block uses e[j >= 16]). ds4jax stores the same codes and scale bytes as separate planes (see each format module); this
module holds the shape rules they share and the host-side argument checks of the encoders and validators.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

BLOCK = 32  # weights per upstream block, along `in`
HALF = 16  # weights per scale byte


def check_weight_shape(fmt: str, shape, in_multiple: int) -> tuple[int, ...]:
  """Raises ValueError unless `shape` is [..., out, in] with `in` a positive multiple of `in_multiple`."""
  shape = tuple(shape)
  if len(shape) < 2:
    raise ValueError(f"{fmt} weights must be at least 2-D [..., out, in], got shape {shape}")
  if shape[-1] % in_multiple or shape[-1] == 0:
    raise ValueError(f"{fmt} needs `in` to be a positive multiple of {in_multiple}, got in = {shape[-1]} "
                     f"(weight shape {shape})")
  return shape


def as_weight(w, fmt: str, in_multiple: int) -> np.ndarray:
  """Encoder input: a finite, non-empty float array [..., out, in] → float32 numpy array."""
  w = np.asarray(w)
  if not np.issubdtype(w.dtype, np.floating) and w.dtype != ml_dtypes.bfloat16:
    raise TypeError(f"{fmt} quantize expects a float array, got dtype {w.dtype}")
  check_weight_shape(fmt, w.shape, in_multiple)
  if w.size == 0:
    raise ValueError(f"{fmt}: cannot quantize an empty weight of shape {w.shape}")
  w = w.astype(np.float32)
  if not np.all(np.isfinite(w)):
    raise ValueError(f"{fmt}: cannot quantize non-finite weights (first at index "
                     f"{tuple(int(i) for i in np.argwhere(~np.isfinite(w))[0])})")
  return w


def plane_shape(weight_shape, values_per_byte: int) -> tuple[int, ...]:
  """Shape of a plane holding `values_per_byte` values of each row per byte: [..., out, in / values_per_byte]."""
  *lead, out_dim, in_dim = weight_shape
  return (*lead, out_dim, in_dim // values_per_byte)


def check_array(fmt: str, name: str, arr, dtype, shape) -> np.ndarray:
  """Host check of one storage array's dtype and shape; returns it as numpy."""
  a = np.asarray(arr)
  if a.dtype != np.dtype(dtype):
    raise TypeError(f"{fmt} {name} must have dtype {np.dtype(dtype).name}, got {a.dtype}")
  if a.shape != tuple(shape):
    raise ValueError(f"{fmt} {name} must have shape {tuple(shape)}, got {a.shape}")
  return a


def weight_shape_from_scales(fmt: str, scales_shape) -> tuple[int, ...]:
  """[..., out, in/16] scale shape → weight shape [..., out, in]."""
  scales_shape = tuple(scales_shape)
  if len(scales_shape) < 2:
    raise ValueError(f"{fmt} scales must be at least 2-D [..., out, in/16], got shape {scales_shape}")
  return (*scales_shape[:-1], scales_shape[-1] * HALF)
