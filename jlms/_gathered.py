"""Weights that XLA holds gathered, whole on every device, in a sharded step.

Under `AxisType.Auto` mesh axes jlms plans on the step's jaxpr, whose values
are whole arrays, and counts each device's bytes as the jaxpr's divided by
the arguments' split (`jlms._sharding.unseen_split`). That holds for what
the devices split: the activations (by batch) and the state (FSDP-style).
It does not hold for a weight a contraction reads: XLA's SPMD partitioner
gathers the weight's shards into the whole array on every device before the
contraction, and where two contractions read the same value (a layer's
forward product and the transposed product of its backward pass, both of
the weight cast to the compute dtype) its CSE leaves one gather, held from
the first contraction to the last. On the 70B Llama of `transformers` over
eight deviceless H100s (FSDP, Auto axis, 2026-12-03) XLA held 69 layers'
`q_proj` and `o_proj` weights gathered from the forward pass to the backward
(bf16[8192,8192], 128 MiB each a device, 17.2 GiB in all, plus 2.4 GiB of
`k_proj` and `v_proj`), and its peak came out at 103.3 GiB a device where the
simulator had counted 76.9 without them; the layers whose backward pass read
a remade cast (a different value) gathered again there instead.

`whole_weight_holds(program, liveness, split)` gives, per equation, the bytes
(in the jaxpr's sizes, `split` times one device's) that such gathered
weights add to the simulator's count: for each value read by two or more
contractions that is a weight, or a copy, cast or re-layout of one,
its whole size on every device less the share already counted, from its
first contraction to its last. Pure; an all-zero array where `split` is 1.
"""

from __future__ import annotations

import numpy as np

from jlms import _compat, _rules
from jlms._liveness import Liveness
from jlms._program import Program


def _is_contraction(eqn) -> bool:
  return _rules.rule(eqn.primitive).flops is not None


def _passes_weight_on(eqn) -> bool:
  """Whether `eqn`'s result is still the weight its one operand is, for
  the gather XLA makes of it: a copy between memories, a cast or a
  re-layout."""
  return (_rules.rule(eqn.primitive).relayout_only
          or _compat.is_device_put(eqn))


def _folds_into_reader(eqn, operand_aval, result_aval) -> bool:
  """Whether a contraction reading `eqn`'s result reads its operand's
  gather (a transpose or reshape XLA folds into the product), rather than
  a value of its own (a cast, gathered in the dtype it makes)."""
  return (_rules.rule(eqn.primitive).relayout_only
          and operand_aval.dtype == result_aval.dtype)


def whole_weight_holds(program: Program, liveness: Liveness,
                       split: int) -> np.ndarray:
  n = len(program)
  extra = np.zeros(n + 2, dtype=np.int64)
  if split <= 1:
    return extra[: n + 1]
  # value -> the value whose gather a contraction reading it reads, for
  # the values that are a weight or made from one alone. The weights are
  # the donated arguments (the state the step returns updated): the batch
  # is split along rows that a contraction keeps or sums over, and is not
  # gathered.
  gathered_as: dict[int, int] = {program.invars[p]: program.invars[p]
                                 for p in program.donated}
  readers: dict[int, list[int]] = {}
  for index, equation in enumerate(program.equations):
    eqn, inputs = equation.eqn, equation.inputs
    rule = _rules.rule(eqn.primitive)
    if rule.aliases_operands:  # a barrier passes each operand on
      for atom, out in zip(inputs, equation.outputs):
        if isinstance(atom, int) and atom in gathered_as:
          gathered_as[out] = gathered_as[atom]
      continue
    operands = [a for a in inputs if isinstance(a, int)]
    if (len(operands) == 1 and len(equation.outputs) == 1
        and operands[0] in gathered_as and _passes_weight_on(eqn)):
      out = equation.outputs[0]
      folds = _folds_into_reader(eqn, program.avals[operands[0]],
                                 program.avals[out])
      gathered_as[out] = gathered_as[operands[0]] if folds else out
      continue
    if _is_contraction(eqn):
      for atom in set(operands):
        if atom in gathered_as:
          readers.setdefault(gathered_as[atom], []).append(index)
  for value, at in readers.items():
    if len(at) < 2:
      continue
    size = liveness.nbytes[value] * (split - 1)
    extra[min(at)] += size
    extra[max(at) + 1] -= size
  return np.cumsum(extra)[: n + 1]
