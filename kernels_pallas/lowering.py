"""Offline lowering check of Pallas-Triton kernels for AMD gfx1151 (and NVIDIA sm_90): no GPU needed.

    kernels = lower_kernels(fn, args, "rocm")                # one TritonKernel per pallas_call in fn
    for k in kernels:
      stats = compile_hip(k.ttir, "gfx1151", num_warps=k.num_warps, num_stages=k.num_stages)
      print(k.name, stats["lds_bytes"], stats["vgpr"], check(stats))   # check → [] when within limits

The recipe (docs/lowering.md §3):
  1. Lower `jax.jit(fn)` for an abstract GPU (`AbstractDevice(device_kind="gfx1151", platform="rocm")`); `args` are
     `jax.ShapeDtypeStruct`s, nothing is allocated.
  2. Every Pallas-Triton kernel is a `stablehlo.custom_call @__gpu$xla.gpu.triton` whose `mhlo.backend_config`
     holds `name`, `num_warps`, `num_stages`, `grid_x/y/z` and `ir`, the `tt`-dialect module as MLIR bytecode.
  3. The bytecode is re-printed as text with jaxlib's own MLIR (PyPI triton cannot read jaxlib's bytecode).
  4. triton 3.9.0 (the `lowering` extra) parses the text and runs ALL its stages from `make_ttir` (ttir → ttgir →
     llir → amdgcn → hsaco, or → ptx for CUDA). Starting after make_ttir, as `triton.compile("k.ttir")` does,
     skips the inliner/combine/CSE/LICM passes that XLA's pipeline runs and overstates spills.
  5. Numbers: LDS = `metadata["shared"]` (Triton's LDS is dynamic, so the code object's group segment is 0);
     VGPR/SGPR, spills, scratch (`.private_segment_fixed_size`), `; Occupancy:` (waves per SIMD) and the number of
     `v_wmma` instructions come from the amdgcn text. CUDA: registers, spill bytes and stack from `ptxas -v`
     (the wheel's ptxas), shared memory from `metadata["shared"]`, MMA count from the PTX.
  6. `check` applies the limits Triton does not enforce at compile time: LDS ≤ 64 KiB per workgroup on gfx11, no
     VGPR spills, no scratch.

Also here: `code_object_kernels` reads a code object's per-kernel resources (for XLA's output too,
experiments/compile_gfx1151.py, docs/lowering.md §5), and `contractions` / `unsafe_contractions` / `fma_instructions`
check that FMA fusion cannot change the in-kernel decode (`decode_case`; docs/lowering.md §6); `sass_cuda` /
`sass_loops` read what each loop of a kernel issues on sm_90 (experiments/sass_loops.py).

ds4jax's shipped kernels: `moe_case` (grouped MoE at V4-Flash shapes, any weight format) and `package_cases`
(the indexer and sparse MLA kernels, from each package's `lowering_cases(platform)`: (label, fn, args) with the
shipped `Config.default(..., platform=...)`); `lower_case` / `kernel_config` lower and describe the latter.
experiments/lower_gfx1151.py and tests/kernels_pallas/test_lowering_gfx1151.py check all of them.

This is a close proxy, not XLA's exact compiler: on the device XLA runs its vendored Triton with its own pipeline;
LDS should match closely, VGPR and spill counts may drift. Relies on JAX internals of jax/jaxlib 0.11.2.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import inspect
import json
import math
import os
import re
import struct
import subprocess
import tempfile
import time
import warnings
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp

from ds4jax.quant import formats
from kernels_pallas.moe import Config, moe
from kernels_pallas.moe.quantized_weights import QuantizedExpertWeights, dequantize_tiles

TRITON_VERSION = "3.9.0"
INSTALL_HINT = "pip install -e '.[lowering]'  (installs triton==3.9.0)"
CUSTOM_CALL = "__gpu$xla.gpu.triton"
LDS_LIMIT = 65536          # bytes of LDS per workgroup on gfx11 (RDNA3/3.5)
SMEM_LIMIT_SM90 = 232448   # 227 KiB: the opt-in dynamic shared memory per block on H100/H200
DEFAULT_DEVICE_KIND = {"rocm": "gfx1151", "cuda": "NVIDIA H200"}


class TritonKernel(NamedTuple):
  """One Pallas-Triton kernel as XLA would receive it."""
  name: str
  num_warps: int
  num_stages: int
  grid: tuple[int, int, int]
  ttir: str                # the tt-dialect module as text (parseable by triton 3.9.0)


# ---- triton import ----------------------------------------------------------------------------------------------

def _triton():
  """Imports triton, with a clear error when the `lowering` extra is missing."""
  os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's default; silences a warning
  try:
    import triton  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ImportError(f"the offline lowering check needs triton=={TRITON_VERSION}, which is not installed: "
                      f"{INSTALL_HINT}") from e
  if triton.__version__ != TRITON_VERSION:
    warnings.warn(f"the lowering check was validated with triton=={TRITON_VERSION}, found {triton.__version__}; "
                  f"numbers may differ ({INSTALL_HINT})", stacklevel=3)
  return triton


def triton_available() -> bool:
  try:
    _triton()
  except ImportError:
    return False
  return True


# ---- step 1-3: lower and extract ---------------------------------------------------------------------------------

def lower_kernels(fn: Callable, args: Sequence[Any], platform: str, *, device_kind: str | None = None,
                  kwargs: dict | None = None) -> list[TritonKernel]:
  """Lowers `jax.jit(fn)(*args)` for an abstract `platform` GPU ("rocm" or "cuda") and returns its Pallas-Triton
  kernels in program order. `args` may be ShapeDtypeStructs. `device_kind` defaults to "gfx1151" (ROCm: the
  gfx name, a marketing name fails) or "NVIDIA H200" (CUDA). The ROCm lowering does not depend on the gfx arch;
  compilation does (pass the arch to `compile_hip`)."""
  from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh  # pylint: disable=import-outside-toplevel

  if platform not in DEFAULT_DEVICE_KIND:
    raise ValueError(f"platform must be 'rocm' or 'cuda', got {platform!r}")
  kind = device_kind or DEFAULT_DEVICE_KIND[platform]
  mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(device_kind=kind, num_cores=None,
                                                                   platform=platform))
  jitted = fn if hasattr(fn, "trace") else jax.jit(fn)
  with use_abstract_mesh(mesh):
    lowered = jitted.trace(*args, **(kwargs or {})).lower(lowering_platforms=(platform,))
  return kernels_of(lowered.compiler_ir("stablehlo"))


def _walk(op, out: list) -> None:
  for region in op.regions:
    for block in region.blocks:
      for child in block.operations:
        o = child.operation
        if o.name == "stablehlo.custom_call" and "call_target_name" in o.attributes:
          if o.attributes["call_target_name"].value == CUSTOM_CALL:
            out.append(o)
        _walk(o, out)


def _int(attr) -> int:
  return int(attr.value)


def kernels_of(module) -> list[TritonKernel]:
  """The Triton kernels of a lowered StableHLO module (jaxlib `ir.Module`)."""
  calls: list = []
  _walk(module.operation, calls)
  kernels = []
  for op in calls:
    cfg = op.attributes["mhlo.backend_config"]
    kernels.append(TritonKernel(
        name=cfg["name"].value, num_warps=_int(cfg["num_warps"]), num_stages=_int(cfg["num_stages"]),
        grid=(_int(cfg["grid_x"]), _int(cfg["grid_y"]), _int(cfg["grid_z"])),
        ttir=bytecode_to_text(cfg["ir"].value_bytes)))
  return kernels


def bytecode_to_text(data: bytes) -> str:
  """jaxlib's tt-dialect MLIR bytecode → text (without debug locations), via jaxlib's MLIR.

  jaxlib's MLIR does not register the `gpu` dialect, yet `plt.debug_barrier()` lowers to `gpu.barrier` (the
  grouped MLA kernel, between its score and value passes). It is parsed as an unregistered op, printed in generic
  form (`"gpu.barrier"() : () -> ()`) and rewritten to the custom form, which triton 3.9.0 (it registers `gpu`)
  parses."""
  from jax._src.lib.mlir import ir  # pylint: disable=import-outside-toplevel
  from jaxlib.triton import dialect  # pylint: disable=import-outside-toplevel

  with ir.Context() as ctx:
    dialect.register_dialect(ctx)
    ctx.allow_unregistered_dialects = True
    module = ir.Module.parse(data)
    text = module.operation.get_asm(enable_debug_info=False)
  return _GENERIC_BARRIER.sub("gpu.barrier", text)


_GENERIC_BARRIER = re.compile(r'"gpu\.barrier"\(\)[^\n]*')


# ---- step 4-5: compile ------------------------------------------------------------------------------------------

def _run_stages(ttir: str, target, opts: dict, *, stop_after: str | None = None):
  """Parses `ttir` with triton and runs every stage of the backend from make_ttir on. Returns (stage outputs,
  metadata, seconds)."""
  _triton()
  # pylint: disable=import-outside-toplevel
  from triton._C.libtriton import ir as tir
  from triton.backends.compiler import Language
  from triton.compiler.compiler import make_backend

  backend = make_backend(target)
  options = backend.parse_options(dict(opts))
  ctx = tir.context()
  tir.load_dialects(ctx)
  backend.load_dialects(ctx)
  t0 = time.perf_counter()
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "kernel.ttir")
    with open(path, "w") as f:
      f.write(ttir)
    module = tir.parse_mlir_module(path, ctx)
  module.context = ctx
  stages: dict = {}
  backend.add_stages(stages, options, Language.TRITON)
  metadata = {"hash": "offline", "target": target, **options.__dict__}
  out = {}
  src = module
  for ext, stage in stages.items():
    src = stage(src, metadata)
    out[ext] = src
    if ext == stop_after:
      break
  return out, metadata, time.perf_counter() - t0


def _field(text: str, key: str) -> int | None:
  m = re.search(rf"^\s*{re.escape(key)}:\s*(\d+)", text, re.M)
  return int(m.group(1)) if m else None


def compile_hip(ttir: str, arch: str = "gfx1151", num_warps: int = 4, num_stages: int = 1, *,
                keep_asm: bool = False) -> dict:
  """Compiles tt-dialect text to an AMD code object with triton's HIP backend (wave32 on gfx ≥ 10) and returns
  lds_bytes, vgpr, sgpr, vgpr_spills, sgpr_spills, scratch_bytes, occupancy (waves/SIMD), wmma (count of v_wmma
  instructions), compile_s (+ "amdgcn", "llir" and the code object "hsaco" when keep_asm)."""
  _triton()
  from triton.backends.compiler import GPUTarget  # pylint: disable=import-outside-toplevel

  warp = 64 if arch.startswith("gfx9") else 32
  out, md, secs = _run_stages(ttir, GPUTarget("hip", arch, warp), dict(num_warps=num_warps, num_stages=num_stages))
  asm = out["amdgcn"]
  occ = re.search(r";\s*Occupancy:\s*(\d+)", asm)
  stats = dict(backend="hip", arch=arch, name=md.get("name"), num_warps=num_warps, num_stages=num_stages,
               lds_bytes=int(md["shared"] or 0), vgpr=_field(asm, ".vgpr_count"), sgpr=_field(asm, ".sgpr_count"),
               vgpr_spills=_field(asm, ".vgpr_spill_count") or 0, sgpr_spills=_field(asm, ".sgpr_spill_count") or 0,
               scratch_bytes=_field(asm, ".private_segment_fixed_size") or 0,
               occupancy=int(occ.group(1)) if occ else None,
               wmma=len(re.findall(r"^\s*v_wmma_", asm, re.M)), hsaco_bytes=len(out["hsaco"]),
               compile_s=round(secs, 3))
  if keep_asm:
    stats.update(amdgcn=asm, llir=out["llir"], hsaco=out["hsaco"])
  return stats


def llvm_ir(ttir: str, target: str = "gfx1151", num_warps: int = 4, num_stages: int = 1) -> str:
  """The LLVM module (Triton's `llir` stage, after its O3 pipeline) that the backend turns into code for `target`
  ("gfx…" or "sm_<cap>"): where FMA contraction candidates are visible before instruction selection fuses them."""
  _triton()
  from triton.backends.compiler import GPUTarget  # pylint: disable=import-outside-toplevel

  gpu = GPUTarget("cuda", int(target[3:]), 32) if target.startswith("sm_") else GPUTarget(
      "hip", target, 64 if target.startswith("gfx9") else 32)
  out, _, _ = _run_stages(ttir, gpu, dict(num_warps=num_warps, num_stages=num_stages), stop_after="llir")
  return out["llir"]


def compile_cuda(ttir: str, capability: int = 90, num_warps: int = 4, num_stages: int = 3, *,
                 keep_asm: bool = False) -> dict:
  """Compiles tt-dialect text to PTX with triton's CUDA backend and runs the wheel's `ptxas -v` for sm_<cap>(a).
  Returns smem_bytes, registers, spill_stores/spill_loads (bytes), stack_bytes, mma (count of mma/wgmma
  instructions in the PTX), compile_s (+ "ptx" and "llir" when keep_asm)."""
  _triton()
  # pylint: disable=import-outside-toplevel
  from triton.backends.compiler import GPUTarget
  from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

  out, md, secs = _run_stages(ttir, GPUTarget("cuda", capability, 32),
                              dict(num_warps=num_warps, num_stages=num_stages), stop_after="ptx")
  ptx = out["ptx"]
  t0 = time.perf_counter()
  with tempfile.TemporaryDirectory() as tmp:
    src = os.path.join(tmp, "kernel.ptx")
    with open(src, "w") as f:
      f.write(ptx)
    cmd = [get_ptxas(capability).path, "-v", f"--gpu-name={sm_arch_from_capability(capability)}", src,
           "-o", os.path.join(tmp, "kernel.cubin")]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
  if res.returncode:
    raise RuntimeError(f"ptxas failed ({res.returncode}) on kernel {md.get('name')}:\n{res.stderr[-4000:]}")
  log = res.stderr + res.stdout
  grab = lambda pat: int(m.group(1)) if (m := re.search(pat, log)) else 0
  stats = dict(backend="cuda", arch=f"sm_{capability}", name=md.get("name"), num_warps=num_warps,
               num_stages=num_stages, smem_bytes=int(md["shared"] or 0),
               registers=grab(r"Used (\d+) registers"), spill_stores=grab(r"(\d+) bytes spill stores"),
               spill_loads=grab(r"(\d+) bytes spill loads"), stack_bytes=grab(r"(\d+) bytes stack frame"),
               mma=len(re.findall(r"^\s*(?:wgmma\.mma_async|mma\.sync)", ptx, re.M)),
               compile_s=round(secs + time.perf_counter() - t0, 3))
  if keep_asm:
    stats.update(ptx=ptx, llir=out["llir"])
  return stats


def sass_cuda(ttir: str, capability: int = 90, num_warps: int = 4, num_stages: int = 3) -> str:
  """The kernel's SASS for sm_<cap>a, annotated with TTIR line numbers (`//## File "kernel.ttir", line N`): the PTX
  of `compile_cuda` through Triton's own ptxas (`-lineinfo`) and the wheel's nvdisasm."""
  _triton()
  # pylint: disable=import-outside-toplevel
  from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

  ptxas = get_ptxas(capability).path
  ptx = compile_cuda(ttir, capability, num_warps, num_stages, keep_asm=True)["ptx"]
  with tempfile.TemporaryDirectory() as tmp:
    src, obj = os.path.join(tmp, "kernel.ptx"), os.path.join(tmp, "kernel.cubin")
    with open(src, "w") as f:
      f.write(ptx)
    subprocess.run([ptxas, "-lineinfo", f"--gpu-name={sm_arch_from_capability(capability)}", src, "-o", obj],
                   capture_output=True, text=True, check=True)
    res = subprocess.run([os.path.join(os.path.dirname(ptxas), "nvdisasm"), "-c", "-g", obj],
                         capture_output=True, text=True, check=True)
  return res.stdout


# SASS opcodes that say where a loop's time can go: tensor-core MMAs, waits on them, CTA barriers and memory fences,
# spills (local memory), exponentials, shared-memory traffic
SASS_OPS = ("HGMMA", "WARPGROUP.DEPBAR", "BAR.SYNC", "MEMBAR", "LDL", "STL", "MUFU.EX2", "LDS", "STS")


def sass_loops(sass: str) -> list[dict]:
  """Each loop of a SASS listing (a label and a branch back to it): its instruction count and the count of each
  SASS_OPS opcode (a prefix match, e.g. `LDS` counts LDS.128 and not LDSM), largest loop first."""
  lines = sass.splitlines()
  label_at = {m.group(1): i for i, l in enumerate(lines) if (m := re.match(r"(\.L_x_\d+):", l))}
  loops = []
  for i, line in enumerate(lines):
    m = re.search(r"BRA `\((\.L_x_\d+)\)", line)
    if not m or label_at.get(m.group(1), i) >= i:
      continue
    ops = [re.sub(r"^(@!?U?P\w+\s+)", "", x.split("*/", 1)[1].strip()) for x in lines[label_at[m.group(1)]:i + 1]
           if re.match(r"\s*/\*[0-9a-f]+\*/", x)]
    counts = {op: sum(1 for o in ops if re.match(rf"{re.escape(op)}(\.|\s|;)", o)) for op in SASS_OPS}
    if len(ops) > 1:  # not the branch-to-self that ends a kernel
      loops.append(dict(label=m.group(1), instructions=len(ops), **counts))
  return sorted(loops, key=lambda d: -d["instructions"])


# ---- step 6: limits ---------------------------------------------------------------------------------------------

def check(stats: dict, lds_limit: int = LDS_LIMIT, smem_limit: int = SMEM_LIMIT_SM90) -> list[str]:
  """The limit violations of one compiled kernel ([] when within limits). HIP: LDS > lds_limit (Triton does not
  reject it; the runtime refuses to launch), VGPR spills > 0, scratch > 0. CUDA: shared memory > smem_limit,
  spill bytes > 0."""
  v = []
  if stats.get("backend") == "cuda":
    if stats["smem_bytes"] > smem_limit:
      v.append(f"shared memory {stats['smem_bytes']} B > {smem_limit} B")
    if stats["spill_stores"] or stats["spill_loads"]:
      v.append(f"register spills: {stats['spill_stores']} B stored / {stats['spill_loads']} B loaded")
    return v
  if stats["lds_bytes"] > lds_limit:
    v.append(f"LDS {stats['lds_bytes']} B > {lds_limit} B")
  if stats["vgpr_spills"]:
    v.append(f"{stats['vgpr_spills']} VGPR spills")
  if stats["scratch_bytes"]:
    v.append(f"{stats['scratch_bytes']} B scratch")
  return v


# ---- batch compilation ------------------------------------------------------------------------------------------

def compile_kernel(kernel: TritonKernel, target: str) -> dict:
  """Compiles one kernel for `target` ("gfx1151", "gfx1150", …, or "sm_90") with its own warps/stages; an error
  is returned as {"error": ...} rather than raised (one bad kernel must not hide the others)."""
  try:
    if target.startswith("sm_"):
      return compile_cuda(kernel.ttir, int(target[3:]), num_warps=kernel.num_warps, num_stages=kernel.num_stages)
    return compile_hip(kernel.ttir, target, num_warps=kernel.num_warps, num_stages=kernel.num_stages)
  except Exception as e:  # pylint: disable=broad-except
    return dict(backend="cuda" if target.startswith("sm_") else "hip", arch=target, name=kernel.name,
                error=f"{type(e).__name__}: {e}"[:2000])


def _compile_job(job):
  kernel, target = job
  return compile_kernel(kernel, target)


def job_digest(job: tuple[TritonKernel, str]) -> str:
  """What a compile's result depends on: the kernel's Triton IR, warps, stages, the target and triton's version."""
  kernel, target = job
  text = f"{TRITON_VERSION}|{target}|{kernel.num_warps}|{kernel.num_stages}|{kernel.ttir}"
  return hashlib.sha256(text.encode()).hexdigest()


def compile_many(jobs: Sequence[tuple[TritonKernel, str]], processes: int = 1, cache: str | None = None,
                 prune: bool = False) -> list[dict]:
  """`compile_kernel` over (kernel, target) pairs, in `processes` spawned worker processes (triton compiles are
  single-threaded; each takes ~0.1–20 s and ~300 MB). Identical (module, target, warps, stages) jobs are compiled
  once. Workers are spawned, so a calling script needs the usual `if __name__ == "__main__":` guard.

  `cache`: a JSON file of earlier results by `job_digest` (a compile is a pure function of what the digest covers);
  jobs found there are not compiled again, and new results (errors excepted) are added to it; with `prune` the file
  keeps only these jobs' results (the entries of kernels that changed since are dropped)."""
  _triton()
  stored = {}
  if cache and os.path.exists(cache):
    with open(cache) as f:
      stored = json.load(f)
  todo = list({job_digest(j): j for j in jobs if job_digest(j) not in stored}.items())
  if processes > 1 and len(todo) > 1:
    import concurrent.futures  # pylint: disable=import-outside-toplevel
    import multiprocessing  # pylint: disable=import-outside-toplevel
    with concurrent.futures.ProcessPoolExecutor(min(processes, len(todo)),
                                                mp_context=multiprocessing.get_context("spawn")) as pool:
      results = list(pool.map(_compile_job, [j for _, j in todo]))
  else:
    results = [_compile_job(j) for _, j in todo]
  done = stored | {d: r for (d, _), r in zip(todo, results)}
  used = {job_digest(j) for j in jobs}
  if cache and (todo or (prune and set(stored) - used)):
    keep = stored | {d: r for (d, _), r in zip(todo, results) if "error" not in r}
    keep = {d: r for d, r in keep.items() if d in used} if prune else keep
    with open(cache, "w") as f:
      json.dump(dict(sorted(keep.items())), f, indent=0)
  return [dict(done[job_digest(j)], name=j[0].name, cached=job_digest(j) in stored) for j in jobs]


# ---- ds4jax's shipped kernels -----------------------------------------------------------------------------------

# Kernel packages that list their shipped kernels themselves: `lowering_cases(platform)` → [(label, fn, args)] at
# V4-Flash shapes with the config their `Config.default(..., platform=platform)` ships. The grouped MoE has its
# own, plan-checked path below (`moe_case`).
CASE_PACKAGES = ("indexer", "mla")


class KernelCase(NamedTuple):
  """One (label, fn, args) of a package's `lowering_cases(platform)`."""
  package: str             # "indexer" | "mla"
  label: str               # e.g. "mla csa grouped bf16 8192 q @ 114688" (without the platform)
  platform: str            # "rocm" | "cuda"
  fn: Callable
  args: tuple

  def configs(self) -> list[dict]:
    """The package Configs `fn` closes over (as dicts; recorded, best effort): the knobs behind its kernels."""
    return [dict(dataclasses.asdict(v), type=f"{type(v).__module__}.{type(v).__qualname__}")
            for v in _bound_values(self.fn) if dataclasses.is_dataclass(v) and type(v).__name__ == "Config"]


def _bound_values(fn) -> list:
  seen = [*(fn.__defaults__ or ()), *inspect.getclosurevars(fn).nonlocals.values()]
  return list({id(v): v for v in seen}.values())


def package_cases(platform: str, packages: Sequence[str] = CASE_PACKAGES) -> list[KernelCase]:
  """Every `kernels_pallas.<package>.lowering_cases(platform)` case, in package order."""
  if platform not in DEFAULT_DEVICE_KIND:
    raise ValueError(f"platform must be 'rocm' or 'cuda', got {platform!r}")
  unknown = [p for p in packages if p not in CASE_PACKAGES]
  if unknown:
    raise ValueError(f"unknown kernel packages {unknown}; expected some of {CASE_PACKAGES}")
  cases = []
  for package in packages:
    module = importlib.import_module(f"kernels_pallas.{package}")
    for label, fn, args in module.lowering_cases(platform):
      cases.append(KernelCase(package, label.removesuffix(f" {platform}"), platform, fn, tuple(args)))
  return cases


def package_shapes(package: str) -> dict:
  """The V4-Flash shapes a package's cases use (`kernels_pallas.<package>.V4_FLASH_<PACKAGE>`)."""
  return dict(getattr(importlib.import_module(f"kernels_pallas.{package}"), f"V4_FLASH_{package.upper()}"))


def lower_case(case: KernelCase) -> list[TritonKernel]:
  """The kernels of one package case; a case without any Pallas-Triton kernel is an error (it would pass the
  check vacuously)."""
  kernels = lower_kernels(case.fn, case.args, case.platform)
  if not kernels:
    raise RuntimeError(f"{case.package} case {case.label!r} ({case.platform}) lowers to no Pallas-Triton kernel")
  return kernels


def kernel_config(kernel: TritonKernel) -> str:
  """The launch knobs every Pallas-Triton kernel carries, e.g. 'w8 s1 grid 8192×4'."""
  grid = "×".join(str(g) for g in (kernel.grid[:2] if kernel.grid[2] == 1 else kernel.grid))
  return f"w{kernel.num_warps} s{kernel.num_stages} grid {grid}"


# V4-Flash routed experts (ds4jax.config.v4_flash): hidden 4096, expert intermediate 2048, 256 experts, top-6.
V4_FLASH_MOE = dict(hidden=4096, intermediate=2048, num_experts=256, top_k=6)
# Cores that size the persistent MoE grid offline (on a device, its own core_count): gfx1151's Radeon 8060S has 40
# CUs, the H200 132 SMs.
PERSISTENT_CORES = {"rocm": 40, "cuda": 132}


class Case(NamedTuple):
  """A jittable function whose Pallas kernels ds4jax would launch, with abstract arguments."""
  label: str               # e.g. "moe bf16 8192 tok"
  fmt: str                 # weight format
  tokens: int
  platform: str            # "rocm" | "cuda"
  config: Any              # kernels_pallas.moe.Config
  fn: Callable
  args: tuple


def moe_case(fmt: str = "bf16", tokens: int = 8192, platform: str = "rocm", *, config=None,
             x_dtype=None, shapes: dict | None = None, **config_overrides) -> Case:
  """The grouped MoE (kernels_pallas/moe `moe`: gate_up, down, combine) at V4-Flash shapes with `fmt` expert
  weights ("bf16" or a quantized format of kernels_pallas.moe.quantized_weights), bf16 activations and the shared
  expert's output precomputed (as ds4jax.moe passes it). `config=None` takes what ds4jax would ship for the
  platform: `Config.default(..., platform=...)` (+ `config_overrides`)."""
  s = dict(V4_FLASH_MOE, **(shapes or {}))
  S, K, E, D, I = tokens, s["top_k"], s["num_experts"], s["hidden"], s["intermediate"]
  x_dtype = jnp.dtype(x_dtype or jnp.bfloat16)
  if config is None:
    config = Config.default(num_tokens=S, top_k=K, num_experts=E, hidden=D, intermediate=I, dtype=x_dtype,
                            platform=platform, **config_overrides)
  sds = jax.ShapeDtypeStruct
  if fmt == "bf16":
    w13, w2 = sds((E, I, D), jnp.bfloat16), sds((E, D, I), jnp.bfloat16)
    wrap = lambda w, shape: w
  else:
    storage = lambda shape: {n: sds(sh, dt) for n, (sh, dt) in formats.get(fmt).storage(shape).items()}
    w13, w2 = storage((E, I, D)), storage((E, D, I))
    wrap = lambda w, shape: QuantizedExpertWeights.from_storage(fmt, w, shape)

  def fn(x, route_weights, route_ids, w1, w2_, w3, shared):
    return moe(x, route_weights, route_ids, wrap(w1, (E, I, D)), wrap(w2_, (E, D, I)), wrap(w3, (E, I, D)),
               swiglu_limit=10.0, shared=shared, config=config, validate_routes=False)

  args = (sds((S, D), x_dtype), sds((S, K), jnp.float32), sds((S, K), jnp.int32), w13, w2, w13,
          sds((S, D), jnp.float32))
  return Case(f"moe {fmt} {S} tok" + (" persistent" if config.persistent else ""), fmt, S, platform, config, fn, args)


def moe_kernel_config(kernel_name: str, config, tokens: int, shapes: dict | None = None) -> str:
  """The knobs one MoE kernel was built with, e.g. 'm128 n128 k64 w8 s1' (m = the row tile actually used,
  the adaptive tile capped at block_m)."""
  s = dict(V4_FLASH_MOE, **(shapes or {}))
  bm = config.row_tile(tokens * s["top_k"], s["num_experts"])
  cap = "" if bm == config.block_m else f"/{config.block_m}"
  if "gate_up" in kernel_name:
    return f"m{bm}{cap} n{config.block_n} k{config.block_k} w{config.num_warps} s{config.num_stages}"
  if "down" in kernel_name:
    return f"m{bm}{cap} n{config.down_bn} k{config.down_bk} w{config.num_warps} s{config.num_stages}"
  if "combine" in kernel_name:
    return f"t{config.combine_block_t} d{config.combine_block_d} w{config.num_warps} s1"
  return f"w{config.num_warps} s{config.num_stages}"


# ---- code objects: what a compiled AMD kernel needs ---------------------------------------------------------------

def _elf_sections(data: bytes) -> dict[str, tuple[int, int]]:
  """{section name: (file offset, size)} of a little-endian ELF64 file."""
  if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
    raise ValueError("not a little-endian ELF64 code object")
  shoff, = struct.unpack_from("<Q", data, 0x28)
  entsize, count, names = struct.unpack_from("<HHH", data, 0x3A)
  headers = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * entsize) for i in range(count)]
  table = headers[names][4]
  name = lambda off: data[table + off:data.index(b"\0", table + off)].decode()
  return {name(h[0]): (h[4], h[5]) for h in headers}


def _amdgpu_metadata(data: bytes, note: tuple[int, int]) -> dict:
  """The msgpack map of the NT_AMDGPU_METADATA (type 32) note: per-kernel resource usage, as the loader reads it."""
  import msgpack  # pylint: disable=import-outside-toplevel  (a flax dependency; only code-object readers need it)

  pos, end = note[0], note[0] + note[1]
  while pos < end:
    name_size, desc_size, kind = struct.unpack_from("<III", data, pos)
    desc = pos + 12 + ((name_size + 3) & ~3)
    if kind == 32:
      return msgpack.unpackb(data[desc:desc + desc_size], strict_map_key=False)
    pos = desc + ((desc_size + 3) & ~3)
  raise ValueError("code object has no AMDGPU metadata note")


def _function_sizes(data: bytes, sections: dict) -> dict[str, int]:
  """{function symbol: bytes of machine code} from .symtab (Elf64_Sym: name, info, other, shndx, value, size)."""
  (symtab, size), (strtab, _) = sections[".symtab"], sections[".strtab"]
  out = {}
  for pos in range(symtab, symtab + size, 24):
    name, info, _, _, _, nbytes = struct.unpack_from("<IBBHQQ", data, pos)
    if info & 0xF == 2:  # STT_FUNC
      out[data[strtab + name:data.index(b"\0", strtab + name)].decode()] = nbytes
  return out


def code_object_kernels(hsaco: bytes) -> list[dict]:
  """The kernels of an AMD code object (HSACO) with what the loader sees: name, arch, vgpr, sgpr, vgpr_spills,
  sgpr_spills, static LDS (`.group_segment_fixed_size`; Triton's LDS is dynamic, given at launch), scratch
  (`.private_segment_fixed_size`), workgroup (max flat size), wavefront and code_bytes (the kernel's .text symbol).
  Works on any compiler's output (triton's here, XLA's in experiments/compile_gfx1151.py)."""
  sections = _elf_sections(hsaco)
  meta = _amdgpu_metadata(hsaco, sections[".note"])
  sizes = _function_sizes(hsaco, sections)
  arch = str(meta.get("amdhsa.target", "")).rsplit("-", 1)[-1]
  return [dict(name=k[".name"], arch=arch, vgpr=k[".vgpr_count"], sgpr=k[".sgpr_count"],
               vgpr_spills=k.get(".vgpr_spill_count", 0), sgpr_spills=k.get(".sgpr_spill_count", 0),
               lds_static=k[".group_segment_fixed_size"], scratch_bytes=k[".private_segment_fixed_size"],
               workgroup=k[".max_flat_workgroup_size"], wavefront=k[".wavefront_size"],
               code_bytes=sizes.get(k[".name"], 0))
          for k in meta["amdhsa.kernels"]]


# ---- FMA contraction of the in-kernel decode (docs/lowering.md §6) -----------------------------------------------

# With fp fusion on (TRITON_DEFAULT_FP_FUSION=1; ptxas --fmad=true), the backends may fuse an fmul whose result
# feeds an fadd/fsub into one FMA: round(a·b + c) instead of round(round(a·b) + c). The two differ only when a·b is
# not exactly representable, so a contraction is harmless exactly when its product is exact. `contractions` finds
# every such candidate in the LLVM IR a kernel is compiled from and proves exactness where it can, from a bound on
# each value's significand and binary exponent; what it cannot prove is reported as unsafe.

FMA_INSTRUCTIONS = re.compile(r"^\s*(v_fma\w*|v_fmac\w*|v_mad\w*|v_pk_fma\w*|v_dual_fmac\w*|fma\.rn\.f32|"
                              r"fma\.rn\.ftz\.f32)\b", re.M)
# float32: smallest subnormal 2^-149, values below 2^128, 24-bit significand
_F32_MIN_EXP, _F32_MAX_EXP, _F32_BITS = -149, 127, 24


class Sig(NamedTuple):
  """Every value is 0 or ±m·2^e with an integer m < 2^bits and e in [lo, hi]."""
  bits: int
  lo: int
  hi: int

  def exact(self) -> bool:
    return self.bits <= _F32_BITS and self.lo >= _F32_MIN_EXP and self.hi + self.bits <= _F32_MAX_EXP + 1


_ANY = Sig(_F32_BITS, _F32_MIN_EXP, _F32_MAX_EXP - _F32_BITS + 1)  # any finite float32
_FORMAT_SIG = {"half": Sig(11, -24, 5), "bfloat": Sig(8, -133, 120), "float": _ANY}


class Contraction(NamedTuple):
  """An fmul feeding an fadd/fsub (or an explicit llvm.fma / llvm.fmuladd): the backend may fuse it."""
  product: str         # the fmul (or fma call) instruction
  use: str             # the fadd/fsub that consumes it
  sig: Sig             # bound on the exact product
  exact: bool          # exact product: fusing it cannot change any result


def _union(sigs) -> Sig:
  sigs = [s for s in sigs if s is not None]
  if not sigs:
    return _ANY
  return Sig(max(s.bits for s in sigs), min(s.lo for s in sigs), max(s.hi for s in sigs))


def _product(a: Sig, b: Sig) -> Sig:
  # A power of two (one significant bit) leaves the other significand as it is.
  bits = max(a.bits, b.bits) if min(a.bits, b.bits) <= 1 else a.bits + b.bits
  return Sig(bits, a.lo + b.lo, a.hi + b.hi)


def _rounded(s: Sig) -> Sig:
  """What an operation whose exact result is `s` yields after rounding to float32."""
  if s.exact():
    return s
  lo = max(s.lo, _F32_MIN_EXP)
  return Sig(min(s.bits, _F32_BITS), lo, max(lo, min(s.hi + max(s.bits - _F32_BITS, 0), _ANY.hi)))


def _sum(a: Sig, b: Sig) -> Sig:
  lo = min(a.lo, b.lo)
  return Sig(max(a.hi + a.bits, b.hi + b.bits) - lo + 1, lo, lo)


def _float_sig(x: float) -> Sig | None:
  if x != x or x in (float("inf"), float("-inf")):
    return None
  if x == 0:
    return Sig(0, 0, 0)
  m, e = math.frexp(abs(x))  # x = m · 2^e, 0.5 ≤ m < 1
  m, e = int(m * 2**53), e - 53
  while m % 2 == 0:
    m, e = m // 2, e + 1
  return Sig(m.bit_length(), e, e)


_LLVM_FLOAT = re.compile(r"(?:float|half|bfloat|double)\s+(0x[0-9A-Fa-f]{16}|[-+]?[\d.]+(?:e[-+]?\d+)?)")
_INT_CONST = re.compile(r"^(?:splat \()?(?:i\d+ )?(-?\d+)\)?$")


def _parse_float(tok: str) -> float:
  if tok.startswith("0x"):
    return struct.unpack(">d", bytes.fromhex(tok[2:]))[0]
  return float(tok)


def _constant_sig(operand: str) -> Sig | None:
  """Sig of a float constant operand (scalar, splat, vector, zeroinitializer), None if it is not one."""
  op = operand.strip()
  if op == "zeroinitializer":
    return Sig(0, 0, 0)
  if op in ("poison", "undef"):
    return Sig(0, 0, 0)
  if op.startswith("%"):
    return None
  values = [_parse_float(t) for t in _LLVM_FLOAT.findall(op)]
  if not values and re.fullmatch(r"0x[0-9A-Fa-f]{16}|[-+]?[\d.]+(?:e[-+]?\d+)?", op):
    values = [_parse_float(op)]
  sigs = [_float_sig(v) for v in values]
  return _union(sigs) if values and None not in sigs else (_ANY if values else None)


def _split_operands(text: str) -> list[str]:
  """Top-level comma split of an instruction's operand text, metadata (`!dbg`) dropped."""
  text = re.sub(r",\s*!\w+\s+!\d+", "", text)
  out, depth, cur = [], 0, ""
  for ch in text:
    depth += ch in "(<[{"
    depth -= ch in ")>]}"
    if ch == "," and depth == 0:
      out.append(cur.strip())
      cur = ""
    else:
      cur += ch
  return out + [cur.strip()] if cur.strip() else out


_INSTR = re.compile(r"^\s*(%[\w.]+) = (\w+)\s+(.*)$")
_FLAGS = {"nnan", "ninf", "nsz", "arcp", "contract", "afn", "reassoc", "fast", "nneg", "nuw", "nsw", "exact",
          "disjoint", "tail", "musttail", "notail"}
_FLOAT_TYPE = re.compile(r"^(?:<\d+ x )?(float|half|bfloat|double)>?")
_INT_TYPE = re.compile(r"^(?:<\d+ x )?i(\d+)>?")


def _strip_type(rest: str) -> tuple[str, str]:
  """'nnan <4 x float> %a, %b' → ('<4 x float>', '%a, %b')."""
  words = rest.split(" ")
  while words and words[0] in _FLAGS:
    words.pop(0)
  rest = " ".join(words)
  m = re.match(r"(<\d+ x [\w]+>|[\w]+)\s+(.*)$", rest)
  return (m.group(1), m.group(2)) if m else ("", rest)


def _int_bits(operand: str, ints: dict[str, int], width: int) -> int:
  operand = operand.strip()
  if operand in ints:
    return ints[operand]
  m = _INT_CONST.match(operand.split(" ", 1)[-1] if operand.startswith("i") else operand)
  if m:
    v = int(m.group(1))
    return v.bit_length() if v >= 0 else width
  consts = [int(c) for c in re.findall(r"i\d+ (-?\d+)", operand)]
  if consts and not operand.startswith("%"):
    return max(c.bit_length() if c >= 0 else width for c in consts)
  return width


def _int_step(op: str, ty: str, args: list[str], ints: dict[str, int]) -> int:
  """A bound on the bit length of an integer result (unsigned view), from masks, shifts and conversions."""
  width = int(_INT_TYPE.match(ty).group(1)) if _INT_TYPE.match(ty) else 64
  bits = [_int_bits(a, ints, width) for a in args[:2]]
  if op == "and":
    return min(bits)
  if op in ("or", "xor"):
    return max(bits)
  if op == "lshr" and not args[1].startswith("%"):
    return max(bits[0] - min(int(c) for c in re.findall(r"-?\d+", args[1].split("(")[-1]) or ["0"]), 0)
  if op == "shl":
    return min(width, bits[0] + (bits[1] if args[1].startswith("%") else
                                 max(int(c) for c in re.findall(r"-?\d+", args[1].split("(")[-1]) or ["0"])))
  if op == "add":
    return min(width, max(bits) + 1)
  if op == "mul":
    return min(width, sum(bits))
  if op == "icmp":
    return 1
  return width


def contractions(llir: str) -> list[Contraction]:
  """Every multiply-add the backend may fuse in an LLVM module (Triton's `llir` stage), with a proof of exactness
  where the significand/exponent bounds give one (see Sig). A product of small integers, or of anything by a power of
  two in range, is exact; a product involving a loaded float, a bitcast or anything not bounded is not provable."""
  sigs: dict[str, Sig] = {}
  ints: dict[str, int] = {}
  defs: dict[str, tuple[str, list[str], str]] = {}  # name → (op, operands, line) for floats
  shl23: set[str] = set()  # integers shifted left by 23: bitcast to float, powers of two (ue8m0 / ue4m3 decode)
  found = []

  def sig_of(operand: str) -> Sig:
    operand = operand.strip()
    if operand.startswith("%"):
      return sigs.get(operand, _ANY)
    const = _constant_sig(operand.split(" ", 1)[1] if _FLOAT_TYPE.match(operand) else operand)
    return _ANY if const is None else const

  def product_of(name: str) -> tuple[str, Sig] | None:
    """The fmul behind `name` (through fneg), as (line, exact product bound)."""
    seen = 0
    while name in defs and seen < 4:
      op, args, line = defs[name]
      if op == "fmul":
        return line, _product(sig_of(args[0]), sig_of(args[1]))
      if op != "fneg":
        return None
      name, seen = args[0], seen + 1
    return None

  for line in llir.splitlines():
    m = _INSTR.match(line)
    if not m:  # stores, branches, calls without a result: they feed no value
      continue
    name, op, rest = m.groups()
    line = line.strip()
    if op in ("fmul", "fadd", "fsub", "fneg"):
      ty, operands = _strip_type(rest)
      args = _split_operands(operands)
      defs[name] = (op, args, line)
      a = sig_of(args[0])
      if op == "fneg":
        sigs[name] = a
      elif op == "fmul":
        sigs[name] = _rounded(_product(a, sig_of(args[1])))
      else:
        for arg in args[:2]:
          hit = product_of(arg.strip())
          if hit:
            found.append(Contraction(hit[0], line, hit[1], hit[1].exact()))
        sigs[name] = _rounded(_sum(a, sig_of(args[1])))
    elif op in ("uitofp", "sitofp"):
      src = re.match(r"(?:nneg\s+)?(<\d+ x i\d+>|i\d+)\s+([^\s,]+)", rest)
      width = int(_INT_TYPE.match(src.group(1)).group(1)) if src else 32
      bits = ints.get(src.group(2), width) if src else width
      bits += op == "sitofp"  # the sign is separate; a signed bound covers both halves
      sigs[name] = _rounded(Sig(bits, 0, 0))
    elif op == "fpext":
      sigs[name] = _FORMAT_SIG.get(_FLOAT_TYPE.match(rest).group(1), _ANY) if _FLOAT_TYPE.match(rest) else _ANY
    elif op == "bitcast":
      src = re.match(r"(<\d+ x \w+>|\w+)\s+(%[\w.]+)", rest)
      if src and src.group(2) in shl23:
        sigs[name] = Sig(1, _F32_MIN_EXP, _F32_MAX_EXP)  # exponent field only: a power of two (or 0 / subnormal)
      elif src and src.group(2) in sigs:
        sigs[name] = sigs[src.group(2)]
    elif op in ("select", "shufflevector", "insertelement", "extractelement", "phi"):
      ty, operands = _strip_type(rest)
      args = _split_operands(operands)
      if op == "select":
        args = args[1:]
      elif op == "phi":
        args = [a.strip("[ ]").split(",")[0] for a in args]
      if _FLOAT_TYPE.search(rest.split("%", 1)[0]) or any(a.strip() in sigs for a in args):
        sigs[name] = _union(sig_of(re.sub(r"^(<\d+ x \w+>|\w+)\s+", "", a)) for a in args
                            if not re.match(r"^i\d+ ", a))
      if op in ("select", "phi") and not _FLOAT_TYPE.search(ty):
        width = int(_INT_TYPE.match(ty).group(1)) if _INT_TYPE.match(ty) else 64
        ints[name] = max(_int_bits(re.sub(r"^(<\d+ x \w+>|\w+)\s+", "", a), ints, width) for a in args)
    elif op == "call":
      callee = re.search(r"@(llvm\.[\w.]+)\((.*)\)", rest)
      if callee and callee.group(1).startswith(("llvm.fma.", "llvm.fmuladd.")):
        args = [re.sub(r"^(<\d+ x \w+>|\w+)\s+", "", a) for a in _split_operands(callee.group(2))]
        prod = _product(sig_of(args[0]), sig_of(args[1]))
        found.append(Contraction(line.strip(), line.strip(), prod, prod.exact()))
      elif callee and callee.group(1).startswith(("llvm.fabs.", "llvm.maxnum.", "llvm.minnum.", "llvm.copysign.")):
        args = [re.sub(r"^(<\d+ x \w+>|\w+)\s+", "", a) for a in _split_operands(callee.group(2))]
        sigs[name] = _union(sig_of(a) for a in args)
    elif op in ("and", "or", "xor", "lshr", "shl", "add", "mul", "icmp", "zext", "trunc"):
      ty, operands = _strip_type(rest)
      args = _split_operands(operands)
      if op in ("zext", "trunc"):
        src = re.match(r"(<\d+ x i\d+>|i\d+)\s+(%[\w.]+)\s+to\s+(<\d+ x i\d+>|i\d+)", rest)
        to = int(_INT_TYPE.match(src.group(3)).group(1)) if src else 64
        ints[name] = min(ints.get(src.group(2), to) if src else to, to)
        continue
      ints[name] = _int_step(op, ty, args, ints)
      if op == "shl" and re.fullmatch(r"(splat \(i32 23\)|23)", args[1].strip()):
        shl23.add(name)
  return found


def unsafe_contractions(llir: str) -> list[Contraction]:
  """The contraction candidates whose product is not provably exact: where FMA fusion can change a result."""
  return [c for c in contractions(llir) if not c.exact]


def fma_instructions(asm: str) -> dict[str, int]:
  """Count of each fused multiply-add instruction in amdgcn or PTX text (what the backend actually fused)."""
  counts: dict[str, int] = {}
  for m in FMA_INSTRUCTIONS.finditer(asm):
    counts[m.group(1)] = counts.get(m.group(1), 0) + 1
  return counts


def decode_case(fmt: str, *, experts: int = 2, rows: int = 32, cols: int = 128, block_n: int = 16,
                block_k: int = 32, num_warps: int = 1) -> tuple[Callable, tuple]:
  """(fn, args): the MoE kernels' in-kernel decode alone (`dequantize_tiles`, the same tile loader as gate_up and
  down) on a small `fmt` stack, f32 output: what the contraction check compiles."""
  shape = (experts, rows, cols)
  args = ({n: jax.ShapeDtypeStruct(sh, dt) for n, (sh, dt) in formats.get(fmt).storage(shape).items()},)

  def fn(arrays):
    w = QuantizedExpertWeights.from_storage(fmt, arrays, shape)
    return dequantize_tiles(w, block_n=block_n, block_k=block_k, dtype=jnp.float32, num_warps=num_warps)

  return fn, args
