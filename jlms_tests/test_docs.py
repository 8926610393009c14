"""The documentation's API reference covers jlms's public names.

Every name `jlms/__init__.py` exports (the `from m import name as name`
re-exports, and `__all__` where there is one) has an autodoc entry in
docs/api.rst, so a new public name without a reference entry fails here.
Only the source files are read: Sphinx need not be installed (the docs
build itself runs in .ci/run).
"""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
INIT = ROOT / "jlms" / "__init__.py"
API = ROOT / "docs" / "api.rst"

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
