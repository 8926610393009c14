"""On a real GPU: what no CPU test can see, since a CPU's host memory space is
its device memory and no byte ever moves.

Run with `JAX_PLATFORMS=cuda,cpu python -m pytest -m gpu`; skipped without
a GPU backend.
"""

import json
import os
import pathlib
import subprocess
import sys

import jax
import pytest

import jlms
from benchmarks import models
from jlms_tests.conftest import (F32_TOLERANCE, FORCED, PLATFORM,
                                 backend_compiles, max_relative_error)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(PLATFORM != "gpu", reason="needs a GPU backend: "
                       "JAX_PLATFORMS=cuda,cpu python -m pytest -m gpu"),
]

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", sorted(models.SMALL_CASES))
def test_outputs_equal_jax_jit_with_real_host_copies(name):
  case = models.SMALL_CASES[name]()
  args = case.make_args()
  step = jlms.offload(case.step, verify=False, **FORCED)
  memory = jlms.xla_memory(step, *args, target="local")
  assert memory.host_offloaded_buffers > 0, "no value went to pinned host"
  assert memory.host_bytes > 0
  expected = jax.jit(case.step)(*args)
  assert max_relative_error(step(*args), expected) <= F32_TOLERANCE


@pytest.mark.parametrize("which", ["jit", "jlms"])
def test_measured_peak_is_xlas_within_5_percent(which):
  # In a process of its own: the allocator's high-water mark is the
  # process's, and this session has run other steps.
  env = dict(os.environ, JAX_PLATFORMS="cuda")
  result = subprocess.run(
      [sys.executable, "-m", "jlms_tests._peak_worker", which], cwd=ROOT,
      env=env, capture_output=True, text=True, timeout=600, check=False)
  assert result.returncode == 0, result.stderr[-4000:]
  run = json.loads(result.stdout.strip().splitlines()[-1])
  if which == "jlms":
    assert run["host_offloaded_buffers"] > 0, run
  # The step set the high-water mark (not making the arguments, not a
  # compile), so the mark is its peak plus what the process held besides
  # the step's arguments.
  assert run["peak_after"] > run["peak_before"], run
  held_besides = run["in_use_before"] - run["argument_bytes"]
  measured = run["peak_after"] - held_besides
  assert abs(measured - run["xla_peak_bytes"]) <= 0.05 * run["xla_peak_bytes"], run


def test_ten_steps_on_their_own_outputs_compile_once():
  compiles = backend_compiles()
  case = models.mlp_case(depth=8, width=512, batch=256)
  params, x, y = case.make_args()
  traces = []

  def counted(params, x, y):
    traces.append(1)
    return case.step(params, x, y)

  step = jlms.offload(counted, **FORCED)
  params, loss = step(params, x, y)  # traces, plans, compiles (and checks)
  first = (len(traces), len(compiles))
  for _ in range(9):
    params, loss = step(params, x, y)  # the last step's outputs
  jax.block_until_ready((params, loss))
  assert (len(traces), len(compiles)) == first, (
      f"steps 2 to 10 traced {len(traces) - first[0]} and compiled "
      f"{len(compiles) - first[1]} times")


def test_a_plan_beyond_the_pinned_host_pool_is_refused_before_it_runs(
    monkeypatch):
  # The state kept on host (64 MiB of parameters) needs more pinned host
  # memory than XLA's pool per GPU, as jlms reads it: 1 KiB. (A budget
  # between XLA's least peaks with and without copies asked for copies on
  # an H100, but not on an H200: there XLA's least peak with copies, 285.4
  # MB, was above the one without, 277.0 MB, and the step ran.)
  case = models.mlp_case(depth=16, width=1024, batch=2048)
  monkeypatch.setenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", str(1 / (1 << 20)))
  params, x, y = case.make_args()
  step = jlms.offload(case.step, donate_argnums=0, state_on_host=True)
  with pytest.raises(jlms.BudgetError,
                     match="XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=1 "):
    step(params, x, y)
  assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(params)), (
      "the step ran: its donated parameters are gone")
