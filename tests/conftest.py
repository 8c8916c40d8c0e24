"""Shared fixtures. Tests never read absl FLAGS: configs are passed explicitly."""

import numpy as np
import pytest


@pytest.fixture
def rng():
  """A generator with a fresh seed per test; the seed is printed so a failure can be replayed."""
  seed = np.random.SeedSequence().entropy
  print(f"rng seed: {seed}")  # pytest shows this when the test fails
  return np.random.default_rng(seed)


@pytest.fixture
def seed(rng):
  """A fresh integer seed for jax / nnx.Rngs."""
  return int(rng.integers(0, 2**31 - 1))
