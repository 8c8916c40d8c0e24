"""Loads an official-format DeepSeek-V4 safetensors checkpoint into the NNX reference model.

The model's attribute paths mirror the checkpoint names, so the mapping is a rule, not a table:
join the path with '.', except that
  * `embed` is `embed.weight`;
  * hyper-connection parameters are flat names: `hc_head.fn` -> `hc_head_fn`, `layers.L.hc_attn.base`
    -> `layers.L.hc_attn_base`;
  * the stacked routed experts `layers.L.ffn.experts.w1` [E, I, D] come from E tensors
    `layers.L.ffn.experts.{e}.w1.weight`.
Quantized tensors are recognised by dtype: F8_E4M3 (+ `.scale`, 128x128 UE8M0 blocks) and
I8/U8 packed FP4 E2M1 (+ `.scale`, per-32 UE8M0). `mtp.*` (the MTP layer) is ignored.
Checkpoints saved by transformers are read through their official names (hf_names.py).
"""

from __future__ import annotations

import json
import os
import re
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ds4jax import mesh as mesh_lib
from ds4jax.checkpoint import hf_names
from ds4jax.checkpoint.safetensors_reader import CheckpointError, SafetensorsCheckpoint
from ds4jax.checkpoint.safetensors_writer import save_file
from ds4jax.config import DeepseekV4Config
from ds4jax.layers import QuantizedWeight, QuantStorage, dense
from ds4jax.model import DeepseekV4, abstract_model
from ds4jax.quant import formats, fp4_e2m1, fp8_e4m3, ue8m0
from ds4jax.quant import policy as quant_policy
from ds4jax.quant.policy import QuantPolicy

IGNORED_PREFIXES = ("mtp.",)
# Tensors the official checkpoint stores in FP8 (128x128 blocks) and FP4 (per-32); the rest is BF16/F32.
OFFICIAL_FP8 = re.compile(r"\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)\.weight$|\.shared_experts\.w[123]\.weight$")
OFFICIAL_FP4 = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")
INT_DTYPES = ("I64", "I32")


def is_stacked(path: tuple) -> bool:
  """True for the routed experts' [E, ...] variables, each made of E checkpoint tensors."""
  return len(path) == 5 and tuple(path[2:4]) == ("ffn", "experts")


def checkpoint_names(path: tuple, cfg: DeepseekV4Config) -> list[str]:
  """The checkpoint tensor name(s) that make up the model variable at `path`."""
  parts = [str(p) for p in path]
  if parts == ["embed"]:
    return ["embed.weight"]
  if parts[0] == "hc_head":
    return [f"hc_head_{parts[1]}"]
  if len(parts) == 4 and parts[0] == "layers" and parts[2] in ("hc_attn", "hc_ffn"):
    return [f"layers.{parts[1]}.{parts[2]}_{parts[3]}"]
  if is_stacked(path):
    return [f"layers.{parts[1]}.ffn.experts.{e}.{parts[4]}.weight" for e in range(cfg.n_routed_experts)]
  return [".".join(parts)]


_dequantize_fp8 = jax.jit(fp8_e4m3.dequantize)  # jitted: one compile per shape, not one per jnp op
_dequantize_fp4 = jax.jit(fp4_e2m1.dequantize)


def _scale_name(name: str) -> str:
  return name[: -len(".weight")] + ".scale" if name.endswith(".weight") else name + ".scale"


def _scale_bytes(ckpt: SafetensorsCheckpoint, name: str) -> np.ndarray:
  """The raw UE8M0 bytes of the scale tensor of FP8/FP4 tensor `name`; a missing scale, another dtype or a NaN byte
  (0xFF) is a corrupt checkpoint."""
  scale = _scale_name(name)
  if scale not in ckpt:
    raise CheckpointError(f"{ckpt.where(name)}: stored as {ckpt.spec(name).dtype} but its scale tensor {scale!r} "
                          "is missing")
  if ckpt.spec(scale).dtype not in ("F8_E8M0", "U8"):
    raise CheckpointError(f"{ckpt.where(scale)}: scales must be F8_E8M0 (UE8M0 bytes), got {ckpt.spec(scale).dtype}")
  try:
    return ue8m0.check_scale_bytes(np.asarray(ckpt.read(scale)).view(np.uint8), ckpt.where(scale))
  except ValueError as e:
    raise CheckpointError(str(e)) from e


def _code_bytes(ckpt: SafetensorsCheckpoint, name: str) -> np.ndarray:
  """The stored codes of FP8/FP4 tensor `name`; an FP8 NaN byte (0x7F / 0xFF: e4m3fn has no inf) is a corrupt
  checkpoint, whether the codes are then decoded or copied."""
  codes = np.asarray(ckpt.read(name))
  if ckpt.spec(name).dtype == "F8_E4M3":
    nan = (codes.view(np.uint8) & 0x7F) == 0x7F
    if nan.any():
      raise CheckpointError(f"{ckpt.where(name)}: NaN byte at index {tuple(int(i) for i in np.argwhere(nan)[0])}")
  return codes


def read_tensor(ckpt: SafetensorsCheckpoint, name: str, used: set[str]) -> np.ndarray:
  """One tensor as numpy, dequantized to f32 when it is stored in FP8 or FP4. Records what it read."""
  spec = ckpt.spec(name)
  used.add(name)
  if spec.dtype in INT_DTYPES:
    return ckpt.read(name)
  if spec.dtype in FLOAT_DTYPES:
    a = ckpt.read(name)
    if not np.isfinite(a).all():  # a corrupt or diverged weight: as the FP8 NaN bytes, refused here, not as NaN logits
      bad = ~np.isfinite(a)
      first = tuple(int(i) for i in np.argwhere(bad)[0])
      raise CheckpointError(f"{ckpt.where(name)}: {a[first]} at index {first} ({int(bad.sum())} non-finite values)")
    return a
  if spec.dtype in ("F8_E4M3", "I8", "U8"):
    codes, scale_bytes = _code_bytes(ckpt, name), _scale_bytes(ckpt, name)
    used.add(_scale_name(name))
    dequantize = _dequantize_fp8 if spec.dtype == "F8_E4M3" else _dequantize_fp4
    try:
      return np.asarray(dequantize(codes, scale_bytes))
    except (ValueError, TypeError) as e:
      raise CheckpointError(f"{ckpt.where(name)}: {e}") from e
  raise CheckpointError(f"{ckpt.where(name)}: unsupported dtype {spec.dtype} for a model weight")


def weights(model: DeepseekV4) -> list[tuple[tuple, nnx.Variable | QuantizedWeight]]:
  """Every weight of the model with its path: plain variables, and quantized weights as one unit."""
  out = []
  for path, node in nnx.iter_graph(model):
    if isinstance(node, QuantizedWeight):
      out.append((path, node))
    elif isinstance(node, nnx.Variable) and not isinstance(node, QuantStorage):
      out.append((path, node))
  return out


def weight_bytes(w: nnx.Variable | QuantizedWeight) -> int:
  """Bytes a weight takes once loaded: for a quantized one, all its storage (codes, scales, codebooks)."""
  leaves = [getattr(w, n) for n in w.names] if isinstance(w, QuantizedWeight) else [w]
  return sum(x.size * jnp.dtype(x.dtype).itemsize for x in leaves)


def _device_memory_stats() -> dict | None:
  """memory_stats() of the device that jax.device_put fills (None on CPU): this process's own first device (with
  several processes, jax.devices() starts with process 0's, whose stats another process cannot read)."""
  device = jax.config.jax_default_device
  if not isinstance(device, jax.Device):
    device = jax.local_devices(backend=device or None)[0]
  return device.memory_stats()


def check_fits(model: DeepseekV4, stats: dict | None, expert_devices: int = 1) -> None:
  """Refuses, before any tensor is read, weights that exceed the device's free memory (`stats`: memory_stats()).
  `expert_devices` > 1: the routed experts are split over that many devices (ds4jax/mesh.py) and the rest is
  replicated, so each device needs its share of the experts plus the rest."""
  if not stats or not stats.get("bytes_limit"):
    return
  experts = sum(weight_bytes(w) for p, w in weights(model) if is_stacked(p))
  need = sum(weight_bytes(w) for _, w in weights(model)) - experts + -(-experts // expert_devices)
  free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
  if need > free:
    if expert_devices == 1:
      raise CheckpointError(f"the weights need {_gib(need)} but the device has {_gib(free)} free (bytes_limit "
                            f"{_gib(stats['bytes_limit'])}): use a smaller --quant_policy or a larger device")
    raise CheckpointError(f"the weights need {_gib(need)} on each of the {expert_devices} devices (routed experts "
                          f"{_gib(experts)} split {expert_devices} ways, the rest whole) but each has {_gib(free)} "
                          f"free (bytes_limit {_gib(stats['bytes_limit'])}): use a smaller --quant_policy, more "
                          "devices or larger ones")


def _gib(n: int) -> str:
  return f"{n / 2**30:.4g} GiB"


def _read_stored(ckpt: SafetensorsCheckpoint, names: list[str], fmt: str, used: set[str],
                 stacked: bool) -> dict | None:
  """The storage arrays of an official FP8/FP4 tensor copied as they are, when the target format is the same."""
  want = {"fp8_e4m3": ("F8_E4M3",), "fp4_e2m1": ("I8", "U8")}.get(fmt)
  if not want or any(ckpt.spec(n).dtype not in want or _scale_name(n) not in ckpt for n in names):
    return None
  codes = [_code_bytes(ckpt, n) for n in names]
  scales = [_scale_bytes(ckpt, n) for n in names]
  for n, c, s in zip(names, codes, scales):  # one stack of experts: every expert as the first
    if (c.shape, s.shape) != (codes[0].shape, scales[0].shape):
      raise CheckpointError(f"{ckpt.where(n)}: shape {c.shape} with scale {s.shape}, where {names[0]} has "
                            f"{codes[0].shape} with {scales[0].shape}")
  used.update(names + [_scale_name(n) for n in names])
  stack = (lambda xs: np.stack(xs)) if stacked else (lambda xs: xs[0])
  key = "weight" if fmt == "fp8_e4m3" else "packed"
  return {key: stack([c.view(np.int8) if fmt == "fp4_e2m1" else c for c in codes]), "scale": stack(scales)}


def load_checkpoint(path: str | os.PathLike, cfg: DeepseekV4Config | None = None, *, dtype=jnp.bfloat16,
                    policy: str | QuantPolicy = "bf16", log: Callable[[str], None] | None = print,
                    mesh: str = "") -> DeepseekV4:
  """Builds the model from a checkpoint directory (config.json + safetensors, single or sharded).

  Every model weight must be present with the right shape and a usable dtype, and every tensor in the
  checkpoint must be used (except `mtp.*`); otherwise a CheckpointError names the file and tensors.
  Official and transformers (`save_pretrained`) names are both read. Weights that would not fit in the
  default device's free memory are refused before any is read. Weights go to the default device one at a
  time. Under a quantization `policy`, each weight is converted to its role's format (FP8/FP4 tensors
  already in the target format are copied, not re-encoded). `mesh` (ds4jax/mesh.py): on an expert axis each
  device reads and receives only its own routed experts (host memory holds one device's share of one weight at a
  time), the rest is replicated; the model fits when each device's share does.
  """
  cfg = cfg or DeepseekV4Config.from_hf_config(path)
  if mesh:
    mesh_lib.check(mesh, cfg)
  model = abstract_model(cfg, dtype, policy)
  check_fits(model, _device_memory_stats(), mesh_lib.expert_devices(mesh))
  put = _Placer(mesh)
  used: set[str] = set()
  t0 = time.time()
  with SafetensorsCheckpoint(path) as file:
    ckpt = hf_names.HFNamedCheckpoint(file) if hf_names.is_hf_named(file) else file
    wanted = [(p, w, checkpoint_names(p, cfg)) for p, w in weights(model)]
    missing = [n for _, _, names in wanted for n in names if n not in ckpt]
    if missing:
      needed = {n for _, _, names in wanted for n in names}
      unnamed = [ckpt.where(n) for n in ckpt.names() if n not in needed and not n.startswith(IGNORED_PREFIXES)]
      raise CheckpointError(f"checkpoint {os.fspath(path)} lacks {len(missing)} tensor(s) the model needs, "
                            f"e.g. {missing[:5]}" + (f"; it has {len(unnamed)} the model does not name, e.g. "
                                                     f"{unnamed[:3]}" if unnamed else ""))
    for i, (p, w, names) in enumerate(wanted):
      if isinstance(w, QuantizedWeight):
        def read(names, shape):
          stored = _read_stored(ckpt, names, w.format, used, is_stacked(p))
          if stored is None:
            value = _read_float(ckpt, names, is_stacked(p), shape, used)
            stored = quant_policy.quantize(formats.get(w.format), value)
          return stored
        for name, array in put.stored(p, names, w.logical_shape, read).items():
          var = getattr(w, name)
          if array.shape != tuple(var.shape):
            raise CheckpointError(f"{ckpt.where(names[0])}: {name} shape {array.shape} does not match the "
                                  f"config's {tuple(var.shape)}")
          var.set_value(array if array.dtype == var.dtype else array.astype(var.dtype))
      elif put.split(p):
        var = w
        value = put.stored(p, names, tuple(w.shape), lambda names, shape: {
            "v": _read_float(ckpt, names, True, shape, used).astype(var.dtype)})["v"]
        w.set_value(value)
      else:
        is_int = jnp.issubdtype(w.dtype, jnp.integer)
        value = _read_float(ckpt, names, is_stacked(p), tuple(w.shape), used, integer=is_int)
        if names[0].endswith("tid2eid") and (value.min() < 0 or value.max() >= cfg.n_routed_experts):
          raise CheckpointError(f"{ckpt.where(names[0])}: expert ids must lie in [0, {cfg.n_routed_experts}), "
                                f"got [{value.min()}, {value.max()}]")
        w.set_value(put.whole(value.astype(w.dtype)))
      if log and (i + 1) % 200 == 0:
        log(f"  loaded {i + 1}/{len(wanted)} weights ({time.time() - t0:.0f}s)")
    used |= put.elsewhere | {_scale_name(n) for n in put.elsewhere}  # read by another process
    unexpected = [ckpt.where(n) for n in ckpt.names() if n not in used and not n.startswith(IGNORED_PREFIXES)]
  if unexpected:
    raise CheckpointError(f"checkpoint {os.fspath(path)} has {len(unexpected)} tensor(s) the model does not "
                          f"use, e.g. {unexpected[:5]} (wrong config?)")
  return mesh_lib.place(model, mesh) if mesh else model  # arrays already where they belong: place marks the MoE


class _Placer:
  """Where a loaded weight goes: the default device, or on a mesh its expert stacks split (each device's share read
  and sent on its own) and the rest replicated. With several processes each reads only its own devices' experts;
  `elsewhere` collects the tensor names left to the other processes."""

  def __init__(self, mesh: str):
    self.mesh = mesh
    self.elsewhere: set[str] = set()

  def split(self, path: tuple) -> bool:
    return mesh_lib.axis_of(self.mesh, mesh_lib.EXPERT) is not None and is_stacked(path)

  def whole(self, value: np.ndarray) -> jax.Array:
    return jax.device_put(value, mesh_lib.replicated(self.mesh) if self.mesh else None)

  def stored(self, path: tuple, names: list[str], shape: tuple, read) -> dict[str, jax.Array]:
    """read(names, shape) -> {storage name: numpy array} for the experts `names` (all, or one device's), placed."""
    if not self.split(path):
      return {k: self.whole(a) for k, a in read(names, shape).items()}
    sharding = mesh_lib.expert_sharding(self.mesh)
    shards: dict[str, list] = {}
    here = sharding.addressable_devices_indices_map(shape)
    for device, index in sharding.devices_indices_map(shape).items():
      if device not in here:
        self.elsewhere.update(names[index[0]])
    for device, index in here.items():
      rows = index[0]
      for k, a in read(names[rows], (rows.stop - rows.start, *shape[1:])).items():
        shards.setdefault(k, []).append(jax.device_put(a, device))
    return {k: jax.make_array_from_single_device_arrays((len(names), *parts[0].shape[1:]), sharding, parts)
            for k, parts in shards.items()}


def _read_float(ckpt, names, stacked: bool, shape, used, integer: bool = False) -> np.ndarray:
  """Reads (and dequantizes) the tensors of one weight, checking dtype class and shape; stacks experts."""
  want = shape[1:] if stacked else shape
  arrays = [read_tensor(ckpt, n, used) for n in names]
  for n, a in zip(names, arrays):
    if np.issubdtype(a.dtype, np.integer) != integer:
      raise CheckpointError(f"{ckpt.where(n)}: expected {'an integer' if integer else 'a floating-point or FP8/FP4'} "
                            f"tensor, got {ckpt.spec(n).dtype}")
    if a.shape != want:
      raise CheckpointError(f"{ckpt.where(n)}: shape {a.shape} does not match the config's {want}")
  return np.stack(arrays) if stacked else arrays[0]


def save_checkpoint(model: DeepseekV4, directory: str | os.PathLike, *, official_formats: bool = False) -> None:
  """Writes `config.json` (HF form) and `model.safetensors` under the official names.

  Quantized weights are written dequantized (f32). With `official_formats`, dense projections are
  stored as FP8 E4M3 and routed experts as FP4 E2M1, each with its UE8M0 `.scale`, as in the
  published checkpoint; otherwise every plain tensor keeps its dtype.
  """
  os.makedirs(directory, exist_ok=True)
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(model.cfg.to_hf_config(), f, indent=1)
  tensors, dtype_names = {}, {}
  for path, w in weights(model):
    names = checkpoint_names(path, model.cfg)
    value = np.asarray(dense(w) if isinstance(w, QuantizedWeight) else w[...])
    for name, part in zip(names, value if is_stacked(path) else [value]):
      if official_formats and (OFFICIAL_FP8.search(name) or OFFICIAL_FP4.search(name)):
        fmt = fp8_e4m3 if OFFICIAL_FP8.search(name) else fp4_e2m1
        tensors[name], tensors[_scale_name(name)] = fmt.quantize(part.astype(np.float32))
        dtype_names[_scale_name(name)] = "F8_E8M0"
      else:
        tensors[name] = part
  save_file(os.path.join(directory, "model.safetensors"), tensors, dtype_names)
