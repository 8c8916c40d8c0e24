"""Sparse MLA attention kernels (kernels_pallas/mla) against the dense reference, in Pallas interpret mode on CPU
and compiled (Pallas-Triton) on a GPU: the same cases run on both (INTERPRET follows the default backend).

Parity follows Lucebox's streaming-attention differential test (docs/upstream.md §7.2): every element within
|a − b| <= 5e-4 + 5e-4·max(|a|, |b|) of `sparse_mla_reference`, for the streaming kernel with every
(f32_stage, fast_exp) combination and for the grouped baseline; positions near 0, on window and compression
boundaries (ratio 4 and 128), far out (131000), 4 / 12 / 16 / 64 heads (D 512 once), f32 and bf16 KV, k larger
than the visible rows, traced q_start; byte identity of the direct and the mask-rebuilt index lists; fast exp's
NMSE printed; unsupported shapes rejected.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ds4jax.metrics import nmse
from kernels_pallas.indexer.handoff import selected_rows
from kernels_pallas.mla import Config, default_platform, kernel_name, sparse_mla, sparse_mla_reference
from kernels_pallas.mla.reference import apply_rope

INTERPRET = jax.default_backend() == "cpu"
PLATFORM = "cpu" if INTERPRET else default_platform()
ATOL = RTOL = 5e-4
VARIANTS = (  # (impl, f32_stage, fast_exp)
    ("stream", True, False), ("stream", False, False), ("stream", True, True), ("grouped", True, False))
FAST = VARIANTS[2:]  # fewer compiles for the cases that add shapes rather than key-set boundaries
NO_UNSTAGED = (VARIANTS[0],) + FAST


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  kind: str
  T: int
  H: int
  D: int
  q_start: int
  window: int
  ratio: int = 1
  k: int = 0
  rope_dim: int = 16
  dtype: str = "float32"        # K/V (and q) storage
  raw_lead: int = 0             # extra raw rows before the first needed one
  config: dict | None = None    # Config overrides (None: Config.default for the platform)
  variants: tuple = VARIANTS


CASES = (
    Case("window_near0", "window", T=8, H=4, D=64, q_start=0, window=8),
    Case("window_bf16_wrap", "window", T=9, H=16, D=64, q_start=3, window=5, dtype="bfloat16", variants=FAST),
    Case("hca_ratio4_boundary", "hca", T=8, H=16, D=64, q_start=5, window=8, ratio=4, dtype="bfloat16"),
    Case("hca_ratio128_boundary", "hca", T=16, H=4, D=64, q_start=120, window=16, ratio=128, raw_lead=3,
         variants=NO_UNSTAGED),
    Case("csa_k_exceeds_visible", "csa", T=8, H=4, D=64, q_start=2, window=8, ratio=4, k=16),
    Case("csa_ratio4_window_edge", "csa", T=8, H=16, D=128, q_start=124, window=8, ratio=4, k=16,
         dtype="bfloat16", rope_dim=32),
    Case("csa_far_131000", "csa", T=2, H=16, D=64, q_start=131000, window=128, ratio=4, k=32, dtype="bfloat16",
         variants=NO_UNSTAGED),
    Case("hca_far_131000", "hca", T=2, H=16, D=64, q_start=131000, window=16, ratio=128, variants=FAST),
    Case("csa_64heads_d512", "csa", T=2, H=64, D=512, q_start=300, window=128, ratio=4, k=64, rope_dim=64,
         variants=FAST),
    Case("csa_12heads_tiled", "csa", T=5, H=12, D=64, q_start=40, window=8, ratio=4, k=16,
         config=dict(heads_per_program=8, tokens_per_program=2), variants=NO_UNSTAGED),
    Case("hca_tokens_tiled", "hca", T=7, H=16, D=64, q_start=61, window=8, ratio=4, dtype="bfloat16",
         config=dict(heads_per_program=8, tokens_per_program=4, head_dim_chunk=32), variants=FAST),
    # The CUDA tiling (every head in one program, 32 or 64 keys per stage, q resident, 2 stages) on each key set.
    Case("csa_cuda_tiles", "csa", T=3, H=16, D=128, q_start=77, window=16, ratio=4, k=32, dtype="bfloat16",
         config=dict(keys_per_stage=32, q_resident=True, num_stages=2), variants=FAST),
    Case("window_cuda_tiles", "window", T=5, H=16, D=64, q_start=40, window=40,
         config=dict(keys_per_stage=32, q_resident=True, num_stages=2), variants=FAST),
)


def freqs(rope_dim: int) -> np.ndarray:
  return (1.0 / 10000.0 ** (np.arange(0, rope_dim, 2) / rope_dim)).astype(np.float32)


def random_indices(rng, T, k, q_start, ratio, R):
  """[T, k] ascending visible rows, −1 at the tail; some queries keep fewer than k rows even when more are
  visible."""
  idx = np.full((T, k), -1, np.int32)
  for t in range(T):
    vis = min((q_start + t + 1) // ratio, R)
    n = min(k, vis) if t % 3 else min(k // 2, vis)
    if n:
      idx[t, :n] = np.sort(rng.choice(vis, n, replace=False))
  return idx


def make_problem(rng, c: Case, q_start=None):
  q_start = c.q_start if q_start is None else q_start
  raw_start = max(q_start - c.window + 1 - c.raw_lead, 0)
  N = q_start + c.T - raw_start
  R = (q_start + c.T) // c.ratio if c.kind != "window" else 0
  q = rng.standard_normal((c.T, c.H, c.D)).astype(np.float32)
  q /= np.sqrt(np.mean(q ** 2, axis=-1, keepdims=True))  # per-head RMS-normalized, as the model's q
  dt = jnp.dtype(c.dtype)
  cast = lambda a: jnp.asarray(a).astype(dt)
  p = dict(q=cast(q), raw_kv=cast(rng.standard_normal((N, c.D))), sink=jnp.asarray(rng.standard_normal(c.H),
                                                                                        jnp.float32),
           comp_kv=cast(rng.standard_normal((R, c.D))) if R else None, q_start=q_start, raw_start=raw_start,
           kind=c.kind, ratio=c.ratio, window=c.window, inv_freq=freqs(c.rope_dim))
  if c.kind == "csa":
    p["indices"] = jnp.asarray(random_indices(rng, c.T, c.k, q_start, c.ratio, R))
  return p


def config_for(c: Case) -> Config:
  """The platform's default config with the case's overrides, at the parity precision ("split")."""
  cfg = Config.default(c.H, c.D, c.kind, platform=PLATFORM, dtype=c.dtype, precision="split")
  over = dict(c.config or {})
  if not INTERPRET:  # GPU dots need M >= 16
    hp = over.get("heads_per_program", cfg.heads_per_program)
    over["tokens_per_program"] = max(over.get("tokens_per_program", cfg.tokens_per_program), 16 // hp)
  return dataclasses.replace(cfg, **over)


def run(p, *, impl="stream", f32_stage=True, fast_exp=False, config=None):
  if config is None:
    config = Config.default(p["q"].shape[1], p["q"].shape[2], p["kind"], platform=PLATFORM, dtype=p["raw_kv"].dtype,
                            precision="split")
  return np.asarray(sparse_mla(**p, impl=impl, f32_stage=f32_stage, fast_exp=fast_exp, config=config,
                               interpret=INTERPRET))


def reference(p):
  """sparse_mla_reference under one jit (eager, every op compiles on its own: seconds per shape)."""
  arrays = {n: p.get(n) for n in ("q", "raw_kv", "comp_kv", "sink", "indices", "q_start", "raw_start")}
  static = {n: p[n] for n in ("kind", "ratio", "window", "inv_freq")}
  return np.asarray(jax.jit(lambda a: sparse_mla_reference(**a, **static))(arrays), np.float64)


def assert_close(got, want):
  assert got.dtype == np.float32 and got.shape == want.shape
  assert np.isfinite(got).all()
  err = np.abs(got.astype(np.float64) - want)
  tol = ATOL + RTOL * np.maximum(np.abs(got), np.abs(want))
  bad = err > tol
  assert not bad.any(), (f"{bad.sum()} of {bad.size} elements out of tolerance; worst |a-b| {err.max():.3e}, "
                         f"NMSE {nmse(got, want):.3e}")


# ---- parity --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_parity(rng, case):
  p = make_problem(rng, case)
  want = reference(p)
  assert np.abs(want).max() > 0.05  # a real signal to compare
  cfg = config_for(case)
  outs = {}
  for impl, stage, fast in case.variants:
    outs[(impl, stage, fast)] = got = run(p, impl=impl, f32_stage=stage, fast_exp=fast, config=cfg)
    assert_close(got, want)
  print(f"{case.name}: NMSE " + ", ".join(f"{kernel_name(*v)} {nmse(o, want):.2e}" for v, o in outs.items()))
  if ("stream", False, False) in outs:  # staging changes where the rows come from, not the arithmetic
    np.testing.assert_array_equal(outs[("stream", True, False)], outs[("stream", False, False)])


@pytest.mark.parametrize("impl, fast_exp", [("stream", False), ("stream", True), ("grouped", False)])
def test_sink_of_minus_inf_is_a_plain_softmax(rng, impl, fast_exp):
  """A sink of −∞ is a plain softmax (docs/model.md §4). The online max starts at the sink, and a band's first
  queries meet a key stage wholly before position 0: from −∞ that gave exp(−∞ − −∞) = NaN everywhere."""
  T, H, D, W = 4, 4, 64, 40
  p = dict(q=jnp.asarray(rng.standard_normal((T, H, D)), jnp.float32),
           raw_kv=jnp.asarray(rng.standard_normal((T + W - 1, D)), jnp.float32), comp_kv=None,
           sink=jnp.full((H,), -jnp.inf, jnp.float32), q_start=0, raw_start=-(W - 1), kind="window", ratio=1,
           window=W, inv_freq=freqs(16))
  want = reference(p)
  assert np.isfinite(want).all()
  assert_close(run(p, impl=impl, fast_exp=fast_exp), want)


def test_unstaged_fast_exp_runs_and_equals_the_staged_one(rng):
  """Fast exp without f32 staging is a kernel option like any other (the upstream rule that pairs them is checked
  once, by the feature switches): it matches the reference and, staging moving no arithmetic, the staged kernel."""
  p = make_problem(rng, CASES[0])
  staged, unstaged = (run(p, f32_stage=stage, fast_exp=True) for stage in (True, False))
  assert_close(unstaged, reference(p))
  np.testing.assert_array_equal(unstaged, staged)
  names = {kernel_name("stream", stage, fast) for stage in (True, False) for fast in (True, False)}
  assert len(names) == 4  # each variant is its own, named kernel


@pytest.mark.parametrize("impl", ["stream", "grouped"])
def test_bf16_output_is_the_f32_output_rounded(rng, impl):
  """out_dtype=bf16 (the model's under bf16_matmul) stores the f32 result rounded once: the same bits as casting the
  f32 output, so the output projection reads what it read before."""
  p = make_problem(rng, CASES[5])  # CSA, bf16 KV, 16 heads
  cfg = config_for(CASES[5])
  f32 = sparse_mla(**p, impl=impl, config=cfg, interpret=INTERPRET)
  bf16 = sparse_mla(**p, impl=impl, config=cfg, interpret=INTERPRET, out_dtype=jnp.bfloat16)
  assert f32.dtype == jnp.float32 and bf16.dtype == jnp.bfloat16 and np.abs(np.asarray(f32)).max() > 0.05
  np.testing.assert_array_equal(np.asarray(bf16).view(np.uint16), np.asarray(f32.astype(jnp.bfloat16)).view(np.uint16))
  with pytest.raises(ValueError, match="out_dtype must be"):
    sparse_mla(**p, impl=impl, config=cfg, interpret=INTERPRET, out_dtype=jnp.float16)


def test_output_rope_dims_are_derotated(rng):
  """Keys that are all one row v: the output is exactly v de-rotated by −p (checks the in-kernel inverse RoPE
  against apply_rope, independent of the softmax)."""
  c = Case("rope", "window", T=4, H=4, D=64, q_start=1000, window=4, rope_dim=64)
  p = make_problem(rng, c)
  v = rng.standard_normal(c.D).astype(np.float32)
  p["raw_kv"] = jnp.broadcast_to(jnp.asarray(v), p["raw_kv"].shape)
  p["sink"] = jnp.full((c.H,), -1e4, jnp.float32)  # no sink mass
  got = run(p)
  pos = jnp.arange(c.q_start, c.q_start + c.T)
  want = np.asarray(apply_rope(jnp.broadcast_to(jnp.asarray(v), (c.T, c.H, c.D)), pos, freqs(64), inverse=True))
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
  assert np.abs(got - v).max() > 0.1  # the rotation did something


def test_traced_q_start_one_compile(rng):
  """Chunked prefill: one jit serves every offset (q_start and raw_start traced; N and R fixed). k = 8 is
  below the 16 keys per stage: the wrapper pads the slots with −1."""
  T, H, D, W, k, R = 4, 4, 64, 8, 8, 16

  def fn(q, raw_kv, comp_kv, sink, indices, qs):
    return sparse_mla(q, raw_kv, comp_kv, sink, q_start=qs, raw_start=qs - (W - 1), kind="csa", ratio=4,
                      window=W, inv_freq=freqs(16), indices=indices, interpret=INTERPRET)

  jitted = jax.jit(fn)
  for q_start in (7, 13, 40):
    p = dict(q=jnp.asarray(rng.standard_normal((T, H, D)), jnp.float32),
             raw_kv=jnp.asarray(rng.standard_normal((T + W - 1, D)), jnp.float32),
             comp_kv=jnp.asarray(rng.standard_normal((R, D)), jnp.float32),
             sink=jnp.asarray(rng.standard_normal(H), jnp.float32),
             indices=jnp.asarray(random_indices(rng, T, k, q_start, 4, R)))
    want = sparse_mla_reference(**p, q_start=q_start, raw_start=q_start - (W - 1), kind="csa", ratio=4, window=W,
                                inv_freq=freqs(16))
    got = np.asarray(jitted(*p.values(), jnp.int32(q_start)))
    assert_close(got, np.asarray(want, np.float64))
  assert jitted._cache_size() == 1  # pylint: disable=protected-access


def test_indices_direct_vs_mask_path_byte_identical(rng):
  """The mask path (lucebox §1.3) scans the additive mask back into ascending physical rows, whatever order the
  indexer picked them in: from best-first picks it rebuilds the ascending list the direct path hands the kernel (the
  model sorts them: ds4jax/attention.py kernel_row_list), so the kernel reads the same rows in the same order and
  gives identical bytes. (Rebuilt from the ascending list itself, it could not differ.)"""
  p = make_problem(rng, CASES[4], q_start=40)  # up to 12 visible rows to pick from, not 2
  R = p["comp_kv"].shape[0]
  ascending = np.asarray(p["indices"])
  best_first = ascending.copy()
  for row in best_first:  # each query's picks in the order of their scores (random here), the −1 tail kept
    n = int((row >= 0).sum())
    row[:n] = rng.permutation(row[:n])
  assert not np.array_equal(best_first, ascending)
  rebuilt = selected_rows(jnp.asarray(best_first), R, direct_indexer_topk=False)
  np.testing.assert_array_equal(np.asarray(rebuilt), ascending)
  direct = run(p)
  via_mask = run(dict(p, indices=rebuilt))
  assert np.array_equal(direct, via_mask)
  assert_close(direct, reference(p))


def test_duplicate_and_invisible_indices_are_masked(rng):
  """A repeated row counts once and a row beyond (p + 1) // ratio is dropped, as in the dense reference."""
  c = CASES[4]
  p = make_problem(rng, c)
  idx = np.asarray(p["indices"]).copy()
  idx[5, :4] = [0, 0, 1, 1]            # duplicates (sorted, adjacent)
  idx[6, 4] = 1000                      # not visible (and >= R)
  idx[7, :3] = [0, 1, 2]                # position 9 sees rows < 10 // 4 = 2: row 2 is not visible
  p["indices"] = jnp.asarray(idx)
  assert_close(run(p), reference(p))


def test_bf16_precision_nmse(rng):
  """precision="bf16" (one bf16 pass per dot): NMSE printed and bounded; fast exp on top of it."""
  c = CASES[5]
  p = make_problem(rng, c)
  want = reference(p)
  cfg = dataclasses.replace(Config.default(c.H, c.D, c.kind, platform=PLATFORM), precision="bf16")
  got = run(p, config=cfg, fast_exp=True)
  err = nmse(got, want)
  print(f"precision bf16 + fast exp NMSE {err:.2e}")
  assert err < 1e-4


# ---- rejection ---------------------------------------------------------------------------------------------------

def _base(rng):
  return make_problem(rng, CASES[4])


@pytest.mark.parametrize("change, match", [
    (lambda p: dict(p, q=p["q"][..., :48], raw_kv=p["raw_kv"][:, :48], comp_kv=p["comp_kv"][:, :48]),
     r"head dim D=48"),
    (lambda p: dict(p, q=jnp.zeros((8, 4, 1024)), raw_kv=jnp.zeros((10, 1024)), comp_kv=jnp.zeros((2, 1024))),
     r"D=1024"),
    (lambda p: dict(p, raw_kv=jnp.zeros((p["raw_kv"].shape[0], 128))), r"raw_kv shape \(\d+, 128\)"),
    (lambda p: dict(p, comp_kv=jnp.zeros((2, 128))), r"comp_kv shape \(2, 128\)"),
    (lambda p: dict(p, indices=p["indices"][:, :12]), r"k=12"),
    (lambda p: dict(p, kind="hca"), r"only taken with kind 'csa'"),
    (lambda p: dict(p, indices=None), r"needs indices"),
    (lambda p: dict(p, kind="mqa"), r"kind='mqa'"),
    (lambda p: dict(p, inv_freq=np.ones(40, np.float32)), r"rope_dim"),
    (lambda p: dict(p, sink=jnp.zeros(3)), r"sink shape \(3,\)"),
    (lambda p: dict(p, raw_start=p["raw_start"] + 1), r"raw_kv shape .* covers positions"),
    (lambda p: dict(p, q=p["q"].astype(jnp.float16)), r"float16"),
    (lambda p: dict(p, impl="dense"), r"impl='dense'"),
    (lambda p: dict(p, impl="grouped", fast_exp=True), r"fast_exp=True requires impl='stream'"),
    (lambda p: dict(p, config=Config(heads_per_program=12)), r"heads_per_program=12"),
])
def test_rejects(rng, change, match):
  p = change(_base(rng))
  with pytest.raises(ValueError, match=match):
    sparse_mla(**{"interpret": INTERPRET, **p})


def test_rejects_hca_without_enough_rows(rng):
  p = make_problem(rng, CASES[2])
  with pytest.raises(ValueError, match=r"compressed rows"):
    sparse_mla(**dict(p, comp_kv=p["comp_kv"][:1]), interpret=INTERPRET)


def test_gpu_needs_16_rows():
  cfg = Config(heads_per_program=4, tokens_per_program=2)
  cfg.validate(compiled=False)
  with pytest.raises(ValueError, match=r">= 16"):
    cfg.validate(compiled=True)


def test_cuda_default_keys_per_stage():
  """64 keys per stage for the staged kernel with bf16 rows (measured fastest on the H200), 32 without staging
  (its second copy of the rows would not fit in shared memory at 64: test_lowering_gfx1151), 16 for f32 rows split
  into two bf16 parts."""
  keys = lambda **kw: Config.default(64, 512, "csa", platform="cuda", **kw).keys_per_stage
  assert (keys(), keys(f32_stage=False), keys(dtype="float32"), keys(dtype="float32", precision="bf16")) == \
      (64, 32, 16, 64)
