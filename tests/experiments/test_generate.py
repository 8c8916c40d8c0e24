"""python -m experiments.generate, end to end in a subprocess (its flags are module-level, like every entry point's):
--speculate gives greedy decoding's tokens, the figures it writes, one-line errors."""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def generate(*args):
  env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", "experiments.generate", "--preset=tiny_window", *args], cwd=REPO,
                        env=env, capture_output=True, text=True, timeout=300)


def test_speculative_generation_gives_greedys_tokens(tmp_path):
  path = tmp_path / "g.json"
  prompt = ",".join(str(i) for i in range(0, 256, 3))  # one-token n-grams then find drafts in it
  p = generate(f"--prompt_ids={prompt}", "--max_new_tokens=12", "--speculate", "--ngram=1", "--compare_greedy",
               f"--json={path}", "--stop_ids=")
  assert p.returncode == 0, p.stderr[-2000:]
  assert "tok/s" in p.stdout and "12/12 tokens" in p.stdout  # the summary and the progress line
  assert "the same tokens as greedy decoding without verification" in p.stdout
  got = json.loads(path.read_text())
  assert got["same_as_greedy"] is True and len(got["tokens"]) == 12 and len(set(got["tokens"])) > 1
  assert got["stop_ids"] == [] and not got["stopped"]
  # a stop id (the EOS id by default) ends it at its first occurrence, included
  tokens, stop = got["tokens"], got["tokens"][6]
  end = tokens.index(stop) + 1
  assert end > 1, tokens
  p = generate(f"--prompt_ids={prompt}", "--max_new_tokens=12", "--speculate", "--ngram=1", "--compare_greedy",
               f"--json={path}", f"--stop_ids={stop}")
  assert p.returncode == 0, p.stderr[-2000:]
  assert f"stopped by token id {stop} (--stop_ids) after {end} of 12 tokens" in p.stdout
  stopped = json.loads(path.read_text())
  assert stopped["tokens"] == tokens[:end] and stopped["stopped"] and stopped["same_as_greedy"] is True
  assert 11 <= got["bands"] + got["accepted"] < 16 and got["decode_tok_per_s"] > 0 and got["speculate"]
  assert got["features"]["bf16_matmul"] is False and got["prompt_tokens"] == 86 and got["drafted"] > 0
  assert got["cache_dtype"] == "f32"


def test_bad_input_is_one_line():
  p = generate("--prompt_ids=7,8,300", "--max_new_tokens=4")
  assert p.returncode == 1 and p.stderr.strip().splitlines()[-1] == (
      "generate: token id 300 at position 2 is outside the vocabulary [0, 256) (1 bad ids in all)")
  p = generate("--prompt_ids=7,8", "--max_new_tokens=4", "--stop_ids=1,256")
  assert p.returncode == 1 and p.stderr.strip().splitlines()[-1] == (
      "generate: --stop_ids: token id 256 at position 1 is outside the vocabulary [0, 256) (1 bad ids in all)")
  p = generate("--prompt_ids=7,8", "--max_new_tokens=4", "--json=/proc/no/g.json")  # refused before generating
  assert p.returncode == 1 and p.stderr.strip().splitlines()[-1] == (
      "generate: --json=/proc/no/g.json: its directory is not writable")


def test_a_checkpoint_the_switches_cannot_take_is_refused_before_its_weights(tmp_path):
  """The switches are checked against the checkpoint's config.json before any tensor is read (a directory with the
  config alone shows it): loading ~100 GB to refuse a switch afterwards is no start-up check."""
  config = os.path.join(REPO, "experiments", "checkpoints", "tiny_stdlib", "config.json")
  (tmp_path / "config.json").write_text(open(config).read())
  p = generate(f"--checkpoint={tmp_path}", "--prompt_ids=7,8", "--max_new_tokens=2", "--bf16_matmul",
               "--moe_sparse_gate_up", "--moe_wgmma_gate_up")
  assert p.returncode == 1 and p.stderr.strip().splitlines()[-1].startswith("generate: --moe_wgmma_gate_up ")
  p = generate(f"--checkpoint={tmp_path}", "--prompt_ids=7,8", "--max_new_tokens=2", "--stop_ids=x")
  assert p.returncode == 1 and p.stderr.strip().splitlines()[-1].startswith("generate: --stop_ids: invalid literal")
