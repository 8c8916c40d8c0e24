"""experiments/parity_by_switch.py: the variants it builds (per-layer verdicts: tests/experiments/test_verdicts.py)."""

from ds4jax import features
from experiments import parity_by_switch as pbs

ALL = {s: features.CAPABILITIES["cpu_interpret"][s].supported and s not in ("moe_sparse_gate_up", "moe_persistent")
       for s in features.SWITCHES}


def test_variants_split_the_switches():
  v = pbs.variants(features.resolve("cpu_interpret", ALL))
  assert v["all_on"].bf16_matmul and not v["all_on_f32"].bf16_matmul
  assert v["reference_bf16"].on() == ["bf16_matmul"]
  assert v["attention_f32"].on() and all(not s.startswith("moe_") and s != "bf16_matmul"
                                         for s in v["attention_f32"].on())
  assert v["moe_f32"].on() and all(s.startswith("moe_") for s in v["moe_f32"].on())
  assert set(v["attention_f32"].on()) | set(v["moe_f32"].on()) == set(v["all_on_f32"].on())
