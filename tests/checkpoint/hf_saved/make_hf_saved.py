"""Writes the checkpoints of tests/checkpoint/hf_saved/ with transformers' own `save_pretrained` (see README.md).

Run with the pinned oracle of tests/goldens/README.md (transformers 5.24.0, torch 2.13.0 CPU), from the repo root:
    /tmp/venv-golden/bin/python tests/checkpoint/hf_saved/make_hf_saved.py
Writes hf_saved/{original_format, module_names, official}/: one tiny random model, saved three ways.
"""

import shutil
import sys
from pathlib import Path

import torch

import transformers
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

OUT_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(OUT_DIR.parents[1] / "goldens"))
import make_goldens as mg  # noqa: E402  (randomize, to_official, save_weights: the goldens' own tools)

# Every tensor kind in two layers: CSA (compressor + indexer) with hash routing, HCA with top-k routing. Small
# enough to commit three times; 2*moe_intermediate_size != hidden_size, so the fused gate_up_proj [E, 2I, D]
# cannot be mistaken for its transpose.
CFG = dict(
    vocab_size=64, hidden_size=32, moe_intermediate_size=8, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, head_dim=32, qk_rope_head_dim=16, q_lora_rank=16, o_groups=2, o_lora_rank=8,
    n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, routed_scaling_factor=1.5, swiglu_limit=10.0,
    index_n_heads=2, index_head_dim=16, index_topk=2, sliding_window=4, compress_ratios=[4, 128],
    compress_rate_hca=8, num_hash_layers=1, hc_mult=2, rope_theta=1e4, compress_rope_theta=1.6e5,
    max_position_embeddings=64,
)


def main():
  torch.set_num_threads(1)
  assert transformers.__version__ == "5.24.0" and torch.__version__.startswith("2.13.0"), "pinned oracle"
  torch.set_grad_enabled(False)
  transformers.utils.logging.disable_progress_bar()
  cfg = DeepseekV4Config(**CFG)
  cfg.architectures = ["DeepseekV4ForCausalLM"]
  torch.manual_seed(0)
  model = DeepseekV4ForCausalLM(cfg).eval()
  mg.randomize(model, seed=22)
  ids = torch.randint(2, cfg.vocab_size, (1, 24), generator=torch.Generator().manual_seed(22))
  logits = model(ids).logits

  dirs = {name: OUT_DIR / name for name in ("original_format", "module_names", "official")}
  for d in dirs.values():
    shutil.rmtree(d, ignore_errors=True)
  model.save_pretrained(dirs["original_format"])  # transformers' default: save_original_format=True
  model.save_pretrained(dirs["module_names"], save_original_format=False)
  dirs["official"].mkdir()
  cfg.to_json_file(dirs["official"] / "config.json")
  mg.save_weights(mg.to_official(model), dirs["official"], shards=1)

  # HF reads all three back (the official names through its own conversion_mapping) to bit-identical logits.
  for name, d in dirs.items():
    loaded, info = DeepseekV4ForCausalLM.from_pretrained(d, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), (name, info)
    assert torch.equal(loaded.eval()(ids).logits, logits), name
    size = sum(f.stat().st_size for f in d.iterdir())
    print(f"{name}: {sorted(f.name for f in d.iterdir())}, {size / 1024:.0f} KiB; from_pretrained: same logits")


if __name__ == "__main__":
  main()
