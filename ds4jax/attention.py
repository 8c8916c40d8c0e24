"""DeepSeek-V4 attention (docs/model.md §4): the dense masked reference and the Pallas fast paths.

One shared K=V latent head; the key set of a query is its 128-token window plus compressed rows (all complete ones
on HCA layers, the indexer's top-k on CSA layers). The reference scores every key and masks the keys outside the
set with -inf: slow, exact, and the yardstick for the kernels (kernels_pallas/indexer, kernels_pallas/mla), which
the feature switches select.

Prefill runs in bands (ds4jax/prefill.py): `band` takes the band's positions [s0, s0+B) and the layer's
`LayerCache` from the previous band and returns the new one; a one-shot prompt is one band from an empty cache.

On a mesh with a query axis (ds4jax/mesh.py) each device runs the per-query part of a band (q, the indexer's
selection, the attention kernel, the output projection) on B/n of its tokens, against the keys of the whole band,
which every device computes (the KV projection and the compressors are small next to the rest).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from ds4jax import compressor as comp
from ds4jax import layer_cache, rope
from ds4jax import mesh as mesh_lib
from ds4jax.compressor import Compressor
from ds4jax.config import Attention as Kind
from ds4jax.config import DeepseekV4Config
from ds4jax.features import REFERENCE, Features
from ds4jax.indexer import Indexer
from ds4jax.layer_cache import LayerCache
from ds4jax.layers import F32, RESIDUAL_GAIN, Linear, RMSNorm, dense, normal, rms_normalize
from ds4jax.quant.policy import POLICIES, QuantPolicy
from kernels_pallas import mla
from kernels_pallas.indexer import handoff
from kernels_pallas.mla import stream_wgmma
from kernels_pallas.mla.reference import apply_rope, selected_bias, sink_attention, visible_rows, window_bias
from kernels_pallas.precision import einsum

KERNEL_KIND = {Kind.WINDOW: "window", Kind.CSA: "csa", Kind.HCA: "hca"}


def query_chunks(n: int, chunk: int) -> int:
  """How many query chunks a band of n tokens is attended in (`long_context_chunk`; 0 = one)."""
  if not chunk or chunk >= n:
    return 1
  if n % chunk:
    raise ValueError(f"the band of {n} tokens is not a multiple of long_context_chunk={chunk}")
  return n // chunk


def chunk_for_share(n: int, chunk: int) -> int:
  """The chunk a device attends its share of n queries in, on a query axis: `long_context_chunk`, or, when the
  share is not a whole number of chunks (a band of 15 chunks over 2 devices), the largest number that divides both
  (gcd), which keeps the bound on the masks and scores. Chunking does not change a query's result."""
  return math.gcd(n, chunk) if chunk and chunk < n and n % chunk else chunk


def kernel_row_list(indices: jnp.ndarray, n_rows: int, features: Features) -> jnp.ndarray:
  """The [S, k] row list the streaming kernel reads, k padded to a power of two with -1.

  Both handoffs deliver the rows in ascending physical order, so the kernel reduces in the same order and the
  output is byte-identical (docs/upstream.md §3): the direct path sorts the indexer's ids (the Pallas indexer
  already returns them sorted); the mask path builds the dense [S, n_rows] additive mask and scans it back.
  """
  k = 1 << max(indices.shape[1] - 1, 0).bit_length()
  if k != indices.shape[1]:
    indices = jnp.pad(indices, ((0, 0), (0, k - indices.shape[1])), constant_values=-1)
  if not features.direct_indexer_topk:
    return handoff.selected_rows(indices, n_rows, direct_indexer_topk=False)
  if features.indexer_score_kernel:
    return indices
  big = jnp.iinfo(jnp.int32).max
  ordered = jnp.sort(jnp.where(indices < 0, big, indices), axis=1)
  return jnp.where(ordered == big, -1, ordered)


def model_fits(cfg: DeepseekV4Config) -> frozenset[str]:
  """The features.MODEL_BOUND switches `cfg` can run (features.resolve's `fits`): `mla_wgmma`, whose kernel takes
  V4-Flash's 64 heads of dim 512 only (kernels_pallas/mla/stream_wgmma.py)."""
  fits = (cfg.num_heads, cfg.head_dim) == (stream_wgmma.HEADS, 2 * stream_wgmma.HALF)
  return frozenset({"mla_wgmma"} if fits else ())


def check_kernels(cfg: DeepseekV4Config, features: Features) -> None:
  """Start-up check of the attention kernels the switches select against the model (ValueError naming what does
  not fit), before any of them is traced: `mla_wgmma` (`model_fits`), the streaming MLA kernels' head dim, the
  indexer kernel's top-k."""
  if features.mla_wgmma and "mla_wgmma" not in model_fits(cfg):
    raise ValueError(f"--mla_wgmma needs {stream_wgmma.HEADS} heads of dim {2 * stream_wgmma.HALF}; {cfg.name} has "
                     f"{cfg.num_heads} of dim {cfg.head_dim}")
  d = cfg.head_dim
  if features.mla_stream_topk and not (64 <= d <= 512 and d & (d - 1) == 0):
    raise ValueError(f"--mla_stream_topk needs a head dim that is a power of two in [64, 512]; {cfg.name} has {d}")
  k = cfg.index_topk
  if features.indexer_score_kernel and Kind.CSA in cfg.attention and k & (k - 1):
    raise ValueError(f"--indexer_score_kernel needs index_topk a power of two; {cfg.name} has {k}")


class Attention(nnx.Module):

  def __init__(self, cfg: DeepseekV4Config, layer: int, *, rngs: nnx.Rngs, dtype=F32,
               policy: QuantPolicy = POLICIES["bf16"], mesh: str = ""):
    self.cfg, self.kind = cfg, cfg.attention[layer]
    H, d, D = cfg.num_heads, cfg.head_dim, cfg.hidden_size
    q = dict(rngs=rngs, dtype=dtype, fmt=policy.dense)  # the projections the official checkpoint keeps in FP8
    self.wq_a = Linear(D, cfg.q_lora_rank, **q)
    self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
    self.wq_b = Linear(cfg.q_lora_rank, H * d, **q)
    self.wkv = Linear(D, d, **q)
    self.kv_norm = RMSNorm(d, cfg.rms_norm_eps)
    self.wo_a = Linear(H * d // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, **q)
    self.wo_b = Linear(cfg.o_groups * cfg.o_lora_rank, D, gain=RESIDUAL_GAIN, **q)  # writes the residual
    self.attn_sink = normal(rngs, (H,), 0.5, F32)
    self.compressor = None if self.kind is Kind.WINDOW else Compressor(
        D, d, cfg.compress_ratio(layer), self.kind is Kind.CSA, cfg.rms_norm_eps, rngs=rngs, dtype=dtype)
    self.indexer = Indexer(cfg, rngs=rngs, dtype=dtype, policy=policy) if self.kind is Kind.CSA else None
    self.mesh = mesh  # the model's mesh spec (ds4jax.mesh.place sets it): a query axis splits `band`'s queries

  def empty_cache(self, capacity: int, band: int) -> LayerCache:
    layer = self.cfg.attention.index(self.kind)  # any layer of this kind: the cache depends on the kind only
    return layer_cache.empty(self.cfg, layer, capacity, band)

  def __call__(self, x: jnp.ndarray, positions: jnp.ndarray, features: Features = REFERENCE) -> jnp.ndarray:
    """x: [S, D] normed input of a prompt starting at position 0 (positions = arange(S)). Returns [S, D]."""
    del positions  # a one-shot prompt starts at 0
    return self.band(x, 0, self.empty_cache(x.shape[0], x.shape[0]), features)[0]

  def band(self, x: jnp.ndarray, s0, cache: LayerCache, features: Features = REFERENCE, pinned_rows=None,
           record_scores: bool = False):
    """x: [B, D] normed input at positions [s0, s0+B) (s0 may be traced). Returns ([B, D], the new cache, the
    indexer's picks [B, k] (CSA layers, else None), their f32 reference scores [B, R] if `record_scores`).
    `pinned_rows` imposes the picks (ds4jax/decisions.py)."""
    cfg = self.cfg
    B = x.shape[0]
    dt = features.matmul_dtype  # every matmul of the layer; norms, softmax and RoPE stay f32
    positions = s0 + jnp.arange(B, dtype=jnp.int32)
    freqs = rope.layer_inv_freq(cfg, self.kind)
    kv = apply_rope(self.kv_norm(self.wkv(x, dt)), positions, freqs)  # [B, d]
    # Keys are read as the cache stores them (bf16 in a bf16 decode state), the band's own too: a band of q tokens
    # then sees what q one-token steps see (docs/decode.md §1). A no-op for f32 caches.
    kv_dtype = cache.kv_tail.dtype
    kv = kv.astype(kv_dtype).astype(F32)
    raw = jnp.concatenate([cache.kv_tail.astype(F32), kv])  # positions [s0 - W + 1, s0 + B)
    new = dict(kv_tail=raw[B:].astype(kv_dtype))
    rows = keys = None
    if self.compressor is not None:
      m = self.compressor.ratio
      ext, a = comp.extend(cache.x_tail, x, s0, m)
      rows = comp.write_rows(cache.rows, self.compressor.pool(ext, a // m, freqs, dt), a // m)
      new.update(x_tail=comp.next_tail(ext, a, s0 + B, m), rows=rows)
      if self.indexer is not None:
        keys = comp.write_rows(cache.index_rows, self.indexer.compressor.pool(ext, a // m, freqs, dt), a // m)
        new["index_rows"] = keys

    def per_query(xq, pq, pinned):
      """The band's queries xq [b, D] at positions pq → (output [b, D], picks [b, k] or None, scores or None)."""
      b, H, d, G = xq.shape[0], cfg.num_heads, cfg.head_dim, cfg.o_groups
      qr = self.q_norm(self.wq_a(xq, dt))  # [b, q_lora]; the indexer reuses it
      q = rms_normalize(self.wq_b(qr, dt).reshape(b, H, d), cfg.rms_norm_eps)  # per-head norm, no weight
      q = apply_rope(q, pq, freqs)
      indices = index_scores = None
      if self.indexer is not None:
        indices = self.indexer.select(xq, qr, pq, freqs, keys, features, pinned)
        if record_scores:
          index_scores = self.indexer.scores(xq, qr, pq, freqs, keys)
      chunk = features.long_context_chunk
      o = self.attend(q, raw, rows, indices, s0, pq, freqs, features,
                      chunk_for_share(b, chunk) if b < B else chunk)  # [b, H, d], de-rotated
      # Grouped low-rank output: heads are grouped contiguously, each group has its own wo_a slice.
      wo_a = dense(self.wo_a.weight).reshape(G, cfg.o_lora_rank, H * d // G)
      z = einsum("sgi,gri->sgr", o.reshape(b, G, H * d // G), wo_a, operand_dtype=dt).reshape(b, -1)
      return self.wo_b(z, dt), indices, index_scores

    out, indices, index_scores = self.split_queries(per_query, x, positions, pinned_rows)
    return out, LayerCache(**new), indices, index_scores

  def split_queries(self, per_query, x, positions, pinned):
    """per_query(x, positions, pinned) over the band's tokens: whole, or on a mesh with a query axis of n devices
    B/n tokens on each (inside `jax.shard_map`; the results come back split over the axis, and XLA gathers them
    where the next step needs them whole). A band whose length n does not divide (a decode step of one token) runs
    whole on every device.

    check_vma=False: the kernels and the exact path's loops are not written for shard_map's varying-axis types;
    nothing crosses devices inside."""
    axis = mesh_lib.axis_of(self.mesh, mesh_lib.QUERY)
    if axis is None or x.shape[0] % axis[1]:
      return per_query(x, positions, pinned)
    return jax.shard_map(per_query, mesh=mesh_lib.build(self.mesh), in_specs=P(axis[0]), out_specs=P(axis[0]),
                         check_vma=False)(x, positions, pinned)

  def attend(self, q, raw, rows, indices, s0, positions, freqs, features: Features, chunk: int):
    """The joint sink softmax over each query's key set, then the output de-rotation: [B, H, d], f32 (the streaming
    kernel: in the matmul dtype, which the output projection reads; the same bits as rounding its f32 output).

    Queries go in chunks of `chunk` (`long_context_chunk`, or `chunk_for_share`), which bounds the [chunk, keys]
    masks and scores at long context.
    """
    cfg, W = self.cfg, self.cfg.sliding_window
    B, d = q.shape[0], cfg.head_dim
    n = query_chunks(B, chunk)
    raw_start = s0 - (W - 1)
    ratio = self.compressor.ratio if self.compressor is not None else 1
    if indices is not None and features.mla_stream_topk:
      indices = kernel_row_list(indices, rows.shape[0], features)
    dt = features.matmul_dtype  # bf16 q/KV: one bf16 dot per tile instead of the split-bf16 f32 emulation
    kind = KERNEL_KIND[self.kind]
    # bf16 operands for both dots under bf16_matmul, the softmax weights included (as the reference's bf16 math
    # rounds them); f32 operands keep the platform's default ("split" on CUDA: the f32 parity path).
    bf16 = dict(precision="bf16") if features.bf16_matmul else {}
    config = mla.Config.default(cfg.num_heads, d, kind, platform=features.platform, dtype=dt,
                                f32_stage=features.mla_stream_f32_stage, **bf16)

    def one_chunk(args):
      qc, pc, ic = args
      if features.mla_wgmma:  # sm_90's Mosaic GPU kernel (docs/mla_mosaic.md): bf16 in, bf16 out
        cast = lambda a: None if a is None else a.astype(dt)
        return stream_wgmma.sparse_mla_wgmma(cast(qc), cast(raw), cast(rows), self.attn_sink[...], q_start=pc[0],
                                             raw_start=raw_start, kind=kind, ratio=ratio, window=W, inv_freq=freqs,
                                             indices=ic, interpret=features.interpret)
      if features.mla_stream_topk:
        cast = lambda a: None if a is None else a.astype(dt)
        return mla.sparse_mla(cast(qc), cast(raw), cast(rows), self.attn_sink[...], q_start=pc[0],
                              raw_start=raw_start, kind=kind, ratio=ratio, window=W, inv_freq=freqs, indices=ic,
                              f32_stage=features.mla_stream_f32_stage, fast_exp=features.mla_stream_fast_exp,
                              config=config, interpret=features.interpret, out_dtype=dt)
      keys = raw if rows is None else jnp.concatenate([raw, rows.astype(F32)])
      bias = window_bias(pc, raw_start + jnp.arange(raw.shape[0]), W)
      if rows is not None:
        row_bias = (jnp.where(visible_rows(pc, rows.shape[0], ratio), 0.0, -jnp.inf) if ic is None
                    else selected_bias(ic, rows.shape[0]))
        bias = jnp.concatenate([bias, row_bias.astype(F32)], axis=1)
      o = sink_attention(qc, keys, bias, self.attn_sink[...], d ** -0.5, dt)
      return apply_rope(o, pc, freqs, inverse=True)  # V carries rotated dims: rotate back by -t

    if n == 1:
      return one_chunk((q, positions, indices))
    split = lambda a: None if a is None else a.reshape(n, B // n, *a.shape[1:])
    out = jax.lax.map(one_chunk, (split(q), split(positions), split(indices)))
    return out.reshape(B, *out.shape[2:])
