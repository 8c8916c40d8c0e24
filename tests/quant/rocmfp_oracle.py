"""Test helpers: an independent numpy decoder of UPSTREAM ROCmFP blocks, random bytes, random weights.

The oracle reads the block layout exactly as docs/formats.md §5 words it (Python ints for the 96-bit FP3 codes,
float64 tables, invalid scale bytes decode to 0) and shares no code with ds4jax.quant.
"""

import ml_dtypes
import numpy as np


def ue4m3_value(e: int) -> float:
  if e > 0x7E:
    return 0.0
  exp, mant = e >> 3, e & 7
  return mant * 2.0**-10 if exp == 0 else (8 + mant) * 2.0**(exp - 11)


def _fp2_code(qs, j):
  return (int(qs[j >> 2]) >> (2 * (j & 3))) & 3


def _fp3_code(qs, j):
  return (int.from_bytes(bytes(int(b) for b in qs), "little") >> (3 * j)) & 7


def _fp3_fixed(code):
  mag = (0.0, 1.0, 2.0, 4.0)[code & 3]
  return -mag if code & 4 else mag  # -0.0 for code 4


def decode_blocks(kind, blocks, books=None, mode=None):
  """float32 [..., out, in] from upstream blocks [..., out, nb, bytes]; kind in rocmfp2/rocmfp3/*_mix."""
  blocks = np.asarray(blocks)
  lead = blocks.shape[:-3]
  out = np.zeros(blocks.shape[:-1] + (32,), np.float64)
  n_qs = 8 if kind.startswith("rocmfp2") else 12
  books = None if books is None else np.asarray(books).astype(np.float64)
  for idx in np.ndindex(*blocks.shape[:-1]):
    blk = blocks[idx]
    qs, e = blk[:n_qs], blk[n_qs:]
    expert = idx[:len(lead)]
    for j in range(32):
      meta = int(e[int(j >= 16)])
      code = _fp2_code(qs, j) if n_qs == 8 else _fp3_code(qs, j)
      if kind == "rocmfp2":
        level = (1.0 - code) if meta & 0x80 else (code - 1.0)
        value = level * ue4m3_value(meta & 0x7F)
      elif kind == "rocmfp3":
        value = _fp3_fixed(code) * ue4m3_value(meta)
      elif int(mode[expert]) == 0:  # MIX uniform fallback: the whole byte is the scale
        fixed = (code - 1.0) if kind == "rocmfp2_mix" else _fp3_fixed(code)
        value = fixed * ue4m3_value(meta)
      else:
        value = books[expert][meta >> 7][code] * ue4m3_value(meta & 0x7F)
      out[idx + (j,)] = value
  return out.reshape(*blocks.shape[:-2], -1).astype(np.float32)


def random_blocks(rng, shape, bytes_per_block, *, valid=True, flag_bit7=True):
  """Random blocks [*shape, bytes]; with `valid`, every scale byte's low 7 bits (or whole byte) ≤ 0x7E."""
  b = rng.integers(0, 256, size=(*shape, bytes_per_block), dtype=np.uint8)
  if valid:
    e = b[..., -2:]
    low = np.minimum(e & 0x7F, 0x7E)
    e[...] = (e & 0x80 | low) if flag_bit7 else low
  return b


def random_books(rng, lead, k):
  """Random strictly increasing BF16 books [*lead, 2, k] without -0.0."""
  out = np.empty((*lead, 2, k), np.float64)
  for idx in np.ndindex(*lead, 2):
    while True:
      v = np.sort(rng.standard_normal(k) * 2.0 ** rng.integers(-3, 4)).astype(np.float32)
      v = v.astype(ml_dtypes.bfloat16).astype(np.float64)
      if np.all(np.diff(v) > 0) and not np.any(v == 0):
        break
    out[idx] = v
  return out.astype(ml_dtypes.bfloat16)


def assert_bits_equal(actual, expected):
  """Bitwise float32 equality: tells -0.0 from 0.0 and never tolerates rounding."""
  actual = np.asarray(actual, np.float32)
  expected = np.asarray(expected, np.float32)
  assert actual.shape == expected.shape, (actual.shape, expected.shape)
  np.testing.assert_array_equal(actual.view(np.uint32), expected.view(np.uint32))


def gaussian_weight(rng, shape):
  """Gaussian weights, std 0.02 scaled per row by 2^U(-2, 2) (typical expert-weight magnitudes)."""
  return (rng.standard_normal(shape) * 0.02 * np.exp2(rng.uniform(-2, 2, shape[:-1] + (1,)))).astype(np.float32)


def heavy_weight(rng, shape):
  """Heavy-tailed weights: Student-t with 3 degrees of freedom, same scaling as `gaussian_weight`."""
  return (rng.standard_t(3, shape) * 0.02 * np.exp2(rng.uniform(-2, 2, shape[:-1] + (1,)))).astype(np.float32)


def relative_mse(approx, w):
  w = np.asarray(w, np.float64)
  return float(((np.asarray(approx, np.float64) - w) ** 2).sum() / (w**2).sum())
