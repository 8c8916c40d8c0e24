"""The sparse MLA attention issue's benchmark: one CSA layer of V4-Flash at long context, in one run.

    python -m experiments.bench_attention --out=experiments/results/attention_h200.json [--queries=8192]
        [--contexts=8192,32768,131072]

Per context L (the query chunk is the last `--queries` tokens of an L-token prefill: q_start = L − T, raw rows
from q_start − 127, R = L // 4 compressed rows, top-512): the grouped baseline, the streaming kernel unstaged,
with the f32 stage, and with f32 stage + fast exp (`--precision` selects the dot precision; default = the
platform's Config.default; `--config` overrides its fields), on a GPU with bf16 q/KV also sm_90's Mosaic GPU kernel
(`stream_wgmma`; `--wgmma_split_chunks` adds split contenders with other accumulator chunks), plus the dense XLA
reference where it fits; the indexer (`kernels_pallas.indexer.topk`, scoring + top-k by sort, and by radix selection:
ids checked equal) and the mask path (`mask_from_topk` + `rows_from_mask`) against the direct handoff (time and compiled
peak memory); per-CSA-layer indexer + attention ms and the indexer's share. NMSE of every variant against the precise
streaming path (exp, f32 stage) and of that against the dense reference on a query slice.
`--smoke` runs tiny shapes in interpret mode on a CPU, to check the script itself.
Results are rewritten after every measurement, so a crash or OOM loses nothing already measured.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from ds4jax.metrics import nmse
from experiments import attention_problem, run_record, timing
from kernels_pallas import indexer, mla
from kernels_pallas.mla import stream_wgmma

_QUERIES = flags.DEFINE_integer("queries", 8192, "Queries per chunk (T).")
_CONTEXTS = flags.DEFINE_list("contexts", ["8192", "32768", "131072"], "Context lengths L (chunk ends at L).")
_PRECISION = flags.DEFINE_enum("precision", None, ["split", "bf16"], "Dot precision (default: Config.default).")
_CONFIG = flags.DEFINE_list("config", [], "Config overrides name=value (e.g. heads_per_program=64,q_resident=true).")
_REPEATS = flags.DEFINE_integer("repeats", 10, "Timed runs per measurement (median).")
_REF_QUERIES = flags.DEFINE_integer("ref_queries", 256, "Queries of the dense-reference NMSE slice.")
_OUT = run_record.define_out_flag()
_SPLIT_CHUNKS = flags.DEFINE_list(
    "wgmma_split_chunks", [], "More stream_wgmma split contenders, as SCORExVALUE accumulator columns (e.g. 512x256: "
    "one chain each, as before the chunks; kernels_pallas/mla/stream_wgmma.py).")
_INDEXER_ONLY = flags.DEFINE_boolean("indexer_only", False, "Time the indexer and the handoffs only.")
_SMOKE = flags.DEFINE_boolean("smoke", False, "Tiny shapes, interpret mode (CPU check of the script).")

FLASH = dict(H=64, D=512, window=128, k=512, ratio=4, rope_dim=64, index_heads=64, index_dim=128)
SMOKE = dict(H=16, D=64, window=16, k=16, ratio=4, rope_dim=16, index_heads=4, index_dim=32)
VARIANTS = {  # name: (impl, f32_stage, fast_exp)
    "grouped": ("grouped", True, False),
    "stream": ("stream", False, False),
    "stream_f32_stage": ("stream", True, False),
    "stream_f32_stage_fast_exp": ("stream", True, True),
}
PRECISE = "stream_f32_stage"


def timeit(f, *args, n):
  """Median ms of n warm calls."""
  return timing.timeit(f, *args, n=n)


def compiled_bytes(f, *args) -> int | None:
  """Temp + output bytes of the compiled function (XLA's memory analysis), or None where unavailable."""
  try:
    m = jax.jit(f).lower(*args).compile().memory_analysis()
    return int(m.temp_size_in_bytes + m.output_size_in_bytes)
  except Exception:  # noqa: BLE001 -- not every backend reports it
    return None


def config_overrides(items: list[str]) -> dict:
  """name=value pairs -> typed Config overrides (ints, true/false, or strings), unknown names refused."""
  fields = {f.name: f.type for f in dataclasses.fields(mla.Config)}
  out = {}
  for item in items:
    name, _, value = item.partition("=")
    if name not in fields or not value:
      raise ValueError(f"--config: {item!r} is not name=value with a name of mla.Config ({sorted(fields)})")
    out[name] = (value.lower() == "true" if value.lower() in ("true", "false")
                 else int(value) if value.lstrip("-").isdigit() else value)
  return out


def main(argv):
  del argv
  dims = SMOKE if _SMOKE.value else FLASH
  H, D, W, k, ratio = dims["H"], dims["D"], dims["window"], dims["k"], dims["ratio"]
  interpret = _SMOKE.value
  n = 2 if _SMOKE.value else _REPEATS.value
  T = 16 if _SMOKE.value else _QUERIES.value
  contexts = [64, 256] if _SMOKE.value else [int(c) for c in _CONTEXTS.value]
  platform = "cpu" if interpret else mla.default_platform()
  over = {} if _PRECISION.value is None else dict(precision=_PRECISION.value)
  over |= config_overrides(_CONFIG.value)
  cfg = mla.Config.default(H, D, "csa", platform=platform, **over)  # the staged kernels'; recorded
  freqs = (1.0 / 10000.0 ** (np.arange(0, dims["rope_dim"], 2) / dims["rope_dim"])).astype(np.float32)
  record = dict(benchmark="sparse_mla", env=run_record.environment(), dims=dims, queries=T,
                config=dataclasses.asdict(cfg), smoke=_SMOKE.value, runs=[])

  save = run_record.appender(_OUT.value, record)

  for L in contexts:
    (q_start, raw_start, N, R), (q, raw_kv, comp_kv, sink), keys = attention_problem.chunk_inputs(L, T, dims)
    Tq = L - q_start
    base = dict(context=L, q_start=q_start, queries=Tq, raw_rows=N, comp_rows=R)
    iq = jax.random.normal(keys[0], (Tq, dims["index_heads"], dims["index_dim"])).astype(jnp.bfloat16)
    iw = jax.random.normal(keys[1], (Tq, dims["index_heads"]), jnp.float32)
    ik = jax.random.normal(keys[2], (R, dims["index_dim"])).astype(jnp.bfloat16)

    # The indexer's scoring kernel alone: TFLOP/s over the visible (query, compressed row) pairs, whose q·k dots
    # (2·heads·dim each) are the useful work, and over the whole [T, R] rectangle the grid covers.
    score_fn = jax.jit(lambda a, b, c, qs: indexer.scores(a, b, c, q_start=qs, ratio=ratio, interpret=interpret))
    qs = jnp.int32(q_start)
    score_ms = timeit(score_fn, iq, iw, ik, qs, n=n)
    pair_flops = 2 * dims["index_heads"] * dims["index_dim"]
    visible = int(np.minimum((q_start + np.arange(Tq) + 1) // ratio, R).sum())
    save(base | dict(contender="indexer_scores", ms=score_ms, visible_pairs=visible,
                     tflops_visible=pair_flops * visible / score_ms / 1e9,
                     tflops_rectangle=pair_flops * Tq * R / score_ms / 1e9))

    # Indexer (scoring + top-k) and the two handoffs.
    idx_fn = jax.jit(lambda a, b, c, qs: indexer.topk(a, b, c, q_start=qs, k=k, ratio=ratio, interpret=interpret))
    indices = idx_fn(iq, iw, ik, qs)
    index_ms = timeit(idx_fn, iq, iw, ik, qs, n=n)
    save(base | dict(contender="indexer_topk", ms=index_ms))
    radix_cfg = dataclasses.replace(indexer.Config.default(Tq, R, dims["index_heads"], dims["index_dim"],
                                                           platform=platform), selection="radix")
    radix_fn = jax.jit(lambda a, b, c, qs: indexer.topk(a, b, c, q_start=qs, k=k, ratio=ratio, config=radix_cfg,
                                                         interpret=interpret))
    save(base | dict(contender="indexer_topk_radix", ms=timeit(radix_fn, iq, iw, ik, qs, n=n),
                     identical_to_sort=bool(jnp.array_equal(radix_fn(iq, iw, ik, qs), indices))))
    mask_path = lambda i: indexer.rows_from_mask(indexer.mask_from_topk(i, R), k)  # noqa: E731
    rebuilt = jax.jit(mask_path)(indices)
    save(base | dict(contender="handoff_mask_path", ms=timeit(jax.jit(mask_path), indices, n=n),
                     compiled_bytes=compiled_bytes(mask_path, indices),
                     identical_to_direct=bool(jnp.array_equal(rebuilt, indices))))
    save(base | dict(contender="handoff_direct", ms=0.0, compiled_bytes=0))

    if _INDEXER_ONLY.value:
      continue

    # Attention variants.
    outs = {}
    for name, (impl, stage, fast) in VARIANTS.items():
      cfg = mla.Config.default(H, D, "csa", platform=platform, f32_stage=stage, **over)
      f = jax.jit(lambda a, b, c, d, e, s, impl=impl, stage=stage, fast=fast, cfg=cfg: mla.sparse_mla(
          a, b, c, d, q_start=s, raw_start=jnp.maximum(s - (W - 1), 0), kind="csa", ratio=ratio, window=W,
          inv_freq=freqs, indices=e, impl=impl, f32_stage=stage, fast_exp=fast, config=cfg, interpret=interpret))
      try:
        outs[name] = f(q, raw_kv, comp_kv, sink, indices, qs)
        ms = timeit(f, q, raw_kv, comp_kv, sink, indices, qs, n=n)
        save(base | dict(contender=name, kernel=mla.kernel_name(impl, stage, fast), ms=ms,
                         keys_per_stage=cfg.keys_per_stage))
      except Exception as e:  # noqa: BLE001 -- one failing contender must not stop the others
        save(base | dict(contender=name, error=f"{type(e).__name__}: {str(e)[:300]}"))
    if not interpret and (H, D) == (64, 512) and q.dtype == jnp.bfloat16:
      # sm_90's Mosaic GPU kernel (docs/mla_mosaic.md): 64 heads a CTA, rows gathered by cp.async; "split" takes the
      # softmax weights in three bf16 parts and stores f32
      chunks = [tuple(int(c) for c in item.split("x")) for item in _SPLIT_CHUNKS.value]
      wgmma = [("stream_wgmma", "bf16", (None, None)), ("stream_wgmma_split", "split", (None, None))]
      wgmma += [(f"stream_wgmma_split_{sc}x{vc}", "split", (sc, vc)) for sc, vc in chunks]
      for name, precision, (sc, vc) in wgmma:
        f = jax.jit(lambda a, b, c, d, e, s, precision=precision, sc=sc, vc=vc: stream_wgmma.sparse_mla_wgmma(
            a, b, c, d, q_start=s, raw_start=jnp.maximum(s - (W - 1), 0), kind="csa", ratio=ratio, window=W,
            inv_freq=freqs, indices=e, precision=precision, score_columns=sc, value_columns=vc))
        try:
          outs[name] = f(q, raw_kv, comp_kv, sink, indices, qs)
          save(base | dict(contender=name, kernel=stream_wgmma.KERNEL_NAME, precision=precision,
                           score_columns=sc or (stream_wgmma.SPLIT_SCORE_COLUMNS if precision == "split" else D),
                           value_columns=vc or (stream_wgmma.SPLIT_VALUE_COLUMNS if precision == "split" else D // 2),
                           ms=timeit(f, q, raw_kv, comp_kv, sink, indices, qs, n=n)))
        except Exception as e:  # noqa: BLE001
          save(base | dict(contender=name, error=f"{type(e).__name__}: {str(e)[:300]}"))
    if PRECISE in outs:
      for name, o in outs.items():
        save(base | dict(contender=name, nmse_vs_precise=nmse(o, outs[PRECISE]),
                         max_abs_vs_precise=float(jnp.max(jnp.abs(o - outs[PRECISE])))))
    if outs:
      # The dense reference on the last ref_queries queries (its [T, N + R] scores do not fit at full T).
      m = min(_REF_QUERIES.value, Tq)
      sl = slice(Tq - m, Tq)
      want = mla.sparse_mla_reference(q[sl], raw_kv, comp_kv, sink, q_start=q_start + Tq - m, raw_start=raw_start,
                                      kind="csa", ratio=ratio, window=W, inv_freq=freqs, indices=indices[sl])
      for name in outs:
        if name == PRECISE or name.startswith("stream_wgmma"):
          save(base | dict(contender=name, ref_queries=m, nmse_vs_dense_reference=nmse(outs[name][sl], want)))
    dense = jax.jit(lambda a, b, c, d, e: mla.sparse_mla_reference(
        a, b, c, d, q_start=q_start, raw_start=raw_start, kind="csa", ratio=ratio, window=W, inv_freq=freqs,
        indices=e))
    try:
      save(base | dict(contender="dense_xla_reference", ms=timeit(dense, q, raw_kv, comp_kv, sink, indices, n=n)))
    except Exception as e:  # noqa: BLE001 -- OOM at long context is expected
      save(base | dict(contender="dense_xla_reference", error=f"{type(e).__name__}: {str(e)[:200]}"))

    # One CSA layer: indexer + attention.
    for name in ("grouped", "stream_f32_stage_fast_exp"):
      att = next((r["ms"] for r in record["runs"] if r.get("context") == L and r.get("contender") == name
                  and "ms" in r), None)
      if att is not None:
        save(base | dict(contender=f"csa_layer indexer + {name}", ms=index_ms + att,
                         indexer_share=index_ms / (index_ms + att)))
    g = next((r["ms"] for r in record["runs"] if r.get("context") == L and r.get("contender") == "grouped"
              and "ms" in r), None)
    s = next((r["ms"] for r in record["runs"] if r.get("context") == L
              and r.get("contender") == "stream_f32_stage_fast_exp" and "ms" in r), None)
    if g and s:
      save(base | dict(contender="speedup stream_f32_stage_fast_exp vs grouped", ratio=g / s))


if __name__ == "__main__":
  app.run(main)
