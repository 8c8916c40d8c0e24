"""What a qualification run is made of: the model config, the weights (and their fingerprint), the prompt ids."""

from __future__ import annotations

import functools
import hashlib
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ds4jax import config as config_lib
from ds4jax import mesh as mesh_lib
from ds4jax import model as model_lib
from ds4jax.checkpoint import mapping
from experiments.qualification.options import DTYPES, Options, StartupError


def sha256_array(x: np.ndarray) -> str:
  return hashlib.sha256(np.ascontiguousarray(x).tobytes()).hexdigest()


def file_sha256(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      h.update(chunk)
  return h.hexdigest()


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


def model_config(opts: Options) -> config_lib.DeepseekV4Config:
  """The model's config; also checks that --mesh fits it and the devices (before any weights exist)."""
  cfg = _config(opts)
  try:
    mesh_lib.check(opts.mesh, cfg)
  except mesh_lib.MeshError as e:
    raise StartupError(f"--mesh: {e}") from e
  return cfg


def _config(opts: Options) -> config_lib.DeepseekV4Config:
  if (opts.preset is None) == (opts.checkpoint is None):
    raise StartupError("give exactly one of --preset (random weights) or --checkpoint (a checkpoint directory)")
  if opts.checkpoint is not None:
    if not os.path.isfile(os.path.join(opts.checkpoint, "config.json")):
      raise StartupError(f"--checkpoint={opts.checkpoint}: no config.json there")
    try:
      return config_lib.DeepseekV4Config.from_hf_config(opts.checkpoint)
    except ValueError as e:
      raise StartupError(f"--checkpoint={opts.checkpoint}: {e}") from e
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
      import tokenizers  # pylint: disable=import-outside-toplevel  (an optional dependency: only for --prompt_file)
    except ImportError as e:
      raise StartupError("--prompt_file needs the `tokenizers` package (pip install tokenizers)") from e
    try:
      with open(opts.prompt_file, encoding="utf-8") as f:
        text = f.read()
    except UnicodeDecodeError as e:
      raise StartupError(f"--prompt_file={opts.prompt_file} is not UTF-8 text: {e}") from e
    try:
      tokenizer = tokenizers.Tokenizer.from_file(tok_path)
    except Exception as e:  # noqa: BLE001 -- the tokenizers package raises a bare Exception for a bad file
      raise StartupError(f"tokenizer file {tok_path} cannot be read: {e}") from e
    ids = np.asarray(tokenizer.encode(text).ids, np.int64)
    if ids.shape[0] < need:
      raise StartupError(f"--prompt_file={opts.prompt_file} gives {ids.shape[0]} tokens with {tok_path}; the "
                         f"longest requested length is {need}")
    source = dict(kind="file", path=opts.prompt_file, sha256=file_sha256(opts.prompt_file), tokenizer=tok_path,
                  tokenizer_sha256=file_sha256(tok_path), tokens_available=int(ids.shape[0]))
  try:
    ids = model_lib.check_tokens(ids[:need], cfg)
  except ValueError as e:
    raise StartupError(f"prompt: {e}") from e
  return ids, source


def build_model(opts: Options, cfg: config_lib.DeepseekV4Config, log: Callable[[str], None] = print):
  """The weights, placed on --mesh (each device its share of the routed experts on an expert axis, the rest
  replicated): drawn or read there share by share (docs/mesh.md)."""
  dtype = DTYPES[opts.dtype]
  if opts.checkpoint is not None:
    m = mapping.load_checkpoint(opts.checkpoint, cfg, dtype=dtype, policy=opts.quant_policy, log=log, mesh=opts.mesh)
  else:
    m = model_lib.init_random(cfg, opts.seed, dtype=dtype, policy=opts.quant_policy, mesh=opts.mesh)
  if opts.mesh:  # init_random and load_checkpoint placed it
    log(mesh_lib.describe(opts.mesh, cfg))
  return m
