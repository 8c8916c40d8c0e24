"""The prefill qualification: the matched matrix of configurations, each timed and given a verdict against the exact
path (docs/qualification.md). The command is experiments/prefill.py; tests and notebooks call `run(Options(...))`
and `load_results(path)`.

  options   what a call is asked to do (Options, the flags)
  matrix    the configurations: all_on, kill_<switch>, kill_<knob>, all_off, mutant_<planted bug>
  inputs    the model config, weights, fingerprint, prompt ids
  runner    what runs the model (ModelRunner, or an injected stand-in) and the timing protocol
  checks    the verdict of a configuration, the final-position parity and the noise floor beside it
  records   the typed records of a results file
  store     the results file, merging, the exact prefix logits kept between calls
  report    the table, the summary line
  qualify   one call: plan, verdicts, timed runs, records
"""

from experiments.qualification.matrix import Configuration, configurations, exact_features
from experiments.qualification.options import (KL_GATE, STARTUP_ERRORS, Options, StartupError, define_flags,
                                               options_from_flags)
from experiments.qualification.qualify import run
from experiments.qualification.records import FAIL, NOT_RUN, PASS, Record, Verdict
from experiments.qualification.report import failed, markdown_table, summary_line, summary_rows, verdict_counts
from experiments.qualification.runner import ModelRunner, Runner
from experiments.qualification.store import Results, load_results, merge_results

__all__ = ["Configuration", "configurations", "exact_features", "KL_GATE", "STARTUP_ERRORS", "Options", "StartupError",
           "define_flags", "options_from_flags", "run", "FAIL", "NOT_RUN", "PASS", "Record", "Verdict",
           "failed", "markdown_table", "summary_line", "summary_rows", "verdict_counts", "ModelRunner", "Runner",
           "Results", "load_results", "merge_results"]
