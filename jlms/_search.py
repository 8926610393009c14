"""The budget search: the fastest plan of a step that fits its budget.

`fit_budget(request)` takes one traced signature of a step (a
`SearchRequest`: the step analysed, its arguments, what the user asked)
and returns the `PlannedStep` that runs. In order:

1. The budget in bytes and where XLA confirms it (`confirm_target`).
2. The ways of placing the step's state (`state_levels`): on the device as
   it is, with its updates inside the loops that make their gradients,
   the optimizer's moments on host in steps, all of it on host.
3. For each, until one fits (`_search_levels`), or until XLA's peak is
   further over the budget than the state left on the device could save
   (`_out_of_reach`): the fastest fit of every way its loops can run
   (`fastest_fit`, over `jlms._variants`), chosen per value by
   `jlms._fit` with the simulator and the time model;
4. confirmed by XLA's deviceless compile, and fitted again for a
   proportionally tighter budget while XLA's peak does not fit, at most
   `CONFIRMATIONS` compiles (`_confirmed`).

A step that fits as it is stays `jax.jit`'s program. Raises `BudgetError`
where nothing fits.
"""

from __future__ import annotations

import dataclasses
import logging
import numbers
import time
from typing import Any

from jlms import _compat, _thresholds
from jlms._analysed import (AnalysedProgram, PlanNeeded, PlannedStep, as_is,
                            predict_planned, predict_times, rewrite_program,
                            rewrite_with_and_without_copies, serialized,
                            xla_compiled)
from jlms._collectives import collective_bytes
from jlms._budget import BudgetError, host_pool_advice, parse_budget
from jlms._config import SyncMode
from jlms._cost import time_target
from jlms._fit import Fitter
from jlms._latency_profile import (PROFILE_CHECK_OFF, PROFILE_OPTION,
                                   latency_profile, schedule_of,
                                   write_profile)
from jlms._liveness import aval_nbytes
from jlms._plan import build_plan
from jlms._options import DEVICE, SearchOptions
from jlms._progress import Progress
from jlms._schedule import (per_device, scheduler_overlaps,
                            scheduler_slop_factor)
from jlms._segment_remat import remaking_barriers
from jlms._sharding import (abstract_arguments, argument_device_bytes,
                            device_count, link_shardings, unseen_split)
from jlms._state import (FITTED_COMPILER_OPTIONS, HostState, host_state,
                         state_pairs)
from jlms._state_order import hidden_updates_first
from jlms._tradeoff import Tradeoff, TradeoffPoint
from jlms._units import format_bytes
from jlms._update_order import worth_holding_in_place
from jlms._variants import WayCache, placed_ways
from jlms._xla_memory import (LOCAL_TARGET, DevicelessUnavailableError,
                              check_local_gpu, target_memory_bytes,
                              target_of_arguments)

log = logging.getLogger("jlms")

#: XLA compiles of a plan at most (after the step as it is). Three: the
#: simulator's error grows as a plan remakes more (Llama-3.2-3B, plain:
#: 76.7 GiB predicted, 82.5 by XLA; refitted to 71.4, 79.5 by XLA, 0.4
#: GiB over the H100), and the least-memory plan that follows a last
#: refusal is far slower than a third fit.
CONFIRMATIONS = 3
# A plan whose XLA peak leaves more than this share of the budget unused is
# fitted once more with that room, and the new plan is compiled when the
# time model puts it faster by at least `_FASTER_BY`, and taken if XLA says
# it fits. A compile of a large step costs as much as jax.jit's own (30 s
# for Gemma2-2B's plan): a plan 0.5% faster is not worth a third more
# planning (Gemma2-2B split over the batch: 1.80 against 1.81 s predicted).
# For a step of at most `_CHEAP_COMPILE_EQUATIONS` equations any faster
# plan is compiled (`_FASTER_BY_CHEAPLY`): the 16-block ResNet of the
# frontier (4029 equations) at a budget halfway to jax.jit's peak left 6% of
# it unused after the first fit. The step's size decides, not how long a
# compile took here, so that the plan does not depend on the machine's
# load (that ResNet's compiles passed 10 s on a busy 2-core machine, and it
# got the first plan there and the faster one elsewhere); the library
# models, whose compiles take 20 to 40 s, have 11000 to 17000.
_UNUSED_ROOM = 0.01
_FASTER_BY = 0.02
_FASTER_BY_CHEAPLY = 0.001
_CHEAP_COMPILE_EQUATIONS = 8000
# Where XLA confirms, the first fit is for this share less than the budget:
# the simulator's peak of a fitted plan falls up to 2% under XLA's on the
# library models (Gemma2-2B split over the batch: 78.55 against 80.12 GiB
# at 79.11), and each compile over the budget costs a fit and a compile
# more (20 s on that step, whose jax.jit lowers and compiles in 22 s).
_MARGIN = 0.03
# XLA's rematerialization pass holds a program to a limit of its own, about
# three quarters of the device's memory on an H100 (60.33 to 62.14 GiB of
# 79.11 seen on the library models), re-running work to meet it: a jlms
# plan of Gemma2-2B at 77.9 GiB took 1117 ms by the schedule model with the
# pass and 996 ms without. So jax.jit's program above this share of the
# budget is compiled again without the pass, and runs without it if it
# fits so; it is planned if not. The peak does not say whether the pass
# changed the program: where it cannot meet its limit it still re-runs
# work, at no saving (the NNX decoder of `benchmarks.real_models`: "only
# reduced to 60.41GiB, down from 60.41GiB", and 268.5 ms by the schedule
# model with the pass, where per-block remat takes 150.1).
_XLA_REMAT_SHARE = 0.7
# Where the simulator's peak of jax.jit's program is more than this factor
# above XLA's, the search is scaled by their ratio (`_search_budget`). Our
# own models are within 10%; library models whose programs XLA
# rematerializes itself reach 1.2x to 2.7x (issue 35).
_OVERSTATED = 1.2
# For the least memory, ways whose predicted peak is within this factor of
# the smallest count as reaching it: the fastest of them is chosen.
_LEAST_PEAK_SLACK = 1.01
# Fits predicted within this share of each other take the same time: the
# one that moves the fewest bytes over the host link is taken first.
_SAME_TIME = 0.01
# For the least memory, XLA compiles the plans of the ways with the next
# smallest predicted peaks too where they are within this of the smallest
# (`_least_by_xla`) ...
_LEAST_PEAK_COMPARED = 1.25
# ... of at most this many ways, the smallest predicted peaks first.
_LEAST_COMPILED = 3
# Where XLA refuses a plan, another way's fit for the same budget is
# compiled before a tighter fit if the time model puts it at most this
# much slower (`_near`): the model's error between ways is about this
# (Llama-3.2-3B: its blocks remade predicted 3% slower than its values
# remade one by one).
_NEXT_WAY_SLOWER_BY = 0.10
# ... unless XLA's peak of the refused plan is within this share over the
# budget: the simulator was nearly right about that way, and a tighter fit
# of every way (the refused one ranked by the same model) comes first. The
# 8B Llama with its state on host: its values remade one by one, 76.73 GiB
# predicted and 79.96 by XLA at 79.11; its segments remade, the next
# fastest ways, 76.14 and 76.02 predicted and 88.35 and 117.31 by XLA.
# (Gemma2-2B at remat's 49.96 GiB, its values remade one by one, 2.9% over:
# its segments remade fitted, as another way.)
_CLOSE_MISS = 0.02
# Under a budget, the optimizer's moments go to host in steps of this share
# of their bytes, the largest leaves first, until the plan fits.
_STATE_LEVEL_SHARE = 0.125
# A placement of the state saves at most the state it moves to host and
# as much again in gradients (`_out_of_reach`): past that, XLA's peak of a
# plan is its own (a tiny attention step: 4.05 MiB by XLA for 0.05
# predicted, at every placement).
_LEVEL_REACH = 2
# XLA's GPU scheduler runs a copy to or from host memory as an
# asynchronous computation, and keeps at most this option's number of them
# in flight (two by default, jaxlib 0.10.2 and 0.12.0.1). A loop that
# fetches and writes back several buffers an iteration then had its
# write-backs take both places beside the kernels and each fetch waited
# for right after its start: a 4-layer GPT of width 4096 with six
# moments on host in its backward loop, 345 ms by the schedule model for
# 176 ms of compute; with room for eight, 262 (JAX 0.12.0.1: 307 and 258).
# The scheduler still holds the program to its memory limit, and XLA's
# peak that confirms a plan is of the program compiled with this option.
ASYNC_COPIES_OPTION = "xla_gpu_experimental_parallel_async_compute_limit"
ASYNC_COPIES_IN_FLIGHT = 8
# The compiled programs a search keeps the text of: the chosen plan is one
# of the last few compiled (a faster fit tried and refused comes after it).
_PROGRAMS_KEPT = 4
# Failures that are the user's to act on, never hidden by running jax.jit's
# program instead: a budget that cannot be met, a GPU target this machine
# cannot compile for (the error says what to install).
NOT_FALLEN_BACK_FROM = (BudgetError, DevicelessUnavailableError)


def confirm_target(options: SearchOptions, leaves=(),
                   on_gpu: bool = False) -> str | None:
  """Where XLA confirms a budget: the named target, else (for the
  device's memory) the GPU target whose compile-only devices the
  arguments `leaves` are placed on, else the local GPU (`on_gpu`), else
  nowhere (a CPU has no GPU compiler to ask)."""
  if options.target == LOCAL_TARGET and not on_gpu:
    check_local_gpu()  # says what to name instead
  if options.target is not None:
    return options.target
  placed_on = (target_of_arguments(leaves) if options.budget is DEVICE
               else None)
  if placed_on is not None:
    return placed_on
  return "local" if on_gpu else None


@dataclasses.dataclass(frozen=True)
class SearchRequest:
  """One traced signature of a step, to fit."""
  options: SearchOptions
  plain: AnalysedProgram  # the step as traced
  baseline: Any  # the simulator's timeline of jax.jit's program
  jit_params: dict
  debug_info: Any
  leaves: tuple  # the call's dynamic leaves (arrays or abstract)
  out_trees: list
  donated: tuple = ()  # positions of the donated leaves
  arrived_on_host: tuple = ()  # positions of leaves in pinned host memory
  ways: WayCache = dataclasses.field(default_factory=WayCache)
  progress: Progress = dataclasses.field(
      default_factory=lambda: Progress("the step"))
  on_gpu: bool = False  # jax's default backend is a GPU
  # Seconds of each XLA compile of the search, in order.
  compile_seconds: list = dataclasses.field(default_factory=list)
  # Bytes one device exchanges with the others in a step, read from each
  # XLA compile of a sharded step: by the compiled program's id, and
  # "plain" for jax.jit's.
  exchanged: dict = dataclasses.field(default_factory=dict)
  # The `jlms._fit.Fitter` of each placed way of the placement of the
  # state being searched (`fitter_of`).
  fitters: dict = dataclasses.field(default_factory=dict)
  # The texts of the programs XLA compiled last, by the rewritten
  # program's id: what a latency profile names (`_with_latency_profile`).
  last_compiled: dict = dataclasses.field(default_factory=dict)
  # Filled by `fit_budget`: where XLA confirms, the budget, the arguments.
  target: str | None = None
  budget: int | None = None
  abstract: tuple = ()
  avals: tuple = ()

  @property
  def time(self):
    """The time model the fit prices plans with."""
    return time_target(self.options.target)

  @property
  def split(self) -> int:
    """How many times one device's bytes the step's jaxpr sizes are: the
    arguments' split under Auto mesh axes, else 1."""
    if device_count(self.leaves) <= 1:
      return 1
    return unseen_split(list(self._argument_avals()), self.leaves)

  def _argument_avals(self) -> tuple:
    """The avals of the step's arguments, as traced."""
    return self.avals or tuple(self.plain.program.avals[v]
                               for v in self.plain.program.invars)

  @property
  def host_scale(self) -> float:
    """Bytes of one GPU's pinned host pool per byte of the step's jaxpr
    sizes. XLA gives each GPU its own pool (a `GetGpuHostAllocator` per
    addressable device for the host memory space, in openxla/xla's
    `se_gpu_pjrt_client.cc`), and the sizes are one device's, or under Auto
    mesh axes the whole step's: 1/8 for a step split eight ways there."""
    return 1 / self.split

  def host_pool(self) -> int:
    """One GPU's pinned host memory the plan may hold at once: `host_budget`,
    else XLA's pool."""
    return self.options.host_budget_bytes(
        confirm_target(self.options, on_gpu=self.on_gpu) == "local")

  def host_budget(self) -> int:
    """`host_pool` in the step's jaxpr sizes."""
    return int(self.host_pool() / self.host_scale)

  def link_shardings(self, program, offloads) -> dict:
    """The shardings `program`'s values copied to host by `offloads` cross
    the link in where the arguments' splits are unseen
    (`jlms._sharding.link_shardings`); none otherwise."""
    if self.split <= 1:
      return {}
    copied = {o.value: program.avals[o.value] for o in offloads
              if not o.is_recompute}
    return link_shardings(copied, self._argument_avals(), self.leaves)

  def time_for(self, program, peak_bytes):
    """The time model for `program` peaking at `peak_bytes` (None: its
    arguments and outputs alone), both in the jaxpr's sizes: whether
    XLA's scheduler will overlap its streamed copies
    (`jlms._schedule.scheduler_overlaps`) on the request's target, whose
    memory counts `split` times where the sizes are the whole step's."""
    return dataclasses.replace(self.time, streams_hide=scheduler_overlaps(
        program, peak_bytes, self._device_bytes(),
        self.slop_factor(program)))

  def _device_bytes(self) -> int | None:
    if self.target is None:
      return None
    return target_memory_bytes(self.target) * self.split

  def slop_factor(self, program, host_temp_bytes: int = 0) -> int | None:
    """The scheduler's memory limit jlms compiles `program` with where it
    copies over the link (`jlms._schedule.scheduler_slop_factor`), for the
    request's budget; None for XLA's default."""
    budget = None if self.budget is None else self.budget * self.split
    return scheduler_slop_factor(program, budget, self._device_bytes(),
                                 host_temp_bytes)

  def compiler_options(self, candidate) -> dict:
    """The XLA options `candidate` (a fit, rewritten) compiles and runs
    with: `FITTED_COMPILER_OPTIONS`, and where it copies over the link,
    the scheduler's memory limit for its budget and room for
    `ASYNC_COPIES_IN_FLIGHT` copies at once."""
    options = dict(FITTED_COMPILER_OPTIONS)
    placed, result = candidate.placed, candidate.result
    if not (placed.state_copies or candidate.residuals
            or any(not o.is_recompute for o in result.offloads)):
      return options  # nothing over the link: XLA's default limit
    options[ASYNC_COPIES_OPTION] = ASYNC_COPIES_IN_FLIGHT
    # What the plan holds on host beside the state it takes from there:
    # its activations copied out, its streamed stacks.
    taken_from_host = sum(aval_nbytes(placed.program.avals[v])
                          for v in placed.program.invars
                          if _compat.is_host_aval(placed.program.avals[v]))
    factor = self.slop_factor(placed.program, max(
        0, result.timeline.host_peak_bytes - taken_from_host))
    if factor is not None:
      options["xla_gpu_memory_limit_slop_factor"] = factor
    log.debug("jlms: XLA's scheduler memory limit for this plan: slop "
              "factor %s", factor)
    return options

  def as_is(self, budget, xla, reason=None) -> PlannedStep:
    """jax.jit's program, with its plan (its times per device, for a
    sharded step)."""
    planned = as_is(self.plain, self.baseline, self.jit_params,
                    self.debug_info, self.out_trees, self.options.config,
                    self.time, budget, xla, reason)
    whole = planned.plan.step_times
    if device_count(self.leaves) <= 1 or whole is None:
      return planned
    plan = dataclasses.replace(
        planned.plan, split=self.split,
        step_times=lambda **constants: self.per_device_times(
            whole(**constants), self.plain.program, None, "plain"))
    return dataclasses.replace(planned, plan=plan)

  def xla_peak(self, rewritten, host_inputs=(), fitted=True,
               key=None, options=None) -> int:
    """XLA's peak on the request's target of `rewritten`, compiled as a
    `fitted` plan runs (XLA's rematerialization off), or as jax.jit
    compiles the step; the seconds it took go to `compile_seconds`, and
    for a sharded step what a device exchanges to `exchanged` (under
    `key`, else the program's id)."""
    self.progress.stage(f"XLA compiling a program for {self.target}")
    start = time.perf_counter()
    devices = device_count(self.leaves)
    memory = xla_compiled(self.jit_params, rewritten, self.abstract,
                          self.target, self.donated, host_inputs, fitted,
                          options)
    if devices > 1:  # what the devices exchange, from the same compile
      self.exchanged[id(rewritten) if key is None else key] = (
          collective_bytes(memory.hlo_text, devices))
    self.last_compiled[id(rewritten)] = memory.hlo_text
    while len(self.last_compiled) > _PROGRAMS_KEPT:
      del self.last_compiled[next(iter(self.last_compiled))]
    peak = memory.peak_bytes
    self.compile_seconds.append(time.perf_counter() - start)
    return peak

  def per_device_times(self, times, program, peak_bytes, compiled):
    """`times`, a (jax.jit's, the plan's) pair of `StepTime`s priced on
    the step's jaxpr, as one device of a sharded step runs them
    (`jlms._schedule.per_device`, with what the `compiled` program, or
    "plain", exchanges; unchanged on one device)."""
    if device_count(self.leaves) <= 1:
      return times
    split = self.split
    target = self.time_for(  # XLA's peak is one device's
        program, None if peak_bytes is None else peak_bytes * split)
    planned = self.exchanged.get(
        compiled if isinstance(compiled, str) else id(compiled), 0)
    baseline = self.exchanged.get("plain", planned)
    return (per_device(times[0], split, baseline, target),
            per_device(times[1], split, planned, target))


def fit_budget(request: SearchRequest) -> PlannedStep:
  """The fastest plan whose peak fits the budget (see the module
  docstring). The budget is per device: XLA compiles the step with the
  shardings of the request's leaves."""
  options, plain = request.options, request.plain
  target = confirm_target(options, request.leaves, request.on_gpu)
  budget = options.budget_bytes(target)
  no_device = options.budget is DEVICE and budget is None
  if no_device:
    if not (options.state_on_host and request.donated):
      log.info("jlms: no GPU here and no target named: the step runs as "
               "jax.jit's program")
      return request.as_is(None, None)
    # The state on host was asked for, with no device to fit: it goes
    # there, and the rest of the step is held to jax.jit's own peak (by
    # the simulator), which it meets as it is.
    budget = request.baseline.peak_bytes
    log.info("jlms: no GPU here and no target named: the state goes to "
             "host as asked, within jax.jit's own peak")
  avals = tuple(plain.program.avals[v] for v in plain.program.invars)
  request = dataclasses.replace(
      request, target=target, budget=budget, avals=avals,
      abstract=tuple(abstract_arguments(list(avals), request.leaves)))
  log.info("jlms: the step has %d equations and %d values; its arguments "
           "take %s", len(plain.program), len(plain.program.avals),
           format_bytes(sum(plain.liveness.nbytes[v]
                            for v in plain.program.invars)))
  levels = state_levels(request)
  if levels[0].state:  # asked for, or the least memory: never as it is
    planned = _search_levels(request, levels, None)
    if budget is None and len(levels) > 1 and planned.state.inputs:
      planned = _lower_of(request, planned, levels[1:])
    # With no device to fit, jax.jit's program (the state on the device)
    # meets what the user asked of memory: a failure of jlms's program
    # falls back to it, with a warning.
    return (dataclasses.replace(planned, needs_plan=False) if no_device
            else planned)
  baseline = request.baseline
  plain_peak = None
  if budget is not None and baseline.peak_bytes <= budget and target is None:
    log.info("jlms: the step fits %s as it is (predicted %s); nothing is "
             "rewritten", format_bytes(budget),
             format_bytes(baseline.peak_bytes))
    return request.as_is(budget, None)
  if budget is not None and target is not None:
    # The simulator can be off either way: ask XLA before offloading.
    plain_peak = _plain_xla_peak(request)
    log.info("jlms: XLA's peak on %s without offloading: %s", target,
             format_bytes(plain_peak))
    if plain_peak <= budget:
      if plain_peak <= _XLA_REMAT_SHARE * budget:
        log.info("jlms: the step fits %s as it is; nothing is rewritten",
                 format_bytes(budget))
        return request.as_is(budget, (plain_peak, target))
      # XLA's rematerialization may have re-run work in jax.jit's program
      # to meet its own limit, under the device's memory; where it fits
      # without the pass, it runs so.
      own = _plain_xla_peak(request, fitted=True)
      log.info("jlms: XLA's peak of jax.jit's program with its "
               "rematerialization: %s; without it: %s",
               format_bytes(plain_peak), format_bytes(own))
      if own <= budget:
        return dataclasses.replace(request.as_is(budget, (own, target)),
                                   fitted=True)
      plain_peak = own
  return _search_levels(request, levels, plain_peak)


def _plain_xla_peak(request: SearchRequest, fitted: bool = False) -> int:
  """XLA's peak of jax.jit's program (as jlms stages it) on the target,
  compiled as jax.jit compiles it, or as jlms compiles a `fitted` plan
  (XLA's rematerialization off)."""
  plain = request.plain
  rewritten, _ = rewrite_program(plain.program, plain.liveness, (),
                                 request.options.config, request.debug_info,
                                 plain.fusion)
  return request.xla_peak(rewritten, fitted=fitted,
                          key=None if fitted else "plain")


def _search_levels(request: SearchRequest, levels, plain_peak
                   ) -> PlannedStep:
  """`_search_budget` for each way of placing the state (`levels`, all
  on the device first, then the optimizer's moments on host, then all of
  it), until one fits; the budget's error if none does."""
  budget = request.budget
  refused_for_host = None
  host_refused = []  # placements refused for host memory alone
  on_device_least = None  # XLA's least peak with the state on the device
  only_the_last = False
  for number, plain in enumerate(levels):
    last = number == len(levels) - 1
    if only_the_last and not last:
      continue
    held = _state_held_on_device(request, plain)
    if not last and budget is not None and held > budget:
      # Arguments stay in device memory the whole step: no plan of this
      # placement fits (the 70B Llama over eight H100s: 98.6 GiB of state
      # a device with all of it there, 86.2 with the first share of its
      # moments on host; each placement fitted took minutes).
      log.info("jlms: with %d state leaves on host, the state left on "
               "each device takes %s, over the budget of %s by itself; "
               "that placement is not fitted", len(plain.state.inputs),
               format_bytes(held), format_bytes(budget))
      continue
    try:
      planned = _search_budget(dataclasses.replace(request, plain=plain),
                               plain_peak, ask_xla_when_refused=last)
      break
    except BudgetError as error:
      if hasattr(error, "host_bytes"):
        # Where only host memory is short, the way that needs the least
        # of it says what to set.
        if (refused_for_host is None
            or error.host_bytes < refused_for_host.host_bytes):
          refused_for_host = error
        host_refused.append(plain)
      if last:
        # Nothing fits: the first placement refused for host memory whose
        # plan fits the device with no host limit says what to ask for.
        for refused in host_refused:
          needed = _host_needed(request, refused, plain_peak)
          if needed is not None:
            raise _short_of_host(request, needed, error) from None
        if refused_for_host is not None and hasattr(error, "host_bytes"):
          raise refused_for_host from None
        raise
      least = getattr(error, "least_by_xla", None)
      if least is None:  # the smallest peak XLA gave this placement
        least = getattr(error, "smallest_bytes", None)
      if least is not None and not plain.state.inputs:
        on_device_least = (least if on_device_least is None
                           else min(on_device_least, least))
      elif (least is not None and on_device_least is not None
            and least >= on_device_least):
        # State on host did not bring XLA's peak under what it was with
        # all of it on the device: its slices and copies cost the device
        # more than the state they moved (a 3-layer step with 2 MiB of
        # state: 9.3 to 9.96 MiB by XLA with 1 to 12 leaves on host, 7.95
        # with none; six compiles a placement, 80 s in all). Only all of
        # it is tried after.
        only_the_last = True
      if refused_for_host is None and _out_of_reach(request, plain, error):
        # A peak that no placement of the state can bring under the
        # budget: XLA's own bytes (a tiny step's 4 MiB of them), not the
        # state's. Each further placement costs six compiles.
        log.info("jlms: %s; no other placement of the state saves that "
                 "much: none is tried", error)
        raise
      following = levels[-1 if only_the_last else number + 1].state
      if budget is None and hasattr(error, "host_bytes"):
        log.warning("%s; the least-memory plan keeps the state on the "
                    "device instead", error)
      elif following:
        log.info("jlms: %s; trying with %d state leaves (%s) on host",
                 error, len(following.inputs),
                 format_bytes(_state_bytes(levels[number + 1])))
      else:
        log.info("jlms: %s; trying with the state's updates inside the "
                 "loops that make their gradients", error)
    except NOT_FALLEN_BACK_FROM:
      raise
    except Exception as error:
      # A pass failed on this placement of the state (the update fused
      # into a loop, the state streamed): the next placement may need no
      # such pass. Only where none is left does the step fall back.
      if last:
        if budget is None:
          raise
        raise PlanNeeded(budget) from error
      log.debug("jlms: placing the state as level %d of %d failed (%s: %s); "
                "trying the next", number + 1, len(levels),
                type(error).__name__, error)
  # The step does not fit the budget as it is: jax.jit's program won't do.
  return dataclasses.replace(planned, needs_plan=budget is not None)


def _lower_of(request: SearchRequest, on_host: PlannedStep, others
              ) -> PlannedStep:
  """For the least memory: `on_host` (the plan with the state on host) or
  the plan of the next placement (`others`, the state on the device),
  whichever peaks lower. The state on host brings buffers of its own to
  the device (slices in flight, an update loop's carry), and where the
  state is small beside them, keeping it on the device takes less (a
  3-layer scanned attention step: 14.08 MiB by XLA on host, 12.10 with
  jax.jit's program). The other placement is planned only where the
  state it keeps on the device is under `on_host`'s peak, since it holds
  that much all the step (the 8B Llama: 120 GiB of state, against a
  77 GiB plan)."""
  peak = _peak_of(on_host)
  if (peak is None
      or _state_held_on_device(request, others[0]) >= peak):
    return on_host
  try:
    on_device = _search_levels(request, others, None)
  except Exception as error:  # noqa: BLE001 -- the first plan stands
    log.info("jlms: the least memory with the state on the device was "
             "not planned (%s: %s); the state stays on host",
             type(error).__name__, error)
    return on_host
  lower = _peak_of(on_device)
  if _by_xla(on_host) != _by_xla(on_device):
    # Peaks are compared as XLA gives them. The least memory with the
    # state on the device may be jax.jit's program, which only the
    # simulator priced (11.45 MiB where XLA says 12.10); other peaks of
    # two kinds are not compared.
    lower = (_plain_xla_peak(request) if _by_xla(on_host)
             and not on_device.rewrites_the_step else None)
  if lower is None or lower >= peak:
    return on_host
  log.info("jlms: the least memory keeps the state on the device: %s, "
           "against %s with it on host", format_bytes(lower),
           format_bytes(peak))
  return on_device


def _peak_of(planned: PlannedStep) -> int | None:
  """XLA's peak of `planned`'s program where XLA measured it, else the
  simulator's."""
  plan = planned.plan
  if plan is None:
    return None
  return plan.xla_peak_bytes if _by_xla(planned) else plan.predicted_peak_bytes


def _by_xla(planned: PlannedStep) -> bool:
  return planned.plan is not None and planned.plan.xla_peak_bytes is not None


def _out_of_reach(request: SearchRequest, plain, error) -> bool:
  """Whether XLA's peak of `plain`'s least-memory plan (`error` is its
  refusal) is over the budget by more than any other placement of the
  state can save: the state still on the device, once on host, and as
  much again for gradients that its updates fused into loops no longer
  stack (`_LEVEL_REACH`)."""
  least = getattr(error, "least_by_xla", None)
  if least is None or request.budget is None:
    return False
  return (least - request.budget
          > _LEVEL_REACH * _state_held_on_device(request, plain))


def _state_held_on_device(request: SearchRequest, plain) -> int:
  """Bytes of the donated state that `plain` keeps on the device, as one
  device holds them (XLA's peaks and the budget are one device's)."""
  on_host = set(plain.state.inputs)
  program, leaves = plain.program, request.leaves
  held = 0
  for position, _ in state_pairs(program, request.donated):
    if position in on_host:
      continue
    aval = program.avals[program.invars[position]]
    leaf = leaves[position] if position < len(leaves) else None
    held += argument_device_bytes(aval_nbytes(aval), aval, leaf)
  return held


def state_levels(request: SearchRequest) -> list:
  """The ways to place the step's state that `_search_levels` tries, as
  the step's analysis with that `state`: the state on the device, as it
  is and then with its updates inside the loops that make their gradients
  (for the least memory, only the latter), unless `state_on_host` says
  otherwise; all of it on host when asked for, or for the least
  memory."""
  plain, options, budget = request.plain, request.options, request.budget
  if not request.donated:
    return [plain]
  program, liveness = plain.program, plain.liveness
  pairs = state_pairs(program, request.donated)
  if not pairs:
    return [plain]
  # All of the state on the device, its updates run inside the loops that
  # make their gradients where they can (`jlms._state`): their gradient
  # stacks are then never made. Tried after the step as it is, since
  # where that fits the fused loops only cost time (a little, for the
  # in-place writes); for the least memory, instead of it.
  fused = dataclasses.replace(plain, state=HostState((), (), pairs))
  on_device = [fused] if budget is None else [plain, fused]
  if options.state_on_host is False or options.host_refused:
    return on_device
  on_host = [(i, o) for i, o in pairs if i in request.arrived_on_host]
  if on_host:  # placed there (by `place`, or by a step): they stay
    return [dataclasses.replace(plain, state=HostState(
        tuple(i for i, _ in on_host), tuple(o for _, o in on_host),
        tuple(p for p in pairs if p not in on_host)))]
  # Asked for, the state goes to host down to a leaf worth a copy of its
  # own (64 KiB), as documented; a budget's search weighs only leaves that
  # can change whether the step fits (a 65536th of the budget, 1.25 MiB
  # on an H100).
  least = (options.min_bytes if options.min_bytes is not None
           else _thresholds.THRESHOLDS.state_leaf_min_bytes
           if options.state_on_host
           else max(options.min_bytes_for(budget),
                    _thresholds.THRESHOLDS.state_leaf_min_bytes))
  everything = host_state(program, liveness, pairs, min_bytes=least)
  if not everything:
    if options.state_on_host:
      log.warning("jlms: no donated argument of %s is returned updated "
                  "(of the same shape and dtype): no state to keep on host",
                  options.name)
    return on_device
  if options.state_on_host:
    return [dataclasses.replace(plain, state=everything)]
  if budget is None:
    # The least memory: all of the state on host, or where the host
    # budget refuses that, on the device (a step given a host budget of
    # 1000 bytes had no plan at all).
    return [dataclasses.replace(plain, state=everything), fused]
  levels = list(on_device)
  # The optimizer's moments cross the link once each way, in the order
  # that hides their copies best (`hidden_updates_first`), as many as the
  # budget needs (what stays on the device costs no copy), then all of
  # the state. The moments that one update reads
  # (a weight's two) go together: its loop then fetches one while it
  # writes the other back. A loop of one leaf on host reads and writes
  # one buffer, which XLA orders one copy after the other (the 8B Llama's
  # plan, leaf by leaf: 91 of its 98 update loops had one leaf on host,
  # 1299 ms of copies exposed in a 2509 ms step).
  moments = host_state(program, liveness, pairs, min_bytes=least,
                       only_update_read=True)
  output_of = dict(zip(moments.inputs, moments.outputs))
  size_of = {i: aval_nbytes(program.avals[program.invars[i]])
             for i in moments.inputs}
  total = sum(size_of.values())
  chosen, moved, share = [], 0, _STATE_LEVEL_SHARE
  for group in hidden_updates_first(program, liveness, moments.inputs):
    chosen.extend((i, output_of[i]) for i in group)
    moved += sum(size_of[i] for i in group)
    if moved >= share * total or len(chosen) == len(size_of):
      share += _STATE_LEVEL_SHARE
      state = host_state(program, liveness,
                         sorted(chosen, key=lambda p: p[0]))
      if state != everything:
        levels.append(dataclasses.replace(plain, state=dataclasses.replace(
            state, on_device=tuple(p for p in pairs
                                   if p[0] not in state.inputs))))
  levels.append(dataclasses.replace(plain, state=everything))
  return levels


def _state_bytes(plain) -> int:
  return sum(aval_nbytes(plain.program.avals[plain.program.invars[i]])
             for i in plain.state.inputs)


@dataclasses.dataclass
class _Candidate:
  """A fit, rewritten: the plan the search holds, and what XLA said."""
  placed: Any
  residuals: tuple
  result: Any
  rewritten: Any
  without_copies: Any
  measured: int | None = None
  # The XLA options it compiles and runs with (`SearchRequest.compiler_options`).
  compiler_options: dict = dataclasses.field(default_factory=dict)


def _rewritten(request: SearchRequest, config, fitted) -> _Candidate:
  """The fit `fitted` (placed, residuals, result), rewritten."""
  placed, residuals, result = fitted
  rewritten, without_copies = rewrite_with_and_without_copies(
      placed.program, result.offloads, config, request.debug_info,
      fusion=placed.fusion, pin_contractions=True,
      pin_updates=worth_holding_in_place(placed.program,
                                         result.timeline.peak_bytes),
      # Each remade segment's weight gradients run before the next
      # remaking, not where XLA's scheduler would leave them: at the next
      # swap-in, holding an activation each till then (GPT-2 medium's 24
      # per-block segments: 16.07 GiB by XLA where 7.63 were simulated).
      pin_before=remaking_barriers(placed.program),
      serialized=serialized(placed.program, placed.liveness, config,
                            placed.fusion),
      shardings=request.link_shardings(placed.program, result.offloads))
  candidate = _Candidate(placed, residuals, result, rewritten,
                         without_copies)
  candidate.compiler_options = request.compiler_options(candidate)
  return candidate


#: A host budget no plan reaches: `_host_needed`'s search.
_UNBOUNDED_HOST = 1 << 60


def _host_needed(request: SearchRequest, plain, plain_peak) -> int | None:
  """The pinned host memory that the plan of the state's placement `plain`
  holds at once where the host budget is no limit, or None where even
  then the device's budget is not met. A placement refused for the host
  alone may not fit the device either (a 65B GPT on eight H100s: the
  first placement refused at XLA's default pool asked for 160 GiB, and at
  160 GiB its device peak did not fit, nor the next one's at 320 GiB);
  what fits is what to ask the user for."""
  unbounded = dataclasses.replace(
      request, plain=plain, options=dataclasses.replace(
          request.options, host_budget=_UNBOUNDED_HOST))
  log.info("jlms: searching this placement of the state again with no "
           "limit on host memory, to say how much it needs")
  try:
    planned = _search_budget(unbounded, plain_peak,
                             ask_xla_when_refused=True)
  except BudgetError:
    return None
  except DevicelessUnavailableError:
    raise
  except Exception as error:  # noqa: BLE001 -- no figure from this one
    log.debug("jlms: no plan of this placement with no host limit (%s: "
              "%s)", type(error).__name__, error)
    return None
  return planned.plan.predicted_host_bytes


def _short_of_host(request: SearchRequest, needed: int,
                   error: BudgetError) -> BudgetError:
  """The budget's error where a plan fits the device with `needed` bytes
  of pinned host memory, more than the host budget."""
  host_budget = request.host_pool()
  fits = ("of the least memory" if request.budget is None
          else f"that fits {format_bytes(request.budget)}")
  on_device = int(needed * request.host_scale)
  short = BudgetError(
      f"jlms: the plan {fits} holds "
      f"{format_bytes(on_device)} of pinned host memory at once (the state "
      f"kept on host and the values copied there{_per_device(request)}), "
      f"above the host budget of {format_bytes(host_budget)}: "
      f"{host_pool_advice(on_device)}")
  short.smallest_bytes = getattr(error, "smallest_bytes", None)
  short.host_bytes = needed
  return short


def _per_device(request: SearchRequest) -> str:
  """Whose pinned host memory a host figure is, where the step's sizes are
  more than one GPU's."""
  return "" if request.split == 1 else ", on each GPU"


def _search_budget(request: SearchRequest, plain_peak,
                   ask_xla_when_refused=True) -> PlannedStep:
  """`fit_budget`'s search for one placement of the state, once the step
  is known not to fit as it is (or the budget is the least memory): the
  fit, confirmed by XLA. Where the simulator finds no plan, XLA is asked
  about the least-memory one only `ask_xla_when_refused`."""
  plain, baseline = request.plain, request.baseline
  budget, target = request.budget, request.target
  searched = budget
  if target is not None and budget is not None:
    # XLA holds the plan to the budget: fitted for a little less, a plan
    # the simulator puts just under it is not compiled over it, then
    # fitted and compiled again.
    searched = int(budget * (1 - _MARGIN))
  unseen = request.split
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
  # Where XLA compiled jax.jit's program far below the simulator's figure
  # (XLA rematerializes a program over the device's memory itself), a
  # budget the simulator finds no plan for is searched again in its bytes
  # scaled by XLA's ratio, before the state is moved to host for it; XLA's
  # compiles of the plan then hold it to the budget. Only then: the ratio
  # is of a program XLA rematerialized, and a plan under XLA's own limit
  # is not, so scaling a budget the simulator can meet would only
  # overshoot it (a Llama-3.2-3B-shaped step at 52.5 GiB: scaled to 76.2
  # GiB, XLA compiled the plan to 77.9).
  scaled = None
  if (unseen <= 1 and budget is not None and plain_peak is not None
      and baseline.peak_bytes > _OVERSTATED * plain_peak):
    scaled = int(budget * baseline.peak_bytes / plain_peak)
  config = dataclasses.replace(request.options.config,
                               sync_mode=SyncMode.NONE)
  others = []  # the other ways that meet the budget, the fastest first
  ranked = []
  try:
    try:
      ranked = ranked_fits(request, searched)
      fitted, *others = _near(ranked)
    except BudgetError:
      if scaled is None:
        raise
      log.info("jlms: the simulator puts jax.jit's program at %s, XLA at "
               "%s; the simulator searches again for a peak of %s",
               format_bytes(baseline.peak_bytes), format_bytes(plain_peak),
               format_bytes(scaled))
      searched = scaled
      fitted, *others = _near(ranked_fits(request, searched))
    simulator_refused, advice = False, ""
  except BudgetError as error:
    if budget is None or error.smallest_bytes is None:
      raise
    if target is None and unseen <= 1 and ask_xla_when_refused:
      # With no XLA to ask, at the last placement of the state: a fit
      # toward a budget stops where its greedy choices do, and a fit for
      # the least memory may go lower (a scanned BatchNorm CNN: 1122660
      # bytes for `budget="min"`, where a fit for that many stopped 16
      # bytes over it).
      fitted = _least_within(request, searched, error)
      return _planned(request, config, _rewritten(request, config, fitted))
    if not ask_xla_when_refused:
      raise
    # The simulator overstates some peaks (a loop body's working memory
    # most): XLA says whether jlms's least-memory plan fits after all.
    log.info("jlms: the simulator's smallest peak is %s%s, above the "
             "budget; asking XLA",
             "at least " if getattr(error, "floor_only", False) else "",
             format_bytes(error.smallest_bytes))
    ranked = ranked_fits(request, None)
    fitted = ranked[0]
    searched = fitted[2].timeline.peak_bytes
    simulator_refused = True
    advice = getattr(error, "advice", "")
  placed, _, result = fitted
  as_it_is = _ways(request)[0].placed
  if (not result.offloads and placed is as_it_is and budget is None
      and not plain.state):
    # As little memory as jlms reaches is the step as it is.
    return request.as_is(budget, None)
  if (budget is None and result.timeline.peak_bytes >= baseline.peak_bytes
      and not plain.state):
    return request.as_is(
        budget, None,
        reason="jlms's least-memory plan is predicted to peak at "
        f"{format_bytes(result.timeline.peak_bytes)}, no lower than "
        f"jax.jit's program ({format_bytes(baseline.peak_bytes)})")

  chosen = _rewritten(request, config, fitted)
  if target is None:
    return _planned(request, config, chosen)
  chosen.measured = request.xla_peak(
      chosen.rewritten, plain.state.inputs,
      options=chosen.compiler_options)
  log.info("jlms: XLA's peak on %s: %s (budget %s)", target,
           format_bytes(chosen.measured),
           "none" if budget is None else format_bytes(budget))
  if budget is None or simulator_refused:
    # The least memory, or the last chance at a budget the simulator
    # refused: the ways' least-memory plans that XLA puts lowest (a
    # scanned GPT at per-layer remat's 1.87 GiB: its layers' inputs
    # streamed, 1.84 predicted and 2.09 by XLA; kept on the device, 2.01
    # predicted and 1.84 by XLA).
    for other in ranked[1:_LEAST_COMPILED]:
      if budget is not None and chosen.measured <= budget:
        break
      chosen = _least_by_xla(request, config, chosen, other)
  if budget is None and not plain.state:
    # A plan XLA finds no smaller than jax.jit's program is not applied.
    plain_peak = _plain_xla_peak(request)
    if chosen.measured >= plain_peak:
      return request.as_is(
          budget, (plain_peak, target),
          reason=f"XLA's peak on {target} with jlms's least-memory plan "
          f"is {format_bytes(chosen.measured)}, no lower than jax.jit's "
          f"program's ({format_bytes(plain_peak)})")
  if budget is not None:
    chosen = _confirmed(request, config, chosen, searched, plain_peak,
                        simulator_refused, others,
                        last_placement=ask_xla_when_refused, advice=advice)
  return _planned(request, config, _with_latency_profile(request, chosen))


def _least_within(request: SearchRequest, budget: int, refused: BudgetError):
  """The fastest of the ways' least-memory fits whose predicted peak is
  at most `budget`; where none is, `refused`, or where the least of them
  is lower than it names (or it names only a floor), an error naming
  that."""
  least = ranked_fits(request, None)
  within = [f for f in least if f[2].timeline.peak_bytes <= budget]
  if within:
    return min(within, key=lambda f: f[2].step_time.total_s)
  placed, residuals, lowest = min(least, key=lambda f: f[2].timeline.peak_bytes)
  if (lowest.timeline.peak_bytes >= refused.smallest_bytes
      and not getattr(refused, "floor_only", False)):
    raise refused
  fitter = fitter_of(request, placed, lowest.target,
                     request.options.min_bytes_for(None),
                     request.host_budget(), None, residuals)
  raise fitter.refusal(budget, lowest) from refused


def _least_by_xla(request: SearchRequest, config, chosen: _Candidate,
                  other) -> _Candidate:
  """Of the least-memory plan `chosen` (compiled) and `other`, another
  way's least-memory fit, the one XLA puts lower, where `other`'s
  predicted peak is within `_LEAST_PEAK_COMPARED` of `chosen`'s: the
  simulator's error differs between ways (Llama-3.2-3B, state on host:
  per sub-block segments remade, 6.40 GiB predicted and 10.64 by XLA; per
  block, 6.63 and 11.66; values remade one by one, 6.87 and 8.64)."""
  if (other[2].timeline.peak_bytes
      > chosen.result.timeline.peak_bytes * _LEAST_PEAK_COMPARED):
    return chosen
  candidate = _rewritten(request, config, other)
  candidate.measured = request.xla_peak(
      candidate.rewritten, request.plain.state.inputs,
      options=candidate.compiler_options)
  log.info("jlms: XLA's peak on %s of the next least-memory way: %s",
           request.target, format_bytes(candidate.measured))
  return candidate if candidate.measured < chosen.measured else chosen


def _confirmed(request: SearchRequest, config, chosen: _Candidate, searched,
               plain_peak, simulator_refused, others=(),
               last_placement: bool = True, advice: str = "") -> _Candidate:
  """`chosen`, or while XLA's peak of it does not fit the budget, the
  next fastest of `others` (fits of other ways for the same budget), then
  a plan fitted again for less (at most `CONFIRMATIONS` compiles, then
  jlms's least-memory plan), then one more for the room XLA leaves
  unused. A plan of another way comes before a tighter fit: the
  simulator's error differs most between ways (Llama-3.2-3B at per-block
  remat's 52.51 GiB: its values remade one by one, 50.93 GiB predicted
  and 57.59 by XLA; its blocks remade, within a GiB), and a tighter fit of
  the first way costs what its error costs again. Where the simulator
  finds no plan for the tighter fit and a placement of the state with
  more of it on host follows (not `last_placement`), `BudgetError` says
  so and the search goes on to it, as it does where the simulator refuses
  the budget itself: the least-memory plans would have to come out of XLA
  further below the simulator than the plans it has compiled, and their
  fits take longest (the 70B Llama of `transformers` with 318 state leaves
  on host: XLA put two plans for 591 GiB of the simulator's, whole-step,
  17% above it, no way fitted 11% less, and the least-memory fits of the
  first three ways took 32 minutes to reach 590 to 595 GiB)."""
  budget, target = request.budget, request.target
  host_inputs = request.plain.state.inputs
  smallest = chosen.measured
  least_peak = chosen.measured if simulator_refused else None
  compiles = 1
  tighter = None  # the budget of a tighter fit, where another way fitted
  while chosen.measured > budget:
    if simulator_refused or compiles >= CONFIRMATIONS:
      if least_peak is None:
        # The last resort, and the least a later budget can rely on:
        # jlms's least-memory plans of the ways the simulator puts lowest,
        # compiled (its error differs between ways: a scanned GPT at
        # per-layer remat's 1.40 GiB, bfloat16: its layers' inputs
        # streamed, 1.42 GiB by XLA; kept on the device, 1.36).
        for fitted in ranked_fits(request, None)[:_LEAST_COMPILED]:
          if (fitted[0] is chosen.placed
              and fitted[2].offloads == chosen.result.offloads):
            least = chosen  # compiled already
          else:
            least = _rewritten(request, config, fitted)
            least.measured = request.xla_peak(
                least.rewritten, host_inputs,
                options=least.compiler_options)
            compiles += 1
            log.info("jlms: XLA's peak on %s of a least-memory plan: %s",
                     target, format_bytes(least.measured))
          smallest = min(smallest, least.measured)
          least_peak = min(least_peak or least.measured, least.measured)
          if least.measured <= budget:
            return least
      raise _refused(budget, target, plain_peak, least_peak, smallest,
                     compiles, advice)
    others = list(others)
    if chosen.measured <= budget * (1 + _CLOSE_MISS) and tighter is None:
      others = []  # a tighter fit first, other ways in its ranking
    if others:
      if tighter is None:
        tighter = int(searched * budget / chosen.measured * 0.97)
      fitted = others.pop(0)
      log.info("jlms: trying the next fastest way: %s",
               fitted[2].step_time.describe())
    else:
      # The simulator was optimistic: ask it for proportionally less, of
      # every way the loops can run (the way first chosen may have no
      # smaller plan where another does, faster than the least-memory
      # one).
      searched = int(searched * budget / chosen.measured * 0.97)
      log.info("jlms: searching again for a predicted peak of %s",
               format_bytes(searched))
      tighter = -1  # this is the tighter fit
      try:
        fitted, *others = _near(ranked_fits(request, searched))
      except BudgetError as refused:
        if not last_placement:
          error = BudgetError(
              f"jlms: XLA's peak on {target} of the plans fitted for this "
              f"placement of the state is at least {format_bytes(smallest)}, "
              f"over the budget of {format_bytes(budget)}, and the "
              "simulator finds no plan for a budget tighter by as much")
          error.smallest_bytes = smallest
          raise error from refused
        simulator_refused = True  # no smaller plan of this kind: say so
        advice = getattr(refused, "advice", "") or advice
        continue
    chosen = _rewritten(request, config, fitted)
    chosen.measured = request.xla_peak(
        chosen.rewritten, host_inputs, options=chosen.compiler_options)
    smallest = min(smallest, chosen.measured)
    compiles += 1
    log.info("jlms: XLA's peak on %s: %s (budget %s)", target,
             format_bytes(chosen.measured), format_bytes(budget))
  if tighter is not None and tighter > 0 and compiles < CONFIRMATIONS:
    # A slower way fitted where the fastest did not: a tighter fit of every
    # way, compiled once, may still be faster (Gemma2-2B at remat's 49.96
    # GiB: its values remade one by one, 51.43 GiB by XLA; its segments
    # remade, 27.91 GiB, 2.6% slower than remat).
    faster = _faster_fit(request, config, chosen, tighter)
    compiles += faster is not None
    if faster is not None and faster.measured <= budget:
      return faster
    return chosen
  relaxed = (None if compiles != 1 else relaxed_search(
      chosen.result.timeline.peak_bytes, chosen.measured, budget))
  if relaxed is None:
    return chosen
  # The simulator overstated this plan's peak (a loop body's working
  # memory most, a few fused buffers XLA does not keep): a plan that it
  # thinks larger, and that recomputes less, may fit too. One more
  # compile says.
  refused = []
  candidate = _faster_fit(request, config, chosen, relaxed, refused=refused)
  cheap = len(request.plain.program) <= _CHEAP_COMPILE_EQUATIONS
  if candidate is None and relaxed < budget and (refused or cheap):
    # Nothing faster within the margin: the budget itself, once (a scanned
    # MLP at per-layer remat's 1.17 GiB: its layers' inputs streamed, 0.70
    # GiB by XLA and 21.0 ms by the schedule model; per-layer remat, 1.16
    # GiB predicted, 1.17 by XLA and 7.1 ms). For a step whose compiles
    # take long, only the ways that did not fit the margin: fitting every
    # way again cost Gemma2-2B, plain, 7 s for no plan faster by 2%. A step
    # that compiles cheaply fits every way (the 16-block ResNet at
    # per-layer remat's peak: 26.32 ms by the schedule model, where the
    # ways refused alone gave 26.57).
    candidate = _faster_fit(request, config, chosen, budget,
                            ways=None if cheap else refused)
  return (candidate if candidate is not None and candidate.measured <= budget
          else chosen)


def _faster_fit(request: SearchRequest, config, chosen: _Candidate,
                searched: int, ways=None, refused: list | None = None
                ) -> _Candidate | None:
  """The fastest fit for `searched` (of `ways`, by default every way),
  compiled, where the time model puts it faster than `chosen` by enough to
  be worth a compile; else None. `refused`, where given, receives the ways
  that could not fit `searched`."""
  try:
    faster = ranked_fits(request, searched, ways, refused)[0]
  except BudgetError:
    return None
  # A compile is worth what it saves: a faster plan of a step whose
  # compiles take seconds is always tried.
  faster_by = (_FASTER_BY if len(request.plain.program)
               > _CHEAP_COMPILE_EQUATIONS else _FASTER_BY_CHEAPLY)
  if (faster[2].step_time.total_s
      >= (1 - faster_by) * chosen.result.step_time.total_s):
    return None
  candidate = _rewritten(request, config, faster)
  candidate.measured = request.xla_peak(
      candidate.rewritten, request.plain.state.inputs,
      options=candidate.compiler_options)
  log.info("jlms: XLA's peak on %s of a faster plan: %s", request.target,
           format_bytes(candidate.measured))
  return candidate


def _with_latency_profile(request: SearchRequest, chosen: _Candidate
                          ) -> _Candidate:
  """`chosen`, compiled by XLA once already, to run with a latency profile
  of that program (`jlms._latency_profile`) where it copies over the host
  link: XLA's scheduler then starts each copy as far ahead of its wait as
  the kernels before it take to hide it (a 6.58B GPT with its moments on
  host, H100, schedule model: 16.3 ms of copies exposed without, 3.7 with
  the profile). Kept where XLA's peak with it stays within the budget (for
  the least memory, no higher than without), since starting copies
  earlier holds their buffers longer (the 4-layer GPT of width 4096 at 16
  GiB, JAX 0.10.2: 262.1 -> 247.4 ms by the schedule model, but 15.93 ->
  16.06 GiB), and where XLA orders the program otherwise with it: the
  same order is the same program, priced as without."""
  text = request.last_compiled.get(id(chosen.rewritten))
  if (text is None or chosen.measured is None
      or ASYNC_COPIES_OPTION not in chosen.compiler_options):
    return chosen
  profile = latency_profile(text, request.time)
  if profile is None:
    return chosen
  options = {**chosen.compiler_options, **PROFILE_CHECK_OFF,
             PROFILE_OPTION: write_profile(profile)}
  try:
    measured = request.xla_peak(chosen.rewritten, request.plain.state.inputs,
                                options=options)
  except Exception as error:  # the plan runs as confirmed without it
    log.warning("jlms: XLA did not compile the plan with a latency "
                "profile of its copies (%s); it runs without one",
                str(error).splitlines()[0] if str(error) else error)
    return chosen
  limit = request.budget if request.budget is not None else chosen.measured
  # `xla_peak` kept the text of the compile it just made.
  reordered = schedule_of(text) != schedule_of(
      request.last_compiled[id(chosen.rewritten)])
  log.info("jlms: XLA's peak on %s with a latency profile of the plan's "
           "copies: %s (without: %s); %s", request.target,
           format_bytes(measured), format_bytes(chosen.measured),
           "reordered" if reordered else "the same order")
  if measured > limit or not reordered:
    return chosen
  return dataclasses.replace(chosen, measured=measured,
                             compiler_options=options)


def _planned(request: SearchRequest, config, chosen: _Candidate
             ) -> PlannedStep:
  """The planned step of the fit `chosen`, with its plan."""
  # The plan keeps the request (its times are priced on demand): not the
  # texts of the programs the search compiled.
  request.last_compiled.clear()
  placed, result, times = chosen.placed, chosen.result, request.time
  plain = request.plain
  measured = chosen.measured
  plan = build_plan(
      placed.program, placed.liveness, result.offloads, config,
      request.baseline, result.timeline, residuals=chosen.residuals,
      budget_bytes=request.budget, fitted=True, xla_peak_bytes=measured,
      serialized=len(serialized(placed.program, placed.liveness, config,
                                placed.fusion)),
      split_over_batch=placed.split_runs,
      xla_target=request.target if measured is not None else None,
      step_times=lambda **constants: request.per_device_times(
          _chosen_times(request, chosen, constants), placed.program,
          measured, chosen.rewritten),
      time_target=times.name, split=request.split,
      state_updated_in_loops=sum(c.updated_in_loop
                                 for c in placed.state_copies),
      state_copies_pinned=sum(c.pinned for c in placed.state_copies))
  return PlannedStep(placed.program, result.offloads, plan,
                     request.out_trees[-1], chosen.rewritten,
                     request.jit_params,
                     rewrite_without_copies=chosen.without_copies,
                     state=plain.state, fitted=True,
                     compiler_options=tuple(sorted(
                         chosen.compiler_options.items())))


def _chosen_times(request: SearchRequest, chosen, constants: dict):
  """(jax.jit's, the `chosen` fit's) predicted step times, by the time
  model with its fields replaced by `constants` (none: as the fit priced
  its choices, but for a plan that runs with a latency profile of its
  copies: the fit prices each as XLA schedules it without)."""
  times = dataclasses.replace(request.time, **constants)
  baseline = predict_times(times, request.plain)[0]
  result, placed = chosen.result, chosen.placed
  profiled = PROFILE_OPTION in chosen.compiler_options
  if not constants and not profiled:
    return baseline, result.step_time
  return baseline, predict_planned(
      dataclasses.replace(result.target, copies_profiled=profiled,
                          **constants),
      (placed.program, placed.liveness, placed.fusion), result.offloads,
      SyncMode.NONE, chosen.residuals, placed.state_copies)


def _ways(request: SearchRequest):
  request.progress.stage("analysing the ways its loops can run")
  return placed_ways(request.plain, request.options.config,
                     request.options.target, request.ways,
                     device_count(request.leaves),
                     least_memory=request.budget is None,
                     on_gpu=request.target is not None)


def _fit_way(request: SearchRequest, way, budget: int | None, host_budget):
  """`jlms._fit`'s fit of one placed way, priced with its streamed copies
  hidden where XLA's scheduler has room for the fitted plan's peak
  (`jlms._schedule.scheduler_overlaps`), else with them exposed: fitted
  again where the first fit's peak leaves it no room. A tighter fit of the
  same way continues from the last one's choices (`fitter_of`)."""
  placed, options = way.placed, request.options

  def fitted(time):
    fitter = fitter_of(request, placed, time, options.min_bytes_for(budget),
                       host_budget, budget, residuals=way.residuals)
    return fitter.fit(budget)

  time = request.time_for(placed.program, None)
  result = fitted(time)
  if (time.streams_hide and (way.residuals or placed.state_copies)
      and not request.time_for(placed.program,
                               result.timeline.peak_bytes).streams_hide):
    result = fitted(dataclasses.replace(time, streams_hide=False))
  return result


def fitter_of(request: SearchRequest, placed, time, min_bytes: int,
              host_budget, budget: int | None, residuals=()) -> Fitter:
  """The `jlms._fit.Fitter` of `placed` (a placed way) under the time
  model `time` and `host_budget` that last fitted it in this search, where
  a fit for `budget` continues from its choices and its smallest value
  worth a choice is at most twice `min_bytes` (a budget a few percent
  tighter asks for a few percent smaller ones: values that small cannot
  change whether it fits); else a new one, kept for the next fit. The
  fitters of one placement of the state only: a new placement drops the
  others'."""
  fitters = request.fitters
  if fitters.get("plain") is not request.plain:
    fitters.clear()
    fitters["plain"] = request.plain
  kept = fitters.setdefault(id(placed), [])  # [(placed, fitter)]
  for held, fitter in kept:
    if (held is placed and fitter.target == time
        and fitter.host_budget_bytes == host_budget
        and fitter.min_bytes <= 2 * min_bytes
        and fitter.continues_to(budget)):
      return fitter
  fitter = Fitter(placed.program, placed.liveness, time, min_bytes,
                  placed.fusion, residuals, host_budget,
                  state_copies=placed.state_copies,
                  host_scale=request.host_scale, split=request.split)
  # One fitter per time model and host budget: a new one replaces the one
  # that cannot continue.
  kept[:] = [(held, f) for held, f in kept
             if held is placed and not (f.target == time
                                        and f.host_budget_bytes == host_budget)]
  kept.append((placed, fitter))
  return fitter


def _quietest_among_the_fastest(fitted: list) -> list:
  """`fitted`, keyed so that a fit ranks after every fit predicted within
  `_SAME_TIME` of it that moves fewer bytes over the host link: a plan no
  faster is not worth the link's traffic (a scanned GPT at a budget
  halfway to jax.jit's peak: its layers' inputs streamed through host,
  51.4 ms predicted; kept on the device, 51.5 ms; both 27.8 ms by the
  schedule model)."""
  def link_bytes(f):
    time_ = f[-1].step_time
    return time_.d2h_bytes + time_.h2d_bytes

  keyed = []
  for f in fitted:
    close = [g for g in fitted
             if g[-1].step_time.total_s <= f[-1].step_time.total_s
             * (1 + _SAME_TIME) and f[-1].step_time.total_s
             <= g[-1].step_time.total_s * (1 + _SAME_TIME)]
    fewest = min(link_bytes(g) for g in close)
    keyed.append(((link_bytes(f) > fewest, *f[0]), *f[1:]))
  return keyed


def fastest_fit(request: SearchRequest, budget: int | None):
  """(placed program, streamed residuals, `jlms._fit.Fit`) of the fastest
  way to fit `budget` (None: the least memory). Each way the step's loops
  can run (as they are, residuals remade inside the backward loops,
  residuals streamed through host, segments remade) is fitted at the top
  level."""
  return ranked_fits(request, budget)[0]


def ranked_fits(request: SearchRequest, budget: int | None, ways=None,
                refused: list | None = None) -> list:
  """`fastest_fit`'s fit of every way that meets `budget`, the fastest
  first; for the least memory (None), those within `_LEAST_PEAK_SLACK` of
  the smallest predicted peak the fastest first, then the others, the
  smallest peak first. Of `ways` where given (else all the step's);
  `refused`, where given, receives those that do not meet `budget`."""
  options = request.options
  fitted, last_error, last_rank = [], None, None
  host_budget = request.host_budget()
  ways = _ways(request) if ways is None else ways
  for number, way in enumerate(ways):
    placed = way.placed
    request.progress.stage(f"fitting {way.description} ({number + 1} of "
                           f"{len(ways)})")
    try:
      result = _fit_way(request, way, budget, host_budget)
    except BudgetError as error:
      if refused is not None:
        refused.append(way)
      # The way that gets closest names the smallest peak reachable; a way
      # refused for the host's memory only where all are, and then the one
      # that needs the least of it.
      host = getattr(error, "host_bytes", None)
      rank = ((False, error.smallest_bytes) if host is None
              else (True, host))
      if last_error is None or rank < last_rank:
        last_error, last_rank = error, rank
      continue
    log.info("jlms: %s: predicted %s", way.description,
             result.step_time.describe())
    fitted.append(((result.step_time.total_s,), len(fitted), placed,
                   way.residuals, result))
  fitted = _quietest_among_the_fastest(fitted)
  if not fitted:
    raise last_error
  if budget is None:
    # The least memory: the fastest of the ways within 1% of the smallest
    # peak (a few MiB less is not worth many times the time).
    least = min(f[-1].timeline.peak_bytes for f in fitted)
    near = [f for f in fitted
            if f[-1].timeline.peak_bytes <= least * _LEAST_PEAK_SLACK]
    rest = sorted((f for f in fitted if f not in near),
                  key=lambda f: f[-1].timeline.peak_bytes)
    fitted = sorted(near) + rest
  else:
    fitted = sorted(fitted)
  return [(placed, residuals, result)
          for _, _, placed, residuals, result in fitted]


def _near(ranked: list) -> list:
  """The fits of `ranked` (the fastest first) predicted within
  `_NEXT_WAY_SLOWER_BY` of the first: those worth a compile when XLA
  refuses the first (each costs as much as jax.jit's own)."""
  first = ranked[0][2].step_time.total_s
  return [f for f in ranked
          if f[2].step_time.total_s <= first * (1 + _NEXT_WAY_SLOWER_BY)]


def _refused(budget, target, plain_peak, least_peak, smallest,
             compiles, advice: str = "") -> BudgetError:
  """The error of a budget XLA finds no plan under. Its minimum is the
  smaller of jax.jit's program's peak and jlms's least-memory plan's: a
  budget search for that much tries both, so it fits. `advice`, the
  simulator's own refusal's (`jlms._fit`), says what else lowers it."""
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
      f"{format_bytes(minimum)}{advice}")
  error.smallest_bytes = minimum
  error.least_by_xla = least_peak
  return error


def relaxed_search(predicted: int, measured: int, budget: int) -> int | None:
  """The simulator's peak to fit for once more, when XLA's peak of a plan
  that the simulator predicted at `predicted` is `measured`, below
  `budget`: the unused room, in the simulator's bytes (scaled by its ratio
  to XLA's for this plan), less a tenth of it as margin; None when the
  room is under `_UNUSED_ROOM` of the budget."""
  if measured >= (1 - _UNUSED_ROOM) * budget:
    return None
  room = predicted * (budget / measured - 1)
  return int(predicted + 0.9 * room)


def _placed_fit(request: SearchRequest, budget: int | None):
  """`fastest_fit` of `budget` with the state placed as a budget search
  places it (`state_levels`: on the device first, then on host, where the
  step donates it): the first placement that fits; for the least memory
  (None), the placement whose fit peaks lowest."""
  levels = state_levels(dataclasses.replace(request, budget=budget))
  fits, refused = [], None
  for plain in levels:
    try:
      fits.append(fastest_fit(dataclasses.replace(request, plain=plain),
                              budget))
    except BudgetError as error:
      refused = error
      continue
    if budget is not None:
      break
  if not fits:
    raise refused
  return min(fits, key=lambda fit: fit[2].timeline.peak_bytes)


def tradeoff(request: SearchRequest, budgets=None, points: int = 6
             ) -> Tradeoff:
  """Predicted step time against device budget: the fastest fit
  (simulator and time model, no compile) of each budget in `budgets`
  (bytes, sizes, or percentages of the memory of the GPU the times are
  for; one budget alone is taken as a list of one; an empty list gives the
  two ends alone), by default `points` budgets from the least memory jlms
  reaches up to `jax.jit`'s predicted peak."""
  if isinstance(points, bool) or not isinstance(points, int) or points < 1:
    raise ValueError(f"jlms: tradeoff points must be a positive int, got "
                     f"{points!r}")
  if isinstance(budgets, (str, numbers.Real)) and not isinstance(
      budgets, bool):
    budgets = [budgets]  # one budget (bytes may be written 2e9)
  # A percentage is of the memory of the GPU the times are predicted for.
  target = request.target or request.time.name
  device_bytes = lambda: target_memory_bytes(target)  # noqa: E731
  budgets = None if budgets is None else [parse_budget(b, device_bytes)
                                          for b in budgets]
  times, baseline = request.time, request.baseline
  least = _placed_fit(request, None)[2]
  if budgets is None:
    low, high = int(1.01 * least.timeline.peak_bytes), baseline.peak_bytes
    budgets = [int(low + (high - low) * i / max(points - 1, 1))
               for i in range(points)]
  rows = []
  for budget in budgets:
    try:
      _, residuals, result = _placed_fit(request, budget)
    except BudgetError:
      rows.append(TradeoffPoint(budget, None, None, 0, 0, 0))
      continue
    rows.append(TradeoffPoint(
        budget, result.timeline.peak_bytes, result.step_time,
        result.recomputed, result.transferred, len(residuals)))
  jit_time = predict_times(times, request.plain)[0]
  return Tradeoff(tuple(rows), baseline.peak_bytes, jit_time,
                  least.timeline.peak_bytes, times.name)
