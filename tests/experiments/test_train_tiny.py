"""experiments/train_tiny.py and the checkpoint it trained (experiments/checkpoints/tiny_stdlib)."""

import concurrent.futures
import json
import math
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers

from ds4jax import model as model_lib
from ds4jax.checkpoint import mapping
from ds4jax.checkpoint.safetensors_reader import SafetensorsCheckpoint
from ds4jax.config import Attention, Routing
from experiments import train_tiny

CKPT = pathlib.Path(__file__).resolve().parents[2] / "experiments" / "checkpoints" / "tiny_stdlib"
UNIFORM = math.log(256)


@pytest.fixture(scope="module")
def trained():
  return mapping.load_checkpoint(CKPT, dtype=jnp.float32, log=None)


def random_text(rng, n: int) -> str:
  """Code points from every UTF-8 length (1 to 4 bytes), whitespace and controls included; no surrogates."""
  ranges = [(0, 0x80), (0x80, 0x800), (0x800, 0xD800), (0xE000, 0x10000), (0x10000, 0x110000)]
  lo, hi = np.array(ranges).T
  pick = rng.integers(0, len(ranges), n)
  return "".join(chr(int(c)) for c in rng.integers(lo[pick], hi[pick]))


def test_tokenizer_ids_are_the_utf8_bytes(rng):
  tok = tokenizers.Tokenizer.from_file(str(CKPT / "tokenizer.json"))
  texts = ["", "x", "  def f(x):\n\treturn x  \n\n", " leading space", "trailing  ", "\r\n\x00\x01\x7f",
           "héllo — 日本語 🐍", "".join(map(chr, range(128))), random_text(rng, 300)]
  for text in texts:
    ids = tok.encode(text).ids
    assert ids == list(text.encode("utf-8")), repr(text[:40])
    assert tok.decode(ids) == text
  assert tok.get_vocab_size() == 256
  assert json.loads((CKPT / "tokenizer.json").read_text()) == train_tiny.tokenizer_json()


def test_checkpoint_is_official_layout_and_small():
  cfg = json.loads((CKPT / "config.json").read_text())
  assert set(cfg["layer_types"]) == {a.value for a in Attention}
  assert set(cfg["mlp_layer_types"]) == {r.value for r in Routing}
  with SafetensorsCheckpoint(CKPT) as ckpt:
    dtypes = {n: ckpt.spec(n).dtype for n in ckpt.names()}
  assert dtypes["layers.1.attn.wq_b.weight"] == "F8_E4M3" and dtypes["layers.1.attn.wq_b.scale"] == "F8_E8M0"
  assert dtypes["layers.1.ffn.experts.0.w1.weight"] in ("I8", "U8")  # packed FP4 E2M1
  assert sum(p.stat().st_size for p in CKPT.iterdir()) <= 10 * 2**20


def test_checkpoint_predicts_held_out_source(trained, seed):
  prompt = (CKPT / "prompt.txt").read_bytes()
  assert len(prompt) >= 256 and prompt.isascii()
  # The random init (eager ops, each compiled on first use) runs beside the forward's compile: two cores.
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    random_model = pool.submit(model_lib.init_random, trained.cfg, seed=seed, dtype=jnp.float32)
    loss = train_tiny.byte_loss(trained, prompt)
    untrained = train_tiny.byte_loss(random_model.result(), prompt)
  print(f"prompt.txt: {loss:.3f} nats/byte trained, {untrained:.3f} random init, {UNIFORM:.3f} uniform")
  assert loss < 3.0
  assert untrained > loss + 2.0
  record = json.loads((CKPT / "training.json").read_text())
  assert loss == pytest.approx(record["final"]["prompt_loss_stored"], abs=1e-3)  # the recorded number is this one


def test_training_record_has_a_decreasing_loss_curve():
  record = json.loads((CKPT / "training.json").read_text())
  curve = record["curve"]
  n = len(curve["step"])
  assert n >= 5 and all(len(v) == n for v in curve.values())
  assert curve["step"] == sorted(curve["step"]) and curve["step"][0] == 0
  val, train = curve["val_loss"], curve["train_loss"]
  assert val[0] > UNIFORM and val[-1] < 2.5 and train[-1] < 2.5
  assert all(b < a + 0.05 for a, b in zip(val, val[1:]))  # no step of the curve goes up by more than noise
  assert record["final"]["val_loss"] == val[-1]
  assert abs(record["final"]["val_loss_stored"] - val[-1]) < 0.05  # FP8/FP4 storage costs little
  assert curve["indexer_recall"][-1] > curve["indexer_recall"][0]  # distillation taught the indexer
  assert record["corpus"]["files"] == record["corpus"]["train_files"] + record["corpus"]["val_files"]


def test_train_step_reduces_loss_and_trains_the_indexer(rng, seed):
  """A one-layer CSA model (indexer and top-k router included) on one seeded batch of 32-byte windows."""
  cfg = train_tiny.model_config(attention=(Attention.CSA,), routing=(Routing.TOPK,))
  h = train_tiny.Hyper(steps=5, batch=2, lr=1e-2, warmup=1, seed=seed)
  state = train_tiny.init_state(cfg, h)
  layer = lambda: state.model().layers[0]
  bias0 = np.asarray(layer().ffn.gate.bias[...])
  index0 = np.asarray(layer().attn.indexer.wq_b.weight[...])
  step = train_tiny.make_train_step(state.graphdef, h, train_tiny.LOW_OPT)  # compiles in half the time
  batch = train_tiny.sample_windows(np.frombuffer(b"def f(x):\n  return x + 1\n" * 20, np.uint8), rng, 2, 32)
  metrics = train_tiny.train_steps(state, step, [batch] * h.steps)
  assert metrics[-1]["lm"] < metrics[0]["lm"] - 1.0
  # The LM loss cannot reach the indexer (top-k): only the distillation moves it, by Adam steps of ~lr per weight
  # (weight decay alone would move it by lr * decay * |w|, a hundred times less).
  moved = np.mean(np.abs(np.asarray(layer().attn.indexer.wq_b.weight[...]) - index0)) / np.mean(np.abs(index0))
  assert moved > 0.02
  assert np.isfinite(metrics[-1]["distill"]) and 0.0 <= metrics[-1]["recall"] <= 1.0
  assert not np.array_equal(np.asarray(layer().ffn.gate.bias[...]), bias0)  # balancing moved it
