"""ROCmFP2 (GGML Q2_0_ROCMFP2, type 107): 2-bit codes with a UE4M3 scale per 16 weights, 2.5 bits per weight.

Element j of a 32-weight block decodes to {-1, 0, 1, 2}[code_j] · ue4m3(e[j >= 16] & 0x7F). Bit 7 of a scale byte
(fp2s, never set by UE4M3 itself) negates that half-block's codebook to {1, 0, -1, -2}, so a half-block whose large
weights are negative keeps the 2-level side for them. Upstream block (10 bytes): qs[8], 2-bit codes four per byte with
code j = (qs[j >> 2] >> 2·(j & 3)) & 3, then e[2].

ds4jax layout (power-of-two last dims whenever `in` is a power of two, as Pallas-Triton tiles need):

    codes  uint8 [..., out, in/4]   code of element 4k + t at bits 2t..2t+1 of byte k (the upstream qs order)
    scales uint8 [..., out, in/16]  the raw scale bytes, fp2s bit included

so block b of a row is codes[8b : 8b+8] ++ scales[2b : 2b+2] (`to_blocks` / `from_blocks`).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from ds4jax.quant import bitplanes, rocmfp_layout, scale_search, ue4m3
from ds4jax.quant.rocmfp_layout import BLOCK, HALF

NAME = "ROCmFP2"
BITS_PER_WEIGHT = 2.5
BYTES_PER_BLOCK = 10
IN_MULTIPLE = BLOCK
FP2S_BIT = 0x80
PLAIN = scale_search.Codebook([-1, 0, 1, 2], [0, 1, 2, 3])  # value = code - 1
FLIPPED = scale_search.Codebook([-2, -1, 0, 1], [3, 2, 1, 0])  # fp2s: value = 1 - code


def storage_shapes(weight_shape) -> dict[str, tuple[int, ...]]:
  """Shapes of the storage arrays for a weight [..., out, in]; rejects `in` not a multiple of 32."""
  shape = rocmfp_layout.check_weight_shape(NAME, weight_shape, IN_MULTIPLE)
  return {"codes": rocmfp_layout.plane_shape(shape, 4), "scales": rocmfp_layout.plane_shape(shape, HALF)}


def static_check(fmt: str, codes, scales) -> None:
  """Shape/dtype checks that also hold under jit and on Pallas tiles (shared with ROCmFP2-MIX; bytes: `check`)."""
  for name, a in (("codes", codes), ("scales", scales)):
    if np.dtype(a.dtype) != np.uint8:
      raise TypeError(f"{fmt} {name} must be uint8, got dtype {a.dtype}")
  want = storage_shapes(rocmfp_layout.weight_shape_from_scales(fmt, scales.shape))
  if tuple(codes.shape) != want["codes"]:
    raise ValueError(f"{fmt} scales of shape {tuple(scales.shape)} need codes of shape {want['codes']}, "
                     f"got {tuple(codes.shape)}")


def levels(code, flip) -> jnp.ndarray:
  """float32 level of int codes 0..3: code - 1, or 1 - code where `flip` (fp2s) is set. Exact small integers."""
  return jnp.where(flip, 1 - code, code - 1).astype(jnp.float32)


def dequantize(codes, scales) -> jnp.ndarray:
  """float32 W [..., out, in] from codes uint8 [..., out, in/4] and scale bytes uint8 [..., out, in/16].

  THE canonical decode: pure jnp, eager on numpy inputs, under jit, and inside Pallas kernel bodies (tiles of the two
  planes). Each weight is one float32 multiply of two exact factors (level, scale), so it is exact and the same on
  every backend. Byte values are not checked here (`check` does that on the host); a low-7-bit 0x7F decodes to 0.
  """
  codes, scales = jnp.asarray(codes), jnp.asarray(scales)
  static_check(NAME, codes, scales)
  e = bitplanes.repeat_last(scales.astype(jnp.int32), HALF)
  level = levels(bitplanes.unpack(codes, 2), (e & FP2S_BIT) != 0)
  return level * ue4m3.decode(e & 0x7F)


def check(codes, scales, name: str = NAME) -> None:
  """Host-side validation: dtypes, shapes (`in` a multiple of 32) and scale bytes (low 7 bits ≤ 0x7E)."""
  scales = np.asarray(scales)
  shapes = storage_shapes(rocmfp_layout.weight_shape_from_scales(NAME, scales.shape))
  rocmfp_layout.check_array(NAME, "scales", scales, np.uint8, shapes["scales"])
  rocmfp_layout.check_array(NAME, "codes", codes, np.uint8, shapes["codes"])
  ue4m3.check_scale_bytes(scales, f"{name} scales", flag_bit7=True)


def quantize(w, *, fp2s: bool = True) -> tuple[np.ndarray, np.ndarray]:
  """Numpy encoder: float weights [..., out, in] → (codes, scales), least squared error per half-block.

  Exhaustive over the 127 scale bytes and, with `fp2s`, both codebook signs (scale_search); each weight takes its
  nearest level. Weights beyond 2 · 224 saturate; ROCmFP has no tensor-level scale.
  """
  w = rocmfp_layout.as_weight(w, NAME, IN_MULTIPLE)
  choice = scale_search.search(w.reshape(-1, HALF), [PLAIN, FLIPPED] if fp2s else [PLAIN])
  codes = bitplanes.pack(choice.codes.reshape(w.shape), 2)
  scales = (choice.byte | (choice.book << 7)).reshape(storage_shapes(w.shape)["scales"])
  return codes, scales


def to_blocks(codes, scales) -> np.ndarray:
  """ds4jax layout → upstream blocks uint8 [..., out, in/32, 10] (qs[8] then e[2]); lossless for any bytes."""
  codes, scales = np.asarray(codes), np.asarray(scales)
  static_check(NAME, codes, scales)
  nb = scales.shape[-1] // 2
  return np.concatenate([codes.reshape(*codes.shape[:-1], nb, 8), scales.reshape(*scales.shape[:-1], nb, 2)], -1)


def from_blocks(blocks) -> tuple[np.ndarray, np.ndarray]:
  """Upstream blocks uint8 [..., out, in/32, 10] → (codes, scales) in ds4jax's layout; lossless for any bytes."""
  blocks = np.asarray(blocks)
  if blocks.dtype != np.uint8 or blocks.ndim < 3 or blocks.shape[-1] != BYTES_PER_BLOCK:
    raise ValueError(f"{NAME} blocks must be uint8 [..., out, in/32, {BYTES_PER_BLOCK}], "
                     f"got {blocks.dtype} {blocks.shape}")
  lead = blocks.shape[:-2]
  return blocks[..., :8].reshape(*lead, -1).copy(), blocks[..., 8:].reshape(*lead, -1).copy()
