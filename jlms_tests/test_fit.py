"""The greedy fit: tighter budgets continue from the last fit's choices,
and a budget below what any choice can reach is refused without walking
the choices to the end."""

import jax
import pytest

import jlms
from benchmarks import models
from jlms._analysed import AnalysedProgram
from jlms._cost import time_target
from jlms._fit import Fitter, fit
from jlms._program import flatten

_MIN_BYTES = 4096


def _analysed(case):
  return AnalysedProgram.of(flatten(jax.make_jaxpr(case.step)(
      *case.abstract_args())))


@pytest.fixture(scope="module", params=["gpt", "resnet"])
def step(request):
  if request.param == "gpt":
    case = models.gpt_case(layers=3, width=128, heads=4, seq=128, batch=4,
                           vocab=256)
  else:
    case = models.resnet_case(blocks=2, channels=8, image_size=32, batch=2)
  return _analysed(case)


def _fit(step, budget, fitter=None):
  if fitter is not None:
    return fitter.fit(budget)
  return fit(step.program, step.liveness, budget, time_target("h100"),
             _MIN_BYTES, step.fusion)


def _chosen(result):
  return (result.offloads, result.timeline.peak_bytes,
          result.step_time.total_s)


def test_a_tighter_fit_continues_from_the_last_ones_choices(step):
  least = _fit(step, None)
  top, bottom = least.baseline.peak_bytes, least.timeline.peak_bytes
  assert bottom < top
  loose = int(top - 0.3 * (top - bottom))
  tight = int(top - 0.8 * (top - bottom))
  fitter = Fitter(step.program, step.liveness, time_target("h100"),
                  _MIN_BYTES, step.fusion)
  first = fitter.fit(loose)
  assert first.offloads and first.timeline.peak_bytes <= loose
  assert fitter.continues_to(tight)
  # Continued, the tighter fit is the one fitted from the start.
  assert _chosen(fitter.fit(tight)) == _chosen(_fit(step, tight))
  # Its choices passed a peak within the looser budget, where a fit of
  # that would have stopped: that one starts again, and is the same.
  assert not fitter.continues_to(loose)
  assert _chosen(fitter.fit(loose)) == _chosen(first)
  # The least memory continues from any fit.
  assert fitter.continues_to(None)
  assert _chosen(fitter.fit(None)) == _chosen(least)


def test_a_budget_below_the_floor_at_the_peak_is_refused_there(step):
  least = _fit(step, None)
  with pytest.raises(jlms.BudgetError) as refused:
    _fit(step, least.timeline.fixed_bytes // 2)
  error = refused.value
  # A floor: no plan of this program peaks below it, whatever it chooses.
  assert error.floor_only
  assert error.smallest_bytes <= least.timeline.peak_bytes
  assert "however many of the values live there" in str(error)
  assert "(equation " in str(error)


def test_a_trial_priced_from_the_last_step_time_is_priced_as_a_whole(step):
  # The greedy fit prices each round's trials from the step time of the
  # choices before (`jlms._schedule.with_offload_added`); choice by
  # choice, that is the figure of the whole plan.
  from jlms._config import SyncMode
  from jlms._cost import kernel_seconds
  from jlms._schedule import (predict_step_time, remade_groups_with,
                              with_offload_added)
  least = _fit(step, None)
  program, liveness, target = step.program, step.liveness, time_target("h100")
  kernel_s = kernel_seconds(program, target, step.fusion, liveness)
  memo = {}

  def whole(offloads):
    return predict_step_time(program, liveness, kernel_s, tuple(offloads),
                             target, SyncMode.NONE, remade_memo=memo)

  chosen, groups, priced = [], {}, whole(())
  for offload in least.offloads:
    priced = with_offload_added(priced, program, liveness, offload, target,
                                groups, memo)
    chosen.append(offload)
    groups = remade_groups_with(groups, offload)
    expected = whole(chosen)
    assert priced.recompute_s == pytest.approx(expected.recompute_s,
                                               rel=1e-9, abs=1e-15)
    assert priced.exposed_transfer_s == pytest.approx(
        expected.exposed_transfer_s, rel=1e-9, abs=1e-15)
    assert (priced.d2h_bytes, priced.h2d_bytes) == (expected.d2h_bytes,
                                                    expected.h2d_bytes)
  assert {o.is_recompute for o in least.offloads} == {True, False}
