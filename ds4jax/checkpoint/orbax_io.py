"""Saves and restores a converted model with Orbax, so it reloads without the original safetensors."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx

from ds4jax.checkpoint.safetensors_reader import CheckpointError
from ds4jax.config import DeepseekV4Config
from ds4jax.model import DeepseekV4, abstract_model

CONFIG_FILE = "ds4jax_config.json"
STATE_DIR = "state"


def save(model: DeepseekV4, directory: str | os.PathLike) -> None:
  """Writes `directory/ds4jax_config.json` and the model state under `directory/state` (must not exist)."""
  directory = os.path.abspath(os.fspath(directory))
  os.makedirs(directory, exist_ok=True)
  with open(os.path.join(directory, CONFIG_FILE), "w") as f:
    json.dump({"config": model.cfg.to_dict(), "dtype": str(model.embed.dtype), "policy": model.policy.name}, f,
              indent=1)
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(os.path.join(directory, STATE_DIR), nnx.state(model))


def restore(directory: str | os.PathLike) -> DeepseekV4:
  """Rebuilds the model saved by `save`, with its weight dtype and quantization policy, on the default device."""
  directory = os.path.abspath(os.fspath(directory))
  cfg_path = os.path.join(directory, CONFIG_FILE)
  if not os.path.exists(cfg_path):
    raise CheckpointError(f"{directory} is not a ds4jax Orbax checkpoint: {CONFIG_FILE} is missing")
  try:
    with open(cfg_path) as f:
      saved = json.load(f)
    cfg, dtype = DeepseekV4Config.from_dict(saved["config"]), jnp.dtype(saved["dtype"])
    graphdef, abstract = nnx.split(abstract_model(cfg, dtype, saved.get("policy", "bf16")))
  except (OSError, ValueError, KeyError, TypeError) as e:  # not JSON, a field missing or out of range
    raise CheckpointError(f"{cfg_path}: not a model description ({type(e).__name__}: {e})") from None
  state_dir = os.path.join(directory, STATE_DIR)
  if not os.path.isdir(state_dir):
    raise CheckpointError(f"{directory} is not a ds4jax Orbax checkpoint: {STATE_DIR}/ is missing")
  with ocp.StandardCheckpointer() as ckptr:
    # Compared before restoring: Orbax's own error for a mismatch comes with screens of asyncio tracebacks.
    saved_arrays, wanted = _arrays(ckptr.metadata(state_dir).item_metadata), _arrays(abstract)
    for name in sorted(saved_arrays.keys() | wanted.keys()):
      if saved_arrays.get(name) != wanted.get(name):
        raise CheckpointError(f"{state_dir} does not hold the weights {CONFIG_FILE} describes: {name} is "
                              f"{saved_arrays.get(name, 'missing')} there, {wanted.get(name, 'not in the model')} in "
                              "the model")
    state = ckptr.restore(state_dir, abstract)
  return nnx.merge(graphdef, state)


def _arrays(tree) -> dict[str, str]:
  """{dotted path: "shape dtype"} of a state's leaves, or of Orbax's metadata of one."""
  part = lambda k: getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))  # dict, sequence, attribute keys
  name = lambda path: ".".join(str(part(k)) for k in path)
  return {name(p): f"{tuple(a.shape)} {a.dtype}" for p, a in jax.tree_util.tree_leaves_with_path(tree)}
