"""Times the exact reference prefill (dense masked attention, dense MoE, f32 math) at real V4 shapes.

    python -m experiments.bench_reference --preset=v4_flash --layers=4 --tokens=512,2048,4096 --out=FILE

The full 43-layer model does not fit in bf16 on one GPU, so `--layers` keeps the first N layers of the
preset's schedule (V4-Flash's first 4 are window, window, CSA, HCA). This is the baseline the kernels are
measured against, and tells the qualification how long a prefix the exact path can check.
"""

import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from ds4jax import config, model
from ds4jax.quant import policy as quant_policy
from experiments import flags as flags_lib
from experiments import run_record

_PRESET = flags.DEFINE_string("preset", "v4_flash", "Model preset.")
_LAYERS = flags.DEFINE_integer("layers", 4, "Keep the first N layers of the preset.")
_TOKENS = flags.DEFINE_list("tokens", ["512", "2048", "4096"], "Prompt lengths.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed runs per length after the compile run.")
_OUT = run_record.define_out_flag(help_text="Results JSON (rewritten after every length).")
flags_lib.define_quant_policy_flag()


def main(argv):
  del argv
  full = config.preset(_PRESET.value)
  n = _LAYERS.value
  cfg = full.replace(attention=full.attention[:n], routing=full.routing[:n], name=f"{full.name}[:{n}]")
  pol = quant_policy.get(flags.FLAGS.quant_policy)
  record = dict(benchmark="reference_prefill", env=run_record.environment(), config=cfg.to_dict(),
                params=cfg.param_counts()["total"], weights_dtype="bfloat16", quant_policy=dataclasses.asdict(pol),
                math="float32 (precision=highest)", runs=[])
  print(f"{cfg.name}: {record['params'] / 1e9:.2f}B params on {record['env']['device_kind']}", flush=True)
  t0 = time.perf_counter()
  m = model.init_random(cfg, seed=0, dtype=jnp.bfloat16, policy=pol)
  jax.block_until_ready(m.embed[...])
  record["init_seconds"] = time.perf_counter() - t0
  record["weights_bytes_on_device"] = run_record.peak_device_bytes()
  print(f"init {record['init_seconds']:.1f}s", flush=True)
  save = run_record.appender(_OUT.value, record)
  for s in map(int, _TOKENS.value):
    run = dict(tokens=s)
    try:
      tokens = np.random.default_rng(s).integers(2, cfg.vocab_size, s)
      t0 = time.perf_counter()
      logits = jax.block_until_ready(model.forward(m, tokens))
      run["first_call_seconds"] = time.perf_counter() - t0
      times = []
      for _ in range(_REPEATS.value):
        t0 = time.perf_counter()
        jax.block_until_ready(model.forward(m, tokens))
        times.append(time.perf_counter() - t0)
      run.update(seconds=times, median_seconds=statistics.median(times),
                 tokens_per_second=s / statistics.median(times), peak_device_bytes=run_record.peak_device_bytes(),
                 finite=bool(jnp.isfinite(logits).all()), logits_sum=float(jnp.sum(logits)))
    except Exception as e:  # noqa: BLE001 -- an OOM at one length must not lose the others
      run["error"] = f"{type(e).__name__}: {str(e)[:500]}"
    save(run)


if __name__ == "__main__":
  app.run(main)
