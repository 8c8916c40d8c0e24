"""The notebooks as committed: without outputs, with a parameter cell, every one rendered by the render command."""

import json

import nbformat
import pytest

from experiments import render_notebooks

PATHS = sorted(render_notebooks.NOTEBOOKS_DIR.glob("*.ipynb"))


def test_every_notebook_is_rendered():
  assert [p.stem for p in PATHS] == sorted(render_notebooks.NOTEBOOKS)


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.name)
def test_committed_without_outputs(path):
  nb = nbformat.read(path, as_version=4)
  nbformat.validate(nb)
  code = [c for c in nb.cells if c.cell_type == "code"]
  assert code
  with_outputs = [c.source.splitlines()[0] for c in code if c.outputs]
  assert not with_outputs, f"{path.name}: cells committed with outputs: {with_outputs}"
  counted = [c.source.splitlines()[0] for c in code if c.execution_count is not None]
  assert not counted, f"{path.name}: cells committed with execution counts: {counted}"
  assert "widgets" not in json.loads(path.read_text()).get("metadata", {})


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.name)
def test_one_parameter_cell_at_the_top(path):
  nb = nbformat.read(path, as_version=4)
  tagged = [i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", [])]
  first_code = next(i for i, c in enumerate(nb.cells) if c.cell_type == "code")
  assert tagged == [first_code]


def test_parameters_are_injected_after_the_parameter_cell():
  nb = render_notebooks.with_parameters(nbformat.read(PATHS[0], as_version=4), {"source": "live", "lengths": (8, 16)})
  at = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
  assert nb.cells[at + 1].source == "source = 'live'\nlengths = (8, 16)"
  assert nb.cells[at + 1].metadata["tags"] == ["injected-parameters"]
  with pytest.raises(ValueError, match="no cell tagged 'parameters'"):
    render_notebooks.with_parameters(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 1")]), {"x": 2})
