"""Each parameter's update moved to where its gradient is made
(`jlms._update_order`): the same values, every update after what it
overwrites, one group per parameter, and the gradients no longer all held
at once."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jlms import _compat, _update_order
from jlms._config import OffloadConfig
from jlms._liveness import analyse
from jlms._program import flatten
from jlms._rewrite import rewrite
from jlms._simulator import simulate
from jlms_tests.conftest import F32_TOLERANCE, max_relative_error

LAYERS, WIDTH, BATCH = 4, 256, 8


def _adamw_step():
  """A deep MLP trained by optax's AdamW, its state donated: weights far
  larger than the batch's activations, so its peak is the gradients."""
  optimizer = optax.adamw(1e-3, weight_decay=0.01)

  def loss_fn(params, x):
    for w in params:
      x = jnp.tanh(x @ w)
    return jnp.mean(x ** 2)

  def step(params, opt_state, x):
    loss, grads = jax.value_and_grad(loss_fn)(params, x)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  keys = jax.random.split(jax.random.key(0), LAYERS + 1)
  params = [jax.random.normal(k, (WIDTH, WIDTH)) / WIDTH**0.5
            for k in keys[:LAYERS]]
  x = jax.random.normal(keys[-1], (BATCH, WIDTH))
  return step, (params, optimizer.init(params), x)


def _programs():
  step, args = _adamw_step()
  program = flatten(jax.make_jaxpr(step)(*args))
  # The parameters and the optimizer's state are donated, as `jlms.offload`
  # donates them for a step that donates its state.
  program = dataclasses.replace(program,
                                donated=tuple(range(len(program.invars) - 1)))
  return program, _update_order.updates_at_gradients(program), args


def _run(program, args):
  closed = rewrite(program, (), OffloadConfig())
  jaxpr, consts = _compat.jaxpr_parts(closed)
  return jax.jit(lambda *a: _compat.eval_jaxpr(jaxpr, consts, *a))(
      *jax.tree.leaves(args))


def test_the_moved_update_computes_what_the_step_computes():
  program, moved, args = _programs()
  assert moved is not program
  assert sorted(map(id, moved.equations)) == sorted(map(id, program.equations))
  for want, got in zip(_run(program, args), _run(moved, args)):
    assert max_relative_error(np.asarray(got), np.asarray(want)) \
        <= F32_TOLERANCE


def test_every_equation_follows_its_inputs_and_updates_follow_their_reads():
  _, moved, _ = _programs()
  made_at = {}
  tail = _update_order.update_tail(moved)
  for index, equation in enumerate(moved.equations):
    for atom in equation.inputs:
      if isinstance(atom, int) and atom not in moved.invars:
        assert made_at[atom] < index
    made_at.update(dict.fromkeys(equation.outputs, index))
  # A parameter or a moment is overwritten only after its last other read.
  for index in tail:
    for atom in moved.equations[index].inputs:
      if isinstance(atom, int) and atom in moved.invars:
        later = [i for i, e in enumerate(moved.equations)
                 if i > index and i not in tail and atom in e.inputs]
        assert not later, (index, later)


def test_the_gradients_are_no_longer_held_all_at_once():
  program, moved, _ = _programs()
  before = simulate(program, analyse(program)).peak_bytes
  after = simulate(moved, analyse(moved)).peak_bytes
  # The last layers' updates run while the first layers' gradients are
  # still to be made: at least one weight's gradient less at the peak.
  assert after <= before - WIDTH * WIDTH * 4, (before, after)


def test_the_update_of_each_parameter_is_a_group_of_its_own():
  program, moved, _ = _programs()
  # Adam's bias corrections are scalars that every update reads; they do
  # not join the parameters' updates into one.
  outputs = [a for a in program.outvars if isinstance(a, int)]
  new_params = outputs[:LAYERS]
  position = {id(e): i for i, e in enumerate(moved.equations)}
  made_at = {v: position[id(e)] for e in program.equations for v in e.outputs}
  positions = sorted(made_at[v] for v in new_params)
  # The new weights are made at LAYERS different places, the last layer's
  # (whose gradient the backward pass makes first) earliest.
  assert len(set(positions)) == LAYERS
  assert made_at[new_params[-1]] == positions[0]


def test_the_update_is_held_in_place_only_where_it_is_a_share_of_the_peak():
  program, moved, _ = _programs()
  # The weights and Adam's two moments: 3 x LAYERS x WIDTH^2 float32.
  written = 3 * LAYERS * WIDTH * WIDTH * 4
  assert _update_order.worth_holding_in_place(moved, 32 * written)
  assert not _update_order.worth_holding_in_place(moved, 32 * written + 4096)


def test_updates_move_before_an_embeddings_scatter_add():
  """An embedding's gradient is a scatter-add, an equation with a body of
  its own (its combiner) but no loop: the updates of the layers after it
  still move to their gradients."""
  optimizer = optax.adam(1e-3)
  vocab = 64

  def loss_fn(params, tokens):
    table, *layers = params
    x = table[tokens]
    for w in layers:
      x = jnp.tanh(x @ w)
    return jnp.mean(x ** 2)

  def step(params, opt_state, tokens):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  keys = jax.random.split(jax.random.key(0), LAYERS + 1)
  params = [jax.random.normal(keys[0], (vocab, WIDTH))] + [
      jax.random.normal(k, (WIDTH, WIDTH)) / WIDTH**0.5 for k in keys[1:]]
  tokens = jnp.arange(BATCH * 4).reshape(BATCH, 4) % vocab
  program = flatten(jax.make_jaxpr(step)(params, optimizer.init(params),
                                         tokens))
  program = dataclasses.replace(program,
                                donated=tuple(range(len(program.invars) - 1)))
  moved = _update_order.updates_at_gradients(program)
  scatter = [i for i, e in enumerate(moved.equations)
             if "scatter" in e.primitive.name]
  assert scatter
  tail = _update_order.update_tail(moved)
  assert sum(i < scatter[-1] for i in tail) >= LAYERS - 1


def test_an_update_into_new_buffers_stays_where_the_step_has_it():
  """Where the step donates nothing, an update moved earlier would hold
  its new parameter and moments beside the old ones: no group moves."""
  program, _, _ = _programs()
  undonated = dataclasses.replace(program, donated=())
  moved = _update_order.updates_at_gradients(undonated)
  outputs = {a for a in program.outvars if isinstance(a, int)}

  def places(p):
    """For each equation writing a step output, how many equations
    outside the update tail run before it."""
    tail = _update_order.update_tail(p)
    seen, found = 0, {}
    for index, equation in enumerate(p.equations):
      if index not in tail:
        seen += 1
      elif set(equation.outputs) & outputs:
        found[id(equation.eqn)] = seen
    return found

  assert places(moved) == places(undonated)
