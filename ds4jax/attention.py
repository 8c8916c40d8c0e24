"""DeepSeek-V4 attention, dense masked reference (deepseek-v4.md §4).

One shared K=V latent head; the key set of a query is its 128-token window plus compressed rows
(all complete ones on HCA layers, the indexer's top-k on CSA layers). Every key is scored and the
keys outside the set are masked with -inf: slow, exact, and the yardstick for the Pallas kernels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ds4jax import rope
from ds4jax.compressor import Compressor, visible_rows
from ds4jax.config import Attention as Kind
from ds4jax.config import DeepseekV4Config
from ds4jax.indexer import Indexer
from ds4jax.layers import F32, Linear, RMSNorm, dense, einsum, normal, rms_normalize
from ds4jax.quant.policy import POLICIES, QuantPolicy


def window_bias(q_pos: jnp.ndarray, k_pos: jnp.ndarray, window: int) -> jnp.ndarray:
  """[Sq, Sk] additive mask: key j is in query t's window iff t - window < j <= t."""
  d = q_pos[:, None] - k_pos[None, :]
  return jnp.where((d >= 0) & (d < window), 0.0, -jnp.inf).astype(F32)


def selected_bias(topk: jnp.ndarray, n_rows: int) -> jnp.ndarray:
  """[S, n_rows] additive mask from [S, k] row ids (-1 = none): 0 at selected rows, -inf elsewhere."""
  safe = jnp.where(topk >= 0, topk, n_rows)  # -1 goes to a spill column that is dropped
  hit = jnp.zeros((topk.shape[0], n_rows + 1), bool).at[jnp.arange(topk.shape[0])[:, None], safe].set(True)
  return jnp.where(hit[:, :n_rows], 0.0, -jnp.inf).astype(F32)


def sink_attention(q: jnp.ndarray, keys: jnp.ndarray, bias: jnp.ndarray, sink: jnp.ndarray,
                   scale: float) -> jnp.ndarray:
  """Softmax over keys and a per-head sink logit jointly; values are the keys (K = V).

  q: [S, H, d]; keys: [N, d]; bias: [S, N] (0 or -inf); sink: [H]. Returns [S, H, d] in f32.
  """
  s = einsum("thd,nd->thn", q.astype(F32), keys.astype(F32)) * scale + bias[:, None, :]
  m = jnp.maximum(jnp.max(s, axis=-1), sink[None, :])  # the sink joins the running max too
  p = jnp.exp(s - m[..., None])
  denom = jnp.sum(p, axis=-1) + jnp.exp(sink[None, :] - m)  # the sink adds mass but no value
  return einsum("thn,nd->thd", p / denom[..., None], keys.astype(F32))


class Attention(nnx.Module):

  def __init__(self, cfg: DeepseekV4Config, layer: int, *, rngs: nnx.Rngs, dtype=F32,
               policy: QuantPolicy = POLICIES["bf16"]):
    self.cfg, self.kind = cfg, cfg.attention[layer]
    H, d, D = cfg.num_heads, cfg.head_dim, cfg.hidden_size
    q = dict(rngs=rngs, dtype=dtype, fmt=policy.dense)  # the projections the official checkpoint keeps in FP8
    self.wq_a = Linear(D, cfg.q_lora_rank, **q)
    self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
    self.wq_b = Linear(cfg.q_lora_rank, H * d, **q)
    self.wkv = Linear(D, d, **q)
    self.kv_norm = RMSNorm(d, cfg.rms_norm_eps)
    self.wo_a = Linear(H * d // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, **q)
    self.wo_b = Linear(cfg.o_groups * cfg.o_lora_rank, D, **q)
    self.attn_sink = normal(rngs, (H,), 0.5, F32)
    self.compressor = None if self.kind is Kind.WINDOW else Compressor(
        D, d, cfg.compress_ratio(layer), self.kind is Kind.CSA, cfg.rms_norm_eps, rngs=rngs, dtype=dtype)
    self.indexer = Indexer(cfg, rngs=rngs, dtype=dtype, policy=policy) if self.kind is Kind.CSA else None

  def key_set(self, x, qr, positions, freqs):
    """The keys and their [S, N] mask: the raw rows (window) followed by the compressed rows."""
    kv = rope.apply(self.kv_norm(self.wkv(x)), positions, freqs)  # [S, d]
    bias = window_bias(positions, positions, self.cfg.sliding_window)
    if self.compressor is None:
      return kv, bias
    rows = self.compressor(x, freqs)  # [R, d]
    if self.indexer is None:  # HCA: every complete row
      row_bias = jnp.where(visible_rows(positions, rows.shape[0], self.compressor.ratio), 0.0, -jnp.inf)
    else:  # CSA: the indexer's picks (already restricted to visible rows)
      row_bias = selected_bias(self.indexer(x, qr, positions, freqs), rows.shape[0])
    return jnp.concatenate([kv, rows]), jnp.concatenate([bias, row_bias.astype(F32)], axis=1)

  def __call__(self, x: jnp.ndarray, positions: jnp.ndarray) -> jnp.ndarray:
    """x: [S, D] normed input of a prompt starting at position 0; positions: [S]. Returns [S, D]."""
    cfg = self.cfg
    S, H, d, G = x.shape[0], cfg.num_heads, cfg.head_dim, cfg.o_groups
    freqs = rope.layer_inv_freq(cfg, self.kind)
    qr = self.q_norm(self.wq_a(x))  # [S, q_lora]; the indexer reuses it
    q = rms_normalize(self.wq_b(qr).reshape(S, H, d), cfg.rms_norm_eps)  # per-head norm, no weight
    q = rope.apply(q, positions, freqs)
    keys, bias = self.key_set(x, qr, positions, freqs)
    o = sink_attention(q, keys, bias, self.attn_sink[...], d ** -0.5)
    o = rope.apply(o, positions, freqs, inverse=True)  # V carries rotated dims: rotate back by -t
    # Grouped low-rank output: heads are grouped contiguously, each group has its own wo_a slice.
    wo_a = dense(self.wo_a.weight).reshape(G, cfg.o_lora_rank, H * d // G)
    z = einsum("sgi,gri->sgr", o.reshape(S, G, H * d // G), wo_a).reshape(S, G * cfg.o_lora_rank)
    return self.wo_b(z)
