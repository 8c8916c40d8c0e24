"""ROCmFP2-MIX (GGML Q2_1_ROCMFP2_MIX, type 106): ROCmFP2 codes with per-expert 4-level BF16 codebooks, 2.5 bpw.

The blocks are ROCmFP2's (10 bytes: qs[8] 2-bit codes, e[2]), but each scale byte is a meta byte: bit 7 selects one of
the expert's two codebooks, bits 0-6 are the UE4M3 scale (rules in `rocmfp_mix`). In mode 0 the fixed levels are
ROCmFP2's code - 1 (no fp2s). Upstream requires `in % 128 == 0` (its wide load reads a 16-byte window around each
10-byte block); `check` and `quantize` enforce that, the decode itself only needs whole blocks.

ds4jax layout:

    codes  uint8    [..., out, in/4]   as ROCmFP2 (four 2-bit codes per byte, LSB pair first)
    scales uint8    [..., out, in/16]  the raw meta bytes
    books  bfloat16 [..., 2, 4]        per leading index (expert): book 0, then book 1
    mode   uint8    [...]              per leading index; 0 = uniform fallback

Blocks convert exactly as ROCmFP2's (`to_blocks` / `from_blocks`); books and mode are side data.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from ds4jax.quant import bitplanes, rocmfp2, rocmfp_layout, rocmfp_mix
from ds4jax.quant.rocmfp_layout import HALF

NAME = "ROCmFP2-MIX"
BITS_PER_WEIGHT = 2.5
BYTES_PER_BLOCK = rocmfp2.BYTES_PER_BLOCK
IN_MULTIPLE = 128
LEVELS = 4
# Fit start, and the placeholder books of mode 0: plain ROCmFP2's two codebooks (fp2s off / on).
INIT_BOOKS = np.array([[-1, 0, 1, 2], [-2, -1, 0, 1]], np.float64)
CODEBOOK_MODE = 1  # the mode byte `quantize` writes for fitted books (any nonzero value means the same)

to_blocks = rocmfp2.to_blocks
from_blocks = rocmfp2.from_blocks


def storage_shapes(weight_shape) -> dict[str, tuple[int, ...]]:
  """Shapes of the storage arrays for a weight [..., out, in]; rejects `in` not a multiple of 128."""
  shape = rocmfp_layout.check_weight_shape(NAME, weight_shape, IN_MULTIPLE)
  lead = shape[:-2]
  return {**rocmfp2.storage_shapes(shape), "books": (*lead, rocmfp_mix.NUM_BOOKS, LEVELS), "mode": lead}


def fixed_level(code) -> jnp.ndarray:
  """Mode-0 level: ROCmFP2's code - 1."""
  return rocmfp2.levels(code, False)


def dequantize(codes, scales, books, mode) -> jnp.ndarray:
  """float32 W [..., out, in] from codes [..., out, in/4], meta bytes [..., out, in/16], books [..., 2, 4], mode [...].

  THE canonical decode: pure jnp, eager, under jit and inside Pallas kernel bodies (a tile with no leading dims takes
  books [2, 4] and a 0-d mode). One float32 multiply of two exact factors per weight. Byte values are not checked here.
  """
  codes, scales, books, mode = (jnp.asarray(a) for a in (codes, scales, books, mode))
  rocmfp2.static_check(NAME, codes, scales)
  rocmfp_mix.static_check_side(NAME, codes.shape[:-2], books, mode, LEVELS)
  meta = bitplanes.repeat_last(scales.astype(jnp.int32), HALF)
  return rocmfp_mix.dequantize(bitplanes.unpack(codes, 2), meta, books, mode, fixed_level)


# The half-block view: the codes plane as [..., in/16, 4] (byte a of a half-block) and the weights as
# [..., in/16, 4, 4] (code b of byte a is weight 4a + b), row-major views of [..., in/4] and [..., in].
HALF_VIEWS = {"codes": (4,)}
HALF_WEIGHTS = (4, 4)


def dequantize_halves(codes, scales, books, mode, dtype=jnp.float32) -> jnp.ndarray:
  """`dequantize` in the half-block view, cast to `dtype`: codes [..., in/16, 4] → W [..., in/16, 4, 4]. The four
  values of each half-block (level × scale) are made once and each weight picks one by its two code bits: the same
  products as the canonical decode, so the same bits, with a fraction of its work per weight. In-kernel safe (no
  reshape: Pallas-Triton reshapes may move data between threads)."""
  values = rocmfp_mix.half_block_values(scales, books, mode, fixed_level, dtype)
  c = jnp.asarray(codes).astype(jnp.int32)[..., None] >> (2 * bitplanes.iota_last(4, codes.ndim + 1))
  return rocmfp_mix.pick([(c & 1) != 0, (c & 2) != 0], [v[..., None, None] for v in values])


def check(codes, scales, books, mode, name: str = NAME) -> None:
  """Host-side validation: dtypes, shapes (`in` a multiple of 128), books, and meta bytes against the mode."""
  scales = np.asarray(scales)
  shapes = storage_shapes(rocmfp_layout.weight_shape_from_scales(NAME, scales.shape))
  for arr_name, arr, dtype in (("scales", scales, np.uint8), ("codes", codes, np.uint8),
                               ("books", books, rocmfp_mix.BF16), ("mode", mode, np.uint8)):
    rocmfp_layout.check_array(name, arr_name, arr, dtype, shapes[arr_name])
  rocmfp_mix.check_books(books, name)
  rocmfp_mix.check_meta(scales, mode, name)


def quantize(w, *, books=None, uniform: bool = False, iters: int = 4):
  """Numpy encoder: float weights [..., out, in] → (codes, scales, books, mode).

  Default: per expert (leading index), fit two codebooks starting from INIT_BOOKS (`rocmfp_mix.fit_books`, `iters`
  Lloyd steps), then pick per half-block the book and scale byte of least squared error over all 2 × 127 choices
  (scale_search). `books` (bfloat16 [..., 2, 4]) skips the fit. `uniform` writes mode 0 (ROCmFP2 levels, no fp2s) with
  INIT_BOOKS as placeholder books (the decoder ignores books in mode 0).
  """
  w = rocmfp_layout.as_weight(w, NAME, IN_MULTIPLE)
  shapes = storage_shapes(w.shape)
  lead = w.shape[:-2]
  experts = w.reshape(math.prod(lead), -1, HALF)
  if books is not None:
    books = rocmfp_layout.check_array(NAME, "books", books, rocmfp_mix.BF16, shapes["books"])
    rocmfp_mix.check_books(books, NAME)
    books = books.reshape(-1, rocmfp_mix.NUM_BOOKS, LEVELS)
  codes, meta, books = rocmfp_mix.encode(experts, INIT_BOOKS, books, rocmfp2.PLAIN if uniform else None, iters)
  mode = np.full(lead, 0 if uniform else CODEBOOK_MODE, np.uint8)
  return bitplanes.pack(codes.reshape(w.shape), 2), meta.reshape(shapes["scales"]), books.reshape(shapes["books"]), mode
