"""The prefill qualification matrix: every switch killable, each configuration timed and checked against the exact path.

Upstream (Lucebox #685) qualifies with matched runs: the same prompt ids and weights for every configuration, the
deployed settings plus each new switch, each switch independently killable, 2 warm-ups + 3 runs (median), and a
next-token KL gate of 0.006 against the control. This module is that protocol for ds4jax:

  configurations  all_on (the flags' resolved features), kill_<switch> for every switch on (a switch others require
                  takes them down too: `also_off`), kill_<knob> for the chunk/band knobs (0 = one chunk / one band),
                  all_off (REFERENCE on the same device class: the exact path)
  timing          cold run (incl. compile), >= 2 warm-ups, >= 1 timed runs, median tokens/s; with
                  --precompile_workers every layer program is first compiled in parallel into jax's persistent
                  cache, and the cold run loads it. A configuration whose cold run exceeds --max_cold_s is
                  recorded "too_slow": its cold run and parity, no warm-ups or timed runs; at a longer length,
                  where its cold run scaled by length would exceed the limit too, it is recorded "not_run"
  parity          final-position logits vs the exact path on the same prompt (a prefix where it does not fit):
                  NMSE, max abs error, top-1 agreement, KL(exact || config) against --kl_gate. For a prefix of p
                  tokens the configuration's logits at position p - 1 come from its own full-length cold run (the
                  model is causal); the exact prefix logits are computed once and kept next to --out
                  (<out>.exact.npz) for later bounded calls with the same weights and prompt. A configuration
                  whose full length runs out of memory is still checked on that prefix (status stays "failed").
  noise floor     the exact path once more with its input streams perturbed by one f32 rounding
                  (--noise_floor_eps), against itself: how far rounding alone moves the statistic. A KL above the
                  gate is "unresolved" (not "FAIL") when the floor is above the gate too and the KL is within
                  FLOOR_FACTOR of it: random-weight models can be that chaotic (parity_by_switch --per_layer then
                  checks each layer's own error).

Library code: the absl entry point is experiments/prefill.py; tests and notebooks call `run(Options(...))` and
`load_results(path)`. Results are one JSON document {"records": [...], "invocations": [...]}, rewritten after every
configuration, plus a markdown table next to it (.md).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import gc
import hashlib
import json
import math
import os
import re
import statistics
import time
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from ds4jax import config as config_lib
from ds4jax.checkpoint import mapping
from ds4jax import features as features_lib
from ds4jax import model as model_lib
from ds4jax import prefill as prefill_lib
from ds4jax.features import KNOBS, SWITCHES, FeatureError, Features
from ds4jax.metrics import kl_divergence, nmse
from ds4jax.quant import policy as quant_policy
from experiments import flags as flags_lib
from experiments import run_record


SCHEMA = "ds4jax.prefill_qualification/1"
KL_GATE = 0.006  # upstream's preregistered teacher-forced mean-KL gate (docs/upstream.md §7.4)
# A KL above the gate is "unresolved" rather than a failure when the noise floor is above the gate too and the KL
# is within this factor of it: the floor is one sample of a chaotic quantity (on the random V4-Flash two runs of
# the same f32 kernels measured KL 0.006 and 0.048 against the same exact logits).
FLOOR_FACTOR = 10.0
# Statuses of a record that measured its configuration (too_slow: a cold run but no timed runs). A "failed" record
# may hold parity too: a full length that ran out of memory is still checked on the parity prefix.
MEASURED = ("ok", "too_slow")
KILLABLE_KNOBS = ("long_context_chunk", "prefill_band_tokens")  # killed = set to 0 (one chunk / one band)
DTYPES = {"bf16": jnp.bfloat16, "f32": jnp.float32}


class StartupError(ValueError):
  """A bad input found before any work (flags, files, prompt, results file)."""


STARTUP_ERRORS = (StartupError, FeatureError)


# ---- options ----
@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Options:
  """Everything a qualification run needs; the flags map onto it one to one (see `define_flags`)."""

  preset: str | None = None            # random weights at a config preset, or
  checkpoint: str | None = None        # a checkpoint directory (config.json + safetensors)
  quant_policy: str = "bf16"
  dtype: str = "bf16"
  seed: int = 0                        # random weights and synthetic prompt ids
  prompt_file: str | None = None       # text, tokenised with `tokenizer`; else synthetic ids
  tokenizer: str | None = None         # default <checkpoint>/tokenizer.json
  lengths: tuple[int, ...] = (8192,)
  configs: tuple[str, ...] = ()        # empty = the whole matrix
  warmups: int = 2
  repeats: int = 3
  min_warmups: int = 2                 # protocol floor; tests lower it
  exact_max_tokens: int = 0            # exact path at full length only up to this (0 = no limit)
  parity_prefix_tokens: int = 4096     # prefix checked where the exact path does not fit
  kl_gate: float = KL_GATE
  noise_floor_eps: float = 2.0 ** -24  # the noise floor's input perturbation (one f32 rounding); 0 = none
  out: str = "/tmp/ds4jax_prefill_qual.json"
  append: bool = False
  precompile_workers: int = 0          # > 0: compile every layer program first, this many in parallel
  max_cold_s: float = 0.0              # > 0: a slower cold run ends the configuration's timing ("too_slow")
  features: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # switch/knob -> value (None = table)
  device_class: str | None = None      # default: the capability-table class of jax.devices()[0]


def define_flags(flag_values=None) -> None:
  """The command's flags, plus one flag per feature switch/knob and --quant_policy, on `flag_values`."""
  from absl import flags  # pylint: disable=import-outside-toplevel

  fv = flags.FLAGS if flag_values is None else flag_values
  d = Options()
  flags.DEFINE_string("preset", None, f"Random weights at this config preset, one of {sorted(config_lib.PRESETS)}.",
                      flag_values=fv)
  flags.DEFINE_string("checkpoint", None, "Checkpoint directory (config.json + safetensors) instead of --preset.",
                      flag_values=fv)
  flags.DEFINE_enum("dtype", d.dtype, list(DTYPES), "Storage dtype of the unquantized weights.", flag_values=fv)
  flags.DEFINE_integer("seed", d.seed, "Seed of the random weights and of the synthetic prompt ids.", flag_values=fv)
  flags.DEFINE_string("prompt_file", None, "Prompt text, tokenised with --tokenizer; default: seeded synthetic ids.",
                      flag_values=fv)
  flags.DEFINE_string("tokenizer", None, "tokenizer.json for --prompt_file (default <checkpoint>/tokenizer.json).",
                      flag_values=fv)
  flags.DEFINE_list("lengths", [str(n) for n in d.lengths], "Exact prompt lengths in tokens.", flag_values=fv)
  flags.DEFINE_list("configs", [], "Configurations to run (default: the whole matrix), e.g. all_on,all_off.",
                    flag_values=fv)
  flags.DEFINE_integer("warmups", d.warmups, f"Warm-up runs after the cold run (>= {d.min_warmups}).", flag_values=fv)
  flags.DEFINE_integer("repeats", d.repeats, "Timed runs (median tokens/s reported).", flag_values=fv)
  flags.DEFINE_integer("exact_max_tokens", d.exact_max_tokens,
                       "Longest prompt the exact path runs at full length (0 = no limit); beyond it parity is "
                       "checked on a prefix.", flag_values=fv)
  flags.DEFINE_integer("parity_prefix_tokens", d.parity_prefix_tokens,
                       "Prefix length compared where the exact path exceeds --exact_max_tokens or runs out of memory.",
                       flag_values=fv)
  flags.DEFINE_float("kl_gate", d.kl_gate, "Parity passes when KL(exact || config) <= this (upstream: 0.006).",
                     flag_values=fv)
  flags.DEFINE_float("noise_floor_eps", d.noise_floor_eps,
                     "Noise floor: the exact path is run once more with its embedded streams multiplied by "
                     "(1 + eps z), z ~ N(0, 1), in f32, and compared with itself like a configuration. A KL gate "
                     "below that KL cannot be resolved on this model and prompt. Default 2^-24: one f32 rounding "
                     "(about half the elements move by one ulp, the rest round back). 0 = skip; else >= 2^-24.",
                     flag_values=fv)
  flags.DEFINE_string("out", d.out, "Results JSON (the markdown table goes next to it as .md).", flag_values=fv)
  flags.DEFINE_integer("precompile_workers", d.precompile_workers,
                       "Before timing, compile every layer program of the planned runs this many at a time into "
                       "jax's persistent compilation cache (0 = compile in each cold run).", flag_values=fv)
  flags.DEFINE_float("max_cold_s", d.max_cold_s,
                     "A configuration whose cold run takes longer is recorded with that cold run and its parity but "
                     "not warmed up or timed (result 'too_slow'), so one slow path cannot eat a bounded call; at "
                     "longer lengths, where that cold run scaled by length exceeds the limit, it is not run (result "
                     "'not_run'). --append retries both only under a higher limit or none. 0 = no limit.",
                     flag_values=fv)
  flags.DEFINE_boolean("append", d.append, "Keep the records in --out; skip (length, config) pairs already done with "
                       "the same weights and prompt; retry failed ones.", flag_values=fv)
  flags_lib.define_quant_policy_flag(fv)
  flags_lib.define_feature_flags(fv)


def options_from_flags(fv) -> Options:
  """Options from parsed flags; malformed values raise StartupError."""
  try:
    lengths = tuple(int(x) for x in fv.lengths)
  except ValueError as e:
    raise StartupError(f"--lengths must be integers, got {fv.lengths}") from e
  return Options(preset=fv.preset, checkpoint=fv.checkpoint, quant_policy=fv.quant_policy, dtype=fv.dtype,
                 seed=fv.seed, prompt_file=fv.prompt_file, tokenizer=fv.tokenizer, lengths=lengths,
                 configs=tuple(fv.configs), warmups=fv.warmups, repeats=fv.repeats,
                 exact_max_tokens=fv.exact_max_tokens, parity_prefix_tokens=fv.parity_prefix_tokens,
                 kl_gate=fv.kl_gate, noise_floor_eps=fv.noise_floor_eps, out=fv.out, append=fv.append,
                 precompile_workers=fv.precompile_workers, max_cold_s=fv.max_cold_s,
                 features={k: getattr(fv, k) for k in list(SWITCHES) + list(KNOBS)})


# ---- the matrix ----
@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Configuration:
  name: str
  features: Features
  killed: tuple[str, ...] = ()
  also_off: tuple[str, ...] = ()  # switches that require the killed one, turned off with it


def _dependents(switch: str) -> list[str]:
  """Switches that require `switch`, directly or through another switch (SWITCHES order)."""
  out: set[str] = set()
  frontier = {switch}
  while frontier:
    frontier = {s for s, (_, _, req) in SWITCHES.items() if set(req) & frontier and s not in out}
    out |= frontier
  return [s for s in SWITCHES if s in out]


def _checked(f: Features) -> Features:
  """Re-resolves a derived feature set, so a kill can never produce a combination the table rejects."""
  return features_lib.resolve(f.device_class, {k: getattr(f, k) for k in list(SWITCHES) + list(KNOBS)})


def matrix(base: Features) -> list[Configuration]:
  """all_on, kill_<switch> per switch on, kill_<knob> per non-zero chunk/band knob, all_off (in that order)."""
  configs = [Configuration(name="all_on", features=base)]
  for s in base.on():
    also = [d for d in _dependents(s) if getattr(base, d)]
    f = dataclasses.replace(base, **{x: False for x in [s, *also]})
    configs.append(Configuration(name=f"kill_{s}", features=_checked(f), killed=(s,), also_off=tuple(also)))
  for k in KILLABLE_KNOBS:
    if getattr(base, k):
      configs.append(Configuration(name=f"kill_{k}", features=_checked(dataclasses.replace(base, **{k: 0})),
                                   killed=(k,)))
  configs.append(Configuration(name="all_off", features=exact_features(base.device_class)))
  return configs


def exact_features(device_cls: str) -> Features:
  """The exact path: every switch off (ds4jax.features.REFERENCE) on the given device class."""
  return dataclasses.replace(features_lib.REFERENCE, device_class=device_cls)


# ---- parity metrics (float64; ds4jax/metrics.py) ----
def parity_metrics(logits, exact, kl_gate: float = KL_GATE) -> dict[str, Any]:
  """Final-position logits of a configuration against the exact path's."""
  a, b = np.asarray(logits, np.float64), np.asarray(exact, np.float64)
  if a.shape != b.shape:
    raise ValueError(f"logits shape {a.shape} != exact logits shape {b.shape}")
  finite = bool(np.isfinite(a).all())
  if not np.isfinite(b).all():
    raise ValueError("the exact path's logits are not finite")
  out = dict(nmse=nmse(a, b), max_abs=float(np.max(np.abs(a - b))), top1_agree=bool(a.argmax() == b.argmax()),
             top1=int(a.argmax()), top1_exact=int(b.argmax()), kl=kl_divergence(b, a) if finite else math.inf,
             finite=finite, kl_gate=kl_gate)
  out["pass"] = finite and out["kl"] <= kl_gate
  return out


# ---- fingerprints ----
def sha256_array(x: np.ndarray) -> str:
  return hashlib.sha256(np.ascontiguousarray(x).tobytes()).hexdigest()


def _unsigned(x: jnp.ndarray) -> jnp.ndarray:
  """The bits of an array as an unsigned integer array of the same width (order-independent checksums)."""
  width = jnp.dtype(x.dtype).itemsize
  kind = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[width]
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint8)
  if width == 8:
    x = x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x.astype(jnp.int32)
  return x if x.dtype == kind else jax.lax.bitcast_convert_type(x, kind)


@functools.partial(jax.jit, static_argnums=1)
def _leaf_digests(arrays, samples_per_leaf: int):
  """Per array: a strided sample of its bits plus the last element, and a wrap-around uint32 sum of all its bits."""
  out = []
  for x in arrays:
    flat = _unsigned(x).reshape(-1)
    n = flat.shape[0]
    sample = jax.lax.slice(flat, (0,), (n,), (max(1, n // samples_per_leaf),))[:samples_per_leaf]
    out.append((jnp.concatenate([sample, flat[-1:]]), flat.astype(jnp.uint32).sum(dtype=jnp.uint32)))
  return out


def weights_fingerprint(m, samples_per_leaf: int = 1024) -> str:
  """sha256 over every weight's path, shape and dtype, a strided sample of its bits, and an integer sum of all its
  bits (every byte counts; an integer sum does not depend on the reduction order, so the fingerprint is
  reproducible across runs and bounded calls). Computed on the device; only the samples reach the host."""
  from flax import nnx  # pylint: disable=import-outside-toplevel

  leaves = [(jax.tree_util.keystr(p), x) for p, x in jax.tree_util.tree_leaves_with_path(nnx.state(m))]
  arrays = [x for _, x in leaves if hasattr(x, "dtype") and x.size]
  digests = iter(jax.device_get(_leaf_digests(arrays, samples_per_leaf)))
  h = hashlib.sha256()
  for name, x in leaves:
    h.update(f"{name}|{getattr(x, 'shape', None)}|{getattr(x, 'dtype', type(x).__name__)}|".encode())
    if hasattr(x, "dtype") and x.size:
      sample, total = next(digests)
      h.update(np.asarray(sample).tobytes() + np.asarray(total).tobytes())
    elif not hasattr(x, "dtype"):
      h.update(repr(x).encode())
  return h.hexdigest()


def _file_sha256(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      h.update(chunk)
  return h.hexdigest()


# ---- inputs ----
def _model_config(opts: Options) -> config_lib.DeepseekV4Config:
  if (opts.preset is None) == (opts.checkpoint is None):
    raise StartupError("give exactly one of --preset (random weights) or --checkpoint (a checkpoint directory)")
  if opts.checkpoint is not None:
    if not os.path.isfile(os.path.join(opts.checkpoint, "config.json")):
      raise StartupError(f"--checkpoint={opts.checkpoint}: no config.json there")
    return config_lib.DeepseekV4Config.from_hf_config(opts.checkpoint)
  try:
    return config_lib.preset(opts.preset)
  except ValueError as e:
    raise StartupError(f"--preset: {e}") from e


def _tokenizer_path(opts: Options) -> str:
  path = opts.tokenizer or (os.path.join(opts.checkpoint, "tokenizer.json") if opts.checkpoint else None)
  if path is None:
    raise StartupError("--prompt_file needs --tokenizer (a tokenizer.json) when no --checkpoint is given")
  if not os.path.isfile(path):
    raise StartupError(f"tokenizer file {path} does not exist")
  return path


def prompt_ids(opts: Options, cfg: config_lib.DeepseekV4Config) -> tuple[np.ndarray, dict[str, Any]]:
  """int32 ids of at least max(lengths) tokens, and where they came from. Every length uses a prefix of them."""
  need = max(opts.lengths)
  if opts.prompt_file is None:
    ids = np.random.default_rng(opts.seed).integers(0, cfg.vocab_size, need).astype(np.int32)
    source = dict(kind="synthetic", seed=opts.seed, vocab_size=cfg.vocab_size)
  else:
    if not os.path.isfile(opts.prompt_file):
      raise StartupError(f"--prompt_file={opts.prompt_file} does not exist")
    tok_path = _tokenizer_path(opts)
    try:
      import tokenizers  # pylint: disable=import-outside-toplevel
    except ImportError as e:
      raise StartupError("--prompt_file needs the `tokenizers` package (pip install tokenizers)") from e
    with open(opts.prompt_file, encoding="utf-8") as f:
      text = f.read()
    ids = np.asarray(tokenizers.Tokenizer.from_file(tok_path).encode(text).ids, np.int64)
    if ids.shape[0] < need:
      raise StartupError(f"--prompt_file={opts.prompt_file} gives {ids.shape[0]} tokens with {tok_path}; the "
                         f"longest requested length is {need}")
    source = dict(kind="file", path=opts.prompt_file, sha256=_file_sha256(opts.prompt_file), tokenizer=tok_path,
                  tokenizer_sha256=_file_sha256(tok_path), tokens_available=int(ids.shape[0]))
  try:
    ids = model_lib.check_tokens(ids[:need], cfg)
  except ValueError as e:
    raise StartupError(f"prompt: {e}") from e
  return ids, source


def build_model(opts: Options, cfg: config_lib.DeepseekV4Config, log: Callable[[str], None] = print):
  dtype = DTYPES[opts.dtype]
  if opts.checkpoint is not None:
    return mapping.load_checkpoint(opts.checkpoint, cfg, dtype=dtype, policy=opts.quant_policy, log=log)
  return model_lib.init_random(cfg, opts.seed, dtype=dtype, policy=opts.quant_policy)


def _validate(opts: Options) -> None:
  if not opts.lengths or any(not isinstance(n, int) or n <= 0 for n in opts.lengths):
    raise StartupError(f"--lengths must be positive integers, got {list(opts.lengths)}")
  for what, values in (("--lengths", opts.lengths), ("--configs", opts.configs)):
    dup = sorted({v for v in values if list(values).count(v) > 1})
    if dup:
      raise StartupError(f"{what} lists {dup} more than once")
  if opts.warmups < opts.min_warmups:
    raise StartupError(f"--warmups must be >= {opts.min_warmups} (the first warm calls can still compile), "
                       f"got {opts.warmups}")
  if opts.precompile_workers < 0:
    raise StartupError(f"--precompile_workers must be >= 0, got {opts.precompile_workers}")
  if not opts.max_cold_s >= 0:
    raise StartupError(f"--max_cold_s must be >= 0 (0 = no limit), got {opts.max_cold_s}")
  if opts.repeats < 1:
    raise StartupError(f"--repeats must be >= 1, got {opts.repeats}")
  if opts.exact_max_tokens < 0 or opts.parity_prefix_tokens < 1:
    raise StartupError(f"--exact_max_tokens must be >= 0 and --parity_prefix_tokens >= 1, got "
                       f"{opts.exact_max_tokens} and {opts.parity_prefix_tokens}")
  if opts.exact_max_tokens and any(n > opts.exact_max_tokens for n in opts.lengths):
    if opts.parity_prefix_tokens > opts.exact_max_tokens:
      raise StartupError(f"--parity_prefix_tokens={opts.parity_prefix_tokens} exceeds --exact_max_tokens="
                         f"{opts.exact_max_tokens}: the prefix check would not fit either")
  if not opts.kl_gate > 0:
    raise StartupError(f"--kl_gate must be > 0, got {opts.kl_gate}")
  if not (opts.noise_floor_eps == 0 or 2.0 ** -24 <= opts.noise_floor_eps < 1):
    raise StartupError(f"--noise_floor_eps must be 0 (no floor) or in [2^-24, 1), got {opts.noise_floor_eps}: "
                       "below one f32 rounding the perturbed streams would round back to the exact ones")
  if opts.dtype not in DTYPES:
    raise StartupError(f"--dtype must be one of {list(DTYPES)}, got {opts.dtype!r}")
  if not opts.out or not opts.out.endswith(".json"):
    raise StartupError(f"--out must name a .json file, got {opts.out!r}")


# ---- results file ----
def load_results(path: str) -> dict[str, Any]:
  """A results document: {"schema", "records": [...], "invocations": [...]} (for notebooks: pandas.DataFrame(
  summary_rows(load_results(path))) gives one flat row per (length, config))."""
  with open(path) as f:
    doc = json.load(f)
  if not isinstance(doc, dict) or doc.get("schema") != SCHEMA or not isinstance(doc.get("records"), list):
    raise StartupError(f"{path} is not a prefill qualification results file (schema {SCHEMA})")
  seen = set()
  for r in doc["records"]:
    key = (r["length"], r["config"])
    if key in seen:
      raise StartupError(f"{path} holds {key} twice; fix the file by hand")
    seen.add(key)
  return doc


def _rank(r: dict) -> int:
  """What a record measured: OK (timed and checked) > too_slow (cold run and parity) > failed with prefix parity
  > failed or not run."""
  return {"ok": 3, "too_slow": 2}.get(r["status"], 1 if r.get("parity") else 0)


def merge_results(out: str, sources: list[str]) -> dict[str, Any]:
  """Merges results files of one matched matrix (e.g. bounded calls run side by side, one per GPU) into `out`
  (created if missing) and rewrites its .md table; returns the merged document.

  A (length, config) record from a source replaces the one in `out` unless that one measured more (`_rank`).
  Records must share the weights fingerprint, and per length the prompt ids and per config the features;
  invocations and noise floors are kept once each. Raises StartupError on a mixed set, before writing."""
  doc = load_results(out) if os.path.exists(out) else dict(schema=SCHEMA, records=[], invocations=[])
  by_key = {(r["length"], r["config"]): r for r in doc["records"]}
  fingerprint = next(iter(by_key.values()), {}).get("weights_fingerprint")
  prompt_sha = {r["length"]: r["prompt"]["sha256"] for r in by_key.values()}
  features = {r["config"]: r["features"] for r in by_key.values()}
  for path in sources:
    src = load_results(path)
    for r in src["records"]:
      key = (r["length"], r["config"])
      fingerprint = fingerprint or r["weights_fingerprint"]
      why = _same_run(r, fingerprint, prompt_sha, features.get(r["config"]))
      if why:
        raise StartupError(f"{path}: record {key} differs from the records merged so far in {', '.join(why)}: "
                           "not one matched matrix")
      if key not in by_key or _rank(r) >= _rank(by_key[key]):
        by_key[key] = r
      prompt_sha.setdefault(r["length"], r["prompt"]["sha256"])
      features.setdefault(r["config"], r["features"])
    doc["invocations"] += [i for i in src["invocations"] if i not in doc["invocations"]]
    for n, floor in src.get("noise_floor", {}).items():
      doc.setdefault("noise_floor", {}).setdefault(n, floor)
  doc["records"] = list(by_key.values())
  run_record.write_json(out, doc)
  with open(markdown_path(out), "w") as f:
    f.write(markdown_table(doc))
  return doc


def _order(name: str) -> tuple[int, int]:
  if name == "all_on":
    return (0, 0)
  if name == "all_off":
    return (3, 0)
  names = [f"kill_{s}" for s in SWITCHES] + [f"kill_{k}" for k in KNOBS]
  return (1 if name in names else 2, names.index(name) if name in names else 0)


def summary_rows(doc_or_records) -> list[dict[str, Any]]:
  """One flat dict per record, sorted by length then matrix order, with the speedup over all_off and the parity
  verdict. The verdict needs the document's noise floor: from a bare list of records it is pass or FAIL only."""
  records = doc_or_records["records"] if isinstance(doc_or_records, dict) else list(doc_or_records)
  floors = doc_or_records.get("noise_floor", {}) if isinstance(doc_or_records, dict) else {}
  base = {r["length"]: r["timing"]["tokens_per_s"] for r in records
          if r["config"] == "all_off" and r["status"] == "ok"}
  rows = []
  for r in sorted(records, key=lambda r: (r["length"], _order(r["config"]), r["config"])):
    t, p = r.get("timing") or {}, r.get("parity") or {}
    tps = t.get("tokens_per_s")
    floor_kl = floors.get(str(p.get("prefix_tokens") or r["length"]), {}).get("kl")
    if not p:
      verdict = None
    elif p.get("pass"):
      verdict = "pass"
    else:  # unresolved: the exact path moves that far when its input moves by one rounding
      verdict = "unresolved" if (floor_kl is not None and math.isfinite(floor_kl) and floor_kl > p["kl_gate"]
                                 and p["finite"] and p["kl"] <= FLOOR_FACTOR * floor_kl) else "FAIL"
    rows.append(dict(length=r["length"], config=r["config"], killed=r.get("killed", []),
                     also_off=r.get("also_off", []), status=r["status"], tokens_per_s=tps,
                     speedup_vs_all_off=tps / base[r["length"]] if tps and r["length"] in base else None,
                     cold_s=t.get("cold_s"), cold_tokens_per_s=t.get("cold_tokens_per_s"), median_s=t.get("median_s"),
                     nmse=p.get("nmse"), max_abs=p.get("max_abs"),
                     top1_agree=p.get("top1_agree"), kl=p.get("kl"), parity_pass=p.get("pass"),
                     floor_kl=floor_kl, verdict=verdict,
                     prefix_tokens=p.get("prefix_tokens"), error=r.get("error"), error_kind=r.get("error_kind")))
  return rows


def verdict_counts(doc: dict[str, Any]) -> dict[str, int]:
  """How many records of the document pass, FAIL, are unresolved, or have no parity verdict ("not run")."""
  counts = dict(passed=0, failed=0, unresolved=0, not_run=0)
  for row in summary_rows(doc):
    key = {"pass": "passed", "FAIL": "failed", "unresolved": "unresolved"}.get(row["verdict"], "not_run")
    counts[key] += 1
  return counts


def summary_line(doc: dict[str, Any]) -> str:
  """`N pass, M fail, K not run` (and the unresolved ones, if any) over every record of the document."""
  c = verdict_counts(doc)
  return (f"{c['passed']} pass, {c['failed']} fail, {c['not_run']} not run"
          + (f", {c['unresolved']} unresolved" if c["unresolved"] else ""))


def _error_summary(error: str | None, kind: str | None) -> str:
  """One short line for the table: the allocation that failed for an out-of-memory error (XLA's GEMM autotuner
  reports it inside a NOT_FOUND or 'failed to get configs' error), else the error's first line."""
  text = error or "failed"
  if kind in ("oom", "parity_oom"):
    want = re.search(r"allocate ([0-9.]+ ?(?:[KMGT]i?B|bytes))", text)
    wanted = f" (wanted {want.group(1)})" if want else ""
    return ("parity: " if kind == "parity_oom" else "") + "out of memory" + wanted
  return "error: " + text.splitlines()[0][:80]


def _fmt(x, spec: str) -> str:
  return "-" if x is None else format(x, spec)


def markdown_table(doc: dict[str, Any]) -> str:
  """The results as a markdown table (with the run's device, versions, model and prompt above it)."""
  records = doc["records"]
  lines = []
  if records:
    r0 = records[-1]
    env, mdl = r0["env"], r0["model"]
    lines += [f"Prefill qualification: {mdl['name']} ({mdl['policy']}, {mdl['dtype']}"
              f"{', ' + mdl['checkpoint'] if mdl.get('checkpoint') else ', random weights seed ' + str(mdl['seed'])}), "
              f"weights {r0['weights_fingerprint'][:12]}, prompt {r0['prompt']['source']['kind']}; "
              f"{env['device_kind']} ({r0['features']['device_class']}), jax {env['jax']}, "
              f"commit {env['git_commit'][:10]}{' (dirty)' if env.get('git_dirty') else ''}.", ""]
  lines += ["| length | config | tok/s | speedup vs all_off | cold s | NMSE | max abs | top-1 | KL | floor KL "
            "| result |", "|---:|---|---:|---:|---:|---:|---:|---|---:|---:|---|"]
  rows = summary_rows(doc)
  for row in rows:
    name = row["config"] + (f" (also off: {', '.join(row['also_off'])})" if row["also_off"] else "")
    if row["status"] == "too_slow":
      result = f"{row['verdict']}; too slow to time (cold run only: {row['cold_tokens_per_s']:.1f} tok/s)"
    elif row["status"] == "not_run":
      result = row["error"].replace("|", "/")
    elif row["status"] != "ok":
      result = _error_summary(row["error"], row["error_kind"]).replace("|", "/")
      if row["verdict"]:
        result += f"; parity {row['verdict']}"
    else:
      result = row["verdict"]
    if row["prefix_tokens"]:
      result += f" (prefix {row['prefix_tokens']})"
    top1 = "-" if row["top1_agree"] is None else ("yes" if row["top1_agree"] else "no")
    lines.append(f"| {row['length']} | {name} | {_fmt(row['tokens_per_s'], '.1f')} | "
                 f"{_fmt(row['speedup_vs_all_off'], '.2f')} | {_fmt(row['cold_s'], '.1f')} | "
                 f"{_fmt(row['nmse'], '.2e')} | {_fmt(row['max_abs'], '.2e')} | {top1} | {_fmt(row['kl'], '.2e')} | "
                 f"{_fmt(row['floor_kl'], '.2e')} | {result} |")
  floors = doc.get("noise_floor", {})
  if floors:
    lines += ["", "floor KL: the exact path against itself with its embedded streams multiplied by (1 + eps z), "
              "z ~ N(0, 1) (" + "; ".join(f"{n} tokens: eps {f['input_noise']:.1e}, " + (
                  f"NMSE {f['nmse']:.2e}, KL {f['kl']:.2e}" if "kl" in f else f"failed: {f['error'][:80]}")
                  for n, f in sorted(floors.items(), key=lambda kv: int(kv[0]))) + ")."]
  if any(row["verdict"] == "unresolved" for row in rows):
    lines += ["", f"unresolved: KL above the gate but at most {FLOOR_FACTOR:g}x the floor KL, which is above the "
              "gate too: on this model and prompt one rounding of the input moves the exact path's logits further "
              "than the gate allows, so the gate cannot tell a wrong kernel from rounding here (parity_by_switch "
              "--per_layer measures each layer's own error instead)."]
  return "\n".join(lines) + "\n"


def markdown_path(out: str) -> str:
  return os.path.splitext(out)[0] + ".md"


def exact_cache_path(out: str) -> str:
  """Where the exact path's prefix logits are kept between bounded calls."""
  return os.path.splitext(out)[0] + ".exact.npz"


# ---- running ----
def is_oom(e: BaseException) -> bool:
  text = str(e)
  return isinstance(e, MemoryError) or "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def _error_text(e: BaseException) -> str:
  return f"{type(e).__name__}: {str(e)[:2000]}"


class _Clock:
  """Elapsed time and a token-weighted ETA (a configuration costs about its length in tokens)."""

  def __init__(self, total_tokens: int, log: Callable[[str], None]):
    self.t0, self.total, self.done, self.log = time.perf_counter(), total_tokens, 0, log

  def say(self, text: str) -> None:
    self.log(f"[{self.elapsed():7.1f}s] {text}")

  def elapsed(self) -> float:
    return time.perf_counter() - self.t0

  def eta(self) -> str:
    if not self.done:
      return "ETA unknown"
    left = self.elapsed() / self.done * (self.total - self.done)
    return f"ETA ~{left / 60:.1f} min" if left >= 60 else f"ETA ~{left:.0f}s"


class _ExactPrefixes:
  """The exact path's final logits on prompt prefixes, computed once per prefix length and shared by every length
  (all lengths use prefixes of the same ids), and the same with the input streams perturbed (the noise floor). Kept
  in `path` (an .npz next to the results) with the weights fingerprint, the prefix ids' hash and the exact features,
  so a later bounded call reuses them."""

  def __init__(self, m, ids: np.ndarray, feats: Features, fingerprint: str, path: str | None, clock: "_Clock"):
    self.m, self.ids, self.feats, self.clock, self.path = m, ids, feats, clock, path
    self.fingerprint = fingerprint
    self.computed: dict[str, tuple[dict[str, Any], np.ndarray]] = {}  # array name -> (meta, logits)
    self.runs: list[dict[str, Any]] = []  # what this invocation computed or loaded (recorded in the invocation)

  def _meta(self, n: int, noise: float = 0.0) -> dict[str, Any]:
    meta = dict(tokens=n, weights_fingerprint=self.fingerprint, prompt_sha256=sha256_array(self.ids[:n]),
                features=self.feats.to_dict())
    return meta | (dict(input_noise=noise, noise_seed=0) if noise else {})

  @staticmethod
  def _name(n: int, noise: float = 0.0) -> str:
    return f"logits_{n}" if not noise else f"perturbed_{n}_{noise:.6e}"

  def _stored(self) -> dict[str, tuple[dict[str, Any], np.ndarray]]:
    """Entries of the file made with these weights, prompt and features."""
    if not self.path or not os.path.exists(self.path):
      return {}
    out = {}
    with np.load(self.path) as z:
      for meta in json.loads(str(z["meta"])):
        n, noise = meta["tokens"], meta.get("input_noise", 0.0)
        if meta == self._meta(n, noise):
          out[self._name(n, noise)] = (meta, np.asarray(z[self._name(n, noise)]))
    return out

  def stored(self) -> dict[int, np.ndarray]:
    """Unperturbed exact logits in the file, by prefix length."""
    return {m["tokens"]: a for m, a in self._stored().values() if "input_noise" not in m}

  def _lookup(self, n: int, noise: float) -> tuple[dict[str, Any], np.ndarray] | None:
    """Computed or stored logits made exactly so (the meta holds the exact eps: names round it)."""
    name = self._name(n, noise)
    hit = self.computed.get(name) or self._stored().get(name)
    return hit if hit is not None and hit[0] == self._meta(n, noise) else None

  def has(self, n: int, noise: float = 0.0) -> bool:
    """Whether the logits are at hand without running the exact path."""
    return self._lookup(n, noise) is not None

  def _save(self) -> None:
    if not self.path:
      return
    keep = self._stored() | self.computed
    os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
    tmp = self.path + ".tmp.npz"
    np.savez(tmp, meta=json.dumps([m for m, _ in keep.values()]), **{k: a for k, (_, a) in keep.items()})
    os.replace(tmp, self.path)

  def _get(self, n: int, noise: float) -> np.ndarray:
    if not 1 <= n <= len(self.ids):  # ids[:n] would be a shorter prompt stored under the wrong length
      raise StartupError(f"a {n}-token prefix lies outside the {len(self.ids)}-token prompt")
    name = self._name(n, noise)
    what = f"exact path on the {n}-token prefix" + (f" with input noise {noise:.2e}" if noise else "")
    hit = self.computed.get(name)
    if hit is None or hit[0] != self._meta(n, noise):
      cached = self._lookup(n, noise)
      if cached is not None:
        self.clock.say(f"  {what}: loaded from {self.path}")
        self.computed[name] = cached
        self.runs.append(dict(tokens=n, input_noise=noise, source=self.path, logits_sha256=sha256_array(cached[1])))
      else:
        self.clock.say(f"  {what} (once, reused by every length and configuration)")
        t0 = time.perf_counter()
        self.computed[name] = (self._meta(n, noise), _final_logits(self.m, self.ids[:n], self.feats,
                                                                   input_noise=noise))
        self.runs.append(dict(tokens=n, input_noise=noise, source="computed", wall_s=time.perf_counter() - t0,
                              logits_sha256=sha256_array(self.computed[name][1])))
        self.clock.say(f"  done in {self.runs[-1]['wall_s']:.1f}s")
        self._save()
    return self.computed[name][1]

  def get(self, n: int) -> np.ndarray:
    return self._get(n, 0.0)

  def perturbed(self, n: int, noise: float) -> np.ndarray:
    """The exact path with its embedded streams multiplied by (1 + noise z) (prefill's input_noise)."""
    return self._get(n, noise)


class _Exact:
  """The exact path's final logits for one length: full length once, or a prefix where it does not fit."""

  def __init__(self, m, ids: np.ndarray, feats: Features, opts: Options, clock: _Clock, prefixes: _ExactPrefixes):
    self.m, self.ids, self.feats, self.clock, self.prefixes = m, ids, feats, clock, prefixes
    self.length, self.prefix = len(ids), min(opts.parity_prefix_tokens, len(ids))
    self.full: np.ndarray | None = None
    self.why_prefix: str | None = None
    self.error: str | None = None
    if opts.exact_max_tokens and self.length > opts.exact_max_tokens:
      self.fall_back(f"{self.length} tokens exceed --exact_max_tokens={opts.exact_max_tokens}")

  def fall_back(self, why: str) -> None:
    self.why_prefix = why
    self.clock.say(f"!!! EXACT PATH AT {self.length} TOKENS: {why}. Parity at this length is checked on the first "
                   f"{self.prefix} tokens instead (config and exact path both run on that prefix). !!!")

  def offer(self, logits: np.ndarray) -> None:
    """The all_off configuration's own full-length logits are the exact path's."""
    if self.full is None and self.why_prefix is None:
      self.full = logits

  def offer_failure(self, e: BaseException) -> None:
    if self.full is None and self.why_prefix is None:
      if is_oom(e):
        self.fall_back("out of memory (RESOURCE_EXHAUSTED)")
      else:
        self.error = _error_text(e)

  def reference(self) -> np.ndarray | None:
    """Full-length exact logits, or None when the prefix is what gets compared. Raises if the exact path failed."""
    if self.error:
      raise RuntimeError(f"exact path failed at {self.length} tokens: {self.error}")
    if self.full is None and self.why_prefix is None:
      self.clock.say(f"  exact path at {self.length} tokens (once, reused by every configuration)")
      try:
        self.full = _final_logits(self.m, self.ids, self.feats)
      except Exception as e:  # noqa: BLE001 -- OOM falls back to the prefix; anything else fails the parity
        self.offer_failure(e)
        return self.reference()
    return self.full

  def prefix_reference(self) -> np.ndarray:
    if self.prefix >= self.length:
      raise RuntimeError(f"exact path does not fit at {self.length} tokens and --parity_prefix_tokens="
                         f"{self.prefix} is not shorter")
    return self.prefixes.get(self.prefix)


def _final_logits(m, ids: np.ndarray, feats: Features, progress=None, positions=None,
                  input_noise: float = 0.0) -> np.ndarray:
  out = jax.block_until_ready(prefill_lib.prefill_logits(m, ids, feats, progress=progress, positions=positions,
                                                         input_noise=input_noise))
  return np.asarray(out, np.float32)


def _time_config(m, ids: np.ndarray, feats: Features, opts: Options, clock: _Clock,
                 prefix: int | None = None) -> tuple[np.ndarray, np.ndarray | None, dict]:
  """Cold run, warm-ups, timed runs -> (final logits, logits at position prefix - 1 or None, timing). The cold run
  also yields the prefix logits (the model is causal). Progress is passed only to the cold run, so timed runs are
  undisturbed."""
  L = len(ids)
  t0 = time.perf_counter()
  if prefix is not None and prefix < L:
    both = _final_logits(m, ids, feats, progress=lambda s: clock.say(f"    {s}"), positions=(prefix - 1, L - 1))
    prefix_logits, logits = both[0], both[1]
  else:
    prefix_logits, logits = None, _final_logits(m, ids, feats, progress=lambda s: clock.say(f"    {s}"))
  cold = time.perf_counter() - t0
  clock.say(f"    cold run: {cold:.2f}s")
  if opts.max_cold_s and cold > opts.max_cold_s:
    clock.say(f"    too slow to time: the cold run took {cold:.1f}s > --max_cold_s={opts.max_cold_s:g}")
    return logits, prefix_logits, dict(cold_s=cold, cold_tokens_per_s=L / cold, too_slow=True,
                                       max_cold_s=opts.max_cold_s, warmup_s=[], run_s=[], median_s=None,
                                       tokens_per_s=None, deterministic=None,
                                       peak_device_bytes_process=run_record.peak_device_bytes())
  hashes, warm, runs = {sha256_array(logits)}, [], []
  for i in range(opts.warmups + opts.repeats):
    gc.collect()  # outside the timer: at 8192 on the H200 each first timed run was ~0.4 s slow; GC is a suspect
    t0 = time.perf_counter()
    out = jax.block_until_ready(prefill_lib.prefill_logits(m, ids, feats))
    dt = time.perf_counter() - t0
    hashes.add(sha256_array(np.asarray(out, np.float32)))
    del out
    (warm if i < opts.warmups else runs).append(dt)
    kind, j, n = ("warm-up", i + 1, opts.warmups) if i < opts.warmups else ("run", i + 1 - opts.warmups, opts.repeats)
    clock.say(f"    {kind} {j}/{n}: {dt:.3f}s ({L / dt:.1f} tok/s)")
  median = statistics.median(runs)
  return logits, prefix_logits, dict(cold_s=cold, cold_tokens_per_s=L / cold, too_slow=False, warmup_s=warm,
                                     run_s=runs, median_s=median, tokens_per_s=L / median,
                                     deterministic=len(hashes) == 1,
                                     peak_device_bytes_process=run_record.peak_device_bytes())


def _prefix_parity(m, ids, conf: Configuration, exact: _Exact, opts: Options, out_p: np.ndarray | None,
                   reason: str) -> dict[str, Any]:
  """Parity on the first exact.prefix tokens; `out_p` are the configuration's logits there if already known."""
  ref_p = exact.prefix_reference()
  source = f"position {exact.prefix - 1} of this configuration's full-length cold run"
  t0 = time.perf_counter()
  if out_p is None and conf.features == exact.feats:  # the exact path itself: its stored prefix logits
    out_p, source = ref_p, "the exact path's prefix logits (this configuration is the exact path)"
  elif out_p is None:
    out_p = _final_logits(m, ids[:exact.prefix], conf.features)
    source = f"a separate {exact.prefix}-token run of this configuration"
  return dict(parity_metrics(out_p, ref_p, opts.kl_gate), prefix_tokens=exact.prefix, prefix_reason=reason,
              prefix_logits_from=source, prefix_run_s=time.perf_counter() - t0,
              prefix_logits_sha256=sha256_array(out_p))


def _run_one(m, ids, conf: Configuration, exact: _Exact, opts: Options, clock: _Clock) -> dict[str, Any]:
  """Times one configuration and checks its parity. Run-time failures are returned in the record, not raised;
  one that runs out of memory at full length is still checked on the parity prefix."""
  rec: dict[str, Any] = dict(status="failed", error=None, error_kind=None, timing=None, parity=None, logits_sha256=None)
  is_exact = conf.features == exact.feats
  try:
    logits, out_p, rec["timing"] = _time_config(m, ids, conf.features, opts, clock,
                                                exact.prefix if exact.why_prefix else None)
  except Exception as e:  # noqa: BLE001 -- an OOM or unsupported shape in one configuration must not stop the rest
    rec.update(error=_error_text(e), error_kind="oom" if is_oom(e) else type(e).__name__)
    if is_exact:
      exact.offer_failure(e)
    if is_oom(e) and exact.prefix < exact.length:
      clock.say(f"    out of memory at {exact.length} tokens: checking parity on the first {exact.prefix}")
      try:
        rec["parity"] = _prefix_parity(m, ids, conf, exact, opts, None,
                                       exact.why_prefix or "the full-length run ran out of memory")
      except Exception as e2:  # noqa: BLE001 -- the timing error stands; say why there is no parity either
        rec["error"] += f"; parity on the {exact.prefix}-token prefix: {_error_text(e2)}"
    return rec
  rec["logits_sha256"] = sha256_array(logits)
  if is_exact:
    exact.offer(logits)
  try:
    ref = exact.reference()
    if ref is not None:
      rec["parity"] = dict(parity_metrics(logits, ref, opts.kl_gate), prefix_tokens=None, prefix_reason=None)
    else:  # out_p is None when the exact path fell back to a prefix after this configuration's cold run
      rec["parity"] = _prefix_parity(m, ids, conf, exact, opts, out_p, exact.why_prefix)
  except Exception as e:  # noqa: BLE001 -- same: record and continue
    rec.update(error=f"parity: {_error_text(e)}", error_kind="parity_oom" if is_oom(e) else "parity")
    return rec
  rec["status"] = "too_slow" if rec["timing"]["too_slow"] else "ok"
  return rec


def noise_floor(prefixes: _ExactPrefixes, n: int, reference: Callable[[], np.ndarray], eps: float,
                kl_gate: float) -> dict[str, Any]:
  """The exact path on n tokens with perturbed input streams against `reference()`, the exact logits the
  configurations were compared with: how far one rounding of the input moves the final position (the parity
  statistic's resolution). A failure (e.g. out of memory) is returned in the record."""
  rec: dict[str, Any] = dict(tokens=n, input_noise=eps, noise_seed=0, weights_fingerprint=prefixes.fingerprint,
                             prompt_sha256=sha256_array(prefixes.ids[:n]))
  try:
    p = parity_metrics(prefixes.perturbed(n, eps), reference(), kl_gate)
    return rec | {k: p[k] for k in ("nmse", "max_abs", "top1_agree", "kl", "finite")}
  except Exception as e:  # noqa: BLE001 -- e.g. out of memory: the floor is missing, the records stand
    return rec | dict(error=_error_text(e))


def _same_run(r: dict, fingerprint: str, prompt_sha: Mapping[int, str], features: dict | None) -> list[str]:
  """Why an existing record does not belong to this run's matched matrix (empty list: it does)."""
  why = []
  if r.get("weights_fingerprint") != fingerprint:
    why.append("weights fingerprint")
  if r["length"] in prompt_sha and r.get("prompt", {}).get("sha256") != prompt_sha[r["length"]]:
    why.append("prompt ids")
  if features is not None and r.get("features") != features:
    why.append("features")
  return why


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class _Setup:
  """What start-up resolved from the options, before the weights exist."""

  cfg: config_lib.DeepseekV4Config
  policy: quant_policy.QuantPolicy
  device_class: str
  base: Features
  configs: list[Configuration]   # the whole matrix
  selected: list[Configuration]  # --configs
  ids: np.ndarray
  source: dict[str, Any]
  prompt_sha: dict[int, str]
  existing: dict[str, Any] | None


def _start_up(opts: Options) -> _Setup:
  """Every check that needs no weights; raises StartupError/FeatureError."""
  _validate(opts)
  cfg = _model_config(opts)
  try:
    pol = quant_policy.get(opts.quant_policy)
    quant_policy.check_config(pol, cfg)
  except ValueError as e:
    raise StartupError(f"--quant_policy: {e}") from e
  too_long = [n for n in opts.lengths if n > cfg.max_position_embeddings]
  if too_long:
    raise StartupError(f"--lengths {too_long} exceed {cfg.name}'s max_position_embeddings="
                       f"{cfg.max_position_embeddings}")
  try:
    dev_cls = opts.device_class or features_lib.device_class()
  except ValueError as e:
    raise StartupError(str(e)) from e
  base = features_lib.resolve(dev_cls, opts.features)  # FeatureError: an impossible combination
  configs = matrix(base)
  names = [c.name for c in configs]
  unknown = [c for c in opts.configs if c not in names]
  if unknown:
    raise StartupError(f"--configs: unknown configuration(s) {unknown}; valid here: {names}")
  ids, source = prompt_ids(opts, cfg)
  existing = None
  if opts.append and os.path.exists(opts.out):
    try:
      existing = load_results(opts.out)
    except (OSError, ValueError) as e:
      raise StartupError(f"--append: cannot read {opts.out}: {e}") from e
  return _Setup(cfg=cfg, policy=pol, device_class=dev_cls, base=base, configs=configs,
                selected=[c for c in configs if not opts.configs or c.name in opts.configs], ids=ids, source=source,
                prompt_sha={n: sha256_array(ids[:n]) for n in opts.lengths}, existing=existing)


def _predicted_cold_s(records, n: int, conf: Configuration, ids: np.ndarray,
                      fingerprint: str) -> tuple[float, int] | None:
  """(cold seconds at n tokens, from length) if `conf` was too slow at a shorter length of this matched matrix:
  that cold run scaled linearly with length. It is a lower bound (attention grows faster than linearly) only for
  a cold run that loaded precompiled programs (compile time does not grow with length), so only those count."""
  slower = [r for r in records if r["config"] == conf.name and r["status"] == "too_slow" and r["length"] < n
            and r["timing"].get("cold_loads_precompiled") and r["features"] == conf.features.to_dict()
            and r["weights_fingerprint"] == fingerprint and r["prompt"]["sha256"] == sha256_array(ids[:r["length"]])]
  if not slower:
    return None
  r = max(slower, key=lambda r: r["length"])
  return r["timing"]["cold_s"] * n / r["length"], r["length"]


def _done_pairs(opts: Options, setup: _Setup, fingerprint: str) -> set[tuple[int, str]]:
  """(length, config) pairs the results file already holds done for this matched matrix: OK, or too_slow under
  a limit that would stop them again (not_run pairs are predicted anew each call). Refuses a mixed file."""
  done = set()
  by_name = {c.name: c for c in setup.configs}
  for r in setup.existing["records"] if setup.existing else []:
    conf = by_name.get(r["config"]) if r["length"] in opts.lengths else None
    why = _same_run(r, fingerprint, setup.prompt_sha, conf and conf.features.to_dict())
    if why and (r["status"] in MEASURED or "weights fingerprint" in why or "prompt ids" in why):
      raise StartupError(
          f"{opts.out} holds a record for length {r['length']} / {r['config']} made with different "
          f"{', '.join(why)}: a matched matrix needs the same weights, prompt and features; use another --out")
    if r["status"] == "ok" or (r["status"] == "too_slow" and 0 < opts.max_cold_s < r["timing"]["cold_s"]):
      done.add((r["length"], r["config"]))
  return done


def _log_plan(opts: Options, setup: _Setup, plan, todo, log) -> None:
  log(f"plan: lengths {list(opts.lengths)} x {len(setup.selected)} configurations = {len(plan)} runs; "
      f"{len(plan) - len(todo)} already done in {opts.out} (skipped), {len(todo)} to run; "
      f"cold + {opts.warmups} warm-ups + {opts.repeats} timed runs each")
  for c in setup.selected:
    extra = f" (also off: {', '.join(c.also_off)})" if c.also_off else ""
    log(f"  {c.name}{extra}: on={c.features.on() or 'none'}")
  todo_keys = {(n, c.name) for n, c in todo}
  for n in opts.lengths:
    skipped = [c.name for c in setup.selected if (n, c.name) not in todo_keys]
    if skipped:
      log(f"  length {n}: skipping {skipped} (already done)")
  prefix_lengths = [n for n in opts.lengths if opts.exact_max_tokens and n > opts.exact_max_tokens]
  log(f"parity vs the exact path at full length for {[n for n in opts.lengths if n not in prefix_lengths]}"
      + (f"; on a {opts.parity_prefix_tokens}-token prefix for {prefix_lengths} (> --exact_max_tokens="
         f"{opts.exact_max_tokens})" if prefix_lengths else "")
      + f"; a prefix also where the exact path runs out of memory; KL gate {opts.kl_gate}")


def _outcome(rec: dict[str, Any]) -> str:
  if rec["status"] == "not_run":
    return rec["error"]
  p, t = rec["parity"], rec["timing"]
  parity = p and (f"NMSE {p['nmse']:.2e} max abs {p['max_abs']:.2e} top-1 {'yes' if p['top1_agree'] else 'no'} "
                  f"KL {p['kl']:.2e} {'pass' if p['pass'] else 'above the gate'}"
                  + (f" (prefix {p['prefix_tokens']})" if p["prefix_tokens"] else ""))
  if rec["status"] not in MEASURED:
    return f"FAILED {rec['error'][:300]}" + (f"; parity: {parity}" if parity else "")
  speed = (f"too slow to time (cold {t['cold_s']:.1f}s, {t['cold_tokens_per_s']:.1f} tok/s)" if t["too_slow"] else
           f"ok {t['tokens_per_s']:.1f} tok/s (cold {t['cold_s']:.1f}s, median {t['median_s']:.3f}s)")
  return f"{speed}; {parity}"


def use_persistent_cache() -> str:
  """Turns on jax's persistent compilation cache for every program (a temporary directory unless one is set), which
  `prefill.precompile` fills; returns the directory."""
  if not jax.config.jax_compilation_cache_dir:
    import tempfile  # pylint: disable=import-outside-toplevel
    jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="ds4jax_jit_cache_"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  return jax.config.jax_compilation_cache_dir


def _precompile(m, opts: Options, todo, exact_feats: Features, prefixes: _ExactPrefixes, clock: _Clock) -> dict:
  """Compiles the layer programs of every planned run (and of the exact path it will need) in parallel into the
  persistent compilation cache; each cold run then loads them."""
  use_persistent_cache()
  runs = [(n, c.features) for n, c in todo]
  for n in sorted({n for n, _ in todo}):
    if opts.exact_max_tokens and n > opts.exact_max_tokens:
      p = min(opts.parity_prefix_tokens, n)
      if not prefixes.has(p) or (opts.noise_floor_eps and not prefixes.has(p, opts.noise_floor_eps)):
        runs.append((p, exact_feats))
    elif (n, exact_feats) not in runs:
      runs.append((n, exact_feats))
  clock.say(f"precompiling the layer programs of {len(runs)} runs, {opts.precompile_workers} at a time, into "
            f"{jax.config.jax_compilation_cache_dir}")
  t0 = time.perf_counter()
  count = prefill_lib.precompile(m, runs, opts.precompile_workers, log=clock.say)
  return dict(programs=count, wall_s=time.perf_counter() - t0, workers=opts.precompile_workers,
              cache_dir=jax.config.jax_compilation_cache_dir)


def run(opts: Options, *, model=None, log: Callable[[str], None] | None = None) -> dict[str, Any]:
  """Runs the qualification matrix; returns the results document (also written to opts.out, plus the .md table).

  `model` skips building the weights (tests, notebooks); it must match opts' preset/policy/dtype.
  Raises StartupError/FeatureError before any prefill for a bad input; a configuration that fails at run time is
  recorded with its error and the others continue.
  """
  log = log or (lambda s: print(s, flush=True))
  setup = _start_up(opts)
  cfg, dev_cls = setup.cfg, setup.device_class
  env = run_record.environment()
  env["jax_compilation_cache_dir"] = jax.config.jax_compilation_cache_dir
  log(f"prefill qualification: {cfg.name} policy={setup.policy.name} dtype={opts.dtype} "
      f"{'checkpoint=' + opts.checkpoint if opts.checkpoint else 'random weights seed=' + str(opts.seed)}; "
      f"{env['device_kind']} ({dev_cls}), jax {env['jax']}, commit {env['git_commit'][:10]}")
  log(f"all_on switches: {setup.base.on() or 'none'}; knobs: "
      + ", ".join(f"{k}={getattr(setup.base, k)}" for k in KNOBS))
  t0 = time.perf_counter()
  m = model if model is not None else build_model(opts, cfg, log)
  log(f"weights ready ({time.perf_counter() - t0:.1f}s); fingerprinting them")
  gc.collect()
  gc.freeze()  # what exists now is never garbage: the collections between timed runs skip it (~0.2 s each in tests)
  fingerprint = weights_fingerprint(m)
  done = _done_pairs(opts, setup, fingerprint)
  if setup.existing is None and os.path.exists(opts.out):
    log(f"note: overwriting {opts.out} (pass --append to keep its records)")
  # all_off first at each length: its cold run is a real cold run and its logits are the exact path's.
  plan = [(n, c) for n in opts.lengths for c in sorted(setup.selected, key=lambda c: c.name != "all_off")]
  todo = [(n, c) for n, c in plan if (n, c.name) not in done]
  _log_plan(opts, setup, plan, todo, log)

  doc = setup.existing or dict(schema=SCHEMA, records=[], invocations=[])
  options = dataclasses.asdict(opts) | dict(features=dict(opts.features))
  doc["invocations"].append(dict(date=env["date"], env=env, options=options, plan=[[n, c.name] for n, c in todo]))
  common = dict(model=dict(name=cfg.name, preset=opts.preset, checkpoint=opts.checkpoint, policy=setup.policy.name,
                           dtype=opts.dtype, seed=opts.seed if opts.checkpoint is None else None),
                weights_fingerprint=fingerprint, options=options, env=env)

  def save():
    run_record.write_json(opts.out, doc)
    with open(markdown_path(opts.out), "w") as f:
      f.write(markdown_table(doc))

  save()
  clock = _Clock(sum(n for n, _ in todo), log)
  exact_feats = exact_features(dev_cls)
  prefixes = _ExactPrefixes(m, setup.ids, exact_feats, fingerprint, exact_cache_path(opts.out), clock)
  doc["invocations"][-1]["exact_prefix_runs"] = prefixes.runs  # filled in as they happen

  def predicted_too_slow(n: int, conf: Configuration, full_exact: bool) -> tuple[float, int] | None:
    if not opts.max_cold_s or (conf.features == exact_feats and full_exact):
      return None  # the exact path's cold run is every configuration's reference: it runs anyway
    p = _predicted_cold_s(doc["records"], n, conf, setup.ids, fingerprint)
    return p if p and p[0] > opts.max_cold_s else None

  to_compile = [(n, c) for n, c in todo if not predicted_too_slow(n, c, full_exact=True)]
  if opts.precompile_workers and to_compile:
    doc["invocations"][-1]["precompile"] = _precompile(m, opts, to_compile, exact_feats, prefixes, clock)
    save()
  exact_by_len: dict[int, _Exact] = {}
  called: set[tuple[Features, int]] = set()  # (features, length) already run in this process
  floors_tried: set[int] = set()  # noise floors (by parity tokens) measured or attempted in this process
  for i, (n, conf) in enumerate(todo):
    if n not in exact_by_len:
      exact_by_len[n] = _Exact(m, setup.ids[:n], exact_feats, opts, clock, prefixes)
    exact = exact_by_len[n]
    clock.say(f"{i + 1}/{len(todo)} length {n} {conf.name}: start ({clock.eta()})")
    t_start = time.perf_counter()
    first_call = (conf.features, n) not in called and not (conf.features == exact.feats and exact.full is not None)
    predicted = predicted_too_slow(n, conf, full_exact=exact.why_prefix is None)
    if predicted:
      result = dict(status="not_run", error=(
          f"not run: its cold run would take >= {predicted[0]:.0f}s (too slow at {predicted[1]} tokens, scaled by "
          f"length) > --max_cold_s={opts.max_cold_s:g}"), error_kind="predicted_too_slow", timing=None, parity=None,
          logits_sha256=None, predicted_cold_s=predicted[0])
    else:
      result = _run_one(m, setup.ids[:n], conf, exact, opts, clock)
    called.add((conf.features, n))
    if result["timing"]:
      result["timing"]["cold_is_first_call"] = first_call  # False: the same program already ran in this process
      result["timing"]["cold_loads_precompiled"] = bool(opts.precompile_workers)
    clock.done += n
    rec = dict(config=conf.name, length=n, killed=list(conf.killed), also_off=list(conf.also_off),
               features=conf.features.to_dict(), switches_on=conf.features.on(),
               prompt=dict(source=setup.source, length=n, sha256=setup.prompt_sha[n]), **common,
               finished=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               wall_s=time.perf_counter() - t_start) | result
    doc["records"] = [r for r in doc["records"] if (r["length"], r["config"]) != (n, conf.name)] + [rec]
    save()
    n_par = (rec["parity"] or {}).get("prefix_tokens") or n
    floor = doc.get("noise_floor", {}).get(str(n_par), {})
    # (Re)computed unless a measured floor of these weights, prompt prefix and eps is on file.
    current = (floor.get("input_noise") == opts.noise_floor_eps and "kl" in floor
               and floor.get("weights_fingerprint") == fingerprint
               and floor.get("prompt_sha256") == sha256_array(setup.ids[:n_par]))
    if opts.noise_floor_eps and rec["parity"] and not current and n_par not in floors_tried:
      floors_tried.add(n_par)  # a floor that failed is retried by the next call, not by every configuration
      ref = exact.prefix_reference if n_par < exact.length else exact.reference
      floor = doc.setdefault("noise_floor", {})[str(n_par)] = noise_floor(prefixes, n_par, ref, opts.noise_floor_eps,
                                                                          opts.kl_gate)
      save()
      clock.say(f"  noise floor at {n_par} tokens (input noise {opts.noise_floor_eps:.1e}): " + (
          f"NMSE {floor['nmse']:.2e} KL {floor['kl']:.2e}" if "kl" in floor else f"FAILED {floor['error'][:200]}"))
    gc.collect()
    clock.say(f"{i + 1}/{len(todo)} length {n} {conf.name}: {_outcome(rec)} ({clock.eta()})")
  log("")
  log(markdown_table(doc))
  log(f"results: {opts.out} and {markdown_path(opts.out)}")
  log(f"verdicts: {summary_line(doc)}")
  gc.unfreeze()
  return doc
