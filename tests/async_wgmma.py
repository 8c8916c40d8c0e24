"""Asynchronous wgmmas in Mosaic GPU's interpreter, for the tests of the Mosaic GPU kernels.

On the GPU a wgmma reads its shared-memory operands at some time between its issue and the `wgmma_wait` that retires
its group, so a kernel may let a TMA copy refill an operand's slot only after that wait. jax 0.11.2's interpreter
runs a wgmma when it is issued and ignores `wgmma_wait`, and its race detector does not see wgmma reads, so a slot
released one wait too early passes there.

`install()` runs each wgmma at the latest moment the hardware may: issuing one only queues it; a wait that leaves n
groups in flight (`plgpu.wgmma_wait(n)`, or an accumulator read with `wait_n`) runs all but the newest n of its
warpgroup's, reading their operands then. Each `plgpu.wgmma` is one group, as Pallas lowers it (a commit after every
wgmma). With `detect_races`, each operand read, at the issue and at the retiring wait, is held against the recent
TMA copies into its slot in happens-before order (vector clocks, the interpreter's): an operand copied in after its
wgmma was issued, or a slot released before the wait and refilled, is then a race on every run, whatever order the
CPU threads ran in, and `get_races().races_found` says so. Without `detect_races`, the refilled bytes reach the sums
when the copy ran first. Operands that a warpgroup writes itself (generic stores) are not checked here.
"""

from __future__ import annotations

import collections
import functools
import threading

import jax
from jax._src import callback, source_info_util
from jax._src.pallas.mosaic.interpret.race_detection_state import _ranges_overlap
from jax._src.pallas.mosaic_gpu import primitives as gpu_primitives
from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks, jaxpr_interpret

_RETIRE = "async_wgmma_retire"  # the param that marks a wait rewritten as a commit_smem eqn (_with_waits_as_retires)
_lock = threading.Lock()  # the interpreter runs each warpgroup, and each TMA copy, on a CPU thread of its own
_queued: dict = {}  # warpgroup → the keyword arguments of its issued wgmmas not yet run, oldest first
# This kernel's recent accesses: (buffer, slot) → {True: the last copies, False: the last reads}, as (range, clock,
# where). A racing pair is close in its slot's history (a refill follows the early release, and the late read comes
# before the slot's next round), so a short window of each kind finds it at a cost that does not grow with the run.
_accesses: dict = {"memory": None, "by_slot": {}}
_WINDOW = {True: 4, False: 32}
_original: dict = {}


def queued() -> int:
  """wgmmas issued and not yet run, over all warpgroups (0 once every kernel has waited for its own)."""
  with _lock:
    return sum(map(len, _queued.values()))


def _where(source_info, what: str) -> str:
  return f"{source_info_util.summarize(source_info)} ({what})" if source_info else what


def _access(key, rnge, clock, is_copy: bool, where) -> None:
  """Holds one TMA copy into shared memory, or one wgmma operand read, against the recent ones of the other kind on
  the same bytes: each pair must be ordered one way or the other. `where`: (source_info, what), for the report."""
  memory = gpu_callbacks._get_shared_memory()  # pylint: disable=protected-access
  slot = rnge[0] if rnge and isinstance(rnge[0], int) else None  # a ring's slot: its first index
  with _lock:
    if _accesses["memory"] is not memory:  # a new kernel (each gets its shared memory)
      _accesses.update(memory=memory, by_slot={})
    seen = _accesses["by_slot"].setdefault((key, slot), {k: collections.deque(maxlen=n) for k, n in _WINDOW.items()})
    races = [(r, w) for r, c, w in seen[not is_copy] if _ranges_overlap(r, rnge) and not c.ordered(clock)]
    seen[is_copy].append((rnge, clock, where))
  for other_range, other_where in races[:1]:
    copy, read = ((rnge, where), (other_range, other_where)) if is_copy else ((other_range, other_where), (rnge, where))
    print(f"RACE DETECTED (async wgmma)\n  TMA copy into {key}[{copy[0]}], {_where(*copy[1])}\n  wgmma read of "
          f"{key}[{read[0]}], {_where(*read[1])}\n  in no happens-before order")
    gpu_callbacks.get_races().races_found = True


def _operand_reads(kwargs, when: str) -> None:
  memory = gpu_callbacks._get_shared_memory()  # pylint: disable=protected-access
  if not memory.detect_races:
    return
  clock = memory.incr_clock(kwargs["thread"]).generic_clock
  where = (kwargs.get("source_info"), f"wgmma {when}")
  for operand in "ab":
    key = gpu_callbacks.HostAllocationKey.from_array(kwargs[f"{operand}_allocation_key_as_array"])
    transforms = jax.tree.map(int, gpu_callbacks._remove_noop_transforms(  # pylint: disable=protected-access
        kwargs[f"{operand}_transforms"]))
    _access(key, memory.access(key, transforms).range, clock, False, where)


def _copy_landed(self, tma_thread_id, memory):
  _original["post_read"](self, tma_thread_id, memory)
  if memory.detect_races:
    _access(self.dst_allocation_key, self.dst_access.range, self.clock.generic_clock.copy(), True,
            (self.source_info, "TMA copy"))


def _issue(**kwargs):
  _operand_reads(kwargs, "issued")
  with _lock:
    _queued.setdefault(kwargs["thread"], []).append(kwargs)
  return kwargs["token"]


def _retire(*, token, mesh_location, thread, in_flight: int, source_info=None):
  del mesh_location, source_info
  with _lock:
    mine = _queued.get(thread, [])
    cut = max(len(mine) - in_flight, 0)
    done, _queued[thread] = mine[:cut], mine[cut:]
  for kwargs in done:
    _operand_reads(kwargs, "retired")
    _original["wgmma"](**kwargs)
  return token


def _deref(*, token, mesh_location, thread, acc_allocation_key_as_array, wait_n, source_info=None):
  if wait_n is not None:
    _retire(token=token, mesh_location=mesh_location, thread=thread, in_flight=wait_n)
  return _original["deref"](token=token, mesh_location=mesh_location, thread=thread,
                            acc_allocation_key_as_array=acc_allocation_key_as_array, wait_n=wait_n,
                            source_info=source_info)


def _commit_smem_or_retire(self, eqn, token, get_invals):
  if _RETIRE not in eqn.params:
    return _original["commit_smem"](self, eqn, token, get_invals)
  retire = functools.partial(_retire, in_flight=eqn.params[_RETIRE], source_info=eqn.source_info)
  return callback.io_callback(retire, gpu_callbacks.TOKEN_SHAPE_DTYPE, token=token, mesh_location=self.mesh_location,
                              thread=self.thread), []


def _with_waits_as_retires(jaxpr):
  """`jaxpr` (or a ClosedJaxpr) with each wgmma_wait eqn made a commit_smem eqn that carries its n: the interpreter
  dispatches on the primitive, and gives commit_smem's handler the token that orders the retire's callback with the
  warpgroup's others."""
  inner = getattr(jaxpr, "jaxpr", jaxpr)
  if not any(e.primitive is gpu_primitives.wgmma_wait_p for e in inner.eqns):
    return jaxpr
  eqns = [e.replace(primitive=gpu_primitives.commit_smem_p, params={_RETIRE: e.params["n"]})
          if e.primitive is gpu_primitives.wgmma_wait_p else e for e in inner.eqns]
  inner = inner.replace(eqns=eqns)
  return jaxpr.replace(jaxpr=inner) if hasattr(jaxpr, "jaxpr") else inner


def _interpret(self, jaxpr, token, *args):
  return _original["interpret"](self, _with_waits_as_retires(jaxpr), token, *args)


def install() -> None:
  """Makes every Mosaic GPU kernel interpreted after this run its wgmmas late (module docstring). Idempotent."""
  if _original:
    return
  interpreter, copy_in = jaxpr_interpret.JaxprInterpreter, gpu_callbacks.AsyncCopyGmemToSmemTask
  _original.update(wgmma=gpu_callbacks.wgmma, deref=gpu_callbacks.wgmma_accumulator_deref,
                   commit_smem=interpreter._interpret_commit_smem_p, interpret=interpreter.interpret,
                   post_read=copy_in.post_read)
  gpu_callbacks.wgmma = _issue
  gpu_callbacks.wgmma_accumulator_deref = _deref
  interpreter._interpret_commit_smem_p = _commit_smem_or_retire
  interpreter.interpret = _interpret
  copy_in.post_read = _copy_landed
