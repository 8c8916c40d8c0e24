"""MoE (docs/model.md §7) against per-token numpy loops.

Router: score = sqrt(softplus(logit)); selection by top-k of score + bias (or tid2eid[token] on hash layers); weights
from the score WITHOUT bias, renormalised, times routed_scaling_factor. Experts: clamped SwiGLU (gate clamped from above
only, up clipped both ways), y[t] = sum_k w[t,k] * W2_e(silu(min(W1_e x, L)) * clip(W3_e x, -L, L)). Plus the shared
expert.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ds4jax import config
from ds4jax.config import Routing
from ds4jax.features import Features
from ds4jax.moe import MoE, Router, Experts, SharedExpert, local_routes
from ds4jax.layers import QuantizedWeight
from ds4jax.quant import formats
from ds4jax.quant.policy import POLICIES
from kernels_pallas.moe.reference import clamped_swiglu, moe_reference

S = 10
HASH_LAYER, TOPK_LAYER = 0, 1  # in the tiny preset


def cfg_(**kw):
  cfg = config.tiny(experts_per_token=3, **kw)
  assert cfg.routing[HASH_LAYER] is Routing.HASH and cfg.routing[TOPK_LAYER] is Routing.TOPK
  return cfg


_route = nnx.jit(lambda r, x, tok: r(x, tok))
_experts = nnx.jit(lambda e, x, w, i: e(x, w, i))
_shared = nnx.jit(lambda m, x: m(x))
_moe = nnx.jit(lambda m, x, tok: m(x, tok))


def setp(p, std, rng):
  p.set_value(jnp.asarray(std * rng.standard_normal(p.shape), jnp.float32))


def ref_score(x, W):
  lg = np.asarray(x, np.float64) @ np.asarray(W, np.float64).T
  return np.sqrt(np.logaddexp(0.0, lg))  # sqrt(softplus)


def ref_route(x, W, bias, k, scale, tid2eid=None, tokens=None):
  """Per token: (weights [k], ids [k]) with ids in selection order (best first for top-k)."""
  s = ref_score(x, W)
  ws, ids = [], []
  for t in range(s.shape[0]):
    if tid2eid is not None:
      sel = np.asarray(tid2eid)[tokens[t]]
    else:
      key = s[t] + np.asarray(bias, np.float64)
      order = np.argsort(-key)
      assert key[order[k - 1]] - key[order[k]] > 1e-6  # no near tie at the boundary
      sel = order[:k]
    w = s[t, sel]
    ws.append(w / w.sum() * scale)
    ids.append(sel)
  return np.array(ws), np.array(ids)


def silu(v):
  return v / (1 + np.exp(-v))


def ref_expert(x, w1, w2, w3, L):
  g, u = w1 @ x, w3 @ x
  return w2 @ (silu(np.minimum(g, L)) * np.clip(u, -L, L))


def ref_experts(x, weights, idx, w1, w2, w3, L):
  x, w1, w2, w3 = (np.asarray(a, np.float64) for a in (x, w1, w2, w3))
  y = np.zeros_like(x)
  for t in range(x.shape[0]):
    for k in range(idx.shape[1]):
      e = int(idx[t, k])
      y[t] += float(weights[t, k]) * ref_expert(x[t], w1[e], w2[e], w3[e], L)
  return y


def make_router(seed, rng, cfg, layer):
  r = Router(cfg, layer, rngs=nnx.Rngs(params=seed))
  setp(r.weight, 0.3, rng)
  if r.bias is not None:
    setp(r.bias, 0.3, rng)
  return r


def test_topk_router_matches_reference(seed, rng):
  cfg = cfg_()
  r = make_router(seed, rng, cfg, TOPK_LAYER)
  x = rng.standard_normal((S, cfg.hidden_size)).astype(np.float32)
  w, idx = (np.asarray(a) for a in _route(r, jnp.asarray(x), jnp.zeros(S, jnp.int32)))
  rw, ridx = ref_route(x, r.weight[...], r.bias[...], 3, cfg.routed_scaling_factor)
  assert idx.shape == (S, 3) and idx.dtype == np.int32
  for t in range(S):
    assert set(idx[t].tolist()) == set(ridx[t].tolist())
    got = dict(zip(idx[t].tolist(), w[t].tolist()))
    for e, we in zip(ridx[t], rw[t]):
      np.testing.assert_allclose(got[int(e)], we, rtol=1e-5)
  np.testing.assert_allclose(w.sum(-1), cfg.routed_scaling_factor, rtol=1e-5)


def test_bias_changes_selection_not_weights(seed, rng):
  """A big bias on the weakest expert forces it into every selection; its weight still comes from the raw score."""
  cfg = cfg_()
  r = make_router(seed, rng, cfg, TOPK_LAYER)
  x = rng.standard_normal((S, cfg.hidden_size)).astype(np.float32)
  s = ref_score(x, r.weight[...])
  weak = int(np.argmin(s.mean(0)))
  bias = np.zeros(cfg.n_routed_experts, np.float32)
  r.bias.set_value(jnp.asarray(bias))
  _, idx0 = (np.asarray(a) for a in _route(r, jnp.asarray(x), jnp.zeros(S, jnp.int32)))
  bias[weak] = 10.0
  r.bias.set_value(jnp.asarray(bias))
  w1, idx1 = (np.asarray(a) for a in _route(r, jnp.asarray(x), jnp.zeros(S, jnp.int32)))
  assert (idx1 == weak).any(axis=1).all()  # always picked with the bias...
  assert not (idx0 == weak).any(axis=1).all()  # ...but not without it: the selection changed
  for t in range(S):
    sel = idx1[t]
    np.testing.assert_allclose(w1[t], s[t, sel] / s[t, sel].sum() * cfg.routed_scaling_factor, rtol=1e-5)
    with_bias = s[t, sel] + bias[sel]
    assert not np.allclose(w1[t], with_bias / with_bias.sum() * cfg.routed_scaling_factor, rtol=1e-3)


def test_hash_router_uses_tid2eid(seed, rng):
  cfg = cfg_()
  r = make_router(seed, rng, cfg, HASH_LAYER)
  assert r.bias is None
  table = np.asarray(r.tid2eid[...])
  assert table.shape == (cfg.vocab_size, 3)
  assert all(len(set(row)) == 3 for row in table.tolist())  # the random table has distinct ids per row
  x = rng.standard_normal((S, cfg.hidden_size)).astype(np.float32)
  tokens = rng.integers(0, cfg.vocab_size, S).astype(np.int32)
  w, idx = (np.asarray(a) for a in _route(r, jnp.asarray(x), jnp.asarray(tokens)))
  np.testing.assert_array_equal(idx, table[tokens])
  rw, _ = ref_route(x, r.weight[...], None, 3, cfg.routed_scaling_factor, table, tokens)
  np.testing.assert_allclose(w, rw, rtol=1e-5)


def test_score_is_sqrt_softplus(seed, rng):
  """With k = E every expert is picked, so the weights expose the score function itself."""
  cfg = cfg_().replace(experts_per_token=8)
  r = make_router(seed, rng, cfg, TOPK_LAYER)
  x = (2 * rng.standard_normal((S, cfg.hidden_size))).astype(np.float32)
  w, idx = (np.asarray(a) for a in _route(r, jnp.asarray(x), jnp.zeros(S, jnp.int32)))
  lg = x.astype(np.float64) @ np.asarray(r.weight[...], np.float64).T
  full = np.zeros_like(lg)
  np.put_along_axis(full, idx, w, axis=1)
  norm = lambda s: s / s.sum(-1, keepdims=True) * cfg.routed_scaling_factor
  np.testing.assert_allclose(full, norm(np.sqrt(np.logaddexp(0, lg))), rtol=1e-5)
  assert not np.allclose(full, norm(np.logaddexp(0, lg)), rtol=1e-2)  # plain softplus
  assert not np.allclose(full, norm(1 / (1 + np.exp(-lg))), rtol=1e-2)  # sigmoid


def test_clamped_swiglu_values():
  L = 1.0
  gate = jnp.asarray([-50.0, -5.0, -0.5, 0.5, 5.0, 50.0])
  up = jnp.asarray([3.0, -3.0, 0.7, -0.7, 5.0, -5.0])
  got = np.asarray(clamped_swiglu(gate, up, L))
  g, u = np.minimum(np.asarray(gate, np.float64), L), np.clip(np.asarray(up, np.float64), -L, L)
  np.testing.assert_allclose(got, silu(g) * u, rtol=1e-6, atol=1e-12)
  # A very negative gate is NOT clamped: silu(-5) * -1 ~ 0.0335, not silu(-1) * -1 ~ 0.269.
  np.testing.assert_allclose(got[1], silu(-5.0) * -1.0, rtol=1e-6)
  assert abs(got[1] - silu(-1.0) * -1.0) > 0.2
  assert abs(got[0]) < 1e-15
  # A big gate is clamped to L, a big up clipped to +-L.
  np.testing.assert_allclose(got[4], silu(1.0) * 1.0, rtol=1e-6)
  np.testing.assert_allclose(got[5], silu(1.0) * -1.0, rtol=1e-6)


def test_clamped_swiglu_random(rng):
  gate = (4 * rng.standard_normal(200)).astype(np.float32)
  up = (4 * rng.standard_normal(200)).astype(np.float32)
  got = np.asarray(clamped_swiglu(jnp.asarray(gate), jnp.asarray(up), 2.5))
  want = silu(np.minimum(gate.astype(np.float64), 2.5)) * np.clip(up.astype(np.float64), -2.5, 2.5)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def make_experts(seed, rng, cfg):
  ex = Experts(cfg, rngs=nnx.Rngs(params=seed))
  E, I, D = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
  assert ex.w1.shape == (E, I, D) and ex.w2.shape == (E, D, I) and ex.w3.shape == (E, I, D)
  setp(ex.w1, 0.3, rng)  # W1 x ~ 2.4 >> L = 1: the clamps are active
  setp(ex.w3, 0.3, rng)
  setp(ex.w2, 0.2, rng)
  return ex


def random_routing(rng, cfg, k=3):
  idx = np.stack([rng.permutation(cfg.n_routed_experts)[:k] for _ in range(S)]).astype(np.int32)
  w = rng.uniform(0.1, 1.0, (S, k)).astype(np.float32)
  return w, idx


def test_experts_match_per_token_loop(seed, rng):
  cfg = cfg_()
  ex = make_experts(seed, rng, cfg)
  x = rng.standard_normal((S, cfg.hidden_size)).astype(np.float32)
  w, idx = random_routing(rng, cfg)
  got = np.asarray(_experts(ex, jnp.asarray(x), jnp.asarray(w), jnp.asarray(idx)))
  want = ref_experts(x, w, idx, ex.w1[...], ex.w2[...], ex.w3[...], cfg.swiglu_limit)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
  # the clamps mattered: without them the answer is different
  g = np.einsum("eid,td->tei", np.asarray(ex.w1[...]), x)
  assert (g > cfg.swiglu_limit).mean() > 0.1 and (g < -cfg.swiglu_limit).mean() > 0.1
  unclamped = ref_experts(x, w, idx, ex.w1[...], ex.w2[...], ex.w3[...], 1e9)
  assert np.max(np.abs(got - unclamped)) > 1e-2


def test_expert_routed_twice_accumulates_twice(seed, rng):
  cfg = cfg_()
  ex = make_experts(seed, rng, cfg)
  x = rng.standard_normal((S, cfg.hidden_size)).astype(np.float32)
  w, idx = random_routing(rng, cfg)
  idx[:, 1] = idx[:, 0]  # every token picks its first expert twice
  got = np.asarray(_experts(ex, jnp.asarray(x), jnp.asarray(w), jnp.asarray(idx)))
  np.testing.assert_allclose(got, ref_experts(x, w, idx, ex.w1[...], ex.w2[...], ex.w3[...], cfg.swiglu_limit),
                             atol=1e-5, rtol=1e-5)
  w1, w2, w3 = (np.asarray(a, np.float64) for a in (ex.w1[...], ex.w2[...], ex.w3[...]))
  for t in range(S):
    e0, e2 = idx[t, 0], idx[t, 2]
    want = ((w[t, 0] + w[t, 1]) * ref_expert(x[t].astype(np.float64), w1[e0], w2[e0], w3[e0], cfg.swiglu_limit)
            + w[t, 2] * ref_expert(x[t].astype(np.float64), w1[e2], w2[e2], w3[e2], cfg.swiglu_limit))
    np.testing.assert_allclose(got[t], want, atol=1e-5, rtol=1e-5)


def test_shared_expert(seed, rng):
  cfg = cfg_()
  sh = SharedExpert(cfg, rngs=nnx.Rngs(params=seed))
  setp(sh.w1.weight, 0.3, rng)
  setp(sh.w3.weight, 0.3, rng)
  setp(sh.w2.weight, 0.2, rng)
  x = rng.standard_normal((S, cfg.hidden_size)).astype(np.float32)
  got = np.asarray(_shared(sh, jnp.asarray(x)))
  w1, w2, w3 = (np.asarray(p.weight[...], np.float64) for p in (sh.w1, sh.w2, sh.w3))
  for t in range(S):
    np.testing.assert_allclose(got[t], ref_expert(x[t].astype(np.float64), w1, w2, w3, cfg.swiglu_limit),
                               atol=1e-5, rtol=1e-5)


def make_moe(seed, rng, cfg, layer):
  moe = MoE(cfg, layer, rngs=nnx.Rngs(params=seed))
  setp(moe.gate.weight, 0.3, rng)
  if moe.gate.bias is not None:
    setp(moe.gate.bias, 0.3, rng)
  for p in (moe.experts.w1, moe.experts.w3, moe.shared_experts.w1.weight, moe.shared_experts.w3.weight):
    setp(p, 0.3, rng)
  for p in (moe.experts.w2, moe.shared_experts.w2.weight):
    setp(p, 0.2, rng)
  return moe


def ref_moe(moe, cfg, x, tokens, table=None):
  g = moe.gate
  rw, ridx = ref_route(x, g.weight[...], None if g.bias is None else g.bias[...], cfg.experts_per_token,
                       cfg.routed_scaling_factor, table, tokens)
  ex, sh = moe.experts, moe.shared_experts
  y = ref_experts(x, rw, ridx, ex.w1[...], ex.w2[...], ex.w3[...], cfg.swiglu_limit)
  w1, w2, w3 = (np.asarray(p.weight[...], np.float64) for p in (sh.w1, sh.w2, sh.w3))
  for t in range(x.shape[0]):
    y[t] += ref_expert(x[t].astype(np.float64), w1, w2, w3, cfg.swiglu_limit)
  return y


@pytest.mark.parametrize("layer", [HASH_LAYER, TOPK_LAYER])
def test_moe_layer_is_routed_plus_shared(seed, rng, layer):
  cfg = cfg_()
  moe = make_moe(seed, rng, cfg, layer)
  x = rng.standard_normal((S, cfg.hidden_size)).astype(np.float32)
  tokens = rng.integers(0, cfg.vocab_size, S).astype(np.int32)
  got = np.asarray(_moe(moe, jnp.asarray(x), jnp.asarray(tokens)))
  table = None if moe.gate.tid2eid is None else np.asarray(moe.gate.tid2eid[...])
  np.testing.assert_allclose(got, ref_moe(moe, cfg, x, tokens, table), atol=1e-5, rtol=1e-5)


def test_moe_hand_written_tid2eid_with_duplicates(seed, rng):
  """A tid2eid row that repeats an expert: that expert's output is added twice (weights normalised over all 3)."""
  cfg = cfg_()
  moe = make_moe(seed, rng, cfg, HASH_LAYER)
  table = np.stack([rng.permutation(cfg.n_routed_experts)[:3] for _ in range(cfg.vocab_size)]).astype(np.int32)
  table[:, 1] = table[:, 0]
  moe.gate.tid2eid.set_value(jnp.asarray(table))
  x = rng.standard_normal((S, cfg.hidden_size)).astype(np.float32)
  tokens = rng.integers(0, cfg.vocab_size, S).astype(np.int32)
  got = np.asarray(_moe(moe, jnp.asarray(x), jnp.asarray(tokens)))
  want = ref_moe(moe, cfg, x, tokens, table)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
  # the dropped-duplicate convention (official `y[idx] += ...`) would give a different answer
  dedup = table.copy()
  dedup[:, 1] = table[:, 2]
  assert np.max(np.abs(got - ref_moe(moe, cfg, x, tokens, dedup))) > 1e-3


# ---- one device's share of the experts (expert parallelism, ds4jax/mesh.py) ----

@pytest.mark.parametrize("n", [2, 4])
def test_devices_shares_of_the_experts_sum_to_the_whole(seed, rng, n):
  """What each device of an `expert=n` mesh computes (moe.on_local_experts, without the mesh): its experts' slice,
  with the routes as it sees them (local ids; other devices' experts masked). The shares sum to the whole MoE, and
  each is only its own experts' part."""
  cfg = cfg_()
  ex = make_experts(seed, rng, cfg)
  x = rng.standard_normal((S, cfg.hidden_size)).astype(np.float32)
  w, idx = random_routing(rng, cfg)
  whole = np.asarray(_experts(ex, jnp.asarray(x), jnp.asarray(w), jnp.asarray(idx)))
  per = cfg.n_routed_experts // n
  shares = []
  for d in range(n):
    lw, li = local_routes(jnp.asarray(w), jnp.asarray(idx), d * per, per)
    mine = (idx >= d * per) & (idx < (d + 1) * per)
    np.testing.assert_array_equal(np.asarray(li), np.where(mine, idx - d * per, -1))
    np.testing.assert_array_equal(np.asarray(lw), np.where(mine, w, 0))
    stacks = tuple(a[d * per:(d + 1) * per] for a in ex.stacks())
    shares.append(np.asarray(_local_share(ex, stacks, jnp.asarray(x), lw, li)))
    own = ref_experts(x, np.where(mine, w, 0), idx, ex.w1[...], ex.w2[...], ex.w3[...], cfg.swiglu_limit)
    np.testing.assert_allclose(shares[-1], own, atol=1e-5, rtol=1e-5)
  assert all(np.abs(s).max() > 1e-2 for s in shares)
  np.testing.assert_allclose(np.sum(shares, axis=0), whole, atol=1e-5, rtol=1e-5)


_local_share = nnx.jit(lambda e, stacks, x, w, i: moe_reference(x, w, i, *e.as_formats(stacks), swiglu_limit=e.limit))


def test_a_slice_of_quantized_experts_is_those_experts(seed, rng):
  """A device holds a slice of every storage array along the experts (codes, scales, codebooks, mode): it decodes to
  those experts, as the reference's format and as the kernels' (in-kernel and decoded-first) weights."""
  cfg = cfg_()
  ex = make_experts(seed, rng, cfg)
  for name in ("w1", "w2", "w3"):  # the numpy encoder fits each expert's own codebooks
    w = np.asarray(getattr(ex, name)[...])
    storage = {k: jnp.asarray(a) for k, a in formats.get("rocmfp3_mix").quantize(w).items()}
    setattr(ex, name, QuantizedWeight("rocmfp3_mix", w.shape, storage))
  part = tuple({k: a[2:4] for k, a in s.items()} for s in ex.stacks())
  whole, decoded = _slice_decodes(ex, part)
  whole = [np.asarray(w) for w in whole]
  assert len(decoded) == 12
  for got, ours in zip(decoded, whole * 4):
    assert got.shape[0] == 2
    np.testing.assert_array_equal(np.asarray(got), ours[2:4])
  assert whole[0][2:4].std() > 0


@nnx.jit
def _slice_decodes(ex, part):
  """(every expert decoded, then the slice `part` decoded four ways: reference format, in-kernel, decoded first by
  XLA and by the decode kernel)."""
  return [w.dequantize() for w in (ex.w1, ex.w2, ex.w3)], (
      [f.dequantize() for f in ex.as_formats(part)]
      + [f.dequantize() for f in ex.kernel_weights(jnp.float32, Features(moe_sparse_gate_up=True), part)]
      + [f.w for f in ex.kernel_weights(jnp.float32, Features(moe_compact_queue=True), part)]
      + [f.w for f in ex.kernel_weights(jnp.float32, Features(moe_decode_kernel=True), part)])


@pytest.mark.parametrize("policy", ["official", "lucebox_mix"])
def test_the_rings_layout_comes_from_either_decode_of_every_gate_up_format(policy):
  """Under moe_wgmma_gate_up without moe_sparse_gate_up, W1 / W3 are decoded beforehand as ring_layout, by XLA or
  by the decode kernel (moe_decode_kernel), from FP4 experts (official) as from FP2-MIX (lucebox_mix): the canonical
  decode's bf16 bits, laid out; W2 stays dense. (The kernel wrote boxes for the MIX formats only, and FP4 crashed.)"""
  cfg = config.tiny_window(hidden_size=256, moe_intermediate_size=256)
  ex = Experts(cfg, rngs=nnx.Rngs(3), dtype=jnp.float32, policy=POLICIES[policy])
  canonical = [np.asarray(getattr(ex, n).dequantize().astype(jnp.bfloat16).astype(jnp.float32)) for n in ("w1", "w3")]
  assert all(np.count_nonzero(w) > w.size // 2 for w in canonical)
  for decode_kernel in (False, True):
    f = Features(bf16_matmul=True, moe_compact_queue=True, moe_wgmma_gate_up=True, moe_decode_kernel=decode_kernel)
    w1, w2, w3 = _kernel_weights(ex, f)
    assert [type(w).__name__ for w in (w1, w2, w3)] == ["RingLayoutWeights", "DenseWeights", "RingLayoutWeights"]
    assert w1.w.shape == (cfg.n_routed_experts, 4, 256, 64)
    for got, want in zip((w1, w3), canonical):
      np.testing.assert_array_equal(np.asarray(got.dequantize()), want)


_kernel_weights = nnx.jit(lambda e, f: e.kernel_weights(jnp.bfloat16, f), static_argnums=1)
