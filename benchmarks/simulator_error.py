"""The simulator's predicted peaks against XLA's, and budgets fitted with them.

    python -m benchmarks.simulator_error [--target h100] [--json PATH]

Part 1: for an MLP, a CNN and a GPT-style decoder (unrolled, and with its
layers under `nn.scan`), the simulator's predicted device peak of
`jax.jit(step)` and of default `jlms.offload(step)`, next to
XLA's peak of the same programs compiled for `target` (deviceless), and the
relative error. Part 2: the 16-block BatchNorm ResNet with budgets of 40%
and 200% of jax.jit's XLA peak and of 10 MiB: what the tuner chose, what
XLA measured, how long the search took.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import time

import jax

import jlms
from benchmarks import models
from benchmarks._output import write_json

MIB = 1 << 20


def error_row(case, target: str) -> dict:
  step = jlms.offload(case.step, **models.TFLMS_KNOBS)
  args = case.abstract_args()
  plan = step.plan(*args)
  xla = step.memory(*args, target=target)
  return {
      "model": case.name, "target": target,
      "equations": plan.num_equations,
      "jit_predicted_mib": plan.baseline_peak_bytes / MIB,
      "jit_xla_mib": xla.baseline.peak_bytes / MIB,
      "jit_error": plan.baseline_peak_bytes / xla.baseline.peak_bytes - 1,
      "jlms_predicted_mib": plan.predicted_peak_bytes / MIB,
      "jlms_xla_mib": xla.offloaded.peak_bytes / MIB,
      "jlms_error": plan.predicted_peak_bytes / xla.offloaded.peak_bytes - 1,
  }


def budget_rows(target: str) -> list[dict]:
  case = models.resnet_case(blocks=16, channels=64, image_size=256, batch=8)
  args = case.abstract_args()
  jit_peak = jlms.xla_memory(jax.jit(case.step), *args,
                             target=target).peak_bytes
  rows = []
  for label, budget in (("40% of jit", int(0.4 * jit_peak)),
                        ("200% of jit", 2 * jit_peak),
                        ("10 MiB", 10 * MIB)):
    step = jlms.offload(case.step, budget=budget, target=target)
    start = time.perf_counter()
    row = {"model": case.name, "budget": label, "budget_mib": budget / MIB,
           "jit_xla_mib": jit_peak / MIB}
    try:
      plan = step.plan(*args)
    except jlms.BudgetError as error:
      row.update(outcome="BudgetError", message=str(error))
    else:
      row.update(
          outcome="fits as it is" if not plan.offloaded else "fitted",
          recomputed=len(plan.recomputed),
          copied=len(plan.offloaded) - len(plan.recomputed),
          host_traffic_mib=plan.host_traffic_bytes / MIB,
          predicted_mib=plan.predicted_peak_bytes / MIB,
          xla_mib=plan.xla_peak_bytes / MIB,
          predicted_step_ms=plan.step_time.total_s * 1e3,
          predicted_jit_step_ms=plan.baseline_step_time.total_s * 1e3)
    row["seconds"] = time.perf_counter() - start
    rows.append(row)
  return rows


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--target", default="h100")
  parser.add_argument("--json", default=None)
  options = parser.parse_args(argv)
  cases = [
      models.mlp_case(depth=16, width=2048, batch=4096),
      models.resnet_case(blocks=16, channels=64, image_size=256, batch=8),
      models.gpt_case(layers=6, width=512, heads=8, seq=1024, batch=8),
      models.gpt_case(layers=12, width=512, heads=8, seq=1024, batch=8,
                      scan_layers=True),
  ]
  errors = [error_row(case, options.target) for case in cases]
  print(f"{'model':<36} {'eqns':>6} {'jit pred':>9} {'jit XLA':>9} "
        f"{'err':>7} {'jlms pred':>9} {'jlms XLA':>9} {'err':>7}"
        f"   (MiB, XLA {options.target})")
  for r in errors:
    print(f"{r['model']:<36} {r['equations']:>6} {r['jit_predicted_mib']:>9.0f} "
          f"{r['jit_xla_mib']:>9.0f} {r['jit_error']:>+7.1%} "
          f"{r['jlms_predicted_mib']:>9.0f} {r['jlms_xla_mib']:>9.0f} "
          f"{r['jlms_error']:>+7.1%}")
  budgets = budget_rows(options.target)
  print(f"\n{'budget':<12} {'MiB':>8} {'outcome':<14} {'remade':>6} "
        f"{'copied':>6} {'traffic':>9} {'pred':>8} {'XLA':>8} {'step ms':>8} "
        f"{'total s':>8}")
  for r in budgets:
    if r["outcome"] == "BudgetError":
      print(f"{r['budget']:<12} {r['budget_mib']:>8.0f} BudgetError: "
            f"{r['message'][:110]}...")
      continue
    print(f"{r['budget']:<12} {r['budget_mib']:>8.0f} {r['outcome']:<14} "
          f"{r['recomputed']:>6} {r['copied']:>6} "
          f"{r['host_traffic_mib']:>9.0f} {r['predicted_mib']:>8.0f} "
          f"{(r['xla_mib'] or 0):>8.0f} {r['predicted_step_ms']:>8.1f} "
          f"{r['seconds']:>8.1f}")
  result = {"errors": errors, "budgets": budgets}
  write_json(options.json, result)
  return result


if __name__ == "__main__":
  main()
