"""Each fused equation placed where XLA runs it: right before its readers.

XLA's GPU fusion computes an elementwise or re-layout result inside the
kernel that reads it, and when kernels at several points of the step read
it, inside each of them: a BatchNorm's `x - mean` is computed in the forward
normalisation and again in the backward pass. In the jaxpr such an equation
appears once, where autodiff wrote it, so its inputs look read there, not
where XLA really reads them, and a plan that moves the input to host across
the real gap would find a read inside it.

`place_fused_at_readers` returns the same program with every such equation
emitted right before each equation that reads it (a copy per reader, with
fresh value ids), and never at its old place. What guarantees hold:

- the program computes the same values: copies are the same pure
  equations on the same inputs (XLA's CSE merges copies that stay
  identical, so the compiled step is unchanged);
- every read of a value in the new program is where XLA reads it, up to
  the fusion model of `jlms._simulator.analyse_fusion`;
- values that are not fused keep their ids, the program's inputs and
  outputs too; copies get new ids past the old ones.
"""

from __future__ import annotations

import dataclasses

from jlms import _rules
from jlms._liveness import Liveness
from jlms._program import Equation, Program


def place_fused_at_readers(program: Program, liveness: Liveness,
                           fusion) -> Program:
  """`program` with fused equations moved (and copied) to their readers
  (see the module docstring); `program` itself if none is fused."""
  equations = program.equations
  fused = [_is_fused(program, index, fusion) for index in range(len(program))]
  if not any(fused):
    return program
  avals = list(program.avals)
  placed: list[Equation] = []
  fused_value = [False] * len(avals)
  for index, equation in enumerate(equations):
    if fused[index]:
      for out in equation.outputs:
        fused_value[out] = True

  def emit(value, copies: dict):
    """The id that holds `value` at the reader being emitted."""
    if not isinstance(value, int):
      return value
    made_by = liveness.producer[value]
    if made_by < 0 or not fused[made_by]:
      return value
    if value not in copies:
      equation = equations[made_by]
      inputs = tuple(emit(a, copies) for a in equation.inputs)
      outputs = []
      for out in equation.outputs:
        avals.append(avals[out])
        copies[out] = len(avals) - 1
        outputs.append(copies[out])
      placed.append(Equation(equation.eqn, inputs, tuple(outputs),
                             equation.name_stack))
    return copies[value]

  for index, equation in enumerate(equations):
    if fused[index]:
      continue
    if not any(isinstance(a, int) and fused_value[a] for a in equation.inputs):
      placed.append(equation)  # reads nothing fused: as it was
      continue
    copies: dict = {}
    inputs = tuple(emit(a, copies) for a in equation.inputs)
    placed.append(Equation(equation.eqn, inputs, equation.outputs,
                           equation.name_stack))
  copies = {}
  outvars = tuple(emit(a, copies) for a in program.outvars)
  return dataclasses.replace(program, equations=tuple(placed),
                             outvars=outvars, avals=tuple(avals))


def _is_fused(program: Program, index: int, fusion) -> bool:
  """Whether XLA computes equation `index` inside its readers' kernels: a
  fusible equation none of whose outputs gets a buffer, that something
  reads."""
  equation = program.equations[index]
  if not _rules.is_fusible_equation(equation.eqn):
    return False
  if any(fusion.materialized[out] for out in equation.outputs):
    return False
  return any(fusion.last_read[out] >= 0 for out in equation.outputs)
