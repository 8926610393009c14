"""The knobs of an offload, with their units, defaults and validation.

Distances are counted in equations of the flattened step (nested jits
inlined), the unit TFLMSv2 counted in levels of its topological sort.
"""

from __future__ import annotations

import dataclasses
import enum

from jlms._serialize import parse_serialize


class SyncMode(enum.IntFlag):
  """Which transfers compute waits for, as TFLMSv2's `sync_mode`.

  NONE (0): transfers overlap with compute; XLA is free to keep a value on
  the device until its copy ends. SWAP_OUT (1): the equation after a swap-out
  starts only once the copy to host has finished, so the device buffer can be
  freed before anything new is allocated. SWAP_IN (2): the equation a
  prefetch is issued before waits for the copy to device. BOTH (3).
  """
  #: Transfers overlap with compute.
  NONE = 0
  #: The equation after a swap-out waits for the copy to host.
  SWAP_OUT = 1
  #: The equation a prefetch is issued before waits for the copy to device.
  SWAP_IN = 2
  #: Both waits.
  BOTH = 3


@dataclasses.dataclass(frozen=True)
class OffloadConfig:
  """What to offload and when to bring it back.

  Attributes:
    min_bytes: values smaller than this many bytes stay on the device.
    swapout_threshold: a value is moved to host across a gap between two
      consecutive reads longer than this many equations; it is swapped out
      right after the read before the gap.
    prefetch_ahead: a swapped-out value is copied back to the device this
      many equations before the equation that reads it (0: just before).
    swapin_groupby: after a swap-in, further reads at most this many
      equations after the previous one share the same device copy; a longer
      gap fetches the value from host again. None: equal to
      `swapout_threshold`.
    sync_mode: a `SyncMode` (or its int value).
    scan_residuals: the residuals a scan stacks for a later scan (the
      layers of `nn.scan`, `jax.lax.scan`, `fori_loop`) go to host one slice
      per iteration inside the loops, rather than whole at the top level
      (see `jlms._loops`); same `min_bytes` and `swapout_threshold` rules.
    split_batch: a run of equations whose working set alone bounds the
      least memory (a loss over a large vocabulary) runs chunk by chunk
      over the batch when a budget is fitted (see `jlms._batch_split`).
    serialize: layers whose ops run strictly one after another, chained by
      barriers (see `jlms._serialize`): name-stack globs such as
      "*Inception_2/*", and equation ranges (`range(a, b)` or `(a, b)`).
    serialize_by_size: also chain every equation whose outputs take at
      least this many bytes; None: no size rule.
  """
  min_bytes: int = 1 << 20
  swapout_threshold: int = 20
  prefetch_ahead: int = 2
  swapin_groupby: int | None = None
  sync_mode: SyncMode = SyncMode.SWAP_OUT
  scan_residuals: bool = True
  split_batch: bool = True
  serialize: tuple = ()
  serialize_by_size: int | None = None

  def __post_init__(self):
    for name in ("min_bytes", "swapout_threshold", "prefetch_ahead"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"jlms: {name} must be a non-negative int, got {value!r}")
    if self.swapin_groupby is not None and (
        not isinstance(self.swapin_groupby, int) or self.swapin_groupby < 0):
      raise ValueError("jlms: swapin_groupby must be None or a non-negative "
                       f"int, got {self.swapin_groupby!r}")
    if self.sync_mode not in (0, 1, 2, 3) or isinstance(self.sync_mode, bool):
      raise ValueError(f"jlms: sync_mode must be 0, 1, 2 or 3, got "
                       f"{self.sync_mode!r}")
    for name in ("scan_residuals", "split_batch"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"jlms: {name} must be True or False, got "
                         f"{getattr(self, name)!r}")
    if self.serialize_by_size is not None and (
        not isinstance(self.serialize_by_size, int)
        or isinstance(self.serialize_by_size, bool)
        or self.serialize_by_size < 0):
      raise ValueError("jlms: serialize_by_size must be None or a "
                       f"non-negative int, got {self.serialize_by_size!r}")
    object.__setattr__(self, "serialize", parse_serialize(self.serialize))
    object.__setattr__(self, "sync_mode", SyncMode(self.sync_mode))

  @property
  def groupby(self) -> int:
    """`swapin_groupby` as the planner reads it: `swapout_threshold` when
    it is None."""
    if self.swapin_groupby is None:
      return self.swapout_threshold
    return self.swapin_groupby
