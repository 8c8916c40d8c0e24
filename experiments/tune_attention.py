"""The streaming-MLA tuning sweep: Config variants of one V4-Flash CSA layer (8192 queries, 64 heads, D 512,
top-512 + the 128-row window, bf16 q/KV), f32 stage + fast exp (the model's sm_90 path), in one process.

    python -m experiments.tune_attention [--contexts=8192,131072] [--variants=default,kb64,...] [--out=F.json]
    python -m experiments.tune_attention --ablations        # diagnostic kernels: where a stage's time goes
    python -m experiments.tune_attention --smoke            # tiny shapes, interpret mode (CPU check of the script)

Per (context, variant): median ms, TFLOP/s over the useful work (2·T·H·keys·2D, keys = the visible window rows
plus the selected rows of each query), and NMSE against the dense f32 reference on the last 256 queries.
`--ablations` times kernels with one part of each stage removed (contiguous rows instead of the gather, no value
dot, no score dot): their outputs are wrong by design, and only their times mean anything.
Each line is written to `--out` as it is measured, so a crash or a time-out loses nothing already measured.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from ds4jax.metrics import nmse
from experiments import attention_problem, run_record, timing
from kernels_pallas import indexer, mla
from kernels_pallas.mla import keyset

_CONTEXTS = flags.DEFINE_list("contexts", ["8192"], "Context lengths L (the 8192-query chunk ends at L).")
_VARIANTS = flags.DEFINE_list("variants", [], "Variants to time (default: all).")
_ABLATIONS = flags.DEFINE_boolean("ablations", False, "Also time the diagnostic kernels (default config).")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed runs per measurement (median).")
_OUT = run_record.define_out_flag()
_SMOKE = flags.DEFINE_boolean("smoke", False, "Tiny shapes in interpret mode (CPU), to check the script.")

FLASH = dict(H=64, D=512, window=128, k=512, ratio=4, rope_dim=64, T=8192)
SMOKE = dict(H=16, D=64, window=16, k=16, ratio=4, rope_dim=16, T=16)

# name: Config overrides on top of Config.default(64, 512, "csa", "cuda", precision="bf16") (the model's
# precision under bf16_matmul); the split variants are the f32 parity path's.
VARIANTS = {
    "default": {},
    "dk64": dict(head_dim_chunk=64),
    "dk256": dict(head_dim_chunk=256),
    "dk512": dict(head_dim_chunk=512),
    "kb16": dict(keys_per_stage=16),
    "kb16_s3": dict(keys_per_stage=16, num_stages=3),
    "kb64_s1": dict(keys_per_stage=64, num_stages=1),
    "kb64": dict(keys_per_stage=64),
    "kb32": dict(keys_per_stage=32),
    "s1": dict(num_stages=1),
    "s3": dict(num_stages=3),
    "s4": dict(num_stages=4),
    "w4": dict(num_warps=4),
    "w16": dict(num_warps=16),
    "w16_kb64": dict(num_warps=16, keys_per_stage=64),
    "w16_kb64_s3": dict(num_warps=16, keys_per_stage=64, num_stages=3),
    "w16_dk256": dict(num_warps=16, head_dim_chunk=256),
    "w16_s3": dict(num_warps=16, num_stages=3),
    "q_reload": dict(q_resident=False),
    "h32": dict(heads_per_program=32),
    "h32_w4": dict(heads_per_program=32, num_warps=4),
    "split": dict(precision="split"),
    "split_kb16": dict(precision="split", keys_per_stage=16),
    "split_w16": dict(precision="split", num_warps=16),
    "split_w16_kb16": dict(precision="split", num_warps=16, keys_per_stage=16),
    "split_dk64": dict(precision="split", head_dim_chunk=64),
    "split_dk128": dict(precision="split", head_dim_chunk=128),  # the split default before f1d2d94
    "kb64_dk256": dict(keys_per_stage=64, head_dim_chunk=256),
    "kb64_dk512": dict(keys_per_stage=64, head_dim_chunk=512),
    "kb64_qreload": dict(keys_per_stage=64, q_resident=False),
    # Offline sm_90 compiles at precision bf16: 64 keys spill 184 B at chunks of 128, 52 B at 256, 8 B at 64.
    "kb64_dk64": dict(keys_per_stage=64, head_dim_chunk=64),
    "split_kb64": dict(precision="split", keys_per_stage=64),
    # the grouped baseline (two passes, scores through HBM, no fast exp) at its own tilings: issue #19 compares the
    # streaming kernel with it "each at its best config"
    "grouped": dict(impl="grouped"),
    "grouped_kb32": dict(impl="grouped", keys_per_stage=32),
    "grouped_kb16": dict(impl="grouped", keys_per_stage=16),
    "grouped_dk64": dict(impl="grouped", head_dim_chunk=64),
    "grouped_dk256": dict(impl="grouped", head_dim_chunk=256),
    "grouped_s3": dict(impl="grouped", num_stages=3),
    "grouped_h32_w4": dict(impl="grouped", heads_per_program=32, num_warps=4),
}


def _contiguous_csa_stage(pr, s, idx_ref):
  """Diagnostic: the stage reads rows s·kb … s·kb + kb − 1 instead of the selected ones (no gather)."""
  st = _CSA_STAGE(pr, s, idx_ref)
  g = pr.g
  rows = jnp.minimum(s * g.kb + jnp.arange(g.kb, dtype=jnp.int32), g.R - 1)
  return keyset.Stage(st.index, rows, st.valid, st.mask)


def _no_value_dot(acc, p_parts, tile, transposed):
  del tile, transposed
  return acc + jnp.sum(p_parts[0].astype(jnp.float32), axis=1, keepdims=True)


def _no_score_dot(g, pr, q_refs, q_held, k_tiles, stage):
  kb = k_tiles[0][0].shape[1]
  return jnp.zeros((g.M, kb), jnp.float32) + k_tiles[0][0][:1, :].astype(jnp.float32)


_CSA_STAGE = keyset.csa_stage
ABLATIONS = {
    "ablate_contiguous_rows": ("csa_stage", _contiguous_csa_stage),
    "ablate_no_value_dot": ("add_values", _no_value_dot),
    "ablate_no_score_dot": ("scores", _no_score_dot),
}


def main(argv):
  del argv
  dims = SMOKE if _SMOKE.value else FLASH
  H, D, W, k, ratio, T = (dims[n] for n in ("H", "D", "window", "k", "ratio", "T"))
  interpret = _SMOKE.value
  n = 1 if interpret else _REPEATS.value
  platform = "cpu" if interpret else "cuda"
  contexts = [64] if interpret else [int(c) for c in _CONTEXTS.value]
  freqs = (1.0 / 10000.0 ** (np.arange(0, dims["rope_dim"], 2) / dims["rope_dim"])).astype(np.float32)
  record = dict(benchmark="tune_attention", env=run_record.environment(), dims=dims, runs=[])
  names = _VARIANTS.value or list(VARIANTS)
  unknown = sorted(set(names) - set(VARIANTS))
  if unknown:
    raise app.UsageError(f"--variants: unknown {unknown}; known: {sorted(VARIANTS)}")

  save = run_record.appender(_OUT.value, record)

  for L in contexts:
    (q_start, raw_start, _, R), (q, raw_kv, comp_kv, sink), keys = attention_problem.chunk_inputs(L, T, dims)
    Tq = L - q_start
    # Random visible rows per query (the indexer's output is ascending, −1 past the visible ones).
    pos = q_start + jnp.arange(Tq)
    vis = jnp.minimum((pos + 1) // ratio, R)
    u = jax.random.uniform(keys[0], (Tq, R))
    u = jnp.where(jnp.arange(R)[None, :] < vis[:, None], u, -1.0)
    top = jax.lax.top_k(u, k)[1]
    indices = jnp.sort(jnp.where(jnp.take_along_axis(u, top, 1) >= 0, top, R + 1), axis=1)
    indices = jnp.where(indices > R, -1, indices).astype(jnp.int32)
    used = int(jnp.sum(indices >= 0)) + int(np.sum(np.minimum(np.asarray(pos) + 1, W)))
    flops = 2 * H * used * 2 * D
    m = min(256, Tq)
    sl = slice(Tq - m, Tq)
    want = mla.sparse_mla_reference(q[sl], raw_kv, comp_kv, sink, q_start=q_start + Tq - m, raw_start=raw_start,
                                    kind="csa", ratio=ratio, window=W, inv_freq=freqs, indices=indices[sl])
    base = dict(context=L, q_start=q_start, queries=Tq, comp_rows=R, used_keys=used)

    def run(name, over, patch=None):
      try:
        over = dict(over)
        impl = over.pop("impl", "stream")
        cfg = mla.Config.default(H, D, "csa", platform=platform, **(dict(precision="bf16") | over))
        f = jax.jit(lambda a, b, c, d, e, s: mla.sparse_mla(
            a, b, c, d, q_start=s, raw_start=jnp.maximum(s - (W - 1), 0), kind="csa", ratio=ratio, window=W,
            inv_freq=freqs, indices=e, impl=impl, f32_stage=True, fast_exp=impl == "stream", config=cfg,
            interpret=interpret))
        args = (q, raw_kv, comp_kv, sink, indices, jnp.int32(q_start))
        jax.clear_caches()  # a patched kernel must not reuse (or leave behind) a compiled one
        t0 = time.perf_counter()
        with mock.patch.object(keyset, patch[0], patch[1]) if patch else contextlib.nullcontext():
          out = jax.block_until_ready(f(*args))
          compile_s = time.perf_counter() - t0
          ms = timing.timeit(f, *args, n=n)
        save(base | dict(variant=name, impl=impl, config=dataclasses.asdict(cfg), ms=ms, tflops=flops / ms / 1e9,
                         compile_s=compile_s, nmse_vs_reference=None if patch else nmse(out[sl], want)))
      except Exception as e:  # noqa: BLE001 -- one failing variant must not stop the sweep
        save(base | dict(variant=name, config=over, error=f"{type(e).__name__}: {str(e)[:300]}"))
      finally:
        if patch:
          jax.clear_caches()

    if _ABLATIONS.value:
      run("default", {})
      for name, patch in ABLATIONS.items():
        run(name, {}, patch)
    for name in names:
      if not (_ABLATIONS.value and name == "default"):
        run(name, VARIANTS[name])


if __name__ == "__main__":
  app.run(main)
