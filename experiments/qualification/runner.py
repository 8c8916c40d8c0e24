"""What runs the model for the qualification: `ModelRunner` (ds4jax's banded prefill and experiments/verdicts.py),
or a stand-in with the same methods (tests inject one: `qualify.run(opts, runner=...)`), and the timing protocol on
top of it: cold run, warm-ups, timed runs."""

from __future__ import annotations

import gc
import statistics
import tempfile
import time
from typing import Callable, Protocol, Sequence

import jax
import numpy as np

from ds4jax import prefill as prefill_lib
from ds4jax.features import Features
from experiments import mutations, run_record, verdicts
from experiments.qualification.inputs import sha256_array
from experiments.qualification.matrix import Configuration, is_the_reference
from experiments.qualification.options import Options
from experiments.qualification.records import Timing


class Runner(Protocol):
  def logits(self, m, ids: np.ndarray, features: Features, progress: Callable[[str], None] | None = None,
             positions: Sequence[int] | None = None, input_noise: float = 0.0) -> np.ndarray:
    """Final-position logits [vocab] (or [len(positions), vocab]) of a prefill, f32 on the host."""

  def judge(self, m, ids: np.ndarray, configs: Sequence[Configuration], log: Callable[[str], None],
            on_layers: Callable[[dict[str, verdicts.Judgement]], None] | None = None,
            reference_kl: float | None = None, band_tokens: int = 0) -> dict[str, verdicts.Judgement | Exception]:
    """The verdicts of `configs` on the prompt `ids`, by configuration name (an exception: why that one could not
    be judged). `on_layers`: verdicts.judge's, the per-layer judgements before the teacher-forced KL;
    `reference_kl`: the bf16 reference math's teacher-forced KL on file for this model and prompt, or None;
    `band_tokens`: verdicts.judge's, the band size of the judged runs."""

  def precompile(self, m, runs: Sequence[tuple[int, Features]], workers: int, log: Callable[[str], None],
                 pinned: Sequence[tuple[int, Features]] = (), scored: Sequence[tuple[int, Features]] = (),
                 seen: set | None = None) -> int:
    """Compiles the layer programs of `runs` (prompt length, features), and of the verdict pass's `pinned` and
    `scored` runs (ds4jax.prefill.precompile), into the persistent cache; `seen`: the programs of earlier calls,
    skipped."""

  def now(self) -> float:
    """Seconds, for timing (perf_counter)."""


class ModelRunner:
  """The real thing: ds4jax.prefill and experiments/verdicts.judge."""

  def logits(self, m, ids, features, progress=None, positions=None, input_noise=0.0) -> np.ndarray:
    out = jax.block_until_ready(prefill_lib.prefill_logits(m, ids, features, progress=progress, positions=positions,
                                                           input_noise=input_noise))
    return np.asarray(out, np.float32)

  def judge(self, m, ids, configs, log, on_layers=None, reference_kl=None, band_tokens=0):
    # A planted bug is judged in its own layer (the others are the exact path's): pinned parity and decision
    # accounting there. Its teacher-forced KL would cost a whole exact-path prefill per bug on the full model; only
    # a bug in what a layer carries between bands (mutations.CARRY) pays for one, so the KL too is seen to fail.
    # The exact path in one band is the reference itself: its pinned runs would repeat the reference's (costly on
    # the full model, ~40% of the pass); the CPU tests check that they do (tests/experiments/test_verdicts.py).
    exact = {c.name: verdicts.Judgement((), None) for c in configs if is_the_reference(c, len(ids), band_tokens)}
    cannot: dict[str, Exception] = {}
    runners, models = {}, {}
    for c in configs:
      if c.mutation:
        try:  # e.g. expert_scale_step on quantized experts: that bug alone cannot be planted
          bugged = mutations.MUTATIONS[c.mutation](m.layers[c.mutation_layer])
          runners[c.name] = mutations.replacing({c.mutation_layer: bugged})
          if c.mutation in mutations.CARRY:
            models[c.name] = mutations.mutated_model(m, lambda _, b=bugged: b, {c.mutation_layer})
        except ValueError as e:
          cannot[c.name] = e
    configs = [c for c in configs if c.name not in cannot and c.name not in exact]
    if not configs:
      return exact | cannot
    only = {c.name: {c.mutation_layer} for c in configs if c.mutation}
    return exact | cannot | verdicts.judge(m, ids, {c.name: c.features for c in configs}, runners, models, log=log,
                                           only=only, end_to_end=[c.name for c in configs if not c.mutation
                                                                  or c.name in models],
                                           on_layers=on_layers, reference_kl=reference_kl,
                                           band_tokens=band_tokens)

  def precompile(self, m, runs, workers, log, pinned=(), scored=(), seen=None) -> int:
    if not jax.config.jax_compilation_cache_dir:  # a temporary directory unless the user set one
      jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="ds4jax_jit_cache_"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    log(f"precompiling the layer programs of {len(runs)} runs and {len(pinned) + len(scored)} pinned or scored "
        f"verdict runs, {workers} at a time, into "
        f"{jax.config.jax_compilation_cache_dir}")
    return prefill_lib.precompile(m, runs, workers, log=log, pinned=pinned, scored=scored, seen=seen)

  def now(self) -> float:
    return time.perf_counter()


class Clock:
  """Elapsed time and a token-weighted ETA (a configuration costs about its length in tokens)."""

  def __init__(self, total_tokens: int, log: Callable[[str], None], now: Callable[[], float] = time.perf_counter):
    self.now, self.total, self.done, self.log = now, total_tokens, 0, log
    self.t0 = now()

  def say(self, text: str) -> None:
    self.log(f"[{self.elapsed():7.1f}s] {text}")

  def elapsed(self) -> float:
    return self.now() - self.t0

  def eta(self) -> str:
    if not self.done:
      return "ETA unknown"
    left = self.elapsed() / self.done * (self.total - self.done)
    return f"ETA ~{left / 60:.1f} min" if left >= 60 else f"ETA ~{left:.0f}s"


def time_configuration(runner: Runner, m, ids: np.ndarray, feats: Features, opts: Options, clock: Clock,
                       prefix: int | None = None) -> tuple[np.ndarray, np.ndarray | None, Timing]:
  """Cold run, warm-ups, timed runs -> (final logits, logits at position prefix - 1 or None, timing). The cold run
  also yields the prefix logits (the model is causal). Progress is passed only to the cold run, so timed runs are
  undisturbed."""
  L = len(ids)
  progress = lambda s: clock.say(f"    {s}")
  t0 = runner.now()
  if prefix is not None and prefix < L:
    both = runner.logits(m, ids, feats, progress=progress, positions=(prefix - 1, L - 1))
    prefix_logits, logits = both[0], both[1]
  else:
    prefix_logits, logits = None, runner.logits(m, ids, feats, progress=progress)
  cold = runner.now() - t0
  clock.say(f"    cold run: {cold:.2f}s")
  if opts.max_cold_s and cold > opts.max_cold_s:
    clock.say(f"    too slow to time: the cold run took {cold:.1f}s > --max_cold_s={opts.max_cold_s:g}")
    return logits, prefix_logits, Timing(cold_s=cold, cold_tokens_per_s=L / cold, too_slow=True,
                                         max_cold_s=opts.max_cold_s,
                                         peak_device_bytes_process=run_record.peak_device_bytes())
  hashes, warm, runs = {sha256_array(logits)}, [], []
  for i in range(opts.warmups + opts.repeats):
    gc.collect()  # outside the timer: at 8192 on the H200 each first timed run was ~0.4 s slow; GC is a suspect
    t0 = runner.now()
    out = runner.logits(m, ids, feats)
    dt = runner.now() - t0
    hashes.add(sha256_array(out))
    (warm if i < opts.warmups else runs).append(dt)
    kind, j, n = ("warm-up", i + 1, opts.warmups) if i < opts.warmups else ("run", i + 1 - opts.warmups, opts.repeats)
    clock.say(f"    {kind} {j}/{n}: {dt:.3f}s ({L / dt:.1f} tok/s)")
  median = statistics.median(runs)
  return logits, prefix_logits, Timing(cold_s=cold, cold_tokens_per_s=L / cold, too_slow=False,
                                       max_cold_s=opts.max_cold_s, warmup_s=tuple(warm), run_s=tuple(runs),
                                       median_s=median, tokens_per_s=L / median, deterministic=len(hashes) == 1,
                                       peak_device_bytes_process=run_record.peak_device_bytes())


