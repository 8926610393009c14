"""The main job: a real model's train step, memory and time, before and after.

    python -m benchmarks.demo [--blocks 16] [--image-size 256] [--batch 8]
                              [--target h100] [--json PATH]

A 16-block BatchNorm ResNet (64 channels, 3x3 convs, adam) at 256x256 is
compiled by XLA for an H100 without a GPU (or for the local GPU with
`--target local`): as `jax.jit`, and under `jlms.offload` with two device
budgets, 65% and 35% of jax.jit's XLA peak. For each, XLA's own memory
accounting and the predicted step time: jlms's time model of the target and,
where `../shared/tools/step_time.py` is beside the repository, that
schedule model of XLA's compiled program. Then a small copy of the model
trains a few steps on this machine under both, to show the results are the
same.

Each phase that takes more than a moment is announced before it starts,
and one that outlasts `TICK_S` seconds is announced again every `TICK_S`
seconds, so that the demo is never silent for longer (jlms's planning
reports its own stages on stderr after `jlms._progress.QUIET_S` seconds).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import contextlib
import logging
import sys
import threading
import time
import warnings

import jax

import jlms
from jlms._units import format_bytes
from benchmarks import models
from benchmarks._output import write_json
from benchmarks.frontier import load_yardstick

GIB = 1 << 30
BUDGETS = (0.65, 0.35)  # of jax.jit's XLA peak
#: The longest a phase of the demo goes without a line.
TICK_S = 8.0


@contextlib.contextmanager
def phase(what: str, ticking: bool = True, stream=None, tick_s: float = TICK_S):
  """Says `what` the demo does next and, if `ticking`, again every `tick_s`
  seconds until it is done, with the time so far. A phase that is jlms's
  planning alone passes `ticking=False`: jlms says what it is doing after
  `jlms._progress.QUIET_S` seconds itself."""
  stream = stream or sys.stdout
  print(f"> {what}", file=stream, flush=True)
  start, done = time.perf_counter(), threading.Event()

  def tick():
    while not done.wait(tick_s):
      print(f"> {what}: {time.perf_counter() - start:.0f} s so far",
            file=stream, flush=True)

  ticker = threading.Thread(target=tick, daemon=True, name="demo-phase")
  if ticking:
    ticker.start()
  try:
    yield
  finally:
    done.set()
    if ticking:
      ticker.join()


def _row(label, memory, plan, yardstick, seconds) -> dict:
  row = {"config": label, "xla": memory.as_dict(), "plan_seconds": seconds,
         "predicted_ms": plan.step_time.total_s * 1e3,
         "recomputed": len(plan.recomputed),
         "copied": len(plan.offloaded) - len(plan.recomputed)}
  if yardstick is not None:
    row["yardstick_ms"] = yardstick.estimate(memory.hlo_text)["total_ms"]
  return row


def _measure(case, target: str) -> list[dict]:
  args = case.abstract_args()
  yardstick = load_yardstick()
  with phase(f"XLA compiling jax.jit's step for {target}"):
    jit = jlms.xla_memory(jax.jit(case.step), *args, target=target)
  with phase("jlms planning the step as it is (a budget above its peak)",
             ticking=False), warnings.catch_warnings():
    # A budget above the GPU on purpose: the step as it is.
    warnings.simplefilter("ignore", UserWarning)
    as_is = jlms.offload(case.step, budget="1TiB", target=target).plan(*args)
  rows = [_row("jax.jit", jit, as_is, yardstick, 0.0)]
  for fraction in BUDGETS:
    budget = int(fraction * jit.peak_bytes)
    label = f"jlms, budget {fraction:.0%} ({budget / GIB:.2f} GiB)"
    step = jlms.offload(case.step, budget=budget, target=target)
    with phase(f"jlms planning for a budget of {fraction:.0%} of jax.jit's "
               f"XLA peak ({format_bytes(budget)})", ticking=False):
      start = time.perf_counter()
      plan = step.plan(*args)
      seconds = time.perf_counter() - start
    with phase(f"XLA compiling jlms's step for {target}"):
      memory = jlms.xla_memory(step, *args, target=target)
    if fraction == BUDGETS[-1]:
      print(plan, "\n")
    rows.append(_row(label, memory, plan, yardstick, seconds))
  print(f"{'':<32} {'XLA peak':>9} {'host':>7} {'jlms model':>11} "
        f"{'XLA schedule':>13} {'remade':>7} {'copied':>7} {'plan s':>7}")
  for r in rows:
    sched = (f"{r['yardstick_ms']:>10.1f} ms" if "yardstick_ms" in r
             else f"{'-':>13}")
    print(f"{r['config']:<32} {r['xla']['peak_bytes'] / GIB:>5.2f} GiB "
          f"{r['xla']['host_bytes'] / GIB:>3.2f} GiB "
          f"{r['predicted_ms']:>8.1f} ms {sched} {r['recomputed']:>7} "
          f"{r['copied']:>7} {r['plan_seconds']:>7.1f}")
  print(f"(peaks: XLA for {target}, deviceless; times: jlms's time model "
        "and the schedule model of XLA's compiled program, predicted, "
        "not measured)")
  return rows


def _train_small_copy(steps: int = 3) -> float:
  """Trains a small ResNet under jax.jit and jlms.offload (as little
  device memory as jlms reaches) from the same start; returns the largest
  relative difference of the losses."""
  case = models.resnet_case(blocks=2, channels=16, image_size=32, batch=4)
  print()
  with phase(f"making {case.name} on {jax.default_backend()} and planning "
             "it in the least memory jlms reaches"):
    params, stats, opt_state, images, labels = case.make_args()
    jit_step = jax.jit(case.step)
    jlms_step = jlms.offload(case.step, budget="min")
    plan = jlms_step.plan(*case.make_args())
  state_jit = state_jlms = (params, stats, opt_state)
  worst = 0.0
  print(f"Training {case.name} on {jax.default_backend()} in the least "
        f"memory jlms reaches ({format_bytes(plan.baseline_peak_bytes)} -> "
        f"{format_bytes(plan.predicted_peak_bytes)} predicted; "
        f"{len(plan.recomputed)} values recomputed, "
        f"{len(plan.offloaded) - len(plan.recomputed)} copied):")
  for i in range(steps):
    with (phase(f"compiling both steps for {jax.default_backend()} and "
                "taking the first") if i == 0 else contextlib.nullcontext()):
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
  print(f"== {case.name}: XLA memory and predicted step time on "
        f"{options.target} ==")
  rows = _measure(case, options.target)
  result = {"model": case.name, "target": options.target, "rows": rows,
            "small_copy_loss_difference": _train_small_copy()}
  write_json(options.json, result)
  return result


if __name__ == "__main__":
  main()
