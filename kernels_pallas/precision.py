"""How the plain-jnp references multiply: exact f32, or bf16 operands with f32 accumulation.

Every reference (and the model's exact path, which calls them) takes the operand dtype explicitly:
  float32   HIGHEST precision, so a GPU never slips in TF32 or bf16 passes (the exact path);
  bfloat16  operands rounded to bf16, products accumulated in f32 (what the `bf16_matmul` switch selects).
Outputs are always f32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

F32 = jnp.float32


def einsum(spec: str, *operands, operand_dtype=F32) -> jax.Array:
  """jnp.einsum with operands in `operand_dtype` (float32: exact; bfloat16: one bf16 pass) and f32 out."""
  if jnp.dtype(operand_dtype) == jnp.dtype(F32):
    return jnp.einsum(spec, *(o.astype(F32) for o in operands), precision=jax.lax.Precision.HIGHEST)
  return jnp.einsum(spec, *(o.astype(operand_dtype) for o in operands), preferred_element_type=F32)


def matmul_t(x: jax.Array, w: jax.Array, operand_dtype=F32) -> jax.Array:
  """x @ w.T with w in the checkpoint's [out, in] layout; f32 out."""
  return einsum("...i,oi->...o", x, w, operand_dtype=operand_dtype)
