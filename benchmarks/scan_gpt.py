"""A scanned GPT decoder against JAX's own answers to "it does not fit".

    python -m benchmarks.scan_gpt [--layers 12 24] [--target h100] [--json PATH]

The model is issue 4's: a pre-LayerNorm GPT decoder whose layers are one
`nn.scan` (sequence 1024, width 512, 8 heads, batch 8, vocabulary 1024,
AdamW, float32). For each depth it compiles, deviceless for the target,
- `jax.jit` of the plain step;
- `jlms.offload` of the plain step (scan residuals streamed through host);
- `jax.jit` with each layer under `nn.remat(nothing_saveable)`: recompute
  everything in the backward pass;
- `jax.jit` with each layer under `nn.remat(save_and_offload_only_these_names)`
  offloading each layer's input to pinned host, as MaxText does;
and prints XLA's device peak, temporaries and host bytes, and the step's
FLOPs from XLA's cost analysis (the recomputing variants do more work).
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

GIB = models.GIB
VARIANTS = ("jax.jit", "jlms.offload", "remat nothing_saveable",
            "remat offload policy")


def _case(layers: int, remat):
  return models.zoo_gpt_case(seq=1024, batch_size=8, remat=remat, layers=layers,
                      width=512, heads=8, vocab=1024)


def _measure(variant: str, layers: int, target: str) -> dict:
  remat = {"remat nothing_saveable": "nothing_saveable",
           "remat offload policy": "offload"}.get(variant)
  case = _case(layers, remat)
  step = jlms.offload(case.step, **models.TFLMS_KNOBS) if variant == "jlms.offload" else case.step
  args = case.abstract_args()
  start = time.perf_counter()
  memory = jlms.xla_memory(step, *args, target=target)
  seconds = time.perf_counter() - start
  cost = jax.jit(case.step).trace(*args).lower().cost_analysis() or {}
  return {
      "variant": variant, "layers": layers, "target": target,
      "peak_bytes": memory.peak_bytes, "temp_bytes": memory.temp_bytes,
      "host_bytes": memory.host_bytes, "flops": float(cost.get("flops", 0.0)),
      "compile_seconds": round(seconds, 1),
  }


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--layers", type=int, nargs="+", default=[12, 24])
  parser.add_argument("--target", default="h100")
  parser.add_argument("--json", default=None)
  args = parser.parse_args(argv)
  rows = []
  print(f"{'variant':<24} {'layers':>6} {'peak GiB':>9} {'temp GiB':>9} "
        f"{'host GiB':>9} {'TFLOP':>7} {'compile s':>9}")
  for layers in args.layers:
    for variant in VARIANTS:
      row = _measure(variant, layers, args.target)
      rows.append(row)
      print(f"{variant:<24} {layers:>6} {row['peak_bytes'] / GIB:>9.2f} "
            f"{row['temp_bytes'] / GIB:>9.2f} {row['host_bytes'] / GIB:>9.2f} "
            f"{row['flops'] / 1e12:>7.2f} {row['compile_seconds']:>9.1f}",
            flush=True)
  write_json(args.json, rows)
  return rows


if __name__ == "__main__":
  main()
