"""MSE search over the 127 UE4M3 scale bytes and a few codebooks, per 16-weight half-block (numpy; ROCmFP encoders).

For a half-block w[0..15], a codebook (sorted levels L) and a scale s, every weight takes its nearest level, and the
error is E(s) = Σ_i (w_i - s·L[c_i])², with s·L[c_i] the float32 product the decoder computes. `search` returns, per
half-block, the (book, byte) of least error over ALL books and ALL 127 bytes (ties: lowest book, then lowest byte):
exactly what a brute-force search returns (`exhaustive=True` runs that, for tests), without trying most bytes:

1. an upper bound UB = the least error over a few bytes at and below the no-clipping scale, over all books;
2. each weight alone bounds the error from below: E(s) ≥ d(w_i, s)², d the distance from w_i to the nearest scaled
   level. So a byte can only reach E ≤ UB if, for every i, some level has |w_i - s·L_k| ≤ √UB: per weight a union of
   intervals in s; their hulls, intersected over the 16 weights, give one byte window per row and book;
3. those windows (typically 10-30 bytes of 127) are evaluated exhaustively, rows sorted by window width.

Every (row, book, byte) error comes from the same elementwise float32 code and a fixed summation tree, so the pruned
and the exhaustive search pick identical bytes. The bound is widened by a relative 1e-5 (the float32 errors are good
to ~1e-6) and by one byte on each side. Rows are processed in chunks by a thread pool (numpy releases the GIL).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os

import numpy as np

from ds4jax.quant import ue4m3

HALF = 16  # weights per scale byte
_SCALES = ue4m3.VALUES.astype(np.float32)  # exact
_ROWS_PER_SCAN = 8192  # rows of one [16, rows] working array: stays in cache
_ROWS_PER_TASK = 1 << 16
_UB_OFFSETS = (-6, -4, -2, 0)  # stage 1 bytes, relative to the no-clipping byte


@dataclasses.dataclass(frozen=True)
class Codebook:
  """A decoder codebook seen by the encoder: strictly increasing float32 `levels` and the stored code of each."""
  levels: np.ndarray
  codes: np.ndarray

  def __post_init__(self):
    levels = np.asarray(self.levels, np.float32)
    codes = np.asarray(self.codes, np.uint8)
    if levels.ndim != 1 or levels.shape != codes.shape or levels.size < 2:
      raise ValueError(f"Codebook needs ≥ 2 levels and one code per level, got {levels.shape} and {codes.shape}")
    if not np.all(np.isfinite(levels)) or np.any(np.diff(levels) <= 0):
      raise ValueError(f"Codebook levels must be finite and strictly increasing, got {levels.tolist()}")
    object.__setattr__(self, "levels", levels)
    object.__setattr__(self, "codes", codes)

  @property
  def mids(self) -> np.ndarray:
    return (self.levels[:-1] + self.levels[1:]) * np.float32(0.5)

  @property
  def steps_exact(self) -> bool:
    """Whether s·L0 + Σ s·(L[k+1] - L[k]) reproduces every s·L[j] exactly in float32 for every scale s.

    Then `_scan` builds the decoded values by adding steps (fast); otherwise it gathers levels (exact, slower).
    """
    s = _SCALES[:, None]
    acc = s * self.levels[0]
    for k, step in enumerate(np.diff(self.levels)):
      acc = acc + s * step
      if np.any(acc != s * self.levels[k + 1]) or np.float64(step) != np.diff(self.levels.astype(np.float64))[k]:
        return False
    return True


@dataclasses.dataclass(frozen=True)
class Choice:
  """Search result per half-block: codebook index, scale byte (0..0x7E), 16 codes, and the float32 error."""
  book: np.ndarray  # uint8 [N]
  byte: np.ndarray  # uint8 [N]
  codes: np.ndarray  # uint8 [N, 16]
  error: np.ndarray  # float32 [N]


def _scan(wt, first, offsets, book: Codebook, fast: bool):
  """Least error over bytes first + offsets (offsets increasing, bytes in range) for rows wt [16, n].

  Returns (error [n], byte [n]); the first minimum wins, i.e. the lowest byte among ties. The decoded value s·L[c] of
  each weight is built per byte from threshold tests x > s·mid, by adding exact steps or by a gather.
  """
  best = np.full(wt.shape[1], np.inf, np.float32)
  best_byte = np.zeros(wt.shape[1], np.int64)
  steps = np.diff(book.levels)
  for off in offsets:
    byte = first + off
    s = _SCALES[byte]  # [n]
    if fast:
      v = np.empty(wt.shape, np.float32)
      v[...] = s * book.levels[0]
      for mid, step in zip(book.mids, steps):
        v += (wt > s * mid) * (s * step)
    else:
      idx = np.zeros(wt.shape, np.int8)
      for mid in book.mids:
        idx += wt > s * mid
      v = np.take(book.levels, idx) * s
    np.subtract(wt, v, out=v)
    np.square(v, out=v)
    while v.shape[0] > 1:  # fixed pairwise tree over the 16 weights: the same sums whatever the batch
      v = v[:v.shape[0] // 2] + v[v.shape[0] // 2:]
    err = v[0]
    better = err < best
    best = np.where(better, err, best)
    best_byte = np.where(better, byte, best_byte)
  return best, best_byte


def _byte_window(w, ub, book: Codebook):
  """[lo, hi] byte range (inclusive) outside of which this book cannot reach an error ≤ ub; empty if lo > hi.

  Float32 is enough: the bound is widened by 1e-5 and by a byte (neighbouring scales differ by ≥ 1/16). Empty
  intervals are pushed to ±BIG arithmetically.
  """
  big = np.float32(1e30)
  delta = np.sqrt(ub * np.float32(1 + 1e-5))[:, None]  # [n, 1]
  lo = np.full(w.shape, big, np.float32)  # hull over levels, per weight [n, 16]
  hi = np.full(w.shape, -big, np.float32)
  for level in book.levels:
    if level == 0:  # level 0 reaches w at every s iff |w| ≤ δ
      ok = np.abs(w) <= delta
      lvl_lo, lvl_hi = (~ok) * big, ok * (2 * big) - big
    else:  # |w - s·L| ≤ δ ⇔ s between (w-δ)/L and (w+δ)/L; empty when that interval lies below s = 0
      a, b = (w - delta) / level, (w + delta) / level
      lvl_lo, lvl_hi = np.minimum(a, b), np.maximum(a, b)
      lvl_lo = np.maximum(lvl_lo, 0) + (lvl_hi < 0) * big
    np.minimum(lo, lvl_lo, out=lo)
    np.maximum(hi, lvl_hi, out=hi)
  s_lo, s_hi = lo.max(axis=1), hi.min(axis=1)  # intersection over the 16 weights
  k_lo = np.searchsorted(_SCALES, s_lo, "left") - 1  # one byte of slack on each side
  k_hi = np.searchsorted(_SCALES, s_hi, "right")
  empty = s_lo > s_hi
  return np.clip(k_lo, 0, ue4m3.MAX_BYTE), np.where(empty, -1, np.clip(k_hi, 0, ue4m3.MAX_BYTE))


def _no_clip_byte(w, book: Codebook):
  """Smallest byte whose scaled levels span every weight of the row (clamped to 0x7E)."""
  top, bottom = book.levels[-1], book.levels[0]
  need = np.zeros(w.shape[0], np.float32)
  if top > 0:
    need = np.maximum(need, w.max(axis=1) / top)
  if bottom < 0:
    need = np.maximum(need, w.min(axis=1) / bottom)
  return np.minimum(np.searchsorted(_SCALES, need, "left"), ue4m3.MAX_BYTE)


def _merge(best, rows, err, byte, book_i):
  """Keep the lexicographic minimum of (error, book, byte) per row; best = (err, book, byte) arrays."""
  b_err, b_book, b_byte = best
  old_e, old_b, old_k = b_err[rows], b_book[rows], b_byte[rows]
  better = (err < old_e) | ((err == old_e) & ((book_i < old_b) | ((book_i == old_b) & (byte < old_k))))
  r = rows[better]
  b_err[r], b_book[r], b_byte[r] = err[better], book_i, byte[better]


def _search_rows(w, books, exhaustive: bool):
  """Best (error, book, byte) arrays for the rows of w [n, 16]."""
  n = w.shape[0]
  best = (np.full(n, np.inf, np.float32), np.zeros(n, np.int64), np.zeros(n, np.int64))
  fast = [book.steps_exact for book in books]

  def scan(rows, first, offsets, b):
    for a in range(0, len(rows), _ROWS_PER_SCAN):
      r = rows[a:a + _ROWS_PER_SCAN]
      err, byte = _scan(np.ascontiguousarray(w[r].T), first[a:a + _ROWS_PER_SCAN], offsets, books[b], fast[b])
      _merge(best, r, err, byte, b)

  all_rows = np.arange(n)
  if exhaustive:
    for b in range(len(books)):
      scan(all_rows, np.zeros(n, np.int64), range(ue4m3.NUM_VALUES), b)
    return best
  span = _UB_OFFSETS[-1] - _UB_OFFSETS[0]
  for b, book in enumerate(books):  # 1: upper bound (near byte 0 or 0x7E the few bytes shift inwards)
    first = np.clip(_no_clip_byte(w, book) + _UB_OFFSETS[0], 0, ue4m3.MAX_BYTE - span)
    scan(all_rows, first, [o - _UB_OFFSETS[0] for o in _UB_OFFSETS], b)
  for b, book in enumerate(books):  # 2-3: every byte that could still reach the bound
    lo, hi = _byte_window(w, best[0], book)
    width = hi - lo + 1
    rows = np.argsort(width, kind="stable")  # similar widths share a scan
    rows = rows[width[rows] > 0]
    for a in range(0, len(rows), _ROWS_PER_SCAN):
      r = rows[a:a + _ROWS_PER_SCAN]
      size = int(width[r].max())
      first = np.minimum(lo[r], ue4m3.NUM_VALUES - size)  # extra bytes are harmless candidates
      err, byte = _scan(np.ascontiguousarray(w[r].T), first, range(size), book, fast[b])
      _merge(best, r, err, byte, b)
  return best


def _level_index(x, s, book: Codebook):
  """Index of the nearest level to x / s: the count of thresholds s·mid below x, as in `_scan`."""
  idx = np.zeros(np.broadcast_shapes(x.shape, s.shape), np.int8)
  for mid in book.mids:
    idx += x > s * mid
  return idx


def search(halves, books, *, exhaustive: bool = False, threads: int | None = None) -> Choice:
  """Least-error (book, byte, codes) per half-block of `halves` [N, 16], over all `books` (1 or 2) × 127 bytes.
  Weights beyond 2^10 times the largest value any book reaches are clipped there (they saturate either way).

  `threads` (default: the CPU count, at most 8) share chunks of rows; the result does not depend on it.
  """
  w = np.ascontiguousarray(halves, np.float32)
  if w.ndim != 2 or w.shape[1] != HALF:
    raise ValueError(f"search expects half-blocks [N, {HALF}], got shape {w.shape}")
  if not 1 <= len(books) <= 2:
    raise ValueError(f"search takes one or two codebooks, got {len(books)}")
  # Far past every book's reach (~1e7 times it) every byte's float32 error rounds to the same value, and the tie
  # would go to byte 0: all zeros. Clipped to 2^10 times the reach, such a weight saturates as a nearer one does;
  # below that nothing changes.
  reach = max(float(np.abs(b.levels).max()) for b in books) * float(_SCALES[ue4m3.MAX_BYTE]) * 2.0**10
  w = np.clip(w, -reach, reach)
  n = w.shape[0]
  tasks = [slice(a, a + _ROWS_PER_TASK) for a in range(0, n, _ROWS_PER_TASK)]
  threads = threads or min(os.cpu_count() or 1, 8)
  with concurrent.futures.ThreadPoolExecutor(max(1, min(threads, len(tasks)))) as pool:
    parts = list(pool.map(lambda t: _search_rows(w[t], books, exhaustive), tasks))
  err, book_i, byte = (np.concatenate([p[i] for p in parts]) if parts else np.zeros(0) for i in range(3))
  codes = np.empty((n, HALF), np.uint8)
  for b, book in enumerate(books):
    r = np.nonzero(book_i == b)[0]
    codes[r] = book.codes[_level_index(w[r], _SCALES[byte[r]][:, None], book)]
  return Choice(book_i.astype(np.uint8), byte.astype(np.uint8), codes, err.astype(np.float32))
