"""Per-layer verdicts of one configuration, and of planted bugs, on a random model (experiments/verdicts.py).

    python -m experiments.layer_verdicts --preset=tiny_sparse --tokens=32
    python -m experiments.layer_verdicts --preset=tiny_sparse --tokens=32 --bands=2 --mutations=kv_tail_dropped
    python -m experiments.layer_verdicts --preset=v4_flash --quant_policy=lucebox_mix --tokens=1024 \\
        --mutations=dropped_sink,window_off_by_one,index_topk_minus_one --out=verdicts.json      # on an H200

First the configuration the feature flags resolve to (the device's defaults: all_on), every layer; then each
--mutations entry on the exact path with that bug planted in one layer (--mutation_layer, or the first layer of the
kind the bug lives in), that layer only. With --bands=N each run takes the prompt in N bands, as a prefill of a
longer prompt would: what a layer carries between bands is then judged too. Prints one line per layer and a
summary; the JSON is rewritten after each run. Exit status 1 when the configuration fails or a planted bug passes.
"""

from __future__ import annotations

import dataclasses
import sys
import time

import numpy as np
from absl import app, flags

from ds4jax import config as config_lib
from ds4jax import features as features_lib
from ds4jax import mesh as mesh_lib
from ds4jax import model as model_lib
from ds4jax.quant import policy as quant_policy
from experiments import device_memory, mutations, run_record, verdicts
from experiments import flags as flags_lib

_PRESET = flags.DEFINE_string("preset", "tiny_sparse", "Model preset (random weights).")
_TOKENS = flags.DEFINE_integer("tokens", 32, "Prompt length (seeded random ids).")
_BANDS = flags.DEFINE_integer("bands", 1, "Run each layer over the prompt in this many bands (what carries between "
                              "bands is judged from 2 on); a configuration with --prefill_band_tokens=0 stays one.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the weights and the prompt.")
_MUTATIONS = flags.DEFINE_list("mutations", [], f"Planted bugs to run, of {list(mutations.MUTATIONS)}.")
_MUTATION_LAYER = flags.DEFINE_integer("mutation_layer", -1, "Layer to plant them in (-1: the first that fits).")
_CONFIGURATION = flags.DEFINE_boolean("configuration", True, "Judge the configuration (else the mutations only).")
_OUT = run_record.define_out_flag()
flags_lib.define_quant_policy_flag()
flags_lib.define_feature_flags()
flags_lib.define_mesh_flag()

def mutation_layer(cfg, name: str) -> int:
  return _MUTATION_LAYER.value if _MUTATION_LAYER.value >= 0 else mutations.default_layer(cfg, name)


def as_record(v: verdicts.LayerVerdict) -> dict:
  return dict(dataclasses.asdict(v), passed=v.passed, bad_flips=[dataclasses.asdict(f) for f in v.bad_flips[:20]],
              n_bad_flips=len(v.bad_flips))


def main(argv):
  del argv
  device_memory.claim()  # before JAX starts its backend
  try:
    run()
  except ValueError as e:  # FeatureError, an unknown preset or quant policy, a bug with no layer of its kind, ...
    sys.exit(f"layer_verdicts: {e}")


def run():
  cfg = config_lib.preset(_PRESET.value)
  unknown = [n for n in _MUTATIONS.value if n not in mutations.MUTATIONS]
  if unknown:
    sys.exit(f"layer_verdicts: unknown --mutations {unknown}; known: {list(mutations.MUTATIONS)}")
  if not 1 <= _TOKENS.value <= cfg.max_position_embeddings:
    sys.exit(f"layer_verdicts: --tokens must lie in [1, {cfg.max_position_embeddings}]")
  if not 1 <= _BANDS.value <= _TOKENS.value:
    sys.exit(f"layer_verdicts: --bands must lie in [1, --tokens={_TOKENS.value}]")
  carry = [n for n in _MUTATIONS.value if n in mutations.CARRY]
  if carry and _BANDS.value < 2:
    sys.exit(f"layer_verdicts: --mutations {carry} plant bugs in what a layer carries between bands, which one band "
             "from position 0 cannot show: run them with --bands=2")
  if not -1 <= _MUTATION_LAYER.value < cfg.num_layers:
    sys.exit(f"layer_verdicts: --mutation_layer must lie in [0, {cfg.num_layers}) (or -1: the first of its kind)")
  for name in _MUTATIONS.value:
    mutation_layer(cfg, name)  # a bug with no layer of its kind: refused before any weights exist
  band_tokens = -(-_TOKENS.value // _BANDS.value) if _BANDS.value > 1 else 0
  flags_lib.check_mesh("layer_verdicts", flags.FLAGS.mesh, cfg)  # before drawing the weights
  conf = flags_lib.features_from_flags(flags.FLAGS, cfg=cfg, policy=flags.FLAGS.quant_policy, tokens=_TOKENS.value)
  flags_lib.check_model_features("layer_verdicts", cfg, flags.FLAGS.quant_policy, conf)
  exact = dataclasses.replace(features_lib.REFERENCE, device_class=conf.device_class)
  t0 = time.perf_counter()
  m = model_lib.init_random(cfg, seed=_SEED.value, policy=quant_policy.get(flags.FLAGS.quant_policy),
                            mesh=flags.FLAGS.mesh)
  ids = np.random.default_rng(_SEED.value).integers(0, cfg.vocab_size, _TOKENS.value).astype(np.int32)
  print(f"{cfg.name} {flags.FLAGS.quant_policy}: weights ready ({time.perf_counter() - t0:.0f}s); configuration "
        f"{conf.on()}; {mesh_lib.describe(flags.FLAGS.mesh, cfg)}", flush=True)
  doc = dict(run_record.environment(), preset=cfg.name, quant_policy=flags.FLAGS.quant_policy, mesh=mesh_lib.spec_of(m),
             tokens=_TOKENS.value, bands=_BANDS.value, seed=_SEED.value,
             bounds=dict(bf16_factor=verdicts.BF16_FACTOR, f32_bound=verdicts.F32_BOUND, abs_cap=verdicts.ABS_CAP,
                         near_tie_ulps=verdicts.NEAR_TIE_ULPS),
             configuration=dict(features=conf.to_dict(), layers=[]), mutations={})
  save = lambda: _OUT.value and run_record.write_json(_OUT.value, doc)
  ok = True
  if _CONFIGURATION.value:
    out = verdicts.layer_verdicts(m, ids, conf, log=lambda s: print(s, flush=True), band_tokens=band_tokens)
    doc["configuration"]["layers"] = [as_record(v) for v in out]
    doc["configuration"]["passed"] = ok = all(v.passed for v in out)
    w = verdicts.worst(out)
    print(f"configuration: {'PASS' if ok else 'FAIL'}; worst layer {w.layer} ({w.attention}): pinned NMSE "
          f"{w.update_nmse:.2e} of bound {w.bound:.2e}, {len(w.bad_flips)} flips not near-ties", flush=True)
    save()
  caught = True
  for name in _MUTATIONS.value:
    layer = mutation_layer(cfg, name)
    t0 = time.perf_counter()
    v = verdicts.layer_verdicts(m, ids, exact, run_layer=mutations.run_layer(mutations.MUTATIONS[name], {layer}),
                                only={layer}, band_tokens=band_tokens)[0]
    doc["mutations"][name] = as_record(v)
    caught &= not v.passed
    print(f"mutation {name} in layer {layer}: {'FAIL (caught)' if not v.passed else 'PASS (missed!)'}; pinned NMSE "
          f"{v.update_nmse:.2e} of bound {v.bound:.2e}, {len(v.bad_flips)} flips not near-ties "
          f"({time.perf_counter() - t0:.0f}s)", flush=True)
    save()
  if not (ok and caught):
    sys.exit("layer_verdicts: " + ("the configuration fails" if not ok else "a planted bug passed"))


if __name__ == "__main__":
  app.run(main)
