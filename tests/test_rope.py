"""RoPE / YaRN (docs/model.md §3) against an independent numpy reference.

The rotation reference is a complex multiplication: pair (x[2i], x[2i+1]) of the LAST r dims is read as
x[2i] + i*x[2i+1] and multiplied by e^{i*p*f_i}. The YaRN table is recomputed from the formula in float64.
"""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from ds4jax import config, rope
from ds4jax.config import Attention, Yarn
from kernels_pallas.mla.reference import apply_rope


def ref_inv_freq(r, theta, yarn=None):
  """float64 f_i = theta^(-2i/r), YaRN-blended (DeepSeek-V3 form, written from the doc's formula)."""
  f = np.array([theta ** (-2.0 * i / r) for i in range(r // 2)], np.float64)
  if yarn is None:
    return f
  L0, factor = yarn.original_max_position_embeddings, yarn.factor
  low = max(math.floor(r * math.log(L0 / (yarn.beta_fast * 2 * math.pi)) / (2 * math.log(theta))), 0)
  high = min(math.ceil(r * math.log(L0 / (yarn.beta_slow * 2 * math.pi)) / (2 * math.log(theta))), r - 1)
  if high == low:
    high += 0.001
  out = np.empty_like(f)
  for i in range(r // 2):
    ramp = min(max((i - low) / (high - low), 0.0), 1.0)
    out[i] = f[i] / factor * ramp + f[i] * (1 - ramp)
  return out


def ref_rope(x, positions, freqs, sign=1.0):
  """Complex-multiply reference on the last 2*len(freqs) dims; x [S, ..., d], positions [S]."""
  x = np.asarray(x, np.float64)
  r = 2 * len(freqs)
  out = x.copy()
  for s, p in enumerate(np.asarray(positions)):
    z = x[s, ..., -r::2] + 1j * x[s, ..., -r + 1::2]
    z = z * np.exp(1j * sign * float(p) * np.asarray(freqs, np.float64))
    out[s, ..., -r::2] = z.real
    out[s, ..., -r + 1::2] = z.imag
  return out


def test_yarn_flash_numbers_low15_high25():
  """V4-Flash compressed table: r=64, theta=160000, factor 16, L0 65536, beta 32/1 -> low 15, high 25."""
  yarn = Yarn(factor=16.0, original_max_position_embeddings=65536, beta_fast=32.0, beta_slow=1.0)
  r, theta = 64, 160000.0
  got = np.asarray(rope.inv_freq(r, theta, yarn), np.float64)
  assert got.shape == (32,)
  base = np.array([theta ** (-2.0 * i / r) for i in range(32)])
  # i <= 15: ramp 0 (original frequency); i >= 25: ramp 1 (frequency / 16); strictly between in 16..24.
  np.testing.assert_allclose(got[:16], base[:16], rtol=1e-6)
  np.testing.assert_allclose(got[25:], base[25:] / 16, rtol=1e-6)
  for i in range(16, 25):
    assert base[i] / 16 * (1 + 1e-3) < got[i] < base[i] * (1 - 1e-3), i
    ramp = (i - 15) / 10
    np.testing.assert_allclose(got[i], base[i] / 16 * ramp + base[i] * (1 - ramp), rtol=1e-6)
  # The preset carries exactly these numbers.
  flash = config.v4_flash()
  np.testing.assert_allclose(rope.layer_inv_freq(flash, Attention.CSA), got, rtol=0)
  np.testing.assert_allclose(rope.layer_inv_freq(flash, Attention.HCA), got, rtol=0)


@pytest.mark.parametrize("r,theta,yarn", [
    (32, 160000.0, Yarn(factor=4.0, original_max_position_embeddings=32)),
    (16, 10000.0, Yarn(factor=8.0, original_max_position_embeddings=4096, beta_fast=16.0, beta_slow=2.0)),
    (64, 10000.0, None),
])
def test_inv_freq_matches_formula(r, theta, yarn):
  np.testing.assert_allclose(rope.inv_freq(r, theta, yarn), ref_inv_freq(r, theta, yarn), rtol=1e-6)


def test_layer_inv_freq_window_vs_compressed():
  """Window layers: rope_theta, no YaRN; compressed layers: compress_rope_theta with YaRN."""
  cfg = config.tiny()
  r = cfg.rope_head_dim
  win = rope.layer_inv_freq(cfg, Attention.WINDOW)
  np.testing.assert_allclose(win, ref_inv_freq(r, cfg.rope_theta), rtol=1e-6)
  comp = ref_inv_freq(r, cfg.compress_rope_theta, cfg.yarn)
  for kind in (Attention.CSA, Attention.HCA):
    np.testing.assert_allclose(rope.layer_inv_freq(cfg, kind), comp, rtol=1e-6)
  # The two tables really differ (different theta, and YaRN lowers the low frequencies).
  assert np.max(np.abs(win - comp) / win) > 0.5
  assert not np.allclose(comp, ref_inv_freq(r, cfg.compress_rope_theta), rtol=1e-3)


@pytest.mark.parametrize("shape", [(11, 24), (11, 3, 24)])
def test_apply_matches_complex_reference_last_dims_only(rng, shape):
  freqs = ref_inv_freq(8, 100.0).astype(np.float32)  # r = 8 of d = 24: nope dims are the first 16
  x = rng.standard_normal(shape).astype(np.float32)
  pos = rng.integers(0, 200, size=shape[0])
  got = np.asarray(apply_rope(jnp.asarray(x), jnp.asarray(pos), freqs))
  want = ref_rope(x, pos, freqs)
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
  np.testing.assert_array_equal(got[..., :16], x[..., :16])  # nope dims untouched, bit for bit
  assert np.max(np.abs(got[..., 16:] - x[..., 16:])) > 0.1  # and the rope dims did move


def test_apply_inverse_undoes_rotation(rng):
  freqs = ref_inv_freq(16, 10000.0).astype(np.float32)
  x = rng.standard_normal((9, 2, 40)).astype(np.float32)
  pos = jnp.asarray(rng.integers(0, 500, size=9))
  rot = apply_rope(jnp.asarray(x), pos, freqs)
  np.testing.assert_allclose(np.asarray(apply_rope(rot, pos, freqs, inverse=True)), x, atol=2e-5)
  # inverse is the rotation by -p, checked against the complex reference
  np.testing.assert_allclose(np.asarray(apply_rope(jnp.asarray(x), pos, freqs, inverse=True)),
                             ref_rope(x, np.asarray(pos), freqs, sign=-1.0), atol=2e-5, rtol=1e-5)


def test_relative_position_property(rng):
  """<rope(q, p1), rope(k, p2)> depends only on p1 - p2."""
  freqs = ref_inv_freq(16, 10000.0).astype(np.float32)
  q = rng.standard_normal((1, 24)).astype(np.float32)
  k = rng.standard_normal((1, 24)).astype(np.float32)

  def dot(p1, p2):
    a = apply_rope(jnp.asarray(q), jnp.asarray([p1]), freqs)
    b = apply_rope(jnp.asarray(k), jnp.asarray([p2]), freqs)
    return float(jnp.sum(a * b))

  for p1, p2 in [(7, 3), (3, 7), (20, 20)]:
    base = dot(p1, p2)
    for shift in (1, 13, 50):
      np.testing.assert_allclose(dot(p1 + shift, p2 + shift), base, atol=1e-4, rtol=1e-5)
  # ...and does change with the offset itself.
  assert abs(dot(7, 3) - dot(8, 3)) > 1e-3
