"""Session 42 probe: the PTX and ptxas's log of the MoE Mosaic GPU kernels at V4-Flash's hidden size (16 experts, 512
tokens): argv names any of mix (gate/up MIX_TILING), mixc2 (the same with cluster 2), down (down_wgmma.TILING), ring
(the bf16 ring w64_n128_i_t_x3), bf16 (the bf16 pipeline, BF16_TILING on separate W1/W3; session 43). Run on the
GPU with MOSAIC_GPU_DUMP_TO=dir MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_PTXAS=1; output: ptxas_moe_kernels_c7512_s42.log
(session 43: ptxas_moe_kernels_h100_c7518e2.log). At 6a99a1b a variant of it compiled the 384-row
tilings (Tiling(wg_rows=192, block_n=64, stages=2 or 3, mma_rows=128)): ptxas_mix384_h100_6a99a1b.log."""
import sys
import jax, jax.numpy as jnp, numpy as np
from kernels_pallas.moe import routing
from kernels_pallas.moe import gate_up_wgmma as G, down_wgmma as DW
from ds4jax.quant import formats, policy as quant_policy
E, D, I, S, K = 16, 4096, 512, 512, 6
key = jax.random.key(0)
ids = jnp.asarray(np.stack([np.random.default_rng(i).permutation(E)[:K] for i in range(S)]), jnp.int32)
r = routing.route(ids, E, 128)
x = jax.random.normal(key, (S, D)).astype(jnp.bfloat16)
for name in sys.argv[1:]:
  print("== kernel", name, flush=True)
  if name.startswith("mix"):
    m = jax.jit(G.mix_stack)(quant_policy.random_storage(formats.get("rocmfp2_mix"), (E, I, D), key, D**-0.5))
    t = G.MIX_TILING if name == "mix" else G.Tiling(wg_rows=128, block_n=64, stages=3, mma_rows=256, cluster=2)
    G.gate_up_wgmma(x, m, m, r, swiglu_limit=10.0, tiling=t).block_until_ready()
  elif name == "down":
    m2 = jax.jit(DW.mix3_stack)(quant_policy.random_storage(formats.get("rocmfp3_mix"), (E, D, I), key, I**-0.5))
    h = jax.random.normal(key, (S * K, I)).astype(jnp.bfloat16)
    DW.down_wgmma(h, m2, r, tiling=DW.TILING).block_until_ready()
  elif name == "ring":
    w = (jax.random.normal(key, (E, I, D)) * D**-0.5).astype(jnp.bfloat16)
    t = G.Tiling(wg_rows=64, block_n=128, x_stages=3, mma_in_flight=1)
    w13 = G.tile_by_step(G.interleave(w, w, t.block_n), 2 * t.block_n, t.block_k)
    G.gate_up_wgmma(x, w13, None, r, swiglu_limit=10.0, tiling=t).block_until_ready()
  elif name == "bf16":
    w = (jax.random.normal(key, (E, I, D)) * D**-0.5).astype(jnp.bfloat16)
    G.gate_up_wgmma(x, w, w, r, swiglu_limit=10.0, tiling=G.BF16_TILING).block_until_ready()
