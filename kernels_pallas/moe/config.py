"""Tuning knobs of the grouped MoE kernels: one frozen `Config` plus a heuristic default.

Block sizes must be powers of two (Pallas-Triton tensors must have power-of-two sizes) and at least 16 where they
are a dot dimension (Triton's `tl.dot` minimum). Which knob maps to which Lucebox switch
(docs/upstream.md §5):

* `adaptive_tile`  : §5.2 `GGML_CUDA_MMQ_MOE_ADAPTIVE_X` — the row tile follows the mean rows per expert.
* `compact_queue`  : §5.3 — the grid covers only the (expert, row tile) items that hold rows, instead of every
                     expert × the worst-case tile count with an early exit.
* `persistent`     : §5.3 `GGML_CUDA_MMQ_MOE_PERSISTENT` — `programs_per_core × num_cores` programs loop over the
                     work list (`..._PERSISTENT_BLOCKS_PER_CU`).
* `fused_combine`  : §5.4 `DFLASH_MOE_FUSED_COMBINE` — one kernel over tokens weights and sums the routed rows.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kernels_pallas.tiling import MIN_DOT, is_pow2, next_pow2, pow2_divisor  # noqa: F401 (re-exported)

ADAPTIVE_TILES = (16, 32, 64, 128, 256)  # capped at block_m: 256 only where a config allows it


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Config:
  """Static knobs of `api.moe`. Hashable, so it can be a static jit argument.

  block_m       row tile of the grouped kernels (the cap of the adaptive tile when `adaptive_tile`).
  block_n/k     gate/up output tile (over I) and reduction tile (over D).
  down_block_n/k  down-projection output tile (over D) and reduction tile (over I); None = block_n / block_k.
  combine_block_t/d  token and column tile of the fused combine kernel.
  compute_dtype dot operand dtype; None = promote(activation dtype, weight compute dtype): f32 activations with
                bf16 weights run exact f32 dots (IEEE, not TF32), bf16 with bf16 run bf16 dots. Accumulation is f32.
  h_dtype       storage dtype of the SwiGLU output h [rows, I]; None = compute dtype.
  num_cores     SMs/CUs for the persistent grid; None = the default device's `core_count`, else 132 (H200).
  tile_order    "n" or "item": which work index varies fastest in launch order (see _schedule.py). "n" (all N
                tiles of an item run together, so its activation tile is read once) measured 14% faster than
                "item" on the H200 at V4-Flash shapes (8192 tokens: 6.8 vs 8.0 ms; down 2.3 vs 3.2 ms).
  gate_up_kernel "triton" (gate_up.py, every platform) or "wgmma" (gate_up_wgmma.py: Mosaic GPU, sm_90; bf16
                x, W1/W3 bf16 or FP2-MIX, at its own tiling `gate_up_wgmma.default_tiling`: on bf16 a ring).
  down_kernel   "triton" (down.py) or "wgmma" (down_wgmma.py: Mosaic GPU, sm_90; bf16 h, FP3-MIX W2, at
                `down_wgmma.default_tiling`). The combine and the shared expert are Triton's either way.
  """

  block_m: int = 64
  block_n: int = 64
  block_k: int = 64
  down_block_n: int | None = None
  down_block_k: int | None = None
  combine_block_t: int = 16
  combine_block_d: int = 128
  num_warps: int = 4
  num_stages: int = 3
  adaptive_tile: bool = True
  compact_queue: bool = True
  persistent: bool = False
  programs_per_core: int = 4
  num_cores: int | None = None
  fused_combine: bool = True
  compute_dtype: str | None = None
  h_dtype: str | None = None
  tile_order: str = "n"
  gate_up_kernel: str = "triton"
  down_kernel: str = "triton"

  # ---- resolved values -------------------------------------------------------------------------------------
  @property
  def down_bn(self) -> int:
    return self.block_n if self.down_block_n is None else self.down_block_n

  @property
  def down_bk(self) -> int:
    return self.block_k if self.down_block_k is None else self.down_block_k

  def row_tile(self, num_routes: int, num_experts: int) -> int:
    """The row tile used by the routed kernels: `block_m`, or with `adaptive_tile` the smallest of
    16/32/64/128/256 that holds the mean rows per expert (S·K/E), capped at `block_m`."""
    if not self.adaptive_tile:
      return self.block_m
    mean_rows = -(-num_routes // max(num_experts, 1))
    tile = next((t for t in ADAPTIVE_TILES if t >= mean_rows), ADAPTIVE_TILES[-1])
    return max(MIN_DOT, min(tile, self.block_m))

  def programs(self) -> int:
    """Number of programs of the persistent grid."""
    cores = self.num_cores
    if cores is None:
      cores = getattr(jax.devices()[0], "core_count", None) or 132
    return max(1, self.programs_per_core * int(cores))

  def validate(self) -> None:
    """Raises ValueError for block sizes the Triton lowering cannot take."""
    dots = dict(block_m=self.block_m, block_n=self.block_n, block_k=self.block_k,
                down_block_n=self.down_bn, down_block_k=self.down_bk)
    for name, v in dots.items():
      if not is_pow2(v) or v < MIN_DOT:
        raise ValueError(f"Config.{name}={v}: must be a power of two >= {MIN_DOT}")
    for name in ("combine_block_t", "combine_block_d"):
      v = getattr(self, name)
      if not is_pow2(v):
        raise ValueError(f"Config.{name}={v}: must be a power of two")
    if self.tile_order not in ("item", "n"):
      raise ValueError(f"Config.tile_order={self.tile_order!r}: expected 'item' or 'n'")
    if self.gate_up_kernel not in ("triton", "wgmma"):
      raise ValueError(f"Config.gate_up_kernel={self.gate_up_kernel!r}: expected 'triton' or 'wgmma'")
    if self.down_kernel not in ("triton", "wgmma"):
      raise ValueError(f"Config.down_kernel={self.down_kernel!r}: expected 'triton' or 'wgmma'")
    if not is_pow2(self.num_warps):
      raise ValueError(f"Config.num_warps={self.num_warps}: must be a power of two")
    if self.num_stages < 0 or self.programs_per_core < 1:
      raise ValueError(f"Config: num_stages={self.num_stages} must be >= 0, "
                       f"programs_per_core={self.programs_per_core} >= 1")
    for name in ("compute_dtype", "h_dtype"):
      v = getattr(self, name)
      if v is not None and jnp.dtype(v) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16),
                                                jnp.dtype(jnp.float16)):
        raise ValueError(f"Config.{name}={v!r}: expected float32, bfloat16 or float16")

  @classmethod
  def default(cls, *, num_tokens: int, top_k: int, num_experts: int, hidden: int, intermediate: int,
              dtype=jnp.bfloat16, platform: str = "cuda", decodes_weights: bool = False, **overrides) -> "Config":
    """Heuristic starting point, checked on one H200 (jax 0.11.2, bf16, V4-Flash D 4096 / I 2048 / E 256 / top-6,
    uniform routing; experiments/tune_moe.py): 8192 tokens 6.8 ms (≈360 useful TFLOP/s), 2048 tokens 3.9 ms. Of the
    variants tried there, block_m 64, block_n 64, block_k 128 or 32 and 4 stages were slower or no better.

    Row tile: adaptive, capped at 128 (V4-Flash at 8K tokens has ~192 rows per expert). `decodes_weights` (quantized
    experts decoded in the kernel) on CUDA: rows of up to 256 per tile and gate/up tiles 64 wide, because each decoded
    weight tile then serves twice the rows; on one H200 at V4-Flash shapes the rocmfp2_mix MoE took 18.4 instead of
    26.2 ms at 8192 tokens, 59.7 instead of 80.0 ms at 32768 (bf16 weights: 7.5 vs 7.0 ms, so they keep 128; the
    row tile of 512, gate/up tiles 32 or 128 wide, and 4 warps were slower; experiments/results/logs/tune_moe_*).
    f32 dots get smaller
    K tiles (register pressure; the f32 path is the exact-parity path, not the fast one). ROCm gets one pipeline
    stage (Pallas' ROCm default), CUDA three. The rocm configs are checked by the offline lowering only: nothing
    has run on gfx1151 hardware.
    """
    f32 = jnp.dtype(dtype) == jnp.dtype(jnp.float32)
    bk_cap = 32 if f32 else 64
    block_n = max(MIN_DOT, pow2_divisor(intermediate, 128))
    block_k = max(MIN_DOT, pow2_divisor(hidden, bk_cap))
    down_n = max(MIN_DOT, pow2_divisor(hidden, 128))
    down_k = max(MIN_DOT, pow2_divisor(intermediate, bk_cap))
    rows = -(-num_tokens * top_k // max(num_experts, 1))
    block_m = 128 if rows > 64 else 64
    num_warps = 8 if block_m * block_n >= 128 * 128 else 4
    if decodes_weights and platform == "cuda" and not f32 and rows > 128:
      block_m, block_n, num_warps = 256, min(block_n, 64), 8
    if platform == "rocm":
      # gfx1151 (offline lowering check, experiments/results/lowering_gfx1151.md): twice the warps and K tiles
      # of 32 remove every VGPR spill for all formats (the 8/4-warp, k64 configs spill up to 378 VGPRs).
      num_warps, block_k, down_k = 2 * num_warps, min(block_k, 32), min(down_k, 32)
    cfg = cls(block_m=block_m, block_n=block_n, block_k=block_k, down_block_n=down_n, down_block_k=down_k,
              combine_block_t=16, combine_block_d=max(1, pow2_divisor(hidden, 256)),
              num_warps=num_warps, num_stages=1 if platform == "rocm" else 3)
    return dataclasses.replace(cfg, **overrides)
