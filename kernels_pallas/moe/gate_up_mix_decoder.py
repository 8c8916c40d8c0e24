"""sm_90 FP2-MIX gate/up with a decoding warpgroup (experiment; issue #18): the decode off the MMAs' critical path.

Profiled on the H200 (experiments/profile_moe.py), gate_up_wgmma.py's FP2-MIX kernel spends a pipeline step of
~1450 cycles against ~1024 of tensor-core work: each compute warpgroup decodes its W tile (~480 cycles), issues its
wgmmas and waits for them, one after the other. Here the roles are split between three warpgroups:

    2: feeder   TMA copies of the code and meta tiles (ring `code_slots`) and x planes (ring `stages`); W1's and
                W3's tiles of a step decoded into bf16 planes in shared memory (ring `dec_slots`)
    0, 1: MMA   W1 (0) / W3 (1) planes from shared memory as the wgmma's A operand, x planes as B; then the SwiGLU

so the two MMA warpgroups run like the bf16 kernel while the feeder decodes the next step. (A fourth warpgroup of
its own for the copies leaves 128 registers a thread, too few for a 256-row wgmma's f32 accumulators: ptxas C7602.)
Each ring slot has a full and, where another warpgroup frees it, a free barrier; a step's slot is its index in the
unit mod the ring's size (which divides the unit's K steps, so slots need no count across units). A unit's first
copies are issued when the feeder starts it. The work list, x planes and epilogue are gate_up_wgmma's
(`aligned_items`, `gather_planes`, W3 handed to warpgroup 0 for the SwiGLU): the same bits.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ds4jax.quant import rocmfp_layout
from kernels_pallas.moe import gate_up_wgmma as gw
from kernels_pallas.moe.gate_up import clamped_swiglu
from kernels_pallas.moe.routing import Routing

F32, BF16, U8 = jnp.float32, jnp.bfloat16, jnp.uint8
KERNEL_NAME = "moe_gate_up_mix_decoder"
MMA_WGS, FEEDER = 2, 2  # warpgroups 0 and 1 issue wgmmas; 2 copies and decodes


def _kernel(item_expert, item_x_start, item_lo, item_end, num_items, x_g, c1_g, m1_g, lv1_g, zf1_g, c3_g, m3_g,
            lv3_g, zf3_g, h_g, *, t: gw.Tiling, limit: float, max_items: int, n_tiles: int, d: int,
            code_slots: int, dec_slots: int, interpret: bool):
  bk = t.block_k // gw.PLANES  # code bytes (plane columns) per K step
  steps = d // t.block_k
  per_box = gw.META_BOX // (t.block_k // rocmfp_layout.HALF)  # K steps one meta tile covers
  swizzle = plgpu.find_swizzle(bk * jnp.dtype(BF16).itemsize * 8)
  tiles = (plgpu.TilingTransform((gw.ROW_ALIGN, swizzle // jnp.dtype(BF16).itemsize)), plgpu.SwizzleTransform(swizzle))
  stacks = ((c1_g, m1_g, lv1_g, zf1_g), (c3_g, m3_g, lv3_g, zf3_g))
  blocks = range(t.block_m // t.mma_rows)

  scratch = dict(
      x_s=plgpu.SMEM((t.stages, gw.PLANES, t.block_m, bk), BF16, transforms=tiles),
      code_s=plgpu.SMEM((code_slots, 2, t.block_n, bk), U8),
      meta_s=plgpu.SMEM((code_slots, 2, t.block_n, gw.META_BOX), U8),
      dec=plgpu.SMEM((dec_slots, 2, gw.PLANES, t.block_n, bk), BF16, transforms=tiles),
      out_smem=plgpu.SMEM((1, t.block_m, t.block_n), h_g.dtype),
      up=plgpu.SMEM((len(blocks), t.block_n, t.mma_rows), F32,
                    transforms=(plgpu.TilingTransform((gw.ROW_ALIGN, 32)), plgpu.SwizzleTransform(128))),
      x_full=plgpu.Barrier(num_arrivals=1, num_barriers=t.stages),
      x_free=plgpu.Barrier(num_arrivals=MMA_WGS, num_barriers=t.stages),
      code_full=plgpu.Barrier(num_arrivals=4, num_barriers=code_slots),  # 2 code + 2 meta copies
      dec_full=plgpu.Barrier(num_arrivals=1, num_barriers=dec_slots),
      dec_free=plgpu.Barrier(num_arrivals=MMA_WGS, num_barriers=dec_slots),
      up_ready=plgpu.Barrier(num_arrivals=1), up_free=plgpu.Barrier(num_arrivals=1))

  @functools.partial(pl.run_scoped, collective_axes="wg", **scratch)
  def _scope(x_s, code_s, meta_s, dec, out_smem, up, x_full, x_free, code_full, dec_full, dec_free, up_ready,
             up_free):
    wg = lax.axis_index("wg")
    count = num_items[0]

    def units(body):  # every warpgroup walks the same units: (item, N tile) of this SM
      @plgpu.nd_loop((max_items * n_tiles,), collective_axes="sm")
      def _unit(info):
        (w,) = info.index
        i, j = w // n_tiles, w % n_tiles
        pl.when(w < count * n_tiles)(lambda: body(i, j))

    def free_all(free, n, arrivals):  # every slot starts free: its first wait passes
      for s in range(n):
        for _ in range(arrivals):
          plgpu.barrier_arrive(free.at[s])

    def drain(free, n):  # observe each slot's last release (a barrier's phases must all be seen before it is freed)
      for s in range(n):
        plgpu.barrier_wait(free.at[s])

    @pl.when(wg == FEEDER)
    def _():
      def unit(i, j):
        e, x_start = item_expert[i], pl.multiple_of(item_x_start[i], gw.ROW_ALIGN)
        rows = pl.ds(j * t.block_n, t.block_n)
        sides = [([[lv[e, s, q] for q in range(4)] for s in range(2)], zf[e]) for _, _, lv, zf in stacks]

        def copy_codes(k):  # this feeder alone reads the code slots: no barrier frees them
          for v, (c_g, m_g, _, _) in enumerate(stacks):
            plgpu.copy_gmem_to_smem(c_g.at[e, rows, pl.ds(k * bk, bk)], code_s.at[k % code_slots, v],
                                    code_full.at[k % code_slots])
            plgpu.copy_gmem_to_smem(m_g.at[e, rows, pl.ds(k // per_box * gw.META_BOX, gw.META_BOX)],
                                    meta_s.at[k % code_slots, v], code_full.at[k % code_slots])

        def copy_x(k):
          plgpu.barrier_wait(x_free.at[k % t.stages])
          plgpu.copy_gmem_to_smem(x_g.at[:, pl.ds(x_start, t.block_m), pl.ds(k * bk, bk)], x_s.at[k % t.stages],
                                  x_full.at[k % t.stages])

        for k in range(code_slots):
          copy_codes(k)
        copy_x(0)

        @pl.loop(0, steps)
        def _(k):
          cs, ds_ = k % code_slots, k % dec_slots
          meta_col = k % per_box * (t.block_k // rocmfp_layout.HALF)
          plgpu.barrier_wait(code_full.at[cs])
          planes = []
          for v in range(2):
            levels, flagged = sides[v]
            if interpret:  # the interpreter runs no inline code: decode_planes' jnp (the same bits)
              meta = meta_s[cs, v, :, pl.ds(meta_col, t.block_k // rocmfp_layout.HALF)]
              meta = jnp.repeat(meta, rocmfp_layout.HALF // gw.PLANES, axis=1)
              planes.append(gw.decode_planes(code_s[cs, v], meta, levels, flagged))
            else:
              planes.append(gw.decode_planes_prmt(code_s[cs, v], meta_s.at[cs, v], meta_col, levels, flagged))
          plgpu.barrier_wait(dec_free.at[ds_])
          for v in range(2):
            for q in range(gw.PLANES):
              dec[ds_, v, q] = planes[v][q]
          plgpu.commit_smem()  # the planes written and this slot's codes read, before TMA and wgmma use them
          plgpu.barrier_arrive(dec_full.at[ds_])
          pl.when(k + code_slots < steps)(lambda: copy_codes(k + code_slots))
          pl.when(k + 1 < steps)(lambda: copy_x(k + 1))  # after the step's planes: the MMAs never wait on it

      units(unit)
      drain(x_free, t.stages)
      drain(dec_free, dec_slots)

    @pl.when(wg < MMA_WGS)
    def _():
      free_all(x_free, t.stages, 1)
      free_all(dec_free, dec_slots, 1)
      pl.when(wg == 0)(lambda: plgpu.barrier_arrive(up_free))  # the first unit's up buffer is free

      def unit(i, j):
        x_start = pl.multiple_of(item_x_start[i], gw.ROW_ALIGN)
        lo, end = item_lo[i], item_end[i]
        cols = pl.ds(j * t.block_n, t.block_n)

        def rows_in(first_row, n):  # (first stored row, count) of rows [first_row, first_row + n)
          first = jnp.maximum(first_row, lo)
          return first, jnp.clip(jnp.minimum(first_row + n, end) - first, 0, n)

        @functools.partial(pl.run_scoped, accs=[plgpu.ACC((t.block_n, t.mma_rows), F32) for _ in blocks])
        def _acc(accs):
          @pl.loop(0, steps)
          def _(k):
            xs, ds_ = k % t.stages, k % dec_slots
            plgpu.barrier_wait(x_full.at[xs])
            plgpu.barrier_wait(dec_full.at[ds_])
            for v in range(2):
              @pl.when(wg == v)
              def _(v=v):
                for b in blocks:
                  def issue(b=b):
                    rows = pl.ds(b * t.mma_rows, t.mma_rows)
                    for q in range(gw.PLANES):
                      plgpu.wgmma(accs[b], dec.at[ds_, v, q], x_s.at[xs, q, rows].T)
                  if t.skip_empty:
                    pl.when(rows_in(x_start + b * t.mma_rows, t.mma_rows)[1] > 0)(issue)
                  else:
                    issue()
                plgpu.wgmma_wait(0)
            plgpu.barrier_arrive(x_free.at[xs])
            plgpu.barrier_arrive(dec_free.at[ds_])

          chunks = range(0, t.mma_rows, gw.WGMMA_M)

          @pl.when(wg == 1)
          def _():
            plgpu.barrier_wait(up_free)  # warpgroup 0 has read the previous unit's
            for b in blocks:
              a = accs[b][...]
              for c in chunks:
                up[b, :, pl.ds(c, gw.WGMMA_M)] = a[:, c:c + gw.WGMMA_M]
            plgpu.commit_smem()
            plgpu.barrier_arrive(up_ready)

          @pl.when(wg == 0)
          def _():
            first, count_rows = rows_in(x_start, t.block_m)
            plgpu.barrier_wait(up_ready)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous unit's store has left out_smem
            for b in blocks:
              gate = accs[b][...]
              for c in chunks:
                h = clamped_swiglu(gate[:, c:c + gw.WGMMA_M], up[b, :, pl.ds(c, gw.WGMMA_M)], limit).astype(h_g.dtype)
                out_smem.at[0, pl.ds(b * t.mma_rows + c, gw.WGMMA_M)].T[...] = h
            plgpu.barrier_arrive(up_free)
            plgpu.commit_smem()
            store = gw._store_rows  # pylint: disable=protected-access
            store(out_smem, 0, first - x_start, h_g, first, count_rows, cols, t.block_m)

      units(unit)
      pl.when(wg == 1)(lambda: plgpu.barrier_wait(up_free))  # observe warpgroup 0's last arrival
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def gate_up_mix_decoder(x, w1: gw.MixStack, w3: gw.MixStack, r: Routing, *, swiglu_limit: float,
                        tiling: gw.Tiling = gw.MIX_TILING, code_slots: int = 4, dec_slots: int = 2,
                        num_sms: int = 132, interpret=None) -> jax.Array:
  """h [S·K, I] in sorted-row order, as gate_up_wgmma.gate_up_wgmma on FP2-MIX stacks (the same bits). The rings'
  sizes (`stages` for x, code_slots, dec_slots) must divide the K steps."""
  t = tiling
  D = x.shape[1]
  E, I, _ = w1.shape
  steps = D // t.block_k
  if t.block_n != gw.WGMMA_M or t.block_k != 64 or D % (gw.META_BOX * rocmfp_layout.HALF):
    raise ValueError(f"needs block_n {gw.WGMMA_M}, block_k 64 and D a multiple of "
                     f"{gw.META_BOX * rocmfp_layout.HALF}; got {t.block_n}, {t.block_k}, D={D}")
  if any(steps % n for n in (t.stages, code_slots, dec_slots)):
    raise ValueError(f"stages {t.stages}, code_slots {code_slots} and dec_slots {dec_slots} must divide the "
                     f"{steps} K steps")
  if interpret is True:
    interpret = plgpu.InterpretGPUParams()
  items = gw.aligned_items(r, t.block_m)
  kernel = plgpu.kernel(
      functools.partial(_kernel, t=t, limit=float(swiglu_limit), max_items=items.expert.shape[0],
                        n_tiles=I // t.block_n, d=D, code_slots=code_slots, dec_slots=dec_slots,
                        interpret=interpret is not None),
      out_type=jax.ShapeDtypeStruct((r.num_routes, I), x.dtype), grid=(num_sms,), grid_names=("sm",),
      num_threads=3, thread_name="wg", interpret=interpret, kernel_name=KERNEL_NAME,
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
  x_planes = gw.gather_planes(x, r, t.block_m, interpret=interpret is not None)
  return kernel(*items, x_planes, *w1, *w3)
