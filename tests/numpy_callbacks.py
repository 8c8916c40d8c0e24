"""Mosaic GPU's interpreter without a device copy per callback, for the tests.

The interpreter runs every memory access, barrier and wgmma of a kernel as an `io_callback`, and jax 0.11.2's
`io_callback` puts each callback's arguments (NumPy arrays from XLA) on the CPU device as jax arrays before the call,
which the interpreter then turns back into Python ints and NumPy arrays. `install()` hands the interpreter's callbacks
(and tests/async_wgmma.py's) the same values without that copy: integer scalars as Python ints (which its `_to_int`
takes for thread ids and mesh positions), the rest as NumPy arrays (which `HostAllocationKey.from_array` and its
buffer reads take). Every other io_callback keeps jax's path.
"""

from __future__ import annotations

import numpy as np
from jax._src import callback, config, tree_util
from jax._src import xla_bridge as xb

_INTERPRETER = ("jax._src.pallas.mosaic_gpu.interpret.", "tests.async_wgmma")
_original: dict = {}


def _interpreters(flat_callback) -> bool:
  f = flat_callback.callback_func
  f = getattr(f, "func", f)  # a functools.partial (tests/async_wgmma.py's retire)
  return getattr(f, "__module__", "").startswith(_INTERPRETER)


def _plain(a):
  """An integer scalar as a Python int (what the interpreter reads positions and thread ids as), else NumPy."""
  a = np.asarray(a)
  return int(a) if a.ndim == 0 and a.dtype.kind in "iu" else a


def _io_callback_impl(*args, result_avals, callback, sharding, ordered):  # pylint: disable=redefined-outer-name
  if not _interpreters(callback):
    return _original["impl"](*args, result_avals=result_avals, callback=callback, sharding=sharding, ordered=ordered)
  cpu_device, *_ = xb.local_devices(backend="cpu")
  with config.default_device(cpu_device):
    return tree_util.tree_map(np.asarray, callback(*map(_plain, args)))


def install() -> None:
  """Idempotent."""
  if not _original:
    _original["impl"] = callback.io_callback_impl
    callback.io_callback_impl = _io_callback_impl
