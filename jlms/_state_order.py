"""The order in which a budget's search moves the optimizer's moments to
host (`hidden_updates_first`): the moments one update reads together, and
first those whose copies hide best.

Pure analyses over `jlms._program.Program`. Guarantees: each position
given is in exactly one group; a weight's moments that one update run
reads are in one group.
"""

from __future__ import annotations

from typing import Sequence

from jlms._liveness import Liveness, aval_nbytes
from jlms._program import Program
from jlms._update_fusion import fusable_run
from jlms._update_loops import update_runs


def _groups_and_runs(program: Program, liveness: Liveness,
                     positions: Sequence[int]) -> list[tuple[tuple, list]]:
  """`positions` (inputs of the program) grouped by the update run that
  reads them (`jlms._update_loops.update_runs`), each with its run: an
  optimizer's two moments of one weight are updated by one run, so they
  cross together. A position that no run reads (not streamable, or read
  whole) is a group of its own, with no run (None). In program order of
  the positions."""
  values = {program.invars[p]: p for p in positions}
  runs = update_runs(program, liveness, set(values))
  group_of = {}
  for number, run in enumerate(runs):
    for index in run:
      for atom in program.equations[index].inputs:
        if isinstance(atom, int) and atom in values:
          group_of.setdefault(values[atom], number)
  groups: dict = {}
  for position in positions:
    groups.setdefault(group_of.get(position, ("alone", position)),
                      []).append(position)
  return [(tuple(group), runs[key] if isinstance(key, int) else None)
          for key, group in groups.items()]


def hidden_updates_first(program: Program, liveness: Liveness,
                         positions: Sequence[int]) -> list[tuple[int, ...]]:
  """`positions` grouped as their updates read them (a weight's moments
  together), in the order a budget's search moves the optimizer's
  moments to host: first those whose update runs inside the loop that
  makes its gradient
  (`jlms._update_fusion`: its slices cross beside that loop's kernels),
  the largest first; then the rest, whose whole copies are pinned beside
  the backward pass (`jlms._state_pins`), the smallest first. A copy
  hides between the kernels of the layers around its update, and a
  large one needs more of them than a layer has: Llama-3-8B at batch 4,
  schedule model, each 224 MiB moment waited 1.2 to 2.5 ms of its 4.3 ms
  of link time, each 2 GiB one of its embedding's and head's 21 to 38 ms
  of 38."""
  size = {p: aval_nbytes(program.avals[program.invars[p]])
          for p in positions}

  def key(pair):
    group, run = pair
    largest, total = max(size[p] for p in group), sum(size[p] for p in group)
    if run is not None and fusable_run(program, liveness, run)[0] is not None:
      return (0, -largest, -total, group)
    return (1, largest, total, group)

  return [group for group, _ in sorted(
      _groups_and_runs(program, liveness, positions), key=key)]
