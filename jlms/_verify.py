"""Did the offload do anything? XLA's answer, compared with `jax.jit`'s.

`compare_memory(step, *args, target=...)` compiles the step twice with XLA
(as `jax.jit` would, and rewritten by jlms) and returns both accountings.
It never trusts the plan: XLA deletes a bare host round trip and reorders
work, so a plan can offload values while the program puts nothing on host,
or keeps as much on the device as before. When that happens the comparison
lists the problem and an `OffloadIneffectiveWarning` tells the user.
"""

from __future__ import annotations

import dataclasses
import warnings

from jlms._arguments import with_state_on_device
from jlms._plan import Plan
from jlms._units import format_bytes
from jlms._xla_memory import XlaMemory, xla_memory_of_call


class OffloadIneffectiveWarning(UserWarning):
  """The compiled program does not keep what the plan offloaded on host, or
  its device peak is not lower than `jax.jit`'s."""

  __module__ = "jlms"  # tracebacks and reprs show the public name


@dataclasses.dataclass(frozen=True)
class MemoryComparison:
  """XLA's memory of a step compiled by `jax.jit` and by `jlms.offload`."""
  #: What both programs were compiled for.
  target: str
  #: jlms's plan of the step for these arguments.
  plan: Plan
  #: XLA's memory of `jax.jit`'s program.
  baseline: XlaMemory
  #: XLA's memory of jlms's program.
  offloaded: XlaMemory

  @property
  def peak_ratio(self) -> float:
    """Offloaded device peak over `jax.jit`'s (lower is better)."""
    return self.offloaded.peak_bytes / max(self.baseline.peak_bytes, 1)

  @property
  def problems(self) -> tuple[str, ...]:
    """What shows the offload ineffective, one sentence each: values the
    plan copies to host that XLA's program keeps on the device, a device
    peak that did not go down. Empty when there is none."""
    found = []
    # Recomputed values are remade on the device: none is meant for host.
    copied = [v for v in self.plan.offloaded if not v.recomputed]
    if copied and self.offloaded.host_offloaded_buffers == 0:
      found.append(
          f"the plan offloads {len(copied)} values "
          f"({format_bytes(self.plan.offloaded_bytes)}) but XLA's program "
          "keeps nothing in host memory")
    if self.plan.offloaded and (
        self.offloaded.peak_bytes >= self.baseline.peak_bytes):
      found.append(
          f"the device peak did not go down: "
          f"{format_bytes(self.offloaded.peak_bytes)} with jlms against "
          f"{format_bytes(self.baseline.peak_bytes)} with jax.jit")
    return tuple(found)

  def __str__(self) -> str:
    rows = [("", "jax.jit", "jlms.offload")]
    for label, attr in (("device peak", "peak_bytes"),
                        ("device temp", "temp_bytes"),
                        ("arguments", "argument_bytes"),
                        ("outputs", "output_bytes"),
                        ("host", "host_bytes")):
      rows.append((label, format_bytes(getattr(self.baseline, attr)),
                   format_bytes(getattr(self.offloaded, attr))))
    lines = [f"XLA memory on {self.target}:"]
    lines += [f"  {a:<12} {b:>12} {c:>14}" for a, b, c in rows]
    lines.append(f"  peak ratio {self.peak_ratio:.3f}")
    lines += [f"  problem: {p}" for p in self.problems]
    return "\n".join(lines)


def compare_memory(step, *args, target: str = "h100",
                   **kwargs) -> MemoryComparison:
  """Compiles `step` (an `OffloadedStep`) with and without jlms for `target`
  and warns when the offload is ineffective."""
  return compare_memory_of_call(step, args, kwargs, target)


def compare_memory_of_call(step, args: tuple, kwargs: dict,
                           target: str) -> MemoryComparison:
  """`compare_memory` of `step(*args, **kwargs)`, whose keyword arguments
  may include one named `target` (the step's own)."""
  # jax.jit's program from the step's own trace: jlms traced it once.
  baseline_fn = step._as_traced_jitted
  # Without jlms the state is on the device: jax.jit's program cannot take
  # it from host.
  base_args, base_kwargs = with_state_on_device((args, kwargs))
  comparison = MemoryComparison(
      target=target,
      plan=step.plan(*args, **kwargs),
      baseline=xla_memory_of_call(baseline_fn, base_args, base_kwargs,
                                  target),
      offloaded=xla_memory_of_call(step, args, kwargs, target),
  )
  for problem in comparison.problems:
    warnings.warn(f"jlms.offload: {problem}. Try other min_bytes / "
                  "swapout_threshold / sync_mode, or read the XLA dump "
                  "(XLA_FLAGS=--xla_dump_to=DIR, *-live-range.txt) for what "
                  "is alive at the peak.", OffloadIneffectiveWarning,
                  stacklevel=3)
  return comparison
