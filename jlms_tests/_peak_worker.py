"""One step on the local GPU in a fresh process, for `test_gpu.py`: the
allocator's peak in use during the step, and XLA's peak of the program.

    python -m jlms_tests._peak_worker {jit,jlms}

Prints one JSON object: XLA's peak and argument bytes of the compiled
program (`jlms.xla_memory(..., target="local")`), and the allocator's
`bytes_in_use` before the step and `peak_bytes_in_use` before and after it.
The allocator's high-water mark is the whole process's, so the process does
nothing but make the arguments, compile the step (with autotuning off: its
scratch buffers would set the mark) and run it once.
"""

from __future__ import annotations

import os

# Memory on demand, so that the stats are the step's and the test session
# that started this process keeps its own.
os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_gpu_autotune_level=0").strip()

import json
import sys

import jax

import jlms
from benchmarks import models

# Activations far larger than the parameters, so that what the step
# allocates dominates what the process holds.
CASE = dict(depth=16, width=2048, batch=4096)


def main(which: str) -> dict:
  case = models.mlp_case(**CASE)
  args = jax.block_until_ready(case.make_args())
  if which == "jlms":
    step = jlms.offload(case.step, verify=False, **models.TFLMS_KNOBS)
  else:
    step = jax.jit(case.step)
  memory = jlms.xla_memory(step, *args, target="local")
  device = jax.local_devices()[0]
  before = device.memory_stats()
  jax.block_until_ready(step(*args))
  after = device.memory_stats()
  return {
      "xla_peak_bytes": memory.peak_bytes,
      "argument_bytes": memory.argument_bytes,
      "host_offloaded_buffers": memory.host_offloaded_buffers,
      "in_use_before": before["bytes_in_use"],
      "peak_before": before["peak_bytes_in_use"],
      "peak_after": after["peak_bytes_in_use"],
  }


if __name__ == "__main__":
  print(json.dumps(main(sys.argv[1])))
