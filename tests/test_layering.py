"""The import structure: experiments → ds4jax → kernels_pallas → ds4jax.quant, no cycles, no dodges.

Parses every module of the three packages (nothing is imported) and builds the graph of module-level imports
between them. A `from P import N` counts as an import of P.N when that is a module, else of P.
"""

import ast
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("ds4jax", "kernels_pallas", "experiments")
LIBRARIES = ("ds4jax", "kernels_pallas")  # imported by notebooks and tests: no flags, no entry-point state


def module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, pathlib.Path]:
  return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def imports(tree: ast.Module, modules) -> list[tuple[str, int, bool]]:
  """(imported project module, line, at module level) for every import statement in the tree."""
  top = {id(n) for n in tree.body}
  top |= {id(n) for s in tree.body if isinstance(s, (ast.If, ast.Try)) for n in ast.walk(s)}
  out = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
               for a in node.names]
    else:
      continue
    for name in names:
      if name.split(".")[0] in PACKAGES:
        out.append((name, node.lineno, id(node) in top))
  return out


def graph(modules) -> dict[str, list[tuple[str, int, bool]]]:
  return {m: imports(ast.parse(p.read_text()), modules) for m, p in modules.items()}


def allowed(src: str, dst: str) -> bool:
  """The one direction: experiments → ds4jax → kernels_pallas → ds4jax.quant (and within a package)."""
  layer = lambda m: ("quant" if m.startswith("ds4jax.quant") or m == "ds4jax" else m.split(".")[0])
  order = {"experiments": 3, "ds4jax": 2, "kernels_pallas": 1, "quant": 0}
  return order[layer(src)] >= order[layer(dst)]


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
  """Every strongly connected component with more than one module (Tarjan)."""
  index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

  def visit(v):
    index[v] = low[v] = counter[0]
    counter[0] += 1
    stack.append(v)
    on.add(v)
    for w in edges.get(v, ()):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1:
        out.append(sorted(comp))

  for v in sorted(edges):
    if v not in index:
      visit(v)
  return out


@pytest.fixture(scope="module")
def modules():
  return project_modules()


def check_direction(g) -> list[str]:
  return [f"{src}:{line} imports {dst}" for src, found in g.items() for dst, line, _ in found
          if not allowed(src, dst)]


def check_local_imports(g) -> list[str]:
  return [f"{src}:{line} imports {dst} inside a function" for src, found in g.items()
          for dst, line, at_top in found if not at_top]


def module_edges(g) -> dict[str, set[str]]:
  # A package's __init__ gathering its own submodules is not a cycle; a submodule importing its package is.
  return {src: {dst for dst, _, at_top in found if at_top and not dst.startswith(src + ".")}
          for src, found in g.items()}


def test_kernels_sit_below_the_model(modules):
  assert check_direction(graph(modules)) == []


def test_no_import_cycles(modules):
  assert cycles(module_edges(graph(modules))) == []


def test_no_function_local_project_imports(modules):
  assert check_local_imports(graph(modules)) == []


def test_libraries_define_no_flags(modules):
  """absl flags belong to entry points (experiments/); library modules never import absl."""
  bad = [m for m, p in modules.items() if m.split(".")[0] in LIBRARIES and "absl" in {
      n.split(".")[0] for node in ast.walk(ast.parse(p.read_text()))
      for n in ([a.name for a in node.names] if isinstance(node, ast.Import) else
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])}]
  assert bad == []


def test_the_checks_catch_planted_violations(modules):
  """Each check fails on a planted violation: a kernel importing the model, a two-module cycle, a local import."""
  planted = dict(modules)
  g = graph(planted)
  g["kernels_pallas.mla.reference"] = g["kernels_pallas.mla.reference"] + [("ds4jax.attention", 1, True)]
  assert check_direction(g) == ["kernels_pallas.mla.reference:1 imports ds4jax.attention"]
  assert ["ds4jax.attention", "kernels_pallas.mla.reference"] in [
      [m for m in c if m in ("ds4jax.attention", "kernels_pallas.mla.reference")] for c in cycles(module_edges(g))]
  g["ds4jax.moe"] = g["ds4jax.moe"] + [("kernels_pallas.moe", 7, False)]
  assert check_local_imports(g) == ["ds4jax.moe:7 imports kernels_pallas.moe inside a function"]
  tree = ast.parse("def f():\n  from ds4jax import model\n")
  assert imports(tree, modules) == [("ds4jax.model", 2, False)]


def test_importing_the_kernels_widens_the_interpreters_thread_pool():
  """kernels_pallas (imported by every kernel and by the model) sets PJRT_NPROC (≥ 8) before jax starts its CPU
  client, so Mosaic GPU's interpreter cannot deadlock on a 2-core machine (docs/lowering.md §2) whatever entry point
  runs it; a value the user set is kept."""
  code = "import os, kernels_pallas; print(os.environ.get('PJRT_NPROC'))"
  env = {k: v for k, v in os.environ.items() if k != "PJRT_NPROC"} | {"PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
  run = lambda e: subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, timeout=120,
                                 check=True).stdout.split()[-1]
  assert int(run(env)) >= 8
  assert run(env | {"PJRT_NPROC": "3"}) == "3"
