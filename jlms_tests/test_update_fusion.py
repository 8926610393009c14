"""The optimizer's update run inside the backward loop (`jlms._update_fusion`):
which runs fuse, what the fused loop makes and moves, and that the
program computes what the step computes."""

import dataclasses
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jlms
from jlms import _compat, _state, _thresholds
from jlms._config import OffloadConfig
from jlms._liveness import analyse
from jlms._loops import find_scan_residuals
from jlms._program import flatten
from jlms._rewrite import rewrite

LAYERS, WIDTH = 4, 16


@pytest.fixture(autouse=True)
def stream_small_leaves(monkeypatch):
  # The leaves here are KiB: stream them anyway.
  monkeypatch.setattr(_thresholds, "THRESHOLDS", dataclasses.replace(
      _thresholds.THRESHOLDS, streamed_leaf_min_bytes=1))


def _adam_step(clip: bool):
  """A step whose layers run under `lax.scan`, with Adam's update of the
  stacked weights: moment `m` (kept on host by the tests), `v` and the
  weights on the device, bias corrections from the step count; with
  `clip`, the gradient scaled by its global norm first. A bias shared by
  the layers is updated by SGD."""
  def step(w, m, v, count, b, x):
    def loss(w, b):
      def layer(h, wi):
        return jnp.tanh(h @ wi + b), None
      h, _ = jax.lax.scan(layer, x, w)
      return jnp.sum(h ** 2)

    g, gb = jax.grad(loss, argnums=(0, 1))(w, b)
    if clip:
      g = g * jnp.minimum(1.0, 1.0 / jnp.sqrt(jnp.sum(g * g)))
    count = count + 1.0
    m = 0.9 * m + 0.1 * g
    v = 0.99 * v + 0.01 * g * g
    update = (m / (1 - 0.9 ** count)) / (
        jnp.sqrt(v / (1 - 0.99 ** count)) + 1e-8)
    return w - 1e-2 * update, m, v, count, b - 1e-2 * gb

  return step


def _arguments(layers: int = LAYERS):
  keys = jax.random.split(jax.random.key(0), 5)
  shape = (layers, WIDTH, WIDTH)
  return (0.3 * jax.random.normal(keys[0], shape),
          0.01 * jax.random.normal(keys[1], shape),
          jnp.abs(0.01 * jax.random.normal(keys[2], shape)),
          jnp.float32(3.0), 0.1 * jax.random.normal(keys[4], (WIDTH,)),
          jax.random.normal(keys[3], (2, WIDTH)))


def _moment_on_host(step):
  """The step's program and the rewrite with its moment `m` on host and
  the rest of its state on the device."""
  program = flatten(jax.make_jaxpr(step)(*_arguments()))
  state = _state.HostState(inputs=(1,), outputs=(1,),
                           on_device=((0, 0), (2, 2), (3, 3), (4, 4)))
  rewritten, copies, _ = _state.keep_state_on_host(program, state)
  return program, rewritten, copies


def _loops(program):
  return [e for e in program.equations
          if e.primitive is _compat.scan_p
          or _compat.is_jit_primitive(e.primitive)]


def _run(rewritten, step, on_host=1):
  closed = rewrite(rewritten, (), OffloadConfig())
  args = _arguments()
  placed = list(args)
  placed[on_host] = jax.device_put(args[on_host], jax.memory.Space.Host)
  got = jax.jit(lambda *a: _compat.eval_jaxpr(
      closed.jaxpr, closed.consts, *a))(*placed)
  want = jax.jit(step)(*args)
  for g, w in zip(got, want):
    np.testing.assert_allclose(
        np.asarray(jax.device_put(g, jax.memory.Space.Device)),
        np.asarray(w), rtol=1e-6, atol=1e-7)


def test_the_update_runs_in_the_loop_that_makes_the_gradient():
  step = _adam_step(clip=False)
  program, rewritten, copies = _moment_on_host(step)
  # Forward and backward loops, and no update loop of their own.
  assert len(_loops(program)) == 2
  assert len(_loops(rewritten)) == 2
  (copy,) = copies
  backward = rewritten.equations[copy.index]
  assert backward is _loops(rewritten)[1]
  leaf = LAYERS * WIDTH * WIDTH * 4
  # The moment crosses once each way, and one slice twice (fetched again
  # at the end, written back unchanged at the start).
  assert (copy.to_device, copy.to_host) == (leaf + leaf // LAYERS,) * 2
  # Inside the loop both run beside its kernels; the slices at its edges
  # do not.
  assert (copy.to_device_beside, copy.to_host_beside) == (leaf, leaf)
  # The loop makes the three updated leaves and no gradient stack.
  stacks = [v for v in backward.outputs
            if tuple(rewritten.avals[v].shape) == (LAYERS, WIDTH, WIDTH)]
  assert sorted(stacks) == sorted(rewritten.outvars[:3])
  assert _compat.is_host_aval(rewritten.avals[rewritten.outvars[1]])
  _run(rewritten, step)


def test_an_update_that_reads_the_whole_gradient_keeps_its_own_loop():
  # Clipping by the global norm needs every layer's gradient before any
  # layer's update: the update cannot run in the backward loop.
  step = _adam_step(clip=True)
  program, rewritten, copies = _moment_on_host(step)
  assert len(_loops(rewritten)) == len(_loops(program)) + 1
  assert all(rewritten.equations[c.index] not in _loops(program)
             for c in copies)
  _run(rewritten, step)


def test_the_updates_of_state_on_the_device_run_in_the_loop_too():
  # Only the bias on host, which no loop updates: the weights' and both
  # moments' updates still run in the backward loop, in place, and their
  # gradient stack is not made.
  step = _adam_step(clip=False)
  program = flatten(jax.make_jaxpr(step)(*_arguments()))
  state = _state.HostState(inputs=(4,), outputs=(4,),
                           on_device=((0, 0), (1, 1), (2, 2), (3, 3)))
  rewritten, _, _ = _state.keep_state_on_host(program, state)
  assert len(_loops(rewritten)) == 2
  backward = _loops(rewritten)[1]
  stacks = [v for v in backward.outputs
            if tuple(rewritten.avals[v].shape) == (LAYERS, WIDTH, WIDTH)]
  assert sorted(stacks) == sorted(rewritten.outvars[:3])
  _run(rewritten, step, on_host=4)


def test_the_update_runs_in_a_backward_loop_that_streams_its_residuals():
  # The backward loop reads the forward's residuals from host, as a call
  # of a loop that prefetches them (`jlms._loops.prefetching_reader`): the
  # update runs in that call's loop.
  step = _adam_step(clip=False)
  program = flatten(jax.make_jaxpr(step)(*_arguments()))
  residuals = find_scan_residuals(program, analyse(program), OffloadConfig(
      min_bytes=1, swapout_threshold=0))
  assert residuals
  state = _state.HostState(inputs=(1,), outputs=(1,),
                           on_device=((0, 0), (2, 2), (3, 3), (4, 4)))
  rewritten, copies, streamed = _state.keep_state_on_host(program, state,
                                                          residuals)
  backward = _loops(rewritten)[1]
  assert _compat.call_name(backward.eqn) == "jlms_prefetching_scan"
  assert copies[0].index == rewritten.equations.index(backward)
  assert streamed[0].readers == (copies[0].index,)
  stacks = [v for v in backward.outputs
            if tuple(rewritten.avals[v].shape) == (LAYERS, WIDTH, WIDTH)]
  assert sorted(stacks) == sorted(rewritten.outvars[:3])
  _run(rewritten, step)


def test_the_plan_says_whose_updates_run_in_the_loop():
  # Sixteen layers: with four (JAX 0.12.0.1), the least memory with the
  # updates in the loop (17.95 KiB simulated) is no lower than jax.jit's
  # program (17.63, its transposes folded into the matmuls), and the step
  # runs as it is.
  step = _adam_step(clip=False)
  offloaded = jlms.offload(step, donate_argnums=(0, 1, 2, 3, 4),
                           budget="min", state_on_host=False)
  plan = offloaded.plan(*_arguments(16))
  assert plan.state_updated_in_loops == 3  # the weights and both moments
  assert plan.state_leaves == 0
  assert "the updates of 3 state leaves run inside the loops" in str(plan)
  got = offloaded(*jax.tree.map(jnp.copy, _arguments(16)))
  for g, w in zip(got, jax.jit(step)(*_arguments(16))):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6,
                               atol=1e-7)
