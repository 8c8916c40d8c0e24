"""What one qualification call is asked to do: `Options` and the absl flags that map onto it one to one."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax.numpy as jnp

from ds4jax import config as config_lib
from ds4jax import mesh as mesh_lib
from ds4jax.features import KNOBS, SWITCHES, FeatureError
from experiments import flags as flags_lib
from experiments import mutations, run_record

KL_GATE = 0.006  # upstream's preregistered teacher-forced mean-KL gate (docs/upstream.md §7.4): reported, not judged
DTYPES = {"bf16": jnp.bfloat16, "f32": jnp.float32}


class StartupError(ValueError):
  """A bad input found before any work (flags, files, prompt, results file)."""


STARTUP_ERRORS = (StartupError, FeatureError)


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
  mutations: tuple[str, ...] = ()      # planted bugs judged as extra configurations (experiments/mutations.py)
  warmups: int = 2
  repeats: int = 3
  min_warmups: int = 2                 # protocol floor; tests lower it
  exact_max_tokens: int = 0            # exact path at full length only up to this (0 = no limit)
  parity_prefix_tokens: int = 4096     # prefix checked where the exact path does not fit
  verdict_tokens: int = 4096           # verdicts on the first min(length, verdict_tokens) tokens
  verdict_bands: int = 1               # the verdicts' runs in this many bands (so what carries is judged)
  kl_gate: float = KL_GATE
  noise_floor_eps: float = 2.0 ** -24  # the noise floor's input perturbation (one f32 rounding); 0 = none
  out: str = "/tmp/ds4jax_prefill_qual.json"
  append: bool = False
  precompile_workers: int = 0          # > 0: compile every layer program first, this many in parallel
  max_cold_s: float = 0.0              # > 0: a slower cold run ends the configuration's timing ("too_slow")
  stop_after_s: float = 0.0            # > 0: start nothing new this long after the start (a bounded call)
  features: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # switch/knob -> value (None = table)
  device_class: str | None = None      # default: the capability-table class of jax.devices()[0]
  mesh: str = ""                       # "expert=N", "query=N", "expert+query=N", ...: ds4jax/mesh.py; "" = one


def verdict_band_tokens(opts: Options, verdict_tokens: int) -> int:
  """The band size of the verdicts' runs (per layer and the teacher-forced KL's prefills) on a verdict prefix of
  `verdict_tokens` (0: each configuration's own, --verdict_bands=1)."""
  return -(-verdict_tokens // opts.verdict_bands) if opts.verdict_bands > 1 else 0


def define_flags(flag_values=None) -> None:
  """The command's flags, plus one flag per feature switch/knob and --quant_policy, on `flag_values`."""
  from absl import flags  # pylint: disable=import-outside-toplevel  (library code: absl only when asked)

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
  flags.DEFINE_list("mutations", [], "Planted bugs to judge as extra configurations mutant_<name> (the exact path "
                    f"with the bug in one layer; judged, not timed), of {list(mutations.MUTATIONS)}. Each must FAIL.",
                    flag_values=fv)
  flags.DEFINE_integer("warmups", d.warmups, f"Warm-up runs after the cold run (>= {d.min_warmups}).", flag_values=fv)
  flags.DEFINE_integer("repeats", d.repeats, "Timed runs (median tokens/s reported).", flag_values=fv)
  flags.DEFINE_integer("exact_max_tokens", d.exact_max_tokens,
                       "Longest prompt the exact path runs at full length (0 = no limit); beyond it the final-position "
                       "parity is checked on a prefix.", flag_values=fv)
  flags.DEFINE_integer("parity_prefix_tokens", d.parity_prefix_tokens,
                       "Prefix length of the final-position parity where the exact path exceeds --exact_max_tokens or "
                       "runs out of memory.", flag_values=fv)
  flags.DEFINE_integer("verdict_tokens", d.verdict_tokens,
                       "Verdicts (per-layer pinned parity, decision accounting, teacher-forced KL) run on the first "
                       "min(length, this) tokens; lengths with the same verdict prefix share one verdict.",
                       flag_values=fv)
  flags.DEFINE_integer("verdict_bands", d.verdict_bands,
                       "The verdicts run each banded configuration on the verdict prefix in this many bands, per "
                       "layer and in the teacher-forced KL's prefill (and the bf16 reference's), so that the layer "
                       "state carried between bands, weights stationary and the MoE over bands are judged; 1 = the "
                       "configuration's own band size.",
                       flag_values=fv)
  flags.DEFINE_float("kl_gate", d.kl_gate, "Upstream's absolute KL gate, reported beside the verdicts (upstream: "
                     "0.006).", flag_values=fv)
  flags.DEFINE_float("noise_floor_eps", d.noise_floor_eps,
                     "Noise floor: the exact path is run once more with its embedded streams multiplied by "
                     "(1 + eps z), z ~ N(0, 1), in f32, and compared with itself like a configuration (final position; "
                     "information). Default 2^-24: one f32 rounding. 0 = skip; else >= 2^-24.", flag_values=fv)
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
  flags.DEFINE_float("stop_after_s", d.stop_after_s,
                     "Start no configuration (and no verdict pass) later than this many seconds after the start, "
                     "weights included: a call bounded by a time limit ends on its own with everything it finished "
                     "on file, and --append continues. Runs not started are listed in the results. 0 = no limit.",
                     flag_values=fv)
  flags_lib.define_mesh_flag(fv, d.mesh)
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
                 configs=tuple(fv.configs), mutations=tuple(fv.mutations), warmups=fv.warmups, repeats=fv.repeats,
                 exact_max_tokens=fv.exact_max_tokens, parity_prefix_tokens=fv.parity_prefix_tokens,
                 verdict_tokens=fv.verdict_tokens, verdict_bands=fv.verdict_bands, kl_gate=fv.kl_gate,
                 noise_floor_eps=fv.noise_floor_eps, out=fv.out, append=fv.append,
                 precompile_workers=fv.precompile_workers, max_cold_s=fv.max_cold_s,
                 stop_after_s=fv.stop_after_s, mesh=fv.mesh,
                 features={k: getattr(fv, k) for k in list(SWITCHES) + list(KNOBS)})


def validate(opts: Options) -> None:
  """Every check of the options alone; raises StartupError."""
  if not opts.lengths or any(not isinstance(n, int) or n <= 0 for n in opts.lengths):
    raise StartupError(f"--lengths must be positive integers, got {list(opts.lengths)}")
  for what, values in (("--lengths", opts.lengths), ("--configs", opts.configs), ("--mutations", opts.mutations)):
    dup = sorted({v for v in values if list(values).count(v) > 1})
    if dup:
      raise StartupError(f"{what} lists {dup} more than once")
  unknown = [n for n in opts.mutations if n not in mutations.MUTATIONS]
  if unknown:
    raise StartupError(f"--mutations: unknown {unknown}; known: {list(mutations.MUTATIONS)}")
  if opts.warmups < opts.min_warmups:
    raise StartupError(f"--warmups must be >= {opts.min_warmups} (the first warm calls can still compile), "
                       f"got {opts.warmups}")
  if opts.precompile_workers < 0:
    raise StartupError(f"--precompile_workers must be >= 0, got {opts.precompile_workers}")
  if not opts.max_cold_s >= 0:
    raise StartupError(f"--max_cold_s must be >= 0 (0 = no limit), got {opts.max_cold_s}")
  if not opts.stop_after_s >= 0:
    raise StartupError(f"--stop_after_s must be >= 0 (0 = no limit), got {opts.stop_after_s}")
  if opts.repeats < 1:
    raise StartupError(f"--repeats must be >= 1, got {opts.repeats}")
  if opts.exact_max_tokens < 0 or opts.parity_prefix_tokens < 1 or opts.verdict_tokens < 1:
    raise StartupError(f"--exact_max_tokens must be >= 0, --parity_prefix_tokens and --verdict_tokens >= 1, got "
                       f"{opts.exact_max_tokens}, {opts.parity_prefix_tokens} and {opts.verdict_tokens}")
  if opts.exact_max_tokens and any(n > opts.exact_max_tokens for n in opts.lengths):
    if opts.parity_prefix_tokens > opts.exact_max_tokens:
      raise StartupError(f"--parity_prefix_tokens={opts.parity_prefix_tokens} exceeds --exact_max_tokens="
                         f"{opts.exact_max_tokens}: the prefix check would not fit either")
  if opts.exact_max_tokens and min(max(opts.lengths), opts.verdict_tokens) > opts.exact_max_tokens:
    raise StartupError(f"--verdict_tokens={opts.verdict_tokens} exceeds --exact_max_tokens={opts.exact_max_tokens}: "
                       "the verdicts run the exact path on that prefix")
  if not 1 <= opts.verdict_bands <= opts.verdict_tokens:
    raise StartupError(f"--verdict_bands must be in [1, --verdict_tokens={opts.verdict_tokens}], got "
                       f"{opts.verdict_bands}")
  carry = sorted(set(opts.mutations) & mutations.CARRY)
  if carry and (opts.verdict_bands < 2 or min(opts.lengths) < 2):
    raise StartupError(f"--mutations {carry} plant bugs in what a layer carries between bands; they need "
                       f"--verdict_bands >= 2 and lengths of at least 2 tokens (one band from position 0 carries "
                       "nothing, so they could only pass)")
  if not opts.kl_gate > 0:
    raise StartupError(f"--kl_gate must be > 0, got {opts.kl_gate}")
  if not (opts.noise_floor_eps == 0 or 2.0 ** -24 <= opts.noise_floor_eps < 1):
    raise StartupError(f"--noise_floor_eps must be 0 (no floor) or in [2^-24, 1), got {opts.noise_floor_eps}: "
                       "below one f32 rounding the perturbed streams would round back to the exact ones")
  if opts.dtype not in DTYPES:
    raise StartupError(f"--dtype must be one of {list(DTYPES)}, got {opts.dtype!r}")
  try:
    mesh_lib.parse(opts.mesh)  # the axes; whether they fit the model and the devices: inputs.model_config
  except mesh_lib.MeshError as e:
    raise StartupError(f"--mesh: {e}") from e
  if not opts.out or not opts.out.endswith(".json"):
    raise StartupError(f"--out must name a .json file, got {opts.out!r}")
  if problem := run_record.out_problem(opts.out):
    raise StartupError(f"--out={opts.out}: {problem}")
  if opts.seed < 0:
    raise StartupError(f"--seed must be >= 0, got {opts.seed}")
