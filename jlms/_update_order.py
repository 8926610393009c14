"""The optimizer's update of each parameter, moved to where its gradient is made.

A step traced from `value_and_grad` and an optimizer makes every gradient
in the backward pass and then updates every parameter, in the order the
optimizer's code runs: a program in that order holds all the gradients at
once at the end of the backward pass (13.4 GiB on the float32
Llama-3.2-3B of `benchmarks.real_models`), and a plan made in that order
pays for them. Per-block remat compiled by XLA does not: its scheduler
updates a layer as soon as that layer's gradient exists, which is how it
holds that Llama's step and its AdamW state in 52.5 GiB.

The update is the program's tail: the pointwise equations whose results
only other such equations or the step's outputs read. It falls apart into
groups, one per parameter (the equations joined by values larger than
scalars: Adam's bias corrections are shared by all). `updates_at_gradients`
moves each group that writes into a donated input's buffer to right
after the last equation it waits for: the making of its gradient, and
every read of the parameter and the moments it overwrites, so that the
update can still write them in place.

Pure. Guarantees: the result has the same equations, in an order in which
every equation follows the makers of its inputs; equations outside the
tail keep their order; a tail equation that reads a step input follows
every equation outside the tail that reads it; no tail equation moves
before a loop (an equation with a body) that it followed.
"""

from __future__ import annotations

import bisect
import dataclasses

from jlms import _rules
from jlms._groups import connected_groups
from jlms._liveness import aval_nbytes
from jlms._program import Program, donation_pairs

#: The update is held where it is placed when it writes at least this
#: share of the peak (`worth_holding_in_place`).
_HELD_SHARE = 32
#: Values up to this size (scalars, a step counter) do not join groups:
#: one bias correction read by every parameter's update would make the
#: whole update one group.
_JOINS_ABOVE_BYTES = 64


def update_tail(program: Program) -> frozenset[int]:
  """The pointwise equations, without effects, whose results only other
  such equations or the step's outputs read: the optimizer's update (and
  the loss's last scalar arithmetic)."""
  readers: dict[int, list[int]] = {}
  for index, equation in enumerate(program.equations):
    for atom in equation.inputs:
      if isinstance(atom, int):
        readers.setdefault(atom, []).append(index)
  tail: set[int] = set()
  for index in range(len(program) - 1, -1, -1):
    equation = program.equations[index]
    if (_rules.rule(equation.primitive).pointwise and not equation.eqn.effects
        and all(r in tail for v in equation.outputs
                for r in readers.get(v, ()))):
      tail.add(index)
  return frozenset(tail)


def worth_holding_in_place(program: Program, peak_bytes: int) -> bool:
  """Whether the update writes at least `_HELD_SHARE` of `peak_bytes`:
  only then are the gradients XLA would hold to the end of the step worth
  the barriers that keep each update where it is placed, which cost time
  (ResNet-50 at per-block remat's peak, its 25M parameters a fraction of
  its 69.7 GiB: 723.2 ms with them, 717.9 without; Llama-3.2-3B's
  parameters and moments are three quarters of its 51.4 GiB)."""
  outputs = {a for a in program.outvars if isinstance(a, int)}
  written = sum(aval_nbytes(program.avals[v]) for index in update_tail(program)
                for v in program.equations[index].outputs if v in outputs)
  return written * _HELD_SHARE >= peak_bytes


def updates_at_gradients(program: Program) -> Program:
  """`program` with each group of its update tail right after the last
  equation it waits for (see the module docstring); `program` itself
  where that is where they are."""
  tail = update_tail(program)
  if not tail:
    return program
  equations = program.equations
  producer = {v: i for i, e in enumerate(equations) for v in e.outputs}
  groups = _groups(program, tail, producer)
  group_of = {i: g for g, members in enumerate(groups) for i in members}
  # The last read of each step input by an equation outside the tail.
  last_outside: dict[int, int] = {}
  for index, equation in enumerate(equations):
    if index not in tail:
      for atom in equation.inputs:
        if isinstance(atom, int) and atom not in producer:
          last_outside[atom] = index
  # No group moves before a loop it followed: a loop is one equation
  # that holds its whole working set, and an update moved before it holds
  # its results and temporaries through it (the scanned GPT of
  # `benchmarks.frontier_cases`, whose head's update would move before the
  # backward loop: 1.872 GiB by XLA against 1.840 left after it).
  # (A loop is a scan or a while, not any equation with a body: the
  # embedding gradient's scatter-add has one, its combiner, and taken for
  # a loop it held every update of a language model to the step's end.)
  loops = [i for i, e in enumerate(equations)
           if i not in tail and _rules.rule(e.primitive).loop]
  # (The latest loop before each group's first equation, by bisection:
  # a step of many loops and many parameters stays linear.)
  after = [loops[k - 1] if (k := bisect.bisect_left(loops, members[0]))
           else -1 for members in groups]
  # Only an update that writes in place, into a donated input's buffer,
  # moves (and the groups of intermediates, Adam's bias corrections, that
  # the updates read): one that writes new buffers (a step that donates
  # nothing) holds
  # its new parameter and moments from then on beside the old ones, two
  # buffers more for the gradient it frees (the scanned GPT of
  # `benchmarks.frontier_cases`: least memory 1.87 GiB by XLA moved, 1.84
  # not). It stays after the last equation outside the tail before it.
  in_place = _donation_targets(program)
  step_outputs = {a for a in program.outvars if isinstance(a, int)}
  outside = [i for i in range(len(equations)) if i not in tail]
  for g, members in enumerate(groups):
    written = {v for i in members for v in equations[i].outputs
               if v in step_outputs}
    if written and not written & in_place:
      k = bisect.bisect_left(outside, members[-1])
      after[g] = outside[k - 1] if k else -1
  # Each group waits for what its members read; a group may read another
  # group's results (a scalar shared by all), so settle in rounds.
  for _ in range(len(groups) + 1):
    changed = False
    for g, members in enumerate(groups):
      at = after[g]
      for index in members:
        for atom in equations[index].inputs:
          if not isinstance(atom, int):
            continue
          made_by = producer.get(atom)
          if made_by is None:
            at = max(at, last_outside.get(atom, -1))
          elif made_by not in tail:
            at = max(at, made_by)
          elif group_of[made_by] != g:
            at = max(at, after[group_of[made_by]])
      if at != after[g]:
        after[g], changed = at, True
    if not changed:
      break
  placed: dict[int, list[int]] = {}
  for g, members in enumerate(groups):
    placed.setdefault(after[g], []).extend(members)
  order = sorted(placed.get(-1, ()))
  for index in range(len(equations)):
    if index not in tail:
      order.append(index)
      order.extend(sorted(placed.get(index, ())))
  if order == list(range(len(equations))):
    return program
  return dataclasses.replace(
      program, equations=tuple(equations[i] for i in order))


def _donation_targets(program: Program) -> frozenset[int]:
  """The output ids whose buffers are donated inputs' (`donation_pairs`)."""
  return frozenset(program.outvars[out] for _, out in donation_pairs(program)
                   if isinstance(program.outvars[out], int))


def _groups(program: Program, tail: frozenset[int], producer: dict
            ) -> list[list[int]]:
  """The tail's equations, joined where one reads the other's result
  larger than `_JOINS_ABOVE_BYTES`; each group in program order."""
  pairs = []
  for index in tail:
    for atom in program.equations[index].inputs:
      made_by = producer.get(atom) if isinstance(atom, int) else None
      if (made_by in tail
          and aval_nbytes(program.avals[atom]) > _JOINS_ABOVE_BYTES):
        pairs.append((index, made_by))
  return connected_groups(tail, pairs)
