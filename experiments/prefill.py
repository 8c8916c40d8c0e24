"""The qualification command (issue #6): the matched prefill matrix, timed and checked against the exact path.

    python -m experiments.prefill --flagfile=qual.cfg                      # V4-Flash, lucebox_mix, 8K/32K/122879
    python -m experiments.prefill --flagfile=experiments/qual_smoke.cfg    # CPU smoke (tiny preset, interpret mode)
    python -m experiments.prefill --flagfile=qual.cfg --configs=all_on,all_off --lengths=8192   # a bounded call

Configurations: all_on (the flags' resolved features, per length: docs/qualification.md §1), kill_<switch> per
switch on, kill_<knob> for the chunk/band knobs, all_off (the exact path). Every configuration uses the same prompt
ids and weights. Each one is written to --out (JSON, plus a .md table) as soon as it finishes; with --append, pairs
already OK are skipped and failed ones retried, so a full matrix can be run in several bounded calls. The logic
lives in experiments/qualification/. Each record has a verdict (PASS, FAIL or not run, with the reasons), taken on
the first min(length, --verdict_tokens) tokens: per-layer pinned parity, decision accounting and the teacher-forced
KL, whose runs --verdict_bands splits into bands (docs/qualification.md); --mutations adds planted bugs,
judged beside the matrix, each of which must FAIL. --mesh
splits the routed experts and each band's attention queries over devices (docs/mesh.md),
--coordinator_address/--num_processes/--process_id over processes (experiments/processes.py).
The last line says `N pass, M fail, K not run; planted bugs: X of Y caught`; the exit status is non-zero when a
configuration FAILs or a planted bug passes.
"""

import sys

from absl import app, flags

from ds4jax.checkpoint.safetensors_reader import CheckpointError
from experiments import device_memory, processes, qualification


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  device_memory.claim()  # before JAX starts its backend
  try:
    where = processes.start_from_flags(flags.FLAGS)
    if where:
      print(where, flush=True)
    doc = qualification.run(qualification.options_from_flags(flags.FLAGS))
  except (*qualification.STARTUP_ERRORS, CheckpointError, processes.ProcessError) as e:
    sys.exit(f"prefill: {e}")
  if qualification.failed(doc):  # a script can tell: non-zero exit on a FAIL or a planted bug that passes
    sys.exit(f"prefill: {qualification.summary_line(doc)}")


if __name__ == "__main__":
  qualification.define_flags(flags.FLAGS)  # only as a program: tests import main
  processes.define_flags(flags.FLAGS)
  app.run(main)
