"""The MoE's one exact reference (plain jnp): the model's exact path (ds4jax/moe.py) and the kernel tests call it.

    y[t] = shared(x[t]) + Σ_k w[t,k] · W2_e( clamped_swiglu(W1_e x_t, W3_e x_t) ),   e = ids[t,k]

Dense formulation: every expert runs on every token, one expert at a time inside a scan (a quantized expert is
decoded there, so no more than one expert's f32 weights exist at once), weighted by a [S, E] combine matrix that
is 0 where the token is not routed. Exact, and O(E) slow.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.moe.weights import as_expert_weights, is_format
from kernels_pallas.precision import matmul_t

F32 = jnp.float32


def clamped_swiglu(gate: jax.Array, up: jax.Array, limit: float) -> jax.Array:
  """silu(min(gate, L)) * clip(up, -L, L): the gate is clamped from above only (docs/model.md §7)."""
  return jax.nn.silu(jnp.minimum(gate, limit)) * jnp.clip(up, -limit, limit)


def swiglu_expert(x: jax.Array, w1: jax.Array, w2: jax.Array, w3: jax.Array, limit: float,
                  operand_dtype=F32) -> jax.Array:
  """One expert (routed or shared) on x [S, D]: W2 · clamped_swiglu(W1 x, W3 x), weights [out, in], f32 out."""
  mm = lambda a, w: matmul_t(a, w, operand_dtype)
  return mm(clamped_swiglu(mm(x, w1), mm(x, w3), limit), w2)


def moe_reference(x, route_weights, route_ids, w1, w2, w3, *, swiglu_limit: float, shared=None,
                  operand_dtype=F32) -> jax.Array:
  """y [S, D] f32. x [S, D]; route_weights / route_ids [S, K] (−1 and out-of-range ids are dropped from the combine);
  w1/w3 [E, I, D], w2 [E, D, I] as float arrays or `ExpertWeights` formats (decoded by the format's canonical
  `dequantize`, one expert at a time); `shared` = None, (w1, w2, w3) weights of the shared expert (arrays or
  one-expert formats) or its output [S, D]. Matmul operands in `operand_dtype` (f32: exact; bf16: `bf16_matmul`)."""
  x = jnp.asarray(x).astype(F32)
  S = x.shape[0]
  w1, w2, w3 = (as_expert_weights(w, n) for w, n in ((w1, "w1"), (w2, "w2"), (w3, "w3")))
  E = w1.shape[0]
  ids = jnp.asarray(route_ids).astype(jnp.int32)
  valid = (ids >= 0) & (ids < E)
  rows, slots = jnp.arange(S)[:, None], jnp.where(valid, ids, E)
  combine = jnp.zeros((S, E), F32).at[rows, slots].add(jnp.where(valid, jnp.asarray(route_weights, F32), 0.0),
                                                         mode="drop")
  routed = jnp.zeros((S, E), bool).at[rows, slots].set(True, mode="drop")

  def one_expert(acc, expert):
    a, b, c, cw, taken = expert  # one expert's slice of each weight pytree: decode it here, inside the scan
    y = swiglu_expert(x, a.dequantize(), b.dequantize(), c.dequantize(), swiglu_limit, operand_dtype)
    # a token the expert is not routed to adds nothing: not 0 · y, which is NaN where y is not finite
    return acc + jnp.where(taken[:, None], cw[:, None] * y, 0.0), None

  y, _ = jax.lax.scan(one_expert, jnp.zeros(x.shape, F32), (w1, w2, w3, combine.T, routed.T))
  if isinstance(shared, (tuple, list)):
    s1, s2, s3 = (w.dequantize()[0] if is_format(w) else w for w in shared)
    y = y + swiglu_expert(x, s1, s2, s3, swiglu_limit, operand_dtype)
  elif shared is not None:
    y = y + jnp.asarray(shared, F32)
  return y
