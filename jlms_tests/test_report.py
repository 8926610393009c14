"""`Plan.plot` and `Plan._repr_html_`: the plot draws the plan's numbers, the
HTML carries them, escaped, with the plot inline."""

import base64
import dataclasses
import functools
import html
import re
import sys

import matplotlib
import numpy as np
import pytest
from matplotlib.figure import Figure

import jlms
from benchmarks import models
from jlms import _report
from jlms._plan import format_bytes

MIB = 1 << 20
GIB = 1 << 30
# The MLP below peaks at 45.07 MiB without offloading (predicted; XLA:
# 45.01 MiB); fitted, at 33.07 (XLA: 33.01 on JAX 0.10.2 and 0.12.0.1).
BUDGET = 36 * MIB

# The plan is made once, on one worker (its H100 compiles take a few
# seconds).
pytestmark = pytest.mark.xdist_group("report")


@functools.cache
def _budget_plan() -> jlms.Plan:
  """A plan fitted to a budget, confirmed by XLA for an H100: the same plan
  on every platform (without a target, a GPU's XLA confirms it; a CPU has
  none to ask). The MLP this took before (8 layers of 256, batch 512,
  budget 8 MiB, 9.77 MiB predicted) has 20 MiB of temporaries in XLA's
  H100 program, which the simulator does not model: 25.02 MiB for jax.jit's
  program, deviceless as on an H100, and no plan under 8 MiB. With a batch
  of 8192 the activations make the peak, and XLA's peaks are the
  simulator's to 0.1 MiB."""
  case = models.mlp_case(depth=8, width=128, batch=8192)
  return jlms.offload(case.step, min_bytes=1, budget=BUDGET,
                      target="h100").plan(*case.abstract_args())


def _lines(ax) -> dict:
  return {line.get_gid(): line for line in ax.get_lines() if line.get_gid()}


def _axes():
  return Figure().add_subplot()


def test_budget_plan_offloads():
  plan = _budget_plan()
  assert plan.offloaded, "the tests must draw swaps"
  assert plan.baseline_peak_bytes > BUDGET >= plan.predicted_peak_bytes
  assert plan.xla_target == "h100" and plan.xla_peak_bytes <= BUDGET


def test_plot_draws_the_timelines_in_the_unit_it_names():
  plan = _budget_plan()
  ax = plan.plot(ax=_axes())
  lines = _lines(ax)
  assert "MiB" in ax.get_ylabel()
  np.testing.assert_array_equal(lines["baseline"].get_ydata(),
                                plan.baseline.device_bytes / MIB)
  np.testing.assert_array_equal(lines["plan"].get_ydata(),
                                plan.timeline.device_bytes / MIB)
  np.testing.assert_array_equal(lines["host"].get_ydata(),
                                plan.timeline.host_bytes / MIB)
  np.testing.assert_array_equal(lines["plan"].get_xdata(),
                                np.arange(plan.num_equations + 1))


def test_plot_switches_to_gib_for_large_quantities():
  plan = dataclasses.replace(_budget_plan(), budget_bytes=3 * GIB)
  ax = _report.plot_plan(plan, ax=_axes())
  assert "GiB" in ax.get_ylabel()
  np.testing.assert_array_equal(_lines(ax)["plan"].get_ydata(),
                                plan.timeline.device_bytes / GIB)


def test_plot_draws_the_budget_unless_told_not_to():
  plan = _budget_plan()
  budget = _lines(plan.plot(ax=_axes()))["budget"]
  np.testing.assert_array_equal(budget.get_ydata(), [BUDGET / MIB] * 2)
  assert format_bytes(BUDGET) in budget.get_label()
  assert "budget" not in _lines(plan.plot(ax=_axes(), show_budget=False))


def test_plot_marks_every_swap():
  plan = _budget_plan()
  lines = _lines(plan.plot(ax=_axes()))
  assert sorted(lines["swap_out"].get_xdata()) == sorted(
      v.swapped_out_after for v in plan.offloaded)
  assert sorted(lines["swap_in"].get_xdata()) == sorted(
      i for v in plan.offloaded for i in v.prefetched_before)


def test_plot_marks_xla_peak_with_its_target():
  plan = dataclasses.replace(_budget_plan(), xla_peak_bytes=9 * MIB,
                             xla_target="h100")
  marker = _lines(plan.plot(ax=_axes()))["xla_peak"]
  np.testing.assert_array_equal(marker.get_ydata(), [9.0])
  assert "h100" in marker.get_label()
  unconfirmed = dataclasses.replace(_budget_plan(), xla_peak_bytes=None,
                                    xla_target=None)
  assert "xla_peak" not in _lines(unconfirmed.plot(ax=_axes()))


def test_plot_without_ax_makes_a_figure():
  import matplotlib.pyplot as plt
  matplotlib.use("Agg")
  ax = _budget_plan().plot()
  try:
    assert ax.figure is not None and _lines(ax)["plan"] is not None
  finally:
    plt.close(ax.figure)


def test_plot_without_timeline_raises():
  plan = dataclasses.replace(_budget_plan(), timeline=None)
  with pytest.raises(ValueError, match="no predicted memory timeline"):
    plan.plot(ax=_axes())


def test_html_has_the_summary_numbers():
  plan = _budget_plan()
  page = plan._repr_html_()
  cells = re.findall(r"<td[^>]*>(.*?)</td>", page)

  def row(label):
    return cells[cells.index(label) + 1]

  assert row("equations") == str(plan.num_equations)
  assert row("values") == str(plan.num_values)
  assert row("predicted device peak without offloading") == format_bytes(
      plan.baseline_peak_bytes)
  assert row("predicted device peak with jlms") == format_bytes(
      plan.predicted_peak_bytes)
  assert row("predicted pinned host peak") == format_bytes(
      plan.predicted_host_bytes)
  assert row("host traffic") == format_bytes(plan.host_traffic_bytes)
  assert html.unescape(row("budget")) == (
      f"{format_bytes(BUDGET)}: fitted (XLA's peak on h100 "
      f"{format_bytes(plan.xla_peak_bytes)})")
  assert row(html.escape("XLA's peak on h100")) == format_bytes(
      plan.xla_peak_bytes)
  assert row(f"predicted step time with jlms on {plan.time_target}") == (
      plan.step_time.describe())
  assert row("chosen").startswith(
      f"by the time model: {len(plan.recomputed)} values recomputed")


def test_html_names_xla_peak_and_target():
  plan = dataclasses.replace(_budget_plan(), xla_peak_bytes=40 * MIB,
                             xla_target="a100")
  page = html.unescape(plan._repr_html_())
  assert f"<td>XLA's peak on a100</td><td>{format_bytes(40 * MIB)}</td>" in page
  # XLA's peak decides the verdict when known: 40 MiB is over 36 MiB, the
  # predicted peak under it.
  assert plan.predicted_peak_bytes <= BUDGET
  assert "over budget (XLA's peak on a100 40.00 MiB)" in page


def test_html_embeds_the_plot_as_png():
  match = re.search(r'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)"',
                    _budget_plan()._repr_html_())
  assert match is not None
  assert base64.b64decode(match.group(1)).startswith(b"\x89PNG\r\n\x1a\n")


def test_html_lists_the_largest_offloaded_value():
  plan = _budget_plan()
  largest = max(plan.offloaded, key=lambda v: v.nbytes)
  row = (f"<tr><td>{html.escape(largest.name)}</td>"
         f"<td>{html.escape(largest.source)}</td>"
         f"<td>{largest.dtype.name}{list(largest.shape)}</td>"
         f'<td class="num">{format_bytes(largest.nbytes)}</td>'
         f'<td class="num">{largest.produced_at}</td>'
         f'<td class="num">{largest.swapped_out_after}</td>')
  assert row in plan._repr_html_()


def test_html_escapes_names():
  plan = _budget_plan()
  hostile = "<script>alert('x')</script>"
  largest = max(plan.offloaded, key=lambda v: v.nbytes)
  plan = dataclasses.replace(
      plan, offloaded=tuple(
          dataclasses.replace(v, name=hostile) if v is largest else v
          for v in plan.offloaded),
      live_at_peak=((f"live {hostile}", 1024),),
      largest_equation=f"eq {hostile}")
  page = plan._repr_html_()
  assert "<script>" not in page
  assert page.count(
      "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;") == 3


def test_html_without_matplotlib_leaves_a_note(monkeypatch):
  for name in [n for n in sys.modules if n.split(".")[0] == "matplotlib"]:
    monkeypatch.setitem(sys.modules, name, None)
  page = _budget_plan()._repr_html_()
  assert "data:image/png" not in page
  assert "matplotlib is not installed" in page
  assert format_bytes(_budget_plan().predicted_peak_bytes) in page


def test_html_without_timeline_still_has_the_summary():
  plan = dataclasses.replace(_budget_plan(), timeline=None)
  page = plan._repr_html_()
  assert "data:image/png" not in page
  assert "nothing to plot" in page
  assert "predicted device peak with jlms" not in page
  assert format_bytes(plan.host_traffic_bytes) in page
