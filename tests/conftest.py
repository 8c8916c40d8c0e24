"""Shared fixtures. Tests never read absl FLAGS: configs are passed explicitly.

Random inputs are seeded per test: the seed is a hash of the test's id, so a failure in CI reproduces locally, and
DS4JAX_TEST_SEED=<int> replaces it for every test (to replay or to explore other draws). A failing test that drew
from `rng` or `seed` prints its seed in the report.

XLA compiling small CPU programs is ~40% of the suite's time (2026-12-05: 580 of 1390 s; 5150 distinct programs, 30 s
of them compiled twice, so the shared cache below has little more to give; no XLA CPU flag tried cut it). Tests
compile with LLVM's optimisation off (XLA's own passes stay on), which cuts the suite's CPU time by about a third.
DS4JAX_TEST_XLA_OPT=1 keeps the default level. On a GPU the tests compare numbers, not speed, so XLA's GEMM autotuning
is off too: it times many candidate kernels for each dot while a program compiles, and XLA's priority fusion is off:
on the H200 it spent over 60 s on one layer of the 3-layer 64-head model of test_mla_wgmma_in_the_model (every
feature set, the exact path too; 6.6 s to the logits without it). The CPU pipeline has no pass of that name.
Each worker on a core of its own from its start (XLA's CPU pools then have one thread) took test_qualification.py
from 88 to 63 CPU s (2026-12-06), but Mosaic GPU's interpreter then deadlocks: its warpgroup threads block inside
callbacks that hold the pool's only thread. Pinned after jax starts, the pools' threads share one core: 2x slower.
The same deadlock hit the bf16 rings under an outer jit on 2 cores (2026-12-07): the thread running the kernel's
callback and one warpgroup's barrier wait held both threads of the CPU client's pool, so PJRT_NPROC gives it 8 at least
(kernels_pallas sets it on import; imported here, before any test module can start jax's CPU client).
2026-12-07 (937-950 s on 2 cores, 1823 worker-s): XLA's backend compile is 71% of test_prefill.py alone; perf puts
about two thirds of XLA CPU's fusion compile in making an MLIR context per fusion (loading every dialect, building
the canonicalizer's patterns). No setting cut it: emitter verification 0, LLVM's expensive passes off, one codegen
split, the xtile lowering either way, platform-dependent math off, larger gc thresholds, PJRT_NPROC 1 / 2 / 3 / 8,
each worker pinned to a core (test_qualification.py 104 CPU s either way now), caching every compile however
short (990 s), and (session 65, tests/kernels_pallas/mla/test_mla.py 63-78 s by default) the FAST_COMPILE preset
(xla_cpu_opt_preset, 75 s) or LLVM at -O0 (xla_backend_optimization_level=0, 86 s); jaxlib 0.11.2 has no flag to
turn XLA CPU's fusion emitters off. Cutting the suite further means fewer distinct programs, or smaller ones: a Pallas
kernel in interpret mode is a large program (each case of test_every_supported_switch_matches_the_reference compiles one
in 3-5 s).
2026-12-08 (686 s on 2 cores, 1329 worker-s; py-spy): in a Triton kernel's interpret-mode tests XLA's compile is ~46% of
the time and tracing and lowering ~23%, running the program next to nothing. Mosaic GPU's interpreter instead runs a
kernel as thousands of io_callbacks, and jax put each callback's arguments on the device first (~20% of a model test
with both Mosaic MoE kernels); tests/numpy_callbacks.py skips that copy: test_moe_down_wgmma.py 38.6 -> 30.8 s alone,
the gate/up, streaming-MLA and mosaic_check files 115 -> 95 s, the whole suite within its run-to-run noise (700 s).
"""

import os
import zlib

if os.environ.get("DS4JAX_TEST_XLA_OPT") != "1" and "xla_backend_optimization_level" not in os.environ.get(
    "XLA_FLAGS", ""):  # read when jax starts its backend, after this
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()
if "xla_gpu_autotune_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_autotune_level=0").strip()
if "xla_disable_hlo_passes" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_disable_hlo_passes=priority-fusion").strip()

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import kernels_pallas  # noqa: E402,F401  (PJRT_NPROC)
from tests import async_wgmma, numpy_callbacks  # noqa: E402

async_wgmma.install()  # the Mosaic GPU kernels' wgmmas run as late as on the GPU (tests/async_wgmma.py)
numpy_callbacks.install()  # and its callbacks take NumPy, not a device copy each (tests/numpy_callbacks.py)

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


@pytest.fixture(scope="session", autouse=True)
def shared_compilation_cache(tmp_path_factory):
  """One persistent compilation cache for the whole run: a program one test worker compiled (or a notebook kernel
  or an entry point started as a subprocess: they inherit the variable) loads from disk in the others. The run's
  temp dir is fresh, so nothing carries over between runs. DS4JAX_TEST_JIT_CACHE=0 turns it off; a cache directory
  the user set is kept."""
  import jax  # pylint: disable=import-outside-toplevel  (after XLA_FLAGS above)

  if os.environ.get("DS4JAX_TEST_JIT_CACHE") == "0" or jax.config.jax_compilation_cache_dir:
    return
  root = tmp_path_factory.getbasetemp()
  root = root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root  # shared by the workers of this run
  path = root / "jit_cache"
  path.mkdir(exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", str(path))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.3)  # interpret-mode kernels: ~0.3-3 s each
  os.environ["JAX_COMPILATION_CACHE_DIR"] = str(path)
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.3"


def memory_maps() -> int | None:
  """This process's memory mappings (Linux; None elsewhere)."""
  try:
    with open(f"/proc/{os.getpid()}/maps", encoding="utf-8") as f:
      return sum(1 for _ in f)
  except OSError:
    return None


def map_budget() -> int:
  """Half of the kernel's per-process limit on mappings (vm.max_map_count, 65530 by default)."""
  try:
    with open("/proc/sys/vm/max_map_count", encoding="utf-8") as f:
      return int(f.read()) // 2
  except (OSError, ValueError):
    return 32765


def release_compiled_programs(budget: int) -> bool:
  """Drops jax's caches of compiled programs where this process holds more than `budget` mappings; whether it did."""
  n = memory_maps()
  if n is None or n <= budget:
    return False
  import gc  # pylint: disable=import-outside-toplevel

  import jax  # pylint: disable=import-outside-toplevel  (after XLA_FLAGS above)

  jax.clear_caches()
  gc.collect()
  return True


@pytest.fixture(scope="module", autouse=True)
def bounded_memory_maps():
  """After each test file, `release_compiled_programs` over half of the kernel's limit. Each compiled XLA CPU program
  keeps ~6 mappings alive; over the whole suite in one process (plain `pytest`) they reached the limit and XLA's next
  compile crashed (a segfault in the teacher-forced KL test, ~35% in; reproduced alone by taking ~62000 mappings
  first). Each of CI's two workers stays under it, for now."""
  yield
  release_compiled_programs(map_budget())


# The files that take longest on the 2-core CI machine (seconds, `--durations=0` summed by file, 2026-12-05), heaviest
# first. `scripts/dev test` hands files to the two workers in collection order (--dist loadfile
# --no-loadscope-reorder): started first, they cannot be what one worker is still running alone while the other idles
# at the end.
HEAVY_FILES = {
    "tests/test_model_features.py": 130, "tests/test_prefill.py": 125,
    "tests/kernels_pallas/moe/test_moe_gate_up_wgmma.py": 110, "tests/experiments/test_verdicts.py": 105,
    "tests/experiments/test_qualification.py": 100, "tests/test_decode.py": 95,
    "tests/kernels_pallas/moe/test_moe_quantized.py": 70, "tests/test_mesh.py": 65,
    "tests/kernels_pallas/moe/test_moe_kernels.py": 55, "tests/kernels_pallas/mla/test_mla.py": 50,
    "tests/kernels_pallas/moe/test_moe_down_wgmma.py": 45, "tests/kernels_pallas/test_lowering_gfx1151.py": 20,
    "tests/kernels_pallas/mla/test_mla_stream_wgmma.py": 45, "tests/quant/test_policy.py": 35,
    "tests/experiments/test_processes.py": 30, "tests/test_golden.py": 25, "tests/experiments/test_generate.py": 25,
    "tests/notebooks/test_ablation_notebook.py": 25, "tests/notebooks/test_walkthrough_notebook.py": 15,
    "tests/test_model.py": 15, "tests/experiments/test_train_tiny.py": 15,
    "tests/kernels_pallas/indexer/test_indexer_topk.py": 15,
}


def pytest_collection_modifyitems(items):
  items.sort(key=lambda item: -HEAVY_FILES.get(item.nodeid.split("::")[0], 0))  # stable: the rest keep their order


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
  report = (yield).get_result()
  seeds = [v for k, v in item.user_properties if k == "seed"]
  if report.failed and seeds:
    report.sections.append(("seed", f"{SEED_ENV}={seeds[0]} reproduces this test's random inputs"))
