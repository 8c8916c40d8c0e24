"""Pallas-Triton kernels of ds4jax: one package per kernel (moe, indexer, mla), each with its plain-jnp reference,
plus the offline lowering check. Nothing here imports the model; only the weight formats (ds4jax.quant)."""

# The first pallas_call imports this module lazily, and it registers a tracing-context option, which makes the next
# call of every jitted function retrace and compile again. Importing it with the kernels (before any jit runs)
# keeps that from happening inside a run.
import jax.experimental.pallas.fuser  # noqa: F401  pylint: disable=unused-import
