"""What each loop of a shipped Triton kernel does on sm_90, read from its SASS (offline, no GPU needed).

    python -m experiments.sass_loops [--packages=mla,indexer] [--mla_precision=bf16] [--out=FILE.json]

Lowers each case of `kernels_pallas.<package>.lowering_cases("cuda")` (V4-Flash shapes, the CUDA configs; with
`--mla_precision` the MLA configs' precision replaced, "bf16" being the model's under bf16_matmul), compiles it to
SASS with Triton's own ptxas and the wheel's nvdisasm (`kernels_pallas.lowering.sass_cuda`) and prints, for the
largest loop of each kernel (the streaming stage loop of the MLA kernels), its instruction count and the count of
each opcode in `lowering.SASS_OPS`: HGMMA, waits on them, CTA barriers, memory fences, spills, exponentials and
shared-memory traffic. A static count: it says what a loop iteration issues, not how long it takes
(BENCHMARKS.md, "The streaming MLA kernel's SASS"; docs/lowering.md). Needs the `lowering` extra.
"""

from __future__ import annotations

import importlib
import json
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from absl import app, flags  # noqa: E402

from experiments import run_record  # noqa: E402
from kernels_pallas import lowering  # noqa: E402

_PACKAGES = flags.DEFINE_list("packages", ["mla"], f"Kernel packages, some of {list(lowering.CASE_PACKAGES)}.")
_MLA_PRECISION = flags.DEFINE_string("mla_precision", None, "Replace the MLA configs' precision (e.g. bf16).")
_OUT = run_record.define_out_flag(help_text="Write the records here as JSON.")


def loop_records(packages, mla_precision: str | None = None) -> list[dict]:
  """One record per kernel of every case: its largest SASS loop's counts, the kernel's config and label."""
  unknown = [p for p in packages if p not in lowering.CASE_PACKAGES]
  if unknown:
    raise ValueError(f"unknown kernel packages {unknown}; expected some of {list(lowering.CASE_PACKAGES)}")
  records = []
  for package in packages:
    module = importlib.import_module(f"kernels_pallas.{package}")
    extra = {"precision": mla_precision} if package == "mla" and mla_precision else {}
    for label, fn, args in module.lowering_cases("cuda", **extra):
      case = lowering.KernelCase(package, label.removesuffix(" cuda"), "cuda", fn, tuple(args))
      for k in lowering.lower_case(case):
        loops = lowering.sass_loops(lowering.sass_cuda(k.ttir, 90, k.num_warps, k.num_stages))
        records.append(dict(case=case.label, kernel=k.name, config=lowering.kernel_config(k), **extra,
                            loop=loops[0] if loops else None))
  return records


def main(argv):
  del argv
  records = loop_records(_PACKAGES.value, _MLA_PRECISION.value)
  ops = ("instructions", *lowering.SASS_OPS)
  print("case | kernel | " + " | ".join(ops))
  for r in records:
    loop = r["loop"] or {}
    print(f"{r['case']} | {r['kernel']} | " + " | ".join(str(loop.get(o, "-")) for o in ops))
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      json.dump(dict(kind="sass_loops", env=run_record.environment(), records=records), f, indent=1)


if __name__ == "__main__":
  app.run(main)
