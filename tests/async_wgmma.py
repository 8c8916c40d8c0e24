"""Asynchronous wgmmas in Mosaic GPU's interpreter, for the tests of the Mosaic GPU kernels.

On the GPU a wgmma reads its shared-memory operands at some time between its issue and the `wgmma_wait` that retires
its group, so a kernel may let a TMA copy refill an operand's slot only after that wait. jax 0.11.2's interpreter
runs a wgmma when it is issued and ignores `wgmma_wait`, and its race detector does not see wgmma reads, so a slot
released one wait too early passes there.

`install()` runs each wgmma at the latest moment the hardware may: issuing one only queues it; a wait that leaves n
groups in flight (`plgpu.wgmma_wait(n)`, or an accumulator read with `wait_n`) runs all but the newest n of its
warpgroup's, reading their operands then. Each `plgpu.wgmma` is one group, as Pallas lowers it (a commit after every
wgmma). A warpgroup that ends its kernel with wgmmas not waited for fails it. With `detect_races`, each operand read
is the interval from the wgmma's issue to its retiring wait, and each TMA copy into shared memory must come before
the issue or after the wait in happens-before order (vector clocks, the interpreter's). A copy into an operand's slot
that lands before its wgmma was issued without a barrier between, or inside the interval (a slot released before the
wait and refilled) is then a race, whatever order the CPU threads ran in, and `get_races().races_found` says so.
Without `detect_races`, the refilled bytes reach the sums when the copy ran first. Operands that a warpgroup writes
itself (generic stores) are not checked here.
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
_COPIES_KEPT = 8  # a slot's latest copies a read is held against (one a round in a ring)
_lock = threading.Lock()  # the interpreter runs each warpgroup, and each TMA copy, on a CPU thread of its own
_original: dict = {}


class _Kernel:
  """What one interpreted kernel has issued and not yet retired, and each shared-memory slot's recent accesses."""

  def __init__(self, memory):
    self.memory = memory
    self.queued = collections.defaultdict(list)  # warpgroup → [(wgmma kwargs, its reads)], oldest first
    # (buffer, slot) → its recent copies [range, clock, where] and the reads not yet known to precede every later
    # copy [range, issue clock, retire clock or None, where]. A slot is a ring's first index.
    self.copies = collections.defaultdict(lambda: collections.deque(maxlen=_COPIES_KEPT))
    self.reads = collections.defaultdict(list)


_state = {"kernel": None}


def _kernel() -> _Kernel:
  """The running kernel's state (a new kernel gets a new shared memory); under _lock."""
  memory = gpu_callbacks._get_shared_memory()  # pylint: disable=protected-access
  if _state["kernel"] is None or _state["kernel"].memory is not memory:
    _state["kernel"] = _Kernel(memory)
  return _state["kernel"]


def queued() -> int:
  """wgmmas issued and not yet run, over all warpgroups of the last kernel (0 once each has waited for its own)."""
  with _lock:
    return sum(map(len, _state["kernel"].queued.values())) if _state["kernel"] else 0


def _where(source_info, what: str) -> str:
  return f"{source_info_util.summarize(source_info)} ({what})" if source_info else what


def _race(slot, copy_range, copy_where, read_range, read_where) -> None:
  key, _ = slot
  print(f"RACE DETECTED (async wgmma)\n  TMA copy into {key}[{copy_range}], {_where(*copy_where)}\n  wgmma read of "
        f"{key}[{read_range}], {_where(*read_where)}\n  inside the read's interval from issue to retire, or unordered")
  gpu_callbacks.get_races().races_found = True


def _outside(copy_clock, issue, retire) -> bool:
  """A copy before the read's issue, or after its retire (None: not yet retired)."""
  return copy_clock.lt(issue) or (retire is not None and retire.lt(copy_clock))


def _operand_slots(kwargs):
  memory = gpu_callbacks._get_shared_memory()  # pylint: disable=protected-access
  for operand in "ab":
    key = gpu_callbacks.HostAllocationKey.from_array(kwargs[f"{operand}_allocation_key_as_array"])
    transforms = jax.tree.map(int, gpu_callbacks._remove_noop_transforms(  # pylint: disable=protected-access
        kwargs[f"{operand}_transforms"]))
    rnge = memory.access(key, transforms).range
    yield (key, rnge[0] if rnge and isinstance(rnge[0], int) else None), rnge


@gpu_callbacks.fail_on_exception
def _issue(*, token, thread, **kwargs):
  kwargs.update(token=token, thread=thread)
  memory = gpu_callbacks._get_shared_memory()  # pylint: disable=protected-access
  reads, races = [], []
  if memory.detect_races:
    issue, where = memory.incr_clock(thread).generic_clock, (kwargs.get("source_info"), "wgmma")
    with _lock:
      kernel = _kernel()
      for slot, rnge in _operand_slots(kwargs):
        races += [(slot, r, w, rnge, where) for r, c, w in kernel.copies[slot]
                  if _ranges_overlap(r, rnge) and not c.lt(issue)]
        read = [rnge, issue, None, where]
        kernel.reads[slot].append(read)
        reads.append((slot, read))
  with _lock:
    _kernel().queued[thread].append((kwargs, reads))
  for race in races[:1]:
    _race(*race)
  return token


@gpu_callbacks.fail_on_exception
def _retire(*, token, mesh_location, thread, in_flight: int, source_info=None):
  del mesh_location, source_info
  memory = gpu_callbacks._get_shared_memory()  # pylint: disable=protected-access
  with _lock:
    mine = _kernel().queued[thread]
    cut = max(len(mine) - in_flight, 0)
    done, mine[:] = mine[:cut], mine[cut:]
  for kwargs, reads in done:
    races = []
    if reads:
      retire = memory.incr_clock(thread).generic_clock
      with _lock:
        for slot, read in reads:
          read[2] = retire
          races += [(slot, r, w, read[0], read[3]) for r, c, w in _kernel().copies[slot]
                    if _ranges_overlap(r, read[0]) and not _outside(c, read[1], retire)]
    for race in races[:1]:
      _race(*race)
    _original["wgmma"](**kwargs)
  return token


def _deref(*, token, mesh_location, thread, acc_allocation_key_as_array, wait_n, source_info=None):
  if wait_n is not None:
    _retire(token=token, mesh_location=mesh_location, thread=thread, in_flight=wait_n)
  return _original["deref"](token=token, mesh_location=mesh_location, thread=thread,
                            acc_allocation_key_as_array=acc_allocation_key_as_array, wait_n=wait_n,
                            source_info=source_info)


def _copy_landed(self, tma_thread_id, memory):
  _original["post_read"](self, tma_thread_id, memory)
  if not memory.detect_races:
    return
  clock, rnge, where = self.clock.generic_clock.copy(), self.dst_access.range, (self.source_info, "TMA copy")
  slot = (self.dst_allocation_key, rnge[0] if rnge and isinstance(rnge[0], int) else None)
  with _lock:
    kernel = _kernel()
    reads = kernel.reads[slot]
    races = [(slot, rnge, where, r, w) for r, issue, retire, w in reads
             if _ranges_overlap(r, rnge) and not _outside(clock, issue, retire)]
    # a read retired before this copy precedes the producer's later copies too (its program order)
    reads[:] = [read for read in reads if read[2] is None or not read[2].lt(clock)]
    kernel.copies[slot].append((rnge, clock, where))
  for race in races[:1]:
    _race(*race)


@gpu_callbacks.fail_on_exception
def _thread_finished(*, token, mesh_location, thread):
  with _lock:
    left = len(_kernel().queued.pop(thread, []))
  if left:
    raise RuntimeError(f"{thread} ended the kernel with {left} wgmma(s) not waited for (plgpu.wgmma_wait)")
  return _original["thread_finished"](token=token, mesh_location=mesh_location, thread=thread)


def _commit_smem_or_retire(self, eqn, token, get_invals):
  if _RETIRE not in eqn.params:
    return _original["commit_smem"](self, eqn, token, get_invals)
  retire = functools.partial(_retire, in_flight=eqn.params[_RETIRE], source_info=eqn.source_info)
  return callback.io_callback(retire, gpu_callbacks.TOKEN_SHAPE_DTYPE, token=token, mesh_location=self.mesh_location,
                              thread=self.thread), []


def _with_waits_as_retires(jaxpr):
  """`jaxpr` with each wgmma_wait eqn made a commit_smem eqn that carries its n: the interpreter dispatches on the
  primitive, and gives commit_smem's handler the token that orders the retire's callback with the warpgroup's
  others. (In jax 0.11.2 a ClosedJaxpr is a Jaxpr.)"""
  if not any(e.primitive is gpu_primitives.wgmma_wait_p for e in jaxpr.eqns):
    return jaxpr
  return jaxpr.replace(eqns=[e.replace(primitive=gpu_primitives.commit_smem_p, params={_RETIRE: e.params["n"]})
                             if e.primitive is gpu_primitives.wgmma_wait_p else e for e in jaxpr.eqns])


def _interpret(self, jaxpr, token, *args):
  return _original["interpret"](self, _with_waits_as_retires(jaxpr), token, *args)


def install() -> None:
  """Makes every Mosaic GPU kernel interpreted after this run its wgmmas late (module docstring). Idempotent."""
  if _original:
    return
  interpreter, copy_in = jaxpr_interpret.JaxprInterpreter, gpu_callbacks.AsyncCopyGmemToSmemTask
  _original.update(wgmma=gpu_callbacks.wgmma, deref=gpu_callbacks.wgmma_accumulator_deref,
                   thread_finished=gpu_callbacks.kernel_thread_finished,
                   commit_smem=interpreter._interpret_commit_smem_p, interpret=interpreter.interpret,
                   post_read=copy_in.post_read)
  gpu_callbacks.wgmma = _issue
  gpu_callbacks.wgmma_accumulator_deref = _deref
  gpu_callbacks.kernel_thread_finished = _thread_finished
  interpreter._interpret_commit_smem_p = _commit_smem_or_retire
  interpreter.interpret = _interpret
  copy_in.post_read = _copy_landed
