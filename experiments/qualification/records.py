"""The typed records of a results file, and their JSON form (docs/qualification.md).

A `Record` is one (length, configuration): its timing at full length, the final-position parity against the exact
path (information), and its `Verdict` (PASS, FAIL or not run, with the reasons). Verdicts are taken on a prefix of
min(length, --verdict_tokens) tokens, so lengths that share that prefix share one verdict.
"""

from __future__ import annotations

import dataclasses
from typing import Any

SCHEMA = "ds4jax.prefill_qualification/2"
PASS, FAIL, NOT_RUN = "PASS", "FAIL", "not run"
MEASURED = ("ok", "too_slow")  # statuses of a record whose configuration was measured (too_slow: cold run only)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Timing:
  cold_s: float
  cold_tokens_per_s: float
  too_slow: bool
  max_cold_s: float = 0.0
  warmup_s: tuple[float, ...] = ()
  run_s: tuple[float, ...] = ()
  median_s: float | None = None
  tokens_per_s: float | None = None
  deterministic: bool | None = None           # every run's logits bit-identical
  peak_device_bytes_process: int | None = None
  cold_is_first_call: bool | None = None      # False: the same program already ran in this process
  cold_loads_precompiled: bool | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class FinalParity:
  """Final-position logits against the exact path's, unpinned (information: one position, near-ties may flip)."""
  nmse: float
  max_abs: float
  top1_agree: bool
  top1: int
  top1_exact: int
  kl: float
  finite: bool
  kl_gate: float
  within_gate: bool
  prefix_tokens: int | None = None            # compared on this prefix (the exact path did not fit)
  prefix_reason: str | None = None
  prefix_logits_from: str | None = None
  prefix_run_s: float | None = None
  prefix_logits_sha256: str | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Verdict:
  """PASS / FAIL / not run for one configuration on the first `tokens` prompt tokens (experiments/verdicts.py)."""
  result: str
  tokens: int
  config: str = ""
  reasons: tuple[str, ...] = ()               # the failed checks, why it could not run, or why a PASS measured nothing
  worst_layer: dict[str, Any] | None = None
  layers: tuple[dict[str, Any], ...] = ()     # one per layer: pinned update NMSE, bound, flips
  teacher_forced: dict[str, Any] | None = None
  features: dict[str, Any] | None = None      # what it judged (a verdict is reused only for the same)
  mutation: str | None = None
  mutation_layer: int | None = None
  weights_fingerprint: str = ""
  prompt_sha256: str = ""
  band_tokens: int = 0                        # the verdict runs' band size (0: the configuration's own)
  wall_s: float | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class NoiseFloor:
  """The exact path with its input streams perturbed by one rounding, against itself (final position)."""
  tokens: int
  input_noise: float
  noise_seed: int
  weights_fingerprint: str
  prompt_sha256: str
  nmse: float | None = None
  max_abs: float | None = None
  top1_agree: bool | None = None
  kl: float | None = None
  finite: bool | None = None
  error: str | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Record:
  config: str
  length: int
  status: str                                 # ok | too_slow | failed | not_run | not_timed (planted bugs)
  features: dict[str, Any]
  weights_fingerprint: str
  prompt: dict[str, Any]
  model: dict[str, Any]
  env: dict[str, Any]
  options: dict[str, Any]
  killed: tuple[str, ...] = ()
  also_off: tuple[str, ...] = ()
  switches_on: tuple[str, ...] = ()
  switch_states: dict[str, str] | None = None  # capability state of each switch on (ran / lowered: ds4jax.features)
  mutation: str | None = None
  error: str | None = None
  error_kind: str | None = None
  timing: Timing | None = None
  parity: FinalParity | None = None
  verdict: Verdict | None = None
  logits_sha256: str | None = None
  predicted_cold_s: float | None = None
  finished: str = ""
  wall_s: float = 0.0

  @property
  def key(self) -> tuple[int, str]:
    return (self.length, self.config)

  @property
  def result(self) -> str:
    return self.verdict.result if self.verdict else NOT_RUN


def _tuples(d: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
  return d | {k: tuple(d[k]) for k in names if d.get(k) is not None}


def record_from_json(d: dict[str, Any]) -> Record:
  d = _tuples(dict(d), ("killed", "also_off", "switches_on"))
  if d.get("timing"):
    d["timing"] = Timing(**_tuples(d["timing"], ("warmup_s", "run_s")))
  if d.get("parity"):
    d["parity"] = FinalParity(**d["parity"])
  if d.get("verdict"):
    d["verdict"] = verdict_from_json(d["verdict"])
  return Record(**d)


def verdict_from_json(d: dict[str, Any]) -> Verdict:
  # Files of 2026-12-04 (3a53a39 to ad0acc7) say `kl_band_tokens`: their KL ran in those bands, their layers in one.
  # Read as band_tokens 0, they are not reused for verdicts in bands, which judge the layers in bands too.
  d = {k: v for k, v in d.items() if k != "kl_band_tokens"}
  return Verdict(**_tuples(d, ("reasons", "layers")))


def to_json(x) -> Any:
  """A record (or any of its parts) as JSON-ready dicts and lists."""
  return dataclasses.asdict(x) if dataclasses.is_dataclass(x) else x
