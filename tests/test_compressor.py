"""Gated-pooling compressor (docs/model.md §5) against a per-window, per-channel numpy loop.

Covers the overlapping CSA form (ratio 4; FIRST `dim` channels = PREVIOUS window; window 0's previous
slots have value 0 and logit -inf) and the non-overlapping HCA form, incomplete trailing windows, S < ratio,
causality, and `visible_rows`.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ds4jax.compressor import Compressor
from kernels_pallas.mla.reference import visible_rows

HIDDEN, DIM, EPS = 16, 12, 1e-6
FREQS = (100.0 ** -(np.arange(4) / 4)).astype(np.float32)  # r = 8: rope on the last 8 of 12 dims
# One jitted entry point: eager jnp recompiles every op for each new shape, which is much slower.
_run = nnx.jit(lambda comp, x: comp(x, FREQS))


def run(comp, x):
  return np.asarray(_run(comp, jnp.asarray(x, jnp.float32)))


def ref_rope_row(v, p, freqs):
  r = 2 * len(freqs)
  out = v.copy()
  z = (v[-r::2] + 1j * v[-r + 1::2]) * np.exp(1j * p * np.asarray(freqs, np.float64))
  out[-r::2], out[-r + 1::2] = z.real, z.imag
  return out


def ref_compress(x, wkv, wgate, ape, norm_w, m, overlap, freqs, eps=EPS):
  """Loop reference: per window w and channel ch, a softmax over the slots of (gate + ape)."""
  x = np.asarray(x, np.float64)
  kv = x @ np.asarray(wkv, np.float64).T
  z = x @ np.asarray(wgate, np.float64).T
  ape = np.asarray(ape, np.float64)
  c = len(norm_w)
  n = x.shape[0] // m
  rows = np.zeros((n, c))
  for w in range(n):
    pooled = np.zeros(c)
    for ch in range(c):
      vals, logits = [], []
      if overlap:
        for j in range(m):  # previous window, first c channels
          if w == 0:
            vals.append(0.0)
            logits.append(-np.inf)
          else:
            vals.append(kv[(w - 1) * m + j, ch])
            logits.append(z[(w - 1) * m + j, ch] + ape[j, ch])
        for j in range(m):  # current window, last c channels
          vals.append(kv[w * m + j, c + ch])
          logits.append(z[w * m + j, c + ch] + ape[j, c + ch])
      else:
        for j in range(m):
          vals.append(kv[w * m + j, ch])
          logits.append(z[w * m + j, ch] + ape[j, ch])
      logits = np.array(logits)
      p = np.exp(logits - logits.max())
      pooled[ch] = np.dot(p / p.sum(), vals)
    normed = pooled / np.sqrt(np.mean(pooled ** 2) + eps) * np.asarray(norm_w, np.float64)
    rows[w] = ref_rope_row(normed, w * m, freqs)
  return rows


def make(seed, rng, ratio, overlap):
  """A compressor with non-trivial weights: larger gates and ape so the softmax is far from uniform."""
  comp = Compressor(HIDDEN, DIM, ratio, overlap, EPS, rngs=nnx.Rngs(params=seed))
  width = (2 if overlap else 1) * DIM
  assert comp.wkv.weight.shape == (width, HIDDEN) and comp.ape.shape == (ratio, width)
  comp.wkv.weight.set_value(jnp.asarray(0.3 * rng.standard_normal((width, HIDDEN)), jnp.float32))
  comp.wgate.weight.set_value(jnp.asarray(0.5 * rng.standard_normal((width, HIDDEN)), jnp.float32))
  comp.ape.set_value(jnp.asarray(rng.standard_normal((ratio, width)), jnp.float32))
  comp.norm.weight.set_value(jnp.asarray(1 + 0.5 * rng.standard_normal(DIM), jnp.float32))
  return comp


def ref_of(comp, x):
  return ref_compress(x, comp.wkv.weight[...], comp.wgate.weight[...], comp.ape[...], comp.norm.weight[...],
                      comp.ratio, comp.overlap, FREQS)


# Few distinct shapes (each one is a compile): S = 23 for ratio 4, 29 for ratio 8, both with a trailing
# incomplete window.
S4, S8 = 23, 29


@pytest.mark.parametrize("ratio,overlap,S", [(4, True, S4), (8, False, S8), (4, False, S4)])
def test_compressor_matches_loop_reference(seed, rng, ratio, overlap, S):
  comp = make(seed, rng, ratio, overlap)
  x = rng.standard_normal((S, HIDDEN)).astype(np.float32)
  got = run(comp, x)
  want = ref_of(comp, x)
  assert got.shape == (S // ratio, DIM)  # the incomplete trailing window produces no row
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


def test_overlap_channel_halves_not_swapped(seed, rng):
  """The reference with the halves swapped (first c = current window) must NOT match."""
  comp = make(seed, rng, 4, True)
  x = rng.standard_normal((S4, HIDDEN)).astype(np.float32)
  got = run(comp, x)
  swap = lambda a: np.concatenate([a[..., DIM:], a[..., :DIM]], axis=-1)
  wrong = ref_compress(x, swap(np.asarray(comp.wkv.weight[...]).T).T, swap(np.asarray(comp.wgate.weight[...]).T).T,
                       swap(np.asarray(comp.ape[...])), comp.norm.weight[...], 4, True, FREQS)
  assert np.max(np.abs(got - wrong)) > 1e-2
  np.testing.assert_allclose(got, ref_of(comp, x), atol=2e-5, rtol=2e-5)


def test_window0_has_no_previous_contribution(seed, rng):
  """Row 0 of CSA depends only on tokens 0..3 through the current-window half (previous slots are -inf)."""
  comp = make(seed, rng, 4, True)
  x = rng.standard_normal((S4, HIDDEN)).astype(np.float32)
  row0 = run(comp, x)[0]
  # Equivalent to a non-overlapping compressor over the current-window half only.
  half = ref_compress(x, np.asarray(comp.wkv.weight[...])[DIM:], np.asarray(comp.wgate.weight[...])[DIM:],
                      np.asarray(comp.ape[...])[:, DIM:], comp.norm.weight[...], 4, False, FREQS)[0]
  np.testing.assert_allclose(row0, half, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("ratio,overlap,S", [(4, True, 3), (8, False, 7), (4, True, 0)])
def test_shorter_than_ratio_gives_zero_rows(seed, rng, ratio, overlap, S):
  comp = make(seed, rng, ratio, overlap)
  got = comp(jnp.asarray(rng.standard_normal((S, HIDDEN)), jnp.float32), FREQS)  # eager: no compile here
  assert got.shape == (0, DIM)


@pytest.mark.parametrize("ratio,overlap,S", [(4, True, S4), (8, False, S8)])
def test_causality(seed, rng, ratio, overlap, S):
  """Perturbing x at positions >= (w+1)*ratio leaves rows 0..w unchanged, and does change row w+1.
  The last w perturbs only the incomplete trailing window, which must change nothing."""
  comp = make(seed, rng, ratio, overlap)
  n = S // ratio
  x = rng.standard_normal((S, HIDDEN)).astype(np.float32)
  base = run(comp, x)
  for w in range(n):
    x2 = x.copy()
    x2[(w + 1) * ratio:] += rng.standard_normal((S - (w + 1) * ratio, HIDDEN)).astype(np.float32)
    got = run(comp, x2)
    np.testing.assert_array_equal(got[:w + 1], base[:w + 1])
    if w + 1 < n:
      assert np.max(np.abs(got[w + 1] - base[w + 1])) > 1e-3


@pytest.mark.parametrize("ratio,overlap,S,changed", [(4, True, S4, {1, 2}), (8, False, S8, {1})])
def test_one_window_reaches_its_rows_only(seed, rng, ratio, overlap, S, changed):
  """Perturbing window 1 alone changes row 1, and row 2 only with overlap (CSA's previous-window slots)."""
  comp = make(seed, rng, ratio, overlap)
  x = rng.standard_normal((S, HIDDEN)).astype(np.float32)
  x2 = x.copy()
  x2[ratio:2 * ratio] += rng.standard_normal((ratio, HIDDEN)).astype(np.float32)
  a, b = run(comp, x), run(comp, x2)
  diff = np.max(np.abs(a - b), axis=-1)
  assert {w for w in range(S // ratio) if diff[w] > 1e-4} == changed, diff
  for w in range(S // ratio):
    if w not in changed:
      assert diff[w] == 0.0


def test_rows_rotated_at_window_start(seed, rng):
  """The same pooled content gives rows that differ only by RoPE at w*ratio: de-rotating them by -w*ratio
  with identical windows makes all HCA rows equal."""
  comp = make(seed, rng, 8, False)
  win = rng.standard_normal((8, HIDDEN)).astype(np.float32)
  rows = run(comp, np.tile(win, (4, 1))[:S8]).astype(np.float64)  # 3 identical windows + 5 trailing
  unrot = np.stack([ref_rope_row(rows[w], -8.0 * w, FREQS) for w in range(3)])
  np.testing.assert_allclose(unrot[1], unrot[0], atol=3e-5)
  np.testing.assert_allclose(unrot[2], unrot[0], atol=3e-5)
  assert np.max(np.abs(rows[1] - rows[0])) > 1e-2  # the rotation itself is not trivial


@pytest.mark.parametrize("ratio", [4, 8])
def test_visible_rows(ratio):
  S, n = 3 * ratio + 3, 4
  got = np.asarray(visible_rows(jnp.arange(S), n, ratio))
  want = np.zeros((S, n), bool)
  for t in range(S):
    for w in range(n):
      want[t, w] = (w + 1) * ratio - 1 <= t  # the window's last token has been seen
  np.testing.assert_array_equal(got, want)
  # spot checks: row 0 first visible at t = ratio-1
  assert not got[ratio - 2, 0] and got[ratio - 1, 0] and not got[ratio - 1, 1]
