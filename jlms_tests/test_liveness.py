"""Liveness of a flat program."""

import jax
import jax.numpy as jnp
import numpy as np

from jlms._liveness import aval_nbytes, analyse, live_bytes_by_equation
from jlms._program import flatten


def _program(f, *args):
  return flatten(jax.make_jaxpr(f)(*args))


def test_producers_reads_and_sizes():
  def f(x):
    a = jnp.sin(x)      # 0
    b = jnp.cos(x)      # 1
    c = a * b           # 2
    return c + a, b     # 3, outputs read at 4

  program = _program(f, jnp.ones((8, 4), jnp.float32))
  live = analyse(program)
  x = program.invars[0]
  a, b, c = (program.equations[i].outputs[0] for i in range(3))
  assert live.producer[x] == -1 and live.producer[c] == 2
  assert live.uses[x] == (0, 1)
  assert live.uses[a] == (2, 3)
  assert live.uses[b] == (2, 4)  # read by the mul and by the outputs
  assert live.last_use(c) == 3
  assert live.nbytes[a] == 8 * 4 * 4
  assert live.end == 4


def test_repeated_reads_by_one_equation_count_once():
  program = _program(lambda x: x * x, jnp.ones(3))
  assert analyse(program).uses[program.invars[0]] == (0,)


def test_a_token_has_no_size():
  assert aval_nbytes(jax.typeof(jax.lax.create_token())) == 0
  assert aval_nbytes(jax.typeof(jnp.ones((2, 3), jnp.bfloat16))) == 12


def test_live_bytes_follow_the_jaxpr_order():
  def f(x):
    a = x * 2.0
    b = a * 3.0
    return b * 4.0

  program = _program(f, jnp.ones(256, jnp.float32))  # 1 KiB each
  live = live_bytes_by_equation(analyse(program))
  # x lives through equation 0 only; each step holds its input and output.
  np.testing.assert_array_equal(live, [2048, 2048, 2048, 1024])


def test_typed_prng_keys_are_sized_as_their_key_data():
  """A typed key array takes on the device what its data does (two uint32
  a threefry key): it was counted as nothing, and a step carrying a
  million keys was predicted 16 MiB under jax.jit's peak (found by
  fuzzing)."""
  typed = jax.eval_shape(lambda: jax.random.split(jax.random.key(0), 1024))
  legacy = jax.eval_shape(lambda: jax.random.split(jax.random.PRNGKey(0), 1024))
  assert aval_nbytes(typed) == aval_nbytes(legacy) == 1024 * 8
