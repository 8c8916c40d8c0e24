"""What the entry points do before and after the library: device memory, exit status, refused inputs."""

import os
import re
import subprocess
import sys

import pytest

from experiments import device_memory, run_record
from experiments import prefill as prefill_command
from experiments import qualification as q


def test_memory_fraction_is_set_only_when_the_user_has_not(monkeypatch, capsys):
  monkeypatch.delenv(device_memory.VARIABLE, raising=False)
  assert device_memory.claim() == "0.95" and os.environ[device_memory.VARIABLE] == "0.95"
  assert "set by ds4jax" in capsys.readouterr().err
  monkeypatch.setenv(device_memory.VARIABLE, "0.5")
  assert device_memory.claim() == "0.5" and os.environ[device_memory.VARIABLE] == "0.5"
  assert capsys.readouterr().err == ""


def record(config, result):
  verdict = q.Verdict(result=result, tokens=64, reasons=() if result == q.PASS else ("layer 1: NMSE 1e-2 > 1e-9",))
  return q.Record(config=config, length=64, status="ok", features={}, weights_fingerprint="w", prompt={}, model={},
                  env={}, options={}, verdict=verdict)


@pytest.mark.parametrize("results, exits", [((q.PASS, q.PASS), False), ((q.PASS, q.FAIL), True)])
def test_prefill_exits_non_zero_on_a_fail(monkeypatch, results, exits):
  doc = q.Results(records=[record("all_off", results[0]), record("all_on", results[1]),
                           q.Record(config="kill_x", length=64, status="not_run", features={}, weights_fingerprint="w",
                                    prompt={}, model={}, env={}, options={})])
  monkeypatch.setenv(device_memory.VARIABLE, "0.5")
  monkeypatch.setattr(q, "options_from_flags", lambda fv: q.Options())
  monkeypatch.setattr(q, "run", lambda opts: doc)
  if exits:
    with pytest.raises(SystemExit, match="1 pass, 1 fail, 1 not run"):
      prefill_command.main(["prefill"])
  else:
    prefill_command.main(["prefill"])  # returns: exit status 0


@pytest.mark.parametrize("args, message", [
    (["--routings=bogus"], "--routings: unknown ['bogus']; known: ['uniform', 'zipf']"),
    (["--tokens=abc"], "--tokens must be positive integers, got ['abc']"),
    (["--only=torch", "--head_to_head=torch_grouped_mm_gate_up,ours_bf16_gate_up"],  # the second one never runs
     "--head_to_head takes two or more distinct contender names, each run (see --only)"),
    (["--head_to_head=torch_grouped_mm_gate_up,bogus"],
     "--head_to_head takes two or more distinct contender names, each run (see --only)"),
    (["--only=dense,bogus"], "--only: ['bogus'] match no contender (bench_moe.contenders() lists them)"),
])
def test_bench_moe_refuses_bad_input_before_any_work(args, message):
  """An unknown routing was run as Zipf and recorded under its own name; a bad token count raised a traceback; a typo
  in --only was found after the whole run."""
  p = subprocess.run([sys.executable, "-m", "experiments.bench_moe", *args], capture_output=True, text=True,
                     env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=120)
  assert p.returncode == 1 and message in p.stderr, p.stderr[-2000:]


def test_out_problem_names_what_stops_a_results_file(tmp_path):
  """Checked at start-up: a directory, a file where a folder must be, a folder root may not write in (os.access said
  yes to /proc); where nothing stops it, None, and nothing made (the writer makes the missing folders)."""
  (tmp_path / "file").write_text("x")
  assert run_record.out_problem(str(tmp_path)) == "is a directory"
  assert run_record.out_problem(str(tmp_path / "file" / "r.json")) == f"{tmp_path / 'file'} is not a directory"
  assert run_record.out_problem("/proc/no/r.json").startswith("cannot write in /proc (")
  assert run_record.out_problem(str(tmp_path / "file"), directory=True) == "is a file, not a directory"
  assert run_record.out_problem(str(tmp_path / "a" / "b" / "r.json")) is None
  assert run_record.out_problem(str(tmp_path / "c"), directory=True) is None
  assert sorted(os.listdir(tmp_path)) == ["file"]


def test_results_paths_are_checked_when_the_flags_are_parsed(tmp_path):
  """define_out_flag's check runs at parse time, and every entry point with a results path defines it that way (a
  directory as --out ended bench_moe's run in IsADirectoryError, train_tiny's after its training)."""
  from absl import flags  # pylint: disable=import-outside-toplevel

  def parse(arg, directory=False):
    fv = flags.FlagValues()
    run_record.define_out_flag(directory=directory, flag_values=fv)
    fv(["prog", arg])
    return fv.out
  (tmp_path / "file").write_text("x")
  with pytest.raises(flags.IllegalFlagValueError, match=f"^flag --out={re.escape(str(tmp_path))}: is a directory$"):
    parse(f"--out={tmp_path}")
  with pytest.raises(flags.IllegalFlagValueError, match="is a file, not a directory"):
    parse(f"--out={tmp_path / 'file'}", directory=True)
  assert parse(f"--out={tmp_path / 'new' / 'r.json'}").endswith("r.json")
  experiments = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                             "experiments")
  unchecked = [f for f in sorted(os.listdir(experiments)) if f.endswith(".py") and any(
      f'DEFINE_string("{name}"' in open(os.path.join(experiments, f)).read() for name in ("out", "json"))]
  # generate checks --json in run() (its tests run several command lines in one process); render_notebooks' --out
  # is relative to the repository, not to the working directory
  assert unchecked == ["generate.py", "render_notebooks.py"], unchecked


def test_entry_points_refuse_bad_input_in_one_line(tmp_path):
  """Each of these ran (trained for minutes, drew the weights) and then ended in a traceback, or ran nothing and
  exited 0. All but bench_moe's stop before any work (it runs the contenders --only picks, then says which patterns
picked none that this device ran: the Mosaic GPU ones run on a GPU only).
  All run at once: each is a process that starts jax, then stops."""
  tiny = ["--preset=tiny_window"]
  cases = [
      (["trace_prefill", *tiny, "--tokens=16", "--without=bogus"],
       "trace_prefill: --without: unknown switches ['bogus']"),
      (["bench_generate", *tiny, "--lengths=8", f"--prompt_file={tmp_path}/none.txt"],
       f"bench_generate: --prompt_file={tmp_path}/none.txt with --tokenizer="),
      (["init_stats", *tiny, "--tokens=5000"], "--tokens must be in [1, 128], got 5000"),
      (["train_tiny", "--val_windows=2"], "train_tiny: --val_windows must be >= 16, got 2"),
      (["bench_moe", "--smoke", "--only=dense,ours_wgmma_rocmfp3", "--routings=uniform"],
       "bench_moe: --only: ['ours_wgmma_rocmfp3'] matched no contender that ran on this device"),
  ]
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  runs = [subprocess.Popen([sys.executable, "-m", f"experiments.{args[0]}", *args[1:]], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env=env) for args, _ in cases]
  for (args, message), p in zip(cases, runs):
    _, err = p.communicate(timeout=300)
    assert p.returncode == 1 and message in err and "Traceback" not in err, (args, err[-2000:])
