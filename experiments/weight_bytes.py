"""Bytes of each model component under each quantization policy, from the model's own storage layout.

    python -m experiments.weight_bytes [--preset=v4_flash] [--policies=bf16,official,lucebox_mix]

Counts what `init_random` / `load_checkpoint` would allocate (codes, scales, codebooks included), by
building the model abstractly: nothing is allocated.
"""

import collections

import jax
import jax.numpy as jnp
from absl import app, flags

from ds4jax import config, model
from ds4jax.checkpoint.mapping import weight_bytes, weights
from ds4jax.quant import policy as quant_policy

_PRESET = flags.DEFINE_string("preset", "v4_flash", "Model preset.")
_POLICIES = flags.DEFINE_list("policies", list(quant_policy.POLICIES), "Quantization policies.")


def component(path: tuple) -> str:
  p = [str(x) for x in path]
  if p[0] != "layers":
    return {"embed": "embedding", "head": "lm head"}.get(p[0], "final norm + HC head")
  if p[2:4] == ["ffn", "experts"]:
    return "routed experts gate/up" if p[4] in ("w1", "w3") else "routed experts down"
  if p[2:4] == ["ffn", "shared_experts"]:
    return "shared expert"
  if p[2:4] == ["ffn", "gate"]:
    return "router (+ hash tables)"
  if p[2] == "attn" and len(p) > 3 and p[3] in ("compressor", "indexer"):
    return "compressors + indexer"
  if p[2] == "attn":
    return "attention projections"
  return "norms + hyper-connections"


def bytes_by_component(cfg, pol) -> dict[str, int]:
  m = model.abstract_model(cfg, jnp.bfloat16, pol)
  out = collections.Counter()
  for path, w in weights(m):
    out[component(path)] += weight_bytes(w)
  return dict(out)


def main(argv):
  del argv
  cfg = config.preset(_PRESET.value)
  table = {p: bytes_by_component(cfg, quant_policy.get(p)) for p in _POLICIES.value}
  rows = sorted({c for t in table.values() for c in t}, key=lambda c: -table[_POLICIES.value[0]].get(c, 0))
  print(f"{cfg.name}: weight bytes by component (GB = 1e9 bytes)")
  print(f"{'component':<28}" + "".join(f"{p:>14}" for p in _POLICIES.value))
  for c in rows:
    print(f"{c:<28}" + "".join(f"{table[p].get(c, 0) / 1e9:>14.3f}" for p in _POLICIES.value))
  print(f"{'TOTAL':<28}" + "".join(f"{sum(table[p].values()) / 1e9:>14.3f}" for p in _POLICIES.value))
  for p in _POLICIES.value:
    pol = quant_policy.get(p)
    print(f"  {p}: dense={pol.dense} gate_up={pol.gate_up} down={pol.down}")
  if cfg.name == "v4_flash" and "lucebox_mix" in table:
    print(UPSTREAM_NOTE.format(total=sum(table["lucebox_mix"].values()) / 1e9))


UPSTREAM_NOTE = """
lucebox_mix vs upstream's 98.3 GB "ROCmFPX MIX" GGUF: {total:.1f} GB here. The routed experts match the formats
(gate/up ROCmFP2-MIX 2.5 bpw, down ROCmFP3-MIX 3.5 bpw, plus two bf16 codebooks per expert). The gap comes from
  * dense weights: upstream's ROCmFP4_FAST layout is undocumented; the official FP4 E2M1 (4.25 bpw) stands in;
  * embedding and LM head: bf16 here (2.1 GB); a GGUF usually stores them quantized;
  * upstream's experts are "adaptive qtype-105/106": some tensors take the 2.5-bit format where this policy uses
    3.5 bits (all down projections); which ones is not published.
It fits one 141 GB H200 with room for a 128K-token cache (compressed rows + indexer keys + windows: ~0.9 GB
in bf16 across the 41 compressed layers) and the prefill activations."""


if __name__ == "__main__":
  jax.config.update("jax_platforms", "cpu")
  app.run(main)
