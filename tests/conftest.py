"""Shared fixtures. Tests never read absl FLAGS: configs are passed explicitly.

Random inputs are seeded per test: the seed is a hash of the test's id, so a failure in CI reproduces locally, and
DS4JAX_TEST_SEED=<int> replaces it for every test (to replay or to explore other draws). A failing test that drew
from `rng` or `seed` prints its seed in the report.

The suite's time is mostly XLA compiling small CPU programs, each run a few times: tests compile with LLVM's
optimisation off (XLA's own passes stay on), which cuts the suite's CPU time by about a third. DS4JAX_TEST_XLA_OPT=1
keeps the default level.
"""

import os
import zlib

if os.environ.get("DS4JAX_TEST_XLA_OPT") != "1" and "xla_backend_optimization_level" not in os.environ.get(
    "XLA_FLAGS", ""):  # read when jax starts its backend, after this
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()

import numpy as np  # noqa: E402
import pytest  # noqa: E402

SEED_ENV = "DS4JAX_TEST_SEED"


def seed_of(nodeid: str) -> int:
  """The seed of one test: DS4JAX_TEST_SEED if set, else a stable hash of the test id."""
  override = os.environ.get(SEED_ENV)
  return int(override) if override else zlib.crc32(nodeid.encode())


@pytest.fixture
def rng(request):
  """A numpy generator seeded for this test (see the module docstring)."""
  seed = seed_of(request.node.nodeid)
  request.node.user_properties.append(("seed", seed))
  return np.random.default_rng(seed)


@pytest.fixture(scope="module")
def module_seed(request):
  """The seed of a module-scoped fixture (a model shared by a file's tests): its module's id, hashed."""
  return seed_of(request.node.nodeid) % 2**31


@pytest.fixture
def seed(rng):
  """An integer seed for jax / nnx.Rngs, drawn from this test's `rng`."""
  return int(rng.integers(0, 2**31 - 1))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
  report = (yield).get_result()
  seeds = [v for k, v in item.user_properties if k == "seed"]
  if report.failed and seeds:
    report.sections.append(("seed", f"{SEED_ENV}={seeds[0]} reproduces this test's random inputs"))
