# session 56 (#18): the rings' stage splits against torch._grouped_mm in alternating rounds (H100, commit d9de448).
# Run as: python devring56.py TOKENS ROUTING VARIANTS ROUNDS (XLA_PYTHON_CLIENT_PREALLOCATE=false). Output in ring_stage_probe_h100_s56_d9de448.log
# session 56 (#18): ring stage splits against torch, alternating rounds, at one cell
import sys, jax, jax.numpy as jnp, torch
from experiments import bench_moe, timing
from kernels_pallas.moe import gate_up_wgmma as G, routing
from kernels_pallas.moe import config as moe_config
S = int(sys.argv[1]); kind = sys.argv[2]
D, I, E, K = 4096, 2048, 256, 6
keys = jax.random.split(jax.random.key(0), 8)
w1 = (jax.random.normal(keys[0], (E, I, D)) * D**-0.5).astype(jnp.bfloat16)
w3 = (jax.random.normal(keys[1], (E, I, D)) * D**-0.5).astype(jnp.bfloat16)
x = jax.random.normal(keys[6], (S, D)).astype(jnp.bfloat16)
ids = bench_moe.route_ids(keys[7], S, E, K, kind)
cfg = moe_config.Config.default(num_tokens=S, top_k=K, num_experts=E, hidden=D, intermediate=I)
r = jax.jit(lambda i: routing.route(i, E, cfg.row_tile(S * K, E)))(ids)
T = G.Tiling
V = {"x4_s4": T(wg_rows=128, block_n=64, x_stages=4, mma_in_flight=1),
     "x3_s5": T(wg_rows=128, block_n=64, x_stages=3, stages=5, mma_in_flight=1),
     "x3_s4": T(wg_rows=128, block_n=64, x_stages=3, stages=4, mma_in_flight=1),
     "w64_x3_s4": T(wg_rows=64, block_n=128, x_stages=3, mma_in_flight=1),
     "w64_x2_s5": T(wg_rows=64, block_n=128, x_stages=2, stages=5, mma_in_flight=1),
     "w64_x2_s4": T(wg_rows=64, block_n=128, x_stages=2, stages=4, mma_in_flight=1),
     "w64_x4_s4": T(wg_rows=64, block_n=128, x_stages=4, stages=4, mma_in_flight=1)}
want = sys.argv[3].split(",") if len(sys.argv) > 3 else list(V)
calls, ref = {}, None
x_sorted = x[r.token_of_row]
sizes = jnp.bincount(jnp.where(ids >= 0, ids, E).reshape(-1), length=E + 1)[:E].astype(jnp.int32)
b = torch.cat([torch.from_dlpack(w1), torch.from_dlpack(w3)], 1).transpose(1, 2).contiguous()
torch.cuda.empty_cache()
layouts = {bn: jax.block_until_ready(G.tile_by_step(G.interleave(w1, w3, bn), 2 * bn, 64))
           for bn in sorted({V[n].block_n for n in want})}
del w1, w3
a = torch.from_dlpack(x_sorted)
offs = torch.from_dlpack(jnp.cumsum(sizes).astype(jnp.int32))
calls["torch"] = (lambda: torch._grouped_mm(a, b, offs=offs), lambda _: torch.cuda.synchronize())
for name in want:
  t = V[name]
  xs = G.sorted_rows(x, r, t.block_m)
  f = jax.jit(lambda xs, w, r, t=t: G.gate_up_wgmma(xs, w, None, r, swiglu_limit=10.0, tiling=t, rows_sorted=True))
  try:
    h = f(xs, layouts[t.block_n], r)
    rows = int(r.num_rows[0])
    hh = h[:rows].astype(jnp.float32)
    if ref is None:
      ref = hh
    print(name, "max diff vs first", float(jnp.max(jnp.abs(hh - ref))), flush=True)
    calls[name] = (lambda f=f, xs=xs, w=layouts[t.block_n]: f(xs, w, r), jax.block_until_ready)
  except Exception as e:
    print(name, "error", type(e).__name__, str(e)[:300], flush=True)
ms = timing.rotated_rounds(calls, rounds=int(sys.argv[4]) if len(sys.argv) > 4 else 20)
import statistics
print(S, kind, {n: round(statistics.median(v), 3) for n, v in ms.items()})
for n, v in timing.rate_ratios(ms, "torch").items():
  print(S, kind, n, {k: round(x, 3) for k, x in v.items()}, flush=True)
