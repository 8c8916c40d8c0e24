"""Decoding a quantized expert stack [E, N, K] to a dense one in a Pallas kernel: what the dequantize-then-matmul
path runs before the bf16 MoE kernels when `moe_decode_kernel` is on (ds4jax/moe.py), instead of XLA's canonical
decode. The reference is `formats.get(fmt).dequantize(**storage).astype(dtype)`; the output equals it bit for bit.

    dense = decode_stack(w, jnp.bfloat16)      # w: QuantizedExpertWeights; [E, N, K] bf16

One program decodes a [block_n, block_k] tile of one expert (grid E × N/bn × K/bk).

* ROCmFP2-MIX and ROCmFP3-MIX (the lucebox_mix experts): the format's `dequantize_halves`. The values a code can
  take in a 16-weight half-block (level × scale) are made once per half-block and cast to the output dtype, and each
  weight picks one by a select tree over its code bits. The canonical decode instead chooses level and scale per
  weight (a where chain over both books, a UE4M3 decode, a multiply), which leaves XLA's decode ALU-bound on the H200
  (experiments/bench_decode.py, BENCHMARKS.md). Planes and output are handled in the format's half-block view (row-
  major views of the storage and of [E, N, K]), so the kernel reshapes nothing.
* Every other format: `dequantize_tiles`, the grouped kernels' tile loader alone (the canonical decode on a tile).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from ds4jax.quant.rocmfp_layout import HALF
from kernels_pallas.moe.quantized_weights import (HALF_BLOCK_FORMATS, QuantizedExpertWeights, dequantize_tiles,
                                                  half_views)

@dataclasses.dataclass(frozen=True)
class Tiling:
  block_n: int = 64
  block_k: int = 256
  num_warps: int = 8


# Measured on the H200 at V4-Flash's stacks (bench_decode, BENCHMARKS.md): about 64 weights per thread did best, and
# of those tiles the narrowest (8 rows of 512) for both formats.
BEST = {"rocmfp2_mix": Tiling(8, 512, 2), "rocmfp3_mix": Tiling(8, 512, 2)}
WEIGHTS_PER_WARP = 2048


def _pow2_divisor(n: int, cap: int) -> int:
  """The largest power of two ≤ cap that divides n."""
  return min(n & -n, cap)


def default_tiling(fmt_name: str, shape) -> Tiling:
  """The measured tiles (`BEST`; the tile loader's 64 × 256, 8 warps for other formats), cut to what divides a
  small stack, with a warp per 2048 weights of a smaller tile."""
  _, N, K = shape
  best = BEST.get(fmt_name, Tiling())
  bn, bk = _pow2_divisor(N, best.block_n), _pow2_divisor(K, best.block_k)
  return Tiling(bn, bk, max(1, min(best.num_warps, bn * bk // WEIGHTS_PER_WARP)))


def _mix_kernel(*refs, fmt_name: str, block_n: int, block_k: int, dtype):
  fmt = HALF_BLOCK_FORMATS[fmt_name]
  *plane_refs, scales_ref, books_ref, mode_ref, out_ref = refs
  e, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  n0 = pl.multiple_of(i * block_n, block_n)
  h = block_k // HALF
  h0 = pl.multiple_of(j * h, h)
  rows, halves = pl.ds(n0, block_n), pl.ds(h0, h)
  planes = [plt.load(r.at[e, rows, halves]) for r in plane_refs]
  scales = plt.load(scales_ref.at[e, rows, halves])
  books = plt.load(books_ref.at[e, pl.ds(0, books_ref.shape[1]), pl.ds(0, books_ref.shape[2])])
  plt.store(out_ref.at[e, rows, halves], fmt.dequantize_halves(*planes, scales, books, mode_ref[e], dtype))


@functools.partial(jax.jit, static_argnames=("dtype", "tiling", "interpret"))
def decode_stack(w: QuantizedExpertWeights, dtype=jnp.bfloat16, *, tiling: Tiling | None = None,
                 interpret: bool = False) -> jax.Array:
  """[E, N, K] of `dtype`, equal bit for bit to the canonical decode of `w` cast to `dtype`."""
  tiling = tiling or default_tiling(w.fmt_name, w.shape)
  bn, bk = tiling.block_n, tiling.block_k
  w.check_blocks(bn, bk, "decode_stack")
  dtype = jnp.dtype(dtype)
  if w.fmt_name not in HALF_BLOCK_FORMATS:
    return dequantize_tiles(w, block_n=bn, block_k=bk, dtype=dtype, num_warps=tiling.num_warps, interpret=interpret)
  E, N, K = w.shape
  fmt = HALF_BLOCK_FORMATS[w.fmt_name]
  s = half_views(w.fmt_name, w.storage)
  out = pl.pallas_call(
      functools.partial(_mix_kernel, fmt_name=w.fmt_name, block_n=bn, block_k=bk, dtype=dtype),
      out_shape=jax.ShapeDtypeStruct((E, N, K // HALF, *fmt.HALF_WEIGHTS), dtype), grid=(E, N // bn, K // bk),
      interpret=interpret, name=f"moe_decode_{w.fmt_name}",
      compiler_params=plt.CompilerParams(num_warps=tiling.num_warps, num_stages=1),
  )(*(s[n] for n in fmt.HALF_VIEWS), s["scales"], s["books"], s["mode"])
  return out.reshape(E, N, K)
