"""Session probe (not committed): the weights_lhs MIX gate/up with other decodes, to split decode from MMA time."""
import sys, time, json
import numpy as np
import jax, jax.numpy as jnp
from jax import lax
from ds4jax.quant import formats, ue4m3, rocmfp_mix
from ds4jax.quant import policy as quant_policy
from kernels_pallas import moe as moe_kernels
from kernels_pallas.moe import gate_up_wgmma as G, routing
from experiments import timing
from experiments.bench_moe import route_ids
F32, I32, BF16 = jnp.float32, jnp.int32, jnp.bfloat16
orig = G.decode_planes

def fast(codes, meta, levels, zero_flagged):
  b, m = codes.astype(I32), meta.astype(I32)
  flagged = m >= 0x80
  m7 = m & 0x7F
  # UE4M3 (2^(e − 8) · (1 + mant/8); e = 0: 2^-7 · mant/8) → float32 bits, exponent rebiased; e = 0 corrected by
  # 2c − 2^-7 (exact)
  c = lax.bitcast_convert_type((m7 << 20) + (119 << 23), F32)
  scale = jnp.where(m7 < 8, 2 * c - F32(2.0 ** -7), c)
  kill = (m7 == 0x7F) | (flagged & (zero_flagged != 0))
  scale = jnp.where(kill, F32(0), scale)
  values = [(jnp.where(flagged, levels[1][k], levels[0][k]) * scale).astype(BF16) for k in range(4)]
  planes = []
  for q in range(4):
    b0, b1 = (b << (31 - 2 * q)) < 0, (b << (30 - 2 * q)) < 0
    planes.append(jnp.where(b1, jnp.where(b0, values[3], values[2]), jnp.where(b0, values[1], values[0])))
  return planes

def codes_only(codes, meta, levels, zero_flagged):
  b = codes.astype(I32)
  return [((b >> (2 * q)) & 3).astype(F32).astype(BF16) for q in range(4)]

def none(codes, meta, levels, zero_flagged):
  v = codes.astype(F32).astype(BF16)
  return [v] * 4

VARIANTS = {k: v for k, v in dict(canonical=orig, fast=fast, codes_only=codes_only, none=none).items()
            if k in sys.argv[4].split(",")}

def main():
  # bit-exactness of `fast` on every meta byte × code byte (pure jnp, on this backend)
  m = jnp.repeat(jnp.arange(256, dtype=jnp.uint8), 256).reshape(256, 256)
  c = jnp.tile(jnp.arange(256, dtype=jnp.uint8), 256).reshape(256, 256)
  lv = jnp.asarray([[-1.5, -0.25, 0.375, 2.0], [-3.0, -0.5, 0.0, 1.25]], F32)
  for zf in (0, 1):
    a, bb = orig(c, m, lv, jnp.int32(zf)), fast(c, m, lv, jnp.int32(zf))
    same = all(bool(jnp.all(lax.bitcast_convert_type(x, jnp.uint16) == lax.bitcast_convert_type(y, jnp.uint16))) for x, y in zip(a, bb))
    print("fast decode bit-identical (jnp, zf=%d):" % zf, same, flush=True)
  E, I, D, K = 256, 2048, 4096, 6
  keys = jax.random.split(jax.random.key(0), 8)
  mix2 = formats.get("rocmfp2_mix")
  qs = [moe_kernels.QuantizedExpertWeights.from_storage("rocmfp2_mix", quant_policy.random_storage(mix2, (E, I, D), keys[3 + i], D**-0.5), (E, I, D)) for i in range(2)]
  m1, m3 = (jax.jit(G.mix_stack)(q.storage) for q in qs)
  out = []
  for S in [int(s) for s in sys.argv[1].split(",")]:
    x = jax.random.normal(keys[6], (S, D)).astype(BF16)
    r = jax.jit(lambda i: routing.route(i, E, 128))(route_ids(keys[7], S, E, K, "uniform"))
    ref = None
    for name, fn in VARIANTS.items():
      for tname in sys.argv[2].split(","):
        wg, st, mr, *cl = map(int, tname.split("_"))
        t = G.Tiling(wg_rows=wg, block_n=64, stages=st, weights_lhs=True, mma_rows=mr, cluster=cl[0] if cl else 1,
                     producer_registers=int(__import__("os").environ.get("PREG", "40")))
        G.decode_planes = fn
        try:
          f = jax.jit(lambda x, a, b, r, t=t: G.gate_up_wgmma(x, a, b, r, swiglu_limit=10.0, tiling=t))
          h = f(x, m1, m3, r); h.block_until_ready()
          n = int(r.num_rows[0])
          if name == "canonical" and ref is None: ref = h[:n]
          same = bool(jnp.all(h[:n] == ref)) if ref is not None else None
          ms = timing.timeit(f, x, m1, m3, r, n=10)
          rec = dict(tokens=S, decode=name, tiling=tname, ms=ms, same_as_canonical=same)
        except Exception as e:
          rec = dict(tokens=S, decode=name, tiling=tname, error=f"{type(e).__name__}: {str(e)[:400]}")
        finally:
          G.decode_planes = orig
        print(rec, flush=True); out.append(rec)
  json.dump(out, open(sys.argv[3], "w"), indent=1)

main()
