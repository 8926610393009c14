"""The optimizer's update of a stacked state leaf, run inside the loop that
makes the leaf's gradient.

A scan's backward loop makes the gradient of a layer stack one layer per
iteration, and the step then updates the stack, its moments and so on, as
a run of pointwise equations over the whole stack (`jlms._state` finds
these runs). Run after the loop, that update needs the whole gradient
stack on the device (on the 6.58B-parameter GPT of issue 15, 8 GiB for
each MLP kernel) and, for state kept on host, a loop of its own that does
nothing but copy. Here the update of layer `i` runs in the backward
loop's iteration for layer `i` instead, on the gradient slice it has just
made:

- the gradient stack is not made where nothing else reads it;
- state on the device (the parameter, a moment) is updated in place, slice
  by slice, the loop reading each slice from the buffer that the update
  then overwrites;
- state on host is fetched a layer ahead and written back a layer behind,
  so that its copies run under the layer's backward where XLA's scheduler
  has room (jaxlib 0.10.2 and 0.12.0.1 do, for a weight's two moments:
  docs/state-on-host.md);
- the scalars that the update reads (Adam's bias corrections) are
  computed again before the loop, from the same inputs, when the step
  computes them after it.

The analyses (`fusable_run`, which widens a run by the pointwise
equations after the loop that make what it reads, and `fusable_loop`) and
one rewrite (`fused_update_loop`), used by `jlms._state._stream_state`. A run that these rules do not cover (chunked
rows, a gradient read whole by something else, scalars that depend on the
loop's results, such as a global-norm clip) keeps `jlms._state`'s own
update loop, or stays as it is.

Guarantees: the rewritten loop computes exactly the values of the loop and
the update it replaces (pointwise equations compute on a slice what they
compute on that slice of the whole; the scalars are the same equations on
the same inputs); every read of a slice of a buffer updated in place
precedes the write of that slice.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
import jax.numpy as jnp

from jlms import _compat, _rules
from jlms._liveness import Liveness, aval_nbytes
from jlms._names import profile_scope
from jlms._program import Const, Equation, Program
from jlms._retrace import traced_call

# Scalars recomputed before the loop: a few equations each (Adam's bias
# corrections are two powers and a subtraction); more means the update
# depends on something that is not cheap to redo.
_MAX_HOISTED_EQUATIONS = 64


class CannotFuse(Exception):
  """A run that this module's rules do not cover (see the docstring)."""


@dataclasses.dataclass(frozen=True)
class _Run:
  """One update run (`jlms._update_loops.update_runs`), sorted by role."""
  equations: tuple[int, ...]
  slice_shape: tuple[int, ...]
  gradients: tuple[int, ...]  # stacks the loop makes, read by the run
  host_carried: tuple[tuple[int, int], ...]  # (input on host, its update)
  device_carried: tuple[tuple[int, int], ...]  # (input on device, its update)
  read_only: tuple[int, ...]  # other stacks on the device it reads
  scalars: tuple[int, ...]  # values of other shapes, read whole


@dataclasses.dataclass(frozen=True)
class FusedLoop:
  """The equation that replaces a loop, and what it moves."""
  equation: Equation
  runs: tuple[tuple[int, ...], ...]  # the update runs folded into it
  to_device: int
  to_host: int
  host_outputs: tuple[int, ...]  # values it makes on host
  leaves: int = 0  # state leaves whose update it runs
  # Of `to_device` and of `to_host`, the bytes that XLA copies beside the
  # loop's kernels; the rest it waits for (see `_beside_kernels`).
  to_device_beside: int = 0
  to_host_beside: int = 0
  # Of the rest, each way, the slices fetched before the first iteration
  # and written back after the last, outside the loop's body.
  edge_bytes: int = 0


def is_sliceable(equation: Equation, program: Program, shape) -> bool:
  """Whether `equation` computes the same on a leading slice of arrays of
  `shape` as on the whole: pointwise (or a broadcast of a rank-0
  operand), every array it reads and makes of `shape` or rank 0."""
  eqn = equation.eqn
  if _compat.sub_jaxprs(eqn) or not equation.outputs:
    return False
  if not _rules.rule(eqn.primitive).pointwise and not (
      _compat.is_scalar_broadcast(eqn)):
    return False
  for value in equation.outputs:
    aval = program.avals[value]
    if tuple(aval.shape) != shape or not _compat.has_plain_layout(aval):
      return False
  for atom in equation.inputs:
    if isinstance(atom, Const):
      if getattr(atom.value, "shape", ()) not in ((), shape):
        return False
      continue
    aval = program.avals[atom]
    if tuple(aval.shape) not in ((), shape) or not _compat.has_plain_layout(
        aval):
      return False
  return True


def _is_loop_or_call(primitive) -> bool:
  return primitive is _compat.scan_p or _compat.is_jit_primitive(primitive)


def fusable_run(program: Program, liveness: Liveness, run: list[int]
                ) -> tuple[int | None, list[int]]:
  """(the loop whose iterations can run `run`, see `fusable_loop`, or
  None; the run widened by the sliceable equations after that loop that
  make what it reads: the update of a moment kept on the device, which the
  run reads and the step returns)."""
  shape = tuple(program.avals[program.equations[run[0]].outputs[0]].shape)
  inside = set(run)
  loops = sorted({liveness.producer[a] for i in run
                  for a in program.equations[i].inputs
                  if isinstance(a, int) and liveness.producer[a] >= 0
                  and liveness.producer[a] not in inside
                  and _is_loop_or_call(
                      program.equations[liveness.producer[a]].primitive)},
                 reverse=True)
  for loop in loops:
    extended, work = set(run), list(run)
    while work:
      for atom in program.equations[work.pop()].inputs:
        if not isinstance(atom, int):
          continue
        maker = liveness.producer[atom]
        if (maker > loop and maker not in extended and tuple(
            program.avals[atom].shape) == shape and is_sliceable(
                program.equations[maker], program, shape)):
          extended.add(maker)
          work.append(maker)
    extended = sorted(extended)
    if fusable_loop(program, liveness, extended) == loop:
      return loop, extended
  return None, run


def fusable_loop(program: Program, liveness: Liveness,
                 run: Sequence[int]) -> int | None:
  """The index of the loop equation (a scan, or a call of one) whose
  stacked output is the one stack of the run's leaf shape made inside the
  program that the run reads, where there is one; else None."""
  inside = set(run)
  shape = tuple(program.avals[program.equations[run[0]].outputs[0]].shape)
  makers = set()
  for index in run:
    for atom in program.equations[index].inputs:
      if not isinstance(atom, int) or tuple(program.avals[atom].shape) != shape:
        continue
      maker = liveness.producer[atom]
      if maker >= 0 and maker not in inside:
        makers.add(maker)
  if len(makers) != 1:
    return None
  (maker,) = makers
  equation = program.equations[maker]
  positions = [p for p, v in enumerate(equation.outputs)
               if any(v in program.equations[i].inputs for i in run)]
  if maker > run[0] or _loop_chain(equation.eqn, positions) is None:
    return None
  return maker


def _loop_chain(eqn, positions: list[int]):
  """(the equations from `eqn` down to the scan that makes its outputs at
  `positions` as stacked outputs, through nested jits that pass them on
  untouched; their positions among the scan's outputs), or None."""
  if eqn.primitive is _compat.scan_p:
    layout = _compat.scan_layout(eqn)
    if layout.length < 2 or any(p < layout.num_carry for p in positions):
      return None
    return [eqn], list(positions)
  if not _compat.is_jit_primitive(eqn.primitive):
    return None
  jaxpr, _ = _compat.call_body(eqn)
  wanted = [jaxpr.outvars[p] for p in positions]
  if any(isinstance(v, _compat.Literal) for v in wanted):
    return None
  if any(sum(o is v for o in jaxpr.outvars) != 1 for v in wanted):
    return None
  makers = [inner for inner in jaxpr.eqns
            if any(o is v for o in inner.outvars for v in wanted)]
  if len(makers) != 1 or any(
      _reads(inner, wanted) for inner in jaxpr.eqns):
    return None
  inner = makers[0]
  found = _loop_chain(inner, [
      next(k for k, o in enumerate(inner.outvars) if o is v) for v in wanted])
  if found is None:
    return None
  return [eqn, *found[0]], found[1]


def _reads(eqn, variables) -> bool:
  return any(not isinstance(v, _compat.Literal) and any(v is w for w in variables)
             for v in eqn.invars)


def _scanned_positions(chain, positions: list[int]) -> list[int]:
  """Positions, among the scan's inputs, of what the chain's first
  equation takes at `positions`; raises `CannotFuse` unless the scan
  alone reads it, as its scanned input."""
  for level, eqn in enumerate(chain[:-1]):
    jaxpr, _ = _compat.call_body(eqn)
    taken = [jaxpr.invars[p] for p in positions]
    following = chain[level + 1]
    if any(_reads(inner, taken) for inner in jaxpr.eqns
           if inner is not following) or any(
               any(o is v for v in taken) for o in jaxpr.outvars):
      raise CannotFuse
    positions = [q for q, v in enumerate(following.invars)
                 if not isinstance(v, _compat.Literal)
                 and any(v is w for w in taken)]
  layout = _compat.scan_layout(chain[-1])
  if any(q < layout.num_consts + layout.num_carry for q in positions):
    raise CannotFuse
  return positions


def _sorted_run(program: Program, liveness: Liveness, run: Sequence[int],
                loop: int, on_host: set[int], updated: dict[int, int]
                ) -> _Run:
  inside = set(run)
  made = {v for i in run for v in program.equations[i].outputs}
  shape = tuple(program.avals[program.equations[run[0]].outputs[0]].shape)
  loop_outputs = set(program.equations[loop].outputs)
  gradients, host, device, scalars = [], [], [], []
  for index in run:
    for atom in program.equations[index].inputs:
      if not isinstance(atom, int) or atom in made:
        continue
      if atom in gradients + host + device + scalars:
        continue
      if tuple(program.avals[atom].shape) != shape:
        scalars.append(atom)
      elif atom in loop_outputs:
        gradients.append(atom)
      elif atom in on_host:
        host.append(atom)
      else:
        device.append(atom)
  n = len(program)
  for value in made:  # the run's results are the step's outputs alone
    if any(r not in inside and r != n for r in liveness.uses[value]):
      raise CannotFuse
  host_carried = []
  for h in host:
    if updated.get(h) not in made or any(r not in inside
                                         for r in liveness.uses[h]):
      raise CannotFuse  # read elsewhere, or not updated here
    host_carried.append((h, updated[h]))
  device_carried, read_only = [], []
  for d in device:
    out = updated.get(d)
    if out in made and all(r in inside or r <= loop
                           for r in liveness.uses[d]):
      device_carried.append((d, out))
    else:
      read_only.append(d)
  carried_outputs = {out for _, out in host_carried + device_carried}
  if any(n in liveness.uses[v] and v not in carried_outputs for v in made):
    raise CannotFuse  # a result the loop would not give back
  return _Run(tuple(run), shape[1:], tuple(gradients), tuple(host_carried),
              tuple(device_carried), tuple(read_only), tuple(scalars))


def _hoisted(program: Program, liveness: Liveness, values, loop: int,
             excluded: set[int]) -> tuple[list[int], list[int]]:
  """(equations after `loop` that make `values`, in order; the values made
  before it that they read): rank-0 equations with no bodies, recomputed
  before the loop. Raises `CannotFuse` if they depend on the loop."""
  equations, inputs, seen = set(), set(), set()
  work = list(values)
  while work:
    value = work.pop()
    if value in seen:
      continue
    seen.add(value)
    maker = liveness.producer[value]
    if maker < loop:
      inputs.add(value)
      continue
    if maker == loop or maker in excluded:
      raise CannotFuse
    equation = program.equations[maker]
    if _compat.sub_jaxprs(equation.eqn) or any(
        tuple(program.avals[v].shape) for v in equation.outputs):
      raise CannotFuse
    equations.add(maker)
    if len(equations) > _MAX_HOISTED_EQUATIONS:
      raise CannotFuse
    work.extend(a for a in equation.inputs if isinstance(a, int))
  return sorted(equations), sorted(inputs)


def fused_update_loop(program: Program, liveness: Liveness, loop: int,
                      runs: Sequence[Sequence[int]], on_host: set[int],
                      updated: dict[int, int], label: Callable[[int], str]
                      ) -> FusedLoop:
  """The loop equation at `loop` (see `fusable_loop`) running those of the
  update `runs` that the rules cover in its iterations (see the module
  docstring). Raises `CannotFuse` where they cover none."""
  sorted_runs = []
  for run in runs:
    try:
      sorted_runs.append(_sorted_run(program, liveness, run, loop, on_host,
                                     updated))
    except CannotFuse:
      continue  # left to its own update loop
  if not sorted_runs:
    raise CannotFuse
  runs = [r.equations for r in sorted_runs]
  equation = program.equations[loop]
  gradients = [g for r in sorted_runs for g in r.gradients]
  positions = [equation.outputs.index(g) for g in gradients]
  chain, ys_positions = _loop_chain(equation.eqn, positions)
  scan = chain[-1]
  layout = _compat.scan_layout(scan)
  length, reverse = layout.length, layout.reverse
  for r in sorted_runs:
    stacks = [*r.gradients, *(h for h, _ in r.host_carried),
              *(d for d, _ in r.device_carried), *r.read_only]
    if any(program.avals[s].shape[0] != length
           or not _compat.has_plain_layout(program.avals[s]) for s in stacks):
      raise CannotFuse
  inside = {i for run in runs for i in run}
  # A gradient read by nothing but the update is not stacked at all.
  dropped = {g for g in gradients
             if all(r in inside for r in liveness.uses[g])}
  scalars = [s for r in sorted_runs for s in r.scalars]
  hoisted, scalar_inputs = _hoisted(program, liveness, scalars, loop, inside)
  host_carried = [pair for r in sorted_runs for pair in r.host_carried]
  device_carried = [pair for r in sorted_runs for pair in r.device_carried]
  read_only = list(dict.fromkeys(v for r in sorted_runs for v in r.read_only))
  extra = [*scalar_inputs, *(d for d, _ in device_carried), *read_only,
           *(h for h, _ in host_carried)]
  if any(_compat.is_host_aval(program.avals[v])
         for v in extra[:len(extra) - len(host_carried)]):
    raise CannotFuse
  # The scan reads a parameter updated in place from the carried buffer.
  substituted = {}
  for k, (d, _) in enumerate(device_carried):
    taken = [p for p, a in enumerate(equation.inputs) if a == d]
    for q in _scanned_positions(chain, taken):
      substituted[q] = k
  kept_outputs = [p for p, v in enumerate(equation.outputs)
                  if v not in dropped]
  dropped_ys = {ys for g, ys in zip(gradients, ys_positions) if g in dropped}
  gradient_ys = dict(zip(gradients, ys_positions))
  n_inputs = len(equation.inputs)

  def index_of(count):
    index = length - 1 - count if reverse else count
    return jnp.clip(index, 0, length - 1)

  def fetch(h, buffer, index):
    with jax.named_scope(profile_scope("swap_in", label(h))):
      return jnp.squeeze(jax.device_put(
          jax.lax.dynamic_slice_in_dim(buffer, index, 1),
          jax.memory.Space.Device), 0)

  def write(out, buffer, value, index):
    with jax.named_scope(profile_scope("swap_out", label(out))):
      return jax.lax.dynamic_update_slice_in_dim(
          buffer, jax.device_put(value, jax.memory.Space.Host)[None],
          index, 0)

  def run_update(env):
    for r in sorted_runs:
      for index in r.equations:
        eq = program.equations[index]
        args = [a.value if isinstance(a, Const) else env[a]
                for a in eq.inputs]
        if _compat.is_scalar_broadcast(eq.eqn):
          results = [_compat.broadcast_scalar(eq.eqn, args[0], r.slice_shape)]
        else:
          results = _compat.bind_equation(eq.eqn, args)
        env.update(zip(eq.outputs, results))

  def extended_scan(args, values):
    first_xs = layout.num_consts + layout.num_carry
    consts, carry = args[:layout.num_consts], args[layout.num_consts:first_xs]
    scanned = range(first_xs, len(args))
    others = [q for q in scanned if q not in substituted]
    n_ys = len(scan.outvars) - layout.num_carry
    kept_ys = [j for j in range(layout.num_carry, layout.num_carry + n_ys)
               if j not in dropped_ys]
    device_buffers = [values[d] for d, _ in device_carried]
    host_buffers = [values[h] for h, _ in host_carried]
    half = (len(host_carried) + 1) // 2

    def iteration(state, xs):
      carry, count, device_buffers, host_buffers, fetched, pending = state
      # A count of its own, not XLA's loop counter (see `jlms._loops`):
      # the fetch ahead and the write behind can then start at the top of
      # the body.
      count = jax.lax.optimization_barrier(count)
      other_slices, read_only_slices = xs
      index = index_of(count)
      slices = [jax.lax.dynamic_index_in_dim(b, index, keepdims=False)
                for b in device_buffers]
      taken = dict(zip(others, other_slices))
      taken.update((q, slices[k]) for q, k in substituted.items())
      outs = _compat.eval_jaxpr(layout.body.jaxpr, layout.body.consts,
                                *consts, *carry, *(taken[q] for q in scanned))
      env = {s: values[s] for s in scalars}
      env.update((g, outs[gradient_ys[g]]) for g in gradients)
      env.update(zip(read_only, read_only_slices))
      env.update((d, s) for (d, _), s in zip(device_carried, slices))
      env.update((h, f) for (h, _), f in zip(host_carried, fetched))
      run_update(env)
      device_buffers = [
          jax.lax.dynamic_update_index_in_dim(b, env[out], index, 0)
          for b, (_, out) in zip(device_buffers, device_carried)]
      # The previous layer's moments go out while the next layer's come in:
      # a buffer gives its next slice and takes its written one in either
      # order, so half the buffers read first and half write first, and
      # each half's copies run beside the other half's on the other engine.
      # The neighbours' indices leave through a barrier, and the next count
      # is made from what comes out of it. Made from the same count, XLA
      # fuses the index with the next count, whose kernel writes the loop's
      # count buffer in place and so runs after every read of the old count:
      # after the in-place updates at the body's end, and the fetch with it
      # (the 6.58B-parameter GPT: each moment's fetch waited for whole,
      # 256 ms of its 1504 by the schedule model).
      count, previous, following = jax.lax.optimization_barrier(
          (count, index_of(count - 1), index_of(count + 1)))
      new_buffers, next_fetched = list(host_buffers), [None] * len(host_buffers)
      for k, ((h, out), buffer) in enumerate(zip(host_carried, host_buffers)):
        if k < half:
          ahead = fetch(h, buffer, following)
          # The write-back also waits for this layer's update: started at
          # the body's top, it left its fetch, which must come first, no
          # kernel to run beside (the 6.58B-parameter GPT: 1430 -> 1275 ms
          # by the schedule model).
          buffer, ahead, written = jax.lax.optimization_barrier(
              (buffer, ahead, [pending[k], env[out]]))
          new_buffers[k] = write(out, buffer, written[0], previous)
          next_fetched[k] = ahead
        else:
          new_buffers[k] = write(out, buffer, pending[k], previous)
          next_fetched[k] = fetch(h, new_buffers[k], following)
      pending = [env[out] for _, out in host_carried]
      state = (outs[:layout.num_carry], count + 1, device_buffers,
               new_buffers, next_fetched, pending)
      return state, [outs[j] for j in kept_ys]

    first = index_of(jnp.int32(0))
    fetched = [fetch(h, b, first) for (h, _), b in zip(host_carried,
                                                       host_buffers)]
    # The first iteration writes its slices back unchanged: the loop then
    # has one shape of iteration.
    start = (list(carry), jnp.int32(0), device_buffers, host_buffers,
             fetched, list(fetched))
    (carry, _, device_buffers, host_buffers, _, pending), ys = jax.lax.scan(
        iteration, start, ([args[q] for q in others],
                           [values[v] for v in read_only]),
        length=length, reverse=reverse)
    last = index_of(jnp.int32(length - 1))
    host_buffers = [write(out, b, p, last) for (_, out), b, p in zip(
        host_carried, host_buffers, pending)]
    outputs = [*carry, *[None] * n_ys]
    for j, y in zip(kept_ys, ys):
      outputs[j] = y
    return outputs, [*host_buffers, *device_buffers]

  def through(level, args, values):
    eqn = chain[level]
    if level == len(chain) - 1:
      return extended_scan(args, values)
    jaxpr, consts = _compat.call_body(eqn)
    env = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    finals = None
    for inner in jaxpr.eqns:
      ins = [v.val if isinstance(v, _compat.Literal) else env[v]
             for v in inner.invars]
      if inner is chain[level + 1]:
        outs, finals = through(level + 1, ins, values)
      else:
        outs = _compat.stage_equation(inner, ins)
      env.update(zip(inner.outvars, outs))
    return [v.val if isinstance(v, _compat.Literal) else env[v]
            for v in jaxpr.outvars], finals

  def call(*args):
    values = dict(zip(extra, args[n_inputs:]))
    for index in hoisted:
      eq = program.equations[index]
      ins = [a.value if isinstance(a, Const) else values[a] for a in eq.inputs]
      values.update(zip(eq.outputs, _compat.bind_equation(eq.eqn, ins)))
    outs, finals = through(0, list(args[:n_inputs]), values)
    return [*(outs[p] for p in kept_outputs), *finals]

  avals = [v.aval for v in equation.eqn.invars] + [
      program.avals[v] for v in extra]
  host_positions = [p for p, a in enumerate(avals) if _compat.is_host_aval(a)]
  name = _compat.call_name(equation.eqn) if _compat.is_jit_primitive(
      equation.primitive) else None
  eqn = traced_call(call, avals, host_positions,
                    name or "jlms_scan_updating_state", equation.eqn)
  outputs = ([equation.outputs[p] for p in kept_outputs]
             + [out for _, out in host_carried]
             + [out for _, out in device_carried])
  fused = Equation(eqn, (*equation.inputs, *extra), tuple(outputs),
                   equation.name_stack)
  stacks = sum(aval_nbytes(program.avals[h]) for h, _ in host_carried)
  # One slice of each buffer crosses twice: fetched again at the end, and
  # written back unchanged at the start.
  moved = stacks * (length + 1) // length
  to_device_beside, to_host_beside = _beside_kernels(len(host_carried),
                                                    stacks)
  return FusedLoop(fused, tuple(tuple(run) for run in runs), moved,
                   moved, tuple(out for _, out in host_carried),
                   len(host_carried) + len(device_carried),
                   to_device_beside, to_host_beside, moved - stacks)


#: The most buffers on host whose fetches XLA's scheduler runs beside the
#: fused loop's kernels in full (jaxlib 0.10.2 and 0.12.0.1, by their
#: compiled schedules, with `jlms._search.ASYNC_COPIES_IN_FLIGHT`).
_FETCHES_BESIDE_KERNELS = 2


def _beside_kernels(host_buffers: int, stacks: int) -> tuple[int, int]:
  """(bytes fetched, bytes written back) that XLA copies beside a fused
  loop's kernels, of a loop carrying `host_buffers` buffers on host of
  `stacks` bytes in all. The slices fetched before the first iteration
  and written after the last have no kernel of the loop beside them.
  Inside it, every write-back runs under the layers' kernels, and the
  fetches do for a weight's two moments (one buffer of each half: the
  6.58B-parameter GPT, 16 ms of 16.5 GiB each way exposed by the schedule
  model). With more buffers XLA waits for about half of the fetches'
  time (a 42-layer GPT with four moments on host: 415 ms exposed of 840
  ms each way; a 4-layer one with six: 87 of 144)."""
  fetched = (stacks if host_buffers <= _FETCHES_BESIDE_KERNELS
             else stacks // 2)
  return fetched, stacks

