"""Decoding a quantized expert stack [E, N, K] to a dense one in a Pallas kernel: what the dequantize-then-matmul
path runs before the bf16 MoE kernels when `moe_decode_kernel` is on (ds4jax/moe.py), instead of XLA's canonical
decode. The reference is `formats.get(fmt).dequantize(**storage).astype(dtype)`; the output equals it bit for bit.

    dense = decode_stack(w, jnp.bfloat16)      # w: QuantizedExpertWeights; [E, N, K] bf16

One program decodes a [block_n, block_k] tile of one expert (grid E × N/bn × K/bk).

* ROCmFP2-MIX and ROCmFP3-MIX (the lucebox_mix experts): the K values a code can take in a 16-weight half-block
  (level × scale, `rocmfp_mix.half_block_values`) are made once per half-block and cast to the output dtype; each
  weight then picks one by a select tree over its code bits (`rocmfp_mix.pick`). The canonical decode instead
  chooses level and scale per weight (a where chain over both books, a UE4M3 decode, a multiply), which makes the
  XLA decode ALU-bound on the H200 (experiments/bench_decode.py, BENCHMARKS.md). The tile is handled in a view of the half-block with no
  reshape (Pallas-Triton reshapes can move data between threads): codes and output as [bn, bk/16, 4, 4] (FP2:
  byte a of the half-block, code b of the byte) or [bn, bk/16, 2, 2, 4] (FP3: weight 8p + 4q + b, whose low bits
  sit in byte 2p + q of codes_lo and high bit in bit 4q + b of byte p of codes_hi), all row-major views of the
  storage planes and of the [E, N, K] output.
* Every other format: the grouped kernels' tile loader (the canonical decode on the tile).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from ds4jax.quant import rocmfp2_mix, rocmfp3, rocmfp_mix
from ds4jax.quant.rocmfp_layout import HALF
from kernels_pallas.moe.quantized_weights import QuantizedExpertWeights

MIX_FIXED_LEVEL = {"rocmfp2_mix": rocmfp2_mix.fixed_level, "rocmfp3_mix": rocmfp3.levels}


@dataclasses.dataclass(frozen=True)
class Tiling:
  block_n: int = 64
  block_k: int = 256
  num_warps: int = 8


# Measured on the H200 at V4-Flash's stacks (bench_decode, BENCHMARKS.md): about 64 weights per thread did best.
BEST = {"rocmfp2_mix": Tiling(32, 512, 8), "rocmfp3_mix": Tiling(16, 256, 2)}
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


def _iota(shape, axis):
  return lax.broadcasted_iota(jnp.int32, shape, axis)


def _fp2_bits(codes):
  """codes u8 [bn, h, 4] → the two code bits [bn, h, 4, 4] (byte a, code b at bits 2b, 2b + 1)."""
  c = codes.astype(jnp.int32)[..., None] >> (2 * _iota((1, 1, 1, 4), 3))
  return [(c & 1) != 0, (c & 2) != 0]


def _fp3_bits(codes_lo, codes_hi):
  """codes_lo u8 [bn, h, 2, 2], codes_hi u8 [bn, h, 2] → the three code bits [bn, h, 2, 2, 4]."""
  lo = codes_lo.astype(jnp.int32)[..., None] >> (2 * _iota((1, 1, 1, 1, 4), 4))
  hi_shift = 4 * _iota((1, 1, 1, 2, 4), 3) + _iota((1, 1, 1, 2, 4), 4)
  hi = codes_hi.astype(jnp.int32)[..., None, None] >> hi_shift
  return [(lo & 1) != 0, (lo & 2) != 0, (hi & 1) != 0]


def mix_half_view(fmt_name: str, planes, scales, books, mode, dtype):
  """The decoded weights of MIX storage tiles in the half-block view (module docstring): pure jnp, in-kernel safe.
  `planes`: (codes [.., h, 4],) for FP2, (codes_lo [.., h, 2, 2], codes_hi [.., h, 2]) for FP3; scales [.., h]."""
  values = rocmfp_mix.half_block_values(scales, books, mode, MIX_FIXED_LEVEL[fmt_name], dtype)
  bits = _fp2_bits(*planes) if fmt_name == "rocmfp2_mix" else _fp3_bits(*planes)
  extra = bits[0].ndim - values[0].ndim
  return rocmfp_mix.pick(bits, [v.reshape(*v.shape, *(1,) * extra) for v in values])


def _plane_views(fmt_name: str, storage: dict) -> tuple:
  """The code planes as row-major views in half-blocks: [E, N, K/16, 4] (FP2); [E, N, K/16, 2, 2], [E, N, K/16, 2]."""
  if fmt_name == "rocmfp2_mix":
    c = storage["codes"]
    return (c.reshape(*c.shape[:-1], -1, 4),)
  lo, hi = storage["codes_lo"], storage["codes_hi"]
  return lo.reshape(*lo.shape[:-1], -1, 2, 2), hi.reshape(*hi.shape[:-1], -1, 2)


def _mix_kernel(*refs, fmt_name: str, block_n: int, block_k: int, dtype):
  *plane_refs, scales_ref, books_ref, mode_ref, out_ref = refs
  e, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  n0 = pl.multiple_of(i * block_n, block_n)
  h = block_k // HALF
  h0 = pl.multiple_of(j * h, h)
  rows, halves = pl.ds(n0, block_n), pl.ds(h0, h)
  planes = [plt.load(r.at[e, rows, halves]) for r in plane_refs]
  scales = plt.load(scales_ref.at[e, rows, halves])
  books = plt.load(books_ref.at[e, pl.ds(0, books_ref.shape[1]), pl.ds(0, books_ref.shape[2])])
  tile = mix_half_view(fmt_name, planes, scales, books, mode_ref[e], dtype)
  plt.store(out_ref.at[e, rows, halves], tile)


def _tile_kernel(*refs, load, block_n: int, block_k: int, dtype):
  *w_refs, out_ref = refs
  e, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  n0 = pl.multiple_of(i * block_n, block_n)
  k0 = pl.multiple_of(j * block_k, block_k)
  tile = load(w_refs, e, n0, k0, block_n=block_n, block_k=block_k, dtype=dtype)
  plt.store(out_ref.at[e, pl.ds(n0, block_n), pl.ds(k0, block_k)], tile)


@functools.partial(jax.jit, static_argnames=("dtype", "tiling", "interpret"))
def decode_stack(w: QuantizedExpertWeights, dtype=jnp.bfloat16, *, tiling: Tiling | None = None,
                 interpret: bool = False) -> jax.Array:
  """[E, N, K] of `dtype`, equal bit for bit to the canonical decode of `w` cast to `dtype`."""
  tiling = tiling or default_tiling(w.fmt_name, w.shape)
  bn, bk = tiling.block_n, tiling.block_k
  w.check_blocks(bn, bk, "decode_stack")
  E, N, K = w.shape
  dtype = jnp.dtype(dtype)
  params = plt.CompilerParams(num_warps=tiling.num_warps, num_stages=1)
  grid = (E, N // bn, K // bk)
  if w.fmt_name in MIX_FIXED_LEVEL:
    s = w.storage
    planes = _plane_views(w.fmt_name, s)
    view = (4, 4) if len(planes) == 1 else (2, 2, 4)
    out = pl.pallas_call(
        functools.partial(_mix_kernel, fmt_name=w.fmt_name, block_n=bn, block_k=bk, dtype=dtype),
        out_shape=jax.ShapeDtypeStruct((E, N, K // HALF, *view), dtype),
        grid=grid, interpret=interpret, name=f"moe_decode_{w.fmt_name}", compiler_params=params,
    )(*planes, s["scales"], s["books"], s["mode"])
    return out.reshape(E, N, K)
  return pl.pallas_call(
      functools.partial(_tile_kernel, load=w.loader(), block_n=bn, block_k=bk, dtype=dtype),
      out_shape=jax.ShapeDtypeStruct((E, N, K), dtype), grid=grid, interpret=interpret,
      name=f"moe_decode_{w.fmt_name}", compiler_params=params,
  )(*w.operands)
