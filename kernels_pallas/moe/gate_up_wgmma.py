"""Grouped gate/up for Hopper (sm_90) as a Pallas Mosaic GPU kernel: async wgmma fed by a TMA warpgroup.

    h[r] = silu(min(x_sorted[r] · W1_e^T, L)) * clip(x_sorted[r] · W3_e^T, −L, L)      e = expert of sorted row r

Why a second gate/up next to the Triton one (gate_up.py): Triton keeps a wgmma in flight only when it loads both
operands itself, so a tile decoded in registers (the MIX formats) makes every MMA wait (BENCHMARKS.md, "Where the
MMAs wait"). Here the pipeline is explicit: one warpgroup only issues TMA copies of the x, W1 and W3 tiles into a
ring of `stages` shared-memory slots, and two compute warpgroups issue wgmmas on them, each on its own half of the
row tile. On bf16 weights it is measured against gate_up.py and torch._grouped_mm; on FP2-MIX weights (below) it
decodes next to the MMAs, not in front of them.

TMA cannot gather rows, so the rows come pre-gathered in sorted-row order (`x_sorted`: `gather_rows`, a
Pallas-Triton kernel of S·K rows before this one; XLA's gather was ~1.6× slower). A TMA copy into the swizzled
shared-memory layout wgmma reads must start at a multiple of 8 rows, so the work list is this kernel's own
(`aligned_items`): an expert's first tile starts at its first row rounded down to 8, and the up to 7 rows of the
previous expert that it holds are computed and not stored. A warpgroup issues its wgmmas per 64-row block and
skips a block that holds no row of the expert (at 8192 tokens an expert has ~192 rows: a 256-row tile then issues
3 of its 4 blocks).
Each SM loops over (item, N tile) units. With `tile_order` "n" the SMs running together cover all N tiles of a few
items: each x tile is read from HBM once, and an expert's items run together, so its weight tiles are too.
The store of a variable number of rows is a few power-of-two TMA copies.
With `Tiling.x_stages` (bf16 weights) the loop is `_ring_kernel`'s instead of emit_pipeline_warp_specialized's: x
and the weights get rings of their own, and the weight copies (from HBM, the slower stream) run ahead of x's (L2).

FP2-MIX weights (`MixStack`: the storage's code and meta bytes as they are; gate/up's format in lucebox_mix): warpgroup
0 computes W1's tile and warpgroup 1 W3's, each for the whole row tile. The TMA warpgroup copies each K step's code
bytes and a 16-byte-wide tile of meta bytes (a TMA row needs ≥ 16 bytes; it covers 256 weights, i.e. 4 steps of
64, and is copied again for each). Each compute warpgroup decodes its tile into 4 bf16 planes that stay in registers
as the wgmmas' A operand (h^T = W · x^T per tile): no shared-memory planes, one decode per weight per tile, and one
warpgroup's decode runs while the other's wgmmas do. Plane q of a K step holds weights 4i + q (the codes' order);
the 4 planes sit side by side in one [64, 64] operand, so x comes as `plane_rows` (each 64-column block holds
columns 4i + q at 16q + i), a step's x tile has 128-byte rows, one K-64 wgmma a step, and the MMAs sum over K in
another order than gate_up.py. (x as 4 planes of 32-byte rows, one K-16 wgmma each, took 13-23% longer: BENCHMARKS.md,
sessions 51 and 52.) Warpgroup 1 hands its accumulators to warpgroup 0 through shared memory for the SwiGLU, which
stores h transposed back to rows; with `h_plane_rows`, in the Mosaic down's plane_rows order: each unit decodes its
64 weight rows so that register row 16q + i holds tile row 4i + q (`rows_by_plane`): its 64 output columns
come out in that order.
Compiled, the planes come from `decode_planes_prmt` (a byte permute per two weights; each code-byte pair reads its
meta byte from shared memory); the interpreter runs neither inline code nor wgmmas on register operands, so there
the planes are decode_planes' and go through shared memory. Both give the canonical decode's bits.
Tried and removed (BENCHMARKS.md has the figures): x and h as 4 separate planes (session 52); planes decoded into
shared memory by each warpgroup, or half of them by each (`shared_decode`; 10.7 and 11.5 ms at 8192 tokens against
5.2 now), or with the wgmmas left in flight on them while the next step decodes (fab9549: 6.8 against 5.1 ms; no
gain in down_wgmma.py either); the meta byte repeated per code byte in a copy of the stack (~0.8 GB a V4-Flash
layer); issuing the two warpgroups' wgmmas in turn (8.4 ms); each warpgroup making the SwiGLU of half of the rows
(5.5 ms); a third warpgroup that copies and decodes both tiles into shared-memory planes while the other two only
issue wgmmas (2a804c4: 5.9 ms). Profiled (experiments/profile_moe.py), a step is ~1450 cycles against ~1024 of
tensor-core work: each warpgroup's slot wait (~290), decode (~490), issue (~190) and wait (~320) run one after the
other. Each step of this pipeline waits for its own wgmmas. Leaving them in flight into the next step
(`mma_in_flight`, the first version) made ptxas serialize every wgmma of the pipeline ("insufficient register
resources for the wgmma pipeline", C7511) at every tiling, even with no decode (docs/lowering.md; BENCHMARKS.md has
the figures), and it raced: emit_pipeline_warp_specialized's `delay_release` never releases the slot of a pipeline's
last step, so the next unit's prologue copies refilled it under that step's wgmmas (found by the tests' interpreter
with late wgmmas, tests/async_wgmma.py). Only `_ring_kernel`, which releases a unit's last slots after its final
wait, keeps wgmmas in flight. An FP2-MIX version of it (e3db26e: two plane sets in registers, steps unrolled in
pairs) compiled with the wgmmas asynchronous and was no faster than this pipeline at cluster 2. Without wgmmas in
flight, in clusters of two sharing x (a37cf74), it was within ±5% of it (BENCHMARKS.md, session 51).

sm_90 only (Mosaic GPU has no ROCm backend): gfx1151 keeps gate_up.py. bf16 (or f16) operands, f32 accumulation;
on bf16 weights its h is bit-identical to gate_up.py's on the H200 (FP2-MIX: the same decoded bits, summed over K
in plane order). `api.moe` runs it for `Config.gate_up_kernel` "wgmma" (the model's
`moe_wgmma_gate_up`). On the H200 the bf16 version ties the Triton kernel once its row gather is counted
(BENCHMARKS.md, "A Mosaic GPU gate/up").
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, memref, vector
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import triton as plt

from ds4jax.quant import rocmfp2_mix, rocmfp_layout, rocmfp_mix, ue4m3
from kernels_pallas.moe.gate_up import clamped_swiglu
from kernels_pallas.moe.routing import Routing

F32 = jnp.float32
I32 = jnp.int32
BF16 = jnp.bfloat16
PLANES = 4  # FP2-MIX: four 2-bit codes per byte
ROW_ALIGN = 8  # the shared-memory tiling's row tile
META_BOX = 16  # meta bytes per row of one TMA copy (its minimum row): 16 half-blocks, 256 weights
WGMMA_M = 64  # rows of one warpgroup MMA: a warpgroup's rows are issued (or skipped) in blocks of this


@dataclasses.dataclass(frozen=True)
class Tiling:
  """wg_rows: rows per compute warpgroup (a unit's row tile is twice that); block_n: output columns of W1 and of W3
  per unit; block_k: the reduction step; stages: shared-memory slots; tile_order: which index of (item, N tile) the SMs
  running together share ("n": the item, "item": the N tile); skip_empty: a warpgroup issues no wgmma for a
  64-row block of its rows that holds none of the expert's; cluster 2: two SMs take neighbouring N tiles of one
  item and each x tile is read from L2 once for both (a TMA multicast);
  mma_rows (FP2-MIX): rows of x per wgmma. With FP2-MIX weights block_n must be 64 (one warpgroup's wgmma rows)
  and block_k 64 (a meta tile then serves 4 steps). profile_regions: what the
  regions Mosaic GPU's profiler records are (experiments/profile_moe.py; nothing without the profiler): "steps"
  (decode, mma, wait per pipeline step, epilogue per unit) or "units" (one per unit).
  x_stages > 0 (bf16 weights, cluster 1, tile_order "n"): `_ring_kernel`, where x gets a ring of its own of
  x_stages slots (at least 2 with mma_in_flight) and the weights `stages` slots, the weight copies running
  stages − x_stages steps ahead; there mma_in_flight 1 frees a step's slots one step late, so its wgmmas run while
  the next step's are issued (the pipeline of x_stages 0 refuses it: module docstring). Their copy loop (bench-only
  switches, BENCHMARKS.md session 59): copy_warp issues it from one warp of the producer warpgroup, not all four;
  carried_units carries each copy's (item, N tile, K step) from step to step, with no integer division per step."""
  wg_rows: int = 64
  block_n: int = 128
  block_k: int = 64
  stages: int = 4
  mma_in_flight: int = 0
  tile_order: str = "n"
  skip_empty: bool = True
  cluster: int = 1
  mma_rows: int = 64
  producer_registers: int = 40
  profile_regions: str = "steps"
  x_stages: int = 0
  copy_warp: bool = False
  carried_units: bool = False

  @property
  def block_m(self) -> int:
    return 2 * self.wg_rows


# The measured best tilings at V4-Flash shapes (bench_moe, BENCHMARKS.md): FP2-MIX "lhs r256" with x multicast over
# clusters of two SMs (c2) above 64 rows per expert: faster than without at 8192 and 32768 tokens, by 14-19% on the
# H100 (two calls; 5.04 against 6.24 ms at 8192) and 5% / 1% on the H200 (4.85 against 5.10 ms at 8192); with x as
# plane_rows 4.49 ms at 8192 on the H100 (session 52). "lhs w64 r128" at 2048 (48 rows: 3.86 ms on the H200); bf16
# w128 n64 (8192: 3.99 ms on the H200).
MIX_TILING = Tiling(wg_rows=128, block_n=64, stages=3, mma_rows=256, cluster=2)
MIX_TILING_FEW_ROWS = Tiling(wg_rows=64, block_n=64, stages=3, mma_rows=128)
# bf16 on the model's dense W1 / W3: the separate x and weight rings, timed in turns with torch._grouped_mm on H100s
# (BENCHMARKS.md, sessions 56-63). RING_X4 won at about 192 rows per expert (8192 tokens, uniform routing), RING_W64
# at more (32768) and fewer (512, 2048); the one picked beat BF16_TILING (the pipeline without rings) in every cell.
RING_X4 = Tiling(wg_rows=128, block_n=64, x_stages=4, mma_in_flight=1)
RING_W64 = Tiling(wg_rows=64, block_n=128, x_stages=3, mma_in_flight=1)
BF16_TILING = Tiling(wg_rows=128, block_n=64)
# Separate W1 / W3 stacks step-tiled in 64 × 64 boxes (ring_layout; 64 is the rings' block_k): each step's box one
# contiguous 8 KB, read by RING_X4 as one copy per projection and by RING_W64 as two, so one copy of the weights
# serves either ring.
RING_BOX = 64
KERNEL_NAME = "moe_gate_up_wgmma"


def default_tiling(rows_per_expert: int, mix: bool, intermediate: int) -> Tiling:
  """The tiling `api.moe` runs this kernel at, by the mean rows per expert, the weights' format and I (RING_W64's
  N tile and MIX_TILING's cluster of two N tiles take I a multiple of 128)."""
  if mix:
    paired = intermediate % (MIX_TILING.block_n * MIX_TILING.cluster) == 0
    return MIX_TILING if rows_per_expert > 64 and paired else MIX_TILING_FEW_ROWS
  if 128 < rows_per_expert <= 256 or intermediate % RING_W64.block_n:
    return RING_X4
  return RING_W64


class Items(NamedTuple):
  """The aligned work list: item i covers sorted rows [x_start, x_start + block_m) of expert `expert` and stores
  rows [lo, end) ∩ that range. Padding items (i >= count) have expert 0 and lo = end = 0."""
  expert: jax.Array
  x_start: jax.Array
  lo: jax.Array
  end: jax.Array
  count: jax.Array  # [1]


def aligned_items(r: Routing, block_m: int) -> Items:
  E, R = r.num_experts, r.num_routes
  sizes, offsets = r.group_sizes, r.group_offsets
  first = offsets[:E] - offsets[:E] % ROW_ALIGN
  tiles = jnp.where(sizes > 0, -(-(offsets[1:] - first) // block_m), 0).astype(I32)
  tile_ends = jnp.cumsum(tiles, dtype=I32)
  T = max(1, (R + E * (block_m + ROW_ALIGN - 2)) // block_m)  # Σ ceil((c_e + 7) / bm) over non-empty experts
  i = jnp.arange(T, dtype=I32)
  # compare_all: one fused kernel; the default 'scan' is a while loop, a chain of small launches before each kernel
  e = jnp.minimum(jnp.searchsorted(tile_ends, i, side="right", method="compare_all").astype(I32), E - 1)
  ok = i < tile_ends[E - 1]
  x_start = first[e] + (i - (tile_ends[e] - tiles[e])) * block_m
  lo = jnp.maximum(x_start, offsets[e])
  return Items(jnp.where(ok, e, 0), jnp.where(ok, x_start, 0), jnp.where(ok, lo, 0),
               jnp.where(ok, offsets[e + 1], 0), tile_ends[E - 1].reshape(1))


def padded_rows(rows: int, block_m: int) -> int:
  """`rows` rounded up to 8 plus one row tile: the last item's copy then stays in bounds (those rows are never
  stored). The length of sorted_rows, and of h for the down (down_wgmma.plane_rows)."""
  return -(-rows // ROW_ALIGN) * ROW_ALIGN + block_m


def sorted_rows(x, r: Routing, block_m: int) -> jax.Array:
  """x_sorted [padded_rows, D]: row r holds x[token_of_row[r]], then x[0]."""
  return x[jnp.pad(r.token_of_row, (0, padded_rows(r.num_routes, block_m) - r.num_routes))]


class MixStack(NamedTuple):
  """An FP2-MIX expert stack [E, N, K] as this kernel reads it (`mix_stack`). codes [E, N, K/4] u8 and meta
  [E, N, K/16] u8 as stored (weight 4i + q at bits 2q of code byte i; one meta byte per 16-weight half-block);
  levels [E, 2, 4] f32: what each book's entries are multiplied by (`expert_levels`)."""
  codes: jax.Array
  meta: jax.Array
  levels: jax.Array

  @property
  def shape(self) -> tuple[int, int, int]:
    E, N, K4 = self.codes.shape
    return E, N, K4 * PLANES


def expert_levels(storage: dict, fixed_levels) -> jax.Array:
  """levels [E, 2, L] f32 of a MIX stack's storage: each expert's two books, or for a mode-0 (uniform) expert
  `fixed_levels` [L] and, as book 1, their signed zeros: there a set bit 7 zeroes the scale, and level × 0 is the
  canonical product's bits. So the decode picks a book by bit 7 whatever the mode."""
  uniform = (jnp.asarray(storage["mode"]) == 0)[:, None]
  fixed = jnp.asarray(fixed_levels, F32)
  fixed = jnp.stack([fixed, jnp.copysign(F32(0), fixed)])
  return jnp.where(uniform[..., None], fixed, jnp.asarray(storage["books"]).astype(F32))


def mix_stack(storage: dict) -> MixStack:
  """From rocmfp2_mix storage arrays (codes, scales, books, mode): the codes and meta bytes themselves, and each
  expert's 8 levels (a few bytes an expert)."""
  fixed = rocmfp2_mix.fixed_level(jnp.arange(rocmfp2_mix.LEVELS))
  return MixStack(jnp.asarray(storage["codes"]), jnp.asarray(storage["scales"]), expert_levels(storage, fixed))


def half_block_values(meta, levels) -> list[jax.Array]:
  """The bf16 value of each level k (len(levels[0]) of them) for meta bytes `meta`: book level × UE4M3 scale in
  f32, then bf16, as the canonical decode. Pure jnp."""
  m = meta.astype(I32)
  m7 = m & 0x7F
  # ue4m3.decode in fewer integer ops (the decode is this kernel's ALU bound): 2^(e − 8)·(1 + mant/8) as float32
  # bits with the exponent rebiased; e = 0 (2^-7·mant/8) is 2c − 2^-7 of that. Every step is exact.
  c = lax.bitcast_convert_type((m7 << 20) + ((127 - 8) << 23), F32)
  scale = jnp.where(m7 < 8, 2 * c - F32(2.0**-7), c)
  scale = jnp.where(m7 > ue4m3.MAX_BYTE, F32(0), scale)
  flagged = m >= rocmfp_mix.SELECT_BIT
  return [(jnp.where(flagged, levels[1][k], levels[0][k]) * scale).astype(BF16) for k in range(len(levels[0]))]


def bf16_pair_ir(lo, hi):
  """Two f32 IR scalars, exact in bf16, as one i32 of two bf16 (lo in bits 0-15)."""
  pair = ir.VectorType.get((2,), ir.BF16Type.get())
  bf16 = [arith.truncf(ir.BF16Type.get(), v) for v in (lo, hi)]
  return mgpu.utils.bitcast(vector.from_elements(pair, bf16), ir.IntegerType.get_signless(32))


def scale_ir(m):
  """(bit 7 set, the UE4M3 scale of bits 0-6 as f32) of a meta byte `m` (i32), in Mosaic GPU IR: half_block_values'
  integer steps."""
  i32, f32 = ir.IntegerType.get_signless(32), ir.F32Type.get()
  const = lambda v, t=i32: arith.constant(t, v)
  m7 = arith.andi(m, const(0x7F))
  c = arith.bitcast(f32, arith.addi(arith.shli(m7, const(20)), const((127 - 8) << 23)))
  low = arith.subf(arith.mulf(c, const(2.0, f32)), const(2.0**-7, f32))
  scale = arith.select(arith.cmpi(arith.CmpIPredicate.ult, m7, const(8)), low, c)
  scale = arith.select(arith.cmpi(arith.CmpIPredicate.ugt, m7, const(ue4m3.MAX_BYTE)), const(0.0, f32), scale)
  return arith.cmpi(arith.CmpIPredicate.uge, m, const(rocmfp_mix.SELECT_BIT)), scale


def half_block_values_ir(m, levels):
  """half_block_values in Mosaic GPU IR for one meta byte `m` (i32): the bf16 values of levels[s][k] (f32 IR
  scalars), the same f32 products, so the same bits. The down's (down_wgmma.py): there value_pairs_ir's products
  measured no faster (BENCHMARKS.md, session 46)."""
  flagged, scale = scale_ir(m)
  return [arith.truncf(ir.BF16Type.get(), arith.mulf(arith.select(flagged, levels[1][k], levels[0][k]), scale))
          for k in range(len(levels[0]))]


def value_pairs_ir(m, level_pairs):
  """half_block_values in Mosaic GPU IR for one meta byte `m` (i32), two values to a register: register h holds the
  bf16 values of levels 2h and 2h + 1 of the book bit 7 picks. level_pairs[s][h]: book s's levels 2h, 2h + 1 as
  bf16 pairs (bf16_pair_ir). The scale has 4 significant bits and a level 8, so their product is exact in f32 and the
  canonical decode rounds it to bf16 once; a bf16x2 multiply of the two (the scale is exact in bf16) rounds the
  same exact product once: the same bits, two values an instruction, where the f32 products take four. The gate/up's:
  2-4% faster there than half_block_values_ir's products (BENCHMARKS.md, session 46)."""
  i32 = ir.IntegerType.get_signless(32)
  flagged, scale = scale_ir(m)
  bits = arith.bitcast(i32, scale)
  scale_pair = mgpu.utils.prmt(bits, bits, arith.constant(i32, 0x3232))  # the f32's high half (its bf16) twice
  return [mgpu.utils.inline_ptx("mul.rn.bf16x2 $0, $1, $2;", arith.select(flagged, one, zero), scale_pair,
                                result_types=i32) for zero, one in zip(*level_pairs)]


def decode_planes(codes, meta, levels) -> list[jax.Array]:
  """Code bytes and meta bytes [n, m] → 4 bf16 planes [n, m], plane q holding weight 4i + q of byte i; `levels`
  is [2][4] scalars. The canonical decode's products (book level × UE4M3 scale in f32, then bf16): the same bits.
  Pure jnp: runs in the kernel and in tests."""
  b = codes.astype(I32)
  values = half_block_values(meta, levels)
  # code bit j of weight 4i + q tested as the sign of the byte shifted left (one shift and a compare per bit)
  return [rocmfp_mix.pick([(b << (31 - 2 * q)) < 0, (b << (30 - 2 * q)) < 0], values) for q in range(PLANES)]


SELECTOR = (0x0303, 0x22, 0x1010)  # prmt_selectors' mask, multiplier and offset


def prmt_selectors(code_pairs, q: int):
  """The byte selectors that pick plane q's two bf16 values out of a byte pair's table (prmt on sm_90): code_pairs
  holds two code bytes (byte 2c in bits 0–7, byte 2c + 1 in bits 8–15) of one half-block, whose 4 values sit in
  table bytes 2v, 2v + 1 (value v). Selector nibbles 2c_a, 2c_a + 1, 2c_b, 2c_b + 1. Pure jnp: tested on CPU."""
  mask, mul, offset = SELECTOR
  return ((code_pairs >> (2 * q)) & mask) * mul + offset


def prmt_selectors_ir(code_pairs, q: int):
  """prmt_selectors in Mosaic GPU IR (i32 code_pairs)."""
  const = lambda v: arith.constant(ir.IntegerType.get_signless(32), v)
  mask, mul, offset = SELECTOR
  return arith.addi(arith.muli(arith.andi(arith.shrui(code_pairs, const(2 * q)), const(mask)), const(mul)),
                    const(offset))


def joined_planes_type(shape):
  """The return type of a decode into 4 bf16 planes of `shape` [n, m] in wgmma's register layout, side by side: one
  [n, 4m] array (see joined_planes)."""
  n, m = shape
  return plgpu.ShapeDtypeStruct((n, PLANES * m), BF16, layout=plgpu.Layout.WGMMA)


def joined_planes(registers, shape):
  """The 4 planes' register arrays (each of a [n, m] array in wgmma's layout) as one Mosaic GPU [n, 4m] array with
  plane q in columns [q·m, (q + 1)·m): the layout's 8-column tiles are its registers' second axis. The K-64 operand
  whose columns match a plane_rows tile."""
  n, m = shape
  layout = mgpu.WGMMA_LAYOUT
  joined = np.concatenate(registers, axis=1)
  assert joined.shape == layout.registers_shape((n, PLANES * m)), joined.shape
  return mgpu.FragmentedArray(_registers=joined, _layout=layout, _is_signed=None)


def byte_pairs(smem, shape, plane_ordered_rows: bool):
  """((row, column), code-byte pair as i32) of each register of a [n, m] u8 shared-memory tile in wgmma's layout,
  loaded by hand (Mosaic GPU IR): the row is the tile's own, or with `plane_ordered_rows` (a 64-row tile) register
  row 16q + i reads tile row 4i + q (rows_by_plane). Pairs (2c, 2c + 1), byte 2c in bits 0-7."""
  if plane_ordered_rows and shape[0] != 64:
    raise ValueError(f"plane-ordered rows take a 64-row tile, got {shape}")
  i8, i16, i32 = (ir.IntegerType.get_signless(w) for w in (8, 16, 32))
  index = ir.IndexType.get()
  const = lambda v: arith.constant(index, v)
  for row, col in mgpu.WGMMA_LAYOUT.thread_idxs(shape):
    if plane_ordered_rows:
      row = arith.addi(arith.muli(arith.remui(row, const(16)), const(PLANES)), arith.divui(row, const(16)))
    pair = vector.load(ir.VectorType.get((2,), i8), smem, [row, col])
    yield (row, col), arith.extui(i32, mgpu.utils.bitcast(pair, i16))


def decode_planes_prmt(codes_ref, meta_ref, first, levels, *, plane_ordered_rows: bool = False) -> jax.Array:
  """decode_planes in wgmma's register layout, joined (joined_planes), compiled (sm_90): in that layout a thread's
  bytes come in pairs (2c, 2c + 1) of one half-block, which share a scale and a book. So each pair of `codes_ref`
  (the step's [n, m] code bytes in shared memory) reads its meta byte, column first + c // 4 of `meta_ref`, makes
  its 4 values once, two to a register (value_pairs_ir: decode_planes' bits), and each plane's two weights are one
  `prmt` of them by `prmt_selectors`: ~4 instructions per 2 weights, where decode_planes spends ~12 per weight.
  `plane_ordered_rows`: the tile's rows in rows_by_plane's order. Not in interpret mode (inline Mosaic GPU code has no
  interpreter); its planes are decode_planes' bits."""
  wg = plgpu.Layout.WGMMA
  scalars = [first] + [levels[s][k] for s in range(2) for k in range(4)]
  shape = tuple(codes_ref.shape)

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType()) + (wg,) * len(scalars),
                     return_type=joined_planes_type(shape))
  def planes(_, code_smem, meta_smem, *args):
    i32, index = ir.IntegerType.get_signless(32), ir.IndexType.get()
    pair = ir.VectorType.get((2,), ir.BF16Type.get())
    args = [a.registers.item() for a in args]  # scalars come as splat arrays
    first_col = arith.index_cast(index, args[0])
    level_pairs = [[bf16_pair_ir(*args[1 + 4 * s + 2 * h:3 + 4 * s + 2 * h]) for h in range(2)] for s in range(2)]
    registers_shape = mgpu.WGMMA_LAYOUT.registers_shape(shape)
    out = [np.empty(registers_shape, object) for _ in range(PLANES)]
    for idx, ((row, col), w) in zip(np.ndindex(registers_shape), byte_pairs(code_smem, shape, plane_ordered_rows),
                                                       strict=True):
      half_block = arith.addi(first_col, arith.divui(col, arith.constant(index, rocmfp_layout.HALF // PLANES)))
      m = arith.extui(i32, memref.load(meta_smem, [row, half_block]))
      table = value_pairs_ir(m, level_pairs)
      for q in range(PLANES):
        out[q][idx] = mgpu.utils.bitcast(mgpu.utils.prmt(table[0], table[1], prmt_selectors_ir(w, q)), pair)
    return joined_planes(out, shape)

  return planes(codes_ref, meta_ref, *scalars)


def rows_by_plane(a) -> jax.Array:
  """[64·t, m] → the same, each 64-row tile reordered so that row 16q + i is row 4i + q: the gate/up's weight rows
  in this order make its output columns plane_rows' (as_plane_rows of h). Pure jnp."""
  n, m = a.shape
  return a.reshape(n // 64, 64 // PLANES, PLANES, m).transpose(0, 2, 1, 3).reshape(n, m)


def as_plane_rows(rows, block_k: int = 64) -> jax.Array:
  """[n, K] → [n, K]: each block_k-column block holds its 4 planes side by side, column 4i + q of the block at
  q · block_k/4 + i. A step's x tile is then one block of 128-byte rows whose K sub-tiles are the planes."""
  n, K = rows.shape
  return rows.reshape(n, K // block_k, block_k // PLANES, PLANES).transpose(0, 1, 3, 2).reshape(n, K)


GATHER_NAME = "moe_gather_rows"
GATHER_ROWS = 8  # rows per program: padded_rows is a multiple of 8


def _gather_kernel(token_ref, x_ref, out_ref, *, cols: int, plane_rows: bool):
  rows = pl.ds(pl.program_id(0) * GATHER_ROWS, GATHER_ROWS)
  tokens = plt.load(token_ref.at[rows])
  planes = PLANES if plane_rows else 1
  c = pl.program_id(1) * (cols // planes) + jnp.arange(cols // planes, dtype=I32)  # (plane) columns
  row_ids = pl.program_id(0) * GATHER_ROWS + jnp.arange(GATHER_ROWS, dtype=I32)
  plane_block = 64 // PLANES
  for q in range(planes):  # stride-4 reads of the same rows: the planes after the first come from L1
    values = plt.load(x_ref.at[tokens[:, None], (planes * c + q)[None, :]])
    if plane_rows:  # as_plane_rows: plane q's column c at q · plane_block + c within its block of 4 · plane_block
      dst = c // plane_block * (PLANES * plane_block) + q * plane_block + c % plane_block
      plt.store(out_ref.at[row_ids[:, None], dst[None, :]], values)
    else:
      plt.store(out_ref.at[rows, pl.ds(pl.program_id(1) * cols, cols)], values)


def gather_rows(x, r: Routing, block_m: int, *, plane_rows: bool = False, cols: int | None = None,
                interpret: bool = False) -> jax.Array:
  """sorted_rows, or with `plane_rows` as_plane_rows(sorted_rows) (the FP2-MIX kernel's x), as one Pallas-Triton
  kernel: each program reads 8 gathered rows of x and writes `cols` of its columns (by default 512, the fastest
  measured on the H200: BENCHMARKS.md, "x's rows gathered by a Pallas kernel"), where XLA's gather writes at
  ~1 TB/s."""
  n = padded_rows(r.num_routes, block_m)
  D = x.shape[1]
  if cols is None:  # the largest power of two (a Triton block) up to 512 that tiles the columns
    cols = 512
    while D % cols:
      cols //= 2
  if D % cols or cols & (cols - 1) or (plane_rows and cols % 64):
    raise ValueError(f"gather_rows needs cols={cols} a power of two (a Triton block; with plane_rows at least 64) "
                     f"dividing D={D}")
  tokens = jnp.pad(r.token_of_row, (0, n - r.num_routes))
  return pl.pallas_call(
      functools.partial(_gather_kernel, cols=cols, plane_rows=plane_rows),
      out_shape=jax.ShapeDtypeStruct((n, D), x.dtype), grid=(n // GATHER_ROWS, D // cols),
      interpret=interpret, name=GATHER_NAME,
      compiler_params=plt.CompilerParams(num_warps=4, num_stages=1))(tokens, x)


def profile_region(name: str, t: Tiling, kind: str = "steps"):
  """A named region for Mosaic GPU's profiler where `t.profile_regions` is `kind` (this kernel's and down_wgmma's)."""
  return jax.named_scope(name) if t.profile_regions == kind else contextlib.nullcontext()


def issue_blocks(issue, rows_in_block, n_blocks: int, t: Tiling, always_full: bool = False) -> None:
  """Issues issue(b), block b's wgmmas, for the blocks that hold rows, then waits for them. The blocks with rows are
  a prefix (an item's rows start fewer than ROW_ALIGN rows into its tile), so with skip_empty each count of them is
  one branch that issues and waits: a branch that issues a wgmma without its wait makes ptxas serialize every wgmma
  of the kernel (C7512, docs/lowering.md §1). `always_full`: every block holds rows (no branch at all)."""
  def issue_and_wait(count):
    for b in range(count):
      issue(b)
    with profile_region("wait", t):
      plgpu.wgmma_wait(0)

  if not t.skip_empty or always_full:
    issue_and_wait(n_blocks)
    return
  nonempty = sum((rows_in_block(b) > 0).astype(I32) for b in range(n_blocks))
  for count in range(1, n_blocks + 1):  # none: nothing was issued, nothing to wait for
    pl.when(nonempty == count)(functools.partial(issue_and_wait, count))


def _store_rows(out_smem, slot, src_row, h_g, first_row, count, cols, max_rows: int):
  """Copies rows [src_row, src_row + count) of out_smem[slot] to h rows [first_row, first_row + count), columns
  `cols`: TMA copies need static shapes, so `count` is written as a sum of powers of two, largest first."""
  done = 0  # a Python int while static: a constant array here breaks the slice lowering
  size = 1 << (max_rows.bit_length() - 1)
  while size >= 1:
    @pl.when((count & size) != 0)
    def _(size=size, done=done):
      plgpu.copy_smem_to_gmem(out_smem.at[slot, pl.ds(src_row + done, size)],
                              h_g.at[pl.ds(first_row + done, size), cols])
    done = done + (count & size)
    size //= 2


def _kernel(item_expert, item_x_start, item_lo, item_end, num_items, x_g, *refs, t: Tiling, limit: float,
            max_items: int, n_tiles: int, d: int, mix: bool, lhs_in_smem: bool, plane_ordered_rows: bool,
            step_tiled: bool = False):
  """x_g is x_sorted [rows, D] (bf16 weights) or as_plane_rows of it (FP2-MIX). refs: the weight arrays (w1, w3 |
  w13 | codes, meta, levels of W1 then of W3), then h. With `plane_ordered_rows` each unit decodes its weight rows in
  rows_by_plane's order, so h comes as plane_rows. With `step_tiled` the dense weights come as tile_by_step's
  [E, N tiles, steps · rows, block_k]."""
  *w_gs, h_g = refs
  if mix:
    stacks = [w_gs[:3], w_gs[3:]]
    n_w, w_rows, fused = 2, t.block_n, False
  else:
    n_w = len(w_gs)
    fused = n_w == 1  # one interleaved [E, 2I, D] stack: one wgmma of width 2 · block_n per step
    w_rows = 2 * t.block_n if fused else t.block_n
  # wgmma reads swizzled tiles of K-64 rows (FP2-MIX: x's plane_rows, as the joined planes); their row offsets must
  # be multiples of the 8-row tile
  swizzle = plgpu.find_swizzle(t.block_k * jnp.dtype(BF16).itemsize * 8)
  tiles = (plgpu.TilingTransform((ROW_ALIGN, swizzle // jnp.dtype(BF16).itemsize)), plgpu.SwizzleTransform(swizzle))
  cluster = ("cluster",) if t.cluster > 1 else ()
  x_spec = plgpu.BlockSpec((t.block_m, t.block_k), lambda k: (0, k), transforms=tiles, memory_space=plgpu.SMEM,
                           collective_axes=cluster)
  if mix:  # code and meta bytes: read into registers by the decode, no swizzle needed
    per_box = META_BOX // (t.block_k // rocmfp_layout.HALF)  # K steps covered by one meta tile
    code_spec = plgpu.BlockSpec((t.block_n, t.block_k // PLANES), lambda k: (0, k), memory_space=plgpu.SMEM)
    meta_spec = plgpu.BlockSpec((t.block_n, META_BOX), lambda k: (0, k // per_box), memory_space=plgpu.SMEM)
    w_specs = [code_spec, meta_spec] * 2
  else:
    at_k = (lambda k: (k, 0)) if step_tiled else (lambda k: (0, k))
    w_specs = [plgpu.BlockSpec((w_rows, t.block_k), at_k, transforms=tiles, memory_space=plgpu.SMEM)] * n_w

  def pipeline(body, compute_context):
    return plgpu.emit_pipeline_warp_specialized(
        body, grid=(d // t.block_k,), memory_registers=t.producer_registers, in_specs=[x_spec] + w_specs,
        wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=t.stages, compute_context=compute_context)

  def operands(e, j, x_start):  # the pipeline's arrays for one unit: x rows, then the weight tiles' rows
    at = lambda a: a.at[e, pl.ds(j * w_rows, w_rows)]  # an interleaved stack's tile has both projections
    if step_tiled:  # the N tile's steps, one after the other
      at = lambda a: a.at[e, j]
    ws = [at(a) for c, m, _ in stacks for a in (c, m)] if mix else [at(w) for w in w_gs]
    return [x_g.at[pl.ds(x_start, t.block_m)]] + ws

  noop = lambda *_, **__: None
  scratch = dict(out_smem=plgpu.SMEM((2, t.wg_rows, t.block_n), h_g.dtype))  # untiled: row slices of any size
  if mix:  # h tile [rows, n]; W3's accumulators [n, 64 rows] per block, handed to warpgroup 0 for the SwiGLU
    scratch = dict(out_smem=plgpu.SMEM((1, t.block_m, t.block_n), h_g.dtype),
                   up=plgpu.SMEM((t.block_m // t.mma_rows, t.block_n, t.mma_rows), F32, transforms=(
                       plgpu.TilingTransform((ROW_ALIGN, 32)), plgpu.SwizzleTransform(128))),
                   up_ready=plgpu.Barrier(num_arrivals=1), up_free=plgpu.Barrier(num_arrivals=1))
    if lhs_in_smem:  # the interpreter takes wgmma operands from refs only: the planes go through shared memory
      scratch["dec"] = plgpu.SMEM((2, t.block_n, t.block_k), BF16, transforms=tiles)  # a warpgroup's joined planes

  @functools.partial(pl.run_scoped, allocs=pipeline(noop, noop).get_allocations(*operands(0, 0, 0)),
                     collective_axes="wg", **scratch)
  def _scope(allocs, out_smem, dec=None, up=None, up_ready=None, up_free=None):
    wg = lax.axis_index("wg")
    if mix:  # the first unit's up buffer is free
      pl.when(wg == 0)(lambda: plgpu.barrier_arrive(up_free))
    count = num_items[0]
    groups = n_tiles // t.cluster  # N tiles are taken `cluster` at a time, one per SM of the cluster

    @plgpu.nd_loop((max_items * groups,), collective_axes="sm")
    def _unit(info):
      (w,) = info.index
      if t.tile_order == "n":
        i, g = w // groups, w % groups
      else:
        safe = jnp.maximum(count, 1)
        i, g = w % safe, w // safe
      j = g * t.cluster + lax.axis_index("cluster")

      @pl.when(w < count * groups)
      def _():
        e, x_start = item_expert[i], pl.multiple_of(item_x_start[i], ROW_ALIGN)
        cols = pl.ds(j * t.block_n, t.block_n)
        lo, end = item_lo[i], item_end[i]

        def rows_in(first_row, n):  # (first stored row, count) of rows [first_row, first_row + n)
          first = jnp.maximum(first_row, lo)
          return first, jnp.clip(jnp.minimum(first_row + n, end) - first, 0, n)

        wg_first = x_start + wg * t.wg_rows  # this warpgroup's rows of the tile: [wg_first, wg_first + wg_rows)
        first, rows = rows_in(wg_first, t.wg_rows)
        blocks = range(t.wg_rows // WGMMA_M)
        if mix:  # both warpgroups cover the whole row tile, one projection each
          first, rows = rows_in(x_start, t.block_m)
          blocks = range(t.block_m // t.mma_rows)
        if mix:  # this expert's book levels, as scalars
          sides = [[[lv[e, s, k] for k in range(4)] for s in range(2)] for _, _, lv in stacks]

        def lhs_context(run):
          @functools.partial(pl.run_scoped, accs=[[plgpu.ACC((t.block_n, t.mma_rows), F32)] for _ in blocks])
          def _acc(accs):  # accs[b]: this warpgroup's projection, [n, rows of block b]
            run(accs)
            with profile_region("epilogue", t):
              # In 64-row chunks, through a swizzled buffer: fewer live registers than a whole [64, 256] f32 copy
              chunks = range(0, t.mma_rows, WGMMA_M)

              @pl.when(wg == 1)
              def _():
                plgpu.barrier_wait(up_free)  # warpgroup 0 has read the previous unit's
                for b in blocks:
                  a = accs[b][0][...]
                  for c in chunks:
                    up[b, :, pl.ds(c, WGMMA_M)] = a[:, c:c + WGMMA_M]
                plgpu.commit_smem()
                plgpu.barrier_arrive(up_ready)

              @pl.when(wg == 0)
              def _():
                plgpu.barrier_wait(up_ready)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous unit's store has left out_smem
                for b in blocks:
                  gate = accs[b][0][...]
                  for c in chunks:
                    h = clamped_swiglu(gate[:, c:c + WGMMA_M], up[b, :, pl.ds(c, WGMMA_M)], limit).astype(h_g.dtype)
                    out_smem.at[0, pl.ds(b * t.mma_rows + c, WGMMA_M)].T[...] = h
                plgpu.barrier_arrive(up_free)
                plgpu.commit_smem()
                _store_rows(out_smem, 0, first - x_start, h_g, first, rows, cols, t.block_m)

        def lhs_mma(idx, x_s, *args):
          *w_ss, accs = args
          for v in range(2):
            @pl.when(wg == v)
            def _(v=v):
              levels = sides[v]
              codes_s, meta_s = w_ss[2 * v], w_ss[2 * v + 1]
              meta_col = idx[0] % per_box * (t.block_k // rocmfp_layout.HALF)  # this step's first meta column
              if lhs_in_smem:
                codes, meta = codes_s[...], meta_s[:, pl.ds(meta_col, t.block_k // rocmfp_layout.HALF)]
                if plane_ordered_rows:
                  codes, meta = rows_by_plane(codes), rows_by_plane(meta)
                meta = jnp.repeat(meta, rocmfp_layout.HALF // PLANES, axis=1)  # one per code byte
                # the previous step's wgmmas have read them (its wait)
                dec[v] = jnp.concatenate(decode_planes(codes, meta, levels), axis=1)
                plgpu.commit_smem()
                planes = dec.at[v]
              else:
                with profile_region("decode", t):
                  planes = decode_planes_prmt(codes_s, meta_s, meta_col, levels,
                                              plane_ordered_rows=plane_ordered_rows)
              def issue(b):
                rows = pl.ds(b * t.mma_rows, t.mma_rows)
                with profile_region("mma", t):  # x's K tile holds the planes side by side, as the joined planes do
                  plgpu.wgmma(accs[b][0], planes, x_s.at[rows].T)

              # an item has rows in the first block of its tile
              issue_blocks(issue, lambda b: rows_in(x_start + b * t.mma_rows, t.mma_rows)[1], len(blocks), t,
                           always_full=len(blocks) == 1)
          return accs

        def compute_context(run):
          @functools.partial(pl.run_scoped, accs=[[plgpu.ACC((WGMMA_M, w_rows), F32) for _ in range(n_w)]
                                                  for _ in blocks])
          def _acc(accs):
            run(accs)
            with profile_region("epilogue", t):
              plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous unit's store has left out_smem
              for b in blocks:
                if fused:
                  a = accs[b][0][...]
                  gate, up = a[:, :t.block_n], a[:, t.block_n:]
                else:
                  gate, up = accs[b][0][...], accs[b][1][...]
                out_smem[wg, pl.ds(b * WGMMA_M, WGMMA_M)] = clamped_swiglu(gate, up, limit).astype(h_g.dtype)
              plgpu.commit_smem()
              _store_rows(out_smem, wg, first - wg_first, h_g, first, rows, cols, t.wg_rows)

        def mma(idx, x_s, *args):
          *w_ss, accs = args

          def issue(b):
            row0 = pl.multiple_of(wg * t.wg_rows + b * WGMMA_M, WGMMA_M)
            with profile_region("mma", t):
              for acc, w_s in zip(accs[b], w_ss):
                plgpu.wgmma(acc, x_s.at[pl.ds(row0, WGMMA_M)], w_s.T)

          issue_blocks(issue, lambda b: rows_in(wg_first + b * WGMMA_M, WGMMA_M)[1], len(blocks), t)
          return accs

        body, context = (lhs_mma, lhs_context) if mix else (mma, compute_context)
        with profile_region("unit", t, "units"):
          pipeline(body, context)(*operands(e, j, x_start), allocations=allocs)

    if mix:  # observe warpgroup 0's last arrival (the barrier's phases must all be seen before it is freed)
      pl.when(wg == 1)(lambda: plgpu.barrier_wait(up_free))

  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _ring_kernel(item_expert, item_x_start, item_lo, item_end, num_items, x_g, *refs, t: Tiling, limit: float,
                 n_tiles: int, d: int, step_tiled: bool, box_rows: int, interpret: bool):
  """The bf16 gate/up over two rings of shared-memory slots, one for x tiles and one for weight tiles, where _kernel
  has one ring of (x, W) slots. The weights stream from HBM and x from L2, and the weight stream was the slower
  (BENCHMARKS.md, session 40), so the copy warpgroup issues step g's weight copies with step g − lag's x copies,
  lag = stages − x_stages: more weight bytes in flight for the same shared memory. One persistent loop over all
  of this SM's (item, N tile) units: the next unit's copies go out under this unit's last steps and epilogue.
  With mma_in_flight a step's wgmmas run on until the next step's are issued; its slots are released one step
  late. A unit's non-empty 64-row blocks are a prefix of its blocks (an item's rows start at most 7 rows into its
  tile), so each count runs its own loop with a static wait and no branch around a wgmma: with such a branch
  ptxas serializes every wgmma (C7511). A weight slot holds W1's and W3's tiles side by side, as interleave's stack
  does: two separate stacks (the model's dense W1 / W3) are two copies into one slot, and each 64-row block is one
  wgmma of width 2 · block_n either way. Step-tiled stacks may hold boxes of fewer rows (box_rows) than a slot's
  share: then each projection is block_n / box_rows copies of neighbouring N tiles (one layout for both rings)."""
  *w_gs, h_g = refs
  n_w = len(w_gs)
  w_rows, bk, sx, sw = 2 * t.block_n, t.block_k, t.x_stages, t.stages
  copy_rows = w_rows // n_w  # a stack's rows in a slot: both projections from an interleaved stack, else one
  boxes = copy_rows // box_rows if step_tiled else 1  # copies per stack and step
  steps, lag = d // bk, t.stages - t.x_stages
  swizzle = plgpu.find_swizzle(bk * jnp.dtype(BF16).itemsize * 8)
  tiles = (plgpu.TilingTransform((ROW_ALIGN, swizzle // jnp.dtype(BF16).itemsize)), plgpu.SwizzleTransform(swizzle))
  blocks = range(t.wg_rows // WGMMA_M)
  scratch = dict(x_s=plgpu.SMEM((sx, t.block_m, bk), x_g.dtype, transforms=tiles),
                 w_s=plgpu.SMEM((sw, w_rows, bk), x_g.dtype, transforms=tiles),
                 out_smem=plgpu.SMEM((2, t.wg_rows, t.block_n), h_g.dtype),
                 x_full=plgpu.Barrier(num_arrivals=1, num_barriers=sx),
                 x_free=plgpu.Barrier(num_arrivals=2, num_barriers=sx),
                 w_full=plgpu.Barrier(num_arrivals=n_w * boxes, num_barriers=sw),
                 w_free=plgpu.Barrier(num_arrivals=2, num_barriers=sw))

  @functools.partial(pl.run_scoped, collective_axes="wg", **scratch)
  def _scope(x_s, w_s, out_smem, x_full, x_free, w_full, w_free):
    wg, sm, num_sms = lax.axis_index("wg"), lax.axis_index("sm"), lax.axis_size("sm")
    local_units = jnp.maximum(num_items[0] * n_tiles - sm + num_sms - 1, 0) // num_sms  # as plgpu.nd_loop deals
    local_steps = local_units * steps

    def unit_of(g):  # (item, N tile, K step) of this SM's step g
      u = sm + num_sms * (g // steps)
      return u // n_tiles, u % n_tiles, g % steps

    def copy_step(g, w_unit, x_unit):  # step g's weight copy and step g - lag's x copy
      @pl.when(g < local_steps)
      def _():
        i, j, k = w_unit
        e, s = item_expert[i], g % sw
        plgpu.barrier_wait(w_free.at[s])
        for p, w_g in enumerate(w_gs):
          if step_tiled:
            for q in range(boxes):
              plgpu.copy_gmem_to_smem(w_g.at[e, j * boxes + q, pl.ds(k * box_rows, box_rows)],
                                      w_s.at[s, pl.ds(p * copy_rows + q * box_rows, box_rows)], w_full.at[s])
          else:
            plgpu.copy_gmem_to_smem(w_g.at[e, pl.ds(j * copy_rows, copy_rows), pl.ds(k * bk, bk)],
                                    w_s.at[s, pl.ds(p * copy_rows, copy_rows)], w_full.at[s])

      @pl.when(g >= lag)
      def _():
        i, _, k = x_unit
        s = (g - lag) % sx
        plgpu.barrier_wait(x_free.at[s])
        # one warp's semantics lower no multiple_of (jax 0.11.2); the rounding shows the lowering the same fact
        x_start = (item_x_start[i] // ROW_ALIGN * ROW_ALIGN if t.copy_warp
                   else pl.multiple_of(item_x_start[i], ROW_ALIGN))
        plgpu.copy_gmem_to_smem(x_g.at[pl.ds(x_start, t.block_m), pl.ds(k * bk, bk)], x_s.at[s], x_full.at[s])

    di, dj = divmod(num_sms, n_tiles)

    def advance(unit):  # the (item, N tile, K step) after `unit` on this SM, without a division
      i, j, k = unit
      j1 = j + dj
      carry = j1 >= n_tiles
      at_end = k + 1 == steps
      j1 = jnp.where(carry, j1 - n_tiles, j1)
      return jnp.where(at_end, i + di + carry.astype(I32), i), jnp.where(at_end, j1, j), jnp.where(at_end, 0, k + 1)

    def copies():
      if t.carried_units:
        def body(g, units):
          w_unit, x_unit = units
          copy_step(g, w_unit, x_unit)
          x_next = advance(x_unit)
          return advance(w_unit), tuple(jnp.where(g >= lag, a, b) for a, b in zip(x_next, x_unit))

        first = (sm // n_tiles, sm % n_tiles, jnp.int32(0))
        lax.fori_loop(0, local_steps + lag, body, (first, first))
      else:
        @pl.loop(0, local_steps + lag)
        def _(g):
          copy_step(g, unit_of(g), unit_of(g - lag))

      for s in range(sw):  # the consumers' last releases
        plgpu.barrier_wait(w_free.at[s])
      for s in range(sx):
        plgpu.barrier_wait(x_free.at[s])

    @pl.when(wg == 2)
    def _():
      if not interpret:
        plgpu.set_max_registers(t.producer_registers, action="decrease")
      if t.copy_warp:
        plgpu.warp_map(lambda warp: pl.when(warp == 0)(copies))
      else:
        copies()

    @pl.when(wg < 2)
    def _():
      if not interpret:
        plgpu.set_max_registers(232, action="increase")
      for s in range(sw):
        plgpu.barrier_arrive(w_free.at[s])
      for s in range(sx):
        plgpu.barrier_arrive(x_free.at[s])

      def release(g):
        plgpu.barrier_arrive(w_free.at[g % sw])
        plgpu.barrier_arrive(x_free.at[g % sx])

      @pl.loop(0, local_units)
      def _(u):
        i, j, _ = unit_of(u * steps)
        x_start, lo, end = pl.multiple_of(item_x_start[i], ROW_ALIGN), item_lo[i], item_end[i]
        wg_first = x_start + wg * t.wg_rows

        def rows_in(first_row, n):  # (first stored row, count) of rows [first_row, first_row + n)
          first = jnp.maximum(first_row, lo)
          return first, jnp.clip(jnp.minimum(first_row + n, end) - first, 0, n)

        nonempty = sum((rows_in(wg_first + b * WGMMA_M, WGMMA_M)[1] > 0).astype(I32) for b in blocks)

        @functools.partial(pl.run_scoped, accs=[plgpu.ACC((WGMMA_M, w_rows), F32) for _ in blocks])
        def _acc(accs):
          with profile_region("unit", t, "units"):
            for nb in range(len(blocks) + 1) if t.skip_empty else (len(blocks),):
              @pl.when((nonempty == nb) if t.skip_empty else True)
              def _(nb=nb):
                @pl.loop(0, steps)
                def _(k):
                  g = u * steps + k
                  plgpu.barrier_wait(w_full.at[g % sw])
                  plgpu.barrier_wait(x_full.at[g % sx])
                  with profile_region("mma", t):
                    for b in range(nb):
                      row0 = pl.multiple_of(wg * t.wg_rows + b * WGMMA_M, WGMMA_M)
                      plgpu.wgmma(accs[b], x_s.at[g % sx, pl.ds(row0, WGMMA_M)], w_s.at[g % sw].T)
                  with profile_region("wait", t):  # in flight: step g − 1's wgmmas are done, its slots free
                    plgpu.wgmma_wait(nb * t.mma_in_flight)
                  if t.mma_in_flight:
                    pl.when(k > 0)(lambda: release(g - 1))
                  else:
                    release(g)

                if t.mma_in_flight:
                  plgpu.wgmma_wait(0)
                  release(u * steps + steps - 1)

            with profile_region("epilogue", t):
              first, rows = rows_in(wg_first, t.wg_rows)
              plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous unit's store has left out_smem
              for b in blocks:
                a = accs[b][...]
                out_smem[wg, pl.ds(b * WGMMA_M, WGMMA_M)] = clamped_swiglu(
                    a[:, :t.block_n], a[:, t.block_n:], limit).astype(h_g.dtype)
              plgpu.commit_smem()
              _store_rows(out_smem, wg, first - wg_first, h_g, first, rows, pl.ds(j * t.block_n, t.block_n),
                          t.wg_rows)

  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def interleave(w1, w3, block_n: int) -> jax.Array:
  """w13 [E, 2I, D]: rows [2j·bn, (2j+1)·bn) are W1's N tile j and the next bn rows W3's, so one TMA copy and one
  wgmma cover both projections of a tile."""
  E, I, D = w1.shape
  return jnp.stack([w1.reshape(E, I // block_n, block_n, D), w3.reshape(E, I // block_n, block_n, D)],
                   axis=2).reshape(E, 2 * I, D)


def tile_by_step(w, rows: int, block_k: int) -> jax.Array:
  """Dense weights [E, N, D] (or interleave's [E, 2I, D]) → [E, N/rows, (D/block_k)·rows, block_k]: the (rows, block_k)
  box of N tile j and K step k is one contiguous run at [e, j, k·rows : (k+1)·rows]. A strided box reads `rows`
  separate 2·block_k-byte pieces of HBM, 2·D bytes apart. Made once per weights (a copy)."""
  E, N, D = w.shape
  if N % rows or D % block_k:
    raise ValueError(f"weights {tuple(w.shape)} do not split into ({rows}, {block_k}) boxes")
  return w.reshape(E, N // rows, rows, D // block_k, block_k).transpose(0, 1, 3, 2, 4).reshape(
      E, N // rows, D // block_k * rows, block_k)


def ring_layout(w) -> jax.Array:
  """A dense stack [E, N, D] as both rings read it contiguously: tile_by_step(w, RING_BOX, RING_BOX)."""
  return tile_by_step(w, RING_BOX, RING_BOX)


def gate_up_wgmma(x, w1, w3, r: Routing, *, swiglu_limit: float, tiling: Tiling = Tiling(), num_sms: int = 132,
                  rows_sorted: bool = False, h_plane_rows: int | None = None, interpret=None) -> jax.Array:
  """h [S·K, I] in sorted-row order (rows >= num_rows unspecified), as gate_up.gate_up. w1/w3: dense [E, I, D]; or
  w3=None and w1 = interleave(w1, w3, tiling.block_n); either also as tile_by_step(·, its box rows, block_k) (each
  step's box contiguous); or two FP2-MIX `MixStack`s (decoded in the kernel, the
  canonical decode's bits). x [S, D], or with `rows_sorted` already sorted_rows(x, r, tiling.block_m) (dense
  weights; to time the kernel without the gather). With `h_plane_rows` (FP2-MIX) h comes as the Mosaic down's
  input, [h_plane_rows, I] in plane_rows order (down_wgmma.plane_rows without its XLA transpose: each unit decodes
  its weight rows in rows_by_plane's order). The routing's own row tile and work list are not used (see
  aligned_items). `interpret`: None (compiled), True or an InterpretGPUParams."""
  t = tiling
  mix = isinstance(w1, MixStack)
  ws = (w1,) if w3 is None else (w1, w3)
  if jnp.dtype(x.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    raise ValueError(f"the wgmma gate/up takes bf16/f16 activations, got {x.dtype}")
  if mix != isinstance(w3, MixStack):
    raise ValueError("w1 and w3 must both be MixStacks or both be dense")
  # block_k 128 hung in the interpreter (a K step would then hold 8 meta bytes a row); only 64 is tested
  if mix and (jnp.dtype(x.dtype) != jnp.dtype(BF16) or rows_sorted or t.block_k != 64
              or x.shape[1] % (META_BOX * rocmfp_layout.HALF)):
    raise ValueError(f"FP2-MIX weights take bf16 x [S, D] (not presorted) with D a multiple of "
                     f"{META_BOX * rocmfp_layout.HALF} (a TMA row of meta bytes), and block_k 64; got "
                     f"{x.dtype} {tuple(x.shape)}, rows_sorted={rows_sorted}, block_k={t.block_k}")
  if not mix and any(w.dtype != x.dtype for w in ws):
    raise ValueError(f"w1/w3 dtypes {[str(w.dtype) for w in ws]} must equal x's {x.dtype} (or be MixStacks)")
  if t.wg_rows % WGMMA_M:
    raise ValueError(f"wg_rows={t.wg_rows} must be a multiple of {WGMMA_M}")
  if t.cluster not in (1, 2):
    raise ValueError(f"cluster must be 1 or 2, got {t.cluster}")
  if mix and (t.block_n != WGMMA_M or t.block_m % t.mma_rows or t.mma_rows % WGMMA_M or t.mma_rows > 256):
    raise ValueError(f"FP2-MIX weights need block_n={WGMMA_M} and mma_rows a multiple of {WGMMA_M} up to 256 "
                     f"dividing block_m; got block_n={t.block_n}, mma_rows={t.mma_rows}, block_m={t.block_m}")
  # in flight, step g's x copy waits for step g − 1's release, which comes after step g's x: one x slot deadlocks
  lowest = 2 if t.mma_in_flight else 1
  if t.x_stages and (mix or t.cluster != 1 or t.tile_order != "n" or not lowest <= t.x_stages <= t.stages):
    raise ValueError(f"x_stages={t.x_stages} (separate x and weight rings) takes bf16 weights, cluster 1, tile_order "
                     f"'n' and {lowest} <= x_stages <= stages={t.stages} (2 with mma_in_flight); got mix={mix}, "
                     f"cluster={t.cluster}, tile_order={t.tile_order!r}")
  if t.mma_in_flight and not t.x_stages:
    raise ValueError("mma_in_flight=1 takes the separate x and weight rings (x_stages > 0): in the pipeline a unit's "
                     "last slot is refilled under its last wgmmas (gate_up_wgmma's docstring)")
  if (t.copy_warp or t.carried_units) and not t.x_stages:
    raise ValueError("copy_warp and carried_units shape the copy loop of the separate x and weight rings "
                     "(x_stages > 0)")
  if t.tile_order not in ("n", "item"):
    raise ValueError(f"tile_order must be 'n' or 'item', got {t.tile_order!r}")
  if t.profile_regions not in ("steps", "units"):
    raise ValueError(f"profile_regions must be 'steps' or 'units', got {t.profile_regions!r}")
  D = x.shape[1]
  step_tiled = not mix and w1.ndim == 4  # tile_by_step's layout
  w_rows = t.block_n * (2 if w3 is None else 1)
  box_rows = w_rows
  if step_tiled:
    # the rings also take separate stacks as ring_layout (boxes of RING_BOX rows: one layout for both rings)
    if t.x_stages and w3 is not None and w_rows % RING_BOX == 0 and D % t.block_k == 0 and (
        w1.shape[2] == D // t.block_k * RING_BOX):
      box_rows = RING_BOX
    want = (w1.shape[0], w1.shape[1], D // t.block_k * box_rows, t.block_k)
    if D % t.block_k or tuple(w1.shape) != want or (w3 is not None and tuple(w3.shape) != want):
      raise ValueError(f"step-tiled w1 {tuple(w1.shape)} / w3 {None if w3 is None else tuple(w3.shape)} must be "
                       f"tile_by_step(w, {w_rows}, {t.block_k}) of [E, N, {D}]: {want} (the rings also take "
                       f"separate stacks as ring_layout, boxes of {RING_BOX} rows)")
    I, Dw = w1.shape[1] * box_rows, D
  else:
    _, I, Dw = w1.shape
  if w3 is None:
    I //= 2
  if Dw != D or (w3 is not None and tuple(w3.shape) != tuple(w1.shape)):  # (a step-tiled shape passed above)
    raise ValueError(f"w1 {tuple(w1.shape)} / w3 {None if w3 is None else tuple(w3.shape)} must be [E, I, D] "
                     f"(or w1 an interleaved [E, 2I, D] and w3 None) with D = {D}")
  if D % t.block_k or I % (t.block_n * t.cluster):
    raise ValueError(f"D={D} / I={I} must be multiples of block_k={t.block_k} / block_n × cluster="
                     f"{t.block_n * t.cluster}")
  plane_ordered_rows = h_plane_rows is not None
  if plane_ordered_rows and (not mix or h_plane_rows < r.num_routes):
    raise ValueError(f"h as plane_rows takes FP2-MIX weights and h_plane_rows >= {r.num_routes} routes; got "
                     f"mix={mix}, h_plane_rows={h_plane_rows}")
  if interpret is True:  # Mosaic GPU's own interpreter (pallas' generic one cannot run its warpgroups)
    interpret = plgpu.InterpretGPUParams()
  items = aligned_items(r, t.block_m)
  out_shape = (h_plane_rows if plane_ordered_rows else r.num_routes, I)
  body = functools.partial(_kernel, max_items=items.expert.shape[0], mix=mix,
                           lhs_in_smem=interpret not in (None, False), plane_ordered_rows=plane_ordered_rows)
  if t.x_stages:
    body = functools.partial(_ring_kernel, box_rows=box_rows, interpret=interpret not in (None, False))
  kernel = plgpu.kernel(
      functools.partial(body, t=t, limit=float(swiglu_limit), n_tiles=I // t.block_n, d=D, step_tiled=step_tiled),
      out_type=jax.ShapeDtypeStruct(out_shape, x.dtype), grid=(num_sms // t.cluster,), grid_names=("sm",),
      cluster=(t.cluster,), cluster_names=("cluster",),
      num_threads=3, thread_name="wg", interpret=interpret, kernel_name=KERNEL_NAME,
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
  gather = functools.partial(gather_rows, x, r, t.block_m, interpret=interpret is not None)
  if mix:
    return kernel(*items, gather(plane_rows=True), *w1, *w3)
  return kernel(*items, x if rows_sorted else gather(), *ws)
