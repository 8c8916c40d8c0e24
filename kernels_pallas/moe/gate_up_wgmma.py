"""Grouped gate/up for Hopper (sm_90) as a Pallas Mosaic GPU kernel: async wgmma fed by a TMA warpgroup.

    h[r] = silu(min(x_sorted[r] · W1_e^T, L)) * clip(x_sorted[r] · W3_e^T, −L, L)      e = expert of sorted row r

Why a second gate/up next to the Triton one (gate_up.py): Triton waits on every wgmma of a K step before it issues
the next loads' consumers, and its grouped kernel reaches ~53% of the dense bf16 GEMM at 8192 tokens
(docs/kernels.md, "Where the MMAs wait"). Here one warpgroup only issues TMA copies of the x, W1 and W3 tiles into a
ring of `stages` shared-memory slots, and two compute warpgroups issue wgmmas on them, each on its own half of the
row tile, so the tensor cores never wait for a load or for the other half's epilogue.

The work list is the compact queue of routing.py (item = expert, rows [start, start + block_m) clipped to the
expert's end). Each SM loops over (item, N tile) units, items fastest, so the SMs running together read the same
weight tiles (L2 hits). TMA cannot gather rows, so the rows come pre-gathered (`x_sorted`, padded by one row tile):
an XLA gather of S·K rows before the kernel. Rows past the expert's end are computed and not stored; the store of
a variable number of rows is a few power-of-two TMA copies.

sm_90 only (Mosaic GPU has no ROCm backend): gfx1151 keeps gate_up.py. bf16 (or f16) operands, f32 accumulation.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas.moe.gate_up import clamped_swiglu
from kernels_pallas.moe.routing import Routing

F32 = jnp.float32
ROW_ALIGN = 8  # the shared-memory tiling's row tile


@dataclasses.dataclass(frozen=True)
class Tiling:
  """wg_rows: rows per compute warpgroup (the CTA's row tile is twice that; it must equal the routing's block_m);
  block_n: output columns of W1 and of W3 per unit; block_k: the reduction step; stages: shared-memory slots;
  mma_in_flight 1 frees a slot one step late, so a step's wgmmas run while the next step's are issued."""
  wg_rows: int = 64
  block_n: int = 128
  block_k: int = 64
  stages: int = 4
  mma_in_flight: int = 0  # K steps whose wgmmas may still run when the next step's are issued (0 or 1)
  producer_registers: int = 40

  @property
  def block_m(self) -> int:
    return 2 * self.wg_rows


def _store_rows(out_smem, slot, h_g, first_row, count, cols, max_rows: int):
  """Copies rows [0, count) of out_smem[slot] to h rows [first_row, first_row + count), columns `cols`: TMA copies
  need static shapes, so `count` is written as a sum of powers of two, largest first."""
  done = 0  # a Python int while static: a constant array here breaks the slice lowering
  size = 1 << (max_rows.bit_length() - 1)
  while size >= 1:
    @pl.when((count & size) != 0)
    def _(size=size, done=done):
      plgpu.copy_smem_to_gmem(out_smem.at[slot, pl.ds(done, size)], h_g.at[pl.ds(first_row + done, size), cols])
    done = done + (count & size)
    size //= 2


def _kernel(item_expert, item_start, item_end, item_x_start, num_items, x_g, w1_g, w3_g, h_g, *, t: Tiling, limit: float,
            max_items: int, n_tiles: int, d: int):
  dt = x_g.dtype
  swizzle = plgpu.find_swizzle(t.block_k * jnp.dtype(dt).itemsize * 8)
  swizzle_elems = swizzle // jnp.dtype(dt).itemsize
  tiles = (plgpu.TilingTransform((8, swizzle_elems)), plgpu.SwizzleTransform(swizzle))

  def pipeline(body, compute_context):
    spec = lambda rows: plgpu.BlockSpec((rows, t.block_k), lambda k: (0, k), transforms=tiles,
                                        memory_space=plgpu.SMEM, delay_release=t.mma_in_flight)
    return plgpu.emit_pipeline_warp_specialized(
        body, grid=(d // t.block_k,), memory_registers=t.producer_registers,
        in_specs=[spec(t.block_m), spec(t.block_n), spec(t.block_n)], wg_axis="wg", num_compute_wgs=2,
        max_concurrent_steps=t.stages, compute_context=compute_context)

  noop = lambda *_, **__: None

  @functools.partial(
      pl.run_scoped,
      allocs=pipeline(noop, noop).get_allocations(x_g.at[pl.ds(0, t.block_m)], w1_g.at[0, pl.ds(0, t.block_n)],
                                                  w3_g.at[0, pl.ds(0, t.block_n)]),
      out_smem=plgpu.SMEM((2, t.wg_rows, t.block_n), h_g.dtype),  # untiled: row slices of any size
      collective_axes="wg")
  def _scope(allocs, out_smem):
    wg = lax.axis_index("wg")
    count = num_items[0]

    @plgpu.nd_loop((max_items * n_tiles,), collective_axes="sm")
    def _unit(info):
      (w,) = info.index
      safe = jnp.maximum(count, 1)
      i, j = w % safe, w // safe

      @pl.when(w < count * n_tiles)
      def _():
        e, start, end = item_expert[i], item_start[i], item_end[i]
        cols = pl.ds(j * t.block_n, t.block_n)
        mine = pl.ds(pl.multiple_of(wg * t.wg_rows, t.wg_rows), t.wg_rows)

        def compute_context(run):
          @functools.partial(pl.run_scoped, acc1=plgpu.ACC((t.wg_rows, t.block_n), F32),
                             acc3=plgpu.ACC((t.wg_rows, t.block_n), F32))
          def _acc(acc1, acc3):
            run((acc1, acc3))
            h = clamped_swiglu(acc1[...], acc3[...], limit).astype(h_g.dtype)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous unit's store has left out_smem
            out_smem[wg] = h
            plgpu.commit_smem()
            first = start + wg * t.wg_rows
            rows = jnp.clip(end - first, 0, t.wg_rows)
            _store_rows(out_smem, wg, h_g, first, rows, cols, t.wg_rows)

        def mma(_, x_s, w1_s, w3_s, accs):
          acc1, acc3 = accs
          xs = x_s.at[mine]
          plgpu.wgmma(acc1, xs, w1_s.T)
          plgpu.wgmma(acc3, xs, w3_s.T)
          plgpu.wgmma_wait(2 * t.mma_in_flight)  # two wgmmas (W1, W3) per step
          return accs

        x_rows = pl.ds(pl.multiple_of(item_x_start[i], ROW_ALIGN), t.block_m)
        pipeline(mma, compute_context)(x_g.at[x_rows], w1_g.at[e, cols], w3_g.at[e, cols],
                                       allocations=allocs)

  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def gather_rows(x, r: Routing) -> tuple[jax.Array, jax.Array]:
  """(x_aligned, item_x_start): the routed rows of x grouped by expert as in sorted-row order, but with each
  expert's first row at a multiple of ROW_ALIGN (a TMA copy into a tiled shared-memory layout needs aligned rows),
  zeros between groups and one row tile of zeros at the end; and each work item's first row in it."""
  E = r.num_experts
  sizes, offsets = r.group_sizes, r.group_offsets[:-1]
  aligned = jnp.cumsum(-(-sizes // ROW_ALIGN) * ROW_ALIGN) - -(-sizes // ROW_ALIGN) * ROW_ALIGN  # exclusive
  n = -(-(r.num_routes + E * (ROW_ALIGN - 1)) // ROW_ALIGN) * ROW_ALIGN + r.block_m  # whole tiles of rows
  p = jnp.arange(n, dtype=jnp.int32)
  e = jnp.clip(jnp.searchsorted(aligned, p, side="right") - 1, 0, E - 1)
  within = p - aligned[e]
  row = jnp.clip(offsets[e] + within, 0, r.num_routes - 1)
  x_aligned = jnp.where((within < sizes[e])[:, None], x[r.token_of_row[row]], jnp.zeros((), x.dtype))
  ie = jnp.clip(r.item_expert, 0, E - 1)
  return x_aligned, (aligned[ie] + r.item_start - offsets[ie]).astype(jnp.int32)


def gate_up_wgmma(x, w1, w3, r: Routing, *, swiglu_limit: float, tiling: Tiling = Tiling(), num_sms: int = 132,
                  interpret=None) -> jax.Array:
  """h [S·K, I] in sorted-row order (rows >= num_rows unspecified), as gate_up.gate_up; w1/w3 dense [E, I, D]."""
  t = tiling
  if r.block_m != t.block_m:
    raise ValueError(f"routing row tile {r.block_m} != the wgmma tiling's 2 × wg_rows = {t.block_m}")
  if jnp.dtype(x.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    raise ValueError(f"the wgmma gate/up takes bf16/f16 activations, got {x.dtype}")
  if w1.dtype != x.dtype or w3.dtype != x.dtype:
    raise ValueError(f"w1/w3 dtypes {w1.dtype}/{w3.dtype} must equal x's {x.dtype} (decode MIX experts first)")
  S, D = x.shape
  E, I, Dw = w1.shape
  if Dw != D or tuple(w3.shape) != tuple(w1.shape):
    raise ValueError(f"w1 {tuple(w1.shape)} / w3 {tuple(w3.shape)} must be [E, I, D] with D = {D}")
  if D % t.block_k or I % t.block_n:
    raise ValueError(f"D={D} / I={I} must be multiples of block_k={t.block_k} / block_n={t.block_n}")
  xs, item_x_start = gather_rows(x, r)
  max_items = r.item_expert.shape[0]
  kernel = plgpu.kernel(
      functools.partial(_kernel, t=t, limit=float(swiglu_limit), max_items=max_items, n_tiles=I // t.block_n, d=D),
      out_type=jax.ShapeDtypeStruct((r.num_routes, I), x.dtype), grid=(num_sms,), grid_names=("sm",),
      num_threads=3, thread_name="wg", interpret=interpret,
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
  return kernel(r.item_expert, r.item_start, r.item_end, item_x_start, r.num_items, xs, w1, w3)
