"""Primitive layers of the reference model: weights (plain or quantized), linear, RMSNorm.

Weights use the checkpoint's [out, in] layout.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from ds4jax.quant import formats
from ds4jax.quant import policy as quant_policy
from kernels_pallas.precision import matmul_t

F32 = jnp.float32

# Random weights are drawn as trained transformers are conditioned (docs/model.md §12): a matmul keeps the scale of
# its input (std 1/sqrt(fan_in)), and the projections that write into the residual streams (attention output,
# expert and shared-expert down) are scaled by RESIDUAL_GAIN, so that one layer's update is a fraction of the stream.
RESIDUAL_GAIN = 0.3


def normal(rngs: nnx.Rngs, shape, std: float, dtype) -> nnx.Param:
  """A N(0, std^2) parameter. Draws a power-of-two sized vector and reshapes it: eager random
  draws compile once per shape, and this keeps a tiny model's init from compiling ~100 of them."""
  return nnx.Param(_normal(rngs.params(), tuple(shape), std, dtype))


def _normal(key, shape: tuple, std: float, dtype) -> jax.Array:
  n = math.prod(shape)
  draw = jax.random.normal(key, (1 << max(n - 1, 0).bit_length(),), F32)[:n]
  return (std * draw.reshape(shape)).astype(dtype)


def _draw(key, shape: tuple, std: float, dtype, fmt: str):
  if fmt == "bf16":
    return _normal(key, shape, std, dtype)
  return quant_policy.random_storage(formats.get(fmt), shape, key, std)


@functools.partial(jax.jit, static_argnames=("shape", "std", "dtype", "fmt", "sharding"))
def _draw_sharded(key, *, shape: tuple, std: float, dtype, fmt: str, sharding):
  """The same draw (same key, same bits) made straight into `sharding`: on a mesh each device computes its own shard,
  so a model larger than one device is never whole on one (ds4jax/mesh.py)."""
  return jax.lax.with_sharding_constraint(_draw(key, shape, std, dtype, fmt), sharding)


class QuantStorage(nnx.Variable):
  """One storage array (codes, scales, codebooks, mode) of a quantized weight."""


class QuantizedWeight(nnx.Module):
  """A weight [..., out, in] stored in a ds4jax.quant format; read it through `dequantize`."""

  def __init__(self, fmt: str, shape: tuple[int, ...], arrays: dict):
    want = {n: s for n, (s, _) in formats.get(fmt).storage(shape).items()}
    got = {n: tuple(a.shape) for n, a in arrays.items()}
    if got != want:  # else dequantize() gives some other weight's shape, or fails deep in a trace
      raise ValueError(f"{fmt} storage of a {tuple(shape)} weight is {want}, got {got}")
    self.format, self.logical_shape = fmt, tuple(shape)
    self.names = tuple(arrays)
    for name, a in arrays.items():
      setattr(self, name, QuantStorage(a))

  def storage(self) -> dict:
    return {n: getattr(self, n)[...] for n in self.names}

  def dequantize(self) -> jnp.ndarray:
    return formats.get(self.format).dequantize(**self.storage())


def make_weight(rngs: nnx.Rngs, shape, std: float, dtype, fmt: str = "bf16", sharding=None):
  """A random weight: a plain parameter in `dtype` for the "bf16" format, else quantized storage. `sharding`: drawn
  straight into it (the routed experts on a mesh), with the bits of the unsharded draw."""
  key, shape = rngs.params(), tuple(shape)
  w = (_draw(key, shape, std, dtype, fmt) if sharding is None else
       _draw_sharded(key, shape=shape, std=std, dtype=dtype, fmt=fmt, sharding=sharding))
  return nnx.Param(w) if fmt == "bf16" else QuantizedWeight(fmt, shape, w)


def dense(w) -> jnp.ndarray:
  """The f32 value of a weight, plain or quantized."""
  return w.dequantize() if isinstance(w, QuantizedWeight) else w[...].astype(F32)


class Linear(nnx.Module):
  """y = x @ W^T with W stored [out, in], as in the checkpoint. No bias anywhere in DeepSeek-V4."""

  def __init__(self, d_in: int, d_out: int, *, rngs: nnx.Rngs, dtype=F32, gain: float = 1.0, fmt: str = "bf16"):
    self.weight = make_weight(rngs, (d_out, d_in), gain / math.sqrt(d_in), dtype, fmt)  # random init: fan-in

  def __call__(self, x: jnp.ndarray, operand_dtype=F32) -> jnp.ndarray:
    """f32 out; operands in `operand_dtype` (f32 exact, bf16 under `bf16_matmul`)."""
    return matmul_t(x, dense(self.weight), operand_dtype)


def rms_normalize(x: jnp.ndarray, eps: float) -> jnp.ndarray:
  """Unweighted RMSNorm in f32 (the per-head q norm and the hyper-connection input norm)."""
  x = x.astype(F32)
  return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


class RMSNorm(nnx.Module):
  """Weighted RMSNorm; weights are kept in f32 (both references do)."""

  def __init__(self, dim: int, eps: float, *, rngs: nnx.Rngs | None = None, jitter: float = 0.0):
    w = jnp.ones((dim,), F32)
    if jitter and rngs is not None:
      w = w + jitter * jax.random.normal(rngs.params(), (dim,), F32)
    self.weight = nnx.Param(w)
    self.eps = eps

  def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
    return self.weight[...].astype(F32) * rms_normalize(x, self.eps)
