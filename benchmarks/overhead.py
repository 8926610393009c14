"""What jlms costs in run time on this machine: step time under jax.jit and jlms.offload.

    python -m benchmarks.overhead [--repeats 20] [--json PATH]

Three programs per model: `jax.jit`; jlms's schedule with its barriers but
without the copies ("barriers"); and the full `jlms.offload` ("jlms"). On a
CPU host and device memory are the same RAM, so the copies are plain memcpys
that nothing overlaps; on a GPU (`JAX_PLATFORMS=cuda`) they run on the copy
engines. The steps are timed alternately so that the machine's drift hits
all three alike. Prints a table and writes JSON. This is a measurement, not
a test: timings vary run to run.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import statistics
import time

import jax

import jlms
from benchmarks import models
from benchmarks._output import write_json

CASES = {
    "mlp": lambda: models.mlp_case(depth=16, width=1024, batch=1024),
    "resnet": lambda: models.resnet_case(blocks=4, channels=32, image_size=64,
                                         batch=8),
    "gpt": lambda: models.gpt_case(layers=4, width=256, heads=4, seq=256,
                                   batch=8),
}


def barriers_only(step: jlms.OffloadedStep, args):
  """The step's rewritten schedule with the copies left out: made by the
  very call that made the program that runs, so that its barriers (anchored
  where XLA runs each fused equation) are that program's."""
  closed = step.jaxpr_without_copies(*args)
  out_tree = jax.tree.structure(jax.eval_shape(step, *args))

  def run(*call_args):
    leaves = jax.tree.leaves(call_args)
    outs = jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *leaves)
    return jax.tree.unflatten(out_tree, outs)

  return jax.jit(run)


def _median_step_seconds(steps: dict, args, repeats: int) -> dict:
  """Median wall time of one step of each program, timed alternately, each
  call until its outputs are ready (jax dispatches asynchronously)."""
  jax.block_until_ready(args)  # made asynchronously: not the first step's
  for step in steps.values():
    jax.block_until_ready(step(*args))  # compile
  times = {name: [] for name in steps}
  for _ in range(repeats):
    for name, step in steps.items():
      start = time.perf_counter()
      jax.block_until_ready(step(*args))
      times[name].append(time.perf_counter() - start)
  return {name: statistics.median(t) for name, t in times.items()}


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=int, default=20)
  parser.add_argument("--json", default=None)
  options = parser.parse_args(argv)
  rows = []
  print(f"{'model':<38} {'offloaded':>9} {'jax.jit ms':>11} "
        f"{'barriers':>9} {'jlms ms':>9} {'barriers':>9} {'jlms':>7}")
  for name, make in CASES.items():
    case = make()
    args = case.make_args()
    step = jlms.offload(case.step, **models.TFLMS_KNOBS)
    seconds = _median_step_seconds(
        {"jit": jax.jit(case.step), "barriers": barriers_only(step, args),
         "jlms": step}, args, options.repeats)
    row = {
        "model": case.name,
        "backend": jax.default_backend(),
        "offloaded_values": len(step.plan(*args).offloaded),
        "jit_seconds": seconds["jit"],
        "barriers_seconds": seconds["barriers"],
        "jlms_seconds": seconds["jlms"],
        "barrier_overhead": seconds["barriers"] / seconds["jit"] - 1.0,
        "jlms_overhead": seconds["jlms"] / seconds["jit"] - 1.0,
    }
    rows.append(row)
    print(f"{row['model']:<38} {row['offloaded_values']:>9} "
          f"{1e3 * seconds['jit']:>11.2f} {1e3 * seconds['barriers']:>9.2f} "
          f"{1e3 * seconds['jlms']:>9.2f} {row['barrier_overhead']:>+9.1%} "
          f"{row['jlms_overhead']:>+7.1%}")
  write_json(options.json, rows)
  return rows


if __name__ == "__main__":
  main()
