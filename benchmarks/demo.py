"""The main job: a real model's train step, offloaded, with memory before and after.

    python -m benchmarks.demo [--blocks 16] [--image-size 256] [--batch 8]
                              [--target h100] [--json PATH]

A 16-block BatchNorm ResNet (64 channels, 3x3 convs, adam) at 256x256 is
compiled by XLA for an H100 without a GPU (or for the local GPU with
`--target local`), once as `jax.jit` and once under `jlms.offload`, and XLA's
own accounting of both is printed. Then a small copy of the model trains a
few steps on this machine under both, to show the results are the same.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import logging
import time

import jax

import jlms
from benchmarks import models
from benchmarks._output import write_json


def _measure(case, target: str) -> dict:
  step = jlms.offload(case.step)
  args = case.abstract_args()
  start = time.perf_counter()
  plan = step.plan(*args)
  plan_seconds = time.perf_counter() - start
  print(plan)
  comparison = step.memory(*args, target=target)
  print()
  print(comparison)
  return {
      "model": case.name,
      "target": target,
      "plan_seconds": plan_seconds,
      "equations": plan.num_equations,
      "offloaded_values": len(plan.offloaded),
      "offloaded_bytes": plan.offloaded_bytes,
      "jit": comparison.baseline.as_dict(),
      "jlms": comparison.offloaded.as_dict(),
      "peak_ratio": comparison.peak_ratio,
  }


def _train_small_copy(steps: int = 3) -> float:
  """Trains a small ResNet under jax.jit and jlms.offload from the same
  start; returns the largest relative difference of the losses."""
  case = models.resnet_case(blocks=2, channels=16, image_size=32, batch=4)
  params, stats, opt_state, images, labels = case.make_args()
  jit_step = jax.jit(case.step)
  jlms_step = jlms.offload(case.step, min_bytes=1 << 10)
  state_jit = state_jlms = (params, stats, opt_state)
  worst = 0.0
  print(f"\nTraining {case.name} on {jax.default_backend()} "
        f"({len(jlms_step.plan(*case.make_args()).offloaded)} values "
        "offloaded):")
  for i in range(steps):
    state_jit, loss_jit = jit_step(*state_jit, images, labels)
    state_jlms, loss_jlms = jlms_step(*state_jlms, images, labels)
    worst = max(worst, abs(float(loss_jlms) - float(loss_jit)) /
                abs(float(loss_jit)))
    print(f"  step {i}: loss jax.jit {float(loss_jit):.6f}   "
          f"jlms.offload {float(loss_jlms):.6f}")
  return worst


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--blocks", type=int, default=16)
  parser.add_argument("--image-size", type=int, default=256)
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--target", default="h100",
                      help="h100, h200, a100 (deviceless) or local")
  parser.add_argument("--json", help="write the figures here")
  options = parser.parse_args(argv)
  logging.basicConfig(level=logging.WARNING)
  case = models.resnet_case(blocks=options.blocks, channels=64,
                            image_size=options.image_size,
                            batch=options.batch)
  print(f"== {case.name}: XLA memory for {options.target} ==")
  result = _measure(case, options.target)
  result["small_copy_loss_difference"] = _train_small_copy()
  print(f"\nDevice peak {result['jit']['peak_bytes'] / 2**30:.2f} GiB with "
        f"jax.jit, {result['jlms']['peak_bytes'] / 2**30:.2f} GiB with "
        f"jlms.offload ({result['peak_ratio']:.1%}); "
        f"{result['jlms']['host_bytes'] / 2**30:.2f} GiB on host.")
  write_json(options.json, result)
  return result


if __name__ == "__main__":
  main()
