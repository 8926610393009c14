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
trace.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
from typing import Any, Callable, Sequence

import jax
import numpy as np

from jlms import _compat
from jlms._config import OffloadConfig, SyncMode
from jlms._liveness import analyse, largest_equation
from jlms._loops import find_scan_residuals, offload_scan_residuals
from jlms._plan import Plan, build_plan
from jlms._planner import Offload, plan_offloads
from jlms._program import Program, flatten
from jlms._rewrite import rewrite
from jlms._sharding import abstract_arguments, unseen_split
from jlms._serialize import serialized_equations
from jlms._simulator import analyse_fusion, simulate
from jlms._plan import format_bytes
from jlms._tuner import BudgetError, Tuning, parse_budget, tune
from jlms._xla_memory import target_memory_bytes, xla_memory

_CACHE_SIZE = 32
_CONFIRMATIONS = 4  # XLA compiles at most, when fitting a budget

log = logging.getLogger("jlms")


@dataclasses.dataclass(frozen=True)
class _Analysis:
  program: Program
  offloads: tuple[Offload, ...]
  plan: Plan
  out_tree: Any
  rewritten: Any  # the closed jaxpr that runs
  jit_params: dict  # params of the nested-jit equation that stages it


def _as_tuple(x) -> tuple:
  if x is None:
    return ()
  if isinstance(x, (int, str)):
    return (x,)
  return tuple(x)


class OffloadedStep:
  """A jitted train step with host offload. See `jlms.offload`."""

  def __init__(self, fun: Callable, config: OffloadConfig, *,
               static_argnums=(), static_argnames=(), donate_argnums=(),
               donate_argnames=(), verify=None, budget=None, target=None):
    if not callable(fun):
      raise TypeError(f"jlms.offload expects a callable, got {type(fun)}")
    functools.update_wrapper(self, fun)
    self._fun = fun
    self.config = config
    self._static_argnums = _as_tuple(static_argnums)
    self._static_argnames = _as_tuple(static_argnames)
    self._analyses: collections.OrderedDict = collections.OrderedDict()
    self.jit_options = dict(
        static_argnums=self._static_argnums,
        static_argnames=self._static_argnames,
        donate_argnums=_as_tuple(donate_argnums),
        donate_argnames=_as_tuple(donate_argnames))
    self._jitted = jax.jit(self._rewritten, **self.jit_options)
    self._verify = verify
    self._verified: set = set()
    self.budget = budget
    self.target = target
    if budget is not None:
      parse_budget(budget, lambda: 1)  # reject malformed budgets now

  def __repr__(self) -> str:
    name = getattr(self._fun, "__qualname__", repr(self._fun))
    return f"jlms.offload({name}, {self.config})"

  # -- the jax.jit surface -------------------------------------------------
  def __call__(self, *args, **kwargs):
    if self._should_verify(args, kwargs):
      self.memory(*args, target="local", **kwargs)
    return self._jitted(*args, **kwargs)

  def _should_verify(self, args, kwargs) -> bool:
    """On a GPU, the first concrete call of each signature checks with XLA
    that the offload is effective (it costs one extra compile of each)."""
    verify = self._verify
    if verify is None:
      verify = jax.default_backend() == "gpu"
    if not verify:
      return False
    leaves = jax.tree.leaves((args, kwargs))
    if any(isinstance(x, jax.core.Tracer) for x in leaves):
      return False
    key = self._signature(args, kwargs)
    if key in self._verified:
      return False
    self._verified.add(key)
    return True

  def lower(self, *args, **kwargs) -> jax.stages.Lowered:
    """The `jax.stages.Lowered` of the rewritten program."""
    return self._jitted.lower(*args, **kwargs)

  def trace(self, *args, **kwargs) -> jax.stages.Traced:
    return self._jitted.trace(*args, **kwargs)

  def eval_shape(self, *args, **kwargs):
    return self._jitted.eval_shape(*args, **kwargs)

  # -- what it does ----------------------------------------------------------
  def plan(self, *args, **kwargs) -> Plan:
    """The offload plan for these arguments (arrays or ShapeDtypeStructs)."""
    return self._analysis(args, kwargs)[0].plan

  def memory(self, *args, target: str = "h100", **kwargs):
    """XLA's memory for `target` ("h100", "h200", "a100" deviceless, or
    "local") with and without jlms, as a `jlms.MemoryComparison`; warns with
    `jlms.OffloadIneffectiveWarning` when the offload does nothing."""
    from jlms._verify import compare_memory
    return compare_memory(self, *args, target=target, **kwargs)

  # -- internals -----------------------------------------------------------
  def _static_positions(self, nargs: int) -> set[int]:
    return {i % nargs for i in self._static_argnums if -nargs <= i < nargs}

  def _split_static(self, args, kwargs):
    static_pos = self._static_positions(len(args))
    dyn_args = tuple(None if i in static_pos else a for i, a in enumerate(args))
    static_args = tuple((i, args[i]) for i in sorted(static_pos))
    dyn_kwargs = {k: v for k, v in kwargs.items()
                  if k not in self._static_argnames}
    static_kwargs = tuple(sorted((k, v) for k, v in kwargs.items()
                                 if k in self._static_argnames))
    leaves, treedef = jax.tree.flatten((dyn_args, dyn_kwargs))
    return leaves, treedef, static_args, static_kwargs

  @staticmethod
  def _key(leaves, treedef, static_args, static_kwargs) -> tuple:
    return (treedef, static_args, static_kwargs,
            tuple(_compat.abstractify(x) for x in leaves))

  def _signature(self, args, kwargs) -> tuple:
    return self._key(*self._split_static(args, kwargs))

  def _analysis(self, args, kwargs) -> tuple[_Analysis, list]:
    """The cached analysis for these arguments, with their dynamic leaves."""
    split = self._split_static(args, kwargs)
    leaves, treedef, static_args, static_kwargs = split
    key = self._key(*split)
    cached = self._analyses.get(key)
    if cached is not None:
      self._analyses.move_to_end(key)
      return cached, leaves
    out_trees = []

    def flat_fun(*flat):
      dyn_args, dyn_kwargs = jax.tree.unflatten(treedef, flat)
      full_args = list(dyn_args)
      for i, value in static_args:
        full_args[i] = value
      out = self._fun(*full_args, **dyn_kwargs, **dict(static_kwargs))
      out_leaves, out_tree = jax.tree.flatten(out)
      out_trees.append(out_tree)
      return out_leaves

    try:
      # Traced under a jit so that the jaxpr carries the params of a nested
      # jit equation: the rewritten program is staged as one such equation.
      closed = jax.make_jaxpr(jax.jit(flat_fun))(*leaves)
    except jax.errors.JAXTypeError as e:
      e.add_note("jlms.offload traces the step like jax.jit does: it must be "
                 "jittable (mark Python-valued arguments static with "
                 "static_argnums/static_argnames).")
      raise
    jit_params, debug_info = _compat.call_template(closed)
    plain_program = flatten(closed)
    plain_liveness = analyse(plain_program)
    baseline = simulate(plain_program, plain_liveness)
    # Scan residuals go to host slice by slice inside the loops; the
    # top-level offloads are then planned around what is left.
    residuals = ()
    if self.config.scan_residuals:
      residuals = find_scan_residuals(plain_program, plain_liveness,
                                      self.config)
    program = offload_scan_residuals(plain_program, residuals)
    liveness = analyse(program)
    if self.budget is None:
      unforced = analyse_fusion(program, liveness)
      offloads = plan_offloads(program, liveness, self.config,
                               unforced.materialized)
      rewritten = self._rewrite(program, liveness, offloads, self.config,
                                debug_info)
      extra = {}
      config = self.config
    else:
      offloads, rewritten, config, extra = self._fit_budget(
          program, liveness, baseline, jit_params, debug_info, plain_program,
          plain_liveness, leaves)
      if extra["tuning"].chosen is None and not offloads:
        # It fits as it is: the plain program runs, scans untouched.
        program, liveness, residuals = plain_program, plain_liveness, ()
        rewritten = self._rewrite(program, liveness, (), config, debug_info)
    timeline = simulate(program, liveness, offloads)
    analysis = _Analysis(
        program, offloads,
        build_plan(program, liveness, offloads, config, baseline, timeline,
                   residuals=residuals,
                   serialized=len(_serialized(program, liveness, config)),
                   **extra),
        out_trees[-1], rewritten, jit_params)
    self._analyses[key] = analysis
    if len(self._analyses) > _CACHE_SIZE:
      self._analyses.popitem(last=False)
    return analysis, leaves

  @staticmethod
  def _rewrite(program, liveness, offloads, config, debug_info):
    fusion = analyse_fusion(program, liveness,
                            frozenset(o.value for o in offloads))
    return rewrite(program, offloads, config, debug_info, fusion=fusion,
                   serialized=_serialized(program, liveness, config, fusion))

  def _confirm_target(self) -> str | None:
    """Where XLA confirms a budget: the named target, else the local GPU,
    else nowhere (a CPU has no GPU compiler to ask)."""
    if self.target is not None:
      return self.target
    return "local" if jax.default_backend() == "gpu" else None

  @staticmethod
  def _xla_peak(jit_params, rewritten, abstract, target) -> int:
    def program_fn(*leaves):
      return _compat.bind_jit(jit_params, rewritten, leaves)
    return xla_memory(jax.jit(program_fn), *abstract,
                      target=target).peak_bytes

  def _fit_budget(self, program, liveness, baseline, jit_params, debug_info,
                  plain_program, plain_liveness, leaves):
    """Tune for the budget with the simulator, then confirm with XLA,
    tightening the simulator's budget while XLA's peak does not fit.
    `plain_program` is the step before its scan residuals were moved to
    host: what runs if the step fits as it is. The budget is per device:
    XLA compiles the step with the shardings of `leaves`."""
    target = self._confirm_target()
    budget = parse_budget(
        self.budget, lambda: target_memory_bytes(target or "local"))
    avals = [program.avals[v] for v in program.invars]
    abstract = abstract_arguments(avals, leaves)
    log.info("jlms: the step has %d equations and %d values; its arguments "
             "take %s", len(program), len(program.avals),
             format_bytes(sum(liveness.nbytes[v] for v in program.invars)))
    index, size = largest_equation(program, liveness)
    if index >= 0:
      log.info("jlms: the largest equation is %s (equation %d) with %s of "
               "inputs and outputs", program.equations[index].readable_name(),
               index, format_bytes(size))
    searched = budget
    measured = None
    plain_peak = None
    if target is not None and baseline.peak_bytes > budget:
      # The simulator can overstate jax.jit's peak too: ask XLA before
      # offloading a step that already fits.
      plain = self._rewrite(plain_program, plain_liveness, (), self.config,
                            debug_info)
      plain_peak = self._xla_peak(jit_params, plain, abstract, target)
      log.info("jlms: XLA's peak on %s without offloading: %s", target,
               format_bytes(plain_peak))
      if plain_peak <= budget:
        log.info("jlms: the step fits without offloading; nothing is "
                 "rewritten")
        tuning = Tuning(budget, baseline.peak_bytes, None, (), 0.0)
        return (), plain, self.config, dict(
            budget_bytes=budget, tuning=tuning, xla_peak_bytes=plain_peak,
            xla_target=target)
    unseen = unseen_split(avals, leaves)
    if unseen > 1:
      # Auto mesh axes: the simulator sizes whole arrays, XLA and the budget
      # one device's shards. Scale the budget by XLA's ratio of the two for
      # jax.jit's program, or, with no XLA to ask, by the arguments' split.
      scale = unseen if plain_peak is None else (
          baseline.peak_bytes / max(plain_peak, 1))
      searched = int(budget * scale)
      log.info("jlms: the arguments are split %d ways but the step's values "
               "carry no sharding (Auto mesh axes); the simulator searches "
               "for a whole-step peak of %s", unseen, format_bytes(searched))
    def try_most_eager(trial):
      offloads = plan_offloads(program, liveness, trial.config,
                               analyse_fusion(program, liveness).materialized)
      rewritten = self._rewrite(program, liveness, offloads, trial.config,
                                debug_info)
      eager = self._xla_peak(jit_params, rewritten, abstract, target)
      log.info("jlms: XLA's peak of the most eager setting: %s",
               format_bytes(eager))
      tuning = Tuning(budget, baseline.peak_bytes, trial, (trial,), 0.0)
      return eager, offloads, rewritten, tuning

    for _ in range(_CONFIRMATIONS):
      try:
        tuning, offloads = tune(program, liveness, searched, self.config,
                                baseline)
      except BudgetError as error:
        smallest = getattr(error, "smallest", None)
        if target is None or smallest is None:
          raise
        # The simulator sees nothing that fits (it overstates some steps,
        # such as loop bodies' working memory); XLA may still accept the
        # most eager setting.
        eager, offloads, rewritten, tuning = try_most_eager(smallest)
        if eager <= budget:
          measured, config = eager, smallest.config
          break
        earlier = "" if measured is None else (
            f"the plan the simulator predicted to fit has an XLA peak of "
            f"{format_bytes(measured)}, and ")
        raise BudgetError(
            f"jlms: the step does not fit a budget of {format_bytes(budget)} "
            f"on {target}: {earlier}the most eager setting has an XLA peak "
            f"of {format_bytes(eager)}. {error}") from None
      config = tuning.chosen.config if tuning.chosen else self.config
      rewritten = self._rewrite(program, liveness, offloads, config,
                                debug_info)
      if target is None:
        log.info("jlms: not confirmed with XLA (no GPU here and no target= "
                 "named)")
        break

      measured = self._xla_peak(jit_params, rewritten, abstract, target)
      log.info("jlms: XLA's peak on %s: %s (budget %s)", target,
               format_bytes(measured), format_bytes(budget))
      if measured <= budget:
        break
      # The simulator was optimistic by measured/searched-peak: ask it for
      # proportionally less and search again.
      searched = int(searched * budget / measured * 0.97)
      log.warning("jlms: XLA's peak %s exceeds the budget %s; searching "
                  "again for %s", format_bytes(measured), format_bytes(budget),
                  format_bytes(searched))
    else:
      # The re-searches kept landing just above the budget: the most eager
      # setting the simulator saw is the last thing to ask XLA about.
      most_eager = min(tuning.trials, key=lambda t: t.predicted_peak_bytes,
                       default=None)
      eager = None
      if most_eager is not None:
        eager, offloads, rewritten, tuning = try_most_eager(most_eager)
      if eager is None or eager > budget:
        raise BudgetError(
            f"jlms: XLA's peak on {target} is {format_bytes(measured)}, "
            f"above the budget of {format_bytes(budget)}, after "
            f"{_CONFIRMATIONS} searches and the most eager setting; raise "
            "the budget or lower min_bytes/prefetch_ahead")
      measured, config = eager, most_eager.config
    extra = dict(budget_bytes=budget, tuning=tuning, xla_peak_bytes=measured,
                 xla_target=target if measured is not None else None)
    return offloads, rewritten, config, extra

  def _rewritten(self, *args, **kwargs):
    analysis, leaves = self._analysis(args, kwargs)
    outs = _compat.bind_jit(analysis.jit_params, analysis.rewritten, leaves)
    return jax.tree.unflatten(analysis.out_tree, outs)


def _serialized(program, liveness, config, fusion=None) -> frozenset:
  if not config.serialize and config.serialize_by_size is None:
    return frozenset()
  if fusion is None:
    fusion = analyse_fusion(program, liveness)
  runs_in_place = fusion.executes_at == np.arange(len(program))
  return serialized_equations(program, liveness, runs_in_place,
                              config.serialize, config.serialize_by_size)


def offload(fun: Callable | None = None, *,
            min_bytes: int = OffloadConfig.min_bytes,
            swapout_threshold: int = OffloadConfig.swapout_threshold,
            prefetch_ahead: int = OffloadConfig.prefetch_ahead,
            swapin_groupby: int | None = OffloadConfig.swapin_groupby,
            sync_mode: int | SyncMode = OffloadConfig.sync_mode,
            scan_residuals: bool = OffloadConfig.scan_residuals,
            serialize=OffloadConfig.serialize,
            serialize_by_size: int | None = OffloadConfig.serialize_by_size,
            static_argnums: int | Sequence[int] = (),
            static_argnames: str | Sequence[str] = (),
            donate_argnums: int | Sequence[int] = (),
            donate_argnames: str | Sequence[str] = (),
            verify: bool | None = None,
            budget: int | str | None = None,
            target: str | None = None):
  """Wraps a train step so that its large, long-lived values live on host.

  Use like `jax.jit`: `step = jlms.offload(train_step)` or as a decorator,
  with or without arguments. The step's jaxpr (forward, backward and update
  together) is flattened, every value's reads are found, and each floating
  point value of at least `min_bytes` that is not read for more than
  `swapout_threshold` equations is copied to pinned host memory after its
  last near read and brought back `prefetch_ahead` equations before it is
  needed again.

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
    budget: device memory the step may use: bytes, a size such as "20GiB",
      or a percentage such as "90%" of the device's (or the target's)
      memory. The knobs `min_bytes` and `swapout_threshold` are then
      searched for the least host traffic whose predicted peak fits; a step
      that fits as it is is not rewritten. The choice is confirmed with XLA
      (on `target`, else on the local GPU) and searched again while XLA's
      peak does not fit. Raises `jlms.BudgetError` when nothing fits.
    target: "h100", "h200", "a100" (deviceless compile) or "local": where
      XLA confirms a budget. None: the local GPU if there is one, else the
      choice rests on the simulator alone.

  Returns:
    An `OffloadedStep`: call it like the step; `.lower(...)`, `.trace(...)`
    and `.plan(...)` inspect it.
  """
  config = OffloadConfig(min_bytes=min_bytes,
                         swapout_threshold=swapout_threshold,
                         prefetch_ahead=prefetch_ahead,
                         swapin_groupby=swapin_groupby, sync_mode=sync_mode,
                         scan_residuals=scan_residuals, serialize=serialize,
                         serialize_by_size=serialize_by_size)
  jit_options = dict(static_argnums=static_argnums,
                     static_argnames=static_argnames,
                     donate_argnums=donate_argnums,
                     donate_argnames=donate_argnames, verify=verify,
                     budget=budget, target=target)
  if fun is None:
    return lambda f: OffloadedStep(f, config, **jit_options)
  return OffloadedStep(fun, config, **jit_options)
