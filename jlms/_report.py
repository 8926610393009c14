"""Pictures of a `Plan`: its memory timelines as a plot, and as HTML for
Jupyter.

Guarantees:

- `plot_plan` draws the simulator's numbers unchanged, only divided by one
  unit (GiB, MiB or KiB) for the whole Axes: the lines "without offloading",
  "with jlms" and "host" have `plan.baseline.device_bytes`,
  `plan.timeline.device_bytes` and `plan.timeline.host_bytes` as y data, over
  equation indices `0 .. num_equations` (the last is the step's end). Swap-outs
  and swap-ins are one marker each, along the bottom of the Axes. Each drawn
  line has a gid ("baseline", "plan", "host", "budget", "xla_peak",
  "swap_out", "swap_in") by which a caller or test can find it.
- `plan_html` returns one self-contained HTML string (no scripts, no files:
  the plot is an inline base64 PNG) in which every name taken from the
  program is escaped.
- matplotlib is imported only here and only when drawing; nothing calls
  `pyplot.show`, so both work under Agg.
"""

from __future__ import annotations

import base64
import html
import io
from typing import TYPE_CHECKING

import numpy as np

from jlms._units import format_bytes

if TYPE_CHECKING:
  from jlms._plan import Plan

_UNITS = (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))
_BASELINE_COLOR = "#8c8c8c"
_PLAN_COLOR = "#1f77b4"
_HOST_COLOR = "#ff7f0e"
_BUDGET_COLOR = "#d62728"
_XLA_COLOR = "#2ca02c"
_SWAP_OUT_COLOR = "#9467bd"
_SWAP_IN_COLOR = "#17becf"


def plot_unit(plan: Plan) -> tuple[str, int]:
  """The unit the plot of `plan` uses: the largest in which its tallest
  quantity is at least 1."""
  tallest = max(_plotted_bytes(plan), default=0)
  for name, size in _UNITS:
    if tallest >= size:
      return name, size
  return "B", 1


def _plotted_bytes(plan: Plan) -> list[int]:
  heights = [int(plan.timeline.device_bytes.max()),
             int(plan.timeline.host_bytes.max())]
  if plan.baseline is not None:
    heights.append(int(plan.baseline.device_bytes.max()))
  if plan.budget_bytes is not None:
    heights.append(plan.budget_bytes)
  if plan.xla_peak_bytes is not None:
    heights.append(plan.xla_peak_bytes)
  return heights


def plot_plan(plan: Plan, ax=None, show_budget: bool = True):
  """Device memory over one step without offloading and with `plan`, host
  memory, the budget, XLA's peak and the swaps; returns the Axes.

  With `ax=None` a new figure is made with pyplot, so that Jupyter shows it.
  """
  if plan.timeline is None:
    raise ValueError(
        "jlms: this plan has no predicted memory timeline (Plan.timeline is "
        "None), so there is nothing to plot; plans from "
        "jlms.offload(step).plan(*args) carry one")
  if ax is None:
    import matplotlib.pyplot as plt
    _, ax = plt.subplots(figsize=(10, 4.8), layout="constrained")
  unit, size = plot_unit(plan)
  timeline = plan.timeline
  steps = np.arange(len(timeline.device_bytes))

  if plan.baseline is not None:
    # jax.jit's program and the plan's may differ in length (loops remade,
    # fused equations placed at their readers): each on its own equations.
    ax.plot(np.arange(len(plan.baseline.device_bytes)),
            plan.baseline.device_bytes / size, drawstyle="steps-post",
            color=_BASELINE_COLOR, linewidth=1.5,
            label="device, without offloading", gid="baseline")
    _annotate_peak(ax, plan.baseline, size, unit, "peak without",
                   _BASELINE_COLOR, above=True)
  ax.plot(steps, timeline.device_bytes / size, drawstyle="steps-post",
          color=_PLAN_COLOR, linewidth=2, label="device, with jlms", gid="plan")
  _annotate_peak(ax, timeline, size, unit, "peak with jlms", _PLAN_COLOR,
                 above=False)
  ax.plot(steps, timeline.host_bytes / size, drawstyle="steps-post",
          color=_HOST_COLOR, linewidth=1, linestyle="--",
          label="pinned host, with jlms", gid="host")

  if show_budget and plan.budget_bytes is not None:
    ax.axhline(plan.budget_bytes / size, color=_BUDGET_COLOR, linestyle=":",
               linewidth=1.5, gid="budget",
               label=f"budget {format_bytes(plan.budget_bytes)}")
  if plan.xla_peak_bytes is not None:
    # XLA reports one number, not a timeline: shown where the simulator
    # puts the peak, so that the two peaks can be compared by eye.
    ax.plot([timeline.peak_index], [plan.xla_peak_bytes / size],
            linestyle="none", marker="D", markersize=7, color=_XLA_COLOR,
            gid="xla_peak",
            label=f"XLA's peak on {plan.xla_target}: "
            f"{format_bytes(plan.xla_peak_bytes)}")

  # Swaps as a rug in axes coordinates, one row each below zero: their
  # positions matter, not a height.
  rug = ax.get_xaxis_transform()
  outs = [v.swapped_out_after for v in plan.offloaded]
  ins = [i for v in plan.offloaded for i in v.prefetched_before]
  if outs:
    ax.plot(outs, np.full(len(outs), 0.06), transform=rug, linestyle="none",
            marker="v", markersize=5, color=_SWAP_OUT_COLOR, alpha=0.7,
            gid="swap_out", label=f"swap-out ({len(outs)})")
  if ins:
    ax.plot(ins, np.full(len(ins), 0.025), transform=rug, linestyle="none",
            marker="^", markersize=5, color=_SWAP_IN_COLOR, alpha=0.7,
            gid="swap_in", label=f"swap-in ({len(ins)})")

  ax.set_xlim(0, len(steps) - 1)
  # Room at the bottom for the rug and at the top for the annotations.
  top = max(_plotted_bytes(plan)) / size
  ax.set_ylim(-0.14 * top, 1.18 * top)
  ax.set_xlabel(f"equation of the flattened step ({len(steps) - 1} = end "
                "of the step)")
  ax.set_ylabel(f"memory ({unit})")
  ax.set_title(f"jlms plan: {len(plan.offloaded)} values offloaded, "
               f"{format_bytes(plan.offloaded_bytes)} to host")
  ax.grid(True, alpha=0.3)
  ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small",
            frameon=False)
  return ax


def _annotate_peak(ax, timeline, size, unit, what, color, above):
  x, y = timeline.peak_index, timeline.peak_bytes / size
  ax.plot([x], [y], marker="o", markersize=5, color=color, linestyle="none")
  ax.annotate(f"{what}: {format_bytes(timeline.peak_bytes)}", (x, y),
              xytext=(8, 6 if above else -16), textcoords="offset points",
              fontsize="small", color=color,
              bbox=dict(boxstyle="round,pad=0.15", facecolor="white",
                        edgecolor="none", alpha=0.85))


def plot_png(plan: Plan, dpi: int = 100) -> bytes:
  """`plot_plan` of `plan` as PNG bytes, drawn without pyplot (no figure is
  left open, and Jupyter does not show it a second time)."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure
  figure = Figure(figsize=(10, 4.8), layout="constrained")
  FigureCanvasAgg(figure)
  plot_plan(plan, ax=figure.add_subplot())
  buffer = io.BytesIO()
  figure.savefig(buffer, format="png", dpi=dpi)
  return buffer.getvalue()


# -- HTML --------------------------------------------------------------------

_STYLE = """<style>
.jlms-plan table {border-collapse: collapse; margin: 0.3em 0 1em 0;
  font-size: 0.9em;}
.jlms-plan th, .jlms-plan td {border: 1px solid #ccc; padding: 2px 8px;
  text-align: left;}
.jlms-plan td.num {text-align: right; font-family: monospace;}
.jlms-plan h4 {margin: 0.8em 0 0.2em 0;}
</style>"""


def plan_html(plan: Plan) -> str:
  """The plan as one self-contained HTML fragment: summary, plot, largest
  offloaded values and what is live at the predicted peak."""
  parts = ['<div class="jlms-plan">', _STYLE, "<h4>jlms plan</h4>",
           _table(("quantity", "value"), _summary_rows(plan))]
  parts.append(_plot_html(plan))
  parts.append(_offloaded_html(plan))
  parts.append(_live_at_peak_html(plan))
  parts.append("</div>")
  return "\n".join(parts)


def _summary_rows(plan: Plan) -> list[tuple[str, str]]:
  c = plan.config
  rows = [
      ("equations", str(plan.num_equations)),
      ("values", str(plan.num_values)),
      ("arguments (parameters, optimizer state, batch)",
       format_bytes(plan.argument_bytes)),
      ("largest equation", f"{plan.largest_equation} (equation "
       f"{plan.largest_equation_index}), "
       f"{format_bytes(plan.largest_equation_bytes)}"),
  ]
  if plan.timeline is not None:
    rows += [
        ("predicted device peak without offloading",
         _maybe_bytes(plan.baseline_peak_bytes)),
        ("predicted device peak with jlms",
         format_bytes(plan.predicted_peak_bytes)),
        ("predicted pinned host peak", format_bytes(plan.predicted_host_bytes)),
    ]
  rows += [
      ("offloaded", f"{len(plan.offloaded)} values, "
       f"{format_bytes(plan.offloaded_bytes)}; "
       f"{sum(v.swap_ins for v in plan.offloaded)} swap-ins, "
       f"{format_bytes(plan.prefetched_bytes)}"),
      ("host traffic", format_bytes(plan.host_traffic_bytes)),
  ]
  if plan.budget_bytes is not None:
    rows.append(("budget", f"{format_bytes(plan.budget_bytes)}: "
                 f"{_verdict(plan)}"))
  if plan.xla_peak_bytes is not None:
    rows.append((f"XLA's peak on {plan.xla_target}",
                 format_bytes(plan.xla_peak_bytes)))
  if plan.step_time is not None and plan.baseline_step_time is not None:
    rows += [
        (f"predicted step time of jax.jit on {plan.time_target}",
         plan.baseline_step_time.describe()),
        (f"predicted step time with jlms on {plan.time_target}",
         plan.step_time.describe()),
    ]
  if plan.fitted:
    rows.append(("chosen", f"by the time model: {len(plan.recomputed)} "
                 f"values recomputed, "
                 f"{len(plan.offloaded) - len(plan.recomputed)} copied"))
  else:
    rows.append(("settings",
                 f"min_bytes {c.min_bytes}, swapout_threshold "
                 f"{c.swapout_threshold}, prefetch_ahead {c.prefetch_ahead}, "
                 f"swapin_groupby {c.groupby}, sync_mode {int(c.sync_mode)}"))
  return rows


def _verdict(plan: Plan) -> str:
  """Whether the step fits, by XLA's peak where known, else the
  simulator's."""
  how = "fits without offloading" if plan.fits_as_is else "fitted"
  if plan.xla_peak_bytes is not None:
    peak, by = plan.xla_peak_bytes, f"XLA's peak on {plan.xla_target}"
  elif plan.predicted_peak_bytes is not None:
    peak, by = plan.predicted_peak_bytes, "predicted peak"
  else:
    return how
  if peak > plan.budget_bytes:
    return f"over budget ({by} {format_bytes(peak)})"
  return f"{how} ({by} {format_bytes(peak)})"


def _plot_html(plan: Plan) -> str:
  if plan.timeline is None:
    return "<p><em>No memory timeline in this plan: nothing to plot.</em></p>"
  try:
    png = plot_png(plan)
  except ImportError:
    return ("<p><em>matplotlib is not installed, so the plot is left out "
            "(pip install matplotlib, or jlms[plot]).</em></p>")
  encoded = base64.b64encode(png).decode("ascii")
  return (f'<img src="data:image/png;base64,{encoded}" '
          'alt="device and host memory over the step, with and without jlms"'
          ' style="max-width: 100%;"/>')


def _offloaded_html(plan: Plan) -> str:
  """The values `str(plan)` lists, with the same names and shapes, whole
  (HTML wraps them), and how each is kept: its mark in `str(plan)`."""
  if not plan.offloaded:
    return "<p>No values are offloaded.</p>"
  listed = plan.largest_offloaded()
  rows = [(v.name, v.source, v.shape_text, format_bytes(v.nbytes),
           str(v.produced_at), str(v.swapped_out_after),
           ", ".join(str(i) for i in v.prefetched_before), _kept_as(v))
          for v in listed]
  title = (f"<h4>The {len(listed)} largest of {len(plan.offloaded)} "
           "offloaded values</h4>")
  return title + _table(
      ("value", "made by", "shape", "size", "made at", "out after",
       "in before", "kept as"), rows, numeric=(3, 4, 5, 6))


def _kept_as(value) -> str:
  if value.recomputed:
    return "recomputed (+)"
  if value.streamed:
    return "host copy, a slice per iteration (*)"
  return "host copy"


def _live_at_peak_html(plan: Plan) -> str:
  if plan.timeline is None or not plan.live_at_peak:
    return ""
  timeline = plan.timeline
  rows = [("arguments and outputs", format_bytes(timeline.fixed_bytes))]
  rows += [(name, format_bytes(nbytes)) for name, nbytes in plan.live_at_peak]
  # The plan keeps only the largest few; the rest is what adds up to the peak.
  unlisted = (timeline.peak_bytes - timeline.fixed_bytes
              - sum(nbytes for _, nbytes in plan.live_at_peak))
  if unlisted > 0:
    rows.append(("smaller values, not listed", format_bytes(unlisted)))
  title = (f"<h4>Live on the device at the predicted peak (equation "
           f"{timeline.peak_index}, {format_bytes(timeline.peak_bytes)})"
           "</h4>")
  return title + _table(("value", "size"), rows, numeric=(1,))


def _table(header, rows, numeric=()) -> str:
  lines = ["<table>", "<tr>" + "".join(
      f"<th>{html.escape(h)}</th>" for h in header) + "</tr>"]
  for row in rows:
    cells = "".join(
        f'<td class="num">{html.escape(cell)}</td>' if i in numeric
        else f"<td>{html.escape(cell)}</td>" for i, cell in enumerate(row))
    lines.append(f"<tr>{cells}</tr>")
  lines.append("</table>")
  return "\n".join(lines)


def _maybe_bytes(n: int | None) -> str:
  return "unknown" if n is None else format_bytes(n)
