"""Fitting a step into a memory budget in the least predicted time.

Each large value that lives across a gap between two of its reads can stay
on the device, be copied to host and back, or be recomputed before its far
read from values that are on the device then anyway. `fit` decides per
value, greedily at the predicted peak: while the simulated peak is over the
budget, it takes, among the values that occupy the device at the peak
without being read there, the choice that adds the least predicted step time
per byte it frees, and simulates again.

- A recomputation re-emits the pure equations that made the value, back to
  inputs that are step inputs or values on the device at the far read
  (at most `Thresholds.recompute_max_chain`): mostly elementwise chains XLA fuses into one
  memory-bound kernel (a BatchNorm's normalisation, a relu, a mask), and
  where it pays, a convolution or matmul, priced as `jlms._cost` prices it.
  A value such a recomputation reads may still move, if it is back on the
  device by then. An elementwise recomputation may also be remade where an
  elementwise one already chosen reads all its inputs, before its own far
  read: remade together, XLA makes both in one kernel (a relu's mask with
  the relu, from one BatchNorm output), and it costs only its writing.
- Once the budget is met, a value whose making one recomputation re-emits
  while its own is remade later is remade once, at the earlier place,
  where that neither raises the predicted peak nor slows the step: the
  chains after it start from it instead of making it again.
- A copy goes to host after the last read before the gap and must have
  finished before the first equation at which compute has hidden it
  (`swap_out_done_before`); it comes back from where compute before the far
  read hides it. Each costs what the schedule model of `jlms._schedule`
  says it exposes, link traffic of earlier choices included: on targets
  whose `hides_copies` is False (XLA's scheduler as it is) its whole link
  time each way, so a copy is chosen only where recomputing costs more.

Pure: it never compiles. `jlms.offload` confirms the result with XLA and
calls it again with a tighter budget if XLA disagrees.

Guarantees: the returned offloads' predicted peak is at most the budget, or
`BudgetError` is raised with the smallest peak reached; a step whose peak
fits gets no offloads; every offload satisfies `jlms._planner`'s guarantees,
a recompute's chain reads only step inputs, constants and values on the
device at its swap-in; no copy takes the host memory in use at once above
the host budget.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np

from jlms import _rules, _thresholds
from jlms._cost import GpuTarget, kernel_seconds, recompute_seconds
from jlms._liveness import Liveness
from jlms._units import format_bytes
from jlms._planner import (Offload, SwapIn, is_offloadable, joins_kernel,
                           kernel_facts)
from jlms._program import Program
from jlms._schedule import (StepTime, predict_step_time, remade_groups_with,
                            with_offload_added)
from jlms._simulator import (Fusion, MemoryTimeline, analyse_fusion,
                             simulate, step_constants)
from jlms._config import SyncMode
from jlms._budget import BudgetError, host_pool_advice

log = logging.getLogger("jlms")

_EXACT_PER_ROUND = 4  # options priced by the schedule model each round
_HIDE_MARGIN = 1.1  # a copy is hidden by 10% more compute than it takes


@dataclasses.dataclass(frozen=True)
class Fit:
  """What `fit` chose, and what it predicts."""
  offloads: tuple[Offload, ...]
  timeline: MemoryTimeline
  baseline: MemoryTimeline
  step_time: StepTime
  baseline_step_time: StepTime
  budget_bytes: int | None  # None: the least memory reachable
  seconds: float  # spent fitting
  #: The time model the fit priced its choices on (its `streams_hide` as
  #: fitted), so that the same choices can be priced again with other
  #: constants (`jlms.Plan.step_times_with`).
  target: GpuTarget | None = None

  @property
  def recomputed(self) -> int:
    return sum(o.is_recompute for o in self.offloads)

  @property
  def transferred(self) -> int:
    return sum(not o.is_recompute for o in self.offloads)


@dataclasses.dataclass(frozen=True)
class _Option:
  offload: Offload
  nbytes: int
  frees_from: int  # the device buffer is free from this equation ...
  frees_until: int  # ... to this one (exclusive)
  estimate_s: float  # added step time, ignoring other copies
  leaves: tuple[int, ...] = ()  # values a recomputation reads


class _Problem:
  """One program, priced once, with the options of each of its values."""

  def __init__(self, program: Program, liveness: Liveness, fusion: Fusion,
               target: GpuTarget, min_bytes: int, residuals=(),
               state_copies=(), split: int = 1):
    self.program, self.liveness, self.fusion = program, liveness, fusion
    self.residuals = residuals
    self.state_copies = state_copies
    self.target = target
    self.kernel_s = kernel_seconds(program, target, fusion, liveness)
    # start[i]: compute seconds before equation i starts, without copies.
    self.start = np.concatenate([[0.0], np.cumsum(self.kernel_s)])
    # What every simulation of this program shares, reckoned once.
    self.constants = step_constants(program, liveness, fusion, split)
    self.min_bytes = min_bytes
    self.host_budget: int | None = None
    self.host_scale = 1.0  # one GPU's pinned pool per byte of host_budget
    # Whether the host budget turned a copy down: only then is raising it
    # worth saying when the budget is not met.
    self.host_budget_refused = False
    self._facts: dict = {}  # chain -> `kernel_facts`
    self._remake_s: dict = {}  # (chain, value) -> `recompute_seconds`
    self._remade_together_s: dict = {}  # see `predict_step_time`
    # Whether each equation may be emitted again (the chain walk asks of
    # the same equations round after round).
    self._recomputable = [_rules.is_recomputable(e.eqn)
                          for e in program.equations]
    # The same walk reads these per value: Python lists index several
    # times faster than numpy arrays do, one item at a time.
    self._materialized = fusion.materialized.tolist()
    self._last_read = fusion.last_read.tolist()

  def gap(self, value: int) -> tuple[int, int] | None:
    """(last read before, first read after) the longest gap, in compute
    time, between the making of `value` and its reads; None if it has no
    gap worth a choice."""
    liveness = self.liveness
    reads = liveness.uses[value]
    if not reads or reads[-1] >= len(self.program):  # dead, or a step output
      return None
    previous = liveness.producer[value]
    best, best_gap = None, 0.0
    for read in reads:
      length = self.start[read] - self.start[previous + 1]
      if read - previous > 2 and length > best_gap:
        best, best_gap = (previous, read), length
      previous = read
    return best

  def candidates(self) -> list[int]:
    liveness, fusion = self.liveness, self.fusion
    return [v for v, size in enumerate(liveness.nbytes)
            if size >= self.min_bytes and liveness.producer[v] >= 0
            and fusion.materialized[v]
            and is_offloadable(self.program.avals[v])]

  def transfer(self, value: int, near: int, far: int) -> _Option | None:
    """Copy `value` to host after `near`, back before `far`, each placed
    where the compute around it can hide it."""
    size = self.liveness.nbytes[value]
    copy_s = self.target.transfer_seconds(size) * _HIDE_MARGIN
    executes = int(self.fusion.executes_at[near])
    done = executes + 1
    while done < far and self.start[done] - self.start[executes + 1] < copy_s:
      done += 1
    issue = far
    while issue > done and self.start[far] - self.start[issue] < copy_s:
      issue -= 1
    if issue <= done:
      # Compute cannot hide both copies: free the buffer as soon as the copy
      # out ends and fetch it just in time, and let the wait be priced.
      done, issue = executes + 1, far - 1
      if issue <= done:
        return None  # nothing is freed between the two copies
    reads = tuple(r for r in self.liveness.uses[value] if r > near)
    exposed = (max(0.0, copy_s - (self.start[done] - self.start[executes + 1]))
               + max(0.0, copy_s - (self.start[far] - self.start[issue])))
    if not self.target.hides_copies:
      exposed = 2 * self.target.transfer_seconds(size)
    offload = Offload(value, near, (SwapIn(issue, reads),),
                      swap_out_done_before=done)
    return _Option(offload, size, done, issue, exposed)

  def recompute(self, value: int, near: int, far: int, moved: dict,
                watched: set | None = None) -> _Option | None:
    """Remake `value` before `far` from values alive there, by at most
    `Thresholds.recompute_max_chain` pure equations. `watched`, where
    given, receives every value whose entry in `moved` the answer read:
    the answer stands while none of them is moved anew."""
    liveness, fusion, program = self.liveness, self.fusion, self.program
    producer, recomputable = liveness.producer, self._recomputable
    materialized, last_read = self._materialized, self._last_read
    longest = _thresholds.THRESHOLDS.recompute_max_chain
    chain: set[int] = set()
    leaves: set[int] = set()
    stack = [producer[value]]
    while stack:
      index = stack.pop()
      if index in chain:
        continue
      equation = program.equations[index]
      if not recomputable[index]:
        return None
      chain.add(index)
      if len(chain) > longest:
        return None
      for atom in equation.inputs:
        if not isinstance(atom, int):
          continue  # a constant
        made_by = producer[atom]
        if watched is not None and made_by >= 0:
          watched.add(atom)
        back = moved.get(atom)
        alive = (made_by < 0 or (materialized[atom]
                                 and last_read[atom] >= far
                                 and (back is None
                                      or back.frees_until <= far)))
        if alive:
          leaves.add(atom)
        elif made_by >= 0:
          stack.append(made_by)
        else:
          return None
    ordered = tuple(sorted(chain))
    reads = tuple(r for r in liveness.uses[value] if r > near)
    offload = Offload(value, near, (SwapIn(far, reads),), recompute=ordered)
    frees_from = int(fusion.executes_at[near]) + 1
    cost = self._recompute_seconds(ordered, value)
    return _Option(offload, liveness.nbytes[value], frees_from, far, cost,
                   tuple(sorted(leaves)))

  def shared_recompute(self, option: _Option, remade: "_RemadeAt"
                       ) -> _Option | None:
    """`option`, a recomputation, remade instead beside a recomputation
    already chosen (`remade`), at or before its own far read, where the
    two share a kernel (`jlms._planner.shared_kernels`: elementwise
    chains, the other reading all this one's inputs; the rewrite emits
    them behind one barrier). Its estimate is then the writing of its value
    alone (the schedule model prices the pair exactly). None where there
    is no such place; the latest place where there are several."""
    offload = option.offload
    # This one joins the other's kernel, so its inputs are the other's, on
    # the device there (never the other way round: one of its own inputs
    # may be made after that place).
    place = remade.latest_joined(option.frees_from, option.frees_until,
                                 self._kernel_facts(offload.recompute))
    if place is None:
      return None
    shared = dataclasses.replace(
        offload, swap_ins=(SwapIn(place, offload.swap_ins[0].reads),))
    cost = self._recompute_seconds(offload.recompute, offload.value,
                                   reads_inputs=False)
    return _Option(shared, option.nbytes, option.frees_from, place, cost,
                   option.leaves)

  def _recompute_seconds(self, chain: tuple[int, ...], value: int,
                         reads_inputs: bool = True) -> float:
    """`recompute_seconds` of remaking `value` by `chain`, priced once (a
    fit asks of the same chains round after round)."""
    key = (chain, value, reads_inputs)
    seconds = self._remake_s.get(key)
    if seconds is None:
      seconds = self._remake_s[key] = recompute_seconds(
          self.program, self.liveness, chain, value, self.target,
          reads_inputs=reads_inputs)
    return seconds

  def _kernel_facts(self, chain: tuple[int, ...]):
    facts = self._facts.get(chain)
    if facts is None:
      facts = self._facts[chain] = kernel_facts(self.program, chain)
    return facts

  def simulate(self, offloads) -> MemoryTimeline:
    return simulate(self.program, self.liveness, tuple(offloads), self.fusion,
                    constants=self.constants)

  def step_time(self, offloads) -> StepTime:
    return predict_step_time(self.program, self.liveness, self.kernel_s,
                             tuple(offloads), self.target, SyncMode.NONE,
                             self.residuals, self.state_copies,
                             remade_memo=self._remade_together_s)


def fit(program: Program, liveness: Liveness, budget_bytes: int | None,
        target: GpuTarget, min_bytes: int = 1 << 20,
        fusion: Fusion | None = None, residuals=(),
        host_budget_bytes: int | None = None, state_copies=(),
        host_scale: float = 1.0) -> Fit:
  """The offloads, transfers and recomputations, that fit `budget_bytes` in
  the least predicted step time (see the module docstring); with
  `budget_bytes=None`, those that reach the smallest peak jlms can. The
  program's scan `residuals`, already streamed through host, and the copies
  of its state kept on host (`jlms._state.StateCopy`), are priced.
  No copy is chosen that would take the pinned host memory in use at once
  above `host_budget_bytes`, in the program's sizes; `host_scale` is the
  bytes of one GPU's pinned pool per byte of them, for the errors' figures
  (`jlms._search.SearchRequest.host_scale`)."""
  return Fitter(program, liveness, target, min_bytes, fusion, residuals,
                host_budget_bytes, state_copies, host_scale).fit(budget_bytes)


class Fitter:
  """`fit` of one program, time model and host budget, at one budget after
  another. The greedy fit's choices do not depend on the budget, only where
  they stop: a fit for a budget below every peak the choices so far passed
  through continues from the last fit's choices instead of starting again
  (a budget search fits tighter after XLA refuses a plan: the 70B Llama's
  program as it is took minutes to fit from the start). Its fits equal
  `fit`'s from the start."""

  def __init__(self, program: Program, liveness: Liveness,
               target: GpuTarget, min_bytes: int = 1 << 20,
               fusion: Fusion | None = None, residuals=(),
               host_budget_bytes: int | None = None, state_copies=(),
               host_scale: float = 1.0, split: int = 1):
    self.program, self.liveness, self.target = program, liveness, target
    self.min_bytes = min_bytes
    self.host_budget_bytes, self.host_scale = host_budget_bytes, host_scale
    self.split = split
    self._arguments = (fusion, residuals, state_copies)
    self._greedy: _Greedy | None = None

  def continues_to(self, budget_bytes: int | None) -> bool:
    """Whether a fit for `budget_bytes` continues from the last one's
    choices (else it starts again)."""
    greedy = self._greedy
    return greedy is not None and (budget_bytes is None
                                   or budget_bytes < greedy.passed_least)

  def fit(self, budget_bytes: int | None) -> Fit:
    started = time.perf_counter()
    if not self.continues_to(budget_bytes):
      self._greedy = self._start()
    greedy = self._greedy
    problem = greedy.problem
    timeline, step_time = greedy.baseline, greedy.baseline_time
    chosen: list[Offload] = []
    if budget_bytes is None or greedy.baseline.peak_bytes > budget_bytes:
      timeline, step_time = greedy.run(budget_bytes)
      chosen = list(greedy.chosen)
      timeline, step_time = _remake_once(problem, chosen, timeline, step_time)
    result = Fit(tuple(chosen), timeline, greedy.baseline, step_time,
                 greedy.baseline_time, budget_bytes,
                 time.perf_counter() - started, self.target)
    log.info("jlms: fitted %s in %.2f s: %d values recomputed, %d copied "
             "to host; predicted peak %s, step %s",
             "the least memory" if budget_bytes is None
             else format_bytes(budget_bytes),
             result.seconds, result.recomputed, result.transferred,
             format_bytes(timeline.peak_bytes), step_time.describe())
    return result

  def refusal(self, budget_bytes: int, least: Fit) -> BudgetError:
    """The error of `budget_bytes` where `least`, this fitter's last fit,
    for the least memory, peaks above it: that peak, and what bounds it."""
    return _smallest_error(self._greedy.problem, least.timeline, budget_bytes)

  def _start(self) -> "_Greedy":
    fusion, residuals, state_copies = self._arguments
    program, liveness = self.program, self.liveness
    if fusion is None:
      fusion = analyse_fusion(program, liveness)
    problem = _Problem(program, liveness, fusion, self.target,
                       self.min_bytes, residuals, state_copies, self.split)
    problem.host_budget = host_budget = self.host_budget_bytes
    problem.host_scale = host_scale = self.host_scale
    baseline = problem.simulate(())
    if host_budget is not None and baseline.host_peak_bytes > host_budget:
      on_device = int(baseline.host_peak_bytes * host_scale)
      error = BudgetError(
          f"jlms: the state kept on host and the scan residuals streamed "
          f"through host take {format_bytes(on_device)} of "
          f"pinned host memory at once, above the host budget of "
          f"{format_bytes(int(host_budget * host_scale))}: "
          f"{host_pool_advice(on_device)}")
      error.smallest_bytes = baseline.peak_bytes
      error.host_bytes = baseline.host_peak_bytes  # the host is what failed
      raise error
    return _Greedy(problem, baseline, problem.step_time(()))


class _Greedy:
  """The greedy fit's choices so far, and what it reckoned to make them:
  `run` takes the next choice while the predicted peak is over a budget."""

  def __init__(self, problem: _Problem, baseline: MemoryTimeline,
               baseline_time: StepTime):
    self.problem = problem
    self.baseline, self.baseline_time = baseline, baseline_time
    self.timeline, self.step_time = baseline, baseline_time
    self.chosen: list[Offload] = []
    # The chosen recomputations by the equation they are remade before,
    # for pricing a trial from the step time so far (`_trial_time`).
    self.remade_groups: dict = {}
    # The least predicted peak of the choices before the last: a fit for a
    # budget at or above it would have stopped earlier.
    self.passed_least = float("inf")
    gaps = {v: g for v in problem.candidates()
            if (g := problem.gap(v)) is not None}
    # The values with a gap, their gaps' ends and whether each is still
    # unchosen, as arrays. The far end is brought in to the earliest
    # equation at which a chosen recomputation reads the value: moving it
    # is fine if it is back on the device by then. As arrays: a round looks at the values live at the peak
    # alone, a few hundred of the 70B Llama's tens of thousands.
    self.values = np.fromiter(gaps, dtype=np.int64, count=len(gaps))
    self.near = np.array([g[0] for g in gaps.values()], dtype=np.int64)
    self.far = np.array([g[1] for g in gaps.values()], dtype=np.int64)
    self.unchosen = np.ones(len(gaps), dtype=bool)
    self.sizes = np.array([problem.liveness.nbytes[v] for v in gaps],
                          dtype=np.int64)
    self.position = {v: i for i, v in enumerate(gaps)}
    self.transfers: dict = {}
    self.moved: dict[int, _Option] = {}  # value -> the option chosen for it
    self.remade_at = _RemadeAt()  # the recomputations among them, by place
    # (value, far) -> its recomputation, derived once and again only when a
    # value its chain reached is moved: a round moves one value, and most
    # chains never reach it (Gemma2-2B: about 250 chains a round, 300
    # rounds).
    self.remakes: dict = {}
    self.watchers: dict[int, list] = {}  # value -> remakes that read its move

  def run(self, budget: int | None):
    """(timeline, step time) once the predicted peak is at most `budget`
    (None: once no choice lowers it); `BudgetError` where it cannot be."""
    problem = self.problem
    while budget is None or self.timeline.peak_bytes > budget:
      timeline = self.timeline
      peak = timeline.peak_index
      ranked, freeable = self._options_at(peak)
      if budget is not None and timeline.peak_bytes - freeable > budget:
        # However many of the values live there are copied out or remade,
        # the peak's equation stays over the budget: no further choice can
        # fit it (seven ways of the 70B Llama's program with a share of
        # its moments on host fitted to the end, 18 minutes, for this).
        raise _out_of_reach_error(problem, timeline, budget, freeable)
      if not ranked:
        if budget is None:  # as low as it goes
          break
        raise _smallest_error(problem, timeline, budget)
      self._take(self._best(ranked))
    # The rounds priced each choice from the last one's time: the fit's
    # own figure is priced whole, as any plan's is.
    self.step_time = problem.step_time(self.chosen)
    return self.timeline, self.step_time

  def _options_at(self, peak: int):
    """The options that free device memory at equation `peak`, and the
    bytes of every value that some choice could still free there."""
    problem, ranked = self.problem, []
    live = np.nonzero(self.unchosen & (self.near < peak)
                      & (peak < self.far))[0]
    freeable = int(self.sizes[live].sum())
    for value, near, far in zip(self.values[live].tolist(),
                                self.near[live].tolist(),
                                self.far[live].tolist()):
      if (value, far) not in self.transfers:
        self.transfers[value, far] = problem.transfer(value, near, far)
      if (value, far) not in self.remakes:
        watched: set[int] = set()
        self.remakes[value, far] = problem.recompute(value, near, far,
                                                     self.moved, watched)
        for atom in watched:
          self.watchers.setdefault(atom, []).append((value, far))
      remade = self.remakes[value, far]
      found = (self.transfers[value, far], remade,
               remade and problem.shared_recompute(remade, self.remade_at))
      for option in found:
        if (option is not None
            and option.frees_from <= peak < option.frees_until
            and _fits_host(problem, self.timeline, option)):
          ranked.append(option)
    return ranked, freeable

  def _best(self, ranked: list):
    """The option of `ranked` that adds the least step time per byte, by
    the schedule model for the best few of each kind (the estimate that
    ranks them ignores the link's other copies); with its step time."""
    ranked.sort(key=lambda o: (o.estimate_s + 1e-12) / o.nbytes)
    shortlist = ([o for o in ranked if o.offload.is_recompute][
        :_EXACT_PER_ROUND] + [o for o in ranked if not o.offload.is_recompute][
            :_EXACT_PER_ROUND])
    best, best_score, best_time = None, None, None
    for option in shortlist:
      trial = self._trial_time(option.offload)
      score = (trial.total_s - self.step_time.total_s + 1e-12) / option.nbytes
      if best is None or score < best_score:
        best, best_score, best_time = option, score, trial
    return best, best_time

  def _trial_time(self, offload) -> StepTime:
    """The step time of the choices so far and `offload`: added to theirs
    where the target exposes each copy whole (the same figure, to
    rounding, in the time of `offload`'s own group of recomputations
    rather than of every choice: a 300-layer MLP's fit priced 21,868
    trials, 96 of its 216 s of planning), else priced whole."""
    problem = self.problem
    if problem.target.hides_copies:
      return problem.step_time(self.chosen + [offload])
    return with_offload_added(self.step_time, problem.program,
                              problem.liveness, offload, problem.target,
                              self.remade_groups,
                              problem._remade_together_s)

  def _take(self, best_and_time) -> None:
    best, best_time = best_and_time
    problem = self.problem
    self.passed_least = min(self.passed_least, self.timeline.peak_bytes)
    self.chosen.append(best.offload)
    self.remade_groups = remade_groups_with(self.remade_groups, best.offload)
    self.moved[best.offload.value] = best
    self.unchosen[self.position[best.offload.value]] = False
    for key in self.watchers.pop(best.offload.value, ()):
      self.remakes.pop(key, None)
    if best.offload.is_recompute:
      self.remade_at.add(best.offload.swap_ins[0].issue_before,
                         problem._kernel_facts(best.offload.recompute))
    far = best.offload.swap_ins[0].issue_before
    for leaf in best.leaves:
      if leaf in self.position:
        at = self.position[leaf]
        self.far[at] = min(self.far[at], far)
    self.step_time = best_time
    self.timeline = problem.simulate(self.chosen)


class _RemadeAt:
  """The chosen recomputations whose kernel another may join, indexed by
  each value they read, with the equation they are remade before: for
  `_Problem.shared_recompute` to find the latest one a chain joins (it
  must read all the chain reads) among the few that read one of its
  inputs, rather than test every choice each round."""

  def __init__(self):
    self._by_input: dict[int, list[tuple[int, frozenset]]] = {}

  def add(self, anchor: int, facts: tuple[frozenset, bool]) -> None:
    reads, elementwise = facts
    if elementwise:  # only an elementwise kernel takes another chain
      for value in reads:
        self._by_input.setdefault(value, []).append((anchor, reads))

  def latest_joined(self, after: int, up_to: int,
                    facts: tuple[frozenset, bool]) -> int | None:
    """The latest place in `(after, up_to]` of a chosen recomputation
    whose kernel a chain with these `kernel_facts` joins
    (`jlms._planner.joins_kernel`); None where there is none."""
    reads, elementwise = facts
    if not elementwise or not reads:
      return None
    rarest = min(reads, key=lambda v: len(self._by_input.get(v, ())))
    best = None
    for anchor, other_reads in self._by_input.get(rarest, ()):
      if (after < anchor <= up_to and (best is None or anchor > best)
          and joins_kernel((other_reads, True), facts)):
        best = anchor
    return best


@dataclasses.dataclass(frozen=True)
class _Back:
  frees_until: int  # the value is on the device again from here


def _anchor(offload: Offload) -> int:
  return offload.swap_ins[0].issue_before


class _Rederived:
  """`chosen`'s recomputations with every chain derived again, each back
  to the values on the device at its place (a value remade earlier
  included), and the values each derivation read: a trial that moves one
  value's remake (`_remake_once`) derives again only the chains that read
  it and its own, since no other derivation reads where it is made (the
  70B Llama's 30 layers: 314 trials re-derived all 613 chains each, 27 s
  of a 28 s fit)."""

  def __init__(self, problem: _Problem, chosen: list, derived=None):
    """`derived`, where given, is (`chosen` derived, where each value is
    back, what each derivation read), known already."""
    self.problem, self.chosen = problem, chosen
    self._last = None  # the last trial: (moved, its back, what each read)
    if derived is not None:
      self.derived, self.back, self.read = derived
      return
    self.back = {o.value: _back(o) for o in chosen}
    self.derived, self.read = [], []
    for offload in chosen:
      read: set[int] = set()
      self.derived.append(self._derive(offload, self.back, read))
      self.read.append(read)

  def _derive(self, offload: Offload, back: dict, read: set):
    """`offload`'s chain derived again for `back` (None where it cannot
    be made at its place), or itself if it is a copy."""
    if not offload.is_recompute:
      return offload
    option = self.problem.recompute(offload.value, offload.swap_out_after,
                                    _anchor(offload), back, read)
    if option is None:
      return None
    return dataclasses.replace(option.offload, swap_ins=offload.swap_ins)

  def moving(self, value: int, place: int) -> list | None:
    """`chosen` with `value`'s remake moved to `place`, every chain
    derived again; None where one can no longer be made there."""
    back = dict(self.back)
    out = []
    for offload, derived, read in zip(self.chosen, self.derived, self.read):
      if offload.value == value:
        offload = dataclasses.replace(offload, swap_ins=(
            SwapIn(place, offload.swap_ins[0].reads),))
        back[value] = _back(offload)
        derived = None  # derived below, for its new place
      out.append((offload, derived, offload.value == value or value in read))
    moved, reads = [], []
    for (offload, derived, again), read in zip(out, self.read):
      if again:
        read = set()
        derived = self._derive(offload, back, read)
      if derived is None:
        return None
      moved.append(derived)
      reads.append(read)
    self._last = (moved, back, reads)
    return moved

  def taken(self) -> "_Rederived":
    """The derivation of the last trial's list, once it is taken: its
    chains are already derived for where they are (deriving a chain again
    at the same place, with the same values back, gives the same chain)."""
    moved, back, reads = self._last
    return _Rederived(self.problem, moved, (list(moved), back, reads))


def _back(offload: Offload) -> "_Back":
  """Where `offload`'s value is on the device again."""
  return _Back(_anchor(offload) if offload.is_recompute
               else min(s.issue_before for s in offload.swap_ins))


def _remake_once(problem: _Problem, chosen: list, timeline: MemoryTimeline,
                 step_time: StepTime):
  """Where one recomputation re-emits the making of a value that is itself
  remade later (a block's input, remade within the chain of a later
  block's input), remake that value once, at the earlier place, and keep
  it until its own reads: the later chains then start from it. Taken value
  by value, earliest place first, where the predicted peak does not rise
  and the predicted step gets faster (the 16-block ResNet at remat's peak: 84
  equations re-emitted twice or more, 23 after; 26.9 -> 26.3 ms by the
  schedule model of XLA's program)."""
  tried: set[tuple[int, int]] = set()
  rederived = None  # of `chosen` as it is
  while True:
    remade = {o.value: o for o in chosen if o.is_recompute}
    made_by = {problem.liveness.producer[v]: v for v in remade}
    trial = None
    for offload in sorted(remade.values(), key=_anchor):
      place = _anchor(offload)
      for index in offload.recompute:
        value = made_by.get(index)
        if (value is None or value == offload.value
            or (value, place) in tried):
          continue
        other = remade[value]
        if (_anchor(other) <= place or int(
            problem.fusion.executes_at[other.swap_out_after]) + 1 >= place):
          continue
        tried.add((value, place))
        trial = (value, place)
        break
      if trial is not None:
        break
    if trial is None:
      return timeline, step_time
    value, place = trial
    if rederived is None:
      rederived = _Rederived(problem, list(chosen))
    moved = rederived.moving(value, place)
    if moved is None:
      continue
    new_timeline = problem.simulate(moved)
    # Not above the peak the greedy fit reached: a value held longer than
    # planned is where XLA's own peak may part from the prediction.
    if new_timeline.peak_bytes > timeline.peak_bytes:
      continue
    new_time = problem.step_time(moved)
    if new_time.total_s >= step_time.total_s:
      continue
    chosen[:] = moved
    timeline, step_time = new_timeline, new_time
    rederived = rederived.taken()


def _fits_host(problem: _Problem, timeline: MemoryTimeline,
               option: _Option) -> bool:
  """Whether a copy keeps the pinned host memory in use at once within the
  host budget (a recomputation uses none)."""
  if option.offload.is_recompute or problem.host_budget is None:
    return True
  if timeline.host_peak_bytes + option.nbytes <= problem.host_budget:
    return True  # within the budget even at the host's peak
  start = option.offload.swap_out_after
  end = option.offload.swap_ins[-1].issue_before
  on_host = int(timeline.host_bytes[start:end + 1].max(initial=0))
  fits = on_host + option.nbytes <= problem.host_budget
  problem.host_budget_refused |= not fits
  return fits


#: A loop whose one iteration needs at least this share of the
#: temporaries at the least peak is named in the budget's error.
_LOOP_BOUND_SHARE = 0.5


def _loop_working_memory(problem, timeline) -> str:
  """The clause of the budget error that names a loop (", and <bytes>
  that one iteration of the loop <name> makes and drops inside its body:
  ...") where the least peak is mostly that (a forward and backward pass
  in one `lax.scan` body, as gradient accumulation writes it): what
  `jlms._body_remat` remakes inside it aside, no keep, remake or copy
  lowers it. Empty otherwise."""
  index = timeline.peak_index
  if index >= len(problem.program):
    return ""
  working = int(problem.constants.working[index])
  temporaries = timeline.peak_bytes - timeline.fixed_bytes
  if working <= 0 or working < _LOOP_BOUND_SHARE * temporaries:
    return ""
  name = problem.program.equations[index].readable_name()
  return (f", and {format_bytes(working)} that one iteration of the loop "
          f"{name} (equation {index}) makes and drops inside its body, "
          "as far as jlms remakes it there: fewer rows an iteration lower "
          "that")


def _out_of_reach_error(problem, timeline, budget, freeable) -> BudgetError:
  """The error of a budget that the equation at the predicted peak stays
  above whatever is chosen: its `smallest_bytes` is that floor, a bound
  below which no plan of this program goes, not a peak reached
  (`floor_only`)."""
  floor = timeline.peak_bytes - freeable
  name = (problem.program.equations[timeline.peak_index].readable_name()
          if timeline.peak_index < len(problem.program) else "the step's end")
  error = BudgetError(
      f"jlms: the step does not fit a budget of {format_bytes(budget)}: "
      f"while {name} (equation {timeline.peak_index}) runs, "
      f"{format_bytes(floor)} stay on the device however many of the "
      f"values live there are copied to host or remade (arguments and "
      f"outputs {format_bytes(timeline.fixed_bytes)}); raise the budget "
      "above that")
  error.smallest_bytes = floor
  error.floor_only = True
  return _with_advice(error, problem,
                      _loop_working_memory(problem, timeline))


def _host_budget_clause(problem) -> str:
  """", or the host budget (...)" where the host budget turned copies
  down, else empty: also where there is none to raise (no host memory
  for a step with an ordered effect, whose error says so)."""
  if not problem.host_budget_refused or not problem.host_budget:
    return ""
  return (f", or the host budget ("
          f"{format_bytes(int(problem.host_budget * problem.host_scale))} of "
          "pinned host memory, which bounds what can be copied out)")


def _with_advice(error: BudgetError, problem, loop: str) -> BudgetError:
  """`error` with its `advice`: what besides the budget would lower the
  peak (`loop`, the clause of a loop body's working memory, and the host
  budget), for an error of XLA's, which compiles the plans after the
  simulator, to repeat (`jlms._search`)."""
  error.advice = _host_budget_clause(problem) + (
      "; by jlms's own count, the peak holds "
      + loop.removeprefix(", and ") if loop else "")
  return error


def _smallest_error(problem, timeline, budget) -> BudgetError:
  """The error of a budget below the least peak jlms reaches."""
  loop = _loop_working_memory(problem, timeline)
  host = _host_budget_clause(problem)
  error = BudgetError(
      f"jlms: the step does not fit a budget of {format_bytes(budget)}: the "
      f"smallest peak jlms reaches is {format_bytes(timeline.peak_bytes)} "
      f"(arguments and outputs {format_bytes(timeline.fixed_bytes)}"
      f"{loop}); raise the budget to at least that{host}")
  error.smallest_bytes = timeline.peak_bytes
  return _with_advice(error, problem, loop)
