"""What the entry points do before and after the library: device memory, exit status, refused inputs."""

import os

import pytest

from experiments import device_memory
from experiments import parity_by_switch as pbs
from experiments import prefill as prefill_command
from experiments import qualification as q


def test_memory_fraction_is_set_only_when_the_user_has_not(monkeypatch, capsys):
  monkeypatch.delenv(device_memory.VARIABLE, raising=False)
  assert device_memory.claim() == "0.95" and os.environ[device_memory.VARIABLE] == "0.95"
  assert "set by ds4jax" in capsys.readouterr().err
  monkeypatch.setenv(device_memory.VARIABLE, "0.5")
  assert device_memory.claim() == "0.5" and os.environ[device_memory.VARIABLE] == "0.5"
  assert capsys.readouterr().err == ""


def record(config, kl, prefix=None):
  parity = dict(kl=kl, kl_gate=0.006, finite=True, prefix_tokens=prefix)
  parity["pass"] = kl <= 0.006
  return dict(length=64, config=config, status="ok", timing=dict(tokens_per_s=100.0), parity=parity)


@pytest.mark.parametrize("kls, exits", [((0.001, 0.002), False), ((0.001, 0.5), True)])
def test_prefill_exits_non_zero_on_a_fail(monkeypatch, kls, exits):
  doc = dict(records=[record("all_off", kls[0]), record("all_on", kls[1]),
                      dict(length=64, config="kill_x", status="not_run", timing=None, parity=None)])
  monkeypatch.setenv(device_memory.VARIABLE, "0.5")
  monkeypatch.setattr(q, "options_from_flags", lambda fv: q.Options())
  monkeypatch.setattr(q, "run", lambda opts: doc)
  if exits:
    with pytest.raises(SystemExit, match="1 pass, 1 fail, 1 not run"):
      prefill_command.main(["prefill"])
  else:
    prefill_command.main(["prefill"])  # returns: exit status 0


def test_parity_by_switch_refuses_tokens_outside_the_prompt(monkeypatch, tmp_path):
  """No run and nothing written when --tokens exceeds the prompt (the store would file a shorter prefix under it)."""
  class Flags:
    variants, tokens, per_layer, end_to_end, results = ["all_on"], 65, False, True, None
  monkeypatch.setattr(pbs, "FLAGS", Flags)
  monkeypatch.setattr(q, "build_model", lambda *a: pytest.fail("the model was built"))
  opts = q.Options(preset="tiny", lengths=(64,), out=str(tmp_path / "q.json"))
  with pytest.raises(q.StartupError, match="--tokens=65 lies outside the 64-token prompt"):
    pbs.run(opts)
  assert list(tmp_path.iterdir()) == []
