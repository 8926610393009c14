"""`memory_stats`: what a device's allocator says it holds, like TFLMS v2's
statistics (`get_bytes_in_use`, `get_peak_bytes_in_use`, `get_num_allocs`,
`get_largest_alloc_size`, `get_bytes_limit`).

Guarantees:

- Every number is read from `device.memory_stats()` under its own key, unchanged;
  nothing is estimated. A key the backend leaves out, or reports as negative
  (JAX documents -1 as "unavailable"), is None, never 0.
- A backend that reports nothing (CPU returns None) gives a `MemoryStats` with
  `reported=False` whose `str()` says so in one line.
- The pinned-host fields are None: up to JAX 0.11.1 the device's dict comes
  from its device allocator's `tsl::AllocatorStats` alone (jaxlib's
  py_device.cc; `PJRT_Device_MemoryStats` in XLA's pjrt_c_api.h), and `Memory`
  objects, "pinned_host" included, have no statistics. The fields are there so
  that callers need not change when a backend does report them.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

import jax

from jlms._units import format_bytes

# The device fields of `MemoryStats`, each named after its key in the dict
# that `Device.memory_stats()` returns.
_DEVICE_FIELDS = ("bytes_in_use", "peak_bytes_in_use", "num_allocs",
                  "largest_alloc_size", "bytes_limit")


@dataclasses.dataclass(frozen=True)
class MemoryStats:
  """One device's allocator statistics at the moment they were read.

  Each count is an int, or None where the backend does not report it.
  """
  #: The device, as `str(device)` names it.
  device: str
  #: Its platform: "gpu", "cpu", ...
  platform: str
  #: Bytes the allocator holds now (TFLMS's `get_bytes_in_use`).
  bytes_in_use: int | None
  #: The most bytes it has held at once (`get_peak_bytes_in_use`).
  peak_bytes_in_use: int | None
  #: Allocations made (`get_num_allocs`).
  num_allocs: int | None
  #: The largest single allocation, in bytes (`get_largest_alloc_size`).
  largest_alloc_size: int | None
  #: The bytes the allocator may hold at most (`get_bytes_limit`).
  bytes_limit: int | None
  #: Pinned host memory in use, in bytes (None up to JAX 0.11.1 at least:
  #: see the module's guarantees).
  host_bytes_in_use: int | None
  #: The most pinned host memory in use at once, in bytes.
  host_peak_bytes_in_use: int | None
  #: Whether any of the counts above is known.
  reported: bool
  #: The backend's own dict, copied.
  raw: dict = dataclasses.field(hash=False)

  @property
  def bytes_free(self) -> int | None:
    """Bytes the allocator may still hand out (limit minus in use)."""
    if self.bytes_limit is None or self.bytes_in_use is None:
      return None
    return self.bytes_limit - self.bytes_in_use

  @property
  def peak_fraction(self) -> float | None:
    """Peak bytes in use as a fraction of the limit."""
    if not self.bytes_limit or self.peak_bytes_in_use is None:
      return None
    return self.peak_bytes_in_use / self.bytes_limit

  def as_dict(self) -> dict[str, Any]:
    """The fields as plain values (`MemoryStats(**d)` rebuilds it)."""
    return dataclasses.asdict(self)

  def __str__(self) -> str:
    if not self.reported:
      return (f"jlms: the {self.platform} backend reports no memory "
              f"statistics for {self.device}")
    rows = (
        ("bytes in use", _bytes(self.bytes_in_use)),
        ("peak bytes in use", _bytes(self.peak_bytes_in_use)),
        ("allocations", _count(self.num_allocs)),
        ("largest allocation", _bytes(self.largest_alloc_size)),
        ("bytes limit", _bytes(self.bytes_limit)),
        ("bytes free", _bytes(self.bytes_free)),
        ("peak / limit", "not reported" if self.peak_fraction is None
         else f"{self.peak_fraction:.1%}"),
        ("pinned host in use", _bytes(self.host_bytes_in_use)),
        ("pinned host peak", _bytes(self.host_peak_bytes_in_use)),
    )
    lines = [f"jlms: memory statistics of {self.device} ({self.platform})"]
    lines += [f"  {name:<20}{value:>14}" for name, value in rows]
    return "\n".join(lines)


def _bytes(n: int | None) -> str:
  return "not reported" if n is None else format_bytes(n)


def _count(n: int | None) -> str:
  return "not reported" if n is None else str(n)


def memory_stats(device=None) -> MemoryStats:
  """Allocator statistics of `device`.

  Args:
    device: None for `jax.local_devices()[0]`, an index into
      `jax.local_devices()`, or a device (anything with `memory_stats()`,
      such as a `jax.Device`).

  Returns:
    A `MemoryStats`; fields the backend does not report are None.
  """
  device = _resolve_device(device)
  stats = device.memory_stats()
  if stats is None:
    stats = {}
  elif not isinstance(stats, dict):
    raise TypeError(f"{device}.memory_stats() returned a "
                    f"{type(stats).__name__}, not a dict or None")
  counts = {field: _reported_int(stats, field) for field in _DEVICE_FIELDS}
  return MemoryStats(
      device=str(device),
      platform=str(getattr(device, "platform", "unknown")),
      **counts,
      # No JAX backend sends a pinned-host key (see the module docstring);
      # guessing one would only hide a future, differently named statistic.
      host_bytes_in_use=None,
      host_peak_bytes_in_use=None,
      reported=any(v is not None for v in counts.values()),
      raw=dict(stats))


def _reported_int(stats: dict, key: str) -> int | None:
  value = stats.get(key)
  # bool is an Integral but never a byte count.
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    return None
  return int(value) if value >= 0 else None


def _resolve_device(device):
  if device is None:
    return jax.local_devices()[0]
  if isinstance(device, bool):  # an Integral, but surely not an index
    raise TypeError("memory_stats(device=...) got a bool; pass None, an index "
                    "into jax.local_devices() or a jax.Device")
  if isinstance(device, numbers.Integral):
    local = jax.local_devices()
    if not 0 <= device < len(local):
      raise ValueError(
          f"memory_stats(device={device}): there are {len(local)} local "
          f"devices ({', '.join(str(d) for d in local)}); pass an index from "
          f"0 to {len(local) - 1}")
    return local[int(device)]
  if callable(getattr(device, "memory_stats", None)):
    return device
  raise TypeError(
      f"memory_stats(device=...) takes None, an index into jax.local_devices() "
      f"or a jax.Device, not {type(device).__name__} {device!r}")
