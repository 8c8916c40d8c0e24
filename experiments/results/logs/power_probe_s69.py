"""Session 68 probe (#18; run in session 69): SM clock and board power while torch._grouped_mm and the ring default run back to back at
32768 tokens, uniform and Zipf routing: is ours ~5% slower at Zipf because of the power cap?"""
import functools, json, os, subprocess, sys, time
import jax, jax.numpy as jnp, numpy as np
from experiments.bench_moe import route_ids, torch_grouped_mm
from kernels_pallas import moe as moe_kernels
from kernels_pallas.moe import gate_up_wgmma as g, routing

S, E, K, D, I = 32768, 256, 6, 4096, 2048
CALLS = int(os.environ.get("CALLS", 300))


def main(out_path):
  keys = jax.random.split(jax.random.key(0), 8)
  w1 = (jax.random.normal(keys[0], (E, I, D)) * D**-0.5).astype(jnp.bfloat16)
  w3 = (jax.random.normal(keys[1], (E, I, D)) * D**-0.5).astype(jnp.bfloat16)
  w13 = jnp.concatenate([w1, w3], axis=1).transpose(0, 2, 1)
  ws = tuple(jax.jit(g.ring_layout)(w) for w in (w1, w3))
  del w1, w3
  x = jax.random.normal(keys[6], (S, D)).astype(jnp.bfloat16)
  t = g.default_tiling(-(-S * K // E), False, I)
  calls = {}
  for kind in ("uniform", "zipf"):
    ids = route_ids(keys[7], S, E, K, kind)
    cfg = moe_kernels.Config.default(num_tokens=S, top_k=K, num_experts=E, hidden=D, intermediate=I)
    r = jax.jit(lambda i, bm=cfg.row_tile(S * K, E): routing.route(i, E, bm))(ids)
    xs = g.sorted_rows(x, r, t.block_m)
    f = jax.jit(lambda xs, a, b, r: g.gate_up_wgmma(xs, a, b, r, swiglu_limit=10.0, tiling=t, rows_sorted=True))
    f(xs, *ws, r).block_until_ready()
    calls[f"ring {kind}"] = (functools.partial(f, xs, *ws, r), jax.block_until_ready)
    sizes = jnp.bincount(ids.reshape(-1), length=E).astype(jnp.int32)
    calls[f"torch {kind}"] = torch_grouped_mm(x[r.token_of_row], w13, sizes)
  log = open(out_path + ".smi.csv", "w")
  smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu",
                          "--format=csv,noheader,nounits", "-lms", "20"], stdout=log)
  time.sleep(2)
  windows = []
  for rep in range(2):
    for name, (call, wait) in calls.items():
      t0 = time.time()
      for _ in range(CALLS):
        res = call()
      wait(res)
      t1 = time.time()
      windows.append(dict(name=name, rep=rep, start=t0, end=t1, ms_per_call=(t1 - t0) / CALLS * 1e3))
      print(windows[-1], flush=True)
      time.sleep(1.0)
  smi.terminate()
  log.close()
  json.dump(dict(windows=windows, tiling=str(t)), open(out_path, "w"), indent=1)


if __name__ == "__main__":
  main(sys.argv[1])
