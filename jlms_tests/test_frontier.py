"""Issue 13's claims, as XLA compiles them for an H100 (deviceless): a budget
between jax.jit's and per-layer remat's peaks is met, in about jax.jit's
time by jlms's time model; a step that fits is jax.jit's program."""

import jax
import pytest

import jlms
from jlms import _search
from benchmarks import frontier_cases, models

# One worker runs the whole module: its module-scoped fixture compiles
# (or starts processes) once.
pytestmark = pytest.mark.xdist_group("frontier")

TARGET = "h100"


def _peaks(case, remat_case):
  args = case.abstract_args()
  jit = jlms.xla_memory(jax.jit(case.step), *args, target=TARGET).peak_bytes
  remat = jlms.xla_memory(jax.jit(remat_case.step), *args,
                          target=TARGET).peak_bytes
  return args, jit, remat


def _predicted_ms(fn, args, **knobs):
  plan = jlms.offload(fn, target=TARGET, **knobs).plan(*args)
  return plan.step_time.total_s * 1e3, plan


def _as_is_ms(fn, args):
  """jlms's predicted time of `fn`'s program as it is. With no `target`,
  on a machine without a GPU, nothing is compiled (the XLA peak of a step
  that fits is not needed here); the time model is the H100's either
  way."""
  plan = jlms.offload(fn, budget="1TiB").plan(*args)
  assert plan.offloaded == ()
  return plan.step_time.total_s * 1e3


@pytest.fixture(scope="module")
def resnet():
  case, remat_case = (frontier_cases.resnet(), frontier_cases.resnet(True))
  args, jit, remat = _peaks(case, remat_case)
  jit_ms = _as_is_ms(case.step, args)
  remat_ms = _as_is_ms(remat_case.step, args)
  return case, args, jit, remat, jit_ms, remat_ms


@pytest.mark.slow
def test_resnet_halfway_fits_in_about_jits_time(resnet, monkeypatch):
  case, args, jit, remat, jit_ms, remat_ms = resnet
  budget = (jit + remat) // 2
  compiles = []
  xla_compiled = _search.xla_compiled  # each XLA compile of the search
  monkeypatch.setattr(_search, "xla_compiled",
                      lambda *a: compiles.append(a) or xla_compiled(*a))
  ms, plan = _predicted_ms(case.step, args, budget=budget)
  assert plan.xla_peak_bytes <= budget
  assert 2 <= len(compiles) <= 3  # the step as it is, the plan, a re-fit
  # XLA's peak leaves less of the budget unused than one of the 128 MiB
  # values the plan remakes: keeping one more would not fit. (The first
  # plan left 1.7% unused, 96 MiB; fitted again with that room, the
  # simulator finds the same plan. Before relu masks were remade with their
  # relus, the second fit remade a value fewer, 24.6 -> 24.3 ms by the
  # schedule model; now 24.0 ms.)
  assert plan.xla_peak_bytes >= budget - 128 * 2**20
  assert plan.recomputed  # BatchNorm and relu outputs, remade
  assert plan.offloaded_bytes == 0  # host copies would be exposed
  assert ms <= 1.10 * jit_ms and ms <= remat_ms
  # Issue 13: the predicted peak within 10% of XLA's (+2.2%, JAX 0.10.2).
  assert abs(plan.predicted_peak_bytes / plan.xla_peak_bytes - 1) <= 0.10


@pytest.mark.slow
def test_resnet_at_remats_peak_is_no_slower_than_remat(resnet):
  case, args, jit, remat, jit_ms, remat_ms = resnet
  ms, plan = _predicted_ms(case.step, args, budget=remat)
  assert plan.xla_peak_bytes <= remat
  assert abs(plan.predicted_peak_bytes / plan.xla_peak_bytes - 1) <= 0.10
  # By the schedule model of XLA's compiled programs jlms's plan is faster
  # than remat (26.6 against 28.2 ms, JAX 0.10.2; 27.3 before relu masks
  # were remade with their relus), and by jlms's own H100-calibrated model
  # too (54.5 against 55.7 ms). Until the fusion
  # model kept relu masks as XLA does, jlms's model priced remat, whose
  # recomputation XLA fuses into the backward pass's kernels, below the
  # plan: the bound is remat's predicted time within 10%, as for the
  # scanned GPT below.
  assert ms <= 1.10 * remat_ms


@pytest.mark.slow
def test_scanned_gpt_fits_remats_peak_by_remaking_residuals_in_the_loop():
  case, remat_case = frontier_cases.gpt(), frontier_cases.gpt(True)
  args, jit, remat = _peaks(case, remat_case)
  budget = (jit + remat) // 2
  ms, plan = _predicted_ms(case.step, args, budget=budget)
  # Residuals remade in the backward loop, and the mask and fill that
  # autodiff hoisted out of the loops made inside them: remat's peak (1.84
  # against 1.87 GiB on JAX 0.10; on 0.12, whose remat compiles to 2.23
  # GiB, 123 KB above it).
  assert plan.xla_peak_bytes <= 1.001 * remat
  assert plan.offloaded_bytes == 0  # nothing crosses the host link
  # jlms's model prices this step's jax.jit low (52.3 ms against 56.3 ms
  # measured on an H100) and remat high (59.6 against 43.4): the bound it
  # holds to is remat's own predicted time, within 10%.
  assert ms <= 1.10 * _as_is_ms(remat_case.step, args)
  # At remat's own peak (0.1% over it) the simulator finds no plan (it
  # overstates the backward loop's working memory); XLA, asked about the
  # least-memory plan, finds it fits.
  _, at_remat = _predicted_ms(case.step, args, budget=int(1.001 * remat))
  assert at_remat.xla_peak_bytes <= 1.001 * remat


@pytest.mark.slow
def test_a_step_that_fits_the_h100_is_jax_jits_program():
  case = models.resnet_case(blocks=4, channels=32, image_size=64, batch=8)
  args = case.abstract_args()
  step = jlms.offload(case.step, target=TARGET)  # the default: fit the H100
  plan = step.plan(*args)
  assert plan.offloaded == () and plan.budget_bytes > 70 * 2**30
  offloaded = jlms.xla_memory(step, *args, target=TARGET)
  jit = jlms.xla_memory(jax.jit(case.step), *args, target=TARGET)
  assert offloaded.host_bytes == 0 and offloaded.host_offloaded_buffers == 0
  assert offloaded.peak_bytes == jit.peak_bytes
