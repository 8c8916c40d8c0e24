"""Registry of ds4jax weight formats: one `Format` per name, with named storage arrays.

    fmt = formats.get("rocmfp3_mix")
    arrays = fmt.quantize(w)            # {"codes_lo": ..., "codes_hi": ..., "scales": ..., "books": ..., "mode": ...}
    fmt.check(**arrays)                 # host-side validation (loaders run it once per tensor)
    w_hat = fmt.dequantize(**arrays)    # jnp float32 [..., out, in], the format module's canonical decode
    fmt.nbytes(w.shape)                 # storage bytes, scales and per-expert side data included

Weights are [..., out, in]; leading dims (stacked experts) pass through, and the MIX formats keep one `mode` and two
codebooks per leading index. `bits_per_weight` counts codes and scales; `nbytes` adds per-expert side data.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from ds4jax.quant import (fp4_e2m1, fp8_e4m3, rocmfp2, rocmfp2_mix, rocmfp3, rocmfp3_mix, rocmfp_layout, ue8m0)

Layout = dict[str, tuple[tuple[int, ...], np.dtype]]  # array name → (shape, dtype)


@dataclasses.dataclass(frozen=True)
class Format:
  """A weight format. `arrays` names the storage arrays in the order the module functions take them."""
  name: str
  bits_per_weight: float  # codes + scales, per weight (side data excluded)
  block: int  # weights per scale along `in` (fp8: 128 × 128 tiles; bf16: 1, no scales)
  in_multiple: int  # `in` must be a multiple of this
  arrays: tuple[str, ...]
  encoder: Callable[..., tuple] = dataclasses.field(repr=False)
  decoder: Callable[..., jnp.ndarray] = dataclasses.field(repr=False)
  validator: Callable[..., None] = dataclasses.field(repr=False)
  layout: Callable[[tuple[int, ...]], Layout] = dataclasses.field(repr=False)

  def _ordered(self, arrays: dict) -> list:
    if set(arrays) != set(self.arrays):
      raise TypeError(f"format {self.name!r} takes arrays {list(self.arrays)}, got {sorted(arrays)}")
    return [arrays[n] for n in self.arrays]

  def quantize(self, w) -> dict[str, np.ndarray]:
    """Numpy encoder: float weights [..., out, in] → named storage arrays."""
    return dict(zip(self.arrays, self.encoder(w)))

  def dequantize(self, **arrays) -> jnp.ndarray:
    """The format's canonical decode → jnp float32 [..., out, in] (pure jnp: eager, under jit, in kernels)."""
    return self.decoder(*self._ordered(arrays))

  def check(self, **arrays) -> None:
    """Host-side validation of dtypes, shapes and byte values; raises TypeError/ValueError naming the problem."""
    self.validator(*self._ordered(arrays))

  def nbytes(self, shape) -> int:
    """Storage bytes of a weight of this shape, scales and side data (codebooks, mode) included."""
    return sum(math.prod(s) * np.dtype(d).itemsize for s, d in self.layout(tuple(shape)).values())

  def storage(self, shape) -> Layout:
    """Shape and dtype of every storage array for a weight of this shape."""
    return self.layout(tuple(shape))


# --- bf16 ------------------------------------------------------------------------------------------------------------

BF16 = ml_dtypes.bfloat16


def _bf16_layout(shape):
  return {"weight": (rocmfp_layout.check_weight_shape("bf16", shape, 1), np.dtype(BF16))}


def _bf16_quantize(w):
  w = np.asarray(w)
  if not np.issubdtype(w.dtype, np.floating) and w.dtype != BF16:
    raise TypeError(f"bf16 quantize expects a float array, got dtype {w.dtype}")
  _bf16_layout(w.shape)
  out = w.astype(np.float32).astype(BF16)
  if not np.isfinite(out).all():  # NaN, inf, or past bf16's range: as every other format's encoder, refused
    bad = np.argwhere(~np.isfinite(out))[0]
    raise ValueError(f"bf16 quantize: non-finite value at index {tuple(int(i) for i in bad)}")
  return (out,)


def _bf16_dequantize(weight):
  weight = jnp.asarray(weight)
  if np.dtype(weight.dtype) != np.dtype(BF16):
    raise TypeError(f"bf16 weight must have dtype bfloat16, got {weight.dtype}")
  return weight.astype(jnp.float32)


def _bf16_check(weight):
  weight = np.asarray(weight)
  rocmfp_layout.check_array("bf16", "weight", weight, BF16, _bf16_layout(weight.shape)["weight"][0])
  bad = ~np.isfinite(weight.astype(np.float32))
  if bad.any():
    raise ValueError(f"bf16 weight has a non-finite value at index {tuple(int(i) for i in np.argwhere(bad)[0])}")


# --- fp8_e4m3 and fp4_e2m1 (DeepSeek's own formats, wrapped) ---------------------------------------------------------

E4M3 = ml_dtypes.float8_e4m3fn


def _fp8_layout(shape):
  shape = rocmfp_layout.check_weight_shape("fp8_e4m3", shape, 1)
  return {"weight": (shape, np.dtype(E4M3)), "scale": (fp8_e4m3.scale_shape(shape), np.dtype(np.uint8))}


def _fp8_check(weight, scale):
  weight = np.asarray(weight)
  lay = _fp8_layout(weight.shape)
  rocmfp_layout.check_array("fp8_e4m3", "weight", weight, E4M3, lay["weight"][0])
  rocmfp_layout.check_array("fp8_e4m3", "scale", scale, np.uint8, lay["scale"][0])
  ue8m0.check_scale_bytes(scale, "fp8_e4m3 scale")
  nan = (weight.view(np.uint8) & 0x7F) == 0x7F  # float8_e4m3fn has no inf; 0x7F / 0xFF are NaN
  if nan.any():
    raise ValueError(f"fp8_e4m3 weight has a NaN byte at index {tuple(int(i) for i in np.argwhere(nan)[0])}")


def _fp4_layout(shape):
  shape = rocmfp_layout.check_weight_shape("fp4_e2m1", shape, fp4_e2m1.BLOCK)
  packed = rocmfp_layout.plane_shape(shape, 2)
  return {"packed": (packed, np.dtype(np.int8)), "scale": (fp4_e2m1.scale_shape(packed), np.dtype(np.uint8))}


def _fp4_check(packed, scale):
  packed = np.asarray(packed)
  if packed.dtype not in (np.int8, np.uint8):
    raise TypeError(f"fp4_e2m1 packed must be int8 or uint8, got dtype {packed.dtype}")
  want = fp4_e2m1.scale_shape(packed.shape)
  rocmfp_layout.check_array("fp4_e2m1", "scale", scale, np.uint8, want)
  ue8m0.check_scale_bytes(scale, "fp4_e2m1 scale")


# --- ROCmFP (ds4jax's storage layouts; see each module) -------------------------------------------------------------


def _rocmfp_layout(module):
  def layout(shape):
    shapes = module.storage_shapes(shape)
    dtypes = {"books": np.dtype(BF16)}
    return {n: (s, dtypes.get(n, np.dtype(np.uint8))) for n, s in shapes.items()}
  return layout


def _rocmfp(name, module, arrays):
  return Format(name, module.BITS_PER_WEIGHT, rocmfp_layout.HALF, module.IN_MULTIPLE, arrays, module.quantize,
                module.dequantize, module.check, _rocmfp_layout(module))


FORMATS: dict[str, Format] = {
    "bf16": Format("bf16", 16.0, 1, 1, ("weight",), _bf16_quantize, _bf16_dequantize, _bf16_check, _bf16_layout),
    "fp8_e4m3": Format("fp8_e4m3", 8 + 8 / fp8_e4m3.BLOCK**2, fp8_e4m3.BLOCK, 1, ("weight", "scale"),
                       fp8_e4m3.quantize, fp8_e4m3.dequantize, _fp8_check, _fp8_layout),
    "fp4_e2m1": Format("fp4_e2m1", 4 + 8 / fp4_e2m1.BLOCK, fp4_e2m1.BLOCK, fp4_e2m1.BLOCK, ("packed", "scale"),
                       fp4_e2m1.quantize, fp4_e2m1.dequantize, _fp4_check, _fp4_layout),
    "rocmfp2": _rocmfp("rocmfp2", rocmfp2, ("codes", "scales")),
    "rocmfp3": _rocmfp("rocmfp3", rocmfp3, ("codes_lo", "codes_hi", "scales")),
    "rocmfp2_mix": _rocmfp("rocmfp2_mix", rocmfp2_mix, ("codes", "scales", "books", "mode")),
    "rocmfp3_mix": _rocmfp("rocmfp3_mix", rocmfp3_mix, ("codes_lo", "codes_hi", "scales", "books", "mode")),
}


def get(name: str) -> Format:
  """The format called `name`; a ValueError lists the valid names otherwise."""
  try:
    return FORMATS[name]
  except KeyError:
    raise ValueError(f"unknown weight format {name!r}; valid formats: {', '.join(FORMATS)}") from None
