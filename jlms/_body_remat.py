"""Remat inside loop bodies that run a forward and a backward pass.

Gradient accumulation by `jax.lax.scan` puts a whole train step in one loop
body: each iteration runs a microbatch's forward pass, its backward pass,
and adds the gradient to a carry. Every value the body makes is made and
dropped inside one iteration, out of reach of the passes that plan around
loops (`jlms._fit`, `jlms._loops`): the least memory of such a step is one
iteration's working set.

Here each such body gets what the step itself gets when its layers are a
Python loop or a scan: its forward pass cut into segments whose
activations are remade where their backward pass starts
(`jlms._segment_remat`), and each scan inside it that stacks residuals for
a backward scan made to remake them instead (`jlms._loop_remat`, all of
them: per-layer remat). The body is flattened to a `Program`, rewritten
by those passes, and the loop traced again from Python with public
`jax.lax.scan` around the new body, as `jlms._loop_remat` traces its loops.

Two pure steps:
- `bodies_with_backward` (analysis): the scans whose body has a backward
  pass after a forward one, and what remaking inside it frees, at least
  `min_bytes`;
- `remade_in_bodies` (rewrite): the program with those scans' bodies
  rewritten.

Guarantees: the new program computes the same values (each body computes
what it computed: `jlms._segment_remat` and `jlms._loop_remat` keep
values); the rewritten scans keep their inputs and output ids; a scan
whose body the passes cannot rewrite is left as it is, with a debug log
line that says why.
"""

from __future__ import annotations

import dataclasses
import logging

import jax

from jlms import _compat
from jlms._config import OffloadConfig
from jlms._liveness import analyse
from jlms._loop_remat import (cheapest, loop_rematerializations,
                              rematerialize_in_loops)
from jlms._program import Program, scan_body
from jlms._retrace import atom_aval, traced_call, unwrapped_call
from jlms._rewrite import rewrite
from jlms._segment_remat import (forward_cuts, forward_end,
                                 rematerialize_segments, remaking_barriers,
                                 segment_remats)

log = logging.getLogger("jlms")


@dataclasses.dataclass(frozen=True)
class BodyRemat:
  """A scan (equation `index`) whose body, rewritten, remakes `freed` bytes
  of activations instead of keeping them across its forward and backward
  pass."""
  index: int
  body: Program
  freed: int


def _remade_body(body: Program, every: int) -> tuple[Program, int]:
  """`body` with its forward segments between every `every`-th cut
  remade where the backward pass starts, and each of its scan pairs
  remaking its residuals; the bytes of activations that stop living
  across its forward and backward pass."""
  liveness = analyse(body)
  freed = 0
  remats = segment_remats(body, liveness, forward_cuts(body, liveness),
                          every)
  if remats:
    freed += sum(liveness.nbytes[v] for r in remats for v in r.remade)
    body = rematerialize_segments(body, remats)
    liveness = analyse(body)
  pairs = loop_rematerializations(body, liveness)
  if pairs:
    chosen = cheapest(pairs, 1.0)
    freed += sum(liveness.nbytes[v] for c in chosen for v in c.residuals)
    body = rematerialize_in_loops(body, chosen)
  return body, freed


def bodies_with_backward(program: Program, min_bytes: int, every: int = 1
                         ) -> tuple[BodyRemat, ...]:
  """The scans of `program` whose body runs a backward pass after a
  forward one, each with its body rewritten (`every` as
  `jlms._segment_remat.segment_remats` takes it), where that frees at
  least `min_bytes`."""
  found = []
  for index, equation in enumerate(program.equations):
    if equation.primitive.name != "scan":
      continue
    try:
      body, _ = scan_body(equation.eqn)
      end = forward_end(body)
      if not end:  # no backward pass, or no forward pass before it
        continue
      remade, freed = _remade_body(body, every)
    except Exception as error:  # noqa: BLE001 -- this loop only
      log.debug("jlms: the body of %s is left as it is (%s: %s)",
                equation.readable_name(), type(error).__name__, error)
      continue
    if freed >= max(min_bytes, 1):
      found.append(BodyRemat(index, remade, freed))
  return tuple(found)


def remade_in_bodies(program: Program, remats: tuple[BodyRemat, ...]
                     ) -> Program:
  """`program` with each of `remats`' scans running its rewritten body."""
  if not remats:
    return program
  equations = list(program.equations)
  for remat in remats:
    equation = program.equations[remat.index]
    eqn = _scan_with_body(equation, remat.body, program.avals)
    rewritten = dataclasses.replace(equation, eqn=eqn)
    equations[remat.index] = unwrapped_call(rewritten) or rewritten
  return dataclasses.replace(program, equations=tuple(equations))


def _scan_with_body(equation, body: Program, avals):
  """A nested-jit equation running `equation`'s scan (same length,
  direction, inputs and outputs) over `body`, a flat program laid out as
  `jlms._program.scan_body` lays out its body."""
  layout = _compat.scan_layout(equation.eqn)
  _, body_consts = _compat.jaxpr_parts(layout.body)
  # Its weight gradients made before each remaking, not held to the end
  # of the body, where the accumulating adds run.
  closed = rewrite(body, (), OffloadConfig(), pin_contractions=True,
                   pin_before=remaking_barriers(body))
  jaxpr, consts = _compat.jaxpr_parts(closed)
  nc, nk = layout.num_consts, layout.num_carry

  def call(*args):
    loop_consts, carry, xs = (args[:nc], list(args[nc:nc + nk]),
                              list(args[nc + nk:]))

    def iteration(carry, x):
      outs = _compat.eval_jaxpr(jaxpr, consts, *body_consts, *loop_consts,
                                *carry, *x)
      return outs[:nk], outs[nk:]

    carry_out, ys = jax.lax.scan(iteration, carry, xs, length=layout.length,
                                 reverse=layout.reverse)
    return [*carry_out, *ys]

  return traced_call(call, [atom_aval(a, avals) for a in equation.inputs],
                     (), "jlms_body_remaking", equation.eqn)
