"""jlms's predicted step time of a plan, in the terms of the schedule model
of XLA's compiled program (`../shared/tools/step_time.py`).

jlms plans with its target's calibration: each kind of kernel at the share
of its roofline it reached in steps timed on an H100, and the host link at
the 52 GB/s measured inside a jitted program (`jlms._cost`). The schedule
model prices XLA's program with every kernel at its roofline and the link
at 55 GB/s. Compared as they are, the two differ by the calibration as
much as by what each says waits for what; so every row gives jlms's
prediction twice: as planned, and with the schedule model's constants
(`jlms.Plan.step_times_with`), the one to hold against the schedule model.
"""

from __future__ import annotations

#: The host link of the schedule model (its `PCIE_BW`), each way.
SCHEDULE_MODEL_LINK_BYTES_PER_S = 55e9


def _ms(seconds: float) -> float:
  return round(seconds * 1e3, 2)


def prediction_columns(plan) -> dict:
  """A plan's predicted step time, its exposed copies and exchanges, as
  planned and at the schedule model's constants ("roofline_" keys)."""
  planned = plan.step_time
  _, roofline = plan.step_times_with(
      efficiency=1.0, link_bytes_per_s=SCHEDULE_MODEL_LINK_BYTES_PER_S)
  columns = {}
  for prefix, time in (("", planned), ("roofline_", roofline)):
    columns.update({
        f"{prefix}predicted_ms": _ms(time.total_s),
        f"{prefix}predicted_compute_ms": _ms(time.compute_s
                                             + time.recompute_s),
        f"{prefix}predicted_exposed_copy_ms": _ms(time.exposed_transfer_s),
        f"{prefix}predicted_exchange_ms": _ms(time.exposed_collective_s)})
  return columns


def schedule_columns(schedule: dict) -> dict:
  """The schedule model's figures of a compiled program (the dict of its
  `estimate`): total, compute and exposed copy time, the bytes each way
  over the host link, and the link floor (the larger direction's bytes at
  the schedule model's link)."""
  moved = max(schedule["d2h_mib"], schedule["h2d_mib"]) * 2**20
  return {
      "schedule_ms": round(schedule["total_ms"], 2),
      "schedule_compute_ms": round(schedule["compute_ms"], 2),
      "schedule_exposed_copy_ms": round(schedule["exposed_copy_ms"], 2),
      "d2h_gib": round(schedule["d2h_mib"] / 1024, 2),
      "h2d_gib": round(schedule["h2d_mib"] / 1024, 2),
      "link_floor_ms": round(moved / SCHEDULE_MODEL_LINK_BYTES_PER_S * 1e3,
                             2)}


def relative_error(predicted: float | None, measured: float | None):
  """predicted / measured - 1, rounded; None where either is missing or
  the measure is zero."""
  if predicted is None or not measured:
    return None
  return round(predicted / measured - 1, 3)
