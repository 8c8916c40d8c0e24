"""Checkpoints saved by transformers' DeepseekV4ForCausalLM, read under the official DeepSeek names.

transformers 5.24's `save_pretrained` writes one of two namings (both start with `model.embed_tokens.weight`):
  * by default (save_original_format=True) it undoes its own renames but keeps the `model.` prefix:
    `model.layers.L.attn.wq_a.weight`, `model.layers.L.ffn.experts.E.w1.weight`, `model.hc_head.hc_fn`,
    `head.weight`, and `model.layers.L.attn.norm.weight` for the official `attn.kv_norm.weight`;
  * with save_original_format=False (and in `state_dict()`) it uses its module names:
    `model.layers.L.self_attn.q_a_proj.weight`, `lm_head.weight`, ... (docs/model.md §10.3), and each layer's
    routed experts are fused: `mlp.experts.gate_up_proj` [E, 2I, D] holds rows [w1; w3] of expert e, and
    `mlp.experts.down_proj` [E, D, I] holds w2 (no transposes).
`HFNamedCheckpoint` presents either one under the official names, splitting the fused experts on read.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import numpy as np

from ds4jax.checkpoint.safetensors_reader import CheckpointError, SafetensorsCheckpoint, TensorSpec

MARKER = "model.embed_tokens.weight"  # the official name is embed.weight

# Stored name -> official name, applied in order. The module-name rules do not fire on the default naming.
_RULES = [(re.compile(p), r) for p, r in [
    (r"^model\.embed_tokens\.weight$", "embed.weight"),
    (r"^lm_head\.weight$", "head.weight"),
    (r"^model\.hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
    (r"^model\.", ""),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.(attn|ffn)_hc\.(fn|base|scale)$", r".hc_\1_\2"),
    # transformers nests the indexer in the compressor; officially it sits beside it, holding its own compressor
    (r"\.self_attn\.compressor\.indexer\.scorer\.weights_proj\.", ".attn.indexer.weights_proj."),
    (r"\.self_attn\.compressor\.indexer\.q_b_proj\.", ".attn.indexer.wq_b."),
    (r"\.self_attn\.compressor\.indexer\.", ".attn.indexer.compressor."),
    (r"\.self_attn\.", ".attn."),
    (r"\.sinks$", ".attn_sink"),
    (r"\.position_bias$", ".ape"),
    (r"\.compressor\.kv_norm\.", ".compressor.norm."),
    (r"\.attn\.norm\.", ".attn.kv_norm."),  # the default naming's spelling of the attention's KV norm
    (r"\.mlp\.", ".ffn."),
    (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
    (r"\.shared_experts\.gate_proj\.", ".shared_experts.w1."),  # before the compressor's gate_proj -> wgate
    (r"\.shared_experts\.down_proj\.", ".shared_experts.w2."),
    (r"\.shared_experts\.up_proj\.", ".shared_experts.w3."),
    (r"\.q_a_proj\.", ".wq_a."),
    (r"\.q_a_norm\.", ".q_norm."),
    (r"\.q_b_proj\.", ".wq_b."),
    (r"\.kv_proj\.", ".wkv."),
    (r"\.gate_proj\.", ".wgate."),
    (r"\.o_a_proj\.", ".wo_a."),
    (r"\.o_b_proj\.", ".wo_b."),
]]
_FUSED = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")


def is_hf_named(ckpt: SafetensorsCheckpoint) -> bool:
  return MARKER in ckpt


def official_name(name: str) -> str:
  """The official name of an unfused tensor stored under one of transformers' namings."""
  for pattern, replacement in _RULES:
    name = pattern.sub(replacement, name)
  return name


class _Source(NamedTuple):
  name: str  # as stored
  expert: int | None = None  # for a fused tensor: the expert, its rows, and the resulting shape
  rows: slice = slice(0)
  shape: tuple[int, ...] = ()


class HFNamedCheckpoint:
  """A transformers-named checkpoint with the official-name interface that mapping.load_checkpoint reads through."""

  def __init__(self, ckpt: SafetensorsCheckpoint):
    self._ckpt = ckpt
    self._sources: dict[str, _Source] = {}
    for name in ckpt.names():
      for official, source in self._split(name):
        if official in self._sources:
          raise CheckpointError(f"{ckpt.where(name)} and {self._sources[official].name} both stand for {official}")
        self._sources[official] = source

  def _split(self, name: str) -> list[tuple[str, _Source]]:
    """(official name, source) of each tensor that the stored tensor holds: E x 2 for gate_up_proj."""
    m = _FUSED.fullmatch(name)
    if not m:
      return [(official_name(name), _Source(name))]
    shape = self._ckpt.spec(name).shape
    if len(shape) != 3 or (m[2] == "gate_up_proj" and shape[1] % 2):
      want = "[experts, 2 * intermediate, hidden]" if m[2] == "gate_up_proj" else "[experts, hidden, intermediate]"
      raise CheckpointError(f"{self._ckpt.where(name)}: shape {shape} is not {want}")
    n = shape[1] // 2
    parts = [("w1", slice(0, n)), ("w3", slice(n, 2 * n))] if m[2] == "gate_up_proj" else [("w2", slice(0, shape[1]))]
    return [(f"layers.{m[1]}.ffn.experts.{e}.{w}.weight", _Source(name, e, rows, (rows.stop - rows.start, shape[2])))
            for e in range(shape[0]) for w, rows in parts]

  def names(self) -> list[str]:
    return sorted(self._sources)

  def __contains__(self, name: object) -> bool:
    return name in self._sources

  def spec(self, name: str) -> TensorSpec:
    source = self._source(name)
    spec = self._ckpt.spec(source.name)
    return spec if source.expert is None else TensorSpec(source.shape, spec.dtype)

  def read(self, name: str) -> np.ndarray:
    source = self._source(name)
    array = self._ckpt.read(source.name)
    return array if source.expert is None else array[source.expert, source.rows]

  def where(self, name: str) -> str:
    """'<file>: <stored name>' (with the expert and rows of a fused tensor), for error messages."""
    source = self._sources.get(name)
    if source is None or source.expert is None:
      return self._ckpt.where(source.name if source else name)
    return f"{self._ckpt.where(source.name)}[{source.expert}, {source.rows.start}:{source.rows.stop}] ({name})"

  def _source(self, name: str) -> _Source:
    try:
      return self._sources[name]
    except KeyError:
      raise CheckpointError(f"{self._ckpt.path}: no tensor read as {name!r}") from None
