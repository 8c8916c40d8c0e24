"""mHC hyper-connections (docs/model.md §8) against numpy loop references.

`sinkhorn`: softmax over the last axis + eps, a column normalisation, then iters-1 rounds of rows/cols (each with +eps
in the denominator). A full HC site: mix = unweighted-rmsnorm(flattened streams) @ fn^T, [pre | post | comb] in that
order, comb[j, k] at flat index 2n + j*n + k, and `merge` uses C^T: new stream k = post[k]*y + sum_j C[j,k] X[j].
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ds4jax import hyper_connection
from ds4jax.hyper_connection import HyperConnection, HyperHead, sinkhorn

N, D, EPS, NORM_EPS = 4, 8, 1e-6, 1e-6


def sigmoid(v):
  return 1.0 / (1.0 + np.exp(-v))


def ref_sinkhorn(logits, iters, eps):
  """One [n, n] matrix, explicit loops."""
  L = np.asarray(logits, np.float64)
  n = L.shape[0]
  C = np.zeros((n, n))
  for j in range(n):  # softmax over k (each row), + eps
    e = np.exp(L[j] - L[j].max())
    C[j] = e / e.sum() + eps
  def cols(C):
    out = C.copy()
    for k in range(n):
      out[:, k] = C[:, k] / (sum(C[j, k] for j in range(n)) + eps)
    return out
  def rows(C):
    out = C.copy()
    for j in range(n):
      out[j] = C[j] / (sum(C[j, k] for k in range(n)) + eps)
    return out
  C = cols(C)
  for _ in range(iters - 1):
    C = cols(rows(C))
  return C


def test_sinkhorn_matches_loop_reference(rng):
  logits = (2.0 * rng.standard_normal((5, N, N))).astype(np.float32)
  for iters in (1, 3, 20):
    got = np.asarray(sinkhorn(jnp.asarray(logits), iters, EPS))
    for b in range(5):
      np.testing.assert_allclose(got[b], ref_sinkhorn(logits[b], iters, EPS), atol=1e-6, rtol=1e-5)
  # iters=1 is only softmax + one column normalisation: rows are NOT yet normalised
  one = np.asarray(sinkhorn(jnp.asarray(logits), 1, EPS))
  assert np.max(np.abs(one.sum(-1) - 1)) > 1e-2


def test_sinkhorn_columns_sum_to_one(rng):
  logits = (3.0 * rng.standard_normal((7, N, N))).astype(np.float32)
  C = np.asarray(sinkhorn(jnp.asarray(logits), 20, EPS))
  np.testing.assert_allclose(C.sum(axis=-2), 1.0, atol=1e-5)  # sum over j: columns, exactly (last step)
  # (rows are only approximately normalised after 20 rounds: with large logits they can be off by several %)
  assert (C > 0).all()


def test_sinkhorn_large_eps_shows_eps_placement(rng):
  """With a big eps the +eps terms are visible: the reference (eps after softmax and in each denominator) still
  matches."""
  logits = rng.standard_normal((2, N, N)).astype(np.float32)
  got = np.asarray(sinkhorn(jnp.asarray(logits), 4, 0.1))
  for b in range(2):
    np.testing.assert_allclose(got[b], ref_sinkhorn(logits[b], 4, 0.1), atol=1e-6, rtol=1e-5)
  # columns sum to 1/(1+eps*...) < 1, not 1: the eps is in the denominator
  assert np.all(got.sum(-2) < 0.99)


def make_site(seed, rng):
  hc = HyperConnection(D, N, 20, EPS, NORM_EPS, rngs=nnx.Rngs(params=seed))
  assert hc.fn.shape == ((2 + N) * N, N * D) and hc.base.shape == ((2 + N) * N,) and hc.scale.shape == (3,)
  # Bigger than the init so the mix, the gates and the comb matrix are far from trivial.
  hc.fn.set_value(jnp.asarray(0.3 * rng.standard_normal(hc.fn.shape), jnp.float32))
  hc.base.set_value(jnp.asarray(rng.standard_normal(hc.base.shape), jnp.float32))
  hc.scale.set_value(jnp.asarray(rng.uniform(0.5, 1.5, 3), jnp.float32))
  return hc


def ref_site(X, fn, base, scale, iters=20, eps=EPS, norm_eps=NORM_EPS):
  """Per token: (h [D], post [n], comb [n, n])."""
  X = np.asarray(X, np.float64)
  fn, base, scale = (np.asarray(a, np.float64) for a in (fn, base, scale))
  n = X.shape[1]
  hs, posts, combs = [], [], []
  for s in range(X.shape[0]):
    xf = X[s].reshape(-1)
    normed = xf / np.sqrt(np.mean(xf ** 2) + norm_eps)
    mix = fn @ normed
    pre = np.array([sigmoid(mix[i] * scale[0] + base[i]) + eps for i in range(n)])
    post = np.array([2 * sigmoid(mix[n + i] * scale[1] + base[n + i]) for i in range(n)])
    logits = np.zeros((n, n))
    for j in range(n):
      for k in range(n):
        logits[j, k] = mix[2 * n + j * n + k] * scale[2] + base[2 * n + j * n + k]
    combs.append(ref_sinkhorn(logits, iters, eps))
    hs.append(sum(pre[i] * X[s, i] for i in range(n)))
    posts.append(post)
  return np.array(hs), np.array(posts), np.array(combs)


def ref_merge(X, y, post, comb):
  X = np.asarray(X, np.float64)
  out = np.zeros_like(X)
  for s in range(X.shape[0]):
    for k in range(X.shape[1]):
      out[s, k] = post[s, k] * y[s] + sum(comb[s, j, k] * X[s, j] for j in range(X.shape[1]))
  return out


_site = nnx.jit(lambda hc, X: hc(X))
_merge = nnx.jit(HyperConnection.merge)


def test_site_matches_loop_reference(seed, rng):
  hc = make_site(seed, rng)
  X = (rng.standard_normal((6, N, D)) * rng.uniform(0.5, 3, (6, 1, 1))).astype(np.float32)
  h, post, comb = (np.asarray(a) for a in _site(hc, jnp.asarray(X)))
  rh, rpost, rcomb = ref_site(X, hc.fn[...], hc.base[...], hc.scale[...])
  np.testing.assert_allclose(post, rpost, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(comb, rcomb, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(h, rh, atol=1e-5, rtol=1e-5)
  assert h.shape == (6, D) and post.shape == (6, N) and comb.shape == (6, N, N)
  # the comb matrix really is non-symmetric, and post really spans (0, 2)
  assert np.max(np.abs(comb - np.swapaxes(comb, -1, -2))) > 0.05
  assert post.max() > 1.0


def test_site_is_scale_invariant_in_mix(seed, rng):
  """The mix uses the RMS-normalised streams: scaling X scales h but leaves post and comb unchanged."""
  hc = make_site(seed, rng)
  X = rng.standard_normal((6, N, D)).astype(np.float32)
  h1, p1, c1 = (np.asarray(a) for a in _site(hc, jnp.asarray(X)))
  h2, p2, c2 = (np.asarray(a) for a in _site(hc, jnp.asarray(5 * X)))
  np.testing.assert_allclose(p2, p1, atol=1e-5)
  np.testing.assert_allclose(c2, c1, atol=1e-5)
  np.testing.assert_allclose(h2, 5 * h1, atol=1e-4, rtol=1e-5)


def test_merge_matches_loop_reference_and_uses_transpose(rng):
  S = 6
  X = rng.standard_normal((S, N, D)).astype(np.float32)
  y = rng.standard_normal((S, D)).astype(np.float32)
  post = rng.uniform(0, 2, (S, N)).astype(np.float32)
  comb = rng.uniform(0, 1, (S, N, N)).astype(np.float32)  # not symmetric
  got = np.asarray(_merge(jnp.asarray(X), jnp.asarray(y), jnp.asarray(post), jnp.asarray(comb)))
  np.testing.assert_allclose(got, ref_merge(X, y, post, comb), atol=1e-5, rtol=1e-5)
  wrong = ref_merge(X, y, post, np.swapaxes(comb, -1, -2))
  assert np.max(np.abs(got - wrong)) > 1e-2


def test_merge_with_permutation_comb():
  """comb[j, k] = 1 iff k = perm[j]: old stream j lands in new stream perm[j] (not perm^-1)."""
  perm = [1, 2, 3, 0]
  comb = np.zeros((1, N, N), np.float32)
  for j, k in enumerate(perm):
    comb[0, j, k] = 1.0
  X = np.arange(N * D, dtype=np.float32).reshape(1, N, D)
  y = np.full((1, D), 100.0, np.float32)
  post = np.array([[0.0, 0.5, 1.0, 2.0]], np.float32)
  got = np.asarray(_merge(jnp.asarray(X), jnp.asarray(y), jnp.asarray(post), jnp.asarray(comb)))
  for j, k in enumerate(perm):
    np.testing.assert_allclose(got[0, k], X[0, j] + post[0, k] * 100.0)


def test_site_then_merge_end_to_end(seed, rng):
  """Collapse, a toy sublayer, re-expand: the whole site against the reference."""
  hc = make_site(seed, rng)
  X = rng.standard_normal((6, N, D)).astype(np.float32)
  h, post, comb = _site(hc, jnp.asarray(X))
  y = jnp.tanh(h)
  got = np.asarray(_merge(jnp.asarray(X), y, post, comb))
  rh, rpost, rcomb = ref_site(X, hc.fn[...], hc.base[...], hc.scale[...])
  np.testing.assert_allclose(got, ref_merge(X, np.tanh(rh), rpost, rcomb), atol=2e-5, rtol=1e-5)


def test_hyper_head_matches_loop_reference(seed, rng):
  head = HyperHead(D, N, EPS, NORM_EPS, rngs=nnx.Rngs(params=seed))
  assert head.fn.shape == (N, N * D) and head.base.shape == (N,) and head.scale.shape == (1,)
  head.fn.set_value(jnp.asarray(0.3 * rng.standard_normal(head.fn.shape), jnp.float32))
  head.base.set_value(jnp.asarray(rng.standard_normal(N), jnp.float32))
  head.scale.set_value(jnp.asarray([rng.uniform(0.5, 1.5)], jnp.float32))
  X = rng.standard_normal((5, N, D)).astype(np.float32)
  got = np.asarray(nnx.jit(lambda m, X: m(X))(head, jnp.asarray(X)))
  fn, base, scale = (np.asarray(a, np.float64) for a in (head.fn[...], head.base[...], head.scale[...]))
  for s in range(5):
    xf = X[s].reshape(-1).astype(np.float64)
    mix = fn @ (xf / np.sqrt(np.mean(xf ** 2) + NORM_EPS))
    pre = sigmoid(mix * scale[0] + base) + EPS
    want = sum(pre[i] * X[s, i].astype(np.float64) for i in range(N))
    np.testing.assert_allclose(got[s], want, atol=1e-5, rtol=1e-5)


def test_sinkhorn_rounds_are_unrolled_for_gpus_only(rng):
  """CUDA and ROCm run the rounds unrolled (a while loop of tiny ops cost a launch per op per round: docs/decode.md
  §6); other platforms keep the loop (compile time). Both forms give the same bits."""
  f = jax.jit(lambda x: sinkhorn(x, 20, 1e-6))
  x = jnp.asarray(rng.standard_normal((3, 4, 4)), jnp.float32)
  lowered = {p: jax.export.export(f, platforms=[p])(x).mlir_module() for p in ("cpu", "tpu", "cuda", "rocm")}
  for p in ("cpu", "tpu"):
    assert "stablehlo.while" in lowered[p] and lowered[p].count("stablehlo.divide") < 10, p
  for p in ("cuda", "rocm"):
    assert "stablehlo.while" not in lowered[p] and lowered[p].count("stablehlo.divide") >= 2 * 19, p
  c = jax.nn.softmax(x, axis=-1) + 1e-6
  unrolled = jax.jit(lambda c: hyper_connection._rounds(c, 19, 1e-6, True))(c)  # pylint: disable=protected-access
  looped = jax.jit(lambda c: hyper_connection._rounds(c, 19, 1e-6, 1))(c)  # pylint: disable=protected-access
  np.testing.assert_array_equal(np.asarray(unrolled), np.asarray(looped))
