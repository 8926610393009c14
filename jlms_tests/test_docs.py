"""The documentation's API reference covers jlms's public names.

Every name `jlms/__init__.py` exports (the `from m import name as name`
re-exports, and `__all__` where there is one) has an autodoc entry in
docs/api.rst, so a new public name without a reference entry fails here.
Only the source files are read: Sphinx need not be installed (the docs
build itself runs in .ci/run).
"""

import ast
import importlib.util
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
INIT = ROOT / "jlms" / "__init__.py"
API = ROOT / "docs" / "api.rst"

def _docs_script(name: str):
  """The module docs/`name`.py (docs/ is no package)."""
  spec = importlib.util.spec_from_file_location(
      f"docs_{name}", ROOT / "docs" / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


_DIRECTIVE = re.compile(
    r"^\.\. auto(?:function|class|exception|data|attribute)::\s+jlms\.(\w+)\s*$",
    re.MULTILINE)


def public_names() -> set[str]:
  tree = ast.parse(INIT.read_text())
  names = set()
  for node in tree.body:
    if isinstance(node, ast.ImportFrom):
      names.update(alias.asname for alias in node.names
                   if alias.asname is not None and alias.asname == alias.name)
    elif isinstance(node, ast.Assign) and any(
        isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
      names.update(ast.literal_eval(node.value))
  return names


def documented_names() -> set[str]:
  return set(_DIRECTIVE.findall(API.read_text()))


def test_public_names_are_found():
  names = public_names()
  assert {"offload", "Plan", "xla_memory", "BudgetError"} <= names


def test_every_public_name_has_a_reference_entry():
  missing = sorted(public_names() - documented_names())
  assert not missing, f"docs/api.rst has no autodoc entry for jlms.{missing}"


def test_reference_names_only_what_jlms_exports():
  stale = sorted(documented_names() - public_names())
  assert not stale, f"docs/api.rst documents jlms.{stale}, not exported"




_PAGE = """
<dl class="py class"><dt class="sig sig-object py" id="jlms.Plan">Plan</dt>
<dd><p>What jlms.offload does.</p>
<dl class="py attribute"><dt class="sig sig-object py" id="jlms.Plan.fitted">
fitted<em>: bool</em></dt><dd></dd></dl>
<dl class="py attribute"><dt class="sig sig-object py" id="jlms.Plan.config">
config</dt><dd><p>TFLMS's knobs.</p></dd></dl>
</dd></dl>
<dl class="py class"><dt class="sig sig-object py" id="jlms.Tradeoff">Tradeoff</dt>
<dd><dl class="py attribute"><dt class="sig sig-object py" id="jlms.Tradeoff.target">
target</dt><dd><p>The GPU.</p></dd></dl></dd></dl>
"""


def test_the_reference_check_finds_entries_without_text_of_their_own():
  check = _docs_script("check_reference")
  assert set(check.entries(_PAGE)) == {
      "jlms.Plan", "jlms.Plan.fitted", "jlms.Plan.config", "jlms.Tradeoff",
      "jlms.Tradeoff.target"}
  # A class whose members alone have text is empty itself.
  assert check.empty_entries(_PAGE) == ["jlms.Plan.fitted", "jlms.Tradeoff"]


@pytest.mark.slow
def test_the_built_reference_has_no_empty_entry(tmp_path):
  for module in ("sphinx", "myst_nb", "furo"):
    pytest.importorskip(module, reason='the docs extra: pip install -e ".[docs]"')
  built = subprocess.run(
      [sys.executable, "-m", "sphinx", "-q", "-b", "html", str(ROOT / "docs"),
       str(tmp_path)], capture_output=True, text=True, cwd=ROOT)
  assert built.returncode == 0, built.stderr
  check = _docs_script("check_reference")
  page = (tmp_path / "api.html").read_text(encoding="utf-8")
  assert len(check.entries(page)) > 100
  assert check.empty_entries(page) == []


def test_the_figures_script_leaves_the_committed_pictures_unless_asked(
    monkeypatch, tmp_path):
  figures = _docs_script("figures")
  drawn = []
  monkeypatch.setattr(figures, "draw", drawn.append)  # no model planned
  figures.main([])
  [folder] = drawn
  static = ROOT / "docs" / "_static"
  assert folder.resolve() != static.resolve()
  assert not folder.resolve().is_relative_to(ROOT)
  asked = tmp_path / "pictures"
  figures.main(["--out", str(asked)])
  assert drawn[1] == asked and asked.is_dir()


#: A notebook command the docs may name -> what a `pip install` beside it
#: must name for the command to exist.
_NOTEBOOK_COMMANDS = {"jupyter nbconvert": ("nbconvert",),
                      "jupyter execute": ("nbclient", ".[test]")}


def _paragraphs_naming(command: str):
  for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
    for paragraph in re.split(r"\n\s*\n", path.read_text()):
      if command in " ".join(paragraph.split()):
        yield path.name, paragraph


def test_the_docs_say_how_to_install_each_notebook_command_they_name():
  unexplained = [
      (name, command) for command, packages in _NOTEBOOK_COMMANDS.items()
      for name, paragraph in _paragraphs_naming(command)
      if "pip install" not in paragraph
      or not any(package in paragraph for package in packages)]
  assert not unexplained, f"named without its install: {unexplained}"
  assert any(_paragraphs_naming("jupyter execute")), (
      "the docs no longer say how to run the notebook again")
