"""Exact dense reference of one sparse MLA attention layer, the math it is built from, and the input checks the
kernels share.

    o[t, h] = invrope_{p_t}( Σ_j softmax_j(q[t,h]·k_j·scale ; sink[h]) · k_j ),   p_t = q_start + t

The key set of query t (docs/model.md §4.1; one shared K = V latent head):
  raw rows      raw_kv[i] sits at position raw_start + i and is seen iff p_t − window < raw_start + i <= p_t
                and raw_start + i >= 0;
  compressed    "hca": every row w < (p_t + 1) // ratio; "csa": the rows in indices[t] (−1 = empty), which must
                also satisfy that visibility test (checked analytically again); "window": none.
One softmax per head over all its keys plus the sink logit (the sink adds mass, no value). The last rope_dim dims
of the output are rotated back by −p_t (values carry rotated dims).

The building blocks (`window_bias`, `selected_bias`, `visible_rows`, `sink_attention`, `apply_rope`) are also the
model's exact attention path (ds4jax/attention.py): one definition serves both.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.mla.config import is_pow2
from kernels_pallas.precision import einsum

F32 = jnp.float32
KINDS = ("window", "hca", "csa")
FLOATS = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def window_bias(q_pos: jax.Array, k_pos: jax.Array, window: int) -> jax.Array:
  """[Sq, Sk] additive mask: key j is in query t's window iff t - window < j <= t (and j >= 0: a real position)."""
  d = q_pos[:, None] - k_pos[None, :]
  return jnp.where((d >= 0) & (d < window) & (k_pos[None, :] >= 0), 0.0, -jnp.inf).astype(F32)


def selected_bias(topk: jax.Array, n_rows: int) -> jax.Array:
  """[S, n_rows] additive mask from [S, k] row ids (-1 = none): 0 at selected rows, -inf elsewhere."""
  safe = jnp.where(topk >= 0, topk, n_rows)  # -1 goes to a spill column that is dropped
  hit = jnp.zeros((topk.shape[0], n_rows + 1), bool).at[jnp.arange(topk.shape[0])[:, None], safe].set(True)
  return jnp.where(hit[:, :n_rows], 0.0, -jnp.inf).astype(F32)


def visible_rows(positions: jax.Array, n_rows: int, ratio: int) -> jax.Array:
  """[S, n_rows] bool: compressed row w is complete, hence visible, at query position t iff w < (t+1) // ratio."""
  return jnp.arange(n_rows)[None, :] < ((positions + 1) // ratio)[:, None]


def sink_attention(q: jax.Array, keys: jax.Array, bias: jax.Array, sink: jax.Array, scale: float,
                   operand_dtype=F32) -> jax.Array:
  """Softmax over keys and a per-head sink logit jointly; values are the keys (K = V) (docs/model.md §4.2).

  q: [S, H, d]; keys: [N, d]; bias: [S, N] (0 or -inf); sink: [H]. Returns [S, H, d] in f32. The two dots take
  `operand_dtype` operands (kernels_pallas/precision.py); the softmax is f32.
  """
  s = einsum("thd,nd->thn", q.astype(F32), keys.astype(F32), operand_dtype=operand_dtype) * scale
  s = s + bias[:, None, :]
  m = jnp.maximum(jnp.max(s, axis=-1), sink[None, :])  # the sink joins the running max too
  p = jnp.exp(s - m[..., None])
  denom = jnp.sum(p, axis=-1) + jnp.exp(sink[None, :] - m)  # the sink adds mass but no value
  return einsum("thn,nd->thd", p / denom[..., None], keys.astype(F32), operand_dtype=operand_dtype)


def apply_rope(x: jax.Array, positions: jax.Array, freqs: np.ndarray, inverse: bool = False) -> jax.Array:
  """Rotates dims (2i, 2i+1) of the last 2*len(freqs) dims of x by angle pos*f_i (docs/model.md §3).

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


def _concrete_int(x):
  """x as a Python int when it is concrete (int, numpy or a non-traced scalar array), else None."""
  if isinstance(x, (int, np.integer)) and not isinstance(x, bool):
    return int(x)
  if isinstance(x, jax.core.Tracer):
    return None
  try:
    return int(x)
  except (TypeError, jax.errors.ConcretizationTypeError):
    return None


def check_inputs(q, raw_kv, comp_kv, sink, *, q_start, raw_start, kind, ratio, window, inv_freq,
                 indices=None) -> dict:
  """Raises ValueError naming the offending shape/value; returns the static geometry (T, H, D, N, R, k,
  rope_dim)."""
  if kind not in KINDS:
    raise ValueError(f"kind={kind!r}: expected one of {KINDS}")
  if q.ndim != 3:
    raise ValueError(f"q must be [T, H, D], got shape {tuple(q.shape)}")
  T, H, D = q.shape
  if not is_pow2(D) or not 64 <= D <= 512:
    raise ValueError(f"head dim D={D} (q shape {tuple(q.shape)}) must be a power of two in [64, 512]")
  if raw_kv.ndim != 2 or raw_kv.shape[1] != D:
    raise ValueError(f"raw_kv shape {tuple(raw_kv.shape)} must be [N, D] with D = {D} (q shape {tuple(q.shape)})")
  if kind == "window":
    if comp_kv is not None and (comp_kv.ndim != 2 or comp_kv.shape[1] != D):
      raise ValueError(f"comp_kv shape {tuple(comp_kv.shape)} must be None or [R, D] with D = {D}")
  elif comp_kv is None or comp_kv.ndim != 2 or comp_kv.shape[1] != D:
    shape = None if comp_kv is None else tuple(comp_kv.shape)
    raise ValueError(f"comp_kv shape {shape} must be [R, D] with D = {D} for kind {kind!r} "
                     f"(q shape {tuple(q.shape)})")
  for name, a in (("q", q), ("raw_kv", raw_kv), ("comp_kv", comp_kv)):
    if a is not None and jnp.dtype(a.dtype) not in FLOATS:
      raise ValueError(f"{name}: unsupported dtype {a.dtype}; expected float32 or bfloat16")
  if tuple(sink.shape) != (H,):
    raise ValueError(f"sink shape {tuple(sink.shape)} must be [H] = ({H},)")
  freqs = np.asarray(inv_freq)
  r = 2 * freqs.size
  if freqs.ndim != 1 or r < 2 or r > D:
    raise ValueError(f"inv_freq shape {freqs.shape} must be [rope_dim / 2] with an even rope_dim in [2, D={D}]")
  if not isinstance(window, int) or window < 1:
    raise ValueError(f"window={window!r}: must be a positive int")
  if kind != "window" and (not isinstance(ratio, int) or ratio < 1):
    raise ValueError(f"ratio={ratio!r}: must be a positive int for kind {kind!r}")
  k = 0
  if kind == "csa":
    if indices is None:
      raise ValueError("kind 'csa' needs indices [T, k]")
    if indices.ndim != 2 or indices.shape[0] != T:
      raise ValueError(f"indices shape {tuple(indices.shape)} must be [T, k] with T = {T}")
    if not jnp.issubdtype(indices.dtype, jnp.integer):
      raise ValueError(f"indices must be integers, got dtype {indices.dtype}")
    k = indices.shape[1]
    if not is_pow2(k):
      raise ValueError(f"k={k} (indices shape {tuple(indices.shape)}) must be a power of two")
  elif indices is not None:
    raise ValueError(f"indices (shape {tuple(indices.shape)}) are only taken with kind 'csa', got kind {kind!r}")
  N = raw_kv.shape[0]
  R = 0 if comp_kv is None else comp_kv.shape[0]
  qs, rs = _concrete_int(q_start), _concrete_int(raw_start)
  if qs is not None and qs < 0:
    raise ValueError(f"q_start={qs} must be >= 0")
  if qs is not None and rs is not None and T:
    first, last = max(qs - window + 1, 0), qs + T - 1
    if rs > first or rs + N <= last:
      raise ValueError(f"raw_kv shape {tuple(raw_kv.shape)} at raw_start={rs} covers positions [{rs}, {rs + N}); "
                       f"queries at [{qs}, {qs + T}) with window {window} need [{first}, {last}]")
    if kind == "hca" and R < (qs + T) // ratio:
      raise ValueError(f"comp_kv shape {tuple(comp_kv.shape)}: queries up to position {last} see "
                       f"{(qs + T) // ratio} compressed rows at ratio {ratio}")
  return dict(T=T, H=H, D=D, N=N, R=R, k=k, rope_dim=r)


def sparse_mla_reference(q, raw_kv, comp_kv, sink, *, q_start, raw_start, kind: str, ratio: int, window: int,
                         inv_freq, indices=None, scale: float | None = None) -> jax.Array:
  """f32 [T, H, D]: the model's dense masked attention (all keys scored, bias 0/−inf) at the given
  offsets. Dense [T, N + R] scores: an oracle for small problems (chunk the queries for large ones)."""
  check_inputs(q, raw_kv, comp_kv, sink, q_start=q_start, raw_start=raw_start, kind=kind, ratio=ratio,
               window=window, inv_freq=inv_freq, indices=indices)
  T, H, D = q.shape
  scale = D ** -0.5 if scale is None else float(scale)
  positions = jnp.asarray(q_start, jnp.int32) + jnp.arange(T, dtype=jnp.int32)
  raw_pos = jnp.asarray(raw_start, jnp.int32) + jnp.arange(raw_kv.shape[0], dtype=jnp.int32)
  keys, bias = raw_kv.astype(F32), window_bias(positions, raw_pos, window)
  if kind != "window":
    R = comp_kv.shape[0]
    vis = jnp.where(visible_rows(positions, R, ratio), 0.0, -jnp.inf).astype(F32)
    row_bias = vis if kind == "hca" else vis + selected_bias(jnp.asarray(indices, jnp.int32), R)
    keys = jnp.concatenate([keys, comp_kv.astype(F32)])
    bias = jnp.concatenate([bias, row_bias], axis=1)
  o = sink_attention(q, keys, bias, jnp.asarray(sink, F32), scale)
  return apply_rope(o, positions, np.asarray(inv_freq, np.float32), inverse=True)
