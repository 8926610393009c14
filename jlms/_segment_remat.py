"""Per-segment remat of a step whose layers are not a loop.

A model written as a Python loop over its layers (Hugging Face's Flax
GPT-2 and Llama, `gemma`) traces to one long forward pass, then its
backward pass. Per-block remat (`nn.remat` around each layer) keeps each
layer's input and remakes the layer's activations when its backward pass
starts. `jlms._fit` prices each value alone, so it cannot see that one
re-run of a layer remakes all of its activations at once; on GPT-2 medium
at remat's peak it copied 12 GiB of attention weights to host instead
(610 ms against remat's 138 ms).

This pass finds the cuts of the forward pass: the places where the only
large values that later forward equations read are a few small ones (a
transformer's residual stream between two sub-blocks). Between two cuts
lies a segment. Each segment's activations that the backward pass reads
are remade there from the values the segment reads from outside it. This
is what `jax.checkpoint` with `nothing_saveable` does for each segment,
found from the program's data flow, with no names or layer classes:

- `forward_cuts` (analysis): the cut positions, each the equation after
  which the bytes the forward pass carries across are within
  `_CUT_SLACK` of the least it carries anywhere (ignoring the start and
  the end of the pass, where it carries next to nothing);
- `segment_remats` (analysis): per segment, the equations that remake
  what its backward pass reads, and where;
- `kept_tail` (analysis): how many of the last segments may keep their
  activations instead, at little or no cost to the peak: the backward
  pass reads them first, right after the loss, so where the step's peak
  lies later (its backward pass) keeping them only saves their re-run;
- `rematerialize_segments` (rewrite): the new `Program`. Each segment's
  remaking runs before the first backward equation that reads one of its
  activations. Its inputs go through one optimization barrier with that
  equation's backward operands, so XLA neither merges it with the forward
  pass (CSE) nor moves it before its backward pass starts.

Pure. Guarantees: the new program computes the same values (each
remade equation is the original, reading the same values or their remade
copies); forward equations and every value they make keep their ids; the
backward pass reads each remade value's copy, never the original.
"""

from __future__ import annotations

import bisect
import dataclasses

import numpy as np

from jlms import _compat, _rules
from jlms._liveness import Liveness
from jlms._names import made_in_backward
from jlms._program import Equation, Program

#: A place is a cut where the forward pass carries at most this many
#: times the least it carries anywhere in its middle.
_CUT_SLACK = 1.5
#: The middle of the forward pass: where it carries at least this share
#: of what it carries at the median place (its first and last equations
#: carry almost nothing: a key, the labels; its loss may carry 40 times
#: a layer's residual, GPT-2's logits).
_MIDDLE_SHARE = 1 / 16
#: A stretch of the pass between two cuts longer than this many times the
#: cuts' median spacing is cut again by its own least (`_stretches`).
_LONG_STRETCH = 4
#: Rounds of cutting long stretches, at most.
_STRETCH_ROUNDS = 8
#: The scope of the barrier that ties a remaking to its place.
REMAKING_SCOPE = "jlms/remat_segment"


def remaking_barriers(program: Program) -> tuple[int, ...]:
  """The indices of the barriers that tie each remaking of `program` to its
  place (`rematerialize_segments`, `jlms._body_remat`): where the rewrite
  pins the weight-gradient contractions made before them
  (`jlms._rewrite.rewrite`'s `pin_before`)."""
  return tuple(i for i, e in enumerate(program.equations)
               if e.primitive is _compat.barrier_p
               and REMAKING_SCOPE in str(e.name_stack))


@dataclasses.dataclass(frozen=True)
class SegmentRemat:
  """One segment's remaking: `chain` (forward equation indices, in order)
  re-run before equation `before`; the backward pass then reads the
  copies of `remade` (value ids) and of every other value `chain` makes."""
  chain: tuple[int, ...]
  remade: tuple[int, ...]
  before: int
  #: The first equation of the backward pass of the segment's forward
  #: pass.
  forward_end: int


def forward_end(program: Program) -> int | None:
  """The index of the first equation of the backward pass (made under
  autodiff's `transpose`); None for a step without one."""
  for index, equation in enumerate(program.equations):
    if made_in_backward(str(equation.name_stack)):
      return index
  return None


def forward_passes(program: Program) -> tuple[tuple[int, int], ...]:
  """(start, end) of each forward pass of `program`: its equations
  [start, end), `end` the first equation of its backward pass. The first
  pass starts at the step's start; each later one (a step that
  accumulates microbatches in a Python loop or an unrolled scan, or
  differentiates twice) at the first equation after a backward pass that
  is not made under `transpose`, where a contraction or a loop (a layer
  stack's scan) runs before the next backward pass (an optimizer's update
  between the passes has neither)."""
  backward = [made_in_backward(str(e.name_stack))
              for e in program.equations]
  passes, start = [], 0
  while True:
    end = next((i for i in range(start, len(backward)) if backward[i]),
               None)
    if end is None:
      return tuple(passes)
    if not passes or any(_rules.flops(e.eqn) > 0
                         or _compat.sub_jaxprs(e.eqn)
                         for e in program.equations[start:end]):
      passes.append((start, end))
    start = next((i for i in range(end, len(backward)) if not backward[i]),
                 len(backward))


def forward_cuts(program: Program, liveness: Liveness) -> tuple[int, ...]:
  """The cut positions of each forward pass (see the module docstring): an
  equation index per cut, the first of a run of places that each carry
  little across."""
  cuts = []
  for start, end in forward_passes(program):
    if end - start >= 2:
      cuts += _pass_cuts(program, liveness, start, end)
  return tuple(cuts)


def _pass_cuts(program: Program, liveness: Liveness, start: int,
               end: int) -> list[int]:
  """The cuts of the forward pass of equations [start, end): those within
  `_CUT_SLACK` of the least the pass carries, then those of each long
  stretch between two of them within `_CUT_SLACK` of the least that
  stretch carries (`_stretches`)."""
  carried = _carried_bytes(program, liveness, start, end)
  middle = carried[carried >= _MIDDLE_SHARE * np.median(carried)]
  if not middle.size:
    return []
  everywhere = np.ones(len(carried), dtype=bool)
  cuts = _cuts_under(liveness, carried, start, end, middle.min(), everywhere)
  # Until no long stretch is left: a stretch's least may lie at its edge
  # (an encoder's last norm, the decoder's embedding), whose cut leaves the
  # rest of the stretch to cut by its own least.
  spacing = _spacing(cuts)
  for _ in range(_STRETCH_ROUNDS):
    found = []
    for low, high in _stretches(cuts, spacing):
      inside = np.zeros(len(carried), dtype=bool)
      inside[low - start:high - start] = True
      found += _cuts_under(liveness, carried, start, end,
                           carried[inside].min(), inside, stretch=True)
    if not found:
      break
    cuts = sorted(cuts + found)
  return cuts


def _spacing(cuts: list[int]) -> int | None:
  """The median spacing of `cuts`; None under three cuts."""
  return int(np.median(np.diff(cuts))) if len(cuts) >= 3 else None


def _stretches(cuts: list[int],
               spacing: int | None) -> list[tuple[int, int]]:
  """[low, high) of each stretch between two consecutive `cuts` longer than
  `_LONG_STRETCH` times `spacing` (the first cuts' median spacing), less
  that spacing at each end: a part of the pass that carries more than the
  rest all along, as a decoder carries its encoder's output beside its
  own residual stream into every layer's cross-attention (BART, T5,
  Whisper), so that the pass's least cuts only the encoder."""
  if spacing is None:
    return []
  return [(low + spacing, high - spacing)
          for low, high in zip(cuts, cuts[1:])
          if high - low > _LONG_STRETCH * spacing]


def _carried_through(liveness, first, last, start, end) -> frozenset:
  """The values of the pass [start, end) made before place `first` that a
  forward equation after place `last` reads: carried across every place
  between (a decoder's encoder output)."""
  return frozenset(
      value for value, size in enumerate(liveness.nbytes)
      if size and start <= liveness.producer[value] < first
      and _last_forward_read(liveness, value, end) > last)


def _cuts_under(liveness, carried, start, end, least, where,
                stretch=False) -> list[int]:
  """The places of `where` that begin a run of places carrying at most
  `_CUT_SLACK * least`, one per largest value carried; in a `stretch`,
  one per largest value of those not carried across all of the runs."""
  # A run of places that each carry little is one cut (a residual add,
  # then the elementwise steps that read it alone: dropout, a norm's
  # statistics), and so are runs that carry the same largest value (a
  # norm's centred input, carried beside its input, parts two runs).
  at_most = (carried <= _CUT_SLACK * least) & where
  starts = start + np.flatnonzero(
      at_most & ~np.concatenate([[False], at_most[:-1]]))
  through = (_carried_through(liveness, starts[0], starts[-1], start, end)
             if stretch and len(starts) > 1 else frozenset())
  largest = _largest_carried(liveness, [int(i) for i in starts], start, end,
                             through)
  cuts, previous = [], object()
  for place, value in zip(starts, largest):
    if value != previous:
      cuts.append(int(place))
    previous = value
  return cuts


def _largest_carried(liveness, places, start, end,
                     skipped=frozenset()) -> list:
  """For each of `places` (indices of the forward pass [start, end),
  increasing), the largest value but `skipped` made at or before it in
  that pass that a forward equation after it reads."""
  best = [None] * len(places)
  best_size = [0] * len(places)
  for value, size in enumerate(liveness.nbytes):
    made_by = liveness.producer[value]
    if (size == 0 or made_by < start or made_by >= end
        or value in skipped):
      continue
    last = _last_forward_read(liveness, value, end)
    k = bisect.bisect_left(places, made_by)
    while k < len(places) and places[k] < last:
      if size > best_size[k]:
        best[k], best_size[k] = value, size
      k += 1
  return best


def _carried_bytes(program, liveness, start, end) -> np.ndarray:
  """carried[i - start]: bytes of the values made at or before equation
  `i` of the forward pass [start, end) that a later equation of that pass
  reads. Not a barrier's outputs, which are values made before (a later
  microbatch's parameters, `jlms._unroll`), as the step's arguments are
  not."""
  delta = np.zeros(end - start + 1)
  for value, size in enumerate(liveness.nbytes):
    made_by = liveness.producer[value]
    if (size == 0 or made_by < start or made_by >= end or _rules.rule(
        program.equations[made_by].primitive).aliases_operands):
      continue
    last = _last_forward_read(liveness, value, end)
    if last > made_by:
      delta[made_by - start] += size
      delta[last - start] -= size
  return np.cumsum(delta)[:end - start]


def _last_forward_read(liveness: Liveness, value: int, end: int) -> int:
  last = -1
  for read in liveness.uses[value]:
    if read >= end:
      break
    last = read
  return last


def segment_remats(program: Program, liveness: Liveness,
                   cuts: tuple[int, ...], every: int = 1, phase: int = 0
                   ) -> tuple[SegmentRemat, ...]:
  """The remaking of each segment between every `every`-th cut of each
  forward pass from the `phase`-th on (1: each sub-block of a
  transformer; 2: each block, or each MLP with the next attention, as
  `phase` says: a segment remakes the values its own later equations
  read, so the phase decides which sub-block's last matmul is remade).
  The segment before a pass's first cut and after its last stay as they
  are: the backward pass starts right after the last, and the first
  holds the embedding's lookup."""
  remats = []
  for start, end in forward_passes(program):
    chosen = [c for c in cuts if start <= c < end][phase::every]
    for first, last in zip(chosen, chosen[1:]):
      remat = _segment(program, liveness, first, last, end)
      if remat is not None:
        remats.append(remat)
  return tuple(remats)


def _segment(program, liveness, start, stop, end) -> SegmentRemat | None:
  """The remaking of the segment of forward equations (start, stop]."""
  inside = range(start + 1, stop + 1)
  remade, first_read = [], None
  for index in inside:
    equation = program.equations[index]
    if not _rules.is_recomputable(equation.eqn):
      continue
    for value in equation.outputs:
      if _last_forward_read(liveness, value, end) > stop:
        continue  # carried across the cut: kept
      backward = [r for r in liveness.uses[value] if end <= r < liveness.end]
      if backward:
        remade.append(value)
        first_read = min(backward[0], first_read or backward[0])
  if not remade:
    return None
  chain: set[int] = set()
  stack = [liveness.producer[v] for v in remade]
  while stack:
    index = stack.pop()
    if index in chain:
      continue
    chain.add(index)
    for atom in program.equations[index].inputs:
      if not isinstance(atom, int):
        continue
      made_by = liveness.producer[atom]
      if (start < made_by <= stop and made_by not in chain
          and _rules.is_recomputable(program.equations[made_by].eqn)
          and _last_forward_read(liveness, atom, end) <= stop):
        stack.append(made_by)
  return SegmentRemat(tuple(sorted(chain)), tuple(remade), first_read, end)


def kept_tail(profile: np.ndarray, liveness: Liveness,
              remats: tuple[SegmentRemat, ...],
              materialized: np.ndarray | None = None,
              rise: float = 0.0) -> int:
  """How many of the last of `remats` (in forward order) can be left out, their activations kept, with
  the program's peak at most `rise` (a share) above its peak with all of
  them remade.

  `profile`: the device bytes alive at each equation of the program as it
  is (`live_bytes_by_equation`, or the simulator's timeline, which knows
  what XLA fuses away); `materialized`: which values have a buffer of
  their own (all where None). Remaking a segment frees each value it
  remakes from its last forward read to the segment's place in the
  backward pass (its copy lives from there on); keeping it adds that gap
  back. Segments are added back from the last while the peak stays.
  Conservative: the remade chain's own temporaries, which raise the peak
  of the all-remade program at each place, are not counted.
  """
  if not remats:
    return 0
  profile = np.asarray(profile, dtype=np.int64)[:liveness.end]
  gaps = []
  for remat in remats:
    delta = np.zeros(len(profile) + 1, dtype=np.int64)
    for value in remat.remade:
      if materialized is not None and not materialized[value]:
        continue
      freed_from = max(_last_forward_read(liveness, value,
                                          remat.forward_end),
                       liveness.producer[value]) + 1
      if freed_from < remat.before:
        delta[freed_from] += liveness.nbytes[value]
        delta[remat.before] -= liveness.nbytes[value]
    gaps.append(np.cumsum(delta)[:len(profile)])
  profile = profile - np.sum(gaps, axis=0)
  peak = profile.max() * (1 + rise)
  kept = 0
  for gap in reversed(gaps):
    profile = profile + gap
    if profile.max() > peak:
      break
    kept += 1
  return kept


def rematerialize_segments(program: Program,
                           remats: tuple[SegmentRemat, ...]) -> Program:
  """`program` with each of `remats` re-run where it says (see the module
  docstring); `program` itself for none."""
  if not remats:
    return program
  avals = list(program.avals)
  by_place: dict[int, list[SegmentRemat]] = {}
  for remat in remats:
    by_place.setdefault(remat.before, []).append(remat)
  renamed: dict[int, int] = {}  # original id -> its copy, once remade
  equations: list[Equation] = []

  def read(atom):
    return renamed.get(atom, atom) if isinstance(atom, int) else atom

  def new_id(aval) -> int:
    avals.append(aval)
    return len(avals) - 1

  # Only values the backward pass made tie a remaking to its place (a
  # parameter read there, tied too, would reach the update through the
  # barrier): from the first backward equation of the remaking's own
  # forward pass on (a later microbatch's forward values are no such).
  made_from: dict[int, frozenset] = {}

  def made_backward(remat):
    if remat.forward_end not in made_from:
      made_from[remat.forward_end] = frozenset(
          v for e in program.equations[remat.forward_end:]
          for v in e.outputs)
    return made_from[remat.forward_end]
  fills = _constant_fills(program)
  for index, equation in enumerate(program.equations):
    for remat in by_place.get(index, ()):
      equations.extend(_remade(program, remat, equation, read, renamed,
                               new_id, made_backward(remat), fills))
    equations.append(dataclasses.replace(
        equation, inputs=tuple(read(a) for a in equation.inputs)))
  outvars = tuple(read(a) for a in program.outvars)
  return dataclasses.replace(program, equations=tuple(equations),
                             outvars=outvars, avals=tuple(avals))


def _constant_fills(program: Program) -> frozenset:
  """The values that broadcast one constant scalar (a zero fill, made from
  literals alone): XLA computes them inside each kernel that reads them,
  unless a barrier reads one, which gives it a buffer. (Not broadcasts of
  other values: left untied, the remakings' dropout masks, each made from
  broadcasts of the same two counter vectors, were fused into one kernel
  and held: GPT-2 medium at remat's peak, 7.41 to 7.79 GiB.)"""
  broadcasts = frozenset(_compat.primitives_named("broadcast_in_dim"))
  constant: set[int] = set()
  fills = set()
  for equation in program.equations:
    if (_compat.sub_jaxprs(equation.eqn) or not all(
        not isinstance(a, int) or a in constant for a in equation.inputs)):
      continue
    constant.update(equation.outputs)
    if equation.primitive in broadcasts and equation.inputs and not (
        program.avals[equation.inputs[0]].shape
        if isinstance(equation.inputs[0], int)
        else np.shape(equation.inputs[0].value)):
      fills.update(equation.outputs)
  return frozenset(fills)


def _remade(program, remat, before: Equation, read, renamed, new_id,
            made_backward, fills=frozenset()) -> list[Equation]:
  """The equations that re-run `remat.chain` before `before`: a barrier
  over the chain's inputs and those of `before`'s operands that the
  backward pass made (`made_backward`), but `fills` where others tie the
  same, then each chain equation reading copies. Updates `renamed`."""
  chain = set(remat.chain)
  made = {v for i in chain for v in program.equations[i].outputs}
  leaves = [a for a in dict.fromkeys(
      a for i in remat.chain for a in program.equations[i].inputs
      if isinstance(a, int)) if a not in made]
  # A fill through the barrier would be a buffer the chain's kernels read
  # (GPT-2's dropout zeros, f32[8, 1024, 1024], made once and read by 94
  # remade kernels: 0.9 ms by the schedule model, where per-block remat
  # computes them in each kernel); read as it is, XLA makes it there.
  if any(a not in fills for a in leaves):
    leaves = [a for a in leaves if a not in fills]
  # PRNG keys go through the barrier too: a dropout mask made from a key
  # alone, untied, is one computation with the forward pass's mask, and XLA
  # merges the two and hoists them: GPT-2 medium's 49 masks (392 MiB) were
  # made at the step's start and held to their backward reads.
  tied = [a for a in leaves if _compat.passes_a_barrier(program.avals[a])]
  waits_for = [a for a in dict.fromkeys(before.inputs)
               if isinstance(a, int) and a in made_backward
               and a not in tied and _compat.has_plain_layout(program.avals[a])]
  if any(a not in fills for a in waits_for):
    waits_for = [a for a in waits_for if a not in fills]
  barrier_inputs = [read(a) for a in tied + waits_for]
  out = []
  if barrier_inputs:
    outputs = tuple(new_id(program.avals[a]) for a in tied + waits_for)
    scope = REMAKING_SCOPE
    vars_in = [_compat.new_var(program.avals[a]) for a in tied + waits_for]
    vars_out = [_compat.new_var(program.avals[a]) for a in tied + waits_for]
    template = _compat.barrier_equation(vars_in, vars_out, before.eqn, scope)
    out.append(Equation(template, tuple(barrier_inputs), outputs,
                        _compat.scope_name_stack(scope)))
    # The leaves' copies feed the chain only; the backward operands'
    # copies are what the backward pass reads from here on, which keeps
    # the barrier (and the order it sets) in XLA's program.
    local = dict(zip(tied, outputs[:len(tied)]))
    renamed.update(zip(waits_for, outputs[len(tied):]))
  else:
    local = {}
  for index in remat.chain:
    equation = program.equations[index]
    inputs = tuple(local.get(a, read(a)) if isinstance(a, int) else a
                   for a in equation.inputs)
    outputs = tuple(new_id(program.avals[v]) for v in equation.outputs)
    local.update(zip(equation.outputs, outputs))
    stack = _compat.extend_name_stack(equation.name_stack,
                                      "rematted_computation")
    # A distinct equation object (passes key equations by identity),
    # with fresh result vars; the Program's ids say what it reads.
    eqn = _compat.rebuilt_equation(
        equation.eqn, equation.eqn.invars,
        [_compat.new_var(program.avals[v]) for v in equation.outputs], stack)
    out.append(Equation(eqn, inputs, outputs, stack))
  renamed.update((v, local[v]) for i in chain
                 for v in program.equations[i].outputs)
  return out
