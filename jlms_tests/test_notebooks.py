"""Every notebook under notebooks/ runs top to bottom without an error and
shows at least one plot.

The kernel is `python3` from ipykernel in this environment (the `test`
extra installs it), started in the repository root so that `import jlms`
finds this checkout, on the CPU platform that deviceless GPU compiles need.
"""

import os
import pathlib

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


def test_there_are_notebooks():
  assert NOTEBOOKS, "notebooks/ should hold at least one .ipynb"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs_and_plots(path):
  notebook = execute(path)
  errors = [out for out in outputs(notebook) if out.output_type == "error"]
  assert not errors, "\n".join(f"{e.ename}: {e.evalue}" for e in errors)
  images = [out for out in outputs(notebook)
            if "image/png" in out.get("data", {})]
  assert images, f"{path.name} shows no plot"
