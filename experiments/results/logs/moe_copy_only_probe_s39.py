"""Session probe (issue #18): is the bf16 Mosaic gate/up bound by its TMA copies? The same copies as the hand-rolled
gate/up of devbf16.py (an x tile of block_m rows and a W1/W3 tile of 2 x block_n rows per 64-wide K step, per
(item, N tile) unit, N tiles fastest), with no MMA: the consumers wait for each slot and release it. Variants copy
both tiles, x only or w only. If copying alone takes ~the gate/up's 3.4 ms, the kernel is bound by data movement
from L2; if it takes much less, by something else. Usage: python devcopy.py [tokens] (CPU: interpret mode, small)."""
import functools, json, os, sys
import jax, jax.numpy as jnp, numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from kernels_pallas.moe import gate_up_wgmma as gw, routing

BF16 = jnp.bfloat16
ON_GPU = jax.default_backend() == "gpu"


def _kernel(item_expert, item_x_start, item_lo, item_end, num_items, x_g, w_g, out_g, *, t, max_items, n_tiles, d,
            copies):
  del item_lo, item_end, out_g  # never written: a custom call's result that jit returns is not removed
  steps, bk = d // t.block_k, t.block_k
  swizzle = plgpu.find_swizzle(bk * 2 * 8)
  tiles = (plgpu.TilingTransform((gw.ROW_ALIGN, swizzle // 2)), plgpu.SwizzleTransform(swizzle))
  w_rows, S = 2 * t.block_n, t.stages
  scratch = dict(x_s=plgpu.SMEM((S, t.block_m, bk), BF16, transforms=tiles),
                 w_s=plgpu.SMEM((S, w_rows, bk), BF16, transforms=tiles),
                 full=plgpu.Barrier(num_arrivals=("x" in copies) + ("w" in copies), num_barriers=S),
                 free=plgpu.Barrier(num_arrivals=2, num_barriers=S))

  @functools.partial(pl.run_scoped, collective_axes="wg", **scratch)
  def _scope(x_s, w_s, full, free):
    wg = lax.axis_index("wg")
    count = num_items[0]

    def units(body):
      @plgpu.nd_loop((max_items * n_tiles,), collective_axes="sm")
      def _unit(info):
        (w,) = info.index
        pl.when(w < count * n_tiles)(lambda: body(w // n_tiles, w % n_tiles, info.local_index))

    @pl.when(wg == 2)
    def _():
      def unit(i, j, u):
        e, x_start = item_expert[i], pl.multiple_of(item_x_start[i], gw.ROW_ALIGN)

        @pl.loop(0, steps)
        def _(k):
          s = (u * steps + k) % S
          plgpu.barrier_wait(free.at[s])
          if "x" in copies:
            plgpu.copy_gmem_to_smem(x_g.at[pl.ds(x_start, t.block_m), pl.ds(k * bk, bk)], x_s.at[s], full.at[s])
          if "w" in copies:  # "tiled": W1/W3 stored tile by tile, each step's (w_rows, bk) box one contiguous 16 KB
            src = w_g.at[e, j, k] if "tiled" in copies else w_g.at[e, pl.ds(j * w_rows, w_rows), pl.ds(k * bk, bk)]
            plgpu.copy_gmem_to_smem(src, w_s.at[s], full.at[s])

      units(unit)
      for s in range(S):
        plgpu.barrier_wait(free.at[s])

    @pl.when(wg < 2)
    def _():
      for s in range(S):
        plgpu.barrier_arrive(free.at[s])

      def unit(i, j, u):
        del i, j

        @pl.loop(0, steps)
        def _(k):
          s = (u * steps + k) % S
          plgpu.barrier_wait(full.at[s])
          plgpu.barrier_arrive(free.at[s])

      units(unit)



def copy_only(xs, w13, r, *, t, copies, num_sms=132, interpret=None):
  D = xs.shape[1]
  n_tiles = w13.shape[1] if w13.ndim == 5 else w13.shape[1] // 2 // t.block_n
  items = gw.aligned_items(r, t.block_m)
  kernel = plgpu.kernel(
      functools.partial(_kernel, t=t, max_items=items.expert.shape[0], n_tiles=n_tiles, d=D,
                        copies=copies),
      out_type=jax.ShapeDtypeStruct((num_sms,), jnp.float32), grid=(num_sms,), grid_names=("sm",), num_threads=3,
      thread_name="wg", interpret=interpret, kernel_name=f"moe_copy_only_{copies}",
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
  return kernel(*items, xs, w13), items


if __name__ == "__main__":
  if not ON_GPU:
    E, D, I, S, K = 8, 256, 128, 96, 4
    t, interp, sms = gw.Tiling(wg_rows=64, block_n=64, stages=2), plgpu.InterpretGPUParams(), 4
  else:
    E, D, I, S, K = 256, 4096, 2048, int(sys.argv[1]) if len(sys.argv) > 1 else 8192, 6
    t, interp, sms = gw.Tiling(wg_rows=128, block_n=64, stages=4), None, 132
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((S, D)), BF16)
  w1, w3 = (jnp.asarray(rng.standard_normal((E, I, D)) / np.sqrt(D), BF16) for _ in range(2))
  ids = jnp.asarray(np.stack([rng.permutation(E)[:K] for _ in range(S)]).astype(np.int32))
  r = jax.jit(lambda i: routing.route(i, E, 128))(ids)
  w13 = gw.interleave(w1, w3, t.block_n)
  xs = gw.sorted_rows(x, r, t.block_m)
  out = {}
  if ON_GPU:
    from experiments import timing
    out["gate_up_wgmma_ms"] = timing.timeit(jax.jit(lambda xs, w, r: gw.gate_up_wgmma(
        xs, w, None, r, swiglu_limit=10.0, tiling=t, rows_sorted=True)), xs, w13, r, n=10)
  # The real kernel with its wgmmas left out (plgpu.wgmma a no-op while it traces): its pipeline, copies and
  # epilogue alone, without and with the x multicast of clusters of 2.
  import contextlib, dataclasses

  @contextlib.contextmanager
  def no_mma():
    real = plgpu.wgmma
    plgpu.wgmma = lambda *a, **k: None
    try:
      yield
    finally:
      plgpu.wgmma = real

  for name, tt in (("kernel_no_mma", t), ("kernel_no_mma_c2", dataclasses.replace(t, cluster=2))):
    try:
      with no_mma():
        f = jax.jit(lambda xs, w, r, tt=tt: gw.gate_up_wgmma(xs, w, None, r, swiglu_limit=10.0, tiling=tt,
                                                           rows_sorted=True, interpret=interp,
                                                           **({} if ON_GPU else dict(num_sms=sms))))
        got = np.asarray(f(xs, w13, r))
      res = dict(h_absmax=float(np.abs(got.astype(np.float32)).max()))
      if ON_GPU:
        res["ms"] = timing.timeit(f, xs, w13, r, n=10)
        if name == "kernel_no_mma":
          with_mma = jax.jit(lambda xs, w, r, tt=tt: gw.gate_up_wgmma(xs, w, None, r, swiglu_limit=10.0, tiling=tt,
                                                                     rows_sorted=True))
          res["with_mma_ms"] = timing.timeit(with_mma, xs, w13, r, n=10)
      out[name] = res
    except Exception as e:  # noqa: BLE001
      out[name] = dict(error=f"{type(e).__name__}: {str(e)[:600]}")
    print(name, out[name], flush=True)
  # W1/W3 tile by tile: [E, n_tiles, steps, 2 block_n, 64], so a unit's W is one contiguous run
  w_rows, bk = 2 * t.block_n, 64
  w13_tiled = w13.reshape(E, 2 * I // w_rows, w_rows, D // bk, bk).transpose(0, 1, 3, 2, 4)
  for copies in ("xw", "x", "w", "w_tiled", "xw_tiled"):
    f = jax.jit(lambda xs, w, r, c=copies: copy_only(xs, w, r, t=t, copies=c, num_sms=sms, interpret=interp)[0])
    try:
      got = np.asarray(f(xs, w13_tiled if "tiled" in copies else w13, r))
      items = gw.aligned_items(r, t.block_m)
      units = int(items[4][0]) * (I // t.block_n)
      step_bytes = ("x" in copies) * t.block_m * 64 * 2 + ("w" in copies) * 2 * t.block_n * 64 * 2
      gb = units * (D // 64) * step_bytes / 1e9
      res = dict(units=units, gbytes=gb, out_shape=list(got.shape))
      if ON_GPU:
        res["ms"] = timing.timeit(f, xs, w13_tiled if "tiled" in copies else w13, r, n=10)
        res["tb_per_s"] = gb / res["ms"]
      out[copies] = res
    except Exception as e:  # noqa: BLE001
      out[copies] = dict(error=f"{type(e).__name__}: {str(e)[:600]}")
    print(copies, out[copies], flush=True)
  print(json.dumps(out))
  if os.environ.get("OUT"):
    json.dump(out, open(os.path.join(os.environ["OUT"], "moe_copy_only_probe.json"), "w"), indent=1)
