"""The sm_90 row gather of kernels_pallas/mla/row_gather.py: its address arithmetic against the tiled, swizzled
layout wgmma reads (CPU), its lowering for sm_90 (CPU, offline), and kv[idx] through it (compiled, on a GPU only:
inline code has no interpreter)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.interpreters import mlir as jax_mlir
from jax._src.lib.mlir import ir
from jax.experimental.mosaic.gpu import dialect as mgpu_dialect

from kernels_pallas.mla.row_gather import ROWS, chunk_offsets, gather_check

ON_GPU = jax.default_backend() == "gpu"


def swizzled_offset(r, c, d):
  """Element offset of logical (r, c) of a [rows, d] bf16 buffer with (8, 64) tiles and the 128-byte swizzle: the
  16-byte chunk index within a 128-byte row XORed with the row's index within its 8-row tile."""
  tile = (r // 8) * (d // 64) + c // 64
  return tile * 512 + (r % 8) * 64 + (((c % 64) // 8) ^ (r % 8)) * 8 + c % 8


@pytest.mark.parametrize("d", [64, 512])
def test_chunk_offsets_fill_the_swizzled_tile_once(d):
  # every (thread, copy k, column tile j) → a 16-byte chunk of row r = t // 8 + 16k: its source is 8 consecutive
  # elements of row idx[r], its destination the swizzled place of those elements; the chunks cover the buffer once
  tokens = np.random.default_rng(0).permutation(1000)[:ROWS]
  seen = np.zeros(ROWS * d, int)
  for t in range(128):
    for k in range(4):
      for j in range(d // 64):
        r, src, dst = chunk_offsets(t, k, j, int(tokens[t // 8 + 16 * k]), d)
        c = 64 * j + 8 * (t % 8)
        assert r == t // 8 + 16 * k and src == tokens[r] * d + c
        assert dst == swizzled_offset(r, c, d)
        seen[dst:dst + 8] += 1
  assert (seen == 1).all()


def mosaic_module_text(fn, *args) -> str:
  """The Mosaic GPU module of `fn`'s one kernel, lowered for sm_90 without a GPU, as MLIR text."""
  module = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).compiler_ir("stablehlo")
  call, = [op for op in module.body.operations[0].regions[0].blocks[0].operations if op.name == "stablehlo.custom_call"]
  data = bytes(ir.StringAttr(call.attributes["mhlo.backend_config"]["module"]).value_bytes)
  ctx = jax_mlir.make_ir_context()
  mgpu_dialect.register_dialect(ctx)
  ctx.allow_unregistered_dialects = True
  with ctx:
    return str(ir.Module.parse(data))


def test_gather_check_lowers_for_sm90():
  # 128 rows of a V4-Flash-wide latent: two gather calls of 4 rows × 8 column tiles of copies per thread each
  text = mosaic_module_text(gather_check, jax.ShapeDtypeStruct((4096, 512), jnp.bfloat16),
                            jax.ShapeDtypeStruct((128,), jnp.int32))
  assert text.count("nvvm.cp.async.shared.global") == 2 * 4 * 8
  # every copy takes a source size (0 for a negative id: a zero row, nothing read)
  assert text.count("(!llvm.ptr<3>, !llvm.ptr<1>, i32) -> ()") == 2 * 4 * 8
  assert text.count("nvvm.cp.async.wait.group") == 2 and text.count("nvvm.fence.proxy") >= 2


def test_gather_check_refuses_bad_shapes():
  with pytest.raises(ValueError, match="multiple of 64"):
    gather_check(jnp.zeros((16, 96), jnp.bfloat16), jnp.zeros((64,), jnp.int32))
  with pytest.raises(ValueError, match="64·k indices"):
    gather_check(jnp.zeros((16, 128), jnp.bfloat16), jnp.zeros((32,), jnp.int32))


@pytest.mark.skipif(not ON_GPU, reason="inline Mosaic GPU code runs compiled only (no interpreter)")
@pytest.mark.parametrize("d", [64, 512])
def test_gather_check_is_kv_of_idx(rng, d):
  kv = jnp.asarray(rng.standard_normal((4096, d)), jnp.bfloat16)
  idx = jnp.asarray(rng.permutation(4096)[:192], jnp.int32)  # three 64-row calls, repeats of none
  np.testing.assert_array_equal(np.asarray(gather_check(kv, idx)), np.asarray(kv)[np.asarray(idx)])


@pytest.mark.skipif(not ON_GPU, reason="inline Mosaic GPU code runs compiled only (no interpreter)")
def test_gather_check_zero_fills_negative_ids(rng):
  # a masked key slot (id -1) must not read memory: its row is zeros, whatever the table or what lies before it
  kv = jnp.asarray(rng.standard_normal((4096, 512)) + 3.0, jnp.bfloat16)  # no zero rows
  idx = np.asarray(rng.permutation(4096)[:128], np.int32)
  idx[rng.permutation(128)[:40]] = -1
  want = np.where(idx[:, None] >= 0, np.asarray(kv)[np.maximum(idx, 0)], 0)
  np.testing.assert_array_equal(np.asarray(gather_check(kv, jnp.asarray(idx))), want)
