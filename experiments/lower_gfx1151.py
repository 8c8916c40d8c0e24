"""Offline gfx1151 lowering check of every Pallas kernel ds4jax ships, at V4-Flash shapes (no GPU needed).

    python -m experiments.lower_gfx1151 [--arch=gfx1151] [--record_arch=gfx1150] [--also_cuda] [--tokens=8192,512]
        [--formats=all] [--sweep] [--out=experiments/results/lowering_gfx1151]

Lowers each kernel for an abstract ROCm device at the configuration ds4jax would ship there (today: the grouped MoE
— gate_up, down, combine — with `Config.default(..., platform="rocm")`, bf16 activations, bf16 and every quantized
expert format), compiles the Triton IR with triton 3.9.0's HIP backend for `--arch` (gating) and `--record_arch`
(recorded only), and with `--also_cuda` the CUDA config for sm_90 (recorded only). See kernels_pallas/lowering.py
and /work/shared/reference/pallas-notes.md §8. Writes OUT.json and OUT.md and prints the tables.

Exits 1, naming kernel and config, when a shipped `--arch` kernel needs more than 65,536 bytes of LDS, spills
VGPRs or uses scratch. `--sweep` then searches block sizes / warps / stages for configurations that pass for every
format at each failing token count (nothing is changed in kernels_pallas; the result is a proposal).
Needs the `lowering` extra: pip install -e '.[lowering]'.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import warnings  # noqa: E402

import jax  # noqa: E402
from absl import app, flags  # noqa: E402

from experiments import run_record  # noqa: E402
from kernels_pallas import lowering  # noqa: E402

_ARCH = flags.DEFINE_string("arch", "gfx1151", "AMD target whose limits gate the run (exit 1 on a violation).")
_RECORD_ARCH = flags.DEFINE_list("record_arch", ["gfx1150"], "More AMD targets, recorded but not gating.")
_ALSO_CUDA = flags.DEFINE_bool("also_cuda", True, "Also lower the CUDA config and compile it for sm_90 (recorded).")
_TOKENS = flags.DEFINE_list("tokens", ["8192", "512"], "Prompt lengths (the adaptive row tile follows them).")
_FORMATS = flags.DEFINE_list("formats", ["all"], "Expert weight formats: 'all', or bf16 and quantized names.")
_SWEEP = flags.DEFINE_bool("sweep", False, "Search configs that pass --arch for every token count that fails.")
_X_DTYPE = flags.DEFINE_enum("x_dtype", "bfloat16", ["bfloat16", "float32"],
                              "Activation dtype (bf16: bf16 dots on WMMA; float32: exact f32 dots, no WMMA).")
_JOBS = flags.DEFINE_integer("jobs", os.cpu_count() or 1, "Compile processes.")
_OUT = flags.DEFINE_string("out", "experiments/results/lowering_gfx1151", "Output path prefix (.json and .md).")

HIP_COLS = ("kernel", "format", "tokens", "config", "LDS B", "VGPR/SGPR", "spills V/S", "scratch B", "occ.", "WMMA",
            "compile s", "status")
CUDA_COLS = ("kernel", "format", "tokens", "config", "smem B", "regs", "spill st/ld B", "MMA", "compile s", "status")


def formats(names) -> list[str]:
  try:
    from kernels_pallas.moe.quantized_weights import QUANTIZED_FORMATS  # pylint: disable=import-outside-toplevel
  except ImportError:
    QUANTIZED_FORMATS = ()
  if list(names) == ["all"]:
    return ["bf16", *QUANTIZED_FORMATS]
  bad = [n for n in names if n != "bf16" and n not in QUANTIZED_FORMATS]
  if bad:
    raise app.UsageError(f"unknown or unavailable formats {bad}; available: bf16, {', '.join(QUANTIZED_FORMATS)}")
  return list(names)


def lower_case(case: lowering.Case):
  """Lowers a case and checks its kernels against kernels_pallas.moe.plan (names and grids)."""
  from kernels_pallas.moe import plan  # pylint: disable=import-outside-toplevel

  kernels = lowering.lower_kernels(case.fn, case.args, case.platform)
  s = lowering.V4_FLASH_MOE
  p = plan(num_tokens=case.tokens, top_k=s["top_k"], num_experts=s["num_experts"], hidden=s["hidden"],
           intermediate=s["intermediate"], config=case.config)
  names = tuple(k.name for k in kernels)
  if names != p.kernels:
    raise RuntimeError(f"{case.label}: lowered kernels {names} differ from plan {p.kernels}")
  grids = {"gate_up": p.gate_up_grid, "down": p.down_grid, "combine": p.combine_grid}
  for k in kernels:
    want = next(g for n, g in grids.items() if n in k.name)
    if k.grid[:len(want)] != tuple(want):
      raise RuntimeError(f"{case.label}: {k.name} grid {k.grid} differs from plan {want}")
  return kernels


def rows_for(cases, targets, jobs: int, gating: str | None):
  """Lowers every case once per platform and compiles each kernel for each of its platform's targets."""
  work = []
  for case in cases:
    kernels = lower_case(case)
    for target in targets[case.platform]:
      for k in kernels:
        work.append((case, k, target))
  stats = lowering.compile_many([(k, t) for _, k, t in work], processes=jobs)
  rows = []
  for (case, k, target), st in zip(work, stats):
    violations = [st["error"]] if "error" in st else lowering.check(st)
    rows.append(dict(target=target, gating=target == gating, kernel=k.name, format=case.fmt, tokens=case.tokens,
                     config=lowering.moe_kernel_config(k.name, case.config, case.tokens), grid=list(k.grid),
                     stats=st, violations=violations))
  return rows


def fmt_hip(r) -> tuple:
  s = r["stats"]
  if "error" in s:
    return (r["kernel"], r["format"], r["tokens"], r["config"], "-", "-", "-", "-", "-", "-", "-",
            "ERROR " + s["error"][:80])
  return (r["kernel"], r["format"], r["tokens"], r["config"], s["lds_bytes"], f"{s['vgpr']}/{s['sgpr']}",
          f"{s['vgpr_spills']}/{s['sgpr_spills']}", s["scratch_bytes"], s["occupancy"], s["wmma"],
          f"{s['compile_s']:.1f}", "; ".join(r["violations"]) or "ok")


def fmt_cuda(r) -> tuple:
  s = r["stats"]
  if "error" in s:
    return (r["kernel"], r["format"], r["tokens"], r["config"], "-", "-", "-", "-", "-", "ERROR " + s["error"][:80])
  return (r["kernel"], r["format"], r["tokens"], r["config"], s["smem_bytes"], s["registers"],
          f"{s['spill_stores']}/{s['spill_loads']}", s["mma"], f"{s['compile_s']:.1f}",
          "; ".join(r["violations"]) or "ok")


def markdown(cols, rows) -> str:
  out = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
  out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
  return "\n".join(out)


def tables(rows) -> list[tuple[str, str]]:
  out = []
  for target in dict.fromkeys(r["target"] for r in rows):
    sel = [r for r in rows if r["target"] == target]
    if target.startswith("sm_"):
      title = f"{target} (CUDA config, recorded)"
      out.append((title, markdown(CUDA_COLS, [fmt_cuda(r) for r in sel])))
    else:
      title = f"{target} ({'gating' if sel[0]['gating'] else 'recorded, not gating'})"
      out.append((title, markdown(HIP_COLS, [fmt_hip(r) for r in sel])))
  return out


# ---- sweep ------------------------------------------------------------------------------------------------------

KNOBS = ("num_warps", "num_stages", "block_n", "block_k", "down_block_n", "down_block_k")


def sweep(tokens: int, fmts, arch: str, jobs: int, x_dtype="bfloat16") -> dict:
  """Configs that pass `arch` for every format at `tokens`. Varies num_warps (4/8 for row tiles ≤ 32, else 8/16),
  num_stages (1/2; 0 compiles like 1 in triton 3.9's own pipeline), gate/up and down N tiles (64/128) and K tiles
  (32/64); block_m, combine tiles and the rest stay at the shipped values. Each lowering builds gate_up and down
  with the same (n, k), and full configs pair any passing gate_up with any passing down of equal warps/stages."""
  base = lowering.moe_case("bf16", tokens, x_dtype=x_dtype).config
  bm = base.row_tile(tokens * lowering.V4_FLASH_MOE["top_k"], lowering.V4_FLASH_MOE["num_experts"])
  warps = sorted({*((4, 8) if bm <= 32 else (8, 16))})
  grid = list(itertools.product(warps, (1, 2), (64, 128), (32, 64)))
  work = []
  for fmt, (w, st, n, k) in itertools.product(fmts, grid):
    cfg = dataclasses.replace(base, num_warps=w, num_stages=st, block_n=n, block_k=k, down_block_n=n,
                              down_block_k=k)
    case = lowering.moe_case(fmt, tokens, config=cfg, x_dtype=x_dtype)
    for kern in lowering.lower_kernels(case.fn, case.args, "rocm"):
      work.append(((fmt, kern.name.removeprefix("moe_"), w, st, n, k), kern))
  t0 = time.perf_counter()
  stats = lowering.compile_many([(kern, arch) for _, kern in work], processes=jobs)
  print(f"sweep {tokens} tok: {len(work)} kernels compiled in {time.perf_counter() - t0:.0f} s", flush=True)
  res = {key: st for (key, _), st in zip(work, stats)}
  ok = lambda st: "error" not in st and not lowering.check(st)
  brief = lambda st: {k: st.get(k) for k in ("lds_bytes", "vgpr", "sgpr", "vgpr_spills", "sgpr_spills",
                                             "scratch_bytes", "occupancy", "wmma", "error")}
  candidates = []
  for w, st in itertools.product(warps, (1, 2)):
    for (gn, gk), (dn, dk) in itertools.product(itertools.product((64, 128), (32, 64)), repeat=2):
      per = {}
      for fmt in fmts:
        per[fmt] = dict(gate_up=res[(fmt, "gate_up", w, st, gn, gk)], down=res[(fmt, "down", w, st, dn, dk)],
                        combine=res[(fmt, "combine", w, st, gn, gk)])
      if not all(ok(s) for p in per.values() for s in p.values()):
        continue
      knobs = dict(num_warps=w, num_stages=st, block_n=gn, block_k=gk, down_block_n=dn, down_block_k=dk)
      changed = {k: v for k, v in knobs.items() if getattr(base, k) != v}
      min_occ = min(s["occupancy"] for p in per.values() for s in p.values())
      max_vgpr = max(s["vgpr"] for p in per.values() for s in p.values())
      candidates.append(dict(overrides=changed, knobs=knobs, min_occupancy=min_occ, max_vgpr=max_vgpr,
                             stats={f: {k: brief(s) for k, s in p.items()} for f, p in per.items()}))
  candidates.sort(key=lambda c: (len(c["overrides"]), -c["min_occupancy"],
                                 -(c["knobs"]["block_n"] * c["knobs"]["block_k"]
                                   + c["knobs"]["down_block_n"] * c["knobs"]["down_block_k"])))
  per_kernel = [dict(format=f, kernel=kn, num_warps=w, num_stages=st, block_n=n, block_k=k, **brief(s),
                     passes=ok(s)) for (f, kn, w, st, n, k), s in res.items()]
  shipped = {k: getattr(base, k) for k in KNOBS}
  return dict(tokens=tokens, arch=arch, row_tile=bm, shipped=shipped, passing_count=len(candidates),
              passing=candidates[:10], per_kernel=per_kernel)


def sweep_markdown(sw: dict, top: int = 6) -> str:
  head = (f"Shipped knobs: {sw['shipped']} (row tile {sw['row_tile']}). {sw['passing_count']} configurations pass "
          f"{sw['arch']} for every format; fewest changes first, then highest worst-case occupancy "
          "(no hardware timing: pick on the device; the JSON keeps the first 10 and every kernel compiled):")
  if not sw["passing"]:
    return head + "\n\n**No configuration in the sweep passes.**"
  fmts = list(sw["passing"][0]["stats"])
  cols = ("overrides", "min occ.", "max VGPR", *(f"{f}: gate_up/down VGPR, LDS B" for f in fmts))
  rows = []
  for c in sw["passing"][:top]:
    cells = [", ".join(f"{k}={v}" for k, v in c["overrides"].items()) or "(none)", c["min_occupancy"],
             c["max_vgpr"]]
    for s in c["stats"].values():
      cells.append(f"{s['gate_up']['vgpr']}/{s['down']['vgpr']}, {s['gate_up']['lds_bytes']}/"
                   f"{s['down']['lds_bytes']}")
    rows.append(cells)
  return head + "\n\n" + markdown(cols, rows)


# ---- main -------------------------------------------------------------------------------------------------------

def main(argv):
  del argv
  warnings.simplefilter("ignore", DeprecationWarning)  # every Pallas-Triton pallas_call warns
  try:
    import triton  # pylint: disable=import-outside-toplevel
  except ImportError:
    print(f"error: {lowering.INSTALL_HINT} — triton is not installed", file=sys.stderr)
    return 2
  t_start = time.perf_counter()
  arch, fmts, tokens = _ARCH.value, formats(_FORMATS.value), [int(t) for t in _TOKENS.value]
  targets = {"rocm": [arch, *[a for a in _RECORD_ARCH.value if a and a != arch]]}
  x_dtype = _X_DTYPE.value
  cases = [lowering.moe_case(f, t, "rocm", x_dtype=x_dtype) for t in tokens for f in fmts]
  if _ALSO_CUDA.value:
    targets["cuda"] = ["sm_90"]
    cases += [lowering.moe_case(f, t, "cuda", x_dtype=x_dtype) for t in tokens for f in fmts]
  print(f"lowering {len(cases)} cases ({', '.join(fmts)} × {tokens} tokens) for {targets}; "
        f"{_JOBS.value} compile processes", flush=True)
  rows = rows_for(cases, targets, _JOBS.value, gating=arch)
  failing = [r for r in rows if r["gating"] and r["violations"]]
  record = dict(check="lowering_gfx1151", env=run_record.environment(), triton=triton.__version__,
                shapes=lowering.V4_FLASH_MOE, activations=x_dtype, gating_arch=arch, targets=targets,
                lds_limit=lowering.LDS_LIMIT,
                configs={f"{c.platform} {c.tokens}": dataclasses.asdict(c.config) for c in cases if c.fmt == fmts[0]},
                rows=rows, failing=[dict(kernel=r["kernel"], format=r["format"], tokens=r["tokens"],
                                         config=r["config"], violations=r["violations"]) for r in failing])
  md = [f"# Offline lowering check: {arch} (gating)", "",
        f"`python -m experiments.lower_gfx1151` — jax {jax.__version__}, triton {triton.__version__}, "
        f"{record['env']['date']}, commit {record['env']['git_commit'][:10]}"
        f"{' (dirty)' if record['env']['git_dirty'] else ''}.",
        f"V4-Flash grouped MoE (D 4096, I 2048, E 256, top-6), {x_dtype} activations, shipped configs "
        "(`Config.default(..., platform=\"rocm\")`; CUDA rows: `platform=\"cuda\"`). Config: m = row tile (/cap), "
        "n/k = N/K tiles, w = warps, s = stages; combine: t/d = token/column tiles. LDS = Triton's dynamic LDS; "
        "occ. = waves per SIMD; spills V/S = VGPR/SGPR spill counts. Limits: LDS ≤ 65536 B, no VGPR spills, "
        "no scratch.", ""]
  for title, table in tables(rows):
    print(f"\n== {title}\n{table}")
    md += [f"## {title}", "", table, ""]
  record["check_seconds"] = round(time.perf_counter() - t_start, 1)
  if failing and _SWEEP.value:
    record["sweep"] = []
    md += [f"## Passing configurations for {arch} (sweep)", ""]
    for t in sorted({r["tokens"] for r in failing}, reverse=True):
      sw = sweep(t, fmts, arch, _JOBS.value, x_dtype)
      record["sweep"].append(sw)
      text = sweep_markdown(sw)
      print(f"\n== sweep, {t} tokens\n{text}")
      md += [f"### {t} tokens", "", text, ""]
  record["seconds"] = round(time.perf_counter() - t_start, 1)
  md += [f"Run time: {record['seconds']} s on {os.cpu_count()} CPU cores ({record['check_seconds']} s without the "
         "sweep)."]
  out = _OUT.value.removesuffix(".json").removesuffix(".md")
  run_record.write_json(out + ".json", record)
  with open(out + ".md", "w") as f:
    f.write("\n".join(md) + "\n")
  print(f"\nwrote {out}.json and {out}.md ({record['seconds']} s)")
  if failing:
    print(f"\nFAIL: {len(failing)} shipped {arch} kernel(s) break the limits (LDS ≤ {lowering.LDS_LIMIT} B, "
          "no VGPR spills, no scratch):", file=sys.stderr)
    for r in failing:
      print(f"  {r['kernel']} [{r['format']}, {r['tokens']} tokens, {r['config']}]: {'; '.join(r['violations'])}",
            file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  app.run(main)
