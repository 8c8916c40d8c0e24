"""python -m experiments.generate, end to end in a subprocess (its flags are module-level, like every entry point's):
--speculate gives greedy decoding's tokens, the figures it writes, one-line errors."""

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np

from ds4jax import config, decode, model

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def generate(*args):
  env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", "experiments.generate", "--preset=tiny_window", *args], cwd=REPO,
                        env=env, capture_output=True, text=True, timeout=300)


def test_speculative_generation_gives_greedys_tokens(tmp_path):
  path = tmp_path / "g.json"
  p = generate("--prompt_ids=7,8,9,7,8", "--max_new_tokens=12", "--speculate", f"--json={path}")
  assert p.returncode == 0, p.stderr[-2000:]
  assert "tok/s" in p.stdout and "12/12 tokens" in p.stdout  # the summary and the progress line
  got = json.loads(path.read_text())
  m = model.init_random(config.tiny_window(), 0, jnp.float32)  # the command's weights: --seed=0, --dtype=f32
  want = decode.generate(m, np.asarray([7, 8, 9, 7, 8]), 12)
  assert got["tokens"] == want.tolist() and len(set(got["tokens"])) > 1
  assert 11 <= got["bands"] + got["accepted"] < 16 and got["decode_tok_per_s"] > 0 and got["speculate"]
  assert got["features"]["bf16_matmul"] is False and got["prompt_tokens"] == 5


def test_bad_input_is_one_line():
  p = generate("--prompt_ids=7,8,300", "--max_new_tokens=4")
  assert p.returncode == 1 and p.stderr.strip().splitlines()[-1] == (
      "generate: token id 300 at position 2 is outside the vocabulary [0, 256) (1 bad ids in all)")
