"""Attention (docs/model.md §4): masks, the sink softmax, and whole layers of each kind against a per-query loop.

The loop reference gathers each query's key set explicitly (window rows t-W < j <= t, plus every visible compressed
row on HCA layers or the indexer's picks on CSA layers), runs one joint softmax with the per-head sink (denominator
only, no value), de-rotates the last r dims of the output by -t, and applies the grouped low-rank output projection.
Compressor rows and indexer picks are taken from the module itself (they have their own tests).
"""

import math

import jax.numpy as jnp
import numpy as np
from flax import nnx

from ds4jax import config
from ds4jax.attention import Attention
from kernels_pallas.mla.reference import selected_bias, sink_attention, window_bias
from ds4jax.config import Attention as Kind

S = 37


def softmax_with_sink(scores, sink):
  z = np.append(scores, sink)
  p = np.exp(z - z.max())
  return p[:-1] / p.sum()


def test_sink_attention_matches_numpy(rng):
  Sq, H, N, d = 5, 3, 7, 6
  q = rng.standard_normal((Sq, H, d)).astype(np.float32)
  keys = rng.standard_normal((N, d)).astype(np.float32)
  mask = rng.uniform(size=(Sq, N)) < 0.6
  mask[:, 0] = True
  mask[Sq - 1] = False  # a query with no key at all: only the sink, so the output is 0
  bias = np.where(mask, 0.0, -np.inf).astype(np.float32)
  sink = (2 * rng.standard_normal(H)).astype(np.float32)
  scale = 0.7
  got = np.asarray(sink_attention(jnp.asarray(q), jnp.asarray(keys), jnp.asarray(bias), jnp.asarray(sink), scale))
  q64, k64 = q.astype(np.float64), keys.astype(np.float64)
  for t in range(Sq):
    vis = np.flatnonzero(mask[t])
    for h in range(H):
      p = softmax_with_sink(scale * (k64[vis] @ q64[t, h]), float(sink[h]))
      want = p @ k64[vis] if len(vis) else np.zeros(d)
      np.testing.assert_allclose(got[t, h], want, atol=1e-6, rtol=1e-5)
  # The sink takes mass: the key weights sum to < 1, so outputs are smaller than a sink-free softmax's.
  t, h = 0, 0
  vis = np.flatnonzero(mask[t])
  s = scale * (k64[vis] @ q64[t, h])
  no_sink = np.exp(s - s.max()) / np.exp(s - s.max()).sum() @ k64[vis]
  assert np.max(np.abs(got[t, h] - no_sink)) > 1e-3


def test_sink_attention_huge_sink_gives_zero_and_tiny_sink_plain_softmax(rng):
  q = rng.standard_normal((2, 2, 4)).astype(np.float32)
  keys = rng.standard_normal((3, 4)).astype(np.float32)
  bias = np.zeros((2, 3), np.float32)
  out = np.asarray(sink_attention(jnp.asarray(q), jnp.asarray(keys), jnp.asarray(bias),
                                  jnp.asarray([60.0, -60.0]), 1.0))
  np.testing.assert_allclose(out[:, 0], 0.0, atol=1e-12)  # all mass on the sink, which has no value
  for t in range(2):
    s = keys.astype(np.float64) @ q[t, 1]
    p = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
    np.testing.assert_allclose(out[t, 1], p @ keys, atol=1e-6, rtol=1e-5)


def test_window_bias():
  W = 4
  q_pos, k_pos = np.arange(10, 16), np.arange(20)
  got = np.asarray(window_bias(jnp.asarray(q_pos), jnp.asarray(k_pos), W))
  for a, t in enumerate(q_pos):
    for b, j in enumerate(k_pos):
      assert got[a, b] == (0.0 if t - W < j <= t else -np.inf), (t, j)
  # self window: the current token plus the previous W-1
  got = np.asarray(window_bias(jnp.arange(12), jnp.arange(12), W))
  for t in range(12):
    assert set(np.flatnonzero(got[t] == 0).tolist()) == set(range(max(0, t - W + 1), t + 1))


def test_selected_bias_with_minus_one():
  topk = np.array([[2, -1, -1], [0, 5, 3], [-1, -1, -1], [4, 4, -1]], np.int32)
  got = np.asarray(selected_bias(jnp.asarray(topk), 6))
  assert got.shape == (4, 6)
  for t in range(4):
    picked = {int(i) for i in topk[t] if i >= 0}
    for r in range(6):
      assert got[t, r] == (0.0 if r in picked else -np.inf), (t, r)


# ---------------------------------------------------------------- the whole layer

def ref_inv_freq(r, theta, yarn=None):
  f = np.array([theta ** (-2.0 * i / r) for i in range(r // 2)])
  if yarn is None:
    return f
  cd = lambda rot: r * math.log(yarn.original_max_position_embeddings / (rot * 2 * math.pi)) / (2 * math.log(theta))
  low, high = max(math.floor(cd(yarn.beta_fast)), 0), min(math.ceil(cd(yarn.beta_slow)), r - 1)
  high = high + 0.001 if high == low else high
  ramp = np.clip((np.arange(r // 2) - low) / (high - low), 0, 1)
  return f / yarn.factor * ramp + f * (1 - ramp)


def ref_rope(v, p, freqs):
  """Complex-multiply rotation of the last 2*len(freqs) dims of a vector."""
  r = 2 * len(freqs)
  out = np.array(v, np.float64)
  z = (out[-r::2] + 1j * out[-r + 1::2]) * np.exp(1j * p * np.asarray(freqs, np.float64))
  out[-r::2], out[-r + 1::2] = z.real, z.imag
  return out


def rmsnorm(v, eps):
  return v / np.sqrt(np.mean(v ** 2, axis=-1, keepdims=True) + eps)


_layer = nnx.jit(lambda a, x: a(x, jnp.arange(x.shape[0])))
_rows = nnx.jit(lambda a, x, freqs: a.compressor(x, freqs))
_picks = nnx.jit(lambda a, x, freqs: a.indexer(x, a.q_norm(a.wq_a(x)), jnp.arange(x.shape[0]), freqs))


def make_layer(seed, rng, cfg):
  attn = Attention(cfg, 0, rngs=nnx.Rngs(params=seed))
  setp = lambda p, v: p.set_value(jnp.asarray(v, jnp.float32))
  setp(attn.q_norm.weight, 1 + 0.3 * rng.standard_normal(cfg.q_lora_rank))
  setp(attn.kv_norm.weight, 1 + 0.3 * rng.standard_normal(cfg.head_dim))
  setp(attn.attn_sink, rng.standard_normal(cfg.num_heads))
  setp(attn.wo_a.weight, 0.2 * rng.standard_normal(attn.wo_a.weight.shape))
  setp(attn.wo_b.weight, 0.2 * rng.standard_normal(attn.wo_b.weight.shape))
  if attn.compressor is not None:
    c = attn.compressor
    setp(c.norm.weight, 1 + 0.3 * rng.standard_normal(cfg.head_dim))
    setp(c.wgate.weight, 0.5 * rng.standard_normal(c.wgate.weight.shape))
    setp(c.ape, rng.standard_normal(c.ape.shape))
  return attn


def ref_layer(attn, cfg, kind, x, rows=None, picks=None):
  H, d, r, G, W, eps = (cfg.num_heads, cfg.head_dim, cfg.rope_head_dim, cfg.o_groups, cfg.sliding_window,
                        cfg.rms_norm_eps)
  freqs = (ref_inv_freq(r, cfg.rope_theta) if kind is Kind.WINDOW
           else ref_inv_freq(r, cfg.compress_rope_theta, cfg.yarn))
  P = lambda p: np.asarray(p[...], np.float64)
  x = x.astype(np.float64)
  qr = rmsnorm(x @ P(attn.wq_a.weight).T, eps) * P(attn.q_norm.weight)
  q = rmsnorm((qr @ P(attn.wq_b.weight).T).reshape(S, H, d), eps)
  kv = rmsnorm(x @ P(attn.wkv.weight).T, eps) * P(attn.kv_norm.weight)
  sink = P(attn.attn_sink)
  o = np.zeros((S, H, d))
  for t in range(S):
    keys = [ref_rope(kv[j], j, freqs) for j in range(max(0, t - W + 1), t + 1)]
    if kind is Kind.HCA:
      keys += [rows[w] for w in range(rows.shape[0]) if w < (t + 1) // attn.compressor.ratio]
    elif kind is Kind.CSA:
      keys += [rows[w] for w in picks[t] if w >= 0]
    keys = np.stack(keys)
    for h in range(H):
      qt = ref_rope(q[t, h], t, freqs)
      p = softmax_with_sink(d ** -0.5 * (keys @ qt), sink[h])
      o[t, h] = ref_rope(p @ keys, -t, freqs)  # de-rotate at the query position
  og = o.reshape(S, G, H * d // G)
  wo_a = P(attn.wo_a.weight).reshape(G, cfg.o_lora_rank, H * d // G)
  z = np.zeros((S, G, cfg.o_lora_rank))
  for g in range(G):
    z[:, g] = og[:, g] @ wo_a[g].T
  return z.reshape(S, -1) @ P(attn.wo_b.weight).T


def check(got, want):
  scale = np.abs(want).max()
  assert scale > 0.1
  np.testing.assert_allclose(got, want, atol=1e-5 * scale, rtol=1e-4)


def test_window_layer_matches_loop_reference(seed, rng):
  cfg = config.tiny()
  assert cfg.attention[0] is Kind.WINDOW
  attn = make_layer(seed, rng, cfg)
  assert attn.compressor is None and attn.indexer is None
  x = rng.standard_normal((S, cfg.hidden_size)).astype(np.float32)
  got = np.asarray(_layer(attn, jnp.asarray(x)))
  check(got, ref_layer(attn, cfg, Kind.WINDOW, x))


def test_hca_layer_matches_loop_reference(seed, rng):
  cfg = config.tiny_hca()
  assert cfg.attention[0] is Kind.HCA and cfg.hca_ratio == 8
  attn = make_layer(seed, rng, cfg)
  assert attn.indexer is None and attn.compressor.ratio == 8 and not attn.compressor.overlap
  x = rng.standard_normal((S, cfg.hidden_size)).astype(np.float32)
  freqs = ref_inv_freq(cfg.rope_head_dim, cfg.compress_rope_theta, cfg.yarn).astype(np.float32)
  rows = np.asarray(_rows(attn, jnp.asarray(x), freqs), np.float64)
  assert rows.shape == (S // 8, cfg.head_dim)
  got = np.asarray(_layer(attn, jnp.asarray(x)))
  want = ref_layer(attn, cfg, Kind.HCA, x, rows=rows)
  check(got, want)
  # the compressed rows matter: the window-only answer differs from query 7 on, and equals it before
  window_only = ref_layer(attn, cfg, Kind.HCA, x, rows=rows[:0])  # no rows
  np.testing.assert_allclose(got[:7], window_only[:7], atol=1e-5 * np.abs(want).max(), rtol=1e-4)
  assert np.max(np.abs(got[7:] - window_only[7:])) > 1e-3


def test_csa_layer_matches_loop_reference(seed, rng):
  cfg = config.tiny_csa()
  assert cfg.attention[0] is Kind.CSA and cfg.index_topk == 4
  attn = make_layer(seed, rng, cfg)
  assert attn.compressor.ratio == 4 and attn.compressor.overlap and attn.indexer is not None
  x = rng.standard_normal((S, cfg.hidden_size)).astype(np.float32)
  freqs = ref_inv_freq(cfg.rope_head_dim, cfg.compress_rope_theta, cfg.yarn).astype(np.float32)
  rows = np.asarray(_rows(attn, jnp.asarray(x), freqs), np.float64)
  picks = np.asarray(_picks(attn, jnp.asarray(x), freqs))
  assert rows.shape == (S // 4, cfg.head_dim) and picks.shape == (S, 4)
  # the indexer really drops rows for late queries, and never picks an invisible one
  assert any(len({p for p in picks[t] if p >= 0}) < (t + 1) // 4 for t in range(S))
  assert all(p < (t + 1) // 4 for t in range(S) for p in picks[t] if p >= 0)
  got = np.asarray(_layer(attn, jnp.asarray(x)))
  check(got, ref_layer(attn, cfg, Kind.CSA, x, rows=rows, picks=picks))
  # taking every visible row instead of the picks gives a different answer
  all_rows = ref_layer(attn, cfg, Kind.CSA, x, rows=rows,
                       picks=np.array([[w if w < (t + 1) // 4 else -1 for w in range(S // 4)] for t in range(S)]))
  assert np.max(np.abs(got - all_rows)) > 1e-3


def test_window_layer_ignores_tokens_outside_the_window(seed, rng):
  """Causality and window size of a window-only layer: output t depends only on x[t-W+1 .. t]."""
  cfg = config.tiny()
  attn = make_layer(seed, rng, cfg)
  x = rng.standard_normal((S, cfg.hidden_size)).astype(np.float32)
  base = np.asarray(_layer(attn, jnp.asarray(x)))
  t, W = 20, cfg.sliding_window
  x2 = x.copy()
  x2[: t - W + 1] += 1.0  # before the window of query t
  x2[t + 1:] += 1.0  # the future
  got = np.asarray(_layer(attn, jnp.asarray(x2)))
  np.testing.assert_allclose(got[t], base[t], atol=1e-6, rtol=1e-5)
  assert np.max(np.abs(got[t + 1] - base[t + 1])) > 1e-4
  assert np.max(np.abs(got[t - 1] - base[t - 1])) > 1e-4
