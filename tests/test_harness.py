"""The suite's own harness (tests/conftest.py): compiled programs are released before a process runs out of memory
mappings; Mosaic GPU kernels' wgmmas run in the interpreter as late as the GPU may run them (tests/async_wgmma.py);
the interpreter's callbacks take NumPy arrays, every other io_callback jax's (tests/numpy_callbacks.py)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
from jax.experimental import io_callback
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jax._src import callback

from tests import async_wgmma, conftest, numpy_callbacks


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


# A two-slot ring, as the Mosaic GPU kernels have them: warpgroup 1 copies x's and w's K tiles in, warpgroup 0 sums
# x @ w^T over them with one wgmma a step and releases each slot for the next copy. `release` → (wgmmas a step's
# wait leaves in flight, whose slot it then frees: this step's or the previous one's, and whether that is a bug):
# each step waiting for its wgmma; a step's wgmma running on until the next step's wait; and the planted bugs where
# the next copy may refill a slot under its wgmma, landing before or while that wgmma is retired.
ROWS, STEP, STEPS = 64, 64, 4
RELEASES = {"after its wait": (0, 0, False), "in flight": (1, 1, False), "before its wait": (None, 0, True),
            "in flight, its own slot": (1, 0, True), "two in flight, the previous slot": (2, 1, True)}


def ring_matmul(x, w, *, release: str, read_acc: bool = True):
  swizzle = plgpu.find_swizzle(STEP * 2 * 8)
  tiles = (plgpu.TilingTransform((8, swizzle // 2)), plgpu.SwizzleTransform(swizzle))

  def body(x_g, w_g, out_g):
    @functools.partial(pl.run_scoped, x_s=plgpu.SMEM((2, ROWS, STEP), jnp.bfloat16, transforms=tiles),
                       w_s=plgpu.SMEM((2, ROWS, STEP), jnp.bfloat16, transforms=tiles),
                       out_s=plgpu.SMEM((ROWS, ROWS), jnp.float32), full=plgpu.Barrier(num_arrivals=2, num_barriers=2),
                       free=plgpu.Barrier(num_arrivals=1, num_barriers=2), collective_axes="wg")
    def _(x_s, w_s, out_s, full, free):
      wg = lax.axis_index("wg")

      @pl.when(wg == 1)
      def _():
        for k in range(STEPS):
          if k >= 2:
            plgpu.barrier_wait(free.at[k % 2])
          plgpu.copy_gmem_to_smem(x_g.at[:, pl.ds(k * STEP, STEP)], x_s.at[k % 2], full.at[k % 2])
          plgpu.copy_gmem_to_smem(w_g.at[:, pl.ds(k * STEP, STEP)], w_s.at[k % 2], full.at[k % 2])
        for s in range(2):  # the last two releases
          plgpu.barrier_wait(free.at[s])

      @pl.when(wg == 0)
      def _():
        @functools.partial(pl.run_scoped, acc=plgpu.ACC((ROWS, ROWS), jnp.float32))
        def _(acc):
          in_flight, back, _ = RELEASES[release]
          for k in range(STEPS):
            plgpu.barrier_wait(full.at[k % 2])
            plgpu.wgmma(acc, x_s.at[k % 2], w_s.at[k % 2].T)
            if in_flight is None:  # released, then waited for
              plgpu.barrier_arrive(free.at[k % 2])
            plgpu.wgmma_wait(in_flight or 0)
            if in_flight is not None and k >= back:
              plgpu.barrier_arrive(free.at[(k - back) % 2])
          if read_acc:
            plgpu.wgmma_wait(0)
          for k in range(STEPS - back, STEPS):
            plgpu.barrier_arrive(free.at[k % 2])
          out_s[...] = acc[...] if read_acc else jnp.zeros((ROWS, ROWS), jnp.float32)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_s, out_g)
        plgpu.wait_smem_to_gmem(0)

  return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((ROWS, ROWS), jnp.float32), num_threads=2, thread_name="wg",
                      interpret=plgpu.InterpretGPUParams(detect_races=True),
                      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup))(x, w)


@pytest.mark.parametrize("release", RELEASES)
def test_wgmmas_run_late_and_a_slot_released_before_their_wait_is_a_race(rng, release):
  """tests/async_wgmma.py, installed by conftest for every test: a ring released in order sums right with no race
  and no wgmma left queued, a wgmma kept in flight for a step too; a slot released between its wgmma's issue and
  the wait that retires it (bugs the stock interpreter passes: it runs a wgmma at issue) is a race on every run,
  whether the refill lands before that wait or inside it."""
  x, w = (jnp.asarray(rng.standard_normal((ROWS, STEP * STEPS)), jnp.bfloat16) for _ in range(2))
  out = jax.block_until_ready(ring_matmul(x, w, release=release))
  assert async_wgmma.queued() == 0
  bug = RELEASES[release][2]
  assert interpret_pallas_call.get_races().races_found == bug
  if not bug:
    want = np.asarray(x, np.float32) @ np.asarray(w, np.float32).T
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-4)


def test_a_warpgroup_ending_with_a_wgmma_not_waited_for_fails_its_kernel(rng):
  x, w = (jnp.asarray(rng.standard_normal((ROWS, STEP * STEPS)), jnp.bfloat16) for _ in range(2))
  with pytest.raises(Exception, match="not waited for"):
    jax.block_until_ready(ring_matmul(x, w, release="in flight", read_acc=False))
  jax.block_until_ready(ring_matmul(x, w, release="in flight"))  # the next kernel starts clean
  assert not interpret_pallas_call.get_races().races_found and async_wgmma.queued() == 0


def test_only_the_interpreters_callbacks_skip_the_device_copy(rng, monkeypatch):
  """An interpreted ring kernel sends none of its memory, barrier and wgmma callbacks through jax's io_callback path
  (which puts every argument on the device), only the one that starts its warpgroups' threads, and sums the same;
  a callback of this module still gets jax arrays."""
  through_jax = []
  impl = numpy_callbacks._original["impl"]  # pylint: disable=protected-access
  counted = lambda *a, callback, **k: through_jax.append(callback.callback_func) or impl(*a, callback=callback, **k)
  monkeypatch.setitem(numpy_callbacks._original, "impl", counted)  # pylint: disable=protected-access
  x, w = (jnp.asarray(rng.standard_normal((ROWS, STEP * STEPS)), jnp.bfloat16) for _ in range(2))
  out = jax.block_until_ready(ring_matmul(x, w, release="after its wait"))
  assert callback.io_callback_impl is numpy_callbacks._io_callback_impl  # pylint: disable=protected-access
  assert [getattr(f, "func", f).__name__ for f in through_jax] == ["_thread_map_callback"]
  np.testing.assert_allclose(np.asarray(out), np.asarray(x, np.float32) @ np.asarray(w, np.float32).T, rtol=1e-5,
                             atol=1e-4)
  got = []
  jax.jit(lambda v: io_callback(lambda a: got.append(a) or a, v, v))(jnp.arange(3.0)).block_until_ready()
  assert len(through_jax) == 2 and isinstance(got[0], jax.Array)
