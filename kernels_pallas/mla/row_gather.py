"""Selected KV rows gathered into shared memory for sm_90 wgmma, in Pallas Mosaic GPU: the first piece of a
head-batched sparse MLA kernel for Hopper (issue #19; the design and its sources: docs/mla_mosaic.md).

Each query of a CSA layer reads its own ~640 rows of the KV latent ([rows, 512] bf16, 1 KiB a row), chosen by
index. On sm_90 none of Mosaic GPU's copies can gather them into the tiled, swizzled layout wgmma reads: TMA's
row gather (`gather4`) is sm_100 only, Mosaic's cp.async copy takes contiguous 8-row blocks, and a Pallas store
into a tiled ref must cover whole 8-row tiles. So the 128 threads of one warpgroup issue the copies themselves
(`gather_rows`, an `inline_mgpu` block), as FlashMLA's SM90 sparse prefill does: 16-byte `cp.async.cg` copies
straight into the layout of `TILED` ((8, 64) tiles of 1 KiB, whose 16-byte chunk c of row r sits at chunk
c ^ (r mod 8)). Thread t moves chunk t mod 8 of rows t // 8 + 16k, k < 4, for every 64-column tile: a 64-row
call issues 4 · D/64 copies per thread. `wait_gathered` then waits for this thread's copies and fences them for
the async proxy (wgmma, TMA) before the thread arrives on a barrier (one that counts all 128 arrivals).

`chunk_offsets` is the address arithmetic, written once for Python ints (tests) and for the kernel's IR.
A negative id gathers a zero row (a masked key slot): cp.async's source size is 0 there, so nothing is read.
`gather_check` is a kernel that gathers rows and stores them back by TMA: on a GPU it must equal kv[idx], with zero
rows for negative ids.
Compiled only: inline code has no interpreter (a kernel built on this takes pre-gathered rows there).
"""

from __future__ import annotations

import operator

import jax
import jax.numpy as jnp
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, llvm, memref, nvvm
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

ROWS = 64  # rows per gather_rows call: 16 groups of 8 threads, 4 rows each
TILE = (8, 64)  # bf16: 8 rows of 128 bytes, one swizzle block
CHUNK = 8  # bf16 per 16-byte copy
TILED = (plgpu.TilingTransform(TILE), plgpu.SwizzleTransform(128))
THREADS = 128
GROUP = TILE[1] // CHUNK  # threads sharing a row: one chunk of each 64-column tile each

_PY = dict(add=operator.add, mul=operator.mul, div=operator.floordiv, rem=operator.mod, xor=operator.xor)


def chunk_offsets(thread, k: int, j: int, token, d: int, ops=_PY):
  """(row of the tile, source element offset, destination element offset) of thread `thread`'s copy k (row
  thread // 8 + 16k) of column tile j, for a source row `token` of width d. `ops`: integer add/mul/div/rem/xor on
  Python ints (default) or on IR values."""
  add, mul, div, rem, xor = (ops[n] for n in ("add", "mul", "div", "rem", "xor"))
  chunk, row = rem(thread, GROUP), add(div(thread, GROUP), THREADS // GROUP * k)
  src = add(mul(token, d), add(mul(chunk, CHUNK), TILE[1] * j))
  tile = add(mul(div(row, TILE[0]), d // TILE[1]), j)  # tiles are row-major: (row tile, column tile)
  in_tile = add(mul(rem(row, TILE[0]), TILE[1]), mul(xor(chunk, rem(row, TILE[0])), CHUNK))  # the swizzle
  dst = add(mul(tile, TILE[0] * TILE[1]), in_tile)
  return row, src, dst


def _ir_ops():
  i32 = ir.IntegerType.get_signless(32)
  val = lambda a: arith.constant(i32, a) if isinstance(a, int) else a
  binary = lambda f: lambda a, b: f(val(a), val(b))
  return dict(add=binary(arith.addi), mul=binary(arith.muli), div=binary(arith.divui), rem=binary(arith.remui),
              xor=binary(arith.xori))


@plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(), plgpu.RefType(transforms=TILED)))
def gather_rows(_, kv, idx, dst):
  """dst [64, d] (TILED, shared memory) ← kv[idx] (kv [n, d] bf16 in global memory, idx [64] int32 < n), with
  zero rows where idx < 0. Issued by every thread of one warpgroup; the copies are in flight until
  `wait_gathered`."""
  i32, index, bf16 = ir.IntegerType.get_signless(32), ir.IndexType.get(), ir.BF16Type.get()
  d = ir.MemRefType(kv.type).shape[1]
  ops = _ir_ops()
  thread = arith.remui(mgpu_utils.thread_idx(), arith.constant(i32, THREADS))
  # cp.async takes a global-space pointer; the memref's is generic (as Mosaic's own cp.async copy casts it)
  src_base = llvm.addrspacecast(llvm.PointerType.get(address_space=1), mgpu_utils.memref_ptr(kv))
  dst_base = mgpu_utils.memref_ptr(dst)
  zero = arith.constant(i32, 0)
  for k in range(ROWS * GROUP // THREADS):
    row = ops["add"](ops["div"](thread, GROUP), THREADS // GROUP * k)
    token = memref.load(idx, [arith.index_cast(index, row)])
    # a negative id is a masked key: its chunks are zero-filled (cp.async reads 0 of the 16 bytes, from row 0's
    # address), so whatever lies at or before the table cannot reach p·V as 0 × NaN
    live = arith.cmpi(arith.CmpIPredicate.sge, token, zero)
    token, read = arith.select(live, token, zero), arith.select(live, arith.constant(i32, 16), zero)
    for j in range(d // TILE[1]):
      _, src, dst_off = chunk_offsets(thread, k, j, token, d, ops)
      nvvm.cp_async_shared_global(mgpu_utils.getelementptr(dst_base, [dst_off], bf16),
                                  mgpu_utils.getelementptr(src_base, [src], bf16), 16,
                                  nvvm.LoadCacheModifierKind.CG, cp_size=read)
  nvvm.cp_async_commit_group()


@plgpu.inline_mgpu()
def wait_gathered(_):
  """This thread's gather_rows copies have landed and are visible to wgmma and TMA (the async proxy)."""
  nvvm.cp_async_wait_group(0)
  nvvm.fence_proxy(nvvm.ProxyKind.async_shared, space=nvvm.SharedSpace.shared_cta)


def gather_check(kv, idx) -> jax.Array:
  """kv[idx] through shared memory, zero rows where idx < 0: gather_rows 64 rows at a time into a TILED buffer,
  then TMA copies out (which un-swizzle). kv [n, d] bf16 with d a multiple of 64, idx [m] int32 < n with m a
  multiple of 64."""
  n, d = kv.shape
  m = idx.shape[0]
  if kv.dtype != jnp.bfloat16 or d % TILE[1] or m % ROWS:
    raise ValueError(f"gather_check takes bf16 kv [n, d] with d a multiple of {TILE[1]} and {ROWS}·k indices; got "
                     f"{kv.dtype} {tuple(kv.shape)}, {m} indices")

  def body(kv_g, idx_g, out_g, rows_s):
    for b in range(m // ROWS):
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous block has left the buffer
      gather_rows(kv_g, idx_g.at[pl.ds(b * ROWS, ROWS)], rows_s)
      wait_gathered()
      plgpu.copy_smem_to_gmem(rows_s, out_g.at[pl.ds(b * ROWS, ROWS)])
    plgpu.wait_smem_to_gmem(0)

  return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((m, d), kv.dtype),
                      scratch_types=[plgpu.SMEM((ROWS, d), kv.dtype, transforms=TILED)],
                      kernel_name="mla_row_gather_check",
                      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)
                      )(kv, idx)
