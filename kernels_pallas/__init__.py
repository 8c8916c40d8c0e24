"""Pallas-Triton kernels of ds4jax: one package per kernel (moe, indexer, mla), each with its plain-jnp reference,
plus the offline lowering check. Nothing here imports the model; only the weight formats (ds4jax.quant)."""

import os

# Mosaic GPU's interpreter deadlocks when the XLA CPU client's pool has fewer threads than its blocked warpgroups
# (docs/lowering.md §2). The pool takes one thread per CPU unless PJRT_NPROC, read when jax starts that client, says
# otherwise; every kernel is imported through here, before that. A value the user set is kept.
os.environ.setdefault("PJRT_NPROC", str(max(8, os.cpu_count() or 1)))

# The first pallas_call imports this module lazily, and it registers a tracing-context option, which makes the next
# call of every jitted function retrace and compile again. Importing it with the kernels (before any jit runs)
# keeps that from happening inside a run.
import jax.experimental.pallas.fuser  # noqa: F401  pylint: disable=unused-import
