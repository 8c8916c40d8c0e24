"""Indexer scoring kernel (docs/model.md §6; Lucebox `ggml_ds4_indexer_score_masked`), Pallas-Triton.

    score[t, s] = Σ_h w[t,h] · relu(q[t,h] · k[s])    visible iff s < (q_start + t + 1) // ratio, else −inf

Grid (row tile, query tile); one program owns an output tile [block_q, block_r]. It loads its key tile once and
loops over the Hi heads: a [block_q, c] · [c, block_r] dot per head (bf16/f16 operands or IEEE f32, f32
accumulate), relu, times the head weight column w[:, h], added to an f32 accumulator. Row tiles vary fastest
(program_id(0), the fastest launch axis), so the programs in flight share one query tile in L2 while every key
tile is small enough to stay there. A row tile with no visible row for any query of the tile writes −inf and
does no dot (about half of a causal prefill).

q_start is a runtime int32 input (no scalar prefetch on this backend), so query chunks at different offsets reuse
one compiled kernel. q is read as [T, Hi·c]: head h of a query tile is the 2-D slice [q0:q0+bq, h·c:h·c+c].
A head_dim that is not a power of two is padded in-tile with masked zero loads.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kernels_pallas.indexer.config import Config, default_platform, next_pow2

F32 = jnp.float32
I32 = jnp.int32


def check_inputs(q, w, keys, ratio) -> None:
  """ValueError naming the shapes for anything `scores` cannot take."""
  if q.ndim != 3:
    raise ValueError(f"q must be [T, Hi, c], got shape {tuple(q.shape)}")
  if w.ndim != 2:
    raise ValueError(f"w must be [T, Hi], got shape {tuple(w.shape)}")
  if keys.ndim != 2:
    raise ValueError(f"keys must be [R, c], got shape {tuple(keys.shape)}")
  if tuple(w.shape) != tuple(q.shape[:2]):
    raise ValueError(f"w shape {tuple(w.shape)} must be [T, Hi] = {tuple(q.shape[:2])} (q shape {tuple(q.shape)})")
  if keys.shape[1] != q.shape[2]:
    raise ValueError(f"keys shape {tuple(keys.shape)} must be [R, c] with c = {q.shape[2]} "
                     f"(q shape {tuple(q.shape)})")
  for name, a in (("q", q), ("w", w), ("keys", keys)):
    if not jnp.issubdtype(a.dtype, jnp.floating):
      raise ValueError(f"{name} must be a float array, got {a.dtype} (shape {tuple(a.shape)})")
  if not isinstance(ratio, int) or isinstance(ratio, bool) or ratio < 1:
    raise ValueError(f"ratio must be an int >= 1, got {ratio!r}")


def as_q_start(q_start) -> jax.Array:
  """[1] int32 runtime input; a Python int must be >= 0."""
  if isinstance(q_start, (int,)) and not isinstance(q_start, bool):
    if q_start < 0:
      raise ValueError(f"q_start must be >= 0, got {q_start}")
  elif not hasattr(q_start, "dtype") or not jnp.issubdtype(q_start.dtype, jnp.integer) or jnp.ndim(q_start):
    raise ValueError(f"q_start must be an int or an integer scalar array, got {q_start!r}")
  return jnp.asarray(q_start, I32).reshape(1)


def dot_nt(a, b):
  """a [m, c] · b [n, c]^T → [m, n] f32; f32 operands need HIGHEST (the Triton lowering maps DEFAULT to TF32)."""
  prec = jax.lax.Precision.HIGHEST if a.dtype == jnp.dtype(F32) else None
  return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=prec, preferred_element_type=F32)


def _kernel(q_start_ref, q_ref, w_ref, k_ref, o_ref, *, T: int, R: int, n_heads: int, c: int, c_pad: int,
            ratio: int, block_q: int, block_r: int):
  r0 = pl.program_id(0) * block_r
  q0 = pl.program_id(1) * block_q
  qs = q_start_ref[0]
  rows = q0 + jnp.arange(block_q, dtype=I32)
  cols = r0 + jnp.arange(block_r, dtype=I32)
  qmask, rmask = rows < T, cols < R
  out = o_ref.at[pl.ds(q0, block_q), pl.ds(r0, block_r)]
  omask = qmask[:, None] & rmask[None, :]
  # Rows visible to the tile's last real query bound the whole tile (visibility grows with t).
  tile_limit = jax.lax.div(qs + jnp.minimum(q0 + block_q, T), ratio)

  @pl.when(r0 < tile_limit)
  def _():
    cpad_mask = None if c_pad == c else (jnp.arange(c_pad, dtype=I32) < c)[None, :]
    kt = plt.load(k_ref.at[pl.ds(r0, block_r), pl.ds(0, c_pad)],
                  mask=rmask[:, None] if cpad_mask is None else rmask[:, None] & cpad_mask, other=0)
    qm = qmask[:, None] if cpad_mask is None else qmask[:, None] & cpad_mask

    def head(h, acc):
      c0 = h * c if c_pad != c else pl.multiple_of(h * c, c)
      qt = plt.load(q_ref.at[pl.ds(q0, block_q), pl.ds(c0, c_pad)], mask=qm, other=0)
      wt = plt.load(w_ref.at[pl.ds(q0, block_q), pl.ds(h, 1)], mask=qmask[:, None], other=0)
      qk = dot_nt(qt, kt)
      return acc + wt * jnp.where(qk < 0, 0.0, qk)  # relu as a select: compiled, a max turns NaN into 0

    acc = jax.lax.fori_loop(0, n_heads, head, jnp.zeros((block_q, block_r), F32))
    limit = jax.lax.div(qs + rows + 1, ratio)  # per query: rows < limit are visible
    s = jnp.where(cols[None, :] < limit[:, None], acc, -jnp.inf)
    plt.store(out, s, mask=omask)

  @pl.when(r0 >= tile_limit)
  def _():
    plt.store(out, jnp.full((block_q, block_r), -jnp.inf, F32), mask=omask)


def scores(q, w, keys, *, q_start, ratio: int = 4, config: Config | None = None,
           interpret: bool = False) -> jax.Array:
  """f32 [T, R] indexer scores (−inf where invisible). q [T, Hi, c] (rotated; f32/bf16), w [T, Hi] f32 (with the
  head_dim^−½·n_heads^−½ scale), keys [R, c]; q_start: absolute position of q[0], a Python int or a traced int32
  scalar (one compile for every offset). `config=None` takes `Config.default` for the default backend."""
  check_inputs(q, w, keys, ratio)
  T, Hi, c = q.shape
  R = keys.shape[0]
  if config is None:
    config = Config.default(T, R, Hi, c, platform=default_platform())
  config.validate()
  qs = as_q_start(q_start)
  if T == 0 or R == 0:
    return jnp.full((T, R), -jnp.inf, F32)
  cdt = config.dtype
  bq, br = config.block_q, config.block_r
  c_pad = max(16, next_pow2(c))  # the dot's K must be a power of two >= 16
  kernel = functools.partial(_kernel, T=T, R=R, n_heads=Hi, c=c, c_pad=c_pad, ratio=ratio, block_q=bq,
                             block_r=br)
  return pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((T, R), F32), grid=(pl.cdiv(R, br), pl.cdiv(T, bq)),
      interpret=interpret, name="indexer_scores",
      compiler_params=plt.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
  )(qs, q.astype(cdt).reshape(T, Hi * c), w.astype(F32), keys.astype(cdt))
