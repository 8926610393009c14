"""Whole copies of state on host pinned beside the backward pass
(`jlms._state_pins`, and `jlms._state.keep_state_on_host` with a target):
each fetch starts a margin of link time ahead of its read, each write-back
ends a margin after its update, one engine a direction; the pinned program
of a Python-loop stack equals jax.jit's over several steps. And the order
in which a budget's search moves moments to host (`jlms._state_order`)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jlms
from jlms import _compat, _state, _state_order, _thresholds
from jlms._cost import TARGETS, kernel_seconds
from jlms._liveness import analyse
from jlms._program import flatten
from jlms._schedule import predict_step_time
from jlms._state_pins import (LEAD_MARGIN, chain_times, fetch_times,
                              write_times)
from jlms._update_order import updates_at_gradients
from jlms_tests.conftest import max_relative_error

STEPS = 3


def test_a_fetch_is_issued_its_margin_of_link_time_before_its_read():
  [issued] = fetch_times([60.0], [5.0])
  assert issued == 60.0 - LEAD_MARGIN * 5.0


def test_fetches_queue_on_one_engine_the_last_read_first():
  # Two fetches of 5 s read 1 s apart: the earlier one must be done
  # before the later one starts on the engine, 4 s before its own read.
  first, second = fetch_times([61.0, 60.0], [5.0, 5.0])
  assert first == 61.0 - LEAD_MARGIN * 5.0
  assert second == 60.0 - LEAD_MARGIN * 9.0


def test_a_write_back_is_done_its_margin_after_its_update():
  done = write_times([20.0, 21.0], [5.0, 5.0])
  assert done[0] == 20.0 + LEAD_MARGIN * 5.0
  # The second queues behind the first on the engine: its copy ends at 30.
  assert done[1] == 21.0 + LEAD_MARGIN * 9.0


def test_the_critical_chain_is_timed_and_the_rest_is_not_pinned_to():
  """A chain of four kernels of 1 s, and beside it one of 1 s read by the
  third: that one could start at 0 or 1 s, so it is not on the chain;
  the update reading the first kernel's result is timed as soon as it
  can run, and is not on the chain either."""
  def step(x, w):
    a = jnp.tanh(x)          # 0
    b = jnp.tanh(a)          # 1
    side = jnp.exp(x)        # 2
    c = jnp.sum(b * side)    # 3, 4
    return c, w - a          # 5: the update, read by the outputs alone
  program = flatten(jax.make_jaxpr(step)(jnp.ones(4), jnp.ones(4)))
  starts, on_chain = chain_times(program, analyse(program),
                                 np.ones(len(program)))
  assert list(starts) == [0.0, 1.0, 0.0, 2.0, 3.0, 1.0]
  assert list(on_chain) == [True, True, False, True, True, False]


@pytest.fixture
def stream_small_leaves(monkeypatch):
  # The tests' leaves are KiB: copy them as leaves of MiB are.
  monkeypatch.setattr(_thresholds, "THRESHOLDS", dataclasses.replace(
      _thresholds.THRESHOLDS, streamed_leaf_min_bytes=1))


def _adam_step(w, m, v, g):
  m = 0.9 * m + 0.1 * g
  v = 0.999 * v + 0.001 * g * g
  return w - 0.01 * m / (jnp.sqrt(v) + 1e-8), m, v


def test_a_stacks_moments_on_host_are_pinned_whole_beside_later_layers(
    stream_small_leaves):
  """Four layers in a Python loop, their moments on host, each update
  where its gradient is made: each moment comes to the device whole
  through a barrier with a value made before its read (not in a loop at
  the step's end), and goes back through one with a value read after
  its update."""
  def step(ws, ms, vs, x):
    def loss(ws):
      y = x
      for w in ws:
        y = jnp.tanh(y @ w)
      return jnp.sum(y)
    grads = jax.grad(loss)(ws)
    updated = [_adam_step(*a) for a in zip(ws, ms, vs, grads)]
    return tuple(tuple(u[k] for u in updated) for k in range(3))

  # 65536 rows: a layer's matmuls take several times a moment's link
  # time, so the pins fall inside the backward pass.
  weights = [jax.ShapeDtypeStruct((256, 256), jnp.float32)] * 4
  program = flatten(jax.make_jaxpr(step)(
      weights, weights, weights, jax.ShapeDtypeStruct((65536, 256),
                                                      jnp.float32)))
  # All of the state donated and on host, as `jlms.offload` donates it.
  program = updates_at_gradients(dataclasses.replace(
      program, donated=tuple(range(12))))
  liveness = analyse(program)
  state = _state.host_state(program, liveness,
                            _state.state_pairs(program, range(12)))
  rewritten, copies, _ = _state.keep_state_on_host(
      program, state, target=TARGETS["h100"])
  assert not any(e.primitive is _compat.scan_p for e in rewritten.equations)
  fetched = [i for i, e in enumerate(rewritten.equations)
             if _compat.is_device_put(e.eqn) and _compat.is_host_aval(
                 rewritten.avals[e.inputs[0]])]
  # The weights come whole before the forward pass reads them; each
  # moment is fetched for its update alone.
  assert len(fetched) == 12
  producers = {v: i for i, e in enumerate(rewritten.equations)
               for v in e.outputs}
  barriers = [e for e in rewritten.equations
              if e.primitive is _compat.barrier_p]
  pinned = 0
  for index in fetched:
    source = rewritten.equations[index].inputs[0]
    # Through a barrier, unless it starts with the step.
    maker = producers.get(source)
    assert maker is None or rewritten.equations[
        maker].primitive is _compat.barrier_p
    pinned += maker is not None
  assert pinned >= 4
  moments = {rewritten.invars[p] for p in range(4, 12)}
  assert sum(rewritten.equations[i].inputs[0] not in moments
             for i in fetched) == 4 + pinned
  # Some write-backs are pinned before a later layer's backward.
  tied_outputs = {v for e in barriers for v in e.outputs}
  assert any(v in tied_outputs for v in rewritten.outvars)
  assert sum(c.to_device for c in copies) == 12 * 256 * 256 * 4
  assert sum(c.to_host for c in copies) == 12 * 256 * 256 * 4
  # The time model runs the pinned copies beside the kernels between
  # their issue and their wait; priced as waited for whole, they cost
  # their link time each way.
  h100 = TARGETS["h100"]
  kernel_s = kernel_seconds(rewritten, h100)
  beside, whole = (predict_step_time(
      rewritten, analyse(rewritten), kernel_s, target=target,
      state_copies=copies) for target in (
          h100, dataclasses.replace(h100, pinned_copies_hide=False)))
  leaf = h100.transfer_seconds(256 * 256 * 4)
  assert whole.exposed_transfer_s == pytest.approx(24 * leaf)
  assert beside.exposed_transfer_s < 0.5 * whole.exposed_transfer_s
  # Both count every byte that crosses the link.
  for time in (beside, whole):
    assert time.d2h_bytes == time.h2d_bytes == 12 * 256 * 256 * 4


def test_a_python_loop_stack_with_pinned_state_equals_jax_jit(
    stream_small_leaves):
  optimizer = optax.adamw(1e-3)

  def train_step(params, opt_state, x):
    def loss(ps):
      y = x
      for w in ps:
        y = y + jnp.tanh(y @ w["a"]) @ w["b"]
      return jnp.mean(y ** 2)
    value, grads = jax.value_and_grad(loss)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  keys = jax.random.split(jax.random.key(0), 8)
  params = [{"a": 0.1 * jax.random.normal(keys[2 * i], (64, 128)),
             "b": 0.1 * jax.random.normal(keys[2 * i + 1], (128, 64))}
            for i in range(4)]
  # 65536 rows: a layer's kernels outlast a leaf's link time, so that the
  # copies are pinned between them.
  x = jax.random.normal(jax.random.key(1), (65536, 64))
  args = (params, optimizer.init(params), x)
  step = jlms.offload(train_step, donate_argnums=(0, 1), budget="90%",
                      state_on_host=True, min_bytes=4096, target="h100")
  assert "optimization_barrier" in step.lower(*args).as_text()
  reference = jax.jit(train_step)
  copy = lambda tree: jax.tree.map(jnp.copy, tree)
  actual, expected = step.place(*copy(args)), copy(args)
  for _ in range(STEPS):
    *state, loss = step(*actual)
    *ref_state, ref_loss = reference(*expected)
    actual, expected = (*state, x), (*ref_state, x)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
  for a, e in zip(jax.tree.leaves(actual[:2]), jax.tree.leaves(expected[:2])):
    np.testing.assert_allclose(
        np.asarray(jax.device_put(a, jax.memory.Space.Device)),
        np.asarray(e), rtol=1e-5, atol=1e-6)
  assert step.plan(*actual).state_leaves > 0


def _moments_in_order(step, params, optimizer, x):
  """(the Adam moments' positions of each parameter of `step`'s flat
  inputs, by name; the groups of them in the order a budget's search
  moves them to host)."""
  opt_state = optimizer.init(params)
  program = flatten(jax.make_jaxpr(step)(params, opt_state, x))
  flat = jax.tree_util.tree_flatten_with_path((params, opt_state))[0]
  positions = {jax.tree_util.keystr(path): k
               for k, (path, _) in enumerate(flat)}
  moments_of = {name: tuple(sorted(positions[f"[1][0].{which}['{name}']"]
                                   for which in ("mu", "nu")))
                for name in params}
  every = sorted(p for pair in moments_of.values() for p in pair)
  groups = _state_order.hidden_updates_first(program, analyse(program),
                                             every)
  return moments_of, [tuple(sorted(g)) for g in groups]


def test_a_weights_two_moments_are_grouped_and_go_to_host_together(
    stream_small_leaves):
  """AdamW's two moments of one weight are updated by one run, so they go
  to host together: the budget search moves both moments of one weight
  at a time, not one moment each of two weights of the same size. No
  loop makes these gradients, so the moments' whole copies are pinned
  beside the backward pass, the smallest first."""
  params = {"a": jnp.ones((64, 128)), "b": jnp.ones((64, 128)),
            "small": jnp.ones((64, 32))}
  optimizer = optax.adamw(1e-3)

  def loss(p, x):
    hidden = jnp.tanh(x @ p["a"].T) * jnp.tanh(x @ p["b"].T)
    return jnp.sum(hidden @ p["small"])

  def step(params, opt_state, x):
    grads = jax.grad(loss)(params, x)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  moments_of, groups = _moments_in_order(step, params, optimizer,
                                         jnp.ones((4, 128)))
  assert sorted(groups) == sorted(moments_of.values())
  assert groups[0] == moments_of["small"]
  assert groups[-1] in (moments_of["a"], moments_of["b"])


def test_moments_updated_in_the_backward_loop_go_to_host_first(
    stream_small_leaves):
  """A layer stack run by `lax.scan` and a head beside it, four times the
  stack's bytes: the stack's moments, whose update runs inside the
  backward loop (its slices cross beside the loop's kernels), go to host
  before the head's, whose whole copies are pinned."""
  optimizer = optax.adam(1e-3)

  def step(params, opt_state, x):
    def loss(p):
      y, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x,
                          p["stack"])
      return jnp.sum(y @ p["head"])
    grads = jax.grad(loss)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  params = {"stack": jnp.ones((4, 64, 64)), "head": jnp.ones((64, 1024))}
  moments_of, groups = _moments_in_order(step, params, optimizer,
                                         jnp.ones((8, 64)))
  assert groups == [moments_of["stack"], moments_of["head"]]


@pytest.mark.xdist_group("tiny_llama_pinned")
def test_a_tiny_llama_with_pinned_state_equals_jax_jit(stream_small_leaves):
  """`transformers`' Flax Llama at a tiny size, its layers a Python loop,
  planned for an H100's budget with its state on host: the plan pins its
  state's whole copies beside the backward pass (the plan of the 8B at
  batch 4), and three steps of it equal jax.jit's. AdamW's rounding
  differs between two legal compiles (see test_sharding), so float32
  is held to 1e-4 of each leaf's largest value, where a wrong gradient
  moves a parameter by a whole step."""
  from benchmarks.real_models import REAL_MODELS
  real = REAL_MODELS["llama"]("tiny", batch=2)
  step = real.offload(budget="90%", target="h100", state_on_host=True,
                      min_bytes=1024)
  plan = step.plan(*real.make_args())
  assert plan.state_leaves > 0 and plan.state_copies_pinned > 0
  expected_args, actual_args = real.make_args(), step.place(
      *real.make_args())
  reference = real.jitted()
  for _ in range(STEPS):
    expected = reference(*expected_args)
    actual = step(*actual_args)
    expected_args = real.next_args(expected_args, expected)
    actual_args = real.next_args(actual_args, actual)
  on_device = jax.tree.map(
      lambda a: jax.device_put(a, jax.memory.Space.Device), actual)
  assert max_relative_error(on_device, expected) <= 1e-4
