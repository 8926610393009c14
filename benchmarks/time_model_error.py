"""jlms's time model against step times measured on a real H100, and the
calibration of its kernel efficiencies.

    python -m benchmarks.time_model_error [--no-yardstick] [--json PATH]
                                          [--measured GPU_STEPS.json --target NAME]

The ground truth: the frontier's `jax.jit` and per-layer remat
(`jax.checkpoint(nothing_saveable)`) programs timed on an NVIDIA H100 80GB
HBM3 by `benchmarks.gpu_steps` (median of 8 steps, JAX 0.11.2;
`benchmarks/results/gpu_steps_h100.json`), nine steps: the BatchNorm
ResNet at 256x256 (both) and at 1024x1024 (remat; jax.jit does not fit),
the scanned GPT in float32 and bfloat16, the scanned MLP. Without that
file, the eight steps of ../shared/reference/H100-MEASURED.md ("Step time
and memory"), models kept outside the project. `--measured` names another
run of `benchmarks.gpu_steps` and `--target` the GPU it ran on (an H200's,
`benchmarks/results/gpu_steps_h200.json`, with `--target h200`): the model
of that target (`jlms._cost.TARGETS`, the H100's efficiencies) is judged
against it, and the schedule model prices XLA's program for that target.
These programs are the
user's own, so the measurements hold whatever jlms's version. For each,
the table gives:

- the time jlms's model predicts for the program as it is (its kernels
  priced by `jlms._cost.kernel_seconds`, as `Plan.baseline_step_time` is,
  the fused equations placed once so that the grid below reprices them
  quickly), with the efficiencies jlms ships
  (`jlms._cost.GpuTarget.efficiency`);
- the same model at the roofline (every efficiency 1), and split into its
  memory-bound and contraction parts;
- the schedule model of XLA's compiled program
  (`../shared/tools/step_time.py`), when that file is there;
- each one's error against the measurement.

Then it searches a grid of (memory, matmul, convolution) efficiencies for
the least root-mean-square log error over the measured steps, beside
which the calibration that `jlms._cost` ships is judged. Nothing runs on
a GPU.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import dataclasses
import itertools
import json
import math
import pathlib
import types

import jax
import jax.numpy as jnp
import numpy as np

import jlms
from jlms import _cost
from jlms._analysed import AnalysedProgram
from jlms._placement import place_fused_at_readers
from jlms._program import flatten
from benchmarks import frontier, frontier_cases
from benchmarks._output import write_json

# Measured on an H100 80GB HBM3, ms per step (H100-MEASURED.md): models
# kept outside the project, similar to the frontier's.
REFERENCE_H100_MS = {
    ("resnet", "jax.jit"): 45.6,
    ("resnet", "remat"): 55.5,
    ("gpt_f32", "jax.jit"): 56.3,
    ("gpt_f32", "remat"): 43.4,
    ("gpt_bf16", "jax.jit"): 35.7,
    ("gpt_bf16", "remat"): 29.1,
    ("scan_mlp", "jax.jit"): 9.4,
    ("scan_mlp", "remat"): 11.0,
}

# The frontier's own programs timed on an H100 80GB HBM3 by
# `benchmarks.gpu_steps` (median of 8 steps, JAX 0.11.2): the ground truth
# where that file is there.
GPU_STEPS_JSON = (pathlib.Path(__file__).resolve().parent / "results"
                  / "gpu_steps_h100.json")
_CONFIGS = {"jax.jit": "jax.jit", "remat nothing_saveable": "remat"}


def measured_ms(path: pathlib.Path = GPU_STEPS_JSON,
                     reference: bool = True) -> dict:
  """(model, "jax.jit" or "remat") -> ms measured on a GPU (an H100 unless
  `path` says otherwise): the frontier's programs as `benchmarks.gpu_steps`
  timed them, else (with `reference`) the H100's reference table."""
  if not path.is_file():
    if not reference:
      raise FileNotFoundError(f"no gpu_steps results at {path}")
    return dict(REFERENCE_H100_MS)
  rows = json.loads(path.read_text())["rows"]
  return {(row["case"], _CONFIGS[row["config"]]): row["measured_ms"]
          for row in rows if row["config"] in _CONFIGS
          and row.get("measured_ms") and row["case"] in _FACTORIES}


_FACTORIES = {
    "resnet": lambda remat: frontier_cases.resnet(remat=remat),
    "gpt_f32": lambda remat: frontier_cases.gpt(remat=remat),
    "gpt_bf16": lambda remat: frontier_cases.gpt(
        remat=remat, compute_dtype=jnp.bfloat16),
    "scan_mlp": lambda remat: frontier_cases.scan_mlp(remat=remat),
    "resnet_1024": lambda remat: frontier_cases.resnet(remat=remat,
                                                       image_size=1024),
}

# The grid the calibration searches.
MEMORY_GRID = np.round(np.arange(0.5, 1.001, 0.05), 2)
MATMUL_GRID = np.round(np.arange(0.3, 1.001, 0.1), 2)
CONV_GRID = np.round(np.arange(0.3, 0.601, 0.05), 2)


def case_of(model: str, config: str):
  return _FACTORIES[model](config == "remat")


def placed_program(case) -> AnalysedProgram:
  """The step as jax.jit runs it, analysed and with fused equations placed
  at their readers: what the time model prices."""
  plain = AnalysedProgram.of(flatten(jax.make_jaxpr(jax.jit(case.step))(
      *case.abstract_args())))
  return AnalysedProgram.of(place_fused_at_readers(
      plain.program, plain.liveness, plain.fusion))


def predicted_ms(placed: AnalysedProgram, efficiency: dict,
                 target: str = "h100") -> float:
  """jlms's predicted time of the program with these kernel efficiencies."""
  gpu = dataclasses.replace(_cost.TARGETS[target],
                            efficiency=types.MappingProxyType(efficiency))
  return 1e3 * float(_cost.kernel_seconds(
      placed.program, gpu, placed.fusion, placed.liveness).sum())


def error_summary(ratios) -> dict:
  """Largest relative error and root-mean-square log error of predicted /
  measured `ratios`."""
  logs = [math.log(r) for r in ratios]
  return {"max_abs_error": max(abs(r - 1) for r in ratios),
          "rms_log_error": math.sqrt(sum(x * x for x in logs) / len(logs))}


def calibrate(programs: dict, measured_ms: dict, target: str = "h100") -> dict:
  """The efficiencies on the grid with the least root-mean-square log error
  against the measurements, and that error."""
  best = None
  for memory, matmul, conv in itertools.product(MEMORY_GRID, MATMUL_GRID,
                                                CONV_GRID):
    efficiency = {"memory": float(memory), "matmul": float(matmul),
                  "conv": float(conv)}
    summary = error_summary([predicted_ms(programs[key], efficiency, target)
                             / measured for key, measured
                             in measured_ms.items()])
    if best is None or summary["rms_log_error"] < best["rms_log_error"]:
      best = {"efficiency": efficiency, **summary}
  return best


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--no-yardstick", action="store_true",
                      help="skip compiling for the schedule model")
  parser.add_argument("--no-grid", action="store_true",
                      help="skip the calibration search")
  parser.add_argument("--measured", default=None,
                      help="a benchmarks.gpu_steps JSON (default: the H100's)")
  parser.add_argument("--target", default="h100", choices=sorted(_cost.TARGETS),
                      help="the GPU the measured run was on")
  parser.add_argument("--json", default=None)
  options = parser.parse_args(argv)
  target = options.target
  yardstick = None if options.no_yardstick else frontier.load_yardstick()
  shipped = dict(_cost.TARGETS[target].efficiency)
  roofline = {"memory": 1.0, "matmul": 1.0, "conv": 1.0}
  programs, rows = {}, []
  print(f"{'step':<10} {'config':<8} {target.upper() + ' ms':>8} {'jlms':>7} {'err':>7} "
        f"{'roofline':>8} {'err':>7} {'memory':>7} {'contr.':>7} "
        f"{'XLA sched':>9} {'err':>7}")
  measured_ms = (measured_ms() if options.measured is None else
                 measured_ms(pathlib.Path(options.measured),
                                  reference=False))
  for (model, config), measured in measured_ms.items():
    case = case_of(model, config)
    placed = programs[model, config] = placed_program(case)
    row = {"model": model, "config": config, "step": case.name,
           "measured_ms": measured,
           "jlms_ms": predicted_ms(placed, shipped, target),
           "roofline_ms": predicted_ms(placed, roofline, target),
           # Each part alone: the other kinds of kernel made free.
           "memory_ms": predicted_ms(placed, {"memory": 1.0, "matmul": 1e9,
                                              "conv": 1e9}, target),
           "contraction_ms": predicted_ms(placed, {"memory": 1e9,
                                                   "matmul": 1.0,
                                                   "conv": 1.0}, target),
           "yardstick_ms": None}
    if yardstick is not None:
      hlo = jlms.xla_memory(jax.jit(case.step), *case.abstract_args(),
                            target=target).hlo_text
      row["yardstick_ms"] = float(yardstick.estimate(hlo)["total_ms"])
    for key in ("jlms", "roofline", "yardstick"):
      value = row[f"{key}_ms"]
      row[f"{key}_error"] = None if value is None else value / measured - 1
    rows.append(row)
    cell = lambda v: "" if v is None else f"{v:.1f}"
    pct = lambda v: "" if v is None else f"{v:+.0%}"
    print(f"{model:<10} {config:<8} {measured:>8.1f} {row['jlms_ms']:>7.1f} "
          f"{pct(row['jlms_error']):>7} {row['roofline_ms']:>8.1f} "
          f"{pct(row['roofline_error']):>7} {row['memory_ms']:>7.1f} "
          f"{row['contraction_ms']:>7.1f} {cell(row['yardstick_ms']):>9} "
          f"{pct(row['yardstick_error']):>7}", flush=True)
  summary = {}
  for key in ("jlms", "roofline", "yardstick"):
    errors = [r[f"{key}_error"] for r in rows if r[f"{key}_error"] is not None]
    if errors:
      summary[key] = error_summary([1 + e for e in errors])
      print(f"{key:<10} largest error {summary[key]['max_abs_error']:.0%}, "
            f"rms log error {summary[key]['rms_log_error']:.3f}")
  result = {"target": target, "efficiency": shipped, "rows": rows,
            "summary": summary}
  if not options.no_grid:
    best = calibrate(programs, measured_ms, target)
    result["calibration"] = best
    print(f"calibration: least rms log error {best['rms_log_error']:.3f} "
          f"(largest error {best['max_abs_error']:.0%}) at "
          f"{best['efficiency']}; jlms ships {shipped}")
  write_json(options.json, result)
  return result


if __name__ == "__main__":
  main()
