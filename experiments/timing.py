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
