"""`jlms.offload`: a train step whose large, long-lived values live on host.

`offload(step)` returns an `OffloadedStep` that behaves like
`jax.jit(step)` (same results, same static/donated arguments, traceable
itself) but whose program is the step's jaxpr rewritten by jlms: flattened,
analysed for liveness, with swap-outs to pinned host memory and prefetches
back pinned in place by optimization barriers.

Guarantees: for every abstract signature the rewrite is computed once and
cached; outputs equal `jax.jit(step)`'s (host copies are exact); calling the
step under an outer trace (`jax.jit(step)`, `.lower` with
`ShapeDtypeStruct`s of other devices) emits the rewritten program into that
trace; where jlms fails to plan, rewrite or compile a signature's program,
that signature runs as `jax.jit`'s program (`jlms._fallback` says when it
raises instead).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import os
import time
import warnings
from typing import Any, Callable, Sequence

import jax
import numpy as np

from jlms import _compat
from jlms._arguments import (SplitArguments, committed_where_they_are,
                             complete_argnums, host_positions,
                             split_arguments, traceable,
                             with_state_on_device)
from jlms._config import OffloadConfig, SyncMode
from jlms._fallback import (OffloadError, describe,
                            raise_unless_fallback_allowed, warn_fallback)
from jlms._liveness import analyse, aval_nbytes
from jlms._loop_remat import (cheapest, loop_rematerializations,
                              rematerialize_in_loops)
from jlms._loop_sink import loop_sinks, sink_into_loops
from jlms._loops import find_scan_residuals, offload_scan_residuals
from jlms._state import (STATE_ON_HOST_COMPILER_OPTIONS, HostState, host_state,
                         keep_state_on_host, state_pairs)
from jlms._plan import Plan, build_plan
from jlms._planner import Offload, plan_offloads
from jlms._replan import PlanCounter
from jlms._program import Program, flatten
from jlms._rewrite import rewrite
from jlms._sharding import abstract_arguments, unseen_split
from jlms._serialize import serialized_equations
from jlms._simulator import analyse_fusion, simulate
from jlms._units import format_bytes
from jlms._budget import BudgetError, parse_budget
from jlms._cost import kernel_seconds, time_target
from jlms._fit import fit
from jlms._tradeoff import Tradeoff, TradeoffPoint
from jlms._placement import place_fused_at_readers
from jlms._schedule import predict_step_time
from jlms._verify import compare_memory_of_call
from jlms._xla_memory import (KNOWN_TARGETS, DevicelessUnavailableError,
                              target_memory_bytes, target_of_arguments,
                              xla_memory)

_CACHE_SIZE = 32
# Failures that are the user's to act on, never hidden by running jax.jit's
# program instead: a budget that cannot be met, a GPU target this machine
# cannot compile for (the error says what to install).
_NOT_FALLEN_BACK_FROM = (BudgetError, DevicelessUnavailableError)

# What `budget` can be besides bytes or a size: TFLMS's knobs apply as given
# (`KNOBS`, when knobs are passed and no budget), fit the memory of the
# device the step is compiled for (`DEVICE`, the default), or use as little
# device memory as jlms can reach (`MINIMUM`).
KNOBS = "knobs"
DEVICE = "device"
MINIMUM = "min"
_CONFIRMATIONS = 2  # XLA compiles of a plan at most (after the step as it is)
# A plan whose XLA peak leaves more than this share of the budget unused is
# fitted once more with that room, and the new plan is taken if XLA says it
# fits and it is faster by more than `_FASTER_BY` (a compile buys a step
# time that every step then saves).
_UNUSED_ROOM = 0.01
_FASTER_BY = 0.001
# Shares of a scan's residuals (the cheapest to remake first) that the
# backward loop remakes, one variant of the step each.
_LOOP_REMAT_FRACTIONS = (0.25, 0.5, 0.75, 1.0)
# For the least memory, ways whose predicted peak is within this factor of
# the smallest count as reaching it: the fastest of them is chosen.
_LEAST_PEAK_SLACK = 1.01
# Under a budget, the optimizer's moments go to host in steps of this share
# of their bytes, the largest leaves first, until the plan fits.
_STATE_LEVEL_SHARE = 0.125
_STATE_MIN_BYTES = 64 << 10

log = logging.getLogger("jlms")


class StateOnDeviceWarning(UserWarning):
  """State that jlms keeps in pinned host memory arrived on the device:
  the step copies it to host first. `OffloadedStep.place` puts it there."""


@dataclasses.dataclass(frozen=True)
class _Analysed:
  """A flat program with its liveness and fusion (analysed once, read by
  the planner, the simulator, the time model and the rewrite)."""
  program: Program
  liveness: Any
  fusion: Any
  # The step's own jaxpr as traced, for the step that runs unchanged.
  traced: Any = None
  # The state kept on host between steps (`jlms._state`), and the copies
  # of it that the program makes (for the time model).
  state: HostState = HostState((), ())
  state_copies: tuple = ()
  # value id -> the argument's path in the step's arguments, for names.
  argument_names: Any = None

  @classmethod
  def of(cls, program: Program) -> "_Analysed":
    liveness = analyse(program)
    return cls(program, liveness, analyse_fusion(program, liveness))


class _PlanNeeded(Exception):
  """Planning failed where the step does not fit its budget as it is (the
  failure is the `__cause__`)."""

  def __init__(self, budget: int):
    super().__init__(format_bytes(budget))


@dataclasses.dataclass(frozen=True)
class _Analysis:
  program: Program
  offloads: tuple[Offload, ...]
  plan: Plan
  out_tree: Any
  rewritten: Any  # the closed jaxpr that runs
  jit_params: dict  # params of the nested-jit equation that stages it
  plain: Any = None  # the step as traced, analysed (`_Analysed`)
  # Makes `rewritten` again with the copies left out; None where jlms did
  # not rewrite the step.
  rewrite_without_copies: Callable[[], Any] | None = None
  # The step does not fit its budget as jax.jit's program.
  needs_plan: bool = False
  # Why jlms has no program for these arguments (the step then runs as
  # jax.jit's); None when it has one.
  failure: BaseException | None = None
  # The state the program takes from host and gives back there: positions
  # among the call's dynamic leaves and among its output leaves.
  state: HostState = HostState((), ())

  @property
  def rewrites_the_step(self) -> bool:
    """Whether the program that runs is jlms's, not the step as traced."""
    return self.failure is None and self.rewrite_without_copies is not None

  def without_copies(self):
    """The closed jaxpr that runs, with the same barriers and
    recomputations but no copies to host: what the benchmarks time to
    price the barriers alone."""
    if self.rewrite_without_copies is None:
      return self.rewritten
    return self.rewrite_without_copies()


class OffloadedStep:
  """A jitted train step with host offload. See `jlms.offload`."""

  def __init__(self, fun: Callable, config: OffloadConfig, *,
               static_argnums=(), static_argnames=(), donate_argnums=(),
               donate_argnames=(), verify=None, budget=DEVICE, target=None,
               min_bytes_given=None, host_budget=None, strict=False,
               state_on_host=None):
    if not callable(fun):
      raise TypeError(f"jlms.offload expects a callable, got {type(fun)}")
    functools.update_wrapper(self, fun)
    self._fun = fun
    self.config = config
    # Completed as jax.jit completes them: the wrapper that jax.jit traces
    # takes (*args, **kwargs), so jax cannot see the step's signature.
    self._static_argnums, self._static_argnames = complete_argnums(
        fun, static_argnums, static_argnames)
    donate_argnums, donate_argnames = complete_argnums(
        fun, donate_argnums, donate_argnames)
    self._analyses: collections.OrderedDict = collections.OrderedDict()
    self._plans = PlanCounter()
    self._variants: dict = {}  # id(plain program) -> its placed variants
    self.jit_options = dict(
        static_argnums=self._static_argnums,
        static_argnames=self._static_argnames,
        donate_argnums=donate_argnums, donate_argnames=donate_argnames)
    self._jitted = jax.jit(_named_like(self._rewritten, fun),
                           **self.jit_options)
    # The same, for signatures whose state the plan keeps on host.
    self._jitted_state_on_host = jax.jit(
        _named_like(self._rewritten, fun),
        compiler_options=dict(STATE_ON_HOST_COMPILER_OPTIONS),
        **self.jit_options)
    # jax.jit's own program, for signatures whose program jlms failed to
    # compile (jax.jit keeps the trace of `_rewritten` that failed).
    self._plain_jitted = jax.jit(fun, **self.jit_options)
    # jax.jit's program from the trace jlms already made: what `verify`
    # compares with (a second jax.jit of `fun` would trace the step again).
    self._as_traced_jitted = jax.jit(_named_like(self._as_traced, fun),
                                     **self.jit_options)
    self._fallen_back: dict = {}  # signature -> jlms's failure
    self.strict = strict
    self._verify = verify
    self._verified: set = set()
    # The named budgets are told apart by identity below: a string equal to
    # one (read from a command line, say) is made that one.
    self.budget = next((named for named in (KNOBS, DEVICE, MINIMUM)
                        if budget == named), budget)
    self.target = target
    # The smallest value a budget's fit may move: the knob if given.
    self._fit_min_bytes = min_bytes_given
    self.host_budget = host_budget
    if host_budget is not None:
      parse_budget(host_budget)  # reject malformed budgets now
    if target is not None and target not in KNOWN_TARGETS:
      # Where XLA confirms a budget; each has a time model.
      raise ValueError(f"jlms.offload: unknown target {target!r}; valid "
                       f"targets: {', '.join(KNOWN_TARGETS)}")
    if self.budget not in (KNOBS, DEVICE, MINIMUM):
      parse_budget(budget, lambda: 1)  # reject malformed budgets now
    if state_on_host not in (None, True, False):
      raise TypeError("jlms.offload: state_on_host is True, False or None, "
                      f"not {state_on_host!r}")
    if state_on_host and self.budget is KNOBS:
      raise ValueError(
          "jlms.offload: state_on_host is planned under a budget; TFLMS's "
          "knobs (min_bytes, swapout_threshold, ...) move activations only. "
          "Pass budget= (or no knob) to keep the state on host")
    if state_on_host and not (donate_argnums or donate_argnames):
      raise ValueError(
          "jlms.offload: state_on_host=True keeps on host the donated "
          "arguments that the step returns updated (parameters, optimizer "
          "state); donate them with donate_argnums or donate_argnames")
    self.state_on_host = state_on_host
    self._warned_state: set = set()

  def __repr__(self) -> str:
    return f"jlms.offload({self._name}, {self.config})"

  # -- the jax.jit surface -------------------------------------------------
  def __call__(self, *args, **kwargs):
    if jax.config.jax_disable_jit:
      return self._fun(*args, **kwargs)  # op by op, as jax.jit's step runs
    args, kwargs = committed_where_they_are(args, kwargs)
    args, kwargs = self._state_placed(args, kwargs)
    program = self._program_for(args, kwargs)
    if program is self._plain_jitted:
      return self._as_jax_jit(args, kwargs)
    try:
      self._check_once(args, kwargs)
      return program(*args, **kwargs)
    except Exception as error:  # handled outside, so as not to chain
      failure = error
    return self._after_failure(failure, args, kwargs)

  def _program_for(self, args, kwargs):
    """The jitted program for these arguments: jlms's, or jax.jit's where
    jlms's failed to compile."""
    if self._has_fallen_back(args, kwargs):
      return self._plain_jitted
    if self._keeps_state_on_host(args, kwargs):
      return self._jitted_state_on_host
    return self._jitted

  def _has_fallen_back(self, args, kwargs) -> bool:
    """Whether jlms's program failed for these arguments' signature, which
    then runs as jax.jit's."""
    return bool(self._fallen_back) and (
        self._signature(args, kwargs) in self._fallen_back)

  def _may_keep_state_on_host(self) -> bool:
    """Whether any plan of this step may keep state on host: one made
    under a budget, of a step that donates its state."""
    return (self.budget is not KNOBS and self.state_on_host is not False
            and bool(self.jit_options["donate_argnums"]
                     or self.jit_options["donate_argnames"]))

  def _keeps_state_on_host(self, args, kwargs) -> bool:
    """Whether the plan for these arguments keeps state on host."""
    if not self._may_keep_state_on_host():
      return False
    analysis = self._analysis(args, kwargs)[0]
    return analysis.failure is None and bool(analysis.state)

  def _after_failure(self, error: Exception, args, kwargs):
    """The step's outputs by jax.jit's program when `error` is a failure of
    jlms's program (compiling or checking it); raises `error` unchanged
    when it is the step's own."""
    key = self._failed_in_jlms(error, args, kwargs)
    if key is None:
      raise error
    analysis = self._analyses[key]
    raise_unless_fallback_allowed(
        error, self._name, strict=self.strict,
        budget=format_bytes(analysis.plan.budget_bytes)
        if analysis.needs_plan else None)
    # jax.jit's own error, if it fails too, is the step's: it propagates.
    outputs = self._as_jax_jit(args, kwargs)
    self._fallen_back[key] = error
    warn_fallback(error, self._name, stacklevel=3)
    return outputs

  def _as_jax_jit(self, args, kwargs):
    """The step's outputs by jax.jit's program, with its state on the
    device: state that a plan kept on host is copied back first (jax.jit's
    program cannot take it from host; the state then stays on the device,
    as under jax.jit)."""
    args, kwargs = with_state_on_device((args, kwargs), abstract=False)
    return self._plain_jitted(*args, **kwargs)

  def _failed_in_jlms(self, error: Exception, args, kwargs):
    """The signature whose jlms program raised `error`; None when the error
    is not jlms's: the step's own (tracing it failed, or its program is
    jax.jit's), a decision already made (`OffloadError`, `BudgetError`),
    inside an outer trace, or after donated arguments were consumed."""
    if isinstance(error, (OffloadError, *_NOT_FALLEN_BACK_FROM)):
      return None
    leaves = jax.tree.leaves((args, kwargs))
    if any(isinstance(x, jax.core.Tracer) or (
        isinstance(x, jax.Array) and x.is_deleted()) for x in leaves):
      return None
    try:
      key = self._signature(args, kwargs)
    except TypeError:  # an argument jax.jit refuses too
      return None
    analysis = self._analyses.get(key)
    if analysis is None or not analysis.rewrites_the_step:
      return None
    return key

  def _state_placed(self, args, kwargs):
    """The call's arguments with the state that the plan keeps on host in
    pinned host memory: state that arrives on the device is copied there
    first (by `place`; the caller's arrays stay valid), with one warning
    per signature that says what it costs."""
    if not self._may_keep_state_on_host():
      return args, kwargs
    leaves = self._split(args, kwargs).leaves
    if any(isinstance(x, jax.core.Tracer) for x in leaves):
      return args, kwargs  # under an outer trace: `_rewritten` copies
    analysis = self._analysis(args, kwargs)[0]
    if analysis.failure is not None or not analysis.state:
      return args, kwargs
    if self._has_fallen_back(args, kwargs):
      return args, kwargs  # jax.jit's program runs, with the state on device
    arrived = [leaves[i] for i in analysis.state.inputs
               if isinstance(leaves[i], jax.Array)
               and leaves[i].sharding.memory_kind != "pinned_host"]
    if not arrived:
      return args, kwargs
    key = self._signature(args, kwargs)
    if key not in self._warned_state:
      self._warned_state.add(key)
      self._warn_state_on_device(analysis, arrived)
    placed = self.place(*args, **kwargs)
    return (placed, {}) if not kwargs else placed

  def _warn_state_on_device(self, analysis, arrived) -> None:
    size = sum(x.nbytes for x in arrived)
    target = time_target(self.target)
    warnings.warn(
        f"jlms.offload({self._name}) keeps {len(analysis.state.inputs)} "
        f"state leaves in pinned host memory between steps, but "
        f"{len(arrived)} of them ({format_bytes(size)}) arrived on the "
        f"device: they are copied to host first (about "
        f"{1e3 * target.transfer_seconds(size):.3g} ms over "
        f"{target.link} on {target.name}) and returns the state on host. "
        "Place the state once before the first step: "
        "`args = step.place(*args)`", StateOnDeviceWarning, stacklevel=4)

  @property
  def _name(self) -> str:
    return getattr(self._fun, "__qualname__", repr(self._fun))

  def _check_once(self, args, kwargs) -> None:
    """Checks with XLA, once per signature when asked, that jlms's program
    keeps what it offloads on host and lowers the peak."""
    unverified = self._unverified_signature(args, kwargs)
    if unverified is None:
      return
    if self._analysis(args, kwargs)[0].failure is None:  # else: jax.jit's
      # Not through `self.memory`: the step may take a `target` of its own.
      compare_memory_of_call(self, args, kwargs, "local")
    # Marked once it has run: a check that raised runs again next call.
    self._verified.add(unverified)

  def _unverified_signature(self, args, kwargs):
    """The signature of this call if it is to be checked with XLA: on a GPU,
    the first concrete call of each signature checks that the offload is
    effective (it costs one extra compile of each). None otherwise."""
    verify = self._verify
    if verify is None:
      verify = jax.default_backend() == "gpu"
    if not verify:
      return None
    leaves = jax.tree.leaves((args, kwargs))
    if any(isinstance(x, jax.core.Tracer) for x in leaves):
      return None
    key = self._signature(args, kwargs)
    return None if key in self._verified else key

  def tradeoff(self, *args, budgets=None, points: int = 6,
               **kwargs) -> Tradeoff:
    """Predicted step time against device budget for these arguments: the
    fastest fit (simulator and time model, no compile) of each budget in
    `budgets` (bytes or sizes), by default `points` budgets from the least
    memory jlms reaches up to `jax.jit`'s predicted peak."""
    plain = self._runnable_analysis(args, kwargs).plain
    times = time_target(self.target)
    baseline = _predicted_baseline(plain)
    least = self._fastest_fit(plain, None, times)[2]
    if budgets is None:
      low, high = int(1.01 * least.timeline.peak_bytes), baseline.peak_bytes
      budgets = [int(low + (high - low) * i / max(points - 1, 1))
                 for i in range(points)]
    rows = []
    for budget in budgets:
      budget = parse_budget(budget)
      try:
        _, residuals, result = self._fastest_fit(plain, budget, times)
      except BudgetError:
        rows.append(TradeoffPoint(budget, None, None, 0, 0, 0))
        continue
      rows.append(TradeoffPoint(
          budget, result.timeline.peak_bytes, result.step_time,
          result.recomputed, result.transferred, len(residuals)))
    jit_time = self._predict_times(times, plain, None, (), None, ())[0]
    return Tradeoff(tuple(rows), baseline.peak_bytes, jit_time,
                    least.timeline.peak_bytes, times.name)

  def lower(self, *args, **kwargs) -> jax.stages.Lowered:
    """The `jax.stages.Lowered` of the program that runs: the rewritten
    one, or jax.jit's where jlms failed. State kept on host is taken from
    pinned host memory, as on a GPU, even from abstract arguments of
    compile-only devices (which carry no memory kind)."""
    program = self._program_for(args, kwargs)
    if program is self._jitted_state_on_host:
      analysis = self._analysis(args, kwargs)[0]
      if analysis.failure is None and analysis.state:
        # Lowered for the state in pinned host memory, as `__call__` runs
        # it (never a device argument donated to a host output).
        args, kwargs, unmarked = self._placed_abstractly(
            args, kwargs, analysis.state.inputs)
        lowered = program.lower(*args, **kwargs)
        if unmarked:
          _compat.mark_host_arguments(lowered, unmarked)
        return lowered
    return program.lower(*args, **kwargs)

  def _placed_abstractly(self, args, kwargs, positions):
    """`args` and `kwargs` with the leaves at `positions` as abstract
    arrays in pinned host memory, and the positions among them whose
    devices drop that memory kind (compile-only devices: their lowering
    is marked instead)."""
    split = self._split(args, kwargs)
    leaves = list(split.leaves)
    unmarked = []
    for i in positions:
      leaf = leaves[i]
      sharding = getattr(leaf, "sharding", None)
      if not isinstance(sharding, jax.sharding.Sharding):
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
      sharding = sharding.with_memory_kind("pinned_host")
      if sharding.memory_kind != "pinned_host":
        unmarked.append(i)
      leaves[i] = jax.ShapeDtypeStruct(
          leaf.shape, leaf.dtype, sharding=sharding,
          weak_type=getattr(leaf, "weak_type", False))
    return (*split.rebuilt(leaves), tuple(unmarked))

  def place(self, *args, **kwargs):
    """The arguments (`args`, or `(args, kwargs)` when keywords are given)
    with each leaf in the memory the step takes it
    from: the state that the plan keeps on host copied to pinned host
    memory (by one jitted copy per leaf's device set, far faster than
    `jax.device_put` to host outside jit), everything else as it is. Call
    it once before the first step; the step returns the state where it
    takes it."""
    analysis = self._runnable_analysis(args, kwargs)
    if not analysis.state:
      return args, kwargs
    split = self._split(args, kwargs)
    leaves = list(split.leaves)
    moved = [i for i in analysis.state.inputs
             if isinstance(leaves[i], jax.Array)
             and leaves[i].sharding.memory_kind != "pinned_host"]
    if moved:
      copied = _to_pinned_host([leaves[i] for i in moved])
      for i, leaf in zip(moved, copied):
        leaves[i] = leaf
    placed_args, placed_kwargs = split.rebuilt(leaves)
    return (placed_args, placed_kwargs) if kwargs else placed_args

  def trace(self, *args, **kwargs) -> jax.stages.Traced:
    return self._program_for(args, kwargs).trace(*args, **kwargs)

  def eval_shape(self, *args, **kwargs):
    return self._jitted.eval_shape(*args, **kwargs)

  # -- what it does ----------------------------------------------------------
  def plan(self, *args, **kwargs) -> Plan:
    """The offload plan for these arguments (arrays or ShapeDtypeStructs).
    Raises `jlms.OffloadError` where jlms failed for them (the step runs
    as jax.jit's program)."""
    return self._runnable_analysis(args, kwargs).plan

  def _runnable_analysis(self, args, kwargs) -> _Analysis:
    """The analysis of these arguments; `OffloadError` where jlms failed
    to plan or compile them."""
    analysis = self._analysis(args, kwargs)[0]
    failure = analysis.failure
    if failure is None and self._fallen_back:
      failure = self._fallen_back.get(self._signature(args, kwargs))
    if failure is not None:
      raise OffloadError(
          f"jlms.offload({self._name}) has no plan that runs for these "
          f"arguments: jlms failed with {describe(failure)}; the step runs "
          "as jax.jit's program") from failure
    return analysis

  def memory(self, *args, target: str = "h100", **kwargs):
    """XLA's memory for `target` ("h100", "h200", "a100" deviceless, or
    "local") with and without jlms, as a `jlms.MemoryComparison`; warns with
    `jlms.OffloadIneffectiveWarning` when the offload does nothing."""
    return compare_memory_of_call(self, args, kwargs, target)

  # -- internals -----------------------------------------------------------
  def _split(self, args, kwargs) -> SplitArguments:
    return split_arguments(args, kwargs, self._static_argnums,
                           self._static_argnames)

  def _signature(self, args, kwargs) -> tuple:
    return self._split(args, kwargs).key()

  def _analysis(self, args, kwargs) -> tuple[_Analysis, list]:
    """The cached analysis for these arguments, with their dynamic leaves."""
    split = self._split(args, kwargs)
    leaves = split.leaves
    key = split.key()
    cached = self._analyses.get(key)
    if cached is not None:
      self._analyses.move_to_end(key)
      return cached, leaves
    start = time.perf_counter()
    out_trees = []

    def flat_fun(*flat):
      out = split.call(self._fun, flat)
      out_leaves, out_tree = jax.tree.flatten(out)
      out_trees.append(out_tree)
      return out_leaves

    try:
      # Traced under a jit so that the jaxpr carries the params of a nested
      # jit equation: the rewritten program is staged as one such equation.
      closed = jax.make_jaxpr(jax.jit(flat_fun))(*traceable(leaves))
    except jax.errors.JAXTypeError as e:
      e.add_note("jlms.offload traces the step like jax.jit does: it must be "
                 "jittable (mark Python-valued arguments static with "
                 "static_argnums/static_argnames).")
      raise
    try:
      analysis = self._planned(closed, leaves, out_trees,
                               self._donated_leaves(args, kwargs),
                               split.treedef, host_positions(leaves))
    except _NOT_FALLEN_BACK_FROM:
      raise
    except Exception as error:  # jlms's failure, not the step's
      analysis = self._planning_failed(error)
    self._plans.record(time.perf_counter() - start, self._name)
    self._analyses[key] = analysis
    if len(self._analyses) > _CACHE_SIZE:
      self._analyses.popitem(last=False)
    return analysis, leaves

  def _planned(self, closed, leaves, out_trees, donated=(),
               treedef=None, arrived_on_host=()) -> _Analysis:
    """The analysis of the step traced as `closed`: its plan and the
    program that runs."""
    jit_params, debug_info = _compat.call_template(closed)
    program = dataclasses.replace(flatten(closed), donated=tuple(donated))
    plain = dataclasses.replace(
        _Analysed.of(program),
        traced=_compat.call_body_closed(closed.jaxpr.eqns[0]),
        argument_names=_argument_names(program, treedef, leaves))
    baseline = simulate(plain.program, plain.liveness, fusion=plain.fusion)
    if self.budget is KNOBS:
      analysis = self._apply_knobs(plain, baseline, jit_params, debug_info,
                                   out_trees)
    else:
      analysis = self._fit_budget(plain, baseline, jit_params, debug_info,
                                  leaves, out_trees, donated,
                                  arrived_on_host)
    analysis = dataclasses.replace(analysis, plain=plain)
    if analysis.plan is not None and treedef is not None:
      analysis = dataclasses.replace(analysis, plan=_with_kinds(
          analysis.plan, analysis.state, plain.program, treedef,
          out_trees[-1]))
    return analysis

  def _planning_failed(self, error: Exception,
                       needs_plan: bool = False) -> _Analysis:
    """The analysis of a step that jlms failed to plan, rewrite or stage:
    it runs as jax.jit's program, with one warning; raises instead where
    that is not allowed."""
    budget = None
    if isinstance(error, _PlanNeeded):
      budget, error = str(error), error.__cause__
    elif needs_plan or self.budget not in (KNOBS, DEVICE, MINIMUM):
      # A budget the user gave: jax.jit's program is not known to meet it.
      budget = repr(self.budget)
    raise_unless_fallback_allowed(error, self._name, strict=self.strict,
                                  budget=budget)
    warn_fallback(error, self._name, stacklevel=4)
    return _Analysis(None, (), None, None, None, None, failure=error)

  def _apply_knobs(self, plain, baseline, jit_params, debug_info,
                   out_trees) -> _Analysis:
    """TFLMS's rules with the expert's knobs, exactly: scan residuals
    streamed, then every value far enough from its next read offloaded."""
    plain_program, plain_liveness = plain.program, plain.liveness
    residuals = ()
    if self.config.scan_residuals:
      residuals = find_scan_residuals(plain_program, plain_liveness,
                                      self.config)
    program = offload_scan_residuals(plain_program, residuals)
    liveness = analyse(program)
    unforced = analyse_fusion(program, liveness)
    offloads = plan_offloads(program, liveness, self.config,
                             unforced.materialized)
    forced = analyse_fusion(program, liveness,
                            frozenset(o.value for o in offloads))
    rewritten, without_copies = self._rewrite(
        program, liveness, offloads, self.config, debug_info, forced)
    timeline = simulate(program, liveness, offloads, forced)
    plan = build_plan(
        program, liveness, offloads, self.config, baseline, timeline,
        residuals=residuals,
        serialized=len(_serialized(program, liveness, self.config, forced)),
        **self._step_times(plain, (program, liveness, forced), offloads,
                           self.config.sync_mode, residuals))
    return _Analysis(program, offloads, plan, out_trees[-1], rewritten,
                     jit_params, rewrite_without_copies=without_copies)

  def _step_times(self, plain, planned=None, offloads=(),
                  sync_mode=SyncMode.NONE, residuals=()) -> dict:
    """Plan fields that predict, when asked, the step time of `jax.jit`'s
    program and, given the `planned` (program, liveness, fusion), of the
    plan's."""
    target = time_target(self.target)
    return dict(step_times=lambda: self._predict_times(
        target, plain, planned, offloads, sync_mode, residuals),
                time_target=target.name)

  @staticmethod
  def _predict_times(target, plain, planned, offloads, sync_mode, residuals):
    # Priced with fused equations where XLA runs them, as `jlms._fit` does.
    placed = _Analysed.of(place_fused_at_readers(
        plain.program, plain.liveness, plain.fusion))
    baseline = predict_step_time(
        placed.program, placed.liveness,
        kernel_seconds(placed.program, target, placed.fusion,
                       placed.liveness), (), target)
    step_time = baseline
    if planned is not None:
      program, liveness, fusion = planned
      step_time = predict_step_time(
          program, liveness,
          kernel_seconds(program, target, fusion, liveness), offloads,
          target, sync_mode, residuals)
    return baseline, step_time

  @staticmethod
  def _rewrite(program, liveness, offloads, config, debug_info, fusion=None):
    """The rewritten closed jaxpr, and a function that makes it again with
    the copies left out."""
    if fusion is None:
      fusion = analyse_fusion(program, liveness,
                              frozenset(o.value for o in offloads))
    return _rewrite_twice(
        program, offloads, config, debug_info, fusion=fusion,
        serialized=_serialized(program, liveness, config, fusion))

  def _confirm_target(self, leaves=()) -> str | None:
    """Where XLA confirms a budget: the named target, else (for the
    device's memory) the GPU target whose compile-only devices the
    arguments `leaves` are placed on, else the local GPU, else nowhere (a
    CPU has no GPU compiler to ask)."""
    if self.target is not None:
      return self.target
    # The device's memory, with arguments on a target's devices: that one.
    placed_on = target_of_arguments(leaves) if self.budget is DEVICE else None
    if placed_on is not None:
      return placed_on
    return "local" if jax.default_backend() == "gpu" else None

  @staticmethod
  def _xla_peak(jit_params, rewritten, abstract, target, donated=(),
                host_inputs=()) -> int:
    """XLA's peak of `rewritten` on `target`, its `donated` leaves donated
    as the step donates them (XLA reuses their buffers for outputs), its
    `host_inputs` leaves taken from pinned host memory."""
    def program_fn(*leaves):
      return _compat.bind_jit(jit_params, rewritten,
                              _placed_for(leaves, host_inputs))
    options = dict(STATE_ON_HOST_COMPILER_OPTIONS) if host_inputs else None
    jitted = jax.jit(program_fn, donate_argnums=donated,
                     compiler_options=options)
    return xla_memory(_HostArguments(jitted, host_inputs), *abstract,
                      target=target).peak_bytes

  def _donated_leaves(self, args, kwargs) -> tuple[int, ...]:
    """Positions, among a call's dynamic leaves, of those the step donates,
    as jax.jit reads `donate_argnums` and `donate_argnames`."""
    options = self.jit_options
    if not options["donate_argnums"] and not options["donate_argnames"]:
      return ()
    # The step's own signature, which jax.jit maps argument names through.
    signature_only = functools.wraps(self._fun)(lambda *a, **k: None)
    traced = jax.jit(signature_only, **options).trace(*args, **kwargs)
    return tuple(i for i, info in enumerate(jax.tree.leaves(traced.args_info))
                 if info.donated)

  def _budget_bytes(self, target: str | None) -> int | None:
    """The budget in bytes per device; None for "as little as jlms can" or
    when there is no device to fit (a CPU and no target named)."""
    if self.budget is MINIMUM:
      return None
    if self.budget is DEVICE:
      if target is None:
        return None
      return target_memory_bytes(target)
    return parse_budget(self.budget,
                        lambda: target_memory_bytes(target or "local"))

  def _fit_budget(self, plain, baseline, jit_params, debug_info, leaves,
                  out_trees, donated=(), arrived_on_host=()) -> _Analysis:
    """The fastest plan whose peak fits the budget: `jlms._fit` chooses per
    value with the simulator and the time model; XLA (on `target`, else on
    the local GPU) confirms the peak, and the choice is made again for a
    proportionally tighter budget while XLA's peak does not fit. The
    budget is per device: XLA compiles the step with the shardings of
    `leaves`."""
    plain_program, plain_liveness = plain.program, plain.liveness
    target = self._confirm_target(leaves)
    budget = self._budget_bytes(target)
    if self.budget is DEVICE and budget is None:
      log.info("jlms: no GPU here and no target named: the step runs as "
               "jax.jit's program")
      return self._as_is(plain, baseline, jit_params, debug_info, out_trees,
                         None, None)
    avals = [plain_program.avals[v] for v in plain_program.invars]
    abstract = abstract_arguments(avals, leaves)
    log.info("jlms: the step has %d equations and %d values; its arguments "
             "take %s", len(plain_program), len(plain_program.avals),
             format_bytes(sum(plain_liveness.nbytes[v]
                              for v in plain_program.invars)))
    levels = self._state_levels(plain, donated, budget, arrived_on_host)
    if levels[0].state:  # asked for, or the least memory: never as it is
      return self._search_levels(levels, baseline, jit_params, debug_info,
                                 leaves, out_trees, target, budget, avals,
                                 abstract, None, donated)
    plain_peak = None
    if budget is not None and baseline.peak_bytes <= budget and target is None:
      log.info("jlms: the step fits %s as it is (predicted %s); nothing is "
               "rewritten", format_bytes(budget),
               format_bytes(baseline.peak_bytes))
      return self._as_is(plain, baseline, jit_params, debug_info, out_trees,
                         budget, None)
    if budget is not None and target is not None:
      # The simulator can be off either way: ask XLA before offloading.
      as_is, _ = self._rewrite(plain_program, plain_liveness, (),
                               self.config, debug_info, plain.fusion)
      plain_peak = self._xla_peak(jit_params, as_is, abstract, target,
                                  donated)
      log.info("jlms: XLA's peak on %s without offloading: %s", target,
               format_bytes(plain_peak))
      if plain_peak <= budget:
        log.info("jlms: the step fits %s as it is; nothing is rewritten",
                 format_bytes(budget))
        return self._as_is(plain, baseline, jit_params, debug_info,
                           out_trees, budget, (plain_peak, target))
    return self._search_levels(levels, baseline, jit_params, debug_info,
                               leaves, out_trees, target, budget, avals,
                               abstract, plain_peak, donated)

  def _search_levels(self, levels, baseline, jit_params, debug_info, leaves,
                     out_trees, target, budget, avals, abstract, plain_peak,
                     donated) -> _Analysis:
    """`_search_budget` for each way of placing the state (`levels`, all
    on the device first, then the optimizer's moments on host, then all of
    it), until one fits; the budget's error if none does."""
    refused_for_host = None
    for number, plain in enumerate(levels):
      last = number == len(levels) - 1
      try:
        analysis = self._search_budget(
            plain, baseline, jit_params, debug_info, leaves, out_trees,
            target, budget, avals, abstract, plain_peak, donated,
            ask_xla_when_refused=last)
        break
      except BudgetError as error:
        if hasattr(error, "host_bytes"):
          # Where only host memory is short, the way that needs the least
          # of it says what to set.
          if (refused_for_host is None
              or error.host_bytes < refused_for_host.host_bytes):
            refused_for_host = error
        if last:
          if (refused_for_host is not None and hasattr(error, "host_bytes")):
            raise refused_for_host from None
          raise
        following = levels[number + 1].state
        if following:
          log.info("jlms: %s; trying with %d state leaves (%s) on host",
                   error, len(following.inputs),
                   format_bytes(_state_bytes(levels[number + 1])))
        else:
          log.info("jlms: %s; trying with the state's updates inside the "
                   "loops that make their gradients", error)
      except _NOT_FALLEN_BACK_FROM:
        raise
      except Exception as error:
        if budget is None:
          raise
        raise _PlanNeeded(budget) from error
    # The step does not fit the budget as it is: jax.jit's program won't do.
    return dataclasses.replace(analysis, needs_plan=budget is not None)

  def _state_levels(self, plain, donated, budget, arrived_on_host=()
                    ) -> list:
    """The ways to place the step's state that `_search_levels` tries, as
    the step's analysis with that `state`: the state on the device, as it
    is and then with its updates inside the loops that make its gradients
    (for the least memory, only the latter), unless `state_on_host` says
    otherwise; all of it on host when asked for, or for the least
    memory."""
    if not donated:
      return [plain]
    program, liveness = plain.program, plain.liveness
    pairs = state_pairs(program, donated)
    if not pairs:
      return [plain]
    # All of the state on the device, its updates run inside the loops that
    # make their gradients where they can (`jlms._state`): their gradient
    # stacks are then never made. Tried after the step as it is, since
    # where that fits the fused loops only cost time (a little, for the
    # in-place writes); for the least memory, instead of it.
    fused = dataclasses.replace(plain, state=HostState((), (), pairs))
    on_device = [fused] if budget is None else [plain, fused]
    if self.state_on_host is False:
      return on_device
    on_host = [(i, o) for i, o in pairs if i in arrived_on_host]
    if on_host:  # placed there (by `place`, or by a step): they stay
      return [dataclasses.replace(plain, state=HostState(
          tuple(i for i, _ in on_host), tuple(o for _, o in on_host),
          tuple(p for p in pairs if p not in on_host)))]
    # A leaf is worth a copy of its own from 64 KiB (each copy costs a
    # transfer's latency, about 10 us), or from `min_bytes` if given.
    least = (self._fit_min_bytes if self._fit_min_bytes is not None
             else max(self._min_bytes(budget), _STATE_MIN_BYTES))
    everything = host_state(program, liveness, pairs, min_bytes=least)
    if not everything:
      if self.state_on_host:
        log.warning("jlms: no donated argument of %s is returned updated "
                    "(of the same shape and dtype): no state to keep on host",
                    self._name)
      return on_device
    if self.state_on_host or budget is None:
      return [dataclasses.replace(plain, state=everything)]
    levels = list(on_device)
    # The optimizer's moments cross the link once each way: the largest
    # first, as many as the budget needs (what stays on the device costs
    # no copy), then all of the state.
    moments = host_state(program, liveness, pairs, min_bytes=least,
                         only_update_read=True)
    sizes = sorted(((aval_nbytes(program.avals[program.invars[i]]), i, o)
                    for i, o in zip(moments.inputs, moments.outputs)),
                   reverse=True)
    total = sum(size for size, _, _ in sizes)
    chosen, moved, share = [], 0, _STATE_LEVEL_SHARE
    for size, i, o in sizes:
      chosen.append((i, o))
      moved += size
      if moved >= share * total or len(chosen) == len(sizes):
        share += _STATE_LEVEL_SHARE
        state = host_state(program, liveness, sorted(chosen, key=lambda p:
                                                      p[0]))
        if state != everything:
          levels.append(dataclasses.replace(plain, state=dataclasses.replace(
              state, on_device=tuple(p for p in pairs
                                     if p[0] not in state.inputs))))
    levels.append(dataclasses.replace(plain, state=everything))
    return levels

  def _search_budget(self, plain, baseline, jit_params, debug_info, leaves,
                     out_trees, target, budget, avals, abstract,
                     plain_peak, donated=(),
                     ask_xla_when_refused=True) -> _Analysis:
    """`_fit_budget`'s search, once the step is known not to fit as it is
    (or the budget is the least memory): the fit, confirmed by XLA. Where
    the simulator finds no plan, XLA is asked about the least-memory one
    only `ask_xla_when_refused`."""
    plain_program, plain_liveness = plain.program, plain.liveness
    searched = budget
    unseen = unseen_split(avals, leaves)
    if unseen > 1 and budget is not None:
      # Auto mesh axes: the simulator sizes whole arrays, XLA and the budget
      # one device's shards. Scale the budget by XLA's ratio of the two for
      # jax.jit's program, or, with no XLA to ask, by the arguments' split.
      scale = unseen if plain_peak is None else (
          baseline.peak_bytes / max(plain_peak, 1))
      searched = int(budget * scale)
      log.info("jlms: the arguments are split %d ways but the step's values "
               "carry no sharding (Auto mesh axes); the simulator searches "
               "for a whole-step peak of %s", unseen, format_bytes(searched))
    times = time_target(self.target)
    config = dataclasses.replace(self.config, sync_mode=SyncMode.NONE)
    try:
      placed, residuals, result = self._fastest_fit(plain, searched, times)
      simulator_refused = False
    except BudgetError as error:
      if (target is None or budget is None or error.smallest_bytes is None
          or not ask_xla_when_refused):
        raise
      # The simulator overstates some peaks (a loop body's working memory
      # most): XLA says whether jlms's least-memory plan fits after all.
      log.info("jlms: the simulator's smallest peak is %s, above the budget; "
               "asking XLA", format_bytes(error.smallest_bytes))
      placed, residuals, result = self._fastest_fit(plain, None, times)
      searched = result.timeline.peak_bytes
      simulator_refused = True
    if (not result.offloads and placed is self._placed_variants(plain)[0][0]
        and budget is None and not plain.state):
      # As little memory as jlms reaches is the step as it is.
      return self._as_is(plain, baseline, jit_params, debug_info, out_trees,
                         budget, None)

    def rewritten_of(placed, result):
      """The rewritten program, and a function that makes it again with
      the copies left out."""
      return _rewrite_twice(
          placed.program, result.offloads, config, debug_info,
          fusion=placed.fusion, pin_contractions=True,
          serialized=_serialized(placed.program, placed.liveness, config,
                                 placed.fusion))

    if (budget is None and result.timeline.peak_bytes >= baseline.peak_bytes
        and not plain.state):
      return self._as_is(
          plain, baseline, jit_params, debug_info, out_trees, budget, None,
          reason="jlms's least-memory plan is predicted to peak at "
          f"{format_bytes(result.timeline.peak_bytes)}, no lower than "
          f"jax.jit's program ({format_bytes(baseline.peak_bytes)})")

    rewritten, without_copies = rewritten_of(placed, result)
    measured = least_peak = None
    if target is not None:
      measured = self._xla_peak(jit_params, rewritten, abstract, target,
                                donated, plain.state.inputs)
      smallest = measured
      if simulator_refused:  # the plan in hand is the least-memory one
        least_peak = measured
      log.info("jlms: XLA's peak on %s: %s (budget %s)", target,
               format_bytes(measured),
               "none" if budget is None else format_bytes(budget))
    if budget is None and measured is not None and not plain.state:
      # A plan XLA finds no smaller than jax.jit's program is not applied.
      as_is, _ = self._rewrite(plain_program, plain_liveness, (),
                               self.config, debug_info, plain.fusion)
      plain_peak = self._xla_peak(jit_params, as_is, abstract, target,
                                  donated)
      if measured >= plain_peak:
        return self._as_is(
            plain, baseline, jit_params, debug_info, out_trees, budget,
            (plain_peak, target),
            reason=f"XLA's peak on {target} with jlms's least-memory plan "
            f"is {format_bytes(measured)}, no lower than jax.jit's program's "
            f"({format_bytes(plain_peak)})")
    compiles = 1
    while budget is not None and measured is not None and measured > budget:
      if simulator_refused or compiles >= _CONFIRMATIONS:
        if least_peak is None:
          # The last resort, and the least a later budget can rely on:
          # jlms's least-memory plan, compiled.
          least = self._fastest_fit(plain, None, times)
          least_rewritten, least_without_copies = rewritten_of(least[0],
                                                               least[2])
          least_peak = self._xla_peak(jit_params, least_rewritten, abstract,
                                      target, donated, plain.state.inputs)
          smallest = min(smallest, least_peak)
          compiles += 1
          log.info("jlms: XLA's peak on %s of the least-memory plan: %s",
                   target, format_bytes(least_peak))
          if least_peak <= budget:
            placed, residuals, result = least
            rewritten, measured = least_rewritten, least_peak
            without_copies = least_without_copies
            break
        raise _refused(budget, target, plain_peak, least_peak, smallest,
                       compiles)
      # The simulator was optimistic: ask it for proportionally less, of
      # every way the loops can run (the way first chosen may have no
      # smaller plan where another does, faster than the least-memory one).
      searched = int(searched * budget / measured * 0.97)
      log.info("jlms: searching again for a predicted peak of %s",
               format_bytes(searched))
      try:
        placed, residuals, result = self._fastest_fit(plain, searched, times)
      except BudgetError:
        simulator_refused = True  # no smaller plan of this kind: say so
        continue
      rewritten, without_copies = rewritten_of(placed, result)
      measured = self._xla_peak(jit_params, rewritten, abstract, target,
                                donated, plain.state.inputs)
      smallest = min(smallest, measured)
      compiles += 1
      log.info("jlms: XLA's peak on %s: %s (budget %s)", target,
               format_bytes(measured), format_bytes(budget))
    relaxed = (None if measured is None or budget is None
               or compiles != 1 else
               _relaxed_search(result.timeline.peak_bytes, measured, budget))
    if relaxed is not None:
      # The simulator overstated this plan's peak (a loop body's working
      # memory most, a few fused buffers XLA does not keep): a plan that
      # it thinks larger, and that recomputes less, may fit too. One more
      # compile says.
      try:
        faster = self._fastest_fit(plain, relaxed, times)
      except BudgetError:
        faster = None
      if (faster is not None and faster[2].step_time.total_s
          < (1 - _FASTER_BY) * result.step_time.total_s):
        candidate, candidate_without_copies = rewritten_of(faster[0],
                                                           faster[2])
        peak = self._xla_peak(jit_params, candidate, abstract, target,
                              donated, plain.state.inputs)
        log.info("jlms: XLA's peak on %s of a faster plan: %s", target,
                 format_bytes(peak))
        if peak <= budget:
          placed, residuals, result = faster
          rewritten, measured = candidate, peak
          without_copies = candidate_without_copies
    placed_liveness = placed.liveness
    plan = build_plan(
        placed.program, placed_liveness, result.offloads, config, baseline,
        result.timeline, residuals=residuals, budget_bytes=budget,
        fitted=True, xla_peak_bytes=measured,
        xla_target=target if measured is not None else None,
        step_times=lambda: (
            self._predict_times(times, plain, None, (), None, ())[0],
            result.step_time),
        time_target=times.name,
        state_updated_in_loops=sum(c.updated_in_loop
                                   for c in placed.state_copies))
    return _Analysis(placed.program, result.offloads, plan, out_trees[-1],
                     rewritten, jit_params,
                     rewrite_without_copies=without_copies, state=plain.state)

  def _fastest_fit(self, plain, budget, times):
    """(placed program, streamed residuals, `jlms._fit.Fit`) of the fastest
    way to fit `budget` (None: the least memory). Each way the step's loops
    can run (as they are, residuals remade inside the backward loops,
    residuals streamed through host) is fitted at the top level."""
    fitted, last_error, last_rank = [], None, None
    for placed, residuals, loops in self._placed_variants(plain):
      try:
        result = fit(placed.program, placed.liveness, budget, times,
                     self._min_bytes(budget), placed.fusion, residuals,
                     self._host_budget_bytes(),
                     state_copies=placed.state_copies)
      except BudgetError as error:
        # The variant that gets closest names the smallest peak reachable;
        # a variant refused for the host's memory only where all are, and
        # then the one that needs the least of it.
        host = getattr(error, "host_bytes", None)
        rank = ((False, error.smallest_bytes) if host is None
                else (True, host))
        if last_error is None or rank < last_rank:
          last_error, last_rank = error, rank
        continue
      log.info("jlms: %s: predicted %s", loops, result.step_time.describe())
      fitted.append(((result.step_time.total_s,), len(fitted), placed,
                     residuals, result))
    if not fitted:
      raise last_error
    if budget is None:
      # The least memory: the fastest of the ways within 1% of the
      # smallest peak (a few MiB less is not worth many times the time).
      least = min(f[-1].timeline.peak_bytes for f in fitted)
      fitted = [f for f in fitted
                if f[-1].timeline.peak_bytes <= least * _LEAST_PEAK_SLACK]
    _, _, placed, residuals, result = min(fitted)
    return placed, residuals, result

  def _placed_variants(self, plain):
    """Each variant of `_programs_to_fit`, analysed with its fused
    equations placed at their readers; computed once per signature."""
    cached = self._variants.get(id(plain))
    if cached is None or cached[0] is not plain:
      variants = []
      for program, liveness, residuals, loops in self._programs_to_fit(plain):
        copies = ()
        if plain.state or plain.state.on_device:
          program, copies, residuals = keep_state_on_host(
              program, plain.state, residuals, plain.argument_names)
          liveness = analyse(program)
          if plain.state:
            loops += f", {len(plain.state.inputs)} state leaves on host"
        elif residuals:
          program = offload_scan_residuals(program, residuals)
          liveness = analyse(program)
        fusion = (plain.fusion if program is plain.program
                  else analyse_fusion(program, liveness))
        placed_program = place_fused_at_readers(program, liveness, fusion)
        residuals, copies = _reindexed(program, placed_program, residuals,
                                       copies)
        placed = dataclasses.replace(_Analysed.of(placed_program),
                                     state=plain.state, state_copies=copies)
        variants.append((placed, residuals, loops))
      cached = self._variants[id(plain)] = (plain, tuple(variants))
      if len(self._variants) > _CACHE_SIZE:
        self._variants.pop(next(iter(self._variants)))
    return cached[1]

  def _host_budget_bytes(self) -> int:
    """Pinned host memory the plan may hold at once, per device:
    `host_budget` if given, else XLA's pinned pool for each GPU
    (`XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB` GiB, 64 by default), and on a
    local GPU never more than the memory this machine has available."""
    if self.host_budget is not None:
      return parse_budget(self.host_budget)
    pool = float(os.environ.get("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "64"))
    limit = int(pool * (1 << 30))
    if self._confirm_target() == "local":
      try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        limit = min(limit, available)
      except (ValueError, OSError):  # not reported on this system
        pass
    return limit

  def _min_bytes(self, budget: int | None) -> int:
    """The smallest value worth a choice: the `min_bytes` knob if given,
    else a 65536th of the budget (at least 4 KiB): smaller values cannot
    change whether a step fits, only slow the search."""
    if self._fit_min_bytes is not None:
      return self._fit_min_bytes
    return max(4096, (budget or 0) >> 16)

  def _programs_to_fit(self, plain):
    """(program, liveness, residuals to stream, description) of each way
    the step's scans can run: as they are; with the residuals a forward
    scan stacks for a backward one remade inside the backward loop;
    streamed through host one slice per iteration (the program as it is,
    with the residuals that `_placed_variants` streams)."""
    plain_program, plain_liveness = plain.program, plain.liveness
    yield plain_program, plain_liveness, (), "loops as they are"
    if not self.config.scan_residuals:
      return
    # Loop-invariant masks and fills that autodiff hoisted out of the scans
    # are made inside them again: every variant below rewrites its loops
    # anyway, and each such input is a buffer alive through both loops.
    sinks = loop_sinks(plain_program, plain_liveness)
    base_program, sinks = sink_into_loops(plain_program, sinks)
    base_liveness = analyse(base_program) if sinks else plain_liveness
    if sinks:
      yield (base_program, base_liveness, (),
             f"loops making {len(sinks)} loop-invariant inputs inside")
    pairs = loop_rematerializations(base_program, base_liveness,
                                    target=time_target(self.target))
    # The cheapest residuals (time to remake a byte) first: remaking all of
    # them is per-layer remat; a budget may need only some.
    seen = set()
    for fraction in _LOOP_REMAT_FRACTIONS:
      chosen = cheapest(pairs, fraction)
      key = tuple(c.residuals for c in chosen)
      if not pairs or key in seen:
        continue
      seen.add(key)
      program = rematerialize_in_loops(base_program, chosen)
      remade = sum(len(c.residuals) for c in chosen)
      yield (program, analyse(program), (),
             f"{len(chosen)} loops remaking {remade} of their residuals")
    residuals = find_scan_residuals(base_program, base_liveness,
                                    dataclasses.replace(
                                        self.config, swapout_threshold=2))
    if residuals:  # streamed by `_placed_variants`
      yield (base_program, base_liveness, residuals,
             f"{len(residuals)} scan residuals streamed through host")

  def _as_is(self, plain, baseline, jit_params, debug_info, out_trees, budget,
             xla, reason=None) -> _Analysis:
    """jax.jit's program, unchanged, with its plan (and the `reason`, when
    a plan was made but not applied)."""
    rewritten = plain.traced  # the step's own jaxpr, as traced
    without_copies = None
    if self.config.serialize or self.config.serialize_by_size is not None:
      rewritten, without_copies = self._rewrite(
          plain.program, plain.liveness, (), self.config, debug_info,
          plain.fusion)
    plan = build_plan(
        plain.program, plain.liveness, (), self.config, baseline, baseline,
        budget_bytes=budget, fitted=True,
        xla_peak_bytes=None if xla is None else xla[0],
        xla_target=None if xla is None else xla[1], not_applied=reason,
        **self._step_times(plain))
    return _Analysis(plain.program, (), plan, out_trees[-1], rewritten,
                     jit_params, rewrite_without_copies=without_copies)

  def _rewritten(self, *args, **kwargs):
    analysis, leaves = self._analysis(args, kwargs)
    if analysis.failure is None:
      try:
        outs = _compat.bind_jit(analysis.jit_params, analysis.rewritten,
                                _placed_for(leaves, analysis.state.inputs))
        return jax.tree.unflatten(analysis.out_tree, outs)
      except Exception as error:  # staging jlms's program: jlms's failure
        self._analyses[self._signature(args, kwargs)] = (
            self._planning_failed(error, analysis.needs_plan))
    return self._fun(*args, **kwargs)  # jax.jit's program, in this trace

  def _as_traced(self, *args, **kwargs):
    """The step as traced, unchanged (jax.jit's program), staged from the
    analysis's trace; the step itself where planning failed before one."""
    analysis, leaves = self._analysis(args, kwargs)
    if analysis.plain is None or analysis.plain.traced is None:
      return self._fun(*args, **kwargs)
    outs = _compat.bind_jit(analysis.jit_params, analysis.plain.traced,
                            leaves)
    return jax.tree.unflatten(analysis.out_tree, outs)


def _named_like(method, fun):
  """`method` under `fun`'s name, so that XLA's module is "jit_<step>" and
  its op names "jit(<step>)/..." as with `jax.jit(fun)`: a profile names
  the step. Only the name: jax.jit must still see `method`'s
  (*args, **kwargs) signature, not `fun`'s (no `__wrapped__`)."""
  def staged(*args, **kwargs):
    return method(*args, **kwargs)
  name = getattr(fun, "__name__", None)
  if isinstance(name, str) and name.isidentifier():
    staged.__name__ = staged.__qualname__ = name
  return staged


def _rewrite_twice(*args, **kwargs):
  """`rewrite(*args, **kwargs)`, and a function that makes it again with
  the copies left out (the same barriers, so that a benchmark times the
  schedule that runs)."""
  return (rewrite(*args, **kwargs),
          functools.partial(rewrite, *args, **kwargs, transfers=False))


def _refused(budget, target, plain_peak, least_peak, smallest,
             compiles) -> BudgetError:
  """The error of a budget XLA finds no plan under. Its minimum is the
  smaller of jax.jit's program's peak and jlms's least-memory plan's: a
  budget search for that much tries both, so it fits."""
  minimum = least_peak if plain_peak is None else min(plain_peak, least_peak)
  as_it_is = ("" if plain_peak is None else
              f"{format_bytes(plain_peak)} for jax.jit's program and ")
  error = BudgetError(
      f"jlms: the step does not fit a budget of {format_bytes(budget)} on "
      f"{target}: XLA's peak is {as_it_is}"
      f"{format_bytes(least_peak)} with jlms's least-memory "
      f"plan (XLA compiled {compiles} jlms "
      f"{'plan' if compiles == 1 else 'plans'}, the smallest peaking at "
      f"{format_bytes(smallest)}); raise the budget to at least "
      f"{format_bytes(minimum)}")
  error.smallest_bytes = minimum
  return error


def _relaxed_search(predicted: int, measured: int, budget: int) -> int | None:
  """The simulator's peak to fit for once more, when XLA's peak of a plan
  that the simulator predicted at `predicted` is `measured`, below
  `budget`: the unused room, in the simulator's bytes (scaled by its ratio
  to XLA's for this plan), less a tenth of it as margin; None when the
  room is under `_UNUSED_ROOM` of the budget."""
  if measured >= (1 - _UNUSED_ROOM) * budget:
    return None
  room = predicted * (budget / measured - 1)
  return int(predicted + 0.9 * room)


def _predicted_baseline(plain):
  return simulate(plain.program, plain.liveness, fusion=plain.fusion)


def _serialized(program, liveness, config, fusion=None) -> frozenset:
  if not config.serialize and config.serialize_by_size is None:
    return frozenset()
  if fusion is None:
    fusion = analyse_fusion(program, liveness)
  runs_in_place = fusion.executes_at == np.arange(len(program))
  return serialized_equations(program, liveness, runs_in_place,
                              config.serialize, config.serialize_by_size)


def offload(fun: Callable | None = None, *,
            min_bytes: int | None = None,
            swapout_threshold: int | None = None,
            prefetch_ahead: int | None = None,
            swapin_groupby: int | None = None,
            sync_mode: int | SyncMode | None = None,
            scan_residuals: bool = OffloadConfig.scan_residuals,
            serialize=OffloadConfig.serialize,
            serialize_by_size: int | None = OffloadConfig.serialize_by_size,
            static_argnums: int | Sequence[int] = (),
            static_argnames: str | Sequence[str] = (),
            donate_argnums: int | Sequence[int] = (),
            donate_argnames: str | Sequence[str] = (),
            verify: bool | None = None,
            budget: int | str | None = None,
            target: str | None = None,
            host_budget: int | str | None = None,
            strict: bool = False,
            state_on_host: bool | None = None):
  """Wraps a train step so that it fits a device memory budget in the least
  time it can.

  Use like `jax.jit`: `step = jlms.offload(train_step)` or as a decorator,
  with or without arguments. The step's jaxpr (forward, backward and update
  together) is flattened and analysed. Under a budget (the default: the
  device's memory), each large value that lives across a gap between its
  reads is kept, recomputed before its far read, or copied to pinned host
  memory and back, whichever a time model of the target predicts costs
  least (XLA's scheduler leaves host copies exposed, so recomputation
  mostly wins); a step that fits is `jax.jit`'s
  program. With any of TFLMS's knobs (`min_bytes`, `swapout_threshold`,
  `prefetch_ahead`, `swapin_groupby`, `sync_mode`) and no budget, TFLMS's
  rules apply exactly: each value of at least `min_bytes` not read for more
  than `swapout_threshold` equations is copied to host after its last near
  read and brought back `prefetch_ahead` equations before its next read.

  Args:
    fun: the step, any jittable function of pytrees of arrays.
    min_bytes: smallest value offloaded, in bytes (default 1 MiB).
    swapout_threshold: gap between two reads of a value, in equations of the
      flattened step, beyond which it is offloaded (default 20).
    prefetch_ahead: how many equations before its next read a value is
      copied back (default 2).
    swapin_groupby: reads at most this many equations apart share one copy
      back; None (default) means `swapout_threshold`.
    sync_mode: 0 overlap everything, 1 (default) compute waits for each
      swap-out, 2 it waits for each swap-in, 3 both (see `jlms.SyncMode`).
    scan_residuals: True (default): what a scan (`nn.scan`, `lax.scan`,
      `fori_loop`) stacks for the backward scan goes to host one layer's
      slice per iteration, so device memory stays flat in the number of
      scanned layers. False: such stacks are offloaded whole, like any
      other value.
    serialize: layers whose ops must run one after another, so that large
      independent ops (an Inception block's branches) are never resident
      together: name-stack globs ("*Inception_2/*"; the Flax module path
      and the primitive, as `Plan` prints them) and equation ranges
      (`range(a, b)` or `(a, b)`). They are chained with optimization
      barriers.
    serialize_by_size: also serialize every equation whose outputs take at
      least this many bytes.
    static_argnums, static_argnames, donate_argnums, donate_argnames: as in
      `jax.jit`.
    verify: check with XLA, on the first call of each signature, that the
      compiled program keeps the offloaded values on host and lowers the
      device peak, warning with `jlms.OffloadIneffectiveWarning` otherwise.
      None (default): only when running on a GPU (it costs one extra compile
      of the step with and without jlms).
    budget: device memory the step may use, per device: bytes, a size such
      as "20GiB", a percentage such as "90%" of the device's (or the
      target's) memory, "device" (the default when no knob is given: the
      memory of the local GPU or of `target`; with neither, the step runs
      as `jax.jit`'s) or "min" (the least memory jlms reaches). The plan is
      confirmed with XLA (on `target`, else on the local GPU) and fitted
      again while XLA's peak does not fit. Raises `jlms.BudgetError` when
      nothing fits.
    target: "h100", "h200", "a100" (deviceless compile) or "local": the GPU
      whose memory and time model the budget is fitted for, and where XLA
      confirms it. None: the local GPU if there is one (timed as an H100),
      else the choice rests on the simulator alone.
    host_budget: pinned host memory the plan may hold at once, per device
      (bytes or a size). None (default): XLA's pinned pool,
      `XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB` GiB or 64, and on a local GPU no
      more than the machine's available memory.
    strict: what happens when jlms itself fails for some arguments
      (planning, rewriting, or XLA compiling or checking the rewritten
      program; a step that jax.jit cannot trace or run fails as it does
      under jax.jit, whatever `strict` says). False (default): the step
      runs as `jax.jit`'s program for those arguments, with one
      `jlms.FallbackWarning` that names the failure, except under a budget
      that `jax.jit`'s program is not known to meet (a `budget` given in
      bytes, as a size or a percentage, or the device's memory when the
      step does not fit it), where `jlms.OffloadError` is raised. True:
      `jlms.OffloadError` is raised, from the failure.
    state_on_host: where the step's state lives between steps: the
      donated arguments that the step returns updated (parameters,
      optimizer state). True: in pinned host memory; each stacked layer's
      slice comes to the device when a scan reads it, the optimizer's
      update runs one leading slice at a time, and the updated state goes
      back to host (`OffloadedStep.place` puts a state there before the
      first call). None (default): only where the budget cannot be met
      otherwise (the optimizer's moments first, then all of it) and for
      `budget="min"`. False: never.

  Returns:
    An `OffloadedStep`: call it like the step; `.lower(...)`, `.trace(...)`
    and `.plan(...)` inspect it.
  """
  knobs = dict(min_bytes=min_bytes, swapout_threshold=swapout_threshold,
               prefetch_ahead=prefetch_ahead, swapin_groupby=swapin_groupby,
               sync_mode=sync_mode)
  given = {k: v for k, v in knobs.items() if v is not None}
  if budget is None and given:
    budget = KNOBS  # an expert's TFLMS knobs: exactly what they say
  elif budget is None:
    budget = DEVICE  # fit the device the step is compiled for
  config = OffloadConfig(**given, scan_residuals=scan_residuals,
                         serialize=serialize,
                         serialize_by_size=serialize_by_size)
  jit_options = dict(static_argnums=static_argnums,
                     static_argnames=static_argnames,
                     donate_argnums=donate_argnums,
                     donate_argnames=donate_argnames, verify=verify,
                     budget=budget, target=target, min_bytes_given=min_bytes,
                     host_budget=host_budget, strict=strict,
                     state_on_host=state_on_host)
  if fun is None:
    return lambda f: OffloadedStep(f, config, **jit_options)
  return OffloadedStep(fun, config, **jit_options)


def _placed_for(leaves, positions) -> list:
  """`leaves` where the program takes them: those at `positions` (state
  kept on host) in pinned host memory, copied there first where one
  arrives on the device (inside the step: a no-op for XLA where the
  argument is laid out on host, see `OffloadedStep.lower`); any other
  that arrives in host memory copied to the device."""
  leaves = list(leaves)
  state = set(positions)
  for i, leaf in enumerate(leaves):
    on_host = _compat.is_host_aval(_compat.abstractify(leaf))
    if i in state and not on_host:
      leaves[i] = jax.device_put(leaf, jax.memory.Space.Host)
    elif i not in state and on_host:
      leaves[i] = jax.device_put(leaf, jax.memory.Space.Device)
  return leaves


class _HostArguments:
  """A jitted function whose `lower` marks the arguments at `positions`
  as taken from pinned host memory (see `_compat.mark_host_arguments`)."""

  def __init__(self, jitted, positions):
    self._jitted, self._positions = jitted, tuple(positions)

  def lower(self, *args, **kwargs):
    lowered = self._jitted.lower(*args, **kwargs)
    if self._positions:
      _compat.mark_host_arguments(lowered, self._positions)
    return lowered


@functools.lru_cache(maxsize=None)
def _pinned_host_copy(shardings):
  return jax.jit(lambda *xs: xs, out_shardings=tuple(
      s.with_memory_kind("pinned_host") for s in shardings))


def _to_pinned_host(arrays) -> list:
  """Copies of `arrays` in pinned host memory, by one jitted copy."""
  shardings = tuple(x.sharding for x in arrays)
  return list(_pinned_host_copy(shardings)(*arrays))


def _reindexed(program, placed, residuals, copies):
  """`residuals` and state `copies` indexed in `placed`, the program that
  `place_fused_at_readers` made of `program` (it moves fused equations,
  not loops or copies)."""
  new_index = {id(e.eqn): i for i, e in enumerate(placed.equations)}
  end = len(placed)

  def moved(index):
    if index is None:
      return None
    if index >= len(program):
      return end
    return new_index.get(id(program.equations[index].eqn), index)

  residuals = tuple(dataclasses.replace(
      r, producer=moved(r.producer),
      readers=tuple(moved(i) for i in r.readers)) for r in residuals)
  copies = tuple(dataclasses.replace(c, index=moved(c.index))
                 for c in copies)
  return residuals, copies


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


def _state_bytes(plain) -> int:
  return sum(aval_nbytes(plain.program.avals[plain.program.invars[i]])
             for i in plain.state.inputs)


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
