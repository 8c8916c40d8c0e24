"""What both MLA kernels share: the program's rows, its key set as a sequence of stages, split-bf16 dots and the
finish (sink, 1/l, in-kernel inverse RoPE).

A program owns Tq queries × Hp heads = M rows (row m: query a = m // Hp, head h = m % Hp). Its keys come in
stages of kb rows, each a gather of kb rows of one table ([kb, D]) plus an [M, kb] visibility mask:
  window stages      n_window = ceil((window + Tq − 1) / kb), static: raw rows from the first query's window
                     start to the last query, i.e. the union of the tile's windows (clamped to [0, N), masked).
  hca stages         ceil(c_max / kb), dynamic: compressed rows 0 … c_max − 1, c_max = min((p_last + 1) // ratio, R);
                     row w is masked for query p unless w < (p + 1) // ratio.
  csa stages         Tq · k / kb, static: query a's indices[t_a, s·kb : (s+1)·kb], masked for the other queries'
                     rows and for −1. `clean_indices` (one XLA pass over [T, k] int32 before the kernel) turns
                     rows that are not visible (w >= (p + 1) // ratio or >= R) and repeats of the previous index
                     (indices are sorted, so a duplicate is adjacent) into −1: doing that in-kernel cost the
                     registers that made the f32-staged CSA kernel spill on gfx1151.
Row ids of masked keys are clamped into the table, so every gather stays in bounds.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

F32 = jnp.float32
BF16 = jnp.bfloat16
I32 = jnp.int32
LOG2E = float(np.log2(np.e))


@dataclasses.dataclass(frozen=True)
class Geometry:
  """Static shapes and knobs of one kernel launch."""
  kind: str
  T: int
  H: int
  D: int
  N: int
  R: int
  k: int
  rope_dim: int
  window: int
  ratio: int
  Tq: int
  Hp: int
  kb: int
  scale: float
  dk: int               # head-dim chunk of the dots and of the accumulator tiles
  q_resident: bool      # q chunks loaded once per program (else reloaded for every stage)
  precision: str        # "split" | "bf16": whether the softmax weights p are split into hi + lo
  q_parts: int          # bf16 operand arrays of q (2 = hi, lo of an f32 q), raw_kv and comp_kv
  raw_parts: int
  comp_parts: int

  @property
  def M(self) -> int:
    return self.Tq * self.Hp

  @property
  def n_chunks(self) -> int:
    return self.D // self.dk

  @property
  def n_window(self) -> int:
    return -(-(self.window + self.Tq - 1) // self.kb)

  @property
  def csa_stages(self) -> int:
    return self.Tq * (self.k // self.kb)

  @property
  def max_comp_stages(self) -> int:
    """Static bound on the compressed stages of one program (the grouped kernel's scratch width)."""
    if self.kind == "csa":
      return self.csa_stages
    if self.kind == "hca":
      return -(-self.R // self.kb)
    return 0

  @property
  def grid(self) -> tuple[int, int]:
    return (-(-self.T // self.Tq), -(-self.H // self.Hp))


def _log2(n: int) -> int:
  return int(n).bit_length() - 1


# ---- split-bf16 dots ---------------------------------------------------------------------------------------------

def parts(x, split: bool):
  """x as bf16 operand parts: (hi, lo) with hi + lo ≈ x to ~2^-16 relative, or (bf16(x),). Used in XLA for the
  inputs (api.operand_parts) and in the kernels for the softmax weights."""
  if x.dtype == BF16 and not split:
    return (x,)
  xf = x.astype(F32)
  if not split:
    return (xf.astype(BF16),)
  # hi = x with the low 16 mantissa bits cleared (exact in bf16), by bit masking: XLA GPU may drop an
  # f32 -> bf16 -> f32 round trip (excess precision allowed), which would make x - hi zero.
  hi = jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(xf, jnp.uint32) & jnp.uint32(0xFFFF0000), F32)
  return hi.astype(BF16), (xf - hi).astype(BF16)


def _passes(a_parts, b_parts, trans_b: bool):
  """The split passes (a_i, b_j) with i + j <= 1 (hi·hi, hi·lo, lo·hi) and the dot_general dimension numbers."""
  dims = (((1,), (1,)), ((), ())) if trans_b else (((1,), (0,)), ((), ()))
  return [(a, b) for i, a in enumerate(a_parts) for j, b in enumerate(b_parts) if i + j <= 1], dims


def dot(a_parts, b_parts, *, trans_b: bool):
  """Σ a_i · b_j over the split passes, 2-D bf16 dots with f32 accumulation.
  trans_b: a [M, K] · b [N, K]^T → [M, N]; else a [M, K] · b [K, N]."""
  passes, dims = _passes(a_parts, b_parts, trans_b)
  out = None
  for a, b in passes:
    d = jax.lax.dot_general(a, b, dims, preferred_element_type=F32)
    out = d if out is None else out + d
  return out


# ---- the program -------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Program:
  """Per-program values (traced) used by the stages and the finish."""
  g: Geometry
  tok: jax.Array        # [M] query index of each row (clamped into [0, T))
  row_ok: jax.Array     # [M] the row is a real (query, head)
  head: jax.Array       # [M] head of each row (clamped)
  pos: jax.Array        # [M] absolute position of each row's query
  raw_start: jax.Array  # scalar
  t0: jax.Array         # scalar: the program's first query
  p_first: jax.Array    # scalar: position of the first query
  p_last: jax.Array     # scalar: position of the last real query


def split_refs(g: Geometry, refs, n_tail: int):
  """(q refs, raw refs, comp refs, the n_tail remaining refs) of a kernel's argument list."""
  a, b, c = g.q_parts, g.raw_parts, g.comp_parts
  return refs[:a], refs[a:a + b], refs[a + b:a + b + c], refs[a + b + c:a + b + c + n_tail]


def make_program(g: Geometry, off_ref, pid_t, pid_h) -> Program:
  q_start, raw_start = off_ref[0], off_ref[1]
  m = jnp.arange(g.M, dtype=I32)
  a, hh = m >> _log2(g.Hp), m & (g.Hp - 1)   # powers of two: shifts/masks (jnp // and % lower poorly)
  t0 = pid_t * g.Tq
  tok = t0 + a
  head = pid_h * g.Hp + hh
  row_ok = (tok < g.T) & (head < g.H)
  tok = jnp.minimum(tok, g.T - 1)
  head = jnp.minimum(head, g.H - 1)
  last = jnp.minimum(t0 + g.Tq, g.T) - 1
  return Program(g=g, tok=tok, row_ok=row_ok, head=head, pos=q_start + tok, raw_start=raw_start, t0=t0,
                 p_first=q_start + t0, p_last=q_start + last)


def load_q(pr: Program, q_refs, c: int, live=True):
  """Column chunk c of the program's q rows: one [M, dk] bf16 tile per operand part (masked rows 0). `live`: a
  loop-variant true scalar, so that the compiler cannot hoist a per-stage reload out of the loop (which would
  keep q resident, replicated in every warp)."""
  g = pr.g
  cols = c * g.dk + jnp.arange(g.dk, dtype=I32)
  rows = pr.tok * g.H + pr.head
  return tuple(plt.load(r.at[rows[:, None], cols[None, :]], mask=pr.row_ok[:, None] & live, other=0)
               for r in q_refs)


def q_tiles(pr: Program, q_refs):
  """q's operand parts, one entry per column chunk (q_resident)."""
  return tuple(load_q(pr, q_refs, c) for c in range(pr.g.n_chunks))


SINK_FLOOR = -1e30  # a sink logit below any score: no mass, as −∞, and finite through the base-2 rescaling


def kernel_sink(sink) -> jax.Array:
  """The sink as the streaming kernels take it: f32 [H], −∞ (a plain softmax) raised to SINK_FLOOR. Their online
  max starts at the sink, and an −∞ start meets a stage with every key masked (a band's first positions) as
  exp(−∞ − −∞) = NaN; from −1e30 it adds exp(−1e30 − μ) = 0, the same softmax whenever a key is visible (the
  window always holds the query's own). Finite sinks above it keep their bits."""
  return jnp.maximum(jnp.asarray(sink, F32), SINK_FLOOR)


def load_sink(pr: Program, sink_ref):
  return plt.load(sink_ref.at[pr.head], mask=pr.row_ok, other=0).astype(F32)


def load_rows(ref, rows, valid, c: int, dk: int, transposed: bool):
  """Column chunk c of kb table rows (invalid rows read as 0; ids clamped in bounds): [kb, dk], or [dk, kb]
  when `transposed` (the score dot's B operand as loaded: no in-register transpose, which Triton would
  otherwise materialise replicated in every warp)."""
  cols = c * dk + jnp.arange(dk, dtype=I32)
  if transposed:
    return plt.load(ref.at[rows[None, :], cols[:, None]], mask=valid[None, :], other=0)
  return plt.load(ref.at[rows[:, None], cols[None, :]], mask=valid[:, None], other=0)


def row_tiles(g: Geometry, refs, rows, valid, transposed: bool = True):
  """A stage's rows: per column chunk, one tile per operand part ([dk, kb] tiles when transposed)."""
  return tuple(tuple(load_rows(r, rows, valid, c, g.dk, transposed) for r in refs) for c in range(g.n_chunks))


def add_values(acc, p_parts, tile, transposed: bool):
  """acc + p [M, kb] · V [kb, dk] → [M, dk], V given as [dk, kb] (transposed) or [kb, dk].

  The first pass takes acc as its accumulator; every further pass (split precision) is subtracted as a dot of −p
  part. Triton folds `x + dot(a, b)` into dot(a, b, x), and a dot whose result feeds another dot gets all its warps
  along the rows; on sm_90 each accumulator tile then crosses between two MMA layouts through shared memory every
  stage (docs/lowering.md). Negating a bf16 part is exact: only the f32 rounding order differs."""
  passes, dims = _passes(p_parts, tile, transposed)
  (a0, b0), rest = passes[0], passes[1:]
  out = acc + jax.lax.dot_general(a0, b0, dims, preferred_element_type=F32)
  for a, b in rest:
    out = out - jax.lax.dot_general(-a, b, dims, preferred_element_type=F32)
  return out


def scores(g: Geometry, pr: Program, q_refs, q_held, k_tiles, stage):
  """q · Kᵀ [M, kb] summed over the column chunks (k_tiles transposed, [dk, kb]); q chunks come from q_held or
  are reloaded for this stage (L1/L2 hits)."""
  s = None
  for c in range(g.n_chunks):
    qc = q_held[c] if q_held is not None else load_q(pr, q_refs, c, stage >= 0)
    d = dot(qc, k_tiles[c], trans_b=False)
    s = d if s is None else s + d
  return s


class Stage:
  """One stage's keys: loop index, clamped row ids [kb], row validity [kb], mask [M, kb]."""

  def __init__(self, index, rows, valid, mask):
    self.index, self.rows, self.valid, self.mask = index, rows, valid, mask


def window_stage(pr: Program, s) -> Stage:
  """Window stage s (0 <= s < n_window): raw rows from the first query's window start on."""
  g = pr.g
  j = pr.p_first - g.window + 1 + s * g.kb + jnp.arange(g.kb, dtype=I32)   # key positions
  i = j - pr.raw_start
  valid = (i >= 0) & (i < g.N) & (j >= 0)  # a band's carried tail holds zeros before position 0
  d = pr.pos[:, None] - j[None, :]
  mask = valid[None, :] & (d >= 0) & (d < g.window) & pr.row_ok[:, None]
  return Stage(s, jnp.clip(i, 0, g.N - 1), valid, mask)


def hca_count(pr: Program):
  """Compressed rows any query of the program sees: min((p_last + 1) // ratio, R) (positions are >= 0)."""
  g = pr.g
  return jnp.minimum(jax.lax.div(pr.p_last + 1, g.ratio), g.R)


def hca_stage(pr: Program, s) -> Stage:
  g = pr.g
  w = s * g.kb + jnp.arange(g.kb, dtype=I32)
  valid = w < g.R
  vis = jax.lax.div(pr.pos + 1, g.ratio)
  mask = valid[None, :] & (w[None, :] < vis[:, None]) & pr.row_ok[:, None]
  return Stage(s, jnp.minimum(w, g.R - 1), valid, mask)


def csa_stage(pr: Program, s, idx_ref) -> Stage:
  """CSA stage s (0 <= s < Tq·k/kb): slots [c·kb, (c+1)·kb) of query a = s // (k/kb)."""
  g = pr.g
  per = g.k // g.kb
  if g.Tq == 1:  # one query per program (the GPU default): no per-row ownership mask
    a, c, t, t_ok = 0, s, pr.t0, pr.t0 < g.T
  else:
    a, c = s >> _log2(per), s & (per - 1)
    t = pr.t0 + a
    t_ok = t < g.T
  t = jnp.minimum(t, g.T - 1)
  slot = c * g.kb + jnp.arange(g.kb, dtype=I32)
  w = plt.load(idx_ref.at[t, slot], mask=t_ok & (slot >= 0), other=-1)
  valid = w >= 0  # visibility and repeats were turned into −1 by `clean_indices` (XLA)
  rows_ok = pr.row_ok
  if g.Tq > 1:
    rows_ok = rows_ok & ((jnp.arange(g.M, dtype=I32) >> _log2(g.Hp)) == a)
  return Stage(s, jnp.clip(w, 0, max(g.R - 1, 0)), valid, valid[None, :] & rows_ok[:, None])


def clean_indices(indices, q_start, ratio: int, R: int):
  """[T, k] int32 with every slot the kernel must not read set to −1: −1 already, not visible at the query's
  position (w >= min((p + 1) // ratio, R), the analytic re-check of the indexer's visibility) or equal to the
  previous slot."""
  T = indices.shape[0]
  idx = indices.astype(I32)
  vis = jnp.minimum((jnp.asarray(q_start, I32) + jnp.arange(T, dtype=I32) + 1) // ratio, R)
  prev = jnp.concatenate([jnp.full((T, 1), -1, I32), idx[:, :-1]], axis=1)
  return jnp.where((idx >= 0) & (idx < vis[:, None]) & (idx != prev), idx, -1)


def comp_stage_count(pr: Program):
  """Compressed stages of this program: static for csa, dynamic for hca, 0 for window."""
  g = pr.g
  if g.kind == "csa":
    return g.csa_stages
  if g.kind == "hca":
    return jax.lax.div(hca_count(pr) + g.kb - 1, g.kb)
  return 0


def comp_stage(pr: Program, s, idx_ref) -> Stage:
  return csa_stage(pr, s, idx_ref) if pr.g.kind == "csa" else hca_stage(pr, s)


# ---- finish ------------------------------------------------------------------------------------------------------

def pair_swap(x):
  """[M, D] → [M, D] with columns 2i and 2i+1 exchanged (reshape + split/join, what Triton lowers)."""
  M, D = x.shape
  x3 = x.reshape(M, D // 2, 2)
  even, odd = jnp.split(x3, 2, axis=-1)
  return jnp.concatenate([odd, even], axis=-1).reshape(M, D)


def inverse_rope(pr: Program, o, freq_ref, c: int):
  """Column chunk c [M, dk] of the output with pairs (2i, 2i+1) of the last rope_dim columns rotated by −p·f_i
  (rope.apply inverse): even' = e·cos + o·sin, odd' = o·cos − e·sin. freq_ref [D] holds f_i at both columns of
  pair i (0 elsewhere). Chunks left of the rope columns pass through."""
  g = pr.g
  if (c + 1) * g.dk <= g.D - g.rope_dim:
    return o
  cols = c * g.dk + jnp.arange(g.dk, dtype=I32)
  freq = plt.load(freq_ref.at[cols])
  is_rope = cols >= g.D - g.rope_dim
  sign = jnp.where((cols & 1) == 0, 1.0, -1.0).astype(F32)
  angle = pr.pos.astype(F32)[:, None] * freq[None, :]
  cos = jnp.where(is_rope[None, :], jnp.cos(angle), 1.0)
  sin = jnp.where(is_rope[None, :], jnp.sin(angle), 0.0) * sign[None, :]
  return o * cos + pair_swap(o) * sin


def finish(pr: Program, o_ref, freq_ref, acc, denom, pid_t, pid_h):
  """acc / denom, inverse RoPE, and the store of the program's [M, D] rows, chunk by chunk; the rows are
  contiguous in the output layout chosen by `out_layout`."""
  g = pr.g
  nt, G = g.grid
  if g.Tq == 1:
    start = (pid_t * G + pid_h) * g.Hp
  elif G == 1:
    start = pid_t * g.M
  else:
    start = (pid_h * nt + pid_t) * g.M
  inv = 1.0 / denom
  for c in range(g.n_chunks):
    o = inverse_rope(pr, acc[c] * inv[:, None], freq_ref, c)
    plt.store(o_ref.at[pl.ds(start, g.M), pl.ds(c * g.dk, g.dk)], o.astype(o_ref.dtype))


def out_layout(g: Geometry):
  """(flat output shape, unflatten fn → [T, H, D]). Each program's M rows are contiguous in the flat output:
  Tq = 1: [Tp, Hpad, D]; one head group: [Tp, Hpad, D]; else [G, Tp, Hp, D] (transposed back in XLA)."""
  nt, G = g.grid
  Tp, Hpad = nt * g.Tq, G * g.Hp
  shape = (Tp * Hpad, g.D)
  if g.Tq > 1 and G > 1:
    def unflatten(o):
      return o.reshape(G, Tp, g.Hp, g.D).transpose(1, 0, 2, 3).reshape(Tp, Hpad, g.D)[:g.T, :g.H]
  else:
    def unflatten(o):
      return o.reshape(Tp, Hpad, g.D)[:g.T, :g.H]
  return shape, unflatten


def freq_columns(inv_freq, D: int) -> np.ndarray:
  """[D] f32: f_i at columns D − r + 2i and D − r + 2i + 1, 0 at the unrotated columns."""
  f = np.asarray(inv_freq, np.float32)
  out = np.zeros((D,), np.float32)
  out[D - 2 * f.size:] = np.repeat(f, 2)
  return out
