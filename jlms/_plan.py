"""`Plan`: what an offload does to a step, in words and numbers.

A `Plan` is built from a flat program, its liveness and the chosen offloads;
it holds no traced values, so it can be kept, printed and compared freely.
Its `str()` reads like TFLMS's info log.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import numpy as np

from jlms import _compat
from jlms._config import OffloadConfig
from jlms._cost import time_constants
from jlms._liveness import Liveness, aval_nbytes, largest_equation
from jlms._loops import ScanResidual
from jlms._names import elide
from jlms._planner import Offload
from jlms._program import Program
from jlms._report import plan_html, plot_plan
from jlms._schedule import StepTime
from jlms._simulator import MemoryTimeline
from jlms._units import format_bytes



#: How many of the offloaded values a plan lists, largest first.
LISTED = 20
#: The widest a value's name is shown in `str(plan)`'s table; longer names
#: are elided in the middle, at '/'s (`jlms._names.elide`).
NAME_WIDTH = 64


def shape_text(dtype, shape) -> str:
  """'float32[8, 256, 256, 64]': how the plan and the report show a shape."""
  name = (str(dtype) if _compat.is_extended_dtype(dtype)  # a PRNG key
          else np.dtype(dtype).name)
  return f"{name}{list(shape)}"


@dataclasses.dataclass(frozen=True)
class OffloadedValue:
  """One value the step keeps in pinned host memory for a while.

  Equation indices are positions in the flattened step (`Plan.num_equations`
  in all); `len(step)` stands for the step's outputs.
  """
  #: Name stack and primitive of the equation that makes the value.
  name: str
  #: file:line of the user's code that made it.
  source: str
  #: The value's shape.
  shape: tuple[int, ...]
  #: The value's dtype.
  dtype: np.dtype
  #: The value's size in bytes.
  nbytes: int
  #: Index of the equation that makes it.
  produced_at: int
  #: Index of the equation after which it is copied to host.
  swapped_out_after: int
  #: Index of the equation before which each copy back to the device is
  #: issued (or, for a recomputed value, where it is remade): one entry per
  #: swap-in.
  prefetched_before: tuple[int, ...]
  #: Indices of the reads served by the copies back (or the remade value).
  used_at: tuple[int, ...]
  #: A scan's stacked residual, moved one slice per iteration inside the
  #: loops (`produced_at` and `swapped_out_after` are then the forward scan,
  #: `prefetched_before` the scans that read it back).
  streamed: bool = False
  #: Made again before its far reads instead of copied (`prefetched_before`
  #: are then where it is remade); nothing of it goes to host.
  recomputed: bool = False

  @property
  def marked_name(self) -> str:
    """The name as the plan lists it: '*' before a streamed scan residual,
    '+' before a recomputed value."""
    return ("*" if self.streamed else "+" if self.recomputed else "") + (
        self.name)

  @property
  def shape_text(self) -> str:
    """Dtype and shape as the plan shows them: 'float32[8, 256, 256, 64]'."""
    return shape_text(self.dtype, self.shape)

  @property
  def swap_ins(self) -> int:
    """How many times the value comes back to the device (or is remade)."""
    return len(self.prefetched_before)

  @property
  def moved_bytes(self) -> int:
    """Bytes this value sends over the host link, out and back."""
    return 0 if self.recomputed else self.nbytes * (1 + self.swap_ins)


@dataclasses.dataclass(frozen=True)
class Plan:
  """What `jlms.offload` does to one abstract signature of a step."""
  #: TFLMS's knobs the plan was made with (`jlms.OffloadConfig`).
  config: OffloadConfig
  #: Equations of the flattened step (forward, backward and update).
  num_equations: int
  #: Values (arguments and equation outputs) of the flattened step.
  num_values: int
  #: Bytes of the step's arguments (parameters, optimizer state, batch).
  argument_bytes: int
  #: Name of the equation whose inputs and outputs take the most bytes.
  largest_equation: str
  #: Its index in the flattened step (-1 for a step with no equation).
  largest_equation_index: int
  #: Bytes of its inputs and outputs together.
  largest_equation_bytes: int
  #: The values the plan copies to host, streams through host or
  #: recomputes, one `jlms.OffloadedValue` each.
  offloaded: tuple[OffloadedValue, ...] = dataclasses.field(repr=False)
  #: The simulator's device and host bytes per equation without
  #: offloading (`plot` draws it); None where no simulation was made.
  baseline: MemoryTimeline | None = dataclasses.field(default=None,
                                                       repr=False)
  #: The same with this plan.
  timeline: MemoryTimeline | None = dataclasses.field(default=None,
                                                       repr=False)
  #: (value, bytes) of the 20 largest values alive at the predicted peak.
  live_at_peak: tuple[tuple[str, int], ...] = dataclasses.field(
      default=(), repr=False)
  #: The device budget fitted, in bytes per device; None under TFLMS's
  #: knobs, for `budget="min"` and where there was no device to fit.
  budget_bytes: int | None = None
  #: XLA's device peak of the chosen program, compiled for `xla_target`;
  #: None where XLA was not asked.
  xla_peak_bytes: int | None = None
  #: The target XLA compiled the program for to measure `xla_peak_bytes`.
  xla_target: str | None = None
  #: Equations chained by barriers (`serialize`).
  serialized: int = 0
  #: The runs of equations that run chunk by chunk over the batch
  #: (`split_batch`), one line each.
  split_over_batch: tuple[str, ...] = ()
  #: A callable giving the time model's predicted (jax.jit's, this plan's)
  #: step times on `time_target`, evaluated when first asked for by
  #: `baseline_step_time` or `step_time` (a training loop never asks); its
  #: keywords replace fields of the time model (`step_times_with`).
  step_times: Callable[..., tuple[StepTime, StepTime]] | None = (
      dataclasses.field(default=None, repr=False, compare=False))
  #: The GPU whose time model predicts the step times.
  time_target: str | None = None
  #: Whether the plan was chosen for a budget, rather than by TFLMS's knobs.
  fitted: bool = False
  #: Why a plan that was made runs as jax.jit's program instead (it would
  #: not lower the peak); None when it is applied or none was sought.
  not_applied: str | None = None
  #: Where the step takes each argument from: a pytree shaped like its
  #: dynamic arguments (a pair with the keywords' when it has some), each
  #: leaf "device" or "pinned_host". None before the arguments are known.
  argument_kinds: Any = dataclasses.field(default=None, repr=False)
  #: Where the step gives each output back: a pytree shaped like its
  #: outputs, each leaf "device" or "pinned_host".
  output_kinds: Any = dataclasses.field(default=None, repr=False)
  #: State leaves (parameters, optimizer state) kept in pinned host memory
  #: between steps.
  state_leaves: int = 0
  #: State leaves whose update runs inside the loop that makes their
  #: gradients (so that no gradient stack of them is made).
  state_updated_in_loops: int = 0
  #: Whole copies of state on host (fetches and write-backs) pinned beside
  #: the backward pass, each update where its gradient is made
  #: (`jlms._state_pins`).
  state_copies_pinned: int = 0
  #: Bytes of the state leaves kept on host.
  state_host_bytes: int = 0
  #: How many devices share the step's arrays where its jaxpr holds them
  #: whole (`AxisType.Auto` mesh axes, `jlms._sharding.unseen_split`): the
  #: predicted peaks are then the whole step's, and a device holds about a
  #: `split`-th of them. 1 where the jaxpr's sizes are one device's.
  split: int = 1

  @functools.cached_property
  def _predicted_times(self) -> tuple[StepTime | None, StepTime | None]:
    return (None, None) if self.step_times is None else self.step_times()

  @property
  def baseline_step_time(self) -> StepTime | None:
    """Predicted time of one step of `jax.jit(step)`'s program."""
    return self._predicted_times[0]

  @property
  def step_time(self) -> StepTime | None:
    """Predicted time of one step with this plan."""
    return self._predicted_times[1]

  def step_times_with(self, efficiency: float | None = None,
                      link_bytes_per_s: float | None = None
                      ) -> tuple[StepTime | None, StepTime | None]:
    """(jax.jit's, this plan's) predicted step times by the same time model
    with other constants: every kind of kernel at `efficiency` of its
    roofline, and the host link moving `link_bytes_per_s` each way (None:
    the target's calibration and link, as `step_time`). With
    `efficiency=1.0, link_bytes_per_s=55e9` it prices the plan as a
    roofline schedule model of XLA's compiled program does
    (../shared/tools/step_time.py), so that the two can be compared apart
    from the calibration to a real H100."""
    constants = time_constants(efficiency, link_bytes_per_s)
    if self.step_times is None:
      return None, None
    if not constants:
      return self._predicted_times
    return self.step_times(**constants)

  @property
  def baseline_peak_bytes(self) -> int | None:
    """Predicted device peak of `jax.jit(step)`."""
    return None if self.baseline is None else self.baseline.peak_bytes

  @property
  def predicted_peak_bytes(self) -> int | None:
    """Predicted device peak of the step with this plan."""
    return None if self.timeline is None else self.timeline.peak_bytes

  @property
  def predicted_host_bytes(self) -> int | None:
    """Predicted largest amount of pinned host memory in use at once."""
    return None if self.timeline is None else self.timeline.host_peak_bytes

  @property
  def fits_as_is(self) -> bool:
    """Whether the plan leaves the step as it is: nothing offloaded or
    recomputed, no state on host or updated in a loop, and no loop
    rewritten (a scan's
    residuals remade inside its backward loop change the predicted peak
    without a value of their own)."""
    return (not self.offloaded and not self.state_leaves
            and not self.state_updated_in_loops
            and self.predicted_peak_bytes == self.baseline_peak_bytes)

  @property
  def recomputed(self) -> tuple[OffloadedValue, ...]:
    """The values made again rather than copied."""
    return tuple(v for v in self.offloaded if v.recomputed)

  @property
  def offloaded_bytes(self) -> int:
    """Bytes copied to host (each offloaded value once)."""
    return sum(v.nbytes for v in self.offloaded if not v.recomputed)

  @property
  def prefetched_bytes(self) -> int:
    """Bytes copied back to the device (once per swap-in)."""
    return sum(v.nbytes * v.swap_ins for v in self.offloaded
               if not v.recomputed)

  @property
  def host_traffic_bytes(self) -> int:
    """Bytes over the host link in one step, both ways."""
    return self.offloaded_bytes + self.prefetched_bytes

  def largest_offloaded(self) -> tuple[OffloadedValue, ...]:
    """The values that `str(plan)` and the HTML report list: the
    `LISTED` largest, largest first."""
    return tuple(sorted(self.offloaded, key=lambda v: -v.nbytes)[:LISTED])

  def plot(self, ax=None, *, show_budget: bool = True):
    """Device memory over one step with and without offloading, the budget
    line and the swaps (matplotlib); returns the Axes."""
    return plot_plan(self, ax=ax, show_budget=show_budget)

  def _repr_html_(self) -> str:
    return plan_html(self)

  def __str__(self) -> str:
    c = self.config
    copied = [v for v in self.offloaded if not v.recomputed]
    lines = [
        f"jlms: the step has {self.num_equations} equations and "
        f"{self.num_values} values",
        f"jlms: the step's arguments (parameters, optimizer state, batch) take "
        f"{format_bytes(self.argument_bytes)}",
        f"jlms: the largest equation is {self.largest_equation} (equation "
        f"{self.largest_equation_index}) with "
        f"{format_bytes(self.largest_equation_bytes)} of inputs and outputs",
        ("jlms: chosen per value by the time model: keep, recompute, or "
         "copy to host and back"
         if self.fitted else
         f"jlms: settings: min_bytes {c.min_bytes}, swapout_threshold "
         f"{c.swapout_threshold}, prefetch_ahead {c.prefetch_ahead}, "
         f"swapin_groupby {c.groupby}, sync_mode {int(c.sync_mode)}"),
        f"jlms: offloaded {len(copied)} values: {len(copied)} swap-outs "
        f"({format_bytes(self.offloaded_bytes)}) and "
        f"{sum(v.swap_ins for v in copied)} swap-ins "
        f"({format_bytes(self.prefetched_bytes)})",
    ]
    if self.recomputed:
      lines.append(
          f"jlms: recomputed {len(self.recomputed)} values "
          f"({format_bytes(sum(v.nbytes for v in self.recomputed))}) before "
          "their far reads instead of keeping them (marked +)")
    streamed = [v for v in self.offloaded if v.streamed]
    if streamed:
      lines.append(
          f"jlms: {len(streamed)} of them are scan residuals "
          f"({format_bytes(sum(v.nbytes for v in streamed))}), moved one "
          "slice per iteration inside the loops (marked *)")
    if self.state_leaves:
      lines.append(
          f"jlms: {self.state_leaves} state leaves "
          f"({format_bytes(self.state_host_bytes)}) live in pinned host "
          "memory between steps: read slice by slice where the scans read "
          "them, updated in loops of slices or fetched whole beside the "
          "backward pass, written back to host")
    if self.state_copies_pinned:
      lines.append(
          f"jlms: {self.state_copies_pinned} whole copies of state run "
          "beside the backward pass, each update where its gradient is "
          "made")
    if self.state_updated_in_loops:
      lines.append(
          f"jlms: the updates of {self.state_updated_in_loops} state leaves "
          "run inside the loops that make their gradients, one layer at a "
          "time: no gradient stack of them is made")
    if self.serialized:
      lines.append(f"jlms: {self.serialized} equations serialized (chained "
                   "by barriers)")
    for run in self.split_over_batch:
      lines.append(f"jlms: split over the batch: {run}")
    if self.baseline is not None and self.timeline is not None:
      if self.split > 1:
        # The budget is one device's; these are the whole step's bytes.
        lines.append(
            f"jlms: predicted peak of the whole step over {self.split} "
            f"devices (its arrays carry no sharding: Auto mesh axes) "
            f"{format_bytes(self.baseline_peak_bytes)} without offloading, "
            f"{format_bytes(self.predicted_peak_bytes)} with it: about "
            f"{format_bytes(self.baseline_peak_bytes // self.split)} and "
            f"{format_bytes(self.predicted_peak_bytes // self.split)} a "
            f"device; host {format_bytes(self.predicted_host_bytes)}")
      else:
        lines.append(
            f"jlms: predicted device peak "
            f"{format_bytes(self.baseline_peak_bytes)} without offloading, "
            f"{format_bytes(self.predicted_peak_bytes)} with it; host "
            f"{format_bytes(self.predicted_host_bytes)}")
    if self.budget_bytes is not None:
      verdict = "fits without offloading" if self.fits_as_is else "fitted"
      if (verdict == "fitted" and self.xla_peak_bytes is not None
          and self.predicted_peak_bytes is not None
          and self.xla_peak_bytes <= self.budget_bytes
          < self.predicted_peak_bytes):
        # The relaxed fit (`jlms._offload._relaxed_search`) searches the
        # simulator's bytes above the budget where XLA's peak is below it.
        verdict += (" by XLA's peak (the simulator's prediction is above "
                    "the budget: it overstates this plan's peak)")
      lines.append(f"jlms: budget {format_bytes(self.budget_bytes)}: {verdict}")
    if self.not_applied is not None:
      lines.append(f"jlms: the step runs as jax.jit's program: "
                   f"{self.not_applied}")
    if self.step_time is not None and self.baseline_step_time is not None:
      lines.append(
          f"jlms: predicted step time on {self.time_target}: jax.jit "
          f"{self.baseline_step_time.describe()}; with this plan "
          f"{self.step_time.describe()}")
    if self.xla_peak_bytes is not None:
      lines.append(f"jlms: XLA's peak on {self.xla_target}: "
                   f"{format_bytes(self.xla_peak_bytes)}")
    shown = self.largest_offloaded()
    if shown:
      lines.extend(_value_table(shown))
      if len(self.offloaded) > len(shown):
        lines.append(f"  ... and {len(self.offloaded) - len(shown)} smaller")
    return "\n".join(lines)


def build_plan(program: Program, liveness: Liveness,
               offloads: tuple[Offload, ...], config: OffloadConfig,
               baseline: MemoryTimeline | None = None,
               timeline: MemoryTimeline | None = None,
               residuals: tuple[ScanResidual, ...] = (), **extra) -> Plan:
  """The plan of `offloads` and of the scan `residuals` streamed through
  host; `extra` sets the budget, time model and XLA fields."""
  largest_index, largest_bytes = largest_equation(program, liveness)
  largest_name = (program.equations[largest_index].readable_name()
                  if largest_index >= 0 else "none")
  values = []
  for offload in offloads:
    aval = program.avals[offload.value]
    producer = program.equations[liveness.producer[offload.value]]
    values.append(OffloadedValue(
        name=producer.readable_name(),
        source=_compat.user_frame_summary(producer.eqn.source_info),
        shape=tuple(aval.shape),
        dtype=np.dtype(aval.dtype),
        nbytes=liveness.nbytes[offload.value],
        produced_at=liveness.producer[offload.value],
        swapped_out_after=offload.swap_out_after,
        prefetched_before=tuple(s.issue_before for s in offload.swap_ins),
        used_at=tuple(r for s in offload.swap_ins for r in s.reads),
        recomputed=offload.is_recompute,
    ))
  for residual in residuals:
    if residual.producer is None:  # state on host: `Plan.state_leaves`
      continue
    aval = program.avals[residual.value]
    producer = program.equations[residual.producer]
    values.append(OffloadedValue(
        name=producer.readable_name(),
        source=_compat.user_frame_summary(producer.eqn.source_info),
        shape=tuple(aval.shape),
        dtype=np.dtype(aval.dtype),
        nbytes=aval_nbytes(aval),
        produced_at=residual.producer,
        swapped_out_after=residual.producer,
        prefetched_before=residual.readers,
        used_at=residual.readers,
        streamed=True,
    ))
  return Plan(
      config=config,
      num_equations=len(program),
      num_values=len(program.avals),
      argument_bytes=sum(liveness.nbytes[v] for v in program.invars),
      largest_equation=largest_name,
      largest_equation_index=largest_index,
      largest_equation_bytes=largest_bytes,
      offloaded=tuple(values),
      baseline=baseline,
      timeline=timeline,
      live_at_peak=() if timeline is None else tuple(
          (_value_name(program, liveness, v), liveness.nbytes[v])
          for v in timeline.live_at_peak[:20]),
      **extra,
  )


def _value_table(values) -> list[str]:
  """The rows of `str(plan)` for `values`, with a header. Nothing is cut:
  shapes and equation lists set their columns' widths, and a name wider
  than `NAME_WIDTH` is elided in the middle at '/'s; one that still does
  not fit (a single long part) takes a line of its own, the row's other
  columns on the next."""
  rows = [(v.marked_name, v.shape_text, format_bytes(v.nbytes),
           str(v.produced_at), str(v.swapped_out_after),
           ",".join(str(i) for i in v.prefetched_before)) for v in values]
  header = ("value", "shape", "size", "made", "out", "in before")
  name_width = max(len(header[0]), min(NAME_WIDTH,
                                       max(len(r[0]) for r in rows)))
  widths = [max(len(header[i]), *(len(r[i]) for r in rows))
            for i in range(1, len(header))]

  def line(name, cells) -> str:
    shape, *numbers = cells
    return "  " + " ".join([f"{name:<{name_width}}",
                            f"{shape:<{widths[0]}}",
                            *(f"{n:>{w}}" for n, w in zip(numbers,
                                                          widths[1:]))])

  lines = [line(header[0], header[1:]).rstrip()]
  for name, *cells in rows:
    shown = elide(name, name_width)
    if len(shown) > name_width:
      lines.append(f"  {shown}")
      shown = ""
    lines.append(line(shown, cells))
  return lines


def _value_name(program: Program, liveness: Liveness, value: int) -> str:
  made_by = liveness.producer[value]
  aval = program.avals[value]
  shape = shape_text(aval.dtype, aval.shape)
  if made_by < 0:
    return f"argument {program.invars.index(value)} {shape}"
  return f"{program.equations[made_by].readable_name()} {shape}"
