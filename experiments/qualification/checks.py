"""The parity checks: the verdict of a configuration (experiments/verdicts.py's judgement as a record) and the
information beside it: its final-position logits against the exact path's, and the exact path's noise floor."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import numpy as np

from ds4jax.metrics import kl_divergence, nmse
from experiments import verdicts
from experiments.qualification.inputs import sha256_array
from experiments.qualification.records import FAIL, NOT_RUN, PASS, FinalParity, NoiseFloor, Verdict
from experiments.qualification.store import ExactPrefixes


def final_parity(logits, exact, kl_gate: float, **prefix) -> FinalParity:
  """Final-position logits of a configuration against the exact path's (`prefix`: where they were compared)."""
  a, b = np.asarray(logits, np.float64), np.asarray(exact, np.float64)
  if a.shape != b.shape:
    raise ValueError(f"logits shape {a.shape} != exact logits shape {b.shape}")
  finite = bool(np.isfinite(a).all())
  if not np.isfinite(b).all():
    raise ValueError("the exact path's logits are not finite")
  kl = kl_divergence(b, a) if finite else math.inf
  return FinalParity(nmse=nmse(a, b), max_abs=float(np.max(np.abs(a - b))), top1_agree=bool(a.argmax() == b.argmax()),
                     top1=int(a.argmax()), top1_exact=int(b.argmax()), kl=kl, finite=finite, kl_gate=kl_gate,
                     within_gate=finite and kl <= kl_gate, **prefix)


def noise_floor(prefixes: ExactPrefixes, n: int, reference: Callable[[], np.ndarray], eps: float,
                kl_gate: float) -> NoiseFloor:
  """The exact path on n tokens with perturbed input streams against `reference()`, the exact logits the
  configurations were compared with: how far one rounding of the input moves the final position. A failure (e.g.
  out of memory) is returned in the record."""
  meta = dict(tokens=n, input_noise=eps, noise_seed=0, weights_fingerprint=prefixes.fingerprint,
              prompt_sha256=sha256_array(prefixes.ids[:n]))
  try:
    p = final_parity(prefixes.perturbed(n, eps), reference(), kl_gate)
    return NoiseFloor(**meta, nmse=p.nmse, max_abs=p.max_abs, top1_agree=p.top1_agree, kl=p.kl, finite=p.finite)
  except Exception as e:  # noqa: BLE001 -- e.g. out of memory: the floor is missing, the records stand
    return NoiseFloor(**meta, error=error_text(e))


def error_text(e: BaseException) -> str:
  return f"{type(e).__name__}: {str(e)[:2000]}"


def is_oom(e: BaseException) -> bool:
  text = str(e)
  return isinstance(e, MemoryError) or "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def _layer_json(v: verdicts.LayerVerdict) -> dict[str, Any]:
  d = dataclasses.asdict(v)
  return d | dict(passed=v.passed, n_bad_flips=len(v.bad_flips), bad_flips=list(d["bad_flips"][:5]))


def as_verdict(j: verdicts.Judgement, **meta) -> Verdict:
  """A judgement as the record's verdict (`meta`: tokens, features, mutation, fingerprint, prompt hash, wall)."""
  worst = verdicts.worst(list(j.layers)) if j.layers else None
  reasons = j.reasons() if j.layers or j.teacher_forced else ["the exact path: the reference itself"]
  return Verdict(result=PASS if j.passed else FAIL, reasons=tuple(reasons),
                 worst_layer=_layer_json(worst) if worst else None, layers=tuple(_layer_json(v) for v in j.layers),
                 teacher_forced=dataclasses.asdict(j.teacher_forced) | dict(passed=j.teacher_forced.passed)
                 if j.teacher_forced else None, **meta)


KL_PENDING = "teacher-forced KL not taken: the call ended during it"


def layers_only(j: verdicts.Judgement, why: str = KL_PENDING, **meta) -> Verdict:
  """The per-layer verdicts of a judgement without its teacher-forced KL: saved before the KL prefills, so a call
  that ends or fails during them loses nothing measured. A failing layer decides the verdict whatever the KL would
  say: FAIL, with why the KL is missing; else "not run" (a later call judges it again)."""
  worst = verdicts.worst(list(j.layers)) if j.layers else None
  failed = not all(v.passed for v in j.layers)
  return Verdict(result=FAIL if failed else NOT_RUN,
                 reasons=(*j.reasons(), why) if failed else (f"{why} (per-layer verdicts: PASS)",),
                 worst_layer=_layer_json(worst) if worst else None, layers=tuple(_layer_json(v) for v in j.layers),
                 **meta)


def not_run(why: str, **meta) -> Verdict:
  return Verdict(result=NOT_RUN, reasons=(why,), **meta)
