"""A train step as one flat, numbered list of equations.

`flatten` turns a closed jaxpr into a `Program`: nested `jax.jit`,
`closed_call`, `custom_jvp`/`custom_vjp` and `jax.checkpoint` bodies are
inlined (their equations become top-level ones, with the caller's name stack
in front of theirs, and the call's name too unless it is the whole step,
like the jit that stages it; a differentiated checkpoint's inputs first go through the
optimization barrier its own lowering would emit, so XLA still cannot merge
the recomputation into the forward pass), every value gets an integer id,
and literals and constants become `Const` atoms. Loops and branches (scan,
while, cond) stay single equations with their sub-jaxprs untouched.

Guarantees: the equations, in order, compute exactly what the jaxpr
computes; `Program.avals[i]` is the abstract
value of id `i`; equation indices are positions in that order, which is the
unit of every distance jlms talks about.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Union

from jlms import _compat, _rules
from jlms._names import common_scope, readable_name


@dataclasses.dataclass(frozen=True, eq=False)
class Const:
  """A value known when the program is built: a jaxpr literal, or an array
  the step closed over (which becomes a constant of the rewritten jaxpr)."""
  value: Any
  literal: Any = None  # the original Literal atom, when there is one


Atom = Union[int, Const]


@dataclasses.dataclass(frozen=True)
class Equation:
  eqn: Any  # the original JaxprEqn: primitive, params, source info, context
  inputs: tuple[Atom, ...]
  outputs: tuple[int, ...]
  name_stack: Any

  @property
  def primitive(self):
    return self.eqn.primitive

  def readable_name(self) -> str:
    """The name of what this equation makes, as `jlms._names` spells it. A
    loop or call is named after the scope its body runs in as well (a
    layer stack's `nn.scan` runs in "blocks": "_GPT/blocks/scan"), and a
    call that jlms made around a loop after that loop."""
    eqn = _loop_in_jlms_call(self.eqn) or self.eqn
    stack = "/".join(s for s in (str(self.name_stack), _inner_scope(eqn))
                     if s)
    return readable_name(stack, eqn.primitive.name)


def _inner_scope(eqn) -> str:
  """The scope that the named equations of `eqn`'s bodies share, jlms's
  own copies aside."""
  stacks = [str(_compat.name_stack(inner))
            for inner in _compat.body_equations(eqn)]
  return common_scope([s for s in stacks if s and not s.startswith("jlms")])


def _loop_in_jlms_call(eqn, depth: int = 3):
  """The loop inside `eqn` if `eqn` is a call that jlms traced around one
  (named "jlms_..."), else None."""
  name = _compat.call_name(eqn)
  if depth == 0 or name is None or not name.startswith("jlms_"):
    return None
  for inner in _compat.body_equations(eqn):
    if _rules.rule(inner.primitive).loop:
      return inner
    found = _loop_in_jlms_call(inner, depth - 1)
    if found is not None:
      return found
  return None


@dataclasses.dataclass(frozen=True)
class Program:
  invars: tuple[int, ...]
  outvars: tuple[Atom, ...]
  equations: tuple[Equation, ...]
  avals: tuple[Any, ...]  # id -> abstract value
  # Positions among `invars` that the step donates (jax.jit's
  # donate_argnums, per leaf): XLA gives their buffers to outputs.
  donated: tuple[int, ...] = ()

  def __len__(self) -> int:
    return len(self.equations)


def donation_pairs(program: Program) -> tuple[tuple[int, int], ...]:
  """(input position, output position) of each donated input and the
  output whose buffer it becomes: each donated input, in order, with the
  first output not yet taken of the same shape and dtype (JAX goes output
  by output, taking the first donated input of its kind: the same pairs).
  JAX compares one device's shard of each where shardings are given; the
  simulator checks the sizes it counts (`_simulator.aliased_outputs`)."""
  if not program.donated:
    return ()
  # The outputs of each shape and dtype, first first: each donated input
  # takes the first one left (linear in inputs and outputs; the simulator
  # asks once per trial of a fit).
  untaken = collections.defaultdict(collections.deque)
  for out_position, atom in enumerate(program.outvars):
    if isinstance(atom, int):
      out = program.avals[atom]
      untaken[out.shape, out.dtype].append(out_position)
  pairs = []
  for position in sorted(program.donated):
    aval = program.avals[program.invars[position]]
    left = untaken.get((aval.shape, aval.dtype))
    if left and _compat.has_plain_layout(aval):
      pairs.append((position, left.popleft()))
  return tuple(pairs)


def flatten(closed_jaxpr, inline_calls: bool = True) -> Program:
  """Flattens `closed_jaxpr` into a `Program` (see the module docstring)."""
  avals: list = []
  equations: list[Equation] = []

  def new_id(aval) -> int:
    avals.append(aval)
    return len(avals) - 1

  def read(env, atom) -> Atom:
    if isinstance(atom, _compat.Literal):
      return Const(atom.val, literal=atom)
    return env[atom]

  def walk(jaxpr, consts, args: list[Atom], name_stack,
           whole: bool = False) -> list[Atom]:
    env: dict = {}
    for var, const in zip(jaxpr.constvars, consts):
      env[var] = Const(const)
    for var, arg in zip(jaxpr.invars, args):
      env[var] = arg
    for eqn in jaxpr.eqns:
      inputs = [read(env, v) for v in eqn.invars]
      stack = name_stack + _compat.name_stack(eqn)
      if inline_calls and eqn.primitive is _compat.remat_p:
        inputs = _barrier_remat_inputs(eqn, inputs, stack, new_id, equations)
        body, body_consts = _compat.remat_body(eqn)
        results = walk(body, body_consts, inputs,
                       _compat.extend_name_stack(stack, "checkpoint"))
        for var, result in zip(eqn.outvars, results):
          env[var] = result
        continue
      if inline_calls and _is_inlinable(eqn):
        body, body_consts = _compat.call_body(eqn)
        inner_stack = stack
        name = _compat.call_name(eqn)
        # A call that is the whole step (jlms's jit of it, or the user's own
        # jit) would put its name in front of every equation's.
        whole_step = whole and len(jaxpr.eqns) == 1
        if name is not None and not whole_step:
          inner_stack = _compat.extend_name_stack(stack, name)
        results = walk(body, body_consts, inputs, inner_stack, whole_step)
        for var, result in zip(eqn.outvars, results):
          env[var] = result
        continue
      outputs = tuple(new_id(v.aval) for v in eqn.outvars)
      for var, out in zip(eqn.outvars, outputs):
        if not isinstance(var, _compat.DropVar):
          env[var] = out
      equations.append(Equation(eqn, tuple(inputs), outputs, stack))
    return [read(env, v) for v in jaxpr.outvars]

  jaxpr, consts = _compat.jaxpr_parts(closed_jaxpr)
  invars = tuple(new_id(v.aval) for v in jaxpr.invars)
  outvars = walk(jaxpr, consts, list(invars), _compat.empty_name_stack(),
                 whole=True)
  return Program(invars, tuple(outvars), tuple(equations), tuple(avals))


def scan_body(eqn) -> tuple[Program, list]:
  """A scan equation's body as a flat program whose inputs are the body's
  own constants, then its consts, carries and scanned slices; and those
  constants' values."""
  layout = _compat.scan_layout(eqn)
  jaxpr, consts = _compat.jaxpr_parts(layout.body)
  closed = _compat.closed_jaxpr(
      [], [], list(jaxpr.constvars) + list(jaxpr.invars), jaxpr.outvars,
      jaxpr.eqns, jaxpr.debug_info)
  return flatten(closed), consts


def _barrier_remat_inputs(eqn, inputs, stack, new_id, equations) -> list:
  """`inputs` of checkpoint `eqn`, the CSE-protected ones replaced by the
  outputs of one optimization barrier appended to `equations`."""
  positions = [i for i in _compat.remat_barrier_positions(eqn)
               if isinstance(inputs[i], int)
               and _compat.passes_a_barrier(eqn.invars[i].aval)]
  if not positions:
    return list(inputs)
  avals = [eqn.invars[i].aval for i in positions]
  outputs = tuple(new_id(aval) for aval in avals)
  template = _compat.barrier_equation(
      [_compat.new_var(a) for a in avals], [_compat.new_var(a) for a in avals],
      eqn, "checkpoint")
  equations.append(Equation(template, tuple(inputs[i] for i in positions),
                            outputs, stack))
  inputs = list(inputs)
  for i, out in zip(positions, outputs):
    inputs[i] = out
  return inputs


def _is_inlinable(eqn) -> bool:
  if not _rules.rule(eqn.primitive).inlined_call:
    return False
  if _compat.is_jit_primitive(eqn.primitive):
    return _compat.jit_is_plain(eqn)
  return True
