"""prefill_moe_over_bands against per-band MoE on the full V4-Flash (lucebox_mix) at 32768 tokens on the H200: final
and sampled positions' logits, both fast paths, compared (max |diff| / max |logit|, NMSE, argmax agreement)."""
import dataclasses, json, os, sys, time
import jax, numpy as np
from ds4jax import config, features, model, prefill
from ds4jax.metrics import nmse
from ds4jax.quant import policy as quant_policy
from experiments import device_memory
device_memory.claim()
n = int(sys.argv[1]) if len(sys.argv) > 1 else 32768
cfg = config.preset("v4_flash")
fits = model.kernel_fits(cfg, "lucebox_mix")
base = features.resolve(features.device_class(), fits=fits, tokens=n)
over = dataclasses.replace(base, prefill_moe_over_bands=True)
t = time.perf_counter()
m = model.init_random(cfg, seed=0, policy=quant_policy.get("lucebox_mix"))
jax.block_until_ready(jax.tree.leaves(m))
tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, n)
positions = list(range(n - 1, 0, -(n // 16)))  # 16 positions across the bands
out = {}
for name, f in (("per_band", base), ("over_bands", over)):
  out[name] = np.asarray(prefill.prefill_logits(m, tokens, f, positions=positions), np.float32)
  print(name, f"{time.perf_counter() - t:.0f}s", flush=True)
a, b = out["per_band"], out["over_bands"]
res = dict(tokens=n, positions=positions, max_abs_diff=float(np.max(np.abs(a - b))), max_abs=float(np.max(np.abs(a))),
           nmse=float(nmse(b, a)), argmax_agree=int(np.sum(a.argmax(-1) == b.argmax(-1))), bitwise=bool(np.array_equal(a, b)),
           finite=bool(np.isfinite(b).all()), code_commit=os.environ.get("DS4JAX_GIT_COMMIT"))
print(json.dumps(res), flush=True)
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "over_bands_parity_h200.json"), "w"), indent=1)
