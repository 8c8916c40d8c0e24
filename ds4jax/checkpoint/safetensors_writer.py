"""Writes safetensors files with every dtype the reader knows (the `safetensors` package lacks BF16/F8 in numpy)."""

from __future__ import annotations

import json
import os
import struct
from typing import Mapping

import numpy as np

from ds4jax.checkpoint.safetensors_reader import DTYPES

_NAME_OF = {np.dtype(v): k for k, v in DTYPES.items() if k != "F8_E8M0"}  # uint8 -> U8 unless told


def save_file(path: str | os.PathLike, tensors: Mapping[str, np.ndarray],
              dtype_names: Mapping[str, str] | None = None, metadata: Mapping[str, str] | None = None) -> None:
  """Writes `tensors` to one file. `dtype_names` overrides the inferred name (e.g. 'F8_E8M0' for scale bytes)."""
  dtype_names = dict(dtype_names or {})
  header, offset = {}, 0
  arrays = {n: np.ascontiguousarray(a) for n, a in tensors.items()}
  for name, a in arrays.items():
    dname = dtype_names.get(name) or _NAME_OF.get(a.dtype)
    if dname is None or DTYPES[dname].itemsize != a.dtype.itemsize:
      raise ValueError(f"{name}: cannot store dtype {a.dtype} as {dname}")
    header[name] = {"dtype": dname, "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
    offset += a.nbytes
  if metadata:
    header["__metadata__"] = dict(metadata)
  text = json.dumps(header).encode()
  text += b" " * (-len(text) % 8)  # keep the data 8-byte aligned, as the reference writer does
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(text)) + text)
    for a in arrays.values():
      f.write(a.tobytes())
