"""Issue 37's steps timed on a real GPU, against what jlms predicted.

    python -m benchmarks.hidden_copies_gpu [--only NAME ...] [--steps N]
        [--target NAME] [--link] [--json PATH] [--hlo DIR]

On a machine with an NVIDIA GPU. Each step of `benchmarks.hidden_copies`
is planned as there, for an H100 (deviceless; `--target` names another of
jlms's targets, such as the local GPU's own), and run on the local GPU
with its real host copies: the scanned MLP at `budget="min"`, the 4-layer
GPT of width 4096 at 16 GiB with its moments on host, and the 6.58B GPT
with its state where the H100's plan puts it (give the process
`XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB` room for it: 16 GiB of moments).

Per step: the planning seconds, the first call's (the local compile and
one step), the median of `--steps` steps after two warm-ups (each waited
for), the allocator's high-water mark, the first and last loss, and jlms's
predicted time and exposed copies, as planned (the H100's calibration) and
at the schedule model's constants. With `--link`, the host link's speed
each way is measured first (a 2 GiB array between the device and pinned
host memory, the median of five copies), and each step's prediction is
given a third time with the link at that speed. A step fed its own outputs (donated
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


def measure_link(nbytes: int = 2 * GIB, repeats: int = 5) -> dict:
  """The host link's achieved speed each way, in bytes per second: the
  median time of `repeats` copies of an `nbytes` array from the device to
  pinned host memory and back, each waited for."""
  device = jax.local_devices()[0]
  on_device = jax.sharding.SingleDeviceSharding(device, memory_kind="device")
  on_host = jax.sharding.SingleDeviceSharding(device,
                                              memory_kind="pinned_host")
  value = jax.device_put(jax.numpy.ones((nbytes // 4,), "float32"), on_device)
  speeds = {}
  for direction, source, destination in (("d2h", value, on_host),
                                         ("h2d", None, on_device)):
    source = value if source is not None else jax.block_until_ready(
        jax.device_put(value, on_host))
    jax.block_until_ready(jax.device_put(source, destination))  # warm-up
    times = []
    for _ in range(repeats):
      started = time.perf_counter()
      jax.block_until_ready(jax.device_put(source, destination))
      times.append(time.perf_counter() - started)
    speeds[f"{direction}_bytes_per_s"] = nbytes / statistics.median(times)
  return {"step": "host link", "device": device.device_kind,
          "jax": jax.__version__, "bytes": nbytes,
          **{key: round(value) for key, value in speeds.items()}}


def _time_steps(row: dict, step, args: tuple, donated: tuple, steps: int,
                warmups: int) -> tuple:
  """Times `steps` calls of `step` after its first call and `warmups`
  more, each fed the last one's state and waited for, into `row`; returns
  the arguments of the next call."""
  device = jax.local_devices()[0]
  started = time.perf_counter()
  outputs = jax.block_until_ready(step(*args))
  row["first_call_s"] = round(time.perf_counter() - started, 1)
  row["first_loss"] = _loss(outputs)
  args = _next_args(args, outputs, donated)
  for _ in range(warmups):
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
  return args


def measure_jit(name, case, keywords, steps: int) -> dict:
  """The row of `jax.jit` of one step (its donations kept), on the local
  GPU, for the compute the offloaded step has beside its copies."""
  device = jax.local_devices()[0]
  donated = keywords.get("donate_argnums", ())
  row = {"step": f"{name}, jax.jit", "device": device.device_kind,
         "jax": jax.__version__, "target": None,
         "pgle": bool(jax.config.jax_enable_pgle),
         "xla_flags": os.environ.get("XLA_FLAGS", ""), "error": None}
  try:
    args = jax.block_until_ready(jax.jit(case.make_args)())
    _time_steps(row, jax.jit(case.step, donate_argnums=donated), args,
                donated, steps, 1)
  except Exception as error:  # out of memory, say: a row
    row["error"] = f"{type(error).__name__}: {str(error)[:400]}"
  return row


def measure(name, case, keywords, steps: int, target: str,
            link_bytes_per_s: float | None) -> tuple[dict, tuple | None]:
  """The row of one step, and (the offloaded step, its next arguments)
  where it ran."""
  device = jax.local_devices()[0]
  pgle = bool(jax.config.jax_enable_pgle)
  profiling_runs = int(jax.config.jax_pgle_profiling_runs) if pgle else 0
  row = {"step": name, "device": device.device_kind, "jax": jax.__version__,
         "target": target, "pgle": pgle,
         "xla_flags": os.environ.get("XLA_FLAGS", ""), "error": None}
  # verify=False: its extra compiles of jax.jit's program cost minutes here.
  step = jlms.offload(case.step, **{**keywords, "target": target,
                                    "verify": False})
  donated = keywords.get("donate_argnums", ())
  kept = None
  try:
    args = jax.block_until_ready(jax.jit(case.make_args)())
    started = time.perf_counter()
    plan = step.plan(*args)
    row["planning_s"] = round(time.perf_counter() - started, 1)
    row.update(prediction_columns(plan))
    if link_bytes_per_s:
      _, at_link = plan.step_times_with(link_bytes_per_s=link_bytes_per_s)
      row.update(link_predicted_ms=round(at_link.total_s * 1e3, 2),
                 link_predicted_exposed_copy_ms=round(
                     at_link.exposed_transfer_s * 1e3, 2))
    row["state_leaves_on_host"] = plan.state_leaves
    # Where the plan keeps them, once, as a training loop would.
    args = jax.block_until_ready(step.place(*args))
    args = _time_steps(row, step, args, donated, steps,
                       1 + profiling_runs + (1 if pgle else 0))
    for key in ("predicted_ms", "link_predicted_ms"):
      if row.get(key):
        row[f"measured_over_{key}"] = round(row["measured_ms"] / row[key], 3)
    # Kept last, once the row is written: a long compile cut off by a
    # time limit then loses only the program.
    kept = (step, args)
  except Exception as error:  # one step's failure is a row
    row["error"] = f"{type(error).__name__}: {str(error)[:400]}"
  return row, kept


def keep_program(name: str, step, args, hlo_dir) -> None:
  """The local GPU's compiled program of `step`, gzipped into `hlo_dir`."""
  text = step.lower(*args).compile().as_text()
  path = pathlib.Path(hlo_dir) / f"{name.split(',')[0].replace(' ', '_')}.hlo.gz"
  path.parent.mkdir(parents=True, exist_ok=True)
  with gzip.open(path, "wt") as f:
    f.write(text)


COLUMNS = ("step", "target", "pgle", "measured_ms", "predicted_ms",
           "measured_over_predicted_ms", "link_predicted_ms",
           "measured_over_link_predicted_ms", "roofline_predicted_ms",
           "predicted_exposed_copy_ms", "peak_in_use_gib", "planning_s",
           "first_call_s", "first_loss", "last_loss", "error")


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--only", nargs="+", default=None,
                      help="steps whose name starts with one of these")
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--large", action="store_true")
  parser.add_argument("--target", default=hidden_copies.TARGET,
                      help="the jlms target each step is planned for")
  parser.add_argument("--link", action="store_true",
                      help="measure the host link first, and predict each "
                      "step at its speed too")
  parser.add_argument("--jit", action="store_true",
                      help="also time each step under plain jax.jit")
  parser.add_argument("--json", default=None)
  parser.add_argument("--hlo", default=os.environ.get("JLMS_HLO_DIR"),
                      help="keep each compiled program here (default: "
                      "$JLMS_HLO_DIR, else not kept)")
  options = parser.parse_args(argv)
  rows, link = [], None
  if options.link:
    rows.append(measure_link())
    link = min(rows[0]["d2h_bytes_per_s"], rows[0]["h2d_bytes_per_s"])
    print(rows[0])
  for name, case, keywords, _ in hidden_copies.subjects(options.large,
                                                     options.target):
    if options.only and not any(name.startswith(o) for o in options.only):
      continue
    row, kept = measure(name, case, keywords, options.steps, options.target,
                        link)
    rows.append(row)
    print_table(rows[-1:], COLUMNS)
    write_json(options.json, rows)
    if options.hlo is not None and kept is not None:
      try:
        keep_program(name, *kept, options.hlo)
      except Exception as error:  # the row stands without its program
        row["program_error"] = f"{type(error).__name__}: {str(error)[:400]}"
        write_json(options.json, rows)
    del kept  # its arguments are off the device before jax.jit's run
    if options.jit:
      rows.append(measure_jit(name, case, keywords, options.steps))
      print_table(rows[-1:], COLUMNS)
      write_json(options.json, rows)
  return rows


if __name__ == "__main__":
  main()
