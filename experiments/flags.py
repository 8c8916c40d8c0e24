"""The absl flags every entry point shares: one per feature switch and knob, and --quant_policy.

Library code never sees a flag: entry points parse them and hand `Features` / a `QuantPolicy` down.
"""

from __future__ import annotations

import sys

from absl import flags

from ds4jax import attention as attention_lib
from ds4jax import features as features_lib
from ds4jax import mesh as mesh_lib
from ds4jax import model as model_lib
from ds4jax import moe as moe_lib
from ds4jax.features import DEVICE_REQUIRES, KNOBS, SWITCHES, Features
from ds4jax.quant import formats
from ds4jax.quant import policy as quant_policy


def define_feature_flags(flag_values: flags.FlagValues | None = None) -> None:
  """One flag per switch and knob (default None = the device capability table's default)."""
  fv = flags.FLAGS if flag_values is None else flag_values  # an empty FlagValues is falsy
  for s, (upstream, text, requires) in SWITCHES.items():
    need = f" Requires {', '.join(requires)}." if requires else ""
    need += "".join(f" On {d} also {', '.join(extra[s])}." for d, extra in DEVICE_REQUIRES.items() if s in extra)
    flags.DEFINE_boolean(s, None, f"{text} Upstream: {upstream}.{need} Default: the device capability table.",
                         flag_values=fv)
  for k, (upstream, text, default) in KNOBS.items():
    flags.DEFINE_integer(k, None, f"{text} Upstream: {upstream}. Default: {default}.", flag_values=fv)


def features_from_flags(flag_values: flags.FlagValues, device_cls: str | None = None, cfg=None, policy=None,
                        tokens: int | None = None) -> Features:
  """The resolved features from parsed flags (FeatureError names an impossible combination). The bound defaults
  (features.Capability.when) hold where met: with the model's `cfg` and quant `policy`, those of the kernels that
  take it (`policy` None: bf16); with the prompt's `tokens`, those of one-band prompts. Without them, off."""
  overrides = {k: getattr(flag_values, k) for k in list(SWITCHES) + list(KNOBS)}
  fits = model_lib.kernel_fits(cfg, policy or "bf16") if cfg is not None else ()
  return features_lib.resolve(device_cls or features_lib.device_class(), overrides, fits=fits, tokens=tokens)


def define_quant_policy_flag(flag_values: flags.FlagValues | None = None) -> None:
  """--quant_policy: a named policy or dense=FMT,gate_up=FMT,down=FMT (ds4jax/quant/policy.py)."""
  flags.DEFINE_string(
      "quant_policy", "bf16",
      f"Weight format per tensor role: one of {sorted(quant_policy.POLICIES)}, or dense=FMT,gate_up=FMT,down=FMT "
      f"with FMT in {list(formats.FORMATS)}. lucebox_mix = upstream's artifact (FP2/FP3 MIX experts, 4-bit dense).",
      flag_values=flags.FLAGS if flag_values is None else flag_values)


def define_mesh_flag(flag_values: flags.FlagValues | None = None, default: str = "") -> None:
  """--mesh: the devices the routed experts and the attention queries are split over (ds4jax/mesh.py, docs/mesh.md)."""
  flags.DEFINE_string(
      "mesh", default, "Devices to split the model over: expert=2 (each device holds and runs 1/2 of every layer's "
      "routed experts), query=2 (each band's attention runs on 1/2 of its queries per device), expert+query=2 (both "
      "over the same two devices), expert=2,query=2 (a 2 x 2 mesh). Dense weights, router and shared expert are "
      "replicated (docs/mesh.md). Empty: one device.",
      flag_values=flags.FLAGS if flag_values is None else flag_values)


def check_model_features(program: str, cfg, policy_name: str, features: Features) -> None:
  """Switches that need something of the model (the Mosaic GPU switches: their experts' formats and sizes), before
  any weights exist; a misfit ends the program with one line naming it (exit status 1)."""
  try:
    moe_lib.check_kernels(cfg, quant_policy.get(policy_name), features)
    attention_lib.check_kernels(cfg, features)
  except ValueError as e:
    sys.exit(f"{program}: {e}")


def check_mesh(program: str, spec: str, cfg=None) -> None:
  """--mesh's axes (cfg None), or whether it fits `cfg` and the devices jax sees; before any weights exist. A bad
  spec ends the program with one line naming what is wrong (exit status 1)."""
  try:
    mesh_lib.parse(spec) if cfg is None else mesh_lib.check(spec, cfg)
  except mesh_lib.MeshError as e:
    sys.exit(f"{program}: --mesh: {e}")
