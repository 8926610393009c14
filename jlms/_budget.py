"""Memory budgets: how a user says one, and the error when a step cannot fit.

A leaf module: the fitting itself is `jlms._fit`, the confirmation with XLA
`jlms._offload`.
"""

from __future__ import annotations

import math
import os
import re
import warnings

import numpy as np

from jlms._units import UNITS, format_bytes

# XLA's pinned host memory pool per GPU, in GiB, and its size when unset.
HOST_POOL_VARIABLE = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
DEFAULT_HOST_POOL_GB = 64


class BudgetError(ValueError):
  """The step cannot fit the memory budget, however much is offloaded.

  Attributes:
    smallest_bytes: the smallest device peak jlms reached (itself a budget
      that fits), when the error comes from fitting; None when XLA refused
      the fit.
  """

  # Tracebacks and reprs show the public name. (autodoc then reads no `#:`
  # comment of this module for the class: its attributes are documented
  # in the docstring.)
  __module__ = "jlms"

  smallest_bytes: int | None = None


def host_pool_advice(needed_bytes: int) -> str:
  """What to do when a plan needs `needed_bytes` of pinned host memory at
  once, more than the host budget: the pool size to set, in whole GiB."""
  needed_gb = -(-needed_bytes // (1 << 30))
  return (f"set {HOST_POOL_VARIABLE}={needed_gb} (XLA's pinned pool, "
          f"{DEFAULT_HOST_POOL_GB} GB unless set) or pass host_budget=, on a "
          f"machine with that much free memory")


def parse_host_budget(host_budget) -> int:
  """Bytes of `host_budget`, pinned host memory: an int of bytes or a size
  such as "120GiB" (no percentage: of what, the host is not the device)."""
  try:
    if isinstance(host_budget, str) and host_budget.strip().endswith("%"):
      raise ValueError(host_budget)
    return parse_budget(host_budget)
  except (TypeError, ValueError):
    raise ValueError(
        f"jlms: cannot read host_budget {host_budget!r}: the pinned host "
        f"memory the plan may hold, as a positive int of bytes or a size "
        f"such as '120GiB'") from None


def parse_budget(budget, device_bytes=None) -> int:
  """Bytes of `budget`: a whole number of bytes (an int, or a float such
  as 2e9), a size such as "20GiB", "512 MB" or "1e6", or a percentage such
  as "90%" of `device_bytes` (a callable giving the device's memory, called
  only for a percentage). ValueError for a fraction of a byte and for a
  number that is not finite."""
  if isinstance(budget, bool):
    raise TypeError(f"jlms: budget must be bytes or a string, got {budget!r}")
  if isinstance(budget, (float, np.floating)):  # bytes written as 2e9
    if not math.isfinite(budget):
      raise ValueError(f"jlms: budget {budget!r} is not a finite number of "
                       "bytes")
    if not float(budget).is_integer():
      raise ValueError(f"jlms: a budget in bytes is a whole number, got "
                       f"{budget!r}; for a fraction of the device, pass a "
                       f"percentage such as '90%'")
    budget = int(budget)
  if isinstance(budget, (int, np.integer)):
    if budget <= 0:
      raise ValueError(f"jlms: budget must be positive, got {budget}")
    return int(budget)
  if not isinstance(budget, str):
    raise TypeError(f"jlms: budget must be an int of bytes, a size string "
                    f"such as '20GiB' or a percentage such as '90%', got "
                    f"{budget!r}")
  text = budget.strip().lower().replace(" ", "")
  if text.startswith("-"):
    raise ValueError(f"jlms: budget must be positive, got {budget!r}")
  match = re.fullmatch(r"((?:\d+(?:\.\d*)?|\.\d+)(?:e[+-]?\d+)?)(%|[a-z]*)",
                       text)
  if match is None or match.group(2) not in (*UNITS, "%"):
    raise ValueError(f"jlms: cannot read budget {budget!r}: use bytes, a size "
                     "such as '20GiB', a percentage such as '90%' of the "
                     "device, 'device' (fit the device, the default) or "
                     "'min' (as little device memory as jlms can reach)")
  number, unit = float(match.group(1)), match.group(2)
  if not math.isfinite(number * UNITS.get(unit, 1)):
    raise ValueError(f"jlms: budget {budget!r} is not a finite number of "
                     "bytes")
  if unit == "%":
    if not 0 < number <= 100:
      raise ValueError(f"jlms: budget percentage must be in (0, 100], got "
                       f"{budget!r}")
    if device_bytes is None:
      raise ValueError("jlms: a percentage budget needs the device's memory: "
                       "run on a GPU or name a target such as 'h100'")
    return int(device_bytes() * number / 100)
  if UNITS[unit] == 1 and not number.is_integer():
    raise ValueError(f"jlms: a budget in bytes is a whole number, got "
                     f"{budget!r}; give a unit for a fraction of one, such "
                     f"as '1.5GiB'")
  value = int(number * UNITS[unit])
  if value <= 0:
    raise ValueError(f"jlms: budget must be positive, got {budget!r}")
  return value


def host_pool_bytes(environ=os.environ) -> int:
  """Bytes of XLA's pinned host memory pool per GPU:
  `XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB` GiB, 64 when unset or empty. Raises
  ValueError naming the variable when it is not a positive number."""
  text = environ.get(HOST_POOL_VARIABLE, "").strip()
  if not text:
    return DEFAULT_HOST_POOL_GB << 30
  try:
    gib = float(text)
  except ValueError:
    gib = float("nan")
  if not 0 < gib < float("inf"):
    raise ValueError(
        f"jlms: cannot read {HOST_POOL_VARIABLE}={text!r}: it is XLA's pinned "
        f"host memory pool per GPU, a positive number of GiB such as "
        f"{DEFAULT_HOST_POOL_GB} (the default when unset); set it to one or "
        f"unset it")
  return int(gib * (1 << 30))


def check_budget_against_target(budget_bytes: int, target_bytes: int,
                                target_name: str, stacklevel: int = 1) -> None:
  """Warns (UserWarning) when `budget_bytes` is above `target_bytes`, the
  memory of one GPU of `target_name`: a plan fitted to such a budget need
  not fit that GPU. The warning names the line `stacklevel` frames up from
  the one calling this function (1: that line), as `warnings.warn` counts."""
  if budget_bytes <= target_bytes:
    return
  warnings.warn(
      f"jlms: the budget of {format_bytes(budget_bytes)} is above the "
      f"{format_bytes(target_bytes)} of one {target_name}: a plan fitted to "
      f"it need not fit the {target_name}. Give a budget of at most "
      f"{format_bytes(target_bytes)}, or none to fit the {target_name}'s "
      f"memory.", UserWarning, stacklevel=stacklevel + 1)
