"""Which switch moves the logits: one prompt prefix under several feature sets, each against the exact path.

    python -m experiments.parity_by_switch --flagfile=qual.cfg --tokens=4096 --out=/tmp/parity_by_switch.json

Takes the model, prompt and exact prefix logits of a qualification run (the same flags; the exact logits come from
<qualification out>.exact.npz, or are computed) and runs the final-position prefill of the first --tokens prompt
tokens under each variant:

  all_on            the flags' resolved features
  all_on_f32        all_on with bf16_matmul off: the kernels on exact f32 operands
  reference_bf16    every kernel off, bf16_matmul on: the reference math with bf16 operands

Each variant gets NMSE, max abs error, top-1 and KL against the exact path (experiments/qualification.py metrics).
"""

import dataclasses
import json
import sys
import time

import jax
from absl import app, flags

from ds4jax import features as features_lib
from ds4jax import prefill as prefill_lib
from experiments import qualification as q
from experiments import run_record

q.define_flags(flags.FLAGS)
flags.DEFINE_integer("tokens", 4096, "Prompt prefix length the variants and the exact path run on.")
flags.DEFINE_list("variants", ["all_on", "all_on_f32", "reference_bf16"], "Variants to run (see the docstring).")
flags.DEFINE_string("results", None, "Output JSON of this tool (default: next to --out, *_parity_by_switch.json).")


def variants(base: features_lib.Features) -> dict[str, features_lib.Features]:
  exact = q.exact_features(base.device_class)
  return dict(all_on=base, all_on_f32=dataclasses.replace(base, bf16_matmul=False),
              reference_bf16=dataclasses.replace(exact, bf16_matmul=True))


def main(argv):
  del argv
  opts = q.options_from_flags(flags.FLAGS)
  cfg = q._model_config(opts)  # pylint: disable=protected-access
  dev_cls = features_lib.device_class()
  base = features_lib.resolve(dev_cls, opts.features)
  ids, _ = q.prompt_ids(opts, cfg)
  n = flags.FLAGS.tokens
  t0 = time.perf_counter()
  m = q.build_model(opts, cfg)
  fingerprint = q.weights_fingerprint(m)
  print(f"weights ready ({time.perf_counter() - t0:.0f}s), fingerprint {fingerprint[:12]}", flush=True)
  clock = q._Clock(1, print)  # pylint: disable=protected-access
  prefixes = q._ExactPrefixes(m, ids, q.exact_features(dev_cls), fingerprint,  # pylint: disable=protected-access
                              q.exact_cache_path(opts.out), clock)
  runs = {k: v for k, v in variants(base).items() if k in flags.FLAGS.variants}
  if opts.precompile_workers:
    if not jax.config.jax_compilation_cache_dir:
      import tempfile  # pylint: disable=import-outside-toplevel
      jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="ds4jax_jit_cache_"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    todo = [(n, f) for f in runs.values()] + ([] if n in prefixes.stored() else [(n, prefixes.feats)])
    prefill_lib.precompile(m, todo, opts.precompile_workers, log=clock.say)
  exact = prefixes.get(n)
  out = dict(env=run_record.environment(), tokens=n, weights_fingerprint=fingerprint,
             prompt_sha256=q.sha256_array(ids[:n]), exact_logits_sha256=q.sha256_array(exact), variants={})
  path = flags.FLAGS.results or opts.out.replace(".json", "_parity_by_switch.json")
  for name, f in runs.items():
    t0 = time.perf_counter()
    try:
      logits = q._final_logits(m, ids[:n], f)  # pylint: disable=protected-access
      rec = dict(features=f.to_dict(), switches_on=f.on(), cold_s=time.perf_counter() - t0,
                 parity=q.parity_metrics(logits, exact, opts.kl_gate))
    except Exception as e:  # noqa: BLE001 -- record and go on
      rec = dict(features=f.to_dict(), switches_on=f.on(), error=f"{type(e).__name__}: {str(e)[:500]}")
    out["variants"][name] = rec
    p = rec.get("parity") or {}
    print(f"{name}: {rec.get('error') or ''} NMSE {p.get('nmse')} KL {p.get('kl')} top-1 {p.get('top1_agree')} "
          f"({time.perf_counter() - t0:.1f}s)", flush=True)
    run_record.write_json(path, out)
  print(f"results: {path}")


if __name__ == "__main__":
  try:
    app.run(main)
  except q.STARTUP_ERRORS as e:
    sys.exit(f"parity_by_switch: {e}")
