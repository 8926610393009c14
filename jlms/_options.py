"""The user's choices of an offload, checked once, when the step is made.

`search_options` reads `jlms.offload`'s budget, target, host budget and
`state_on_host`, refuses what cannot be right at once (with a message that
says what to pass instead) and warns of a budget above the target's
memory; the `SearchOptions` it returns are what every fit of the step
reads.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from jlms import _thresholds
from jlms._budget import (check_budget_against_target, host_pool_bytes,
                          parse_budget, parse_host_budget)
from jlms._config import OffloadConfig
from jlms._xla_memory import KNOWN_TARGETS, LOCAL_TARGET, target_memory_bytes

# What `budget` can be besides bytes or a size: TFLMS's knobs apply as given
# (`KNOBS`, when knobs are passed and no budget), fit the memory of the
# device the step is compiled for (`DEVICE`, the default), or use as little
# device memory as jlms can reach (`MINIMUM`).
KNOBS = "knobs"
DEVICE = "device"
MINIMUM = "min"

@dataclasses.dataclass(frozen=True)
class SearchOptions:
  """What the user asked of every fit of a step (`jlms.offload`'s
  arguments)."""
  config: OffloadConfig
  budget: Any  # KNOBS, DEVICE, MINIMUM, or bytes or a size
  target: str | None
  min_bytes: int | None  # the `min_bytes` knob, if given
  host_budget: Any
  state_on_host: bool | None
  name: str  # the step's, for messages
  #: Why no value of the step may be kept in host memory (empty: it may):
  #: then the plan keeps the state on the device and copies nothing out.
  host_refused: str = ""

  def budget_bytes(self, target: str | None) -> int | None:
    """The budget in bytes per device; None for "as little as jlms can"
    or when there is no device to fit (a CPU and no target named)."""
    if self.budget is MINIMUM:
      return None
    if self.budget is DEVICE:
      if target is None:
        return None
      return target_memory_bytes(target)
    return parse_budget(self.budget,
                        lambda: target_memory_bytes(target or "local"))

  def host_budget_bytes(self, local: bool) -> int:
    """Pinned host memory the plan may hold at once, per device:
    `host_budget` if given, else XLA's pinned pool for each GPU
    (`XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB` GiB, 64 by default), and on a
    `local` GPU never more than the memory this machine has available;
    none where `host_refused` says why."""
    if self.host_refused:
      return 0
    if self.host_budget is not None:
      return parse_host_budget(self.host_budget)
    limit = host_pool_bytes()
    if local:
      try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        limit = min(limit, available)
      except (ValueError, OSError):  # not reported on this system
        pass
    return limit

  def min_bytes_for(self, budget: int | None) -> int:
    """The smallest value worth a choice: the `min_bytes` knob if given,
    else a 65536th of the budget (at least `Thresholds.fit_min_bytes`, 4
    KiB): smaller values cannot
    change whether a step fits, only slow the search."""
    if self.min_bytes is not None:
      return self.min_bytes
    return max(_thresholds.THRESHOLDS.fit_min_bytes, (budget or 0) >> 16)



def search_options(config: OffloadConfig, budget, target, min_bytes,
                   host_budget, state_on_host, name: str,
                   donates: bool) -> SearchOptions:
  """The checked `SearchOptions` of `jlms.offload`'s arguments (a step
  that `donates` arguments); ValueError or TypeError saying what to pass
  where one cannot be right."""
  # The named budgets are told apart by identity: a string equal to one
  # (read from a command line, say), in any case and with spaces around
  # it as a size may have them, is made that one.
  budget = next((named for named in (KNOBS, DEVICE, MINIMUM)
                 if isinstance(budget, str)
                 and budget.strip().lower() == named), budget)
  if host_budget is not None:
    parse_host_budget(host_budget)  # reject malformed budgets now
  else:
    host_pool_bytes()  # reject a malformed XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB
  if target is not None and target not in KNOWN_TARGETS:
    # Where XLA confirms a budget; each has a time model.
    raise ValueError(f"jlms.offload: unknown target {target!r}; valid "
                     f"targets: {', '.join(KNOWN_TARGETS)}")
  if budget not in (KNOBS, DEVICE, MINIMUM):
    parse_budget(budget, lambda: 1)  # reject malformed budgets now
    if target not in (None, LOCAL_TARGET) and not (
        isinstance(budget, str) and budget.strip().endswith("%")):
      check_budget_against_target(parse_budget(budget),
                                  target_memory_bytes(target), target,
                                  stacklevel=4)
  if state_on_host not in (None, True, False):
    raise TypeError("jlms.offload: state_on_host is True, False or None, "
                    f"not {state_on_host!r}")
  if state_on_host and budget is KNOBS:
    raise ValueError(
        "jlms.offload: state_on_host is planned under a budget; TFLMS's "
        "knobs (min_bytes, swapout_threshold, ...) move activations only. "
        "Pass budget= (or no knob) to keep the state on host")
  if state_on_host and not donates:
    raise ValueError(
        "jlms.offload: state_on_host=True keeps on host the donated "
        "arguments that the step returns updated (parameters, optimizer "
        "state); donate them with donate_argnums or donate_argnames")
  return SearchOptions(config, budget, target, min_bytes, host_budget,
                       state_on_host, name)
