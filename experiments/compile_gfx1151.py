"""Whole layer programs (XLA + the Pallas kernels) compiled for gfx1151 by XLA's own ROCm compiler, without a GPU.

    .venv/bin/python -m experiments.compile_gfx1151 [--rocm_python=.venv-rocm/bin/python] [--programs=all]
        [--out=experiments/results/compile_gfx1151]

The offline check of docs/lowering.md §3 recompiles only the Pallas kernels' Triton IR with PyPI triton. This one
runs the real pipeline: the JAX ROCm 7 PJRT plugin (jax-rocm7-plugin/-pjrt 0.11.2, in a separate venv) compiles a
whole `ds4jax.prefill._layer_step` program (HLO passes, XLA's fusions and GEMM emitters, its vendored Triton for the
Pallas custom calls, the AMDGPU LLVM backend, lld) for a compile-only gfx1151 device. How (docs/lowering.md §5):

  1. The plugin's .so needs the ROCm runtime libraries (libamdhip64.so.7, rocBLAS, MIOpen, hipBLASLt, RCCL, …),
     which no wheel here ships. A compile never calls them, so `stub_libraries` builds empty stand-ins with the
     sonames, symbol versions (hip_4.2 …, AMDSMI_1) and function symbols the plugin imports (cc + nm + readelf).
  2. jax_plugins.xla_rocm7.initialize() refuses without an AMD GPU, so the child registers the plugin itself
     (`xla_bridge.register_plugin`) and creates a topology from a GpuTargetConfigProto (TARGET_CONFIG: gfx1151,
     wave32, 64 KiB LDS): `jax.experimental.topologies.get_topology_desc(platform="rocm", target_config=...)`.
  3. The program is lowered for that topology's compile-only device, inside its abstract mesh (the Pallas-Triton
     lowering reads the device kind "gfx1151" from it), and `.compile()`d: deviceless AOT, no autotuning.
  4. Every code object XLA builds goes to TF_XLA_HSACO_CACHE_DIR (TF_XLA_HSACO_BITCODE_SIZE_THRESHOLD=0 makes it
     cache all of them), the thunk sequence (kernel launches: grid, threads, dynamic LDS) to --xla_dump_to.
     A kernel compiled more than once (rejected GEMM configurations) counts by its last compile, the one the
     program keeps. `lowering.code_object_kernels` reads VGPR/SGPR, spills, scratch, static LDS and code bytes.

Each program's Pallas kernels are also compiled by the offline triton proxy (lowering.compile_hip), side by side.
`--programs=decode` adds the MoE tile decode alone for every quantized format and, when llvm-objdump (LLVM ≥ 18) is
found, counts the FMA instructions XLA's pipeline emits there (docs/lowering.md §6). Run from the main venv (it has
triton for the proxy); the compiles run in `--rocm_python` children, one per program. Writes OUT.json and OUT.md.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from typing import Callable, NamedTuple

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from absl import app, flags  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh  # noqa: E402

from ds4jax import config, model, prefill  # noqa: E402
from ds4jax import features as features_lib  # noqa: E402
from experiments import run_record  # noqa: E402
from kernels_pallas import lowering  # noqa: E402
from kernels_pallas.moe.quantized_weights import QUANTIZED_FORMATS  # noqa: E402

_ROCM_PYTHON = flags.DEFINE_string("rocm_python", ".venv-rocm/bin/python",
                                   "Python of a venv with jax-rocm7-plugin/-pjrt 0.11.2 (pyproject's `rocm` extra).")
_PROGRAMS = flags.DEFINE_list("programs", ["all"], "Program labels (see PROGRAMS), 'layers', 'decode' or 'all'.")
_CHILD = flags.DEFINE_string("child", "", "Internal: compile this one program (in the ROCm venv) and exit.")
_WORK = flags.DEFINE_string("work", "", "Internal/debug: where the children keep code objects and dumps.")
_OBJDUMP = flags.DEFINE_string("objdump", "", "llvm-objdump with gfx1151 (LLVM ≥ 18); default: the newest found.")
_OUT = run_record.define_out_flag(default="experiments/results/compile_gfx1151",
                                  help_text="Output path prefix (.json and .md).")
_RENDER = flags.DEFINE_bool("render_only", False, "Rewrite OUT.md from OUT.json (no compiling).")

# What XLA needs to know about the device it compiles for (xla GpuTargetConfigProto, text form). Codegen reads the
# arch, wave size and shared-memory limits; the rest only feeds XLA's cost heuristics (values for Strix Halo's
# Radeon 8060S: 40 CUs, ~256 GB/s LPDDR5X, 2 MiB L2, 128 GiB shared with the host).
TARGET_CONFIG = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 65536
  shared_memory_per_block_optin: 65536
  shared_memory_per_core: 65536
  threads_per_core_limit: 2048
  core_count: 40
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65536
  block_dim_limit_z: 65536
  memory_bandwidth: 256000000000
  l2_cache_size: 2097152
  clock_rate_ghz: 2.9
  device_memory_size: 137438953472
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  rocm_compute_capability { gcn_arch_name: "gfx1151" }
}
platform_name: "ROCM"
dnn_version_info {}
device_description_str: "gfx1151"
"""

# The ROCm runtime libraries xla_rocm_plugin.so links against; none is called while compiling.
NEEDED = ("libamdhip64.so.7", "libamd_smi.so.26", "librocprofiler-sdk.so.1", "librccl.so.1", "libhipblaslt.so.1",
          "libhipfft.so.0", "libMIOpen.so.1", "librocblas.so.5")


# ---- the programs -------------------------------------------------------------------------------------------------

class Spec(NamedTuple):
  """A layer program: preset, layer index (its attention kind), band tokens, expert policy, kernels or reference."""
  preset: str
  layer: int
  band: int
  policy: str
  kernels: bool


# tiny_sparse: layers 0/1/2 are window/CSA/HCA. v4_flash: 0 window, 2 CSA, 3 HCA (lucebox_mix experts, 8192-token
# band as prefill runs it). "kernels" / "reference": see layer_features.
LAYERS = {
    "tiny window kernels": Spec("tiny_sparse", 0, 64, "bf16", True),
    "tiny csa kernels": Spec("tiny_sparse", 1, 64, "bf16", True),
    "tiny hca kernels": Spec("tiny_sparse", 2, 64, "bf16", True),
    "tiny csa reference": Spec("tiny_sparse", 1, 64, "bf16", False),
    "v4_flash window kernels": Spec("v4_flash", 0, 8192, "lucebox_mix", True),
    "v4_flash csa kernels": Spec("v4_flash", 2, 8192, "lucebox_mix", True),
    "v4_flash hca kernels": Spec("v4_flash", 3, 8192, "lucebox_mix", True),
    "v4_flash csa reference": Spec("v4_flash", 2, 8192, "lucebox_mix", False),
}
DECODES = {f"decode {f}": f for f in QUANTIZED_FORMATS}
PROGRAMS = [*LAYERS, *DECODES]


def layer_features(spec: Spec) -> features_lib.Features:
  """kernels: the gfx1151 defaults of the capability table (or, where it turns nothing on, the sm_90 defaults forced
  on: this only compiles); reference: every switch off on device class gfx1151, the exact XLA path."""
  base = features_lib.resolve("gfx1151")
  row = features_lib.CAPABILITIES["gfx1151"] if base.on() else features_lib.CAPABILITIES["sm_90"]
  on = {s for s, cap in row.items() if cap.default} if spec.kernels else set()
  picked = dataclasses.replace(base, **{s: s in on for s in features_lib.SWITCHES})
  return prefill.layer_features(picked, spec.band)


def build(label: str) -> tuple[Callable, tuple, dict]:
  """(fn, abstract args, facts) of a program."""
  if label in DECODES:
    fn, args = lowering.decode_case(DECODES[label])
    return fn, args, dict(kind="decode", format=DECODES[label])
  spec = LAYERS[label]
  cfg = config.preset(spec.preset)
  m = model.abstract_model(cfg, dtype=jnp.bfloat16 if spec.preset == "v4_flash" else jnp.float32, policy=spec.policy)
  block = m.layers[spec.layer]
  gdef, state = nnx.split(block)
  feats = layer_features(spec)
  cache = jax.eval_shape(lambda: block.attn.empty_cache(spec.band, spec.band))

  def fn(state, X, tokens, s0, cache):
    return prefill._layer_step(gdef, state, X, tokens, s0, cache, feats)  # pylint: disable=protected-access

  args = (state, jax.ShapeDtypeStruct((spec.band, cfg.hc_mult, cfg.hidden_size), jnp.float32),
          jax.ShapeDtypeStruct((spec.band,), jnp.int32), jax.ShapeDtypeStruct((), jnp.int32), cache)
  facts = dict(kind="layer", preset=spec.preset, layer=spec.layer, attention=str(cfg.attention[spec.layer]),
               band=spec.band, policy=spec.policy, switches=feats.on(), device_class=feats.device_class)
  return fn, args, facts


# ---- child: compile one program with XLA's ROCm compiler -----------------------------------------------------------

def compile_child(label: str) -> dict:
  """Runs in the ROCm venv with the stubs on LD_LIBRARY_PATH: compiles `label` for a compile-only gfx1151."""
  # pylint: disable=import-outside-toplevel
  from jax._src import xla_bridge
  from jax._src.lib import xla_client
  from jax.experimental import topologies
  from jax.sharding import NamedSharding, PartitionSpec, use_abstract_mesh
  import jax_plugins.xla_rocm7 as rocm_plugin

  library = str(rocm_plugin._get_library_path())  # pylint: disable=protected-access
  xla_bridge.register_plugin("rocm", priority=500, library_path=library,
                             options=xla_client.generate_pjrt_gpu_plugin_options())
  topo = topologies.get_topology_desc("gfx1151", "rocm", target_config=TARGET_CONFIG, topology="1x1x1")
  mesh = topologies.make_mesh(topo, (1,), ("x",))
  placed = NamedSharding(mesh, PartitionSpec())
  fn, args, _ = build(label)
  args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=placed), args)
  t0 = time.perf_counter()
  with use_abstract_mesh(mesh.abstract_mesh):  # the Pallas-Triton lowering reads the device kind here
    lowered = jax.jit(fn).trace(*args).lower()
  t1 = time.perf_counter()
  compiled = lowered.compile()
  return dict(lower_s=round(t1 - t0, 1), compile_s=round(time.perf_counter() - t1, 1),
              device=str(topo.devices[0].device_kind), pallas_calls=lowered.as_text().count(lowering.CUSTOM_CALL),
              memory=str(compiled.memory_analysis()) if hasattr(compiled, "memory_analysis") else None)


# ---- parent: stubs, children, code objects ---------------------------------------------------------------------------

def _plugin_path(python: str) -> str:
  code = "import jax_plugins.xla_rocm7 as p; print(p._get_library_path())"
  return subprocess.run([python, "-c", code], capture_output=True, text=True, check=True,
                        env=dict(os.environ, JAX_PLATFORMS="cpu")).stdout.strip().splitlines()[-1]


def stub_libraries(plugin: str, out_dir: str) -> None:
  """Empty stand-ins for NEEDED: every strong undefined function symbol of the plugin returns an error code (100,
  hipErrorNoDevice), error-string getters a string, hipGetDeviceCount 0 devices; versioned symbols get their
  version node (hip_4.2 …, AMDSMI_1) so the loader's version check passes."""
  os.makedirs(out_dir, exist_ok=True)
  undefined = subprocess.run(["nm", "-D", "--undefined-only", plugin], capture_output=True, text=True,
                             check=True).stdout.split("\n")
  by_version: dict[str, list[str]] = {}
  for line in undefined:
    parts = line.split()
    if len(parts) != 2 or parts[0] != "U" or re.search(r"@(GLIBC|CXXABI|GCC_|GLIBCXX)", parts[1]):
      continue
    name, _, version = parts[1].partition("@")
    by_version.setdefault(version, []).append(name)

  def body(name: str) -> str:
    if name == "hipGetDeviceCount":
      return "int hipGetDeviceCount(int* n) { if (n) *n = 0; return 100; }"
    if name == "__hipRegisterFatBinary":
      return "static char handle[64]; void* __hipRegisterFatBinary(const void* d) { (void)d; return handle; }"
    if re.search(r"(Error|Status)(String|Name)|status_to_string", name):
      return f'const char* {name}(void) {{ return "rocm stub"; }}'
    return f"long {name}(void) {{ return 100; }}"

  groups = {"libamdhip64.so.7": [v for v in by_version if v.startswith("hip_")] + [""],
            "libamd_smi.so.26": [v for v in by_version if v.startswith("AMDSMI")]}
  with tempfile.TemporaryDirectory() as tmp:
    for lib in NEEDED:
      versions = groups.get(lib, [])
      src = os.path.join(tmp, lib + ".c")
      with open(src, "w") as f:
        f.write("\n".join(body(n) for v in versions for n in by_version.get(v, [])) or "void rocm_stub(void) {}")
      cmd = ["cc", "-shared", "-fPIC", "-w", "-o", os.path.join(out_dir, lib), src, f"-Wl,-soname,{lib}"]
      nodes = [f"{v} {{ global: {' '.join(n + ';' for n in by_version[v])} }};" for v in versions if v]
      if nodes:
        script = os.path.join(tmp, lib + ".map")
        with open(script, "w") as f:
          f.write("\n".join(nodes) + "\n")
        cmd.append(f"-Wl,--version-script={script}")
      subprocess.run(cmd, check=True)


LAUNCH = re.compile(r"kCustomKernel\s+\[[^\]]*\]\s+(\S+) grid: \[(\d+), (\d+), (\d+)\] threads: \[(\d+), (\d+), (\d+)\]"
                    r"\s+shared_memory: (\d+) bytes")


def launches(dump_dir: str) -> list[dict]:
  """Kernel launches of the final program (XLA's thunk sequence): name, grid, threads, dynamic LDS."""
  (path,) = glob.glob(os.path.join(dump_dir, "*.thunk_sequence.txt"))
  with open(path) as f:
    return [dict(name=m[0], grid=[int(g) for g in m[1:4]], threads=int(m[4]) * int(m[5]) * int(m[6]),
                 lds_dynamic=int(m[7])) for m in LAUNCH.findall(f.read())]


def code_objects(hsaco_dir: str) -> tuple[dict[str, dict], list[dict]]:
  """({kernel: its last compile}, earlier compiles of the same kernels) from XLA's code-object cache."""
  final, earlier = {}, []
  for path in sorted(glob.glob(os.path.join(hsaco_dir, "*.hsaco")), key=os.path.getmtime):
    with open(path, "rb") as f:
      data = f.read()
    for k in lowering.code_object_kernels(data):
      k["file"] = os.path.basename(path)
      if k["name"] in final:
        earlier.append(final[k["name"]])
      final[k["name"]] = k
  return final, earlier


def find_objdump() -> str | None:
  for name in ("llvm-objdump-21", "llvm-objdump-20", "llvm-objdump-19", "llvm-objdump-18"):
    if shutil.which(name):
      return name
  return None


def fma_listing(objdump: str, hsaco: str, kernel: str) -> dict[str, int]:
  """FMA-family instructions of one kernel in XLA's code object, by mnemonic and non-register operands
  ('v_fma_f32 -2.0, 1.0')."""
  text = subprocess.run([objdump, "-d", "--mcpu=gfx1151", hsaco], capture_output=True, text=True, check=True).stdout
  body = text.split(f"<{kernel}>:", 1)[-1]
  counts: dict[str, int] = {}
  for line in body.splitlines():
    m = re.match(r"^\s+(v_\w*fma\w*|v_\w*fmac\w*|v_mad\w*)\s+([^/]*)", line)
    if m:
      operands = ", ".join(o for o in m.group(2).strip().split(", ") if not re.fullmatch(r"v\d+|s\d+|vcc\w*", o))
      key = f"{m.group(1)} {operands}".strip()
      counts[key] = counts.get(key, 0) + 1
  return counts


def run_program(label: str, python: str, stubs: str, work: str) -> dict:
  dump, hsaco = os.path.join(work, "dump"), os.path.join(work, "hsaco")
  shutil.rmtree(work, ignore_errors=True)
  os.makedirs(hsaco)
  env = dict(os.environ, LD_LIBRARY_PATH=stubs, JAX_PLATFORMS="cpu", TF_XLA_HSACO_CACHE_DIR=hsaco,
             TF_XLA_HSACO_BITCODE_SIZE_THRESHOLD="0", XLA_FLAGS=f"--xla_dump_to={dump}")
  t0 = time.perf_counter()
  res = subprocess.run([python, "-m", "experiments.compile_gfx1151", f"--child={label}"], capture_output=True,
                       text=True, env=env, check=False)
  wall = time.perf_counter() - t0
  out = [line for line in res.stdout.splitlines() if line.startswith("{")]
  if res.returncode or not out:
    return dict(label=label, error=(res.stderr or res.stdout)[-3000:], wall_s=round(wall, 1))
  child = json.loads(out[-1])
  final, earlier = code_objects(hsaco)
  calls = launches(dump)
  kernels = []
  for c in calls:
    k = final.get(c["name"])
    kernels.append(dict(c, **({} if k is None else {key: k[key] for key in (
        "vgpr", "sgpr", "vgpr_spills", "sgpr_spills", "scratch_bytes", "lds_static", "code_bytes", "workgroup")}),
                        lds=max(c["lds_dynamic"], k["lds_static"] if k else 0), missing=k is None))
  return dict(label=label, wall_s=round(wall, 1), **child, launches=len(calls), kernels=kernels,
              code_objects=len(glob.glob(os.path.join(hsaco, "*.hsaco"))),
              rejected=[{key: e[key] for key in ("name", "vgpr", "vgpr_spills", "scratch_bytes")} for e in earlier],
              hsaco_dir=hsaco)


def summary(prog: dict) -> dict:
  """Per program: distinct kernels, code bytes, largest VGPR/SGPR/LDS, spills, scratch."""
  distinct = {k["name"]: k for k in prog["kernels"] if not k["missing"]}.values()
  return dict(kernels=len(distinct), launches=prog["launches"], code_bytes=sum(k["code_bytes"] for k in distinct),
              vgpr_max=max((k["vgpr"] for k in distinct), default=0),
              sgpr_max=max((k["sgpr"] for k in distinct), default=0),
              lds_max=max((k["lds"] for k in distinct), default=0),
              vgpr_spills=sum(k["vgpr_spills"] for k in distinct),
              scratch_max=max((k["scratch_bytes"] for k in distinct), default=0),
              spilling=sorted(k["name"] for k in distinct if k["vgpr_spills"] or k["scratch_bytes"]),
              missing=sorted({k["name"] for k in prog["kernels"] if k["missing"]}))


def triton_kernels(fn, args, platform: str) -> list[lowering.TritonKernel]:
  """`lowering.lower_kernels` with an Auto-axis abstract mesh: a whole layer step mixes arrays with and without a
  mesh, which Explicit axes (lower_kernels' default, fine for single kernels) reject."""
  kind = lowering.DEFAULT_DEVICE_KIND[platform]
  mesh = AbstractMesh((1,), ("x",), axis_types=(AxisType.Auto,),
                      abstract_device=AbstractDevice(device_kind=kind, num_cores=None, platform=platform))
  with use_abstract_mesh(mesh):
    lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,))
  return lowering.kernels_of(lowered.compiler_ir("stablehlo"))


def proxy(label: str) -> dict[str, dict]:
  """The same program's Pallas kernels through the offline triton check (docs/lowering.md §3), by kernel name."""
  fn, args, _ = build(label)
  out = {}
  for k in triton_kernels(fn, args, "rocm"):
    st = lowering.compile_kernel(k, "gfx1151")
    out[k.name] = {key: st.get(key) for key in ("vgpr", "sgpr", "vgpr_spills", "scratch_bytes", "lds_bytes",
                                                "occupancy", "wmma", "error") if key in st}
    if label in DECODES:
      hip = lowering.compile_hip(k.ttir, "gfx1151", num_warps=k.num_warps, num_stages=k.num_stages, keep_asm=True)
      (kc,) = triton_kernels(fn, args, "cuda")
      ptx = lowering.compile_cuda(kc.ttir, 90, num_warps=kc.num_warps, num_stages=kc.num_stages, keep_asm=True)
      sites = lowering.contractions(hip["llir"])
      out[k.name].update(fma_gfx1151=lowering.fma_instructions(hip["amdgcn"]),
                         fma_sm90=lowering.fma_instructions(ptx["ptx"]), contraction_sites=len(sites),
                         unsafe=len([c for c in sites if not c.exact]),
                         unsafe_sm90=len(lowering.unsafe_contractions(ptx["llir"])))
  return out


# ---- report ----------------------------------------------------------------------------------------------------------

def table(rows, cols) -> list[str]:
  return ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)] + [
      "| " + " | ".join(str(c) for c in r) + " |" for r in rows]


def markdown(record: dict) -> str:
  progs = record["programs"]
  lines = ["# Whole programs compiled for gfx1151 by XLA's ROCm compiler (no GPU)", "",
           f"`python -m experiments.compile_gfx1151` — {record['meta_line']}. Each program is lowered for a "
           "compile-only gfx1151 device of the jax-rocm7 0.11.2 PJRT plugin (stubbed ROCm runtime, target config in "
           "the script) and compiled by XLA: HLO passes, fusions, GEMM emitters, its vendored Triton for the Pallas "
           "custom calls, AMDGPU LLVM. Numbers are read from the code objects XLA wrote (docs/lowering.md §5). "
           "Code = machine-code bytes of the program's distinct kernels; LDS = max(static, dynamic at launch); "
           "no autotuning (deviceless: XLA's default GEMM configurations).", ""]
  rows = []
  for p in progs:
    if "error" in p:
      rows.append((p["label"], "ERROR", p["error"].strip().splitlines()[-1][:120], *["-"] * 9))
      continue
    s = p["summary"]
    rows.append((p["label"], p["pallas_calls"], f"{p['compile_s']:.0f}", s["launches"], s["kernels"], s["code_bytes"],
                 f"{s['vgpr_max']}/{s['sgpr_max']}", s["lds_max"], s["vgpr_spills"], s["scratch_max"],
                 ", ".join(s["spilling"]) or "—",
                 f"{len(p['rejected'])} ({sum(1 for e in p['rejected'] if e['vgpr_spills'])} spill)"))
  lines += ["## Per program", ""] + table(rows, ("program", "Pallas calls", "compile s", "launches", "kernels",
                                                 "code B", "max VGPR/SGPR", "max LDS B", "VGPR spills",
                                                 "max scratch B", "kernels that spill",
                                                 "earlier compiles")) + [
      "", "Earlier compiles: kernels XLA compiled more than once before keeping the last one (GEMM fusions whose "
      "Triton configuration spilled were compiled again with another emitter/configuration); they are not in the "
      "program.", ""]
  rows = []
  for p in progs:
    for k in p.get("kernels", []):
      if k["name"] not in p.get("proxy", {}) or k["missing"]:
        continue
      t = p["proxy"][k["name"]]
      rows.append((p["label"], k["name"], "×".join(map(str, k["grid"])), k["threads"], k["lds"],
                   f"{k['vgpr']}/{k['sgpr']}", f"{k['vgpr_spills']}/{k['scratch_bytes']}", k["code_bytes"],
                   t.get("lds_bytes", "-"), f"{t.get('vgpr', '-')}/{t.get('sgpr', '-')}",
                   f"{t.get('vgpr_spills', '-')}/{t.get('scratch_bytes', '-')}"))
  lines += ["## Pallas kernels: XLA's pipeline vs the offline triton check", "",
            "XLA columns from XLA's code objects; proxy columns from `lowering.compile_hip` on the same kernel's "
            "Triton IR (docs/lowering.md §3).", ""]
  lines += table(rows, ("program", "kernel", "grid", "threads", "LDS B", "VGPR/SGPR", "spills/scratch B", "code B",
                        "proxy LDS B", "proxy VGPR/SGPR", "proxy spills/scratch B")) + [""]
  dec = [p for p in progs if p.get("facts", {}).get("kind") == "decode" and "error" not in p]
  if dec:
    rows = []
    for p in dec:
      t = next(iter(p["proxy"].values()))
      rows.append((p["facts"]["format"], "; ".join(f"{n}× {k}" for k, n in p.get("fma_xla", {}).items()) or "none",
                   "; ".join(f"{n}× {k}" for k, n in t["fma_gfx1151"].items()) or "none",
                   "; ".join(f"{n}× {k}" for k, n in t["fma_sm90"].items()) or "none",
                   t["contraction_sites"], t["unsafe"], t["unsafe_sm90"]))
    lines += ["## The MoE tile decode alone: FMA contraction (docs/lowering.md §6)", "",
              "`dequantize_tiles` (the loader gate_up/down use) per format. XLA: FMA-family instructions in XLA's "
              "code object (llvm-objdump), register operands dropped; proxy: triton 3.9 with fp fusion (gfx1151 "
              "amdgcn, sm_90 PTX); candidates: fmul→fadd/fsub pairs in the LLVM IR; unsafe: products not provably "
              "exact (gfx1151 / sm_90).", ""]
    lines += table(rows, ("format", "XLA gfx1151", "proxy gfx1151", "proxy sm_90", "candidates", "unsafe gfx1151",
                          "unsafe sm_90")) + [""]
  return "\n".join(lines)


def main(argv):
  del argv
  if _CHILD.value:
    print(json.dumps(compile_child(_CHILD.value)))
    return 0
  if _RENDER.value:
    with open(_OUT.value + ".json") as f:
      record = json.load(f)
    with open(_OUT.value + ".md", "w") as f:
      f.write(markdown(record))
    return 0
  names = _PROGRAMS.value
  labels = (PROGRAMS if names == ["all"] else list(LAYERS) if names == ["layers"] else list(DECODES)
            if names == ["decode"] else names)
  unknown = [n for n in labels if n not in PROGRAMS]
  if unknown:
    raise app.UsageError(f"unknown programs {unknown}; known: {PROGRAMS}")
  python = os.path.abspath(_ROCM_PYTHON.value)
  work = _WORK.value or tempfile.mkdtemp(prefix="compile_gfx1151_")
  stubs = os.path.join(work, "stubs")
  stub_libraries(_plugin_path(python), stubs)
  objdump = _OBJDUMP.value or find_objdump()
  programs = []
  for i, label in enumerate(labels):
    prog = run_program(label, python, stubs, os.path.join(work, f"p{i}"))
    prog["facts"] = build(label)[2]
    if "error" not in prog:
      prog["summary"] = summary(prog)
      prog["proxy"] = proxy(label)
      if prog["facts"]["kind"] == "decode" and objdump:
        final, _ = code_objects(prog.pop("hsaco_dir"))
        k = final["moe_dequantize_tiles"]
        prog["fma_xla"] = fma_listing(objdump, os.path.join(work, f"p{i}", "hsaco", k["file"]), k["name"])
      prog.pop("hsaco_dir", None)
    programs.append(prog)
    s = prog.get("summary")
    print(f"{label}: " + (f"ERROR {prog['error'].strip().splitlines()[-1][:200]}" if s is None else
                          f"{prog['compile_s']}s, {s['kernels']} kernels, {s['code_bytes']} B code, max VGPR "
                          f"{s['vgpr_max']}, spills {s['vgpr_spills']} ({', '.join(s['spilling']) or 'none'})"),
          flush=True)
  if names not in (["all"],) and os.path.exists(_OUT.value + ".json"):  # a partial run updates the recorded one
    with open(_OUT.value + ".json") as f:
      kept = [p for p in json.load(f)["programs"] if p["label"] not in labels]
    programs = sorted(kept + programs, key=lambda p: PROGRAMS.index(p["label"]) if p["label"] in PROGRAMS else 99)
  env = run_record.environment()
  record = dict(check="compile_gfx1151", env=env, target_config=TARGET_CONFIG, objdump=objdump, programs=programs,
                meta_line=f"jax {jax.__version__}, jax-rocm7-plugin/-pjrt 0.11.2, {env.get('date', '')}, "
                          f"commit {str(env.get('git_commit', '?'))[:10]}")
  run_record.write_json(_OUT.value + ".json", record)
  with open(_OUT.value + ".md", "w") as f:
    f.write(markdown(record))
  print(f"wrote {_OUT.value}.json and .md")
  return 0


if __name__ == "__main__":
  app.run(main)
