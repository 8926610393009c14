"""A step planned once per signature of its arguments.

`StepPlanner` is what an `OffloadedStep` asks for the program of a call:
it splits the arguments as `jax.jit` does (static, dynamic, donated),
traces the step once per signature under a nested jit, analyses the trace
(`jlms._analysed`) and fits it (`jlms._search`, or TFLMS's knobs), and
keeps the result (`PlannedStep`) for the last `CACHE_SIZE` signatures.
Where jlms fails to plan, the signature's `PlannedStep` records the
failure and the step runs as `jax.jit`'s program, with one warning, unless
`strict` or a budget that jax.jit's program is not known to meet says to
raise (`jlms._fallback`).

Guarantees: a step that jax.jit cannot trace raises jax.jit's own error;
each signature is traced and planned once while it stays cached.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import inspect
import time
from typing import Callable

import jax

from jlms import _compat
from jlms._analysed import (AnalysedProgram, PlannedStep, PlanNeeded, failed,
                            knobs_applied, predicted_baseline)
from jlms._arguments import (SplitArguments, host_positions, split_arguments,
                             traceable)
from jlms._budget import BudgetError
from jlms._fallback import raise_unless_fallback_allowed, warn_fallback
from jlms._liveness import aval_nbytes
from jlms._program import flatten
from jlms._progress import Progress
from jlms._replan import PlanCounter
from jlms._sharding import kept_shardings, leading_split
from jlms._options import DEVICE, KNOBS, MINIMUM, SearchOptions
from jlms._search import NOT_FALLEN_BACK_FROM, SearchRequest, fit_budget
from jlms._state import state_pairs
from jlms._variants import WayCache

#: Signatures whose plans a step keeps.
CACHE_SIZE = 32


class StepPlanner:
  """Plans `fun` for each signature of its arguments (see the module
  docstring)."""

  def __init__(self, fun: Callable, name: str, options: SearchOptions,
               jit_options: dict, plain_jitted, strict: bool):
    self.fun, self.name, self.options = fun, name, options
    self.jit_options = jit_options
    self.strict = strict
    # jax.jit's program of the step: its trace names what does not trace.
    self._plain_jitted = plain_jitted
    self._planned_steps: collections.OrderedDict = collections.OrderedDict()
    self._timings = PlanCounter()
    self._ways = WayCache()  # the placed ways of the steps planned last

  def split(self, args, kwargs) -> SplitArguments:
    return split_arguments(args, kwargs, self.jit_options["static_argnums"],
                           self.jit_options["static_argnames"])

  def signature(self, args, kwargs) -> tuple:
    return self.split(args, kwargs).key()

  def cached(self, key) -> PlannedStep | None:
    """The planned step of signature `key`, if it is still kept."""
    return self._planned_steps.get(key)

  def failed_to_stage(self, args, kwargs, error: Exception,
                      needs_plan: bool) -> None:
    """Staging the program of these arguments failed: from now on they run
    as jax.jit's program (or raise, as `planning_failed` says)."""
    self._planned_steps[self.signature(args, kwargs)] = self.planning_failed(
        error, needs_plan, stacklevel=7)

  def planned(self, args, kwargs) -> tuple[PlannedStep, list]:
    """The program and plan for these arguments, made once per signature,
    with their dynamic leaves."""
    split = self.split(args, kwargs)
    leaves = split.leaves
    key = split.key()
    cached = self._planned_steps.get(key)
    if cached is not None:
      self._planned_steps.move_to_end(key)
      return cached, leaves
    start = time.perf_counter()
    progress = Progress(self.name, ticking=True)
    progress.stage("tracing")
    out_trees = []

    def flat_fun(*flat):
      out = split.call(self.fun, flat)
      out_leaves, out_tree = jax.tree.flatten(out)
      out_trees.append(out_tree)
      return out_leaves

    # JAX's errors name the function they trace: the user's step, with
    # the flat signature of the leaves it is traced on.
    flat_fun.__wrapped__ = self.fun
    flat_fun.__signature__ = inspect.signature(lambda *flat: None)
    try:
      # Traced under a jit so that the jaxpr carries the params of a nested
      # jit equation: the rewritten program is staged as one such equation.
      closed = jax.make_jaxpr(jax.jit(flat_fun))(*traceable(leaves))
    except (jax.errors.JAXTypeError, TypeError) as error:
      progress.done()  # the step's own error: nothing more to say
      raise self._traced_as_jax_jit(args, kwargs, error) from None
    except BaseException:
      progress.done()
      raise
    try:
      analysis = self._planned(closed, leaves, out_trees,
                               self.donated_leaves(args, kwargs),
                               split.treedef, host_positions(leaves),
                               progress)
    except NOT_FALLEN_BACK_FROM:
      raise
    except Exception as error:  # jlms's failure, not the step's
      analysis = self.planning_failed(error, stacklevel=6)
    finally:
      progress.done()
    self._timings.record(time.perf_counter() - start, self.name)
    self._planned_steps[key] = analysis
    if len(self._planned_steps) > CACHE_SIZE:
      self._planned_steps.popitem(last=False)
    return analysis, leaves

  def _traced_as_jax_jit(self, args, kwargs, error: Exception) -> Exception:
    """The error `jax.jit(step)` raises tracing these arguments, which
    names the step and the argument's path as jax.jit does ("the argument
    batch['x']"), with a note on jittability; `error` itself where jax.jit
    traces them (the failure is then jlms's own)."""
    try:
      self._plain_jitted.trace(*args, **kwargs)
    except (jax.errors.JAXTypeError, TypeError) as named:
      if isinstance(named, jax.errors.JAXTypeError):
        named.add_note(
            f"jlms.offload({self.name}) traces the step like jax.jit "
            "does: it must be jittable (mark Python-valued arguments "
            "static with static_argnums/static_argnames).")
      return named
    return error

  def _planned(self, closed, leaves, out_trees, donated=(),
               treedef=None, arrived_on_host=(),
               progress=None) -> PlannedStep:
    """The analysis of the step traced as `closed`: its plan and the
    program that runs."""
    jit_params, debug_info = _compat.call_template(closed)
    program = dataclasses.replace(flatten(closed), donated=tuple(donated))
    plain = dataclasses.replace(
        AnalysedProgram.of(program),
        traced=_compat.call_body_closed(closed.jaxpr.eqns[0]),
        argument_names=_argument_names(program, treedef, leaves),
        leading_splits=tuple(
            leading_split(program.avals[value], leaf)
            for value, leaf in zip(program.invars, leaves)))
    request = self.search_request(plain, jit_params, debug_info, leaves,
                                   out_trees, donated, arrived_on_host,
                                   progress)
    refused = request.options.host_refused
    if refused and (self.options.budget is KNOBS
                    or self.options.state_on_host):
      asked = ("TFLMS's knobs copy values to host" if self.options.budget
               is KNOBS else "state_on_host=True keeps the state there")
      raise ValueError(
          f"jlms.offload({self.name}): {asked}, but {refused}. Pass "
          f"ordered=False to the callback, or plan under a budget without "
          f"state_on_host=True: jlms then remakes values instead")
    if self.options.budget is KNOBS:
      analysis = knobs_applied(plain, request.baseline, jit_params,
                               debug_info, out_trees, self.options.config,
                               request.time, request.link_shardings)
    else:
      try:
        analysis = fit_budget(request)
      except BudgetError as error:
        if refused:
          error.args = (f"{error}; nothing was copied to host, since "
                        f"{refused} (ordered=False lifts that)",
                        *error.args[1:])
        elif (self.options.state_on_host is False
              and state_pairs(program, donated)):
          error.args = (f"{error}; state_on_host=False kept the donated "
                        "state on the device (without it, jlms may keep "
                        "the state in pinned host memory)", *error.args[1:])
        elif (self.options.state_on_host is True
              and state_pairs(program, donated)):
          error.args = (f"{error}; state_on_host=True kept the donated "
                        "state in pinned host memory (without it, jlms "
                        "also weighs keeping it on the device)",
                        *error.args[1:])
        raise
    analysis = dataclasses.replace(analysis, plain=plain)
    if request.split > 1 and analysis.rewrites_the_step:
      analysis = dataclasses.replace(analysis, kept_shardings=kept_shardings(
          _returned_undonated(program, donated, analysis.state.outputs),
          [program.avals[v] for v in program.invars], leaves))
    if analysis.plan is not None and treedef is not None:
      analysis = dataclasses.replace(analysis, plan=_with_kinds(
          analysis.plan, analysis.state, plain.program, treedef,
          out_trees[-1]))
    return analysis

  def search_request(self, plain, jit_params, debug_info, leaves,
                      out_trees, donated=(), arrived_on_host=(),
                      progress=None) -> SearchRequest:
    """What `jlms._search` fits for the step traced and analysed as
    `plain`: with nothing in host memory where its program has an ordered
    effect."""
    options = self.options
    refused = host_refused(plain.program)
    if refused:
      options = dataclasses.replace(options, host_refused=refused)
    return SearchRequest(
        options, plain, predicted_baseline(plain), jit_params,
        debug_info, tuple(leaves), out_trees, tuple(donated),
        tuple(arrived_on_host), self._ways,
        progress or Progress(self.name),
        on_gpu=jax.default_backend() == "gpu")

  def planning_failed(self, error: Exception, needs_plan: bool = False,
                      stacklevel: int = 5) -> PlannedStep:
    """The analysis of a step that jlms failed to plan, rewrite or stage:
    it runs as jax.jit's program, with one warning; raises instead where
    that is not allowed."""
    budget = None
    if isinstance(error, PlanNeeded):
      budget, error = str(error), error.__cause__
    elif needs_plan or self.options.budget not in (KNOBS, DEVICE, MINIMUM):
      # A budget the user gave: jax.jit's program is not known to meet it.
      budget = repr(self.options.budget)
    raise_unless_fallback_allowed(error, self.name, strict=self.strict,
                                  budget=budget)
    warn_fallback(error, self.name, stacklevel=stacklevel)
    return failed(error)

  def donated_leaves(self, args, kwargs) -> tuple[int, ...]:
    """Positions, among a call's dynamic leaves, of those the step donates,
    as jax.jit reads `donate_argnums` and `donate_argnames`."""
    options = self.jit_options
    if not options["donate_argnums"] and not options["donate_argnames"]:
      return ()
    # The step's own signature, which jax.jit maps argument names through.
    signature_only = functools.wraps(self.fun)(lambda *a, **k: None)
    traced = jax.jit(signature_only, **options).trace(*args, **kwargs)
    return tuple(i for i, info in enumerate(jax.tree.leaves(traced.args_info))
                 if info.donated)


def host_refused(program) -> str:
  """Why `program` may keep no value in host memory (empty: it may): its
  ordered effects, which JAX cannot lower beside memory kinds."""
  names = list(dict.fromkeys(
      equation.readable_name() for equation in program.equations
      if _compat.has_ordered_effect(equation.eqn)))
  if not names:
    return ""
  shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
  return (f"the step has an ordered effect ({shown}: an io_callback or "
          f"jax.debug.print with ordered=True), and JAX cannot compile one "
          f"in a program that keeps values in host memory")


def _returned_undonated(program, donated, state_outputs) -> tuple:
  """(argument, output) positions of each argument not donated and the
  output of its shape and dtype that XLA would alias it with if it were
  (`jlms._state.state_pairs`), among the outputs that no donated argument
  takes and that are not state kept on host: the output the step returns
  in place of the argument."""
  taken = {o for _, o in state_pairs(program, donated)} | set(state_outputs)
  untaken = dataclasses.replace(program, outvars=tuple(
      None if position in taken else atom
      for position, atom in enumerate(program.outvars)))
  kept = [i for i in range(len(program.invars)) if i not in set(donated)]
  return state_pairs(untaken, kept)


def _argument_names(program, treedef, leaves) -> dict:
  """value id -> the path of each input leaf in the step's arguments
  ("[0]['blocks']['Dense_0']['kernel']": argument 0's)."""
  if treedef is None:
    return {}
  tree = jax.tree.unflatten(treedef, list(range(len(leaves))))
  names = {}
  for path, position in jax.tree_util.tree_leaves_with_path(tree):
    # The first key picks the positional arguments or the keywords.
    names[program.invars[position]] = (
        jax.tree_util.keystr(tuple(path[1:])) or f"argument {position}")
  return names




def _with_kinds(plan, state, program, treedef, out_tree):
  """`plan` with `argument_kinds` and `output_kinds`: pytrees shaped like
  the step's (dynamic) arguments and outputs, each leaf "device" or
  "pinned_host", and the bytes of state on host."""
  host_in, host_out = set(state.inputs), set(state.outputs)
  in_kinds = ["pinned_host" if i in host_in else "device"
              for i in range(len(program.invars))]
  out_kinds = ["pinned_host" if i in host_out else "device"
               for i in range(len(program.outvars))]
  args, kwargs = jax.tree.unflatten(treedef, in_kinds)
  return dataclasses.replace(
      plan, argument_kinds=(args, kwargs) if kwargs else args,
      output_kinds=jax.tree.unflatten(out_tree, out_kinds),
      state_host_bytes=sum(aval_nbytes(program.avals[program.invars[i]])
                           for i in state.inputs),
      state_leaves=len(state.inputs))
