"""mHC hyper-connections (docs/model.md §8): 4 residual streams mixed by a Sinkhorn-projected matrix."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from ds4jax.layers import F32, normal
from kernels_pallas.precision import einsum

# Random init near the identity-like values a trained model holds (docs/model.md §12): the mixing logits vary little
# with the input (MIX_STD), post ~ 1 (each stream takes the sublayer's update), comb ~ the identity (each stream
# keeps itself), each with a small random spread so the streams do not stay copies of one another.
MIX_STD = 0.1
COMB_DIAGONAL = 4.0
BASE_SPREAD = 0.1


def mix_logits(X: jnp.ndarray, fn: jnp.ndarray, norm_eps: float) -> jnp.ndarray:
  """[S, n, D] streams -> [S, m] f32: `fn` applied to the unweighted RMSNorm of the flattened streams. Computed as
  both references write it, the f32 matmul on the raw streams and then each row scaled, so no normalized f32 copy of
  the streams is written (docs/model.md §8). The matmul stays f32 under bf16_matmul: the references run it in f32,
  and the mixing weights feed a 20-round Sinkhorn and the residual streams of every later layer."""
  xf = X.reshape(X.shape[0], -1).astype(F32)
  return einsum("si,oi->so", xf, fn) * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + norm_eps)


def sinkhorn(logits: jnp.ndarray, iters: int, eps: float) -> jnp.ndarray:
  """[..., n, n] logits -> near doubly-stochastic C. C[j, k]: weight of old stream j in new stream k.

  Softmax over rows (k), then a column (j) normalisation, then iters-1 rounds of rows, columns.
  Ending on columns makes sum_j C[j, k] ~= 1.
  """
  c = jax.nn.softmax(logits, axis=-1) + eps
  c = c / (jnp.sum(c, axis=-2, keepdims=True) + eps)
  return _rounds(c, iters - 1, eps)


def _rounds(c: jnp.ndarray, n: int, eps: float, unroll=None) -> jnp.ndarray:
  """n rounds of rows, then columns. Unrolled for CUDA and ROCm: as a GPU while loop of tiny [.., 4, 4] ops they were
  a launch per op per round, half a decode step's launches (docs/decode.md §6); unrolled, XLA fuses them. Elsewhere a
  loop: unrolled, a CPU fast-path test compiled ~15% longer. The same ops in the same order either way."""
  def one_round(_, c):
    c = c / (jnp.sum(c, axis=-1, keepdims=True) + eps)
    return c / (jnp.sum(c, axis=-2, keepdims=True) + eps)

  if unroll is not None:
    return jax.lax.fori_loop(0, n, one_round, c, unroll=unroll)
  unrolled = lambda: _rounds(c, n, eps, True)
  return jax.lax.platform_dependent(cuda=unrolled, rocm=unrolled, default=lambda: _rounds(c, n, eps, 1))


class HyperConnection(nnx.Module):
  """One HC site (`hc_attn_*` or `hc_ffn_*`): collapses the streams for a sublayer, then re-expands."""

  def __init__(self, hidden: int, n: int, iters: int, eps: float, norm_eps: float, *, rngs: nnx.Rngs):
    self.n, self.iters, self.eps, self.norm_eps = n, iters, eps, norm_eps
    self.fn = normal(rngs, ((2 + n) * n, n * hidden), MIX_STD / math.sqrt(n * hidden), F32)
    identity = jnp.concatenate([jnp.zeros((2 * n,), F32), COMB_DIAGONAL * jnp.eye(n, dtype=F32).reshape(-1)])
    self.base = nnx.Param(identity + normal(rngs, ((2 + n) * n,), BASE_SPREAD, F32)[...])
    self.scale = nnx.Param(1.0 + 0.1 * jax.random.normal(rngs.params(), (3,), F32))

  def __call__(self, X: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]:
    """X: [S, n, D] -> (h [S, D] sublayer input, post [S, n], comb [S, n, n])."""
    n = self.n
    mix = mix_logits(X, self.fn[...], self.norm_eps)
    scale, base = self.scale[...], self.base[...]
    pre = jax.nn.sigmoid(mix[:, :n] * scale[0] + base[:n]) + self.eps
    post = 2.0 * jax.nn.sigmoid(mix[:, n:2 * n] * scale[1] + base[n:2 * n])
    comb = sinkhorn((mix[:, 2 * n:] * scale[2] + base[2 * n:]).reshape(-1, n, n), self.iters, self.eps)
    h = einsum("sn,snd->sd", pre, X.astype(F32))
    return h, post, comb

  @staticmethod
  def merge(X: jnp.ndarray, y: jnp.ndarray, post: jnp.ndarray, comb: jnp.ndarray) -> jnp.ndarray:
    """New stream k = post[k] * y + sum_j comb[j, k] * X[j] (C transposed onto the streams). The sum over the n old
    streams is written out in f32, not as an einsum: XLA made that contraction of 4 a GEMM of its own on the GPU,
    which wrote the mixed streams (0.5 GB at 8192 tokens) for the next fusion to read back; elementwise it fuses."""
    Xf = X.astype(F32)
    mixed = comb[:, 0, :, None] * Xf[:, 0, None, :]
    for j in range(1, X.shape[1]):
      mixed = mixed + comb[:, j, :, None] * Xf[:, j, None, :]
    return post[:, :, None] * y[:, None, :] + mixed


class HyperHead(nnx.Module):
  """`hc_head_*`: the final collapse of the streams before the norm and LM head (no Sinkhorn, no post)."""

  def __init__(self, hidden: int, n: int, eps: float, norm_eps: float, *, rngs: nnx.Rngs):
    self.eps, self.norm_eps = eps, norm_eps
    self.fn = normal(rngs, (n, n * hidden), MIX_STD / math.sqrt(n * hidden), F32)
    self.base = normal(rngs, (n,), BASE_SPREAD, F32)
    self.scale = nnx.Param(jnp.ones((1,), F32))

  def __call__(self, X: jnp.ndarray) -> jnp.ndarray:
    mix = mix_logits(X, self.fn[...], self.norm_eps)
    pre = jax.nn.sigmoid(mix * self.scale[...] + self.base[...]) + self.eps
    return einsum("sn,snd->sd", pre, X.astype(F32))
