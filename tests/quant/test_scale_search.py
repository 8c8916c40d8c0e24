"""The pruned UE4M3 scale search equals the exhaustive one (ds4jax.quant.scale_search)."""

import ml_dtypes
import numpy as np
import pytest

from ds4jax.quant import rocmfp2, rocmfp3, scale_search, ue4m3


def hard_rows(rng, n):
  """Half-blocks spanning the cases that stress the pruning bound."""
  parts = [
      rng.standard_normal((n, 16)) * np.exp2(rng.uniform(-14, 10, (n, 1))),  # every magnitude, clipping at 224
      rng.standard_t(1.5, (n, 16)) * 0.05,  # very heavy tails
      np.zeros((4, 16)),  # all-zero rows: every byte ties
      np.full((4, 16), 3e-4),  # constant rows below the smallest scale steps
      rng.choice([-1.0, 0.0, 1.0, 2.0], (n, 16)) * ue4m3.VALUES[rng.integers(1, 127, (n, 1))],  # exact fits
      np.where(rng.uniform(size=(n, 16)) < 0.1, 5.0, 0.01) * rng.choice([-1, 1], (n, 16)),  # sparse spikes
      rng.uniform(-1, 1, (n, 16)) * 1e3,  # beyond the largest scale
  ]
  return np.concatenate(parts).astype(np.float32)


def random_book(rng, k, sign):
  """A random BF16-valued codebook; sign +1 / -1 gives all-positive / all-negative levels (no 0 among them)."""
  while True:
    v = np.sort(np.abs(rng.standard_normal(k)) * sign if sign else rng.standard_normal(k))
    v = v.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)
    if np.all(np.diff(v) > 0):
      return scale_search.Codebook(v, np.arange(k))


BOOKS = {
    "rocmfp2": lambda rng: [rocmfp2.PLAIN, rocmfp2.FLIPPED],
    "rocmfp3": lambda rng: [rocmfp3.CODEBOOK],
    "random4": lambda rng: [random_book(rng, 4, 0), random_book(rng, 4, 0)],
    "random8": lambda rng: [random_book(rng, 8, 0), random_book(rng, 8, 0)],
    "positive_negative": lambda rng: [random_book(rng, 4, 1), random_book(rng, 4, -1)],
    "wide_range": lambda rng: [scale_search.Codebook([-3.0, 2.0**-30, 5.0, 7.0], np.arange(4))],  # step 3 + 2^-30
}


@pytest.mark.parametrize("kind", BOOKS)
def test_pruned_search_equals_exhaustive(rng, kind):
  books = BOOKS[kind](rng)
  w = hard_rows(rng, 300)
  fast = scale_search.search(w, books)
  full = scale_search.search(w, books, exhaustive=True)
  np.testing.assert_array_equal(fast.byte, full.byte)
  np.testing.assert_array_equal(fast.book, full.book)
  np.testing.assert_array_equal(fast.codes, full.codes)
  np.testing.assert_array_equal(fast.error, full.error)
  if kind == "wide_range":  # steps of this book are not exact in float32: the gather path ran
    assert not books[0].steps_exact
  elif kind.startswith("rocmfp"):
    assert all(b.steps_exact for b in books)


def test_choice_is_nearest_level_and_error_is_the_decoders(rng):
  books = [rocmfp2.PLAIN, rocmfp2.FLIPPED]
  w = hard_rows(rng, 200)
  c = scale_search.search(w, books)
  s = ue4m3.VALUES[c.byte].astype(np.float32)[:, None]
  levels = np.stack([b.levels for b in books])[c.book]  # [N, 4] sorted levels of the chosen book
  code_to_level = {0: {int(k): float(v) for k, v in zip(books[0].codes, books[0].levels)},
                   1: {int(k): float(v) for k, v in zip(books[1].codes, books[1].levels)}}
  chosen = np.array([[code_to_level[b][int(x)] for x in row] for b, row in zip(c.book, c.codes)], np.float32)
  value = chosen * s  # what the decoder computes
  dist = np.abs(w.astype(np.float64) - value)
  others = np.abs(w[:, :, None].astype(np.float64) - (levels[:, None, :] * s[:, :, None]))
  assert np.all(dist <= others.min(-1) * (1 + 1e-6) + 1e-30)
  np.testing.assert_allclose(c.error, (dist**2).sum(1), rtol=1e-5, atol=1e-30)


def test_result_does_not_depend_on_threads_or_chunking(rng, monkeypatch):
  w = hard_rows(rng, 500)
  one = scale_search.search(w, [rocmfp3.CODEBOOK], threads=1)
  monkeypatch.setattr(scale_search, "_ROWS_PER_TASK", 257)
  monkeypatch.setattr(scale_search, "_ROWS_PER_SCAN", 61)
  many = scale_search.search(w, [rocmfp3.CODEBOOK], threads=3)
  for a, b in zip((one.byte, one.book, one.codes, one.error), (many.byte, many.book, many.codes, many.error)):
    np.testing.assert_array_equal(a, b)


def test_rejects_bad_arguments(rng):
  with pytest.raises(ValueError, match=r"half-blocks \[N, 16\], got shape \(4, 8\)"):
    scale_search.search(np.zeros((4, 8), np.float32), [rocmfp3.CODEBOOK])
  with pytest.raises(ValueError, match="one or two codebooks, got 3"):
    scale_search.search(np.zeros((4, 16), np.float32), [rocmfp3.CODEBOOK] * 3)
  with pytest.raises(ValueError, match="strictly increasing"):
    scale_search.Codebook([0.0, 1.0, 1.0], [0, 1, 2])
  with pytest.raises(ValueError, match="finite"):
    scale_search.Codebook([0.0, np.nan], [0, 1])


@pytest.mark.parametrize("kind", ["rocmfp2", "rocmfp3", "positive_negative"])
@pytest.mark.parametrize("value", [1e6, 1e12, 3e38])
def test_weights_far_past_the_largest_scale_saturate(rng, kind, value):
  """A half-block of huge weights takes the largest scale and the book's extreme level (at 1e12 the float32 errors of
  every byte were once equal, and the tie gave byte 0: a block of zeros)."""
  books = BOOKS[kind](rng)
  w = np.array([[value] * 8 + [-value] * 8], np.float32)
  c = scale_search.search(w, books)
  book = books[int(c.book[0])]
  level = dict(zip(book.codes.tolist(), book.levels.tolist()))
  decoded = np.array([level[int(x)] for x in c.codes[0]]) * ue4m3.VALUES[c.byte[0]]
  assert c.byte[0] == ue4m3.MAX_BYTE
  np.testing.assert_array_equal(decoded[:8], book.levels[-1] * ue4m3.VALUES[ue4m3.MAX_BYTE])
  np.testing.assert_array_equal(decoded[8:], book.levels[0] * ue4m3.VALUES[ue4m3.MAX_BYTE])
