"""Grouped gate/up projection with the clamped-SwiGLU epilogue (docs/model.md §7), Pallas-Triton.

    h[r] = silu(min(x[tok(r)] · W1_e^T, L)) * clip(x[tok(r)] · W3_e^T, −L, L)      e = expert of sorted row r

One program computes an [block_m, block_n] tile of h for one work item (expert e, rows [start, start+block_m)
clipped to the expert's end) and one N tile: it loops over D in block_k steps, and each step reads the activation
tile ONCE and both the W1 and W3 tiles of expert e (two f32 accumulators), then applies the epilogue and stores h.

Activations are gathered in-kernel: row r's token comes from `token_of_row` and the [block_m, block_k] tile is a
gather load `x.at[tok[:, None], cols[None, :]]`. This avoids materialising x_sorted [S·K, D] in HBM (an extra
write + read of S·K·D elements, 6× the size of x at top-6); each row's block_k columns stay contiguous, so the
gather costs the same coalesced transactions as a dense tile.

Weights come through a pluggable tile loader (weights.py), so quantized formats dequantize in the same place.
Masking: rows >= the expert's end load 0 (`other=0`) and are not stored; padding items (start >= end) exit at once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kernels_pallas.moe import _schedule
from kernels_pallas.moe.config import Config
from kernels_pallas.moe.routing import Routing, dense_work_items
from kernels_pallas.moe.weights import ExpertWeights, as_expert_weights

F32 = jnp.float32
I32 = jnp.int32


def clamped_swiglu(gate, up, limit: float):
  """silu(min(gate, L)) * clip(up, −L, L) in f32; silu written as g / (1 + exp(−g)) (what Triton lowers).

  The clamps are selects, not min/max: compiled, Triton's minimum returns L for a NaN gate, which hid a NaN weight's
  token (the reference's XLA minimum keeps the NaN). A NaN fails both comparisons and passes through."""
  g = jnp.where(gate > limit, limit, gate)
  u = jnp.where(up > limit, limit, jnp.where(up < -limit, -limit, up))
  return (g / (1.0 + jnp.exp(-g))) * u


def dot_precision(dtype):
  """f32 operands need HIGHEST: the Triton lowering maps DEFAULT to TF32."""
  return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.dtype(F32) else None


def dot_nt(a, b, dtype):
  """a [m, k] · b[n, k]^T → [m, n] f32 (a 2-D dot; the lowering transposes b)."""
  return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=dot_precision(dtype),
                             preferred_element_type=F32)


def work_items(r: Routing, compact: bool):
  """(expert, start, end, count[1]) of the compact or the dense work list."""
  if compact:
    return r.item_expert, r.item_start, r.item_end, r.num_items
  return dense_work_items(r)


def resolve_dtypes(x_dtype, weights: ExpertWeights, config: Config):
  cdt = jnp.dtype(config.compute_dtype) if config.compute_dtype else jnp.promote_types(
      x_dtype, weights.compute_dtype)
  hdt = jnp.dtype(config.h_dtype) if config.h_dtype else cdt
  return cdt, hdt


def _kernel(item_expert_ref, item_start_ref, item_end_ref, num_items_ref, token_ref, x_ref, *refs,
            n_w1: int, load_w1, load_w3, limit: float, block_m: int, block_n: int, block_k: int, d: int,
            n_tiles: int, persistent: bool, num_programs: int, tile_order: str, cdt):
  w1_refs, w3_refs, (h_ref,) = refs[:n_w1], refs[n_w1:-1], refs[-1:]

  def unit(i, j):
    start, end = item_start_ref[i], item_end_ref[i]

    @pl.when(start < end)
    def _():
      e = item_expert_ref[i]
      n0 = pl.multiple_of(j * block_n, block_n)
      rows = start + jnp.arange(block_m, dtype=I32)
      rmask = rows < end
      tok = plt.load(token_ref.at[pl.ds(start, block_m)], mask=rmask, other=0)
      tok = jnp.where(rmask, tok, 0)  # masked rows gather row 0: always in bounds

      def step(kk, acc):
        a1, a3 = acc
        k0 = pl.multiple_of(kk * block_k, block_k)
        cols = k0 + jnp.arange(block_k, dtype=I32)
        xt = plt.load(x_ref.at[tok[:, None], cols[None, :]], mask=rmask[:, None], other=0).astype(cdt)
        w1t = load_w1(w1_refs, e, n0, k0, block_n=block_n, block_k=block_k, dtype=cdt)
        w3t = load_w3(w3_refs, e, n0, k0, block_n=block_n, block_k=block_k, dtype=cdt)
        return a1 + dot_nt(xt, w1t, cdt), a3 + dot_nt(xt, w3t, cdt)

      zeros = jnp.zeros((block_m, block_n), F32)
      a1, a3 = jax.lax.fori_loop(0, d // block_k, step, (zeros, zeros))
      h = clamped_swiglu(a1, a3, limit)
      plt.store(h_ref.at[pl.ds(start, block_m), pl.ds(n0, block_n)], h.astype(h_ref.dtype), mask=rmask[:, None])

  _schedule.run(unit, persistent=persistent, num_items_ref=num_items_ref, n_tiles=n_tiles,
                num_programs=num_programs, tile_order=tile_order)


def check_shapes(x, w1: ExpertWeights, w3: ExpertWeights, r: Routing, block_n: int, block_k: int) -> None:
  if x.ndim != 2:
    raise ValueError(f"x must be [S, D], got shape {tuple(x.shape)}")
  S, D = x.shape
  if tuple(w1.shape) != tuple(w3.shape):
    raise ValueError(f"w1 {tuple(w1.shape)} and w3 {tuple(w3.shape)} must have the same shape [E, I, D]")
  E, I, Dw = w1.shape
  if Dw != D:
    raise ValueError(f"w1/w3 shape {tuple(w1.shape)} must be [E, I, D] with D = {D} (x shape {tuple(x.shape)})")
  if E != r.num_experts or r.num_routes != S * r.top_k:
    raise ValueError(f"routing built for E={r.num_experts}, {r.num_routes} routes; w1 shape {tuple(w1.shape)}, "
                     f"x shape {tuple(x.shape)} with top_k={r.top_k}")
  if D % block_k:
    raise ValueError(f"hidden size D={D} (x shape {tuple(x.shape)}) is not a multiple of gate/up block_k={block_k}")
  if I % block_n:
    raise ValueError(f"intermediate size I={I} (w1 shape {tuple(w1.shape)}) is not a multiple of gate/up "
                     f"block_n={block_n}")
  for name, w in (("w1", w1), ("w3", w3)):
    if block_k % w.k_multiple:
      raise ValueError(f"{name}: block_k={block_k} must be a multiple of the format's {w.k_multiple}-value block")
    if hasattr(w, "check_blocks"):  # format-specific tiling rules (quantized_weights.py)
      w.check_blocks(block_n, block_k, f"gate/up {name}")


def gate_up(x: jax.Array, w1, w3, r: Routing, *, swiglu_limit: float, config: Config,
            interpret: bool = False, name: str = "moe_gate_up") -> jax.Array:
  """h [S·K, I] in sorted-row order (rows >= num_rows are unspecified). `r.block_m` is the row tile."""
  w1, w3 = as_expert_weights(w1, "w1"), as_expert_weights(w3, "w3")
  bn, bk, bm = config.block_n, config.block_k, r.block_m
  check_shapes(x, w1, w3, r, bn, bk)
  S, D = x.shape
  E, I, _ = w1.shape
  cdt, hdt = resolve_dtypes(x.dtype, w1, config)
  items = work_items(r, config.compact_queue)
  n_tiles = I // bn
  P = config.programs()
  grid = _schedule.grid(persistent=config.persistent, max_items=items[0].shape[0], n_tiles=n_tiles,
                        num_programs=P, tile_order=config.tile_order)
  kernel = functools.partial(
      _kernel, n_w1=len(w1.operands), load_w1=w1.loader(), load_w3=w3.loader(), limit=float(swiglu_limit),
      block_m=bm, block_n=bn, block_k=bk, d=D, n_tiles=n_tiles, persistent=config.persistent, num_programs=P,
      tile_order=config.tile_order, cdt=cdt)
  return pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((r.num_routes, I), hdt), grid=grid, interpret=interpret,
      name=name + ("_persistent" if config.persistent else ""),
      compiler_params=plt.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
  )(*items, r.token_of_row, x, *w1.operands, *w3.operands)


def gate_up_reference(x, w1, w3, r: Routing, *, swiglu_limit: float) -> jax.Array:
  """f32 h [S·K, I] in sorted-row order (rows >= num_rows are zero), by gathering each row's expert matrices."""
  w1, w3 = as_expert_weights(w1, "w1").dequantize(), as_expert_weights(w3, "w3").dequantize()
  rows = jnp.arange(r.num_routes)
  valid = rows < r.num_rows[0]
  e = jnp.searchsorted(r.group_offsets[1:], rows, side="right").clip(0, r.num_experts - 1)
  xs = x.astype(F32)[r.token_of_row]
  hp = jax.lax.Precision.HIGHEST
  g = jnp.einsum("rd,rid->ri", xs, w1[e], precision=hp)
  u = jnp.einsum("rd,rid->ri", xs, w3[e], precision=hp)
  return jnp.where(valid[:, None], clamped_swiglu(g, u, swiglu_limit), 0.0)
