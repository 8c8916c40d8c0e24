"""prefill_moe_over_bands at one layer on the H200: Block.feed_forward over 32768 rows at once against four
8192-row bands (the decoded experts, as prefill runs them), the same random streams. V4-Flash, lucebox_mix."""
import dataclasses, json, os, sys, time
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from ds4jax import config, features, model, prefill
from ds4jax.metrics import nmse
from ds4jax.quant import policy as quant_policy
from experiments import device_memory
device_memory.claim()
n, B = int(sys.argv[2]), 8192
cfg = config.preset("v4_flash")
f = dataclasses.replace(features.resolve(features.device_class(), fits=model.kernel_fits(cfg, "lucebox_mix"), tokens=n),
                        prefill_moe_over_bands=True)
m = model.init_random(cfg, seed=0, policy=quant_policy.get("lucebox_mix"))
res = dict(tokens=n, band=B, code_commit=os.environ.get("DS4JAX_GIT_COMMIT"), layers={})
key = jax.random.key(1)
tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, n), jnp.int32)
for layer in [int(a) for a in sys.argv[1].split(",")]:
  gdef, state = prefill.step_parts(m.layers[layer], f, n // B)
  ff = jax.jit(lambda st, X, t: nnx.merge(gdef, st).feed_forward(X, t, f)[:2])
  X = jax.random.normal(jax.random.fold_in(key, layer), (n, cfg.hc_mult, cfg.hidden_size), jnp.float32)
  Yj, Rj = (np.asarray(a) for a in ff(state, X, tokens))
  parts = [[np.asarray(a) for a in ff(state, X[k * B:(k + 1) * B], tokens[k * B:(k + 1) * B])] for k in range(n // B)]
  Yb, Rb = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
  Xh = np.asarray(X)
  del X, parts, state
  uj, ub = Yj - Xh, Yb - Xh
  res["layers"][layer] = dict(nmse=float(np.sum((uj - ub) ** 2) / np.sum(ub ** 2)),
                              max_abs_diff=float(np.max(np.abs(Yj - Yb))), max_abs_update=float(np.max(np.abs(ub))),
                              bitwise=bool(np.array_equal(Yj, Yb)), routes_equal=bool(np.array_equal(Rj, Rb)),
                              finite=bool(np.isfinite(Yj).all()))
  print(layer, res["layers"][layer], flush=True)
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "over_bands_layer_parity_h200.json"), "w"), indent=1)
