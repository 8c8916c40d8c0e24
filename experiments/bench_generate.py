"""Decode speed (batch 1) after long prompts, with and without self-speculative verification (ds4jax/decode.py).

    python -m experiments.bench_generate --preset=v4_flash --quant_policy=lucebox_mix --dtype=bf16 \\
        --moe_sparse_gate_up --lengths=8192,131072 --new_tokens=64 --out=experiments/results/generate_h200.json

(Without --moe_sparse_gate_up, the H200's prefill default, every step dequantizes every routed expert: docs/decode.md
§6.)

For each prompt length (seeded synthetic ids, or --prompt_file's text through --tokenizer): the prompt is prefilled
into a decode state, then from that state

  band_ms     one band of q tokens, q = 1 (a decode step) .. 5 (the widest verification), median of --repeats:
              what a verification of q tokens costs against q decode steps
  greedy      --new_tokens greedy tokens: the first from the prompt's logits, then one step each; ms per step and
              tok/s over those steps (the host's argmax per token included)
  speculate   the same tokens, each band the pending token and an n-gram draft of 0-4 tokens: ms per token and tok/s
              over the tokens after the first, bands, drafted and accepted tokens, whether the tokens equal greedy's

Every length shares one state capacity (the longest prompt + new tokens + the widest band), so they share the layer
programs, which are compiled ahead, --precompile_workers at a time, when JAX_COMPILATION_CACHE_DIR is set. With random
weights the acceptance measures how repetitive the random model's own continuation is, not a language model's; the
band costs are what carries over to real weights. Results are rewritten after every length.
"""

from __future__ import annotations

import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from ds4jax import config, decode, mesh, model
from experiments import flags as ds4_flags
from experiments import device_memory, device_trace, run_record

_PRESET = flags.DEFINE_string("preset", "v4_flash", "Model preset (random weights).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the weights and of the prompt ids.")
_DTYPE = flags.DEFINE_enum("dtype", "bf16", ["f32", "bf16"], "Weight dtype.")
_CACHE_DTYPE = flags.DEFINE_enum("cache_dtype", "f32", ["f32", "bf16"], "Dtype of the cached rows.")
_LENGTHS = flags.DEFINE_list("lengths", ["8192", "131072"], "Prompt lengths (tokens).")
_PROMPT_FILE = flags.DEFINE_string("prompt_file", None, "Prompt text, tokenized with --tokenizer and repeated up to "
                                   "the longest length (default: seeded synthetic ids).")
_TOKENIZER = flags.DEFINE_string("tokenizer", "experiments/checkpoints/tiny_stdlib/tokenizer.json",
                                 "tokenizer.json for --prompt_file.")
_NEW = flags.DEFINE_integer("new_tokens", 64, "Tokens generated per run.")
_REPEATS = flags.DEFINE_integer("repeats", 10, "Timed bands per width (median).")
_NGRAM = flags.DEFINE_integer("ngram", 3, "Context tokens an n-gram draft is matched on.")
_WORKERS = flags.DEFINE_integer("precompile_workers", 8, "Layer programs compiled at once.")
_OUT = run_record.define_out_flag()
_TRACE = flags.DEFINE_string("trace_dir", None, "Also trace --trace_steps decode steps after the longest prompt "
                             "here and record the device time by kernel (experiments/device_trace.py).")
_TRACE_STEPS = flags.DEFINE_integer("trace_steps", 4, "Decode steps traced.")
ds4_flags.define_feature_flags()
ds4_flags.define_quant_policy_flag()
ds4_flags.define_mesh_flag()

WIDTHS = (1, 2, 3, 4, 5)


def band_ms(m, state: decode.State, q: int, repeats: int) -> float:
  """Median wall time of one band of q tokens on `state` (its logits fetched), after one untimed band."""
  tokens = np.arange(1, q + 1, dtype=np.int32)
  times = []
  for _ in range(repeats + 1):
    t0 = time.perf_counter()
    jax.block_until_ready(decode.extend(m, state, tokens)[0])
    times.append(time.perf_counter() - t0)
  return 1e3 * statistics.median(times[1:])


def rate(seconds: float, tokens: int) -> dict:
  """Tokens decoded after the first (which the prompt's logits give), per second and in ms each."""
  steps = tokens - 1
  return dict(seconds=seconds, steps=steps, tok_per_s=steps / seconds, ms_per_step=1e3 * seconds / steps)


def trace_steps(m, state: decode.State, steps: int, trace_dir: str) -> dict:
  """Device time by kernel over `steps` decode steps (one token each), and their wall time."""
  token = np.ones((1,), np.int32)
  jax.block_until_ready(decode.extend(m, state, token)[0])
  with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
    t0 = time.perf_counter()
    for _ in range(steps):
      jax.block_until_ready(decode.extend(m, state, token)[0])
    wall = time.perf_counter() - t0
  out = device_trace.summary(device_trace.kernel_times(device_trace.read_trace(trace_dir)), top=20)
  return dict(steps=steps, wall_ms_per_step=1e3 * wall / steps, device_ms_per_step=out["device_ms"] / steps, **out)


def measure(m, prompt: np.ndarray, features, capacity: int, widest: int, new_tokens: int, repeats: int,
            ngram: int, cache_dtype, log=print, trace_dir: str | None = None, traced_steps: int = 4) -> dict:
  """One prompt length's figures (see the module docstring)."""
  t0 = time.perf_counter()
  state = decode.start(m, prompt, features, capacity=capacity, widest=widest, cache_dtype=cache_dtype)
  jax.block_until_ready(state.logits)
  prefill_s = time.perf_counter() - t0
  log(f"{len(prompt)} tokens: prefill {prefill_s:.1f}s")
  bands = {q: band_ms(m, state, q, repeats) for q in WIDTHS}
  log("  band ms " + ", ".join(f"q={q}: {t:.2f}" for q, t in bands.items()))
  decode.greedy(m, state, 3)  # the argmax and logits programs, and verification's choices at each width
  for q in WIDTHS:
    decode.verify(m, state, np.arange(1, q + 1, dtype=np.int32))
  t0 = time.perf_counter()
  greedy = decode.greedy(m, state, new_tokens)
  greedy_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  spec = decode.speculate(m, state, prompt.tolist(), new_tokens, ngram=ngram)
  spec_s = time.perf_counter() - t0
  out = dict(prompt_tokens=len(prompt), prefill_s=prefill_s, band_ms={str(q): t for q, t in bands.items()},
             greedy=dict(**rate(greedy_s, new_tokens), tokens=greedy.tolist()),
             speculate=dict(**rate(spec_s, new_tokens), bands=spec.bands, drafted=spec.drafted,
                            accepted=spec.accepted, acceptance=spec.accepted / max(spec.drafted, 1),
                            same_as_greedy=bool(np.array_equal(spec.tokens, greedy))))
  if trace_dir:
    out["trace"] = trace_steps(m, state, traced_steps, trace_dir)
    log(f"  traced: {out['trace']['wall_ms_per_step']:.1f} ms per step, {out['trace']['device_ms_per_step']:.1f} ms "
        f"of it on the device; " + ", ".join(f"{k['kernel']} {k['ms']:.1f}" for k in out["trace"]["kernels"][:8]))
  log(f"  greedy {out['greedy']['ms_per_step']:.1f} ms a step ({out['greedy']['tok_per_s']:.1f} tok/s); speculative "
      f"{out['speculate']['tok_per_s']:.1f} tok/s, "
      f"{spec.accepted}/{spec.drafted} drafted accepted in {spec.bands} bands, "
      f"{'the same tokens' if out['speculate']['same_as_greedy'] else 'NOT the same tokens'} as greedy")
  return out


def prompt_ids(n: int, vocab: int) -> tuple[np.ndarray, dict]:
  """n prompt ids and where they came from: --prompt_file's text repeated, or seeded synthetic ids."""
  if not _PROMPT_FILE.value:
    ids = np.random.default_rng(_SEED.value).integers(0, vocab, n).astype(np.int32)
    return ids, dict(kind="synthetic", seed=_SEED.value)
  import tokenizers  # pylint: disable=import-outside-toplevel  (optional: only for text prompts)
  try:
    with open(_PROMPT_FILE.value, encoding="utf-8") as f:
      raw = f.read()
    text = tokenizers.Tokenizer.from_file(_TOKENIZER.value).encode(raw).ids
  except Exception as e:  # pylint: disable=broad-except  (OSError, UnicodeDecodeError; tokenizers' bare Exception)
    raise ValueError(f"--prompt_file={_PROMPT_FILE.value} with --tokenizer={_TOKENIZER.value}: {e}") from None
  if not text or max(text) >= vocab:
    raise ValueError(f"--prompt_file gives {len(text)} tokens with ids up to {max(text, default=None)}; the "
                     f"vocabulary has {vocab}")
  ids = np.resize(np.asarray(text, np.int32), n)
  return ids, dict(kind="file", path=_PROMPT_FILE.value, tokenizer=_TOKENIZER.value, tokens=len(text),
                   repeated=n > len(text))


def start():
  """The model config, the features, the prompt lengths and the cache capacity, checked before any weights."""
  cfg = config.preset(_PRESET.value)
  # No `tokens`: sm_90's one-band MoE defaults were measured on prefills, and decode steps with those kernels have
  # not run on a GPU, so they are on here only when asked (docs/decode.md §6).
  features = ds4_flags.features_from_flags(flags.FLAGS, cfg=cfg, policy=flags.FLAGS.quant_policy)
  if not _LENGTHS.value or not all(n.isdigit() and int(n) > 0 for n in _LENGTHS.value):
    raise ValueError(f"--lengths must be positive integers, got {_LENGTHS.value}")
  lengths = sorted(int(n) for n in _LENGTHS.value)
  if _NEW.value < 2:
    raise ValueError(f"--new_tokens={_NEW.value}: at least 2 (the first comes from the prompt's logits)")
  if _REPEATS.value < 1 or _NGRAM.value < 1:
    raise ValueError(f"--repeats and --ngram must be >= 1, got {_REPEATS.value} and {_NGRAM.value}")
  capacity = lengths[-1] + _NEW.value + decode.MAX_VERIFY
  if capacity > cfg.max_position_embeddings:
    raise ValueError(f"--lengths: {lengths[-1]} tokens + {_NEW.value} new leave no room in "
                     f"max_position_embeddings={cfg.max_position_embeddings}")
  ds4_flags.check_mesh("bench_generate", flags.FLAGS.mesh, cfg)  # before drawing the weights
  ds4_flags.check_model_features("bench_generate", cfg, flags.FLAGS.quant_policy, features)
  return cfg, features, lengths, capacity


def main(argv):
  del argv
  device_memory.claim()  # before JAX starts its backend: the full model needs 95% of an H200
  try:
    cfg, features, lengths, capacity = start()
    prompt, source = prompt_ids(lengths[-1], cfg.vocab_size)
  except ValueError as e:  # FeatureError, an unknown preset, bad lengths, an unreadable prompt, ...
    sys.exit(f"bench_generate: {e}")
  dtype = jnp.float32 if _DTYPE.value == "f32" else jnp.bfloat16
  cache_dtype = jnp.float32 if _CACHE_DTYPE.value == "f32" else jnp.bfloat16
  t0 = time.perf_counter()
  m = model.init_random(cfg, _SEED.value, dtype, flags.FLAGS.quant_policy, mesh=flags.FLAGS.mesh)
  jax.block_until_ready(m.embed[...])
  print(f"{cfg.name} {flags.FLAGS.quant_policy}: weights in {time.perf_counter() - t0:.0f}s; on: "
        f"{', '.join(features.on()) or 'none'}; {mesh.describe(flags.FLAGS.mesh, cfg)}", flush=True)
  widths = sorted({*WIDTHS, *(w for n in lengths for w in decode.prompt_bands(n, features))})
  widest = max(decode.MAX_VERIFY, *widths)  # one cache shape for every length
  if jax.config.jax_compilation_cache_dir:
    t0 = time.perf_counter()
    empty = decode.empty_state(m, capacity, widest, features, cache_dtype)
    n = decode.precompile(m, empty, widths, _WORKERS.value)
    del empty
    print(f"precompiled {n} layer programs for bands of {widths} in {time.perf_counter() - t0:.0f}s", flush=True)
  record = dict(env=run_record.environment(), preset=cfg.name, quant_policy=flags.FLAGS.quant_policy,
                mesh=mesh.spec_of(m), dtype=_DTYPE.value, cache_dtype=_CACHE_DTYPE.value,
                features=features.to_dict(), capacity=capacity, new_tokens=_NEW.value, repeats=_REPEATS.value,
                ngram=_NGRAM.value, prompt=source, lengths={})
  for n in lengths:
    record["lengths"][str(n)] = measure(m, prompt[:n], features, capacity, widest, _NEW.value, _REPEATS.value,
                                        _NGRAM.value, cache_dtype, log=lambda s: print(s, flush=True),
                                        trace_dir=_TRACE.value if n == lengths[-1] else None,
                                        traced_steps=_TRACE_STEPS.value)
    if _OUT.value:
      run_record.write_json(_OUT.value, record)


if __name__ == "__main__":
  app.run(main)
