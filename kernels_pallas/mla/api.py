"""Public entry of the sparse MLA attention kernels: `sparse_mla` (Pallas-Triton) and its exact reference.

    o = sparse_mla(q, raw_kv, comp_kv, sink, q_start=…, raw_start=…, kind="csa", ratio=4, window=128,
                   inv_freq=freqs, indices=topk_ids)                       # f32 [T, H, D]

impl "stream" (stream.py: online softmax while each key stage is resident; `f32_stage`, `fast_exp`) or "grouped"
(grouped.py: all scores first, then the values reloaded; the upstream baseline). Semantics in reference.py.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.mla import grouped as grouped_mod
from kernels_pallas.mla import keyset
from kernels_pallas.mla import stream as stream_mod
from kernels_pallas.mla.config import Config, default_platform
from kernels_pallas.mla.reference import check_inputs, sparse_mla_reference


IMPLS = ("stream", "grouped")
F32 = jnp.float32

# V4-Flash attention (ds4jax.config.v4_flash): 64 heads, head dim 512, window 128, rope dim 64, CSA ratio 4 with
# top-512, HCA ratio 128.
V4_FLASH_MLA = dict(num_heads=64, head_dim=512, window=128, k=512, rope_dim=64, csa_ratio=4, hca_ratio=128)


def geometry(q, raw_kv, comp_kv, sink, *, q_start, raw_start, kind, ratio, window, inv_freq, indices, scale,
             config: Config) -> keyset.Geometry:
  """Checks the inputs (ValueError naming the shape) and returns the static launch geometry."""
  s = check_inputs(q, raw_kv, comp_kv, sink, q_start=q_start, raw_start=raw_start, kind=kind, ratio=ratio,
                   window=window, inv_freq=inv_freq, indices=indices)
  kb = config.keys_per_stage
  dk = min(config.head_dim_chunk, s["D"])
  k = max(s["k"], kb) if kind == "csa" else 0   # fewer slots than a stage: padded with −1 (sparse_mla)
  n = lambda a: 2 if (a is not None and config.precision == "split" and jnp.dtype(a.dtype) == jnp.dtype(F32)) \
      else 1
  return keyset.Geometry(
      kind=kind, T=s["T"], H=s["H"], D=s["D"], N=s["N"], R=s["R"], k=k, rope_dim=s["rope_dim"],
      window=int(window), ratio=int(ratio) if kind != "window" else 1, Tq=config.tokens_per_program,
      Hp=config.heads_per_program, kb=kb, dk=dk, q_resident=bool(config.q_resident),
      scale=float(s["D"] ** -0.5 if scale is None else scale), precision=config.precision, q_parts=n(q),
      raw_parts=n(raw_kv), comp_parts=n(comp_kv))


def operand_parts(x, n: int) -> tuple:
  """x as n bf16 arrays: (bf16(x),) or (hi, lo) with hi + lo = x to ~2^-16 relative (one XLA pass; the kernels
  load bf16 tiles only, which keeps f32 conversions and f32 tiles out of their registers)."""
  if n == 1 and x.dtype == jnp.bfloat16:
    return (x,)
  return keyset.parts(x, n == 2)


def sparse_mla(q, raw_kv, comp_kv, sink, *, q_start, raw_start, kind: str, ratio: int, window: int, inv_freq,
               indices=None, scale: float | None = None, impl: str = "stream", f32_stage: bool = True,
               fast_exp: bool = False, config: Config | None = None, interpret: bool = False,
               out_dtype=F32) -> jax.Array:
  """Sparse MLA attention of one layer → [T, H, D] in `out_dtype` (see reference.py for the exact semantics). The
  kernels normalize and de-rotate in f32 and round once when they store: bf16 out (the model's under bf16_matmul,
  where the output projection reads bf16) has the bits of the f32 output cast to bf16, without the f32 copy.

  q [T, H, D] f32/bf16 (normalized, rotated); raw_kv [N, D] (row i at position raw_start + i); comp_kv [R, D]
  (None allowed for kind "window"); sink [H]; q_start / raw_start Python ints or traced int32 scalars (one
  compile serves every offset); kind "window" | "hca" | "csa"; indices [T, k] int32 for "csa" (ascending,
  −1 = empty); inv_freq numpy [rope_dim / 2]; scale defaults to D^−0.5.
  impl "stream" | "grouped"; f32_stage / fast_exp are the streaming kernel's options (any combination runs here;
  the upstream rule that fast exp needs f32 staging is a feature rule, checked in ds4jax/features.py). config=None picks
  `Config.default` for the platform ("cpu" heuristics when interpret).
  """
  if impl not in IMPLS:
    raise ValueError(f"impl={impl!r}: expected one of {IMPLS}")
  if fast_exp and impl != "stream":
    raise ValueError(f"fast_exp=True requires impl='stream' (got impl={impl!r})")
  q, raw_kv, sink = jnp.asarray(q), jnp.asarray(raw_kv), jnp.asarray(sink)
  comp_kv = None if comp_kv is None else jnp.asarray(comp_kv)
  indices = None if indices is None else jnp.asarray(indices)
  if config is None:
    config = Config.default(q.shape[1] if q.ndim == 3 else 1, q.shape[-1], kind,
                            platform="cpu" if interpret else default_platform(), dtype=raw_kv.dtype,
                            f32_stage=f32_stage)
  config.validate(compiled=not interpret)
  g = geometry(q, raw_kv, comp_kv, sink, q_start=q_start, raw_start=raw_start, kind=kind, ratio=ratio,
               window=window, inv_freq=inv_freq, indices=indices, scale=scale, config=config)
  offsets = jnp.stack([jnp.asarray(q_start, jnp.int32), jnp.asarray(raw_start, jnp.int32)])
  idx = jnp.zeros((1, 1), jnp.int32) if indices is None else indices.astype(jnp.int32)
  if indices is not None and idx.shape[1] < g.k:  # k < keys_per_stage: empty slots fill the stage
    idx = jnp.pad(idx, ((0, 0), (0, g.k - idx.shape[1])), constant_values=-1)
  freq_cols = jnp.asarray(keyset.freq_columns(inv_freq, g.D))
  if jnp.dtype(out_dtype) not in (jnp.dtype(F32), jnp.dtype(jnp.bfloat16)):
    raise ValueError(f"out_dtype must be float32 or bfloat16, got {jnp.dtype(out_dtype)}")
  sink = keyset.kernel_sink(sink)
  return _run(offsets, q, raw_kv, comp_kv, idx, sink, freq_cols, g=g, config=config, impl=impl,
              f32_stage=bool(f32_stage), fast_exp=bool(fast_exp), interpret=bool(interpret),
              out_dtype=jnp.dtype(out_dtype))


@functools.partial(jax.jit, static_argnames=("g", "config", "impl", "f32_stage", "fast_exp", "interpret",
                                             "out_dtype"))
def _run(offsets, q, raw_kv, comp_kv, idx, sink, freq_cols, *, g, config, impl, f32_stage, fast_exp, interpret,
         out_dtype):
  qp = operand_parts(q.reshape(g.T * g.H, g.D), g.q_parts)
  rp = operand_parts(raw_kv, g.raw_parts)
  cp = rp[:1] if comp_kv is None else operand_parts(comp_kv, g.comp_parts)  # placeholder for kind "window"
  if g.kind == "csa":
    idx = keyset.clean_indices(idx, offsets[0], g.ratio, g.R)
  if impl == "grouped":
    return grouped_mod.mla_grouped(offsets, qp, rp, cp, idx, sink, freq_cols, g=g, config=config,
                                   interpret=interpret, out_dtype=out_dtype)
  return stream_mod.mla_stream(offsets, qp, rp, cp, idx, sink, freq_cols, g=g, config=config,
                               f32_stage=f32_stage, fast_exp=fast_exp, interpret=interpret, out_dtype=out_dtype)


def kernel_name(impl: str = "stream", f32_stage: bool = True, fast_exp: bool = False) -> str:
  """The pallas_call name `sparse_mla` launches for these options."""
  return grouped_mod.NAME if impl == "grouped" else stream_mod.kernel_name(f32_stage, fast_exp)


def lowering_cases(platform: str, precision: str | None = None) -> list[tuple[str, object, tuple]]:
  """(label, fn, args) at V4-Flash shapes (H 64, D 512, window 128, rope 64) with the configs
  `Config.default(..., platform=platform)` ships: the last 8192-query chunk of a 128K prefill (q_start 114688
  traced, raw rows from q_start − 127) on a CSA layer (ratio 4, top-512, R 30720) — streaming with f32 stage +
  fast exp, with f32 stage only, streaming without staging, and the grouped baseline, bf16 q/KV; the streaming
  kernel with f32 q/KV (3-pass split dots); and an HCA layer (ratio 128, R 960) and a window layer, streaming, bf16.
  `precision` replaces the configs' precision (e.g. "bf16", the model's under bf16_matmul)."""
  s = V4_FLASH_MLA
  H, D, W, k, r = s["num_heads"], s["head_dim"], s["window"], s["k"], s["rope_dim"]
  T, q_start = 8192, 122880 - 8192
  N = T + W - 1
  freqs = np.linspace(1.0, 1e-4, r // 2).astype(np.float32)
  sds = jax.ShapeDtypeStruct
  cases = []

  def case(label, kind, ratio, dtype, impl="stream", f32_stage=True, fast_exp=False):
    R = (q_start + T) // ratio if kind != "window" else 0
    cfg = Config.default(H, D, kind, platform=platform, dtype=dtype, f32_stage=f32_stage)
    if precision is not None:
      cfg = dataclasses.replace(cfg, precision=precision)

    def fn(q, raw_kv, comp_kv, sink, indices, qs):
      return sparse_mla(q, raw_kv, comp_kv, sink, q_start=qs, raw_start=qs - (W - 1), kind=kind, ratio=ratio,
                        window=W, inv_freq=freqs, indices=indices, impl=impl, f32_stage=f32_stage,
                        fast_exp=fast_exp, config=cfg)

    args = (sds((T, H, D), dtype), sds((N, D), dtype), sds((R, D), dtype) if R else None,
            sds((H,), jnp.float32), sds((T, k), jnp.int32) if kind == "csa" else None, sds((), jnp.int32))
    cases.append((f"mla {label} {T} q @ {q_start} {platform}", fn, args))

  case("csa stream f32stage fastexp bf16", "csa", s["csa_ratio"], jnp.bfloat16, fast_exp=True)
  case("csa stream f32stage bf16", "csa", s["csa_ratio"], jnp.bfloat16)  # kill_mla_stream_fast_exp's kernel
  case("csa stream unstaged bf16", "csa", s["csa_ratio"], jnp.bfloat16, f32_stage=False)
  case("csa grouped bf16", "csa", s["csa_ratio"], jnp.bfloat16, impl="grouped")
  case("csa stream f32stage fastexp f32", "csa", s["csa_ratio"], jnp.float32, fast_exp=True)
  case("csa stream unstaged f32", "csa", s["csa_ratio"], jnp.float32, f32_stage=False)
  case("hca stream f32stage fastexp bf16", "hca", s["hca_ratio"], jnp.bfloat16, fast_exp=True)
  case("window stream f32stage fastexp bf16", "window", 1, jnp.bfloat16, fast_exp=True)
  return cases


__all__ = ["Config", "IMPLS", "V4_FLASH_MLA", "kernel_name", "lowering_cases", "sparse_mla",
           "sparse_mla_reference"]
