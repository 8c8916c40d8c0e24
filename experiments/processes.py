"""One run over several processes (one per host, or several on one host): `jax.distributed` started from flags or
the environment, and which process writes the results (process 0; every process computes the same programs in
lockstep, so each reads the same inputs and results files, and only process 0 writes them).

    python -m experiments.prefill ... --mesh=expert=2 --coordinator_address=host0:12355 --num_processes=2 \
        --process_id=0          # on host 0; the same with --process_id=1 on host 1

Without --coordinator_address (or JAX_COORDINATOR_ADDRESS) nothing is started: one process, as always.
"""

from __future__ import annotations

import os

import jax
from absl import flags

class ProcessError(ValueError):
  """An incomplete or inconsistent description of the processes."""


ENV = dict(coordinator_address="JAX_COORDINATOR_ADDRESS", num_processes="JAX_NUM_PROCESSES",
           process_id="JAX_PROCESS_ID")


def define_flags(flag_values: flags.FlagValues | None = None) -> None:
  fv = flags.FLAGS if flag_values is None else flag_values
  flags.DEFINE_string("coordinator_address", None, "host:port of process 0, to run over several processes "
                      f"(jax.distributed; default ${ENV['coordinator_address']}). Unset: one process.", flag_values=fv)
  flags.DEFINE_integer("num_processes", None, f"Processes in the run (default ${ENV['num_processes']}).",
                       flag_values=fv)
  flags.DEFINE_integer("process_id", None, f"This process, 0..num_processes-1; 0 writes the results (default "
                       f"${ENV['process_id']}).", flag_values=fv)


def start(coordinator_address: str | None = None, num_processes: int | None = None,
          process_id: int | None = None) -> str:
  """Joins the run described by the arguments or, for those not given, the environment (before JAX starts its
  backend). Returns one line that says where this process stands ("" for a single process). Raises ProcessError on
  an incomplete or inconsistent description."""
  address = coordinator_address or os.environ.get(ENV["coordinator_address"]) or None
  n = num_processes if num_processes is not None else _env_int("num_processes")
  pid = process_id if process_id is not None else _env_int("process_id")
  if address is None:
    if n is not None or pid is not None:
      raise ProcessError("--num_processes / --process_id need --coordinator_address (or $JAX_COORDINATOR_ADDRESS)")
    return ""
  if n is None or pid is None:
    raise ProcessError(f"--coordinator_address={address} needs --num_processes and --process_id")
  if n < 1 or not 0 <= pid < n:
    raise ProcessError(f"--process_id={pid} must lie in [0, --num_processes={n})")
  jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU collectives across processes
  jax.distributed.initialize(coordinator_address=address, num_processes=n, process_id=pid)
  return (f"process {pid} of {n} (coordinator {address}): {jax.local_device_count()} of {jax.device_count()} "
          f"devices here" + ("; this process writes the results" if pid == 0 else ""))


def start_from_flags(flag_values: flags.FlagValues) -> str:
  """`start` with this module's flags where they are defined (an entry point's main called as a function, as the
  tests do, may have none: then the environment alone)."""
  value = lambda name: flag_values[name].value if name in flag_values else None
  return start(value("coordinator_address"), value("num_processes"), value("process_id"))


def writes() -> bool:
  """Whether this process writes results files (process 0; always in a single process)."""
  return jax.process_index() == 0


def _env_int(name: str) -> int | None:
  value = os.environ.get(ENV[name])
  if value is None:
    return None
  try:
    return int(value)
  except ValueError:
    raise ProcessError(f"${ENV[name]}={value!r} is not an integer") from None
