"""ROCmFP3-MIX (GGML Q3_1_ROCMFP3_MIX, type 105): ROCmFP3 codes with per-expert 8-level BF16 codebooks, 3.5 bpw.

The blocks are ROCmFP3's (14 bytes: qs[12] 3-bit codes, e[2]), but each scale byte is a meta byte: bit 7 selects one
of the expert's two codebooks and the 3-bit code indexes its 8 levels; bits 0-6 are the UE4M3 scale (rules in
`rocmfp_mix`). In mode 0 the fixed levels are ROCmFP3's sign/magnitude rule.

ds4jax layout:

    codes_lo uint8    [..., out, in/4]   bits 0-1 of each code, as ROCmFP3
    codes_hi uint8    [..., out, in/8]   bit 2 of each code (here the high bit of the level index)
    scales   uint8    [..., out, in/16]  the raw meta bytes
    books    bfloat16 [..., 2, 8]        per leading index (expert): book 0, then book 1
    mode     uint8    [...]              per leading index; 0 = uniform fallback

Blocks convert exactly as ROCmFP3's (`to_blocks` / `from_blocks`); books and mode are side data.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from ds4jax.quant import bitplanes, rocmfp3, rocmfp_layout, rocmfp_mix
from ds4jax.quant.rocmfp_layout import BLOCK, HALF

NAME = "ROCmFP3-MIX"
BITS_PER_WEIGHT = 3.5
BYTES_PER_BLOCK = rocmfp3.BYTES_PER_BLOCK
IN_MULTIPLE = BLOCK
LEVELS = 8
# Fit start, and the placeholder books of mode 0: ROCmFP3's 7 levels plus ±3, so the fit starts no worse than ROCmFP3.
INIT_BOOKS = np.array([[-4, -2, -1, 0, 1, 2, 3, 4], [-4, -3, -2, -1, 0, 1, 2, 4]], np.float64)
CODEBOOK_MODE = 1  # the mode byte `quantize` writes for fitted books (any nonzero value means the same)

to_blocks = rocmfp3.to_blocks
from_blocks = rocmfp3.from_blocks


def storage_shapes(weight_shape) -> dict[str, tuple[int, ...]]:
  """Shapes of the storage arrays for a weight [..., out, in]; rejects `in` not a multiple of 32."""
  shape = rocmfp_layout.check_weight_shape(NAME, weight_shape, IN_MULTIPLE)
  lead = shape[:-2]
  return {**rocmfp3.storage_shapes(shape), "books": (*lead, rocmfp_mix.NUM_BOOKS, LEVELS), "mode": lead}


def dequantize(codes_lo, codes_hi, scales, books, mode) -> jnp.ndarray:
  """float32 W [..., out, in] from the ROCmFP3 planes, meta bytes [..., out, in/16], books [..., 2, 8], mode [...].

  THE canonical decode: pure jnp, eager, under jit and inside Pallas kernel bodies (a tile with no leading dims takes
  books [2, 8] and a 0-d mode). One float32 multiply of two exact factors per weight. Byte values are not checked here.
  """
  codes_lo, codes_hi, scales, books, mode = (jnp.asarray(a) for a in (codes_lo, codes_hi, scales, books, mode))
  rocmfp3.static_check(NAME, codes_lo, codes_hi, scales)
  rocmfp_mix.static_check_side(NAME, scales.shape[:-2], books, mode, LEVELS)
  meta = bitplanes.repeat_last(scales.astype(jnp.int32), HALF)
  return rocmfp_mix.dequantize(rocmfp3.unpack_codes(codes_lo, codes_hi), meta, books, mode, rocmfp3.levels)


# The half-block view: codes_lo as [..., in/16, 2, 2], codes_hi as [..., in/16, 2] and the weights as
# [..., in/16, 2, 2, 4]: weight 8p + 4q + b of a half-block has its low bits at 2b in byte 2p + q of codes_lo and
# its high bit at 4q + b in byte p of codes_hi. Row-major views of [..., in/4], [..., in/8] and [..., in].
HALF_VIEWS = {"codes_lo": (2, 2), "codes_hi": (2,)}
HALF_WEIGHTS = (2, 2, 4)


def dequantize_halves(codes_lo, codes_hi, scales, books, mode, dtype=jnp.float32) -> jnp.ndarray:
  """`dequantize` in the half-block view, cast to `dtype`: the eight values of each half-block made once, each
  weight picking one by its three code bits (the same products, so the same bits). In-kernel safe, no reshape."""
  values = rocmfp_mix.half_block_values(scales, books, mode, rocmfp3.levels, dtype)
  n = codes_lo.ndim + 1
  lo = jnp.asarray(codes_lo).astype(jnp.int32)[..., None] >> (2 * bitplanes.iota_last(4, n))
  hi_shift = 4 * bitplanes.iota_last(2, n - 1)[..., None] + bitplanes.iota_last(4, n)
  hi = jnp.asarray(codes_hi).astype(jnp.int32)[..., None, None] >> hi_shift
  return rocmfp_mix.pick([(lo & 1) != 0, (lo & 2) != 0, (hi & 1) != 0], [v[..., None, None, None] for v in values])


def check(codes_lo, codes_hi, scales, books, mode, name: str = NAME) -> None:
  """Host-side validation: dtypes, shapes (`in` a multiple of 32), books, and meta bytes against the mode."""
  scales = np.asarray(scales)
  shapes = storage_shapes(rocmfp_layout.weight_shape_from_scales(NAME, scales.shape))
  for arr_name, arr, dtype in (("scales", scales, np.uint8), ("codes_lo", codes_lo, np.uint8),
                               ("codes_hi", codes_hi, np.uint8), ("books", books, rocmfp_mix.BF16),
                               ("mode", mode, np.uint8)):
    rocmfp_layout.check_array(name, arr_name, arr, dtype, shapes[arr_name])
  rocmfp_mix.check_books(books, name)
  rocmfp_mix.check_meta(scales, mode, name)


def quantize(w, *, books=None, uniform: bool = False, iters: int = 4):
  """Numpy encoder: float weights [..., out, in] → (codes_lo, codes_hi, scales, books, mode).

  Default: per expert (leading index), fit two codebooks starting from INIT_BOOKS (`rocmfp_mix.fit_books`, `iters`
  Lloyd steps), then pick per half-block the book and scale byte of least squared error over all 2 × 127 choices
  (scale_search). `books` (bfloat16 [..., 2, 8]) skips the fit. `uniform` writes mode 0 (ROCmFP3 levels) with
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
  codes, meta, books = rocmfp_mix.encode(experts, INIT_BOOKS, books, rocmfp3.CODEBOOK if uniform else None, iters)
  codes_lo, codes_hi = rocmfp3.split_codes(codes.reshape(w.shape))
  mode = np.full(lead, 0 if uniform else CODEBOOK_MODE, np.uint8)
  return codes_lo, codes_hi, meta.reshape(shapes["scales"]), books.reshape(shapes["books"]), mode
