"""A step planned again and again: one warning, with what it costs.

`jax.jit` traces a step again for each new argument signature (shapes,
dtypes, shardings and memory kinds, static values); jlms then plans it again too, which costs more than
the trace. Guarantees: once a step has been planned for `WARN_AFTER`
distinct signatures, one `ReplanWarning` says so with the seconds spent
planning; never more than one per step.
"""

from __future__ import annotations

import dataclasses
import warnings

WARN_AFTER = 3


class ReplanWarning(UserWarning):
  """A step has been planned for many argument signatures: its shapes,
  dtypes, shardings, memory kinds or static values change between
  calls."""

  __module__ = "jlms"  # tracebacks and reprs show the public name


@dataclasses.dataclass
class PlanCounter:
  """The plans one step has made and the seconds they took."""
  plans: int = 0
  seconds: float = 0.0
  warned: bool = False

  def record(self, seconds: float, step_name: str) -> None:
    self.plans += 1
    self.seconds += seconds
    if self.plans < WARN_AFTER or self.warned:
      return
    self.warned = True
    warnings.warn(
        f"jlms.offload({step_name}) has been planned for {self.plans} "
        f"argument signatures, {self.seconds:.2f} s of planning "
        f"({self.seconds / self.plans:.2f} s each): its arguments' shapes, "
        "dtypes, shardings, memory kinds or static values change between "
        "calls, and each new signature is traced and planned again. Pad or "
        "bucket the shapes to a few sizes, and pass each step the arrays "
        "the last one returned (a step under `shard_map` returns "
        "mesh-sharded arrays for single-device ones: place the first "
        "step's arguments on that mesh).", ReplanWarning, stacklevel=4)
