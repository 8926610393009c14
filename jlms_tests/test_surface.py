"""What a newcomer meets first: the README's examples run on a CPU as
written, a step shows its settings, and a step jax cannot trace is
reported as jax.jit reports it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jlms


def train_step(state, batch):
  params, = state
  loss, grad = jax.value_and_grad(
      lambda p: jnp.mean(jnp.tanh(batch @ p) ** 2))(params)
  return (params - 0.1 * grad,), {"loss": loss}


def _state_and_batch():
  return (jnp.ones((64, 64)) / 64,), jnp.ones((32, 64))


@pytest.mark.parametrize("target", [None, "h100"])
def test_the_readme_state_on_host_example_runs_on_a_cpu(target):
  # As the README writes it.
  step = jlms.offload(train_step, donate_argnums=0, state_on_host=True,
                      target=target)
  state, batch = _state_and_batch()
  state, batch = step.place(state, batch)
  new_state, metrics = step(state, batch)

  expected_state, expected = jax.jit(train_step)(*_state_and_batch())
  np.testing.assert_allclose(new_state[0], expected_state[0], rtol=1e-6)
  np.testing.assert_allclose(metrics["loss"], expected["loss"], rtol=1e-6)


def test_a_step_shows_its_budget_and_target():
  shown = repr(jlms.offload(train_step, budget="20GiB", target="h100"))
  assert shown.startswith("jlms.offload(train_step, ")
  assert "budget='20GiB'" in shown and "target='h100'" in shown
  shown = repr(jlms.offload(train_step))
  assert "budget='device'" in shown and "target=None" in shown


def _branches_on_a_traced_value(w, batch):
  if jnp.sum(batch["x"]) > 0:
    return w * 2
  return w


def _returns_a_string(w, batch):
  return "not an array"


@pytest.mark.parametrize("step, named", [
    # jax.jit says "depends on the value of the argument batch['x']".
    (_branches_on_a_traced_value, "argument batch['x']"),
    (_returns_a_string, "<class 'str'>"),
])
def test_a_step_jax_cannot_trace_is_named_as_jax_jit_names_it(step, named):
  args = (jnp.ones(3), {"x": jnp.ones(3)})
  with pytest.raises((jax.errors.JAXTypeError, TypeError)) as raised:
    jlms.offload(step)(*args)
  said = "\n".join([str(raised.value), *getattr(raised.value, "__notes__", ())])
  assert step.__name__ in said and named in said
  assert "flat_fun" not in said
