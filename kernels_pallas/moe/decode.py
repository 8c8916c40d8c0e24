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
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from ds4jax.quant import bitplanes, rocmfp2_mix, rocmfp3, rocmfp_mix
from ds4jax.quant.rocmfp_layout import HALF
from kernels_pallas.moe.gate_up_wgmma import RING_BOX, tile_by_step
from kernels_pallas.tiling import default_platform
from kernels_pallas.moe.quantized_weights import (HALF_BLOCK_FORMATS, QuantizedExpertWeights, dequantize_tiles,
                                                  half_views)

@dataclasses.dataclass(frozen=True)
class Tiling:
  """select "tree": each weight picks its half-block's value by a select tree over its code bits (the format's
  dequantize_halves); "prmt4" (CUDA, compiled; MIX formats to bf16): the half-block's bf16 values packed 2 per
  32-bit word and picked by byte permutes, one inline asm per code byte (two permutes for its 4 weights, selectors
  made in the asm; `prmt_codes`). One asm per weight ("prmt") was never faster on the H200 and was removed."""
  block_n: int = 64
  block_k: int = 256
  num_warps: int = 8
  select: str = "tree"


# Measured on the H200 at V4-Flash's stacks (bench_decode, BENCHMARKS.md): about 64 weights per thread did best, and
# of those tiles the narrowest (8 rows of 512) for both formats.
BEST = {"rocmfp2_mix": Tiling(8, 512, 2), "rocmfp3_mix": Tiling(8, 512, 2)}
# The byte-permute pick (CUDA), measured on the H200 at e1e8cbf: 8 × 1024 tiles, 4 warps, for both formats
# (gate/up 1.66 vs 1.83 ms a stack with the tree at its best tiles; down 2.05 vs 2.68).
BEST_PRMT4 = Tiling(8, 1024, 4, select="prmt4")
WEIGHTS_PER_WARP = 2048


def _pow2_divisor(n: int, cap: int) -> int:
  """The largest power of two ≤ cap that divides n."""
  return min(n & -n, cap)


def default_tiling(fmt_name: str, shape, select: str = "tree") -> Tiling:
  """The measured tiles (`BEST`; the tile loader's 64 × 256, 8 warps for other formats), cut to what divides a
  small stack, with a warp per 2048 weights of a smaller tile."""
  _, N, K = shape
  best = BEST_PRMT4 if select == "prmt4" else BEST.get(fmt_name, Tiling())
  bn, bk = _pow2_divisor(N, best.block_n), _pow2_divisor(K, best.block_k)
  return Tiling(bn, bk, max(1, min(best.num_warps, bn * bk // WEIGHTS_PER_WARP)), select=select)


def default_select(fmt_name: str, dtype, interpret: bool) -> str:
  """"prmt4" where it runs (a MIX format to bf16, a compiled CUDA kernel; measured faster on the H200,
  BENCHMARKS.md), else "tree"."""
  fast = (fmt_name in HALF_BLOCK_FORMATS and jnp.dtype(dtype) == jnp.bfloat16 and not interpret
          and default_platform() == "cuda")
  return "prmt4" if fast else "tree"


def value_words(values) -> list[jax.Array]:
  """A half-block's K bf16 values → K/2 int32 words, value 2j in bits 0–15 of word j and 2j + 1 in bits 16–31 (the
  byte table a `prmt` indexes: value v in table bytes 2v, 2v + 1, counting from word 0)."""
  bits = [lax.bitcast_convert_type(v, jnp.uint16).astype(jnp.uint32) for v in values]
  return [lax.bitcast_convert_type(lo | (hi << 16), jnp.int32) for lo, hi in zip(bits[0::2], bits[1::2])]


# select "prmt4", the 4 weights of one code byte per asm (Triton hands it 4 neighbours along the last axis, which are
# one byte's): two selectors from the byte's nibbles (codes c0 | c1 << 2 → bytes 0x22·c + 0x10 of the selector: the
# permute copies table bytes 2c, 2c + 1, value c, to a result half), two permutes. ROCmFP3 also permutes values 4–7
# and then picks each weight's half by its high bit.
def _pair_selector(x: str, nibble: int) -> str:
  take = f"and.b32 x, {x}, 15; " if nibble == 0 else f"bfe.u32 x, {x}, 4, 4; "
  return take + "shl.b32 y, x, 6; or.b32 x, x, y; and.b32 x, x, 771; mad.lo.u32 x, x, 34, 4112; "


_PICK4x4 = ("{ .reg .b32 x, y; " + _pair_selector("$2", 0) + "prmt.b32 $0, $6, $10, x; "
            + _pair_selector("$2", 1) + "prmt.b32 $1, $6, $10, x; }")


def _high_pick(nibble: int, out: str) -> str:  # result bytes 0–1 from q (values 4–7) if bit 2n, 2–3 if bit 2n + 1
  shift = "mov.b32 y, $6; " if nibble == 0 else "shr.b32 y, $6, 2; "
  return (shift + "and.b32 m, y, 1; and.b32 y, y, 2; mul.lo.u32 m, m, 68; mad.lo.u32 m, y, 8704, m; "
          f"add.u32 m, m, 12816; prmt.b32 {out}, p, q, m; ")


_PICK8x4 = ("{ .reg .b32 x, y, p, q, m; "
            + "".join(_pair_selector("$2", n) + "prmt.b32 p, $10, $14, x; prmt.b32 q, $18, $22, x; "
                      + _high_pick(n, f"${n}") for n in range(2)) + "}")


def prmt_inputs(fmt_name: str, planes, scales, books, mode) -> tuple[str, list[jax.Array]]:
  """The inline PTX and its operands that make dequantize_halves(..., bf16) of a MIX format by byte permutes. Each
  operand holds one value per weight, a code byte's repeated over its 4 weights (the asm takes them together): the
  code byte (the asm makes the selectors), for ROCmFP3 the byte's 4 high bits, then the value words (the same
  values, made once per half-block as dequantize_halves makes them). Pure jnp; `prmt_codes` runs it (CUDA), tests
  emulate it."""
  levels = rocmfp2_mix.fixed_level if fmt_name == "rocmfp2_mix" else rocmfp3.levels  # as dequantize_halves
  words = value_words(rocmfp_mix.half_block_values(scales, books, mode, levels, jnp.bfloat16))
  codes = planes[0].astype(jnp.int32)[..., None]
  shape = (*planes[0].shape, 4)
  full = lambda a: jnp.broadcast_to(a.reshape(*a.shape, *(1,) * (len(shape) - a.ndim)), shape)
  if fmt_name == "rocmfp2_mix":
    return _PICK4x4, [full(codes), *(full(w) for w in words)]
  high = (planes[1].astype(jnp.int32)[..., None] >> (4 * bitplanes.iota_last(2, planes[0].ndim))) & 15
  return _PICK8x4, [full(codes), full(high[..., None]), *(full(w) for w in words)]


def prmt_codes(fmt_name: str, planes, scales, books, mode) -> jax.Array:
  """dequantize_halves(..., bf16) by byte permutes (inline PTX: compiled CUDA kernels only). Each asm takes one code
  byte's 4 weights (pack=4) and returns their bf16 values in two registers."""
  asm, ins = prmt_inputs(fmt_name, planes, scales, books, mode)
  (out,) = plt.elementwise_inline_asm(asm, args=ins, constraints="=r,=r" + ",r" * (len(ins) * 4), pack=4,
                                      result_shape_dtypes=[jax.ShapeDtypeStruct(ins[0].shape, jnp.bfloat16)])
  return out


def _mix_kernel(*refs, fmt_name: str, block_n: int, block_k: int, dtype, select: str, ring: bool):
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
  if select == "prmt4":
    w = prmt_codes(fmt_name, planes, scales, books, mode_ref[e])
  else:
    w = fmt.dequantize_halves(*planes, scales, books, mode_ref[e], dtype)
  if ring:  # the tile's rows of RING_BOX-wide steps, each into its box: [steps, block_n, RING_BOX]
    steps = block_k // RING_BOX
    w = w.reshape(block_n, steps, RING_BOX).transpose(1, 0, 2)
    plt.store(out_ref.at[e, n0 // RING_BOX, pl.ds(j * steps, steps), pl.ds(n0 % RING_BOX, block_n)], w)
  else:
    plt.store(out_ref.at[e, rows, halves], w)


@functools.partial(jax.jit, static_argnames=("dtype", "tiling", "ring_layout", "interpret"))
def decode_stack(w: QuantizedExpertWeights, dtype=jnp.bfloat16, *, tiling: Tiling | None = None,
                 ring_layout: bool = False, interpret: bool = False) -> jax.Array:
  """[E, N, K] of `dtype`, equal bit for bit to the canonical decode of `w` cast to `dtype`. With `ring_layout`
  written as gate_up_wgmma.ring_layout of it, [E, N/64, K, 64]: each 64 × 64 step box contiguous, as the Mosaic
  gate/up's rings read W1 / W3 fastest (BENCHMARKS.md, session 65). The MIX kernel writes the boxes itself; the
  other formats' decode is followed by XLA's relayout (one more copy of the stack)."""
  tiling = tiling or default_tiling(w.fmt_name, w.shape, default_select(w.fmt_name, dtype, interpret))
  bn, bk = tiling.block_n, tiling.block_k
  E, N, K = w.shape
  mix = w.fmt_name in HALF_BLOCK_FORMATS
  if ring_layout and (N % RING_BOX or K % RING_BOX or (mix and (RING_BOX % bn or bk % RING_BOX))):
    raise ValueError(f"decode_stack: ring_layout takes N={N} and K={K} multiples of {RING_BOX}, and for a MIX "
                     f"format tiles of block_n dividing {RING_BOX} and block_k a multiple of it; got {w.fmt_name}, "
                     f"block_n={bn}, block_k={bk}")
  if tiling.select not in ("tree", "prmt4"):
    raise ValueError(f"decode_stack: select must be 'tree' or 'prmt4', got {tiling.select!r}")
  if tiling.select != "tree" and (not mix or jnp.dtype(dtype) != jnp.bfloat16
                                  or interpret):
    raise ValueError(f"decode_stack: select={tiling.select!r} runs inline PTX (compiled CUDA kernels) on the MIX "
                     f"formats to bfloat16; got {w.fmt_name} to {jnp.dtype(dtype).name}, interpret={interpret}")
  w.check_blocks(bn, bk, "decode_stack")
  dtype = jnp.dtype(dtype)
  if not mix:
    out = dequantize_tiles(w, block_n=bn, block_k=bk, dtype=dtype, num_warps=tiling.num_warps, interpret=interpret)
    return tile_by_step(out, RING_BOX, RING_BOX) if ring_layout else out
  fmt = HALF_BLOCK_FORMATS[w.fmt_name]
  s = half_views(w.fmt_name, w.storage)
  out_shape = (E, N // RING_BOX, K // RING_BOX, RING_BOX, RING_BOX) if ring_layout else (E, N, K // HALF,
                                                                                          *fmt.HALF_WEIGHTS)
  out = pl.pallas_call(
      functools.partial(_mix_kernel, fmt_name=w.fmt_name, block_n=bn, block_k=bk, dtype=dtype,
                        select=tiling.select, ring=ring_layout),
      out_shape=jax.ShapeDtypeStruct(out_shape, dtype), grid=(E, N // bn, K // bk),
      interpret=interpret, name=f"moe_decode_{w.fmt_name}",
      compiler_params=plt.CompilerParams(num_warps=tiling.num_warps, num_stages=1),
  )(*(s[n] for n in fmt.HALF_VIEWS), s["scales"], s["books"], s["mode"])
  return out.reshape(E, N // RING_BOX, K, RING_BOX) if ring_layout else out.reshape(E, N, K)
