"""The ways a step's loops can run, each a small strategy the search tries.

A budget fit (`jlms._search`) fits every way at the top level and keeps the
fastest that fits. The ways, in order:

- `LoopsAsTheyAre`: the step's program unchanged;
- `InputsMadeInLoops`: loop-invariant masks and fills that autodiff hoisted
  out of the scans made inside them again (`jlms._loop_sink`);
- `LoopsRemaking(share)`: a share of the residuals that forward scans stack
  for backward ones remade inside the backward loop, the cheapest first
  (`jlms._loop_remat`; all of them is per-layer remat);
- `ResidualsStreamed`: those residuals streamed through host one slice per
  iteration (`jlms._loops`);
- `LoopsRemakingStreamed`: all of them remade, and each layer's input,
  which the forward loop then stacks, streamed through host;
- `SegmentsRemaking(every)`: a forward pass that is no loop cut where it
  carries least (a transformer's residual stream), and each segment's
  activations remade where its backward pass starts
  (`jlms._segment_remat`; every second cut of a transformer is per-block
  remat), first with the last segments kept where that raises the
  simulated peak by at most `_KEPT_TAIL_RISE` (`kept_tail`), then all of
  them remade;
- `BodiesRemaking(every)`: loops whose body runs a whole forward and
  backward pass (gradient accumulation) remaking inside it, as the last
  two do for the step (`jlms._body_remat`);
- `LoopsUnrolled`: those loops, when short, unrolled into the step
  (`jlms._unroll`), as it is and with each microbatch's segments remade.

Every way starts from the step's program with the runs of equations that
alone bound its memory run over chunks of the batch (`jlms._batch_split`,
where `split_batch` is on) and, where the state stays on the device, each
parameter's update moved to where its gradient is made
(`jlms._update_order`); `InputsMadeInLoops` to `LoopsRemakingStreamed` from that
program with its inputs sunk. A way that
cannot be built for a step (a pass that cannot rewrite its loops) is left
out, with a debug log line that says why; the step as it is always stays.

Guarantees: every way computes what the step computes; `placed_ways`
analyses each once per analysed step (cached by the caller's
`WayCache`), with its fused equations placed at their readers.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Iterator

from jlms import _thresholds
from jlms._analysed import AnalysedProgram
from jlms._batch_split import split_runs
from jlms._body_remat import bodies_with_backward, remade_in_bodies
from jlms._config import OffloadConfig
from jlms._cost import time_target
from jlms._liveness import analyse
from jlms._loop_remat import (cheapest, loop_rematerializations,
                              rematerialize_in_loops)
from jlms._loop_sink import loop_sinks, sink_into_loops
from jlms._loops import find_scan_residuals, offload_scan_residuals
from jlms._placement import place_fused_at_readers
from jlms._retrace import unwrapped_call
from jlms._segment_remat import (forward_cuts, kept_tail,
                                 rematerialize_segments, segment_remats)
from jlms._simulator import analyse_fusion, simulate
from jlms._state import keep_state_on_host
from jlms._unroll import accumulation_loops, unrolled
from jlms._update_order import updates_at_gradients

log = logging.getLogger("jlms")

#: Shares of a scan's residuals (the cheapest to remake first) that the
#: backward loop remakes, one way of the step each.
LOOP_REMAT_SHARES = (0.25, 0.5, 0.75, 1.0)
_CACHE_SIZE = 32


@dataclasses.dataclass(frozen=True)
class Way:
  """One way of running the step's loops: its program, and the residuals
  to stream through host (streamed by `placed_ways`)."""
  program: object
  liveness: object
  residuals: tuple
  description: str
  split_runs: tuple = ()


@dataclasses.dataclass(frozen=True)
class _Start:
  """The program every way starts from: the step's, with the runs of
  equations that alone bound its memory split over the batch."""
  program: object
  liveness: object
  split_runs: tuple
  #: Loops unrolled into it (`jlms._unroll`).
  unrolled_loops: int = 0
  #: The same start from the step with its short gradient-accumulation
  #: loops unrolled; None where it has none.
  unrolled: "_Start | None" = None

  def way(self, program, liveness, residuals, description) -> Way:
    if self.unrolled_loops:
      description += (f", {self.unrolled_loops} accumulation loops "
                      "unrolled")
    if self.split_runs:
      description += f", {len(self.split_runs)} runs split over the batch"
    return Way(program, liveness, residuals, description, self.split_runs)


@dataclasses.dataclass(frozen=True)
class _Sunk:
  """The step's program with its loop-invariant inputs made in the loops,
  shared by the ways that rewrite loops."""
  program: object
  liveness: object
  sinks: tuple


class LoopsAsTheyAre:
  """The step's program, unchanged."""

  def ways(self, start, sunk: _Sunk, config, target) -> Iterator[Way]:
    yield start.way(start.program, start.liveness, (), "loops as they are")


class InputsMadeInLoops:
  """Hoisted masks and fills made inside the loops that read them."""

  def ways(self, start, sunk: _Sunk, config, target) -> Iterator[Way]:
    if sunk.sinks:
      yield start.way(sunk.program, sunk.liveness, (),
                f"loops making {len(sunk.sinks)} loop-invariant inputs "
                "inside")


@dataclasses.dataclass(frozen=True)
class LoopsRemaking:
  """The cheapest `share` of the residuals (time to remake a byte) remade
  inside the backward loops: all of them is per-layer remat; a budget may
  need only some."""
  shares: tuple = LOOP_REMAT_SHARES

  def ways(self, start, sunk: _Sunk, config, target) -> Iterator[Way]:
    for chosen, program in _remade_in_loops(sunk, target, self.shares):
      remade = sum(len(c.residuals) for c in chosen)
      yield start.way(program, analyse(program), (),
                f"{len(chosen)} loops remaking {remade} of their residuals")


def _remade_in_loops(sunk: _Sunk, target, shares):
  """(choices, program) for each distinct cheapest `share` of the scan
  residuals remade inside the backward loops."""
  pairs = loop_rematerializations(sunk.program, sunk.liveness, target=target)
  seen = set()
  for share in shares if pairs else ():
    chosen = cheapest(pairs, share)
    key = tuple(c.residuals for c in chosen)
    if key not in seen:
      seen.add(key)
      yield chosen, rematerialize_in_loops(sunk.program, chosen)


@dataclasses.dataclass(frozen=True)
class LoopsRemakingStreamed:
  """Residuals remade inside the backward loops, as `LoopsRemaking` does,
  and what the forward loop then stacks (each iteration's carry, and the
  residuals not remade) streamed through host one slice per iteration:
  per-layer remat whose checkpoints live on host. A layer's input is there
  before its first kernel runs, so its copy out can run under that
  kernel, and the backward loop remakes the rest instead of waiting for
  them to come back. All of them by default: a share streams the
  residuals the body makes too, which wait for their copies out, and each
  such way is one more that the simulator prices lower than XLA compiles
  it (a scanned GPT's least memory, 1.84 GiB predicted, 2.11 by XLA).
  """
  shares: tuple = (1.0,)

  def ways(self, start, sunk: _Sunk, config, target) -> Iterator[Way]:
    for chosen, program in _remade_in_loops(sunk, target, self.shares):
      program = loops_unwrapped(program, chosen)
      if program is None:
        log.debug("jlms: no remade-and-streamed way: a remaking loop is "
                  "more than one scan")
        return
      liveness = analyse(program)
      residuals = find_scan_residuals(
          program, liveness, dataclasses.replace(config, swapout_threshold=2))
      if residuals:
        remade = sum(len(c.residuals) for c in chosen)
        yield start.way(
            program, liveness, residuals,
            f"{len(chosen)} loops remaking {remade} of their residuals, "
            f"{len(residuals)} stacks streamed through host")


def loops_unwrapped(program, chosen):
  """`program` with the loops that `rematerialize_in_loops` traced for
  `chosen` as scans of their own, not calls around one, so that
  `jlms._loops` finds their stacks; None where a call is more."""
  equations = list(program.equations)
  for choice in chosen:
    for index in (choice.forward, choice.backward):
      unwrapped = unwrapped_call(equations[index])
      if unwrapped is None:
        return None
      equations[index] = unwrapped
  return dataclasses.replace(program, equations=tuple(equations))


class ResidualsStreamed:
  """The residuals a forward scan stacks streamed through host, one slice
  per iteration."""

  def ways(self, start, sunk: _Sunk, config, target) -> Iterator[Way]:
    residuals = find_scan_residuals(
        sunk.program, sunk.liveness,
        dataclasses.replace(config, swapout_threshold=2))
    if residuals:
      yield start.way(sunk.program, sunk.liveness, residuals,
                f"{len(residuals)} scan residuals streamed through host")


@dataclasses.dataclass(frozen=True)
class SegmentsRemaking:
  """The activations of each segment between every `every`-th cut of the
  forward pass remade where its backward pass starts: per sub-block and
  per block of a transformer whose layers are a Python loop."""
  every: tuple = (1, 2)

  def ways(self, start, sunk: _Sunk, config, target) -> Iterator[Way]:
    cuts = forward_cuts(start.program, start.liveness)
    seen = set()
    timeline = None
    for every in self.every:
      for phase in range(every):
        remats = segment_remats(start.program, start.liveness, cuts, every,
                                phase)
        # A step with a few segments (a scanned model's embedding and
        # head) gains little over what the fit remakes value by value, and
        # one of tiny activations not the analysis of a way.
        remade = sum(start.liveness.nbytes[v] for r in remats
                     for v in r.remade)
        if (len(remats) < _MIN_SEGMENTS or remats in seen
            or remade < _thresholds.THRESHOLDS.segment_remat_min_bytes):
          continue
        seen.add(remats)
        described = (f"{len(remats)} segments remade in the backward pass"
                     + (f" (from cut {phase + 1})" if phase else ""))
        # The last segments kept where that leaves the peak about as it
        # is (`_KEPT_TAIL_RISE`); all of them remade too, for a budget
        # below that peak, where the kept ones may be what binds.
        if timeline is None:
          fusion = analyse_fusion(start.program, start.liveness)
          timeline = simulate(start.program, start.liveness, (), fusion)
        kept = kept_tail(timeline.device_bytes, start.liveness, remats,
                         fusion.materialized,
                         rise=_KEPT_TAIL_RISE)
        log.debug("jlms: %s: the last %d of them may be kept, the "
                  "simulated peak rising at most %.0f%%", described, kept,
                  100 * _KEPT_TAIL_RISE)
        if kept and kept < len(remats):
          program = rematerialize_segments(start.program, remats[:-kept])
          yield start.way(program, analyse(program), (),
                          f"{described}, the last {kept} kept")
        program = rematerialize_segments(start.program, remats)
        yield start.way(program, analyse(program), (), described)


@dataclasses.dataclass(frozen=True)
class BodiesRemaking:
  """Loops whose body runs a forward and a backward pass (gradient
  accumulation by `lax.scan`) remaking, inside that body, each segment's
  activations between every `every`-th cut of its forward pass, and the
  residuals of its own scans (`jlms._body_remat`)."""
  every: tuple = (1, 2)

  def ways(self, start, sunk: _Sunk, config, target) -> Iterator[Way]:
    seen = set()
    for every in self.every:
      remats = bodies_with_backward(
          start.program, _thresholds.THRESHOLDS.segment_remat_min_bytes,
          every)
      key = tuple((r.index, r.freed) for r in remats)
      if not remats or key in seen:
        continue
      seen.add(key)
      program = remade_in_bodies(start.program, remats)
      yield start.way(
          program, analyse(program), (),
          f"{len(remats)} loop bodies remaking their forward pass's "
          f"activations" + (" per block" if every > 1 else ""))


class LoopsUnrolled:
  """Short gradient-accumulation loops unrolled into the step
  (`jlms._unroll`): the step then planned as one whose microbatches are a
  Python loop, as it is and with each microbatch's forward pass cut into
  segments remade (`SegmentsRemaking`). Beside `BodiesRemaking`, which
  remakes inside the loop: on small steps that lower (a 6-layer MLP of 4
  microbatches, by XLA: 49 MiB remade in the body, 54 unrolled), on large
  ones it cannot (8 of Llama-3-8B's layers, 2 microbatches of 4 x 4096
  tokens: 45.3 GiB that the body makes and drops)."""

  def ways(self, start, sunk: _Sunk, config, target) -> Iterator[Way]:
    if start.unrolled is None:
      return
    unrolled_start = start.unrolled
    yield unrolled_start.way(unrolled_start.program, unrolled_start.liveness,
                             (), "loops as they are")
    yield from SegmentsRemaking().ways(unrolled_start, None, config, target)


#: A way with its last segments kept, not remade, raises the simulator's
#: peak by at most this share (the all-remade way stays beside it for the
#: budgets that this leaves out). Their activations only live across the
#: loss, which a batch split keeps small: at remat's XLA peak (52.51 GiB),
#: Llama-3.2-3B's last MLP kept raised the simulated peak 2.1% and XLA's
#: not at all (49.63 GiB, 736.5 ms by the schedule model against 739.3 with
#: it remade); GPT-2 medium's last block's MLP kept at the same simulated
#: and XLA peak (7.77 GiB), 0.2 ms less. GPT-2 medium at remat's 7.87 GiB,
#: by the schedule model: 5% kept its last 2 segments (7.38 GiB, 138.05
#: ms), 10% its last 3 (7.71 GiB, 137.86 ms), 20% its last 4 (fitted
#: tighter around them: 7.53 GiB, 138.02 ms).
_KEPT_TAIL_RISE = 0.10

#: Fewest segments worth a way of their own.
_MIN_SEGMENTS = 4

#: The strategies, in the order the search tries them.
STRATEGIES = (LoopsAsTheyAre(), InputsMadeInLoops(), LoopsRemaking(),
              ResidualsStreamed(), LoopsRemakingStreamed(), SegmentsRemaking(),
              BodiesRemaking(), LoopsUnrolled())


def loop_ways(plain: AnalysedProgram, config: OffloadConfig,
              target_name: str | None, devices: int = 1,
              least_memory: bool = False,
              updates_moved: bool | None = None) -> Iterator[Way]:
  """Each way the step's scans can run (see the module docstring); only
  the step as it is where `config.scan_residuals` is off. `devices`: how
  many devices the step spans (a batch split divides each one's share);
  `least_memory`: the ways are for the least memory, not a budget (a
  batch split's totals start from zeros, `jlms._batch_split`);
  `updates_moved`: each update where its gradient is made (None: where
  the state stays on the device)."""
  start = _start(plain, config, devices, least_memory, updates_moved)
  yield from STRATEGIES[0].ways(start, None, config, None)
  if not config.scan_residuals:
    return
  sunk = _sunk(start)
  target = time_target(target_name)
  for strategy in STRATEGIES[1:]:
    try:
      yield from strategy.ways(start, sunk, config, target)
    except Exception as error:  # noqa: BLE001 -- this way only
      log.debug("jlms: no %s way for this step (%s: %s)",
                type(strategy).__name__, type(error).__name__, error)


def _start(plain: AnalysedProgram, config: OffloadConfig,
           devices: int = 1, least_memory: bool = False,
           updates_moved: bool | None = None, program=None) -> _Start:
  """The step's program (or `program`, a rewrite of it), with its runs
  split over the batch where `config.split_batch` (a split that fails
  leaves the step as it is), and, where the state stays on the device
  (or `updates_moved` says so), each parameter's update where its
  gradient is made (`jlms._update_order`). With its short
  gradient-accumulation loops unrolled, the same again as its `unrolled`
  start (`jlms._unroll`)."""
  described = ()
  given = program
  program = plain.program if program is None else program
  if config.split_batch:
    try:
      program, described = split_runs(
          program, devices=devices,
          totals_from_first_chunk=not least_memory)
    except Exception as error:  # noqa: BLE001 -- the split only
      log.debug("jlms: no batch split (%s: %s)", type(error).__name__,
                error)
  moved = not plain.state if updates_moved is None else updates_moved
  if moved:
    # With state kept on host, each leaf's update fetches it: run during
    # the backward pass, what it fetches sits on the device beside the
    # activations (Llama-3.2-3B's least memory: 14.48 GiB by XLA with the
    # updates moved, 8.64 as the step has them), unless its copies are
    # pinned there (`placed_ways`).
    program = updates_at_gradients(program)
  if given is not None:
    return _Start(program, analyse(program), tuple(described))
  unrolled_start = None
  if config.scan_residuals:
    try:
      loops = accumulation_loops(plain.program)
      if loops:
        unrolled_start = dataclasses.replace(
            _start(plain, config, devices, least_memory, updates_moved,
                   unrolled(plain.program, loops)),
            unrolled_loops=len(loops))
    except Exception as error:  # noqa: BLE001 -- the unrolling only
      log.debug("jlms: no loop unrolled (%s: %s)", type(error).__name__,
                error)
  if program is plain.program:
    return _Start(plain.program, plain.liveness, (), unrolled=unrolled_start)
  return _Start(program, analyse(program), tuple(described),
                unrolled=unrolled_start)


def _sunk(start: _Start) -> _Sunk:
  """Every variant below rewrites its loops anyway, and each hoisted input
  is a buffer alive through both loops: they start from it made inside."""
  sinks = loop_sinks(start.program, start.liveness)
  program, sinks = sink_into_loops(start.program, sinks)
  liveness = analyse(program) if sinks else start.liveness
  return _Sunk(program, liveness, sinks)


@dataclasses.dataclass(frozen=True)
class PlacedWay:
  """A way, with the state placed as its analysed step says and its fused
  equations placed at their readers: what `jlms._fit` fits."""
  placed: AnalysedProgram
  residuals: tuple
  description: str


class WayCache:
  """The placed ways of the analysed steps a step object planned last
  (a budget search fits the same ways many times), by analysed step and
  `variant` (what else they depend on: the least memory or a budget,
  copies pinned or not)."""

  def __init__(self):
    self._entries: dict = {}

  def get(self, plain, build, variant=False):
    key = (id(plain), variant)
    cached = self._entries.get(key)
    if cached is None or cached[0] is not plain:
      cached = self._entries[key] = (plain, tuple(build()))
      if len(self._entries) > _CACHE_SIZE:
        self._entries.pop(next(iter(self._entries)))
    return cached[1]


def placed_ways(plain: AnalysedProgram, config: OffloadConfig,
                target_name: str | None, cache: WayCache, devices: int = 1,
                least_memory: bool = False,
                on_gpu: bool = False) -> tuple[PlacedWay, ...]:
  """Each of `loop_ways`, with `plain.state` kept as it says and the
  residuals streamed, analysed with fused equations placed at their
  readers; once per analysed step and `least_memory` (as `loop_ways`
  takes it). A way that the state's or the
  residuals' rewrite cannot take is left out (debug log), except the
  first, the step as it is.

  With state on host and a GPU's budget to fit (`on_gpu`: XLA confirms
  the plan for a GPU), each way comes twice:
  with the updates where the optimizer's code puts them, at the step's
  end, their state streamed in loops of slices; and with each update
  where its gradient is made, its state copied whole and pinned beside
  the backward pass (`jlms._state_pins`). The first holds less at once
  (what a loop fetches is a slice); the second hides its copies under
  the backward pass's kernels (8 of Llama-3-8B's layers at batch 4, 40
  GiB asked of the simulator, schedule model: 1363.6 ms, 793.7 of it
  copies waited for; 1139.0 ms, 451.4, at 46.0 GiB by XLA)."""
  pinned = bool(plain.state) and not least_memory and on_gpu

  def build():
    variants = [(False, None)]
    if pinned:
      variants.append((True, time_target(target_name)))
    for moved, target in variants:
      for number, way in enumerate(loop_ways(
          plain, config, target_name, devices, least_memory,
          moved if pinned else None)):
        try:
          yield _placed(plain, way, target)
        except Exception as error:  # noqa: BLE001 -- this way only
          if number == 0 and not moved:
            raise
          log.debug("jlms: %s left out (%s: %s)", way.description,
                    type(error).__name__, error)
  return cache.get(plain, build, (least_memory, pinned))


def _placed(plain: AnalysedProgram, way: Way, target=None) -> PlacedWay:
  program, liveness, residuals = way.program, way.liveness, way.residuals
  description, copies = way.description, ()
  if plain.state or plain.state.on_device:
    program, copies, residuals = keep_state_on_host(
        program, plain.state, residuals, plain.argument_names,
        plain.leading_splits, target)
    liveness = analyse(program)
    if plain.state:
      description += f", {len(plain.state.inputs)} state leaves on host"
      if target is not None:
        description += ", their copies pinned beside the backward pass"
  elif residuals:
    program = offload_scan_residuals(program, residuals)
    liveness = analyse(program)
  fusion = (plain.fusion if program is plain.program
            else analyse_fusion(program, liveness))
  placed_program = place_fused_at_readers(program, liveness, fusion)
  residuals, copies = _reindexed(program, placed_program, residuals, copies)
  placed = dataclasses.replace(AnalysedProgram.of(placed_program),
                               state=plain.state, state_copies=copies,
                               split_runs=way.split_runs)
  return PlacedWay(placed, residuals, description)


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
  copies = tuple(dataclasses.replace(c, index=moved(c.index),
                                     wait_before=moved(c.wait_before))
                 for c in copies)
  return residuals, copies
