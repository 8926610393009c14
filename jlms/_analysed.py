"""A step's program analysed, and the program that runs for it.

`AnalysedProgram` is a flat program with its liveness and fusion, analysed
once and read by the planner, the simulator, the time model and the
rewrite. `PlannedStep` is what a signature of an `OffloadedStep` runs: the
rewritten closed jaxpr, its plan, and where its state lives. The functions
here turn one into the other without choosing anything: the rewrite of a
chosen plan, `jax.jit`'s program as it is, XLA's peak of a program, and
the predicted step times of a plan.

Guarantees: nothing here decides what to keep, remake or copy (that is
`jlms._search` and `jlms._fit`); the same inputs give the same program.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import numpy as np

from jlms import _compat
from jlms._config import OffloadConfig, SyncMode
from jlms._cost import kernel_seconds
from jlms._liveness import analyse
from jlms._placement import place_fused_at_readers
from jlms._plan import Plan, build_plan
from jlms._loops import find_scan_residuals, offload_scan_residuals
from jlms._planner import Offload, plan_offloads
from jlms._program import Program
from jlms._rewrite import rewrite
from jlms._schedule import predict_step_time
from jlms._serialize import serialized_equations
from jlms._simulator import analyse_fusion, simulate
from jlms._state import FITTED_COMPILER_OPTIONS, HostState
from jlms._units import format_bytes
from jlms._xla_memory import xla_memory


@dataclasses.dataclass(frozen=True)
class AnalysedProgram:
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
  # The runs of equations that run in chunks over the batch
  # (`jlms._batch_split`), described.
  split_runs: tuple = ()
  # Per input position, how the argument's sharding cuts its leading axis
  # (`jlms._sharding.leading_split`, None: not cut); empty: none is.
  leading_splits: tuple = ()

  @classmethod
  def of(cls, program: Program) -> "AnalysedProgram":
    liveness = analyse(program)
    return cls(program, liveness, analyse_fusion(program, liveness))


class PlanNeeded(Exception):
  """Planning failed where the step does not fit its budget as it is (the
  failure is the `__cause__`)."""

  def __init__(self, budget: int):
    super().__init__(format_bytes(budget))


@dataclasses.dataclass(frozen=True)
class PlannedStep:
  """The program one signature of a step runs, with its plan."""
  program: Program
  offloads: tuple[Offload, ...]
  plan: Plan
  out_tree: Any
  rewritten: Any  # the closed jaxpr that runs
  jit_params: dict  # params of the nested-jit equation that stages it
  plain: Any = None  # the step as traced, analysed (`AnalysedProgram`)
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
  # The program was fitted to a budget by jlms: it is compiled with
  # `FITTED_COMPILER_OPTIONS`, as XLA confirmed it.
  fitted: bool = False
  # (name, value) pairs of the XLA options a fitted program compiles and
  # runs with, where the search chose them (the scheduler's memory limit
  # for its budget, `jlms._schedule.scheduler_slop_factor`); empty:
  # `FITTED_COMPILER_OPTIONS`.
  compiler_options: tuple = ()
  # (output position, sharding) of the outputs returned in place of an
  # argument that is not donated, given its split under Auto mesh axes
  # (`jlms._sharding.kept_shardings`).
  kept_shardings: tuple = ()

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


def failed(error: BaseException) -> PlannedStep:
  """The program of a signature jlms has none for: jax.jit's runs."""
  return PlannedStep(None, (), None, None, None, None, failure=error)


def predicted_baseline(plain: AnalysedProgram):
  """The simulator's timeline of `jax.jit`'s program."""
  return simulate(plain.program, plain.liveness, fusion=plain.fusion)


def serialized(program, liveness, config, fusion=None) -> frozenset:
  """The equations that `config`'s serialization chains."""
  if not config.serialize and config.serialize_by_size is None:
    return frozenset()
  if fusion is None:
    fusion = analyse_fusion(program, liveness)
  runs_in_place = fusion.executes_at == np.arange(len(program))
  return serialized_equations(program, liveness, runs_in_place,
                              config.serialize, config.serialize_by_size)


def rewrite_with_and_without_copies(*args, **kwargs):
  """`rewrite(*args, **kwargs)`, and a function that makes it again with
  the copies left out (the same barriers, so that a benchmark times the
  schedule that runs)."""
  return (rewrite(*args, **kwargs),
          functools.partial(rewrite, *args, **kwargs, transfers=False))


def rewrite_program(program, liveness, offloads, config, debug_info,
                    fusion=None, shardings=None):
  """The rewritten closed jaxpr of `program` with `offloads` (copied over
  the link in `shardings`, see `jlms._rewrite.rewrite`), and a function
  that makes it again with the copies left out."""
  if fusion is None:
    fusion = analyse_fusion(program, liveness,
                            frozenset(o.value for o in offloads))
  return rewrite_with_and_without_copies(
      program, offloads, config, debug_info, fusion=fusion,
      serialized=serialized(program, liveness, config, fusion),
      shardings=shardings)


def predict_times(target, plain, planned=None, offloads=(), sync_mode=None,
                  residuals=()):
  """The predicted step times of `jax.jit`'s program and, given the
  `planned` (program, liveness, fusion), of the plan's, on `target`."""
  # Priced with fused equations where XLA runs them, as `jlms._fit` does.
  placed = AnalysedProgram.of(place_fused_at_readers(
      plain.program, plain.liveness, plain.fusion))
  baseline = predict_planned(
      target, (placed.program, placed.liveness, placed.fusion))
  step_time = baseline
  if planned is not None:
    step_time = predict_planned(target, planned, offloads, sync_mode,
                                residuals)
  return baseline, step_time


def predict_planned(target, planned, offloads=(), sync_mode=SyncMode.NONE,
                    residuals=(), state_copies=()):
  """The predicted step time on `target` of the `planned` (program,
  liveness, fusion) with its `offloads`, streamed scan `residuals` and
  copies of state kept on host."""
  program, liveness, fusion = planned
  return predict_step_time(
      program, liveness, kernel_seconds(program, target, fusion, liveness),
      offloads, target, sync_mode, residuals, state_copies)


def step_time_fields(target, plain, planned=None, offloads=(),
                     sync_mode=None, residuals=()) -> dict:
  """Plan fields that predict, when asked, the step time of `jax.jit`'s
  program and, given the `planned` (program, liveness, fusion), of the
  plan's; asked with keywords, on `target` with those fields replaced
  (`jlms.Plan.step_times_with`)."""
  return dict(step_times=lambda **constants: predict_times(
      dataclasses.replace(target, **constants), plain, planned, offloads,
      sync_mode, residuals), time_target=target.name)


def as_is(plain, baseline, jit_params, debug_info, out_trees, config,
          target, budget, xla, reason=None) -> PlannedStep:
  """jax.jit's program, unchanged, with its plan (and the `reason`, when
  a plan was made but not applied); `xla` is (XLA's peak, its target) or
  None."""
  rewritten = plain.traced  # the step's own jaxpr, as traced
  without_copies = None
  if config.serialize or config.serialize_by_size is not None:
    rewritten, without_copies = rewrite_program(
        plain.program, plain.liveness, (), config, debug_info, plain.fusion)
  plan = build_plan(
      plain.program, plain.liveness, (), config, baseline, baseline,
      budget_bytes=budget, fitted=True,
      xla_peak_bytes=None if xla is None else xla[0],
      xla_target=None if xla is None else xla[1], not_applied=reason,
      **step_time_fields(target, plain))
  return PlannedStep(plain.program, (), plan, out_trees[-1], rewritten,
                     jit_params, rewrite_without_copies=without_copies)


def placed_for(leaves, positions) -> list:
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


def xla_compiled(jit_params, rewritten, abstract, target, donated=(),
                 host_inputs=(), fitted: bool = True, options=None):
  """XLA's `XlaMemory` of `rewritten` on `target` (its peak and its
  compiled program), its `donated` leaves donated as the step donates
  them (XLA reuses their buffers for outputs), its `host_inputs` leaves
  taken from pinned host memory; compiled as a `fitted` plan runs (with
  `options`, else `FITTED_COMPILER_OPTIONS`), or as jax.jit compiles the
  step."""
  def program_fn(*leaves):
    return _compat.bind_jit(jit_params, rewritten,
                            placed_for(leaves, host_inputs))
  if not fitted:
    options = None
  elif not options:
    options = dict(FITTED_COMPILER_OPTIONS)
  jitted = jax.jit(program_fn, donate_argnums=donated,
                   compiler_options=options)
  return xla_memory(_HostArguments(jitted, host_inputs), *abstract,
                    target=target)


def xla_peak(jit_params, rewritten, abstract, target, donated=(),
             host_inputs=(), fitted: bool = True, options=None) -> int:
  """XLA's peak of `rewritten` on `target` (see `xla_compiled`)."""
  return xla_compiled(jit_params, rewritten, abstract, target, donated,
                      host_inputs, fitted, options).peak_bytes


def knobs_applied(plain, baseline, jit_params, debug_info, out_trees,
                  config: OffloadConfig, target,
                  link_shardings=None) -> PlannedStep:
  """TFLMS's rules with the expert's knobs, exactly: scan residuals
  streamed, then every value far enough from its next read offloaded;
  `link_shardings(program, offloads)` gives the shardings the copies
  cross the link in."""
  plain_program, plain_liveness = plain.program, plain.liveness
  residuals = ()
  if config.scan_residuals:
    residuals = find_scan_residuals(plain_program, plain_liveness, config)
  program = offload_scan_residuals(plain_program, residuals)
  liveness = analyse(program)
  unforced = analyse_fusion(program, liveness)
  offloads = plan_offloads(program, liveness, config, unforced.materialized)
  forced = analyse_fusion(program, liveness,
                          frozenset(o.value for o in offloads))
  rewritten, without_copies = rewrite_program(
      program, liveness, offloads, config, debug_info, forced,
      shardings=link_shardings and link_shardings(program, offloads))
  timeline = simulate(program, liveness, offloads, forced)
  plan = build_plan(
      program, liveness, offloads, config, baseline, timeline,
      residuals=residuals,
      serialized=len(serialized(program, liveness, config, forced)),
      **step_time_fields(target, plain, (program, liveness, forced),
                         offloads, config.sync_mode, residuals))
  return PlannedStep(program, offloads, plan, out_trees[-1], rewritten,
                     jit_params, rewrite_without_copies=without_copies)
