"""What one device of a sharded step sends to and gets from the others,
read from XLA's compiled program of it.

A step whose arguments are split over several GPUs runs as one program per
device, and XLA's SPMD partitioner decides what the devices exchange. Under
`AxisType.Auto` axes its choice is not the one the arguments suggest: with
every state leaf of a 4-layer GPT split over eight H100s along its largest
axis (FSDP-style), it kept the weights' shards where they were and gathered
the activations over the batch instead (1.2 GiB gathered per device per
step, and the gradients of the activations reduce-scattered). So jlms reads
the exchanges from the compiled program, as it reads XLA's peak.

`collective_bytes(hlo_text, devices)` is the bytes one device moves over
its GPU interconnect in one step, a loop's collectives counted once per
trip: an all-gather the part of its result it receives (result less
operand), a reduce-scatter the part of its operand it sends (operand less
result), an all-reduce twice its operand's `(devices - 1) / devices` (a
ring's reduce-scatter then all-gather), an all-to-all that share of its
operand, a collective-permute its operand; a call's computation is
walked, and a conditional's costliest branch. An all-reduce or all-to-all
over a group smaller than all the devices is counted as over all of them
(at most (n - 1) / n against (g - 1) / g: 1.75x its bytes for groups of
two on eight devices). Pure: a function of the text.
"""

from __future__ import annotations

import re

import numpy as np

from jlms._xla_memory import hlo_computations, hlo_itemsize, split_operands

_ARRAY = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\]")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_BODY = re.compile(r"\bbody=%([\w.\-]+)")
_CALLED = re.compile(r"\bto_apply=%([\w.\-]+)")
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")
_NAMES = re.compile(r"%([\w.\-]+)")
_KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all",
          "collective-permute")


def _shape_bytes(shape: str) -> int:
  """Bytes of every array in an HLO shape (a tuple's, summed)."""
  total = 0.0
  for dtype, dims in _ARRAY.findall(shape):
    itemsize = hlo_itemsize(dtype)
    if itemsize is not None:  # not token[] or opaque types
      total += itemsize * int(np.prod([int(d) for d in dims.split(",") if d]))
  return int(total)


def _kind(opcode: str) -> str | None:
  for kind in _KINDS:
    if opcode in (kind, kind + "-start"):
      return kind
  return None


def collective_bytes(hlo_text: str, devices: int) -> int:
  """Bytes one device sends or receives over its interconnect in one step
  of the compiled program `hlo_text` (see the module docstring)."""
  computations = {c.name: c for c in hlo_computations(hlo_text)}
  entry = next((c for c in computations.values() if c.is_entry), None)
  if entry is None or devices <= 1:
    return 0
  share = (devices - 1) / devices

  def walk(computation, seen: tuple) -> float:
    shapes = {name: shape for name, shape, _ in computation.instructions}
    moved = 0.0
    for _, shape, rest in computation.instructions:
      opcode, operands = split_operands(rest)
      if opcode == "while":
        body = _BODY.search(rest)
        trips = _TRIP_COUNT.search(rest)
        if body and body.group(1) in computations and body.group(1) not in seen:
          moved += (int(trips.group(1)) if trips else 1) * walk(
              computations[body.group(1)], seen + (body.group(1),))
        continue
      if opcode in ("call", "conditional"):
        # A call runs its computation; a conditional one of its branches,
        # taken here as the one that moves the most.
        called, branches = _CALLED.search(rest), _BRANCHES.search(rest)
        callees = ([called.group(1)] if called else
                   _NAMES.findall(branches.group(1)) if branches else [])
        moved += max((walk(computations[c], seen + (c,)) for c in callees
                       if c in computations and c not in seen), default=0.0)
        continue
      kind = _kind(opcode)
      if kind is None:
        continue
      given = sum(_shape_bytes(shapes.get(o, "")) for o in operands)
      whole = _shape_bytes(shape)
      # An async start's shape holds its operands beside its results (and
      # a permute's context words); a synchronous one's is its results.
      made = whole - given if opcode.endswith("-start") and whole > given \
          else whole
      if kind == "all-gather":
        moved += max(made - given, 0)
      elif kind == "reduce-scatter":
        moved += max(given - made, 0)
      elif kind == "all-reduce":
        moved += 2 * given * share
      elif kind == "all-to-all":
        moved += given * share
      else:
        moved += given
    return moved

  return int(walk(entry, (entry.name,)))
