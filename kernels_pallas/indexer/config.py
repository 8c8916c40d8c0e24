"""Tuning knobs of the lightning-indexer kernels: one frozen `Config` plus a heuristic default.

Block sizes must be powers of two (Pallas-Triton tensors need power-of-two sizes) and at least 16 (Triton's
smallest dot dimension): `block_q` and `block_r` are the M and N of the per-head [block_q, c] · [c, block_r] dot.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from kernels_pallas.tiling import MIN_DOT, PLATFORMS, default_platform, is_pow2, next_pow2  # noqa: F401

COMPUTE_DTYPES = ("float32", "bfloat16", "float16")
SELECTIONS = ("sort", "radix")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Config:
  """Static knobs of `scoring.scores` / `topk.topk`. Hashable, so it can be a static jit argument.

  block_q       query tile of the scoring grid (dot M).
  block_r       compressed-row tile of the scoring grid (dot N).
  num_warps, num_stages   Triton launch knobs (num_stages pipelines the per-head q loads).
  query_block   `topk` scores this many queries at a time (lax.map), so only a [query_block, R] score array is
                ever live; a multiple of block_q keeps every scoring tile full.
  compute_dtype dot operand dtype: "float32" (IEEE f32 dots, Precision.HIGHEST: the exact path the tests use) or
                "bfloat16"/"float16" (tensor-core dots, q and keys rounded once in XLA). Accumulation (the dot,
                the relu and the weighted head sum) is f32 in every case. bf16 rounds q·k to ~3 significant
                digits, which can swap rows whose scores are that close around the k-th place (Lucebox feeds F16
                queries: its QAT indexer values are exact in f16).
  selection     how a scored block's k best rows are found: "sort" (`jax.lax.top_k`, a full sort of every row) or
                "radix" (select.py: a Pallas kernel finds the k-th largest digit by digit, no sort); the same ids.
  select_rows, select_cols, select_warps   the radix kernel's [queries, rows] tile and warps (one program per
                `select_rows` queries, streaming their scores `select_cols` at a time).
  """

  block_q: int = 64
  block_r: int = 64
  num_warps: int = 4
  num_stages: int = 2
  query_block: int = 1024
  compute_dtype: str = "float32"
  selection: str = "sort"
  select_rows: int = 8
  select_cols: int = 64
  select_warps: int = 4

  @property
  def dtype(self):
    return jnp.dtype(self.compute_dtype)

  def validate(self) -> None:
    """Raises ValueError for knobs the Triton lowering cannot take."""
    for name in ("block_q", "block_r"):
      v = getattr(self, name)
      if not is_pow2(v) or v < MIN_DOT:
        raise ValueError(f"Config.{name}={v}: must be a power of two >= {MIN_DOT}")
    for name in ("num_warps", "select_rows", "select_cols", "select_warps"):
      if not is_pow2(getattr(self, name)):
        raise ValueError(f"Config.{name}={getattr(self, name)}: must be a power of two")
    if not isinstance(self.num_stages, int) or self.num_stages < 0:
      raise ValueError(f"Config.num_stages={self.num_stages}: must be an int >= 0")
    if not isinstance(self.query_block, int) or self.query_block < 1:
      raise ValueError(f"Config.query_block={self.query_block}: must be an int >= 1")
    if self.compute_dtype not in COMPUTE_DTYPES:
      raise ValueError(f"Config.compute_dtype={self.compute_dtype!r}: expected one of {COMPUTE_DTYPES}")
    if self.selection not in SELECTIONS:
      raise ValueError(f"Config.selection={self.selection!r}: expected one of {SELECTIONS}")

  @classmethod
  def default(cls, num_queries: int, num_rows: int, n_heads: int, head_dim: int, platform: str = "cuda",
              **overrides) -> "Config":
    """Heuristic starting point. The cuda config ran on an H200 (BENCHMARKS.md, sparse attention: score + top-k of
    8192 queries 1.78 ms at 8K context, 28.1 ms at 128K); the rocm one only passed the offline lowering check.

    cuda: 128×128 output tiles, 8 warps, 3 stages, bf16 dots: per program 64 (heads) [128, 128]·[128, 128] bf16
          dots on one resident key tile; row tiles vary fastest in launch order, so the programs in flight share
          one query tile in L2. query_block 1024 → a 128 MiB score block at R = 32K.
    rocm: gfx1151 (64 KiB LDS, 256 VGPRs, WMMA for bf16/f16 only): 128×64 tiles, 8 warps, 1 stage, bf16 —
          LDS 32 KiB, 240 VGPRs, no spills in the offline lowering check (README has the sweep: 64×128 and
          128×128 tiles or 2 stages spill). query_block 512 (unified memory on the APU).
    cpu:  interpret mode: f32 dots (exact), 32×32 tiles, whole problem in a few query blocks.
    Radix selection (`selection="radix"`): cuda one query per program, 2048-row tiles, 8 warps (the best of 36
    variants on the H200 at 128K context: 0.84 ms per 1024 queries against the sort's 2.61); rocm 1024-row tiles
    and 4 warps (lowering check only).
    Tiles shrink (to powers of two >= 16) for small problems so tests and short prefills waste less.
    """
    if platform not in PLATFORMS:
      raise ValueError(f"platform must be one of {PLATFORMS}, got {platform!r}")
    del n_heads, head_dim  # the tiles do not depend on them at V4-Flash sizes; kept for the tuning signature
    if platform == "cuda":
      bq, br, warps, stages, qb, cdt = 128, 128, 8, 3, 1024, "bfloat16"
      select = dict(select_rows=1, select_cols=2048, select_warps=8)
    elif platform == "rocm":
      bq, br, warps, stages, qb, cdt = 128, 64, 8, 1, 512, "bfloat16"
      select = dict(select_rows=1, select_cols=1024, select_warps=4)
    else:
      bq, br, warps, stages, qb, cdt = 32, 32, 4, 1, 1024, "float32"
      select = dict(select_rows=8, select_cols=64, select_warps=4)
    bq = max(MIN_DOT, min(bq, next_pow2(max(num_queries, 1))))
    br = max(MIN_DOT, min(br, next_pow2(max(num_rows, 1))))
    qb = max(bq, min(qb, -(-max(num_queries, 1) // bq) * bq))
    cfg = cls(block_q=bq, block_r=br, num_warps=warps, num_stages=stages, query_block=qb, compute_dtype=cdt, **select)
    cfg = dataclasses.replace(cfg, **overrides)
    cfg.validate()
    return cfg
