"""CPU smoke prefill: runs the exact reference model on a tiny preset and prints tokens/s and a checksum.

    python -m experiments.smoke [--preset=tiny] [--tokens=96] [--seed=0]

The qualification command (experiments/prefill.py) will replace this as the main job.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from ds4jax import config, model
from ds4jax.quant import policy as quant_policy

_PRESET = flags.DEFINE_enum("preset", "tiny", [n for n in config.PRESETS if n.startswith("tiny")],
                            "Model preset (tiny ones only: this runs the dense reference on a CPU).")
_TOKENS = flags.DEFINE_integer("tokens", 96, "Prompt length.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the random weights and prompt ids.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed runs after the compile run (median reported).")
quant_policy.define_flag()


def main(argv):
  del argv
  cfg = config.preset(_PRESET.value)
  pol = quant_policy.get(flags.FLAGS.quant_policy)
  print(f"ds4jax smoke prefill: preset={cfg.name} tokens={_TOKENS.value} seed={_SEED.value} policy={pol.name} "
        f"device={jax.devices()[0].device_kind} jax={jax.__version__}")
  m = model.init_random(cfg, _SEED.value, dtype=jnp.float32, policy=pol)
  tokens = np.random.default_rng(_SEED.value).integers(2, cfg.vocab_size, _TOKENS.value)
  t0 = time.perf_counter()
  logits = jax.block_until_ready(model.forward(m, tokens))
  print(f"compile + first run: {time.perf_counter() - t0:.2f}s")
  times = []
  for _ in range(_REPEATS.value):
    t0 = time.perf_counter()
    jax.block_until_ready(model.forward(m, tokens))
    times.append(time.perf_counter() - t0)
  logits = np.asarray(logits, np.float64)
  if not np.isfinite(logits).all():
    raise SystemExit("FAIL: non-finite logits")
  print(f"prefill: {_TOKENS.value / np.median(times):.1f} tokens/s (median of {len(times)})")
  print(f"logits checksum: sum={logits.sum():.6f} sum|x|={np.abs(logits).sum():.6f} "
        f"argmax[-1]={int(logits[-1].argmax())}")


if __name__ == "__main__":
  app.run(main)
