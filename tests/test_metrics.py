"""ds4jax/metrics.py on hand-made inputs."""

import math

import numpy as np
import pytest

from ds4jax import metrics


def test_nmse():
  assert metrics.nmse([1.0, 2.0], [1.0, 1.0]) == pytest.approx(0.5)  # (0 + 1) / (1 + 1)
  assert metrics.nmse([3.0, 4.0], [3.0, 4.0]) == 0.0
  assert metrics.nmse_of_sums(0.0, 0.0) == 0.0 and metrics.nmse_of_sums(1.0, 0.0) == math.inf


def test_kl_divergence(rng):
  x = np.array([0.3, -1.2, 2.5, 0.0])
  assert metrics.kl_divergence(x, x) == 0.0
  assert metrics.kl_divergence(x, x + 7.0) == pytest.approx(0.0, abs=1e-15)  # softmax is shift-invariant
  near = [metrics.kl_divergence(y, y * (1 + 1e-15 * rng.normal(size=y.shape))) for y in rng.normal(size=(200, 64))]
  assert min(near) >= 0.0 and max(near) < 1e-12  # rounding never shows as a negative KL
  # Two outcomes: p = (1/2, 1/2), q = (e/(1+e), 1/(1+e)); KL = log(1/2) - 1/2 log(e/(1+e)^2).
  want = 0.5 * math.log(0.5 / (math.e / (1 + math.e))) + 0.5 * math.log(0.5 / (1 / (1 + math.e)))
  assert metrics.kl_divergence([0.0, 0.0], [1.0, 0.0]) == pytest.approx(want, rel=1e-12)
  # Rows are distributions: the KL of a batch is the sum of its rows'.
  rows = rng.normal(size=(3, 5)), rng.normal(size=(3, 5))
  assert metrics.kl_divergence(*rows) == pytest.approx(sum(metrics.kl_divergence(a, b) for a, b in zip(*rows)))
