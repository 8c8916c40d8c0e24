"""Interleaved partial RoPE on the last `rope_head_dim` dims, with DeepSeek's YaRN (no mscale)."""

from __future__ import annotations

import math

import jax.numpy as jnp
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


def apply(x: jnp.ndarray, positions: jnp.ndarray, freqs: np.ndarray, inverse: bool = False) -> jnp.ndarray:
  """Rotates dims (2i, 2i+1) of the last 2*len(freqs) dims of x by angle pos*f_i.

  x: [S, d] or [S, heads, d]; positions: [S]. The rotation is computed in f32 and cast back.
  `inverse` rotates by -pos (used to de-rotate the attention output).
  """
  r = 2 * len(freqs)
  angle = positions.astype(jnp.float32)[:, None] * jnp.asarray(freqs)[None, :]  # [S, r/2]
  if inverse:
    angle = -angle
  angle = angle.reshape(angle.shape[:1] + (1,) * (x.ndim - 2) + angle.shape[1:])  # over a head axis
  cos, sin = jnp.cos(angle), jnp.sin(angle)
  nope, rope = x[..., :-r], x[..., -r:].astype(jnp.float32)
  even, odd = rope[..., 0::2], rope[..., 1::2]
  rotated = jnp.stack([even * cos - odd * sin, odd * cos + even * sin], axis=-1).reshape(rope.shape)
  return jnp.concatenate([nope, rotated.astype(x.dtype)], axis=-1)
