# session 57 (#18): bf16 ring variants against x4 / w64_n128 and torch, alternating rounds, at several cells in one
# process: python devring57.py 8192:uniform,32768:zipf VARIANTS ROUNDS. As here for call 3 (balance_units, with
# ring_balance_units_s57.patch applied). Calls 1 and 2 (ring_weights_lhs_s57.patch) had instead, besides x4 and w64_x3:
#   "lhs_x4": T(wg_rows=128, block_n=64, x_stages=4, mma_in_flight=1, weights_lhs=True),
#   "lhs_x3_s4": T(wg_rows=128, block_n=64, x_stages=3, stages=4, mma_in_flight=1, weights_lhs=True),
#   "lhs_x4_f0": T(wg_rows=128, block_n=64, x_stages=4, mma_in_flight=0, weights_lhs=True),
#   "stub_lhs_x4": lhs_x4 run by ring_weights_lhs_stub_s57.py's module (`from devlhsstub import stub`; M = stub)
import sys, statistics, jax, jax.numpy as jnp, torch
from experiments import bench_moe, timing
from kernels_pallas.moe import gate_up_wgmma as G, routing
from kernels_pallas.moe import config as moe_config
cells = [(int(c.split(":")[0]), c.split(":")[1]) for c in sys.argv[1].split(",")]
D, I, E, K = 4096, 2048, 256, 6
keys = jax.random.split(jax.random.key(0), 8)
w1 = (jax.random.normal(keys[0], (E, I, D)) * D**-0.5).astype(jnp.bfloat16)
w3 = (jax.random.normal(keys[1], (E, I, D)) * D**-0.5).astype(jnp.bfloat16)
T = G.Tiling
V = {"x4": T(wg_rows=128, block_n=64, x_stages=4, mma_in_flight=1),
     "w64_x3": T(wg_rows=64, block_n=128, x_stages=3, mma_in_flight=1),
     "x4_bal": T(wg_rows=128, block_n=64, x_stages=4, mma_in_flight=1, balance_units=True),
     "w64_x3_bal": T(wg_rows=64, block_n=128, x_stages=3, mma_in_flight=1, balance_units=True)}
want = sys.argv[2].split(",")
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 15
b = torch.cat([torch.from_dlpack(w1), torch.from_dlpack(w3)], 1).transpose(1, 2).contiguous()
layouts = {bn: jax.block_until_ready(G.tile_by_step(G.interleave(w1, w3, bn), 2 * bn, 64))
           for bn in sorted({V[n].block_n for n in want})}
del w1, w3
for S, kind in cells:
  x = jax.random.normal(keys[6], (S, D)).astype(jnp.bfloat16)
  ids = bench_moe.route_ids(keys[7], S, E, K, kind)
  cfg = moe_config.Config.default(num_tokens=S, top_k=K, num_experts=E, hidden=D, intermediate=I)
  r = jax.jit(lambda i: routing.route(i, E, cfg.row_tile(S * K, E)))(ids)
  x_sorted = x[r.token_of_row]
  sizes = jnp.bincount(jnp.where(ids >= 0, ids, E).reshape(-1), length=E + 1)[:E].astype(jnp.int32)
  a = torch.from_dlpack(x_sorted)
  offs = torch.from_dlpack(jnp.cumsum(sizes).astype(jnp.int32))
  calls, ref = {"torch": (lambda a=a, offs=offs: torch._grouped_mm(a, b, offs=offs), lambda _: torch.cuda.synchronize())}, None
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
      print(S, kind, name, "max diff vs first", float(jnp.max(jnp.abs(hh - ref))), flush=True)
      calls[name] = (lambda f=f, xs=xs, w=layouts[t.block_n], r=r: f(xs, w, r), jax.block_until_ready)
    except Exception as e:
      print(S, kind, name, "error", type(e).__name__, str(e)[:300], flush=True)
  ms = timing.rotated_rounds(calls, rounds=rounds)
  print(S, kind, "median ms", {n: round(statistics.median(v), 3) for n, v in ms.items()})
  for n, v in timing.rate_ratios(ms, "torch").items():
    print(S, kind, n, {k: round(x, 3) for k, x in v.items()}, flush=True)
  del calls, a, offs, x_sorted
