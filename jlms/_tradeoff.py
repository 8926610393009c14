"""Predicted step time against device budget: what a budget costs.

`OffloadedStep.tradeoff(...)` fits a range of budgets with the simulator
and the time model (no compile) and returns a `Tradeoff`: a table to print
and a curve to plot, so that a budget is picked knowing its price.
"""

from __future__ import annotations

import dataclasses

from jlms._schedule import StepTime
from jlms._units import format_bytes


@dataclasses.dataclass(frozen=True)
class TradeoffPoint:
  """The fastest fit of one budget; `step_time` is None when none fits."""
  #: The budget fitted, in bytes per device.
  budget_bytes: int
  #: The simulator's device peak of the fit; None when none fits.
  predicted_peak_bytes: int | None
  #: The time model's predicted step time of the fit; None when none fits.
  step_time: StepTime | None
  #: Values remade before their far reads.
  recomputed: int
  #: Values copied to host and back.
  copied: int
  #: Scan residuals moved through host inside the loops.
  streamed: int


@dataclasses.dataclass(frozen=True)
class Tradeoff:
  """Fits of several budgets for one step, with jax.jit's for reference."""
  #: One `jlms.TradeoffPoint` per budget, in the order they were fitted.
  points: tuple[TradeoffPoint, ...]
  #: The simulator's device peak of jax.jit's program.
  jit_peak_bytes: int
  #: The time model's predicted step time of jax.jit's program.
  jit_step_time: StepTime
  #: The smallest predicted peak jlms reaches.
  least_bytes: int
  #: The GPU whose time model predicts the times.
  target: str

  def __str__(self) -> str:
    jit_ms = self.jit_step_time.total_s * 1e3
    lines = [f"jlms: predicted on {self.target}: jax.jit peaks at "
             f"{format_bytes(self.jit_peak_bytes)} in {jit_ms:.3g} ms; the "
             f"least jlms reaches is {format_bytes(self.least_bytes)}",
             f"  {'budget':>11} {'peak':>11} {'step ms':>9} {'vs jit':>7} "
             f"{'recomputed':>10} {'copied':>7}"]
    for p in self.points:
      if p.step_time is None:
        lines.append(f"  {format_bytes(p.budget_bytes):>11} {'does not fit':>11}")
        continue
      ms = p.step_time.total_s * 1e3
      lines.append(
          f"  {format_bytes(p.budget_bytes):>11} "
          f"{format_bytes(p.predicted_peak_bytes):>11} {ms:>9.3g} "
          f"{ms / jit_ms:>6.2f}x {p.recomputed:>10} {p.copied:>7}")
    return "\n".join(lines)

  def plot(self, ax=None):
    """Predicted step time (ms) against budget (GiB), jax.jit marked."""
    import matplotlib.pyplot as plt
    if ax is None:
      _, ax = plt.subplots(figsize=(6, 4))
    fits = [p for p in self.points if p.step_time is not None]
    ax.plot([p.budget_bytes / 2**30 for p in fits],
            [p.step_time.total_s * 1e3 for p in fits], "o-", label="jlms",
            gid="jlms")
    ax.plot([self.jit_peak_bytes / 2**30], [self.jit_step_time.total_s * 1e3],
            "s", label="jax.jit", gid="jit")
    ax.set_xlabel("device budget (GiB)")
    ax.set_ylabel(f"predicted step time on {self.target} (ms)")
    ax.legend()
    return ax
