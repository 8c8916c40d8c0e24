"""Grouped sparse MLA attention: the baseline upstream measured streaming against (docs/upstream.md §4,
`ds4_flash_attn_d512_shared_kv_grouped_compact_kernel`), Pallas-Triton.

Same programs and key stages as stream.py, but in two passes over the key set:
  1. every score of the program's key set is computed and stored (masked −inf) while the row max is tracked;
  2. after a barrier the scores are read back, p = e^(s − m) summed into l, and the K = V rows are loaded AGAIN
     to accumulate p·V; then the sink, 1/l and the inverse RoPE as in the streaming kernel.
Pallas-Triton has no scratch memory, so the scores go to an HBM scratch output [programs · M, stages · kb] f32
(each program writes and re-reads only its own rows: they mostly stay in L2). Upstream keeps them in LDS; the
extra traffic is part of what the streaming kernel removes. Its size is T·H·(window + k)·4 bytes for CSA
(T·H·(window + R)·4 for HCA), checked against Config.grouped_scratch_bytes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kernels_pallas.mla import keyset
from kernels_pallas.mla.config import Config
from kernels_pallas.mla.keyset import F32, Geometry

NAME = "mla_grouped"


def scratch_shape(g: Geometry) -> tuple[int, int]:
  nt, G = g.grid
  return nt * G * g.M, (g.n_window + g.max_comp_stages) * g.kb


def _kernel(off_ref, *refs, g: Geometry, barrier: bool):
  q_refs, raw_refs, comp_refs, (idx_ref, sink_ref, freq_ref, o_ref, sc_ref) = keyset.split_refs(g, refs, 5)
  pid_t, pid_h = pl.program_id(0), pl.program_id(1)
  pr = keyset.make_program(g, off_ref, pid_t, pid_h)
  split_p = g.precision == "split"
  q_held = keyset.q_tiles(pr, q_refs) if g.q_resident else None
  sink = keyset.load_sink(pr, sink_ref)
  base = (pid_t * g.grid[1] + pid_h) * g.M
  n_comp = keyset.comp_stage_count(pr) if g.kind != "window" else 0

  def score_pass(slot, st: keyset.Stage, refs, m):
    k_tiles = keyset.row_tiles(g, refs, st.rows, st.valid)
    s = keyset.scores(g, pr, q_refs, q_held, k_tiles, st.index) * g.scale
    s = jnp.where(st.mask, s, -jnp.inf)
    plt.store(sc_ref.at[pl.ds(base, g.M), pl.ds(slot * g.kb, g.kb)], s)
    return jnp.maximum(m, jnp.max(s, axis=1))

  def value_pass(slot, st: keyset.Stage, refs, m, carry):
    l, acc = carry
    s = plt.load(sc_ref.at[pl.ds(base, g.M), pl.ds(slot * g.kb, g.kb)])
    p = jnp.exp(s - m[:, None])
    v_tiles = keyset.row_tiles(g, refs, st.rows, st.valid, transposed=False)   # the rows again
    p_parts = keyset.parts(p, split_p)
    return l + jnp.sum(p, axis=1), tuple(keyset.add_values(a, p_parts, v, False) for a, v in zip(acc, v_tiles))

  window = lambda s: keyset.window_stage(pr, s)
  comp = lambda s: keyset.comp_stage(pr, s, idx_ref)
  m = jax.lax.fori_loop(0, g.n_window, lambda s, m: score_pass(s, window(s), raw_refs, m), sink)
  if g.kind != "window":
    m = jax.lax.fori_loop(0, n_comp, lambda s, m: score_pass(g.n_window + s, comp(s), comp_refs, m), m)
  if barrier:  # the scores were stored by other threads of this program (no such primitive when interpreted)
    plt.debug_barrier()
  carry = (jnp.zeros((g.M,), F32), tuple(jnp.zeros((g.M, g.dk), F32) for _ in range(g.n_chunks)))
  carry = jax.lax.fori_loop(0, g.n_window, lambda s, c: value_pass(s, window(s), raw_refs, m, c), carry)
  if g.kind != "window":
    carry = jax.lax.fori_loop(0, n_comp, lambda s, c: value_pass(g.n_window + s, comp(s), comp_refs, m, c), carry)
  l, acc = carry
  keyset.finish(pr, o_ref, freq_ref, acc, l + jnp.exp(sink - m), pid_t, pid_h)


def mla_grouped(offsets, q_parts, raw_parts, comp_parts, indices, sink, freq_cols, *, g: Geometry,
                config: Config, interpret: bool = False, out_dtype=F32) -> jax.Array:
  """[T, H, D] in out_dtype; arguments as stream.mla_stream."""
  rows, cols = scratch_shape(g)
  if rows * cols * 4 > config.grouped_scratch_bytes:
    raise ValueError(f"grouped kernel: score scratch [{rows}, {cols}] f32 ({rows * cols * 4 / 2**30:.1f} GiB) "
                     f"exceeds Config.grouped_scratch_bytes={config.grouped_scratch_bytes} (q shape "
                     f"[{g.T}, {g.H}, {g.D}], kind {g.kind!r}, R {g.R})")
  shape, unflatten = keyset.out_layout(g)
  out, _ = pl.pallas_call(
      functools.partial(_kernel, g=g, barrier=not interpret),
      out_shape=(jax.ShapeDtypeStruct(shape, out_dtype), jax.ShapeDtypeStruct((rows, cols), F32)),
      grid=g.grid, interpret=interpret, name=NAME,
      compiler_params=plt.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
  )(offsets, *q_parts, *raw_parts, *comp_parts, indices, sink, freq_cols)
  return unflatten(out)
