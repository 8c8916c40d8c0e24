"""Offline gfx1151 lowering check of every Pallas kernel ds4jax ships, at V4-Flash shapes (no GPU needed).

    python -m experiments.lower_gfx1151 [--kernels=moe,indexer,mla] [--arch=gfx1151] [--record_arch=gfx1150]
        [--also_cuda] [--tokens=8192,512] [--formats=all] [--sweep] [--out=experiments/results/lowering_gfx1151]

Lowers each kernel for an abstract ROCm device at the configuration ds4jax would ship there, compiles the Triton IR
with triton 3.9.0's HIP backend for `--arch` (gating) and `--record_arch` (recorded only), and with `--also_cuda`
lowers the CUDA configs and compiles them for sm_90 (recorded only). Covered (`--kernels`):

  moe      the grouped MoE (kernels_pallas/moe: gate_up, down, combine) at `--tokens` with
           `Config.default(..., platform=...)`, bf16 activations, bf16 and every quantized expert format
           (`--formats`); kernel names and grids are checked against `kernels_pallas.moe.plan`.
  indexer  `kernels_pallas.indexer.lowering_cases(platform)`: the lightning-indexer scoring kernel (through the
           production `topk` on an 8192-query chunk at 114688 and a direct `scores` call on 512 queries at 130560).
  mla      `kernels_pallas.mla.lowering_cases(platform)`: sparse MLA on the last 8192-query chunk of a 128K prefill —
           CSA streaming with f32 staging + fast exp and without staging, the grouped baseline (bf16 q/KV), both
           streaming variants with f32 q/KV, HCA and window streaming.

Each package case is (label, fn, args) at V4-Flash shapes with the config its `Config.default(..., platform=...)`
ships; the table's config column is the kernel's launch knobs (w = warps, s = stages, grid) and the JSON records
the package Configs. See kernels_pallas/lowering.py and docs/lowering.md §3. Writes OUT.json
and OUT.md and prints the tables.

Exits 1, naming kernel, case and config, when a shipped `--arch` kernel of any covered package needs more than
65,536 bytes of LDS, spills VGPRs, uses scratch or fails to compile. `--sweep` then searches block sizes / warps /
stages of the MoE for configurations that pass for every format at each failing token count (nothing is changed
in kernels_pallas; the result is a proposal; the attention and indexer kernels have no sweep here).
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
from kernels_pallas.moe import plan  # noqa: E402
from kernels_pallas.moe.quantized_weights import QUANTIZED_FORMATS  # noqa: E402

_ARCH = flags.DEFINE_string("arch", "gfx1151", "AMD target whose limits gate the run (exit 1 on a violation).")
_RECORD_ARCH = flags.DEFINE_list("record_arch", ["gfx1150"], "More AMD targets, recorded but not gating.")
_ALSO_CUDA = flags.DEFINE_bool("also_cuda", True, "Also lower the CUDA config and compile it for sm_90 (recorded).")
_TOKENS = flags.DEFINE_list("tokens", ["8192", "512"], "Prompt lengths (the adaptive row tile follows them).")
_PERSISTENT_TOKENS = flags.DEFINE_list("persistent_tokens", ["8192"],
                                        "Prompt lengths at which the persistent MoE grid is also checked (upstream "
                                        "runs it from 256 tokens).")
_KERNELS = flags.DEFINE_list("kernels", ["moe", *lowering.CASE_PACKAGES],
                              f"Kernel families to check: moe and/or {', '.join(lowering.CASE_PACKAGES)}.")
_FORMATS = flags.DEFINE_list("formats", ["all"], "Expert weight formats: 'all', or bf16 and quantized names.")
_SWEEP = flags.DEFINE_bool("sweep", False, "Search configs that pass --arch for every token count that fails.")
_X_DTYPE = flags.DEFINE_enum("x_dtype", "bfloat16", ["bfloat16", "float32"],
                              "Activation dtype (bf16: bf16 dots on WMMA; float32: exact f32 dots, no WMMA).")
_JOBS = flags.DEFINE_integer("jobs", os.cpu_count() or 1, "Compile processes.")
_OUT = run_record.define_out_flag(default="experiments/results/lowering_gfx1151",
                                  help_text="Output path prefix (.json and .md).")

# The leading columns name the kernel (MoE rows: format and tokens; package rows: the case label), then the stats.
LEAD_COLS = {"moe": ("kernel", "format", "tokens", "config"), "cases": ("kernel", "case", "config")}
HIP_COLS = ("LDS B", "VGPR/SGPR", "spills V/S", "scratch B", "occ.", "WMMA", "compile s", "status")
CUDA_COLS = ("smem B", "regs", "spill st/ld B", "MMA", "compile s", "status")


def formats(names) -> list[str]:
  if list(names) == ["all"]:
    return ["bf16", *QUANTIZED_FORMATS]
  bad = [n for n in names if n != "bf16" and n not in QUANTIZED_FORMATS]
  if bad:
    raise app.UsageError(f"unknown or unavailable formats {bad}; available: bf16, {', '.join(QUANTIZED_FORMATS)}")
  return list(names)


def lower_moe_case(case: lowering.Case):
  """Lowers an MoE case and checks its kernels against kernels_pallas.moe.plan (names and grids)."""
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


def lowered(case) -> list[tuple]:
  """(kernel, row fields) for each kernel of a case: an MoE `lowering.Case` (plan-checked, MoE config string) or
  a package `lowering.KernelCase` (generic: the kernel's launch knobs)."""
  if isinstance(case, lowering.Case):
    return [(k, dict(family="moe", case=case.label, format=case.fmt, tokens=case.tokens,
                     config=lowering.moe_kernel_config(k.name, case.config, case.tokens)))
            for k in lower_moe_case(case)]
  return [(k, dict(family=case.package, case=case.label, format=None, tokens=None,
                   config=lowering.kernel_config(k)))
          for k in lowering.lower_case(case)]


def rows_for(cases, targets, jobs: int, gating: str | None):
  """Lowers every case once per platform and compiles each kernel for each of its platform's targets (identical
  kernels once: e.g. ROCm's bf16-precision MLA kernels do not depend on the q/KV dtype)."""
  work = []
  for case in cases:
    kernels = lowered(case)
    for target in targets[case.platform]:
      for k, fields in kernels:
        work.append((k, target, fields))
  stats = lowering.compile_many([(k, t) for k, t, _ in work], processes=jobs)
  rows = []
  for (k, target, fields), st in zip(work, stats):
    violations = [st["error"]] if "error" in st else lowering.check(st)
    rows.append(dict(target=target, gating=target == gating, kernel=k.name, **fields, grid=list(k.grid),
                     stats=st, violations=violations))
  return rows


def group(r) -> str:
  return "moe" if r["family"] == "moe" else "cases"


def where(r) -> str:
  """The row's case and config, for messages."""
  if r["family"] == "moe":
    return f"{r['format']}, {r['tokens']} tokens, {r['config']}"
  return f"{r['case']}, {r['config']}"


def lead(r) -> tuple:
  if r["family"] == "moe":
    return (r["kernel"], r["format"], r["tokens"], r["config"])
  return (r["kernel"], r["case"], r["config"])


def fmt_hip(r) -> tuple:
  s = r["stats"]
  if "error" in s:
    return (*lead(r), "-", "-", "-", "-", "-", "-", "-", "ERROR " + s["error"][:80])
  return (*lead(r), s["lds_bytes"], f"{s['vgpr']}/{s['sgpr']}", f"{s['vgpr_spills']}/{s['sgpr_spills']}",
          s["scratch_bytes"], s["occupancy"], s["wmma"], f"{s['compile_s']:.1f}",
          "; ".join(r["violations"]) or "ok")


def fmt_cuda(r) -> tuple:
  s = r["stats"]
  if "error" in s:
    return (*lead(r), "-", "-", "-", "-", "-", "ERROR " + s["error"][:80])
  return (*lead(r), s["smem_bytes"], s["registers"], f"{s['spill_stores']}/{s['spill_loads']}", s["mma"],
          f"{s['compile_s']:.1f}", "; ".join(r["violations"]) or "ok")


def markdown(cols, rows) -> str:
  out = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
  out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
  return "\n".join(out)


PACKAGE_DOCS = {
    "indexer": "kernels_pallas/indexer: the scoring kernel (Hi 64, c 128, bf16 q/keys) via the production `topk` "
               "on 8192 queries at 114688 (R 30720) and a direct `scores` on 512 queries at 130560 (R 32768).",
    "mla": "kernels_pallas/mla: sparse MLA (H 64, D 512, window 128, rope 64) on the 8192-query chunk at 114688 — "
           "CSA (ratio 4, top-512) streaming with f32 staging + fast exp, streaming unstaged, the grouped "
           "baseline, both streaming variants again with f32 q/KV, then HCA (ratio 128) and window streaming. On "
           "ROCm the MLA precision is \"bf16\" (q/KV rounded once in XLA), so the f32 q/KV rows compile the same "
           "kernels as their bf16 rows.",
}
GROUP_TITLES = {"moe": "grouped MoE", "cases": "attention and indexer"}


def tables(rows) -> list[tuple[str, str]]:
  """One table per (target, group): the MoE and the package cases have different leading columns."""
  out = []
  for target, grp in dict.fromkeys((r["target"], group(r)) for r in rows):
    sel = [r for r in rows if r["target"] == target and group(r) == grp]
    if target.startswith("sm_"):
      title = f"{target} (CUDA config, recorded): {GROUP_TITLES[grp]}"
      out.append((title, markdown(LEAD_COLS[grp] + CUDA_COLS, [fmt_cuda(r) for r in sel])))
    else:
      title = f"{target} ({'gating' if sel[0]['gating'] else 'recorded, not gating'}): {GROUP_TITLES[grp]}"
      out.append((title, markdown(LEAD_COLS[grp] + HIP_COLS, [fmt_hip(r) for r in sel])))
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
  kinds = list(_KERNELS.value)
  bad = [k for k in kinds if k != "moe" and k not in lowering.CASE_PACKAGES]
  if bad or not kinds:
    raise app.UsageError(f"--kernels: unknown {bad or kinds}; expected some of moe, "
                         f"{', '.join(lowering.CASE_PACKAGES)}")
  packages = [k for k in lowering.CASE_PACKAGES if k in kinds]
  arch, fmts, tokens = _ARCH.value, formats(_FORMATS.value), [int(t) for t in _TOKENS.value]
  targets = {"rocm": [arch, *[a for a in _RECORD_ARCH.value if a and a != arch]]}
  if _ALSO_CUDA.value:
    targets["cuda"] = ["sm_90"]
  x_dtype = _X_DTYPE.value
  moe_cases = [lowering.moe_case(f, t, p, x_dtype=x_dtype) for p in targets for t in tokens for f in fmts
               if "moe" in kinds]
  moe_cases += [lowering.moe_case(f, int(t), p, x_dtype=x_dtype, persistent=True,
                                  num_cores=lowering.PERSISTENT_CORES[p])
                for p in targets for t in _PERSISTENT_TOKENS.value for f in fmts if "moe" in kinds]
  pkg_cases = [c for p in targets for c in lowering.package_cases(p, packages)]
  what = [f"{len(moe_cases)} MoE cases ({', '.join(fmts)} × {tokens} tokens)"] if moe_cases else []
  what += [f"{len(pkg_cases)} {'/'.join(packages)} cases"] if pkg_cases else []
  print(f"lowering {' and '.join(what)} for {targets}; {_JOBS.value} compile processes", flush=True)
  rows = rows_for(moe_cases + pkg_cases, targets, _JOBS.value, gating=arch)
  failing = [r for r in rows if r["gating"] and r["violations"]]
  shapes = {"moe": lowering.V4_FLASH_MOE} if moe_cases else {}
  shapes |= {p: lowering.package_shapes(p) for p in packages}
  configs = {f"moe {c.platform} {c.tokens}{' persistent' * c.config.persistent}": dataclasses.asdict(c.config)
             for c in moe_cases if c.fmt == fmts[0]}
  configs |= {f"{c.platform} {c.label}": c.configs() for c in pkg_cases}
  record = dict(check="lowering_gfx1151", env=run_record.environment(), triton=triton.__version__,
                kernels=kinds, shapes=shapes, activations=x_dtype, gating_arch=arch, targets=targets,
                lds_limit=lowering.LDS_LIMIT, configs=configs, rows=rows,
                failing=[dict(kernel=r["kernel"], family=r["family"], case=r["case"], format=r["format"],
                              tokens=r["tokens"], config=r["config"], violations=r["violations"]) for r in failing])
  md = [f"# Offline lowering check: {arch} (gating)", "",
        f"`python -m experiments.lower_gfx1151` — jax {jax.__version__}, triton {triton.__version__}, "
        f"{record['env']['date']}, commit {record['env']['git_commit'][:10]}"
        f"{' (dirty)' if record['env']['git_dirty'] else ''}. Every shipped kernel is lowered for an abstract GPU "
        "at the configuration `Config.default(..., platform=\"rocm\")` ships (CUDA rows: `platform=\"cuda\"`), "
        f"compiled with triton's HIP backend (wave32) for {', '.join(targets['rocm'])}"
        f"{' and its CUDA backend + ptxas for sm_90' if 'cuda' in targets else ''}; only {arch} gates. "
        "LDS = Triton's dynamic LDS; occ. = waves per SIMD; spills V/S = VGPR/SGPR spill counts. Limits: "
        f"LDS ≤ {lowering.LDS_LIMIT} B, no VGPR spills, no scratch (sm_90: smem ≤ {lowering.SMEM_LIMIT_SM90} B, "
        "no spills), for every kernel below.", ""]
  if moe_cases:
    md += [f"Grouped MoE (kernels_pallas/moe; names and grids checked against `moe.plan`): V4-Flash D 4096, "
           f"I 2048, E 256, top-6, {x_dtype} activations, {', '.join(fmts)} experts at {tokens} tokens. Config: "
           "m = row tile (/cap), n/k = N/K tiles, w = warps, s = stages; combine: t/d = token/column tiles.", ""]
  if pkg_cases:
    md += ["Attention and indexer (each package's `lowering_cases(platform)`): "
           + " ".join(PACKAGE_DOCS[p] for p in packages)
           + " Config = the kernel's launch knobs: w = warps, s = stages, grid; shipped package configs (also in "
           "the JSON's `configs`):", ""]
    shipped = {}
    for c in pkg_cases:
      for cfg in c.configs():
        knobs = ", ".join(f"{k}={v}" for k, v in cfg.items() if k != "type")
        shipped.setdefault((c.platform, c.package, knobs), []).append(c.label)
    md += [f"- {plat} {pkg}: `{knobs}` ({len(labels)} case{'s' * (len(labels) > 1)})"
           for (plat, pkg, knobs), labels in shipped.items()] + [""]
  for title, table in tables(rows):
    print(f"\n== {title}\n{table}")
    md += [f"## {title}", "", table, ""]
  record["check_seconds"] = round(time.perf_counter() - t_start, 1)
  moe_failing = [r for r in failing if r["family"] == "moe"]
  if moe_failing and _SWEEP.value:
    record["sweep"] = []
    md += [f"## Passing MoE configurations for {arch} (sweep)", ""]
    for t in sorted({r["tokens"] for r in moe_failing}, reverse=True):
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
          "no VGPR spills, no scratch) or fail to compile:", file=sys.stderr)
    for r in failing:
      print(f"  {r['kernel']} [{where(r)}]: {'; '.join(r['violations'])}", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  app.run(main)
