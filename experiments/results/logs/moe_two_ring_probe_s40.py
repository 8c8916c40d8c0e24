# Session probe (issue #18), run by hand on the H200; kept as the record of moe_two_ring_probe_s40.json. The kernel
# became gate_up_wgmma._ring_kernel (Tiling.x_stages).
"""Session probe (issue #18): the bf16 gate/up with separate shared-memory rings for x and for W1/W3, so that more
weight bytes are in flight than x bytes. Sessions 39/40 found the kernel bound by its copies, and the weight
stream (HBM) at ~3.1-3.4 TB/s with 4 slots of 16 KB an SM, where x comes from L2. Here the producer runs the weight
copies `sw - sx` steps ahead of the x copies, over a ring of `sw` weight slots and `sx` x slots, persistent across
units (a unit's first copies are issued during the previous unit's last steps and epilogue).
Modes: "kernel" (the gate/up; its h must equal gate_up_wgmma's bit for bit), "copies" (the same copies, no MMA),
"w_copies" (weights only). Usage: python devring.py [tokens] (CPU: interpret-mode parity at a small size)."""
import functools, json, os, sys
import jax, jax.numpy as jnp, numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from kernels_pallas.moe import gate_up_wgmma as gw, routing
from kernels_pallas.moe.gate_up import clamped_swiglu

F32, BF16 = jnp.float32, jnp.bfloat16
ON_GPU = jax.default_backend() == "gpu"


def _kernel(item_expert, item_x_start, item_lo, item_end, num_items, x_g, w_g, h_g, *, t, limit, max_items, n_tiles,
            d, sx, sw, mode, step_tiled, num_sms, interpret, in_flight):
  steps, bk = d // t.block_k, t.block_k
  swizzle = plgpu.find_swizzle(bk * 2 * 8)
  tiles = (plgpu.TilingTransform((gw.ROW_ALIGN, swizzle // 2)), plgpu.SwizzleTransform(swizzle))
  blocks = range(t.wg_rows // gw.WGMMA_M)
  w_rows = 2 * t.block_n
  copy_x, mma = mode != "w_copies", mode == "kernel"
  lag = sw - sx if copy_x else 0
  scratch = dict(w_s=plgpu.SMEM((sw, w_rows, bk), BF16, transforms=tiles),
                 w_full=plgpu.Barrier(num_arrivals=1, num_barriers=sw),
                 w_free=plgpu.Barrier(num_arrivals=2, num_barriers=sw))
  if copy_x:
    scratch |= dict(x_s=plgpu.SMEM((sx, t.block_m, bk), BF16, transforms=tiles),
                    x_full=plgpu.Barrier(num_arrivals=1, num_barriers=sx),
                    x_free=plgpu.Barrier(num_arrivals=2, num_barriers=sx))
  if mma:
    scratch["out_smem"] = plgpu.SMEM((2, t.wg_rows, t.block_n), h_g.dtype)

  @functools.partial(pl.run_scoped, collective_axes="wg", **scratch)
  def _scope(w_s, w_full, w_free, x_s=None, x_full=None, x_free=None, out_smem=None):
    wg, sm = lax.axis_index("wg"), lax.axis_index("sm")
    total = num_items[0] * n_tiles
    local_units = jnp.maximum(total - sm + num_sms - 1, 0) // num_sms  # nd_loop's units for this SM
    local_steps = local_units * steps

    def unit_of(g):  # (item, N tile, K step) of this SM's global step g
      w = sm + num_sms * (g // steps)
      return w // n_tiles, w % n_tiles, g % steps

    @pl.when(wg == 2)
    def _():
      if not interpret:
        plgpu.set_max_registers(40, action="decrease")

      @pl.loop(0, local_steps + lag)
      def _(g):
        @pl.when(g < local_steps)
        def _():
          i, j, k = unit_of(g)
          s = g % sw
          plgpu.barrier_wait(w_free.at[s])
          e = item_expert[i]
          src = (w_g.at[e, j, pl.ds(k * w_rows, w_rows)] if step_tiled
                 else w_g.at[e, pl.ds(j * w_rows, w_rows), pl.ds(k * bk, bk)])
          plgpu.copy_gmem_to_smem(src, w_s.at[s], w_full.at[s])

        if copy_x:
          @pl.when(g >= lag)
          def _():
            gx = g - lag
            i, _, k = unit_of(gx)
            s = gx % sx
            plgpu.barrier_wait(x_free.at[s])
            x_start = pl.multiple_of(item_x_start[i], gw.ROW_ALIGN)
            plgpu.copy_gmem_to_smem(x_g.at[pl.ds(x_start, t.block_m), pl.ds(k * bk, bk)], x_s.at[s], x_full.at[s])

      for s in range(sw):
        plgpu.barrier_wait(w_free.at[s])
      for s in range(sx if copy_x else 0):
        plgpu.barrier_wait(x_free.at[s])

    @pl.when(wg < 2)
    def _():
      if not interpret:
        plgpu.set_max_registers(232, action="increase")
      for s in range(sw):
        plgpu.barrier_arrive(w_free.at[s])
      for s in range(sx if copy_x else 0):
        plgpu.barrier_arrive(x_free.at[s])

      def step_slots(g):
        plgpu.barrier_wait(w_full.at[g % sw])
        if copy_x:
          plgpu.barrier_wait(x_full.at[g % sx])

      def release(g):
        plgpu.barrier_arrive(w_free.at[g % sw])
        if copy_x:
          plgpu.barrier_arrive(x_free.at[g % sx])

      if not mma:
        @pl.loop(0, local_steps)
        def _(g):
          step_slots(g)
          release(g)
        return

      @pl.loop(0, local_units)
      def _(u):
        i, j, _ = unit_of(u * steps)
        x_start = pl.multiple_of(item_x_start[i], gw.ROW_ALIGN)
        lo, end = item_lo[i], item_end[i]
        wg_first = x_start + wg * t.wg_rows

        def rows_in(first_row, n):
          first = jnp.maximum(first_row, lo)
          return first, jnp.clip(jnp.minimum(first_row + n, end) - first, 0, n)

        @functools.partial(pl.run_scoped, accs=[plgpu.ACC((gw.WGMMA_M, w_rows), F32) for _ in blocks])
        def _acc(accs):
          def issue(g, b):
            row0 = pl.multiple_of(wg * t.wg_rows + b * gw.WGMMA_M, gw.WGMMA_M)
            plgpu.wgmma(accs[b], x_s.at[g % sx, pl.ds(row0, gw.WGMMA_M)], w_s.at[g % sw].T)

          if not in_flight:
            @pl.loop(0, steps)
            def _(k):
              g = u * steps + k
              step_slots(g)
              for b in blocks:
                pl.when(rows_in(wg_first + b * gw.WGMMA_M, gw.WGMMA_M)[1] > 0)(functools.partial(issue, g, b))
              plgpu.wgmma_wait(0)
              release(g)
          else:
            # A unit's non-empty 64-row blocks are a prefix of its blocks (an item's rows start at most 7 rows into
            # it), so one static count per unit: no branch around a wgmma inside the loop, and a static wait that
            # leaves this step's groups in flight while the next step's slots are waited for.
            nonempty = sum((rows_in(wg_first + b * gw.WGMMA_M, gw.WGMMA_M)[1] > 0).astype(jnp.int32) for b in blocks)
            for nb in range(len(blocks) + 1):
              @pl.when(nonempty == nb)
              def _(nb=nb):
                @pl.loop(0, steps)
                def _(k):
                  g = u * steps + k
                  step_slots(g)
                  for b in range(nb):
                    issue(g, b)
                  plgpu.wgmma_wait(nb)
                  pl.when(k > 0)(lambda: release(g - 1))
                plgpu.wgmma_wait(0)
                release(u * steps + steps - 1)

          first, rows = rows_in(wg_first, t.wg_rows)
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          for b in blocks:
            a = accs[b][...]
            out_smem[wg, pl.ds(b * gw.WGMMA_M, gw.WGMMA_M)] = clamped_swiglu(a[:, :t.block_n], a[:, t.block_n:],
                                                                             limit).astype(h_g.dtype)
          plgpu.commit_smem()
          gw._store_rows(out_smem, wg, first - wg_first, h_g, first, rows,  # pylint: disable=protected-access
                         pl.ds(j * t.block_n, t.block_n), t.wg_rows)

      plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def gate_up_rings(xs, w13, r, *, limit, t, sx, sw, mode="kernel", num_sms=132, interpret=None, in_flight=False):
  """w13: interleave's [E, 2I, D], or tile_by_step(interleave(...), 2 block_n, block_k)."""
  D = xs.shape[1]
  step_tiled = w13.ndim == 4
  I2 = w13.shape[1] * 2 * t.block_n if step_tiled else w13.shape[1]
  items = gw.aligned_items(r, t.block_m)
  kernel = plgpu.kernel(
      functools.partial(_kernel, t=t, limit=limit, max_items=items.expert.shape[0], n_tiles=I2 // 2 // t.block_n, d=D,
                        sx=sx, sw=sw, mode=mode, step_tiled=step_tiled, num_sms=num_sms,
                        interpret=interpret is not None, in_flight=in_flight),
      out_type=jax.ShapeDtypeStruct((r.num_routes, I2 // 2), xs.dtype), grid=(num_sms,), grid_names=("sm",),
      num_threads=3, thread_name="wg", interpret=interpret, kernel_name=f"moe_gate_up_rings_{mode}",
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
  return kernel(*items, xs, w13)


if __name__ == "__main__":
  tilings = {"w128_n64": gw.Tiling(wg_rows=128, block_n=64), "w64_n128": gw.Tiling(wg_rows=64, block_n=128),
             "w128_n64_k128": gw.Tiling(wg_rows=128, block_n=64, block_k=128)}
  ref_of = {"w128_n64_k128": "w128_n64"}  # the gate_up_wgmma tiling whose h a variant must equal bit for bit
  if not ON_GPU:  # parity in interpret mode: small shapes
    E, D, I, S, K = (8, 256, 128, 96, 4) if len(sys.argv) < 2 else (4, 256, 128, 200, 2)
    tilings = {"w64_n64": gw.Tiling(wg_rows=64, block_n=64), "w64_n64_k128": gw.Tiling(wg_rows=64, block_n=64,
                                                                                           block_k=128),
               "w128_n64": gw.Tiling(wg_rows=128, block_n=64)}
    ref_of = {"w64_n64_k128": "w64_n64"}
    variants = [("w64_n64", "kernel", 2, 3, False, False), ("w64_n64", "kernel", 2, 2, True, False),
                ("w64_n64", "kernel", 2, 3, False, True), ("w64_n64_k128", "kernel", 2, 2, True, True),
                ("w64_n64", "copies", 1, 3, False, False), ("w64_n64", "w_copies", 1, 3, True, False)]
    if len(sys.argv) > 1:  # 100 rows an expert: two-block warpgroups with 0, 1 or 2 non-empty blocks
      variants = [("w128_n64", "kernel", 2, 3, False, True), ("w128_n64", "kernel", 2, 3, True, False)]
    interp, sms = plgpu.InterpretGPUParams(), 3
  else:
    E, D, I, S, K = 256, 4096, 2048, int(sys.argv[1]) if len(sys.argv) > 1 else 8192, 6
    variants = [
        ("w128_n64", "kernel", 4, 4, False, False), ("w128_n64", "kernel", 3, 6, True, False),
        ("w128_n64", "kernel", 4, 4, False, True), ("w128_n64", "kernel", 3, 6, True, True),
        ("w128_n64", "kernel", 4, 5, True, True),
        ("w128_n64_k128", "kernel", 2, 2, True, False), ("w128_n64_k128", "kernel", 2, 2, True, True),
        ("w128_n64", "copies", 4, 4, False, False), ("w128_n64", "copies", 3, 6, True, False),
        ("w64_n128", "kernel", 3, 4, True, True), ("w64_n128", "kernel", 4, 4, False, True),
        ("w64_n128", "kernel", 4, 4, True, True), ("w64_n128", "kernel", 2, 5, True, True),
        ("w128_n64", "kernel", 4, 4, True, True)]
    if len(sys.argv) > 2:
      variants = [v for v in variants if f"{v[0]}_{v[1]}_x{v[2]}_w{v[3]}{'_t' if v[4] else ''}{'_f' if v[5] else ''}"
                  in sys.argv[2].split(",")]
    interp, sms = None, 132
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((S, D)), BF16)
  w1, w3 = (jnp.asarray(rng.standard_normal((E, I, D)) / np.sqrt(D), BF16) for _ in range(2))
  ids = jnp.asarray(np.stack([rng.permutation(E)[:K] for _ in range(S)]).astype(np.int32))
  r = jax.jit(lambda i: routing.route(i, E, 128))(ids)
  n = int(r.num_rows[0])
  out = dict(tokens=S)
  if ON_GPU:
    from experiments import timing
  refs = {}
  for tn, mode, sx, sw, tiled, in_flight in variants:
    t = tilings[tn]
    name = f"{tn}_{mode}_x{sx}_w{sw}{'_t' if tiled else ''}{'_f' if in_flight else ''}"
    try:
      w13 = gw.interleave(w1, w3, t.block_n)
      xs = gw.sorted_rows(x, r, t.block_m)
      rn = ref_of.get(tn, tn)
      if rn not in refs:
        ref_f = jax.jit(lambda xs, w, r, t=tilings[rn]: gw.gate_up_wgmma(
            xs, w, None, r, swiglu_limit=10.0, tiling=t, rows_sorted=True, interpret=interp, num_sms=sms))
        refs[rn] = np.asarray(ref_f(xs, w13, r)[:n])
        if ON_GPU:
          out[f"{rn}_gate_up_wgmma_ms"] = timing.timeit(ref_f, xs, w13, r, n=10)
          print(rn, "gate_up_wgmma", out[f"{rn}_gate_up_wgmma_ms"], flush=True)
      w_in = gw.tile_by_step(w13, 2 * t.block_n, t.block_k) if tiled else w13
      f = jax.jit(lambda xs, w, r, t=t, mode=mode, sx=sx, sw=sw, fl=in_flight: gate_up_rings(
          xs, w, r, limit=10.0, t=t, sx=sx, sw=sw, mode=mode, interpret=interp, num_sms=sms, in_flight=fl))
      h = f(xs, w_in, r)
      res = {}
      if mode == "kernel":
        got = np.asarray(h[:n])
        res["bitwise_equal_to_gate_up_wgmma"] = bool(np.array_equal(got.view(np.uint16), refs[rn].view(np.uint16)))
        res["max_abs_diff"] = float(np.abs(got.astype(np.float32) - refs[rn].astype(np.float32)).max())
      if ON_GPU:
        res["ms"] = timing.timeit(f, xs, w_in, r, n=10)
        units = int(gw.aligned_items(r, t.block_m).count[0]) * (I // t.block_n)
        step_bytes = (mode != "w_copies") * t.block_m * t.block_k * 2 + 2 * t.block_n * t.block_k * 2
        res["tb_per_s"] = units * (D // t.block_k) * step_bytes / 1e12 / (res["ms"] / 1e3)
      out[name] = res
    except Exception as e:  # noqa: BLE001
      out[name] = dict(error=f"{type(e).__name__}: {str(e)[:600]}")
    print(name, out[name], flush=True)
  print(json.dumps(out))
  if os.environ.get("OUT"):
    json.dump(out, open(os.path.join(os.environ["OUT"], f"moe_two_ring_probe_{S}.json"), "w"), indent=1)
