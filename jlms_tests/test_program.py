"""Flattening a jaxpr into a numbered program."""

import jax
import jax.numpy as jnp

from jlms import _compat
from jlms._program import Const, flatten


def _primitive_names(program):
  return [e.primitive.name for e in program.equations]


def test_nested_jits_are_inlined_with_their_names():
  @jax.jit
  def inner(x):
    return jnp.sin(x) * 2.0

  def outer(x):
    return inner(inner(x)) + 1.0

  closed = jax.make_jaxpr(outer)(jnp.ones(3))
  assert any(_compat.is_jit_primitive(e.primitive) for e in closed.jaxpr.eqns)
  program = flatten(closed)
  assert _primitive_names(program) == ["sin", "mul", "sin", "mul", "add"]
  assert "inner" in program.equations[0].readable_name()
  # The second call's sin reads the first call's mul.
  assert program.equations[2].inputs == program.equations[1].outputs


def test_higher_order_primitives_stay_whole():
  def f(x):
    y, _ = jax.lax.scan(lambda c, _: (c * 2.0, None), x, None, length=4)
    return jax.lax.cond(y.sum() > 0, jnp.sin, jnp.cos, y)

  program = flatten(jax.make_jaxpr(f)(jnp.ones(3)))
  names = _primitive_names(program)
  assert "scan" in names and "cond" in names


def test_literals_and_closed_over_arrays_become_consts():
  table = jnp.arange(3.0)
  program = flatten(jax.make_jaxpr(lambda x: x * 3.0 + table)(jnp.ones(3)))
  consts = [a for e in program.equations for a in e.inputs
            if isinstance(a, Const)]
  assert len(consts) == 2
  assert all(a.value is not None for a in consts)


def test_output_that_is_an_input_is_kept():
  program = flatten(jax.make_jaxpr(lambda x, y: (y, x + 1.0))(1.0, 2.0))
  assert program.outvars[0] == program.invars[1]
  assert len(program) == 1
