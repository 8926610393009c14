"""Fitting a step into a memory budget with the least host traffic.

`tune` searches the offload knobs with the simulator, as TFLMSv2's
auto-tuner did: for each size floor (`min_bytes`, from the sizes of the
values that could move) it bisects `swapout_threshold`, to within a few
percent, for the largest one whose predicted peak fits the budget, since a larger threshold and a larger
floor both move fewer bytes. Among the settings that fit it keeps the one
with the least host traffic. It never compiles: `jlms.offload` confirms the
choice with XLA and calls `tune` again with a tighter budget if XLA
disagrees.

Guarantees: `Tuning.chosen` is None exactly when the step's predicted peak
without offloading fits; otherwise it is the trial with the least host
traffic among those whose predicted peak fits, or `tune` raises
`BudgetError` naming the smallest peak it found and what it is made of.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import sys
import time

import numpy as np

from jlms._config import OffloadConfig
from jlms._liveness import Liveness, largest_equation
from jlms._plan import format_bytes
from jlms._planner import Offload, candidates, plan_offloads
from jlms._program import Program
from jlms._simulator import Fusion, MemoryTimeline, analyse_fusion, simulate

log = logging.getLogger("jlms")

_MAX_SIZE_FLOORS = 6
_THRESHOLD_RESOLUTION = 32  # bisection stops within 1/32 of the threshold
_STEPS_PER_FLOOR = 10  # about how many settings one size floor takes
_PROGRESS_AFTER_SECONDS = 2.0
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 1 << 10, "m": 1e6,
          "mb": 1e6, "mib": 1 << 20, "g": 1e9, "gb": 1e9, "gib": 1 << 30,
          "t": 1e12, "tb": 1e12, "tib": 1 << 40}


class BudgetError(ValueError):
  """The step cannot fit the memory budget, however much is offloaded."""


def parse_budget(budget, device_bytes=None) -> int:
  """Bytes of `budget`: an int of bytes, a size such as "20GiB" or "512 MB",
  or a percentage such as "90%" of `device_bytes` (a callable giving the
  device's memory, called only for a percentage)."""
  if isinstance(budget, bool):
    raise TypeError(f"jlms: budget must be bytes or a string, got {budget!r}")
  if isinstance(budget, (int, np.integer)):
    if budget <= 0:
      raise ValueError(f"jlms: budget must be positive, got {budget}")
    return int(budget)
  if not isinstance(budget, str):
    raise TypeError(f"jlms: budget must be bytes, a size string such as "
                    f"'20GiB' or a percentage such as '90%', got {budget!r}")
  text = budget.strip().lower().replace(" ", "")
  match = re.fullmatch(r"(\d+(?:\.\d*)?|\.\d+)(%|[a-z]*)", text)
  if match is None or match.group(2) not in (*_UNITS, "%"):
    raise ValueError(f"jlms: cannot read budget {budget!r}: use bytes, a size "
                     "such as '20GiB' or a percentage such as '90%'")
  number, unit = float(match.group(1)), match.group(2)
  if unit == "%":
    if not 0 < number <= 100:
      raise ValueError(f"jlms: budget percentage must be in (0, 100], got "
                       f"{budget!r}")
    if device_bytes is None:
      raise ValueError("jlms: a percentage budget needs the device's memory: "
                       "run on a GPU or name a target such as 'h100'")
    return int(device_bytes() * number / 100)
  value = int(number * _UNITS[unit])
  if value <= 0:
    raise ValueError(f"jlms: budget must be positive, got {budget!r}")
  return value


@dataclasses.dataclass(frozen=True)
class Trial:
  """One setting of the knobs and what the simulator predicts for it."""
  config: OffloadConfig
  predicted_peak_bytes: int
  host_traffic_bytes: int
  offloaded_values: int

  def describe(self) -> str:
    c = self.config
    return (f"min_bytes={c.min_bytes}, swapout_threshold="
            f"{c.swapout_threshold}, prefetch_ahead={c.prefetch_ahead}: "
            f"predicted peak {format_bytes(self.predicted_peak_bytes)}, "
            f"{self.offloaded_values} values offloaded, host traffic "
            f"{format_bytes(self.host_traffic_bytes)}")


@dataclasses.dataclass(frozen=True)
class Tuning:
  """The outcome of one search."""
  budget_bytes: int
  baseline_peak_bytes: int
  chosen: Trial | None  # None: the step fits without offloading
  trials: tuple[Trial, ...]
  seconds: float


class _Progress:
  """A one-line progress bar on stderr, shown only once a search has taken
  longer than a couple of seconds, and only on a terminal (in a log file
  or a captured stream its redraws would pile up)."""

  def __init__(self, total: int):
    self.total, self.done = total, 0
    self.start = time.perf_counter()
    self.shown = False
    isatty = getattr(sys.stderr, "isatty", None)
    self.enabled = bool(isatty and isatty())

  def step(self) -> None:
    self.done += 1
    if not self.enabled or (
        time.perf_counter() - self.start < _PROGRESS_AFTER_SECONDS):
      return
    self.shown = True
    filled = int(30 * self.done / max(self.total, 1))
    sys.stderr.write(f"\rjlms: tuning [{'#' * filled:<30}] "
                     f"{self.done}/{self.total}")
    sys.stderr.flush()

  def close(self) -> None:
    if self.shown:
      sys.stderr.write("\n")
      sys.stderr.flush()


class _Evaluator:
  """Plans and simulates settings of one program, reusing what does not
  depend on the setting."""

  def __init__(self, program: Program, liveness: Liveness):
    self.program, self.liveness = program, liveness
    self.unforced = analyse_fusion(program, liveness)
    self.trials: list[Trial] = []
    self.offloads: dict[OffloadConfig, tuple[Offload, ...]] = {}

  def candidate_sizes(self, floor: int) -> list[int]:
    """Size floors worth trying: the sizes of the values that could move
    (a floor between two of them moves the same values as the larger)."""
    values = candidates(self.program, self.liveness, max(floor, 1),
                        self.unforced.materialized)
    return sorted({self.liveness.nbytes[v] for v in values}, reverse=True)

  def evaluate(self, config: OffloadConfig) -> Trial:
    offloads = plan_offloads(self.program, self.liveness, config,
                             self.unforced.materialized)
    fusion = self._fusion(offloads)
    timeline = simulate(self.program, self.liveness, offloads, fusion)
    nbytes = self.liveness.nbytes
    traffic = sum(nbytes[o.value] * (1 + len(o.swap_ins)) for o in offloads)
    trial = Trial(config, timeline.peak_bytes, traffic, len(offloads))
    self.offloads[config] = offloads
    self.trials.append(trial)
    log.info("jlms: tried %s", trial.describe())
    return trial

  def _fusion(self, offloads) -> Fusion:
    forced = [o.value for o in offloads
              if not self.unforced.materialized[o.value]]
    if not forced:
      return self.unforced
    return analyse_fusion(self.program, self.liveness,
                          frozenset(o.value for o in offloads))


def tune(program: Program, liveness: Liveness, budget_bytes: int,
         base: OffloadConfig, baseline: MemoryTimeline | None = None
         ) -> tuple[Tuning, tuple[Offload, ...]]:
  """The setting with the least host traffic whose predicted peak fits
  `budget_bytes`, and its offloads (empty when the step fits as it is).
  `base` gives the knobs that are not searched (`prefetch_ahead`,
  `sync_mode`) and the smallest `min_bytes` considered."""
  start = time.perf_counter()
  if baseline is None:
    baseline = simulate(program, liveness)
  log.info("jlms: budget %s; predicted peak without offloading %s",
           format_bytes(budget_bytes), format_bytes(baseline.peak_bytes))
  if baseline.peak_bytes <= budget_bytes:
    log.info("jlms: the step fits without offloading; nothing is rewritten")
    return Tuning(budget_bytes, baseline.peak_bytes, None, (),
                  time.perf_counter() - start), ()

  evaluator = _Evaluator(program, liveness)
  sizes = evaluator.candidate_sizes(base.min_bytes)
  if len(sizes) > _MAX_SIZE_FLOORS:
    picks = np.linspace(0, len(sizes) - 1, _MAX_SIZE_FLOORS).round()
    sizes = [sizes[int(i)] for i in picks]
  smallest_threshold = max(2, base.prefetch_ahead + 1)
  largest_threshold = max(len(program), smallest_threshold)
  progress = _Progress(len(sizes) * _STEPS_PER_FLOOR)

  def fits(min_bytes: int, threshold: int) -> bool:
    trial = evaluator.evaluate(dataclasses.replace(
        base, min_bytes=min_bytes, swapout_threshold=threshold,
        swapin_groupby=None))
    progress.step()
    if trial.predicted_peak_bytes <= budget_bytes:
      fitting.append(trial)
      return True
    return False

  fitting: list[Trial] = []
  try:
    for min_bytes in sizes:
      # The most eager threshold first: if it does not fit, no larger one
      # does at this floor.
      if not fits(min_bytes, smallest_threshold):
        continue
      # Then bisect for the largest threshold that fits (fewer, later
      # swaps): by geometric means, since thresholds span orders of
      # magnitude, until the bracket is a few percent wide.
      good, bad = smallest_threshold, largest_threshold + 1
      while bad - good > max(1, good // _THRESHOLD_RESOLUTION):
        middle = min(bad - 1, max(good + 1, round((good * bad) ** 0.5)))
        if fits(min_bytes, middle):
          good = middle
        else:
          bad = middle
  finally:
    progress.close()

  trials = tuple(evaluator.trials)
  seconds = time.perf_counter() - start
  if not fitting:
    raise _budget_error(program, liveness, budget_bytes, baseline, trials)
  best = min(fitting, key=lambda t: (t.host_traffic_bytes,
                                     t.predicted_peak_bytes))
  log.info("jlms: chose %s (%d settings tried in %.2f s); pass "
           "min_bytes=%d, swapout_threshold=%d to jlms.offload to skip the "
           "search", best.describe(), len(trials), seconds,
           best.config.min_bytes, best.config.swapout_threshold)
  return (Tuning(budget_bytes, baseline.peak_bytes, best, trials, seconds),
          evaluator.offloads[best.config])


def _budget_error(program, liveness, budget_bytes, baseline,
                  trials) -> BudgetError:
  smallest = min(trials, key=lambda t: t.predicted_peak_bytes,
                 default=None)
  minimum = smallest.predicted_peak_bytes if smallest else baseline.peak_bytes
  fixed = baseline.fixed_bytes
  index, equation_bytes = largest_equation(program, liveness)
  if fixed >= equation_bytes:
    cause = (f"the step's arguments and outputs (parameters, optimizer "
             f"state, batch), which take {format_bytes(fixed)} on the device "
             "for the whole step")
    advice = ("donate the state (donate_argnums) so that outputs reuse "
              "argument buffers, shard parameters and optimizer state over "
              "devices, or use a smaller model or batch")
  else:
    name = program.equations[index].readable_name()
    cause = (f"its largest equation, {name} (equation {index}), which "
             f"needs {format_bytes(equation_bytes)} of inputs and outputs at "
             "once")
    advice = ("shrink that operation (a smaller batch or image, or split it "
              "into chunks), or shard it over devices")
  error = BudgetError(
      f"jlms: the step cannot fit a budget of {format_bytes(budget_bytes)}: "
      f"the smallest peak jlms can reach is {format_bytes(minimum)} "
      f"(predicted; {format_bytes(baseline.peak_bytes)} without offloading). "
      f"It is dominated by {cause}. To fit, {advice}; or raise the budget to "
      f"at least {format_bytes(minimum)}.")
  # The setting with the smallest predicted peak, for a caller that can
  # check it another way (XLA) before giving up.
  error.smallest = smallest
  return error
