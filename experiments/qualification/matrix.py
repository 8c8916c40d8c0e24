"""The configurations of the matched matrix: all_on, one kill per switch and per chunk/band knob, all_off, and the
planted bugs asked for (each the exact path with one layer wrong)."""

from __future__ import annotations

import dataclasses

from ds4jax import config as config_lib
from ds4jax import features as features_lib
from ds4jax.features import KNOBS, SWITCHES, Features
from experiments import mutations, verdicts

KILLABLE_KNOBS = ("long_context_chunk", "prefill_band_tokens")  # killed = set to 0 (one chunk / one band)
MUTANT_PREFIX = "mutant_"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Configuration:
  name: str
  features: Features
  killed: tuple[str, ...] = ()
  also_off: tuple[str, ...] = ()  # switches that require the killed one, turned off with it
  mutation: str | None = None     # a planted bug (experiments/mutations.py): judged, never timed
  mutation_layer: int | None = None


def dependents(switch: str, device_cls: str = "") -> list[str]:
  """Switches that require `switch` (on `device_cls`: features.requires), directly or through another switch
  (SWITCHES order)."""
  out: set[str] = set()
  frontier = {switch}
  while frontier:
    frontier = {s for s in SWITCHES if set(features_lib.requires(s, device_cls)) & frontier and s not in out}
    out |= frontier
  return [s for s in SWITCHES if s in out]


def without(base: Features, switch: str) -> Features:
  """`base` with `switch` off, and every switch that requires it: the features of kill_<switch>."""
  off = [switch, *dependents(switch, base.device_class)]
  return features_lib.check(dataclasses.replace(base, **dict.fromkeys(off, False)))


def exact_features(device_cls: str) -> Features:
  """The exact path: every switch off (ds4jax.features.REFERENCE) on the given device class."""
  return dataclasses.replace(features_lib.REFERENCE, device_class=device_cls)


def is_the_reference(c: Configuration, verdict_tokens: int, band_tokens: int) -> bool:
  """The exact path in one band is the reference the verdicts judge against: nothing to judge. In the verdicts'
  bands it is judged like any configuration (held to F32_BOUND): what it carries between bands is code the
  reference never runs, shared with every configuration and with the bf16 reference math whose error sets their
  bounds."""
  return (c.features == exact_features(c.features.device_class) and not c.mutation
          and verdicts.n_bands(verdict_tokens, verdicts.banded_features(c.features, band_tokens)) == 1)


def configurations(base: Features, cfg: config_lib.DeepseekV4Config | None = None,
           planted: tuple[str, ...] = ()) -> list[Configuration]:
  """all_on, kill_<switch> per switch on, kill_<knob> per non-zero chunk/band knob, all_off, then mutant_<name> per
  planted bug (in that order; the mutants need the model config `cfg` to place their bug)."""
  configs = [Configuration(name="all_on", features=base)]
  for s in base.on():
    also = [d for d in dependents(s, base.device_class) if getattr(base, d)]
    configs.append(Configuration(name=f"kill_{s}", features=without(base, s), killed=(s,), also_off=tuple(also)))
  for k in KILLABLE_KNOBS:
    if getattr(base, k):
      configs.append(Configuration(name=f"kill_{k}", features=features_lib.check(dataclasses.replace(base, **{k: 0})),
                                   killed=(k,)))
  exact = exact_features(base.device_class)
  configs.append(Configuration(name="all_off", features=exact))
  for name in planted:
    configs.append(Configuration(name=MUTANT_PREFIX + name, features=exact, mutation=name,
                                 mutation_layer=mutations.default_layer(cfg, name)))
  return configs
