"""Where the sm_90 Mosaic GPU MoE kernels' cycles go: one call under Mosaic GPU's on-device profiler (H200 only).

    python -m experiments.profile_moe --tokens=8192 --routings=uniform --variants=mix:lhs_w128_s3_r256 \
        --out=experiments/results/moe_profile_h200.json     # --tokens, --routings and --out are bench_moe's flags

The kernels (kernels_pallas/moe/gate_up_wgmma.py, down_wgmma.py) name the parts of a compute warpgroup's pipeline
step: `decode` (MIX planes), `mma` (the wgmma issues), `wait` (until the step's wgmmas are done), and `epilogue`
per unit.
The profiler writes each region's start and end as the SM's clock, from one thread of each warpgroup, into shared
memory for the first `--profile_space` regions (the rest are dropped), so what "steps" reads is the first unit of
each SM; "units" (`Tiling.profile_regions`) records one region per unit instead: every unit's cycles, the gaps
between units, and the kernel's cycles per nanosecond (the longest warpgroup's span over the unprofiled time). Per
step, "steps" reports, in cycles, the median over the SMs and over the steps after the first `--skip_steps`:
each region, `slot` (from the end of one step's wait to the next region: the pipeline's wait for its TMA copies and
its slot release) and the whole step. A region's time is the issue time of its instructions, so an instruction that
waits on an earlier one's result charges that wait to its own region. The variants are bench_moe's tilings
("mix:" WGMMA_MIX_TILINGS, "bf16:" WGMMA_TILINGS, "down:" WGMMA_DOWN_TILINGS), each timed without the profiler
too.
"""

import dataclasses
import functools
import itertools
import json
import os
import tempfile

import jax
import jax.numpy as jnp
from absl import app, flags

from ds4jax.quant import formats
from ds4jax.quant import policy as quant_policy
from experiments import bench_moe, mosaic_profile, run_record
from kernels_pallas.moe import down_wgmma, gate_up_wgmma, routing

_VARIANTS = flags.DEFINE_list("variants", ["mix:lhs_w128_s3_r256", "bf16:w128_n64_s4_i"],
                              "Tilings: mix:<bench_moe.WGMMA_MIX_TILINGS key> or bf16:<bench_moe.WGMMA_TILINGS key> "
                              "(the gate/up), down:<bench_moe.WGMMA_DOWN_TILINGS key> (the FP3-MIX down).")
_SPACE = flags.DEFINE_integer("profile_space", 200, "Regions recorded per warpgroup (16 bytes of shared memory "
                              "each, times 3 warpgroups).")
_STAGES = flags.DEFINE_list("stages", [], "Each variant at each of these shared-memory slot counts instead of its "
                            "own (the profiler's buffer may not fit next to 4).")
_REGIONS = flags.DEFINE_list("regions", ["steps", "units"], "Profiles per variant: 'steps' (the first unit's "
                              "pipeline steps by region) and/or 'units' (every unit: span, gaps, the clock rate).")
_SKIP = flags.DEFINE_integer("skip_steps", 3, "Steps left out of the medians at the start of each trace.")


def main(argv):
  del argv
  if jax.default_backend() != "gpu":
    raise SystemExit("profile_moe needs an sm_90 GPU (the Mosaic GPU profiler has no interpreter)")
  D, I, E, K = (bench_moe.FLASH[k] for k in ("D", "I", "E", "K"))
  record = dict(run_record.environment(), what="Mosaic GPU gate/up cycles by region (experiments/profile_moe.py)",
                profile_space=_SPACE.value, skip_steps=_SKIP.value, runs=[])
  save = run_record.appender(bench_moe._OUT.value, record)  # pylint: disable=protected-access
  keys = jax.random.split(jax.random.key(0), 8)
  w1 = (jax.random.normal(keys[0], (E, I, D)) * D**-0.5).astype(jnp.bfloat16)
  w3 = (jax.random.normal(keys[1], (E, I, D)) * D**-0.5).astype(jnp.bfloat16)
  mix2 = formats.get("rocmfp2_mix")
  m1, m3 = (gate_up_wgmma.mix_stack(quant_policy.random_storage(mix2, (E, I, D), k, D**-0.5)) for k in keys[3:5])
  m2 = down_wgmma.mix3_stack(quant_policy.random_storage(formats.get("rocmfp3_mix"), (E, D, I), keys[5], I**-0.5))
  tokens = [int(n) for n in bench_moe._TOKENS.value]  # pylint: disable=protected-access
  for S, kind in itertools.product(tokens, bench_moe._ROUTINGS.value):  # pylint: disable=protected-access
    x = jax.random.normal(keys[6], (S, D)).astype(jnp.bfloat16)
    ids = bench_moe.route_ids(keys[7], S, E, K, kind)
    r = jax.jit(lambda i: routing.route(i, E, 128))(ids)
    for variant, stages in itertools.product(_VARIANTS.value, _STAGES.value or [0]):
      fmt, name = variant.split(":")
      if fmt == "down":  # h [S·K, I] in sorted-row order, random (the kernel's time does not depend on its values)
        t = bench_moe.WGMMA_DOWN_TILINGS[name]
        h = jax.random.normal(keys[2], (S * K, I)).astype(jnp.bfloat16)
        call = lambda h, w, r, t: down_wgmma.down_wgmma(h, w, r, tiling=t)
        args = (h, m2, r)
      elif fmt == "mix":
        t, args = bench_moe.WGMMA_MIX_TILINGS[name], (x, m1, m3, r)
      else:
        entry = bench_moe.WGMMA_TILINGS[name]
        t, args = entry[0], (x, *bench_moe.wgmma_weights(entry, w1, w3), r)
      if fmt != "down":
        call = lambda x, a, b, r, t: gate_up_wgmma.gate_up_wgmma(x, a, b, r, swiglu_limit=10.0, tiling=t)
      t = dataclasses.replace(t, stages=int(stages) or t.stages)
      fn = functools.partial(call, t=t)
      entry = dict(tokens=S, routing=kind, variant=variant, stages=t.stages,
                   items=int(gate_up_wgmma.aligned_items(r, t.block_m).count[0]))
      try:
        entry["ms"] = round(bench_moe.timeit(jax.jit(fn), *args, n=10) * 1e3, 3)
        for regions in _REGIONS.value:
          tr = dataclasses.replace(t, profile_regions=regions)
          with tempfile.TemporaryDirectory() as d:
            mosaic_profile.profiled(functools.partial(call, t=tr), d, _SPACE.value)(*args)
            (path,) = [os.path.join(d, f) for f in os.listdir(d) if f.endswith("-trace.json")]
            with open(path, encoding="utf-8") as f:
              trace = json.load(f)
          if regions == "steps":
            entry["cycles"] = mosaic_profile.step_cycles(trace, _SKIP.value)
          else:
            entry["units"] = units = mosaic_profile.unit_cycles(trace)
            entry["clock_ghz"] = round(units["span_max"] / (entry["ms"] * 1e6), 3)  # the kernel's cycles per ns
      except Exception as e:  # noqa: BLE001 -- e.g. the profiler's buffer does not fit: the other variants go on
        entry["error"] = f"{type(e).__name__}: {str(e)[:400]}"
      save(entry)


if __name__ == "__main__":
  app.run(main)
