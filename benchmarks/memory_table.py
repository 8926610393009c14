"""XLA's memory for the core claims, jax.jit against jlms.offload, deviceless.

    python -m benchmarks.memory_table [--target h100] [--json PATH]

Rows: the tanh MLP gradient step (batch 4096, width 2048, f32) at 16, 32 and
64 layers, and the 16-block BatchNorm ResNet step (64 channels, batch 8,
256x256, adam). Every figure is XLA's `memory_analysis()` of the compiled
program; the trace-cost row times `jax.make_jaxpr(step)` against
`jax.jit(jlms.offload(step)).trace` on a step of 15,000+ equations.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import gc
import time

import jax

import jlms
from benchmarks import models
from benchmarks._output import write_json

MIB = 1 << 20


def _row(case, target: str) -> dict:
  step = jlms.offload(case.step, **models.TFLMS_KNOBS)
  args = case.abstract_args()
  start = time.perf_counter()
  plan = step.plan(*args)
  plan_seconds = time.perf_counter() - start
  comparison = step.memory(*args, target=target)
  jit, off = comparison.baseline, comparison.offloaded
  return {
      "model": case.name, "target": target,
      "equations": plan.num_equations, "offloaded": len(plan.offloaded),
      "plan_seconds": plan_seconds,
      "jit_temp_mib": jit.temp_bytes / MIB, "jlms_temp_mib": off.temp_bytes / MIB,
      "jit_peak_mib": jit.peak_bytes / MIB, "jlms_peak_mib": off.peak_bytes / MIB,
      "host_mib": off.host_bytes / MIB,
      "temp_ratio": off.temp_bytes / jit.temp_bytes,
      "peak_ratio": comparison.peak_ratio,
  }


def trace_cost(repeats: int = 3) -> dict:
  """CPU seconds of `jax.make_jaxpr(step)` and of
  `jax.jit(jlms.offload(step)).trace` on the 15,000+-equation case, best of
  `repeats`, each on a fresh case (jax caches traces by function), with the
  garbage collector paused as timeit does."""
  def seconds(fn):
    # As timeit does: collect first and keep the collector out of the timing,
    # whose pauses grow with whatever else the process holds (a test run).
    gc.collect()
    gc.disable()
    try:
      start = time.process_time()
      fn()
      return time.process_time() - start
    finally:
      gc.enable()

  def plain():
    case = models.many_equations_case()
    return seconds(lambda: jax.make_jaxpr(case.step)(*case.abstract_args()))

  def offloaded():
    case = models.many_equations_case()
    step = jax.jit(jlms.offload(case.step, budget="min"))
    return seconds(lambda: step.trace(*case.abstract_args()))

  offloaded()  # warm jax's caches of library code for both
  # Each repeat times the two back to back, so that a machine busy with
  # something else slows both alike; the best repeat counts.
  pairs = [(plain(), offloaded()) for _ in range(repeats)]
  plain_s, offloaded_s = min(pairs, key=lambda pair: pair[1] / pair[0])
  return {"equations": models.count_equations(models.many_equations_case()),
          "make_jaxpr_seconds": plain_s, "offload_trace_seconds": offloaded_s,
          "ratio": offloaded_s / plain_s}


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--target", default="h100")
  parser.add_argument("--json", default=None)
  options = parser.parse_args(argv)
  cases = [models.mlp_case(depth=d, width=2048, batch=4096)
           for d in (16, 32, 64)]
  cases.append(models.resnet_case(blocks=16, channels=64, image_size=256,
                                  batch=8))
  rows = [_row(case, options.target) for case in cases]
  print(f"{'model':<30} {'eqns':>6} {'offl':>5} {'jit temp':>10} "
        f"{'jlms temp':>10} {'jit peak':>10} {'jlms peak':>10} "
        f"{'host':>10} {'peak ratio':>10}   (MiB, XLA {options.target})")
  for r in rows:
    print(f"{r['model']:<30} {r['equations']:>6} {r['offloaded']:>5} "
          f"{r['jit_temp_mib']:>10.1f} {r['jlms_temp_mib']:>10.1f} "
          f"{r['jit_peak_mib']:>10.1f} {r['jlms_peak_mib']:>10.1f} "
          f"{r['host_mib']:>10.1f} {r['peak_ratio']:>10.3f}")
  trace = trace_cost()
  print(f"\ntracing a {trace['equations']}-equation step: make_jaxpr "
        f"{trace['make_jaxpr_seconds']:.2f} s, jax.jit(jlms.offload).trace "
        f"{trace['offload_trace_seconds']:.2f} s (x{trace['ratio']:.2f})")
  result = {"rows": rows, "trace_cost": trace}
  write_json(options.json, result)
  return result


if __name__ == "__main__":
  main()
