"""Greedy generation from a prompt, optionally with self-speculative verification (ds4jax/decode.py).

    python -m experiments.generate --checkpoint=experiments/checkpoints/tiny_stdlib --prompt="def main(" \
        --max_new_tokens=64 [--speculate]

The prompt is text (through the checkpoint's tokenizer.json, or --tokenizer) or --prompt_ids. With --speculate
each band verifies an n-gram draft from the text so far (q adaptive 2-5); the output is the same tokens as
without it. Prints the continuation, then prefill and decode tok/s and the acceptance.
"""

from __future__ import annotations

import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from ds4jax import config, decode, model
from ds4jax import mesh as mesh_lib
from ds4jax import moe as moe_lib
from ds4jax.checkpoint import mapping
from experiments import flags as ds4_flags
from experiments import processes, run_record

_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "Checkpoint directory (config.json + safetensors).")
_PRESET = flags.DEFINE_string("preset", "tiny_sparse", "Model preset for random weights (no --checkpoint).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the random weights.")
_PROMPT = flags.DEFINE_string("prompt", None, "Prompt text (tokenized with --tokenizer or the checkpoint's).")
_PROMPT_IDS = flags.DEFINE_list("prompt_ids", None, "Prompt token ids, instead of --prompt.")
_TOKENIZER = flags.DEFINE_string("tokenizer", None, "tokenizer.json (default: the checkpoint's).")
_NEW = flags.DEFINE_integer("max_new_tokens", 64, "Tokens to generate.")
_SPECULATE = flags.DEFINE_boolean("speculate", False, "Verify n-gram drafts of 2-5 tokens in one band each.")
_NGRAM = flags.DEFINE_integer("ngram", 3, "Context tokens an n-gram draft is matched on.")
_COMPARE = flags.DEFINE_boolean("compare_greedy", False, "With --speculate, also decode without verification and "
                                "report whether the tokens are identical (exit status 1 if not).")
_DTYPE = flags.DEFINE_enum("dtype", "f32", ["f32", "bf16"], "Weight dtype.")
_CACHE_DTYPE = flags.DEFINE_enum("cache_dtype", "f32", ["f32", "bf16"],
                                 "Dtype the decode state stores its cached rows in (docs/decode.md §1).")
_JSON = flags.DEFINE_string("json", None, "Also write the figures to this JSON file.")
_STOP = flags.DEFINE_list("stop_ids", None, "Token ids that end the continuation (included); default the model's EOS "
                          "id (config.json's eos_token_id); --stop_ids= generates all --max_new_tokens.")
ds4_flags.define_feature_flags()
ds4_flags.define_quant_policy_flag()
ds4_flags.define_mesh_flag()
processes.define_flags()


class UsageError(ValueError):
  """A bad command line: printed as one line (as experiments.prefill prints its start-up errors)."""


def _tokenizer():
  path = _TOKENIZER.value or (os.path.join(_CHECKPOINT.value, "tokenizer.json") if _CHECKPOINT.value else None)
  if not path or not os.path.exists(path):
    raise UsageError(f"--prompt needs a tokenizer.json (--tokenizer, or one in --checkpoint); got {path}")
  import tokenizers  # pylint: disable=import-outside-toplevel  (optional: only for text prompts)
  try:
    return tokenizers.Tokenizer.from_file(path)
  except Exception as e:  # pylint: disable=broad-except  (tokenizers raises a bare Exception)
    raise UsageError(f"{path} cannot be read as a tokenizer: {e}") from None


def main(argv):
  del argv
  try:
    where = processes.start_from_flags(flags.FLAGS)
    if where:
      print(where, flush=True)
    run()
  except ValueError as e:  # UsageError, CheckpointError, FeatureError, bad token ids, ...
    sys.exit(f"generate: {e}")


def _stop_ids(cfg) -> set[int]:
  """--stop_ids checked against the vocabulary (before any weights are read); by default the EOS id."""
  if _STOP.value is None:
    return {cfg.eos_token_id}
  try:
    return set(model.check_tokens([int(t) for t in _STOP.value], cfg).tolist()) if _STOP.value else set()
  except ValueError as e:
    raise UsageError(f"--stop_ids: {e}") from None


def run() -> dict:
  if (_PROMPT.value is None) == (_PROMPT_IDS.value is None):
    raise UsageError("give exactly one of --prompt and --prompt_ids")
  if _JSON.value and (problem := run_record.out_problem(_JSON.value)):
    raise UsageError(f"--json={_JSON.value}: {problem}")
  if _SPECULATE.value and _NGRAM.value < 1:
    raise UsageError(f"--ngram must be >= 1, got {_NGRAM.value}")
  feats = ds4_flags.features_from_flags(flags.FLAGS)
  dtype = jnp.float32 if _DTYPE.value == "f32" else jnp.bfloat16
  mesh_spec = flags.FLAGS.mesh
  ds4_flags.check_mesh("generate", mesh_spec, None)
  # Everything about the command line is checked against the model's config before any weight is read or drawn.
  cfg = (config.DeepseekV4Config.from_hf_config(_CHECKPOINT.value) if _CHECKPOINT.value
         else config.preset(_PRESET.value))
  ds4_flags.check_mesh("generate", mesh_spec, cfg)
  ds4_flags.check_model_features("generate", cfg, flags.FLAGS.quant_policy, feats)
  stop = _stop_ids(cfg)
  tok = _tokenizer() if _PROMPT.value is not None else None
  try:
    ids = model.check_tokens(tok.encode(_PROMPT.value).ids if tok else [int(x) for x in _PROMPT_IDS.value], cfg)
  except ValueError as e:
    raise UsageError(f"{'--prompt' if tok else '--prompt_ids'}: {e}") from None
  n = _NEW.value
  room = cfg.max_position_embeddings - len(ids) - (decode.MAX_VERIFY if _SPECULATE.value else 1)
  if room < 1:
    raise UsageError(f"the prompt of {len(ids)} tokens leaves no room to generate (max_position_embeddings="
                     f"{cfg.max_position_embeddings})")
  if not 0 < n <= room:
    raise UsageError(f"--max_new_tokens={n}: the prompt of {len(ids)} tokens leaves room for 1..{room} "
                     f"(max_position_embeddings={cfg.max_position_embeddings})")
  if _CHECKPOINT.value:
    m = mapping.load_checkpoint(_CHECKPOINT.value, cfg, dtype=dtype, policy=flags.FLAGS.quant_policy, log=None,
                                mesh=mesh_spec)
  else:
    m = model.init_random(cfg, _SEED.value, dtype, flags.FLAGS.quant_policy, mesh=mesh_spec)
  print(f"{m.cfg.name} {'checkpoint ' + _CHECKPOINT.value if _CHECKPOINT.value else 'random weights'}; "
        f"{len(ids)} prompt tokens; switches on: {feats.on() or 'none'}; {mesh_lib.describe(mesh_spec, m.cfg)}",
        flush=True)

  if decode.decodes_every_expert(m, feats):
    print("note: every decode step dequantizes routed expert stacks of every layer first "
          f"({', '.join(moe_lib.decoded_beforehand(feats))}; several times slower on V4-Flash); decode with "
          "--moe_sparse_gate_up, and --moe_wgmma_gate_up only with --moe_wgmma_down (else its down reads W2 decoded; "
          "docs/decode.md §6)",
          flush=True)
  say = lambda done, bands, drafted, accepted: print(
      f"\r  {done}/{n} tokens, {bands} bands" + (f", {accepted}/{drafted} drafted accepted" if drafted else ""),
      end="", flush=True)
  widest = decode.MAX_VERIFY if _SPECULATE.value else 1
  t0 = time.perf_counter()
  state = decode.start(m, ids, feats, capacity=len(ids) + n + widest, widest=widest,
                       cache_dtype=jnp.float32 if _CACHE_DTYPE.value == "f32" else jnp.bfloat16)
  jax.block_until_ready(state.logits)
  prefill_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  if _SPECULATE.value:
    spec = decode.speculate(m, state, ids, n, ngram=_NGRAM.value, progress=say, stop=stop)
    out, extra = spec.tokens, dict(bands=spec.bands, drafted=spec.drafted, accepted=spec.accepted,
                                    acceptance=spec.accepted / max(spec.drafted, 1))
  else:
    out = decode.greedy(m, state, n, progress=say, stop=stop)
    extra = dict(bands=len(out) - 1)
  print()
  decode_s = time.perf_counter() - t0
  if _SPECULATE.value and _COMPARE.value:
    extra["same_as_greedy"] = bool(np.array_equal(out, decode.greedy(m, state, n, stop=stop)))
  text = tok.decode(out.tolist()) if tok else " ".join(map(str, out.tolist()))
  print(text)
  stopped = int(out[-1]) in stop
  if stopped:
    print(f"stopped by token id {out[-1]} ({'--stop_ids' if _STOP.value else 'the EOS id'}) after {len(out)} of {n} "
          "tokens")
  result = dict(env=run_record.environment(), model=m.cfg.name, checkpoint=_CHECKPOINT.value,
                prompt_tokens=len(ids), new_tokens=len(out), stop_ids=sorted(stop), stopped=stopped,
                tokens=out.tolist(), speculate=_SPECULATE.value, features=feats.to_dict(), mesh=mesh_lib.spec_of(m),
                cache_dtype=_CACHE_DTYPE.value,
                prefill_tok_per_s=len(ids) / prefill_s, decode_tok_per_s=len(out) / decode_s, **extra)
  print(f"prefill {result['prefill_tok_per_s']:.1f} tok/s (first call, compile included); decode "
        f"{result['decode_tok_per_s']:.1f} tok/s (compiles included)"
        + (f"; {spec.accepted}/{spec.drafted} drafted tokens accepted in {spec.bands} bands" if _SPECULATE.value
           else ""))
  if "same_as_greedy" in extra:
    print("the same tokens as greedy decoding without verification" if extra["same_as_greedy"] else
          "NOT the tokens of greedy decoding without verification")
  if _JSON.value and processes.writes():
    with open(_JSON.value, "w") as f:
      json.dump(result, f, indent=1)
  if not extra.get("same_as_greedy", True):
    raise UsageError("speculative decoding diverged from greedy decoding")
  return result


if __name__ == "__main__":
  app.run(main)
