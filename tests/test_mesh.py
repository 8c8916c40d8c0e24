"""ds4jax/mesh.py: the mesh spec and its checks; a placed model (routed experts split over an expert axis, each band's
attention split by queries over a query axis, the rest replicated) prefills the same logits as the one-device model,
on the exact path and through the kernels.

jax fixes its device count when its backend starts, and the suite runs on one CPU device, so the sharded runs happen
in one subprocess with XLA_FLAGS=--xla_force_host_platform_device_count=4: this file run as a script (`main`) builds
a one-layer (CSA) tiny_sparse model (8 experts: 4 per device on expert=2, 2 on expert=4) with quantized experts, places
it, prefills 16 seeded random tokens on one device (the exact path) and sharded (under each feature set below), and
prints one JSON line that the tests below read. One layer keeps it to one layer program per (features, mesh): the
MoE is what is split, and every layer passes its input and output through the same streams. The trained checkpoint
(tiny_stdlib, four layers of every kind) is loaded onto two devices and prefilled with every CPU switch against the
same switches on one device.
"""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEVICES = 4
EXPERT_FORMAT = "rocmfp3_mix"  # quantized experts: codes, scales, codebooks and mode [E] all split
# Sharded runs: the exact path; every switch the CPU advertises at once (f32 operands: the MoE kernels with the
# in-kernel decode of the quantized experts inside the expert shard_map, the indexer and sparse MLA kernels on
# replicated inputs; the one layer is a CSA layer, so every kernel runs); dequantize-then-matmul with
# weights-stationary bands (the experts decoded once per layer by the decode kernel, each device its own, outside
# the layer step, kept split). Each is a compile
# of its own, so each takes one mesh size (both sizes are covered), and all are held to the one-device exact path:
# in f32 these switches change kernels, not math (tests/test_model_features.py holds them within NMSE 1e-10 of it).
# Every switch inside the query shard_map: the trained checkpoint's run below (expert+query=2: attention.split_queries
# finds the query role by mesh.axis_of, whatever else the axis splits), on all four of its layers, CSA ones selecting.
ALL_CPU = {"moe_sparse_gate_up": True, "moe_adaptive_tile": True, "moe_compact_queue": True,
           "moe_persistent": True, "moe_fused_combine": True, "indexer_score_kernel": True,
           "indexer_radix_topk": True, "direct_indexer_topk": True, "mla_stream_topk": True,
           "mla_stream_f32_stage": True, "mla_stream_fast_exp": True}
SHARDED = {
    "exact/expert=2,query=2": ({}, "expert=2,query=2"),
    "every_cpu_switch/expert=2": (ALL_CPU, "expert=2"),
    # Bands of 12 after the first start at s0 = 12 (a cache to attend to); 6 queries per device are not a whole
    # number of 4-query chunks, so each device attends in chunks of gcd(6, 4) = 2.
    "exact_bands_of_12_in_chunks_of_4/query=2": ({"prefill_band_tokens": 12, "long_context_chunk": 4}, "query=2"),
    # Weights stationary with its MoE over both bands at once (the sm_90 default): the experts decoded once per
    # layer, kept split, and the sharded MoE on the joined tokens. (Stationary with a MoE per band, a compile of its
    # own, was dropped: its sharded MoE on decoded experts is this one's, and that both orders compute the same is
    # tests/test_prefill.py's test_moe_over_bands_matches_the_layer_step_per_band and
    # test_weights_stationary_decodes_each_layers_experts_once.)
    "stationary_decoded_moe_over_bands/expert=4": ({"moe_compact_queue": True, "moe_decode_kernel": True,
                                                    "prefill_weights_stationary": True,
                                                    "prefill_moe_over_bands": True, "prefill_band_tokens": 8},
                                                   "expert=4"),
}
TOKENS = 16
TRAINED = os.path.join(REPO, "experiments", "checkpoints", "tiny_stdlib")
TRAINED_TOKENS = 40
TRAINED_SPEC = "expert+query=2"  # the two-GPU layout: experts and attention queries split over the same two devices
TRAINED_KEY = f"trained_checkpoint_every_cpu_switch/{TRAINED_SPEC}"
RTOL, ATOL = 1e-5, 5e-5  # summation order: the devices' partial sums, the shared expert added after them; and the
# attention kernels against the exact path (measured 1.8e-5 in logits up to 11; a missing psum is off by ~1)
# The trained checkpoint with every switch, two devices against one: 4.3e-5 to 7.1e-5 over seeds 0-3 in logits up to
# 17, past ATOL on seed 0 (its near-zero logits), so its own bound; still ~2000x under a missing psum.
TRAINED_ATOL = 5e-4


def quantized_experts(m):
  """`m` with its routed experts encoded in EXPERT_FORMAT by the format's numpy encoder (the random-storage init of a
  quantized policy costs ~10 s of compiles here), which fits each expert's own codebooks: a device handed another
  device's side data would decode other values."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel

  from ds4jax.layers import QuantizedWeight  # pylint: disable=import-outside-toplevel
  from ds4jax.quant import formats  # pylint: disable=import-outside-toplevel

  for block in m.layers:
    for name in ("w1", "w2", "w3"):
      w = np.asarray(getattr(block.ffn.experts, name)[...])
      storage = {k: jnp.asarray(a) for k, a in formats.get(EXPERT_FORMAT).quantize(w).items()}
      setattr(block.ffn.experts, name, QuantizedWeight(EXPERT_FORMAT, w.shape, storage))
  return m


def shard_map_axes(fn, *args) -> list[str]:
  """The split axes (mesh axis names in the in_specs) of every shard_map `fn(*args)` runs, in order."""
  from ds4jax import features  # pylint: disable=import-outside-toplevel

  return ["+".join(sorted({a for spec in e.params["in_specs"] for part in spec if part
                           for a in ((part,) if isinstance(part, str) else part)}))
          for e in features.traced_eqns(fn, *args) if e.primitive.name == "shard_map"]


def main():
  """The subprocess: prints {"placement": ..., "logits": {name: [max |diff|, max |ref|, excess over the tolerance]},
  "errors": ...}."""
  import jax  # pylint: disable=import-outside-toplevel  (after XLA_FLAGS, set by the parent)
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel

  from ds4jax import config, features, mesh, model, prefill  # pylint: disable=import-outside-toplevel
  from ds4jax.config import Attention, Routing  # pylint: disable=import-outside-toplevel

  assert jax.device_count() == DEVICES, jax.devices()
  cfg = config.tiny_sparse(attention=(Attention.CSA,), routing=(Routing.TOPK,))
  m = quantized_experts(model.init_random(cfg, seed=int(sys.argv[2]), dtype=jnp.float32))
  tokens = np.random.default_rng(int(sys.argv[2])).integers(0, cfg.vocab_size, TOKENS)
  out = {"logits": {}, "errors": {}}

  placed = {spec: mesh.place(m, spec) for spec in ("expert=2", "expert=4", "query=2", "expert=2,query=2",
                                                   "expert+query=2")}
  leaves = lambda mm: {".".join(map(str, p)): v[...] for p, v in nnx.to_flat_state(nnx.state(mm))}
  s4, orig = leaves(placed["expert=4"]), leaves(m)
  experts = [k for k in s4 if mesh.is_expert_path(tuple(k.split(".")))]
  out["placement"] = {
      "expert_leaves": sorted(k.rsplit(".", 1)[-1] for k in experts if k.startswith("layers.0.ffn.experts.w1")),
      "expert_local_rows": sorted({s4[k].sharding.shard_shape(s4[k].shape)[0] for k in experts}),
      "expert_devices": sorted({len(s4[k].sharding.device_set) for k in experts}),
      "other_replicated_on": sorted({len(v.sharding.device_set) if v.sharding.is_fully_replicated else -1
                                     for k, v in s4.items() if k not in experts}),
      "values_equal": all(np.array_equal(np.asarray(s4[k]), np.asarray(orig[k])) for k in s4),
      "experts_mesh": [blk.ffn.experts.mesh for blk in placed["expert=4"].layers],
      "attention_mesh": [blk.attn.mesh for blk in placed["expert=4"].layers],
      "original_mesh": [blk.ffn.experts.mesh for blk in m.layers] + [blk.attn.mesh for blk in m.layers],
      "query_only_experts_on": sorted({len(v.sharding.device_set) if v.sharding.is_fully_replicated else -1
                                       for k, v in leaves(placed["query=2"]).items() if k in experts}),
      "original_on_devices": sorted({len(v.sharding.device_set) for v in orig.values()}),
  }

  # Which split ran: the shard_maps in one attention band's and one MoE call's programs, by mesh axis, for a band of
  # 16 tokens and of 15 (which two devices do not divide: it runs whole on each).
  feats = features.resolve("cpu_interpret", {"prefill_band_tokens": 0})
  out["splits"] = {}
  for spec in ("expert=2", "query=2", "expert=2,query=2", "expert+query=2"):
    blk = placed[spec].layers[0]
    for n in (16, 15):
      x = jnp.asarray(np.random.default_rng(0).standard_normal((n, cfg.hidden_size)), jnp.float32)
      attn = shard_map_axes(lambda x: blk.attn.band(x, 0, blk.attn.empty_cache(n, n), feats)[0], x)
      ids = jnp.zeros((n, cfg.experts_per_token), jnp.int32)
      moe = shard_map_axes(lambda x: blk.ffn.experts(x, jnp.ones(ids.shape), ids), x)
      out["splits"][f"{spec}/{n}"] = {"attention": attn, "experts": moe}

  run = lambda mm, overrides: np.asarray(prefill.prefill(
      mm, tokens, features.resolve("cpu_interpret", {"prefill_band_tokens": 0} | overrides), all_logits=True))
  ref = run(m, {})
  for key, (overrides, spec) in SHARDED.items():
    got = run(placed[spec], overrides)
    excess = float(np.max(np.abs(got - ref) - (ATOL + RTOL * np.abs(ref))))
    out["logits"][key] = [float(np.max(np.abs(got - ref))), float(np.max(np.abs(ref))), excess]

  # The trained checkpoint (tiny_stdlib: window, CSA, HCA and CSA layers, hash and top-k routing), its experts read
  # onto two devices, with every CPU switch, against the same switches on one device (its larger activations put the
  # switches' own f32 summation order at ~2e-4 from the exact path, so the exact path is not the reference here).
  # 40 tokens give the CSA layers 10 rows, past its top-4, so the indexer kernels select.
  from ds4jax.checkpoint import mapping  # pylint: disable=import-outside-toplevel

  every_switch = features.resolve("cpu_interpret", {"prefill_band_tokens": 0} | ALL_CPU)
  trained = lambda spec: mapping.load_checkpoint(TRAINED, dtype=jnp.float32, log=None, mesh=spec)
  trained_ids = np.random.default_rng(int(sys.argv[2])).integers(0, 256, TRAINED_TOKENS)
  ref, got = (np.asarray(prefill.prefill(trained(spec), trained_ids, every_switch, all_logits=True))
              for spec in ("", TRAINED_SPEC))
  out["logits"][TRAINED_KEY] = [float(np.max(np.abs(got - ref))), float(np.max(np.abs(ref))),
                                float(np.max(np.abs(got - ref) - (TRAINED_ATOL + RTOL * np.abs(ref))))]

  # init_random on the mesh: each device draws its own experts (official: FP4 experts, FP8 dense), the bits of the
  # one-device init placed afterwards.
  direct = leaves(model.init_random(cfg, seed=1, dtype=jnp.float32, policy="official", mesh="expert=4"))
  after = leaves(mesh.place(model.init_random(cfg, seed=1, dtype=jnp.float32, policy="official"), "expert=4"))
  drawn = leaves(model.DeepseekV4(cfg, rngs=nnx.Rngs(params=1), dtype=jnp.float32, policy="official",
                                  mesh="expert=4"))  # as drawn, before init_random places the rest
  out["sharded_init"] = {
      "same_bits": sorted(k for k in direct
                          if np.array_equal(np.asarray(direct[k]), np.asarray(after[k]))) == sorted(after),
      "same_shardings": all(direct[k].sharding == after[k].sharding for k in direct),
      "drawn_expert_rows": sorted({v.sharding.shard_shape(v.shape)[0] for k, v in drawn.items()
                                   if mesh.is_expert_path(tuple(k.split(".")))}),
  }

  # load_checkpoint on the mesh: each device reads its own experts; the same arrays as loading whole then placing.
  import tempfile  # pylint: disable=import-outside-toplevel

  out["sharded_load"] = {}
  with tempfile.TemporaryDirectory() as tmp:
    source = model.init_random(cfg, seed=2, dtype=jnp.float32)
    for kind, official in (("fp4_stored", True), ("float_stored", False)):
      path = os.path.join(tmp, kind)
      mapping.save_checkpoint(source, path, official_formats=official)
      for policy in ("official", "bf16"):  # FP4 experts (copied or encoded per share), float experts
        load = lambda spec: leaves(mapping.load_checkpoint(path, cfg, dtype=jnp.float32, policy=policy, log=None,
                                                           mesh=spec))
        direct, after = load("expert=4"), leaves(mesh.place(mapping.load_checkpoint(
            path, cfg, dtype=jnp.float32, policy=policy, log=None), "expert=4"))
        out["sharded_load"][f"{kind}/{policy}"] = [
            sorted(direct) == sorted(after)
            and all(np.array_equal(np.asarray(direct[k]), np.asarray(after[k])) for k in after),
            all(direct[k].sharding == after[k].sharding for k in direct),
            sorted({v.sharding.shard_shape(v.shape)[0] for k, v in direct.items()
                    if mesh.is_expert_path(tuple(k.split(".")))})]

  # spec_of: what a model's modules carry, in one spelling; a model whose layers disagree is refused.
  one = mesh.place(m, "expert=1")
  out["spec_of"] = {"unplaced": mesh.spec_of(m), "placed": mesh.spec_of(one),
                    "spelling": mesh.spec_of(mesh.place(m, "query + expert=1"))}
  one.layers[0].ffn.experts.mesh = ""  # its attention still says expert=1
  try:
    out["spec_of"]["mixed"] = mesh.spec_of(one)
  except mesh.MeshError as e:
    out["spec_of"]["mixed"] = f"MeshError: {e}"

  for spec in ("expert=8", "expert=3"):
    try:
      mesh.place(m, spec)
      out["errors"][spec] = None
    except mesh.MeshError as e:
      out["errors"][spec] = str(e)
  print("MESH_RESULT " + json.dumps(out), flush=True)


@pytest.fixture(scope="module")
def sharded(module_seed):
  flags = (os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={DEVICES}").strip()
  env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu", XLA_FLAGS=flags)
  p = subprocess.run([sys.executable, os.path.abspath(__file__), "main", str(module_seed)], cwd=REPO, env=env,
                     capture_output=True, text=True, timeout=600)
  lines = [ln for ln in p.stdout.splitlines() if ln.startswith("MESH_RESULT ")]
  assert p.returncode == 0 and lines, p.stderr[-3000:]
  return json.loads(lines[-1].removeprefix("MESH_RESULT "))


def test_place_splits_every_expert_array_and_replicates_the_rest(sharded):
  got = sharded["placement"]
  assert got["expert_leaves"] == ["books", "codes_hi", "codes_lo", "mode", "scales"]  # rocmfp3_mix storage
  assert got["expert_local_rows"] == [2] and got["expert_devices"] == [DEVICES]  # 8 experts, 2 per device
  assert got["other_replicated_on"] == [DEVICES]  # attention, router, shared expert, head: whole on every device
  assert got["values_equal"]
  assert got["experts_mesh"] == ["expert=4"] and got["attention_mesh"] == ["expert=4"]  # both know the mesh
  assert got["original_mesh"] == ["", ""] and got["original_on_devices"] == [1]  # place() leaves its input alone
  assert got["query_only_experts_on"] == [2]  # no expert axis: the experts are replicated


def test_each_axis_splits_its_own_work(sharded):
  """The shard_maps a band runs, by the mesh axis they split: the MoE over the expert axis, the attention over the
  query axis, and a band of 15 tokens (not a multiple of 2) runs its attention whole."""
  got = sharded["splits"]
  assert got["expert=2/16"] == {"attention": [], "experts": ["expert"]}
  assert got["query=2/16"] == {"attention": ["query"], "experts": []}
  assert got["expert=2,query=2/16"] == {"attention": ["query"], "experts": ["expert"]}
  assert got["query=2/15"] == {"attention": [], "experts": []}
  assert got["expert=2,query=2/15"] == {"attention": [], "experts": ["expert"]}
  assert got["expert+query=2/16"] == {"attention": ["expert+query"], "experts": ["expert+query"]}


def test_init_random_on_a_mesh_draws_each_share_on_its_device(sharded):
  got = sharded["sharded_init"]
  assert got == {"same_bits": True, "same_shardings": True, "drawn_expert_rows": [2]}


def test_load_checkpoint_on_a_mesh_reads_each_share_onto_its_device(sharded):
  """FP4 experts copied as stored or encoded share by share, and float experts: the arrays of a whole load placed
  afterwards, 2 of the 8 experts on each of 4 devices."""
  assert sharded["sharded_load"] == {f"{k}/{p}": [True, True, [2]] for k in ("fp4_stored", "float_stored")
                                     for p in ("official", "bf16")}


@pytest.mark.parametrize("key", [*SHARDED, TRAINED_KEY])
def test_sharded_prefill_equals_one_device(sharded, key):
  diff, scale, excess = sharded["logits"][key]
  print(f"{key}: max |logits - one device| {diff:.2e} (logits up to {scale:.1f})")
  assert scale > 1 and excess <= 0, (diff, scale)


def test_place_refuses_a_mesh_that_does_not_fit(sharded):
  assert sharded["errors"]["expert=8"] == ("mesh spec 'expert=8' needs 8 devices; jax sees 4 (on the CPU, "
                                           "XLA_FLAGS=--xla_force_host_platform_device_count=8 gives more)")
  assert "8 routed experts do not split evenly over 3 devices" in sharded["errors"]["expert=3"]


def test_spec_of_says_where_the_model_runs(sharded):
  """Results record `spec_of(model)`, not the flag: a model that was never placed reads as one device. (On the
  subprocess's model, built there anyway: a model of its own here cost ~3 s of random-init compiles.)"""
  got = sharded["spec_of"]
  assert got["unplaced"] == "" and got["placed"] == "expert=1"
  assert got["spelling"] == "expert+query=1"  # recorded in one spelling
  assert got["mixed"] == "MeshError: the model's layers run on different meshes: ['', 'expert=1']"


# ---- the spec and its checks, in this process (one device) ----

def test_parse():
  from ds4jax import mesh  # pylint: disable=import-outside-toplevel

  assert mesh.parse("") == () and mesh.parse(" ") == ()
  assert mesh.parse("expert=2") == (("expert", 2),) and mesh.parse(" expert = 4 ") == (("expert", 4),)
  assert mesh.expert_devices("") == 1 and mesh.expert_devices("expert=4") == 4
  assert mesh.parse("expert + query=2") == (("expert+query", 2),) == mesh.parse("query+expert=2")
  assert mesh.normalize(" query + expert = 2 ") == "expert+query=2" and mesh.normalize("") == ""
  assert mesh.parse("query=2,expert=4") == (("query", 2), ("expert", 4))
  assert (mesh.expert_devices("expert+query=2"), mesh.query_devices("expert+query=2")) == (2, 2)
  assert (mesh.expert_devices("query=2"), mesh.query_devices("query=2"), mesh.query_devices("expert=2")) == (1, 2, 1)
  assert mesh.axis_of("expert=2,query=4", "query") == ("query", 4) and mesh.axis_of("expert=2", "query") is None


@pytest.mark.parametrize("spec, message", [
    ("head=2", "mesh spec 'head=2': axis 'head' is not supported yet: attention heads are not split; query=N splits "
               "each band's attention over N devices by queries instead"),
    ("expert=2,head=2", "axis 'head' is not supported yet: attention heads"),
    ("tensor=2", "mesh spec 'tensor=2': unknown axis 'tensor'; supported: expert=N, query=N (several roles on one "
                 "axis: expert+query=N)"),
    ("expert+tensor=2", "unknown axis 'tensor'"),
    ("query=2,expert+query=2", "axis 'query' is given twice"),
    ("expert", "'expert' is not axis=size with a positive integer size (e.g. expert=2)"),
    ("expert=0", "'expert=0' is not axis=size"),
    ("expert=two", "'expert=two' is not axis=size"),
    ("expert=2,expert=2", "axis 'expert' is given twice"),
])
def test_bad_spec_is_refused_with_its_reason(spec, message):
  from ds4jax import mesh  # pylint: disable=import-outside-toplevel

  with pytest.raises(mesh.MeshError) as e:
    mesh.parse(spec)
  assert message in str(e.value) and str(e.value).startswith(f"mesh spec {spec!r}: ")


def test_check_against_the_model_and_the_devices():
  from ds4jax import config, mesh  # pylint: disable=import-outside-toplevel

  four = config.tiny_sparse(n_routed_experts=4)
  with pytest.raises(mesh.MeshError, match=r"^mesh spec 'expert=3': tiny_sparse's 4 routed experts do not split "
                                           r"evenly over 3 devices \(expert=N needs N to divide 4\)$"):
    mesh.check("expert=3", four, n_devices=8)
  with pytest.raises(mesh.MeshError, match=r"needs 4 devices; jax sees 2 \(on the CPU, "
                                           r"XLA_FLAGS=--xla_force_host_platform_device_count=4 gives more\)$"):
    mesh.check("expert=4", four, n_devices=2)
  assert mesh.check("expert=4", four, n_devices=4) == (("expert", 4),)
  assert mesh.check("", four) == ()


def test_over_several_processes_a_mesh_spans_every_device(monkeypatch):
  """A mesh takes the first devices jax lists, process 0's: over 2 processes of 2 devices, expert=2 left process 1
  none of it (it failed at its first read of a result, after the whole prefill)."""
  from ds4jax import config, mesh  # pylint: disable=import-outside-toplevel

  four = config.tiny_sparse(n_routed_experts=4)
  monkeypatch.setattr(mesh.jax, "process_count", lambda: 2)
  with pytest.raises(mesh.MeshError, match=r"^mesh spec 'expert=2' takes 2 of the 4 devices of 2 processes: over "
                                           r"several processes a mesh spans every device$"):
    mesh.check("expert=2", four, n_devices=4)
  assert mesh.check("expert=4", four, n_devices=4) == (("expert", 4),)
  assert mesh.is_expert_path(("layers", 3, "ffn", "experts", "w1", "codes"))
  assert not mesh.is_expert_path(("layers", 3, "ffn", "shared_experts", "w1", "weight"))
  assert not mesh.is_expert_path(("layers", 3, "ffn", "gate", "weight"))


def test_entry_points_refuse_a_bad_mesh_in_one_line():
  """experiments.flags.check_mesh, which trace_prefill, layer_verdicts, generate and bench_generate call before any
  weights exist (generate's whole command line is checked below)."""
  from ds4jax import config  # pylint: disable=import-outside-toplevel
  from experiments import flags  # pylint: disable=import-outside-toplevel

  flags.check_mesh("x", "expert=1", config.tiny_window())
  for spec, cfg, message in (
      ("expert=3", config.tiny_window(), "x: --mesh: mesh spec 'expert=3': tiny_window's 8 routed experts do not "
                                         "split evenly over 3 devices (expert=N needs N to divide 8)"),
      ("expert=2", config.tiny_window(), "x: --mesh: mesh spec 'expert=2' needs 2 devices; jax sees 1"),
      ("head=2", None, "x: --mesh: mesh spec 'head=2': axis 'head' is not supported yet"),
  ):
    with pytest.raises(SystemExit) as e:
      flags.check_mesh("x", spec, cfg)
    assert str(e.value.code).startswith(message), e.value.code


def test_qualification_refuses_a_bad_mesh_at_start_up():
  from experiments import qualification as q  # pylint: disable=import-outside-toplevel

  for spec, message in (
      ("head=2", "--mesh: mesh spec 'head=2': axis 'head' is not supported yet"),  # options.validate
      ("expert=3", "--mesh: mesh spec 'expert=3': tiny_sparse's 8 routed experts do not split evenly over 3 devices"),
      ("expert=2", "--mesh: mesh spec 'expert=2' needs 2 devices; jax sees 1"),  # inputs.model_config
  ):
    with pytest.raises(q.StartupError) as e:
      q.qualify.start_up(q.Options(preset="tiny_sparse", lengths=(16,), mesh=spec))
    assert str(e.value).startswith(message)


def test_generate_refuses_a_bad_mesh_in_one_line():
  env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
  p = subprocess.run([sys.executable, "-m", "experiments.generate", "--preset=tiny_window", "--prompt_ids=1,2",
                      "--mesh=expert=3"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert p.returncode == 1 and p.stderr.strip().splitlines()[-1] == (
      "generate: --mesh: mesh spec 'expert=3': tiny_window's 8 routed experts do not split evenly over 3 devices "
      "(expert=N needs N to divide 8)"), p.stderr[-2000:]


if __name__ == "__main__" and sys.argv[1:2] == ["main"]:
  main()
