"""Flax steps under jlms: a linen `TrainState` step (BatchNorm statistics,
dropout RNG, `apply_gradients`) and an NNX step (`nnx.Module` +
`nnx.Optimizer`, via `jlms.offload_nnx`) give jax.jit's / nnx.jit's results."""

import flax.linen as nn
import jax
import pytest
import numpy as np
import optax
from flax import nnx
from flax.training import train_state

import jlms
from jlms_tests import _doc_setups
from jlms_tests.conftest import F32_TOLERANCE, max_relative_error

_SMALL = dict(min_bytes=1 << 10, swapout_threshold=4)  # offload something


class _Net(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool):
    for width in (64, 64):
      # No bias before BatchNorm: its gradient is zero up to rounding, which
      # Adam would turn into updates made of rounding noise.
      x = nn.Dense(width, use_bias=False)(x)
      x = nn.BatchNorm(use_running_average=not train)(x)
      x = nn.relu(x)
      x = nn.Dropout(0.2, deterministic=not train)(x)
    return nn.Dense(10)(x)


class _State(train_state.TrainState):
  batch_stats: dict
  dropout_key: jax.Array


def _linen_step(state, images, labels):
  step_key = jax.random.fold_in(state.dropout_key, state.step)

  def loss_fn(params):
    logits, updates = state.apply_fn(
        {"params": params, "batch_stats": state.batch_stats}, images,
        train=True, mutable=["batch_stats"], rngs={"dropout": step_key})
    loss = optax.softmax_cross_entropy_with_integer_labels(
        logits, labels).mean()
    return loss, updates["batch_stats"]

  (loss, batch_stats), grads = jax.value_and_grad(
      loss_fn, has_aux=True)(state.params)
  state = state.apply_gradients(grads=grads, batch_stats=batch_stats)
  return state, loss


@pytest.mark.slow  # a few seconds: the quick tier stays within 2 minutes
def test_linen_train_state_step_matches_jit():
  model = _Net()
  images = jax.random.normal(jax.random.key(1), (256, 32))
  labels = jax.random.randint(jax.random.key(2), (256,), 0, 10)
  variables = model.init(jax.random.key(0), images, train=False)
  state = _State.create(apply_fn=model.apply, params=variables["params"],
                        tx=optax.adamw(1e-3),
                        batch_stats=variables["batch_stats"],
                        dropout_key=jax.random.key(3))
  step = jlms.offload(_linen_step, **_SMALL)
  assert step.plan(state, images, labels).offloaded
  expected_state, offloaded_state = state, state
  for _ in range(3):
    expected_state, expected_loss = jax.jit(_linen_step)(
        expected_state, images, labels)
    offloaded_state, loss = step(offloaded_state, images, labels)
    assert abs(float(loss) - float(expected_loss)) <= F32_TOLERANCE
  assert int(offloaded_state.step) == 3
  compare = lambda s: (s.params, s.batch_stats, s.opt_state)
  assert max_relative_error(compare(offloaded_state),
                            compare(expected_state)) <= F32_TOLERANCE


# The NNX model of docs/flax.md, as the docs' code blocks run it.
_NnxNet = _doc_setups.flax_nnx()["Model"]


def _nnx_step(model, optimizer, images, labels):
  def loss_fn(model):
    logits = model(images)
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, labels).mean()

  loss, grads = nnx.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  return loss


def _nnx_objects():
  model = _NnxNet(nnx.Rngs(0, dropout=1))
  return model, nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)


def test_nnx_step_matches_nnx_jit_and_updates_the_objects():
  images = jax.random.normal(jax.random.key(1), (256, 32))
  labels = jax.random.randint(jax.random.key(2), (256,), 0, 10)
  expected_model, expected_optimizer = _nnx_objects()
  model, optimizer = _nnx_objects()
  reference = nnx.jit(_nnx_step)
  step = jlms.offload_nnx(_nnx_step, **_SMALL)
  assert step.plan(model, optimizer, images, labels).offloaded
  before = np.asarray(model.hidden.kernel[...]).copy()
  for _ in range(3):
    expected_loss = reference(expected_model, expected_optimizer, images,
                              labels)
    loss = step(model, optimizer, images, labels)
    assert abs(float(loss) - float(expected_loss)) <= F32_TOLERANCE
  assert not np.array_equal(before, np.asarray(model.hidden.kernel[...]))
  # Parameters, BatchNorm statistics, optimizer state and step count, and
  # the dropout RNG counter all advanced as under nnx.jit.
  assert max_relative_error(nnx.state((model, optimizer)),
                            nnx.state((expected_model, expected_optimizer))
                            ) <= F32_TOLERANCE
