"""experiments/processes.py: one run over two processes (jax.distributed on localhost, gloo collectives on the CPU),
the trained checkpoint's routed experts and the prompt's attention queries split over the two processes' devices (each
process reads its own experts), gives one process's tokens, and only process 0 writes its results; an incomplete
description of the processes is refused in one line."""

import json
import os
import socket
import subprocess
import sys

import pytest

from experiments import processes

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPT = ",".join(str(i) for i in range(3, 60, 5))
CHECKPOINT = os.path.join(REPO, "experiments", "checkpoints", "tiny_stdlib")


def generate(*args, **env):
  full = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu", **env)
  return subprocess.Popen([sys.executable, "-m", "experiments.generate", f"--checkpoint={CHECKPOINT}",
                           f"--prompt_ids={PROMPT}", "--max_new_tokens=2", *args], cwd=REPO, env=full,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def test_two_processes_give_one_process_tokens_and_only_process_0_writes(tmp_path):
  address = f"localhost:{free_port()}"
  runs = {i: generate("--mesh=expert+query=2", f"--json={tmp_path / f'p{i}.json'}", f"--coordinator_address={address}",
                      "--num_processes=2", f"--process_id={i}") for i in (0, 1)}
  runs["one"] = generate(f"--json={tmp_path / 'one.json'}")  # one process, one device, no mesh
  out = {k: p.communicate(timeout=300) for k, p in runs.items()}
  for k, p in runs.items():
    assert p.returncode == 0, (k, out[k][1][-3000:])
  assert "process 0 of 2 (coordinator localhost:" in out[0][0] and "1 of 2 devices here" in out[0][0]
  assert "this process writes the results" in out[0][0] and "process 1 of 2" in out[1][0]
  assert ("mesh expert+query=2: 4 of 8 routed experts per device on 2 devices; each band's attention split by "
          "queries over 2 devices") in out[0][0]
  assert not (tmp_path / "p1.json").exists()  # process 1 computed the same, wrote nothing
  sharded, one = (json.loads((tmp_path / f).read_text()) for f in ("p0.json", "one.json"))
  assert sharded["tokens"] == one["tokens"] and len(set(one["tokens"] + [int(t) for t in PROMPT.split(",")])) > 3
  assert sharded["mesh"] == "expert+query=2" and one["mesh"] == ""


@pytest.mark.parametrize("kw, env, message", [
    (dict(num_processes=2, process_id=0), {}, "--num_processes / --process_id need --coordinator_address"),
    (dict(coordinator_address="localhost:1"), {}, "--coordinator_address=localhost:1 needs --num_processes and"),
    (dict(coordinator_address="localhost:1", num_processes=2, process_id=2), {}, "--process_id=2 must lie in [0,"),
    ({}, {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "two"}, "$JAX_NUM_PROCESSES='two' is not an"),
])
def test_an_incomplete_description_is_refused(monkeypatch, kw, env, message):
  for name in processes.ENV.values():
    monkeypatch.delenv(name, raising=False)
  for name, value in env.items():
    monkeypatch.setenv(name, value)
  with pytest.raises(processes.ProcessError) as e:
    processes.start(**kw)
  assert str(e.value).startswith(message)


def test_one_process_by_default(monkeypatch):
  for name in processes.ENV.values():
    monkeypatch.delenv(name, raising=False)
  assert processes.start() == "" and processes.writes()
