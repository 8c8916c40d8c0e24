# session 61 (#18): the bf16 rings against torch._grouped_mm on the same sorted rows, in turns, at several cells in one
# process: python ring_probe_s61.py 8192:uniform,32768:zipf VARIANTS ROUNDS. Suffixes: _scan puts back searchsorted's
# while loop in the work list (before 8debe8e) for the timed call; _il / _st (session 62) one half of the layout;
# _pre computes the work list before the timed call;
# _dense runs the ring on dense w1 / w3 (the model's layout) instead of interleaved step-tiled weights; "model" is
# BF16_TILING (what api.moe runs, no rings) on dense w1 / w3. Session 61's "_xb" variants ran at 8debe8e with
# dataclasses.replace(V[n], x_block_copies=True), a switch since removed.
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
     "x4_cw": T(wg_rows=128, block_n=64, x_stages=4, mma_in_flight=1, copy_warp=True),
     "w64_x3_cw": T(wg_rows=64, block_n=128, x_stages=3, mma_in_flight=1, copy_warp=True),
     "x4_cu": T(wg_rows=128, block_n=64, x_stages=4, mma_in_flight=1, carried_units=True),
     "x4_cwcu": T(wg_rows=128, block_n=64, x_stages=4, mma_in_flight=1, copy_warp=True, carried_units=True),
     "w64_x3_cu": T(wg_rows=64, block_n=128, x_stages=3, mma_in_flight=1, carried_units=True),
     "w64_x3_cwcu": T(wg_rows=64, block_n=128, x_stages=3, mma_in_flight=1, copy_warp=True, carried_units=True)}
V.update({n + "_pre": V[n] for n in list(V)})  # session 61: the work list (aligned_items) computed before the timed call
V.update({n + "_scan": V[n] for n in list(V) if not n.endswith("_pre")})  # session 61: searchsorted's while loop
V["model"] = G.BF16_TILING  # session 61: what api.moe runs today (no rings), on dense w1 / w3
V.update({n + "_dense": V[n] for n in ("x4", "w64_x3", "x4_cwcu", "w64_x3_cwcu")})  # the rings on dense w1 / w3
# session 62: which half of the layout matters: _il interleaved but not step-tiled, _st w1 / w3 each step-tiled
V.update({n + sfx: V[n] for n in ("x4", "w64_x3") for sfx in ("_il", "_st")})
want = sys.argv[2].split(",")
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 15
b = torch.cat([torch.from_dlpack(w1), torch.from_dlpack(w3)], 1).transpose(1, 2).contiguous()
dense = lambda n: n == "model" or n.endswith("_dense")  # session 63: no step-tiled copy for these
layouts = {bn: jax.block_until_ready(G.tile_by_step(G.interleave(w1, w3, bn), 2 * bn, 64))
           for bn in sorted({V[n].block_n for n in want if not dense(n) and not n.endswith(("_il", "_st"))})}
il = {bn: jax.block_until_ready(G.interleave(w1, w3, bn))
      for bn in sorted({V[n].block_n for n in want if n.endswith("_il")})}
st = {bn: jax.block_until_ready((G.tile_by_step(w1, bn, 64), G.tile_by_step(w3, bn, 64)))
      for bn in sorted({V[n].block_n for n in want if n.endswith("_st")})}
if not any(n == "model" or n.endswith("_dense") for n in want):
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
    if name == "model" or name.endswith(("_dense", "_st")):
      f = jax.jit(lambda xs, w, r, t=t: G.gate_up_wgmma(xs, *w, r, swiglu_limit=10.0, tiling=t, rows_sorted=True))
    if name.endswith("_pre"):
      items = jax.block_until_ready(jax.jit(G.aligned_items, static_argnums=1)(r, t.block_m))
      def pre(xs, w, r, items, t=t):
        keep = G.aligned_items
        G.aligned_items = lambda r_, bm: items
        try:
          return G.gate_up_wgmma(xs, w, None, r, swiglu_limit=10.0, tiling=t, rows_sorted=True)
        finally:
          G.aligned_items = keep
      jf = jax.jit(pre)
      f = lambda xs, w, r, jf=jf, items=items: jf(xs, w, r, items)
    if name.endswith("_scan"):
      def scan(xs, w, r, t=t):
        keep = jnp.searchsorted
        jnp.searchsorted = lambda *a, **k: keep(*a, **(k | dict(method="scan")))
        try:
          return G.gate_up_wgmma(xs, w, None, r, swiglu_limit=10.0, tiling=t, rows_sorted=True)
        finally:
          jnp.searchsorted = keep
      f = jax.jit(scan)
    try:
      wt = ((w1, w3) if name == "model" or name.endswith("_dense") else il[t.block_n] if name.endswith("_il")
            else st[t.block_n] if name.endswith("_st") else layouts[t.block_n])
      h = f(xs, wt, r)
      rows = int(r.num_rows[0])
      hh = h[:rows].astype(jnp.float32)
      if ref is None:
        ref = hh
      print(S, kind, name, "max diff vs first", float(jnp.max(jnp.abs(hh - ref))), flush=True)
      calls[name] = (lambda f=f, xs=xs, w=wt, r=r: f(xs, w, r), jax.block_until_ready)
    except Exception as e:
      print(S, kind, name, "error", type(e).__name__, str(e)[:300], flush=True)
  ms = timing.rotated_rounds(calls, rounds=rounds)
  print(S, kind, "median ms", {n: round(statistics.median(v), 3) for n, v in ms.items()})
  for n, v in timing.rate_ratios(ms, "torch").items():
    print(S, kind, n, {k: round(x, 3) for k, x in v.items()}, flush=True)
  del calls, a, offs, x_sorted
