"""Grouped down projection and the combine (docs/model.md §7), Pallas-Triton.

`down`: out[r] = h[r] · W2_e^T for sorted row r of expert e (h [S·K, I] → out [S·K, D] f32). Same work list,
grid and masking as gate_up.py; the activation tile is a contiguous slice of h (rows are already in expert order).

`combine` (fused): y[t] = shared[t] + Σ_k w[t,k] · out[row_of_route[t,k]], one kernel over (token tile, D tile).
Each program reads the ≤ K routed rows of each of its tokens through the inverse permutation and adds them in slot
order k = 0..K−1, so the result is deterministic (bitwise reproducible run to run) and no [S, K, D] per-slot
temporary exists. The alternative — the down kernel's epilogue atomically adding w·row into y — saves the
[S·K, D] write + read but makes the f32 summation order depend on scheduling (non-deterministic results), needs
y zero-initialised, and masked atomics do not run in interpret mode; so it is not used.

`combine_xla` is the unfused path (gather [S, K, D], weight, sum in XLA) behind `Config.fused_combine=False`.
Masked routes (row −1) contribute exactly nothing: a token whose routes are all masked comes out +0.0 (or equal to
its shared-expert row).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kernels_pallas.moe import _schedule
from kernels_pallas.moe.config import Config
from kernels_pallas.moe.gate_up import dot_nt, work_items
from kernels_pallas.moe.routing import Routing
from kernels_pallas.moe.weights import ExpertWeights, as_expert_weights

F32 = jnp.float32
I32 = jnp.int32


def _down_kernel(item_expert_ref, item_start_ref, item_end_ref, num_items_ref, h_ref, *refs, load_w2,
                 block_m: int, block_n: int, block_k: int, i_dim: int, n_tiles: int, persistent: bool,
                 num_programs: int, tile_order: str, cdt):
  w2_refs, (out_ref,) = refs[:-1], refs[-1:]

  def unit(i, j):
    start, end = item_start_ref[i], item_end_ref[i]

    @pl.when(start < end)
    def _():
      e = item_expert_ref[i]
      n0 = pl.multiple_of(j * block_n, block_n)
      rmask = (start + jnp.arange(block_m, dtype=I32)) < end

      def step(kk, acc):
        k0 = pl.multiple_of(kk * block_k, block_k)
        ht = plt.load(h_ref.at[pl.ds(start, block_m), pl.ds(k0, block_k)], mask=rmask[:, None], other=0)
        wt = load_w2(w2_refs, e, n0, k0, block_n=block_n, block_k=block_k, dtype=cdt)
        return acc + dot_nt(ht.astype(cdt), wt, cdt)

      acc = jax.lax.fori_loop(0, i_dim // block_k, step, jnp.zeros((block_m, block_n), F32))
      plt.store(out_ref.at[pl.ds(start, block_m), pl.ds(n0, block_n)], acc.astype(out_ref.dtype),
                mask=rmask[:, None])

  _schedule.run(unit, persistent=persistent, num_items_ref=num_items_ref, n_tiles=n_tiles,
                num_programs=num_programs, tile_order=tile_order)


def check_shapes(h, w2: ExpertWeights, r: Routing, block_n: int, block_k: int) -> None:
  if h.ndim != 2 or h.shape[0] != r.num_routes:
    raise ValueError(f"h must be [S·K, I] = [{r.num_routes}, I], got shape {tuple(h.shape)}")
  E, D, I = w2.shape
  if I != h.shape[1] or E != r.num_experts:
    raise ValueError(f"w2 shape {tuple(w2.shape)} must be [E, D, I] with E = {r.num_experts}, I = {h.shape[1]} "
                     f"(h shape {tuple(h.shape)})")
  if D % block_n:
    raise ValueError(f"hidden size D={D} (w2 shape {tuple(w2.shape)}) is not a multiple of down block_n={block_n}")
  if I % block_k:
    raise ValueError(f"intermediate size I={I} (w2 shape {tuple(w2.shape)}) is not a multiple of down "
                     f"block_k={block_k}")
  if block_k % w2.k_multiple:
    raise ValueError(f"w2: down block_k={block_k} must be a multiple of the format's {w2.k_multiple}-value block")
  if hasattr(w2, "check_blocks"):  # format-specific tiling rules (quantized_weights.py)
    w2.check_blocks(block_n, block_k, "down w2")


def down(h: jax.Array, w2, r: Routing, *, config: Config, compute_dtype=None, interpret: bool = False,
         name: str = "moe_down") -> jax.Array:
  """out [S·K, D] f32 in sorted-row order (rows >= num_rows are unspecified)."""
  w2 = as_expert_weights(w2, "w2")
  bn, bk, bm = config.down_bn, config.down_bk, r.block_m
  check_shapes(h, w2, r, bn, bk)
  E, D, I = w2.shape
  cdt = jnp.dtype(compute_dtype or config.compute_dtype or jnp.promote_types(h.dtype, w2.compute_dtype))
  items = work_items(r, config.compact_queue)
  n_tiles = D // bn
  P = config.programs()
  grid = _schedule.grid(persistent=config.persistent, max_items=items[0].shape[0], n_tiles=n_tiles,
                        num_programs=P, tile_order=config.tile_order)
  kernel = functools.partial(_down_kernel, load_w2=w2.loader(), block_m=bm, block_n=bn, block_k=bk, i_dim=I,
                             n_tiles=n_tiles, persistent=config.persistent, num_programs=P,
                             tile_order=config.tile_order, cdt=cdt)
  return pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((r.num_routes, D), F32), grid=grid, interpret=interpret,
      name=name + ("_persistent" if config.persistent else ""),
      compiler_params=plt.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
  )(*items, h, *w2.operands)


def down_reference(h, w2, r: Routing) -> jax.Array:
  """f32 out [S·K, D] in sorted-row order (rows >= num_rows are zero)."""
  w2 = as_expert_weights(w2, "w2").dequantize()
  rows = jnp.arange(r.num_routes)
  valid = rows < r.num_rows[0]
  e = jnp.searchsorted(r.group_offsets[1:], rows, side="right").clip(0, r.num_experts - 1)
  out = jnp.einsum("ri,rdi->rd", h.astype(F32), w2[e], precision=jax.lax.Precision.HIGHEST)
  return jnp.where(valid[:, None], out, 0.0)


# ---- combine ----------------------------------------------------------------------------------------------------

def _combine_kernel(rows_ref, w_ref, out_ref, *refs, has_shared: bool, num_tokens: int, top_k: int,
                    block_t: int, block_d: int):
  shared_ref, y_ref = (refs[0], refs[1]) if has_shared else (None, refs[0])
  t0 = pl.program_id(0) * block_t
  d0 = pl.multiple_of(pl.program_id(1) * block_d, block_d)
  tok = t0 + jnp.arange(block_t, dtype=I32)
  tmask = tok < num_tokens
  cols = d0 + jnp.arange(block_d, dtype=I32)
  if has_shared:
    acc = plt.load(shared_ref.at[pl.ds(t0, block_t), pl.ds(d0, block_d)], mask=tmask[:, None], other=0)
    acc = acc.astype(F32)
  else:
    acc = jnp.zeros((block_t, block_d), F32)
  for k in range(top_k):  # fixed order: deterministic
    route = jnp.where(tmask, tok * top_k + k, 0)
    row = plt.load(rows_ref.at[route])
    wk = plt.load(w_ref.at[route]).astype(F32)
    ok = tmask & (row >= 0)
    vals = plt.load(out_ref.at[jnp.where(ok, row, 0)[:, None], cols[None, :]], mask=ok[:, None], other=0)
    acc = acc + jnp.where(ok[:, None], wk[:, None] * vals.astype(F32), 0.0)
  plt.store(y_ref.at[pl.ds(t0, block_t), pl.ds(d0, block_d)], acc, mask=tmask[:, None])


def combine(out: jax.Array, route_weights: jax.Array, r: Routing, shared: jax.Array | None = None, *,
            config: Config, interpret: bool = False, name: str = "moe_combine") -> jax.Array:
  """Fused, deterministic combine: y [S, D] f32 = shared + Σ_k w[t,k] · out[row_of_route[t,k]]."""
  S, K = r.row_of_route.shape
  D = out.shape[1]
  bt, bd = config.combine_block_t, config.combine_block_d
  if route_weights.shape != (S, K):
    raise ValueError(f"route_weights shape {tuple(route_weights.shape)} must be [S, K] = {(S, K)}")
  if D % bd:
    raise ValueError(f"hidden size D={D} is not a multiple of combine_block_d={bd}")
  if shared is not None and shared.shape != (S, D):
    raise ValueError(f"shared output shape {tuple(shared.shape)} must be [S, D] = {(S, D)}")
  kernel = functools.partial(_combine_kernel, has_shared=shared is not None, num_tokens=S, top_k=K,
                             block_t=bt, block_d=bd)
  args = (r.row_of_route.reshape(S * K), route_weights.astype(F32).reshape(S * K), out)
  args += (shared,) if shared is not None else ()
  return pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((S, D), F32), grid=(pl.cdiv(S, bt), D // bd),
      interpret=interpret, name=name,
      compiler_params=plt.CompilerParams(num_warps=config.num_warps, num_stages=1),
  )(*args)


def combine_xla(out: jax.Array, route_weights: jax.Array, r: Routing, shared: jax.Array | None = None) -> jax.Array:
  """Unfused combine in XLA: gathers [S, K, D], weights and sums it (the per-slot temporary the kernel avoids)."""
  rows = r.row_of_route
  ok = rows >= 0
  g = out[jnp.where(ok, rows, 0)].astype(F32)
  y = jnp.sum(jnp.where(ok[..., None], route_weights.astype(F32)[..., None] * g, 0.0), axis=1)
  return y if shared is None else y + shared.astype(F32)
