"""ds4jax/decode.py on the exact path: decode equals prefill, and q-wide verification equals sequential decode, at
positions that put the band across the window's wrap and the compression windows' boundaries; the same with bf16
caches (within bf16 rounding), and once through every fast path.

One model (tiny with a window of 4, so that bands of 4 and 5 reach past it; CSA ratio 4, HCA ratio 8 standing in
for V4's 128) and one state shape (capacity 64, made for bands up to 8) for every f32 test: each band width is then
one compile per layer kind for the whole file. A step copies and scans its state's rows (~0.08 s per band at 128K
positions on CPU, ~0.003 s at 64), so only the tests of positions near 128K hold a 128K state (bands of 1 and 3: their
own programs). bf16 caches and the fast paths compile programs of their own."""

import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ds4jax import config, decode, features, model, prefill
from ds4jax.metrics import nmse
from experiments import cache_memory

PROMPT = 3  # decode runs from here to LENGTH, one token at a time
LENGTH = 36
CAPACITY = 131072  # the model's max_position_embeddings: the long-position tests' states
STATES = 64  # the capacity of every other state (LENGTH and a band of up to 8 fit)
WINDOW = 4


@pytest.fixture(scope="module")
def tiny():
  return model.init_random(config.tiny(sliding_window=WINDOW, max_position_embeddings=CAPACITY), seed=3,
                           dtype=jnp.float32)


@pytest.fixture(scope="module")
def sequential(tiny):
  """Greedy decode from a 3-token prompt, one token per step: the states after each length and the tokens."""
  prompt = np.random.default_rng(3).integers(0, tiny.cfg.vocab_size, PROMPT)
  state = decode.start(tiny, prompt, capacity=STATES)
  states, tokens = {PROMPT: state}, list(prompt)
  while state.length < LENGTH:
    tokens.append(int(jnp.argmax(state.logits)))
    _, state = decode.extend(tiny, state, tokens[-1:])
    states[state.length] = state
  return states, np.asarray(tokens, np.int32)


@pytest.fixture(scope="module")
def full(tiny, sequential):
  """A full prefill's logits [LENGTH, vocab] of the tokens decode chose (f32, exact path)."""
  return np.asarray(prefill.prefill(tiny, sequential[1], all_logits=True))


@pytest.fixture(scope="module")
def bf16(tiny, sequential):
  """The same tokens decoded again on bf16 caches, one per step (teacher-forced, so that its logits compare with the
  prefill of those tokens): the states after each length. Its programs are its own (the cache dtype is part of
  their signature)."""
  _, tokens = sequential
  state = decode.start(tiny, tokens[:PROMPT], capacity=STATES, cache_dtype=jnp.bfloat16)
  states = {PROMPT: state}
  while state.length < LENGTH:
    _, state = decode.extend(tiny, state, tokens[state.length:state.length + 1])
    states[state.length] = state
  return states


def assert_same_state(cfg, got, want, rtol=2e-5):
  a, b = decode.valid_view(cfg, got), decode.valid_view(cfg, want)
  assert got.length == want.length and a.keys() == b.keys()
  for k in a:
    np.testing.assert_allclose(a[k], b[k], rtol=rtol, atol=2e-5, err_msg=k)


def band_logits_match(tiny, states, tokens, s, width):
  logits, state = decode.extend(tiny, states[s], tokens[s:s + width])
  want = np.stack([np.asarray(states[s + i + 1].logits) for i in range(width)])
  np.testing.assert_allclose(np.asarray(logits), want, rtol=1e-5, atol=2e-5, err_msg=f"band [{s}, +{width})")
  return state


def test_decode_equals_prefill(tiny, sequential, full):
  """Each decode step's logits equal a full prefill of the sequence up to it (positions 3..35: the window wraps at
  4, CSA windows complete every 4, HCA every 8), and greedy decoding chose their argmax. (Decode against
  transformers: tests/test_golden.py.)"""
  states, tokens = sequential
  got = np.stack([np.asarray(states[n].logits) for n in range(PROMPT, LENGTH)])
  np.testing.assert_allclose(got, full[PROMPT - 1:LENGTH - 1], rtol=1e-5, atol=2e-5)
  assert np.array_equal(got.argmax(-1), tokens[PROMPT:])
  assert np.abs(full).max() > 1 and np.std(full) > 0.5  # real logits, not a degenerate model
  assert np.array_equal(decode.greedy(tiny, states[PROMPT], 6), tokens[PROMPT:PROMPT + 6])


# Start positions: at / after the window wrap (4), before / at CSA (8, 16, 24) and HCA (8, 16, 24) boundaries,
# so each band of width 2-5 straddles one; the draft rejected at the first, a middle and no draft token.
STARTS = (3, 4, 7, 15, 22, 30)


@pytest.mark.parametrize("width", [2, 3, 4, 5])
def test_verification_equals_sequential_decode(tiny, sequential, width):
  states, tokens = sequential
  vocab = tiny.cfg.vocab_size
  cases = 0
  for s in STARTS:
    greedy = tokens[s:s + width + 1]
    for reject in sorted({0, width // 2, width}):
      draft = greedy[:width].copy()
      if reject < width:
        draft[reject] = (draft[reject] + 1) % vocab
      out = decode.verify(tiny, states[s], draft)
      assert (out.accepted, out.next_token) == (reject, greedy[reject]), (s, width, reject)
      assert_same_state(tiny.cfg, out.state, states[s + reject])
      cases += 1
  assert cases == len(STARTS) * 3  # with widths 2-5: 72 cases


def test_review_4_sparse_selection_after_a_window_wrap(tiny, sequential):
  """Upstream review item 4 (docs/upstream.md §8): a q-wide band that crosses the window's wrap must give every
  token the logits of sequential decoding, on the CSA layers' sparse selection too."""
  states, tokens = sequential
  for width in (2, 3, 4, 5):
    for s in range(max(PROMPT, WINDOW - width + 1), WINDOW + 1):  # bands [s, s + width) that hold position 4
      band_logits_match(tiny, states, tokens, s, width)


def test_review_5_a_band_wider_than_the_window(tiny, sequential):
  """Upstream review item 5: the verifier's mask range with future >= n_swa. Bands of 4 and 5 tokens (the window
  and more) from past the wrap: each token sees its own window, not the band's first token's."""
  states, tokens = sequential
  for s, width in ((9, 4), (9, 5), (17, 5)):
    assert_same_state(tiny.cfg, band_logits_match(tiny, states, tokens, s, width), states[s + width])


def test_long_positions_by_offset(tiny, sequential):
  """Positions near 128K without a 128K prompt: a 3-token prompt at offset 131000 (YaRN-scaled RoPE, rows past
  32K on CSA layers), then a verification band of 3 against three decode steps."""
  ids = np.random.default_rng(4).integers(0, tiny.cfg.vocab_size, 6)
  off = 131000
  state = decode.start(tiny, ids[:3], capacity=CAPACITY, offset=off)
  assert state.length == off + 3 and state.caches[1].rows.shape[0] == CAPACITY // 4 + 2
  band, band_state = decode.extend(tiny, state, ids[3:6])
  seq = state
  for i in range(3):
    logits, seq = decode.extend(tiny, seq, ids[3 + i:4 + i])
    np.testing.assert_allclose(np.asarray(band[i]), np.asarray(logits[0]), rtol=1e-5, atol=2e-5)
  assert_same_state(tiny.cfg, band_state, seq)
  assert np.abs(np.asarray(band_state.caches[1].rows[off // 4])).max() > 0  # the window [off, off + 4), pooled
  # Not the logits of the same tokens at position 3: the position matters.
  assert np.abs(np.asarray(band[-1]) - np.asarray(decode.extend(tiny, sequential[0][PROMPT],
                                                                ids[3:6])[0][-1])).max() > 0.1


# bf16 caches round every stored key once (by up to 2^-8): decode's logits move from the f32 prefill's by an NMSE
# of 2.4e-7 to 3.7e-7 (seeds 3-6; f32 caches: 6e-14). A band of q reads its own keys through the cache dtype too,
# so it sees what q single steps see, but an f32 rounding difference upstream can still flip a stored bf16 value by
# one ulp: band against sequential differ by up to 3.8e-5 of the largest logit (widths 2-5, the STARTS), and by up
# to 5.7e-4 when the band's own keys are not rounded as the cache stores them.
BF16_NMSE = 3e-6
BF16_BAND_ATOL = 1e-4  # times the largest logit
BF16_ULP = 2.0 ** -7  # relative: a stored value one bf16 ulp off


def test_bf16_caches_decode_equals_prefill(tiny, sequential, full, bf16):
  """bf16 caches: each step's logits are a full f32 prefill's within bf16 rounding, yet not the f32 caches' (the
  option does store bf16); the cached rows stay bf16 through the steps, the compressor's input tail f32, and a state
  holds the bytes experiments/cache_memory.py counts for it."""
  states, _ = sequential
  got = np.stack([np.asarray(bf16[n].logits) for n in range(PROMPT, LENGTH)])
  f32 = np.stack([np.asarray(states[n].logits) for n in range(PROMPT, LENGTH)])
  want = full[PROMPT - 1:LENGTH - 1]
  print(f"bf16 caches: NMSE {nmse(got, want):.2e} against the f32 prefill (f32 caches: {nmse(f32, want):.2e})")
  assert nmse(got, want) < BF16_NMSE and nmse(got, f32) > 1e-10
  end = bf16[LENGTH]
  assert end.cache_dtype == jnp.bfloat16 and states[LENGTH].cache_dtype == jnp.float32
  for c in end.caches:
    assert {a.dtype for a in (c.kv_tail, c.rows, c.index_rows) if a is not None} == {jnp.dtype(jnp.bfloat16)}
    assert c.x_tail is None or c.x_tail.dtype == jnp.float32
  for state, dtype in ((end, jnp.bfloat16), (states[LENGTH], jnp.float32)):
    held = [sum(a.nbytes for a in jax.tree.leaves(c)) for c in state.caches]
    assert held == cache_memory.layer_bytes(tiny.cfg, state.capacity, dtype)


def test_bf16_verification_equals_sequential_decode(tiny, sequential, bf16):
  """On bf16 caches a band of 3 gives the logits of three single steps (within one bf16 rounding flip), and
  verification accepts greedy's prefix and returns sequential decoding's state, across the window's wrap (3) and
  the CSA and HCA window boundaries (8, 24)."""
  _, tokens = sequential
  for s in (3, 7, 22):
    logits, _ = decode.extend(tiny, bf16[s], tokens[s:s + 3])
    want = np.stack([np.asarray(bf16[s + i + 1].logits) for i in range(3)])
    err = np.abs(np.asarray(logits) - want).max() / np.abs(want).max()
    print(f"bf16 caches, band [{s}, +3): {err:.1e} of the largest logit off sequential decoding")
    assert err < BF16_BAND_ATOL
    greedy = [int(np.argmax(bf16[s + i].logits)) for i in range(4)]
    for reject in (0, 1, 3):
      draft = tokens[s:s + 3].copy()
      if reject < 3:
        draft[reject] = (draft[reject] + 1) % tiny.cfg.vocab_size
      accepted = next((i for i in range(3) if draft[i] != greedy[i]), 3)
      out = decode.verify(tiny, bf16[s], draft)
      assert (out.accepted, out.next_token) == (accepted, greedy[accepted]), (s, reject)
      assert_same_state(tiny.cfg, out.state, bf16[s + accepted], rtol=BF16_ULP)


def test_a_state_keeps_its_model(tiny, sequential, full):
  """A state continues with the model it was started with, which is split once: another model's state decodes that
  model's logits (sharing the compiled programs), and neither model continues the other's state."""
  states, tokens = sequential
  other = model.init_random(tiny.cfg, seed=4, dtype=jnp.float32)
  want = np.asarray(prefill.prefill(other, tokens, all_logits=True))
  state = decode.start(other, tokens[:PROMPT], capacity=STATES)
  logits, _ = decode.extend(other, state, tokens[PROMPT:PROMPT + 2])
  got = np.concatenate([np.asarray(state.logits)[None], np.asarray(logits)])
  np.testing.assert_allclose(got, want[PROMPT - 1:PROMPT + 2], rtol=1e-5, atol=2e-5)
  assert np.abs(got - full[PROMPT - 1:PROMPT + 2]).max() > 0.1  # not tiny's
  with pytest.raises(ValueError, match="started with another model object.*start a new state"):
    decode.extend(other, states[PROMPT], [1])
  with pytest.raises(ValueError, match="started with another model object"):
    decode.verify(tiny, state, [1, 2])


def test_state_is_not_consumed(tiny, sequential):
  """A verification band leaves the state it started from as it was (the rollback keeps it)."""
  states, tokens = sequential
  before = decode.valid_view(tiny.cfg, states[15])
  decode.verify(tiny, states[15], tokens[15:19])
  after = decode.valid_view(tiny.cfg, states[15])
  assert all(np.array_equal(before[k], after[k]) for k in before)


def test_bad_input_is_refused(tiny, sequential):
  states, _ = sequential
  near_end = decode.start(tiny, [1, 2, 3], capacity=CAPACITY, offset=CAPACITY - 3)
  with pytest.raises(ValueError, match="exceed the state's capacity of 131072 positions"):
    decode.extend(tiny, near_end, [1])
  with pytest.raises(ValueError, match=r"a band of 9 tokens is wider than the state was made for \(8"):
    decode.extend(tiny, states[PROMPT], np.zeros(9, np.int32))
  with pytest.raises(ValueError, match="exceeds MAX_VERIFY"):
    decode.verify(tiny, states[PROMPT], np.zeros(decode.MAX_VERIFY + 1, np.int32))
  with pytest.raises(ValueError, match="token id 256 at position 1 is outside the vocabulary"):
    decode.extend(tiny, states[PROMPT], [3, 256])
  with pytest.raises(ValueError, match=r"capacity 200000 must lie in \(0, max_position_embeddings=131072\]"):
    decode.start(tiny, [1, 2, 3], capacity=200000)
  with pytest.raises(ValueError, match="a prompt of 3 tokens at position 131070 exceeds the capacity"):
    decode.start(tiny, [1, 2, 3], capacity=CAPACITY, offset=CAPACITY - 2)
  with pytest.raises(ValueError, match="cache_dtype float16 must be float32 or bfloat16"):
    decode.start(tiny, [1, 2, 3], capacity=CAPACITY, cache_dtype=jnp.float16)


def test_prompt_bands():
  f = dataclasses.replace(features.REFERENCE, prefill_band_tokens=16, long_context_chunk=4)
  assert decode.prompt_bands(37, f) == [16, 16, 4, 1]
  assert decode.prompt_bands(32, f) == [16, 16]
  assert decode.prompt_bands(3, f) == [3]


def test_speculation_gives_greedys_tokens(tiny, sequential):
  """Self-speculative decoding continues exactly as greedy decoding, whatever the drafts: a drafter that knows the
  greedy continuation but gets every 4th drafted token wrong exercises full acceptances (the band widening to 5)
  and rejections at every draft index; the n-gram drafter, whatever it finds."""
  states, tokens = sequential
  n = LENGTH - PROMPT - decode.MAX_VERIFY
  offered = []

  def oracle(context, k):
    draft = [int(t) for t in tokens[len(context):len(context) + k]]
    for i in range(len(draft)):
      offered.append(len(offered))
      if offered[-1] % 4 == 3:
        draft[i] = (draft[i] + 1) % tiny.cfg.vocab_size
    return draft

  spec = decode.speculate(tiny, states[PROMPT], tokens[:PROMPT], n, drafter=oracle)
  print(f"oracle: {spec.accepted}/{spec.drafted} drafted tokens accepted in {spec.bands} bands for {n} tokens")
  assert np.array_equal(spec.tokens, tokens[PROMPT:PROMPT + n])
  assert 0 < spec.accepted < spec.drafted and spec.bands < 0.6 * n
  assert n - 1 <= spec.bands + spec.accepted < n - 1 + 5  # the last band may overshoot
  ngram = decode.speculate(tiny, states[PROMPT], tokens[:PROMPT], n, ngram=1)
  assert np.array_equal(ngram.tokens, tokens[PROMPT:PROMPT + n])


def test_a_stop_token_ends_greedy_and_speculative_decoding(tiny, sequential):
  """A stop token (the EOS id) ends the continuation at its first occurrence, included, whether greedy chose it,
  speculation's pending token is it (index 5 with a drafter that knows the continuation: bands of 2, 3, 4) or an
  accepted draft token is (index 4)."""
  states, tokens = sequential
  want = tokens[PROMPT:PROMPT + 8].tolist()
  oracle = lambda context, k: [int(t) for t in tokens[len(context):len(context) + k]]
  assert want.index(want[4]) == 4 and want.index(want[5]) == 5, want  # first occurrences (else pick others)
  assert decode.greedy(tiny, states[PROMPT], 8, stop={want[5]}).tolist() == want[:6]
  for at in (4, 5):
    spec = decode.speculate(tiny, states[PROMPT], tokens[:PROMPT], 8, drafter=oracle, stop={want[at]})
    assert spec.tokens.tolist() == want[:at + 1], at
  jax_ints = lambda context, k: [jnp.int32(t) for t in oracle(context, k)]  # a drafter's tokens need not hash
  assert decode.speculate(tiny, states[PROMPT], tokens[:PROMPT], 8, drafter=jax_ints, stop={-5}).tokens.tolist() == want
  assert decode.greedy(tiny, states[PROMPT], 8, stop={-5}).tolist() == want  # never chosen: all 8


def test_speculation_never_rejects_its_pending_token(tiny, monkeypatch):
  """After a partly accepted draft the next token is the replayed state's choice. Chosen from the wide band's
  logits instead, a near-tie that the two bands round apart had the next band reject its own first token, and the
  output took draft tokens no state decoded, 155 logits below a prefill's choice. Planted here: head row 40 is row
  5 (scaled up) to ~3e-8 (that way, a band at length 11 rejected its first token)."""
  m = nnx.clone(tiny)
  w = np.array(m.head.weight[...])
  w[5] *= 40
  w[40] = w[5] * (1 + 3e-8 * np.random.default_rng(0).standard_normal(w.shape[1]))
  m.head.weight[...] = jnp.asarray(w)
  # A prompt of 5 tokens and 31 more: the step programs of a band of 5 and the prefill of `full`'s 36 tokens again
  prompt = np.array([5, 40] * 2 + [5], np.int32)
  n = LENGTH - len(prompt)
  verified, verify = [], decode.verify
  monkeypatch.setattr(decode, "verify", lambda *a: verified.append(verify(*a)) or verified[-1])
  spec = decode.speculate(m, decode.start(m, prompt, capacity=STATES), prompt.tolist(), n, ngram=2)
  assert len(verified) == spec.bands > 0 and min(v.accepted for v in verified) >= 1
  assert spec.accepted > 0 and any(v.accepted < 5 for v in verified)  # partial acceptances happened
  logits = np.asarray(prefill.prefill(m, np.concatenate([prompt, spec.tokens]), all_logits=True))
  chosen = logits[len(prompt) - 1:-1][np.arange(n), spec.tokens]
  assert np.max(logits[len(prompt) - 1:-1].max(axis=1) - chosen) < 1e-4 * np.abs(logits).max()


def test_a_verification_band_that_chunks_do_not_divide(tiny, sequential):
  """Chunks of 2 (long_context_chunk) do not divide a band of 3 drafted tokens: it runs as one chunk (a decode band
  is a few tokens), where it raised "not a multiple of long_context_chunk" mid-generation."""
  states, tokens = sequential
  chunked = dataclasses.replace(states[PROMPT].features, long_context_chunk=2, prefill_band_tokens=4)
  state = dataclasses.replace(states[PROMPT], features=chunked)
  logits, after = decode.extend(tiny, state, tokens[PROMPT:PROMPT + 3])
  want, _ = decode.extend(tiny, states[PROMPT], tokens[PROMPT:PROMPT + 3])
  np.testing.assert_allclose(np.asarray(logits), np.asarray(want), atol=1e-5)


def test_ngram_draft():
  assert decode.ngram_draft([5, 6, 7, 1, 2, 5, 6, 7], 3, n=3) == [1, 2, 5]
  assert decode.ngram_draft([5, 6, 7, 1, 5, 6, 7, 2, 5, 6, 7], 2, n=3) == [2, 5]  # the latest occurrence
  assert decode.ngram_draft([1, 2, 3, 4], 3, n=3) == []


def test_decode_through_every_fast_path():
  """tiny_sparse with every switch this device runs on, f32 operands (the kernels' math is then the exact path's):
  greedy decode after a 36-token prompt gives a full prefill's logits (the indexer keeps 4 of 9 rows), a band of 3
  gives three single steps', and a decode step runs the kernels of a prefill band, one for one (logits alone would
  not see a switch that decode drops).

  Cost: each band width compiles one program per layer kind, ~4 s each in Pallas interpret mode. The prompt goes
  in bands of 3, the verification band's width; the reference prefill (39 tokens in bands of 12, no query chunks,
  its MoE over the bands) has the shapes and features of tests/test_prefill.py's fast-path prefill, so in a full run
  one of the two loads its programs from the shared compilation cache (tests/conftest.py)."""
  device = features.device_class()
  m = model.init_random(config.tiny_sparse(), seed=5, dtype=jnp.float32)
  # the Mosaic GPU switches need bf16 operands and D, I multiples of 256 (tests/test_model_features.py runs them);
  # prefill_moe_over_bands runs a layer's MoE once for all bands, where this test counts the kernels of each band
  on = {s: cap.supported and s not in ("bf16_matmul", "prefill_moe_over_bands", *features.WGMMA_SWITCHES)
        for s, cap in features.CAPABILITIES[device].items()}
  f = features.resolve(device, on | {"prefill_band_tokens": 12, "long_context_chunk": 0})
  in_threes = dataclasses.replace(f, prefill_band_tokens=3)
  assert prefill.layer_features(in_threes, 3) == prefill.layer_features(f, 3)  # the layers see the same features
  P, n = 36, 3
  tokens = list(np.random.default_rng(5).integers(0, m.cfg.vocab_size, P))
  state = decode.start(m, tokens, in_threes, capacity=48)
  states = {P: state}
  for _ in range(n):
    tokens.append(int(np.argmax(state.logits)))
    _, state = decode.extend(m, state, tokens[-1:])
    states[state.length] = state
  tokens = np.asarray(tokens, np.int32)
  full = np.asarray(prefill.prefill(m, tokens, dataclasses.replace(f, prefill_moe_over_bands=True), all_logits=True))
  got = np.stack([np.asarray(states[p].logits) for p in range(P, P + n + 1)])
  np.testing.assert_allclose(got, full[P - 1:], rtol=1e-5, atol=2e-5)
  assert np.abs(full).max() > 1
  logits, band = decode.extend(m, states[P], tokens[P:])
  np.testing.assert_allclose(np.asarray(logits), got[1:], rtol=1e-5, atol=2e-5)
  assert_same_state(m.cfg, band, states[P + n])
  step = collections.Counter(k for k, _ in features.pallas_calls(lambda: decode.extend(m, state, [1])[0]))
  bands = collections.Counter(k for k, _ in features.pallas_calls(lambda: prefill.prefill(m, tokens, f)))
  print(f"a decode step runs {dict(step)}")
  assert step and {k: 4 * v for k, v in step.items()} == bands  # 4 bands of 12


def test_decodes_every_expert_names_the_slow_decode():
  """generate warns when each step would dequantize every routed expert (quantized experts, no in-kernel decode)."""
  cfg = config.tiny_sparse(hidden_size=128, moe_intermediate_size=128)  # the MIX formats' block multiples
  quantized, plain = model.abstract_model(cfg, policy="lucebox_mix"), model.abstract_model(cfg)
  slow = dataclasses.replace(features.REFERENCE, moe_compact_queue=True)  # MoE kernels, experts decoded first
  assert decode.decodes_every_expert(quantized, slow)
  assert not decode.decodes_every_expert(quantized, dataclasses.replace(slow, moe_sparse_gate_up=True))
  # the Mosaic GPU gate/up decodes W1/W3 itself, but its down reads W2 decoded on every step
  assert decode.decodes_every_expert(quantized, dataclasses.replace(slow, moe_sparse_gate_up=True,
                                                                     moe_wgmma_gate_up=True))
  assert not decode.decodes_every_expert(quantized, dataclasses.replace(slow, moe_sparse_gate_up=True,
                                                                         moe_wgmma_gate_up=True, moe_wgmma_down=True))
  assert not decode.decodes_every_expert(plain, slow)
  assert not decode.decodes_every_expert(quantized, features.REFERENCE)


def test_ngram_index_drafts_as_ngram_draft(rng):
  """speculate's incremental n-gram index gives `ngram_draft`'s draft after every appended token (small vocabulary:
  many repeats), for n = 1..3 and q = 1..4."""
  seq = [int(t) for t in rng.integers(0, 4, 60)]
  for n in (1, 2, 3):
    index = decode.NgramIndex(seq[:5], n)
    for t in seq[5:]:
      index.extend([t])
      for q in (1, 2, 4):
        assert index.draft(q) == decode.ngram_draft(index.tokens, q, n), (n, q, len(index.tokens))
  assert decode.NgramIndex([5, 6, 7, 1, 5, 6, 7, 2, 5, 6, 7], 3).draft(2) == [2, 5]  # the latest occurrence
  assert decode.NgramIndex([1, 2, 3, 9, 1, 2, 3], 3).draft(2) == [9, 1]  # the only one, at the very start
