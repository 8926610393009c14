"""Runs of equations that run chunk by chunk over the batch: serialization.

TFLMS's serialization ran a layer's ops one part at a time so that no
single op needed all of its working set at once. In a train step the
least memory is often bounded that way by one run of equations: a loss
over a large vocabulary makes logits, their soft-cap, softmax and one-hot
product, each `batch x sequence x vocabulary` and in float32, forward and
backward back to back, from a hidden state a thousand times smaller. No
choice of keep, remake or copy shrinks those; running the run over
chunks of the batch does.

Two pure steps:
- `batch_splits` finds such a run: from the largest value, it grows a
  region along values at least an eighth of its size whose equations all
  split along one axis (`jlms._split_rules`, keyed by primitive in
  `jlms._rules`), closes it so that nothing outside both reads from it
  and feeds it, and keeps it when its largest cut value is at least twice
  what crosses its edge: its cut inputs and outputs, and for a summed
  output (a weight's gradient, made whole split or not) the partial sums
  the split adds. The number of chunks is the least divisor of the axis
  that brings that value to the edge's size; where the step spans several
  devices that share the axis, of each device's share, and each chunk
  then takes every so many indices (`_chunk_count`).
- `split_over_batch` rewrites the program: the region's whole-valued
  equations first, then one `lax.scan` over the chunks (cut inputs
  sliced, cut outputs joined, partial sums added in float32 where the
  value is a narrower float), then the equations that read the sums. The
  totals start from zeros, or, when asked (a budget's fit), from the
  first chunk's partial sums, that chunk run before the loop: no zeros
  written whole, but in a least-memory plan XLA held the totals twice
  (Gemma2-2B: 9.83 GiB, against 7.71 from zeros; Llama-3.2-3B at
  remat's peak: 727.0 ms from the first chunk, 740.4 from zeros).

Guarantees: the rewritten program computes what the program computes, up
to the additions over chunks: a sum over the batch is added chunk by
chunk, each chunk's partial sum rounded to its dtype (for bfloat16, about
7e-3 relative over 16 chunks in a review's checks) before the float32
total; a region that any equation of it cannot split, that has ordered
effects in its span, or that is not worth splitting, is left as it is.
Gathers and scatter-adds are cut along their batching axes (optax's
integer-label cross-entropy, `take_along_axis`) and along the axes of a
window they take whole. Not split (yet): a reshape that merges the cut
axis into a larger one (logits `(B, S, V)` to `(B * S, V)`), and a
scatter-add whose indices alone are cut (each chunk would add into the
whole operand).
"""

from __future__ import annotations

import dataclasses
import logging
import math

import jax
import jax.numpy as jnp
import numpy as np

from jlms import _compat, _rules, _thresholds
from jlms._program import Atom, Const, Program
from jlms._retrace import atom_aval, traced_equations
from jlms._split_rules import (AFTER, SUMMED, WHOLE, SplitView,
                               Unsplittable)

log = logging.getLogger("jlms")

#: A region grows along cut values from this fraction of its seed's size.
_GROWS_FROM = 8
#: A region is worth splitting when its largest cut value is at least this
#: many times what crosses its edge.
_WORTH = 2
#: Primitives linear in their one operand that only move its elements: a
#: sum's chunks go through them and are added after (`_summed_through`).
_SUMMED_THROUGH = frozenset({"transpose", "reshape"})
#: Seeds tried per search, the largest values first.
_SEEDS = 16


@dataclasses.dataclass(frozen=True)
class BatchSplit:
  """A region of the program and how each value it touches is cut."""
  equations: tuple[int, ...]  # program order
  axes: dict  # atom -> cut axis (int), WHOLE, SUMMED or AFTER
  length: int  # the cut axis's full length
  chunks: int
  largest_bytes: int  # the largest value inside that is cut
  edge_bytes: int  # cut values that cross the region's edge
  # Chunk c takes every `chunks`-th index from c (where the step spans
  # several devices), else the c-th run of `length // chunks` indices.
  interleaved: bool = False

  def describe(self, program: Program) -> str:
    first = program.equations[self.equations[0]]
    return (f"{len(self.equations)} equations from "
            f"{first.readable_name()} run in {self.chunks} "
            f"{'interleaved ' if self.interleaved else ''}chunks of "
            f"{self.length // self.chunks} along an axis of {self.length}")


def _nbytes(aval) -> int:
  if _compat.is_extended_dtype(aval.dtype):  # a PRNG key: never cut
    return 0
  return math.prod(aval.shape) * np.dtype(aval.dtype).itemsize


@dataclasses.dataclass
class _Graph:
  producer: dict
  readers: dict
  outvars: set

  @classmethod
  def of(cls, program: Program) -> "_Graph":
    producer, readers = {}, {}
    for index, equation in enumerate(program.equations):
      for value in equation.outputs:
        producer[value] = index
      for atom in equation.inputs:
        if isinstance(atom, int):
          readers.setdefault(atom, []).append(index)
    return cls(producer, readers,
               {a for a in program.outvars if isinstance(a, int)})


def batch_splits(program: Program, devices: int = 1
                 ) -> tuple[BatchSplit, ...]:
  """At most one region worth running in chunks (see the module
  docstring), from the largest values of the program on; `()` if none.
  `split_over_batch` rewrites one region at a time: search again on its
  result for the next. `devices`: how many devices the step spans (see
  `_chunk_count`)."""
  min_bytes = _thresholds.THRESHOLDS.batch_split_min_bytes
  graph = _Graph.of(program)
  seeds = sorted(
      (v for v, i in graph.producer.items()
       if _rules.rule(program.equations[i].primitive).splits is not None
       and _nbytes(program.avals[v]) >= min_bytes),
      key=lambda v: -_nbytes(program.avals[v]))
  for seed in seeds[:_SEEDS]:
    for axis, length in enumerate(program.avals[seed].shape):
      if length < 2:
        continue
      try:
        found = _grown(program, graph, seed, axis, devices)
      except Unsplittable as why:
        log.debug("jlms: no batch split from %s along axis %d: %s",
                  program.equations[graph.producer[seed]].readable_name(),
                  axis, why)
        continue
      if found is not None:
        return (found,)
  return ()


def _key(atom: Atom):
  return atom  # ids are ints; a Const is hashed by identity


def _derived(program: Program, index: int, axes: dict, length: int):
  """The axes the rule of equation `index` gives its operands and
  results, from those known in `axes`."""
  equation = program.equations[index]
  ins = [axes.get(_key(a)) for a in equation.inputs]
  outs = [axes.get(v) for v in equation.outputs]
  if any(d in (SUMMED, AFTER) for d in ins):
    if any(isinstance(d, int) for d in ins + outs):
      raise Unsplittable(f"{equation.readable_name()} reads a sum over "
                         "the batch and a cut value together")
    if (equation.primitive.name in _SUMMED_THROUGH
        and all(d == SUMMED for d in ins)):
      return ins, [SUMMED] * len(outs)
    return ins, [AFTER] * len(outs)
  split = _rules.rule(equation.primitive).splits
  if split is None:
    raise Unsplittable(f"{equation.readable_name()} "
                       f"({equation.primitive}) has no split rule")
  view = SplitView(
      equation.primitive.name,
      tuple(tuple(atom_aval(a, program.avals).shape)
            for a in equation.inputs),
      tuple(tuple(program.avals[v].shape) for v in equation.outputs),
      _compat.shape_layout(equation.eqn), length)
  return split(view, ins, outs)


def _grown(program: Program, graph: _Graph, seed: int, axis: int,
           devices: int = 1) -> BatchSplit | None:
  length = program.avals[seed].shape[axis]
  grows_from = max(_nbytes(program.avals[seed]) // _GROWS_FROM, 1)
  max_equations = _thresholds.THRESHOLDS.batch_split_max_equations
  axes: dict = {seed: axis}
  region: set = set()

  def take(value: int) -> None:
    producer = graph.producer.get(value)
    for index in ([producer] if producer is not None else []) + list(
        graph.readers.get(value, ())):
      region.add(index)
    if len(region) > max_equations:
      raise Unsplittable(f"the region passes {max_equations} equations")

  take(seed)
  taken = {seed}
  while True:
    changed = True
    while changed:
      changed = False
      for index in sorted(region):
        equation = program.equations[index]
        ins, outs = _derived(program, index, axes, length)
        for atom, dim in zip(list(equation.inputs) + list(equation.outputs),
                             list(ins) + list(outs)):
          key = _key(atom)
          if dim is None or axes.get(key) == dim:
            continue
          if axes.get(key) is not None:
            raise Unsplittable(f"a value of {equation.readable_name()} is "
                               f"cut as {axes[key]!r} and {dim!r}")
          axes[key] = dim
          changed = True
          if (isinstance(dim, int) and isinstance(atom, int)
              and atom not in taken
              and _nbytes(program.avals[atom]) >= grows_from):
            taken.add(atom)
            take(atom)
    between = _between(program, region) + _summed_through(program, graph,
                                                          region, axes)
    if not between:
      break
    region.update(between)
    if len(region) > max_equations:
      raise Unsplittable(f"the region passes {max_equations} equations")
  return _finished(program, graph, sorted(region), axes, length, devices)


def _summed_through(program: Program, graph: _Graph, region: set,
                    axes: dict) -> list[int]:
  """The layout equations (`_SUMMED_THROUGH`) that alone read a sum the
  region makes: the chunks add their results instead. A weight's gradient
  that JAX makes transposed (`dot_general`'s transpose rule, then
  `transpose`) is then summed in the weight's own layout, and the update
  that reads it writes in place: summed transposed, XLA fused the
  transpose into the update and copied Llama-3.2-3B's lm_head weight and
  both its moments to the outputs, 1.5 GiB each."""
  found = []
  for value, dim in list(axes.items()):
    if dim != SUMMED or not isinstance(value, int) or value in graph.outvars:
      continue
    readers = [r for r in graph.readers.get(value, ()) if r not in region]
    if readers and all(program.equations[r].primitive.name
                       in _SUMMED_THROUGH for r in readers):
      found.extend(readers)
  return found


def _between(program: Program, region: set) -> list[int]:
  """Equations outside `region`, inside its span, that read from it and
  feed it: it must take them in to run as one loop."""
  lo, hi = min(region), max(region)
  tainted: set = set()
  after: set = set()
  for index in range(lo, hi + 1):
    equation = program.equations[index]
    if index in region or any(isinstance(a, int) and a in tainted
                              for a in equation.inputs):
      tainted.update(equation.outputs)
      if index not in region:
        after.add(index)
  needed: set = set()
  between = []
  for index in range(hi, lo - 1, -1):
    equation = program.equations[index]
    if index in region or (index in after and any(
        v in needed for v in equation.outputs)):
      if index not in region:
        between.append(index)
      needed.update(a for a in equation.inputs if isinstance(a, int))
  return between


def _kinds(program: Program, equations, axes: dict) -> dict:
  """Each equation of the region: "pre" (all whole), "body" (cut) or
  "post" (reads sums)."""
  kinds = {}
  for index in equations:
    equation = program.equations[index]
    dims = ([axes[_key(a)] for a in equation.inputs]
            + [axes[v] for v in equation.outputs])
    if any(d == AFTER for d in dims):
      kinds[index] = "post"
    elif any(isinstance(d, int) or d == SUMMED for d in dims):
      kinds[index] = "body"
    else:
      kinds[index] = "pre"
  return kinds


def _finished(program: Program, graph: _Graph, equations: list, axes: dict,
              length: int, devices: int = 1) -> BatchSplit | None:
  region = set(equations)
  # The rewrite moves the equations of the span around the loop: ordered
  # effects (a `jax.debug.print(ordered=True)`, an `io_callback`) would
  # change order.
  for index in range(min(region), max(region) + 1):
    if program.equations[index].eqn.effects:
      raise Unsplittable(f"{program.equations[index].readable_name()} has "
                         "effects inside the region's span")
  for index in equations:  # what is still unknown is whole
    equation = program.equations[index]
    for atom in list(equation.inputs) + list(equation.outputs):
      axes.setdefault(_key(atom), WHOLE)
  for index in equations:  # and every rule agrees
    equation = program.equations[index]
    ins, outs = _derived(program, index, axes, length)
    now = ([axes[_key(a)] for a in equation.inputs]
           + [axes[v] for v in equation.outputs])
    if list(ins) + list(outs) != now:
      raise Unsplittable(f"{equation.readable_name()} disagrees with the "
                         "axes around it")
  kinds = _kinds(program, equations, axes)
  body = [i for i in equations if kinds[i] == "body"]
  made_in_body = {v for i in body for v in program.equations[i].outputs}
  read_outside = {
      v for v in made_in_body
      if v in graph.outvars or any(r not in region or kinds[r] != "body"
                                   for r in graph.readers.get(v, ()))}
  edge = sum(_nbytes(atom_aval(a, program.avals)) for a in
             {a for i in body for a in program.equations[i].inputs
              if isinstance(axes[_key(a)], int)
              and not (isinstance(a, int) and a in made_in_body)})
  edge += sum(_nbytes(program.avals[v]) for v in read_outside
              if isinstance(axes[v], int))
  # A summed output is made whole by the program split or not (a weight's
  # gradient); what the split adds is one chunk's partial sum, the size of
  # the whole, and for a narrower float the float32 total in place of the
  # output: together the float32 size of the output.
  edge += sum(_nbytes(program.avals[v])
              * np.dtype(_accumulated(program.avals[v].dtype)).itemsize
              // np.dtype(program.avals[v].dtype).itemsize
              for v in read_outside if axes[v] == SUMMED)
  inside = [_nbytes(program.avals[v]) for v in made_in_body - read_outside
            if isinstance(axes[v], int)]
  largest = max(inside, default=0)
  if not read_outside:  # dead code: nothing to run in chunks
    return None
  if (largest < _thresholds.THRESHOLDS.batch_split_min_bytes
      or largest < _WORTH * edge):
    return None
  chunks, interleaved = _chunk_count(length, math.ceil(
      largest / max(edge, 1)), devices)
  if chunks is None:
    return None
  return BatchSplit(tuple(equations), dict(axes), length, chunks, largest,
                    edge, interleaved)


def _chunk_count(length: int, wanted: int, devices: int
                 ) -> tuple[int | None, bool]:
  """(chunks, interleaved): the least divisor of `length` from `wanted`
  on (the largest there is below it), None where there is none.

  Where the step spans several devices and the axis divides among them
  (a data-parallel batch), each device holds a run of `length // devices`
  indices. A chunk of contiguous indices would lie on a few devices, and
  XLA gathers it to all of them and runs the whole region on each (a
  batch of 16 over 8 devices in 16 chunks of 1: every device computed
  every row's logits, 4.3x the step's time on 8 CPU devices). So the
  chunks divide each device's run instead and take every `chunks`-th
  index: each chunk then holds as many indices of every device."""
  if devices > 1 and length % devices == 0:
    length, interleaved = length // devices, True
  else:
    interleaved = False
  divisors = [d for d in range(2, length + 1) if length % d == 0]
  if not divisors:
    return None, interleaved
  return next((d for d in divisors if d >= wanted), divisors[-1]), interleaved


def _accumulated(dtype):
  """Partial sums of a narrow float are added in float32, as XLA's own
  reductions accumulate."""
  if jnp.issubdtype(dtype, jnp.floating) and np.dtype(dtype).itemsize < 4:
    return jnp.float32
  return dtype


def _chunked(value, axis: int, chunks: int, interleaved: bool = False):
  """`value` as `chunks` chunks along `axis`, stacked first (see
  `BatchSplit.interleaved`)."""
  shape = value.shape
  if interleaved:
    split = (*shape[:axis], shape[axis] // chunks, chunks, *shape[axis + 1:])
    return jnp.moveaxis(value.reshape(split), axis + 1, 0)
  split = (*shape[:axis], chunks, shape[axis] // chunks, *shape[axis + 1:])
  return jnp.moveaxis(value.reshape(split), axis, 0)


def _joined(stacked, axis: int, interleaved: bool = False):
  """The inverse of `_chunked`."""
  moved = jnp.moveaxis(stacked, 0, axis + 1 if interleaved else axis)
  shape = moved.shape
  return moved.reshape(*shape[:axis], shape[axis] * shape[axis + 1],
                       *shape[axis + 2:])


def split_over_batch(program: Program, split: BatchSplit,
                     totals_from_first_chunk: bool = False) -> Program:
  """`program` with `split`'s region run chunk by chunk (see the module
  docstring); the values it hands on keep their ids. With
  `totals_from_first_chunk`, a region that sums runs its first chunk
  before the loop, and its partial sums start the totals."""
  graph = _Graph.of(program)
  region = set(split.equations)
  axes, chunks = split.axes, split.chunks
  kinds = _kinds(program, split.equations, axes)
  order = {k: [i for i in split.equations if kinds[i] == k]
           for k in ("pre", "body", "post")}
  made = {v for i in split.equations for v in program.equations[i].outputs}
  inputs = list(dict.fromkeys(
      a for i in split.equations for a in program.equations[i].inputs
      if isinstance(a, int) and a not in made))
  outputs = [v for i in split.equations for v in program.equations[i].outputs
             if v in graph.outvars or any(r not in region
                                          for r in graph.readers.get(v, ()))]
  body_made = {v for i in order["body"]
               for v in program.equations[i].outputs}
  body_reads = list(dict.fromkeys(
      _key(a) for i in order["body"] for a in program.equations[i].inputs
      if not (isinstance(a, int) and a in body_made)))
  cut_in = [a for a in body_reads if isinstance(axes[a], int)]
  whole_in = [a for a in body_reads if not isinstance(axes[a], int)]
  handed_on = [v for v in body_made
               if v in graph.outvars or any(
                   r not in region or kinds[r] != "body"
                   for r in graph.readers.get(v, ()))]
  summed = [v for v in handed_on if axes[v] == SUMMED]
  stacked = [v for v in handed_on if isinstance(axes[v], int)]

  def chunk_shape(value: int):
    shape = list(program.avals[value].shape)
    if isinstance(axes[value], int):
      shape[axes[value]] //= chunks
    return shape

  def run(*values):
    env = dict(zip(inputs, values))

    def read(atom):
      return atom.value if isinstance(atom, Const) else env[atom]

    def bind(index, reader):
      equation = program.equations[index]
      results = _compat.bind_equation(equation.eqn,
                                      [reader(a) for a in equation.inputs])
      env.update(zip(equation.outputs, results))

    for index in order["pre"]:
      bind(index, read)

    def partials(xs):
      # One chunk: its partial sums, and its slices of the stacked outputs.
      local = {a: read(a) for a in whole_in}
      local.update(zip(cut_in, xs))
      for index in order["body"]:
        equation = program.equations[index]
        results = _compat.bind_resized(
            equation.eqn, [local[_key(a)] for a in equation.inputs],
            [chunk_shape(v) for v in equation.outputs])
        local.update(zip(equation.outputs, results))
      return [local[v] for v in summed], [local[v] for v in stacked]

    whole_chunked = [_chunked(read(a), axes[a], chunks, split.interleaved)
                     for a in cut_in]

    def iteration(carry, index):
      sums, ys = partials([jax.lax.dynamic_index_in_dim(x, index, 0, False)
                           for x in whole_chunked])
      return [c + s.astype(c.dtype) for c, s in zip(carry, sums)], ys

    if summed and totals_from_first_chunk:
      # No zeros written whole to start the totals from (Llama-3.2-3B's
      # head gradient: 1.5 GiB, 0.47 ms on an H100): 0 + x is x.
      first_sums, first_ys = partials([x[0] for x in whole_chunked])
      totals, rest = jax.lax.scan(
          iteration, [s.astype(_accumulated(program.avals[v].dtype))
                      for s, v in zip(first_sums, summed)],
          jnp.arange(1, chunks, dtype=jnp.int32))
      ys = [jnp.concatenate([first[None], others])
            for first, others in zip(first_ys, rest)]
    else:
      zeros = [jnp.zeros(program.avals[v].shape,
                         _accumulated(program.avals[v].dtype)) for v in summed]
      totals, ys = jax.lax.scan(iteration, zeros,
                                jnp.arange(chunks, dtype=jnp.int32))
    env.update((v, t.astype(program.avals[v].dtype))
               for v, t in zip(summed, totals))
    env.update((v, _joined(y, axes[v], split.interleaved))
               for v, y in zip(stacked, ys))
    for index in order["post"]:
      bind(index, read)
    return [env[v] for v in outputs]

  seed = program.equations[split.equations[0]]
  retraced = traced_equations(run, inputs, program.avals, seed.name_stack,
                              like=seed.eqn, output_ids=outputs)
  if retraced.forwarded:
    raise Unsplittable("JAX forwarded an output of the split region")
  lo, hi = min(region), max(region)
  before, after, tainted = [], [], set(made)
  for index in range(lo, hi + 1):
    if index in region:
      continue
    equation = program.equations[index]
    if any(isinstance(a, int) and a in tainted for a in equation.inputs):
      after.append(equation)
      tainted.update(equation.outputs)
    else:
      before.append(equation)
  equations = (program.equations[:lo] + tuple(before) + retraced.equations
               + tuple(after) + program.equations[hi + 1:])
  return dataclasses.replace(program, equations=equations,
                             avals=program.avals + retraced.new_avals)


def split_runs(program: Program, limit: int = 8, devices: int = 1,
               totals_from_first_chunk: bool = False
               ) -> tuple[Program, list]:
  """`program` with up to `limit` regions run in chunks, one after
  another; and the description of each. A region whose rewrite fails is
  left as it is (debug log) and the search stops there. `devices`: as
  `batch_splits` takes it; `totals_from_first_chunk`: as
  `split_over_batch` takes it."""
  described = []
  for _ in range(limit):
    try:
      found = batch_splits(program, devices)
      if not found:
        break
      rewritten = split_over_batch(program, found[0],
                                   totals_from_first_chunk)
    except Exception as error:  # noqa: BLE001 -- this region only
      log.debug("jlms: batch split left out (%s: %s)",
                type(error).__name__, error)
      break
    described.append(found[0].describe(program))
    log.debug("jlms: %s", described[-1])
    program = rewritten
  return program, described
