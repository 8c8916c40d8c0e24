"""experiments/mosaic_profile.py: reading Mosaic GPU profiler traces (the profiler itself runs only on a GPU)."""

from experiments import mosaic_profile


def _trace(steps: int, tids=(1, 2)) -> dict:
  """Each tid: `steps` steps of 1000 cycles (slot 50, decode 250, two mma regions of 20 and 30, wait 650), then an
  epilogue of 490 cycles. ts in cycles / 1000, as the profiler's dump."""
  events = []

  def region(tid, name, begin, end):
    events.extend([dict(tid=tid, name=name, ph="B", ts=begin / 1e3), dict(tid=tid, name=name, ph="E", ts=end / 1e3)])

  for tid in tids:
    for s in range(steps):
      t = 1000 * s + 7 * tid
      region(tid, "decode", t + 50, t + 300)
      region(tid, "mma", t + 300, t + 320)
      region(tid, "mma", t + 320, t + 350)
      region(tid, "wait", t + 350, t + 1000)
    region(tid, "epilogue", 1000 * steps + 7 * tid + 10, 1000 * steps + 7 * tid + 500)
  return dict(traceEvents=events)


def test_step_cycles_sums_regions_per_step_and_skips_the_first_steps():
  got = mosaic_profile.step_cycles(_trace(6), skip_steps=2)
  assert {k: v["median"] for k, v in got.items()} == {
      "decode": 250, "mma": 50, "wait": 650, "slot": 50, "step": 1000, "epilogue/wg0": 490, "epilogue/wg1": 490,
      "traced": 6450}
  # 4 steps a tid after the 2 skipped (the first has no slot or step before it, but is skipped); one epilogue a tid
  assert {k: v["n"] for k, v in got.items()} == {"decode": 8, "mma": 8, "wait": 8, "slot": 8, "step": 8,
                                                 "epilogue/wg0": 1, "epilogue/wg1": 1, "traced": 2}
  assert got["step"]["mean"] == 1000 and got["decode"]["p10"] == got["decode"]["p90"] == 250


def test_step_cycles_counts_the_first_step_when_nothing_is_skipped():
  got = mosaic_profile.step_cycles(_trace(3, tids=(1,)), skip_steps=0)
  assert got["decode"]["n"] == 3 and got["step"]["n"] == 2 and got["slot"]["n"] == 2


def test_step_cycles_spread_shows_a_slow_step():
  trace = _trace(6, tids=(1,))
  for ev in trace["traceEvents"][-3:]:  # the last step's wait ends, and the epilogue runs, 3000 cycles later
    ev["ts"] += 3.0
  got = mosaic_profile.step_cycles(trace, skip_steps=1)
  assert got["step"]["median"] == 1000 and got["step"]["mean"] == 1600 and got["wait"]["p90"] > 3000


def test_unit_cycles_reads_spans_gaps_and_units_per_warpgroup():
  events = []
  for tid, units in ((1, [(0, 100), (110, 230), (250, 330)]), (2, [(5, 105), (125, 245)])):
    for b, e in units:
      events += [dict(tid=tid, name="unit", ph="B", ts=b / 1e3), dict(tid=tid, name="unit", ph="E", ts=e / 1e3)]
  got = mosaic_profile.unit_cycles(dict(traceEvents=events))
  # tid 1: units 100, 120, 80 (median 100), gaps 10, 20 (15), span 330; tid 2: units 100, 120 (110), gap 20, span 240
  assert got == dict(units=2.5, span=285.0, unit=105.0, gap=17.5, first_unit=100.0, last_unit=100.0, tids=2,
                     span_max=330.0)
