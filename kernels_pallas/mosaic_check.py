"""Offline checks of Mosaic GPU kernels on their lowered modules: no GPU needed.

    lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    for module in mosaic_modules(lowered):
      assert not wgmma_report(module).issue_only_branches

A Mosaic GPU kernel is a `stablehlo.custom_call @mosaic_gpu_v2` whose `mhlo.backend_config` holds `module`, the
kernel's MLIR as bytecode (ops wrapped by Mosaic's serde as `stable_mosaic_gpu.*`); jaxlib's MLIR reads it back
with Mosaic's dialect registered. A wgmma there is an `llvm.inline_asm` of `wgmma.mma_async`, and `pl.when` an
`scf.index_switch` (or `scf.if`).

`wgmma_report(...).issue_only_branches`: the wgmmas issued inside a branch that holds no wgmma wait (a wait anywhere
in that branch counts). On sm_90 ptxas then serializes every wgmma of the kernel ("C7512", whatever the register
budget; docs/lowering.md §1). The rule was read off ptxas on dumped PTX (the FP2-MIX gate/up and FP3-MIX down with
such a branch and without it, and the ring kernel), so it stands in for ptxas's verdict without being it. Relies on
jax/jaxlib 0.11.2's serialization.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
from jax._src.interpreters import mlir as jax_mlir
from jax._src.lib import mosaic_gpu_dialect
from jax._src.lib.mlir import ir

_BRANCHES = ("scf.index_switch", "scf.if")  # after the serde prefix


def mosaic_modules(lowered: jax.stages.Lowered) -> list[bytes]:
  """The bytecode of every Mosaic GPU kernel in a lowered program, in program order."""
  found = []

  def visit(op):
    if op.name == "stablehlo.custom_call" and ir.StringAttr(op.attributes["call_target_name"]).value == "mosaic_gpu_v2":
      found.append(op.attributes["mhlo.backend_config"]["module"].value_bytes)
    return ir.WalkResult.ADVANCE

  lowered.compiler_ir("stablehlo").operation.walk(visit)
  return found


class WgmmaReport(NamedTuple):
  issues: int  # wgmma.mma_async sites
  waits: int  # wgmma.wait_group sites
  issue_only_branches: list[int]  # the issues (in program order) whose innermost branch holds no wait


def _branches(op) -> list[tuple[ir.Operation, int]]:
  """The (branch op, region index) pairs around `op`, outermost first."""
  out = []
  while (parent := op.parent) is not None:
    if parent.name.endswith(_BRANCHES):
      region = op.block.region
      out.append((parent, next(k for k, r in enumerate(parent.regions) if r == region)))
    op = parent
  return out[::-1]


def wgmma_report(module: bytes) -> WgmmaReport:
  """Every wgmma issue and wait of a Mosaic GPU kernel, and the issues that a branch holds without a wait."""
  ctx = jax_mlir.make_ir_context()
  ctx.allow_unregistered_dialects = True  # the serde-wrapped ops
  mosaic_gpu_dialect.register_dialect(ctx)  # its types (barriers) must parse
  with ctx:
    sites = {"mma": [], "wait": []}

    def visit(op):
      if op.name.endswith("inline_asm"):
        asm = ir.StringAttr(op.attributes["asm_string"]).value
        for kind, text in (("mma", "wgmma.mma_async"), ("wait", "wgmma.wait_group")):
          if text in asm:
            sites[kind].append(_branches(op))
      return ir.WalkResult.ADVANCE

    ir.Module.parse(module).operation.walk(visit)

    def within(inner, outer):  # region chains: `inner` lies in `outer`'s innermost region
      return len(inner) >= len(outer) and all(a[0] == b[0] and a[1] == b[1] for a, b in zip(inner, outer))

    bad = [i for i, issue in enumerate(sites["mma"])
           if issue and not any(within(wait, issue) for wait in sites["wait"])]
    return WgmmaReport(len(sites["mma"]), len(sites["wait"]), bad)
