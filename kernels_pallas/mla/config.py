"""Tuning knobs of the sparse MLA attention kernels: one frozen `Config` plus a heuristic default.

A program of either kernel owns `tokens_per_program` queries × `heads_per_program` heads; they form the M rows of
its dots (row m = token m // heads_per_program, head m % heads_per_program), so M = tokens × heads must be a
power of two and, compiled, at least 16 (Triton's smallest dot). Keys are staged `keys_per_stage` rows at a time.
Which knob maps to which Lucebox switch (docs/upstream.md §4):

* `heads_per_program` : HEADS_PER_BLOCK (16) of `ds4_flash_attn_d512_streaming_topk_kernel` (8 in the grouped one).
* `keys_per_stage`    : KEYS_PER_STAGE (16).
* f32 staging / fast exp are call arguments of `api.sparse_mla` (GGML_CUDA_MLA_STREAM_F32_STAGE / _FAST_EXP).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from kernels_pallas.tiling import MIN_DOT, PLATFORMS, default_platform, is_pow2, next_pow2  # noqa: F401

PRECISIONS = ("split", "bf16")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Config:
  """Static knobs of `api.sparse_mla`. Hashable, so it can be a static jit argument.

  heads_per_program   heads of one program (power of two; heads beyond H are masked, so H = 4 runs at 16).
  tokens_per_program  queries of one program (power of two). The window rows of neighbouring queries overlap, so
                      a tile of queries stages window + tokens − 1 raw rows once; HCA rows are a shared prefix.
                      CSA rows differ per query: each query's selected rows are staged in turn with the other
                      queries' rows masked, so > 1 only pays off to reach M >= 16 with few heads.
  keys_per_stage      rows staged per step (the dot N of the scores, K of the values; power of two >= 16 compiled).
  head_dim_chunk      D is processed in chunks of this many columns (power of two <= D): the score dot sums
                      D / chunk partial dots and the f32 accumulator is D / chunk tiles [M, chunk]. The dot
                      operands of one chunk are all a warp holds at a time (a [16, 512] bf16 q operand alone is
                      128 VGPRs per lane when every warp needs it, which spills on gfx1151).
  q_resident          keep q's operand parts in registers for the whole program (else each stage reloads them
                      from L1/L2; cheap next to the staged rows, and it frees the registers).
  num_warps, num_stages   Triton launch knobs.
  precision           "split": every f32 dot operand (q and f32 K/V rows in XLA before the kernel, the softmax
                      weights in-kernel) is split into bf16 hi + lo and multiplied in three bf16 passes with f32
                      accumulation (~2^-16 relative, the parity path; bf16 K/V rows are exact in one part, so bf16 KV
                      costs 2 passes per dot instead of 3).
                      "bf16": one bf16 pass per dot (operands rounded to bf16; fewer registers and dots; NMSE
                      1.6e-6 with bf16 q/KV, 7.9e-6 with f32: outside the 5e-4 + 5e-4·|x| parity tolerance).
  grouped_scratch_bytes  the grouped kernel stores every score in an HBM scratch [T·H, keys] f32; larger problems
                      raise ValueError instead of allocating it.
  """

  heads_per_program: int = 16
  tokens_per_program: int = 1
  keys_per_stage: int = 16
  head_dim_chunk: int = 128
  q_resident: bool = False
  num_warps: int = 4
  num_stages: int = 2
  precision: str = "split"
  grouped_scratch_bytes: int = 16 << 30

  @property
  def rows(self) -> int:
    """M: the rows of one program's dots."""
    return self.heads_per_program * self.tokens_per_program

  def validate(self, *, compiled: bool = False) -> None:
    """Raises ValueError for knobs the Triton lowering cannot take (`compiled`: also the GPU dot minimums)."""
    for name in ("heads_per_program", "tokens_per_program", "keys_per_stage", "head_dim_chunk", "num_warps"):
      v = getattr(self, name)
      if not is_pow2(v):
        raise ValueError(f"Config.{name}={v!r}: must be a power of two")
    if compiled and (self.rows < MIN_DOT or self.keys_per_stage < MIN_DOT):
      raise ValueError(f"Config: heads_per_program × tokens_per_program = {self.rows} and keys_per_stage = "
                       f"{self.keys_per_stage} must both be >= {MIN_DOT} on a GPU (Triton's smallest dot); "
                       f"raise tokens_per_program for models with few heads")
    if not isinstance(self.num_stages, int) or self.num_stages < 0:
      raise ValueError(f"Config.num_stages={self.num_stages!r}: must be an int >= 0")
    if self.precision not in PRECISIONS:
      raise ValueError(f"Config.precision={self.precision!r}: expected one of {PRECISIONS}")

  @classmethod
  def default(cls, num_heads: int, head_dim: int, kind: str, platform: str = "cuda", dtype="bfloat16",
              f32_stage: bool = True, **overrides) -> "Config":
    """Heuristic starting point for q / KV rows of `dtype`, for the streaming kernel with or without `f32_stage`.

    CUDA: all heads of a query per program (up to 64; M = 64 rows share each staged KV row), 64 keys per stage
    (32 without f32 staging: its value dot's second copy of the rows asks for 332 KiB of shared memory at 64 keys,
    64 heads and D 512 on sm_90; 16 when f32 rows arrive split into bf16 hi + lo: twice the staged bytes, at 32
    keys 260 KiB), 2 stages (1 for the unstaged kernel on split f32 rows: 266 KiB at 2), q resident, head-dim
    chunks of 128 (64 for the staged kernel at precision "split" on bf16 rows).
    ROCm: 16 heads per program as upstream (M = 16, one mma row block), with as many queries per program as it
    takes to reach M = 16 when the model has fewer heads; 16 keys per stage, head-dim chunks of 128. The f32
    accumulator [16, 512] is 32 KiB: 8 warps keep it at 32 registers per lane. Offline compiles at V4-Flash
    shapes (lowering_cases): gfx1151 at 8 warps / 1 stage and precision "bf16": 184–255 VGPRs, no spills
    (README.md has the table).
    CPU (interpret mode): one program holds every head and a few queries, since the interpreter's cost is per
    grid step.
    """
    del kind  # the same tiling serves window, HCA and CSA (their key sets differ only in length)
    if platform not in PLATFORMS:
      raise ValueError(f"platform={platform!r}: expected one of {PLATFORMS}")
    if not is_pow2(num_heads):
      hp = min(next_pow2(num_heads), 16)
    else:
      hp = min(num_heads, 16)
    if platform == "cpu":
      hp = next_pow2(num_heads)
      cfg = cls(heads_per_program=hp, tokens_per_program=max(1, 16 // hp), keys_per_stage=16, num_warps=4,
                num_stages=1)
    else:
      tq = max(1, MIN_DOT // hp)
      big = head_dim >= 256
      if platform == "rocm":
        # gfx1151 has no f32 matrix path; the hi/lo split doubles the dot operands and spills there in the
        # f32-staged CSA kernel at D 512 (4 VGPRs with bf16 q/KV, 29-174 with f32), so ROCm rounds to bf16 once.
        cfg = cls(heads_per_program=hp, tokens_per_program=tq, keys_per_stage=16, num_warps=8 if big else 4,
                  num_stages=1, precision="bf16")
      else:
        # CUDA: every head of a query in one program (each staged row feeds all of them), 64 keys per stage,
        # 2 stages, q resident. One V4-Flash CSA layer, 8192 queries, bf16 q/KV on an H200 (BENCHMARKS.md, the
        # tune_attention sweep): 3.8 ms at precision "bf16" (32 keys: 4.9) and 9.5 ms "split" (32 keys: 13.7).
        hp = min(next_pow2(num_heads), 64)
        split_rows = str(jnp.dtype(dtype)) == "float32" and overrides.get("precision", "split") == "split"
        keys = 16 if split_rows else 64 if f32_stage else 32
        # Unstaged with split f32 rows, two pipeline stages ask for 266 KiB of shared memory at D 512 (sm_90).
        stages = 1 if split_rows and not f32_stage else 2
        # Precision "split" on bf16 rows, staged: head-dim chunks of 64 (the p_lo·V pass's f32 partial is then half
        # the registers): 6.0 ms against 8.1 at chunks of 128 (BENCHMARKS.md, b9ba229). "bf16": 3.75 vs 3.90, noise.
        split_dk64 = f32_stage and not split_rows and overrides.get("precision", "split") == "split" and big
        cfg = cls(heads_per_program=hp, tokens_per_program=max(1, MIN_DOT // hp), keys_per_stage=keys,
                  head_dim_chunk=64 if split_dk64 else 128, q_resident=True, num_warps=8 if big else 4,
                  num_stages=stages)
    return dataclasses.replace(cfg, **overrides)
