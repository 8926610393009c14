"""Telling the user when the offload does nothing."""

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import pytest

import jlms
from jlms import _verify
from jlms._verify import MemoryComparison
from jlms_tests.conftest import F32_TOLERANCE, PLATFORM, max_relative_error


def _chain(x):
  y = jnp.sin(x)
  for _ in range(12):
    x = jnp.cos(x) * 1.5
  return x + y


X = jnp.ones((256, 256))  # 256 KiB values
EAGER = dict(min_bytes=1, swapout_threshold=4)

#: What the check of `_chain`'s plan against XLA for the local device finds.
#: The CPU backend keeps host copies in the same memory: its program has no
#: host buffers. A GPU's program keeps them on host, but on values this
#: small the copies back cost more device memory than the swap-outs free
#: (512.50 KiB against jax.jit's 512.00 KiB on an H100, JAX 0.11.2), as on
#: the deviceless H100 below.
LOCAL_PROBLEM = "nothing in host" if PLATFORM == "cpu" else "did not go down"


def _memory(**fields):
  base = dict(target="h100", argument_bytes=0, output_bytes=0, alias_bytes=0,
              temp_bytes=0, host_argument_bytes=0, host_output_bytes=0,
              host_temp_bytes=0, generated_code_bytes=0,
              host_offloaded_buffers=0)
  return jlms.XlaMemory(**{**base, **fields})


def test_problems_name_what_went_wrong():
  plan = jlms.offload(_chain, **EAGER).plan(X)
  assert plan.offloaded
  comparison = MemoryComparison(
      "h100", plan, baseline=_memory(temp_bytes=100),
      offloaded=_memory(temp_bytes=120))
  problems = comparison.problems
  assert any("keeps nothing in host memory" in p for p in problems)
  assert any("did not go down" in p for p in problems)
  good = dataclasses.replace(comparison, offloaded=_memory(
      temp_bytes=50, host_temp_bytes=10, host_offloaded_buffers=1))
  assert good.problems == () and good.peak_ratio == 0.5
  assert "peak ratio 0.500" in str(good)


def test_a_plan_that_only_recomputes_expects_nothing_on_host():
  plan = jlms.offload(_chain, **EAGER).plan(X)
  recomputed = tuple(dataclasses.replace(v, recomputed=True)
                     for v in plan.offloaded)
  comparison = MemoryComparison(
      "h100", dataclasses.replace(plan, offloaded=recomputed),
      baseline=_memory(temp_bytes=100), offloaded=_memory(temp_bytes=50))
  assert comparison.problems == ()


def test_memory_compares_with_jit_on_the_h100_and_warns_when_worse():
  # A plan that looks fine on the jaxpr: on values this small, the copies
  # back cost more device memory than the swap-outs free, and XLA says so.
  with pytest.warns(jlms.OffloadIneffectiveWarning, match="did not go down"):
    comparison = jlms.offload(_chain, **EAGER).memory(X, target="h100")
  assert comparison.baseline.host_bytes == 0
  assert comparison.offloaded.host_offloaded_buffers > 0
  assert comparison.offloaded.peak_bytes >= comparison.baseline.peak_bytes


def test_first_call_checks_when_asked_and_warns_once_per_signature():
  # The check compiles for the local device; what it finds there is
  # `LOCAL_PROBLEM`, which is exactly what it must report.
  step = jlms.offload(_chain, verify=True, **EAGER)
  with pytest.warns(jlms.OffloadIneffectiveWarning) as caught:
    step(X)
  assert any(LOCAL_PROBLEM in str(w.message) for w in caught)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    step(X)  # same signature: checked already


def test_no_check_by_default_off_gpu():
  step = jlms.offload(_chain, **EAGER)
  if PLATFORM != "cpu":
    # On a GPU the first call of each signature is checked by default.
    with pytest.warns(jlms.OffloadIneffectiveWarning, match=LOCAL_PROBLEM):
      step(X)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    step(X)  # off a GPU, not checked; on one, checked already


def test_a_step_with_a_target_argument_of_its_own_is_checked():
  def step(x, target):
    return _chain(x) - target

  offloaded = jlms.offload(step, verify=True, **EAGER)
  with pytest.warns(jlms.OffloadIneffectiveWarning) as caught:
    actual = offloaded(X, target=X)
  assert any(LOCAL_PROBLEM in str(w.message) for w in caught)  # checked
  expected = jax.jit(step)(X, target=X)
  assert max_relative_error(actual, expected) <= F32_TOLERANCE


def _comparison_failing_once(checks):
  def comparison(*args, **kwargs):
    checks.append(args)
    if len(checks) == 1:
      raise RuntimeError("the check's compile failed")
    return MemoryComparison(*args, **kwargs)
  return comparison


def test_a_check_that_raised_is_run_again_on_the_next_call(monkeypatch):
  checks = []
  monkeypatch.setattr(_verify, "MemoryComparison",
                      _comparison_failing_once(checks))
  step = jlms.offload(_chain, verify=True, strict=True, **EAGER)
  with pytest.raises(jlms.OffloadError) as info:
    step(X)
  assert "check's compile failed" in str(info.value.__cause__)
  with pytest.warns(jlms.OffloadIneffectiveWarning):
    step(X)  # checked again, and it ran this time
  step(X)
  assert len(checks) == 2


def test_a_check_that_raised_falls_back_to_jax_jit(monkeypatch):
  checks = []
  monkeypatch.setattr(_verify, "MemoryComparison",
                      _comparison_failing_once(checks))
  step = jlms.offload(_chain, verify=True, **EAGER)
  with pytest.warns(jlms.FallbackWarning, match="check's compile failed"):
    actual = step(X)
  assert max_relative_error(actual, jax.jit(_chain)(X)) <= F32_TOLERANCE
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    step(X)  # jax.jit's program from now on: no check, no warning
  assert len(checks) == 1
