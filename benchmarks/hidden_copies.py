"""Host copies under compute: the exposed copy time of issue 37's steps,
by the schedule model of XLA's compiled program and by jlms's own model.

    JAX_PLATFORMS=cpu python -m benchmarks.hidden_copies [--large] [--json PATH]

Each step is planned by `jlms.offload` for an H100 and compiled deviceless
(`jlms.xla_memory(..., target="h100")`). Rows:

- `scan MLP, budget min`: the 16-layer MLP under `jax.lax.scan` (batch
  4096, width 2048, float32, SGD) at `budget="min"`: its layers' inputs
  streamed through host;
- `GPT 4 x 4096, 16 GiB`: the scanned GPT of `models.zoo_gpt_case` (4
  layers, width 4096, sequence 1024, batch 8, AdamW, float32, donated) at a
  16 GiB budget: moments on host, updated inside the backward loop with
  several buffers in flight;
- `GPT 6.58B, plain`: the same GPT at 32 layers, its arguments on an H100,
  plain `jlms.offload(step, donate_argnums=(0, 1))`: two moments on host;
- with `--large`, `GPT 8.6B (42 x 4096), plain`: the deepest GPT of width
  4096 that fits with its state on host (`benchmarks.largest_gpt`), with a
  128 GB host budget.

Columns: whether the plan runs with a latency profile of its copies
(`jlms._latency_profile`); XLA's device peak and host argument bytes; the bytes each way
over the link and the schedule model's total, compute and exposed copy
time (`../shared/tools/step_time.py`); jlms's predicted total and exposed
copy time as planned (the H100 calibration, 52 GB/s) and with the schedule
model's constants (`benchmarks._predicted`: kernels at their roofline, 55
GB/s); each exposed figure's error against the schedule model's, and the
link floor (the larger direction's bytes at 55 GB/s). Not part of CI; the
large row takes about ten minutes on two cores.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import time

import jax

import jlms
from jlms import _compat
from jlms._latency_profile import PROFILE_OPTION
from benchmarks import frontier_cases, models
from benchmarks._output import print_table, write_json
from benchmarks._predicted import (prediction_columns, relative_error,
                                   schedule_columns)
from benchmarks.frontier import load_yardstick
from benchmarks.sharded import on_one_device

TARGET = "h100"
GIB = 1 << 30
DONATED = (0, 1)


def subjects(large: bool, target: str = TARGET):
  """(name, step case, `jlms.offload` keywords, whether its state comes
  placed on one of `target`'s devices) of each row."""
  yield ("scan MLP, budget min",
         models.scan_mlp_case(layers=16, width=2048, batch=4096),
         dict(target=target, budget="min"), False)
  yield ("GPT 4 x 4096, 16 GiB",
         models.zoo_gpt_case(seq=1024, batch_size=8, layers=4, width=4096,
                             heads=32),
         dict(donate_argnums=DONATED, target=target, budget=16 * GIB), False)
  # Plain: the budget is the device's that the arguments are placed on.
  yield ("GPT 6.58B, plain",
         models.zoo_gpt_case(seq=1024, batch_size=8, layers=32, width=4096,
                             heads=32),
         dict(donate_argnums=DONATED), True)
  if large:
    yield ("GPT 8.6B (42 x 4096), plain",
           frontier_cases.gpt(layers=42, width=4096, heads=32, seq=1024,
                              batch=8, vocab=32768),
           dict(donate_argnums=DONATED, host_budget="128GB"), True)


def steps(large: bool):
  """(name, offloaded step, abstract arguments) of each row."""
  for name, case, keywords, placed in subjects(large):
    args = case.abstract_args()
    yield (name, jlms.offload(case.step, **keywords),
           on_one_device(args, TARGET) if placed else args)


def measure(name, step, args, yardstick) -> dict:
  start = time.perf_counter()
  plan = step.plan(*args)
  planning_s = time.perf_counter() - start
  memory = jlms.xla_memory(step, *args, target=TARGET)
  options = _compat.compiler_options(step.lower(*args)) or ()
  row = {"step": name, "planning_s": round(planning_s, 1),
         # Whether it runs with jlms's latency profile of its copies.
         "latency_profile": PROFILE_OPTION in dict(options),
         "peak_gib": round(memory.peak_bytes / GIB, 2),
         "host_argument_gib": round(memory.host_argument_bytes / GIB, 2),
         "state_leaves_on_host": plan.state_leaves,
         **prediction_columns(plan)}
  if yardstick is not None:
    row.update(schedule_columns(yardstick.estimate(memory.hlo_text)))
    row.update(
        exposed_error=relative_error(row["predicted_exposed_copy_ms"],
                                     row["schedule_exposed_copy_ms"]),
        roofline_exposed_error=relative_error(
            row["roofline_predicted_exposed_copy_ms"],
            row["schedule_exposed_copy_ms"]),
        roofline_error=relative_error(row["roofline_predicted_ms"],
                                      row["schedule_ms"]))
  return row


COLUMNS = ("step", "latency_profile", "peak_gib", "d2h_gib", "h2d_gib", "link_floor_ms",
           "schedule_ms", "schedule_compute_ms", "schedule_exposed_copy_ms",
           "predicted_ms", "predicted_exposed_copy_ms", "exposed_error",
           "roofline_predicted_ms", "roofline_predicted_exposed_copy_ms",
           "roofline_exposed_error", "roofline_error", "planning_s")


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--large", action="store_true",
                      help="also the 42-layer GPT of width 4096")
  parser.add_argument("--json", default=None)
  options = parser.parse_args(argv)
  yardstick = load_yardstick()
  rows = [measure(name, step, args, yardstick)
          for name, step, args in steps(options.large)]
  print_table(rows, COLUMNS)
  result = {"target": TARGET, "jax": jax.__version__, "rows": rows}
  write_json(options.json, result)
  return result


if __name__ == "__main__":
  main()
