"""Session 42 probe (ran at 6a99a1b, where 384-row tilings fit): ptxas's verdict (registers, spills, C7511/C7512) on
the FP2-MIX gate/up at the tilings given as wg_rows,stages,mma_rows, at V4-Flash's hidden size. Run on the GPU with
MOSAIC_GPU_DUMP_TO=dir MOSAIC_GPU_DUMP_PTXAS=1; output: ptxas_mix384_h100_6a99a1b.log."""
import sys
import jax, jax.numpy as jnp, numpy as np
from kernels_pallas.moe import routing
from kernels_pallas.moe.gate_up_wgmma import Tiling, gate_up_wgmma, mix_stack
from ds4jax.quant import formats, policy as quant_policy
E, D, I, S, K = 16, 4096, 512, 512, 6
key = jax.random.key(0)
mix2 = formats.get("rocmfp2_mix")
st = quant_policy.random_storage(mix2, (E, I, D), key, D**-0.5)
m = jax.jit(mix_stack)(st)
x = jax.random.normal(key, (S, D)).astype(jnp.bfloat16)
ids = jnp.asarray(np.stack([np.random.default_rng(i).permutation(E)[:K] for i in range(S)]), jnp.int32)
r = routing.route(ids, E, 128)
for spec in sys.argv[1:]:
  w, s, mr = map(int, spec.split(","))
  t = Tiling(wg_rows=w, block_n=64, stages=s, mma_rows=mr)
  print("== tiling", spec, flush=True)
  h = gate_up_wgmma(x, m, m, r, swiglu_limit=10.0, tiling=t)
  h.block_until_ready()
