"""Executes the notebooks headless (experiments/render_notebooks.execute) and checks what they produced.

The kernel inherits this process's environment: the XLA flags of tests/conftest.py (a faster CPU compile) and the
Agg backend (the notebooks draw through matplotlib's inline backend, which renders with Agg).
"""

import dataclasses
import os

os.environ.setdefault("MPLBACKEND", "Agg")

import pytest  # noqa: E402

from experiments import render_notebooks  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Executed:
  nb: object
  markdown: str  # every markdown the notebook displayed: the sentences computed from its numbers
  images: int


def executed(nb) -> Executed:
  """Checks that no cell raised and that every cell tagged "figure" drew an image."""
  outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
  errors = [o for o in outputs if o.output_type == "error"]
  assert not errors, errors[0].get("ename")
  figures = [c for c in nb.cells if "figure" in c.metadata.get("tags", [])]
  assert figures, "the notebook has no cell tagged 'figure'"
  for c in figures:
    assert any("image/png" in o.get("data", {}) for o in c.outputs), f"no image from the figure cell:\n{c.source[:300]}"
  return Executed(nb=nb, markdown="\n".join(o["data"]["text/markdown"] for o in outputs
                                            if "text/markdown" in o.get("data", {})),
                  images=sum("image/png" in o.get("data", {}) for o in outputs))


@pytest.fixture(scope="session")
def run_notebook():
  """run_notebook(name, **parameters) -> Executed: the notebook run headless with those parameters."""
  return lambda name, **parameters: executed(render_notebooks.execute(name, parameters, timeout=300))
