"""Issue 37's steps timed on a real GPU, against what jlms predicted.

    python -m benchmarks.hidden_copies_gpu [--only NAME ...] [--steps N]
        [--json PATH] [--hlo DIR]

On a machine with an NVIDIA GPU. Each step of `benchmarks.hidden_copies`
is planned as there, for an H100 (deviceless), and run on the local GPU
with its real host copies: the scanned MLP at `budget="min"`, the 4-layer
GPT of width 4096 at 16 GiB with its moments on host, and the 6.58B GPT
with its state where the H100's plan puts it (give the process
`XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB` room for it: 16 GiB of moments).

Per step: the planning seconds, the first call's (the local compile and
one step), the median of `--steps` steps after two warm-ups (each waited
for), the allocator's high-water mark, the first and last loss, and jlms's
predicted time and exposed copies, as planned (the H100's calibration) and
at the schedule model's constants. A step fed its own outputs (donated
state) runs as training would. With `--hlo DIR` the local GPU's compiled
program is kept (gzipped; or with JLMS_HLO_DIR set), for the schedule model on any machine.

With `JAX_ENABLE_PGLE=1` (and `JAX_PGLE_PROFILING_RUNS`) in the
environment, JAX's own profile-guided latency estimation recompiles each
step from a measured profile after its profiling runs: the warm-ups are
then that many more, and the row says so.
"""

from __future__ import annotations

import argparse
import os
import gzip
import pathlib
import statistics
import time

import jax

import jlms
from benchmarks import hidden_copies
from benchmarks._output import print_table, write_json
from benchmarks._predicted import prediction_columns

GIB = 1 << 30


def _next_args(args: tuple, outputs, donated: tuple) -> tuple:
  """The arguments of the next step: the step's new state in the donated
  places (or in the first, for a step that donates nothing), the rest as
  they were."""
  state, _ = outputs
  places = donated or (0,)
  new = list(args)
  if len(places) == 1:
    new[places[0]] = state
  else:
    for place, value in zip(places, state):
      new[place] = value
  return tuple(new)


def _loss(outputs) -> float:
  return float(jax.tree.leaves(outputs[1])[0])


def measure(name, case, keywords, steps: int, hlo_dir) -> dict:
  device = jax.local_devices()[0]
  pgle = bool(jax.config.jax_enable_pgle)
  profiling_runs = int(jax.config.jax_pgle_profiling_runs) if pgle else 0
  row = {"step": name, "device": device.device_kind, "jax": jax.__version__,
         "pgle": pgle, "error": None}
  # verify=False: its extra compiles of jax.jit's program cost minutes here.
  step = jlms.offload(case.step, **{**keywords, "target": hidden_copies.TARGET,
                                    "verify": False})
  donated = keywords.get("donate_argnums", ())
  try:
    args = jax.block_until_ready(jax.jit(case.make_args)())
    started = time.perf_counter()
    plan = step.plan(*args)
    row["planning_s"] = round(time.perf_counter() - started, 1)
    row.update(prediction_columns(plan))
    row["state_leaves_on_host"] = plan.state_leaves
    # Where the plan keeps them, once, as a training loop would.
    args = jax.block_until_ready(step.place(*args))
    started = time.perf_counter()
    outputs = jax.block_until_ready(step(*args))
    row["first_call_s"] = round(time.perf_counter() - started, 1)
    row["first_loss"] = _loss(outputs)
    args = _next_args(args, outputs, donated)
    for _ in range(1 + profiling_runs + (1 if pgle else 0)):
      args = _next_args(args, jax.block_until_ready(step(*args)), donated)
    times = []
    for _ in range(steps):
      started = time.perf_counter()
      outputs = jax.block_until_ready(step(*args))
      times.append((time.perf_counter() - started) * 1e3)
      args = _next_args(args, outputs, donated)
    row.update(measured_ms=round(statistics.median(times), 2),
               step_ms=[round(t, 2) for t in times],
               last_loss=_loss(outputs),
               peak_in_use_gib=round(
                   (device.memory_stats() or {}).get("peak_bytes_in_use", 0)
                   / GIB, 2))
    if row["predicted_ms"]:
      row["measured_over_predicted"] = round(
          row["measured_ms"] / row["predicted_ms"], 3)
    if hlo_dir is not None:
      text = step.lower(*args).compile().as_text()
      path = pathlib.Path(hlo_dir) / f"{name.split(',')[0].replace(' ', '_')}.hlo.gz"
      path.parent.mkdir(parents=True, exist_ok=True)
      with gzip.open(path, "wt") as f:
        f.write(text)
  except Exception as error:  # one step's failure is a row
    row["error"] = f"{type(error).__name__}: {str(error)[:400]}"
  return row


COLUMNS = ("step", "device", "pgle", "measured_ms", "predicted_ms",
           "measured_over_predicted", "roofline_predicted_ms",
           "predicted_exposed_copy_ms", "peak_in_use_gib", "planning_s",
           "first_call_s", "first_loss", "last_loss", "error")


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--only", nargs="+", default=None,
                      help="steps whose name starts with one of these")
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--large", action="store_true")
  parser.add_argument("--json", default=None)
  parser.add_argument("--hlo", default=os.environ.get("JLMS_HLO_DIR"),
                      help="keep each compiled program here (default: "
                      "$JLMS_HLO_DIR, else not kept)")
  options = parser.parse_args(argv)
  rows = []
  for name, case, keywords, _ in hidden_copies.subjects(options.large):
    if options.only and not any(name.startswith(o) for o in options.only):
      continue
    rows.append(measure(name, case, keywords, options.steps, options.hlo))
    print_table(rows[-1:], COLUMNS)
    write_json(options.json, rows)
  return rows


if __name__ == "__main__":
  main()
