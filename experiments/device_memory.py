"""How much device memory the entry points ask JAX for.

JAX takes 75% of a GPU's memory by default, which leaves no room next to V4-Flash's 104 GB of weights on an H200
(the qualification ran out of memory at the weights fingerprint). The entry points call `claim` first thing in
main, before JAX starts its backend: it sets XLA_PYTHON_CLIENT_MEM_FRACTION to 0.95 unless the user has set it,
and says so.
"""

from __future__ import annotations

import os
import sys

VARIABLE = "XLA_PYTHON_CLIENT_MEM_FRACTION"
FRACTION = "0.95"


def claim(fraction: str = FRACTION) -> str:
  """Sets the memory fraction unless the environment already does; returns the one in force."""
  if VARIABLE in os.environ:
    return os.environ[VARIABLE]
  os.environ[VARIABLE] = fraction
  print(f"{VARIABLE}={fraction} (set by ds4jax: JAX's default 0.75 leaves no room next to V4-Flash's weights; "
        f"set the variable to choose another)", file=sys.stderr, flush=True)
  return fraction
