"""Predicting XLA's device peak of a step, with and without an offload plan.

XLA's peak of a step is its arguments plus its outputs (allocated for the
whole call) plus the largest set of temporaries alive at once. The jaxpr
alone overstates the temporaries: XLA's GPU compiler fuses elementwise and
re-layout operations into the kernel that reads them, so their results never
get a buffer, while the values they read stay alive until that kernel runs.
The simulator models exactly that, and runs the step in jaxpr order (XLA's
scheduler keeps the order the rewrite pins down with barriers, and mostly
keeps autodiff's order elsewhere).

Pure functions: nothing here traces, compiles or changes a program, so the
auto-tuner can call `simulate` many times in a second. Its error against
XLA's own buffer assignment is measured by the benchmarks
(`python -m benchmarks.simulator_error`) and asserted by the tests.

A loop, branch or rematerialised call is one equation of the flat program;
while it runs, its body's own temporaries (simulated the same way, once per
distinct body) are added to that equation. Values the program itself places
in host memory (the scan stacks of `jlms._loops`) count on host from their
producer to their last read.

Guarantees: `MemoryTimeline.device_bytes[i]` counts every buffer that exists
while equation `i` runs (index `len(program)` stands for the step's end);
`peak_bytes` is its maximum; an offloaded value counts on the device only up
to its swap-out and between each swap-in and its last read, and on host from
its swap-out to its last swap-in.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np

from jlms import _compat, _rules
from jlms._gathered import whole_weight_holds
from jlms._liveness import Liveness, analyse, aval_nbytes, is_expansion
from jlms._planner import Offload
from jlms._program import Program, donation_pairs, flatten


@dataclasses.dataclass(frozen=True)
class Fusion:
  """Which values XLA would give a buffer, and when each value is last read
  once fused reads are accounted for (a value read by a fused elementwise
  operation is read where that operation's fused result is read)."""
  materialized: np.ndarray  # bool per value id
  last_read: np.ndarray  # int per value id; -1 for values nobody reads
  executes_at: np.ndarray  # int per equation: where its work really happens
  # Buffers made by their first reader's kernel rather than where the jaxpr
  # makes them (see `L2_CACHE_BYTES`): value id -> (that reader's index, the
  # buffers at least as large as it that its computation reads, alive there
  # anyway). Such a value holds
  # no memory before that reader unless one of those buffers is moved off
  # the device (offloaded or recomputed): then XLA would have to keep the
  # moved buffer for it, and `simulate` counts it from where it is made.
  made_late: dict = dataclasses.field(default_factory=dict)


# How far `analyse_fusion` looks: the buffers behind a fused value (an
# elementwise chain reads a handful), and the kernels reading one (the
# traffic test below only needs to know whether there are several).
_MOST_BUFFERS_FOLLOWED = 64
_MOST_KERNELS_COUNTED = 16
# XLA fuses a producer into its consumers unless its performance model finds
# that slower; a separate kernel also costs a launch, so it leans towards
# fusing. A margin of 25% on the bytes reproduces its choices for the
# ResNet's relu masks (see `_cheaper_as_buffer`).
_FUSION_MARGIN = 1.25
# XLA's performance model prices a re-read of a buffer smaller than the
# GPU's L2 cache at cache speed (`ReadTimeWithDRAMHeuristic` in XLA's
# gpu_performance_model_base.cc), and that decides where a fusible value
# cheaper as a buffer is made. Deviceless for an H100, the 16-block
# ResNet's relu masks (bool, read by the two reductions of BatchNorm's
# backward pass) of 40.5 MiB (288x288 images) are made in the forward pass
# beside their relu and kept; those of 50.0 MiB (320x320) and more are
# made in the backward pass, by the first reduction that reads them, from
# the convolution output kept for it anyway. 50 MiB is the L2 cache of an
# H100 and an H200 (jlms/targets); an A100's is 40 MiB.
L2_CACHE_BYTES = 50 << 20


def _cheaper_as_buffer(kernels: int, operand_bytes: int, nbytes: int) -> bool:
  """Whether XLA writes a fusible value once rather than recompute it in
  each of the `kernels` that read it, by the traffic either way: fused,
  each kernel reads the buffers behind it (`operand_bytes`); as a buffer,
  one kernel reads them and writes `nbytes`, and each reader reads those.
  Only a value lighter than the buffers behind it can come out cheaper as
  a buffer: a relu's mask (1 byte per element, from float32 inputs) read
  by the two reductions of BatchNorm's backward pass is made in the
  forward pass with the relu and kept (XLA's ResNet programs), while the
  same mask read by one kernel is recomputed there; a transformer's
  residual sum (half the bytes of its two operands) read by LayerNorm's
  kernels and the backward pass is kept as an extra output of LayerNorm's
  reduction."""
  # Fused, the readers read the operands `kernels` times; as a buffer, once,
  # plus the buffer's write and `kernels` reads.
  extra_when_fused = (kernels - 1) * operand_bytes
  extra_when_buffered = (kernels + 1) * nbytes
  return extra_when_fused > _FUSION_MARGIN * extra_when_buffered


def analyse_fusion(program: Program, liveness: Liveness,
                   forced: frozenset | set = frozenset()) -> Fusion:
  """The fusion model: a value is fused away (no buffer) when an elementwise
  or re-layout equation makes it and every reader can take it fused
  (elementwise, re-layout or a reduction), unless it is a step output, one of
  `forced` (offloaded values, which a copy to host must read from a buffer),
  a costly elementwise result read by several equations (XLA computes it
  once rather than in each reader), or a value that the kernels reading it
  would each recompute at more memory traffic than one buffer costs
  (`_cheaper_as_buffer`)."""
  equations = program.equations
  n = len(equations)
  n_values = len(program.avals)
  producer = liveness.producer
  uses = liveness.uses
  fusible = np.zeros(n, dtype=bool)
  takes_fused = np.zeros(n, dtype=bool)
  expensive = np.zeros(n, dtype=bool)
  # An optimization barrier (one `jax.checkpoint` puts on its inputs) makes
  # no buffer: its outputs are its inputs, alive until their last read.
  aliasing = np.zeros(n, dtype=bool)
  # Loops and calls make a broadcast they read inside their bodies (an
  # attention mask, a fill value: `jlms._loop_sink` puts them there in the
  # plans it rewrites), and a cotangent sum computes a broadcast operand in
  # its kernel; other operands both read from buffers.
  has_body = np.zeros(n, dtype=bool)
  takes_expansions = np.zeros(n, dtype=bool)
  # Row reductions (a softmax's, a LayerNorm's) computed inside the kernel
  # that reads them, when only elementwise work does.
  row = np.zeros(n, dtype=bool)
  folds_transposes = np.zeros(n, dtype=bool)
  matrix_transpose = np.zeros(n, dtype=bool)
  for index, equation in enumerate(equations):
    primitive = equation.primitive
    aliasing[index] = _rules.rule(primitive).aliases_operands
    has_body[index] = bool(_compat.sub_jaxprs(equation.eqn))
    rule = _rules.rule(primitive)
    fusible[index] = _rules.is_fusible_equation(equation.eqn)
    takes_fused[index] = fusible[index] or rule.takes_fused_operands
    takes_expansions[index] = has_body[index] or rule.takes_fused_expansions
    expensive[index] = rule.computed_once
    row[index] = _rules.reduces_rows(equation.eqn)
    folds_transposes[index] = rule.folds_transposed_matrices
    matrix_transpose[index] = _rules.is_matrix_transpose(equation.eqn)

  materialized = np.ones(n_values, dtype=bool)
  written_transposed = []
  for value in range(n_values):
    made_by = producer[value]
    if made_by >= 0 and aliasing[made_by] and value not in forced:
      materialized[value] = False  # the input's buffer, under another name
      continue
    if made_by < 0 or value in forced:
      continue
    reads = uses[value]
    if (folds_transposes[made_by] and reads and reads[-1] < n
        and all(matrix_transpose[r] for r in reads)):
      # A contraction's matrix read only transposed: XLA makes the
      # contraction write the transposed layout (the transposes are the
      # buffers, checked below).
      materialized[value] = False
      written_transposed.append(value)
      continue
    if not (fusible[made_by] or row[made_by]):
      continue
    if not reads:
      materialized[value] = False  # dead: XLA removes it
      continue
    if reads[-1] >= n:
      continue  # a step output
    if row[made_by]:
      if all(fusible[r] for r in reads):
        materialized[value] = False
      continue
    if not all(takes_fused[r] or (takes_expansions[r] and is_expansion(
        program, liveness, value)) or (folds_transposes[r]
        and matrix_transpose[made_by]) for r in reads):
      continue
    # A costly value read by several equations is computed once: into a
    # buffer, unless every reader runs in one kernel (a softmax's `exp`,
    # read by its row sum and by the division by it), which
    # `_place_kernels` decides.
    if len(reads) > 1 and expensive[made_by] and not all(
        fusible[r] or row[r] for r in reads):
      continue
    materialized[value] = False

  def lands_in_buffers(value: int, depth: int = 4) -> bool:
    """Whether `value` is a buffer or reaches buffers through transposes
    alone (XLA folds a transpose of a transpose away)."""
    if materialized[value]:
      return True
    reads = uses[value]
    return bool(depth and reads and reads[-1] < n and all(
        matrix_transpose[r] and lands_in_buffers(equations[r].outputs[0],
                                                 depth - 1) for r in reads))

  for value in written_transposed:
    # Where a transpose is itself fused into other readers, the
    # contraction's result is the buffer they read.
    if not all(lands_in_buffers(equations[r].outputs[0])
               for r in uses[value]):
      materialized[value] = True

  # A value fused into several kernels may be cheaper as a buffer (see
  # `_cheaper_as_buffer`), which depends on the buffers behind it: the
  # first pass finds those with the rest as above, the second looks
  # through what the first made buffers (a residual sum XLA keeps makes
  # LayerNorm's `x - mean` behind it a cheap read again).
  buffers = materialized
  for _ in range(2):
    decided = _place_kernels(program, liveness, materialized.copy(), buffers,
                             aliasing, expensive)
    if (decided[0] == buffers).all():
      break
    buffers = decided[0]
  return Fusion(*decided)


def _place_kernels(program: Program, liveness: Liveness,
                   materialized: np.ndarray, buffers: np.ndarray,
                   aliasing: np.ndarray, computed_once: np.ndarray):
  """Where each equation's work runs and each value is last read, given the
  values fusion leaves as buffers (`materialized`, completed here with the
  fusible values cheaper as buffers, judged with the operands `buffers`
  says are buffers). Returns (materialized, last_read, executes_at,
  made_late)."""
  equations = program.equations
  n = len(equations)
  producer = liveness.producer
  uses = liveness.uses
  last_read = np.full(len(program.avals), -1, dtype=np.int64)
  executes_at = np.arange(n, dtype=np.int64)
  # The kernels each equation's work is done in: its own when it makes a
  # buffer, else those of the equations that read its results fused.
  kernels: list[frozenset] = [frozenset()] * n
  behind: dict[int, tuple[int, ...]] = {}
  first_reads: dict[int, int] = {}  # large values cheaper as buffers

  def last_read_of(value: int) -> int:
    reads = uses[value]
    if not reads:
      return -1
    if reads[-1] >= n:
      return n
    latest = -1
    for r in reads:
      if not aliasing[r]:
        latest = max(latest, int(executes_at[r]))
        continue
      # A barrier's operand is its output at the same place, alive until
      # that output's last read (each its own buffer after the barrier,
      # not all until the last of them is read).
      for operand, out in zip(equations[r].inputs, equations[r].outputs):
        if operand == value:
          latest = max(latest, r, int(last_read[out]))
    return latest

  def buffers_behind(value: int) -> tuple[int, ...]:
    """The buffers that computing `value` inline reads: its operands,
    through the fused values among them (not broadcasts: each reader makes
    them from a few bytes)."""
    if value in behind:
      return behind[value]
    seen: set[int] = set()
    found = []
    pending = [a for a in equations[producer[value]].inputs
               if isinstance(a, int)]
    while pending and len(seen) < _MOST_BUFFERS_FOLLOWED:
      operand = pending.pop()
      if operand in seen:
        continue
      seen.add(operand)
      made_by = producer[operand]
      if made_by < 0 or buffers[operand]:
        found.append(operand)
      elif not is_expansion(program, liveness, operand):
        pending.extend(a for a in equations[made_by].inputs
                       if isinstance(a, int))
    behind[value] = tuple(found)
    return behind[value]


  # Reverse order: an equation's reads are all later, so their execution
  # points and kernels are known when its outputs are decided.
  for index in range(n - 1, -1, -1):
    outputs = equations[index].outputs
    for out in outputs:
      if (materialized[out] or aliasing[index] or not uses[out]
          or uses[out][-1] >= n):
        continue
      readers = frozenset().union(*(kernels[r] for r in uses[out]))
      # The buffers behind it are looked up only where it has a choice.
      if len(readers) > 1 and (computed_once[index] or _cheaper_as_buffer(
          len(readers),
          sum(liveness.nbytes[b] for b in buffers_behind(out)),
          liveness.nbytes[out])):
        materialized[out] = True
        if len(outputs) == 1 and liveness.nbytes[out] >= L2_CACHE_BYTES:
          first_reads[out] = min(int(executes_at[r]) for r in uses[out])
    latest = -1
    any_buffer = False
    for out in outputs:
      last_read[out] = last_read_of(out)
      if materialized[out]:
        any_buffer = True
      else:
        latest = max(latest, int(last_read[out]))
    if not any_buffer and latest >= 0:
      executes_at[index] = latest
    if any_buffer or aliasing[index]:
      kernels[index] = frozenset((index,))
    else:
      readers = frozenset().union(
          *(kernels[r] for out in outputs for r in uses[out] if r < n))
      if len(readers) > _MOST_KERNELS_COUNTED:
        readers = frozenset(sorted(readers)[:_MOST_KERNELS_COUNTED])
      kernels[index] = readers
  for value in program.invars:
    last_read[value] = last_read_of(value)
  # Made by its first reader when the buffers behind it at least as large
  # as it are read there or later anyway (XLA keeps smaller ones, such as
  # BatchNorm's statistics, for it at no cost worth counting).
  made_late: dict[int, tuple[int, tuple[int, ...]]] = {}
  for value, first in first_reads.items():
    large = tuple(b for b in buffers_behind(value)
                  if liveness.nbytes[b] >= liveness.nbytes[value])
    if all(last_read[b] >= first for b in large):
      made_late[value] = (first, large)
  return materialized, last_read, executes_at, made_late


def _swap_in_end(swap_in, executes_at) -> int:
  """Where a swapped-in copy dies: where its last read really runs."""
  n = len(executes_at)
  return max(int(executes_at[r]) if r < n else n for r in swap_in.reads)


def _swapped_out_at(value, offload, liveness, executes_at) -> int:
  """Where the device copy of an offloaded value dies: after the swap-out,
  or later if a read before the swap-out is fused into a later equation."""
  end = offload.swap_out_after
  if offload.swap_out_done_before is not None:
    end = max(end, offload.swap_out_done_before - 1)
  for read in liveness.uses[value]:
    if read > offload.swap_out_after:
      break
    end = max(end, int(executes_at[read]))
  return end


@dataclasses.dataclass(frozen=True)
class MemoryTimeline:
  """Predicted memory of one run of a step, equation by equation.

  Index `i` is "while equation `i` of the flattened step runs"; the last
  index is the step's end. `fixed_bytes` (arguments and outputs) is included
  in every entry of `device_bytes`.
  """
  device_bytes: np.ndarray
  host_bytes: np.ndarray
  fixed_bytes: int
  peak_index: int
  # Reckons `live_at_peak` when it is first asked for: a fit simulates
  # thousands of plans and asks it of none.
  live_at_peak_of: Any = dataclasses.field(repr=False, compare=False)

  @functools.cached_property
  def live_at_peak(self) -> tuple[int, ...]:
    """The temporaries at the peak, largest first."""
    return self.live_at_peak_of()

  @property
  def peak_bytes(self) -> int:
    return int(self.device_bytes[self.peak_index])

  @functools.cached_property
  def host_peak_bytes(self) -> int:
    # Cached: a fit asks it of one timeline for every copy it weighs.
    return int(self.host_bytes.max()) if len(self.host_bytes) else 0


def fixed_bytes(program: Program, liveness: Liveness) -> int:
  """Bytes of the step's arguments and outputs (each counted once per
  buffer: an output that is an argument still gets its own buffer, unless
  it is the output a donated argument's buffer becomes)."""
  total = sum(liveness.nbytes[v] for v in program.invars)
  aliased = aliased_outputs(program, liveness)
  seen = set()
  for position, atom in enumerate(program.outvars):
    if position in aliased:
      continue
    if isinstance(atom, int):
      if atom in seen:
        continue
      seen.add(atom)
      total += liveness.nbytes[atom]
    else:
      total += aval_nbytes(_compat.abstractify(atom.value))  # a constant
  return total


def aliased_outputs(program: Program, liveness: Liveness) -> frozenset[int]:
  """Positions of the outputs that XLA writes into a donated argument's
  device buffer (`jlms._program.donation_pairs`, both on the device, of one
  size per device): they cost no buffer of their own. An output made
  before its donated argument's last read is not among them: XLA keeps it
  in a buffer of its own until it can take the argument's."""
  aliased = []
  for position, out in donation_pairs(program):
    value, argument = program.outvars[out], program.invars[position]
    if not isinstance(value, int):
      continue
    size = liveness.nbytes[argument]
    if not size or liveness.nbytes[value] != size:
      continue
    made_by = liveness.producer[value]
    reads = liveness.uses[argument]
    # (A "read" at the step's end is the argument returned as it is.)
    last_read = max((r for r in reads if r < len(program)), default=-1)
    if made_by < 0 or last_read <= made_by:
      aliased.append(out)
  return frozenset(aliased)


def output_donors(program: Program, liveness: Liveness,
                  fusion: Fusion) -> dict[int, int]:
  """Step outputs whose buffer XLA takes from a loop's result of the same
  size that the kernel making the output reads last (w - lr * g takes the
  buffer of g, stacked by a backward scan): output -> that result. Each
  result gives one output. A loop makes its results at its end, so the
  output's buffer exists from there, not from the step's start; outside
  loops XLA moves updates next to their gradients' making and the buffers
  of outputs overlap the backward pass, which counting outputs for the
  whole step approximates better (a 16-layer MLP: 1136 MiB predicted,
  XLA 1120; counting from the gradient: 880)."""
  materialized = fusion.materialized
  producer = liveness.producer
  nbytes = liveness.nbytes
  outputs = {a for a in program.outvars if isinstance(a, int)}
  # An output in a donated argument's buffer takes no other.
  aliased = {program.outvars[p] for p in aliased_outputs(program, liveness)}
  invars = set(program.invars)
  donors: dict[int, int] = {}
  taken: set[int] = set()
  for value in sorted(outputs):
    made_by = producer[value]
    if (made_by < 0 or not materialized[value] or value in invars
        or value in aliased):
      continue
    kernel = int(fusion.executes_at[made_by])
    pending = [a for a in program.equations[made_by].inputs
               if isinstance(a, int)]
    seen = set()
    while pending:
      read = pending.pop()
      if read in seen:
        continue
      seen.add(read)
      if not materialized[read]:  # computed inside the same kernel
        if producer[read] >= 0:
          pending.extend(a for a in program.equations[producer[read]].inputs
                         if isinstance(a, int))
        continue
      if (producer[read] >= 0 and read not in outputs and read not in taken
          and _compat.sub_jaxprs(program.equations[producer[read]].eqn)
          and nbytes[read] == nbytes[value]
          and int(fusion.last_read[read]) == kernel):
        donors[value] = read
        taken.add(read)
        break
  return donors


def carries_in_place(program: Program, liveness: Liveness,
                     fusion: Fusion) -> dict[int, int]:
  """Loop results that take their initial value's buffer: result -> the
  loop's equation. XLA runs a loop's carry in the buffer of its initial
  value when nothing reads that value after the loop, so the two are one
  buffer, not two at the loop (a split loss's weight-gradient totals
  started from the first chunk's partial sums: Gemma2-2B's 2.2 GiB
  embedding gradient counted twice put the least-memory plan's peak at
  the split, 3.5 GiB over XLA's)."""
  invars = set(program.invars)
  reused: dict[int, int] = {}
  for index, equation in enumerate(program.equations):
    carries = _compat.loop_carries(equation.eqn)
    if not carries:
      continue
    operands = [a for a in equation.inputs if isinstance(a, int)]
    for position, out_position in carries:
      initial = equation.inputs[position]
      result = equation.outputs[out_position]
      if (isinstance(initial, int) and initial not in invars
          and operands.count(initial) == 1
          and fusion.materialized[initial] and fusion.materialized[result]
          and int(fusion.last_read[initial]) == index
          and liveness.nbytes[initial] == liveness.nbytes[result]):
        reused[result] = index
  return reused


@dataclasses.dataclass(frozen=True)
class StepConstants:
  """What `simulate` reckons of a program that no choice of offloads
  changes, for a fit that simulates one program many times."""
  donors: dict  # `output_donors`
  fixed: int  # `fixed_bytes`
  working: np.ndarray  # `body_working_bytes`
  host_buffers: tuple  # `_host_buffers`
  in_place: dict  # `carries_in_place`
  # The liveness's sizes and producers as arrays (made from its tuples,
  # they took a fifth of each simulation of a 9108-equation step).
  nbytes: np.ndarray
  producer: np.ndarray
  # Bytes per equation of the weights XLA holds gathered on every device
  # of a sharded step (`jlms._gathered`); zeros on one device.
  held_whole: np.ndarray | None = None
  # id(offload) -> (offload, its device and host memory events): a fit
  # simulates the same chosen offloads round after round.
  offload_events: dict = dataclasses.field(default_factory=dict)


def step_constants(program: Program, liveness: Liveness,
                   fusion: Fusion, split: int = 1) -> StepConstants:
  """`split`: how many times one device's bytes the program's sizes are
  (`jlms._sharding.unseen_split`), for the weights XLA holds gathered."""
  return StepConstants(output_donors(program, liveness, fusion),
                       fixed_bytes(program, liveness),
                       body_working_bytes(program),
                       _host_buffers(program, liveness),
                       carries_in_place(program, liveness, fusion),
                       np.asarray(liveness.nbytes, dtype=np.int64),
                       np.array(liveness.producer, dtype=np.int64),
                       whole_weight_holds(program, liveness, split))


def _host_buffers(program: Program, liveness: Liveness
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(values, bytes, last index) of the buffers in host memory that
  something reads: each until its last read, or to the step's end where
  a loop's output goes on in it; a loop's output in its input's buffer
  (`_host_buffers_reused`) is not one more."""
  reused = _host_buffers_reused(program, liveness)
  n = len(program)
  continued = set(reused.values())
  values = [value for value, aval in enumerate(program.avals)
            if _compat.is_host_aval(aval) and liveness.uses[value]
            and value not in reused]
  sizes = [aval_nbytes(program.avals[v]) for v in values]
  ends = [n if v in continued else min(liveness.uses[v][-1], n)
          for v in values]
  return (np.asarray(values, dtype=np.int64),
          np.asarray(sizes, dtype=np.int64), np.asarray(ends, dtype=np.int64))


def simulate(program: Program, liveness: Liveness,
             offloads: tuple[Offload, ...] = (),
             fusion: Fusion | None = None,
             operands_fixed: bool = True,
             working: np.ndarray | None = None,
             constants: StepConstants | None = None) -> MemoryTimeline:
  """The predicted device and host memory of `program` run with `offloads`.

  `fusion` may be passed when it was computed with the offloaded values
  forced to buffers (the tuner reuses one for many plans); by default it is
  computed here; so may `working`, the `body_working_bytes` of the
  program, or all of its `constants` with the fusion they were reckoned
  with. With `operands_fixed=False` (a loop body's iteration)
  the inputs exist from the start until their last read and the outputs
  from where they are made, rather than for the whole run.
  """
  n = len(program)
  offload_of = {o.value: o for o in offloads}
  if fusion is None:
    fusion = analyse_fusion(program, liveness, frozenset(offload_of))
  if constants is None:
    nbytes = np.asarray(liveness.nbytes, dtype=np.int64)
    start = np.array(liveness.producer, dtype=np.int64)
  else:
    nbytes, start = constants.nbytes, constants.producer.copy()
  for value, (made_at, buffers) in fusion.made_late.items():
    if value not in offload_of and not any(b in offload_of for b in buffers):
      start[value] = made_at
  in_place = (carries_in_place(program, liveness, fusion)
              if constants is None else constants.in_place)
  for value, loop in in_place.items():
    start[value] = loop + 1  # in its initial value's buffer until then
  stop = fusion.last_read.copy()
  outputs = [a for a in program.outvars if isinstance(a, int)]
  donors: dict[int, int] = {}
  if operands_fixed:
    temporary = fusion.materialized & (start >= 0) & (stop >= 0) & (nbytes > 0)
    temporary[outputs] = False
    # An output made in place of a temporary it consumes (a parameter update
    # from its gradient) takes that buffer: one buffer from the temporary's
    # making to the end, not two.
    donors = (output_donors(program, liveness, fusion) if constants is None
              else constants.donors)
    stop[list(donors.values())] = n
  else:
    start = np.maximum(start, 0)
    temporary = fusion.materialized & (stop >= 0) & (nbytes > 0)
    outputs = []
  stop = np.minimum(stop, n)

  device = np.zeros(n + 2, dtype=np.int64)
  host = np.zeros(n + 2, dtype=np.int64)
  if offload_of:
    temporary[list(offload_of)] = False
  values = np.nonzero(temporary)[0]
  np.add.at(device, start[values], nbytes[values])
  np.add.at(device, stop[values] + 1, -nbytes[values])

  executes_at = fusion.executes_at
  # (Where the operands are fixed: an iteration's simulation moves its
  # values' starts.)
  memo = (constants.offload_events
          if constants is not None and operands_fixed else None)
  is_output = set(outputs)
  device_at, device_by, host_at, host_by = [], [], [], []
  for value, offload in offload_of.items():
    events = None if memo is None else memo.get(id(offload))
    if events is None or events[0] is not offload:
      events = (offload, *_offload_events(
          value, offload, int(start[value]), value in is_output, liveness,
          executes_at))
      if memo is not None:
        memo[id(offload)] = events
    device_at += events[1]
    device_by += events[2]
    host_at += events[3]
    host_by += events[4]
  if device_at:
    np.add.at(device, device_at, device_by)
  if host_at:
    np.add.at(host, host_at, host_by)

  # As arrays, not value by value: a step with its state on host has a
  # thousand of them (the 70B Llama's fits spent 80% of their time here).
  host_values, host_sizes, host_ends = (
      _host_buffers(program, liveness) if constants is None
      else constants.host_buffers)
  np.add.at(host, np.maximum(start[host_values], 0), host_sizes)
  np.add.at(host, host_ends + 1, -host_sizes)

  fixed = 0
  if operands_fixed:
    fixed = (fixed_bytes(program, liveness) if constants is None
             else constants.fixed)
  fixed -= sum(liveness.nbytes[v] for v in donors)
  device_bytes = np.cumsum(device)[: n + 1] + fixed
  if constants is not None:
    working = constants.working
  device_bytes[:n] += (body_working_bytes(program) if working is None
                       else working)
  if constants is not None and constants.held_whole is not None:
    device_bytes += constants.held_whole
  host_bytes = np.cumsum(host)[: n + 1]
  peak_index = int(np.argmax(device_bytes))
  return MemoryTimeline(
      device_bytes, host_bytes, fixed, peak_index,
      functools.partial(_live_at, peak_index, values, start, stop, nbytes,
                        offload_of, executes_at, liveness))


def _offload_events(value, offload, start, is_output, liveness, executes_at):
  """(device indices, their byte changes, host indices, theirs) of one
  offload of `value`, made at `start`: its device buffer until its copy
  out (or its recomputation's chain) is done and again from each swap-in
  to its last read, but for a step output (counted whole already); its
  host copy from the copy out to its last swap-in."""
  size = liveness.nbytes[value]
  device_at, device_by, host_at, host_by = [], [], [], []
  if not size:
    return device_at, device_by, host_at, host_by
  if not is_output:
    device_at += [start, _swapped_out_at(value, offload, liveness,
                                         executes_at) + 1]
    device_by += [size, -size]
    for swap_in in offload.swap_ins:
      device_at += [swap_in.issue_before,
                    _swap_in_end(swap_in, executes_at) + 1]
      device_by += [size, -size]
  if not offload.is_recompute:
    host_at += [offload.swap_out_after,
                offload.swap_ins[-1].issue_before + 1]
    host_by += [size, -size]
  return device_at, device_by, host_at, host_by


def _host_buffers_reused(program: Program, liveness: Liveness
                         ) -> dict[int, int]:
  """Host outputs of loops that reuse the buffer of a host input the loop
  reads for the last time (state updated in place, `jlms._state`): output
  -> input. XLA gives a loop's carry its initial value's buffer when
  nothing reads that value after the loop."""
  reused: dict[int, int] = {}
  for index, equation in enumerate(program.equations):
    if not _rules.rule(equation.primitive).loop:
      continue
    free = [a for a in dict.fromkeys(equation.inputs)
            if isinstance(a, int) and _compat.is_host_aval(program.avals[a])
            and liveness.uses[a][-1] == index]
    for out in equation.outputs:
      aval = program.avals[out]
      if not _compat.is_host_aval(aval):
        continue
      match = next((a for a in free if program.avals[a].shape == aval.shape
                    and program.avals[a].dtype == aval.dtype), None)
      if match is not None:
        free.remove(match)
        reused[out] = match
  return reused


def body_working_bytes(program: Program) -> np.ndarray:
  """Per equation, the device bytes its sub-jaxprs (loop bodies, branches,
  calls) need of their own while it runs: the largest temporaries of any
  of its bodies. 0 for plain equations."""
  working = np.zeros(len(program), dtype=np.int64)
  cache: dict[int, int] = {}
  for index, equation in enumerate(program.equations):
    if _rules.is_fusible_equation(equation.eqn):
      continue
    for body in _compat.sub_jaxprs(equation.eqn):
      key = id(body)
      if key not in cache:
        # A body's constants are inputs that exist before it runs.
        inner = flatten(_compat.closed_jaxpr(
            [], [], list(body.constvars) + list(body.invars), body.outvars,
            body.eqns, body.debug_info))
        inner_liveness = analyse(inner)
        # A body's inputs and results are the equation's own operands and
        # results (or slices of them, updated in place), counted outside:
        # only what it makes and drops while it runs is its own.
        operands = {v for v in inner.invars} | {
            v for v in inner.outvars if isinstance(v, int)}
        own = dataclasses.replace(inner_liveness, nbytes=tuple(
            0 if v in operands else size
            for v, size in enumerate(inner_liveness.nbytes)))
        timeline = simulate(inner, own, operands_fixed=False)
        cache[key] = int(timeline.peak_bytes)
      working[index] = max(working[index], cache[key])
  return working


def _live_at(index, values, start, stop, nbytes, offload_of, executes_at,
             liveness) -> tuple[int, ...]:
  live = values[(start[values] <= index) & (index <= stop[values])].tolist()
  for value, offload in offload_of.items():
    if start[value] <= index <= _swapped_out_at(value, offload, liveness,
                                                 executes_at):
      live.append(value)
      continue
    for swap_in in offload.swap_ins:
      if swap_in.issue_before <= index <= _swap_in_end(swap_in, executes_at):
        live.append(value)
        break
  return tuple(sorted(live, key=lambda v: -int(nbytes[v])))
