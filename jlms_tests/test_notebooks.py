"""Every notebook under notebooks/ runs top to bottom without an error and
shows at least one plot.

The kernel is `python3` from ipykernel in this environment (the `test`
extra installs it), started in the repository root so that `import jlms`
finds this checkout, on the CPU platform that deviceless GPU compiles need.
"""

import ast
import os
import pathlib
import re

import pytest

nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT_SECONDS = 600


def execute(path: pathlib.Path):
  """The notebook at `path`, executed in a fresh kernel from the repository
  root; raises `nbclient.exceptions.CellExecutionError` on a failing cell."""
  notebook = nbformat.read(path, as_version=4)
  client = nbclient.NotebookClient(
      notebook, kernel_name="python3", timeout=CELL_TIMEOUT_SECONDS,
      resources={"metadata": {"path": str(ROOT)}})
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  # A kernel inherits the environment of the process that starts it;
  # the kernel manager takes it as `env` when the kernel is launched.
  client.execute(env=env)
  return notebook


def outputs(notebook):
  return [out for cell in notebook.cells if cell.cell_type == "code"
          for out in cell.get("outputs", ())]


def test_notebooks_are_valid_python_that_names_only_what_jlms_has():
  """The quick tier's check of what the slow one runs: each notebook is
  valid nbformat, its code cells parse (IPython's syntax turned into
  Python, as the kernel does), and each `jlms.NAME` it uses exists."""
  import IPython.core.inputtransformer2 as transformer  # with ipykernel
  import jlms
  to_python = transformer.TransformerManager().transform_cell
  assert NOTEBOOKS, "notebooks/ should hold at least one .ipynb"
  for path in NOTEBOOKS:
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    code = [to_python(cell.source) for cell in notebook.cells
            if cell.cell_type == "code"]
    assert code, f"{path.name} has no code"
    for source in code:
      ast.parse(source, filename=path.name)
    used = set(re.findall(r"\bjlms\.([A-Za-z_]\w*)", "\n".join(code)))
    missing = sorted(name for name in used if not hasattr(jlms, name))
    assert not missing, f"{path.name} uses jlms.{missing} (not in jlms)"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs_and_plots(path):
  notebook = execute(path)
  errors = [out for out in outputs(notebook) if out.output_type == "error"]
  assert not errors, "\n".join(f"{e.ename}: {e.evalue}" for e in errors)
  images = [out for out in outputs(notebook)
            if "image/png" in out.get("data", {})]
  assert images, f"{path.name} shows no plot"
