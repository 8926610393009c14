"""Scan residuals remade inside the backward loop instead of stacked."""

import jax
import pytest
import optax

import jlms
from benchmarks import models
from jlms import _compat
from jlms._config import OffloadConfig
from jlms._liveness import analyse
from jlms._loop_remat import loop_rematerializations, rematerialize_in_loops
from jlms._program import flatten
from jlms._rewrite import rewrite
from jlms_tests.conftest import F32_TOLERANCE, max_relative_error


def _gpt_scan():
  return models.gpt_case(layers=3, width=64, heads=2, seq=32, batch=2,
                         vocab=128, scan_layers=True,
                         optimizer=optax.sgd(1e-2, momentum=0.9))


@pytest.mark.slow  # a few seconds: the quick tier stays within 2 minutes
def test_the_backward_scan_remakes_what_the_forward_scan_stacked():
  case = _gpt_scan()
  args = case.make_args()
  closed = jax.make_jaxpr(case.step)(*args)
  program = flatten(closed)
  liveness = analyse(program)
  (pair,) = loop_rematerializations(program, liveness)
  assert len(pair.residuals) >= 10  # activations, attention weights, masks
  remade = rematerialize_in_loops(program, (pair,))
  remade_liveness = analyse(remade)
  # The stacks are gone; the forward loop stacks one carry per layer.
  stacked = sum(liveness.nbytes[v] for v in pair.residuals)
  forward = remade.equations[pair.forward]
  carries = [v for v in forward.outputs
             if v >= len(program.avals)]
  assert carries and all(remade.avals[v].shape[0] == 3 for v in carries)
  assert sum(remade_liveness.nbytes[v] for v in carries) < stacked / 4
  assert not set(pair.residuals) & set(
      a for e in remade.equations for a in e.inputs if isinstance(a, int))
  assert _compat.call_name(remade.equations[pair.backward].eqn) == (
      "jlms_backward_remaking_residuals")
  jaxpr = rewrite(remade, (), OffloadConfig(), closed.jaxpr.debug_info)
  _compat.check_jaxpr(jaxpr)
  outputs = jax.jit(lambda *a: jax.core.eval_jaxpr(jaxpr.jaxpr, jaxpr.consts,
                                                    *a))(*jax.tree.leaves(args))
  expected = jax.tree.leaves(jax.jit(case.step)(*args))
  assert max_relative_error(outputs, expected) <= F32_TOLERANCE


@pytest.mark.slow  # a few seconds: the quick tier stays within 2 minutes
def test_a_budget_below_the_stacks_remakes_them_in_the_loop():
  case = _gpt_scan()
  args = case.make_args()
  plain = jlms.offload(case.step, budget="1TiB").plan(*args)
  least = jlms.offload(case.step, budget="min").plan(*args)
  assert least.predicted_peak_bytes < 0.85 * plain.baseline_peak_bytes
  # A budget only the remade residuals reach: the backward loop remakes
  # them, nothing crosses the host link, and the step is still jax.jit's.
  budget = int(1.05 * least.predicted_peak_bytes)
  step = jlms.offload(case.step, budget=budget)
  plan = step.plan(*args)
  assert plan.predicted_peak_bytes <= budget
  assert plan.offloaded_bytes == 0
  assert plan.step_time.total_s < 2 * plan.baseline_step_time.total_s
  names = [_compat.call_name(e) for e in step.jaxpr(*args).jaxpr.eqns]
  assert "jlms_backward_remaking_residuals" in names
  assert max_relative_error(step(*args), jax.jit(case.step)(*args)) <= (
      F32_TOLERANCE)
