"""The DeepSeek-V4 reference model: Flax NNX, plain jnp, f32 math, logits for every position.

Module attribute names follow the official checkpoint's names (`layers.L.attn.wq_a.weight`, ...),
so that loading a checkpoint is a mechanical mapping (see ds4jax/checkpoint/mapping.py).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from ds4jax import attention as attention_lib
from ds4jax import mesh as mesh_lib
from ds4jax import moe as moe_lib
from ds4jax.attention import Attention
from ds4jax.config import DeepseekV4Config
from ds4jax.decisions import Decisions
from ds4jax.features import REFERENCE, Features
from ds4jax.hyper_connection import HyperConnection, HyperHead
from ds4jax.layer_cache import LayerCache
from ds4jax.layers import F32, Linear, RMSNorm, normal
from ds4jax.moe import MoE
from ds4jax.quant import policy as quant_policy
from ds4jax.quant.policy import QuantPolicy


# The random head's logits have this std (its input is RMS-normed): a peaked next-token distribution, as a trained
# model's, rather than the near-uniform one a small head gives (docs/model.md §12).
LOGIT_STD = 3.0


class Block(nnx.Module):
  """One layer: HC site around attention, HC site around the MoE."""

  def __init__(self, cfg: DeepseekV4Config, layer: int, *, rngs: nnx.Rngs, dtype, policy: QuantPolicy,
               mesh: str = ""):
    D, n, eps = cfg.hidden_size, cfg.hc_mult, cfg.rms_norm_eps
    self.hc_attn = HyperConnection(D, n, cfg.hc_sinkhorn_iters, cfg.hc_eps, eps, rngs=rngs)
    self.attn_norm = RMSNorm(D, eps)
    self.attn = Attention(cfg, layer, rngs=rngs, dtype=dtype, policy=policy, mesh=mesh)
    self.hc_ffn = HyperConnection(D, n, cfg.hc_sinkhorn_iters, cfg.hc_eps, eps, rngs=rngs)
    self.ffn_norm = RMSNorm(D, eps)
    self.ffn = MoE(cfg, layer, rngs=rngs, dtype=dtype, policy=policy, mesh=mesh)

  def __call__(self, X: jnp.ndarray, tokens: jnp.ndarray, positions: jnp.ndarray,
               features: Features = REFERENCE) -> jnp.ndarray:
    """A one-shot prompt from position 0: one band from an empty cache."""
    del positions
    return self.band(X, tokens, 0, self.attn.empty_cache(X.shape[0], X.shape[0]), features)[0]

  def band(self, X: jnp.ndarray, tokens: jnp.ndarray, s0, cache: LayerCache, features: Features = REFERENCE,
           pinned: Decisions | None = None, record_scores: bool = False):
    """X [B, n, D] streams of positions [s0, s0+B) -> (new streams, the attention layer's new cache, the layer's
    Decisions). `pinned` imposes another run's decisions; `record_scores` adds the f32 scores behind them."""
    X, cache, rows, index_scores = self.attend(X, s0, cache, features,
                                               None if pinned is None else pinned.index_rows, record_scores)
    X, route_ids, selection_scores = self.feed_forward(X, tokens, features,
                                                       None if pinned is None else pinned.route_ids, record_scores)
    return X, cache, Decisions(route_ids, rows, selection_scores, index_scores)

  def attend(self, X: jnp.ndarray, s0, cache: LayerCache, features: Features = REFERENCE, pinned_rows=None,
             record_scores: bool = False):
    """The attention half of `band`: (streams, new cache, index rows, index scores or None)."""
    h, post, comb = self.hc_attn(X)  # hyper-connections stay f32 whatever `bf16_matmul` says
    y, cache, rows, index_scores = self.attn.band(self.attn_norm(h), s0, cache, features, pinned_rows,
                                                  record_scores)
    return HyperConnection.merge(X, y, post, comb), cache, rows, index_scores

  def feed_forward(self, X: jnp.ndarray, tokens: jnp.ndarray, features: Features = REFERENCE, pinned_route_ids=None,
                   record_scores: bool = False):
    """The MoE half of `band`, position-free (prefill may run it over several bands' tokens at once): (streams,
    route ids, selection scores or None)."""
    h, post, comb = self.hc_ffn(X)
    x = self.ffn_norm(h)
    y, route_ids = self.ffn.route_and_mix(x, tokens, features, pinned_route_ids)
    scores = self.ffn.gate.selection_scores(x) if record_scores else None
    return HyperConnection.merge(X, y, post, comb), route_ids, scores


class DeepseekV4(nnx.Module):
  """tokens [S] -> logits [S, vocab] (f32), for a prompt that starts at position 0."""

  def __init__(self, cfg: DeepseekV4Config, *, rngs: nnx.Rngs, dtype=F32, policy: str | QuantPolicy = "bf16",
               mesh: str = ""):
    policy = quant_policy.get(policy) if isinstance(policy, str) else policy
    quant_policy.check_config(policy, cfg)
    self.cfg, self.policy = cfg, policy
    D, n = cfg.hidden_size, cfg.hc_mult
    self.embed = normal(rngs, (cfg.vocab_size, D), 1.0, dtype)
    self.layers = nnx.List([Block(cfg, i, rngs=rngs, dtype=dtype, policy=policy, mesh=mesh)
                            for i in range(cfg.num_layers)])
    self.hc_head = HyperHead(D, n, cfg.hc_eps, cfg.rms_norm_eps, rngs=rngs)
    self.norm = RMSNorm(D, cfg.rms_norm_eps)
    self.head = Linear(D, cfg.vocab_size, rngs=rngs, dtype=dtype, gain=LOGIT_STD)

  def __call__(self, tokens: jnp.ndarray, *, return_streams: bool = False, features: Features = REFERENCE):
    """With `return_streams`, also returns the [L+1, S, n, D] streams: the embedding, then each layer's output.

    `features` selects the fast paths (Pallas kernels); the default, all off, is the exact reference.
    """
    positions = jnp.arange(tokens.shape[0], dtype=jnp.int32)
    X = self.embed_streams(tokens)
    streams = [X]
    for block in self.layers:
      X = block(X, tokens, positions, features)
      streams.append(X)
    logits = self.logits(X)
    return (logits, jnp.stack(streams)) if return_streams else logits

  def embed_streams(self, tokens: jnp.ndarray) -> jnp.ndarray:
    """[S] ids -> [S, n, D]: the embedding copied into the n residual streams."""
    return embed_streams(self.embed[...], tokens, self.cfg.hc_mult)

  def output(self) -> tuple[nnx.Module, nnx.Module, nnx.Module]:
    """The modules after the layers (what `prefill` splits for the logits, without walking the 43 layers)."""
    return self.hc_head, self.norm, self.head

  def logits(self, X: jnp.ndarray) -> jnp.ndarray:
    """[S, n, D] final streams -> [S, vocab] f32."""
    return output_logits(self.output(), X)


def embed_streams(table: jnp.ndarray, tokens: jnp.ndarray, hc_mult: int) -> jnp.ndarray:
  e = table[tokens].astype(F32)
  return jnp.broadcast_to(e[:, None, :], (tokens.shape[0], hc_mult, table.shape[1]))


def output_logits(output, X: jnp.ndarray) -> jnp.ndarray:
  hc_head, norm, head = output
  return head(norm(hc_head(X)))


def kernel_fits(cfg: DeepseekV4Config, policy: str | QuantPolicy) -> frozenset[str]:
  """The switches whose kernels take this model (features.resolve's `fits`: their bound defaults hold for it)."""
  pol = quant_policy.get(policy) if isinstance(policy, str) else policy
  return attention_lib.model_fits(cfg) | moe_lib.model_fits(cfg, pol)


def check_tokens(tokens, cfg: DeepseekV4Config) -> np.ndarray:
  """Host-side validation of a prompt (jit code cannot raise on values)."""
  t = np.asarray(tokens)
  if t.ndim != 1 or t.shape[0] == 0:
    raise ValueError(f"tokens must be a non-empty 1-D array of ids, got shape {t.shape}")
  if not np.issubdtype(t.dtype, np.integer):
    raise ValueError(f"tokens must be integers, got dtype {t.dtype}")
  bad = np.flatnonzero((t < 0) | (t >= cfg.vocab_size))
  if bad.size:
    raise ValueError(f"token id {int(t[bad[0]])} at position {int(bad[0])} is outside the vocabulary "
                     f"[0, {cfg.vocab_size}) ({bad.size} bad ids in all)")
  if t.shape[0] > cfg.max_position_embeddings:
    raise ValueError(f"prompt of {t.shape[0]} tokens exceeds max_position_embeddings="
                     f"{cfg.max_position_embeddings}")
  return t.astype(np.int32)


@nnx.jit(static_argnames=("return_streams", "features"))
def _forward(model: DeepseekV4, tokens: jnp.ndarray, return_streams: bool = False, features: Features = REFERENCE):
  return model(tokens, return_streams=return_streams, features=features)


def forward(model: DeepseekV4, tokens, *, return_streams: bool = False, features: Features = REFERENCE):
  """Validated, jitted prefill: logits [S, vocab] (and the streams if asked). `features` picks the fast
  paths; the default is the exact reference."""
  return _forward(model, jnp.asarray(check_tokens(tokens, model.cfg)), return_streams=return_streams,
                  features=features)


def init_random(cfg: DeepseekV4Config, seed: int = 0, dtype=jnp.bfloat16,
                policy: str | QuantPolicy = "bf16", mesh: str = "") -> DeepseekV4:
  """Random weights under a quantization policy. Each one is drawn by a jax op on the default device,
  so on a GPU nothing is staged in host memory (peak memory is the model itself plus one weight). `mesh`
  (ds4jax/mesh.py): with an expert axis each device draws its share of the routed experts; the rest is drawn once
  and replicated; the values are the unsharded init's, bit for bit."""
  if not mesh:
    return DeepseekV4(cfg, rngs=nnx.Rngs(params=seed), dtype=dtype, policy=policy)
  mesh_lib.check(mesh, cfg)
  return mesh_lib.place(DeepseekV4(cfg, rngs=nnx.Rngs(params=seed), dtype=dtype, policy=policy, mesh=mesh), mesh)


def abstract_model(cfg: DeepseekV4Config, dtype=jnp.bfloat16, policy: str | QuantPolicy = "bf16") -> DeepseekV4:
  """The model's structure with ShapeDtypeStructs in place of arrays (no memory; any preset)."""
  return nnx.eval_shape(lambda: DeepseekV4(cfg, rngs=nnx.Rngs(params=0), dtype=dtype, policy=policy))
