"""Head-batched streaming sparse MLA for Hopper (sm_90) as a Pallas Mosaic GPU kernel: a first version (issue #19;
the plan and what it rests on: docs/mla_mosaic.md). Its tests pass compiled on an H200, and V4-Flash with it
(`mla_wgmma`) passes the qualification at 8192 tokens.

A CTA loops over queries (one per SM, persistent). A query's 64 heads are the wgmma M, so each selected KV row is
read once for all of them. Three warpgroups:
- warpgroup 2 gathers the query's key rows, 64 per stage, into two shared-memory slots (`row_gather.gather_rows`,
  per-thread cp.async into the swizzled tiles wgmma reads), running ahead into the next query;
- warpgroups 0 and 1 each compute the same scores s = q·Kᵀ [64 heads, 64 keys] (q resident in shared memory) and
  the online softmax with the sink, then add p·K into their own half of the 512 value columns ([64, 256] f32
  each, 128 registers a thread). The score dot is done twice (1.5× the MMA work of one pass); in exchange the
  two warpgroups never wait for each other.

The key set of each query is one list of row ids into concat(raw_kv, comp_kv) (`key_slots`, in XLA, −1 = masked):
its window rows, then its selected (CSA) or visible (HCA) compressed rows. The kernel masks −1 slots and gathers
zero rows for them: p is 0 there, but 0 × NaN is not 0, so no masked slot may read memory it does not own. The
output's inverse RoPE (its last 64 columns) is applied in the kernel, in f32 before the bf16 store, from a table of
the query's cos / sin made by XLA (`rope_table`).
The interpreter runs no inline code, so there the rows come pre-gathered by XLA ([T, slots, D]) and go in by TMA,
and the rotation is written in jnp (`rotate_back_jnp`; compiled: `rotate_back`, in registers).
bf16 operands, f32 softmax and accumulation, exp2 with log2 e folded into the scale (fast exp). Two precisions:
- "bf16" (the model's): p·V takes p rounded to bf16, and the output is stored bf16 through q's buffer by TMA;
- "split" (the f32 parity path on bf16 rows): p·V takes p as three bf16 parts whose sum is p exactly (`split3`, three
  wgmmas), and the output is stored f32 straight from registers. Triton's "split" takes two parts (~16 of f32's
  24 bits: NMSE ~1e-11 against the exact reference); three take all of them. Hopper's wgmma adds into its f32
  accumulator with truncation (on an H200, q·Kᵀ over 512 columns in one accumulator: ~4 ulps of bias, 5× XLA's
  error), so the split path keeps every accumulator chain short: the score dot in fresh accumulators of
  SPLIT_SCORE_COLUMNS columns, each stage's p·V in fresh accumulators of SPLIT_VALUE_COLUMNS value columns, all joined
  by f32 adds in registers, which round to nearest (docs/mla_mosaic.md).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, memref, vector
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas.mla import row_gather
from kernels_pallas.mla.keyset import clean_indices, kernel_sink
from kernels_pallas.mla.reference import check_inputs

F32, BF16, I32 = jnp.float32, jnp.bfloat16, jnp.int32
KEYS = row_gather.ROWS  # keys per stage
HEADS = 64  # all heads of a query: one warpgroup's wgmma M
HALF = 256  # value columns per compute warpgroup
ROPE = 64  # the rope dims: the last columns of warpgroup 1's half
KERNEL_NAME = "mla_stream_wgmma"
PRECISIONS = ("bf16", "split")
SPLIT_SCORE_COLUMNS = 256  # q·Kᵀ columns (of D) per fresh accumulator, split path (bf16: all D in one)
SCORE_ACCUMULATORS = 2  # score accumulators in flight (32 registers each): one wait for the pair
SPLIT_VALUE_COLUMNS = 64  # value columns per fresh p·V accumulator a stage, split path (bf16: HALF, one chain)
LOG2E = math.log2(math.e)


def key_slots(T: int, q_start, raw_start, N: int, R: int, *, kind: str, ratio: int, window: int,
              indices=None) -> jax.Array:
  """[T, n] int32: query t's keys as rows of concat(raw_kv, comp_kv), −1 where masked, n a multiple of 64.
  Window slots first (positions p − window + 1 … p), then the compressed rows: CSA's cleaned indices (keyset's
  `clean_indices`), or for HCA every row, masked unless visible at p."""
  p = jnp.asarray(q_start, I32) + jnp.arange(T, dtype=I32)
  j = p[:, None] - window + 1 + jnp.arange(window, dtype=I32)[None, :]  # key positions
  i = j - jnp.asarray(raw_start, I32)
  parts = [jnp.where((i >= 0) & (i < N) & (j >= 0), i, -1)]
  if kind == "csa":
    w = clean_indices(indices, q_start, ratio, R)
    parts.append(jnp.where(w >= 0, N + w, -1))
  elif kind == "hca":
    w = jnp.arange(R, dtype=I32)[None, :]
    parts.append(jnp.where(w < jnp.minimum((p[:, None] + 1) // ratio, R), N + w, -1))
  slots = jnp.concatenate(parts, axis=1)
  return jnp.pad(slots, ((0, 0), (0, -slots.shape[1] % KEYS)), constant_values=-1)


def rope_table(T: int, q_start, inv_freq) -> jax.Array:
  """[T, 64] f32: cos then sin of each query's inverse-rotation angles −p·f_i, as reference.apply_rope makes them."""
  p = (jnp.asarray(q_start, I32) + jnp.arange(T, dtype=I32)).astype(F32)
  angle = -(p[:, None] * jnp.asarray(inv_freq, F32)[None, :])
  return jnp.concatenate([jnp.cos(angle), jnp.sin(angle)], axis=1)


def split3(p) -> list[jax.Array]:
  """p (f32) as three bf16 arrays whose f32 sum is p exactly: its top 8 significant bits, the top 8 of the rest,
  then the at most 8 left. Truncation by a mask, not by rounding: XLA may drop an f32 → bf16 → f32 round trip
  (excess precision), never a mask."""
  top = lambda x: lax.bitcast_convert_type(lax.bitcast_convert_type(x, jnp.uint32) & jnp.uint32(0xFFFF0000), F32)
  hi = top(p)
  rest = p - hi  # exact: hi is p with its low mantissa bits cleared
  mid = top(rest)
  return [part.astype(BF16) for part in (hi, mid, rest - mid)]


def rotate_back_jnp(o, rope):
  """o [64, w] f32 (the last w of warpgroup 1's value columns) with its last 64 columns, pairs (2i, 2i + 1), rotated
  by the angles whose cos / sin are rope [64] (reference.apply_rope's f32 arithmetic). For the interpreter."""
  c, s = rope[:ROPE // 2], rope[ROPE // 2:]
  first = o.shape[1] - ROPE
  pairs = o[:, first:].reshape(HEADS, ROPE // 2, 2)
  even, odd = pairs[..., 0], pairs[..., 1]
  rotated = jnp.stack([even * c - odd * s, odd * c + even * s], axis=-1).reshape(HEADS, ROPE)
  return jnp.concatenate([o[:, :first], rotated], axis=1) if first else rotated


def rotate_back(o, rope_ref):
  """rotate_back_jnp in wgmma's register layout, compiled (sm_90): a thread's f32 registers hold column pairs
  (2i, 2i + 1), so each rope pair rotates in place, with its cos / sin read from rope_ref [64] f32 (shared memory).
  Which registers hold rope columns depends on the lane, so every register computes the rotation and selects."""
  wg = plgpu.Layout.WGMMA

  @plgpu.inline_mgpu(arg_types=(wg, plgpu.RefType()), return_type=plgpu.ShapeDtypeStruct(o.shape, F32, layout=wg))
  def rotate(_, acc, rope):
    index = ir.IndexType.get()
    const = lambda v: arith.constant(index, v)
    first = o.shape[1] - ROPE
    out = np.empty(acc.registers.shape, object)
    where = acc.layout.thread_idxs(acc.shape)  # (row, column) of each register's first element
    for (idx, reg), (_, col) in zip(np.ndenumerate(acc.registers), where, strict=True):
      assert ir.VectorType(reg.type).shape == [2], reg.type  # one column pair per register
      live = arith.cmpi(arith.CmpIPredicate.uge, col, const(first))
      pair = arith.select(live, arith.divui(arith.subi(col, const(first)), const(2)), const(0))
      c, s = memref.load(rope, [pair]), memref.load(rope, [arith.addi(pair, const(ROPE // 2))])
      even, odd = vector.extract(reg, [], [0]), vector.extract(reg, [], [1])
      rotated = vector.from_elements(reg.type, [arith.subf(arith.mulf(even, c), arith.mulf(odd, s)),
                                                arith.addf(arith.mulf(odd, c), arith.mulf(even, s))])
      out[idx] = arith.select(live, rotated, reg)
    return mgpu.FragmentedArray(_registers=out, _layout=acc.layout, _is_signed=None)

  return rotate(o, rope_ref)


def _kernel(slots_g, q_g, keys_g, sink_g, rope_g, out_g, q_s, k_s, slots_s, sink_s, rope_s, p_s, bars, *,
            queries: int, stages: int, scale: float, gathered: bool, split: bool, score_columns: int,
            value_columns: int):
  """One CTA takes queries sm, sm + P, … (P CTAs). keys_g: the key table [N + R, D] (compiled) or, in the
  interpreter (`gathered`), the rows already gathered [T, slots, D]; there p also goes through shared memory (p_s),
  since the interpreter takes wgmma operands from refs only. `split`: p in three parts, the output f32 from
  registers (module docstring). `score_columns`: columns of D per score accumulator (D: one); `value_columns`: value
  columns per p·V accumulator (HALF: one chain through all stages; fewer: fresh ones each stage).

  Shared memory: q (two column halves, which then hold the bf16 output), two key slots, the slot lists of two
  queries.
  The gathering warpgroup runs ahead across queries: the next query's first stages are gathered while the compute
  warpgroups finish the previous one, and its q is loaded once their output has left q's buffer (`q_free`)."""
  sm, P = lax.axis_index("sm"), lax.axis_size("sm")
  wg = lax.axis_index("wg")
  count = (queries - 1 - sm) // P + 1  # this CTA's queries (P <= queries)
  sink_bar, slots_bar, q_bar, rope_bar, ready, free, done, q_free = bars

  @pl.when(wg == 2)
  def _producer():
    plgpu.set_max_registers(40, action="decrease")
    plgpu.copy_gmem_to_smem(sink_g, sink_s, sink_bar)

    @pl.loop(0, count)
    def _query(j):
      t, par = sm + j * P, lax.rem(j, 2)
      # the list of query j − 2 is free: its compute warpgroups were done before q_free, waited for at j − 1
      plgpu.copy_gmem_to_smem(slots_g.at[t], slots_s.at[par], slots_bar.at[par])
      plgpu.barrier_wait(slots_bar.at[par])

      @pl.loop(0, stages)
      def _stage(s):
        g = j * stages + s
        slot = lax.rem(g, 2)

        @pl.when(g >= 2)
        def _():
          plgpu.barrier_wait(free.at[slot])

        if gathered:
          plgpu.copy_gmem_to_smem(keys_g.at[t, pl.ds(s * KEYS, KEYS)], k_s.at[slot], ready.at[slot])
        else:
          row_gather.gather_rows(keys_g, slots_s.at[par, s], k_s.at[slot])
          row_gather.wait_gathered()
          plgpu.barrier_arrive(ready.at[slot])

        @pl.when(s == 0)  # q after the first stage's rows: they overlap the previous query's output store
        def _():
          @pl.when(j >= 1)
          def _():
            plgpu.barrier_wait(q_free)

          for v in range(2):
            plgpu.copy_gmem_to_smem(q_g.at[t, :, pl.ds(v * HALF, HALF)], q_s.at[v], q_bar.at[v])
          plgpu.copy_gmem_to_smem(rope_g.at[t], rope_s, rope_bar)  # read by warpgroup 1 before q_free

    # observe the last phases (every phase of a barrier is seen before it is freed)
    plgpu.barrier_wait(sink_bar)
    plgpu.barrier_wait(q_free)
    for slot in range(2):
      pl.when(count * stages > slot)(lambda slot=slot: plgpu.barrier_wait(free.at[slot]))

  def consume(v: int):
    plgpu.set_max_registers(232, action="increase")
    plgpu.barrier_wait(sink_bar)
    sink = plgpu.load(sink_s, (), layout=plgpu.Layout.WGMMA.reduce(1)) * LOG2E

    @pl.loop(0, count)
    def _query(j):
      t, par = sm + j * P, lax.rem(j, 2)
      plgpu.barrier_wait(slots_bar.at[par])
      for h in range(2):
        plgpu.barrier_wait(q_bar.at[h])

      def score_dot(slot, groups):  # q · Kᵀ, an accumulator per group of (half, first column, width) pieces of D
        def dot(*refs):  # all issued before the first read, which waits for them all
          for ref, group in zip(refs, groups, strict=True):
            for h, c, w in group:
              q_piece = q_s.at[h] if w == HALF else q_s.at[h, :, pl.ds(c, w)]
              plgpu.wgmma(ref, q_piece, k_s.at[slot, :, pl.ds(h * HALF + c, w)].T)
          return functools.reduce(jnp.add, [ref[...] for ref in refs])
        return pl.run_scoped(dot, *[plgpu.ACC((HEADS, KEYS), F32)] * len(groups))

      def stage(s, carry):
        m, l, accs = carry
        slot = lax.rem(j * stages + s, 2)
        plgpu.barrier_wait(ready.at[slot])
        w = min(score_columns, HALF)
        pieces = [(h, c, w) for h in range(2) for c in range(0, HALF, w)]
        per_acc = score_columns // w
        groups = [pieces[i:i + per_acc] for i in range(0, len(pieces), per_acc)]
        x = functools.reduce(jnp.add, [score_dot(slot, groups[i:i + SCORE_ACCUMULATORS])
                                       for i in range(0, len(groups), SCORE_ACCUMULATORS)])
        live = plgpu.load(slots_s.at[par, s], (), layout=plgpu.Layout.WGMMA.reduce(0)) >= 0
        x = jnp.where(lax.broadcast_in_dim(live, x.shape, [1]), x * (scale * LOG2E), -jnp.inf)
        m_new = jnp.maximum(m, x.max(axis=1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(x - lax.broadcast_in_dim(m_new, x.shape, [0]))
        accs = [a * lax.broadcast_in_dim(alpha, a.shape, [0]) for a in accs]
        parts = split3(p) if split else [p.astype(BF16)]
        tiles = [k_s.at[slot, :, pl.ds(v * HALF + c * value_columns, value_columns)] for c in range(len(accs))]
        if gathered:  # the interpreter: p through shared memory, and p·V into fresh accumulators added after
          for part in parts:  # reading each accumulator waits for its wgmma: p_s is free again
            p_s[v] = part
            plgpu.commit_smem()
            for c, tile in enumerate(tiles):
              def values(acc_ref, tile=tile):
                plgpu.wgmma(acc_ref, p_s.at[v], tile)
                return acc_ref[...]

              accs[c] = accs[c] + pl.run_scoped(values, plgpu.ACC((HEADS, value_columns), F32))
        elif len(accs) == 1:  # one chain through every stage (bf16)
          def chain(acc_ref):
            for part in parts:
              plgpu.wgmma(acc_ref, part, tiles[0])

          accs = [pl.run_state(chain)(plgpu.ACC.init(accs[0]))]
        else:  # a fresh accumulator per value chunk, added in registers
          for c, tile in enumerate(tiles):
            def values(acc_ref, tile=tile):
              for part in parts:
                plgpu.wgmma(acc_ref, part, tile)
              return acc_ref[...]

            accs[c] = accs[c] + pl.run_scoped(values, plgpu.ACC((HEADS, value_columns), F32))
        plgpu.barrier_arrive(free.at[slot])
        return m_new, p.sum(axis=1) + l * alpha, tuple(accs)

      # the sink joins the running max: no −inf − −inf, even for a query with every key masked
      zero = plgpu.layout_cast(jnp.zeros((HEADS, value_columns), F32), plgpu.Layout.WGMMA)
      l0 = plgpu.layout_cast(jnp.zeros((HEADS,), F32), plgpu.Layout.WGMMA.reduce(1))
      m, l, accs = lax.fori_loop(0, stages, stage, (sink, l0, (zero,) * (HALF // value_columns)))
      norm = l + jnp.exp2(sink - m)
      outs = [a / lax.broadcast_in_dim(norm, a.shape, [0]) for a in accs]
      if v == 1:  # the rope columns: the last chunk's last 64
        plgpu.barrier_wait(rope_bar)
        outs[-1] = rotate_back_jnp(outs[-1], rope_s[...]) if gathered else rotate_back(outs[-1], rope_s)
      if split:  # f32 from registers: q's buffer may take the next query's once both warpgroups are here
        plgpu.commit_smem()  # the reads of the slot list and the rope table before TMA overwrites them
        plgpu.barrier_arrive(q_free)
        for c, o in enumerate(outs):
          out_g[t, :, pl.ds(v * HALF + c * value_columns, value_columns)] = o
      else:  # q's buffer takes the output once both warpgroups' score dots have read q
        (o,) = outs
        plgpu.barrier_arrive(done)
        plgpu.barrier_wait(done)
        out_s = q_s.at[v]
        out_s[...] = o.astype(out_s.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_s, out_g.at[t, :, pl.ds(v * HALF, HALF)])
        plgpu.wait_smem_to_gmem(0)
        plgpu.barrier_arrive(q_free)

  for v in range(2):
    pl.when(wg == v)(functools.partial(consume, v))


def sparse_mla_wgmma(q, raw_kv, comp_kv, sink, *, q_start, raw_start, kind: str, ratio: int, window: int,
                     inv_freq, indices=None, scale: float | None = None, num_sms: int | None = None,
                     precision: str = "bf16", score_columns: int | None = None, value_columns: int | None = None,
                     interpret: bool = False) -> jax.Array:
  """sparse_mla's semantics (reference.py) → [T, H, D], for H = 64 heads of dim D = 512 and bf16 q / KV (the
  kernel's dots take bf16 operands). `precision` "bf16" (bf16 p, bf16 output) or "split" (p in three bf16 parts,
  f32 output; module docstring). `score_columns` / `value_columns`: the accumulator chunks (module docstring; default
  SPLIT_* for split, one chain each for bf16, whose output needs value_columns 256). `num_sms`: CTAs (default
  `_sms`), each looping over queries.
  `interpret`: Mosaic GPU's interpreter, on rows gathered by XLA."""
  if precision not in PRECISIONS:
    raise ValueError(f"precision={precision!r}: the wgmma MLA takes one of {PRECISIONS}")
  split = precision == "split"
  score_columns = score_columns or (SPLIT_SCORE_COLUMNS if split else 2 * HALF)
  value_columns = value_columns or (SPLIT_VALUE_COLUMNS if split else HALF)
  if score_columns not in (64, 128, 256, 512) or value_columns not in ((64, 128, 256) if split else (HALF,)):
    raise ValueError(f"score_columns={score_columns}, value_columns={value_columns}: the wgmma MLA takes score "
                     f"columns 64, 128, 256 or 512 and value columns 64, 128 or 256 (bf16: 256)")
  s = check_inputs(q, raw_kv, comp_kv, sink, q_start=q_start, raw_start=raw_start, kind=kind, ratio=ratio,
                   window=window, inv_freq=inv_freq, indices=indices)
  T, H, D, N, R = s["T"], s["H"], s["D"], s["N"], s["R"]
  if H != HEADS or D != 2 * HALF or any(a is not None and a.dtype != BF16 for a in (q, raw_kv, comp_kv)):
    raise ValueError(f"the wgmma MLA takes {HEADS} heads of dim {2 * HALF} (V4-Flash's) and bf16 q / KV; got "
                     f"H={H}, D={D}, q {q.dtype}, raw_kv {raw_kv.dtype}")
  slots = key_slots(T, q_start, raw_start, N, R, kind=kind, ratio=ratio, window=window, indices=indices)
  table = raw_kv if comp_kv is None or kind == "window" else jnp.concatenate([raw_kv, comp_kv])
  keys = jnp.where(slots[..., None] >= 0, table[jnp.maximum(slots, 0)], 0) if interpret else table
  if len(inv_freq) != ROPE // 2:
    raise ValueError(f"the wgmma MLA rotates the last {ROPE} dims; got {2 * len(inv_freq)} rope dims")
  return _call(slots, q, keys, kernel_sink(sink), rope_table(T, q_start, inv_freq),
               scale=float(D ** -0.5 if scale is None else scale), gathered=bool(interpret),
               split=split, num_sms=num_sms or _sms(interpret), score_columns=score_columns,
               value_columns=value_columns)


def _sms(interpret: bool) -> int:
  """CTAs by default: one per SM (the interpreter, which simulates each CTA's warpgroups, gets 4)."""
  return 4 if interpret else getattr(jax.devices()[0], "core_count", None) or 132


@functools.partial(jax.jit, static_argnames=("scale", "gathered", "split", "num_sms", "score_columns", "value_columns"))
def _call(slots, q, keys, sink, rope, *, scale: float, gathered: bool, split: bool, num_sms: int, score_columns: int,
          value_columns: int):
  T, n = slots.shape
  D = q.shape[-1]
  tiled = row_gather.TILED
  kernel = plgpu.kernel(
      functools.partial(_kernel, queries=T, stages=n // KEYS, scale=scale, gathered=gathered, split=split,
                        score_columns=score_columns, value_columns=value_columns),
      out_type=jax.ShapeDtypeStruct((T, HEADS, D), F32 if split else BF16), grid=(min(T, num_sms),), grid_names=("sm",),
      num_threads=3, thread_name="wg", kernel_name=KERNEL_NAME,
      scratch_types=[plgpu.SMEM((2, HEADS, HALF), BF16, transforms=tiled),  # q's column halves, then the output's
                     plgpu.SMEM((2, KEYS, D), BF16, transforms=tiled),
                     plgpu.SMEM((2, n // KEYS, KEYS), I32), plgpu.SMEM((HEADS,), F32), plgpu.SMEM((ROPE,), F32),
                     plgpu.SMEM((2, HEADS, KEYS), BF16, transforms=tiled) if gathered else None,
                     (plgpu.Barrier(), plgpu.Barrier(num_barriers=2), plgpu.Barrier(num_barriers=2),  # sink, lists, q
                      plgpu.Barrier(),  # the rope table
                      plgpu.Barrier(num_barriers=2), plgpu.Barrier(num_arrivals=2, num_barriers=2),  # ready, free
                      plgpu.Barrier(num_arrivals=2), plgpu.Barrier(num_arrivals=2))],  # done, q_free
      interpret=plgpu.InterpretGPUParams(detect_races=True) if gathered else None,  # tests read the verdict
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
  return kernel(slots.reshape(T, n // KEYS, KEYS), q, keys, sink, rope)  # a TMA box holds <= 256 slots a row
