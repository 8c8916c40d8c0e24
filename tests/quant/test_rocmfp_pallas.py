"""The canonical ROCmFP decodes run unchanged inside a Pallas kernel body and give the jnp path's bits.

On CPU the kernel runs in interpret mode; on a GPU the same test runs the compiled Triton kernel. A second test lowers
the kernel for an abstract gfx1151 (ROCm) and H100 (CUDA) device, which needs no GPU and catches ops that
Pallas-Triton cannot lower (gathers, slices, >2-way concatenation, non-power-of-two tiles).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

from ds4jax.quant import formats, rocmfp2, rocmfp2_mix, rocmfp3, rocmfp3_mix
from rocmfp_oracle import assert_bits_equal, random_blocks, random_books

INTERPRET = jax.default_backend() == "cpu"
MODULES = {"rocmfp2": rocmfp2, "rocmfp3": rocmfp3, "rocmfp2_mix": rocmfp2_mix, "rocmfp3_mix": rocmfp3_mix}
NAMES = list(MODULES)
SIDE = ("books", "mode")
ROWS_PER_TILE = 16


def kernel_dequantize(fmt, arrays, *, interpret):
  """fmt.dequantize inside a pallas_call: grid (expert, row tile); one [16, in] tile of every plane per program.

  Weights are [E, out, in] (or [out, in]); books [E, 2, K] and mode [E] come in one expert at a time, so the kernel
  body sees a tile with no leading dims: planes [16, in/n], books [2, K], a 0-d mode.
  """
  stacked = arrays["scales"].ndim == 3
  if not stacked:
    arrays = {n: a[None] for n, a in arrays.items()}
  n_exp, out_dim, n_scales = arrays["scales"].shape
  in_dim = n_scales * 16
  specs = []
  for name in fmt.arrays:
    a = arrays[name]
    if name == "books":
      specs.append(pl.BlockSpec((None, *a.shape[1:]), lambda e, i: (e, 0, 0)))
    elif name == "mode":
      specs.append(pl.BlockSpec((None,), lambda e, i: (e,)))
    else:  # a code or scale plane [E, out, in/n]: a tile of rows, the whole (power-of-two) row
      specs.append(pl.BlockSpec((None, ROWS_PER_TILE, a.shape[-1]), lambda e, i: (e, i, 0)))

  def body(*refs):
    *in_refs, out_ref = refs
    out_ref[...] = fmt.dequantize(**{n: r[...] for n, r in zip(fmt.arrays, in_refs)})

  out = pl.pallas_call(
      body,
      grid=(n_exp, out_dim // ROWS_PER_TILE),
      in_specs=specs,
      out_specs=pl.BlockSpec((None, ROWS_PER_TILE, in_dim), lambda e, i: (e, i, 0)),
      out_shape=jax.ShapeDtypeStruct((n_exp, out_dim, in_dim), jnp.float32),
      interpret=interpret,
      compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
      name=f"dequantize_{fmt.name}",
  )(*[arrays[n] for n in fmt.arrays])
  return out if stacked else out[0]


def random_arrays(rng, name, lead, out_dim=32, n_blocks=4):
  """Random storage arrays (any byte pattern: fp2s/select bits and invalid scales too) and, for MIX, modes 0 and not."""
  module = MODULES[name]
  blocks = random_blocks(rng, (*lead, out_dim, n_blocks), module.BYTES_PER_BLOCK, valid=False)
  arrays = dict(zip([n for n in formats.get(name).arrays if n not in SIDE], module.from_blocks(blocks)))
  if name.endswith("_mix"):
    arrays["books"] = random_books(rng, lead, module.LEVELS)
    arrays["mode"] = np.array([0, 1, 0, 255], np.uint8)[:lead[0]] if lead else np.uint8(rng.integers(0, 2))
  return arrays


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("lead", [(4,), ()], ids=["stacked", "2d"])
def test_kernel_equals_jnp_bit_for_bit(rng, name, lead):
  fmt = formats.get(name)
  arrays = random_arrays(rng, name, lead)
  reference = jax.jit(lambda a: fmt.dequantize(**a))(arrays)
  got = jax.jit(functools.partial(kernel_dequantize, fmt, interpret=INTERPRET))(arrays)
  assert_bits_equal(got, reference)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("platform, device_kind", [("rocm", "gfx1151"), ("cuda", "NVIDIA H100")])
def test_kernel_lowers_to_triton(rng, name, platform, device_kind):
  fmt = formats.get(name)
  arrays = random_arrays(rng, name, (4,))
  structs = {n: jax.ShapeDtypeStruct(a.shape, a.dtype) for n, a in arrays.items()}
  mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(device_kind=device_kind, num_cores=None,
                                                                    platform=platform))
  with use_abstract_mesh(mesh):
    lowered = jax.jit(functools.partial(kernel_dequantize, fmt, interpret=False)).trace(structs).lower(
        lowering_platforms=(platform,))
  assert "__gpu$xla.gpu.triton" in lowered.as_text()
