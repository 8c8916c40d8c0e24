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


# The entry point's main on several command lines in one subprocess (its flags are module-level): a later run finds
# the earlier's programs in memory, and none pays jax's start-up (~2 s) again. Each command line is one JSON line on
# its stdin; what the run prints (stderr too) follows, then ENDED and how it ended: 0, or SystemExit's code (a
# one-line refusal's message, exit status 1).
RUNS = """
import json, sys
from absl import flags
from experiments import generate
for line in sys.stdin:
  flags.FLAGS.unparse_flags()
  flags.FLAGS(["generate", "--preset=tiny_window", *json.loads(line)])
  try:
    generate.main([])
    code = 0
  except SystemExit as e:
    code = e.code
  print("ENDED " + json.dumps(code), flush=True)
"""


class Generate:
  """`generate` in one subprocess; `run(*args)` gives (what it printed, 0 or SystemExit's code)."""

  def __init__(self):
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    self.p = subprocess.Popen([sys.executable, "-c", RUNS], cwd=REPO, env=env, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

  def run(self, *args):
    self.p.stdin.write(json.dumps(args) + "\n")
    self.p.stdin.flush()
    out = []
    for line in self.p.stdout:
      if line.startswith("ENDED "):
        return "".join(out), json.loads(line.removeprefix("ENDED "))
      out.append(line)
    raise AssertionError(f"the subprocess ended: {''.join(out)[-3000:]}")

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.p.stdin.close()
    assert self.p.wait(timeout=300) == 0 or exc[0] is not None


def test_speculative_generation_gives_greedys_tokens(tmp_path):
  path = tmp_path / "g.json"
  prompt = ",".join(str(i) for i in range(0, 256, 3))  # one-token n-grams then find drafts in it
  args = [f"--prompt_ids={prompt}", "--max_new_tokens=12", "--speculate", "--ngram=1", "--compare_greedy",
          f"--json={path}"]
  with Generate() as g:
    out, code = g.run(*args, "--stop_ids=")
    assert code == 0, out[-2000:]
    assert "tok/s" in out and "12/12 tokens" in out  # the summary and the progress line
    assert "the same tokens as greedy decoding without verification" in out
    got = json.loads(path.read_text())
    assert got["same_as_greedy"] is True and len(got["tokens"]) == 12 and len(set(got["tokens"])) > 1
    assert got["stop_ids"] == [] and not got["stopped"]
    # a stop id (the EOS id by default) ends it at its first occurrence, included
    tokens, stop = got["tokens"], got["tokens"][6]
    end = tokens.index(stop) + 1
    assert end > 1, tokens
    out, code = g.run(*args, f"--stop_ids={stop}")
  assert code == 0, out[-2000:]
  assert f"stopped by token id {stop} (--stop_ids) after {end} of 12 tokens" in out
  stopped = json.loads(path.read_text())
  assert stopped["tokens"] == tokens[:end] and stopped["stopped"] and stopped["same_as_greedy"] is True
  assert 11 <= got["bands"] + got["accepted"] < 16 and got["decode_tok_per_s"] > 0 and got["speculate"]
  assert got["features"]["bf16_matmul"] is False and got["prompt_tokens"] == 86 and got["drafted"] > 0
  assert got["cache_dtype"] == "f32"


def test_bad_input_is_one_line(tmp_path):
  (tmp_path / "tokenizer.json").write_text("{not json")
  with Generate() as g:  # each ends in SystemExit with its line (a traceback or a finished run fails here)
    assert g.run("--prompt_ids=7,8,300", "--max_new_tokens=4")[1] == (
        "generate: --prompt_ids: token id 300 at position 2 is outside the vocabulary [0, 256) (1 bad ids in all)")
    assert g.run("--prompt_ids=7,8", "--max_new_tokens=4", "--stop_ids=1,256")[1] == (
        "generate: --stop_ids: token id 256 at position 1 is outside the vocabulary [0, 256) (1 bad ids in all)")
    # before generating: a directory, and a place os.access says root may write (the run's results were lost)
    assert g.run("--prompt_ids=7,8", "--max_new_tokens=4", f"--json={tmp_path}")[1] == (
        f"generate: --json={tmp_path}: is a directory")
    assert g.run("--prompt_ids=7,8", "--max_new_tokens=4", "--json=/proc/no/g.json")[1].startswith(
        "generate: --json=/proc/no/g.json: cannot write in /proc (")
    assert g.run("--prompt_ids=7,8", "--speculate", "--ngram=0")[1] == (  # it ran with no drafts
        "generate: --ngram must be >= 1, got 0")
    assert g.run(f"--prompt_ids={','.join(['7'] * 200)}")[1] == (  # tiny_window has 128 positions
        "generate: --prompt_ids: prompt of 200 tokens exceeds max_position_embeddings=128")
    assert g.run(f"--checkpoint={tmp_path / 'none'}", "--prompt_ids=7")[1] == (  # FileNotFoundError
        f"generate: {tmp_path / 'none'} does not exist")
    assert g.run(f"--tokenizer={tmp_path / 'tokenizer.json'}", "--prompt=hi")[1].startswith(  # a bare Exception
        f"generate: {tmp_path / 'tokenizer.json'} cannot be read as a tokenizer: ")


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
