"""The `jlms` command line: plan a train step for a GPU without having one.

    jlms plan MODULE:FUNCTION [--target h100] [--budget 40GiB]
              [--host-budget 64GiB] [--arg NAME=VALUE ...]
              [--html report.html] [--verbose]
    jlms targets
    python -m jlms ...   (the same)

`jlms plan` imports MODULE (the current directory is on the path, as for
`python -m`), calls FUNCTION with the `--arg` keyword arguments, and plans
the step it returns for the target GPU under the budget. It prints the plan,
XLA's device peak and host bytes of `jax.jit`'s program and of jlms's (each
compiled deviceless for the target), and the predicted step time of each;
with `--html` it also writes the plan as a self-contained HTML report. The
step is traced and compiled, never run, so `jax.ShapeDtypeStruct`s stand in
for arrays and nothing is allocated. `--verbose` logs the search (each
fit and each XLA compile with its peak) as it goes: a plan takes two to
four compiles of the step, seconds to minutes each on a CPU.

FUNCTION returns one of:

- `(step, args)` or `(step, args, kwargs)`: `args` a tuple or list of the
  step's positional arguments, `kwargs` a dict of its keyword arguments,
  each a pytree of arrays or `jax.ShapeDtypeStruct`s;
- an object with a `step` and an `abstract_args()` method returning the
  positional arguments, such as the `StepCase`s of `benchmarks/zoo.py`
  (`make_args()` is used where there is no `abstract_args()`).

The step is a plain function (planned as `jlms.offload(step)`), a `jax.jit`
of one (its static and donated arguments are not seen: give a plain
function to `jlms.offload` with them instead), or a `jlms.offload`ed step,
whose settings are kept except the target, and the budget where `--budget`
is given.

For example, from the repository's root, a two-layer GPT of the zoo
(GPT-2 small's width and vocabulary, 256 tokens, batch 8), which peaks at
1.66 GiB under `jax.jit`, on an H100 with 1.5 GiB of device memory:

    jlms plan benchmarks.zoo:gpt_case --arg layers=2 --arg seq=256 \\
        --target h100 --budget 1.5GiB --html gpt.html

Exit status: 0 when the step is planned, 1 when the budget cannot be met
or jlms cannot plan the step (the message says why), 2 for a usage error.
On a machine without a GPU, targets other than "local" compile on jax's
CPU platform (set here unless JAX_PLATFORMS is set), as deviceless
compilation needs; the `aot` extra (pip install 'jlms[aot]') provides the
compiler.
"""

from __future__ import annotations

import argparse
import ast
import html
import importlib
import inspect
import logging
import os
import sys
import warnings
from typing import Any, Sequence

import jax

from jlms._budget import BudgetError, parse_budget
from jlms._cost import time_target
from jlms._fallback import OffloadError
from jlms._offload import OffloadedStep, offload
from jlms._options import DEVICE, MINIMUM
from jlms._report import plan_html
from jlms._units import format_bytes
from jlms._verify import OffloadIneffectiveWarning, compare_memory_of_call
from jlms._xla_memory import (KNOWN_TARGETS, LOCAL_TARGET,
                              DevicelessUnavailableError, target_memory_bytes)

_GPU_TARGETS = tuple(t for t in KNOWN_TARGETS if t != LOCAL_TARGET)
_TARGETS = (*_GPU_TARGETS, LOCAL_TARGET)
_BUDGET_FORMS = ("bytes (40000000000), a size (40GiB, 512MiB, 80GB), a "
                 "percentage of the target's memory (90%), 'device' (the "
                 "target's memory, the default) or 'min' (the least device "
                 "memory jlms reaches)")
_EXPECTED = ("FUNCTION must return (step, args), (step, args, kwargs) or an "
             "object with a 'step' and an 'abstract_args()' method (such as "
             "a benchmarks.zoo StepCase)")


class _UsageError(Exception):
  """A mistake in the command line or in what it names (exit status 2)."""


def main(argv: Sequence[str] | None = None) -> int:
  """Runs the command line on `argv` (default `sys.argv[1:]`); returns the
  exit status."""
  parser = _parser()
  args = parser.parse_args(argv)
  if args.command is None:
    parser.print_help()
    return 2
  if args.command == "targets":
    return _targets()
  try:
    return _plan(args)
  except _UsageError as error:
    args.parser.error(str(error))  # exits with status 2
    raise  # not reached


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="jlms", description="Large Model Support for JAX: plan a train "
      "step's activations for a GPU's memory, on any machine.",
      epilog="Run 'jlms plan --help' for what FUNCTION returns.")
  commands = parser.add_subparsers(dest="command", metavar="COMMAND")
  plan = commands.add_parser(
      "plan", help="plan a step for a target GPU and a budget",
      formatter_class=argparse.RawDescriptionHelpFormatter,
      description="Plan the step that MODULE:FUNCTION returns for a target "
      "GPU: print the plan,\nXLA's device peak and host bytes and the "
      "predicted step time, with jax.jit\nand with jlms. The step is "
      "traced and compiled, never run.",
      epilog="FUNCTION returns (step, args), (step, args, kwargs) or an "
      "object with a 'step'\nand an 'abstract_args()' method (such as a "
      "benchmarks.zoo StepCase); arrays\nin args may be "
      "jax.ShapeDtypeStructs. The step is a function, a jax.jit of one,\n"
      "or a jlms.offload'ed step.\n\n"
      "example (from jlms's repository root):\n"
      "  jlms plan benchmarks.zoo:gpt_case --arg layers=2 --arg seq=256 "
      "\\\n      --target h100 --budget 1.5GiB --html gpt.html\n\n"
      "exit status: 0 planned, 1 the budget cannot be met or jlms cannot "
      "plan the step,\n2 usage error")
  plan.set_defaults(parser=plan)
  plan.add_argument("function", metavar="MODULE:FUNCTION",
                    help="an importable module and a function in it, "
                    "e.g. benchmarks.zoo:resnet50_case")
  plan.add_argument("--target", default="h100", type=_target,
                    help=f"the GPU to plan for: {', '.join(_GPU_TARGETS)} "
                    "(compiled deviceless) or local (the GPU attached "
                    "here); default h100")
  plan.add_argument("--budget", type=_budget,
                    help="device memory the step may use: "
                    f"{_BUDGET_FORMS.replace('%', '%%')}"
                    "; a jlms.offload'ed step keeps its own by default")
  plan.add_argument("--host-budget", type=_size, default=None,
                    help="pinned host memory the plan may hold at once "
                    "(a size); default XLA's pinned pool")
  plan.add_argument("--arg", "-a", action="append", default=[],
                    metavar="NAME=VALUE", type=_keyword,
                    help="a keyword argument of FUNCTION, VALUE a Python "
                    "literal or else a string (repeatable), e.g. "
                    "--arg layers=2 --arg 'stage_blocks=(1, 1, 1, 1)'")
  plan.add_argument("--html", metavar="PATH",
                    help="write the plan as a self-contained HTML report")
  plan.add_argument("--verbose", "-v", action="store_true",
                    help="log the search as it goes (each fit, each XLA "
                    "compile and its peak) to stderr")
  commands.add_parser("targets", help="list the GPUs jlms can plan for",
                      description="List the GPUs jlms can plan for, with "
                      "the memory and speeds its time model uses.")
  return parser


# -- arguments ------------------------------------------------------------------

def _target(text: str) -> str:
  name = text.strip().lower()
  if name not in _TARGETS:
    raise argparse.ArgumentTypeError(
        f"unknown target {text!r}; valid targets: {', '.join(_TARGETS)} "
        "(jlms targets lists them)")
  return name


def _budget(text: str) -> str:
  if text.strip().lower() in (DEVICE, MINIMUM):
    return text.strip().lower()
  try:
    parse_budget(text, lambda: 1)  # percentages are checked, not sized here
  except (ValueError, TypeError):
    raise argparse.ArgumentTypeError(
        f"cannot read budget {text!r}: use {_BUDGET_FORMS}") from None
  return text


def _size(text: str) -> str:
  try:
    parse_budget(text)
  except (ValueError, TypeError):
    raise argparse.ArgumentTypeError(
        f"cannot read size {text!r}: use bytes or a size such as 64GiB"
    ) from None
  return text


def _keyword(text: str) -> tuple[str, Any]:
  name, equals, value = text.partition("=")
  if not equals or not name.strip().isidentifier():
    raise argparse.ArgumentTypeError(
        f"expected NAME=VALUE, e.g. layers=2, got {text!r}")
  try:
    parsed = ast.literal_eval(value.strip())
  except (ValueError, SyntaxError):
    parsed = value  # not a literal: the text itself
  return name.strip(), parsed


# -- jlms targets -----------------------------------------------------------------

def _targets() -> int:
  print(f"{'target':<8} {'memory':>10} {'HBM':>10} {'bf16 peak':>13}  "
        "host link")
  for name in _GPU_TARGETS:
    model = time_target(name)
    print(f"{name:<8} {format_bytes(target_memory_bytes(name)):>10} "
          f"{model.hbm_bytes_per_s / 1e12:>6.2f} TB/s "
          f"{model.contraction_flops_per_s['bfloat16'] / 1e12:>6.0f} TFLOP/s"
          f"  {model.link}, {model.link_bytes_per_s / 1e9:.0f} GB/s each way")
  print("local    the GPU attached to this machine (timed as an h100)")
  return 0


# -- jlms plan --------------------------------------------------------------------

def _plan(args) -> int:
  if args.target != LOCAL_TARGET and "JAX_PLATFORMS" not in os.environ:
    # Deviceless GPU compiles need jax on its CPU platform (else the CUDA
    # plugin's start-up check fails without a GPU); the step never runs.
    jax.config.update("jax_platforms", "cpu")
  if args.verbose:
    handler = logging.StreamHandler()
    handler.setFormatter(
        logging.Formatter("%(relativeCreated)8.0f ms %(message)s"))
    logging.getLogger("jlms").addHandler(handler)
    logging.getLogger("jlms").setLevel(logging.INFO)
  if args.html and not os.path.isdir(
      os.path.dirname(os.path.abspath(args.html))):
    # Checked before planning, which may take minutes.
    raise _UsageError(f"--html {args.html}: its folder does not exist")
  step, step_args, step_kwargs = _step_and_arguments(
      _load(args.function), dict(args.arg))
  offloaded = _offloaded(step, args.budget, args.target, args.host_budget)
  try:
    plan = offloaded.plan(*step_args, **step_kwargs)
    comparison = _compare(offloaded, step_args, step_kwargs, args.target)
  except (BudgetError, OffloadError, DevicelessUnavailableError) as error:
    message = str(error)
    print(message if message.startswith("jlms") else f"jlms: {message}",
          file=sys.stderr)
    return 1
  print(plan)
  print()
  print(_summary(comparison))
  for problem in comparison.problems:
    print(f"jlms: warning: {problem}")
  if args.html:
    with open(args.html, "w", encoding="utf-8") as file:
      file.write(_report(args.function, comparison))
    print(f"jlms: HTML report written to {args.html}")
  return 0


def _load(spec: str):
  """The callable that `MODULE:FUNCTION` names (FUNCTION may be dotted)."""
  module_name, colon, function_name = spec.partition(":")
  if not colon or not module_name or not function_name:
    raise _UsageError(f"expected MODULE:FUNCTION, e.g. "
                      f"benchmarks.zoo:resnet50_case, got {spec!r}")
  if os.getcwd() not in sys.path and "" not in sys.path:
    sys.path.insert(0, os.getcwd())  # as `python -m` does
  try:
    found = importlib.import_module(module_name)
  except ModuleNotFoundError as error:
    if error.name is None or not module_name.startswith(error.name):
      raise  # the module itself imports something missing
    raise _UsageError(f"cannot import module {module_name!r} (from "
                      f"{os.getcwd()}): {error}") from None
  for part in function_name.split("."):
    try:
      found = getattr(found, part)
    except AttributeError:
      raise _UsageError(f"{module_name!r} has no {function_name!r}") from None
  if not callable(found):
    raise _UsageError(f"{spec} is not callable: {type(found).__name__}")
  return found


def _step_and_arguments(function, keywords: dict):
  """(step, args, kwargs) of what `function(**keywords)` returns."""
  try:
    inspect.signature(function).bind(**keywords)
  except TypeError as error:  # a parameter without a default and no --arg
    raise _UsageError(f"{_name(function)}: {error}; give each with --arg "
                      f"NAME=VALUE") from error
  except ValueError:  # no signature to read (a builtin): called as it is
    pass
  try:
    made = function(**keywords)
  except TypeError as error:
    if keywords and "argument" in str(error):  # an --arg it does not take
      raise _UsageError(f"calling {_name(function)} with "
                        f"{keywords}: {error}") from error
    raise
  if hasattr(made, "step") and not isinstance(made, tuple):
    arguments = getattr(made, "abstract_args", None) or getattr(
        made, "make_args", None)
    if not callable(arguments):
      raise _UsageError(f"{_name(function)} returned a "
                        f"{type(made).__name__} with a 'step' but no "
                        f"'abstract_args()': {_EXPECTED}")
    made = (made.step, arguments())
  if not isinstance(made, tuple) or len(made) not in (2, 3):
    raise _UsageError(f"{_EXPECTED}; {_name(function)} returned an "
                      f"object of type {type(made).__name__}")
  step, step_args, step_kwargs = (*made, {})[:3]
  if not callable(step):
    raise _UsageError(f"{_EXPECTED}; the step {_name(function)} returned is "
                      f"a {type(step).__name__}, not a function")
  if not isinstance(step_args, (tuple, list)):
    raise _UsageError(f"{_EXPECTED}; its args must be a tuple or list of "
                      f"the step's positional arguments, got a "
                      f"{type(step_args).__name__}")
  if not isinstance(step_kwargs, dict):
    raise _UsageError(f"{_EXPECTED}; its kwargs must be a dict, got a "
                      f"{type(step_kwargs).__name__}")
  return step, tuple(step_args), step_kwargs


def _name(function) -> str:
  return getattr(function, "__qualname__", repr(function))


def _offloaded(step, budget: str | None, target: str, host_budget):
  """`step` as a `jlms.offload`ed step for `target` and `budget` (None:
  the target's memory); an offloaded step keeps its own settings, its
  budget and host budget too where none is given."""
  options = dict(target=target, verify=False, strict=True)
  if isinstance(step, OffloadedStep):
    return OffloadedStep(
        step.__wrapped__, step.config, **step.jit_options, **options,
        budget=step.budget if budget is None else budget,
        min_bytes_given=step.min_bytes,
        host_budget=step.host_budget if host_budget is None else host_budget)
  return offload(step, budget=DEVICE if budget is None else budget,
                 host_budget=host_budget, **options)


def _compare(offloaded, step_args, step_kwargs, target):
  """XLA's memory of jax.jit's program and of jlms's on `target`; the
  problems it finds are printed, not warned."""
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", OffloadIneffectiveWarning)
    return compare_memory_of_call(offloaded, step_args, step_kwargs, target)


def _rows(comparison) -> list[tuple[str, str, str]]:
  """(quantity, jax.jit's, jlms's) of the summary, as text."""
  plan, target = comparison.plan, comparison.target
  rows = [(f"XLA's device peak on {target}",
           format_bytes(comparison.baseline.peak_bytes),
           format_bytes(comparison.offloaded.peak_bytes)),
          (f"XLA's host bytes on {target}",
           format_bytes(comparison.baseline.host_bytes),
           format_bytes(comparison.offloaded.host_bytes))]
  if plan.step_time is not None and plan.baseline_step_time is not None:
    rows.append((f"predicted step time on {plan.time_target}",
                 f"{plan.baseline_step_time.total_s * 1e3:.3g} ms",
                 f"{plan.step_time.total_s * 1e3:.3g} ms"))
  return rows


def _summary(comparison) -> str:
  rows = [("", "jax.jit", "jlms"), *_rows(comparison)]
  width = max(len(row[0]) for row in rows)
  return "\n".join(f"{a:<{width}}  {b:>12}  {c:>12}" for a, b, c in rows)


def _report(function: str, comparison) -> str:
  """A whole HTML page: the summary table, then `jlms._report.plan_html`."""
  title = html.escape(f"jlms plan of {function} on {comparison.target}")
  cells = lambda row, tag: "".join(f"<{tag}>{html.escape(c)}</{tag}>"
                                   for c in row)
  table = "\n".join(
      ["<table>", f"<tr>{cells(('', 'jax.jit', 'jlms'), 'th')}</tr>"]
      + [f"<tr>{cells(row, 'td')}</tr>" for row in _rows(comparison)]
      + ["</table>"])
  return "\n".join([
      "<!DOCTYPE html>", '<html lang="en">', "<head>",
      '<meta charset="utf-8">', f"<title>{title}</title>",
      "<style>body {font-family: sans-serif; margin: 1.5em;} "
      "table {border-collapse: collapse;} th, td {border: 1px solid #ccc; "
      "padding: 2px 8px; text-align: right;}</style>",
      "</head>", "<body>", f"<h3>{title}</h3>", table,
      plan_html(comparison.plan), "</body>", "</html>", ""])
