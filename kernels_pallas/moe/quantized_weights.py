"""Quantized expert stacks as tile loaders for the grouped kernels: every ds4jax.quant format except bf16.

    w = QuantizedExpertWeights.from_storage("rocmfp2_mix", arrays, (E, N, K))   # arrays: formats.get(..).quantize(..)
    y = moe(x, rw, ids, w1, w2, w3, ...)        # w1/w2/w3 may each be quantized, dense, or a float array
    dense = dequantize_to_dense(w)              # the "dequantize-then-matmul" path: bf16 DenseWeights, same values

In the kernel, `load(refs, e, n0, k0, block_n=bn, block_k=bk, dtype)` loads the [bn, bk] tile's slice of EVERY
storage array of expert e (codes / scales planes at their packing, the expert's books and mode) and decodes them: the
MIX formats by their `dequantize_halves` (the same products as the canonical decode, each half-block's made once),
the others by the format module's canonical `dequantize` (the function the reference uses). Either way the kernel's
weights are bit-identical to `formats.get(fmt).dequantize(**arrays)` (`dequantize_tiles` below runs the loader
alone, for that check).

Tile geometry, per storage array of an [E, N, K] stack (tile = rows [n0, n0+bn), columns [k0, k0+bk)):

| format        | array               | stored as                    | tile loaded                                   |
|---------------|---------------------|------------------------------|-----------------------------------------------|
| fp8_e4m3      | weight              | e4m3 [E, N, K]               | [bn, bk]                                      |
|               | scale               | u8 [E, ⌈N/128⌉, ⌈K/128⌉]     | [⌈bn/128⌉, ⌈bk/128⌉] at (n0/128, k0/128)      |
| fp4_e2m1      | packed              | i8 (or u8) [E, N, K/2]       | [bn, bk/2]                                    |
|               | scale               | u8 [E, N, K/32]              | [bn, bk/32]                                   |
| rocmfp2(_mix) | codes               | u8 [E, N, K/4]               | [bn, bk/4]                                    |
| rocmfp3(_mix) | codes_lo / codes_hi | u8 [E, N, K/4] / [E, N, K/8] | [bn, bk/4] / [bn, bk/8]                       |
| rocmfp*       | scales              | u8 [E, N, K/16]              | [bn, bk/16]                                   |
| *_mix         | books               | bf16 [E, 2, L]               | [2, L] (L = 4 / 8 levels)                     |
|               | mode                | u8 [E]                       | a scalar                                      |

Block rules (checked when the kernels are built, `check_blocks`; Config already makes blocks powers of two ≥ 16):
* fp4_e2m1 and the ROCmFP formats: block_k a multiple of 32 (the upstream block: one fp4 scale, two ROCmFP half-block
  scales, whole bytes of every code plane); any block_n.
* fp8_e4m3 (128×128 UE8M0 blocks): block_n and block_k each either divide 128 or are multiples of 128 — for powers of
  two always true. A tile then lies inside one scale block along each axis whose block is ≤ 128, and covers whole
  scale blocks along an axis whose block is > 128. The loader expands the loaded scales to a [bn/g, bk/g] grid of
  g × g blocks, g = min(bn, bk, 128), and calls `fp8_e4m3.dequantize(tile, grid, block=g)`: every weight meets its own
  128×128 block's byte, by broadcasts and reshapes only (no slices, no gathers). Partial last scale blocks
  (N or K not a multiple of 128) need nothing special: tiles never straddle them.
* K a multiple of block_k (as for dense weights), and K a multiple of the format's `in_multiple` (32; 128 for
  rocmfp2_mix: upstream's rule, so its down projection needs I a multiple of 128).

`compute_dtype` is bf16: with bf16 activations the dots run in bf16. fp8/fp4/ROCmFP2/ROCmFP3 weights (at most 4
significant bits: a ≤ 4-bit level times a power of two, or a ≤ 2-bit level times a 4-bit UE4M3 scale) are exact in
bf16 (`BF16_EXACT`); MIX weights (BF16 level × UE4M3 scale, up to 12 significant bits) are rounded once to bf16
there. With f32 activations (or Config.compute_dtype="float32") the kernel multiplies the exact f32 weights — the
parity path.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from ds4jax.quant import formats, fp8_e4m3, rocmfp2_mix, rocmfp3_mix
from kernels_pallas.moe.weights import DenseWeights, ExpertWeights, TileLoader

F32 = jnp.float32

# How each storage array is tiled: ("plane", v) = [E, N, K/v] sliced like the weight with v values per element
# along K; ("fp8_scale",) = [E, ⌈N/128⌉, ⌈K/128⌉]; ("books",) = [E, 2, L]; ("mode",) = [E].
_PLANE = "plane"
TILING: dict[str, dict[str, tuple]] = {
    "fp8_e4m3": {"weight": (_PLANE, 1), "scale": ("fp8_scale",)},
    "fp4_e2m1": {"packed": (_PLANE, 2), "scale": (_PLANE, 32)},
    "rocmfp2": {"codes": (_PLANE, 4), "scales": (_PLANE, 16)},
    "rocmfp3": {"codes_lo": (_PLANE, 4), "codes_hi": (_PLANE, 8), "scales": (_PLANE, 16)},
    "rocmfp2_mix": {"codes": (_PLANE, 4), "scales": (_PLANE, 16), "books": ("books",), "mode": ("mode",)},
    "rocmfp3_mix": {"codes_lo": (_PLANE, 4), "codes_hi": (_PLANE, 8), "scales": (_PLANE, 16), "books": ("books",),
                    "mode": ("mode",)},
}
QUANTIZED_FORMATS = tuple(TILING)
K_BLOCK = {name: 1 if name == "fp8_e4m3" else 32 for name in TILING}  # block_k must be a multiple of this
BF16_EXACT = {name: not name.endswith("_mix") for name in TILING}  # dequantized values all exact in bf16


# Formats with a half-block decode (`dequantize_halves`, the canonical decode's bits with each half-block's values
# made once): the modules, which also define the half-block views of their planes.
HALF_BLOCK_FORMATS = {"rocmfp2_mix": rocmfp2_mix, "rocmfp3_mix": rocmfp3_mix}


def half_views(fmt_name: str, storage: dict) -> dict:
  """The code planes of `storage` (a stack's or a tile's) as the format's half-block views (row-major reshapes)."""
  views = HALF_BLOCK_FORMATS[fmt_name].HALF_VIEWS
  return {n: a.reshape(*a.shape[:-1], -1, *views[n]) if n in views else a for n, a in storage.items()}


def _is_pow2(n: int) -> bool:
  return isinstance(n, int) and n > 0 and n & (n - 1) == 0


def _repeat_axis0(x, times: int):
  """[r, c] → [r · times, c], each row repeated (broadcast + reshape: lowers in Pallas-Triton)."""
  if times == 1:
    return x
  r, c = x.shape
  return jnp.broadcast_to(x[:, None, :], (r, times, c)).reshape(r * times, c)


def _repeat_axis1(x, times: int):
  if times == 1:
    return x
  r, c = x.shape
  return jnp.broadcast_to(x[:, :, None], (r, c, times)).reshape(r, c * times)


def fp8_scale_grid(scale_tile, block_n: int, block_k: int):
  """The loaded fp8 scale bytes [max(1, bn/128), max(1, bk/128)] → [bn/g, bk/g] bytes of g × g blocks,
  g = min(bn, bk, 128): the scale grid `fp8_e4m3.dequantize(tile, grid, block=g)` needs for a [bn, bk] tile."""
  g = min(block_n, block_k, fp8_e4m3.BLOCK)
  rn, rk = scale_tile.shape
  out = _repeat_axis0(scale_tile, (block_n // g) // rn)
  return _repeat_axis1(out, (block_k // g) // rk), g


def load_tiles(fmt_name: str, refs, expert, n_start, k_start, *, block_n: int, block_k: int) -> dict[str, Any]:
  """The raw storage tiles of expert `expert` for weight rows [n0, n0+bn) and columns [k0, k0+bk), by array name
  (in-kernel: `plt.load` on the refs of `QuantizedExpertWeights.operands`)."""
  fmt = formats.get(fmt_name)
  tiles = {}
  for name, ref in zip(fmt.arrays, refs):
    kind = TILING[fmt_name][name]
    if kind[0] == _PLANE:
      v = kind[1]
      k0 = pl.multiple_of(k_start // v, max(block_k // v, 1))
      tiles[name] = plt.load(ref.at[expert, pl.ds(n_start, block_n), pl.ds(k0, block_k // v)])
    elif kind[0] == "fp8_scale":
      rn, rk = max(1, block_n // fp8_e4m3.BLOCK), max(1, block_k // fp8_e4m3.BLOCK)
      n0, k0 = n_start // fp8_e4m3.BLOCK, k_start // fp8_e4m3.BLOCK
      tiles[name] = plt.load(ref.at[expert, pl.ds(n0, rn), pl.ds(k0, rk)])
    elif kind[0] == "books":
      tiles[name] = plt.load(ref.at[expert, pl.ds(0, ref.shape[1]), pl.ds(0, ref.shape[2])])
    else:  # mode: one byte per expert, a scalar
      tiles[name] = ref[expert]
  return tiles


def dequantize_tile(fmt_name: str, tiles: dict[str, Any], *, block_n: int, block_k: int, dtype=F32):
  """[bn, bk] of `dtype` from the storage tiles (pure jnp; in-kernel safe): the MIX formats by their half-block
  decode (`dequantize_halves`: each half-block's values made once), the others by the format's canonical
  dequantize. Both give the canonical decode's bits."""
  fmt = formats.get(fmt_name)
  if fmt_name == "fp8_e4m3":
    grid, g = fp8_scale_grid(tiles["scale"], block_n, block_k)
    return fp8_e4m3.dequantize(tiles["weight"], grid, block=g).astype(dtype)
  if fmt_name in HALF_BLOCK_FORMATS:
    return HALF_BLOCK_FORMATS[fmt_name].dequantize_halves(**half_views(fmt_name, tiles), dtype=dtype).reshape(
        block_n, block_k)
  return fmt.dequantize(**tiles).astype(dtype)


def load_quantized_tile(refs, expert, n_start, k_start, *, block_n: int, block_k: int, dtype, fmt_name: str):
  """Tile loader of `QuantizedExpertWeights` (see the module docstring): [bn, bk] of `dtype`."""
  tiles = load_tiles(fmt_name, refs, expert, n_start, k_start, block_n=block_n, block_k=block_k)
  return dequantize_tile(fmt_name, tiles, block_n=block_n, block_k=block_k, dtype=dtype)


@functools.cache
def _loader(fmt_name: str) -> TileLoader:
  return functools.partial(load_quantized_tile, fmt_name=fmt_name)


def _shape_dtype(a):
  return tuple(int(d) for d in np.shape(a)), np.dtype(a.dtype)


def check_storage(fmt_name: str, arrays: dict, shape) -> tuple[int, int, int]:
  """Raises ValueError naming the format, the logical shape and the array unless `arrays` is valid storage of an
  expert stack [E, N, K] in `fmt_name` (array names, shapes and dtypes; byte values are `formats.get(..).check`'s
  job, on the host). Works on arrays and ShapeDtypeStructs alike."""
  if fmt_name == "bf16":
    raise ValueError("format 'bf16' is not quantized: pass the bf16 stack itself or DenseWeights(w) "
                     "(expert_weights('bf16', ...) does that)")
  if fmt_name not in TILING:
    raise ValueError(f"unknown quantized weight format {fmt_name!r}; valid formats: "
                     f"{', '.join(QUANTIZED_FORMATS)} (and 'bf16' through DenseWeights)")
  fmt = formats.get(fmt_name)
  shape = tuple(shape)
  if len(shape) != 3 or not all(isinstance(d, (int, np.integer)) and d > 0 for d in shape):
    raise ValueError(f"{fmt_name}: logical shape must be a positive [E, N, K] expert stack, got {shape}")
  shape = tuple(int(d) for d in shape)
  try:
    layout = fmt.storage(shape)
  except ValueError as e:
    raise ValueError(f"{fmt_name} expert stack {shape}: {e}") from None
  if not isinstance(arrays, dict) or set(arrays) != set(fmt.arrays):
    got = sorted(arrays) if isinstance(arrays, dict) else type(arrays).__name__
    raise ValueError(f"{fmt_name} expert stack {shape} takes storage arrays {list(fmt.arrays)}, got {got}")
  for name in fmt.arrays:
    want_shape, want_dtype = layout[name]
    got_shape, got_dtype = _shape_dtype(arrays[name])
    ok_dtypes = (want_dtype, np.dtype(np.uint8)) if (fmt_name, name) == ("fp4_e2m1", "packed") else (want_dtype,)
    if got_shape != tuple(want_shape) or got_dtype not in ok_dtypes:
      raise ValueError(f"{fmt_name} expert stack {shape}: array {name!r} must be {want_dtype.name} "
                       f"{tuple(want_shape)}, got {got_dtype.name} {got_shape}")
  return shape


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedExpertWeights:
  """An expert stack [E, N, K] ([out, in] per expert) stored in a ds4jax.quant format, dequantized tile by tile in
  the grouped kernels. `arrays` are the format's storage arrays in `formats.get(fmt_name).arrays` order."""

  arrays: tuple[jax.Array, ...]
  fmt_name: str = dataclasses.field(metadata=dict(static=True))
  logical_shape: tuple[int, int, int] = dataclasses.field(metadata=dict(static=True))

  @classmethod
  def from_storage(cls, fmt_name: str, arrays: dict, shape) -> "QuantizedExpertWeights":
    """From named storage arrays (`formats.get(fmt_name).quantize(w)`, `policy.random_storage`, a checkpoint);
    validates names, shapes and dtypes against the logical [E, N, K] (ValueError)."""
    shape = check_storage(fmt_name, arrays, shape)
    names = formats.get(fmt_name).arrays
    as_array = lambda a: a if isinstance(a, (jax.Array, jax.ShapeDtypeStruct)) else jnp.asarray(a)
    return cls(tuple(as_array(arrays[n]) for n in names), fmt_name, shape)

  @property
  def shape(self) -> tuple[int, int, int]:
    return self.logical_shape

  @property
  def operands(self) -> tuple[jax.Array, ...]:
    return self.arrays

  @property
  def compute_dtype(self):
    return jnp.dtype(jnp.bfloat16)

  @property
  def k_multiple(self) -> int:
    return K_BLOCK[self.fmt_name]

  @property
  def storage(self) -> dict[str, jax.Array]:
    return dict(zip(formats.get(self.fmt_name).arrays, self.arrays))

  def loader(self) -> TileLoader:
    return _loader(self.fmt_name)

  def check_blocks(self, block_n: int, block_k: int, what: str = "") -> None:
    """Raises ValueError naming format, dims and blocks unless the kernels can tile this stack by [bn, bk]."""
    E, N, K = self.logical_shape
    where = f"{what + ': ' if what else ''}{self.fmt_name} expert stack [E, N, K] = {list(self.logical_shape)}"
    if not (_is_pow2(block_n) and _is_pow2(block_k)):
      raise ValueError(f"{where}: block_n={block_n} and block_k={block_k} must be powers of two")
    if block_k % K_BLOCK[self.fmt_name]:
      raise ValueError(f"{where}: block_k={block_k} must be a multiple of the format's "
                       f"{K_BLOCK[self.fmt_name]}-value block")
    if self.fmt_name == "fp8_e4m3":
      for nm, b in (("block_n", block_n), ("block_k", block_k)):
        if fp8_e4m3.BLOCK % b and b % fp8_e4m3.BLOCK:
          raise ValueError(f"{where}: {nm}={b} must divide or be a multiple of the {fp8_e4m3.BLOCK}×{fp8_e4m3.BLOCK} "
                           "scale block")
    if K % block_k:
      raise ValueError(f"{where}: K={K} is not a multiple of block_k={block_k}")
    if N % block_n:
      raise ValueError(f"{where}: N={N} is not a multiple of block_n={block_n}")

  def dequantize(self) -> jax.Array:
    """f32 [E, N, K] by the format's canonical dequantize (the reference's weights)."""
    return formats.get(self.fmt_name).dequantize(**self.storage)


def expert_weights(fmt_name: str, arrays: dict, shape) -> ExpertWeights:
  """Any registry format → kernel weights: `DenseWeights` for 'bf16' ({"weight": bf16 [E, N, K]}), else
  `QuantizedExpertWeights.from_storage`."""
  if fmt_name == "bf16":
    fmt = formats.get("bf16")
    if not isinstance(arrays, dict) or set(arrays) != set(fmt.arrays):
      raise ValueError(f"bf16 expert stack takes storage arrays ['weight'], got {arrays!r:.80}")
    got = _shape_dtype(arrays["weight"])
    if got != (tuple(shape), np.dtype(jnp.bfloat16)):
      raise ValueError(f"bf16 expert stack {tuple(shape)}: array 'weight' must be bfloat16 {tuple(shape)}, "
                       f"got {got[1].name} {got[0]}")
    return DenseWeights(jnp.asarray(arrays["weight"]))
  return QuantizedExpertWeights.from_storage(fmt_name, arrays, shape)


@functools.partial(jax.jit, static_argnames=("dtype",))
def _dequantize_dense(w, dtype):
  return DenseWeights(w.dequantize().astype(dtype))


def dequantize_to_dense(w: ExpertWeights, dtype=jnp.bfloat16) -> DenseWeights:
  """The dequantize-then-matmul path: the whole stack through the canonical dequantize in XLA, cast to `dtype`
  (bf16 by default: exact for all formats but the MIX ones, see the module docstring; float32 is always exact),
  as `DenseWeights` for the grouped kernels. Costs an [E, N, K] `dtype` copy in HBM."""
  return _dequantize_dense(w, jnp.dtype(dtype).name)


# ---- the loader alone: decoding a whole stack tile by tile -----------------------------------------------------

def _dequantize_tiles_kernel(*refs, load, block_n: int, block_k: int, dtype):
  *w_refs, out_ref = refs
  e, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  n0 = pl.multiple_of(i * block_n, block_n)
  k0 = pl.multiple_of(j * block_k, block_k)
  tile = load(w_refs, e, n0, k0, block_n=block_n, block_k=block_k, dtype=dtype)
  plt.store(out_ref.at[e, pl.ds(n0, block_n), pl.ds(k0, block_k)], tile)


@functools.partial(jax.jit, static_argnames=("block_n", "block_k", "dtype", "num_warps", "interpret"))
def dequantize_tiles(w: ExpertWeights, *, block_n: int, block_k: int, dtype=F32, num_warps: int = 4,
                     interpret: bool = False) -> jax.Array:
  """[E, N, K] of `dtype` built by the kernel-side tile loader, one [bn, bk] tile per program (grid
  (E, N/bn, K/bk)): must equal `w.dequantize().astype(dtype)` bit for bit. (A Pallas alternative to the XLA decode
  of `dequantize_to_dense`, timed by experiments/bench_decode.py.)"""
  if hasattr(w, "check_blocks"):
    w.check_blocks(block_n, block_k, "dequantize_tiles")
  E, N, K = w.shape
  dtype = jnp.dtype(dtype)
  kernel = functools.partial(_dequantize_tiles_kernel, load=w.loader(), block_n=block_n, block_k=block_k,
                             dtype=dtype)
  return pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((E, N, K), dtype), grid=(E, N // block_n, K // block_k),
      interpret=interpret, name="moe_dequantize_tiles",
      compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
  )(*w.operands)
