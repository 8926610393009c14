"""The train step's state kept in pinned host memory, on an H100.

    JAX_PLATFORMS=cpu python -m benchmarks.state_on_host [--layers 12 24]
                                                         [--no-large] [--json PATH]

Every program is compiled deviceless for the H100 (`jlms.xla_memory(...,
target="h100")`); each row holds XLA's device peak, its host argument and
host temporary bytes, the state the plan keeps on host (`plan.state_leaves`,
`plan.state_host_bytes`), and the step time predicted two ways: by the
plan's own time model (`plan.step_time`; `plan.baseline_step_time` for the
jax.jit rows) and by the schedule model of XLA's compiled program, the
yardstick `../shared/tools/step_time.py` (`estimate(hlo)`).

1. The scanned GPT of `models.zoo_gpt_case(seq=1024, batch_size=8, layers=L,
   width=512, heads=8)` for each L of `--layers`: `jax.jit(step,
   donate_argnums=(0, 1))`, and `jlms.offload(step, donate_argnums=(0, 1),
   budget="min", target="h100", state_on_host=S)` with S False (the state
   stays on the device) and None (the planner's choice, which for "min" is
   the state on host).
2. Unless `--no-large`: the 6.58B-parameter GPT (32 layers, width 4096, 32
   heads), its arguments placed on an H100 (`jlms.target_devices("h100")`)
   so that plain `jlms.offload(step, donate_argnums=(0, 1))`, with no
   budget and no target, fits the device it infers. jax.jit's program
   (about 309 GiB) is compiled too. XLA's pinned host pool is left as the
   environment says (64 GB unless `XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB` is
   set; recorded in the JSON). Its jlms row also holds the yardstick ratio:
   predicted time / max(compute time, state bytes / 52 GB/s, jlms's H100
   link), the time that the state's trip over PCIe (each way at once)
   allows at best.

A row that fails records the first line of its error; the others go on.
When the yardstick file is missing its columns are left empty.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import pathlib
import time
from typing import Any

import jax

import jlms
from benchmarks import models
from benchmarks._output import write_json
from benchmarks._predicted import prediction_columns
from benchmarks.frontier import YARDSTICK_PATH, _cell, load_yardstick
from benchmarks.sharded import on_one_device

TARGET = "h100"
GIB = models.GIB
# The H100's host link (PCIe Gen5 x16), achieved bytes/s per direction:
# jlms's own figure, the one the plans are made with.
HOST_LINK_BYTES_PER_S = models.host_link(TARGET)[1]
# XLA's pinned host pool for the 6.58B model, in GB.
DONATED = (0, 1)

_REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_JSON = _REPO_ROOT / "benchmarks" / "results" / f"state_on_host_{TARGET}.json"

JIT = "jax.jit"
JLMS_STATE_ON_DEVICE = "jlms min, state_on_host=False"
JLMS_STATE_PLANNED = "jlms min, state_on_host=None"
JLMS_DEFAULT = "jlms.offload (no budget)"


def _first_line(error: BaseException) -> str:
  lines = str(error).strip().splitlines()
  return f"{type(error).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def _ms(seconds: float | None) -> float | None:
  return None if seconds is None else round(seconds * 1e3, 3)


def _plan_figures(plan) -> dict:
  """The plan's state on host, XLA peak and predicted step times."""
  time_ = plan.step_time
  return {
      "state_leaves": plan.state_leaves,
      "state_host_bytes": plan.state_host_bytes,
      "plan_xla_peak_bytes": plan.xla_peak_bytes,
      "predicted_ms": _ms(time_.total_s),
      "predicted_compute_ms": _ms(time_.compute_s),
      "predicted_recompute_ms": _ms(time_.recompute_s),
      "predicted_exposed_copy_ms": _ms(time_.exposed_transfer_s),
      "jit_predicted_ms": _ms(plan.baseline_step_time.total_s),
      # The same at the schedule model's constants (kernels at their
      # roofline, its link): the figures to hold against its times.
      **{key: value for key, value in prediction_columns(plan).items()
         if key.startswith("roofline_")},
  }


def measure(model: str, config: str, fn, args: tuple, yardstick) -> dict:
  """One row: XLA's bytes of `fn(*args)` compiled for the H100, the
  plan's figures when `fn` is a jlms step, and the yardstick's times; or
  the error of the step that failed."""
  row: dict[str, Any] = {
      "model": model, "config": config,
      "peak_bytes": None, "host_argument_bytes": None, "host_temp_bytes": None,
      "state_leaves": None, "state_host_bytes": None, "predicted_ms": None,
      "total_ms": None, "compute_ms": None, "exposed_copy_ms": None,
      "seconds": None, "error": None,
  }
  start = time.perf_counter()
  try:
    if isinstance(fn, jlms.OffloadedStep):
      row.update(_plan_figures(fn.plan(*args)))
    memory = jlms.xla_memory(fn, *args, target=TARGET)
  except Exception as error:  # a row that fails must not stop the others
    row["error"] = _first_line(error)
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row
  row.update(peak_bytes=memory.peak_bytes,
             host_argument_bytes=memory.host_argument_bytes,
             host_temp_bytes=memory.host_temp_bytes)
  if yardstick is not None:
    try:
      times = yardstick.estimate(memory.hlo_text)
      row.update({key: round(float(times[key]), 3) for key in
                  ("total_ms", "compute_ms", "exposed_copy_ms",
                   "d2h_mib", "h2d_mib")})
    except Exception as error:
      row["error"] = f"yardstick: {_first_line(error)}"
  row["seconds"] = round(time.perf_counter() - start, 1)
  return row


def _jit_prediction(jit_row: dict, jlms_row: dict) -> None:
  """Gives the jax.jit row the plan's prediction of jax.jit's program."""
  jit_row["predicted_ms"] = jlms_row.get("jit_predicted_ms")


def small_rows(layers: int, yardstick) -> list[dict]:
  """Part 1: the width-512 scanned GPT of `layers` layers under jax.jit and
  under `budget="min"` with the state on the device and as planned."""
  case = models.zoo_gpt_case(seq=1024, batch_size=8, layers=layers, width=512, heads=8)
  args = jax.eval_shape(case.make_args)
  model = f"gpt L{layers} w512"
  rows = [measure(model, JIT, jax.jit(case.step, donate_argnums=DONATED),
                  args, yardstick)]
  for config, state_on_host in ((JLMS_STATE_ON_DEVICE, False),
                                (JLMS_STATE_PLANNED, None)):
    step = jlms.offload(case.step, donate_argnums=DONATED, budget="min",
                        target=TARGET, state_on_host=state_on_host)
    rows.append(measure(model, config, step, args, yardstick))
  _jit_prediction(rows[0], rows[1])
  return rows


def large_rows(yardstick) -> list[dict]:
  """Part 2: the 6.58B-parameter GPT, its arguments on an H100, under
  jax.jit and under plain `jlms.offload`, with the yardstick ratio."""
  case = models.zoo_gpt_case(seq=1024, batch_size=8, layers=32, width=4096, heads=32)
  args = on_one_device(jax.eval_shape(case.make_args), TARGET)
  model = "gpt 6.58B"
  parameters = sum(x.size for x in jax.tree.leaves(args[0]))
  step = jlms.offload(case.step, donate_argnums=DONATED)
  jlms_row = measure(model, JLMS_DEFAULT, step, args, yardstick)
  jit_row = measure(model, JIT, jax.jit(case.step, donate_argnums=DONATED),
                    args, yardstick)
  _jit_prediction(jit_row, jlms_row)
  for row in (jit_row, jlms_row):
    row.update(parameters=parameters, host_memory_limit_gb=os.environ.get(
        "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"))
  if jlms_row["predicted_ms"] is not None:
    jlms_row.update(_yardstick_ratios(jlms_row))
  return [jit_row, jlms_row]


def _yardstick_ratios(row: dict) -> dict:
  """The issue's yardstick: predicted time over max(compute time, the
  state's bytes over one PCIe direction), by the plan's model and by the
  schedule model of the compiled program."""
  transfer_ms = row["state_host_bytes"] / HOST_LINK_BYTES_PER_S * 1e3
  ratios = {"state_transfer_ms": round(transfer_ms, 3),
            "ratio_plan": round(row["predicted_ms"] / max(
                row["predicted_compute_ms"], transfer_ms), 3)}
  if row["total_ms"] is not None:
    ratios["ratio_schedule_model"] = round(row["total_ms"] / max(
        row["compute_ms"], transfer_ms), 3)
  return ratios


# --- printing ------------------------------------------------------------------

_HEADER = (f"{'model':<12} {'config':<30} {'peak GiB':>9} {'host arg GiB':>12} "
           f"{'host tmp GiB':>12} {'state':>5} {'state GiB':>9} "
           f"{'plan ms':>9} {'sched ms':>9} {'s':>5}  note")


def format_row(row: dict) -> str:
  note = row["error"] or ""
  if row.get("ratio_plan") is not None:
    note = (f"ratio {row['ratio_plan']:.2f} (plan), "
            f"{row.get('ratio_schedule_model', float('nan')):.2f} (sched)"
            + (f"; {note}" if note else ""))
  state = "-" if row["state_leaves"] is None else str(row["state_leaves"])
  return (f"{row['model']:<12} {row['config']:<30} {_cell(row['peak_bytes'], GIB)} "
          f"{_cell(row['host_argument_bytes'], GIB, 12)} "
          f"{_cell(row['host_temp_bytes'], GIB, 12)} {state:>5} "
          f"{_cell(row['state_host_bytes'], GIB)} "
          f"{_cell(row['predicted_ms'], digits=1)} {_cell(row['total_ms'], digits=1)} "
          f"{_cell(row['seconds'], width=5, digits=0)}  {note}")


def _large_details(row: dict) -> str:
  """The 6.58B jlms row's plan time split and its yardstick ratio."""
  if row.get("predicted_ms") is None:
    return f"6.58B: no plan ({row['error']})"
  return (f"6.58B jlms plan: compute {row['predicted_compute_ms']:.1f} ms, "
          f"recompute {row['predicted_recompute_ms']:.1f} ms, exposed copy "
          f"{row['predicted_exposed_copy_ms']:.1f} ms, total "
          f"{row['predicted_ms']:.1f} ms; plan's XLA peak "
          f"{_cell(row['plan_xla_peak_bytes'], GIB, 0)} GiB; state "
          f"{row['state_host_bytes'] / GIB:.2f} GiB over PCIe "
          f"{row['state_transfer_ms']:.1f} ms; ratio {row['ratio_plan']:.3f} "
          f"(plan), {row.get('ratio_schedule_model')} (schedule model)")


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--layers", type=int, nargs="+", default=[12, 24])
  parser.add_argument("--no-large", action="store_true",
                      help="leave out the 6.58B-parameter GPT")
  parser.add_argument("--json", default=str(DEFAULT_JSON))
  args = parser.parse_args(argv)

  yardstick = load_yardstick()
  if yardstick is None:
    print(f"state_on_host: {YARDSTICK_PATH} is absent: the schedule-model "
          "columns are unavailable")
  started = time.perf_counter()
  rows = []
  print(_HEADER, flush=True)
  parts = [lambda layers=layers: small_rows(layers, yardstick)
           for layers in args.layers]
  if not args.no_large:
    parts.append(lambda: large_rows(yardstick))
  for part in parts:
    for row in part():
      rows.append(row)
      print(format_row(row), flush=True)
  if not args.no_large:
    print(_large_details(rows[-1]))
  print(f"state_on_host: {len(rows)} rows in {time.perf_counter() - started:.0f} s")

  result = {
      "target": TARGET, "jax": jax.__version__,
      "yardstick": str(YARDSTICK_PATH) if yardstick is not None else None,
      "pcie_bytes_per_s": HOST_LINK_BYTES_PER_S,
      "host_memory_limit_gb": os.environ.get(
          "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"),
      "rows": rows,
  }
  write_json(args.json, result)
  return result


if __name__ == "__main__":
  main()
