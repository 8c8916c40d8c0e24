"""Layer-major banded prefill (ds4jax/prefill.py) against one-shot prefill of the same prompt."""

import collections
import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ds4jax import config, features, model, prefill
from ds4jax.decisions import Decisions

S = 45  # not a multiple of any band below, nor of the ratios 4 and 8


@pytest.fixture(scope="module")
def tiny(module_seed):
  """The tiny model has every layer kind: window (W=8), CSA (ratio 4, top-3 indexer), HCA (ratio 8)."""
  m = model.init_random(config.tiny(), seed=module_seed, dtype=jnp.float32)
  tokens = np.random.default_rng(module_seed).integers(0, m.cfg.vocab_size, S)
  return m, tokens, np.asarray(model.forward(m, tokens))


def run(m, tokens, **knobs):
  return np.asarray(prefill.prefill(m, tokens, features.resolve("cpu_interpret", knobs), all_logits=True))


@pytest.mark.parametrize("band,chunk", [
    (8, 0),    # aligned with both ratios and the window (bands of 12, aligned with ratio 4 only: every fast path)
    (5, 0),    # aligned with nothing: windows complete mid-band, CSA's previous window spans two bands
    (16, 8),   # query chunks inside each band
])
def test_banded_prefill_matches_one_shot(tiny, band, chunk):
  m, tokens, ref = tiny
  before = prefill._layer_step._cache_size()  # pylint: disable=protected-access
  got = run(m, tokens, prefill_band_tokens=band, long_context_chunk=chunk)
  if band == 5:  # no other test runs bands of 5, so the count is this run's: tiny's 4 layers are of 3 types (the two
    # CSA layers share a graph), and its 9 bands and 4 layers reuse 3 compiles
    assert prefill._layer_step._cache_size() - before == 3  # pylint: disable=protected-access
  err = np.abs(got - ref).max()
  print(f"band {band} chunk {chunk}: max abs error {err:.2e} (logits up to {np.abs(ref).max():.2f})")
  assert got.shape == ref.shape and np.isfinite(got).all()
  assert err < 2e-6 * max(1.0, np.abs(ref).max())


def test_long_context_chunk_splits_the_band_attention(tiny):
  """The (16, 8) case above matches the one-shot logits whether or not the band's attention is chunked (a query's
  result does not depend on its chunk), so the trace of prefill's CSA layer step over a band of 16 shows it: with
  chunks of 8 the attention gains a loop of 2 chunks and its softmax spans [8, heads, keys] instead of
  [16, heads, keys]; nothing else changes. Traced, not compiled."""
  m, tokens, _ = tiny
  block = m.layers[m.cfg.attention.index(config.Attention.CSA)]
  band = jnp.asarray(tokens[:16])

  def trace(chunk):
    """The loop lengths and the shapes of the rank-3 exps (softmaxes) in one layer step of the band."""
    f = features.resolve("cpu_interpret", dict(prefill_band_tokens=16, long_context_chunk=chunk))
    eqns = features.traced_eqns(lambda X: prefill.layer_step(block, X, band, 0, block.attn.empty_cache(16, 16), f)[0],
                                model.embed_streams(m.embed[...], band, m.cfg.hc_mult))
    return (collections.Counter(e.params["length"] for e in eqns if e.primitive.name == "scan"),
            {v.aval.shape for e in eqns if e.primitive.name == "exp" for v in e.outvars if v.aval.ndim == 3})

  (loops, softmax), (chunked_loops, chunked_softmax) = trace(0), trace(8)
  assert chunked_loops - loops == {2: 1} and not loops - chunked_loops, "the band's attention is not in 2 chunks"
  changed, H = softmax ^ chunked_softmax, m.cfg.num_heads
  keys = {s[2] for s in changed}  # the attention's softmax is [queries, heads, keys]
  assert len(keys) == 1, f"more than the attention's softmax changed: {changed}"
  assert softmax - chunked_softmax == {(16, H, *keys)} and chunked_softmax - softmax == {(8, H, *keys)}, changed


@pytest.mark.parametrize("n, band", [(1, 0), (4, 1)])
def test_all_logits_where_a_band_index_is_also_a_position(tiny, n, band):
  """Bands and positions were once keyed in one dict: band b's logits were lost where position b was wanted too
  (one token, or bands of one)."""
  m, tokens, ref = tiny
  got = run(m, tokens[:n], prefill_band_tokens=band)
  assert got.shape == ref[:n].shape
  np.testing.assert_allclose(got, ref[:n], atol=2e-6 * max(1.0, np.abs(ref).max()))


@pytest.mark.parametrize("changes, message", [
    (dict(direct_indexer_topk=True), "--direct_indexer_topk requires --mla_stream_topk"),
    (dict(device_class="bogus"), "unknown device class 'bogus'"),
    (dict(prefill_band_tokens=-4), "--prefill_band_tokens must be a non-negative integer, got -4"),
])
def test_a_feature_set_built_by_hand_is_held_to_the_table(tiny, changes, message):
  """Features(...) or a replace skips `resolve`: prefill checks it again, where a switch without what it requires
  ran as a silent no-op and a negative band raised a KeyError."""
  m, tokens, _ = tiny
  with pytest.raises(features.FeatureError, match=message):
    prefill.prefill(m, tokens, dataclasses.replace(features.REFERENCE, **changes))


def test_all_logits_refuses_positions(tiny):
  m, tokens, _ = tiny
  with pytest.raises(ValueError, match="pass positions only without it"):
    prefill.prefill(m, tokens, all_logits=True, positions=[0])


def test_band_state_matters(tiny):
  """Dropping the carried state breaks equivalence: with fresh caches per band the later bands differ."""
  m, tokens, ref = tiny
  # the last 21 tokens alone, as if from position 0 (in bands of 16 and 5: the layer programs of the 21-token
  # prefix below)
  got = run(m, tokens[S - 21:], prefill_band_tokens=16)
  assert np.abs(got - ref[S - 21:]).max() > 1e-3


def test_final_logits_and_progress(tiny):
  m, tokens, ref = tiny
  lines = []
  last = prefill.prefill_logits(m, tokens, features.resolve("cpu_interpret", dict(prefill_band_tokens=16)),
                                progress=lines.append)
  np.testing.assert_allclose(np.asarray(last), ref[-1], atol=2e-6 * max(1.0, np.abs(ref).max()))
  assert len(lines) == 3 and lines[-1].startswith("band 3/3")


def test_chunk_must_divide_band():
  with pytest.raises(features.FeatureError, match="multiple of --long_context_chunk=8"):
    features.resolve("cpu_interpret", dict(prefill_band_tokens=12, long_context_chunk=8))


def test_short_prompt_band_rounds_up_to_whole_chunks():
  f = features.resolve("cpu_interpret", dict(prefill_band_tokens=64, long_context_chunk=16))
  assert prefill.band_size(45, f) == 48 and prefill.band_size(200, f) == 64
  assert prefill.band_size(45, features.resolve("cpu_interpret", dict(prefill_band_tokens=0,
                                                                        long_context_chunk=0))) == 45


def test_banded_prefill_with_every_fast_path_matches_one_shot(rng, seed):
  """The Pallas paths at traced band offsets: window tail before position 0, compressed rows of earlier bands.
  39 tokens (a last band of 3): tests/test_decode.py's fast-path decode takes this prefill as its reference, so in a
  full run one of the two loads its programs from the shared compilation cache (tests/conftest.py)."""
  m = model.init_random(config.tiny_sparse(), seed=seed, dtype=jnp.float32)
  tokens = rng.integers(0, m.cfg.vocab_size, 39)
  ref = np.asarray(model.forward(m, tokens))
  all_on = {s: True for s in features.SWITCHES if features.CAPABILITIES["cpu_interpret"][s].supported
            and s not in ("bf16_matmul", *features.WGMMA_SWITCHES)}  # the kernels compute the exact math;
  # bf16 operands do not (and the Mosaic GPU switches take only those)
  got = run(m, tokens, prefill_band_tokens=12, long_context_chunk=0, **all_on)
  err = np.abs(got - ref).max()
  print(f"all fast paths, bands of 12: max abs error {err:.2e}")
  assert np.isfinite(got).all() and err < 1e-5 * max(1.0, np.abs(ref).max())


def test_logits_at_positions_are_the_prefixes_final_logits(tiny):
  """Causality: position p - 1 of a full run is the final position of the p-token prefix (the qualification's
  parity check reads a prefix from the full-length run)."""
  m, tokens, ref = tiny
  f = features.resolve("cpu_interpret", dict(prefill_band_tokens=16))
  got = np.asarray(prefill.prefill_logits(m, tokens, f, positions=(20, 7, S - 1)))
  assert got.shape == (3, ref.shape[1])
  np.testing.assert_allclose(got, ref[[20, 7, S - 1]], atol=2e-6 * max(1.0, np.abs(ref).max()))
  prefix = np.asarray(prefill.prefill_logits(m, tokens[:21], f))
  np.testing.assert_allclose(got[0], prefix, atol=2e-6 * max(1.0, np.abs(ref).max()))
  with pytest.raises(ValueError, match="positions"):
    prefill.prefill_logits(m, tokens, f, positions=(S,))


def test_band_knobs_that_change_nothing_share_the_layer_programs(tiny):
  """A band of the whole prompt and a chunk of the whole band run the same computation as no band and no chunk, so
  kill_prefill_band_tokens / kill_long_context_chunk at such a length compile nothing new."""
  m, tokens, _ = tiny
  banded = features.resolve("cpu_interpret", dict(prefill_band_tokens=64, long_context_chunk=64))
  plain = features.resolve("cpu_interpret", dict(prefill_band_tokens=0, long_context_chunk=0))
  assert prefill.layer_features(banded, S) == prefill.layer_features(plain, S)
  chunked = features.resolve("cpu_interpret", dict(prefill_band_tokens=32, long_context_chunk=16))
  assert prefill.layer_features(chunked, 32).long_context_chunk == 16
  size = prefill._layer_step._cache_size  # pylint: disable=protected-access
  before = size()
  a = np.asarray(prefill.prefill_logits(m, tokens, banded))
  after_a = size()
  b = np.asarray(prefill.prefill_logits(m, tokens, plain))
  assert after_a - before <= 3 and size() == after_a and np.array_equal(a, b)  # b compiled nothing


def test_input_noise_moves_the_logits_by_its_size(tiny):
  """The noise floor's perturbation: seeded, and the logits move by about its relative size (the tiny model is not
  chaotic), not at all without it."""
  m, tokens, _ = tiny
  f = features.resolve("cpu_interpret", {})
  clean = np.asarray(prefill.prefill(m, tokens, f, all_logits=True))
  noisy = [np.asarray(prefill.prefill(m, tokens, f, all_logits=True, input_noise=1e-3, noise_seed=s)) for s in
           (0, 0, 1)]
  rel = np.abs(noisy[0] - clean).max() / np.abs(clean).max()
  assert np.array_equal(noisy[0], noisy[1]) and not np.array_equal(noisy[0], noisy[2])
  assert 1e-6 < rel < 1e-1
  banded = np.asarray(prefill.prefill(m, tokens, features.resolve("cpu_interpret", {"prefill_band_tokens": 8}),
                                      all_logits=True, input_noise=1e-3))
  assert not np.array_equal(banded, noisy[0]) and np.abs(banded - clean).max() / np.abs(clean).max() < 1e-1


def test_prefill_walks_each_layer_once_and_never_the_whole_model(tiny, monkeypatch):
  """Host cost: the NNX graph of each block is split once per call (not once per band), right before its first
  dispatch, and the model as a whole (all layers) is never walked."""
  m, tokens, _ = tiny
  split, walked = prefill.nnx.split, []
  monkeypatch.setattr(prefill.nnx, "split", lambda node, *a: walked.append(node) or split(node, *a))
  prefill.prefill(m, tokens, features.resolve("cpu_interpret", {"prefill_band_tokens": 16}))
  blocks = [n for n in walked if any(n is b for b in m.layers)]
  assert len(blocks) == len(m.layers) and all(b is n for b, n in zip(m.layers, blocks))
  assert not any(n is m for n in walked) and len(walked) == len(m.layers) + 1  # + the output head


def test_precompile_fills_the_persistent_cache(tiny, tmp_path):
  """After precompile, prefill's layer programs are persistent-cache hits, not compiles."""
  import jax  # pylint: disable=import-outside-toplevel
  from jax import monitoring  # pylint: disable=import-outside-toplevel

  m, tokens, ref = tiny
  f = features.resolve("cpu_interpret", dict(prefill_band_tokens=16))
  old = (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs)
  jax.config.update("jax_compilation_cache_dir", None)
  with pytest.raises(ValueError, match="jax_compilation_cache_dir"):
    prefill.precompile(m, [(S, f)])
  jax.config.update("jax_compilation_cache_dir", str(tmp_path))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  hits = []
  listener = lambda event, **kw: hits.append(event) if event == "/jax/compilation_cache/cache_hits" else None
  monitoring.register_event_listener(listener)
  try:
    lines = []
    assert prefill.precompile(m, [(S, f), (S, f)], workers=2, log=lines.append) == 3  # 3 layer types, deduped
    assert len(lines) == 3
    prefill._layer_step.clear_cache()  # pylint: disable=protected-access
    hits.clear()
    got = np.asarray(prefill.prefill_logits(m, tokens, f))
    assert hits.count("/jax/compilation_cache/cache_hits") >= 3
    np.testing.assert_allclose(got, ref[-1], atol=2e-6 * max(1.0, np.abs(ref).max()))
    # prefill_moe_over_bands: each layer type's attention step and its MoE step over the 3 bands at once.
    over = dataclasses.replace(f, prefill_weights_stationary=True, prefill_moe_over_bands=True)
    assert prefill.precompile(m, [(S, over)], workers=2) == 6
    # beside the same run without it (a kill, a --without), whose layer features are the same: both sets
    assert prefill.precompile(m, [(S, stationary(f)), (S, over)], workers=2) == 3 + 6
    hits.clear()
    got = np.asarray(prefill.prefill_logits(m, tokens, over))
    assert hits.count("/jax/compilation_cache/cache_hits") >= 6
    np.testing.assert_allclose(got, ref[-1], atol=2e-6 * max(1.0, np.abs(ref).max()))
    # pinned runs in their bands (the qualification's verdicts in several bands)
    made = []
    prefill.prefill(m, tokens, f, decisions=made)
    assert prefill.precompile(m, [], workers=2, pinned=[(S, over), (S, f)]) == 6 + 3
    prefill._attend_step.clear_cache()  # pylint: disable=protected-access
    prefill._moe_step.clear_cache()  # pylint: disable=protected-access
    prefill._layer_step.clear_cache()  # pylint: disable=protected-access
    hits.clear()
    got = np.asarray(prefill.prefill(m, tokens, over, pinned=made))
    got_f = np.asarray(prefill.prefill(m, tokens, f, pinned=made))
    assert hits.count("/jax/compilation_cache/cache_hits") >= 6 + 3
    np.testing.assert_allclose(got, ref[-1], atol=2e-6 * max(1.0, np.abs(ref).max()))
    np.testing.assert_allclose(got_f, ref[-1], atol=2e-6 * max(1.0, np.abs(ref).max()))
  finally:
    monitoring.unregister_event_listener(listener)
    jax.config.update("jax_compilation_cache_dir", old[0])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", old[1])


def test_precompile_covers_the_verdict_pass(tmp_path, monkeypatch):
  """The qualification's verdict pass (ds4jax.prefill.precompile `pinned` and `scored`): the exact path recording
  its scores (one band), and layers pinned to its decisions, in one band and in bands with the MoE over them (as a
  configuration is judged with --verdict_bands), find their layer programs in the persistent cache: no layer
  program misses it. (The small eager programs that stage tokens and cut streams into bands compile where they
  run.)"""
  import jax  # pylint: disable=import-outside-toplevel
  from jax._src import compilation_cache  # pylint: disable=import-outside-toplevel

  m = model.init_random(config.tiny_csa(), seed=3, dtype=jnp.float32)  # one layer type
  tokens = jnp.asarray(np.random.default_rng(3).integers(0, m.cfg.vocab_size, S), jnp.int32)
  exact = features.resolve("cpu_interpret", {})
  over = features.resolve("cpu_interpret", dict(prefill_band_tokens=16, prefill_weights_stationary=True,
                                                prefill_moe_over_bands=True))
  old = (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs)
  jax.config.update("jax_compilation_cache_dir", str(tmp_path))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  lookups, get = [], compilation_cache.get_executable_and_time

  def recorded(key, *args, **kwargs):  # (program, found) of each persistent-cache lookup
    out = get(key, *args, **kwargs)
    lookups.append((key.split("-")[0], out[0] is not None))
    return out

  monkeypatch.setattr(compilation_cache, "get_executable_and_time", recorded)
  layer_programs = ("jit__layer_step", "jit__attend_step", "jit__moe_step")
  try:
    for f in (prefill._layer_step, prefill._attend_step, prefill._moe_step):  # pylint: disable=protected-access
      f.clear_cache()
    assert prefill.precompile(m, [], workers=2, pinned=[(S, exact), (S, over)], scored=[(S, exact)]) == 2 + 2
    lookups.clear()
    X = np.asarray(m.embed_streams(tokens))
    for block in m.layers:  # device_put copies X without a compile of its own
      y, _, made = prefill.layer_step(block, jax.device_put(X), tokens, 0, block.attn.empty_cache(S, S), exact,
                                      record_scores=True)
      assert made.index_scores is not None
      pinned = Decisions(made.route_ids, made.index_rows)
      again, _ = prefill.layer_in_bands(block, jax.device_put(X), tokens, exact, pinned)
      banded, _ = prefill.layer_in_bands(block, jax.device_put(X), tokens, over, pinned)  # 3 bands, one MoE call
      X = np.asarray(y)
      np.testing.assert_array_equal(np.asarray(again), X)
      np.testing.assert_allclose(np.asarray(banded), X, atol=2e-6 * np.abs(X).max())
    # A program precompile compiled in this process may also be reused from memory, with no lookup at all.
    looked = [(name, found) for name, found in lookups if name in layer_programs]
    assert {"jit__attend_step", "jit__moe_step"} <= {name for name, _ in looked} and all(f for _, f in looked), looked
  finally:
    jax.config.update("jax_compilation_cache_dir", old[0])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", old[1])


def test_pinned_decisions_are_imposed_band_by_band(tiny):
  """A run's recorded decisions (whole prompt, per layer), imposed on a banded run, come back unchanged and give the
  same logits; altered ones are imposed as given and move the logits."""
  m, tokens, ref = tiny
  exact = features.resolve("cpu_interpret", {"prefill_band_tokens": 0})
  made: list = []
  one_shot = np.asarray(prefill.prefill(m, tokens, exact, all_logits=True, decisions=made))
  k = m.cfg.experts_per_token
  assert len(made) == m.cfg.num_layers and all(d.route_ids.shape == (S, k) for d in made)
  assert [d.index_rows is not None for d in made] == [a == config.Attention.CSA for a in m.cfg.attention]
  banded = features.resolve("cpu_interpret", {"prefill_band_tokens": 16})
  got: list = []
  pinned = np.asarray(prefill.prefill(m, tokens, banded, all_logits=True, pinned=made, decisions=got))
  for want, have in zip(made, got):
    np.testing.assert_array_equal(have.route_ids, want.route_ids)
    if want.index_rows is not None:
      np.testing.assert_array_equal(have.index_rows, want.index_rows)
  assert np.abs(pinned - one_shot).max() < 2e-6 * max(1.0, np.abs(ref).max())
  # Layer 1 (top-k routed) sent to other experts: imposed as given, and the logits move.
  moved = list(made)
  moved[1] = dataclasses.replace(made[1], route_ids=(made[1].route_ids + 1) % m.cfg.n_routed_experts)
  got = []
  other = np.asarray(prefill.prefill(m, tokens, banded, all_logits=True, pinned=moved, decisions=got))
  np.testing.assert_array_equal(got[1].route_ids, moved[1].route_ids)
  assert np.abs(other - one_shot).max() > 1e-3
  with pytest.raises(ValueError, match="pinned holds 3 layers' decisions; the model has 4"):
    prefill.prefill(m, tokens, banded, pinned=made[:3])


def stationary(f: features.Features) -> features.Features:
  return dataclasses.replace(f, prefill_weights_stationary=True)


def test_weights_stationary_order_is_bit_identical(tiny):
  """Each layer running every band before the next layer computes the same layer steps as band-major order: the
  same logits and decisions, bit for bit, and one progress line per layer."""
  m, tokens, _ = tiny
  f = features.resolve("cpu_interpret", dict(prefill_band_tokens=16))
  made, made_stationary, lines = [], [], []
  want = np.asarray(prefill.prefill(m, tokens, f, all_logits=True, decisions=made))
  got = np.asarray(prefill.prefill(m, tokens, stationary(f), all_logits=True, decisions=made_stationary,
                                   progress=lines.append))
  assert np.array_equal(got, want)
  for a, b in zip(made, made_stationary):
    assert np.array_equal(a.route_ids, b.route_ids)
  assert [line.split(":")[0] for line in lines] == [f"layer {i}/4" for i in range(1, 5)]
  assert all("3 bands done" in line for line in lines)


def test_weights_stationary_decodes_each_layers_experts_once(seed, monkeypatch):
  """With the MoE kernels reading decoded experts, the stationary order decodes each layer's quantized experts once
  for all bands (band-major decodes them inside every band's step), and the logits stay bit-identical."""
  from ds4jax import moe  # pylint: disable=import-outside-toplevel
  m = model.init_random(config.tiny_window(hidden_size=128), seed=seed, dtype=jnp.float32, policy="lucebox_mix")
  tokens = np.arange(2, 42)
  f = features.resolve("cpu_interpret", dict(moe_compact_queue=True, prefill_band_tokens=16))
  decoded, decode = [], moe._decoded  # pylint: disable=protected-access
  monkeypatch.setattr(moe, "_decoded", lambda fmts, *a, **k: decoded.append(fmts) or decode(fmts, *a, **k))
  want = np.asarray(prefill.prefill(m, tokens, f, all_logits=True))
  assert decoded == []
  got = np.asarray(prefill.prefill(m, tokens, stationary(f), all_logits=True))
  assert decoded == [("rocmfp2_mix", "rocmfp3_mix", "rocmfp2_mix")] * m.cfg.num_layers  # w1, w2, w3 per layer
  assert np.array_equal(got, want)
  _, state = prefill.step_parts(m.layers[0], stationary(f), n_bands=1)
  assert any("codes" in str(p) for p, _ in state.flat_state())  # one band: nothing hoisted, band-major's program
  gdef, state = prefill.step_parts(m.layers[0], stationary(f), n_bands=3)
  experts = nnx.merge(gdef, state).ffn.experts
  w1 = experts.w1[...]
  c = m.cfg
  assert w1.dtype == jnp.float32 and w1.shape == (c.n_routed_experts, c.moe_intermediate_size, c.hidden_size)
  # moe_decode_kernel: the hoisted decode made by the Pallas kernel, the same bits.
  kernel_calls, kernel = [], moe.moe_kernels.decode_stack
  monkeypatch.setattr(moe.moe_kernels, "decode_stack", lambda w, *a, **k: kernel_calls.append(w.fmt_name) or
                      kernel(w, *a, **k))
  by_kernel = nnx.merge(*prefill.step_parts(m.layers[0], stationary(dataclasses.replace(f, moe_decode_kernel=True)),
                                            n_bands=3)).ffn.experts
  assert kernel_calls == ["rocmfp2_mix", "rocmfp3_mix", "rocmfp2_mix"]
  for name in ("w1", "w2", "w3"):
    np.testing.assert_array_equal(getattr(by_kernel, name)[...], getattr(experts, name)[...])
  # No decode to hoist: the fused kernel decodes in-tile; the exact path decodes one expert at a time.
  for f_other in (dataclasses.replace(f, moe_sparse_gate_up=True), features.REFERENCE):
    _, state = prefill.step_parts(m.layers[0], stationary(f_other), n_bands=3)
    assert any("codes" in str(p) for p, _ in state.flat_state())


@pytest.mark.parametrize("band,moe_tokens", [(8, 24), (16, 32)])  # 6 bands as 3 + 3; 3 bands as 2 + 1
def test_moe_over_bands_matches_the_layer_step_per_band(tiny, monkeypatch, band, moe_tokens):
  """prefill_moe_over_bands: each layer's attention for every band, then its MoE over groups of bands. The same
  logits to float rounding (the joined MoE's matmuls are blocked for more rows), the same decisions, bands in
  order, one progress line per layer."""
  m, tokens, _ = tiny
  monkeypatch.setattr(prefill, "MOE_TOKENS", moe_tokens)
  f = stationary(features.resolve("cpu_interpret", dict(prefill_band_tokens=band)))
  made, made_over, lines = [], [], []
  want = np.asarray(prefill.prefill(m, tokens, f, all_logits=True, decisions=made))
  over = dataclasses.replace(f, prefill_moe_over_bands=True)
  groups = prefill.moe_groups(-(-S // band), band)
  assert [len(g) for g in groups] == ([3, 3] if band == 8 else [2, 1])
  got = np.asarray(prefill.prefill(m, tokens, over, all_logits=True, decisions=made_over, progress=lines.append))
  assert np.abs(got - want).max() < 2e-6 * max(1.0, np.abs(want).max()) and np.abs(want).max() > 1.0
  for a, b in zip(made, made_over, strict=True):
    np.testing.assert_array_equal(a.route_ids, b.route_ids)
    assert (a.index_rows is None) == (b.index_rows is None)
    if a.index_rows is not None:
      np.testing.assert_array_equal(a.index_rows, b.index_rows)
  assert [line.split(":")[0] for line in lines] == [f"layer {i}/4" for i in range(1, 5)]
  last = np.asarray(prefill.prefill(m, tokens, over, positions=[S - 1, 3]))
  np.testing.assert_allclose(last, want[[S - 1, 3]], atol=2e-6 * np.abs(want).max())
  # Decisions pinned band by band reach each joined MoE call: moving one layer's routes moves them there too.
  moved = list(made)
  moved[1] = dataclasses.replace(made[1], route_ids=(made[1].route_ids + 1) % m.cfg.n_routed_experts)
  again = []
  prefill.prefill(m, tokens, over, pinned=moved, decisions=again)
  np.testing.assert_array_equal(again[1].route_ids, moved[1].route_ids)


def test_layer_in_bands_is_the_prefills_layer(tiny, monkeypatch):
  """prefill.layer_in_bands (how the per-layer verdicts run a layer in bands) runs the programs the prefill runs for
  that layer: layer after layer from the embedded streams it gives the prefill's logits and decisions, bit for bit
  with the MoE over bands on whole bands (5 bands of 8 as 3 + 2); band by band on a padded last band (45 tokens), to
  rounding (its padding rows are zeros, the prefill's are token 0's streams, so the MoE may block rows otherwise).
  Pinned decisions (routes, index rows) are imposed and move the layer's output."""
  m, tokens, _ = tiny
  monkeypatch.setattr(prefill, "MOE_TOKENS", 24)
  f = stationary(features.resolve("cpu_interpret", dict(prefill_band_tokens=8)))
  over = dataclasses.replace(f, prefill_moe_over_bands=True)

  def layer_by_layer(ids, feats):
    made = []
    want = np.asarray(prefill.prefill(m, ids, feats, all_logits=True, decisions=made))
    X = m.embed_streams(jnp.asarray(ids))
    for i, block in enumerate(m.layers):
      X, d = prefill.layer_in_bands(block, X, ids, feats)
      np.testing.assert_array_equal(d.route_ids, made[i].route_ids)
      if d.index_rows is not None:
        np.testing.assert_array_equal(d.index_rows, made[i].index_rows)
    by_band = [prefill.logits_of_streams(m, X[s:s + 8]) for s in range(0, len(ids), 8)]  # as the prefill does
    return np.concatenate(by_band), want, made

  got, want, made = layer_by_layer(tokens[:40], over)  # whole bands: no padding
  np.testing.assert_array_equal(got, want)
  got, want, _ = layer_by_layer(tokens, f)
  np.testing.assert_allclose(got, want, atol=2e-6 * np.abs(want).max())
  csa = m.cfg.attention.index(config.Attention.CSA)
  free = made[csa]
  X = m.embed_streams(jnp.asarray(tokens[:40]))
  y_free, _ = prefill.layer_in_bands(m.layers[csa], jnp.copy(X), tokens[:40], over)
  for moved in (dataclasses.replace(free, route_ids=(free.route_ids + 1) % m.cfg.n_routed_experts),
                dataclasses.replace(free, index_rows=jnp.full_like(free.index_rows, -1))):
    y, d = prefill.layer_in_bands(m.layers[csa], jnp.copy(X), tokens[:40], over, moved)
    np.testing.assert_array_equal(d.route_ids, moved.route_ids)
    np.testing.assert_array_equal(d.index_rows, moved.index_rows)
    assert np.abs(np.asarray(y - y_free)).max() > 1e-3


def test_moe_over_bands_runs_the_moe_kernels_once_a_group(tiny, monkeypatch):
  """Which path ran: with the MoE kernels on, a layer's gate/up runs once per band, or once per group of bands."""
  m, tokens, _ = tiny
  monkeypatch.setattr(prefill, "MOE_TOKENS", 24)  # 6 bands of 8: two groups of 3
  f = stationary(features.resolve("cpu_interpret", dict(prefill_band_tokens=8, moe_compact_queue=True)))
  count = lambda f: sum(name.startswith("moe_gate_up") for name, _ in features.pallas_calls(
      lambda: prefill.prefill(m, tokens, f)))
  assert count(f) == 6 * m.cfg.num_layers
  assert count(dataclasses.replace(f, prefill_moe_over_bands=True)) == 2 * m.cfg.num_layers


def test_moe_groups_are_even_whole_bands(monkeypatch):
  assert [len(g) for g in prefill.moe_groups(15, 8192)] == [4, 4, 4, 3]  # 122879 tokens at the defaults
  assert [len(g) for g in prefill.moe_groups(4, 8192)] == [4]
  assert [list(g) for g in prefill.moe_groups(5, 8192)] == [[0, 1, 2], [3, 4]]
  assert [len(g) for g in prefill.moe_groups(3, 65536)] == [1, 1, 1]  # a band above MOE_TOKENS: one band a call
  monkeypatch.setattr(prefill, "MOE_TOKENS", 32)
  assert [list(g) for g in prefill.moe_groups(3, 16)] == [[0, 1], [2]]
  with pytest.raises(features.FeatureError, match="prefill_moe_over_bands requires --prefill_weights_stationary"):
    features.resolve("cpu_interpret", dict(prefill_moe_over_bands=True))
