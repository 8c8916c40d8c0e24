"""Lightning indexer (docs/model.md §6) against a numpy loop reference.

score[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s]), w = weights_proj(x) * ci^-0.5 * Hi^-0.5, q rotated at t with the
compressed-layer table, k from the indexer's own overlapping ratio-4 compressor (dim index_head_dim); -inf for
s >= (t+1)//4; the selection is the best min(k, visible) rows, -1 for the rest.
"""

import jax.numpy as jnp
import numpy as np
from flax import nnx

from ds4jax import config, rope
from ds4jax.config import Attention
from ds4jax.indexer import Indexer

S = 37  # 9 complete ratio-4 windows plus one token


def small_cfg(**kw):
  # 16 index heads: a score is exactly 0 only if all 16 relu terms are, so ties are (practically) absent.
  return config.tiny_csa(hidden_size=32, q_lora_rank=16, head_dim=48, rope_head_dim=16, index_n_heads=16,
                         index_head_dim=32, **kw)


# Jitted entry points (eager jnp would recompile every op per shape, which is slower).
_scores = nnx.jit(lambda m, x, qr, freqs: m.scores(x, qr, jnp.arange(x.shape[0]), freqs))
_select = nnx.jit(lambda m, x, qr, freqs: m(x, qr, jnp.arange(x.shape[0]), freqs))
_keys = nnx.jit(lambda m, x, freqs: m.compressor(x, freqs))


def make(seed, rng, cfg):
  idx = Indexer(cfg, rngs=nnx.Rngs(params=seed))
  ci = cfg.index_head_dim
  c = idx.compressor
  assert (c.dim, c.ratio, c.overlap) == (ci, 4, True)  # its own overlapping compressor of width index_head_dim
  set_ = lambda p, std: p.set_value(jnp.asarray(std * rng.standard_normal(p.shape), jnp.float32))
  set_(idx.wq_b.weight, 0.3)
  set_(idx.weights_proj.weight, 0.3)
  set_(c.wkv.weight, 0.3)
  set_(c.wgate.weight, 0.5)
  set_(c.ape, 1.0)
  c.norm.weight.set_value(jnp.asarray(1 + 0.5 * rng.standard_normal(ci), jnp.float32))
  return idx


def inputs(rng, cfg, n=S):
  x = rng.standard_normal((n, cfg.hidden_size)).astype(np.float32)
  qr = rng.standard_normal((n, cfg.q_lora_rank)).astype(np.float32)
  return x, qr, rope.layer_inv_freq(cfg, Attention.CSA)


def ref_rope(v, p, freqs):
  r = 2 * len(freqs)
  out = np.array(v, np.float64)
  z = (out[..., -r::2] + 1j * out[..., -r + 1::2]) * np.exp(1j * p * np.asarray(freqs, np.float64))
  out[..., -r::2], out[..., -r + 1::2] = z.real, z.imag
  return out


def ref_scores(idx, cfg, x, qr, freqs, keys):
  Hi, ci = cfg.index_n_heads, cfg.index_head_dim
  wq_b = np.asarray(idx.wq_b.weight[...], np.float64)
  wp = np.asarray(idx.weights_proj.weight[...], np.float64)
  keys = np.asarray(keys, np.float64)
  n, R = x.shape[0], keys.shape[0]
  out = np.full((n, R), -np.inf)
  for t in range(n):
    q = (qr[t].astype(np.float64) @ wq_b.T).reshape(Hi, ci)
    q = np.stack([ref_rope(q[h], t, freqs) for h in range(Hi)])
    w = (x[t].astype(np.float64) @ wp.T) * ci ** -0.5 * Hi ** -0.5
    for s in range(R):
      if s < (t + 1) // 4:
        out[t, s] = sum(w[h] * max(0.0, float(q[h] @ keys[s])) for h in range(Hi))
  return out


def test_scores_match_loop_reference(seed, rng):
  cfg = small_cfg()
  idx = make(seed, rng, cfg)
  x, qr, freqs = inputs(rng, cfg)
  keys = np.asarray(_keys(idx, x, freqs))
  assert keys.shape == (S // 4, cfg.index_head_dim)
  got = np.asarray(_scores(idx, x, qr, freqs))
  want = ref_scores(idx, cfg, x, qr, freqs, keys)
  assert got.shape == (S, S // 4)
  np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))  # -inf exactly where s >= (t+1)//4
  for t in range(S):
    for s in range(S // 4):
      assert np.isneginf(got[t, s]) == (s >= (t + 1) // 4)
  fin = np.isfinite(want)
  assert np.std(want[fin]) > 1e-2
  np.testing.assert_allclose(got[fin], want[fin], atol=1e-5 * np.abs(want[fin]).max(), rtol=1e-4)


def test_query_rope_uses_compressed_table(seed, rng):
  """Scores computed with the window (no-YaRN) table for q differ from the module's: the table matters."""
  cfg = small_cfg()
  idx = make(seed, rng, cfg)
  x, qr, freqs = inputs(rng, cfg)
  keys = np.asarray(_keys(idx, x, freqs))
  wrong = ref_scores(idx, cfg, x, qr, rope.layer_inv_freq(cfg, Attention.WINDOW), keys)
  got = np.asarray(_scores(idx, x, qr, freqs))
  fin = np.isfinite(wrong)
  assert np.max(np.abs(got[fin] - wrong[fin])) > 1e-3


def check_selection(picks, scores, k):
  """picks [S, k'] against numpy argsort of the reference scores, tolerant only where scores nearly tie."""
  n_unambiguous = 0
  for t in range(scores.shape[0]):
    nvis = (t + 1) // 4
    row = picks[t]
    if nvis <= k:
      assert sorted(row[:nvis].tolist()) == list(range(nvis)), (t, row)
      assert (row[nvis:] == -1).all(), (t, row)
      continue
    assert (row >= 0).all() and len(set(row.tolist())) == k, (t, row)
    vis = scores[t, :nvis]
    order = np.argsort(-vis, kind="stable")
    gap = vis[order[k - 1]] - vis[order[k]]
    scale = np.abs(vis).max()
    if gap > 1e-4 * scale:
      n_unambiguous += 1
      assert set(row.tolist()) == set(order[:k].tolist()), (t, row, order[:k], vis)
    else:  # a near tie at the boundary: any best-k choice is valid
      assert vis[row].min() >= vis[order[k - 1]] - 1e-4 * scale
    # best first
    assert np.all(np.diff(vis[row]) <= 1e-5 * scale), (t, vis[row])
  return n_unambiguous


def test_selection_is_topk_of_visible(seed, rng):
  cfg = small_cfg(index_topk=3)
  idx = make(seed, rng, cfg)
  x, qr, freqs = inputs(rng, cfg)
  keys = np.asarray(_keys(idx, x, freqs))
  want = ref_scores(idx, cfg, x, qr, freqs, keys)
  picks = np.asarray(_select(idx, x, qr, freqs))
  assert picks.shape == (S, 3) and picks.dtype == np.int32
  n_queries_dropping = sum((t + 1) // 4 > 3 for t in range(S))
  # Random data: all (or all but one) of the queries that must drop rows have a clear gap at the boundary.
  assert check_selection(picks, want, 3) >= n_queries_dropping - 1
  # Queries before the first complete window see nothing.
  assert (picks[:3] == -1).all()


def test_topk_larger_than_row_count(seed, rng):
  """index_topk 20 > 9 rows: output width is the row count, each query gets every visible row, -1 after."""
  cfg = small_cfg(index_topk=20)
  idx = make(seed, rng, cfg)
  x, qr, freqs = inputs(rng, cfg)
  picks = np.asarray(_select(idx, x, qr, freqs))
  assert picks.shape == (S, S // 4)
  for t in range(S):
    nvis = (t + 1) // 4
    assert sorted(picks[t, :nvis].tolist()) == list(range(nvis))
    assert (picks[t, nvis:] == -1).all()
  # best first against the reference scores
  keys = np.asarray(_keys(idx, x, freqs))
  check_selection(picks, ref_scores(idx, cfg, x, qr, freqs, keys), S // 4)


def test_no_complete_window_gives_empty_selection(seed, rng):
  cfg = small_cfg()
  idx = make(seed, rng, cfg)
  x, qr, freqs = inputs(rng, cfg, n=3)
  picks = _select(idx, x, qr, freqs)
  assert picks.shape == (3, 0)


def test_scores_in_row_blocks_match_one_block(seed, rng):
  """Scoring 4 rows at a time (3 blocks, the last padded) gives the one-block scores: long prompts take this."""
  cfg = small_cfg()
  idx = make(seed, rng, cfg)
  x, qr, freqs = inputs(rng, cfg)
  blocked = nnx.jit(lambda m, x, qr: m.scores(x, qr, jnp.arange(x.shape[0]), freqs, row_block=4))
  got = np.asarray(blocked(idx, x, qr))
  want = np.asarray(_scores(idx, x, qr, freqs))
  assert got.shape == want.shape == (S, S // 4)
  fin = np.isfinite(want)
  assert np.std(want[fin]) > 1e-2
  np.testing.assert_array_equal(np.isneginf(got), ~fin)
  np.testing.assert_allclose(got[fin], want[fin], rtol=1e-6, atol=1e-6 * np.abs(want[fin]).max())
