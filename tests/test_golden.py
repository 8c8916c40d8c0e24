"""The reference model against Hugging Face transformers' DeepseekV4ForCausalLM (goldens in tests/goldens/).

The goldens' weights are loaded through ds4jax's own safetensors loader (official names; one sharded).
"""

import pathlib

import chex
import numpy as np
import pytest

from ds4jax import decode, model, prefill
from ds4jax.checkpoint.mapping import load_checkpoint
from ds4jax.metrics import nmse

GOLDENS = pathlib.Path(__file__).parent / "goldens"
ATOL = 1e-4  # f32, every position


@pytest.fixture(scope="module", params=["mixed", "csa_topk", "hca_hash"])
def golden(request):
  d = GOLDENS / request.param
  m = load_checkpoint(d, dtype=np.float32, log=None)
  g = dict(np.load(d / "golden.npz"))
  logits, streams = model.forward(m, g["input_ids"], return_streams=True)
  return request.param, g, np.asarray(logits), np.asarray(streams), m


def test_logits_match_transformers_at_every_position(golden):
  name, g, logits, _, _ = golden
  err = np.abs(logits - g["logits"]).max()
  print(f"{name}: S={len(g['input_ids'])} max|logit|={np.abs(g['logits']).max():.3f} "
        f"max abs err={err:.3e} NMSE={nmse(logits, g['logits']):.3e}")
  assert np.abs(g["logits"]).max() > 1.0  # the golden is not degenerate
  chex.assert_trees_all_close(logits, g["logits"], atol=ATOL, rtol=0)


def test_streams_match_after_every_layer(golden):
  """hidden_states[0] is the embedding copied into the streams, [i] the output of layer i-1."""
  name, g, _, streams, _ = golden
  assert streams.shape == g["hidden_states"].shape
  for i, (ours, theirs) in enumerate(zip(streams, g["hidden_states"])):
    chex.assert_trees_all_close(ours, theirs, atol=ATOL, rtol=1e-4, custom_message=f"{name} stream {i}")


def test_top1_agrees(golden):
  _, g, logits, _, _ = golden
  assert (logits.argmax(-1) == g["logits"].argmax(-1)).mean() == 1.0


def test_golden_comparison_can_fail(golden):
  """A one-ulp-scale bug would show: perturbing the prompt changes the logits far beyond the tolerance."""
  _, g, _, _, m = golden
  ids = g["input_ids"].copy()
  ids[len(ids) // 2] = (ids[len(ids) // 2] + 1) % 256
  moved = np.abs(np.asarray(model.forward(m, ids, return_streams=True)[0]) - g["logits"])[len(ids) // 2:].max()
  assert moved > 100 * ATOL


def test_decode_matches_transformers(golden):
  """ds4jax.decode from a 13-token prefix (not a multiple of 4 or 8), one token at a time, against transformers'
  logits (whose own cached decode make_goldens.py checked against them). `mixed` holds every layer kind; the other
  two goldens add nothing decode-specific and would cost a compile of every band width each."""
  name, g, _, _, m = golden
  if name != "mixed":
    pytest.skip("decode is checked on the `mixed` golden")
  ids, prefix = g["input_ids"], 13
  state = decode.start(m, ids[:prefix], capacity=len(ids), widest=1)
  got = [np.asarray(state.logits)]
  for t in ids[prefix:-1]:
    logits, state = decode.extend(m, state, [t])
    got.append(np.asarray(logits[0]))
  chex.assert_trees_all_close(np.stack(got), g["logits"][prefix - 1:-1], atol=ATOL, rtol=0)


def test_indexer_picks_are_transformers(golden):
  """Each CSA layer's indexer choices, at every position, are the rows transformers' indexer picked (the goldens
  store them): agreement on the decisions themselves, not only through the logits' tolerance. The picks are real
  choices: later positions see more compressed rows than the indexer keeps."""
  name, g, _, _, m = golden
  layers = sorted(int(k.removeprefix("topk_layer")) for k in g if k.startswith("topk_layer"))
  if not layers:
    pytest.skip(f"{name} has no CSA layer")
  made = []
  prefill.prefill(m, g["input_ids"], decisions=made)
  for i in layers:
    ours, theirs = np.asarray(made[i].index_rows), g[f"topk_layer{i}"]
    picked = lambda rows: [sorted(r[r >= 0].tolist()) for r in rows]
    assert picked(ours) == picked(theirs), f"{name} layer {i}"
    visible = (np.arange(len(g["input_ids"])) + 1) // m.cfg.csa_ratio
    assert (visible > theirs.shape[1]).any() and (theirs >= 0).sum() > theirs.shape[1]
