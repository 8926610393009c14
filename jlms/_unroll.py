"""Short gradient-accumulation loops unrolled into the step.

A step that accumulates gradients by `jax.lax.scan` runs each microbatch's
forward and backward pass inside one loop body. The passes that plan the
step (copies to host, values remade one by one, runs split over the
batch, segments remade) see a loop as one equation, and what its body
makes and drops as one lump: inside the body only `jlms._body_remat`
remakes. The same step written as a Python loop over its microbatches
gets all of them. On 8 of Llama-3-8B's layers, 2 microbatches of 4 x 4096
tokens, a 40 GiB budget: as a scan, the least jlms reached was 66.1 GiB
(45.3 GiB of it made inside the body); as a Python loop, a plan of 44.4
GiB by XLA.

So a scan whose body runs a backward pass after a forward one (as
`jlms._body_remat` finds them), over at most `MAX_ITERATIONS` iterations,
is unrolled here: its body's equations, inlined once per iteration, each
reading that iteration's slices of the scanned inputs and the carry the
iteration before made; the per-iteration outputs stacked. Longer loops
stay loops: the program, and planning time, grow with every iteration.

Not unrolled either: a loop whose body runs scans that stack per-layer
outputs (scanned layers, whose forward scan stacks its residuals). XLA
makes each such scan's stacks from one zero-filled buffer, and, unrolled,
the scans of every microbatch start from copies of it: identical
broadcasts merged into one, then the copies fused into one kernel that
makes all of them at once, before the first microbatch. On 6 scanned
layers of 1024 x 1024, 4 microbatches, JAX 0.10.2's XLA: 294 MiB for an
H100 unrolled, against 108 as a loop (eight f32[6,1024,1024] stacks made
together by one `loop_broadcast_fusion`, read from `xla_dump_to`'s buffer
assignment). JAX 0.12.0.1's XLA does not (110 MiB either way); such
loops stay loops on both, where their bodies' own remaking
(`jlms._body_remat`, per layer inside the body) reaches 61 MiB.

Two pure steps: `accumulation_loops` (analysis) and `unrolled` (rewrite).

Guarantees: the rewritten program computes exactly what the program
computes (the same equations on the same values, in the scan's order, its
carry threaded through); values after the loop read the same results
under new ids; a loop whose iterations nothing orders raises
`CannotUnroll`, and the caller plans the step as it is. Each iteration after the first reads its
inputs (the loop's constants, the carry, the scanned inputs it slices)
through one optimization barrier with what the iteration before made
(its carry, its per-iteration outputs: `lax.map` has no carry), so that,
as in the loop, nothing of it runs before that iteration ends: XLA would
otherwise start a microbatch's forward pass before the last one's
backward pass, and merge the iterations' common work (the parameters'
casts to the compute dtype) into one value held throughout.
"""

from __future__ import annotations

import dataclasses
import logging

import jax.numpy as jnp

from jlms import _compat
from jlms._program import Atom, Const, Equation, Program, scan_body
from jlms._retrace import traced_equations
from jlms._segment_remat import forward_end

log = logging.getLogger("jlms")

#: Loops of at most this many iterations are unrolled.
MAX_ITERATIONS = 8
#: The scope of the barriers that run each iteration after the last.
_SCOPE = "jlms/unrolled_iteration"


class CannotUnroll(Exception):
  """A loop whose iterations nothing orders (each makes nothing the next
  reads or is tied to)."""


def accumulation_loops(program: Program,
                       max_iterations: int = MAX_ITERATIONS
                       ) -> tuple[int, ...]:
  """Indices of the scans of `program` that run a forward and then a
  backward pass in their body, over at most `max_iterations`
  iterations."""
  found = []
  for index, equation in enumerate(program.equations):
    if equation.primitive.name != "scan":
      continue
    try:
      if not 1 <= _compat.scan_layout(equation.eqn).length <= max_iterations:
        continue
      body, _ = scan_body(equation.eqn)
    except Exception as error:  # noqa: BLE001 -- this loop only
      log.debug("jlms: %s is not unrolled (%s: %s)",
                equation.readable_name(), type(error).__name__, error)
      continue
    if forward_end(body) and not _stacks_per_iteration(body):
      found.append(index)  # a backward pass, after a forward one
  return tuple(found)


def _stacks_per_iteration(body: Program) -> bool:
  """Whether `body` runs a scan of more than one iteration that stacks an
  output (module docstring: unrolled, XLA makes every microbatch's stacks
  at once)."""
  for equation in body.equations:
    if equation.primitive.name != "scan":
      continue
    layout = _compat.scan_layout(equation.eqn)
    if layout.length > 1 and len(equation.outputs) > layout.num_carry:
      log.debug("jlms: not unrolled: its body's %s stacks its outputs",
                equation.readable_name())
      return True
  return False


class _Builder:
  """New equations and ids after a program's own."""

  def __init__(self, program: Program):
    self.avals = list(program.avals)
    self.equations: list[Equation] = []

  def new_id(self, aval) -> int:
    self.avals.append(aval)
    return len(self.avals) - 1

  def traced(self, fn, inputs, name_stack, like) -> list[Atom]:
    retraced = traced_equations(fn, inputs, self.avals, name_stack, like)
    self.avals.extend(retraced.new_avals)
    self.equations.extend(retraced.equations)
    return list(retraced.outputs)

  def after(self, groups, made: list[int], anchor) -> tuple:
    """`groups` (lists of atoms) as copies that an optimization barrier
    makes only once `made` (ids) are: what reads them waits for them."""
    tied = [a for a in dict.fromkeys(a for g in groups for a in g)
            if isinstance(a, int)
            and _compat.passes_a_barrier(self.avals[a])]
    waits = [a for a in dict.fromkeys(made) if a not in tied
             and _compat.passes_a_barrier(self.avals[a])]
    inputs = tied + waits
    if not tied or not any(a in inputs for a in made):
      raise CannotUnroll("nothing the iteration before makes can order it")
    outputs = tuple(self.new_id(self.avals[a]) for a in inputs)
    self.equations.append(Equation(
        _compat.barrier_equation(
            [_compat.new_var(self.avals[a]) for a in inputs],
            [_compat.new_var(self.avals[a]) for a in inputs], anchor, _SCOPE),
        tuple(inputs), outputs, _compat.scope_name_stack(_SCOPE)))
    copy = dict(zip(inputs, outputs))
    return tuple([copy.get(a, a) if isinstance(a, int) else a for a in g]
                 for g in groups)

  def inlined(self, body: Program, inputs, name_stack) -> list[Atom]:
    """`body`'s equations over `inputs` (one per body input), under
    `name_stack` in front of their own; its outputs."""
    env: dict = dict(zip(body.invars, inputs))

    def read(atom):
      return atom if isinstance(atom, Const) else env[atom]

    for equation in body.equations:
      outputs = tuple(self.new_id(body.avals[v]) for v in equation.outputs)
      env.update(zip(equation.outputs, outputs))
      stack = name_stack + equation.name_stack
      # A distinct equation object an iteration (passes key equations by
      # identity: `jlms._variants` re-indexes a way's copies by it).
      eqn = _compat.rebuilt_equation(
          equation.eqn, equation.eqn.invars,
          [_compat.new_var(body.avals[v]) for v in equation.outputs], stack)
      self.equations.append(Equation(
          eqn, tuple(read(a) for a in equation.inputs), outputs, stack))
    return [read(a) for a in body.outvars]


def _unrolled_scan(builder: _Builder, equation: Equation) -> list[Atom]:
  """`equation`'s scan as equations in `builder`; its outputs' atoms."""
  layout = _compat.scan_layout(equation.eqn)
  body, body_consts = scan_body(equation.eqn)
  nc, nk = layout.num_consts, layout.num_carry
  consts = list(equation.inputs[:nc])
  carry = list(equation.inputs[nc:nc + nk])
  xs = list(equation.inputs[nc + nk:])
  steps = range(layout.length)
  per_iteration: list[list[Atom]] = []
  made: list[int] = []  # by the iteration before, that the next waits for
  for number, t in enumerate(reversed(steps) if layout.reverse else steps):
    if number:
      consts, carry, xs = builder.after((consts, carry, xs), made,
                                        equation.eqn)
    sliced = builder.traced(
        lambda *stacked, t=t: [x[t] for x in stacked], xs,
        equation.name_stack, equation.eqn) if xs else []
    first_new = len(builder.avals)
    outs = builder.inlined(
        body, [Const(c) for c in body_consts] + consts + carry + sliced,
        equation.name_stack)
    made = [a for a in outs if isinstance(a, int) and a >= first_new]
    carry, ys = outs[:nk], outs[nk:]
    per_iteration.append(ys)
  if layout.reverse:
    per_iteration.reverse()
  stacked = []
  for position in range(len(per_iteration[0]) if per_iteration else 0):
    parts = [ys[position] for ys in per_iteration]
    stacked += builder.traced(lambda *ys: jnp.stack(ys), parts,
                              equation.name_stack, equation.eqn)
  return carry + stacked


def unrolled(program: Program, loops: tuple[int, ...]) -> Program:
  """`program` with each scan at `loops` unrolled (module docstring).
  Raises `CannotUnroll` for a loop of more than one iteration that makes
  nothing in an iteration (a carry passed through, no outputs): its
  iterations could not be ordered."""
  if not loops:
    return program
  builder = _Builder(program)
  renamed: dict = {}

  def read(atom):
    return renamed.get(atom, atom) if isinstance(atom, int) else atom

  for index, equation in enumerate(program.equations):
    equation = dataclasses.replace(
        equation, inputs=tuple(read(a) for a in equation.inputs))
    if index not in loops:
      builder.equations.append(equation)
      continue
    outputs = _unrolled_scan(builder, equation)
    renamed.update(zip(equation.outputs, outputs))
  return dataclasses.replace(
      program, outvars=tuple(read(a) for a in program.outvars),
      equations=tuple(builder.equations), avals=tuple(builder.avals))
