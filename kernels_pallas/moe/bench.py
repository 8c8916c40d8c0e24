"""Grouped-MoE timings at V4-Flash shapes (D 4096, I 2048, E 256, top-6), bf16, uniform random routing.

    python -m kernels_pallas.moe.bench [--tokens 2048,8192] [--variants default,n,...] [--no_parity]

Prints one line per (tokens, config): median ms of the whole `moe` call and of each stage, and the useful
TFLOP/s (2 · S·K · D · I · 3 over the whole call). Also checks compiled parity against `moe_reference` at a small
token count first. Needs a GPU (compiled Pallas-Triton).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp

from kernels_pallas.moe import Config, api, down, gate_up, moe, moe_reference, nmse, routing

D, I, E, K, LIMIT = 4096, 2048, 256, 6, 10.0


def problem(S, seed=0, dtype=jnp.bfloat16):
  ks = jax.random.split(jax.random.key(seed), 6)
  x = jax.random.normal(ks[0], (S, D), jnp.float32).astype(dtype)
  ids = jnp.argsort(jax.random.uniform(ks[1], (S, E)), axis=1)[:, :K].astype(jnp.int32)
  w = jax.random.uniform(ks[2], (S, K), jnp.float32)
  w1 = (jax.random.normal(ks[3], (E, I, D), jnp.float32) * 2 / D**0.5).astype(dtype)
  w3 = (jax.random.normal(ks[4], (E, I, D), jnp.float32) * 2 / D**0.5).astype(dtype)
  w2 = (jax.random.normal(ks[5], (E, D, I), jnp.float32) / I**0.5).astype(dtype)
  return x, w, ids, w1, w2, w3


def timeit(f, *args, n=10):
  jax.block_until_ready(f(*args))
  ts = []
  for _ in range(n):
    t = time.perf_counter()
    jax.block_until_ready(f(*args))
    ts.append(time.perf_counter() - t)
  return 1e3 * statistics.median(ts)


def stages(cfg, args):
  x, w, ids, w1, w2, w3 = args
  bm = cfg.row_tile(ids.size, E)
  kcfg = api._kernel_config(cfg)
  route = jax.jit(lambda i: routing.route(i, E, bm))
  r = route(ids)
  gu = jax.jit(lambda x, a, b, r: gate_up.gate_up(x, a, b, r, swiglu_limit=LIMIT, config=kcfg))
  h = gu(x, w1, w3, r)
  dn = jax.jit(lambda h, a, r: down.down(h, a, r, config=kcfg))
  out = dn(h, w2, r)
  cb = jax.jit(lambda o, w, r: down.combine(o, w, r, config=cfg) if cfg.fused_combine else down.combine_xla(o, w, r))
  return dict(route=timeit(route, ids), gate_up=timeit(gu, x, w1, w3, r), down=timeit(dn, h, w2, r),
              combine=timeit(cb, out, w, r))


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--tokens", default="2048,8192")
  ap.add_argument("--variants", default="", help="comma-separated variant names (default: all)")
  ap.add_argument("--no_parity", action="store_true")
  ap.add_argument("--parity_tokens", type=int, default=256)
  a = ap.parse_args()
  print(jax.devices())

  # Compiled parity at V4-Flash width, f32 activations (exact f32 dots) and bf16 (bf16 dots).
  for dtype, tol in () if a.no_parity else ((jnp.float32, 1e-6), (jnp.bfloat16, 5e-4)):
    args = problem(a.parity_tokens, seed=1, dtype=jnp.bfloat16)
    args = (args[0].astype(dtype),) + args[1:]
    want = moe_reference(*args, swiglu_limit=LIMIT)
    for cfg in (Config.default(num_tokens=a.parity_tokens, top_k=K, num_experts=E, hidden=D, intermediate=I,
                               dtype=dtype),
                Config(persistent=True, compact_queue=True, fused_combine=False, tile_order="n")):
      y = moe(*args, swiglu_limit=LIMIT, config=cfg)
      err = nmse(y, want)
      print(f"parity S={a.parity_tokens} x={jnp.dtype(dtype).name} persistent={cfg.persistent}: NMSE {err:.2e} "
            f"{'OK' if err <= tol else 'FAIL'} finite={bool(jnp.isfinite(y).all())}", flush=True)

  for S in (int(s) for s in a.tokens.split(",")):
    args = problem(S)
    flops = 2 * S * K * D * I * 3
    base = Config.default(num_tokens=S, top_k=K, num_experts=E, hidden=D, intermediate=I)
    r = dataclasses.replace
    variants = {
        "default": base,
        "bm64": r(base, block_m=64, num_warps=4),
        "bm128_bn64": r(base, block_n=64, down_block_n=64, num_warps=4),
        "bk128": r(base, block_k=128, down_block_k=128, num_stages=2),
        "stages4": r(base, num_stages=4),
        "persistent": r(base, persistent=True, programs_per_core=2),
        "unfused": r(base, fused_combine=False),
        "no_adaptive_bm64": r(base, adaptive_tile=False, block_m=64, num_warps=4),
        "dense_queue": r(base, compact_queue=False),
        "n": r(base, tile_order="n"),
        "n_stages4": r(base, tile_order="n", num_stages=4),
        "n_persistent": r(base, tile_order="n", persistent=True, programs_per_core=2),
        "n_persistent1": r(base, tile_order="n", persistent=True, programs_per_core=1),
        "n_bm64": r(base, tile_order="n", block_m=64, num_warps=4),
        "n_down256": r(base, tile_order="n", down_block_n=256),
        "n_bk32": r(base, tile_order="n", block_k=32, down_block_k=32, num_stages=4),
    }
    if a.variants:
      variants = {k: v for k, v in variants.items() if k in a.variants.split(",")}
    for name, cfg in variants.items():
      try:
        f = jax.jit(lambda *args, cfg=cfg: api._moe(*args, None, swiglu_limit=LIMIT, config=cfg, interpret=False))
        ms = timeit(f, *args)
        st = stages(cfg, args)
        print(f"S={S} {name:18s} {ms:8.3f} ms {flops / ms / 1e9:7.1f} TFLOP/s | "
              + " ".join(f"{k} {v:.3f}" for k, v in st.items()) + f" | bm={cfg.row_tile(S * K, E)} {cfg}",
              flush=True)
      except Exception as e:  # keep going through the sweep
        print(f"S={S} {name}: FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)


if __name__ == "__main__":
  main()
