"""Prefill scheduler (stub: one-shot prefill until layer-major banding and long-context chunking land)."""

from __future__ import annotations

from typing import Callable

import jax.numpy as jnp

from ds4jax import model as model_lib
from ds4jax.features import REFERENCE, Features


def prefill_logits(m: model_lib.DeepseekV4, tokens, features: Features = REFERENCE,
                   progress: Callable[[str], None] | None = None) -> jnp.ndarray:
  """Runs the prompt through the model; returns the final position's logits [vocab] in f32."""
  if progress:
    progress(f"prefill {len(tokens)} tokens (one shot)")
  return model_lib.forward(m, tokens, features=features)[-1]
