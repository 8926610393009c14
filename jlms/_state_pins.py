"""When whole copies of state on host start and must end, so that XLA runs
them beside the backward pass's kernels.

A step whose layers are a Python loop makes each layer's gradients in turn,
and `jlms._update_order` runs each update right after its gradient. Its
state on host then crosses the link twice, once each way, somewhere in the
backward pass. Left to itself, XLA's GPU scheduler puts each update as late
as it may, and starts each copy a few kernels before its wait: a synthetic
stack of 8 MLP layers of width 4096 (32768 tokens, the two AdamW moments of
each of its 16 weights on host, 7 GiB), H100 deviceless, schedule model:
389.6 ms for 210.9 ms of compute, copies exposed 178.7 ms for a link floor
of 136.7. Pinned by barriers, the update before the backward pass goes on,
each fetch no earlier than a point before its read and each write-back
done before a point after its update, the same program took 282.8 ms.

XLA orders the kernels between barriers by its own schedule, not the
jaxpr's: a list scheduler from the step's end, which runs each kernel as
late as what reads it allows. Only the step's critical chain (the
backward pass's cotangents) runs where it must, so each copy's point is
a value that the chain makes at that time (`chain_times`, by jlms's
kernel model); a weight's gradient and its update are timed as soon as
they can run, and tied there. Each engine carries its copies one after
another, the fetches in the order they are read (each as late as its
engine allows) and the write-backs in the order they are made (each as
early as it allows); each lead is `LEAD_MARGIN` times the link time it
covers, for the kernels that XLA's order puts elsewhere.

`pin_copies` adds the barriers and copies to a program; the times are pure
functions. Guarantees: every fetch is issued no later than its first read
and every write-back is made from the updated value; each barrier's
outputs are its inputs, so the program computes what it computed; a
barrier is placed after the makers of all it reads and before every read
of what it passes on.
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Callable, Sequence

import jax
import numpy as np

from jlms import _compat
from jlms._liveness import Liveness, aval_nbytes
from jlms._names import profile_scope
from jlms._program import Equation, Program

#: The share of the step by which an equation may start later than it can
#: and still count as on the critical chain (`chain_times`).
_CHAIN_SLACK = 0.01
#: How many times its link time of kernels a pinned copy is given, by
#: jlms's kernel model.
LEAD_MARGIN = 2.0


def chain_times(program: Program, liveness: Liveness, kernel_s: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray]:
  """When each equation starts, as soon as what it reads is made, with
  every kernel run back to back (kernel seconds from the step's start);
  and whether it is on the step's critical chain (it could start at most
  `_CHAIN_SLACK` of the step later without making the step longer). Only
  there does XLA's order agree with these times: a scheduler that runs
  each kernel as late as its readers allow moves the rest."""
  n = len(program)
  starts = np.zeros(n)
  for index, equation in enumerate(program.equations):
    made = [starts[p] + kernel_s[p] for a in equation.inputs
            if isinstance(a, int) and (p := liveness.producer[a]) >= 0]
    starts[index] = max(made, default=0.0)
  tail = np.zeros(n)  # the longest chain of kernels from each equation on
  for index in range(n - 1, -1, -1):
    after = 0.0
    for out in program.equations[index].outputs:
      for reader in liveness.uses[out]:
        if reader < n and tail[reader] > after:
          after = tail[reader]
    tail[index] = kernel_s[index] + after
  total = float(tail.max()) if n else 0.0
  latest = total - tail
  return starts, latest - starts <= _CHAIN_SLACK * total


def fetch_times(deadlines: Sequence[float], seconds: Sequence[float]
                ) -> list[float]:
  """For copies to the device, copy i needed at time `deadlines[i]` and
  `seconds[i]` long on one engine: the time each is issued at."""
  order = sorted(range(len(deadlines)), key=lambda i: deadlines[i])
  issued = [0.0] * len(deadlines)
  # As late as the engine allows, the last needed first: each copy ends
  # by its read and before the next one on the engine starts.
  engine_free_until = np.inf
  for i in reversed(order):
    end = min(deadlines[i], engine_free_until)
    begin = end - seconds[i]
    engine_free_until = begin
    issued[i] = deadlines[i] - LEAD_MARGIN * (deadlines[i] - begin)
  return issued


def write_times(made: Sequence[float], seconds: Sequence[float]
                ) -> list[float]:
  """For copies to host, copy i made at time `made[i]` and `seconds[i]`
  long on one engine: the time by which each must be done."""
  order = sorted(range(len(made)), key=lambda i: made[i])
  done = [0.0] * len(made)
  engine_free_at = -np.inf
  for i in order:
    begin = max(made[i], engine_free_at)
    engine_free_at = begin + seconds[i]
    done[i] = made[i] + LEAD_MARGIN * (engine_free_at - made[i])
  return done


@dataclasses.dataclass
class Pins:
  """What `pin_copies` adds: equations after each index of the program
  (each with the state bytes it copies to the device and to host, and
  what a copy is waited for before: the index of its first reader, the
  barrier that binds it, or None for the step's end), reads renamed per
  equation index, and the step's outputs replaced."""
  after: dict = dataclasses.field(default_factory=dict)
  renamed: dict = dataclasses.field(default_factory=dict)
  outputs: dict = dataclasses.field(default_factory=dict)


def pin_copies(program: Program, liveness: Liveness, avals: list,
               new_id: Callable, kernel_s: np.ndarray,
               link_bytes_per_s: float, fetches: Sequence[tuple[int, tuple]],
               writes: Sequence[tuple[int, int]], label: Callable,
               skipped: set[int]) -> Pins:
  """Whole copies of state on host, pinned (see the module docstring):
  `fetches` are (host value, the indices of the equations that read it
  on the device), each read from a device copy issued at its point;
  `writes` are (output position, updated device value), each copied to
  host after its update and done by its point. `avals` and `new_id` make the new values; equations in
  `skipped` (replaced by the caller) are not renamed."""
  n = len(program)
  starts, on_chain = chain_times(program, liveness, kernel_s)
  ends = starts + kernel_s
  # Points on the critical chain alone: elsewhere XLA's order is its own.
  by_end = sorted(np.flatnonzero(on_chain).tolist(), key=lambda i: ends[i])
  end_times = [ends[i] for i in by_end]
  tied_values: set[int] = set()
  pins = Pins()

  def place(index: int, equation: Equation, to_device=0, to_host=0,
            until=None):
    pins.after.setdefault(index, []).append(
        [equation, to_device, to_host, until])

  def tie(carried: Sequence[int], candidates, not_before: int,
          scope: str, anchor: Equation):
    """A barrier of `carried` with the first device value made by one of
    `candidates` (equation indices) that some equation after both reads;
    those reads go through it. (the carried values passed on, the index
    it is placed after), or None."""
    for k in candidates:
      placed = max(k, not_before)
      for made in program.equations[k].outputs:
        later = [r for r in liveness.uses[made]
                 if placed < r < n and r not in skipped]
        # One barrier a value: a second would take the first's later
        # reads, and XLA drops an operand whose result nobody reads.
        if (not later or made in tied_values
            or _compat.is_host_aval(avals[made])
            or not _compat.passes_a_barrier(avals[made])):
          continue
        tied_values.add(made)
        inputs = (*carried, made)
        outputs = tuple(new_id(avals[v]) for v in inputs)
        eqn = _compat.barrier_equation(
            [_compat.new_var(avals[v]) for v in inputs],
            [_compat.new_var(avals[v]) for v in outputs], anchor.eqn, scope)
        place(placed, Equation(eqn, inputs, outputs, anchor.name_stack))
        for r in later:
          pins.renamed.setdefault(r, {})[made] = outputs[-1]
        return outputs[:-1], placed
    return None

  def ending_by(time: float, before: int):
    """Equations ending at or before `time`, the latest first, each
    before index `before`."""
    k = bisect.bisect_right(end_times, time)
    return (i for i in reversed(by_end[:k]) if i < before)

  def ending_after(time: float, after: int):
    """Equations ending at or after `time`, the earliest first, each
    after index `after`."""
    k = bisect.bisect_left(end_times, time)
    return (i for i in by_end[k:] if i > after)

  def seconds(value: int) -> float:
    return aval_nbytes(avals[value]) / link_bytes_per_s

  def needed_at(readers) -> float:
    """When what reads a fetched value first meets what the step makes:
    a moment's decay (`0.9 * m`) could run at the start, but its update
    runs where its gradient is made."""
    times, seen, pending = [], set(), list(readers)
    while pending:
      r = pending.pop()
      if r in seen or r >= n:
        continue
      seen.add(r)
      if starts[r] > 0:  # it waits for a kernel
        times.append(starts[r])
        continue
      pending.extend(u for out in program.equations[r].outputs
                     for u in liveness.uses[out])
    return min(times, default=min(starts[r] for r in readers))

  issued = fetch_times([needed_at(readers) for _, readers in fetches],
                       [seconds(v) for v, _ in fetches])
  for (value, readers), time in zip(fetches, issued):
    first = min(readers)
    anchor = program.equations[first]
    scope = profile_scope("swap_in", label(value))
    tied = tie((value,), ending_by(time, first), -1, scope, anchor)
    source, at = ((value,), -1) if tied is None else tied
    on_device = new_id(_compat.memory_space_aval(avals[value],
                                                 jax.memory.Space.Device))
    eqn = _compat.device_put_equation(
        _compat.new_var(avals[value]), _compat.new_var(avals[on_device]),
        False, anchor.eqn, scope)
    place(at, Equation(eqn, source, (on_device,), anchor.name_stack),
          to_device=aval_nbytes(avals[value]), until=first)
    for r in readers:
      pins.renamed.setdefault(r, {})[value] = on_device

  made_at = [liveness.producer[value] for _, value in writes]
  done_by = write_times([ends[m] for m in made_at],
                        [seconds(v) for _, v in writes])
  for (position, value), maker, time in zip(writes, made_at, done_by):
    anchor = program.equations[maker]
    scope = profile_scope("swap_out", label(value))
    # The update before the backward pass goes on: tied to what the
    # kernels right after it make, so that XLA cannot run it (and the
    # copy that reads it) just before the copy's wait.
    early = tie((value,), ending_after(ends[maker], maker), maker, scope,
                anchor)
    (source,), at = ((value,), maker) if early is None else early
    on_host = new_id(_compat.memory_space_aval(avals[value],
                                               jax.memory.Space.Host))
    eqn = _compat.device_put_equation(
        _compat.new_var(avals[value]), _compat.new_var(avals[on_host]),
        True, anchor.eqn, scope)
    place(at, Equation(eqn, (source,), (on_host,), anchor.name_stack),
          to_host=aval_nbytes(avals[value]))
    copy = pins.after[at][-1]
    pins.outputs[position] = on_host
    # Done before what is made a margin of its link time later. The
    # barrier carries the device value too: XLA keeps a copy's source
    # until the copy is done, and so then does the simulator.
    late = tie((on_host, source), ending_after(time, at), at, scope, anchor)
    if late is not None:
      pins.outputs[position] = late[0][0]
      copy[3] = pins.after[late[1]][-1][0]  # waited for before its barrier
  return pins
