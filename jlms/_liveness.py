"""Liveness of every value of a flat program: where it is made, where it is read.

Pure functions over a `jlms._program.Program`; nothing here changes a program.

Guarantees: `Liveness.uses[i]` lists, in increasing order and without repeats,
the indices of the equations that read id `i`; a value that is an output of
the program is also read at index `len(program)` (the end of the step).
`producer[i]` is the index of the equation that makes `i`, or -1 for the
program's inputs. `nbytes[i]` is the device size of id `i` (one device's
shard of a value with an explicit sharding, see `jlms._sharding`), 0 for values
without a plain memory layout (tokens, PRNG key arrays) and for values the
program places in host memory.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from jlms import _compat, _thresholds
from jlms._program import Program
from jlms._sharding import device_shape


@dataclasses.dataclass(frozen=True)
class Liveness:
  producer: tuple[int, ...]
  uses: tuple[tuple[int, ...], ...]
  nbytes: tuple[int, ...]
  end: int  # the index that stands for "read by the step's outputs"

  def last_use(self, value: int) -> int:
    uses = self.uses[value]
    return uses[-1] if uses else self.producer[value]


def aval_nbytes(aval) -> int:
  """Bytes one device holds of an array of abstract value `aval`: its shard
  when the aval carries an explicit sharding, else the whole array (a
  typed PRNG key as its key data; 0 for a token)."""
  try:
    return _aval_nbytes(aval)
  except TypeError:  # an unhashable aval: the same sum, uncached
    return _aval_nbytes.__wrapped__(aval)


@functools.lru_cache(maxsize=4096)
def _aval_nbytes(aval) -> int:
  # Cached: a step has tens of thousands of values of a few hundred types.
  shape = getattr(aval, "shape", None)
  dtype = getattr(aval, "dtype", None)
  if shape is None or dtype is None:
    return 0
  itemsize = (_compat.extended_itemsize(dtype)
              if _compat.is_extended_dtype(dtype) else np.dtype(dtype).itemsize)
  return math.prod(device_shape(aval)) * itemsize


def analyse(program: Program) -> Liveness:
  n_values = len(program.avals)
  producer = [-1] * n_values
  uses: list[list[int]] = [[] for _ in range(n_values)]
  for index, equation in enumerate(program.equations):
    for out in equation.outputs:
      producer[out] = index
    for atom in equation.inputs:
      if isinstance(atom, int) and (not uses[atom] or uses[atom][-1] != index):
        uses[atom].append(index)
  end = len(program)
  for atom in program.outvars:
    if isinstance(atom, int) and (not uses[atom] or uses[atom][-1] != end):
      uses[atom].append(end)
  return Liveness(
      producer=tuple(producer),
      uses=tuple(tuple(u) for u in uses),
      nbytes=tuple(0 if _compat.is_host_aval(a) else aval_nbytes(a)
                   for a in program.avals),
      end=end,
  )


def live_bytes_by_equation(liveness: Liveness) -> np.ndarray:
  """Bytes of values alive while each equation runs (its inputs, its outputs
  and everything made earlier and read later), in jaxpr order, program inputs
  included. This is the jaxpr's own view of memory: XLA fuses and reorders, so
  it is an upper-bound-like guide, not XLA's peak."""
  n = liveness.end
  delta = np.zeros(n + 2, dtype=np.int64)
  for value, size in enumerate(liveness.nbytes):
    if not size:
      continue
    start = max(liveness.producer[value], 0)
    stop = liveness.last_use(value)
    delta[start] += size
    delta[min(stop, n) + 1] -= size
  return np.cumsum(delta)[: n + 1]


def largest_equation(program: Program, liveness: Liveness) -> tuple[int, int]:
  """(index, bytes of inputs and outputs) of the equation touching the most
  bytes; (-1, 0) for an empty program."""
  best_index, best_bytes = -1, 0
  for index, equation in enumerate(program.equations):
    touched = {a for a in equation.inputs if isinstance(a, int)}
    touched.update(equation.outputs)
    size = sum(liveness.nbytes[v] for v in touched)
    if size > best_bytes:
      best_index, best_bytes = index, size
  return best_index, best_bytes


def is_expansion(program: Program, liveness: Liveness, value: int) -> bool:
  """Whether `value` is made from inputs at least
  `Thresholds.expansion_factor` (4) times smaller (a broadcast, an iota,
  a fill): cheap to recompute wherever it is read, and not worth a buffer
  of its own."""
  equation = program.equations[liveness.producer[value]]
  inputs = sum(liveness.nbytes[a] for a in equation.inputs
               if isinstance(a, int))
  return (_thresholds.THRESHOLDS.expansion_factor * inputs
          <= liveness.nbytes[value])
