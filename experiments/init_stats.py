"""How a random model is conditioned: each layer's update against its input stream, and the next-token distribution.

    python -m experiments.init_stats --preset=tiny
    python -m experiments.init_stats --preset=v4_flash --quant_policy=lucebox_mix --tokens=512 --out=stats.json

Runs the prompt (seeded random ids) through the exact path layer by layer (one band) and reports, per layer,
‖X_{l+1} − X_l‖ / ‖X_l‖ over the streams, then the entropy and the max probability of the next-token distribution
averaged over positions. docs/model.md §12 lists what these are for each preset.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from ds4jax import config as config_lib
from ds4jax import features as features_lib
from ds4jax import model as model_lib
from ds4jax import prefill as prefill_lib
from ds4jax.quant import policy as quant_policy
from experiments import device_memory
from experiments import flags as flags_lib
from experiments import run_record

_PRESET = flags.DEFINE_string("preset", "tiny", "Model preset.")
_TOKENS = flags.DEFINE_integer("tokens", 64, "Prompt length (random ids).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the weights and of the prompt.")
_OUT = run_record.define_out_flag()
flags_lib.define_quant_policy_flag()


@jax.jit
def _ratio(new, old):
  return jnp.linalg.norm(new - old) / jnp.linalg.norm(old)


@jax.jit
def _distribution(logits):
  logp = jax.nn.log_softmax(logits, axis=-1)
  p = jnp.exp(logp)
  return jnp.mean(-jnp.sum(p * logp, axis=-1)), jnp.mean(jnp.max(p, axis=-1))


def statistics(m: model_lib.DeepseekV4, tokens: np.ndarray) -> dict:
  """Per-layer update/stream ratios and the next-token distribution's mean entropy and max probability."""
  S, exact = len(tokens), features_lib.REFERENCE
  toks = jnp.asarray(tokens, jnp.int32)
  X = model_lib.embed_streams(m.embed[...], toks, m.cfg.hc_mult)
  ratios = []
  for block in m.layers:
    new, _, _ = prefill_lib.layer_step(block, X + 0, toks, 0, block.attn.empty_cache(S, S), exact)
    ratios.append(float(_ratio(new, X)))
    X = new
  entropy, max_p = _distribution(model_lib.output_logits(m.output(), X))
  return dict(update_over_stream=ratios, entropy=float(entropy), log_vocab=float(np.log(m.cfg.vocab_size)),
              max_probability=float(max_p), uniform_probability=1.0 / m.cfg.vocab_size)


def main(argv):
  del argv
  device_memory.claim()  # before JAX starts its backend
  cfg = config_lib.preset(_PRESET.value)
  if not 0 < _TOKENS.value <= cfg.max_position_embeddings:
    sys.exit(f"init_stats: --tokens must be in [1, {cfg.max_position_embeddings}], got {_TOKENS.value}")
  m = model_lib.init_random(cfg, seed=_SEED.value, policy=quant_policy.get(flags.FLAGS.quant_policy))
  tokens = np.random.default_rng(_SEED.value).integers(0, cfg.vocab_size, _TOKENS.value)
  s = statistics(m, tokens)
  print(f"{cfg.name} ({cfg.num_layers} layers, V {cfg.vocab_size}, {flags.FLAGS.quant_policy}): update/stream "
        + " ".join(f"{r:.3f}" for r in s["update_over_stream"])
        + f" | entropy {s['entropy']:.2f} of {s['log_vocab']:.2f} nats | max p {s['max_probability']:.3f} "
        f"(uniform {s['uniform_probability']:.2e})")
  if _OUT.value:
    run_record.write_json(_OUT.value, dict(run_record.environment(), preset=cfg.name, tokens=_TOKENS.value,
                                           seed=_SEED.value, quant_policy=flags.FLAGS.quant_policy, **s))


if __name__ == "__main__":
  app.run(main)
