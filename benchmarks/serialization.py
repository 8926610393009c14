"""Serialization against XLA's own order: does chaining ops lower the peak?

    python -m benchmarks.serialization [--target h100] [--json PATH]

The step is attention written head by head (`models.per_head_attention_case`:
8 heads as separate matmuls, 2 residual layers, sequence 2048, width 512,
batch 4, SGD). It is compiled, deviceless, as `jax.jit`, as default
`jlms.offload`, and as `jlms.offload` with `serialize=` choosing every
matmul, every operation, or every operation making at least 32 MiB; with
offloading off (`min_bytes` beyond any value) and on by TFLMS's rules
(`models.TFLMS_KNOBS`: values of 1 MiB and more read 20 equations later).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse

import jlms
from benchmarks import models
from benchmarks._output import write_json

MIB = 1 << 20
SETTINGS = {
    "none": {},
    'serialize=["dot_general"]': {"serialize": ["dot_general"]},
    'serialize=["*"]': {"serialize": ["*"]},
    "serialize_by_size=32MiB": {"serialize_by_size": 32 * MIB},
}


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--target", default="h100")
  parser.add_argument("--json", default=None)
  args = parser.parse_args(argv)
  case = models.per_head_attention_case()
  shapes = case.abstract_args()
  jit_peak = jlms.xla_memory(case.step, *shapes, target=args.target).peak_bytes
  print(f"{case.name}: jax.jit peak {jit_peak / MIB:.1f} MiB ({args.target})")
  print(f"{'offload':<9} {'serialization':<28} {'chained':>7} {'peak MiB':>9}")
  rows = []
  # Serialization is one of TFLMS's knobs: it is measured with offloading
  # off, and on by TFLMS's rules (`models.TFLMS_KNOBS`). jlms's defaults
  # fit a budget instead, and without a GPU or a target leave the step as
  # jax.jit's program.
  for offloading, knobs in (("off", {"min_bytes": 1 << 62}),
                            ("knobs", models.TFLMS_KNOBS)):
    for label, setting in SETTINGS.items():
      step = jlms.offload(case.step, **knobs, **setting)
      chained = step.plan(*shapes).serialized
      peak = jlms.xla_memory(step, *shapes, target=args.target).peak_bytes
      rows.append({"model": case.name, "target": args.target,
                   "offload": offloading, "serialization": label,
                   "serialized_equations": chained, "peak_bytes": peak,
                   "jit_peak_bytes": jit_peak})
      print(f"{offloading:<9} {label:<28} {chained:>7} {peak / MIB:>9.1f}",
            flush=True)
  write_json(args.json, rows)
  return rows


if __name__ == "__main__":
  main()
