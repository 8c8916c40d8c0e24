"""Where one prefill spends its device time: warm timings, then one prefill under the profiler, kernel time summed
by kernel name.

    python -m experiments.trace_prefill --preset=v4_flash --quant_policy=lucebox_mix --tokens=8192,32768 \
        --out=experiments/results/trace_prefill_h200.json [--without=prefill_weights_stationary] [feature flags]

Per length and feature set (the flags' set, then one per `--without` switch: the qualification's kill_<switch>):
one warm-up prefill (compiles), `--repeats` timed ones (median wall time, tok/s), then one under `jax.profiler.trace`
(unless `--notrace`), its kernels summed by name (experiments/device_trace.py). Each length resolves its own
defaults (a one-band prompt may take other kernels: features.Capability.when), so every run records its switches;
the file's `variants` are the first length's. The total is
the device's busy time; when it is close to the wall time, the device was never idle and host dispatch is not the
bottleneck. Results are rewritten after each run, and a run that fails (out of memory) is recorded as such.
`--preset=tiny_sparse` runs on a CPU (interpret mode: kernels show as host work, so the summary may be empty).
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import tempfile
import time

import jax
import numpy as np
from absl import app, flags

from ds4jax import config as config_lib
from ds4jax import features as features_lib
from ds4jax import mesh as mesh_lib
from ds4jax import model as model_lib
from ds4jax import prefill
from ds4jax.quant import policy as quant_policy
from experiments import device_memory, device_trace, run_record
from experiments import flags as flags_lib
from experiments.qualification import matrix, runner

_PRESET = flags.DEFINE_string("preset", "v4_flash", "Model preset.")
_TOKENS = flags.DEFINE_list("tokens", ["8192"], "Prompt lengths.")
_REPEATS = flags.DEFINE_integer("repeats", 2, "Timed warm prefills per length (median).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the weights and of the prompt.")
_TOP = flags.DEFINE_integer("top", 25, "Kernels listed per length (the rest are summed as 'other').")
_WITHOUT = flags.DEFINE_list("without", [], "Also run with each of these switches off (one run per switch).")
_PRECOMPILE = flags.DEFINE_integer("precompile_workers", 0, "> 0: compile every layer program first, this many at "
                                   "a time (as the qualification does).")
_TRACE = flags.DEFINE_boolean("trace", True, "Trace one prefill per run and sum its kernels.")
_LAYERS = flags.DEFINE_integer("layers", 0, "> 0: the preset's first this many layers only (V4-Flash on a GPU it "
                               "does not fit whole; each layer as in the full model).")
_OUT = run_record.define_out_flag()
flags_lib.define_quant_policy_flag()
flags_lib.define_feature_flags()
flags_lib.define_mesh_flag()  # a sharded prefill's kernel times are summed over the devices


def main(argv):
  del argv
  device_memory.claim()  # before JAX starts its backend
  fv = flags.FLAGS
  try:
    cfg, lengths, by_length, variants = start(fv)
  except ValueError as e:  # FeatureError, an unknown preset, a bad length, ...
    sys.exit(f"trace_prefill: {e}")
  rng = np.random.default_rng(_SEED.value)
  tokens = rng.integers(0, cfg.vocab_size, max(lengths))
  record = dict(run_record.environment(), what="prefill device time by kernel (experiments/trace_prefill.py)",
                preset=cfg.name, layers=cfg.num_layers, quant_policy=fv.quant_policy,
                variants={name: f.on() for name, f in variants[lengths[0]].items()},
                switch_states={name: features_lib.switch_states(f) for name, f in variants[lengths[0]].items()},
                runs=[])
  for n in lengths:
    print(f"{n} tokens: {features_lib.describe_states(by_length[n])}", flush=True)
  t0 = time.perf_counter()
  m = model_lib.init_random(cfg, seed=_SEED.value, policy=quant_policy.get(fv.quant_policy), mesh=fv.mesh)
  jax.block_until_ready(jax.tree.leaves(m))
  record["mesh"] = mesh_lib.spec_of(m)  # where it runs, not what was asked
  print(f"{cfg.name} {fv.quant_policy}: weights in {time.perf_counter() - t0:.0f}s; "
        f"{mesh_lib.describe(fv.mesh, cfg)}", flush=True)
  if _PRECOMPILE.value:
    runner.ModelRunner().precompile(m, [(n, f) for n in lengths for f in variants[n].values()], _PRECOMPILE.value,
                                    lambda line: print(line, flush=True))
  for n in lengths:
    for name, f in variants[n].items():
      entry = dict(tokens=n, variant=name, switches_on=f.on(), switch_states=features_lib.switch_states(f))
      try:
        entry |= measure(m, tokens[:n], f)
      except Exception as e:  # noqa: BLE001 -- e.g. out of memory: recorded, the other runs go on
        entry["error"] = f"{type(e).__name__}: {str(e)[:400]}"
      record["runs"].append(entry)
      report(entry)
      if _OUT.value:
        run_record.write_json(_OUT.value, record)


def start(fv):
  """The model config, the prompt lengths, each length's features and its variants, checked before any weights."""
  cfg = config_lib.preset(_PRESET.value)
  if _LAYERS.value < 0 or _REPEATS.value < 1:
    raise ValueError(f"--layers must be >= 0 and --repeats >= 1, got {_LAYERS.value} and {_REPEATS.value}")
  if _LAYERS.value:
    layers = min(_LAYERS.value, cfg.num_layers)
    cfg = dataclasses.replace(cfg, attention=cfg.attention[:layers], routing=cfg.routing[:layers])
  if not _TOKENS.value or not all(t.isdigit() and 0 < int(t) <= cfg.max_position_embeddings for t in _TOKENS.value):
    raise ValueError(f"--tokens must be lengths in [1, {cfg.max_position_embeddings}], got {_TOKENS.value}")
  unknown = [s for s in _WITHOUT.value if s not in features_lib.SWITCHES]
  if unknown:
    raise ValueError(f"--without: unknown switches {unknown}")
  lengths = [int(t) for t in _TOKENS.value]
  # The defaults may differ by length (one-band prompts: features.Capability.when), so each length has its own.
  by_length = {n: flags_lib.features_from_flags(fv, cfg=cfg, policy=fv.quant_policy, tokens=n) for n in lengths}
  flags_lib.check_mesh("trace_prefill", fv.mesh, cfg)  # before drawing the weights
  variants = {}
  for n, features in by_length.items():
    flags_lib.check_model_features("trace_prefill", cfg, fv.quant_policy, features)
    variants[n] = {"flags": features}
    for switch in _WITHOUT.value:  # the qualification's kill_<switch> features
      variants[n][f"without_{switch}"] = matrix.without(features, switch)
  return cfg, lengths, by_length, variants


def measure(m, tokens, features) -> dict:
  run = lambda: jax.block_until_ready(prefill.prefill_logits(m, tokens, features))
  t = time.perf_counter()
  run()
  cold = time.perf_counter() - t
  walls = []
  for _ in range(_REPEATS.value):
    t = time.perf_counter()
    run()
    walls.append(time.perf_counter() - t)
  out = dict(cold_s=round(cold, 2), wall_s=[round(w, 4) for w in walls],
             tok_s=round(len(tokens) / statistics.median(walls), 1), peak_bytes=run_record.peak_device_bytes())
  if _TRACE.value:
    with tempfile.TemporaryDirectory() as trace_dir:
      with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        t = time.perf_counter()
        run()
        out["traced_wall_ms"] = round(1e3 * (time.perf_counter() - t), 1)
      out |= device_trace.summary(device_trace.kernel_times(device_trace.read_trace(trace_dir)), _TOP.value)
  return out


def report(entry: dict) -> None:
  head = f"{entry['tokens']} tokens, {entry['variant']}: "
  if "error" in entry:
    print(head + entry["error"], flush=True)
    return
  print(head + f"{entry['tok_s']} tok/s (median of {len(entry['wall_s'])}, cold {entry['cold_s']:.1f}s)"
        + (f"; device busy {entry['device_ms']:.0f} ms of {entry['traced_wall_ms']:.0f} ms traced"
           if "device_ms" in entry else ""), flush=True)
  for row in entry.get("kernels", [])[:12]:
    print(f"  {row['ms']:9.1f} ms {100 * row['share']:5.1f}%  x{row['count']:<6} {row['kernel']}", flush=True)


if __name__ == "__main__":
  app.run(main)
