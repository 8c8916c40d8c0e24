# Session probe (issue #18), run by hand on the H200; kept as the record of bf16_hand_pipeline_probe_s36.json.
"""Session probe (issue #18): the bf16 Mosaic gate/up with a hand-rolled warp-specialized loop (one TMA warpgroup, two
MMA warpgroups, a full and a free barrier a slot) instead of emit_pipeline_warp_specialized: is the ~280-cycle
"slot" of a pipeline step the pipeline's own cost? Interleaved W1/W3 stack, w128 n64 (gate_up_wgmma's
w128_n64_s4_i). Usage: python devbf16.py [tokens] (CPU: interpret-mode parity at a small size)."""
import functools, json, os, sys, tempfile
import jax, jax.numpy as jnp, numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from kernels_pallas.moe import gate_up_wgmma as gw, routing
from kernels_pallas.moe.gate_up import clamped_swiglu
from experiments import mosaic_profile

F32, BF16 = jnp.float32, jnp.bfloat16
ON_GPU = jax.default_backend() == "gpu"


def _kernel(item_expert, item_x_start, item_lo, item_end, num_items, x_g, w_g, h_g, *, t, limit, max_items, n_tiles,
            d, interpret, in_flight):
  steps, bk = d // t.block_k, t.block_k
  swizzle = plgpu.find_swizzle(bk * 2 * 8)
  tiles = (plgpu.TilingTransform((gw.ROW_ALIGN, swizzle // 2)), plgpu.SwizzleTransform(swizzle))
  blocks = range(t.wg_rows // gw.WGMMA_M)
  w_rows = 2 * t.block_n
  S = t.stages
  scratch = dict(x_s=plgpu.SMEM((S, t.block_m, bk), BF16, transforms=tiles),
                 w_s=plgpu.SMEM((S, w_rows, bk), BF16, transforms=tiles),
                 out_smem=plgpu.SMEM((2, t.wg_rows, t.block_n), h_g.dtype),
                 full=plgpu.Barrier(num_arrivals=2, num_barriers=S), free=plgpu.Barrier(num_arrivals=2, num_barriers=S))

  @functools.partial(pl.run_scoped, collective_axes="wg", **scratch)
  def _scope(x_s, w_s, out_smem, full, free):
    wg = lax.axis_index("wg")
    count = num_items[0]

    def units(body):
      @plgpu.nd_loop((max_items * n_tiles,), collective_axes="sm")
      def _unit(info):
        (w,) = info.index
        pl.when(w < count * n_tiles)(lambda: body(w // n_tiles, w % n_tiles, info.local_index))

    @pl.when(wg == 2)
    def _():
      if not interpret:
        plgpu.set_max_registers(40, action="decrease")

      def unit(i, j, u):
        e, x_start = item_expert[i], pl.multiple_of(item_x_start[i], gw.ROW_ALIGN)

        @pl.loop(0, steps)
        def _(k):
          s = (u * steps + k) % S
          plgpu.barrier_wait(free.at[s])
          plgpu.copy_gmem_to_smem(x_g.at[pl.ds(x_start, t.block_m), pl.ds(k * bk, bk)], x_s.at[s], full.at[s])
          plgpu.copy_gmem_to_smem(w_g.at[e, pl.ds(j * w_rows, w_rows), pl.ds(k * bk, bk)], w_s.at[s], full.at[s])

      units(unit)
      for s in range(S):
        plgpu.barrier_wait(free.at[s])

    @pl.when(wg < 2)
    def _():
      if not interpret:
        plgpu.set_max_registers(232, action="increase")
      for s in range(S):
        plgpu.barrier_arrive(free.at[s])

      def unit(i, j, u):
        x_start = pl.multiple_of(item_x_start[i], gw.ROW_ALIGN)
        lo, end = item_lo[i], item_end[i]
        wg_first = x_start + wg * t.wg_rows

        def rows_in(first_row, n):
          first = jnp.maximum(first_row, lo)
          return first, jnp.clip(jnp.minimum(first_row + n, end) - first, 0, n)

        @functools.partial(pl.run_scoped, accs=[plgpu.ACC((gw.WGMMA_M, w_rows), F32) for _ in blocks])
        def _acc(accs):
          @pl.loop(0, steps)
          def _(k):
            s = (u * steps + k) % S
            plgpu.barrier_wait(full.at[s])
            for b in blocks:
              def issue(b=b):
                row0 = pl.multiple_of(wg * t.wg_rows + b * gw.WGMMA_M, gw.WGMMA_M)
                with jax.named_scope("mma"):
                  plgpu.wgmma(accs[b], x_s.at[s, pl.ds(row0, gw.WGMMA_M)], w_s.at[s].T)
              if in_flight:  # every block issues: the wait below counts this step's groups
                issue()
              else:
                pl.when(rows_in(wg_first + b * gw.WGMMA_M, gw.WGMMA_M)[1] > 0)(issue)
            with jax.named_scope("wait"):
              plgpu.wgmma_wait(len(blocks) if in_flight else 0)
            if in_flight:  # the previous step's wgmmas are done: release its slot
              pl.when(k > 0)(lambda: plgpu.barrier_arrive(free.at[(u * steps + k + S - 1) % S]))
            else:
              plgpu.barrier_arrive(free.at[s])

          if in_flight:
            plgpu.wgmma_wait(0)
            plgpu.barrier_arrive(free.at[(u * steps + steps - 1) % S])
          with jax.named_scope("epilogue"):
            first, rows = rows_in(wg_first, t.wg_rows)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            for b in blocks:
              a = accs[b][...]
              out_smem[wg, pl.ds(b * gw.WGMMA_M, gw.WGMMA_M)] = clamped_swiglu(a[:, :t.block_n], a[:, t.block_n:],
                                                                               limit).astype(h_g.dtype)
            plgpu.commit_smem()
            store = gw._store_rows  # pylint: disable=protected-access
            store(out_smem, wg, first - wg_first, h_g, first, rows, pl.ds(j * t.block_n, t.block_n), t.wg_rows)

      units(unit)
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def gate_up_hand(xs, w13, r, *, limit, t, num_sms=132, interpret=None, in_flight=False, profile=None):
  D = xs.shape[1]
  E, I2, _ = w13.shape
  items = gw.aligned_items(r, t.block_m)
  params = dict(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)
  if profile:
    params |= dict(profile_space=profile[1], profile_dir=profile[0], profile_bounds_check=True)
  kernel = plgpu.kernel(
      functools.partial(_kernel, t=t, limit=limit, max_items=items.expert.shape[0], n_tiles=I2 // 2 // t.block_n, d=D,
                        interpret=interpret is not None, in_flight=in_flight),
      out_type=jax.ShapeDtypeStruct((r.num_routes, I2 // 2), xs.dtype), grid=(num_sms,), grid_names=("sm",),
      num_threads=3, thread_name="wg", interpret=interpret, kernel_name="moe_gate_up_hand",
      compiler_params=plgpu.CompilerParams(**params))
  return kernel(*items, xs, w13)


if __name__ == "__main__":
  t = gw.Tiling(wg_rows=128, block_n=64, stages=4)
  t3 = gw.Tiling(wg_rows=128, block_n=64, stages=3)  # beside the profiler's buffer (as profile_moe's bf16 run)
  if not ON_GPU:  # parity in interpret mode: small shapes
    E, D, I, S, K = 8, 256, 128, 96, 4
    t = gw.Tiling(wg_rows=64, block_n=64, stages=2)
    interp = plgpu.InterpretGPUParams()
  else:
    E, D, I, S, K = 256, 4096, 2048, int(sys.argv[1]) if len(sys.argv) > 1 else 8192, 6
    interp = None
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((S, D)), BF16)
  w1, w3 = (jnp.asarray(rng.standard_normal((E, I, D)) / np.sqrt(D), BF16) for _ in range(2))
  ids = jnp.asarray(np.stack([rng.permutation(E)[:K] for _ in range(S)]).astype(np.int32))
  r = jax.jit(lambda i: routing.route(i, E, 128))(ids)
  w13 = gw.interleave(w1, w3, t.block_n)
  xs = gw.sorted_rows(x, r, t.block_m)
  n = int(r.num_rows[0])
  ref = jax.jit(lambda xs, w, r: gw.gate_up_wgmma(xs, w, None, r, swiglu_limit=10.0, tiling=t, rows_sorted=True,
                                                    interpret=interp, num_sms=132 if ON_GPU else 3))(xs, w13, r)
  out = {}
  for in_flight in (False, True):
    name = f"hand{'_in_flight' if in_flight else ''}"
    f = jax.jit(lambda xs, w, r, fl=in_flight: gate_up_hand(xs, w, r, limit=10.0, t=t, interpret=interp,
                                                             in_flight=fl, num_sms=132 if ON_GPU else 3))
    try:
      h = f(xs, w13, r)
      eq = bool(np.array_equal(np.asarray(h[:n]).view(np.uint16), np.asarray(ref[:n]).view(np.uint16)))
      out[name] = dict(bitwise_equal_to_gate_up_wgmma=eq)
      if ON_GPU:
        from experiments import timing
        out[name]["ms"] = timing.timeit(f, xs, w13, r, n=10)
        out["gate_up_wgmma_ms"] = timing.timeit(jax.jit(lambda xs, w, r: gw.gate_up_wgmma(
            xs, w, None, r, swiglu_limit=10.0, tiling=t, rows_sorted=True)), xs, w13, r, n=10)
        with tempfile.TemporaryDirectory() as d:
          jax.block_until_ready(jax.jit(lambda xs, w, r, fl=in_flight: gate_up_hand(
              xs, w, r, limit=10.0, t=t3, in_flight=fl, profile=(d, 120)))(xs, w13, r))
          jax.effects_barrier()
          (p,) = [os.path.join(d, q) for q in os.listdir(d) if q.endswith("-trace.json")]
          out[name]["cycles"] = mosaic_profile.step_cycles(json.load(open(p)), 3)
    except Exception as e:  # noqa: BLE001
      out[name] = dict(error=f"{type(e).__name__}: {str(e)[:600]}")
    print(name, out[name], flush=True)
  print(json.dumps(out))
  if os.environ.get("OUT"):
    json.dump(out, open(os.path.join(os.environ["OUT"], "bf16_hand_pipeline_probe.json"), "w"), indent=1)
