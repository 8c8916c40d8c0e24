"""Expert weight formats as seen by the grouped kernels: a stack [E, N, K] read one [block_n, block_k] tile at a time.

The kernels never index a weight array directly. They call the format's *tile loader*

    load_tile(refs, expert, n_start, k_start, *, block_n, block_k, dtype) -> [block_n, block_k] array of `dtype`

where `refs` are the Pallas refs of the format's `operands` (in order), `expert` is a traced int32 scalar and
`n_start`/`k_start` are traced multiples of block_n/block_k. A loader must only use `plt.load` on those refs and
elementwise math, so that it lowers to Triton; the dequantization it applies must be the format's ONE canonical
dequantization (the same function `dequantize` uses for the reference). `DenseWeights` (bf16/f16/f32) is the
first such format; the ds4jax.quant formats are `QuantizedExpertWeights` (quantized_weights.py). A format provides
`operands`, `k_multiple` (block_k must be a multiple of its scale block), `compute_dtype`, `loader()` and
`dequantize()`, and optionally `check_blocks(block_n, block_k, what)`, which the kernels call to reject tilings the
format cannot take (ValueError naming format, dims and blocks).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

F32 = jnp.float32
FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))

TileLoader = Callable[..., jax.Array]


@runtime_checkable
class ExpertWeights(Protocol):
  """A stack of E expert matrices [N, K] (PyTorch [out, in] layout) in some storage format."""

  @property
  def shape(self) -> tuple[int, int, int]: ...          # (E, N, K), logical

  @property
  def operands(self) -> tuple[jax.Array, ...]: ...      # the arrays handed to pallas_call, in loader order

  @property
  def compute_dtype(self) -> Any: ...                   # dtype the loader naturally produces (bf16 for codes)

  @property
  def k_multiple(self) -> int: ...                      # block_k must be a multiple of this

  def loader(self) -> TileLoader: ...                   # static function, see the module docstring

  def dequantize(self) -> jax.Array: ...                # f32 [E, N, K], the canonical dequantization


def load_dense_tile(refs: Sequence[Any], expert, n_start, k_start, *, block_n: int, block_k: int, dtype):
  """Tile loader of `DenseWeights`: a plain [block_n, block_k] load of w[expert] cast to `dtype`."""
  (w_ref,) = refs
  tile = plt.load(w_ref.at[expert, pl.ds(n_start, block_n), pl.ds(k_start, block_k)])
  return tile.astype(dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DenseWeights:
  """Unquantized expert stack w [E, N, K] in float32, bfloat16 or float16."""

  w: jax.Array

  @property
  def shape(self):
    return tuple(self.w.shape)

  @property
  def operands(self):
    return (self.w,)

  @property
  def compute_dtype(self):
    return jnp.dtype(self.w.dtype)

  @property
  def k_multiple(self) -> int:
    return 1

  def loader(self) -> TileLoader:
    return load_dense_tile

  def dequantize(self) -> jax.Array:
    return jnp.asarray(self.w).astype(F32)

  def reshape_single(self) -> "DenseWeights":
    """[N, K] → [1, N, K] (a one-expert stack, for the shared expert)."""
    return DenseWeights(self.w[None])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RingLayoutWeights(DenseWeights):
  """A dense stack stored as gate_up_wgmma.ring_layout: w [E, N/64, K, 64], each 64 × 64 step box contiguous. The
  Mosaic gate/up's rings read it fastest (BENCHMARKS.md, session 65); no Triton kernel reads it."""

  @property
  def shape(self):
    *lead, n, K, box = self._boxes()
    return (*lead, n * box, K)

  def _boxes(self) -> tuple:
    """w's shape, checked: [..., N/box, K, box] (a slice along the experts, as the reference's scan takes, too)."""
    s = tuple(self.w.shape)
    if len(s) < 3 or s[-2] % s[-1]:
      raise ValueError(f"RingLayoutWeights takes gate_up_wgmma.ring_layout's [E, N/64, K, 64], got shape {s}")
    return s

  def loader(self) -> TileLoader:
    raise ValueError("RingLayoutWeights are read by the Mosaic GPU gate/up only (Config.gate_up_kernel='wgmma')")

  def dequantize(self) -> jax.Array:
    *lead, n, K, box = self._boxes()
    w = self.w.reshape(*lead, n, K // box, box, box)
    w = jnp.swapaxes(w, -3, -2)  # [.., N/box, box rows, K/box, box columns]
    return jnp.asarray(w.reshape(*lead, n * box, K)).astype(F32)


def is_format(w) -> bool:
  """An `ExpertWeights` object rather than a plain array."""
  return isinstance(w, ExpertWeights) and not isinstance(w, (jax.Array, np.ndarray))


def decoded_in_kernel(*ws) -> bool:
  """Whether any of these stacks is quantized storage that the kernels decode tile by tile (the default tiling
  differs then: kernels_pallas/moe/config.py)."""
  return not all(isinstance(w, DenseWeights) for w in ws)


def as_expert_weights(w, name: str, *, ndim: int = 3) -> ExpertWeights:
  """Wraps a float array as `DenseWeights`; passes an `ExpertWeights` format through; rejects anything else."""
  if is_format(w):
    if len(w.shape) != 3:
      raise ValueError(f"{name}: expert weight format must have logical shape [E, N, K], got {w.shape}")
    return w
  if not hasattr(w, "dtype") or not hasattr(w, "shape"):
    raise ValueError(f"{name}: expected an array or an ExpertWeights format, got {type(w).__name__}")
  if jnp.dtype(w.dtype) not in FLOAT_DTYPES:
    raise ValueError(f"{name}: unknown weight dtype {w.dtype}; expected float32, bfloat16 or float16 "
                     f"(quantized weights must be wrapped in an ExpertWeights format)")
  if w.ndim != ndim:
    raise ValueError(f"{name}: expected a {ndim}-D weight, got shape {tuple(w.shape)}")
  return DenseWeights(jnp.asarray(w) if ndim == 3 else jnp.asarray(w)[None])
