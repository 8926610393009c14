"""What users write around a model, each under the least-memory plan: three
steps equal `jax.jit`'s. A custom VJP, frozen parameters, optax's
hyperparameters as state, masked weight decay under a schedule, an
associative scan, remat by checkpoint names, a reversed unrolled scan,
several optimizer steps in a `fori_loop` and a typed PRNG key in the state.
Each small, on the CPU; `min_bytes=1` so that every value is a candidate."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.ad_checkpoint import checkpoint_name

import jlms
from jlms_tests.conftest import F32_TOLERANCE, max_relative_error

WIDTH, BATCH, LAYERS = 64, 16, 4


def _params(key):
  keys = jax.random.split(key, LAYERS + 1)
  return {"layers": [{"w": jax.random.normal(k, (WIDTH, WIDTH)) / 8,
                      "b": jnp.zeros(WIDTH)} for k in keys[:LAYERS]],
          "head": jax.random.normal(keys[-1], (WIDTH, 1)) / 8}


def _mlp_loss(params, x, y, activation=jnp.tanh):
  for layer in params["layers"]:
    x = activation(x @ layer["w"] + layer["b"]) + x
  return jnp.mean((x @ params["head"] - y) ** 2)


def _train_step(optimizer, loss=_mlp_loss):
  def step(params, opt_state, x, y):
    value, grads = jax.value_and_grad(loss)(params, x, y)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value
  return step


@jax.custom_vjp
def _swish(x):
  return x * jax.nn.sigmoid(x)


def _swish_forward(x):
  return _swish(x), x


def _swish_backward(x, g):
  s = jax.nn.sigmoid(x)
  return (g * (s + x * s * (1 - s)),)


_swish.defvjp(_swish_forward, _swish_backward)


def _custom_vjp():
  optimizer = optax.sgd(1e-2)
  return _train_step(optimizer, functools.partial(
      _mlp_loss, activation=_swish)), optimizer.init


def _frozen_head():
  # A fine-tune of the layers alone (LoRA-like): the head's updates are
  # zero and it has no optimizer state.
  def labels(params):
    return {"layers": [{"w": "train", "b": "train"} for _ in params["layers"]],
            "head": "frozen"}
  optimizer = optax.multi_transform(
      {"train": optax.adam(1e-3), "frozen": optax.set_to_zero()}, labels)
  return _train_step(optimizer), optimizer.init


def _hyperparameters_in_state():
  optimizer = optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3,
                                                    weight_decay=1e-2)
  return _train_step(optimizer), optimizer.init


def _masked_decay_on_a_schedule():
  def matrices(params):
    return jax.tree.map(lambda p: p.ndim > 1, params)
  optimizer = optax.chain(
      optax.clip_by_global_norm(1.0), optax.scale_by_adam(),
      optax.add_decayed_weights(1e-2, matrices),
      optax.scale_by_schedule(optax.warmup_cosine_decay_schedule(
          0.0, 1e-3, 2, 10)),
      optax.scale(-1.0))
  return _train_step(optimizer), optimizer.init


def _associative_scan():
  def loss(params, x, y):
    gate = jax.nn.sigmoid(x @ params["layers"][0]["w"])
    value = x @ params["layers"][1]["w"]

    def combine(left, right):
      return left[0] * right[0], right[0] * left[1] + right[1]
    _, h = jax.lax.associative_scan(combine, (gate, value), axis=0)
    return jnp.mean((h @ params["head"] - y) ** 2)
  optimizer = optax.sgd(1e-2)
  return _train_step(optimizer, loss), optimizer.init


def _remat_by_names():
  def layer(params, x):
    h = checkpoint_name(x @ params["w"], "projection")
    return jnp.tanh(h + params["b"]) + x
  remat_layer = jax.checkpoint(
      layer, policy=jax.checkpoint_policies.save_only_these_names(
          "projection"))

  def loss(params, x, y):
    for layer_params in params["layers"]:
      x = remat_layer(layer_params, x)
    return jnp.mean((x @ params["head"] - y) ** 2)
  optimizer = optax.adam(1e-3)
  return _train_step(optimizer, loss), optimizer.init


def _reversed_unrolled_scan():
  def loss(params, x, y):
    stacked = jnp.stack([layer["w"] for layer in params["layers"]])

    def body(h, w):
      return jnp.tanh(h @ w) + h, jnp.sum(h)
    h, sums = jax.lax.scan(body, x, stacked, unroll=2, reverse=True)
    return jnp.mean((h @ params["head"] - y) ** 2) + 1e-3 * jnp.sum(sums)
  optimizer = optax.sgd(1e-2)
  return _train_step(optimizer, loss), optimizer.init


def _steps_in_a_fori_loop():
  optimizer = optax.sgd(1e-2)
  inner = _train_step(optimizer)

  def step(params, opt_state, x, y):
    def body(_, carry):
      return inner(carry[0], carry[1], x, y)
    return jax.lax.fori_loop(0, 3, body, (params, opt_state, jnp.zeros(())))
  return step, optimizer.init


def _typed_key_in_state():
  optimizer = optax.sgd(1e-2)

  def step(params, state, x, y):
    opt_state, key = state
    key, dropout_key = jax.random.split(key)

    def loss(params):
      h = x
      for i, layer in enumerate(params["layers"]):
        h = jnp.tanh(h @ layer["w"])
        keep = jax.random.bernoulli(jax.random.fold_in(dropout_key, i), 0.9,
                                    h.shape)
        h = jnp.where(keep, h / 0.9, 0)
      return jnp.mean((h @ params["head"] - y) ** 2)
    value, grads = jax.value_and_grad(loss)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), (opt_state, key), value

  def init(params):
    return optimizer.init(params), jax.random.key(7)
  return step, init


CONSTRUCTS = {
    "custom_vjp": _custom_vjp,
    "frozen_head": _frozen_head,
    "hyperparameters_in_state": _hyperparameters_in_state,
    "masked_decay_on_a_schedule": _masked_decay_on_a_schedule,
    "associative_scan": _associative_scan,
    "remat_by_names": _remat_by_names,
    "reversed_unrolled_scan": _reversed_unrolled_scan,
    "steps_in_a_fori_loop": _steps_in_a_fori_loop,
    "typed_key_in_state": _typed_key_in_state,
}


def _host(tree):
  def leaf(value):
    if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
      value = jax.random.key_data(value)
    return np.asarray(value)
  return jax.tree.map(leaf, tree)


def _three_steps(run, init):
  params = _params(jax.random.key(0))
  x = jax.random.normal(jax.random.key(1), (BATCH, WIDTH))
  y = jnp.sum(x, -1, keepdims=True) / 8
  args = (params, init(params), x, y)
  if hasattr(run, "place"):  # jlms's state goes where its plan keeps it
    args = run.place(*args)
  outputs = []
  for _ in range(3):
    out = run(*args)
    outputs.append(_host(out))
    args = (out[0], out[1], x, y)
  return outputs


@pytest.mark.parametrize("construct", sorted(CONSTRUCTS))
def test_the_least_memory_plan_runs_as_jax_jit(construct):
  step, init = CONSTRUCTS[construct]()
  expected = _three_steps(jax.jit(step, donate_argnums=(0, 1)), init)
  offloaded = jlms.offload(step, donate_argnums=(0, 1), budget="min",
                           min_bytes=1)
  params = _params(jax.random.key(0))
  plan = offloaded.plan(params, init(params),
                        jnp.zeros((BATCH, WIDTH)), jnp.zeros((BATCH, 1)))
  assert plan.recomputed or plan.offloaded, "the plan must change the step"
  actual = _three_steps(offloaded, init)
  for got, want in zip(actual, expected):
    assert max_relative_error(got, want) <= F32_TOLERANCE
