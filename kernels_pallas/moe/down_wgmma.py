"""Grouped down projection for Hopper (sm_90) on FP3-MIX W2, as a Pallas Mosaic GPU kernel that decodes in registers.

    out[r] = h[r] · W2_e^T        h [S·K, I] bf16 in sorted-row order → out [S·K, D] f32,  e = expert of row r

Why: without it W2 is decoded to bf16 before the Triton down (down.py), a copy of every expert each prompt (75 ms of
an 8192-token V4-Flash prefill on the H200, BENCHMARKS.md). Measured (bench_moe, H100, session 52, h laid out by
XLA included): 3.29 ms at 8192 tokens against 4.59 for the decode plus the Triton down, 9.08 against 8.87 at 32768,
where each 256-row item decodes its tiles again. Its decode (~9 instructions a weight) is the limit.

This is gate_up_wgmma.py's FP2-MIX kernel with one weight stack: a TMA warpgroup copies each K step's code bytes
and h's tile into a ring of shared-memory slots, and each of the two compute warpgroups decodes its own N tile of
W2 (64 output columns) into 4 bf16 planes held in registers side by side as the wgmmas' A operand (out^T = W2 · h^T
per tile), while the other's wgmmas run. The work list and its row alignment are gate_up_wgmma's (`aligned_items`);
a unit is (item, pair of N tiles).

FP3-MIX (lucebox_mix's down format, `rocmfp3_mix`): a weight's 3-bit level index is 2 low bits (codes_lo, as
FP2-MIX's codes: weight 4i + q at bits 2q of byte i) and a high bit (codes_hi: weight 8c + b at bit b of byte c), so
the code-byte pair (2c, 2c + 1) that a thread holds in wgmma's register layout has its 8 high bits in one byte, c.
The TMA warpgroup copies 16-byte-wide tiles of high-bit bytes (128 weights: 2 K steps) and of meta bytes (256: 4
steps), the minimum TMA row, each copied again for every step it covers. Compiled, a pair's 8 values (its meta
byte's scale times the 8 levels of its book) are packed in 4 registers; plane q's two weights are `prmt`s of the
low and the high 4 values by the low bits (gate_up_wgmma's selectors), then a mask made by a sign-replicating
`prmt` of the high bits picks between them (`high_bit_mask_ir`). The interpreter runs `decode_planes3` (pure jnp)
through shared memory. Both give the canonical decode's bits, summed over K in plane order.

h comes as `plane_rows` (each 64-column block holds its 4 planes side by side: column 4i + q at 16q + i), so a
step's h tile has 128-byte rows and a warpgroup issues one K-64 wgmma a step on its joined planes. The Mosaic
gate/up writes h in that order itself (its `h_plane_rows`); else `plane_rows` lays it out in XLA. (h as 4 planes of
32-byte rows, one K-16 wgmma each, took 18-34% longer: BENCHMARKS.md, session 52.)
Each warpgroup stores its f32 output tile [rows, 64] from registers (`store_transposed_rows`); the interpreter
stages it in shared memory for TMA stores instead. sm_90 only: gfx1151 keeps down.py. `api.moe` runs it for
`Config.down_kernel` "wgmma" (the model's `moe_wgmma_down`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, memref, scf, vector
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu

from ds4jax.quant import rocmfp3, rocmfp3_mix, rocmfp_layout, rocmfp_mix
from kernels_pallas.moe.gate_up_wgmma import (META_BOX, PLANES, ROW_ALIGN, WGMMA_M, Tiling, _store_rows,
                                              aligned_items, as_plane_rows, byte_pairs, expert_levels,
                                              half_block_values, half_block_values_ir, issue_blocks, joined_planes,
                                              joined_planes_type, padded_rows, prmt_selectors_ir, profile_region)
from kernels_pallas.moe.routing import Routing

F32 = jnp.float32
I32 = jnp.int32
BF16 = jnp.bfloat16
HI_BOX = 16  # high-bit bytes per row of one TMA copy (its minimum row): 128 weights
HIGH_SELECTOR = 0x9988  # prmt: bytes 0-1 ← the sign of byte 0, bytes 2-3 ← the sign of byte 1 (high_bit_mask)
KERNEL_NAME = "moe_down_wgmma"

# bench_moe on the H200 (ea4172e, BENCHMARKS.md; h as 4 planes then): a 256-row tile, 2 stages, at 8192 tokens
# 3.45 ms (4 stages 3.56, 5 stages 3.52, 128-row wgmmas 3.50, 64 rows a warpgroup 4.77) and at 32768 10.6 ms (the
# others 11.2-14.7). Below 64 rows per expert a 128-row tile (not measured there).
TILING = Tiling(wg_rows=128, block_n=64, stages=2, mma_rows=256)
TILING_FEW_ROWS = Tiling(wg_rows=64, block_n=64, stages=4, mma_rows=128)


def default_tiling(rows_per_expert: int) -> Tiling:
  return TILING if rows_per_expert > 64 else TILING_FEW_ROWS


class Mix3Stack(NamedTuple):
  """An FP3-MIX expert stack [E, N, K] as this kernel reads it (`mix3_stack`): codes_lo [E, N, K/4], codes_hi
  [E, N, K/8] and meta [E, N, K/16] u8 as stored; levels [E, 2, 8] f32 (`expert_levels`, the fixed levels
  rocmfp3.levels for a mode-0 expert)."""
  codes_lo: jax.Array
  codes_hi: jax.Array
  meta: jax.Array
  levels: jax.Array

  @property
  def shape(self) -> tuple[int, int, int]:
    E, N, K4 = self.codes_lo.shape
    return E, N, K4 * PLANES


def mix3_stack(storage: dict) -> Mix3Stack:
  """From rocmfp3_mix storage arrays (codes_lo, codes_hi, scales, books, mode)."""
  return Mix3Stack(*(jnp.asarray(storage[k]) for k in ("codes_lo", "codes_hi", "scales")),
                   expert_levels(storage, rocmfp3.levels(jnp.arange(rocmfp3_mix.LEVELS))))


def plane_rows(h, block_m: int) -> jax.Array:
  """h [rows, I] (sorted rows) as this kernel reads it, in XLA: [padded_rows, I] (the last item's copy stays in
  bounds) with each 64-column block's planes side by side (as_plane_rows). The Mosaic gate/up writes this order
  itself (gate_up_wgmma's `h_plane_rows`)."""
  return as_plane_rows(jnp.pad(h, ((0, padded_rows(h.shape[0], block_m) - h.shape[0]), (0, 0))))


def decode_planes3(codes_lo, high_nibbles, meta, levels) -> list[jax.Array]:
  """codes_lo, meta (one per code byte) and high_nibbles [n, m] → 4 bf16 planes [n, m], plane q holding weight
  4i + q of byte i. high_nibbles: the high bits of byte i's 4 weights (bit q for weight 4i + q). levels [2][8]
  scalars. The canonical decode's products: the same bits. Pure jnp: runs in the interpreter and in tests."""
  b, hi = codes_lo.astype(I32), high_nibbles.astype(I32)
  values = half_block_values(meta, levels)
  return [rocmfp_mix.pick([(b >> 2 * q) & 1 != 0, (b >> 2 * q) & 2 != 0, (hi >> q) & 1 != 0], values)
          for q in range(PLANES)]


def spread_high_bits(high_byte):
  """A pair's high-bit byte with bits 4–7 (byte 2c + 1's weights) moved to bits 8–11: then plane q's two bits
  shifted left by 7 − q are the signs of bytes 0 and 1. Pure jnp / numpy: tested on CPU."""
  return (high_byte & 0xF) | ((high_byte & 0xF0) << 4)


def high_bit_mask_ir(spread, q: int):
  """0xFFFF in each bf16 half whose weight (plane q) has its high bit set: a sign-replicating prmt."""
  i32 = ir.IntegerType.get_signless(32)
  y = arith.shli(spread, arith.constant(i32, 7 - q))
  return mgpu.utils.prmt(y, y, arith.constant(i32, HIGH_SELECTOR))


def decode_planes3_prmt(lo_ref, hi_ref, hi_first, meta_ref, meta_first, levels) -> jax.Array:
  """decode_planes3 in wgmma's register layout, joined (gate_up_wgmma.joined_planes), compiled (sm_90). Each
  code-byte pair (2c, 2c + 1) of `lo_ref` (the step's low-bit bytes in shared memory) reads its high-bit byte (column
  hi_first + c of `hi_ref`) and its meta byte (column meta_first + c // 2 of `meta_ref`), both shared-memory tiles;
  makes its 8 values once and packs them in 4 registers; each plane's two weights are two prmts (low and high 4
  values) merged by high_bit_mask. Not in interpret mode."""
  wg = plgpu.Layout.WGMMA
  scalars = [hi_first, meta_first] + [levels[s][k] for s in range(2) for k in range(8)]
  shape = tuple(lo_ref.shape)

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),) * 3 + (wg,) * len(scalars), return_type=joined_planes_type(shape))
  def planes(_, lo_smem, hi_smem, meta_smem, *args):
    i32, index = ir.IntegerType.get_signless(32), ir.IndexType.get()
    pair = ir.VectorType.get((2,), ir.BF16Type.get())
    const = lambda v, t=i32: arith.constant(t, v)
    args = [a.registers.item() for a in args]  # scalars come as splat arrays
    hi_col, meta_col = (arith.index_cast(index, a) for a in args[:2])
    levels = [args[2:10], args[10:18]]
    registers_shape = mgpu.WGMMA_LAYOUT.registers_shape(shape)
    out = [np.empty(registers_shape, object) for _ in range(PLANES)]
    for idx, ((row, col), w) in zip(np.ndindex(registers_shape), byte_pairs(lo_smem, shape, False), strict=True):
      hb = arith.extui(i32, memref.load(hi_smem, [row, arith.addi(hi_col, arith.divui(col, const(2, index)))]))
      half_block = arith.addi(meta_col, arith.divui(col, const(rocmfp_layout.HALF // PLANES, index)))
      m = arith.extui(i32, memref.load(meta_smem, [row, half_block]))
      vals = half_block_values_ir(m, levels)
      table = [mgpu.utils.bitcast(vector.from_elements(pair, vals[2 * h:2 * h + 2]), i32) for h in range(4)]
      spread = arith.ori(arith.andi(hb, const(0xF)), arith.shli(arith.andi(hb, const(0xF0)), const(4)))
      for q in range(PLANES):
        sel = prmt_selectors_ir(w, q)
        low, high = mgpu.utils.prmt(table[0], table[1], sel), mgpu.utils.prmt(table[2], table[3], sel)
        mask = high_bit_mask_ir(spread, q)
        picked = arith.ori(arith.andi(low, arith.xori(mask, const(-1))), arith.andi(high, mask))
        out[q][idx] = mgpu.utils.bitcast(picked, pair)
    return joined_planes(out, shape)

  return planes(lo_ref, hi_ref, meta_ref, *scalars)


def store_transposed_rows(acc, out_ref, row0, lo, end, col0) -> None:
  """out[row0 + j, col0 + i] = acc[i, j] where lo <= row0 + j < end, from registers: acc [n, rows] f32 in wgmma's
  layout (out^T), compiled (sm_90). Why not through shared memory: Mosaic GPU stores f32 transposed to shared memory
  in no layout it can then copy out with TMA. A warp's stores still fill whole 32-byte sectors (8 consecutive
  columns of 4 rows each)."""
  wg = plgpu.Layout.WGMMA

  @plgpu.inline_mgpu(arg_types=(wg, plgpu.RefType(), wg, wg, wg, wg))
  def _(_, acc, out, *scalars):
    i32, index = ir.IntegerType.get_signless(32), ir.IndexType.get()
    row0, lo, end, col0 = (a.registers.item() for a in scalars)
    col0 = arith.index_cast(index, col0)
    where = acc.layout.thread_idxs(acc.shape)  # (n, row) of each register's first element
    for (_, reg), (n, j) in zip(np.ndenumerate(acc.registers), where, strict=True):
      for h in range(ir.VectorType(reg.type).shape[0]):
        row = arith.addi(row0, arith.index_cast(i32, arith.addi(j, arith.constant(index, h))))
        ok = arith.andi(arith.cmpi(arith.CmpIPredicate.sge, row, lo), arith.cmpi(arith.CmpIPredicate.slt, row, end))
        branch = scf.IfOp(ok)
        with ir.InsertionPoint(branch.then_block):
          memref.store(vector.extract(reg, [], [h]), out, [arith.index_cast(index, row), arith.addi(col0, n)])
          scf.yield_([])

  _(acc, out_ref, row0, lo, end, col0)


def _kernel(item_expert, item_x_start, item_lo, item_end, num_items, x_g, lo_g, hi_g, meta_g, levels_g, out_g,
            *, t: Tiling, max_items: int, n_pairs: int, k_dim: int, lhs_in_smem: bool):
  """x_g: h as plane_rows [rows, I]; lo/hi/meta/levels: the Mix3Stack; out_g [R, D] f32."""
  bk = t.block_k // PLANES  # code bytes per row per K step
  # a K-64 tile of 128-byte rows holding the 4 planes side by side, as the joined planes
  swizzle = plgpu.find_swizzle(t.block_k * jnp.dtype(BF16).itemsize * 8)
  tiles = (plgpu.TilingTransform((ROW_ALIGN, swizzle // jnp.dtype(BF16).itemsize)), plgpu.SwizzleTransform(swizzle))
  per_meta = META_BOX // (t.block_k // rocmfp_layout.HALF)  # K steps covered by one meta tile
  per_hi = HI_BOX // (t.block_k // 8)  # and by one high-bit tile
  x_spec = plgpu.BlockSpec((t.block_m, t.block_k), lambda k: (0, k), transforms=tiles, memory_space=plgpu.SMEM)
  w_specs = [plgpu.BlockSpec((t.block_n, bk), lambda k: (0, k), memory_space=plgpu.SMEM),
             plgpu.BlockSpec((t.block_n, HI_BOX), lambda k: (0, k // per_hi), memory_space=plgpu.SMEM),
             plgpu.BlockSpec((t.block_n, META_BOX), lambda k: (0, k // per_meta), memory_space=plgpu.SMEM)] * 2

  def pipeline(body, compute_context):
    return plgpu.emit_pipeline_warp_specialized(
        body, grid=(k_dim // t.block_k,), memory_registers=t.producer_registers, in_specs=[x_spec] + w_specs,
        wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=t.stages, compute_context=compute_context)

  def operands(e, g, x_start):  # h's rows, then each warpgroup's N tile (2g + v) of the three byte arrays
    ws = [a.at[e, pl.ds((2 * g + v) * t.block_n, t.block_n)] for v in range(2) for a in (lo_g, hi_g, meta_g)]
    return [x_g.at[pl.ds(x_start, t.block_m)]] + ws

  noop = lambda *_, **__: None
  scratch = {}
  if lhs_in_smem:  # the interpreter takes wgmma operands from refs only: the planes go through shared memory
    scratch = dict(dec=plgpu.SMEM((2, 2, t.block_n, t.block_k), BF16, transforms=tiles),
                   out_smem=plgpu.SMEM((2, t.block_m, t.block_n), F32))  # untiled: row slices of any size

  @functools.partial(pl.run_scoped, allocs=pipeline(noop, noop).get_allocations(*operands(0, 0, 0)),
                     collective_axes="wg", **scratch)
  def _scope(allocs, dec=None, out_smem=None):
    wg = lax.axis_index("wg")
    count = num_items[0]

    @plgpu.nd_loop((max_items * n_pairs,), collective_axes="sm")
    def _unit(info):
      (w,) = info.index
      if t.tile_order == "n":
        i, g = w // n_pairs, w % n_pairs
      else:
        safe = jnp.maximum(count, 1)
        i, g = w % safe, w // safe

      @pl.when(w < count * n_pairs)
      def _():
        e, x_start = item_expert[i], pl.multiple_of(item_x_start[i], ROW_ALIGN)
        lo, end = item_lo[i], item_end[i]

        def rows_in(first_row, n):  # (first stored row, count) of rows [first_row, first_row + n)
          first = jnp.maximum(first_row, lo)
          return first, jnp.clip(jnp.minimum(first_row + n, end) - first, 0, n)

        first, rows = rows_in(x_start, t.block_m)
        blocks = range(t.block_m // t.mma_rows)
        levels = [[levels_g[e, s, k] for k in range(rocmfp3_mix.LEVELS)] for s in range(2)]

        def context(run):
          @functools.partial(pl.run_scoped, accs=[plgpu.ACC((t.block_n, t.mma_rows), F32) for _ in blocks])
          def _acc(accs):  # accs[b]: this warpgroup's out^T, [n, rows of block b]
            run(accs)
            col0 = (2 * g + wg) * t.block_n
            if not lhs_in_smem:
              with profile_region("epilogue", t):
                for b in blocks:
                  store_transposed_rows(accs[b][...], out_g, x_start + b * t.mma_rows, lo, end, col0)
              return
            # the interpreter: through shared memory (it checks no layouts), then TMA
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous unit's store has left out_smem
            for b in blocks:
              out_smem.at[wg, pl.ds(b * t.mma_rows, t.mma_rows)].T[...] = accs[b][...]
            plgpu.commit_smem()
            _store_rows(out_smem, wg, first - x_start, out_g, first, rows, pl.ds(col0, t.block_n), t.block_m)

        def mma(idx, x_s, *args):
          *w_ss, accs = args
          hi_col = idx[0] % per_hi * (t.block_k // 8)  # this step's first high-bit column
          meta_col = idx[0] % per_meta * (t.block_k // rocmfp_layout.HALF)
          for v in range(2):
            @pl.when(wg == v)
            def _(v=v):
              lo_s, hi_s, meta_s = w_ss[3 * v:3 * v + 3]
              if lhs_in_smem:
                hi = jnp.repeat(hi_s[:, pl.ds(hi_col, t.block_k // 8)], 2, axis=1)  # byte c for code bytes 2c, 2c+1
                odd = lax.broadcasted_iota(I32, hi.shape, 1) % 2
                meta = jnp.repeat(meta_s[:, pl.ds(meta_col, t.block_k // rocmfp_layout.HALF)],
                                  rocmfp_layout.HALF // PLANES, axis=1)
                buf = idx[0] % 2
                dec[buf, v] = jnp.concatenate(decode_planes3(lo_s[...], hi.astype(I32) >> (4 * odd), meta, levels),
                                              axis=1)
                plgpu.commit_smem()
                planes = dec.at[buf, v]
              else:
                with profile_region("decode", t):
                  planes = decode_planes3_prmt(lo_s, hi_s, hi_col, meta_s, meta_col, levels)
              def issue(b):
                rows = pl.ds(b * t.mma_rows, t.mma_rows)
                with profile_region("mma", t):  # h's K tile holds the planes side by side, as the joined planes do
                  plgpu.wgmma(accs[b], planes, x_s.at[rows].T)

              # an item has rows in the first block of its tile
              issue_blocks(issue, lambda b: rows_in(x_start + b * t.mma_rows, t.mma_rows)[1], len(blocks), t,
                           always_full=len(blocks) == 1)
          return accs

        with profile_region("unit", t, "units"):
          pipeline(mma, context)(*operands(e, g, x_start), allocations=allocs)

  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def check(h, w2: Mix3Stack, r: Routing, t: Tiling, h_as_plane_rows: bool = False) -> None:
  """What this kernel takes (ValueError otherwise)."""
  if not isinstance(w2, Mix3Stack):
    raise ValueError(f"the wgmma down takes an FP3-MIX Mix3Stack W2, got {type(w2).__name__}")
  E, D, I = w2.shape
  rows = padded_rows(r.num_routes, t.block_m) if h_as_plane_rows else r.num_routes
  if jnp.dtype(h.dtype) != jnp.dtype(BF16) or tuple(h.shape) != (rows, I):
    what = "already as plane_rows" if h_as_plane_rows else "in sorted rows"
    raise ValueError(f"the wgmma down takes bf16 h [{rows}, {I}] {what} (h_as_plane_rows={h_as_plane_rows}) with W2 "
                     f"[E, D, I] = {[E, D, I]}; got h {h.dtype} {tuple(h.shape)}")
  if I % (META_BOX * rocmfp_layout.HALF) or D % (2 * WGMMA_M):
    raise ValueError(f"the wgmma down needs I a multiple of {META_BOX * rocmfp_layout.HALF} (a TMA row of meta "
                     f"bytes) and D of {2 * WGMMA_M} (two N tiles); got W2 [E, D, I] = {[E, D, I]}")
  if (t.block_n != WGMMA_M or t.block_k != 64 or t.mma_in_flight or t.cluster != 1 or t.block_m % t.mma_rows
      or t.mma_rows % WGMMA_M or t.mma_rows > 256 or t.tile_order not in ("n", "item")
      or t.profile_regions not in ("steps", "units")):
    raise ValueError(f"the wgmma down takes block_n {WGMMA_M}, block_k 64, no wgmma in flight, cluster 1, "
                     f"tile_order 'n' or 'item', mma_rows a multiple of {WGMMA_M} up to 256 dividing block_m, and "
                     f"profile_regions 'steps' or 'units'; got {t}")


def down_wgmma(h, w2: Mix3Stack, r: Routing, *, tiling: Tiling = TILING, num_sms: int = 132,
               h_as_plane_rows: bool = False, interpret=None) -> jax.Array:
  """out [S·K, D] f32 in sorted-row order (rows >= num_rows unspecified), as down.down: h [S·K, I] bf16 in sorted
  rows, or with `h_as_plane_rows` already as plane_rows(h, tiling.block_m) (the Mosaic gate/up's h_plane_rows); W2 an
  FP3-MIX stack decoded in the kernel (the canonical decode's bits, summed in plane order). `interpret`: None
  (compiled), True or an InterpretGPUParams."""
  t = tiling
  check(h, w2, r, t, h_as_plane_rows)
  _, D, I = w2.shape
  if interpret is True:  # Mosaic GPU's own interpreter (pallas' generic one cannot run its warpgroups)
    interpret = plgpu.InterpretGPUParams()
  items = aligned_items(r, t.block_m)
  kernel = plgpu.kernel(
      functools.partial(_kernel, t=t, max_items=items.expert.shape[0], n_pairs=D // (2 * t.block_n), k_dim=I,
                        lhs_in_smem=interpret not in (None, False)),
      out_type=jax.ShapeDtypeStruct((r.num_routes, D), F32), grid=(num_sms,), grid_names=("sm",),
      num_threads=3, thread_name="wg", interpret=interpret, kernel_name=KERNEL_NAME,
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
  return kernel(*items, h if h_as_plane_rows else plane_rows(h, t.block_m), *w2)
