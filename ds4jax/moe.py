"""MoE of every layer (deepseek-v4.md §7): sqrt-softplus router, hash or top-k routing, clamped SwiGLU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ds4jax.config import DeepseekV4Config, Routing
from ds4jax.features import REFERENCE, Features
from ds4jax.layers import F32, Linear, QuantizedWeight, make_weight, matmul_dtype, matmul_inputs, matmul_t, normal
from ds4jax.quant import formats
from ds4jax.quant.policy import POLICIES, QuantPolicy


class Buffer(nnx.Variable):
  """A non-trainable array that is part of the checkpoint (the hash routing table)."""


def clamped_swiglu(gate: jnp.ndarray, up: jnp.ndarray, limit: float) -> jnp.ndarray:
  """silu(min(gate, L)) * clip(up, -L, L): the gate is clamped from above only."""
  return jax.nn.silu(jnp.minimum(gate, limit)) * jnp.clip(up, -limit, limit)


class Router(nnx.Module):
  """`ffn.gate`: scores every expert; picks by tid2eid (hash layers) or top-k of score + bias."""

  def __init__(self, cfg: DeepseekV4Config, layer: int, *, rngs: nnx.Rngs, dtype=F32):
    self.routing, self.k, self.scale = cfg.routing[layer], cfg.experts_per_token, cfg.routed_scaling_factor
    E = cfg.n_routed_experts
    self.weight = normal(rngs, (E, cfg.hidden_size), 0.02, dtype)
    topk = self.routing is Routing.TOPK
    self.bias = normal(rngs, (E,), 0.02, F32) if topk else None  # used for selection only
    # Hash table with distinct experts per token: the top-k of a random key per (token, expert).
    self.tid2eid = None if topk else Buffer(
        jax.lax.top_k(jax.random.uniform(rngs.params(), (cfg.vocab_size, E)), self.k)[1].astype(jnp.int32))

  def __call__(self, x: jnp.ndarray, tokens: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Returns (weights [S, k] f32, expert ids [S, k] int32)."""
    score = jnp.sqrt(jax.nn.softplus(matmul_t(x, self.weight[...])))  # [S, E]
    if self.routing is Routing.HASH:
      idx = self.tid2eid[...][tokens]
    else:
      idx = jax.lax.top_k(score + self.bias[...], self.k)[1]
    w = jnp.take_along_axis(score, idx, axis=-1)
    return w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20) * self.scale, idx.astype(jnp.int32)


def _expert_dense(w, fmt: str | None) -> jnp.ndarray:
  """One expert's f32 weight from its slice: a plain array, or a dict of storage arrays in `fmt`."""
  return w.astype(F32) if fmt is None else formats.get(fmt).dequantize(**w)


class Experts(nnx.Module):
  """The routed experts, stacked: w1/w3 [E, I, D] (gate/up), w2 [E, D, I] (down)."""

  def __init__(self, cfg: DeepseekV4Config, *, rngs: nnx.Rngs, dtype=F32, policy: QuantPolicy = POLICIES["bf16"]):
    E, I, D = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    self.limit, self.n_experts, self.intermediate, self.hidden = cfg.swiglu_limit, E, I, D
    self.w1 = make_weight(rngs, (E, I, D), 0.02, dtype, policy.gate_up)
    self.w2 = make_weight(rngs, (E, D, I), 0.02, dtype, policy.down)
    self.w3 = make_weight(rngs, (E, I, D), 0.02, dtype, policy.gate_up)

  def __call__(self, x: jnp.ndarray, weights: jnp.ndarray, idx: jnp.ndarray) -> jnp.ndarray:
    """y[t] = sum_k weights[t,k] * E_{idx[t,k]}(x[t]).

    Dense reference: every expert runs on every token (one expert at a time, to bound memory)
    and is weighted by the token's combine weight, 0 where not routed. Exact, and O(E) slow.
    """
    S = x.shape[0]
    combine = jnp.zeros((S, self.n_experts), F32).at[jnp.arange(S)[:, None], idx].add(weights)
    x = x.astype(F32)

    def one_expert(acc, expert):
      w1, w2, w3 = (_expert_dense(w, fmt) for w, fmt in zip(expert[:3], formats_))
      c = expert[3]
      h = clamped_swiglu(matmul_t(x, w1), matmul_t(x, w3), self.limit)
      return acc + c[:, None] * matmul_t(h, w2), None

    # Quantized experts are decoded one expert at a time inside the scan: never all of them at once.
    weights_ = [w.storage() if isinstance(w, QuantizedWeight) else w[...] for w in (self.w1, self.w2, self.w3)]
    formats_ = [w.format if isinstance(w, QuantizedWeight) else None for w in (self.w1, self.w2, self.w3)]
    y, _ = jax.lax.scan(one_expert, jnp.zeros(x.shape, F32), (*weights_, combine.T))
    return y


class SharedExpert(nnx.Module):

  def __init__(self, cfg: DeepseekV4Config, *, rngs: nnx.Rngs, dtype=F32, policy: QuantPolicy = POLICIES["bf16"]):
    D, I = cfg.hidden_size, cfg.moe_intermediate_size
    self.limit = cfg.swiglu_limit
    q = dict(rngs=rngs, dtype=dtype, fmt=policy.dense)
    self.w1 = Linear(D, I, **q)
    self.w2 = Linear(I, D, **q)
    self.w3 = Linear(D, I, **q)

  def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
    return self.w2(clamped_swiglu(self.w1(x), self.w3(x), self.limit))


class MoE(nnx.Module):

  def __init__(self, cfg: DeepseekV4Config, layer: int, *, rngs: nnx.Rngs, dtype=F32,
               policy: QuantPolicy = POLICIES["bf16"]):
    self.gate = Router(cfg, layer, rngs=rngs, dtype=dtype)
    self.experts = Experts(cfg, rngs=rngs, dtype=dtype, policy=policy)
    self.shared_experts = SharedExpert(cfg, rngs=rngs, dtype=dtype, policy=policy)

  def __call__(self, x: jnp.ndarray, tokens: jnp.ndarray, features: Features = REFERENCE) -> jnp.ndarray:
    weights, idx = self.gate(x, tokens)  # routing stays f32 (bf16 scores could pick other experts)
    with matmul_inputs(features.bf16_matmul):
      if not features.moe_kernels:
        return self.experts(x, weights, idx) + self.shared_experts(x)
      return routed_with_kernels(self.experts, x, weights, idx, self.shared_experts(x), features)


def kernel_config(features: Features, x: jnp.ndarray, experts: Experts, top_k: int):
  """The grouped-MoE kernel knobs that the feature switches select."""
  from kernels_pallas import moe as moe_kernels  # pylint: disable=import-outside-toplevel (cycle)

  E, I, D = experts.n_experts, experts.intermediate, experts.hidden
  forced = dict(block_m=features.moe_tile_rows, adaptive_tile=False) if features.moe_tile_rows else {}
  return moe_kernels.Config.default(
      num_tokens=x.shape[0], top_k=top_k, num_experts=E, hidden=D, intermediate=I, dtype=x.dtype,
      platform="rocm" if features.device_class in ("gfx1151", "rdna35_other", "rocm_other") else "cuda",
      **(dict(adaptive_tile=features.moe_adaptive_tile, compact_queue=features.moe_compact_queue,
              persistent=features.moe_persistent, programs_per_core=features.moe_programs_per_core,
              fused_combine=features.moe_fused_combine) | forced))


def routed_with_kernels(experts: Experts, x, weights, idx, shared, features: Features) -> jnp.ndarray:
  """Routed experts + `shared` through the Pallas grouped-MoE kernels (kernels_pallas/moe).

  `moe_sparse_gate_up` feeds the quantized storage to the kernels, which dequantize each tile in-kernel;
  without it the stacked weights are dequantized first (in XLA, by the same canonical decode) and the
  kernels read bf16/f32 ("dequantize-then-matmul").
  """
  from kernels_pallas import moe as moe_kernels  # pylint: disable=import-outside-toplevel (cycle)

  dt = matmul_dtype()  # f32 operands: exact IEEE f32 dots; bf16 (`bf16_matmul`): tensor-core dots

  def kernel_weight(w):
    if not isinstance(w, QuantizedWeight):
      return moe_kernels.DenseWeights(w[...] if dt == F32 else w[...].astype(dt))
    if features.moe_sparse_gate_up:
      return moe_kernels.QuantizedExpertWeights.from_storage(w.format, w.storage(), w.logical_shape)
    return moe_kernels.DenseWeights(w.dequantize().astype(dt))  # the cast fuses into the decode

  x = x.astype(dt)
  return moe_kernels.moe(x, weights, idx, *(kernel_weight(w) for w in (experts.w1, experts.w2, experts.w3)),
                         swiglu_limit=experts.limit, shared=shared,
                         config=kernel_config(features, x, experts, idx.shape[1]),
                         interpret=features.interpret, validate_routes=False)
