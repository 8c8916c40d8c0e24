"""What the entry points do before and after the library: device memory, exit status, refused inputs."""

import os
import subprocess
import sys

import pytest

from experiments import device_memory
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
])
def test_bench_moe_refuses_bad_input_before_any_work(args, message):
  """An unknown routing was run as Zipf and recorded under its own name; a bad token count raised a traceback."""
  p = subprocess.run([sys.executable, "-m", "experiments.bench_moe", *args], capture_output=True, text=True,
                     env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=120)
  assert p.returncode == 1 and message in p.stderr, p.stderr[-2000:]
