"""Which switch moves the logits, and in which layer: one prompt prefix under several feature sets.

    python -m experiments.parity_by_switch --flagfile=qual.cfg --tokens=4096 --out=/tmp/q.json [--per_layer]

Takes the model, prompt and exact prefix logits of a qualification run (the same flags; the exact logits come from
<qualification out>.exact.npz, or are computed and stored there) and runs the first --tokens prompt tokens under
each variant:

  all_on              the flags' resolved features
  all_on_f32          all_on with bf16_matmul off: every kernel on exact f32 operands
  reference_bf16      every kernel off, bf16_matmul on: the reference math with bf16 operands
  attention_f32       only the attention switches (indexer + MLA), f32 operands
  moe_f32             only the MoE switches, f32 operands

End to end: final-position logits against the exact path (NMSE, max abs, top-1, KL; the qualification's metrics).
Also the noise floor (--noise_floor_eps): the exact path against itself with its input streams perturbed by one
rounding.
--per_layer: each variant's per-layer verdicts (experiments/verdicts.py): every layer on the exact path's input
streams, its decisions pinned to the exact path's, its update's NMSE against the exact update and the bound of its
operand precision; unpinned, the routing and indexer choices that differ and whether each is a near-tie.
"""

import dataclasses
import sys
import time

from absl import app, flags

from ds4jax import features as features_lib
from ds4jax import prefill as prefill_lib
from experiments import device_memory
from experiments import qualification as q
from experiments import run_record
from experiments import verdicts

FLAGS = flags.FLAGS


def define_flags(fv) -> None:
  """The qualification's flags plus this tool's (defined only when run as a program: tests import the module)."""
  q.define_flags(fv)
  flags.DEFINE_integer("tokens", 4096, "Prompt prefix length the variants and the exact path run on.", flag_values=fv)
  flags.DEFINE_list("variants", ["all_on", "all_on_f32", "reference_bf16"], "Variants to run (see the docstring).",
                    flag_values=fv)
  flags.DEFINE_boolean("end_to_end", True, "Run each variant end to end (final-position logits vs the exact path). "
                       "The exact prefix logits and the noise floor are computed (or loaded) either way.",
                       flag_values=fv)
  flags.DEFINE_boolean("per_layer", False, "Also report each layer's local error on the exact path's input streams.",
                       flag_values=fv)
  flags.DEFINE_string("results", None, "Output JSON (default: --out with _parity_by_switch.json).", flag_values=fv)


def variants(base: features_lib.Features) -> dict[str, features_lib.Features]:
  """The named feature sets (all checked by the capability table of base's device class)."""
  exact = q.exact_features(base.device_class)
  only = lambda prefix_ok: features_lib.resolve(base.device_class, {
      s: getattr(base, s) and prefix_ok(s) for s in features_lib.SWITCHES})
  attention = lambda s: s in ("indexer_score_kernel", "direct_indexer_topk") or s.startswith("mla_")
  return dict(all_on=base, all_on_f32=dataclasses.replace(base, bf16_matmul=False),
              reference_bf16=dataclasses.replace(exact, bf16_matmul=True),
              attention_f32=only(attention), moe_f32=only(lambda s: s.startswith("moe_")))


def main(argv):
  del argv
  device_memory.claim()  # before JAX starts its backend
  try:
    run(q.options_from_flags(FLAGS))
  except q.STARTUP_ERRORS as e:
    sys.exit(f"parity_by_switch: {e}")


def run(opts: q.Options) -> None:
  cfg = q._model_config(opts)  # pylint: disable=protected-access
  dev_cls = features_lib.device_class()
  base = features_lib.resolve(dev_cls, opts.features)
  all_variants = variants(base)
  unknown = [v for v in FLAGS.variants if v not in all_variants]
  if unknown:
    sys.exit(f"parity_by_switch: unknown --variants {unknown}; known: {list(all_variants)}")
  runs = {k: all_variants[k] for k in FLAGS.variants}
  ids, _ = q.prompt_ids(opts, cfg)
  n = FLAGS.tokens
  if not 1 <= n <= len(ids):
    raise q.StartupError(f"--tokens={n} lies outside the {len(ids)}-token prompt (1..{len(ids)})")
  t0 = time.perf_counter()
  m = q.build_model(opts, cfg)
  fingerprint = q.weights_fingerprint(m)
  print(f"weights ready ({time.perf_counter() - t0:.0f}s), fingerprint {fingerprint[:12]}", flush=True)
  clock = q._Clock(1, print)  # pylint: disable=protected-access
  exact_feats = q.exact_features(dev_cls)
  prefixes = q._ExactPrefixes(m, ids, exact_feats, fingerprint,  # pylint: disable=protected-access
                              q.exact_cache_path(opts.out), clock)
  eps = opts.noise_floor_eps
  needs_exact = FLAGS.per_layer or not prefixes.has(n) or (eps and not prefixes.has(n, eps))
  if opts.precompile_workers:
    q.use_persistent_cache()
    todo = [(n, f) for f in runs.values()] + ([(n, exact_feats)] if needs_exact else [])
    prefill_lib.precompile(m, todo, opts.precompile_workers, log=clock.say)
  exact = prefixes.get(n)
  out = dict(env=run_record.environment(), tokens=n, weights_fingerprint=fingerprint,
             prompt_sha256=q.sha256_array(ids[:n]), exact_logits_sha256=q.sha256_array(exact), variants={})
  path = FLAGS.results or opts.out.replace(".json", "_parity_by_switch.json")
  if eps:
    p = out["noise_floor"] = q.noise_floor(prefixes, n, lambda: exact, eps, opts.kl_gate)
    print(f"noise floor (exact path, input noise {eps:.1e}): " + (
        f"NMSE {p['nmse']:.2e} KL {p['kl']:.2e} top-1 {p['top1_agree']}" if "kl" in p else p["error"]), flush=True)
    run_record.write_json(path, out)
  for name, f in (runs.items() if FLAGS.end_to_end else ()):
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
  if FLAGS.per_layer:
    out["per_layer"] = {}
    for name, f in runs.items():
      clock.say(f"per-layer verdicts of {name}")
      layers = verdicts.layer_verdicts(m, ids[:n], f, log=clock.say)
      out["per_layer"][name] = [dict(dataclasses.asdict(v), passed=v.passed) for v in layers]
      run_record.write_json(path, out)
  print(f"results: {path}")


if __name__ == "__main__":
  define_flags(FLAGS)
  app.run(main)
