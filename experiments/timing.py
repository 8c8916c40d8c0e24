"""Wall-clock timing of a jitted call on the device (benchmarks only; tests never time)."""

from __future__ import annotations

import statistics
import time

import jax


def timeit(f, *args, n: int = 10) -> float:
  """Median milliseconds of `n` calls of f(*args), after one call that compiles and warms up."""
  jax.block_until_ready(f(*args))
  ts = []
  for _ in range(n):
    t = time.perf_counter()
    jax.block_until_ready(f(*args))
    ts.append(time.perf_counter() - t)
  return 1e3 * statistics.median(ts)


def pipelined(call, wait, *, n: int = 5, reps: int = 3) -> float:
  """Milliseconds a call takes back to back: `n` calls issued without waiting, then one `wait(last result)`; the
  median over `reps` of the mean. Host dispatch then hides under the device work, as in CUDA-event timing of one call
  (how torch kernels are usually timed), so JAX and torch callables compare on the same footing; `timeit` counts each
  call's dispatch and final sync too."""
  wait(call())
  means = []
  for _ in range(reps):
    t = time.perf_counter()
    for _ in range(n):
      out = call()
    wait(out)
    means.append((time.perf_counter() - t) / n)
  return 1e3 * statistics.median(means)


def rotated_rounds(calls: dict, *, rounds: int = 15, n: int = 5) -> dict[str, list[float]]:
  """Milliseconds a call takes back to back (one batch of `n`, as `pipelined`) for each contender in each of `rounds`
  rounds, the contenders' order rotated by one every round. `calls`: name -> (call, wait). Run one after the other,
  a contender's figure also carries the clock and power state the previous one left (a GPU at its power limit);
  taken in turns, the contenders share it, so their ratio within a round is the fair comparison."""
  names = list(calls)
  for call, wait in calls.values():
    wait(call())
  out = {name: [] for name in names}
  for r in range(rounds):
    for name in names[r % len(names):] + names[:r % len(names)]:
      call, wait = calls[name]
      t = time.perf_counter()
      for _ in range(n):
        res = call()
      wait(res)
      out[name].append(1e3 * (time.perf_counter() - t) / n)
  return out


def rate_ratios(rounds_ms: dict[str, list[float]], base: str) -> dict[str, dict]:
  """Each contender's rate relative to `base`, round by round (base ms / contender ms: above 1 is faster than base):
  the median, the lowest and highest, and how many rounds it was faster in."""
  out = {}
  for name, ms in rounds_ms.items():
    if name == base:
      continue
    ratios = [b / m for b, m in zip(rounds_ms[base], ms)]
    out[name] = dict(median=statistics.median(ratios), low=min(ratios), high=max(ratios),
                     faster_rounds=sum(r > 1 for r in ratios), rounds=len(ratios))
  return out


def head_to_head(calls: dict, names: list[str], rounds: int) -> dict:
  """`rotated_rounds` of the contenders `names` (the base first) out of `calls` (name -> (call, wait): those measured
  here), with each one's `rate_ratios` against the base; or {"error": ...} where one is missing or the rounds fail
  (e.g. out of memory with every contender's operands held at once), so that a benchmark goes on to its next case."""
  missing = [n for n in names if n not in calls]
  if missing:
    return dict(contenders=names, error=f"not measured here (failed or not run): {missing}")
  try:
    ms = rotated_rounds({n: calls[n] for n in names}, rounds=rounds)
  except Exception as e:  # noqa: BLE001
    return dict(contenders=names, error=f"{type(e).__name__}: {str(e)[:300]}")
  return dict(contenders=names, base=names[0], rounds_ms=ms, median_ms={n: statistics.median(v) for n, v in ms.items()},
              rate_vs_base=rate_ratios(ms, names[0]))
