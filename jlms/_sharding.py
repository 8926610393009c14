"""What one device holds of a sharded step's values.

A step whose arguments are sharded over several devices runs as one program
per device, and every memory figure that matters is per device: XLA's
`memory_analysis()`, a GPU's capacity, a `jlms.offload` budget. jlms plans on
the step's jaxpr, whose values are whole (global) arrays; how much of each a
device holds is known only where the jaxpr says so.

Guarantees:
- `device_shape(aval)` is the shape of one device's shard where the aval
  carries an explicit sharding (sharding in types: a mesh with
  `AxisType.Explicit` axes, `jax.make_mesh`'s default), and the whole shape
  otherwise. With `AxisType.Auto` axes XLA chooses the shardings of the
  intermediate values after jlms has planned, so the jaxpr shows none.
- `unseen_split(avals, leaves)` is 1 when the avals already show every split
  of the arguments (or nothing is sharded); otherwise it is the largest
  factor by which an argument's sharding splits it while its aval shows the
  whole array: the factor by which jlms's sizes overstate a device's.
- `device_share(aval)` is the share of a value one device holds (1 unless
  its aval carries an explicit sharding), which the time model prices a
  contraction by; `device_count(leaves)` the devices the arguments span.
- `link_shardings(values, avals, leaves)` gives, under Auto mesh axes, a
  split sharding for each value copied to host that has one like an
  argument's (below), so that every device copies its own shard; values
  with none are left out (XLA chooses, as before).
- `leading_split(aval, leaf)` says, under Auto mesh axes, how many shards
  an argument's sharding cuts its leading axis into, and how to keep them
  apart in a view of the argument as (shards, rows of a shard, ...); None
  where it is not cut.
- `kept_shardings(pairs, avals, leaves)` gives, under Auto mesh axes, the
  sharding each output returned in place of an argument (not donated)
  keeps: that argument's own split.
- `abstract_arguments(avals, leaves)` gives `ShapeDtypeStruct`s that keep
  each argument's sharding, so that XLA compiles (and measures) the program
  as it runs, per device.
"""

from __future__ import annotations

import dataclasses
import math

import jax


def device_shape(aval) -> tuple[int, ...]:
  """The shape of the shard one device holds of a value of `aval`."""
  shape = tuple(aval.shape)
  sharding = getattr(aval, "sharding", None)
  spec = getattr(sharding, "spec", None)
  if spec is None or not any(axis is not None for axis in spec):
    return shape
  try:
    return tuple(sharding.shard_shape(shape))
  except (ValueError, TypeError):
    # An uneven split has no single shard shape: count the whole array, an
    # upper bound, which is the safe side for a budget.
    return shape


def device_share(aval) -> float:
  """The share of a value of `aval` that one device holds: its shard's
  size over the whole's where the aval carries an explicit sharding, else
  1."""
  whole = math.prod(aval.shape)
  return math.prod(device_shape(aval)) / whole if whole else 1.0


def device_count(leaves) -> int:
  """How many devices the step's arguments are placed on (1 where none
  is placed, as under an outer trace)."""
  count = 1
  for leaf in leaves:
    sharding = _concrete_sharding(leaf)
    if sharding is not None:
      count = max(count, len(sharding.device_set))
  return count


def _concrete_sharding(leaf):
  """The placement of an argument (array or ShapeDtypeStruct), or None
  under an outer trace and for Python scalars."""
  if isinstance(leaf, jax.core.Tracer):
    return None
  sharding = getattr(leaf, "sharding", None)
  if not isinstance(sharding, jax.sharding.Sharding):
    return None
  return sharding


def _split(sharding, shape) -> int:
  """Factor by which `sharding` splits an array of `shape` per device."""
  whole = math.prod(shape)
  if whole == 0:
    return 1
  try:
    return max(1, whole // max(1, math.prod(sharding.shard_shape(shape))))
  except (ValueError, TypeError):
    return 1


def unseen_split(avals, leaves) -> int:
  """Largest split of an argument that its aval does not show (see the
  module docstring)."""
  unseen = 1
  for aval, leaf in zip(avals, leaves):
    shape = getattr(aval, "shape", None)
    sharding = _concrete_sharding(leaf)
    if shape is None or sharding is None:
      continue
    if device_shape(aval) == tuple(shape):
      unseen = max(unseen, _split(sharding, tuple(shape)))
  return unseen


def argument_device_bytes(nbytes: int, aval, leaf) -> int:
  """Of an argument of `aval`, of which `nbytes` are counted per device
  (`jlms._liveness.aval_nbytes`: its shard where the aval shows one), the
  bytes one device holds: fewer where the argument's `leaf` is split over
  devices that its aval does not show (Auto mesh axes)."""
  shape = getattr(aval, "shape", None)
  sharding = _concrete_sharding(leaf)
  if shape is None or sharding is None or device_shape(aval) != tuple(shape):
    return nbytes
  return nbytes // _split(sharding, tuple(shape))


@dataclasses.dataclass(frozen=True)
class LeadingSplit:
  """How an argument's sharding cuts its leading axis where the jaxpr does
  not show the cut (Auto mesh axes): into `shards`, and `view`, the
  sharding of the argument viewed as (shards, rows of a shard, ...) that
  keeps each shard on its device."""
  shards: int
  view: jax.sharding.NamedSharding


def leading_split(aval, leaf) -> LeadingSplit | None:
  """How the placed `leaf`'s sharding cuts the leading axis of an
  argument of `aval` whose aval does not show the cut (Auto axes); None
  where it is not cut, is cut unevenly, or the aval shows the cut
  (explicit axes: its type carries the split)."""
  shape = tuple(getattr(aval, "shape", ()))
  if not shape or shape[0] == 0 or device_shape(aval) != shape:
    return None
  sharding = _concrete_sharding(leaf)
  if not isinstance(sharding, jax.sharding.NamedSharding):
    return None
  try:
    rows = sharding.shard_shape(shape)[0]
  except (ValueError, TypeError):
    return None
  if not rows or rows == shape[0] or shape[0] % rows:
    return None
  axes = tuple(sharding.spec)[0]
  view = jax.sharding.NamedSharding(
      sharding.mesh, jax.sharding.PartitionSpec(axes, *[None] * len(shape)))
  return LeadingSplit(shape[0] // rows, view)


def link_shardings(values: dict, avals, leaves) -> dict:
  """For `values` (id -> aval) of a step whose arguments (`avals`,
  `leaves`) are split in ways their avals do not show: id -> the
  NamedSharding each is copied over the link in. XLA's partitioner
  chooses the intermediate values' shardings after jlms has planned, and
  where nothing downstream asks for a split it may hold a value whole on
  every device: on a 16-layer Llama at 70B's widths over eight H100s
  (FSDP, Auto axes) it all-reduced four weight gradients that jlms
  copied to host, and each device copied the whole 448 MiB of each, where
  jlms had planned its 56 MiB shard. So a value is given:
  - the sharding of a split argument of its shape (a parameter's
    gradient or moment is split like the parameter, as FSDP and ZeRO
    split them);
  - else the split of a split argument's dimension that it shares, at the
    same position and of the same size (an activation split along the
    batch like the batch), the later arguments first (a step's batch
    comes after its state);
  - else nothing.
  A value of the shape of an argument that is not split (a replicated
  parameter, under data parallelism) gets nothing: it may be that
  argument's gradient or its update, which XLA holds whole like it, and a
  split would leave the step's outputs split where jax.jit's are not."""
  split, whole = [], set()
  for aval, leaf in zip(avals, leaves):
    shape = getattr(aval, "shape", None)
    if shape is None:
      continue
    sharding = _unseen_split(aval, leaf)
    if sharding is None:
      whole.add(tuple(shape))
      continue
    split.append((tuple(shape), sharding))
  if not split:
    return {}
  by_shape = {}
  for shape, sharding in split:
    by_shape.setdefault(shape, sharding)
  chosen = {}
  for value, aval in values.items():
    shape = tuple(getattr(aval, "shape", ()))
    if shape in whole:
      continue
    sharding = by_shape.get(shape) or _shared_dimension_split(shape, split)
    if sharding is not None:
      chosen[value] = sharding
  return chosen


def kept_shardings(pairs, avals, leaves) -> tuple:
  """(output position, NamedSharding) for each (argument, output) position
  pair of `pairs` (an argument the step returns updated, not donated)
  whose argument is split over the devices in a way its aval does not
  show (Auto mesh axes) and lives in device memory: the output is given
  the argument's split. XLA's partitioner chooses an output's sharding
  from the program, and jlms's program is not jax.jit's: an SGD
  momentum split by rows went in as P('data') and came back as
  P(None, 'data'), where jax.jit gave it back as it came, and the next
  call, of another signature, was planned again (found by fuzzing)."""
  kept = []
  for argument, output in pairs:
    sharding = _unseen_split(avals[argument], leaves[argument])
    if sharding is not None and getattr(sharding, "memory_kind", None) not in (
        "pinned_host", "unpinned_host"):
      kept.append((output, sharding))
  return tuple(kept)


def _unseen_split(aval, leaf) -> jax.sharding.NamedSharding | None:
  """The NamedSharding of an argument that splits it over the devices in a
  way its aval does not show (Auto mesh axes); None otherwise."""
  sharding = _concrete_sharding(leaf)
  shape = tuple(getattr(aval, "shape", ()))
  if (isinstance(sharding, jax.sharding.NamedSharding)
      and device_shape(aval) == shape and _split(sharding, shape) > 1):
    return sharding
  return None


def _shared_dimension_split(shape, split) -> jax.sharding.NamedSharding | None:
  """A sharding of an array of `shape` split as one of the `split`
  arguments (shape, sharding) splits a dimension of the same position
  and size, the last argument first; None where none shares one."""
  for arg_shape, sharding in reversed(split):
    spec = tuple(sharding.spec)
    for dim, axes in enumerate(spec):
      if (axes is None or dim >= len(shape) or dim >= len(arg_shape)
          or shape[dim] != arg_shape[dim]):
        continue
      entries = [None] * len(shape)
      entries[dim] = axes
      candidate = jax.sharding.NamedSharding(
          sharding.mesh, jax.sharding.PartitionSpec(*entries))
      if _split(candidate, shape) > 1 and _divides(candidate, shape):
        return candidate
  return None


def _divides(sharding, shape) -> bool:
  """Whether `sharding` splits `shape` evenly."""
  try:
    shard = sharding.shard_shape(shape)
  except (ValueError, TypeError):
    return False
  return math.prod(shard) * _split(sharding, shape) == math.prod(shape)


def abstract_arguments(avals, leaves) -> list:
  """`ShapeDtypeStruct`s of the arguments, each with its leaf's sharding
  when it has one (so a compile measures one device of the sharded step)."""
  structs = []
  for aval, leaf in zip(avals, leaves):
    sharding = _concrete_sharding(leaf)
    structs.append(jax.ShapeDtypeStruct(
        aval.shape, aval.dtype, sharding=sharding,
        weak_type=getattr(aval, "weak_type", False)))
  return structs
