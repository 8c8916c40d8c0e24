"""ROCmFP3 (GGML Q3_0_ROCMFPX, type 104): 3-bit sign/magnitude codes with a UE4M3 scale per 16 weights, 3.5 bpw.

Code bit 2 is the sign, bits 0-1 index the magnitudes {0, 1, 2, 4}: element j of a 32-weight block decodes to
±{0, 1, 2, 4}[code_j & 3] · ue4m3(e[j >= 16]) (code 4 is -0.0). Upstream block (14 bytes): qs[12] holding the 32 codes
LSB-first as one 96-bit little-endian number (code j = bits 3j..3j+2, bit 3j its least significant bit), then e[2].

ds4jax layout: a 3-bit code does not pack into power-of-two rows, so it is split into two planes:

    codes_lo uint8 [..., out, in/4]   bits 0-1 of each code (the magnitude index), four per byte, LSB pair first
    codes_hi uint8 [..., out, in/8]   bit 2 of each code (the sign), eight per byte, element 8k + t at bit t of byte k
    scales   uint8 [..., out, in/16]  the raw UE4M3 scale bytes

`to_blocks` / `from_blocks` convert to and from the upstream [..., out, in/32, 14] blocks.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from ds4jax.quant import bitplanes, rocmfp_layout, scale_search, ue4m3
from ds4jax.quant.rocmfp_layout import BLOCK, HALF

NAME = "ROCmFP3"
BITS_PER_WEIGHT = 3.5
BYTES_PER_BLOCK = 14
IN_MULTIPLE = BLOCK
SIGN_BIT = 4  # within a 3-bit code
# Code 4 (-0) is never written: 0 is code 0.
CODEBOOK = scale_search.Codebook([-4, -2, -1, 0, 1, 2, 4], [7, 6, 5, 0, 1, 2, 3])


def storage_shapes(weight_shape) -> dict[str, tuple[int, ...]]:
  """Shapes of the storage arrays for a weight [..., out, in]; rejects `in` not a multiple of 32."""
  shape = rocmfp_layout.check_weight_shape(NAME, weight_shape, IN_MULTIPLE)
  return {"codes_lo": rocmfp_layout.plane_shape(shape, 4), "codes_hi": rocmfp_layout.plane_shape(shape, 8),
          "scales": rocmfp_layout.plane_shape(shape, HALF)}


def static_check(fmt: str, codes_lo, codes_hi, scales) -> None:
  """Shape/dtype checks of the three planes that also hold under jit and on Pallas tiles (shared with ROCmFP3-MIX)."""
  arrays = {"codes_lo": codes_lo, "codes_hi": codes_hi, "scales": scales}
  for name, a in arrays.items():
    if np.dtype(a.dtype) != np.uint8:
      raise TypeError(f"{fmt} {name} must be uint8, got dtype {a.dtype}")
  want = storage_shapes(rocmfp_layout.weight_shape_from_scales(fmt, scales.shape))
  for name in ("codes_lo", "codes_hi"):
    if tuple(arrays[name].shape) != want[name]:
      raise ValueError(f"{fmt} scales of shape {tuple(scales.shape)} need {name} of shape {want[name]}, "
                       f"got {tuple(arrays[name].shape)}")


def unpack_codes(codes_lo, codes_hi) -> jnp.ndarray:
  """int32 3-bit codes [..., out, in] from the two planes (in-kernel safe)."""
  return bitplanes.unpack(codes_lo, 2) | (bitplanes.unpack(codes_hi, 1) << 2)


def levels(code) -> jnp.ndarray:
  """float32 level of int codes 0..7: ±{0, 1, 2, 4}[code & 3], negative when bit 2 is set (code 4 → -0.0). Exact."""
  m = code & 3
  magnitude = (m + (m == 3)).astype(jnp.float32)  # 0, 1, 2, 3 → 0, 1, 2, 4 without a table
  # Sign by a multiply, not a negation: Pallas-Triton lowers `-x` as `0 - x` (+0.0 for code 4 on the H200),
  # while x * -1 gives -0.0 in XLA and in kernels alike.
  return magnitude * (1.0 - 2.0 * ((code & SIGN_BIT) != 0).astype(jnp.float32))


def dequantize(codes_lo, codes_hi, scales) -> jnp.ndarray:
  """float32 W [..., out, in] from codes_lo [..., out, in/4], codes_hi [..., out, in/8], scales [..., out, in/16].

  THE canonical decode: pure jnp, eager on numpy inputs, under jit, and inside Pallas kernel bodies. Each weight is
  one float32 multiply of two exact factors (level, scale): exact, no fma/rounding choices. Bytes above 0x7E decode to
  0 (upstream); `check` rejects them on the host.
  """
  codes_lo, codes_hi, scales = jnp.asarray(codes_lo), jnp.asarray(codes_hi), jnp.asarray(scales)
  static_check(NAME, codes_lo, codes_hi, scales)
  e = bitplanes.repeat_last(scales.astype(jnp.int32), HALF)
  return levels(unpack_codes(codes_lo, codes_hi)) * ue4m3.decode(e)


def check(codes_lo, codes_hi, scales, name: str = NAME) -> None:
  """Host-side validation: dtypes, shapes (`in` a multiple of 32) and scale bytes (≤ 0x7E)."""
  scales = np.asarray(scales)
  shapes = storage_shapes(rocmfp_layout.weight_shape_from_scales(NAME, scales.shape))
  for arr_name, arr in (("scales", scales), ("codes_lo", codes_lo), ("codes_hi", codes_hi)):
    rocmfp_layout.check_array(NAME, arr_name, arr, np.uint8, shapes[arr_name])
  ue4m3.check_scale_bytes(scales, f"{name} scales")


def split_codes(codes) -> tuple[np.ndarray, np.ndarray]:
  """Numpy: 3-bit codes [..., out, in] → (codes_lo, codes_hi) planes."""
  codes = np.asarray(codes, np.uint8)
  return bitplanes.pack(codes & 3, 2), bitplanes.pack(codes >> 2, 1)


def quantize(w) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Numpy encoder: float weights [..., out, in] → (codes_lo, codes_hi, scales), least squared error per half-block.

  Exhaustive over the 127 scale bytes (scale_search); each weight takes its nearest level. Weights beyond 4 · 224
  saturate; ROCmFP has no tensor-level scale.
  """
  w = rocmfp_layout.as_weight(w, NAME, IN_MULTIPLE)
  choice = scale_search.search(w.reshape(-1, HALF), [CODEBOOK])
  codes_lo, codes_hi = split_codes(choice.codes.reshape(w.shape))
  return codes_lo, codes_hi, choice.byte.reshape(storage_shapes(w.shape)["scales"])


def to_blocks(codes_lo, codes_hi, scales) -> np.ndarray:
  """ds4jax layout → upstream blocks uint8 [..., out, in/32, 14] (qs[12] then e[2]); lossless for any bytes."""
  codes_lo, codes_hi, scales = (np.asarray(a) for a in (codes_lo, codes_hi, scales))
  static_check(NAME, codes_lo, codes_hi, scales)
  lead, nb = scales.shape[:-1], scales.shape[-1] // 2
  codes = bitplanes.unpack_np(codes_lo, 2) | (bitplanes.unpack_np(codes_hi, 1) << 2)  # [..., in]
  bits = (codes[..., None] >> np.arange(3, dtype=np.uint8)) & 1  # [..., in, 3]: bit b of code j
  qs = np.packbits(bits.reshape(*lead, nb, BLOCK * 3), axis=-1, bitorder="little")  # bit 3j + b of the 96
  return np.concatenate([qs, scales.reshape(*lead, nb, 2)], axis=-1)


def from_blocks(blocks) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Upstream blocks uint8 [..., out, in/32, 14] → (codes_lo, codes_hi, scales); lossless for any bytes."""
  blocks = np.asarray(blocks)
  if blocks.dtype != np.uint8 or blocks.ndim < 3 or blocks.shape[-1] != BYTES_PER_BLOCK:
    raise ValueError(f"{NAME} blocks must be uint8 [..., out, in/32, {BYTES_PER_BLOCK}], "
                     f"got {blocks.dtype} {blocks.shape}")
  lead = blocks.shape[:-2]
  bits = np.unpackbits(blocks[..., :12], axis=-1, bitorder="little").reshape(*lead, -1, 3)  # [..., in, 3]
  codes = bits[..., 0] | (bits[..., 1] << 1) | (bits[..., 2] << 2)
  codes_lo, codes_hi = split_codes(codes)
  return codes_lo, codes_hi, blocks[..., 12:].reshape(*lead, -1).copy()
