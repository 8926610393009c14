"""How one equation splits along an axis of its values: the batch-split rules.

`jlms._batch_split` runs a run of equations chunk by chunk along one axis
(the batch, say): each value of the run is either cut along one of its
axes (an int: which axis), whole in every chunk (`WHOLE`), a partial sum
per chunk to be added over the chunks (`SUMMED`: a reduction over the cut
axis), or known only after the chunks are added (`AFTER`). A rule derives
what it can of an equation's operand and result axes from what is known
of the others, and raises `Unsplittable` where no chunking computes what
the equation computes. `jlms._rules` keys the rules by primitive.

A rule sees `SplitView`: the shapes of the operands and results, the
equation's shape parameters (`jlms._compat.shape_layout`) and the length
of the cut axis. It returns the operand and result axes, None where still
unknown. Every value cut must have the cut axis's full length there: a
size-1 axis that broadcasts is whole.

Guarantees: where a rule gives every value an axis, running the equation
on each chunk (with `jlms._compat.bind_resized`) and joining the results
along their axes (adding the `SUMMED` ones) gives the equation's results.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

#: The value is whole in every chunk.
WHOLE = "whole"
#: Each chunk makes a partial sum; the value is their sum.
SUMMED = "summed"
#: Computed after the chunks, from sums.
AFTER = "after"


class Unsplittable(Exception):
  """No chunking of this equation computes what it computes."""


@dataclasses.dataclass(frozen=True)
class SplitView:
  """What a rule reads of an equation."""
  name: str  # the primitive's name, for messages
  in_shapes: tuple
  out_shapes: tuple
  layout: dict
  length: int  # the full length of the cut axis


Rule = Callable[[SplitView, list, list], tuple]


def _cut(dims) -> set:
  return {d for d in dims if isinstance(d, int)}


def _one_axis(view: SplitView, ins, outs) -> int | None:
  """The one cut axis named among `ins` and `outs` (all on the result's
  axes), or None."""
  found = _cut(ins) | _cut(outs)
  if len(found) > 1:
    raise Unsplittable(f"{view.name} would be cut along axes {found}")
  return next(iter(found), None)


def _settle(current, wanted, what: str):
  """`wanted` for a value now `current` (None: unknown)."""
  if current is None or current == wanted:
    return wanted
  raise Unsplittable(f"{what} is {current!r} and {wanted!r} at once")


def _check_length(view: SplitView, shape, axis: int, what: str) -> None:
  if axis >= len(shape) or shape[axis] != view.length:
    raise Unsplittable(f"{view.name}'s {what} has no axis {axis} of length "
                       f"{view.length} (shape {tuple(shape)})")


def pointwise(view: SplitView, ins, outs):
  """Element by element, rank-0 and size-1 operands broadcast: operands of
  the result's rank with the full cut axis are cut along it, the rest
  whole."""
  axis = _one_axis(view, [d for d, s in zip(ins, view.in_shapes)
                          if isinstance(d, int)
                          and len(s) == len(view.out_shapes[0])], outs)
  if _cut(ins) - ({axis} if axis is not None else set()):
    raise Unsplittable(f"{view.name}'s operands are cut along other axes")
  if axis is None:
    return ins, outs
  rank = len(view.out_shapes[0])
  for shape in view.out_shapes:
    _check_length(view, shape, axis, "result")
  new_ins = []
  for shape, dim in zip(view.in_shapes, ins):
    cut = len(shape) == rank and shape[axis] == view.length
    new_ins.append(_settle(dim, axis if cut else WHOLE,
                           f"an operand of {view.name}"))
  return new_ins, [axis] * len(outs)


def _mapped(view: SplitView, ins, outs, in_to_out: dict, operand: int = 0,
            whole_operands=()):
  """A one-operand re-layout: operand axis `a` is result axis
  `in_to_out[a]`; an axis missing from the map cannot be cut."""
  out_to_in = {o: i for i, o in in_to_out.items()}
  new_ins, new_outs = list(ins), list(outs)
  for p in whole_operands:
    new_ins[p] = _settle(ins[p], WHOLE, f"an operand of {view.name}")
  dim = ins[operand]
  if isinstance(dim, int):
    if dim not in in_to_out:
      raise Unsplittable(f"{view.name} moves the cut axis {dim}")
    _check_length(view, view.in_shapes[operand], dim, "operand")
    for p in range(len(new_outs)):
      new_outs[p] = _settle(outs[p], in_to_out[dim], f"{view.name}'s result")
      _check_length(view, view.out_shapes[p], in_to_out[dim], "result")
  for out_dim in _cut(outs):
    if out_dim not in out_to_in:
      raise Unsplittable(f"{view.name} makes its cut axis {out_dim}")
    new_ins[operand] = _settle(new_ins[operand], out_to_in[out_dim],
                               f"{view.name}'s operand")
    _check_length(view, view.in_shapes[operand], out_to_in[out_dim],
                  "operand")
    new_outs = [out_dim] * len(outs)
  return new_ins, new_outs


def _identity(view: SplitView, keep) -> dict:
  return {a: a for a in range(len(view.in_shapes[0])) if keep(a)}


def transpose(view: SplitView, ins, outs):
  permutation = view.layout["permutation"]
  return _mapped(view, ins, outs,
                 {src: dst for dst, src in enumerate(permutation)})


def squeeze(view: SplitView, ins, outs):
  gone = set(view.layout["dimensions"])
  kept = [a for a in range(len(view.in_shapes[0])) if a not in gone]
  return _mapped(view, ins, outs, {a: i for i, a in enumerate(kept)})


def reshape(view: SplitView, ins, outs):
  """Row-major reshape: an axis is kept where the axes before it hold as
  many elements before and after and its length is unchanged."""
  if view.layout.get("dimensions") is not None:
    raise Unsplittable("reshape with a transposition")
  before, after = view.in_shapes[0], view.out_shapes[0]
  in_to_out = {}
  for a in range(len(before)):
    lead = math.prod(before[:a])
    for b in range(len(after)):
      if math.prod(after[:b]) == lead and after[b] == before[a]:
        in_to_out[a] = b
        break
  return _mapped(view, ins, outs, in_to_out,
                 whole_operands=range(1, len(ins)))


def broadcast_in_dim(view: SplitView, ins, outs):
  """Operand axis `a` is result axis `broadcast_dimensions[a]`; a result
  axis made by the broadcast is cut from a whole operand."""
  if len(ins) != 1:
    raise Unsplittable("broadcast_in_dim with dynamic shapes")
  dims = view.layout["broadcast_dimensions"]
  operand = view.in_shapes[0]
  in_to_out = {a: d for a, d in enumerate(dims) if operand[a] == view.length}
  if isinstance(ins[0], int):
    return _mapped(view, ins, outs, in_to_out)
  new_ins, new_outs = list(ins), list(outs)
  for out_dim in _cut(outs):
    _check_length(view, view.out_shapes[0], out_dim, "result")
    from_operand = [a for a, d in in_to_out.items() if d == out_dim]
    new_ins[0] = _settle(ins[0], from_operand[0] if from_operand else WHOLE,
                         "broadcast_in_dim's operand")
  return new_ins, new_outs


def iota(view: SplitView, ins, outs):
  for out_dim in _cut(outs):
    if out_dim == view.layout["dimension"]:
      raise Unsplittable("iota counts along the cut axis")
    _check_length(view, view.out_shapes[0], out_dim, "result")
  return ins, outs


def _reduction(summable: bool) -> Rule:
  def rule(view: SplitView, ins, outs):
    axes = set(view.layout["axes"])
    if isinstance(ins[0], int) and ins[0] in axes:
      if not summable:
        raise Unsplittable(f"{view.name} over the cut axis")
      _check_length(view, view.in_shapes[0], ins[0], "operand")
      return ins, [_settle(outs[0], SUMMED, f"{view.name}'s result")]
    kept = [a for a in range(len(view.in_shapes[0])) if a not in axes]
    return _mapped(view, ins, outs, {a: i for i, a in enumerate(kept)})
  return rule


reduce_sum = _reduction(summable=True)
reduce_other = _reduction(summable=False)


def slice_(view: SplitView, ins, outs):
  start, limit = view.layout["start_indices"], view.layout["limit_indices"]
  strides = view.layout.get("strides") or (1,) * len(start)
  full = {a: a for a in range(len(start))
          if start[a] == 0 and limit[a] == view.length and strides[a] == 1}
  return _mapped(view, ins, outs, full)


def pad(view: SplitView, ins, outs):
  config = view.layout["padding_config"]
  return _mapped(view, ins, outs,
                 _identity(view, lambda a: config[a] == (0, 0, 0)),
                 whole_operands=(1,))


def along_axis(param: str) -> Rule:
  """One operand, one axis worked along (a cumulative sum, a split):
  any other axis can be cut."""
  def rule(view: SplitView, ins, outs):
    along = view.layout[param]
    return _mapped(view, ins, outs, _identity(view, lambda a: a != along))
  return rule


def rev(view: SplitView, ins, outs):
  flipped = set(view.layout["dimensions"])
  return _mapped(view, ins, outs, _identity(view, lambda a: a not in flipped))


def concatenate(view: SplitView, ins, outs):
  along = view.layout["dimension"]
  axis = _one_axis(view, ins, outs)
  if axis is None:
    return ins, outs
  if axis == along:
    raise Unsplittable("concatenate along the cut axis")
  for shape in view.in_shapes:
    _check_length(view, shape, axis, "operand")
  return [_settle(d, axis, "concatenate's operand") for d in ins], [axis]


def dot_general(view: SplitView, ins, outs):
  """Batch axes are cut on both sides; a contracted axis cut on both sides
  makes a partial sum; a free axis is cut on its side, the other operand
  whole."""
  (lc, rc), (lb, rb) = view.layout["dimension_numbers"]
  lhs_rank, rhs_rank = len(view.in_shapes[0]), len(view.in_shapes[1])
  lhs_free = [a for a in range(lhs_rank) if a not in lc and a not in lb]
  rhs_free = [a for a in range(rhs_rank) if a not in rc and a not in rb]
  # Each way to cut: (lhs axis, rhs axis, result axis), None where absent.
  ways = ([(l, r, i) for i, (l, r) in enumerate(zip(lb, rb))]
          + [(l, r, SUMMED) for l, r in zip(lc, rc)]
          + [(l, WHOLE, len(lb) + i) for i, l in enumerate(lhs_free)]
          + [(WHOLE, r, len(lb) + len(lhs_free) + i)
             for i, r in enumerate(rhs_free)])
  lhs, rhs, out = ins[0], ins[1], outs[0]
  known = [w for w in ways
           if (isinstance(lhs, int) and w[0] == lhs)
           or (isinstance(rhs, int) and w[1] == rhs)
           or (isinstance(out, int) and w[2] == out)]
  if not known:
    if isinstance(lhs, int) or isinstance(rhs, int) or isinstance(out, int):
      raise Unsplittable("dot_general cannot cut that axis")
    return ins, outs
  if len(set(known)) > 1:
    raise Unsplittable("dot_general's operands are cut along unpaired axes")
  l, r, o = known[0]
  for value, axis, shape in ((lhs, l, view.in_shapes[0]),
                             (rhs, r, view.in_shapes[1])):
    if isinstance(axis, int):
      _check_length(view, shape, axis, "operand")
  return ([_settle(lhs, l, "dot_general's lhs"),
           _settle(rhs, r, "dot_general's rhs")],
          [_settle(out, o, "dot_general's result")])


def _settled_way(view: SplitView, ins, outs, ways, what: str):
  """Operand and result axes by the one way (an axis or WHOLE per operand,
  then the result's) that the known axes name."""
  known = {w for w in ways
           if any(isinstance(d, int) and d == a
                  for d, a in zip(list(ins) + list(outs), w))}
  if not known:
    if any(isinstance(d, int) for d in list(ins) + list(outs)):
      raise Unsplittable(f"{what} cannot cut that axis")
    return ins, outs
  if len(known) > 1:
    raise Unsplittable(f"{what}'s operands are cut along unpaired axes")
  (way,) = known
  shapes = list(view.in_shapes) + list(view.out_shapes)
  for axis, shape in zip(way, shapes):
    if isinstance(axis, int):
      _check_length(view, shape, axis, f"{what}'s value")
  settled = [_settle(d, a, f"a value of {what}")
             for d, a in zip(list(ins) + list(outs), way)]
  return settled[:len(ins)], settled[len(ins):]


def _indexed_axes(view: SplitView, index_batching: str, dropped: str):
  """A gather's or scatter's operand batching axes, the indices' batching
  axes paired with them, and the operand's window axes (neither batching
  nor `dropped`: collapsed or inserted)."""
  numbers = view.layout["dimension_numbers"]
  operand_batching = numbers.get("operand_batching_dims", ())
  windows = [d for d in range(len(view.in_shapes[0]))
             if d not in numbers[dropped] and d not in operand_batching]
  return operand_batching, numbers.get(index_batching, ()), windows


def gather(view: SplitView, ins, outs):
  """A batching axis is cut in the operand, the indices and the result
  (`take_along_axis`); an axis of the indices alone, in the indices and
  the result, the operand whole (an embedding lookup); a window the
  gather takes whole along an axis of the operand, in the operand and the
  result, the indices whole (its slice size is cut with it)."""
  numbers = view.layout["dimension_numbers"]
  index_rank = len(view.in_shapes[1])
  offset = numbers["offset_dims"]
  batch_out = [d for d in range(len(view.out_shapes[0])) if d not in offset]
  operand_batching, index_batching, windows = _indexed_axes(
      view, "start_indices_batching_dims", "collapsed_slice_dims")
  ways = [(o, i, batch_out[i])
          for o, i in zip(operand_batching, index_batching)]
  ways += [(WHOLE, i, batch_out[i]) for i in range(index_rank - 1)
           if i not in index_batching]
  sizes = view.layout["slice_sizes"]
  ways += [(d, WHOLE, offset[n]) for n, d in enumerate(windows)
           if d not in numbers["start_index_map"]
           and sizes[d] == view.in_shapes[0][d]]
  return _settled_way(view, ins, outs, ways, "gather")


def scatter_add(view: SplitView, ins, outs):
  """A batching axis is cut in the operand, the indices, the updates and
  the result; a window written whole along an axis of the operand, in the
  operand, the updates and the result, the indices whole. (An axis of the
  indices alone would add each chunk's updates into the whole operand:
  not split.)"""
  numbers = view.layout["dimension_numbers"]
  window = numbers["update_window_dims"]
  scatter_dims = [d for d in range(len(view.in_shapes[2]))
                  if d not in window]
  operand_batching, index_batching, windows = _indexed_axes(
      view, "scatter_indices_batching_dims", "inserted_window_dims")
  ways = [(o, i, scatter_dims[i], o)
          for o, i in zip(operand_batching, index_batching)]
  ways += [(d, WHOLE, window[n], d) for n, d in enumerate(windows)
           if d not in numbers["scatter_dims_to_operand_dims"]
           and view.in_shapes[2][window[n]] == view.in_shapes[0][d]]
  return _settled_way(view, ins, outs, ways, "scatter-add")
