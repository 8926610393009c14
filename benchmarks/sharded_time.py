"""A sharded step's time per device: jlms's prediction against the schedule
model of XLA's compiled program, on eight H100s compiled without a GPU.

    python -m benchmarks.sharded_time [--sizes small 6.45b 65b] [--json PATH]

Each GPT decoder of `SIZES` (`benchmarks.models.zoo_gpt_case`: layers
under one `nn.scan`, AdamW, float32) with its global batch split over the
eight GPUs of a 1x1x8 H100 topology and every state leaf split along its
largest axis (FSDP-style; the mesh axis is Auto, so XLA's partitioner
chooses what the devices exchange). Rows:

- "jit": `jax.jit` of the step, donated;
- "plain": `jlms.offload(step, target="h100")`, donated (jax.jit's
  program where it fits a device);
- "half": the same with a per-device budget of half of jax.jit's peak.

Seconds: jax.jit's lowering and compile; jlms's tracing, planning and
confirming compiles. Figures per device: XLA's peak; the bytes it exchanges with the others
per step (`jlms._collectives`, from the compiled program); jlms's
predicted step time and its parts; the schedule model of the compiled
program (`../shared/tools/step_time.py`), which runs every instruction on
one stream and prices a collective as HBM traffic, and that model with
the exchanges on their own NVLink (450 GB/s each way) beside the kernels
("schedule + NVLink": the larger of the two). jlms's prediction is given
as planned (its H100 calibration) and with the schedule model's constants
("roofline_", `benchmarks._predicted`), each with its error against
"schedule + NVLink".
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import time

import jax
from jax.sharding import AxisType

import jlms
from benchmarks import models
from benchmarks._output import print_table, write_json
from benchmarks._predicted import prediction_columns, relative_error
from benchmarks.frontier import load_yardstick
from benchmarks.sharded import mesh_of, shard_step_args
from jlms._collectives import collective_bytes
from jlms._cost import time_target

TARGET = "h100"
TOPOLOGY = "1x1x8"
DEVICES = 8
GIB = 1 << 30

#: GPT decoders by name: zoo_gpt_case's arguments.
SIZES = {
    "small": dict(seq=1024, batch_size=64, layers=12, width=1024, heads=16,
                  vocab=32768),
    "1.3b": dict(seq=1024, batch_size=64, layers=24, width=2048, heads=16,
                 vocab=32768),
    "6.45b": dict(seq=1024, batch_size=64, layers=32, width=4096, heads=32,
                  vocab=32768),
    # Llama-3-70B's depth, width and vocabulary (its MLP is wider, 28672
    # with three matrices): 65.5B parameters, 0.98 TiB of state.
    "65b": dict(seq=4096, batch_size=8, layers=80, width=8192, heads=64,
                vocab=128256),
}

#: jlms's host budget by size, where XLA's default pinned pool is too
#: small: one GPU's pool (XLA keeps one per GPU) on a 2 TiB node of eight
#: GPUs, leaving the processes 128 GiB.
HOST_BUDGETS = {"65b": "240GiB"}


def _row(size: str, config: str, step, args, yardstick, seconds) -> dict:
  memory = jlms.xla_memory(step, *args, target=TARGET)
  exchanged = collective_bytes(memory.hlo_text, DEVICES)
  nvlink_ms = exchanged / time_target(TARGET).interconnect_bytes_per_s * 1e3
  row = {"size": size, "config": config,
         "seconds": None if seconds is None else round(seconds, 1),
         "peak_gib": round(memory.peak_bytes / GIB, 2),
         "host_gib": round(memory.host_bytes / GIB, 2),
         "exchanged_gib": round(exchanged / GIB, 3),
         "nvlink_ms": round(nvlink_ms, 1)}
  if yardstick is not None:
    schedule = yardstick.estimate(memory.hlo_text)
    row["schedule_ms"] = round(float(schedule["total_ms"]), 1)
    row["schedule_nvlink_ms"] = round(max(row["schedule_ms"], nvlink_ms), 1)
  return row


def measure(size: str, configs, yardstick) -> list[dict]:
  case = models.zoo_gpt_case(**SIZES[size])
  abstract = jax.eval_shape(case.make_args)
  mesh = mesh_of(jlms.target_devices(TARGET, TOPOLOGY), AxisType.Auto)
  args = shard_step_args(abstract, mesh, batch_args=1, fsdp=True)
  rows, jit_peak = [], None
  for config in configs:
    start = time.perf_counter()
    if config == "jit":  # its seconds: lowering and compiling it
      step = jax.jit(case.step, donate_argnums=(0, 1))
      row = _row(size, config, step, args, yardstick, None)
      row["seconds"] = round(time.perf_counter() - start, 1)
      jit_peak = row["peak_gib"]
      rows.append(row)
      continue
    options = {}
    if config == "half":
      if jit_peak is None:
        raise ValueError("the 'half' row needs the 'jit' row before it")
      options["budget"] = int(jit_peak * GIB / 2)
    if size in HOST_BUDGETS:
      options["host_budget"] = HOST_BUDGETS[size]
    step = jlms.offload(case.step, donate_argnums=(0, 1), target=TARGET,
                        **options)
    plan = step.plan(*args)
    row = _row(size, config, step, args, yardstick,
               time.perf_counter() - start)
    row.update(prediction_columns(plan))
    if "schedule_nvlink_ms" in row:
      row["error"] = relative_error(row["predicted_ms"],
                                    row["schedule_nvlink_ms"])
      row["roofline_error"] = relative_error(row["roofline_predicted_ms"],
                                             row["schedule_nvlink_ms"])
    rows.append(row)
  return rows


COLUMNS = ("size", "config", "peak_gib", "host_gib", "exchanged_gib",
           "nvlink_ms", "predicted_ms", "predicted_compute_ms",
           "predicted_exposed_copy_ms", "predicted_exchange_ms",
           "roofline_predicted_ms", "roofline_predicted_compute_ms",
           "schedule_ms", "schedule_nvlink_ms", "error", "roofline_error",
           "seconds")


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--sizes", nargs="+", default=["small"],
                      choices=sorted(SIZES))
  parser.add_argument("--configs", nargs="+", default=["jit", "plain",
                                                       "half"])
  parser.add_argument("--json", default=None)
  args = parser.parse_args(argv)
  yardstick = load_yardstick()
  rows = []
  for size in args.sizes:
    rows.extend(measure(size, args.configs, yardstick))
  print_table(rows, COLUMNS)
  result = {"target": TARGET, "topology": TOPOLOGY, "jax": jax.__version__,
            "layout": "fsdp, Auto mesh axis", "rows": rows}
  if args.json:
    write_json(args.json, result)
  return result


if __name__ == "__main__":
  main()
