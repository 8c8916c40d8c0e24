"""Session 58 probe (#18): the x4 bf16 ring lowered offline for sm_90 at V4-Flash shapes (no GPU); prints the ops of
each loop of its Mosaic GPU module (already at the lane level: llvm, arith, inline PTX), largest first. Run:
JAX_PLATFORMS=cpu .venv/bin/python experiments/results/logs/ring_mlir_ops_probe_s58.py (writes /tmp/ring_x4.mlir)."""
import jax, jax.numpy as jnp
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh
from jax._src.lib.mlir import ir
from jax._src.interpreters import mlir as jax_mlir
from jax._src.lib import mosaic_gpu_dialect
from kernels_pallas import mosaic_check
from kernels_pallas.moe import routing, gate_up_wgmma as G
S, K, E, D, I = 8192, 6, 256, 4096, 2048
t = G.Tiling(wg_rows=128, block_n=64, x_stages=4, mma_in_flight=1)
x = jax.ShapeDtypeStruct((S * K + 1024, D), jnp.bfloat16)
w = jax.ShapeDtypeStruct((E, I // 64, D // 64 * 128, 64), jnp.bfloat16)
r = jax.eval_shape(lambda i: routing.route(i, E, 128), jax.ShapeDtypeStruct((S, K), jnp.int32))
f = lambda x, w, r: G.gate_up_wgmma(x, w, None, r, swiglu_limit=10.0, tiling=t, rows_sorted=True)
low = jax.jit(f).trace(x, w, r).lower(lowering_platforms=("cuda",))
(mod,) = mosaic_check.mosaic_modules(low)
ctx = jax_mlir.make_ir_context()
ctx.allow_unregistered_dialects = True
mosaic_gpu_dialect.register_dialect(ctx)
with ctx:
  m = ir.Module.parse(mod)
  open("/tmp/ring_x4.mlir", "w").write(str(m))
print("ok")
import collections
with ctx:
  m = ir.Module.parse(mod)
  loops = []
  def visit(op):
    if op.name.endswith("scf.for") or op.name.endswith("scf.while"):
      cnt = collections.Counter()
      asm = collections.Counter()
      def inner(o):
        if o is not op:
          cnt[o.name.replace("stable_mosaic_gpu.", "")] += 1
          if o.name.endswith("inline_asm"):
            a = ir.StringAttr(o.attributes["asm_string"]).value
            asm[a.strip().split()[0][:40] if a.strip() else "?"] += 1
        return ir.WalkResult.ADVANCE
      op.walk(inner)
      loops.append((sum(cnt.values()), cnt, asm))
    return ir.WalkResult.ADVANCE
  m.operation.walk(visit)
  for n, cnt, asm in sorted(loops, key=lambda l: -l[0])[:12]:
    print(n, dict(asm), dict(cnt.most_common(12)))
