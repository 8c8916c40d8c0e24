# Session probe, run by hand on the H200; kept as the record of final_logit_determinism_probe_s36.json.
"""Session probe: is the all_on final-position logit run-to-run deterministic on the H200 (V4-Flash, 4096-token
prefix of the qualification's prompt)? Same program three times, plus prefill_moe_over_bands off (same program at
one band) and the one-band (8192) defaults."""
import dataclasses, json, os, sys, time
import jax, numpy as np
from absl import flags
from experiments import qualification as q
from experiments.qualification import inputs, qualify
from ds4jax import prefill as prefill_lib

fv = flags.FlagValues(); q.define_flags(fv); fv(["prefill", f"--flagfile={sys.argv[1] if len(sys.argv) > 1 else 'qual.cfg'}"])
opts = q.options_from_flags(fv)
setup = qualify.start_up(opts)
m = inputs.build_model(opts, setup.cfg)
ids = setup.ids[:opts.verdict_tokens]
long_n, short_n = max(opts.lengths), min(opts.lengths)
t0 = time.perf_counter()
def run(f):
  return np.asarray(jax.block_until_ready(prefill_lib.prefill_logits(m, ids, f)), np.float32).reshape(-1)
def kl(a, b):
  pa, pb = jax.nn.log_softmax(a), jax.nn.log_softmax(b)
  return float(np.sum(np.exp(pa) * (pa - pb)))
f32k = setup.base[long_n]
runs = {"multi_a": f32k, "multi_b": f32k, "multi_c": f32k,
        "multi_no_over_bands": dataclasses.replace(f32k, prefill_moe_over_bands=False),
        "one_band_a": setup.base[short_n], "one_band_b": setup.base[short_n]}
out = {k: run(f) for k, f in runs.items()}
ref = out["multi_a"]
res = {}
for k, v in out.items():
  res[k] = dict(bitwise_equal_to_multi_a=bool(np.array_equal(v.view(np.uint32), ref.view(np.uint32))),
                max_abs=float(np.max(np.abs(v - ref))), kl_from_multi_a=kl(ref, v), top1=int(np.argmax(v)))
  print(k, res[k], f"{time.perf_counter() - t0:.0f}s", flush=True)
res["one_band_b_vs_a"] = kl(out["one_band_a"], out["one_band_b"])
print(json.dumps(res))
if os.environ.get("OUT"):
  json.dump(res, open(os.path.join(os.environ["OUT"], "final_logit_determinism_probe.json"), "w"), indent=1)
