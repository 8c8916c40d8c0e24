"""Per-expert codebooks of the ROCmFP MIX formats (Q2_1_ROCMFP2_MIX, Q3_1_ROCMFP3_MIX; docs/formats.md §6).

Each expert (each leading index of a stacked weight [..., out, in]) has a `mode` byte and two sorted BF16 codebooks,
`books` [..., 2, K] (book 0 then book 1; K = 4 for FP2-MIX, 8 for FP3-MIX), strictly increasing and finite. Every
scale byte is a meta byte, bit 7 = codebook select, bits 0-6 = UE4M3:

    mode != 0:  value = ue4m3(meta & 0x7F) · books[meta >> 7][code]
    mode == 0:  value = ue4m3(meta) · fixed(code)   (uniform fallback; a set bit 7 is invalid and decodes to 0)

This module holds what both MIX formats share: the in-kernel level select (no gathers), host validation of books,
mode and meta bytes, and the encoder's codebook fit. The upstream per-expert `rotations` byte is unused upstream
("until p3 rotation lands") and is not stored.

ds4jax restriction (beyond upstream's sorted/finite rule): nonzero levels must have magnitude in [2^-100, 2^100], so
that every product level · scale (scale in [2^-10, 224]) is a normal float32. A BF16 level has 8 significant bits and
a UE4M3 scale 4, so the product is then exact: the one multiply gives the same bits on every backend, flushing or not.
"""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

from ds4jax.quant import scale_search, ue4m3

BF16 = ml_dtypes.bfloat16
NUM_BOOKS = 2
SELECT_BIT = 0x80
MIN_LEVEL, MAX_LEVEL = 2.0**-100, 2.0**100  # allowed magnitude of nonzero levels (see module docstring)


# --- decode (pure jnp, in-kernel safe) -------------------------------------------------------------------------------


def _book_entries(books) -> list[list[jnp.ndarray]]:
  """books [..., 2, K] → entries[b][k] of shape [..., 1, 1], which broadcast against [..., out, in].

  lax.split into equal power-of-two parts lowers in Pallas-Triton; indexing (slice) and gathers do not.
  """
  k = books.shape[-1]
  columns = lax.split(books, (1,) * k, axis=books.ndim - 1)  # K × [..., 2, 1]
  per_book = [lax.split(c, (1, 1), axis=books.ndim - 2) for c in columns]  # K × 2 × [..., 1, 1]
  return [[per_book[j][b] for j in range(k)] for b in range(NUM_BOOKS)]


def book_level(code, select, books) -> jnp.ndarray:
  """float32 books[select][code] for int codes [..., out, in] and bool select, by a where chain over the 2K entries."""
  b = jnp.asarray(books).astype(jnp.float32)  # BF16 → float32 is exact
  entries = _book_entries(b)
  level = jnp.zeros(jnp.broadcast_shapes(code.shape, entries[0][0].shape), jnp.float32)
  for k in range(b.shape[-1]):
    level = jnp.where(code == k, jnp.where(select, entries[1][k], entries[0][k]), level)
  return level


def dequantize(code, meta, books, mode, fixed_level) -> jnp.ndarray:
  """float32 weights from int codes and meta bytes [..., out, in] (already unpacked), books [..., 2, K], mode [...].

  `fixed_level(code)` gives the uniform-fallback level. Level and scale are chosen first, then multiplied once.
  """
  mode = jnp.asarray(mode)
  uniform = (mode == 0).reshape(*mode.shape, 1, 1)  # per expert, broadcast over [out, in]
  level = jnp.where(uniform, fixed_level(code), book_level(code, (meta & SELECT_BIT) != 0, books))
  return level * ue4m3.decode(jnp.where(uniform, meta, meta & 0x7F))


def half_block_values(meta, books, mode, fixed_level, dtype=jnp.float32) -> list[jnp.ndarray]:
  """The value each code k takes in each half-block, [..., out, in/16] per k, cast to `dtype`: the same level and
  scale products as `dequantize` makes per weight, made once per 16 weights (casting before or after picking gives
  the same bits). meta [..., out, in/16], books [..., 2, K], mode [...]."""
  mode = jnp.asarray(mode)
  uniform = (mode == 0).reshape(*mode.shape, 1, 1)
  meta = jnp.asarray(meta).astype(jnp.int32)
  scale = ue4m3.decode(jnp.where(uniform, meta, meta & 0x7F))
  select = (meta & SELECT_BIT) != 0
  entries = _book_entries(jnp.asarray(books).astype(jnp.float32))
  return [(jnp.where(uniform, fixed_level(jnp.int32(k)), jnp.where(select, entries[1][k], entries[0][k])) * scale
           ).astype(dtype) for k in range(len(entries[0]))]


def pick(code_bits, values) -> jnp.ndarray:
  """values[code] per weight, by a select tree over the code's bits (bool arrays, lowest bit first): K - 1 selects
  for K = 2^len(code_bits) values, which broadcast against the bits."""
  for bit in code_bits:
    values = [jnp.where(bit, one, zero) for zero, one in zip(values[0::2], values[1::2])]
  (value,) = values
  return value


def static_check_side(fmt: str, lead_shape, books, mode, k: int) -> None:
  """Shape/dtype checks of books [..., 2, K] and mode [...] against the weight's leading dims (jit-safe)."""
  if np.dtype(books.dtype) != np.dtype(BF16):
    raise TypeError(f"{fmt} books must be bfloat16, got dtype {books.dtype}")
  if tuple(books.shape) != (*lead_shape, NUM_BOOKS, k):
    raise ValueError(f"{fmt} books must have shape {(*lead_shape, NUM_BOOKS, k)} (leading dims of the weight, "
                     f"then 2 books of {k} levels), got {tuple(books.shape)}")
  if np.dtype(mode.dtype) != np.uint8:
    raise TypeError(f"{fmt} mode must be uint8, got dtype {mode.dtype}")
  if tuple(mode.shape) != tuple(lead_shape):
    raise ValueError(f"{fmt} mode must have the weight's leading shape {tuple(lead_shape)}, got {tuple(mode.shape)}")


# --- host validation -------------------------------------------------------------------------------------------------


def check_books(books, fmt: str) -> None:
  """Host check: every book finite, strictly increasing, BF16-exact, nonzero |level| in [2^-100, 2^100]."""
  b = np.asarray(books)
  values = b.astype(np.float64)
  if b.dtype != BF16 and np.any(values.astype(np.float32).astype(BF16).astype(np.float64) != values):
    raise ValueError(f"{fmt} books hold values that are not exactly BF16")
  flat = values.reshape(-1, values.shape[-1])
  mag = np.abs(flat)
  problems = (
      (~np.all(np.isfinite(flat), axis=1), "has a non-finite level"),
      (np.any(~(np.diff(flat, axis=1) > 0), axis=1), "is not strictly increasing"),
      (np.any((mag != 0) & ((mag < MIN_LEVEL) | (mag > MAX_LEVEL)), axis=1),
       "has a level of magnitude outside [2^-100, 2^100] (ds4jax keeps level · scale a normal float32)"),
  )
  for bad, what in problems:
    if bad.any():
      row = int(np.argmax(bad))
      index = tuple(int(i) for i in np.unravel_index(row, values.shape[:-1]))
      raise ValueError(f"{fmt} book at index {index} (leading dims, then book 0/1) {what}: {flat[row].tolist()}")


def check_meta(meta, mode, fmt: str) -> None:
  """Host check of meta bytes [..., out, in/16] against the per-expert mode [...] (see module docstring)."""
  meta, mode = np.asarray(meta), np.asarray(mode)
  uniform = np.broadcast_to((mode == 0).reshape(*mode.shape, 1, 1), meta.shape)
  bad = np.where(uniform, meta > ue4m3.MAX_BYTE, (meta & 0x7F) > ue4m3.MAX_BYTE)
  if bad.any():
    first = tuple(int(i) for i in np.argwhere(bad)[0])
    why = ("mode 0 (uniform) takes the whole byte as UE4M3, so bit 7 and 0x7F are invalid" if uniform[first]
           else "its low 7 bits are 0x7F")
    raise ValueError(f"{fmt} scales: invalid meta byte 0x{int(meta[first]):02X} at index {first} of shape "
                     f"{meta.shape}: {why} ({int(bad.sum())} of {meta.size} bytes are invalid)")


# --- encoder helpers (numpy) -----------------------------------------------------------------------------------------


def _next_bf16_up(x: float) -> float:
  """The smallest allowed BF16 value above x (zero steps to MIN_LEVEL, keeping levels inside the allowed range)."""
  if x == 0:
    return MIN_LEVEL
  bits = np.array(x, np.float32).astype(BF16).view(np.uint16)
  bits = bits + np.uint16(1) if x > 0 else bits - np.uint16(1)
  up = float(bits.view(BF16))
  return 0.0 if -MIN_LEVEL < up < 0 else up


def to_bf16_book(levels) -> np.ndarray:
  """Float levels → a valid BF16 book: sorted, rounded, tiny magnitudes flushed to 0, made strictly increasing."""
  lv = np.sort(np.asarray(levels, np.float64))
  lv = np.clip(np.where(np.abs(lv) < MIN_LEVEL, 0.0, lv), -MAX_LEVEL / 2, MAX_LEVEL / 2)
  out = lv.astype(np.float32).astype(BF16).astype(np.float64)
  for k in range(1, len(out)):
    if out[k] <= out[k - 1]:
      out[k] = _next_bf16_up(out[k - 1])
  return out.astype(BF16)


def fit_books(halves, init, iters: int = 4, max_rows: int = 1 << 14) -> np.ndarray:
  """Two codebooks for one expert's half-blocks [N, 16] by Lloyd steps on the scale-normalised weights.

  Start from `init` [2, K] (deterministic: the callers pass the plain format's levels, so the fit starts at or below
  the plain format's error, and no step raises the error of the fitted rows, up to BF16 rounding). Each step (1) assigns
  every half-block its least-error book, scale byte and codes (scale_search, the real objective), then (2) moves each
  level to the mean of w / s over the weights coded with it, weighted by s² — the least-squares level for fixed codes
  and scales. Levels stay strictly increasing (each is the mean of the normalised weights in its own nearest-level
  interval); unused ones stay put. At most `max_rows` rows (an even stride; all-zero rows skipped) take part. Returns
  BF16 [2, K] books (`to_bf16_book`).
  """
  h = np.asarray(halves, np.float32)
  h = h[np.abs(h).max(axis=1) > 0]
  if h.shape[0] > max_rows:
    h = h[np.linspace(0, h.shape[0] - 1, max_rows).astype(np.int64)]
  books = np.stack([to_bf16_book(b) for b in np.asarray(init, np.float64)])
  k = books.shape[1]
  for _ in range(iters if h.shape[0] else 0):
    choice = scale_search.search(h, [scale_search.Codebook(b.astype(np.float32), np.arange(k)) for b in books])
    s = ue4m3.VALUES[choice.byte][:, None]  # [n, 1] float64
    new = books.astype(np.float64)
    for b in range(NUM_BOOKS):
      rows = choice.book == b
      codes = choice.codes[rows].ravel()
      num = np.bincount(codes, (h[rows] * s[rows]).ravel(), minlength=k)
      den = np.bincount(codes, np.broadcast_to(s[rows] ** 2, h[rows].shape).ravel(), minlength=k)
      new[b] = np.where(den > 0, num / np.where(den > 0, den, 1), new[b])
    books = np.stack([to_bf16_book(b) for b in new])
  return books


def encode(experts, init, books, uniform_book: scale_search.Codebook | None, iters: int):
  """Shared MIX encoder over experts' half-blocks [E, N, 16] → (codes [E, N, 16], meta [E, N], books [E, 2, K] BF16).

  `books` given (BF16 [E, 2, K], already checked): search only. Else with `uniform_book` (mode 0): that one fixed
  codebook, and placeholder books (`init`, ignored by the decoder). Else fit two books per expert from `init` first.
  """
  n_exp, k = experts.shape[0], np.shape(init)[-1]
  if books is None and uniform_book is not None:
    books = np.broadcast_to(np.stack([to_bf16_book(b) for b in init]), (n_exp, NUM_BOOKS, k))
  elif books is None:
    books = np.stack([fit_books(h, init, iters) for h in experts])
  codes = np.empty(experts.shape, np.uint8)
  meta = np.empty(experts.shape[:2], np.uint8)
  for e, h in enumerate(experts):
    cbs = ([uniform_book] if uniform_book is not None else
           [scale_search.Codebook(b.astype(np.float32), np.arange(k)) for b in books[e]])
    choice = scale_search.search(h, cbs)
    codes[e], meta[e] = choice.codes, choice.byte | (choice.book << 7)
  return codes, meta, np.ascontiguousarray(books)
