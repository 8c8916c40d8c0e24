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
