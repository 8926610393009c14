"""Python traced into a `Program`'s equations: the one way passes build jaxpr.

A pass that rewrites a loop or a run of equations writes the new code as
Python on public JAX (`jax.lax.scan`, `jax.device_put`, ...) and lets JAX
trace it, so that JAX writes every parameter. Two shapes of result:

- `traced_equations`: the equations JAX traced, spliced into the program as
  they are. Whatever JAX makes of the Python is accepted: closed-over
  constants, several equations, inputs read in another order, once for
  several arguments, or not at all. Each traced input maps back to the
  program atom it was traced for, each constant to a `Const`, each new
  value to a new id.
- `traced_call`: the Python staged as one nested-jit call equation (its
  body is free to be anything), some of its inputs taken from host memory.

Guarantees: the equations compute what the Python computes on the atoms
given; an output that JAX forwarded from an input (or a literal) is
returned as that atom, so a caller that must keep its output ids sees
`Retraced.forwarded` and can refuse; nothing here asserts the shape of
JAX's trace.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax

from jlms import _compat
from jlms._program import Atom, Const, Equation


@dataclasses.dataclass(frozen=True)
class Retraced:
  """Equations traced from Python, over a program's atoms."""
  equations: tuple[Equation, ...]
  outputs: tuple[Atom, ...]  # what the Python returned, as program atoms
  new_avals: tuple  # avals of the new ids, in order from `first_id`
  first_id: int

  @property
  def forwarded(self) -> bool:
    """Whether some output is not made by a traced equation (an input or
    a constant passed through)."""
    made = {v for e in self.equations for v in e.outputs}
    return any(not isinstance(o, int) or o not in made for o in self.outputs)


def atom_aval(atom: Atom, avals):
  """The abstract value of `atom`, a program id (of `avals`) or a `Const`."""
  return (_compat.abstractify(atom.value) if isinstance(atom, Const)
          else avals[atom])


def atom_struct(atom: Atom, avals) -> jax.ShapeDtypeStruct:
  """The abstract array `atom` is traced as."""
  aval = atom_aval(atom, avals)
  return jax.ShapeDtypeStruct(aval.shape, aval.dtype,
                              weak_type=getattr(aval, "weak_type", False))


def traced_equations(fn: Callable, inputs: Sequence[Atom], avals,
                     name_stack, like=None,
                     output_ids: Sequence[int] | None = None) -> Retraced:
  """`fn(*inputs)` traced by `jax.make_jaxpr` into equations over program
  atoms, with new ids from `len(avals)` on (see `Retraced`). Each equation
  is under `name_stack`, with `like`'s source info and context when given.
  `output_ids`, when given, are the ids the outputs keep: each output made
  by a traced equation is written to that id instead of a new one."""
  traced = jax.make_jaxpr(fn)(*(atom_struct(a, avals) for a in inputs))
  jaxpr, consts = _compat.jaxpr_parts(traced)
  env: dict = dict(zip(jaxpr.invars, inputs))
  env.update((var, Const(value)) for var, value in zip(jaxpr.constvars,
                                                        consts))
  keep: dict = {}
  if output_ids is not None:
    for var, kept in zip(jaxpr.outvars, output_ids):
      if isinstance(var, _compat.Var) and var not in env and var not in keep:
        keep[var] = kept
  new_avals: list = []
  first_id = len(avals)

  def read(var) -> Atom:
    if isinstance(var, _compat.Literal):
      return Const(var.val, literal=var)
    return env[var]

  equations = []
  for eqn in jaxpr.eqns:
    outputs = []
    for var in eqn.outvars:
      if var in keep:
        out = keep[var]
      else:
        out = first_id + len(new_avals)
        new_avals.append(var.aval)
      if not isinstance(var, _compat.DropVar):
        env[var] = out
      outputs.append(out)
    if like is not None:
      eqn = eqn.replace(source_info=like.source_info, ctx=like.ctx)
    equations.append(Equation(eqn, tuple(read(v) for v in eqn.invars),
                              tuple(outputs), name_stack))
  return Retraced(tuple(equations), tuple(read(v) for v in jaxpr.outvars),
                  tuple(new_avals), first_id)


def host_aval(aval):
  """`aval` in host memory."""
  return _compat.memory_space_aval(aval, jax.memory.Space.Host)


def traced_call(call: Callable, avals, host_positions, name: str, like,
                invars=None, outvars=None):
  """A nested-jit equation named `name` whose body is `call` traced from
  Python on `avals`, with its inputs at `host_positions` host values.
  `call` is traced on device values, copied to host first; those copies
  are then cut off, so that the equation takes the host values themselves.
  It has `like`'s source info and context, and `invars` and `outvars` (new
  variables where None). A jit equation takes every argument in order,
  whatever its body reads, so its inputs are the caller's atoms as given."""
  host_positions = sorted(set(host_positions))

  def on_host_first(*args):
    args = list(args)
    for p in host_positions:  # cut off below
      args[p] = jax.device_put(args[p], jax.memory.Space.Host)
    return call(*args)

  device_avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]
  traced = jax.make_jaxpr(jax.jit(on_host_first))(*device_avals)
  outer = traced.jaxpr.eqns[0]
  inner = _compat.call_body_closed(outer)
  jaxpr = inner.jaxpr
  taken = [jaxpr.invars[p] for p in host_positions]
  cut = {}
  for candidate in jaxpr.eqns:
    if (_compat.is_device_put(candidate) and candidate.invars[0] in taken
        and candidate.invars[0] not in cut):
      cut[candidate.invars[0]] = candidate
  inner_invars = [cut[v].outvars[0] if v in cut else v
                  for v in jaxpr.invars]
  cut_ids = {id(e) for e in cut.values()}
  eqns = [e for e in jaxpr.eqns if id(e) not in cut_ids]
  new_inner = _compat.closed_jaxpr(jaxpr.constvars, inner.consts, inner_invars,
                                   jaxpr.outvars, eqns, jaxpr.debug_info)
  if invars is None:
    invars = [_compat.new_var(host_aval(a) if p in host_positions else a)
              for p, a in enumerate(avals)]
  return _compat.with_call_body(
      outer, new_inner, name, invars=invars,
      outvars=list(outer.outvars) if outvars is None else outvars,
      source_info=like.source_info, ctx=like.ctx)


def unwrapped_call(equation: Equation) -> Equation | None:
  """The one equation inside the nested-jit call `equation`, over the
  call's own atoms and writing its outputs, or None where the body is not
  exactly one equation that writes the call's outputs in order (constants
  closed over, an output forwarded from an input, several equations).

  A pass that finds loops by their primitive (`jlms._loops`) then sees the
  loop that `traced_call` wrapped; XLA inlines the call either way, so the
  compiled step is the same."""
  body = _compat.call_body_closed(equation.eqn)
  if body is None:
    return None
  jaxpr, consts = _compat.jaxpr_parts(body)
  if consts or jaxpr.constvars or len(jaxpr.eqns) != 1:
    return None
  inner = jaxpr.eqns[0]
  if list(jaxpr.outvars) != list(inner.outvars):
    return None
  position = {var: p for p, var in enumerate(jaxpr.invars)}
  inputs = []
  for var in inner.invars:
    if isinstance(var, _compat.Literal):
      inputs.append(Const(var.val, literal=var))
    elif var in position:
      inputs.append(equation.inputs[position[var]])
    else:
      return None
  return Equation(inner.replace(source_info=equation.eqn.source_info,
                                ctx=equation.eqn.ctx),
                  tuple(inputs), equation.outputs, equation.name_stack)
