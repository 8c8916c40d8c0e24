# session 57 (#18), dev only (needs gate_up_wgmma.py with ring_weights_lhs_s57.patch applied): gate_up_wgmma with the
# weights_lhs epilogue's hand-over stubbed out (warpgroup 0 stores silu(gate) * gate, warpgroup 1 stores nothing): the
# main loop's own speed. Timed by devring57.py (the s57a/s57b logs name its tilings), imported there as `stub`.
import types, sys
from kernels_pallas.moe import gate_up_wgmma as G
src = open(G.__file__).read()
subs = [("""                    plgpu.barrier_wait(up_free)  # warpgroup 0 has read the previous chunk
                    up[...] = chunk
                    plgpu.commit_smem()
                    plgpu.barrier_arrive(up_ready)
""", "                    pass\n"),
        ("""                    plgpu.barrier_wait(up_ready)
                    h = clamped_swiglu(chunk, up[...], limit).astype(h_g.dtype)  # [block_n, 64 rows]
                    plgpu.barrier_arrive(up_free)
""", "                    h = clamped_swiglu(chunk, chunk, limit).astype(h_g.dtype)\n"),
        ("        pl.when(wg == 0)(lambda: plgpu.barrier_arrive(up_free))  # the first chunk's up buffer is free\n", "        pass\n"),
        ("        pl.when(wg == 1)(lambda: plgpu.barrier_wait(up_free))\n", "        pass\n")]
for a, b in subs:
  assert src.count(a) == 1, a
  src = src.replace(a, b)
stub = types.ModuleType("gate_up_wgmma_stub")
stub.__file__ = G.__file__
sys.modules["gate_up_wgmma_stub"] = stub
exec(compile(src, "gate_up_wgmma_stub", "exec"), stub.__dict__)
