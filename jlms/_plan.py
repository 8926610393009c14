"""`Plan`: what an offload does to a step, in words and numbers.

A `Plan` is built from a flat program, its liveness and the chosen offloads;
it holds no traced values, so it can be kept, printed and compared freely.
Its `str()` reads like TFLMS's info log.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jlms import _compat
from jlms._config import OffloadConfig
from jlms._liveness import Liveness
from jlms._planner import Offload
from jlms._program import Program


def format_bytes(n: float) -> str:
  for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
    if abs(n) >= size:
      return f"{n / size:.2f} {unit}"
  return f"{int(n)} B"


@dataclasses.dataclass(frozen=True)
class OffloadedValue:
  """One value the step keeps in pinned host memory for a while.

  Equation indices are positions in the flattened step (`Plan.num_equations`
  in all); `len(step)` stands for the step's outputs.
  """
  name: str  # name stack and primitive of the producing equation
  source: str  # file:line of the user code that made it
  shape: tuple[int, ...]
  dtype: np.dtype
  nbytes: int
  produced_at: int
  swapped_out_after: int
  prefetched_before: tuple[int, ...]  # one entry per swap-in
  used_at: tuple[int, ...]  # the reads served from host copies

  @property
  def swap_ins(self) -> int:
    return len(self.prefetched_before)


@dataclasses.dataclass(frozen=True)
class Plan:
  """What `jlms.offload` does to one abstract signature of a step."""
  config: OffloadConfig
  num_equations: int
  num_values: int
  argument_bytes: int
  largest_equation: str
  largest_equation_index: int
  largest_equation_bytes: int
  offloaded: tuple[OffloadedValue, ...]

  @property
  def offloaded_bytes(self) -> int:
    """Bytes copied to host (each offloaded value once)."""
    return sum(v.nbytes for v in self.offloaded)

  @property
  def prefetched_bytes(self) -> int:
    """Bytes copied back to the device (once per swap-in)."""
    return sum(v.nbytes * v.swap_ins for v in self.offloaded)

  @property
  def host_traffic_bytes(self) -> int:
    return self.offloaded_bytes + self.prefetched_bytes

  def __str__(self) -> str:
    c = self.config
    lines = [
        f"jlms: the step has {self.num_equations} equations and "
        f"{self.num_values} values",
        f"jlms: the step's arguments (parameters, optimizer state, batch) take "
        f"{format_bytes(self.argument_bytes)}",
        f"jlms: the largest equation is {self.largest_equation} (equation "
        f"{self.largest_equation_index}) with "
        f"{format_bytes(self.largest_equation_bytes)} of inputs and outputs",
        f"jlms: settings: min_bytes {c.min_bytes}, swapout_threshold "
        f"{c.swapout_threshold}, prefetch_ahead {c.prefetch_ahead}, "
        f"swapin_groupby {c.groupby}, sync_mode {int(c.sync_mode)}",
        f"jlms: offloaded {len(self.offloaded)} values: "
        f"{len(self.offloaded)} swap-outs "
        f"({format_bytes(self.offloaded_bytes)}) and "
        f"{sum(v.swap_ins for v in self.offloaded)} swap-ins "
        f"({format_bytes(self.prefetched_bytes)})",
    ]
    shown = sorted(self.offloaded, key=lambda v: -v.nbytes)[:20]
    if shown:
      lines.append(f"  {'value':<48} {'shape':<22} {'size':>11} "
                   f"{'made':>6} {'out':>6} {'in before':>14}")
      for v in shown:
        shape = f"{np.dtype(v.dtype).name}{list(v.shape)}"
        ins = ",".join(str(i) for i in v.prefetched_before)
        lines.append(f"  {v.name[-48:]:<48} {shape[:22]:<22} "
                     f"{format_bytes(v.nbytes):>11} {v.produced_at:>6} "
                     f"{v.swapped_out_after:>6} {ins[:14]:>14}")
      if len(self.offloaded) > len(shown):
        lines.append(f"  ... and {len(self.offloaded) - len(shown)} smaller")
    return "\n".join(lines)


def build_plan(program: Program, liveness: Liveness,
               offloads: tuple[Offload, ...], config: OffloadConfig) -> Plan:
  largest_index, largest_bytes = -1, 0
  for index, equation in enumerate(program.equations):
    touched = {a for a in equation.inputs if isinstance(a, int)}
    touched.update(equation.outputs)
    size = sum(liveness.nbytes[v] for v in touched)
    if size > largest_bytes:
      largest_index, largest_bytes = index, size
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
  )
