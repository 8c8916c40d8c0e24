"""The suite's own harness (tests/conftest.py): compiled programs are released before a process runs out of memory
mappings."""

import jax
import jax.numpy as jnp

from tests import conftest


def test_release_compiled_programs_frees_their_mappings():
  if conftest.memory_maps() is None:
    return  # not Linux: nothing to count
  for i in range(40):  # ~6 mappings each while their executables live in jax's caches
    jax.jit(lambda x, i=i: jnp.sin(x) * i)(jnp.ones((i + 1,))).block_until_ready()
  before = conftest.memory_maps()
  assert not conftest.release_compiled_programs(before + 1000)  # under the budget: nothing dropped
  assert conftest.release_compiled_programs(0)
  assert conftest.memory_maps() < before - 100
  assert 1000 < conftest.map_budget() < 10**9
