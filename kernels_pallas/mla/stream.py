"""Streaming sparse MLA attention (docs/upstream.md §4; upstream `ds4_flash_attn_d512_streaming_topk_kernel`),
Pallas-Triton.

One program = Tq queries × Hp heads (M rows) against their key set (keyset.py): it gathers the window rows, then
the selected (CSA) or visible (HCA) compressed rows, kb rows per stage, and updates the online-softmax state
while the stage is resident:

    s = q·Kᵀ·scale (masked −inf);  m' = max(m, max s);  a = e^(m − m');  p = e^(s − m')
    l = l·a + Σp;  acc = acc·a + p·K

State (m, l, acc [M, D]) is f32. m starts at the sink logit (the sink joins the max, so no −inf − −inf ever
occurs); the sink's mass e^(sink − m) is added to l at the end, then acc / l and the in-kernel inverse RoPE.

Dots are 2-D bf16 with f32 accumulation, chunked over the head dim (dk): scores q [M, dk] · Kᵀ [dk, kb] summed
over chunks (M = the program's heads, as upstream shares one staged row across its 16 heads; the key tile is
gathered already transposed), values p [M, kb] · K [kb, dk] into D/dk accumulator tiles. With precision "split"
f32 inputs arrive as bf16 hi + lo arrays (api.operand_parts) and p is split in-kernel (keyset.dot: three bf16
passes), which keeps the parity tolerance without f32 dots (none on gfx1151).

Options (lucebox switches):
  f32_stage  (GGML_CUDA_MLA_STREAM_F32_STAGE): each stage's tiles (every operand part) are loaded once and feed
             the score and the value dot of every head of the program. Off: the value dot loads the rows again
             (upstream's unstaged kernel converts per use; here the operands are bf16 parts already, so the
             difference is the second load, an L1/L2 hit).
  fast_exp   (GGML_CUDA_MLA_STREAM_FAST_EXP): exp2 with log2 e folded into the scale and the sink (hardware ex2 /
             v_exp_f32) instead of exp. Upstream only ships it with f32 staging, a rule the feature switches
             enforce (ds4jax/features.py); the kernel itself runs either way.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kernels_pallas.mla import keyset
from kernels_pallas.mla.config import Config
from kernels_pallas.mla.keyset import F32, LOG2E, Geometry

NAMES = {(False, False): "mla_stream_topk", (True, False): "mla_stream_f32_stage",
         (True, True): "mla_stream_fast_exp", (False, True): "mla_stream_unstaged_fast_exp"}


def kernel_name(f32_stage: bool, fast_exp: bool) -> str:
  return NAMES[(bool(f32_stage), bool(fast_exp))]


def _kernel(off_ref, *refs, g: Geometry, f32_stage: bool, fast_exp: bool):
  q_refs, raw_refs, comp_refs, (idx_ref, sink_ref, freq_ref, o_ref) = keyset.split_refs(g, refs, 4)
  pid_t, pid_h = pl.program_id(0), pl.program_id(1)
  pr = keyset.make_program(g, off_ref, pid_t, pid_h)
  expf = jnp.exp2 if fast_exp else jnp.exp
  mul = g.scale * LOG2E if fast_exp else g.scale
  split_p = g.precision == "split"
  q_held = keyset.q_tiles(pr, q_refs) if g.q_resident else None
  sink = keyset.load_sink(pr, sink_ref) * (LOG2E if fast_exp else 1.0)

  def update(st: keyset.Stage, refs, carry):
    m, l, acc = carry
    k_tiles = keyset.row_tiles(g, refs, st.rows, st.valid)
    s = keyset.scores(g, pr, q_refs, q_held, k_tiles, st.index) * mul
    s = jnp.where(st.mask, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    alpha = expf(m - m_new)
    p = expf(s - m_new[:, None])
    l = l * alpha + jnp.sum(p, axis=1)
    if not f32_stage:  # unstaged: the value pass loads the rows again
      k_tiles = keyset.row_tiles(g, refs, st.rows, st.valid, transposed=False)
    p_parts = keyset.parts(p, split_p)
    acc = tuple(keyset.add_values(a * alpha[:, None], p_parts, kt, f32_stage) for a, kt in zip(acc, k_tiles))
    return m_new, l, acc

  acc0 = tuple(jnp.zeros((g.M, g.dk), F32) for _ in range(g.n_chunks))
  carry = (sink, jnp.zeros((g.M,), F32), acc0)
  carry = jax.lax.fori_loop(0, g.n_window, lambda s, c: update(keyset.window_stage(pr, s), raw_refs, c), carry)
  if g.kind != "window":
    carry = jax.lax.fori_loop(0, keyset.comp_stage_count(pr),
                              lambda s, c: update(keyset.comp_stage(pr, s, idx_ref), comp_refs, c), carry)
  m, l, acc = carry
  keyset.finish(pr, o_ref, freq_ref, acc, l + expf(sink - m), pid_t, pid_h)


def mla_stream(offsets, q_parts, raw_parts, comp_parts, indices, sink, freq_cols, *, g: Geometry, config: Config,
               f32_stage: bool = True, fast_exp: bool = False, interpret: bool = False, out_dtype=F32) -> jax.Array:
  """[T, H, D] in out_dtype. offsets = int32 [2] (q_start, raw_start); q_parts / raw_parts / comp_parts: the bf16
  operand arrays of q (flattened to [T·H, D]), raw_kv and comp_kv (api.operand_parts; comp_parts / indices are
  placeholders for kinds that do not read them); freq_cols [D] (keyset.freq_columns). Inputs are checked in
  api.sparse_mla."""
  name = kernel_name(f32_stage, fast_exp)
  shape, unflatten = keyset.out_layout(g)
  kernel = functools.partial(_kernel, g=g, f32_stage=f32_stage, fast_exp=fast_exp)
  out = pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct(shape, out_dtype), grid=g.grid, interpret=interpret, name=name,
      compiler_params=plt.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
  )(offsets, *q_parts, *raw_parts, *comp_parts, indices, sink, freq_cols)
  return unflatten(out)
