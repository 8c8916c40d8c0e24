"""A torch-free reader for Hugging Face safetensors checkpoints: one file, or a directory of shards.

File format: 8-byte little-endian header length N, then N bytes of UTF-8 JSON
`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}?}`, then the raw little-endian tensor
bytes. Offsets count from the end of the header. Headers are parsed and checked when a file is opened. Tensor data
is memory-mapped (np.memmap) and sliced on `read`, so a 150 GB checkpoint is never read whole.

`read` returns READ-ONLY numpy views into the mapping (copy with np.array(x) to own them). F8_E8M0 comes back as raw
uint8 bytes on purpose: decoding UE8M0 scales (and rejecting 0xFF) belongs to ds4jax.quant.ue8m0.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Iterator, NamedTuple

import ml_dtypes
import numpy as np

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
MAX_HEADER_BYTES = 100_000_000  # the limit of the reference implementation; beyond it the file is surely corrupt

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(np.uint8),  # raw UE8M0 scale bytes, decoded by ds4jax.quant.ue8m0
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype(np.int8),
    "U64": np.dtype("<u8"),
    "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}


class CheckpointError(ValueError):
  """Anything wrong with a checkpoint on disk: missing files, corrupt headers, absent or malformed tensors."""


class TensorSpec(NamedTuple):
  shape: tuple[int, ...]
  dtype: str  # the safetensors dtype name, e.g. "F8_E4M3"; DTYPES[dtype] is what `read` returns


class _Entry(NamedTuple):
  spec: TensorSpec
  begin: int  # absolute byte offsets in the file
  end: int


def _parse_header(path: Path) -> tuple[dict[str, _Entry], dict[str, str]]:
  """Reads and checks the header of one file; returns its tensors and its __metadata__."""
  try:
    size = path.stat().st_size
    with open(path, "rb") as f:
      prefix = f.read(8)
      if len(prefix) < 8:
        raise CheckpointError(f"{path}: file is {size} bytes, too short for the 8-byte safetensors header length")
      n = int.from_bytes(prefix, "little")
      if n > size - 8:
        raise CheckpointError(f"{path}: header length {n} runs past the end of the file ({size} bytes): the file is "
                              f"truncated or not a safetensors file")
      if n > MAX_HEADER_BYTES:
        raise CheckpointError(f"{path}: header length {n} exceeds {MAX_HEADER_BYTES} bytes; the file is corrupt")
      raw = f.read(n)
  except OSError as e:
    raise CheckpointError(f"{path}: cannot read checkpoint file: {e}") from e
  try:
    header = json.loads(raw.decode("utf-8"))
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise CheckpointError(f"{path}: header is not valid UTF-8 JSON ({e})") from e
  if not isinstance(header, dict):
    raise CheckpointError(f"{path}: header must be a JSON object, got {type(header).__name__}")
  metadata = header.pop("__metadata__", None) or {}
  if not isinstance(metadata, dict):
    raise CheckpointError(f"{path}: __metadata__ must be a JSON object, got {type(metadata).__name__}")

  data_start = 8 + n
  data_size = size - data_start
  entries = {}
  for name, info in header.items():
    where = f"{path}: tensor {name!r}"
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
      raise CheckpointError(f"{where}: header entry must have dtype, shape and data_offsets, got {info!r}")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if dtype not in DTYPES:
      raise CheckpointError(f"{where}: unknown dtype {dtype!r} (supported: {', '.join(DTYPES)})")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
      raise CheckpointError(f"{where}: shape must be a list of non-negative ints, got {shape!r}")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]):
      raise CheckpointError(f"{where}: data_offsets must be [begin, end] with 0 <= begin <= end, got {offsets!r}")
    begin, end = offsets
    nbytes = math.prod(shape) * DTYPES[dtype].itemsize
    if end - begin != nbytes:
      raise CheckpointError(f"{where}: data_offsets [{begin}, {end}] span {end - begin} bytes, but shape {shape} of "
                            f"{dtype} needs {nbytes}")
    if end > data_size:
      raise CheckpointError(f"{where}: data_offsets [{begin}, {end}] reach past the {data_size} data bytes after the "
                            f"header: the file is truncated or its header is corrupt")
    entries[name] = _Entry(TensorSpec(tuple(shape), dtype), data_start + begin, data_start + end)

  # Overlapping tensors mean a corrupt header (the format forbids them), even if every offset is in range.
  spans = sorted((e.begin, e.end, name) for name, e in entries.items() if e.end > e.begin)
  for (_, end_a, a), (begin_b, _, b) in zip(spans, spans[1:]):
    if begin_b < end_a:
      raise CheckpointError(f"{path}: tensors {a!r} and {b!r} overlap in the data section; the header is corrupt")
  return entries, metadata


class SafetensorsFile:
  """One .safetensors file. The header is checked on open; the data is mapped on the first `read`."""

  def __init__(self, path: str | os.PathLike):
    self.path = Path(path)
    if not self.path.is_file():
      raise CheckpointError(f"checkpoint file {self.path} does not exist")
    self._entries, self.metadata = _parse_header(self.path)
    self._mmap: np.memmap | None = None
    self._closed = False

  def names(self) -> list[str]:
    return sorted(self._entries)

  def __contains__(self, name: object) -> bool:
    return name in self._entries

  def spec(self, name: str) -> TensorSpec:
    return self._entry(name).spec

  def read(self, name: str) -> np.ndarray:
    """The tensor as a read-only numpy array viewing the file mapping (dtype DTYPES[spec.dtype])."""
    entry = self._entry(name)
    if self._closed:
      raise CheckpointError(f"{self.path}: read({name!r}) after close()")
    dtype = DTYPES[entry.spec.dtype]
    if entry.end == entry.begin:  # empty tensor; also avoids mapping an empty data section
      return np.zeros(entry.spec.shape, dtype)
    if self._mmap is None:
      self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
    if self._mmap.shape[0] < entry.end:  # the file shrank after its header was checked
      raise CheckpointError(f"{self.path}: file is truncated: tensor {name!r} ends at byte {entry.end}, "
                            f"the file has {self._mmap.shape[0]}")
    return np.asarray(self._mmap[entry.begin:entry.end]).view(dtype).reshape(entry.spec.shape)

  def _entry(self, name: str) -> _Entry:
    try:
      return self._entries[name]
    except KeyError:
      raise CheckpointError(f"{self.path}: no tensor named {name!r}") from None

  def close(self) -> None:
    """Drops the mapping. Arrays returned by `read` stay valid (they keep the mapping alive themselves)."""
    self._mmap = None
    self._closed = True

  def __enter__(self) -> SafetensorsFile:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


class SafetensorsCheckpoint:
  """A checkpoint given as a .safetensors file, a directory holding model.safetensors, or a sharded directory with
  model.safetensors.index.json (or the path of such an index). Shards are opened lazily, on first use.

      with SafetensorsCheckpoint("DeepSeek-V4-Flash") as ckpt:
        shape, dtype = ckpt.spec("layers.0.attn.wkv.weight")   # (512, 4096), "F8_E4M3"
        w = ckpt.read("layers.0.attn.wkv.weight")              # np.ndarray of float8_e4m3fn
  """

  def __init__(self, path: str | os.PathLike):
    path = Path(path)
    if not path.exists():
      raise CheckpointError(f"checkpoint path {path} does not exist")
    self.index_path: Path | None = None
    if path.is_dir():
      if (path / INDEX_NAME).is_file():
        self.index_path = path / INDEX_NAME
      elif (path / SINGLE_NAME).is_file():
        path = path / SINGLE_NAME
      else:
        found = sorted(p.name for p in path.glob("*.safetensors"))
        raise CheckpointError(f"{path}: directory has neither {INDEX_NAME} nor {SINGLE_NAME} "
                              f"(its .safetensors files: {found or 'none'})")
    elif path.name.endswith(".index.json"):
      self.index_path = path

    self.path = path  # the data file, or the index
    self._files: dict[Path, SafetensorsFile] = {}
    if self.index_path is None:
      single = SafetensorsFile(path)
      self._files[single.path] = single
      self._where = {name: single.path for name in single.names()}
      self.metadata: dict = single.metadata
    else:
      self._where, self.metadata = self._parse_index(self.index_path)

  @staticmethod
  def _parse_index(index: Path) -> tuple[dict[str, Path], dict]:
    try:
      data = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
      raise CheckpointError(f"{index}: cannot read the shard index ({e})") from e
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
      raise CheckpointError(f"{index}: needs a 'weight_map' object mapping tensor names to shard file names")
    where = {name: index.parent / shard for name, shard in weight_map.items()}
    # Shard files are only stat-ed here (cheap); their headers are parsed on first use.
    for shard in sorted(set(where.values())):
      if not shard.is_file():
        users = [n for n, s in where.items() if s == shard]
        raise CheckpointError(f"{index}: shard {shard.name!r} is listed in the index ({len(users)} tensors, e.g. "
                              f"{users[0]!r}) but does not exist in {index.parent}")
    return where, data.get("metadata") or {}

  @property
  def files(self) -> list[Path]:
    """The data files of the checkpoint (one, or the shards named by the index)."""
    return sorted(set(self._where.values()))

  def names(self) -> list[str]:
    return sorted(self._where)

  def __contains__(self, name: object) -> bool:
    return name in self._where

  def __iter__(self) -> Iterator[str]:
    return iter(self.names())

  def __len__(self) -> int:
    return len(self._where)

  def spec(self, name: str) -> TensorSpec:
    """(shape, safetensors dtype name) of a tensor, from the header only."""
    return self._file_of(name).spec(name)

  def where(self, name: str) -> str:
    """'<file>: <name>', the start of an error message about one tensor."""
    return f"{self._where.get(name, self.path)}: {name}"

  def read(self, name: str) -> np.ndarray:
    """The tensor as a read-only numpy array backed by the memory-mapped file."""
    return self._file_of(name).read(name)

  def validate(self) -> None:
    """Opens every shard and checks that each tensor the index lists is in its shard (errors otherwise)."""
    for name in self._where:
      self._file_of(name)

  def _file_of(self, name: str) -> SafetensorsFile:
    try:
      path = self._where[name]
    except KeyError:
      raise CheckpointError(f"{self.path}: no tensor named {name!r}") from None
    if path not in self._files:
      self._files[path] = SafetensorsFile(path)
    f = self._files[path]
    if name not in f:
      raise CheckpointError(f"tensor {name!r}: the index {self.index_path} places it in shard {path.name!r}, but that "
                            f"file has no such tensor")
    return f

  def close(self) -> None:
    for f in self._files.values():
      f.close()

  def __enter__(self) -> SafetensorsCheckpoint:
    return self

  def __exit__(self, *exc) -> None:
    self.close()
