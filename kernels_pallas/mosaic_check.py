"""Offline checks of Mosaic GPU kernels on their lowered modules: no GPU needed.

    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    for module in mosaic_modules(text):
      assert not wgmma_report(module).issue_only_branches

A Mosaic GPU kernel is a `stablehlo.custom_call @mosaic_gpu_v2` whose `mhlo.backend_config` holds `module`, the
kernel's MLIR as bytecode (ops wrapped by Mosaic's serde as `stable_mosaic_gpu.*`); jaxlib's MLIR reads it back
with Mosaic's dialect registered. A wgmma there is an `llvm.inline_asm` of `wgmma.mma_async`, and `pl.when` an
`scf.index_switch` (or `scf.if`).

`wgmma_report(...).issue_only_branches`: the wgmmas issued inside a branch that does not also hold a wgmma wait.
On sm_90 ptxas then serializes every wgmma of the kernel ("C7512", whatever the register budget; docs/lowering.md
§2). The rule was read off ptxas on dumped PTX (the FP2-MIX gate/up and FP3-MIX down with such a branch and
without it, and the ring kernel), so it stands in for ptxas's verdict without being it. Relies on jax/jaxlib
0.11.2's serialization.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from jax._src.interpreters import mlir as jax_mlir
from jax._src.lib import mosaic_gpu_dialect
from jax._src.lib.mlir import ir

_MODULE = re.compile(r'module = "((?:[^"\\]|\\.)*)"')
_BRANCHES = ("index_switch", "scf.if")


def _unescape(s: str) -> bytes:
  """An MLIR string attribute's bytes: \\XX is a hex byte, \\\\ \\" \\n \\t themselves."""
  out, i = bytearray(), 0
  while i < len(s):
    if s[i] != "\\":
      out += s[i].encode()
      i += 1
    elif s[i + 1] in '\\"nt':
      out.append({"n": 10, "t": 9}.get(s[i + 1], ord(s[i + 1])))
      i += 2
    else:
      out.append(int(s[i + 1:i + 3], 16))
      i += 3
  return bytes(out)


def mosaic_modules(lowered_text: str) -> list[bytes]:
  """The bytecode of every Mosaic GPU kernel in a lowered program's text, in order."""
  return [_unescape(m.group(1)) for m in _MODULE.finditer(lowered_text)]


class WgmmaReport(NamedTuple):
  issues: int  # wgmma.mma_async sites
  waits: int  # wgmma.wait_group sites
  issue_only_branches: list[int]  # the issues (in program order) whose innermost branch holds no wait


def _branches(op) -> list[tuple]:
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
    inside = lambda inner, outer: len(inner) >= len(outer) and all(
        a[0] == b[0] and a[1] == b[1] for a, b in zip(inner, outer))
    bad = [i for i, b in enumerate(sites["mma"]) if b and not any(inside(w, b) for w in sites["wait"])]
    return WgmmaReport(len(sites["mma"]), len(sites["wait"]), bad)
