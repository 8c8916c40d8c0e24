"""Merges qualification results files of one matched matrix into one, e.g. bounded calls run side by side on
several GPUs of one host, each with its own --out:

    CUDA_VISIBLE_DEVICES=0 python -m experiments.prefill --flagfile=qual.cfg --configs=... --out=/tmp/gpu0.json &
    CUDA_VISIBLE_DEVICES=1 python -m experiments.prefill --flagfile=qual.cfg --configs=... --out=/tmp/gpu1.json
    python -m experiments.merge_qualification --out=experiments/results/qual_v4flash_h200.json \
        /tmp/gpu0.json /tmp/gpu1.json

Copy the main file's .exact.npz next to each --out first, so no call recomputes the exact prefix logits.
"""

import sys

from absl import app, flags

from experiments import qualification, run_record

_OUT = run_record.define_out_flag(help_text="The results JSON to merge into (created if missing; .md rewritten).")
flags.mark_flag_as_required("out")


def main(argv):
  if len(argv) < 2:
    raise app.UsageError("name at least one results file to merge")
  try:
    doc = qualification.merge_results(_OUT.value, argv[1:])
  except qualification.StartupError as e:
    sys.exit(f"merge_qualification: {e}")
  print(f"{_OUT.value}: {len(doc.records)} records")


if __name__ == "__main__":
  app.run(main)
