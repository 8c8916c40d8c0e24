"""Executes the notebooks (notebooks/README.md) against the committed results and writes each as HTML with its
figures, for reading without Jupyter.

    python -m experiments.render_notebooks [--out=notebooks/html] [--notebooks=ablation,kernels]

The notebooks run headless (nbclient) from the repository root, with their parameter cells as committed: the H200
results in experiments/results/ (the walkthrough runs the small trained checkpoint on the CPU). `execute` is also
what the tests run, with other parameters.
"""

from __future__ import annotations

import pathlib
import time
from typing import Any, Mapping

import nbformat

from experiments.results_tables import REPO_ROOT

NOTEBOOKS_DIR = REPO_ROOT / "notebooks"
NOTEBOOKS = ("ablation", "kernels", "walkthrough")
PARAMETERS_TAG = "parameters"


def notebook_path(name: str) -> pathlib.Path:
  """A notebook by name (`ablation`) or path."""
  p = pathlib.Path(name)
  return p if p.suffix == ".ipynb" else NOTEBOOKS_DIR / f"{name}.ipynb"


def with_parameters(nb, parameters: Mapping[str, Any]):
  """A copy of `nb` with a cell assigning `parameters` right after its "parameters" cell (papermill's convention:
  the later assignment wins). Values are written with repr, so they must be literals."""
  nb = nbformat.from_dict(nb)
  if not parameters:
    return nb
  at = next((i for i, c in enumerate(nb.cells) if PARAMETERS_TAG in c.metadata.get("tags", [])), None)
  if at is None:
    raise ValueError("the notebook has no cell tagged 'parameters' to override")
  cell = nbformat.v4.new_code_cell("\n".join(f"{k} = {v!r}" for k, v in parameters.items()))
  cell.metadata["tags"] = ["injected-parameters"]
  cell.pop("id", None)
  nb.cells.insert(at + 1, cell)
  return nb


def execute(name: str, parameters: Mapping[str, Any] | None = None, timeout: int = 900):
  """Runs a notebook headless in a fresh python3 kernel from the repository root; returns the executed notebook.
  A cell that raises stops it with nbclient's CellExecutionError (the cell and the traceback in its message)."""
  from nbclient import NotebookClient  # pylint: disable=import-outside-toplevel  (the notebooks extra)
  nb = with_parameters(nbformat.read(notebook_path(name), as_version=4), parameters or {})
  NotebookClient(nb, timeout=timeout, kernel_name="python3",
                 resources={"metadata": {"path": str(REPO_ROOT)}}).execute()
  return nb


def to_html(nb) -> str:
  from nbconvert import HTMLExporter  # pylint: disable=import-outside-toplevel
  body, _ = HTMLExporter().from_notebook_node(nb)
  return body


def main(argv):
  del argv
  from absl import flags  # pylint: disable=import-outside-toplevel
  out = pathlib.Path(flags.FLAGS.out)
  out = out if out.is_absolute() else REPO_ROOT / out
  out.mkdir(parents=True, exist_ok=True)
  for name in flags.FLAGS.notebooks:
    t0 = time.perf_counter()
    html = out / f"{name}.html"
    html.write_text(to_html(execute(name)))
    print(f"{name}: {html} ({time.perf_counter() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
  from absl import app, flags
  flags.DEFINE_string("out", "notebooks/html", "Folder for the HTML files (relative to the repository root).")
  flags.DEFINE_list("notebooks", list(NOTEBOOKS), f"Notebooks to render, of {list(NOTEBOOKS)}.")
  app.run(main)
