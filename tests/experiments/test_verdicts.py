"""experiments/verdicts.py: per-layer pinned parity and decision accounting pass the real paths and fail every
planted bug of experiments/mutations.py (the tiny_sparse model: window, CSA, HCA, CSA layers)."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ds4jax import attention, config, features, model
from experiments import mutations, verdicts
from experiments.qualification import matrix, runner

DEVICE = "cpu_interpret"
# the Mosaic GPU switches need D, I multiples of 256, which the tiny model is not (tests/test_model_features.py)
SUPPORTED = [s for s, cap in features.CAPABILITIES[DEVICE].items()
             if cap.supported and s not in features.WGMMA_SWITCHES]


@pytest.fixture(scope="module")
def tiny(module_seed):
  m = model.init_random(config.tiny_sparse(), seed=module_seed, dtype=jnp.float32)
  return m, np.random.default_rng(module_seed).integers(0, m.cfg.vocab_size, 24)


def exact():
  return features.resolve(DEVICE, {s: False for s in features.SWITCHES})


def test_flips_are_near_ties_or_named():
  scores = np.array([[3.0, 2.0, 1.0, 0.999999, -np.inf]])
  want = np.array([[0, 1, 2]])
  n, bad = verdicts.flips(want, scores, np.array([[0, 1, 3]]), 2.0 ** -8, 7, "route")
  assert n == 1 and bad == []  # 1.0 vs 0.999999: within 16 bf16 roundings of the scale 3
  n, bad = verdicts.flips(want, scores, np.array([[1, 2, 3]]), 2.0 ** -8, 7, "route")
  assert n == 1 and len(bad) == 1 and bad[0].gap == pytest.approx(3.0 - 0.999999) and bad[0].layer == 7
  n, bad = verdicts.flips(want, scores, np.array([[0, 1, 4]]), 2.0 ** -8, 7, "index")  # an invisible row
  assert n == 1 and bad[0].gap == np.inf and bad[0].kind == "index"
  n, bad = verdicts.flips(want, scores, np.array([[0, 1, -1]]), 2.0 ** -8, 7, "index")  # a row left out
  assert n == 1 and bad[0].gap == np.inf
  assert verdicts.flips(want, scores, np.array([[2, 0, 1]]), 2.0 ** -24, 0, "route") == (0, [])  # order is free
  # an id past the scores (a kernel's "none" other than -1) is never a tie, and no reason to stop judging
  n, bad = verdicts.flips(want, scores, np.array([[0, 1, 5]]), 2.0 ** -8, 7, "index")
  assert n == 1 and len(bad) == 1 and bad[0].gap == np.inf
  n, bad = verdicts.flips(want, scores, np.array([[0, 1, 2], [0, 1, 2**31 - 1]])[:1], 2.0 ** -8, 7, "index")
  assert (n, bad) == (0, [])
  # hash routing does not pick by the scores: the near-tie above is a bad flip there
  n, bad = verdicts.flips(want, scores, np.array([[0, 1, 3]]), 2.0 ** -8, 7, "route", ties=False)
  assert n == 1 and len(bad) == 1 and bad[0].gap == np.inf
  assert verdicts.flips(want, scores, np.array([[2, 0, 1]]), 2.0 ** -8, 7, "route", ties=False) == (0, [])


def test_update_nmse_ignores_the_residual(rng):
  x = rng.normal(size=(8, 4)) * 100
  upd = rng.normal(size=(8, 4))
  nmse, max_abs = verdicts.update_errors(*(jnp.asarray(a, jnp.float32) for a in (x + 1.1 * upd, x + upd, x)))
  assert nmse == pytest.approx(0.01, rel=1e-3) and max_abs == pytest.approx(0.1 * np.abs(upd).max(), rel=1e-3)
  # A layer whose exact update is zero: no error is 0, any error is inf (as the qualification's NMSE).
  same = jnp.asarray(x, jnp.float32)
  assert verdicts.update_errors(same, same, same)[0] == 0.0
  assert verdicts.update_errors(same + jnp.asarray(upd, jnp.float32), same, same)[0] == np.inf


def test_every_fast_path_passes(tiny):
  """Every CPU-advertised switch at once, bf16 operands (the device default): each layer within 4x the bf16
  reference math, every flip a near-tie. A CSA layer: the indexer, sparse MLA and MoE kernels at once (each
  kernel's parity on every layer kind, on f32 operands, is tests/test_model_features.py's)."""
  m, ids = tiny
  cfg = features.resolve(DEVICE, {s: s in SUPPORTED for s in features.SWITCHES})
  lines, kernels = [], []

  def run_layer(i, block, X, tokens, f, pinned):  # the kernels each judged run traces to: the fast path ran
    run = lambda x: verdicts.default_run_layer(i, block, x, tokens, f, pinned)
    kernels.append([name for name, _ in features.pallas_calls(lambda x: run(x)[0], X)])
    return run(X)

  out = verdicts.layer_verdicts(m, ids, cfg, run_layer=run_layer, log=lines.append, only={1})
  print("\n".join(lines))
  assert [v.layer for v in out] == [1] and all(v.passed for v in out), lines
  assert all(v.reference_bf16_nmse > 1e-9 and v.bound <= verdicts.ABS_CAP for v in out)
  layer = ["mla_stream_fast_exp", "moe_gate_up_persistent", "moe_down_persistent", "moe_combine"]
  assert kernels == [layer, ["indexer_scores", "indexer_radix_select", *layer]]  # pinned ids, then its own picks


def test_teacher_forced_kl_is_relative_to_the_bf16_reference_and_fails_a_planted_bug(tiny):
  """End to end with every layer's choices pinned: the bf16 reference math is its own bound (ratio 1), the exact
  path is 0, a dropped sink in layer 0 fails."""
  m, ids = tiny
  bf16 = dataclasses.replace(exact(), bf16_matmul=True)
  lines, handed = [], []
  out = verdicts.judge(m, ids, dict(bf16=bf16, exact=exact(), sink=exact()),
                       runners=dict(sink=mutations.run_layer(mutations.dropped_sink, {0})),
                       models=dict(sink=mutations.mutated_model(m, mutations.dropped_sink, {0})),
                       log=lines.append, only=dict(bf16={0}, exact={0}, sink={0}),
                       on_layers=lambda j: handed.append((len(lines), j)))
  print("\n".join(lines))
  # the per-layer judgements are handed over once, before any teacher-forced KL is logged
  [(at, early)] = handed
  assert not any("teacher-forced" in s for s in lines[:at]) and any("teacher-forced" in s for s in lines[at:])
  assert {n: (j.layers, j.teacher_forced) for n, j in early.items()} == {n: (j.layers, None) for n, j in out.items()}
  ref = out["bf16"].teacher_forced.reference_bf16_mean_kl
  assert out["bf16"].passed and out["bf16"].teacher_forced.mean_kl == ref > 1e-8
  assert out["exact"].passed and out["exact"].teacher_forced.mean_kl < 1e-3 * ref
  sink = out["sink"]
  assert not sink.passed and sink.teacher_forced.mean_kl > 10 * sink.teacher_forced.bound
  assert [v.layer for v in sink.layers] == [0] and not sink.layers[0].passed
  assert "teacher-forced KL" in sink.reasons()[-1]
  assert all(m.layers[i] is mutations.mutated_model(m, mutations.dropped_sink, {0}).layers[i] for i in (1, 2, 3))


def test_every_mutation_has_a_layer_kind_in_tiny_sparse():
  """Each planted bug finds its layer in tiny_sparse (the CI qualification plants all of them there,
  tests/experiments/test_qualification.py); a kind the model lacks is an error, not a silent skip."""
  cfg = config.tiny_sparse()
  assert {n: mutations.default_layer(cfg, n) for n in mutations.MUTATIONS} == dict(
      dropped_sink=0, expert_scale_step=0, window_off_by_one=0, index_topk_minus_one=1, routed_scale_dropped=0,
      compressor_bias_dropped=1, hash_routed_by_score=0, kv_tail_dropped=0, compressed_rows_dropped=1)
  with pytest.raises(ValueError, match=r"^the planted bug index_topk_minus_one needs a layer of kind "
                                       r"\['compressed_sparse_attention'\]; tiny_window has none$"):
    mutations.default_layer(config.tiny_window(), "index_topk_minus_one")
  with pytest.raises(ValueError, match=r"needs a layer of kind \['hash_moe'\]"):  # a model without a hash layer
    mutations.default_layer(dataclasses.replace(cfg, routing=cfg.routing[1:2] * 4), "hash_routed_by_score")


def test_a_hash_layer_routed_by_its_scores_fails_only_by_its_flips(tiny):
  """hash_routed_by_score: pinned to the exact path's experts its layer is exact (NMSE 0), so only the decision
  accounting sees it; the experts it takes over the token's own have higher scores (no negative gap can be a tie
  where the exact path does not pick by score)."""
  m, ids = tiny
  bug = mutations.run_layer(mutations.hash_routed_by_score, {0})
  [v] = verdicts.layer_verdicts(m, ids, exact(), bug, only={0})
  assert v.routing == "hash_moe" and v.update_nmse == 0.0 and v.route_flips > 0
  assert not v.passed and v.bad_flips and all(f.kind == "route" and f.gap == np.inf for f in v.bad_flips)


def test_verdict_bands_keep_the_configurations_query_chunks():
  """A configuration's chunks scale with the verdict's bands: chunks within its bands stay chunks within the verdict
  bands, one that runs a single band in chunks (the whole prompt, as kill_prefill_band_tokens at 32768) runs the
  prefix in verdict-band chunks, and one whose chunk spans its band stays unchunked."""
  f = lambda band, chunk: dataclasses.replace(exact(), prefill_band_tokens=band, long_context_chunk=chunk)
  banded = lambda feats, b: (lambda g: (g.prefill_band_tokens, g.long_context_chunk))(
      verdicts.banded_features(feats, b))
  assert banded(f(8192, 2048), 16) == (16, 4)   # four chunks a band
  assert banded(f(8192, 2048), 12) == (12, 3)
  assert banded(f(8192, 4096), 12) == (12, 6)
  assert banded(f(0, 8192), 16) == (0, 16)      # one band, in chunks of the verdict band
  assert banded(f(8192, 8192), 16) == (16, 8192)  # a chunk that spans the band is no chunk
  assert banded(f(8192, 0), 16) == (16, 0) and banded(f(0, 0), 16) == (0, 0)
  assert verdicts.banded_features(f(0, 8192), 0) == f(0, 8192)


def test_a_bug_only_in_chunked_attention_fails_in_the_verdict_bands(tiny, monkeypatch):
  """A configuration that runs its prompt as one band in query chunks (kill_prefill_band_tokens at long prompts)
  is judged in chunks: a bug that only chunked attention has (planted: its output scaled by 1.01 when a band is
  split) FAILs it, at its layer and end to end, where the prefix's one unchunked band would pass."""
  m, ids = tiny
  attend = attention.Attention.attend

  def chunked_wrong(self, q, *args):
    o = attend(self, q, *args)
    return o * 1.01 if attention.query_chunks(q.shape[0], args[-1]) > 1 else o

  monkeypatch.setattr(attention.Attention, "attend", chunked_wrong)
  jax.clear_caches()  # programs traced before the plant would hide it
  try:
    one_band_in_chunks = dataclasses.replace(exact(), prefill_band_tokens=0, long_context_chunk=8192)
    out = verdicts.judge(m, ids, dict(chunks=one_band_in_chunks), only=dict(chunks={0}),
                         band_tokens=len(ids) // 2, reference_kl=1e-6)["chunks"]
  finally:
    jax.clear_caches()  # nor may the planted programs outlive it
  assert not out.passed and out.layers[0].update_nmse > 1e3 * verdicts.F32_BOUND
  assert out.teacher_forced.mean_kl > out.teacher_forced.bound


def test_a_configuration_whose_run_fails_leaves_the_others_judged(tiny):
  """One configuration's layer run failing (out of memory, say), or its KL prefill, is its own verdict's error: the
  others are judged on, end to end."""
  m, ids = tiny

  def out_of_memory(*args):
    raise RuntimeError("RESOURCE_EXHAUSTED in layer 0")

  names = ("ok", "layer_fails", "kl_fails")
  out = verdicts.judge(m, ids, dict.fromkeys(names, exact()), runners=dict(layer_fails=out_of_memory),
                       models=dict(kl_fails=None), only=dict.fromkeys(names, {0}), reference_kl=0.25)
  assert isinstance(out["layer_fails"], RuntimeError) and isinstance(out["kl_fails"], Exception)
  assert out["ok"].passed and out["ok"].teacher_forced.mean_kl < 1e-6 and len(out["ok"].layers) == 1


def test_the_exact_path_in_bands_is_judged_and_fails_a_bug_every_path_shares(tiny):
  """In one band the exact path is the reference: nothing to judge. In the verdicts' bands it runs the carry
  between bands, which the reference never runs and which every configuration and the bf16 reference math (whose
  error sets their bounds) share: a bug there raises a configuration's bound with its error. Held to F32_BOUND,
  the exact path in bands catches it."""
  m, ids = tiny
  all_off = [matrix.Configuration(name="all_off", features=exact())]
  judge = lambda model_, band: runner.ModelRunner().judge(model_, ids, all_off, lambda s: None,
                                                          band_tokens=band)["all_off"]
  assert judge(m, 0) == verdicts.Judgement((), None)
  good = judge(m, len(ids) // 2)
  assert len(good.layers) == len(m.layers) and good.passed and {v.bands for v in good.layers} == {2}
  assert max(v.update_nmse for v in good.layers) < 1e-3 * verdicts.F32_BOUND
  # planted in layer 0 only (one layer kind compiled again), in the model that every path and the reference run
  shared_bug = judge(mutations.mutated_model(m, mutations.kv_tail_dropped, {0}), len(ids) // 2)
  assert not shared_bug.passed and "in 2 bands" in shared_bug.reasons()[0]


def test_layer_verdicts_command_on_a_mesh_in_bands(tmp_path):
  """The entry point on a mesh of one device, its runs in two bands: every layer of the configuration (bf16 operands,
  so each layer's error is real) passes, both planted bugs fail (the carry bug at its own layer), and the record says
  the model ran on the mesh."""
  out = tmp_path / "verdicts.json"
  p = subprocess.run([sys.executable, "-m", "experiments.layer_verdicts", "--preset=tiny_window", "--tokens=16",
                      "--bands=2", "--mesh=expert=1", "--bf16_matmul", "--mutations=dropped_sink,kv_tail_dropped",
                      f"--out={out}"], capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert p.returncode == 0, p.stderr[-3000:]
  assert "mesh expert=1: 8 of 8 routed experts per device on 1 devices" in p.stdout
  doc = json.loads(out.read_text())
  assert doc["mesh"] == "expert=1" and doc["bands"] == 2 and doc["configuration"]["passed"]
  assert [(v["layer"], v["bands"]) for v in doc["configuration"]["layers"]] == [(0, 2), (1, 2)]
  assert all(0 < v["update_nmse"] <= v["bound"] for v in doc["configuration"]["layers"])
  assert not doc["mutations"]["dropped_sink"]["passed"]
  carry = doc["mutations"]["kv_tail_dropped"]
  assert not carry["passed"] and carry["bands"] == 2 and carry["update_nmse"] > 1e3 * carry["bound"]


BAD_INPUT = [
    # a planted carry bug would pass a run of one band from position 0: refused unless its runs are banded
    (["--mutations=kv_tail_dropped"], "layer_verdicts: --mutations ['kv_tail_dropped'] plant bugs in what a layer "
                                      "carries between bands"),
    (["--mutations=index_topk_minus_one"], "layer_verdicts: the planted bug index_topk_minus_one needs a layer of "
                                           "kind ['compressed_sparse_attention']; tiny_window has none"),
    (["--mutations=dropped_sink", "--mutation_layer=7"], "layer_verdicts: --mutation_layer must lie in [0, 2)"),
    (["--moe_persistent"], "layer_verdicts: invalid feature set: --moe_persistent requires --moe_compact_queue"),
]
# The entry point's main on each command line in one subprocess (its flags are module-level; a process each cost
# ~2.5 s of start-up): what each ends with, SystemExit's message (a one-line exit, status 1) or the exception.
REFUSALS = """
import json, sys
from absl import flags
from experiments import layer_verdicts
for args in json.loads(sys.argv[1]):
  flags.FLAGS.unparse_flags()
  flags.FLAGS(["layer_verdicts", "--preset=tiny_window", *args])
  try:
    layer_verdicts.main([])
    print("ENDED " + json.dumps(None), flush=True)
  except SystemExit as e:
    print("ENDED " + json.dumps(e.code if isinstance(e.code, str) else f"exit status {e.code}"), flush=True)
"""


def test_layer_verdicts_refuses_bad_input_in_one_line():
  p = subprocess.run([sys.executable, "-c", REFUSALS, json.dumps([args for args, _ in BAD_INPUT])],
                     capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  ended = [json.loads(ln.removeprefix("ENDED ")) for ln in p.stdout.splitlines() if ln.startswith("ENDED ")]
  assert p.returncode == 0 and len(ended) == len(BAD_INPUT), p.stderr[-3000:]
  for (args, message), got in zip(BAD_INPUT, ended):
    assert isinstance(got, str) and "\n" not in got and got.startswith(message), (args, got)


def test_a_reference_kl_on_file_is_used_not_measured(tiny, monkeypatch):
  """verdicts.judge takes the bf16 reference's teacher-forced KL from the caller (the qualification's verdicts on
  file) instead of running its prefill again, and bounds every configuration by it."""
  m, ids = tiny
  ran = []
  real = verdicts.prefill_lib.prefill
  monkeypatch.setattr(verdicts.prefill_lib, "prefill", lambda mm, i, f, **kw: ran.append(f) or real(mm, i, f, **kw))
  lines = []
  out = verdicts.judge(m, ids, dict(exact=exact()), log=lines.append, only=dict(exact={0}), reference_kl=0.25)
  assert ran == [exact()]  # the configuration's own prefill only
  tf = out["exact"].teacher_forced
  assert (tf.reference_bf16_mean_kl, tf.bound) == (0.25, verdicts.KL_FACTOR * 0.25)
  assert any("2.50e-01" in s and "on file" in s for s in lines)


def test_a_carry_bug_passes_one_band_and_fails_in_two_at_its_layer_and_end_to_end(tiny):
  """A bug in what a layer carries between bands (kv_tail_dropped: the window's KV rows) is invisible in one band
  from position 0, which carries nothing. With the verdicts' runs in two bands (band_tokens) it FAILs twice: its own
  layer's pinned update (against the exact path's one band) and the teacher-forced KL; the exact path in the same two
  bands stays far below both bounds. (Every carry bug FAILs the qualification in two bands:
  tests/experiments/test_qualification.py.)"""
  m, ids = tiny
  layer, bugged = 0, mutations.kv_tail_dropped
  bug = dict(runners=dict(carry=mutations.run_layer(bugged, {layer})),
             models=dict(carry=mutations.mutated_model(m, bugged, {layer})),
             only=dict(exact={layer}, carry={layer}))
  two = verdicts.judge(m, ids, dict(exact=exact(), carry=exact()), **bug, band_tokens=len(ids) // 2)
  tf, ok = two["carry"].teacher_forced, two["exact"].teacher_forced
  [bad], [good] = two["carry"].layers, two["exact"].layers
  assert tf.bands == ok.bands == bad.bands == good.bands == 2
  assert bad.update_nmse > 1e3 * bad.bound and bad.bound == verdicts.F32_BOUND
  assert good.passed and good.update_nmse < 1e-3 * good.bound
  assert not two["carry"].passed and tf.mean_kl > 10 * tf.bound and tf.worst_position >= len(ids) // 2
  assert two["exact"].passed and ok.mean_kl < 1e-2 * ok.bound
  reasons = two["carry"].reasons()
  assert "in 2 bands" in reasons[0] and "teacher-forced KL" in reasons[-1]
  # the same bug, one band (the reference's KL as measured above: a prefill saved)
  one = verdicts.judge(m, ids, dict(carry=exact()), **bug, reference_kl=tf.reference_bf16_mean_kl)
  assert one["carry"].passed and one["carry"].layers[0].update_nmse == 0.0 and one["carry"].teacher_forced.bands == 1
  # a configuration that runs one band (prefill_band_tokens=0) keeps it: bands are what it would run
  assert verdicts.banded_features(dataclasses.replace(exact(), prefill_band_tokens=0), 16).prefill_band_tokens == 0
  assert verdicts.banded_features(exact(), 16).prefill_band_tokens == 16

