"""Library models at their published sizes, planned for an H100 deviceless.

`python -m benchmarks.library_models [--models llama gpt2 ...]
[--configs jit plain min] [--json PATH]`

For each model of `benchmarks.real_models` at its "realistic" size (a
batch that does not fit an H100 under `jax.jit`), and each configuration:

- "jit": `jax.jit` with the step's donation: the seconds to lower and
  compile it for the H100 (deviceless), XLA's peak and host bytes;
- "plain": `jlms.offload(step, target="h100")` with the donation: the
  seconds to trace, plan and confirm it with XLA (the plan's own
  compiles), then XLA's peak and host bytes of the program that runs;
- "min": the same with `budget="min"`;
- "remat": `jax.jit` of the model with each block under `nn.remat`
  (`REAL_MODELS[name](size, remat=True)`), the peer jlms is held to;
- "remat-peak": jlms with the budget of the "remat" row's XLA peak (which
  runs it first, if it is not asked for before);
- any size ("52.5GiB"): the same with that budget.

Times: jlms's prediction (its H100 time model) and the schedule model of
XLA's compiled program (`../shared/tools/step_time.py`), where present.
A configuration that fails is a row with its error. Needs the `models` and
`aot` extras and a machine with room for the compiles (a few GiB each).
"""

from __future__ import annotations

import argparse
import time

import jax

import jlms
from benchmarks import real_models
from benchmarks._output import write_json
from benchmarks.frontier import load_yardstick

TARGET = "h100"
GIB = 1 << 30
DEFAULT_MODELS = ("llama", "gpt2", "bart", "resnet50", "nnx_transformer",
                  "equinox_transformer", "gemma2")
DEFAULT_CONFIGS = ("jit", "plain")


def _first_line(error: BaseException) -> str:
  lines = str(error).strip().splitlines()
  return f"{type(error).__name__}: {lines[0] if lines else ''}"


def measure(real, config: str, yardstick) -> dict:
  """One row of figures of `real` under `config` (see the module
  docstring)."""
  row = {"model": real.name, "config": config, "seconds": None,
         "peak_gib": None, "host_gib": None, "predicted_ms": None,
         "schedule_ms": None, "recomputed": None, "copied": None,
         "error": None}
  args = real.abstract_args()
  start = time.perf_counter()
  try:
    if config == "jit":
      fn = real.jitted()
      memory = jlms.xla_memory(fn, *args, target=TARGET)
      row["seconds"] = round(time.perf_counter() - start, 1)
    else:
      options = {} if config == "plain" else {"budget": config}
      fn = real.offload(target=TARGET, **options)
      plan = fn.plan(*args)
      row["seconds"] = round(time.perf_counter() - start, 1)
      row.update(predicted_ms=round(plan.step_time.total_s * 1e3, 1),
                 recomputed=len(plan.recomputed),
                 copied=len(plan.offloaded) - len(plan.recomputed))
      # The program that runs, compiled as the plan confirmed it (jlms's
      # compile cache returns it).
      memory = jlms.xla_memory(fn, *args, target=TARGET)
  except Exception as error:  # a row that fails must not stop the others
    row["error"] = _first_line(error)
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row
  row.update(peak_gib=round(memory.peak_bytes / GIB, 2),
             host_gib=round(memory.host_bytes / GIB, 2))
  if yardstick is not None:
    row["schedule_ms"] = round(float(
        yardstick.estimate(memory.hlo_text)["total_ms"]), 1)
  return row


def _cell(value) -> str:
  return "-" if value is None else str(value)


def print_table(rows) -> None:
  columns = ("model", "config", "seconds", "peak_gib", "host_gib",
             "predicted_ms", "schedule_ms", "recomputed", "copied")
  print(" | ".join(columns))
  for row in rows:
    cells = [_cell(row[c]) for c in columns]
    if row["error"]:
      cells.append(row["error"])
    print(" | ".join(cells), flush=True)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", nargs="+", default=DEFAULT_MODELS,
                      choices=sorted(real_models.REAL_MODELS))
  parser.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS)
  parser.add_argument("--json", default=None)
  options = parser.parse_args(argv)
  jax.config.update("jax_platforms", "cpu")
  yardstick = load_yardstick()
  rows = []
  # Importing `gemma` replaces Flax's `Module.param` for the whole process
  # (`real_models.gemma2`): the other models are built first.
  for name in sorted(options.models, key=lambda name: name == "gemma2"):
    real = real_models.REAL_MODELS[name]("realistic")
    remat_row = None
    for config in options.configs:
      if config in ("remat", "remat-peak") and remat_row is None:
        remat = real_models.REAL_MODELS[name]("realistic", remat=True)
        remat_row = dict(measure(remat, "jit", yardstick), model=real.name,
                         config="remat")
        rows.append(remat_row)
        print_table(rows[-1:])
      if config == "remat":
        continue
      if config == "remat-peak":
        if remat_row["peak_gib"] is None:
          continue
        row = measure(real, f"{remat_row['peak_gib']}GiB", yardstick)
      else:
        row = measure(real, config, yardstick)
      rows.append(row)
      print_table(rows[-1:])
  print()
  print_table(rows)
  write_json(options.json, {"target": TARGET, "jax": jax.__version__,
                            "rows": rows})


if __name__ == "__main__":
  main()
