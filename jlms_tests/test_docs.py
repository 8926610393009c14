"""The documentation's API reference covers jlms's public names.

Every name `jlms/__init__.py` exports (the `from m import name as name`
re-exports, and `__all__` where there is one) has an autodoc entry in
docs/api.rst, so a new public name without a reference entry fails here.
Only the source files are read: Sphinx need not be installed (the docs
build itself runs in .ci/run).
"""

import ast
import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys
import typing

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


# The code blocks of README.md and docs/*.md. Every ```python and ```bash
# block runs here, on a CPU, unless the line before it (blank lines aside)
# is one of
#   <!-- jlms-doc: setup=NAME -->     run in the namespace that
#                                     jlms_tests._doc_setups.NAME() returns
#   <!-- jlms-doc: skip: REASON -->   not run, for the reason given
# (HTML comments: neither GitHub nor the docs site shows them). A block
# without a language is printed output, and a ```{directive} is MyST's.
# The Python blocks run in one process started for them, each in a fresh
# namespace (a process each took 15 s more, importing jax and jlms again);
# each bash block in a shell of its own.

DOC_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CODE_LANGUAGES = ("python", "bash")
#: Seconds a block may take, on two busy cores (the slowest, the README's
#: example, plans and compiles for an H100 three times: about 5 s).
BLOCK_TIMEOUT_S = 60

# The language, then MyST's arguments; no backtick after the fence's own
# (CommonMark: "```` ```python ````" on a line is inline code).
_FENCE = re.compile(r"^```([^`\s]*)[^`]*$")
_MARK = re.compile(r"^<!--\s*jlms-doc:\s*(.*?)\s*-->$")
_SETUP = re.compile(r"setup=(\w+)$")
_SKIP = re.compile(r"skip:\s*(\S.*)$")


class DocBlock(typing.NamedTuple):
  page: str  # relative to the repository
  line: int  # of the opening fence
  language: str
  code: str
  mark: str  # the jlms-doc comment before the block, "" if none

  @property
  def setup(self):
    match = _SETUP.match(self.mark)
    return match and match.group(1)

  @property
  def skip_reason(self):
    match = _SKIP.match(self.mark)
    return match and match.group(1)

  def __str__(self):
    return f"{self.page}:{self.line}"


def doc_blocks(pages=DOC_PAGES) -> list[DocBlock]:
  """The fenced blocks of `pages`, in order."""
  blocks = []
  for path in pages:
    page = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    lines = path.read_text(encoding="utf-8").splitlines()
    opened, previous = None, ""
    for number, line in enumerate(lines, 1):
      fence = _FENCE.match(line.lstrip())
      if opened is None and fence:
        assert line == line.lstrip(), (
            f"{page}:{number}: an indented block, which test_docs would not "
            "see whole")
        mark = _MARK.match(previous)
        opened = (number, fence.group(1), mark.group(1) if mark else "")
      elif opened is not None and line.strip() == "```":
        start, language, mark = opened
        blocks.append(DocBlock(str(page), start, language,
                               "\n".join(lines[start:number - 1]) + "\n",
                               mark))
        opened = None
      if line.strip() and opened is None:
        previous = line.strip()
    assert opened is None, f"{page}:{opened[0]}: a block never closed"
  return blocks


_CODE_BLOCKS = [block for block in doc_blocks()
                if block.language in CODE_LANGUAGES]


def test_every_doc_block_is_code_output_or_a_directive_and_marks_are_known():
  blocks = doc_blocks()
  assert len(_CODE_BLOCKS) >= 20
  odd = [f"{b} ```{b.language}" for b in blocks
         if b.language not in CODE_LANGUAGES + ("",)
         and not b.language.startswith("{")]
  assert not odd, f"a language test_docs neither runs nor skips: {odd}"
  unknown = [f"{b}: {b.mark!r}" for b in blocks
             if b.mark and not (b.setup or b.skip_reason)]
  assert not unknown, f"jlms-doc comments not understood: {unknown}"
  from jlms_tests import _doc_setups
  missing = [f"{b}: {b.setup}" for b in blocks
             if b.setup and not hasattr(_doc_setups, b.setup)]
  assert not missing, f"no such setup in jlms_tests/_doc_setups.py: {missing}"
  marked_output = [str(b) for b in blocks if b.mark and b.language == ""]
  assert not marked_output, f"output blocks are not run: {marked_output}"
  bash_setups = [str(b) for b in blocks if b.setup and b.language == "bash"]
  assert not bash_setups, f"setups are Python: {bash_setups}"


def test_the_block_reader_finds_marks_fences_and_lines(tmp_path):
  page = tmp_path / "page.md"
  page.write_text("Text.\n\n<!-- jlms-doc: setup=train_step -->\n\n"
                  "```python\nx = 1\n```\n\n```\nprinted\n```\n\n"
                  "<!-- jlms-doc: skip: needs a GPU -->\n```bash\n"
                  "nvidia-smi\n```\n")
  first, output, gpu = doc_blocks([page])
  assert (first.line, first.language, first.code, first.setup) == (
      5, "python", "x = 1\n", "train_step")
  assert (output.language, output.code, output.mark) == ("", "printed\n", "")
  assert gpu.skip_reason == "needs a GPU" and gpu.setup is None


#: Runs the Python blocks given as JSON on stdin, each in a fresh namespace
#: and within its time, and writes each one's traceback (None if it ran),
#: printed output and seconds to the file named by argv[1].
_RUN_PYTHON_BLOCKS = r"""
import contextlib, io, json, signal, sys, time, traceback

results_path, limit = sys.argv[1], int(sys.argv[2])

def out_of_time(signum, frame):
  raise TimeoutError(f"the block took more than {limit} s")

signal.signal(signal.SIGALRM, out_of_time)
results = {}
for block in json.load(sys.stdin):
  printed, start, error = io.StringIO(), time.perf_counter(), None
  signal.alarm(limit)
  try:
    with contextlib.redirect_stdout(printed):
      namespace = {"__name__": "__main__"}
      if block["setup"]:
        from jlms_tests import _doc_setups
        namespace.update(getattr(_doc_setups, block["setup"])())
      # The block's own line numbers in a traceback.
      code = "\n" * block["line"] + block["code"]
      exec(compile(code, block["page"], "exec"), namespace)
  except BaseException:
    error = traceback.format_exc()
  finally:
    signal.alarm(0)
  results[block["id"]] = {"error": error, "printed": printed.getvalue(),
                          "seconds": time.perf_counter() - start}
with open(results_path, "w") as f:
  json.dump(results, f)
"""


def _environment() -> dict:
  return dict(os.environ, JAX_PLATFORMS="cpu", MPLBACKEND="Agg",
              PYTHONPATH=os.pathsep.join(
                  [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))


def run_python_blocks(blocks, folder, limit_s=BLOCK_TIMEOUT_S) -> dict:
  """{str(block): its result} for `blocks`, run in `folder` by one new
  Python process."""
  results = folder / "results.json"
  done = subprocess.run(
      [sys.executable, "-c", _RUN_PYTHON_BLOCKS, str(results), str(limit_s)],
      input=json.dumps([dict(id=str(b), page=b.page, line=b.line,
                             code=b.code, setup=b.setup) for b in blocks]),
      capture_output=True, text=True, cwd=folder, env=_environment(),
      timeout=limit_s * len(blocks) + 30)
  assert done.returncode == 0 and results.exists(), done.stderr[-4000:]
  return json.loads(results.read_text())


@pytest.fixture(scope="module")
def python_block_results(tmp_path_factory):
  """Each Python block's result, all run in an empty folder (what a block
  writes stays out of the repository)."""
  return run_python_blocks(
      [b for b in _CODE_BLOCKS if b.language == "python" and not b.skip_reason],
      tmp_path_factory.mktemp("doc_blocks"))


def test_a_failing_block_is_reported_at_its_line_and_a_slow_one_stopped(
    tmp_path):
  failing = DocBlock("docs/page.md", 10, "python", "x = 1\ny = x / 0\n", "")
  slow = DocBlock("docs/page.md", 20, "python",
                  "import time\ntime.sleep(30)\n", "")
  fresh = DocBlock("docs/page.md", 30, "python", "print(x)\n", "")
  results = run_python_blocks([failing, slow, fresh], tmp_path, limit_s=1)
  assert 'File "docs/page.md", line 12' in results[str(failing)]["error"]
  assert "ZeroDivisionError" in results[str(failing)]["error"]
  assert "TimeoutError: the block took more than 1 s" in (
      results[str(slow)]["error"])
  assert results[str(slow)]["seconds"] < 5
  # Each block in a namespace of its own: no x from the first.
  assert "NameError: name 'x' is not defined" in results[str(fresh)]["error"]


@pytest.mark.xdist_group("doc_blocks")  # one process runs them all
@pytest.mark.parametrize("block", _CODE_BLOCKS, ids=str)
def test_the_doc_block_runs_on_a_cpu(block, request, tmp_path):
  if block.skip_reason:
    pytest.skip(block.skip_reason)
  if block.language == "python":
    result = request.getfixturevalue("python_block_results")[str(block)]
    assert result["error"] is None, (
        f"{block} failed:\n{result['printed'][-2000:]}\n{result['error']}")
    return
  done = subprocess.run(["bash", "-euo", "pipefail", "-s"], input=block.code,
                        capture_output=True, text=True, cwd=tmp_path,
                        env=_environment(), timeout=BLOCK_TIMEOUT_S)
  assert done.returncode == 0, (
      f"{block} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")


def test_the_long_profile_runs_only_when_its_marker_is_asked_for():
  """testing.md: `python -m pytest` leaves the tests marked `long` out (as
  deselected, not skipped), and `-m long` keeps them."""
  import types
  from jlms_tests.conftest import _leave_out_the_long_profile

  class Item:
    def __init__(self, marks):
      self.marks = marks

    def get_closest_marker(self, name):
      return name if name in self.marks else None

  def run(markexpr):
    deselected = []
    config = types.SimpleNamespace(
        getoption=lambda name, default=None: markexpr,
        hook=types.SimpleNamespace(
            pytest_deselected=lambda items: deselected.extend(items)))
    items = [Item({"slow", "long"}), Item({"slow"}), Item(set())]
    _leave_out_the_long_profile(config, items)
    return [sorted(item.marks) for item in items], len(deselected)

  assert run("") == ([["slow"], []], 1)
  assert run("slow") == ([["slow"], []], 1)
  assert run("not slow") == ([["slow"], []], 1)
  assert run("long") == ([["long", "slow"], ["slow"], []], 0)
