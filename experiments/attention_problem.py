"""The inputs the sparse-attention benchmarks time (bench_attention, tune_attention): one query chunk of a long
prefill at a CSA layer's shapes, random and seeded by the context length."""

import jax
import jax.numpy as jnp


def chunk_inputs(L: int, T: int, dims: dict):
  """The last T-query chunk of an L-token prefill, seeded by L: (q_start, raw_start, raw rows N, compressed rows R),
  the attention inputs (q [T, H, D] RMS-normalized, raw_kv [N, D], comp_kv [R, D] in bf16, sink [H] f32) and four
  more keys for the caller's own draws."""
  H, D, W, ratio = dims["H"], dims["D"], dims["window"], dims["ratio"]
  q_start = max(L - T, 0)
  raw_start = max(q_start - (W - 1), 0)
  N, R = L - raw_start, L // ratio
  keys = jax.random.split(jax.random.key(L), 8)
  q = jax.random.normal(keys[0], (L - q_start, H, D), jnp.float32)
  q = (q * jax.lax.rsqrt(jnp.mean(q * q, axis=-1, keepdims=True))).astype(jnp.bfloat16)
  raw_kv = jax.random.normal(keys[1], (N, D)).astype(jnp.bfloat16)
  comp_kv = jax.random.normal(keys[2], (R, D)).astype(jnp.bfloat16)
  sink = jax.random.normal(keys[3], (H,), jnp.float32)
  return (q_start, raw_start, N, R), (q, raw_kv, comp_kv, sink), keys[4:]
