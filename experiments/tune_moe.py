"""The grouped-MoE tuning sweep: config variants at V4-Flash shapes (D 4096, I 2048, E 256, top-6), bf16, uniform
random routing.

    python -m experiments.tune_moe [--tokens 2048,8192] [--variants default,n,...] [--noparity]
    python -m experiments.tune_moe --formats fp4_e2m1,rocmfp2_mix,... [--tokens ...]
    python -m experiments.tune_moe --smoke      # tiny shapes in interpret mode on a CPU, to check this script

Prints one line per (tokens, config): median ms of the whole `moe` call and of each stage, and the useful
TFLOP/s (2 · S·K · D · I · 3 over the whole call). Also checks compiled parity against `moe_reference` at a small
token count first. Needs a GPU (compiled Pallas-Triton).

`--formats`: expert weights in each ds4jax.quant format (random valid storage, `policy.random_storage`), dequantized
in-kernel (quantized_weights.py); per format also the in-kernel dequantization against the canonical one (bit for
bit), and the dequantize-then-matmul path (bf16 copy made in XLA, then the bf16 kernels; "dq" = the dequantization
alone, "dq+moe" = both; "decode kernel" = the copy made by `decode_stack`, what `moe_decode_kernel` runs).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from absl import app, flags

from ds4jax.metrics import nmse
from ds4jax.quant import formats, policy
from experiments.timing import timeit
from kernels_pallas.moe import Config, DenseWeights, api, decode_stack, down, gate_up, moe, moe_reference, routing
from kernels_pallas.moe import quantized_weights as qw

_TOKENS = flags.DEFINE_list("tokens", ["2048", "8192"], "Token counts to time.")
_VARIANTS = flags.DEFINE_list("variants", [], "Config variants to time (default: all).")
_PARITY = flags.DEFINE_boolean("parity", True, "Check compiled parity against moe_reference first.")
_PARITY_TOKENS = flags.DEFINE_integer("parity_tokens", 256, "Tokens of the parity check.")
_FORMATS = flags.DEFINE_list("formats", [], "Weight formats (bf16, fp8_e4m3, ...) instead of the bf16 sweep.")
_SMOKE = flags.DEFINE_boolean("smoke", False, "Tiny shapes in interpret mode (CPU), to check the script.")

K, LIMIT = 6, 10.0


@dataclasses.dataclass(frozen=True)
class Shape:
  """The MoE dimensions swept, and whether the kernels run in interpret mode."""
  D: int
  I: int
  E: int
  interpret: bool = False


V4_FLASH = Shape(D=4096, I=2048, E=256)
SMOKE = Shape(D=256, I=128, E=8, interpret=True)


def problem(sh, S, seed=0, dtype=jnp.bfloat16, fmt=None):
  ks = jax.random.split(jax.random.key(seed), 6)
  x = jax.random.normal(ks[0], (S, sh.D), jnp.float32).astype(dtype)
  ids = jnp.argsort(jax.random.uniform(ks[1], (S, sh.E)), axis=1)[:, :K].astype(jnp.int32)
  w = jax.random.uniform(ks[2], (S, K), jnp.float32)
  if fmt is not None:
    return (x, w, ids) + quantized_weights(sh, fmt, seed)
  w1 = (jax.random.normal(ks[3], (sh.E, sh.I, sh.D), jnp.float32) * 2 / sh.D**0.5).astype(dtype)
  w3 = (jax.random.normal(ks[4], (sh.E, sh.I, sh.D), jnp.float32) * 2 / sh.D**0.5).astype(dtype)
  w2 = (jax.random.normal(ks[5], (sh.E, sh.D, sh.I), jnp.float32) / sh.I**0.5).astype(dtype)
  return x, w, ids, w1, w2, w3


_WEIGHTS = {}


def quantized_weights(sh, fmt, seed=0):
  """(w1, w2, w3) in format `fmt` (random valid storage drawn on the device), built once per (fmt, seed)."""
  if (fmt, seed) not in _WEIGHTS:
    _WEIGHTS.clear()  # one format's stacks at a time in HBM
    ks = jax.random.split(jax.random.key(100 + seed), 3)
    out = []
    gate_up_shape, down_shape = (sh.E, sh.I, sh.D), (sh.E, sh.D, sh.I)
    for key, shape, std in ((ks[0], gate_up_shape, 2 / sh.D**0.5), (ks[1], down_shape, 1 / sh.I**0.5),
                            (ks[2], gate_up_shape, 2 / sh.D**0.5)):
      st = jax.jit(lambda k, shape=shape, std=std: policy.random_storage(formats.get(fmt), shape, k, std))(key)
      out.append(qw.expert_weights(fmt, st, shape))
    _WEIGHTS[(fmt, seed)] = tuple(out)
  return _WEIGHTS[(fmt, seed)]


def format_checks(sh, fmt):
  """Compiled in-kernel dequantization == canonical dequantization (bit for bit) for one expert-stack slice, at the
  default gate/up and down tiles."""
  w1, w2, _ = quantized_weights(sh, fmt)
  if fmt == "bf16":
    return
  for name, w, (bn, bk) in (("w1", w1, (128, 64)), ("w2", w2, (128, 64)), ("w1", w1, (64, 32))):
    sub = qw.QuantizedExpertWeights(tuple(a[:4] for a in w.arrays), w.fmt_name, (4,) + w.shape[1:])
    got = qw.dequantize_tiles(sub, block_n=bn, block_k=bk, interpret=sh.interpret)
    want = jax.jit(lambda s: s.dequantize())(sub)
    bits = lambda v: jax.lax.bitcast_convert_type(v, jnp.uint32)
    same = bool(jnp.all(bits(got) == bits(want)))
    print(f"{fmt}: in-kernel dequantization of {name}[:4] with {bn}x{bk} tiles bit-identical: {same}", flush=True)


def stages(sh, cfg, args):
  x, w, ids, w1, w2, w3 = args
  bm = cfg.row_tile(ids.size, sh.E)
  kcfg = api._kernel_config(cfg)
  route = jax.jit(lambda i: routing.route(i, sh.E, bm))
  r = route(ids)
  gu = jax.jit(lambda x, a, b, r: gate_up.gate_up(x, a, b, r, swiglu_limit=LIMIT, config=kcfg,
                                                  interpret=sh.interpret))
  h = gu(x, w1, w3, r)
  dn = jax.jit(lambda h, a, r: down.down(h, a, r, config=kcfg, interpret=sh.interpret))
  out = dn(h, w2, r)
  cb = jax.jit(lambda o, w, r: down.combine(o, w, r, config=cfg, interpret=sh.interpret) if cfg.fused_combine
               else down.combine_xla(o, w, r))
  return dict(route=timeit(route, ids), gate_up=timeit(gu, x, w1, w3, r), down=timeit(dn, h, w2, r),
              combine=timeit(cb, out, w, r))


def timed(sh, cfg, args, S, against=None) -> tuple[str, jax.Array]:
  """The whole MoE under `cfg`: median ms, useful TFLOP/s (2·S·K·D·I·3), the gate/up's TFLOP/s, each stage's ms
  (and the output's NMSE against `against`, another config's output); returns the line and the output."""
  f = jax.jit(lambda *args: api._moe(*args, None, swiglu_limit=LIMIT, config=cfg, interpret=sh.interpret))
  ms, st = timeit(f, *args), stages(sh, cfg, args)
  y = f(*args)
  flops = 2 * S * K * sh.D * sh.I * 3
  vs = "" if against is None else f" | NMSE vs the first variant {nmse(y, against):.1e}"
  return (f"{ms:8.3f} ms {flops / ms / 1e9:7.1f} TFLOP/s | gate/up {flops * 2 / 3 / st['gate_up'] / 1e9:6.1f} "
          f"TFLOP/s | " + " ".join(f"{k} {v:.3f}" for k, v in st.items()) + f" | bm={cfg.row_tile(S * K, sh.E)}"
          + vs), y


def main(argv):
  del argv
  sh = SMOKE if _SMOKE.value else V4_FLASH
  print(jax.devices())
  tokens = [int(t) for t in _TOKENS.value]

  if _FORMATS.value:
    for fmt in _FORMATS.value:
      bench_format(sh, fmt, tokens)
    return

  # Compiled parity at V4-Flash width, f32 activations (exact f32 dots) and bf16 (bf16 dots).
  pt = _PARITY_TOKENS.value
  for dtype, tol in ((jnp.float32, 1e-6), (jnp.bfloat16, 5e-4)) if _PARITY.value else ():
    args = problem(sh, pt, seed=1, dtype=jnp.bfloat16)
    args = (args[0].astype(dtype),) + args[1:]
    want = moe_reference(*args, swiglu_limit=LIMIT)
    for cfg in (Config.default(num_tokens=pt, top_k=K, num_experts=sh.E, hidden=sh.D, intermediate=sh.I,
                               dtype=dtype),
                Config(persistent=True, compact_queue=True, fused_combine=False, tile_order="n")):
      y = moe(*args, swiglu_limit=LIMIT, config=cfg, interpret=sh.interpret)
      err = nmse(y, want)
      print(f"parity S={pt} x={jnp.dtype(dtype).name} persistent={cfg.persistent}: NMSE {err:.2e} "
            f"{'OK' if err <= tol else 'FAIL'} finite={bool(jnp.isfinite(y).all())}", flush=True)

  for S in tokens:
    args = problem(sh, S)
    base = Config.default(num_tokens=S, top_k=K, num_experts=sh.E, hidden=sh.D, intermediate=sh.I)
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
    if _VARIANTS.value:
      variants = {k: v for k, v in variants.items() if k in _VARIANTS.value}
    for name, cfg in variants.items():
      try:
        print(f"S={S} {name:18s} {timed(sh, cfg, args, S)[0]} {cfg}", flush=True)
      except Exception as e:  # keep going through the sweep
        print(f"S={S} {name}: FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)


def bench_format(sh, fmt, tokens):
  """Parity, loader bit-identity and timings of one weight format (default config, bf16 activations)."""
  try:
    format_checks(sh, fmt)
    if _PARITY.value:
      pt = _PARITY_TOKENS.value
      for dtype, tol in ((jnp.float32, 1e-6 if fmt == "bf16" else 5e-4), (jnp.bfloat16, 5e-4)):
        args = problem(sh, pt, seed=1, dtype=dtype, fmt=fmt)
        want = moe_reference(*args, swiglu_limit=LIMIT)
        cfg = Config.default(num_tokens=pt, top_k=K, num_experts=sh.E, hidden=sh.D, intermediate=sh.I,
                             dtype=dtype)
        y = moe(*args, swiglu_limit=LIMIT, config=cfg, interpret=sh.interpret)
        err = nmse(y, want)
        print(f"{fmt} parity S={pt} x={jnp.dtype(dtype).name}: NMSE {err:.2e} "
              f"{'OK' if err <= tol else 'FAIL'} finite={bool(jnp.isfinite(y).all())}", flush=True)
  except Exception as e:  # keep going through the formats
    print(f"{fmt} checks: FAILED {type(e).__name__}: {str(e)[:600]}", flush=True)
  for S in tokens:
    try:
      args = problem(sh, S, fmt=fmt)
      base = Config.default(num_tokens=S, top_k=K, num_experts=sh.E, hidden=sh.D, intermediate=sh.I,
                            decodes_weights=fmt != "bf16")  # what the model ships for these weights
      first = None  # the first variant's output: every other variant is checked against it
      for name, cfg in format_variants(base).items():
        try:
          line, y = timed(sh, cfg, args, S, first)
          first = y if first is None else first
          print(f"{fmt:12s} S={S} {name:14s} {line}", flush=True)
        except Exception as e:  # keep going through the variants
          print(f"{fmt} S={S} {name}: FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)
      if fmt != "bf16":  # the bf16 copy runs the bf16 default
        dense_cfg = Config.default(num_tokens=S, top_k=K, num_experts=sh.E, hidden=sh.D, intermediate=sh.I)
        f = jax.jit(lambda *args, cfg=dense_cfg: api._moe(*args, None, swiglu_limit=LIMIT, config=cfg,
                                                    interpret=sh.interpret))
        dq = jax.jit(lambda ws: tuple(qw.dequantize_to_dense(w) for w in ws))
        dq_kernel = jax.jit(lambda ws: tuple(DenseWeights(decode_stack(w, interpret=sh.interpret)) for w in ws))
        dense = dq(args[3:])
        t_dq, t_dq_kernel = timeit(dq, args[3:]), timeit(dq_kernel, args[3:])
        t_dense = timeit(f, *args[:3], *dense)
        print(f"{fmt:12s} S={S} dq {t_dq:.3f} dq+moe {t_dq + t_dense:.3f} (moe on bf16 copy {t_dense:.3f}); "
              f"decode kernel {t_dq_kernel:.3f} + moe {t_dq_kernel + t_dense:.3f}", flush=True)
        del dense
    except Exception as e:  # keep going through the sweep
      print(f"{fmt} S={S}: FAILED {type(e).__name__}: {str(e)[:600]}", flush=True)


def format_variants(base: Config) -> dict[str, Config]:
  """Tilings tried for in-kernel decoded weights (--variants picks; default: the default config only). A decoded
  [bk, bn] weight tile serves block_m rows, so bigger row tiles decode less per FLOP. (The log of 2026-12-02 was
  taken when the default for decoded weights was still m128 n128: its "default" rows are that config.)"""
  r = dataclasses.replace
  out = {"default": base,
         "bm256_bn64": r(base, block_m=256, adaptive_tile=False, block_n=64, num_warps=8),
         "bm256_bn64_s2": r(base, block_m=256, adaptive_tile=False, block_n=64, num_warps=8, num_stages=2),
         "bm256_bn128": r(base, block_m=256, adaptive_tile=False, num_warps=8, num_stages=2),
         "bm256_bn128_s3": r(base, block_m=256, adaptive_tile=False, block_n=128, num_warps=8),
         "bm128_bn128": r(base, block_m=128, block_n=128, num_warps=8),
         "bm256_bn64_w4": r(base, block_m=256, adaptive_tile=False, block_n=64, num_warps=4),
         "bm256_bn64_k32": r(base, block_m=256, adaptive_tile=False, block_n=64, block_k=32, num_warps=8),
         "bm256_bn64_k128": r(base, block_m=256, adaptive_tile=False, block_n=64, block_k=128, num_warps=8,
                              num_stages=2),
         "bm256_bn32": r(base, block_m=256, adaptive_tile=False, block_n=32, num_warps=8),
         "bm512_bn32": r(base, block_m=512, adaptive_tile=False, block_n=32, num_warps=8),
         "bm512_bn64": r(base, block_m=512, adaptive_tile=False, block_n=64, num_warps=8, num_stages=2),
         "bm128_bn64": r(base, block_n=64, num_warps=4),
         "bk128_s2": r(base, block_k=128, num_stages=2),
         "w4": r(base, num_warps=4),
         "s2": r(base, num_stages=2),
         "s4": r(base, num_stages=4)}
  return {k: v for k, v in out.items() if k in (_VARIANTS.value or ["default"])}

if __name__ == "__main__":
  app.run(main)
