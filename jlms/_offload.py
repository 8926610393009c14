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

import functools
import logging
import warnings
from typing import Callable, Sequence

import jax

from jlms import _compat
from jlms._analysed import PlannedStep, placed_for
from jlms._arguments import (SplitArguments, committed_where_they_are,
                             complete_argnums, in_pinned_host, on_device)
from jlms._config import OffloadConfig, SyncMode
from jlms._cost import time_target
from jlms._fallback import (OffloadError, describe,
                            raise_unless_fallback_allowed, warn_fallback)
from jlms._plan import Plan
from jlms._planning import StepPlanner
from jlms._options import DEVICE, KNOBS, search_options
from jlms._search import NOT_FALLEN_BACK_FROM, tradeoff
from jlms._state import FITTED_COMPILER_OPTIONS
from jlms._tradeoff import Tradeoff
from jlms._units import format_bytes
from jlms._verify import compare_memory_of_call


log = logging.getLogger("jlms")


class StateOnDeviceWarning(UserWarning):
  """The state arrived in another memory than the step's plan takes it
  from: state that the plan keeps in pinned host memory arrived on the
  device, or state that another plan returned on host arrived where this
  plan takes it on the device. The step copies it first, at the cost the
  warning names. `OffloadedStep.place` puts it where the step takes it;
  `jlms.on_device` brings state on host back to the device."""

  __module__ = "jlms"  # tracebacks and reprs show the public name


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
    self.jit_options = dict(
        static_argnums=self._static_argnums,
        static_argnames=self._static_argnames,
        donate_argnums=donate_argnums, donate_argnames=donate_argnames)
    self._jitted = jax.jit(_named_like(self._rewritten, fun),
                           **self.jit_options)
    # The same, for signatures whose program jlms fitted to a budget:
    # compiled as XLA confirmed it (its rematerialization off; where the
    # plan copies over the link, the scheduler's memory limit of its
    # budget), one jit for each set of options (`_fitted_jit`).
    self._fitted_jits: dict = {}
    # The same, called inside another trace (the user's jit, vmap, grad),
    # donating nothing: a nested jit's donation is dropped anyway, and a
    # transformation's eager run of a donating program whose state comes
    # back on host from device inputs aborted the process (JAX 0.10 to
    # 0.12; `_given_back` then puts it back where it came from).
    self._jitted_in_trace = jax.jit(
        _named_like(self._rewritten, fun),
        **dict(self.jit_options, donate_argnums=(), donate_argnames=()))
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
    options = search_options(
        config, budget, target, min_bytes_given, host_budget, state_on_host,
        self._name, bool(donate_argnums or donate_argnames))
    self.budget, self.target = options.budget, target
    # The smallest value a budget's fit may move: the knob if given.
    self.min_bytes = min_bytes_given
    self.host_budget, self.state_on_host = host_budget, state_on_host
    self._planner = StepPlanner(fun, self._name, options, self.jit_options,
                                self._plain_jitted, strict)
    self._warned_state: set = set()

  def __repr__(self) -> str:
    shown = [self._name, f"budget={self.budget!r}", f"target={self.target!r}"]
    if self.budget is KNOBS:  # the knobs apply only without a budget
      shown.append(str(self.config))
    shown += [f"{name}={getattr(self, name)!r}"
              for name in ("host_budget", "state_on_host")
              if getattr(self, name) is not None]
    if self.strict:
      shown.append("strict=True")
    return f"jlms.offload({', '.join(shown)})"

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
      return self._given_back(program(*args, **kwargs), args, kwargs)
    except Exception as error:  # handled outside, so as not to chain
      failure = error
    return self._after_failure(failure, args, kwargs)

  def _program_for(self, args, kwargs):
    """The jitted program for these arguments: jlms's, or jax.jit's where
    jlms's failed to compile."""
    if self._has_fallen_back(args, kwargs):
      return self._plain_jitted
    analysis, leaves = self._analysis(args, kwargs)
    if analysis.state and any(_compat.is_transformed(x) for x in leaves):
      # Batched (an ensemble under vmap) or differentiated (meta-learning
      # over a train step): JAX refuses a batched slice of a state leaf in
      # host memory (a gather there) and gives the copies of the state to
      # host cotangents in host memory ("Expected cotangent type"). The
      # step runs as jax.jit's program there, its state on the device.
      return self._plain_jitted
    # Inside another trace the outer jit compiles the step: JAX takes
    # compiler options on the top-level jit only.
    if any(isinstance(x, jax.core.Tracer) for x in leaves):
      return self._jitted_in_trace
    if analysis.failure is None and analysis.fitted:
      return self._fitted_jit(analysis.compiler_options)
    return self._jitted

  def _fitted_jit(self, options: tuple):
    """The step's rewritten program under `jax.jit` with XLA's `options`
    ((name, value) pairs; empty: `FITTED_COMPILER_OPTIONS`), made once."""
    if options not in self._fitted_jits:
      self._fitted_jits[options] = jax.jit(
          _named_like(self._rewritten, self._fun),
          compiler_options=dict(options or FITTED_COMPILER_OPTIONS),
          **self.jit_options)
    return self._fitted_jits[options]

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

  def _after_failure(self, error: Exception, args, kwargs):
    """The step's outputs by jax.jit's program when `error` is a failure of
    jlms's program (compiling or checking it); raises `error` unchanged
    when it is the step's own."""
    key = self._failed_in_jlms(error, args, kwargs)
    if key is None:
      raise error
    analysis = self._planner.cached(key)
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
    args, kwargs = on_device((args, kwargs))
    return self._plain_jitted(*args, **kwargs)

  def _failed_in_jlms(self, error: Exception, args, kwargs):
    """The signature whose jlms program raised `error`; None when the error
    is not jlms's: the step's own (tracing it failed, or its program is
    jax.jit's), a decision already made (`OffloadError`, `BudgetError`),
    inside an outer trace, or after donated arguments were consumed."""
    if isinstance(error, (OffloadError, *NOT_FALLEN_BACK_FROM,
                          *_compat.nan_check_errors())):
      return None
    leaves = jax.tree.leaves((args, kwargs))
    if any(isinstance(x, jax.core.Tracer) or (
        isinstance(x, jax.Array) and x.is_deleted()) for x in leaves):
      return None
    try:
      key = self._signature(args, kwargs)
    except TypeError:  # an argument jax.jit refuses too
      return None
    analysis = self._planner.cached(key)
    if analysis is None or not analysis.rewrites_the_step:
      return None
    return key

  def _state_placed(self, args, kwargs):
    """The call's arguments in the memory that the program for them takes
    them from (`place`): the state that the plan keeps on host in pinned
    host memory, everything else on the device. Arguments that arrive
    elsewhere are copied first, with one warning per signature that says
    what it costs (state copied to host is donated: the caller's device
    arrays are deleted, as jax.jit deletes donated ones, unless the call
    passes one in another place too): state arriving on the
    device, or state that another plan (another batch's shape, another
    `jlms.offload` of the step) returned on host where this plan keeps it
    on the device. Not left to JAX: a compiled program that donates an
    argument aborts the whole process when the argument is in another
    memory than it was compiled for (JAX 0.10 to 0.12)."""
    leaves = self._split(args, kwargs).leaves
    if any(isinstance(x, jax.core.Tracer) for x in leaves):
      return args, kwargs  # under an outer trace: `_rewritten` copies
    if not self._may_keep_state_on_host() and not any(
        in_pinned_host(x) for x in leaves):
      return args, kwargs
    analysis = self._analysis(args, kwargs)[0]
    if analysis.failure is not None or self._has_fallen_back(args, kwargs):
      # jax.jit's program runs, with the state on the device.
      return on_device((args, kwargs))
    to_host, to_device = self._misplaced(leaves, analysis)
    if not to_host and not to_device:
      return args, kwargs
    key = self._signature(args, kwargs)
    if key not in self._warned_state:
      self._warned_state.add(key)
      if to_host:
        self._warn_state_on_device(analysis, [leaves[i] for i in to_host])
      if to_device:
        self._warn_state_on_host([leaves[i] for i in to_device])
    placed = self.place(*args, **kwargs)
    # An array passed in another place as well (EMA weights initialised
    # from the parameters: step(params, params, x)) is still read there;
    # its two leaves share buffers (committing an array keeps its buffer).
    moved = set(to_host)
    read_elsewhere = set().union(*(
        _buffers(leaf) for i, leaf in enumerate(leaves) if i not in moved))
    for i in to_host:
      # Donated, as jax.jit donates them: the caller's device copy is not
      # kept beside the host one (it would hold the state's bytes on the
      # device the whole step), and using it again gets JAX's error.
      if (isinstance(leaves[i], jax.Array) and not leaves[i].is_deleted()
          and not _buffers(leaves[i]) & read_elsewhere):
        leaves[i].delete()
    return (placed, {}) if not kwargs else placed

  def _given_back(self, out, args, kwargs):
    """`out`, with the updated state that went in on the device given back
    on the device where the step runs under an outer trace (a `jax.jit` or
    `lax.scan` of the step): the outer program holds the state between
    calls, and where it gives the state on the device it takes it back
    there. Returned on host, an outer jit that donates the state aborted
    the process (JAX 0.10 to 0.12) and an outer scan refused its carry."""
    if not _compat.under_a_trace():
      return out  # a training loop's call: nothing to look for
    leaves = self._split(args, kwargs).leaves
    if not any(isinstance(x, jax.core.Tracer) for x in leaves):
      return out
    analysis = self._analysis(args, kwargs)[0]
    if analysis.failure is not None or not analysis.state:
      return out
    outs, treedef = jax.tree.flatten(out)
    for i, o in zip(analysis.state.inputs, analysis.state.outputs):
      if not _compat.is_host_aval(_compat.abstractify(leaves[i])):
        outs[o] = jax.device_put(outs[o], jax.memory.Space.Device)
    return jax.tree.unflatten(treedef, outs)

  @staticmethod
  def _misplaced(leaves, analysis) -> tuple[list[int], list[int]]:
    """Positions of the leaves to copy to pinned host memory (state the
    plan keeps there, arriving on the device) and to the device (donated
    arrays in pinned host memory that the plan takes on the device; one
    not donated, such as a data loader's pinned batch, the program copies
    itself)."""
    kept = set(analysis.state.inputs) if analysis.failure is None else set()
    donated = set(analysis.plain.program.donated
                  if analysis.plain is not None else ())
    to_host = [i for i in sorted(kept) if isinstance(leaves[i], jax.Array)
               and leaves[i].sharding.memory_kind != "pinned_host"]
    to_device = [i for i in sorted(donated - kept)
                 if in_pinned_host(leaves[i])]
    return to_host, to_device

  def _copy_cost(self, arrived) -> str:
    """The bytes of `arrived` and what copying them over the target's host
    link takes, as the placement warnings say it."""
    size = sum(x.nbytes for x in arrived)
    target = time_target(self.target)
    return (f"{format_bytes(size)}; about "
            f"{1e3 * target.transfer_seconds(size):.3g} ms over "
            f"{target.link} on {target.name}")

  def _warn_state_on_host(self, arrived) -> None:
    warnings.warn(
        f"jlms.offload({self._name}): {len(arrived)} arguments "
        f"({self._copy_cost(arrived)}) arrived in pinned host memory, where "
        f"this plan takes them on the device (another plan, for other shapes "
        f"or another budget, returned them on host): they are copied to the "
        f"device first. `jlms.on_device(tree)` copies such state back once",
        StateOnDeviceWarning, stacklevel=4)

  def _warn_state_on_device(self, analysis, arrived) -> None:
    warnings.warn(
        f"jlms.offload({self._name}) keeps {len(analysis.state.inputs)} "
        f"state leaves in pinned host memory between steps, but "
        f"{len(arrived)} of them ({self._copy_cost(arrived)}) arrived on the "
        f"device: they are copied to host first (the arrays passed are "
        f"donated, as jax.jit donates them) and the step returns the "
        f"state on host. Place the state once before the first step with "
        "`step.place(...)`", StateOnDeviceWarning, stacklevel=4)

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
    memory jlms reaches up to `jax.jit`'s predicted peak. A donated state
    is placed as a budget search places it: on the device where that
    fits, else on host (unless `state_on_host=False`)."""
    plain = self._runnable_analysis(args, kwargs).plain
    return tradeoff(self._planner.search_request(
        plain, None, None, (), [None], donated=plain.program.donated),
        budgets, points)

  def lower(self, *args, **kwargs) -> jax.stages.Lowered:
    """The `jax.stages.Lowered` of the program that runs: the rewritten
    one, or jax.jit's where jlms failed. State kept on host is taken from
    pinned host memory, as on a GPU, even from abstract arguments of
    compile-only devices (which carry no memory kind). Call its compiled
    program on the arguments `place` gives: JAX (0.10 to 0.12) aborts the
    process when a compiled program that donates a pinned-host argument
    is called a second time with that argument in device memory."""
    program = self._program_for(args, kwargs)
    if program in self._fitted_jits.values():
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
    `jax.device_put` to host outside jit), any other donated array in
    pinned host memory copied to the device, everything else as it is. Call it once
    before the first step; the step returns the state where it takes it."""
    analysis = self._runnable_analysis(args, kwargs)
    split = self._split(args, kwargs)
    leaves = list(split.leaves)
    to_host, to_device = self._misplaced(leaves, analysis)
    if not to_host and not to_device:
      return (args, kwargs) if kwargs else args
    if to_host:
      copied = _to_pinned_host([leaves[i] for i in to_host])
      for i, leaf in zip(to_host, copied):
        leaves[i] = leaf
    for i in to_device:
      leaves[i] = on_device(leaves[i])
    placed_args, placed_kwargs = split.rebuilt(leaves)
    return (placed_args, placed_kwargs) if kwargs else placed_args

  def trace(self, *args, **kwargs) -> jax.stages.Traced:
    """The `jax.stages.Traced` of the program that runs for these arguments
    (jlms's, or jax.jit's where jlms's failed), as `jax.jit(step).trace`
    gives it."""
    return self._program_for(args, kwargs).trace(*args, **kwargs)

  def eval_shape(self, *args, **kwargs):
    """The step's outputs as `jax.ShapeDtypeStruct`s, as
    `jax.jit(step).eval_shape` gives them; nothing is compiled or run."""
    return self._jitted.eval_shape(*args, **kwargs)

  # -- what it does ----------------------------------------------------------
  def plan(self, *args, **kwargs) -> Plan:
    """The offload plan for these arguments (arrays or ShapeDtypeStructs).
    Raises `jlms.OffloadError` where jlms failed for them (the step runs
    as jax.jit's program)."""
    return self._runnable_analysis(args, kwargs).plan

  def jaxpr(self, *args, **kwargs):
    """The closed jaxpr that runs for these arguments: jlms's rewritten
    program (its copies, barriers and recomputations), or the step as
    traced where jlms leaves it as `jax.jit`'s. Raises `jlms.OffloadError`
    where jlms failed for them."""
    return self._runnable_analysis(args, kwargs).rewritten

  def jaxpr_without_copies(self, *args, **kwargs):
    """`jaxpr` with the same barriers and recomputations but no copies to
    host: what a benchmark times to price the barriers alone."""
    return self._runnable_analysis(args, kwargs).without_copies()

  def _runnable_analysis(self, args, kwargs) -> PlannedStep:
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
    return self._planner.split(args, kwargs)

  def _signature(self, args, kwargs) -> tuple:
    return self._planner.signature(args, kwargs)

  def _analysis(self, args, kwargs) -> tuple[PlannedStep, list]:
    return self._planner.planned(args, kwargs)

  def _rewritten(self, *args, **kwargs):
    analysis, leaves = self._analysis(args, kwargs)
    if analysis.failure is None:
      try:
        outs = _compat.bind_jit(analysis.jit_params, analysis.rewritten,
                                placed_for(leaves, analysis.state.inputs))
        # Only the updated state is given back on host (`plan.output_kinds`):
        # another output that is a leaf kept on host (a step returning a
        # state leaf's old value) goes to the device.
        kept = set(analysis.state.outputs)
        outs = [jax.device_put(o, jax.memory.Space.Device)
                if p not in kept and _compat.is_host_aval(
                    _compat.abstractify(o)) else o
                for p, o in enumerate(outs)]
        for p, sharding in analysis.kept_shardings:
          outs[p] = jax.lax.with_sharding_constraint(outs[p], sharding)
        return jax.tree.unflatten(analysis.out_tree, outs)
      except _compat.nan_check_errors() as error:
        # jax_debug_nans re-running the step op by op found a NaN in jlms's
        # program: run the step itself op by op, as jax.jit's re-run does,
        # so that JAX's error names the step's operation that made it.
        if not isinstance(error, FloatingPointError):
          on_device_args, on_device_kwargs = on_device((args, kwargs))
          with jax.disable_jit():
            self._fun(*on_device_args, **on_device_kwargs)
        raise
      except Exception as error:  # staging jlms's program: jlms's failure
        self._planner.failed_to_stage(args, kwargs, error,
                                      analysis.needs_plan)
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


def _buffers(leaf) -> set:
  """The device buffers an array holds, by address (nothing for another
  leaf): two arrays that share one are the same data."""
  if not isinstance(leaf, jax.Array) or leaf.is_deleted():
    return set()
  try:
    return {(shard.device, shard.data.unsafe_buffer_pointer())
            for shard in leaf.addressable_shards}
  except Exception:  # noqa: BLE001 -- a backend without addresses
    return {id(leaf)}


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












def offload(fun: Callable | None = None, *,
            min_bytes: int | None = None,
            swapout_threshold: int | None = None,
            prefetch_ahead: int | None = None,
            swapin_groupby: int | None = None,
            sync_mode: int | SyncMode | None = None,
            scan_residuals: bool = OffloadConfig.scan_residuals,
            split_batch: bool = OffloadConfig.split_batch,
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
    split_batch: True (default): when a budget is fitted, a run of
      equations that alone needs more memory than the rest of the step (a
      loss over a large vocabulary: logits, soft-cap, softmax, forward and
      backward, each `batch x sequence x vocabulary`) runs as a loop over
      chunks of the batch, as TFLMS's serialization ran a layer part by
      part; the plan says so. False: never.
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
                         split_batch=split_batch, serialize=serialize,
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






@functools.lru_cache(maxsize=None)
def _pinned_host_copy(shardings):
  return jax.jit(lambda *xs: xs, out_shardings=tuple(
      s.with_memory_kind("pinned_host") for s in shardings))


def _to_pinned_host(arrays) -> list:
  """Copies of `arrays` in pinned host memory, by one jitted copy."""
  shardings = tuple(x.sharding for x in arrays)
  return list(_pinned_host_copy(shardings)(*arrays))
