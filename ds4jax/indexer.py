"""Lightning indexer of CSA layers (docs/model.md §6): scores compressed rows, keeps the top-k per query."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ds4jax.compressor import Compressor
from ds4jax.config import DeepseekV4Config
from ds4jax.features import REFERENCE, Features
from ds4jax.layers import F32, Linear
from ds4jax.quant.policy import POLICIES, QuantPolicy
from kernels_pallas import indexer as indexer_kernels
from kernels_pallas.mla.reference import apply_rope, visible_rows
from kernels_pallas.precision import einsum


# Rows scored at once by the reference: bounds its [S, Hi, rows] f32 product (4 GiB for a band of 8192 queries
# and 64 heads; the 30722 rows of a 122879-token prompt would need 60 GiB at once).
SCORE_ROW_BLOCK = 2048


class Indexer(nnx.Module):

  def __init__(self, cfg: DeepseekV4Config, *, rngs: nnx.Rngs, dtype=F32, policy: QuantPolicy = POLICIES["bf16"]):
    self.n_heads, self.head_dim, self.topk, self.ratio = (
        cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk, cfg.csa_ratio)
    self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, rngs=rngs, dtype=dtype, fmt=policy.dense)
    self.weights_proj = Linear(cfg.hidden_size, self.n_heads, rngs=rngs, dtype=dtype)
    self.compressor = Compressor(cfg.hidden_size, self.head_dim, cfg.csa_ratio, True, cfg.rms_norm_eps,
                                 rngs=rngs, dtype=dtype)

  def queries(self, x, qr, positions, freqs, operand_dtype=F32) -> tuple[jnp.ndarray, jnp.ndarray]:
    """(q [S, Hi, ci] rotated, per-head weights w [S, Hi] with the ci^-0.5 · Hi^-0.5 scale folded in)."""
    q = apply_rope(self.wq_b(qr, operand_dtype).reshape(x.shape[0], self.n_heads, self.head_dim), positions, freqs)
    return q, self.weights_proj(x, operand_dtype) * (self.head_dim ** -0.5 * self.n_heads ** -0.5)

  def scores(self, x, qr, positions, freqs: np.ndarray, keys: jnp.ndarray | None = None, *,
             row_block: int = SCORE_ROW_BLOCK, operand_dtype=F32) -> jnp.ndarray:
    """score[t, s] = sum_h w[t,h] * relu(q[t,h] . k[s]) in f32; -inf where row s is not yet visible.
    `keys` [R, ci] default to the compressor's rows of x (a prompt from position 0). More than `row_block` rows
    are scored a block at a time (each score is computed alone, so blocking does not change it)."""
    keys = self.compressor(x, freqs) if keys is None else keys
    q, w = self.queries(x, qr, positions, freqs, operand_dtype)
    dot = lambda spec, a, b: einsum(spec, a, b, operand_dtype=operand_dtype)
    score = lambda k: dot("th,thr->tr", w, jax.nn.relu(dot("thc,rc->thr", q, k)))
    R = keys.shape[0]
    if R <= row_block:
      s = score(keys)
    else:
      blocks = -(-R // row_block)
      padded = jnp.pad(keys, ((0, blocks * row_block - R), (0, 0))).reshape(blocks, row_block, keys.shape[1])
      s = jax.lax.map(score, padded).transpose(1, 0, 2).reshape(x.shape[0], blocks * row_block)[:, :R]
    return jnp.where(visible_rows(positions, R, self.ratio), s, -jnp.inf)

  def __call__(self, x, qr, positions, freqs) -> jnp.ndarray:
    """[S, min(topk, R)] int32 row ids, best first; -1 marks a slot with no visible row (a prompt from 0)."""
    return self.select(x, qr, positions, freqs, self.compressor(x, freqs), REFERENCE)

  def select(self, x, qr, positions, freqs, keys, features: Features, pinned=None) -> jnp.ndarray:
    """Row ids [S, k] of each query's best visible rows among `keys` [R, ci], -1 for empty slots.

    Reference: XLA scores + top_k, best first, k = min(topk, R). `indexer_score_kernel`: the Pallas scoring
    kernel with query-blocked top-k (kernels_pallas/indexer), ascending ids, k = topk (a power of two), by a sort
    or, under `indexer_radix_topk`, by the radix-selection kernel (the same ids).
    `pinned` (the reference's ids of another run, decisions.py) replaces the choice, in this path's layout.
    """
    dt = features.matmul_dtype
    if pinned is not None:
      if not features.indexer_score_kernel:
        return pinned
      pad = self.topk - pinned.shape[1]
      return indexer_kernels.sort_ids(jnp.pad(pinned, ((0, 0), (0, pad)), constant_values=-1) if pad else pinned)
    if features.indexer_score_kernel:
      q, w = self.queries(x, qr, positions, freqs, dt)
      # Dots in the model's matmul dtype: f32 keeps the exact selection; bf16 (`bf16_matmul`) may swap near-ties.
      config = indexer_kernels.Config.default(
          x.shape[0], keys.shape[0], self.n_heads, self.head_dim, platform=features.platform,
          compute_dtype=jnp.dtype(dt).name, selection="radix" if features.indexer_radix_topk else "sort")
      return indexer_kernels.topk(q, w, keys, q_start=positions[0], k=self.topk, ratio=self.ratio, config=config,
                                  interpret=features.interpret)
    s = self.scores(x, qr, positions, freqs, keys, operand_dtype=dt)
    k = min(self.topk, s.shape[1])
    if k == 0:
      return jnp.zeros((x.shape[0], 0), jnp.int32)
    vals, idx = jax.lax.top_k(s, k)
    return jnp.where(jnp.isneginf(vals), -1, idx).astype(jnp.int32)
