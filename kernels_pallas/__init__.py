"""Pallas-Triton kernels of ds4jax: one package per kernel (moe, indexer, mla), plus the offline lowering check."""

# The first pallas_call imports this module lazily, and it registers a tracing-context option, which makes the next
# call of every jitted function retrace and compile again. ds4jax imports this package up front (ds4jax/__init__.py),
# so that never happens inside a run, even though the model imports its kernels lazily (an import cycle).
import jax.experimental.pallas.fuser  # noqa: F401  pylint: disable=unused-import
