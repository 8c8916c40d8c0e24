"""kernels_pallas/mosaic_check.py on the Mosaic GPU kernels, lowered offline for sm_90 (no GPU): the shipped MoE and
MLA kernels issue no wgmma inside a branch that does not also wait for it (ptxas would serialize every wgmma of the
kernel, C7512), and a tiling with such a branch is found."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
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
MIX = gate_up.MixStack(SDS((E, I, D // 4), jnp.uint8), SDS((E, I, D // 16), jnp.uint8), SDS((E, 2, 4), jnp.float32),
                       SDS((E,), jnp.int32))
BF16 = SDS((E, I, D), jnp.bfloat16)
RING = gate_up.Tiling(wg_rows=64, block_n=128, x_stages=3, mma_in_flight=1)  # bench_moe's w64_n128_x3


def modules(fn, *args) -> list[bytes]:
  with use_abstract_mesh(H200):  # the row gather in front of the gate/up is a Pallas-Triton kernel
    return mosaic_modules(jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)))


def gate_up_kernel(weights, tiling) -> bytes:
  (m,) = modules(lambda x, a, b, r: gate_up.gate_up_wgmma(x, a, b, r, swiglu_limit=10.0, tiling=tiling),
                 SDS((S, D), jnp.bfloat16), weights, weights, ROUTES)
  return m


def down_kernel(tiling) -> bytes:
  w2 = down.Mix3Stack(SDS((E, D, I // 4), jnp.uint8), SDS((E, D, I // 8), jnp.uint8), SDS((E, D, I // 16), jnp.uint8),
                      SDS((E, 2, 8), jnp.float32), SDS((E,), jnp.int32))
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
    "gate_up bf16 rings (w64_n128_x3)": lambda: gate_up_kernel(BF16, RING),
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


def test_a_branch_around_an_issue_is_found():
  """Four 64-row blocks a warpgroup: skip_empty branches around each block's wgmmas (what 18c3514's MIX kernels had
  around their one block, which ptxas reported as C7512: docs/lowering.md §1); without skip_empty, none. The bf16
  pipeline (several 64-row blocks a warpgroup) has such branches."""
  four_blocks = gate_up.Tiling(wg_rows=128, block_n=64, stages=3, mma_rows=64)
  branched = wgmma_report(gate_up_kernel(MIX, four_blocks))
  assert len(branched.issue_only_branches) == branched.issues == 2 * 4 * 4  # 2 warpgroups x 4 blocks x 4 planes
  unbranched = wgmma_report(gate_up_kernel(MIX, dataclasses.replace(four_blocks, skip_empty=False)))
  assert unbranched.issues == 2 * 4 * 4 and unbranched.issue_only_branches == []
  bf16 = wgmma_report(gate_up_kernel(BF16, gate_up.BF16_TILING))
  assert bf16.issues and len(bf16.issue_only_branches) == bf16.issues
