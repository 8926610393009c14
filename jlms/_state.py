"""The step's state kept in pinned host memory between steps.

A train step takes its state (parameters, optimizer state) and returns it
updated; donated, each input buffer is reused for its update. Here the
state lives in pinned host memory before and after the step, and the step
brings to the device only what it computes on at the time:

- a stacked leaf that a scan reads one slice per iteration (the layers of
  an `nn.scan`, forward and backward) is read from host one slice per
  iteration, as streamed scan residuals are (`jlms._loops`);
- the optimizer's update of a layer stack whose gradient a scan makes
  runs inside that scan, one layer per iteration as its gradient is made
  (`jlms._update_fusion`), for the stack's state on host and on the
  device alike: no gradient stack is then made;
- any other update of a leaf, a run of pointwise equations on arrays
  of the leaf's shape, runs as a loop over the leaf's leading axis (a
  chunk of rows of a few MiB per iteration, or one slice of a short
  axis): each
  iteration updates its slice of the state, fetched an iteration ahead,
  and copies the updated slice to the host output while the next slices
  come in; the gradient is read slice by slice where it is on the device;
- any other read takes a device copy of the whole leaf just before it;
- an updated leaf not made on host by such a loop is copied there as soon
  as it is made.

Device memory then holds a slice or two of each leaf at a time, not the
state. Pure analyses (`state_pairs`, `host_state`, `state_scan_reads`)
and one rewrite (`keep_state_on_host`) over `jlms._program.Program`.

Guarantees: the rewritten program computes exactly the same values (copies
are exact, and a pointwise equation computes on a slice what it computes
on that slice of the whole); its state inputs and outputs, and nothing
else, change memory space; each `StateCopy` says where the program moves
how many bytes of state each way, for the time model.
"""

from __future__ import annotations

import dataclasses
import os
import types
from typing import Sequence

import jax
import numpy as np

from jlms import _compat, _rules
from jlms._cost import GpuTarget, kernel_seconds
from jlms._liveness import Liveness, aval_nbytes, analyse
from jlms._loops import (ScanResidual, host_aval, offload_scan_residuals,
                         prefetching_reader, reads_only_as_scanned)
from jlms._names import profile_scope
from jlms._program import Equation, Program, donation_pairs
from jlms._state_pins import pin_copies
from jlms._update_fusion import CannotFuse, fusable_run, fused_update_loop
from jlms._update_loops import (CannotLoop, reads_on_device, update_loop,
                                update_runs)


def disabled_passes(xla_flags: str, *ours: str) -> str:
  """The `xla_disable_hlo_passes` compile option that disables `ours` and
  the passes that `xla_flags` (the `XLA_FLAGS` setting) disables: a
  compile option of that name replaces the flag's list, so that a pass a
  user turned off would otherwise run again under jlms. `XLA_FLAGS` is
  read when jlms is imported, as XLA reads it when its backend starts."""
  passes = list(ours)
  for flag in xla_flags.split():
    name, _, value = flag.partition("=")
    if name.lstrip("-") == "xla_disable_hlo_passes":
      passes += [p for p in value.split(",") if p]
  return ",".join(dict.fromkeys(passes))


# Compiler options for a program jlms fitted to a budget: XLA's own
# rematerialization pass off. The plan fits its budget itself, and XLA
# confirms its peak under these options; left on, the pass re-runs work to
# meet a limit of its own that is well under the device's memory:
# - with the state on host it takes every argument and output of the
#   program to be on the device, state on host included (its memory limit
#   is 80% of the device's less their bytes), so its limit falls below zero
#   and it re-runs matmuls to save what the plan has already saved: on the
#   6.58B-parameter GPT of `benchmarks.state_on_host`, 260 ms of compute by
#   the schedule model for 0.1 GiB of device memory;
# - with the state on the device, its limit for Gemma2-2B's step (bfloat16,
#   16 x 2048) is 60.85 GiB of the H100's 79.11: a plan fitted for 79.11
#   GiB, 76.5 GiB by XLA after that pass, took 1117 ms by the schedule
#   model, where a plan fitted under the pass's limit, 58.8 GiB, took 1038.
FITTED_COMPILER_OPTIONS = types.MappingProxyType(
    {"xla_disable_hlo_passes": disabled_passes(
        os.environ.get("XLA_FLAGS", ""), "rematerialization")})


@dataclasses.dataclass(frozen=True)
class HostState:
  """Which of a program's inputs and outputs are state on host."""
  inputs: tuple[int, ...]  # positions among the program's inputs
  outputs: tuple[int, ...]  # positions among its outputs, pairwise
  # The rest of the donated state, (input, output) positions: it stays on
  # the device, and an update loop that makes it updates it in place.
  on_device: tuple[tuple[int, int], ...] = ()

  def __bool__(self) -> bool:
    return bool(self.inputs)


@dataclasses.dataclass(frozen=True)
class StateCopy:
  """State bytes moved where equation `index` of the rewritten program
  runs (a whole-leaf copy, or a loop that streams slices)."""
  index: int
  to_device: int
  to_host: int
  # State leaves whose optimizer update runs inside the loop at `index`
  # (`jlms._update_fusion`), on host or on the device.
  updated_in_loop: int = 0
  # The bytes of one direction that the copies take the time of, where
  # the two directions run side by side in part (an update loop's, see
  # `jlms._update_loops._serial_bytes`); None: one after the other.
  serial_bytes: int | None = None
  # Of `to_device` and `to_host`, the bytes copied beside the kernels of
  # the loop at `index` (the fused update loop's, `jlms._update_fusion`);
  # the rest is waited for after them.
  to_device_beside: int = 0
  to_host_beside: int = 0
  # Of the bytes not beside, each way: the slices fetched before the
  # loop's first iteration and written back after its last (outside its
  # body, where a latency profile lets XLA hide them under the kernels
  # before and after the loop, `GpuTarget.copies_profiled`).
  edge_bytes: int = 0
  # A whole copy pinned beside the backward pass (`jlms._state_pins`):
  # issued at `index`, and waited for before equation `wait_before` (its
  # first read, or the barrier that binds a write-back; None: the step's
  # end), `GpuTarget.pinned_copies_hide`.
  pinned: bool = False
  wait_before: int | None = None


#: How many pointwise equations back from an output `state_pairs` looks
#: for the input it updates: an optimizer's update of a leaf is a few tens
#: (optax's AdamW with a schedule: under 20 from a moment to its output).
_UPDATE_DEPTH = 64


def state_pairs(program: Program, donated: Sequence[int]
                ) -> tuple[tuple[int, int], ...]:
  """(input position, output position) of each donated input that the
  step returns updated, in input order: each output with the donated input
  of its shape and dtype that it is made from by the fewest pointwise
  equations (an optimizer's update), nearest pairs first, then a leaf
  returned as it is (by no equation), the rest as XLA's aliasing pairs them
  (`jlms._program.donation_pairs`). A step that returns its state in
  another order than it takes it (`return opt_state, params` for
  `(params, opt_state)`) so keeps each leaf with its own update, where
  aliasing pairs a parameter with the moment of its shape; `host_state`
  then moves such leaves to host with those whose buffers they take.
  Where the two pairings do not cover the same inputs and outputs (more
  donated inputs of a kind than outputs), aliasing's pairs stand: an
  input and the output that takes its buffer must be in one memory."""
  donated = tuple(donated)
  aliased = donation_pairs(dataclasses.replace(program, donated=donated))
  if not aliased:
    return ()
  updated = _nearest_updates(program, donated)
  pairs = []
  for component in _components(updated, aliased):
    ours = [pair for pair in updated if pair[0] in component.inputs]
    theirs = [pair for pair in aliased if pair[0] in component.inputs]
    covers = ({i for i, _ in ours} == {i for i, _ in theirs}
              and {o for _, o in ours} == {o for _, o in theirs})
    pairs += ours if covers else theirs
  return tuple(sorted(pairs))


@dataclasses.dataclass(frozen=True)
class _Component:
  inputs: frozenset
  outputs: frozenset


def _components(*pairings) -> list[_Component]:
  """The inputs and outputs that `pairings` ((input, output) pairs each)
  connect, one `_Component` per connected set."""
  parent: dict = {}

  def root(node):
    while parent.setdefault(node, node) != node:
      parent[node] = parent[parent[node]]
      node = parent[node]
    return node

  for pairing in pairings:
    for i, o in pairing:
      parent[root(("in", i))] = root(("out", o))
  members: dict = {}
  for node in list(parent):
    members.setdefault(root(node), []).append(node)
  return [_Component(frozenset(n for side, n in nodes if side == "in"),
                     frozenset(n for side, n in nodes if side == "out"))
          for nodes in members.values()]


def _nearest_updates(program: Program, donated: Sequence[int]
                     ) -> list[tuple[int, int]]:
  """Each output paired with the donated input nearest by pointwise
  equations (`_updated_from`), the nearest first; the inputs and outputs
  left, by aliasing's order."""
  pairs, taken_in, taken_out = [], set(), set()
  # An input returned as it is pairs last: a step that also returns a
  # leaf's old value (for a metric) returns the leaf's update too.
  nearest = sorted(_updated_from(program, donated),
                   key=lambda found: (found[0] == 0, *found))
  for _, out_position, position in nearest:
    if position not in taken_in and out_position not in taken_out:
      pairs.append((position, out_position))
      taken_in.add(position)
      taken_out.add(out_position)
  rest = dataclasses.replace(
      program, donated=tuple(p for p in donated if p not in taken_in),
      outvars=tuple(None if o in taken_out else atom
                    for o, atom in enumerate(program.outvars)))
  return pairs + list(donation_pairs(rest))


def _updated_from(program: Program, donated: Sequence[int]
                  ) -> list[tuple[int, int, int]]:
  """(equations between, output position, input position) for each
  output and each donated input of its shape and dtype that it is made
  from through pointwise equations alone, at most `_UPDATE_DEPTH` of
  them."""
  position_of = {program.invars[p]: p for p in donated
                 if _compat.has_plain_layout(
                     program.avals[program.invars[p]])}
  producer = {out: equation for equation in program.equations
              for out in equation.outputs}
  found = []
  for out_position, atom in enumerate(program.outvars):
    if not isinstance(atom, int):
      continue
    kind = _kind(program, atom)
    # Breadth first, so that each input is met at its fewest equations;
    # only through values of the output's shape, as an update's are.
    seen, frontier = {atom}, [atom]
    for depth in range(_UPDATE_DEPTH + 1):
      after = []
      for value in frontier:
        if value in position_of and _kind(program, value) == kind:
          found.append((depth, out_position, position_of[value]))
        equation = producer.get(value)
        if equation is None or not _rules.rule(equation.primitive).pointwise:
          continue
        for source in equation.inputs:
          if (isinstance(source, int) and source not in seen
              and getattr(program.avals[source], "shape", None) == kind[0]):
            seen.add(source)
            after.append(source)
      frontier = after
      if not frontier:
        break
  return found


def _kind(program: Program, value: int) -> tuple:
  aval = program.avals[value]
  return aval.shape, aval.dtype


def update_only(program: Program, liveness: Liveness, position: int) -> bool:
  """Whether input `position` is read by nothing but top-level pointwise
  equations (an optimizer's moments, read only by its update)."""
  value = program.invars[position]
  return all(r < len(program) and _rules.rule(
      program.equations[r].primitive).pointwise for r in liveness.uses[value])


def host_state(program: Program, liveness: Liveness,
               pairs: Sequence[tuple[int, int]], *, min_bytes: int = 0,
               only_update_read: bool = False) -> HostState:
  """The state of `pairs` (`state_pairs`) worth keeping on host: leaves of
  at least `min_bytes` (and with `only_update_read`, only those read by
  the update alone, the optimizer's moments, which cost one crossing each
  way), with each leaf whose buffer aliasing gives to one of theirs."""
  picked = {i for i, o in pairs
            if aval_nbytes(program.avals[program.invars[i]])
            >= max(min_bytes, 1)
            and (not only_update_read or update_only(program, liveness, i))}
  # An input goes to host with the output that takes its buffer
  # (`state_pairs`): XLA aliases only within one memory.
  aliased = donation_pairs(dataclasses.replace(
      program, donated=tuple(i for i, _ in pairs)))
  for component in _components(pairs, aliased):
    if component.inputs & picked:
      picked |= component.inputs
  chosen = [(i, o) for i, o in pairs if i in picked]
  rest = tuple(pair for pair in pairs if pair not in chosen)
  return HostState(tuple(i for i, _ in chosen), tuple(o for _, o in chosen),
                   rest)


def state_scan_reads(program: Program, liveness: Liveness, state: HostState,
                     names: dict[int, str] | None = None
                     ) -> tuple[ScanResidual, ...]:
  """The state stacks that scans read as their scanned input, as residuals
  already on host: `offload_scan_residuals` then makes those scans read
  them slice by slice. Scans of one iteration are left out (they take a
  whole copy, see `_MAX_LOOP_LENGTH`)."""
  reads = []
  for position in state.inputs:
    value = program.invars[position]
    readers = tuple(
        r for r in liveness.uses[value] if r < len(program)
        and reads_only_as_scanned(program.equations[r], value)
        and _compat.scan_layout(program.equations[r].eqn).length >= 2)
    if readers:
      label = (names or {}).get(value, f"state {position}")
      reads.append(ScanResidual(value, None, readers, label))
  return tuple(reads)


def keep_state_on_host(program: Program, state: HostState,
                       residuals: Sequence[ScanResidual] = (),
                       names: dict[int, str] | None = None,
                       leading_splits: Sequence = (),
                       target: GpuTarget | None = None
                       ) -> tuple[Program, tuple[StateCopy, ...],
                                  tuple[ScanResidual, ...]]:
  """`program` with its `state` on host (see the module docstring), and
  its scan `residuals` streamed through host as `offload_scan_residuals`
  streams them. `leading_splits` (per input position) says how each
  argument's leading axis is cut over devices
  (`jlms._sharding.leading_split`); an update loop takes its rows within
  each shard (`jlms._update_loops`). With a `target`, an update that no
  loop fuses copies its state on host whole, pinned beside the kernels
  around it by `jlms._state_pins` (by `target`'s kernel model), instead of
  running as a loop of its own. Returns
  the program, the `StateCopy`s, and the streamed residuals and state
  reads, indexed in the returned program."""
  liveness = analyse(program)
  reads = state_scan_reads(program, liveness, state, names)
  streamed = tuple(residuals) + reads
  program = offload_scan_residuals(program, streamed)
  avals = list(program.avals)
  for position in state.inputs:
    value = program.invars[position]
    avals[value] = _compat.memory_space_aval(avals[value],
                                             jax.memory.Space.Host)
  program = dataclasses.replace(program, avals=tuple(avals))
  program, call_reads = _calls_reading_from_host(program, state, names or {})
  streamed += call_reads
  kernel_s = None if target is None else kernel_seconds(program, target)
  program, copies, index_of = _stream_state(
      program, state, names or {}, leading_splits, kernel_s,
      None if target is None else target.link_bytes_per_s)
  streamed = tuple(dataclasses.replace(
      r, producer=None if r.producer is None else index_of[r.producer],
      readers=tuple(index_of[i] for i in r.readers)) for r in streamed)
  return program, copies, streamed


def _calls_reading_from_host(program: Program, state: HostState,
                             names: dict[int, str]
                             ) -> tuple[Program, tuple[ScanResidual, ...]]:
  """`program` whose calls of loops (the scans that `jlms._loop_remat`
  traces inside a nested jit) read the state they scan from host, one
  slice per iteration; and those reads, as residuals already on host."""
  on_host = {program.invars[p] for p in state.inputs}
  equations = list(program.equations)
  reads: dict[int, list[int]] = {}
  for index, equation in enumerate(equations):
    if not _compat.is_jit_primitive(equation.primitive):
      continue
    positions = {p for p, a in enumerate(equation.inputs)
                 if isinstance(a, int) and a in on_host
                 and not _compat.is_host_aval(equation.eqn.invars[p].aval)}
    if not positions:
      continue
    labels = {p: names.get(equation.inputs[p], "state") for p in positions}
    rewritten = _reading_from_host(equation.eqn, positions, labels)
    if rewritten is None:
      continue  # read whole, from a device copy (`_stream_state`)
    equations[index] = dataclasses.replace(equation, eqn=rewritten)
    for p in positions:
      reads.setdefault(equation.inputs[p], []).append(index)
  found = tuple(ScanResidual(v, None, tuple(r), names.get(v, "state"))
                for v, r in reads.items())
  return dataclasses.replace(program, equations=tuple(equations)), found


def _reading_from_host(eqn, positions: set[int], labels: dict[int, str]):
  """`eqn` taking its inputs at `positions` from host: a scan that scans
  them reads them one slice per iteration, fetched an iteration ahead; a
  nested jit passes them on to the scans of its body that do. None where
  something else reads them (they then come to the device whole)."""
  if eqn.primitive is _compat.scan_p:
    layout = _compat.scan_layout(eqn)
    first = layout.num_consts + layout.num_carry
    if layout.length < 2 or min(positions) < first:
      return None
    ordered = sorted(positions)
    return prefetching_reader(eqn, ordered, [
        profile_scope("swap_in", labels[p]) for p in ordered])
  if not _compat.is_jit_primitive(eqn.primitive):
    return None
  body = _compat.call_body_closed(eqn)
  jaxpr = body.jaxpr
  host_vars = {jaxpr.invars[p]: _compat.new_var(host_aval(jaxpr.invars[p].aval))
               for p in positions}
  if any(v in host_vars for v in jaxpr.outvars):
    return None
  label_of = {jaxpr.invars[p]: labels[p] for p in positions}
  inner_eqns = []
  for inner in jaxpr.eqns:
    inner_positions = {p for p, v in enumerate(inner.invars)
                       if not isinstance(v, _compat.Literal)
                       and v in host_vars}
    if not inner_positions:
      inner_eqns.append(inner)
      continue
    rewritten = _reading_from_host(inner, inner_positions, {
        p: label_of[inner.invars[p]] for p in inner_positions})
    if rewritten is None:
      return None
    invars = list(rewritten.invars)
    for p in inner_positions:
      invars[p] = host_vars[inner.invars[p]]
    inner_eqns.append(rewritten.replace(invars=invars))
  new_body = _compat.closed_jaxpr(
      jaxpr.constvars, body.consts,
      [host_vars.get(v, v) for v in jaxpr.invars], jaxpr.outvars, inner_eqns,
      jaxpr.debug_info)
  invars = list(eqn.invars)
  for p in positions:
    invars[p] = _compat.new_var(host_aval(invars[p].aval))
  return _compat.with_call_body(eqn, new_body, _compat.call_name(eqn),
                                invars=invars)


def _stream_state(program: Program, state: HostState, names: dict[int, str],
                  leading_splits: Sequence = (),
                  kernel_s: np.ndarray | None = None,
                  link_bytes_per_s: float | None = None
                  ) -> tuple[Program, tuple[StateCopy, ...], list[int]]:
  """The update loops, whole copies and output copies of
  `keep_state_on_host`, on a program whose state inputs are host values;
  with the copies and each old equation's new index. With `kernel_s` (the
  seconds of each equation's kernel), the updates that no loop fuses copy
  their state whole, pinned (`jlms._state_pins`)."""
  liveness = analyse(program)
  n = len(program)
  avals = list(program.avals)
  on_host = {program.invars[p] for p in state.inputs}
  host_outputs = set(state.outputs)
  output_readers = {}  # value -> output positions it is read at
  for position, atom in enumerate(program.outvars):
    if isinstance(atom, int):
      output_readers.setdefault(atom, []).append(position)

  def new_id(aval) -> int:
    avals.append(aval)
    return len(avals) - 1

  def label(value: int) -> str:
    if value in names:
      return names[value]
    maker = liveness.producer[value]
    if maker >= 0:
      return program.equations[maker].readable_name()
    return f"state {program.invars.index(value)}"

  split_of = {program.invars[p]: split
              for p, split in enumerate(leading_splits) if split is not None}
  updated = {program.invars[i]: program.outvars[o]
             for i, o in (*zip(state.inputs, state.outputs),
                          *state.on_device)
             if isinstance(program.outvars[o], int)}
  runs = update_runs(program, liveness, on_host)
  removed: set[int] = set()
  # Updates run inside the loop that makes their gradients where they can
  # (`jlms._update_fusion`): index of that loop -> its replacement.
  fused_at = {}
  by_loop: dict[int, list[list[int]]] = {}
  taken: set[int] = set()
  origin = {}  # an extended run -> the run it extends
  # The update of state kept on the device is fused too where it can be:
  # its gradient stack is then not made (on the 6.58B GPT, 8 GiB a leaf).
  device_state = {program.invars[i] for i, _ in state.on_device}
  in_runs = {i for run in runs for i in run}
  device_runs = [run for run in update_runs(program, liveness, device_state)
                 if not in_runs & set(run)]
  for run in runs + device_runs:
    loop, extended = fusable_run(program, liveness, run)
    if loop is not None and not taken & set(extended):
      taken.update(extended)
      by_loop.setdefault(loop, []).append(extended)
      origin[tuple(extended)] = tuple(run)
  for loop, group in by_loop.items():
    try:
      fused = fused_update_loop(program, liveness, loop, group, on_host,
                                updated, label)
    except CannotFuse:
      continue
    fused_at[loop] = fused
    removed.update(i for run in fused.runs for i in run)
    for value in fused.host_outputs:
      avals[value] = _compat.memory_space_aval(avals[value],
                                               jax.memory.Space.Host)
  fused_runs = {origin[run] for fused in fused_at.values()
                for run in fused.runs}
  runs = [run for run in runs if tuple(run) not in fused_runs]
  pinned: set[int] = set()  # equations of runs whose copies are pinned
  if kernel_s is not None:
    pinned.update(i for run in runs for i in run)
    runs = []
  # index of a run's last equation -> its loop's equations
  loop_at: dict[int, tuple[Equation, ...]] = {}
  loop_copies: dict[int, tuple[int, int, int]] = {}
  outvars = list(program.outvars)
  for run in runs:
    try:
      loop, to_device, to_host, host_outs, serial = update_loop(
          program, liveness, run, on_host, host_outputs, output_readers,
          updated, label, new_id, split_of)
    except CannotLoop:
      continue
    loop_at[run[-1]] = loop
    removed.update(run)
    loop_copies[run[-1]] = (to_device, to_host, serial)
    for value in host_outs:
      avals[value] = _compat.memory_space_aval(avals[value],
                                               jax.memory.Space.Host)

  # Whole copies for the reads the loops and scans do not serve.
  copy_before: dict[int, list[Equation]] = {}
  renamed: dict[int, dict[int, int]] = {}  # index -> {host id: device id}
  pinned_fetches = []  # (host value, its readers on the device)
  for value in sorted(on_host):
    readers = [r for r in liveness.uses[value] if r < n and r not in removed
               and reads_on_device(program.equations[r], value)]
    if not readers:
      continue
    if pinned and all(r in pinned for r in readers):
      pinned_fetches.append((value, tuple(readers)))
      continue
    first = readers[0]
    on_device = new_id(_compat.memory_space_aval(avals[value],
                                                 jax.memory.Space.Device))
    anchor = program.equations[first]
    eqn = _compat.device_put_equation(
        _compat.new_var(avals[value]), _compat.new_var(avals[on_device]),
        False, anchor.eqn, profile_scope("swap_in", label(value)))
    copy_before.setdefault(first, []).append(
        Equation(eqn, (value,), (on_device,), anchor.name_stack))
    for r in readers:
      renamed.setdefault(r, {})[value] = on_device

  # Updated state made on the device goes to host as soon as it is made.
  copy_after: dict[int, list[Equation]] = {}
  pinned_writes = []  # (output position, updated device value)
  for position in state.outputs:
    atom = outvars[position]
    if not isinstance(atom, int) or _compat.is_host_aval(avals[atom]):
      continue
    maker = liveness.producer[atom]
    if maker in pinned:
      pinned_writes.append((position, atom))
      continue
    on_host_id = new_id(_compat.memory_space_aval(avals[atom],
                                                  jax.memory.Space.Host))
    anchor = program.equations[maker] if maker >= 0 else (
        program.equations[0] if program.equations else None)
    if anchor is None:
      continue
    eqn = _compat.device_put_equation(
        _compat.new_var(avals[atom]), _compat.new_var(avals[on_host_id]),
        True, anchor.eqn, profile_scope("swap_out", label(atom)))
    copy = Equation(eqn, (atom,), (on_host_id,), anchor.name_stack)
    if maker >= 0:
      # After the run's loop if the maker was folded into one.
      at = next((end for end, loop in loop_at.items()
                 if any(atom in e.outputs for e in loop)), maker)
      copy_after.setdefault(at, []).append(copy)
    else:
      copy_before.setdefault(0, []).append(copy)
    outvars[position] = on_host_id
  pinned_after: dict = {}
  if pinned_fetches or pinned_writes:
    pins = pin_copies(program, liveness, avals, new_id, kernel_s,
                      link_bytes_per_s, pinned_fetches, pinned_writes, label,
                      removed)
    pinned_after = pins.after
    for index, names in pins.renamed.items():
      renamed.setdefault(index, {}).update(names)
    for position, value in pins.outputs.items():
      outvars[position] = value

  equations: list[Equation] = []
  index_of = [-1] * (n + 1)
  copies: list[StateCopy] = []

  waits = []  # (copies' index, what the copy is waited for before)

  def emit_pinned(index: int) -> None:
    for copy, to_device, to_host, until in pinned_after.get(index, ()):
      if to_device or to_host:
        waits.append((len(copies), until))
        copies.append(StateCopy(len(equations), to_device, to_host,
                                pinned=True))
      equations.append(copy)

  emit_pinned(-1)  # fetched at the step's start
  for index, equation in enumerate(program.equations):
    for copy in copy_before.get(index, ()):
      copies.append(StateCopy(len(equations),
                              aval_nbytes(avals[copy.outputs[0]]), 0))
      equations.append(copy)
    if index in loop_at:
      loop = loop_at[index]
      at = next(k for k, e in enumerate(loop)
                if e.eqn.primitive is _compat.scan_p)
      equations.extend(loop[:at])
      to_device, to_host, serial = loop_copies[index]
      copies.append(StateCopy(len(equations), to_device, to_host,
                              serial_bytes=serial))
      index_of[index] = len(equations)
      equations.extend(loop[at:])
    elif index not in removed:
      index_of[index] = len(equations)
      if index in fused_at:
        fused = fused_at[index]
        equation = fused.equation
        copies.append(StateCopy(len(equations), fused.to_device,
                                fused.to_host, fused.leaves,
                                to_device_beside=fused.to_device_beside,
                                to_host_beside=fused.to_host_beside,
                                edge_bytes=fused.edge_bytes))
      swap = renamed.get(index)
      if swap:
        equation = dataclasses.replace(equation, inputs=tuple(
            swap.get(a, a) if isinstance(a, int) else a
            for a in equation.inputs))
      equations.append(equation)
    for copy in copy_after.get(index, ()):
      copies.append(StateCopy(len(equations), 0,
                              aval_nbytes(avals[copy.inputs[0]])))
      equations.append(copy)
    emit_pinned(index)
  for copy in copy_before.get(n, ()):
    equations.append(copy)

  index_of[n] = len(equations)
  at = {id(e): k for k, e in enumerate(equations)}
  for number, until in waits:
    wait = (None if until is None else index_of[until]
            if isinstance(until, int) else at[id(until)])
    copies[number] = dataclasses.replace(copies[number], wait_before=wait)
  # A removed equation's index stands for its run's loop.
  for run in runs:
    for index in run:
      index_of[index] = index_of[run[-1]]
  for loop, fused in fused_at.items():
    for run in fused.runs:
      for index in run:
        index_of[index] = index_of[loop]
  rewritten = dataclasses.replace(program, outvars=tuple(outvars),
                                  equations=tuple(equations),
                                  avals=tuple(avals))
  return rewritten, tuple(copies), index_of
