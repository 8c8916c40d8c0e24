"""RoPE frequencies of each layer, with DeepSeek's YaRN (no mscale) (docs/model.md §3).

The rotation itself, `apply_rope`, lives with the attention reference (kernels_pallas/mla/reference.py): the model
and the kernels share it.
"""

from __future__ import annotations

import math

import numpy as np

from ds4jax.config import Attention, DeepseekV4Config, Yarn


def inv_freq(rope_dim: int, theta: float, yarn: Yarn | None) -> np.ndarray:
  """Per-pair angular frequencies f_i = theta^(-2i/r), blended towards f_i/factor by YaRN."""
  f = 1.0 / theta ** (np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim)
  if yarn is None:
    return f.astype(np.float32)

  def correction_dim(rotations: float) -> float:
    return rope_dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
        2 * math.log(theta))

  low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
  high = min(math.ceil(correction_dim(yarn.beta_slow)), rope_dim - 1)
  if high == low:
    high += 0.001  # avoid a zero-width ramp
  ramp = np.clip((np.arange(rope_dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
  # ramp 0 keeps the original (high) frequency, ramp 1 fully interpolates it by `factor`.
  return (f / yarn.factor * ramp + f * (1.0 - ramp)).astype(np.float32)


def layer_inv_freq(cfg: DeepseekV4Config, kind: Attention) -> np.ndarray:
  """Window-only layers: theta=rope_theta, no YaRN. Compressed layers: compress_rope_theta + YaRN."""
  if kind is Attention.WINDOW:
    return inv_freq(cfg.rope_head_dim, cfg.rope_theta, None)
  return inv_freq(cfg.rope_head_dim, cfg.compress_rope_theta, cfg.yarn)

