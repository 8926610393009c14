"""Scan residuals streamed through host inside the loops (`jlms._loops`),
and the calls flattening sees through (checkpoint, custom_jvp/vjp)."""

import jax
import pytest
import jax.numpy as jnp
import optax

import jlms
from benchmarks import models
from jlms import _compat
from jlms._config import OffloadConfig
from jlms._liveness import analyse
from jlms._loops import find_scan_residuals, offload_scan_residuals
from jlms._program import flatten
from jlms._rewrite import rewrite
from jlms_tests.conftest import F32_TOLERANCE, max_relative_error

_EAGER = dict(min_bytes=1, swapout_threshold=4)


def _gpt_scan():
  return models.gpt_case(layers=3, width=64, heads=2, seq=32, batch=2,
                         vocab=128, scan_layers=True,
                         optimizer=optax.sgd(1e-2, momentum=0.9))


def test_residuals_are_the_forward_scans_stacks_read_by_the_backward_scan():
  case = _gpt_scan()
  closed = jax.make_jaxpr(case.step)(*case.abstract_args())
  program = flatten(closed)
  liveness = analyse(program)
  residuals = find_scan_residuals(program, liveness, OffloadConfig(**_EAGER))
  assert len(residuals) >= 10  # activations, attention weights, masks...
  for residual in residuals:
    producer = program.equations[residual.producer]
    assert producer.primitive is _compat.scan_p
    assert not _compat.scan_layout(producer.eqn).reverse  # the forward scan
    for reader in residual.readers:
      assert _compat.scan_layout(program.equations[reader].eqn).reverse
    assert program.avals[residual.value].shape[0] == 3  # one slice a layer

  streamed = offload_scan_residuals(program, residuals)
  for residual in residuals:
    assert _compat.is_host_aval(streamed.avals[residual.value])
    body = _compat.scan_layout(
        streamed.equations[residual.producer].eqn).body.jaxpr
    position = program.equations[residual.producer].outputs.index(
        residual.value)
    assert _compat.is_host_aval(body.outvars[position].aval)
  # Host stacks take no device bytes in the liveness analysis.
  assert all(analyse(streamed).nbytes[r.value] == 0 for r in residuals)
  _compat.check_jaxpr(rewrite(streamed, (), OffloadConfig(**_EAGER),
                               closed.jaxpr.debug_info))


def test_plan_marks_streamed_values_and_the_switch_turns_them_off():
  case = _gpt_scan()
  args = case.abstract_args()
  plan = jlms.offload(case.step, **_EAGER).plan(*args)
  streamed = [v for v in plan.offloaded if v.streamed]
  assert streamed and "scan residuals" in str(plan)
  assert all(v.shape[0] == 3 for v in streamed)
  off = jlms.offload(case.step, scan_residuals=False, **_EAGER).plan(*args)
  assert not any(v.streamed for v in off.offloaded)
  # Without streaming, the stacks are offloaded whole at the top level.
  assert {v.shape for v in off.offloaded} >= {v.shape for v in streamed}


def _fori_loss(params, x):
  def layer(i, h):
    return jnp.tanh(h @ params["w"][i]) * params["scale"][i]
  h = jax.lax.fori_loop(0, params["w"].shape[0], layer, x)
  return jnp.mean(h ** 2)


def test_fori_loop_step_streams_and_matches_jit():
  key_w, key_x = jax.random.split(jax.random.key(0))
  params = {"w": jax.random.normal(key_w, (6, 64, 64)) / 8,
            "scale": jnp.linspace(0.5, 1.5, 6)}
  x = jax.random.normal(key_x, (32, 64))

  def step(params, x):
    loss, grads = jax.value_and_grad(_fori_loss)(params, x)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss

  offloaded = jlms.offload(step, **_EAGER)
  assert any(v.streamed for v in offloaded.plan(params, x).offloaded)
  assert max_relative_error(offloaded(params, x),
                            jax.jit(step)(params, x)) <= F32_TOLERANCE


def test_checkpoint_is_inlined_behind_its_cse_barrier():
  def loss(w, x):
    layer = jax.checkpoint(lambda w, h: jnp.sin(h @ w) @ w)
    return jnp.sum(layer(w, layer(w, x)) ** 2)

  w = jax.random.normal(jax.random.key(0), (32, 32)) / 4
  x = jnp.ones((8, 32))
  step = lambda w, x: jax.grad(loss)(w, x)
  program = flatten(jax.make_jaxpr(step)(w, x))
  primitives = [e.primitive for e in program.equations]
  assert _compat.remat_p not in primitives  # analysed through
  assert primitives.count(_compat.barrier_p) == 2  # one per recomputation
  assert max_relative_error(jlms.offload(step, **_EAGER)(w, x),
                            jax.jit(step)(w, x)) <= F32_TOLERANCE


@pytest.mark.slow  # a few seconds: the quick tier stays within 2 minutes
def test_backward_scan_fetches_the_next_iterations_slices_ahead():
  case = _gpt_scan()
  args = case.make_args()
  closed = jax.make_jaxpr(case.step)(*args)
  program = flatten(closed)
  residuals = find_scan_residuals(program, analyse(program),
                                  OffloadConfig(**_EAGER))
  (reader,) = {i for r in residuals for i in r.readers}
  outputs = {}
  for prefetch in (True, False):
    streamed = offload_scan_residuals(program, residuals, prefetch=prefetch)
    eqn = streamed.equations[reader].eqn
    if prefetch:
      # A call of a scan that carries the fetched slices on the device.
      assert _compat.call_name(eqn) == "jlms_prefetching_scan"
      inner, _ = _compat.call_body(eqn)
      (scan,) = [e for e in inner.eqns if e.primitive is _compat.scan_p]
      layout = _compat.scan_layout(scan)
      carried = [v.aval for v in layout.body.jaxpr.invars[
          layout.num_consts:][:layout.num_carry]]
      slices = {program.avals[r.value].shape[1:] for r in residuals}
      assert sum(a.shape in slices and not _compat.is_host_aval(a)
                 for a in carried) >= len(residuals)
    else:
      assert eqn.primitive is _compat.scan_p
    rewritten = rewrite(streamed, (), OffloadConfig(**_EAGER),
                        closed.jaxpr.debug_info)
    _compat.check_jaxpr(rewritten)
    outputs[prefetch] = jax.jit(
        lambda *a, c=rewritten: jax.core.eval_jaxpr(c.jaxpr, c.consts, *a)
    )(*jax.tree.leaves(args))
  # The same values either way; the two programs fuse differently, and on
  # XLA's older CPU loop emitters (JAX 0.10, conftest) they round apart by
  # 2.9e-7. A slice of the wrong iteration is off by order one.
  assert max_relative_error(outputs[True], outputs[False]) <= 1e-6
