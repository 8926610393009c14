"""`benchmarks.gpu_steps`, the way programs planned here reach a GPU: on a
tiny step, exported for CUDA and the CPU, run here on the CPU, reported.
What it measures on a GPU is in benchmarks/results/gpu_steps_h100.json."""

import json

import jax
import numpy as np
import pytest

from benchmarks import frontier, frontier_cases, gpu_steps


@pytest.mark.slow  # about 10 s: plans, exports and compiles three programs
def test_programs_planned_here_run_elsewhere_as_planned(tmp_path, monkeypatch):
  case = frontier_cases.scan_mlp(layers=4, width=64, batch=128)
  remat = frontier_cases.scan_mlp(layers=4, width=64, batch=128, remat=True)
  monkeypatch.setitem(frontier.CASES, "scan_mlp", lambda: (case, remat))
  monkeypatch.setitem(gpu_steps.CONFIGS, "scan_mlp", [
      gpu_steps.JIT, gpu_steps.REMAT, gpu_steps.MINIMUM])
  entries = gpu_steps.export(["scan_mlp"], tmp_path / "programs",
                             platforms=("cuda", "cpu"))
  assert [e.config for e in entries] == gpu_steps.CONFIGS["scan_mlp"]
  planned = entries[-1]
  assert planned.predicted_ms > 0 and planned.predicted_peak_bytes > 0

  rows = gpu_steps.run(tmp_path / "programs", tmp_path / "out", steps=2,
                       cases=["scan_mlp"])
  assert not [row["error"] for row in rows if row["error"]]
  assert {row["config"] for row in rows} == set(gpu_steps.CONFIGS["scan_mlp"])
  expected = jax.jit(case.step)(*case.make_args())[1]
  for row in rows:  # each program computes the step: the same loss
    np.testing.assert_allclose(row["loss"], float(expected), rtol=1e-5)
    assert row["measured_ms"] > 0 and row["xla_peak_bytes"] > 0
  assert json.loads((tmp_path / "out" / "gpu_steps.json").read_text()) == rows

  report = gpu_steps.report(rows, yardstick=None)
  assert len(report["rows"]) == len(rows)
  assert report["summary"]["predicted_ms"]["rms_log_error"] is not None
