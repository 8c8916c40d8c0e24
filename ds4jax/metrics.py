"""Error metrics of every parity check (kernel tests, goldens, the qualification), in float64 on the host."""

from __future__ import annotations

import math

import numpy as np


def nmse_of_sums(num: float, den: float) -> float:
  """num / den, where a zero reference gives 0 for a zero error and inf otherwise."""
  if den == 0.0:
    return 0.0 if num == 0.0 else math.inf
  return num / den


def nmse(got, want) -> float:
  """Σ(got − want)² / Σ want², `want` the reference."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return nmse_of_sums(float(np.sum((got - want) ** 2)), float(np.sum(want ** 2)))


def log_softmax(x) -> np.ndarray:
  """log softmax over the last axis, float64."""
  x = np.asarray(x, np.float64)
  z = x - x.max(axis=-1, keepdims=True)
  return z - np.log(np.sum(np.exp(z), axis=-1, keepdims=True))


def kl_divergence(p_logits, q_logits) -> float:
  """KL(softmax(p) || softmax(q)) over the last axis, float64, summed over any leading axes: p the exact path, q
  the configuration. Never negative: rounding can make the sum a few ulps below 0 for nearly equal logits."""
  lp, lq = log_softmax(p_logits), log_softmax(q_logits)
  return max(float(np.sum(np.exp(lp) * (lp - lq))), 0.0)  # NaN stays NaN
