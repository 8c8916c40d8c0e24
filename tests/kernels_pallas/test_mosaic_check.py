"""kernels_pallas/mosaic_check.py on the Mosaic GPU kernels, lowered offline for sm_90 (no GPU): the shipped MoE and
MLA kernels, and their tilings with several row blocks a warpgroup, issue no wgmma inside a branch that does not also
wait for it (ptxas would serialize every wgmma of the kernel, C7512), and such a branch is found."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

from kernels_pallas.mla.stream_wgmma import sparse_mla_wgmma
from kernels_pallas.moe import down_wgmma as down
from kernels_pallas.moe import gate_up_wgmma as gate_up
from kernels_pallas.moe import routing
from kernels_pallas.mosaic_check import mosaic_modules, wgmma_report

H200 = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(device_kind="NVIDIA H200", num_cores=None,
                                                                 platform="cuda"))
S, K, E, D, I = 512, 6, 16, 4096, 512  # V4-Flash's hidden size, few experts: the kernels' code does not change
SDS = jax.ShapeDtypeStruct
ROUTES = jax.eval_shape(lambda i: routing.route(i, E, 128), SDS((S, K), jnp.int32))
MIX = gate_up.MixStack(SDS((E, I, D // 4), jnp.uint8), SDS((E, I, D // 16), jnp.uint8), SDS((E, 2, 4), jnp.float32))
BF16 = SDS((E, I, D), jnp.bfloat16)


def modules(fn, *args) -> list[bytes]:
  with use_abstract_mesh(H200):  # the row gather in front of the gate/up is a Pallas-Triton kernel
    return mosaic_modules(jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)))


def gate_up_kernel(weights, tiling) -> bytes:
  (m,) = modules(lambda x, a, b, r: gate_up.gate_up_wgmma(x, a, b, r, swiglu_limit=10.0, tiling=tiling),
                 SDS((S, D), jnp.bfloat16), weights, weights, ROUTES)
  return m


def down_kernel(tiling) -> bytes:
  w2 = down.Mix3Stack(SDS((E, D, I // 4), jnp.uint8), SDS((E, D, I // 8), jnp.uint8), SDS((E, D, I // 16), jnp.uint8),
                      SDS((E, 2, 8), jnp.float32))
  (m,) = modules(lambda h, w, r: down.down_wgmma(h, w, r, tiling=tiling), SDS((S * K, I), jnp.bfloat16), w2, ROUTES)
  return m


def mla_kernel(precision) -> bytes:
  T, W, k, q_start = 256, 128, 64, 4096
  args = (SDS((T, 64, 512), jnp.bfloat16), SDS((T + W - 1, 512), jnp.bfloat16), SDS((q_start // 4, 512), jnp.bfloat16),
          SDS((64,), jnp.float32), SDS((T, k), jnp.int32))
  freqs = np.linspace(1.0, 1e-3, 32).astype(np.float32)
  (m,) = modules(lambda q, raw, comp, sink, idx: sparse_mla_wgmma(
      q, raw, comp, sink, q_start=q_start, raw_start=q_start - (W - 1), kind="csa", ratio=4, window=W,
      inv_freq=freqs, indices=idx, precision=precision), *args)
  return m


SHIPPED = {
    "gate_up FP2-MIX (default_tiling, > 64 rows an expert)": lambda: gate_up_kernel(MIX, gate_up.MIX_TILING),
    "gate_up FP2-MIX (default_tiling, few rows)": lambda: gate_up_kernel(MIX, gate_up.MIX_TILING_FEW_ROWS),
    "gate_up bf16 rings (default_tiling, RING_W64)": lambda: gate_up_kernel(BF16, gate_up.RING_W64),
    "gate_up bf16 rings (default_tiling, RING_X4)": lambda: gate_up_kernel(BF16, gate_up.RING_X4),
    "down FP3-MIX (TILING)": lambda: down_kernel(down.TILING),
    "down FP3-MIX (TILING_FEW_ROWS)": lambda: down_kernel(down.TILING_FEW_ROWS),
    "MLA bf16": lambda: mla_kernel("bf16"),
    "MLA split": lambda: mla_kernel("split"),
}


@pytest.mark.parametrize("kernel", list(SHIPPED))
def test_shipped_kernels_wait_for_their_wgmmas_in_the_branch_that_issues_them(kernel):
  report = wgmma_report(SHIPPED[kernel]())
  assert report.issues >= 4 and report.waits >= 1  # the check saw the kernel's wgmmas
  assert report.issue_only_branches == []


# Tilings no default picks, with several row blocks a warpgroup: skip_empty issues each count of non-empty blocks in
# its own branch, with its wait. (kernel, wgmma instructions: a block's issue once per count that includes it)
SEVERAL_BLOCKS = {
    # 2 warpgroups (one projection each) x (1 + 2 + 3 + 4) block issues x 4 k16 instructions (one K-64 wgmma)
    "gate_up FP2-MIX, four 64-row blocks": (lambda: gate_up_kernel(MIX, gate_up.Tiling(
        wg_rows=128, block_n=64, stages=3, mma_rows=64)), 2 * 10 * 4),
    # one code path for both warpgroups: (1 + 2) block issues x 2 weight stacks x 4 k16 instructions
    "gate_up bf16 pipeline (BF16_TILING)": (lambda: gate_up_kernel(BF16, gate_up.BF16_TILING), 3 * 2 * 4),
    # 2 warpgroups (an N tile each) x (1 + 2) block issues x 4 k16 instructions (one K-64 wgmma)
    "down FP3-MIX, two 128-row blocks": (lambda: down_kernel(gate_up.Tiling(
        wg_rows=128, block_n=64, stages=2, mma_rows=128)), 2 * 3 * 4),
}


@pytest.mark.parametrize("kernel", list(SEVERAL_BLOCKS))
def test_several_blocks_wait_in_each_branch_that_issues(kernel):
  lower, issues = SEVERAL_BLOCKS[kernel]
  report = wgmma_report(lower())
  assert report.issues == issues and report.waits >= 2
  assert report.issue_only_branches == []


def one_wgmma_kernel(wait_in_branch: bool) -> bytes:
  """One 64x64x64 wgmma (4 instructions) behind a branch, waited for inside the branch or after it (the latter is
  what 18c3514's MIX kernels did around their one block, which ptxas reported as C7512: docs/lowering.md §1)."""
  tiles = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))

  def body(a_g, b_g, out_g):
    @functools.partial(pl.run_scoped, a_s=plgpu.SMEM((64, 64), jnp.bfloat16, transforms=tiles),
                       b_s=plgpu.SMEM((64, 64), jnp.bfloat16, transforms=tiles), ready=plgpu.Barrier(num_arrivals=2),
                       acc=plgpu.ACC((64, 64), jnp.float32), out_s=plgpu.SMEM((64, 64), jnp.float32))
    def _(a_s, b_s, ready, acc, out_s):
      plgpu.copy_gmem_to_smem(a_g, a_s, ready)
      plgpu.copy_gmem_to_smem(b_g, b_s, ready)
      plgpu.barrier_wait(ready)

      @pl.when(lax.axis_index("x") == 0)
      def _():
        plgpu.wgmma(acc, a_s, b_s.T)
        if wait_in_branch:
          plgpu.wgmma_wait(0)

      if not wait_in_branch:
        plgpu.wgmma_wait(0)
      out_s[...] = acc[...]
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(out_s, out_g)
      plgpu.wait_smem_to_gmem(0)

  kernel = plgpu.kernel(body, out_type=SDS((64, 64), jnp.float32), grid=(2,), grid_names=("x",))
  (m,) = modules(kernel, SDS((64, 64), jnp.bfloat16), SDS((64, 64), jnp.bfloat16))
  return m


def test_a_branch_around_an_issue_is_found():
  branched = wgmma_report(one_wgmma_kernel(wait_in_branch=False))
  assert branched.issues == 4 and branched.issue_only_branches == [0, 1, 2, 3]
  waited = wgmma_report(one_wgmma_kernel(wait_in_branch=True))
  assert waited.issues == 4 and waited.issue_only_branches == []
