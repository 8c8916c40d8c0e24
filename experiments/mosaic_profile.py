"""Mosaic GPU's on-device profiler, for a kernel call: `profiled` runs a function with every Mosaic GPU kernel it
makes under the profiler, and `step_cycles` / `unit_cycles` read the traces it writes (Chrome trace JSON: B/E
events of named regions, ts = the SM's clock cycles / 1000 within one trace, one trace per warpgroup per block).
experiments/profile_moe.py runs it on the Mosaic gate/up; no flags here, so tests import it alone."""

import collections
import functools
import statistics

import jax
from jax.experimental.pallas import mosaic_gpu as plgpu

STEP_END = "wait"  # the region that ends a pipeline step
WARPGROUPS = 3  # per block: two compute warpgroups and the TMA one (a trace's tid is 1 + its block's index · 3 + wg)


def step_cycles(trace: dict, skip_steps: int) -> dict:
  """From a profiler trace (Chrome trace JSON: B/E events, ts = clock cycles / 1000 within one tid): per region name
  (summed over a step, e.g. one `mma` region per 64-row block) and for `slot` and `step`, the median, mean, 10th and
  90th percentile cycles over all tids' steps after the first `skip_steps`, and how many steps that is. A step ends
  where a `wait` region ends. A region after the last step (the epilogue) counts once per tid, by warpgroup
  ("epilogue/wg0"); `traced` is each tid's first to last event."""
  per = collections.defaultdict(list)
  for tid, events in _by_tid(trace).items():
    open_at, sums, step, step_end = {}, collections.Counter(), 0, None
    for ev in events:
      t = ev["ts"] * 1e3
      if ev["ph"] == "B":
        if step_end is not None and not open_at and not sums:
          sums["slot"] += t - step_end
        open_at[ev["name"]] = t
        continue
      sums[ev["name"]] += t - open_at.pop(ev["name"])
      if ev["name"] == STEP_END:
        if step_end is not None:
          sums["step"] = t - step_end
        if step >= skip_steps:
          for name, v in sums.items():
            per[name].append(v)
        sums, step, step_end = collections.Counter(), step + 1, t
    for name, v in sums.items():  # after the last wait: the epilogue
      if name != "slot":
        per[f"{name}/wg{(tid - 1) % WARPGROUPS}"].append(v)
    if step:
      per["traced"].append((events[-1]["ts"] - events[0]["ts"]) * 1e3)
  return {name: _summary(v) for name, v in sorted(per.items())}


def _summary(values: list[float]) -> dict:
  p10, *_, p90 = statistics.quantiles(values, n=10) if len(values) > 1 else values * 2
  return dict(median=round(statistics.median(values), 1), mean=round(statistics.fmean(values), 1),
              p10=round(p10, 1), p90=round(p90, 1), n=len(values))


def unit_cycles(trace: dict) -> dict:
  """From a trace of `unit` regions (Tiling.profile_regions "units"): per tid (one warpgroup of one SM) its units'
  cycles and the gaps between them; returned as medians over tids of: units, span (first start to last end),
  each tid's median unit and gap, and its first and last unit."""
  rows = []
  for events in _by_tid(trace).values():
    begins = [ev["ts"] * 1e3 for ev in events if ev["name"] == "unit" and ev["ph"] == "B"]
    ends = [ev["ts"] * 1e3 for ev in events if ev["name"] == "unit" and ev["ph"] == "E"]
    if not ends:
      continue
    units = [e - b for b, e in zip(begins, ends)]
    gaps = [b - e for e, b in zip(ends, begins[1:])] or [0.0]
    rows.append(dict(units=len(units), span=ends[-1] - begins[0], unit=statistics.median(units),
                     gap=statistics.median(gaps), first_unit=units[0], last_unit=units[-1]))
  return {k: round(statistics.median(r[k] for r in rows), 1) for k in rows[0]} | dict(
      tids=len(rows), span_max=round(max(r["span"] for r in rows), 1))


def _by_tid(trace: dict) -> dict:
  by_tid = collections.defaultdict(list)
  for ev in trace["traceEvents"]:
    by_tid[ev["tid"]].append(ev)
  return by_tid


def profiled(fn, profile_dir: str, space: int):
  """fn run with every Mosaic GPU kernel it makes under the profiler (traces written to profile_dir)."""
  plain = plgpu.CompilerParams

  @functools.wraps(fn)
  def run(*args):
    plgpu.CompilerParams = functools.partial(plain, profile_space=space, profile_dir=profile_dir,
                                             profile_bounds_check=True)
    try:  # a fresh function: a jaxpr traced before (the unprofiled timing) would be reused as it is
      out = jax.block_until_ready(jax.jit(lambda *a: fn(*a))(*args))
      jax.effects_barrier()  # the trace is written by a host callback
      return out
    finally:
      plgpu.CompilerParams = plain
  return run
