"""The model zoo's train steps under jlms.offload give jax.jit's outputs (CPU),
and the many-models benchmark writes its figures."""

import json

import jax
import pytest
from jax.flatten_util import ravel_pytree

import jlms
from benchmarks import many_models, models
from jlms_tests.conftest import (F32_TOLERANCE, fast_compile_options,
                                 max_relative_error)

def _run(jitted, args=()):
  return jitted.lower(*args).compile(compiler_options=fast_compile_options())(*args)


def _step_error(actual, expected) -> float:
  """conftest's normwise error of each output of a step (parameters, batch
  statistics, optimizer state, loss) taken as one vector.

  Leaf by leaf it would compare rounding noise with itself: some leaves are
  zero in exact arithmetic, such as the gradient of a bias or scale whose
  only readers are BatchNorms, which undo any per-channel shift or scale.
  """
  (actual_state, actual_loss), (expected_state, expected_loss) = actual, expected
  pairs = zip((*actual_state, actual_loss), (*expected_state, expected_loss))
  return max(max_relative_error(ravel_pytree(a)[0], ravel_pytree(e)[0])
             for a, e in pairs)


# The zoo's models take 5 to 25 s each on a 2-core machine: the slow tier
# runs them, so that the quick one stays under two minutes (its property
# tests draw convolution, attention and scanned steps of every family).
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(models.ZOO))
def test_offloaded_zoo_step_matches_jit(name):
  case = models.ZOO[name].tiny_case()
  args = _run(case.make_args)
  # 1 KiB: at this size the default 1 MiB would leave little to offload.
  step = jlms.offload(case.step, min_bytes=1 << 10)
  assert step.plan(*args).offloaded, "the tiny step offloads nothing"
  expected = _run(jax.jit(case.step), args)
  assert _step_error(_run(step, args), expected) <= F32_TOLERANCE


@pytest.mark.slow  # ~6 s each, on top of ~65 s for the six tests above
@pytest.mark.parametrize("remat", ["nothing_saveable", "offload"])
def test_rematerialised_zoo_step_matches_plain(remat):
  # The U-Net: BatchNorm statistics updated inside nn.remat, and decoder
  # units whose input (upsampled and skip maps) is a tuple.
  unet3d = models.ZOO["unet3d"]
  plain, rematerialised = unet3d.tiny_case(), unet3d.tiny_case(remat)
  args = _run(plain.make_args)
  # Same parameter names and values, so one set of arguments serves both.
  assert max_relative_error(_run(rematerialised.make_args), args) == 0.0
  expected = _run(jax.jit(plain.step), args)
  actual = _run(jax.jit(rematerialised.step), args)
  assert _step_error(actual, expected) <= F32_TOLERANCE


@pytest.mark.slow
def test_many_models_writes_json(tmp_path):
  path = tmp_path / "figures.json"
  many_models.main(["--model", "gpt", "--image-size", "64",
                    "--batch-size", "2", "--target", "h100",
                    "--json", str(path)])
  (row,) = json.loads(path.read_text())["models"].values()
  assert row["case"] == "gpt-l12-w768-s64-b2"
  for variant in ("jit", "jlms", "remat_nothing_saveable", "remat_offload"):
    assert row[variant]["peak_bytes"] > 0, row[variant]
  assert row["flops"] > 0
  assert row["jlms"]["predicted"]["serial_ms"] >= row["jit"]["predicted"][
      "compute_ms"]
