"""The update of a state leaf outside any scan, as a loop over its rows.

`jlms._state` keeps a step's state in pinned host memory. An optimizer
update that no scan makes (a leaf not stacked by layers, or the stack's
update where its gradient is made whole) is a run of pointwise equations
on arrays of the leaf's shape: `update_runs` finds such runs, and
`update_loop` traces each as a loop over the leaf's leading axis (a
chunk of rows of a few MiB per iteration, or one slice of a short axis
such as a stack's layers), fetching the
state on host an iteration ahead and writing each updated slice back while
the next comes in.

Guarantees: a pointwise equation computes on a slice what it computes on
that slice of the whole, so the loop computes exactly the run's values;
`CannotLoop` where no loop can make a run (its reads then take whole
copies).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jlms import _compat, _thresholds
from jlms._groups import connected_groups
from jlms._liveness import Liveness, aval_nbytes
from jlms._names import profile_scope
from jlms._program import Const, Equation, Program
from jlms._sharding import device_shape
from jlms._update_fusion import is_sliceable

# The leading axis a leaf's update loop runs over: at least 2 iterations
# (XLA refuses a one-slice host stack, see `jlms._loops`) and at most
# `_MAX_LOOP_LENGTH`; rows are taken together until a slice holds
# `update_slice_min_bytes`, keeping at least `_MIN_ITERATIONS` where the
# axis has them: one row at a time, a Llama-3-8B's weight of 4096 rows is
# 4096 copies of 16 KiB each way, and its step with 158 leaves on host
# runs some 600,000 iterations (seconds of fixed costs on a GPU, where
# its copies take 1.3 s); fewer than `_MIN_ITERATIONS` leave more of the
# leaf in the slices fetched before the loop and written after it, and
# the last slice, fetched twice, a larger share of the bytes.
_MAX_LOOP_LENGTH = 4096
_MIN_ITERATIONS = 16


def reads_on_device(equation: Equation, value: int) -> bool:
  """Whether `equation` reads `value` as a device array (not as a host
  stack that it reads slice by slice itself)."""
  return any(a == value and not _compat.is_host_aval(v.aval)
             for a, v in zip(equation.inputs, equation.eqn.invars))


def _loop_rows(shape, row_bytes: int, chunks: bool = True) -> int | None:
  """The rows of a leaf of `shape` (`row_bytes` a row) that one iteration
  of its update loop takes: a divisor of the leading axis leaving 2 to
  `_MAX_LOOP_LENGTH` iterations; the fewest rows that make a slice of
  `update_slice_min_bytes`, but no more than leave `_MIN_ITERATIONS`
  (one row for an axis shorter than that: the layers of a stack); None
  when no divisor fits, or a long axis has none that leaves
  `_MIN_ITERATIONS`. Without `chunks` (a loop whose stacks cannot come
  out in chunks, see `update_loop`), one row, where the axis has 2 to
  `_MAX_LOOP_LENGTH` of them."""
  length = shape[0]
  if length < 2:
    return None
  if not chunks:
    return 1 if length <= _MAX_LOOP_LENGTH else None
  divisors = [d for d in _divisors(length)
              if 2 <= length // d <= _MAX_LOOP_LENGTH]
  if not divisors:
    return None
  many = [d for d in divisors if length // d >= _MIN_ITERATIONS]
  if not many:
    # A short axis, one slice an iteration; a long one with no divisor
    # leaving `_MIN_ITERATIONS` (a vocabulary of 32002 rows: 2 slices of
    # half the table, the last fetched twice) takes whole copies.
    return 1 if length <= _MAX_LOOP_LENGTH else None
  wanted = -(-_thresholds.THRESHOLDS.update_slice_min_bytes
             // max(row_bytes, 1))
  return next((d for d in many if d >= wanted), many[-1])


@functools.lru_cache(maxsize=None)
def _divisors(n: int) -> tuple[int, ...]:
  """The divisors of `n`, ascending."""
  small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
  return tuple(sorted({*small, *(n // d for d in small)}))


def _row_bytes(aval) -> int:
  shape = tuple(aval.shape)
  return aval_nbytes(aval) // shape[0] if shape and shape[0] else 0


def _split(shape, splits):
  """Of the `splits` of a run's stacks (of `shape`; None: not cut), the
  one cutting their rows into the most shards; None where none is cut."""
  cut = [s for s in splits if s is not None and shape[0] % s.shards == 0]
  return max(cut, key=lambda s: s.shards, default=None)


def _streamable(aval) -> bool:
  shape = tuple(aval.shape)
  return (len(shape) >= 2 and _loop_rows(shape, _row_bytes(aval)) is not None
          # A smaller leaf is copied whole: a loop buys nothing.
          and aval_nbytes(aval)
          >= _thresholds.THRESHOLDS.streamed_leaf_min_bytes)


class CannotLoop(Exception):
  """A run that no update loop can make (see `update_loop`). Its reads
  then take whole copies."""


def update_runs(program: Program, liveness: Liveness,
                 on_host: set[int]) -> list[list[int]]:
  """Runs of sliceable equations that read state on host, each closed
  over the sliceable equations that read what it makes, and those whose
  results only it reads; split into runs connected by the values they
  make, each cut where an equation outside it reads what it makes before
  its last equation."""
  n = len(program)
  shapes = {}
  for value in on_host:
    if _streamable(program.avals[value]):
      shapes[value] = tuple(program.avals[value].shape)
  member: dict[int, tuple] = {}  # equation index -> its leaf shape
  work = []
  for value, shape in shapes.items():
    for r in liveness.uses[value]:
      if (r < n and r not in member and reads_on_device(
          program.equations[r], value)
          and is_sliceable(program.equations[r], program, shape)):
        member[r] = shape
        work.append(r)
  while work:
    index = work.pop()
    shape = member[index]
    equation = program.equations[index]
    for out in equation.outputs:  # readers of what it makes
      for r in liveness.uses[out]:
        if r < n and r not in member and is_sliceable(
            program.equations[r], program, shape):
          member[r] = shape
          work.append(r)
    for atom in equation.inputs:  # makers of what only the run reads
      if not isinstance(atom, int) or atom in on_host:
        continue
      maker = liveness.producer[atom]
      if (maker < 0 or maker in member or not is_sliceable(
          program.equations[maker], program, shape)):
        continue
      made = program.equations[maker].outputs
      if all(r in member and member[r] == shape
             for v in made for r in liveness.uses[v]):
        member[maker] = shape
        work.append(maker)
  # Connected by made values.
  runs = connected_groups(
      member, [(index, r) for index in member
               for out in program.equations[index].outputs
               for r in liveness.uses[out]
               if r in member and member[r] == member[index]])
  result = []
  for run in runs:
    while run:
      inside = set(run)
      last = run[-1]
      early = [r for i in run for v in program.equations[i].outputs
               for r in liveness.uses[v] if r not in inside and r < last]
      if not early:
        break
      run = [i for i in run if i < min(early)]
    if run:
      result.append(run)
  return result


def update_loop(program: Program, liveness: Liveness, run: list[int],
                 on_host: set[int], host_outputs: set[int],
                 output_readers: dict, updated: dict[int, int], label,
                 new_id, split_of: dict | None = None
                 ) -> tuple[tuple[Equation, ...], int, int, list[int], int]:
  """The scan equation that runs the equations of `run` one leading slice
  (or chunk of rows, see `_loop_rows`) at a time. State on host is read
  slice by slice from host, an iteration ahead; a state leaf
  whose update (`updated`: input value -> output value) the run makes is
  updated in place, its host buffer carried through the loop and each
  updated slice written over the slice it was read from (the donated
  buffer is the output's: XLA allocates no second one); other updated
  state that is only an output of the step is written slice by slice to
  a new host stack.

  Where the state's leading axis is cut into shards over devices
  (`split_of`: value -> `jlms._sharding.LeadingSplit`), each stack is
  viewed as (shards, rows of a shard, ...), the stacks on the device held
  in the state's shards, and the loop runs over the rows within each
  shard: every device then reads and writes its own shard's rows. Taken
  across the shards' cut, a row lies on one device, and XLA's partitioner
  gathered the whole leaf on every device's host to slice it (on the 70B
  Llama over eight H100s, `f32[128256,8192]` all-gathered in host memory
  each iteration, which XLA's host offloader turns into host compute).

  Returns the loop's equations (those that fetch its first slices, the
  scan, then the reshapes of its buffers and chunked stacks back), the
  bytes it moves to the device and to host, the values it makes on host
  (the caller places their avals there), and the bytes one direction
  moves in the time its copies take (`_serial_bytes`). Raises
  `CannotLoop` where `_loop_rows` finds no rows for the leaf; for a run
  that writes stacks to host when its leaf's axis is longer than
  `_MAX_LOOP_LENGTH` (chunks would be reshaped in host memory); for one
  over shards that makes stacks; and for stacks whose avals show a split
  (explicit mesh axes: such a leaf takes whole copies)."""
  inside = set(run)
  made = {v for i in run for v in program.equations[i].outputs}
  shape = tuple(program.avals[program.equations[run[0]].outputs[0]].shape)
  scalars, device_stacks, host_stacks = [], [], []
  for index in run:
    for atom in program.equations[index].inputs:
      if not isinstance(atom, int) or atom in made:
        continue
      if atom in scalars or atom in device_stacks or atom in host_stacks:
        continue
      if tuple(program.avals[atom].shape) != shape:
        scalars.append(atom)
      elif atom in on_host:
        host_stacks.append(atom)
      else:
        device_stacks.append(atom)
  outputs, host_outs, only_outputs = [], [], set()
  for value in sorted(made):
    readers = [r for r in liveness.uses[value] if r not in inside]
    if not readers:
      continue
    if readers == [len(program)]:
      only_outputs.add(value)
    if readers == [len(program)] and any(
        p in host_outputs for p in output_readers.get(value, ())):
      host_outs.append(value)
    else:
      outputs.append(value)
  # In place: (input, its update) pairs of donated state that the run reads
  # last and makes as nothing but the step's output (on host, or on the
  # device for state that stays there).
  carried = [(h, updated[h]) for h in host_stacks + device_stacks
             if updated.get(h) in only_outputs
             and liveness.uses[h][-1] <= run[-1]]
  carried_outs = {o for _, o in carried}
  streamed_outs = [v for v in host_outs if v not in carried_outs]
  outputs = [v for v in outputs if v not in carried_outs]
  carried_on_device = {h for h, _ in carried if h in device_stacks}
  scanned = [v for v in device_stacks if v not in carried_on_device]
  equations = [program.equations[i] for i in run]
  if any(device_shape(program.avals[v]) != shape
         for v in host_stacks + device_stacks):
    # Explicit mesh axes: the loop is traced without sharding types, and
    # JAX rejects its slices of a split leaf (`ShardingTypeError`); the
    # leaf takes whole copies, as its types say.
    raise CannotLoop
  split = _split(shape, [(split_of or {}).get(v)
                         for v in host_stacks + device_stacks])
  shards = split.shards if split else 1
  # Within a shard (see the docstring): axis 0 counts the shards, axis 1
  # is the one the loop runs over.
  axis = 1 if shards > 1 else 0
  local = (shape[0] // shards, *shape[1:])
  # Chunks of rows keep their axis (single slices drop it). A stack the
  # loop makes on the device (a weight cast for the forward pass) comes out
  # as (chunks, rows, ...), reshaped back whole after the loop; one it
  # writes to host would be reshaped in host memory, so such a run takes
  # one row at a time where its axis allows. Shard by shard, the stacks
  # would come out in the shards' order: such a run makes none. A run
  # that makes a stack on an axis longer than `_MAX_LOOP_LENGTH` takes
  # whole copies, as it did when such axes came in 16 chunks: where the
  # step reads the leaf whole elsewhere too, a loop only adds a crossing
  # (two layers of the 70B Llama over eight H100s: 9389 MiB to the
  # device instead of 8663, 340.4 ms by the schedule model instead of
  # 310.1).
  if shards > 1 and (outputs or streamed_outs):
    raise CannotLoop
  rows = _loop_rows(
      local, max(_row_bytes(program.avals[v])
                 for v in host_stacks + device_stacks),
      chunks=not (streamed_outs or (outputs and local[0] > _MAX_LOOP_LENGTH)))
  if rows is None:
    raise CannotLoop
  length = local[0] // rows
  chunked = rows > 1
  lead = (shards,) if shards > 1 else ()
  slice_shape = (*lead, rows, *shape[1:]) if chunked else (*lead, *shape[1:])

  def as_shards(buffer):
    return jnp.reshape(buffer, (shards, *local)) if shards > 1 else buffer

  def on_device_as_shards(buffer):
    # Each shard kept on its device: XLA's partitioner may have made a
    # gradient split along another axis, and would then move the state on
    # host to match it there (an all-to-all in host memory).
    view = as_shards(buffer)
    if split is not None:
      view = jax.lax.with_sharding_constraint(view, split.view)
    return view

  def whole(buffer):
    return jnp.reshape(buffer, shape) if shards > 1 else buffer

  def read_rows(buffer, index):
    # The axis is kept: before the loop the index is a constant, and XLA's
    # host offloader refuses a host slice reshaped before its copy once
    # SPMD has partitioned it. A single slice drops it where it is read
    # (`as_read`), on the device.
    return jax.lax.dynamic_slice_in_dim(buffer, index * rows, rows, axis)

  def as_read(rows_read):
    return rows_read if chunked else jnp.squeeze(rows_read, axis)

  def write_rows(buffer, value, index):
    return jax.lax.dynamic_update_slice_in_dim(
        buffer, value if chunked else jnp.expand_dims(value, axis),
        index * rows, axis)

  def call(scalar_values, device_values, host_values):
    # Traced on device values: the copies to host made here are cut off
    # below, so that the loop takes the program's host values.
    buffers_of = dict(zip(host_stacks, (
        as_shards(jax.device_put(v, jax.memory.Space.Host))
        for v in host_values)))
    buffers_of.update(zip(device_stacks,
                          map(on_device_as_shards, device_values)))
    read_only = {h: buffers_of[h] for h in host_stacks
                 if h not in dict(carried)}

    host_carried = [k for k, (h, _) in enumerate(carried)
                    if h not in carried_on_device]
    fetched_names = list(read_only) + [carried[k][0] for k in host_carried]

    def slice_in(h, buffer, index):
      # The last iteration fetches its own slice again, and drops it.
      index = jnp.minimum(index, length - 1)
      with jax.named_scope(profile_scope("swap_in", label(h))):
        return jax.device_put(read_rows(buffer, index),
                              jax.memory.Space.Device)

    def slice_out(out, buffer, value, index):
      with jax.named_scope(profile_scope("swap_out", label(out))):
        return write_rows(
            buffer, jax.device_put(value, jax.memory.Space.Host), index)

    def iteration(state, device_slices):
      # The slices of state on host are fetched an iteration ahead. A
      # buffer updated in place gives its next slice and takes its updated
      # one in either order, one after the other; so the buffers are split
      # in two halves that go in opposite orders, and each half's copies in
      # run beside the other half's copies out, on the other engine.
      index, buffers, prefetched = state
      env = dict(zip(scalars, scalar_values))
      if shards > 1:  # sliced here: a scan's slices are of its axis 0
        env.update((v, as_read(read_rows(buffers_of[v], index)))
                   for v in scanned)
      else:
        env.update(zip(scanned, device_slices))
      env.update((h, as_read(fetched))
                 for h, fetched in zip(fetched_names, prefetched))
      for (h, _), buffer in zip(carried, buffers):
        if h in carried_on_device:
          env[h] = as_read(read_rows(buffer, index))
      for equation in equations:
        args = [a.value if isinstance(a, Const) else env[a]
                for a in equation.inputs]
        if _compat.is_scalar_broadcast(equation.eqn):
          results = [_compat.broadcast_scalar(equation.eqn, args[0],
                                              slice_shape)]
        else:
          results = _compat.bind_equation(equation.eqn, args)
        env.update(zip(equation.outputs, results))
      new_buffers = list(buffers)
      for k, ((h, out), buffer) in enumerate(zip(carried, buffers)):
        if h in carried_on_device:
          new_buffers[k] = write_rows(buffer, env[out], index)
      next_of = {h: slice_in(h, buffer, index + 1)
                 for h, buffer in read_only.items()}
      half = (len(host_carried) + 1) // 2
      reads_first, writes_first = host_carried[:half], host_carried[half:]
      for k in reads_first:
        h = carried[k][0]
        next_of[h] = slice_in(h, buffers[k], index + 1)
      for k in writes_first:
        h, out = carried[k]
        new_buffers[k] = slice_out(out, buffers[k], env[out], index)
      for k in reads_first:
        # Written only once its next slice has been read from it.
        h, out = carried[k]
        buffer, next_of[h] = jax.lax.optimization_barrier(
            (buffers[k], next_of[h]))
        new_buffers[k] = slice_out(out, buffer, env[out], index)
      for k in writes_first:
        h = carried[k][0]
        next_of[h] = slice_in(h, new_buffers[k], index + 1)
      ys = [env[v] for v in outputs]
      for value in streamed_outs:
        with jax.named_scope(profile_scope("swap_out", label(value))):
          ys.append(jax.device_put(env[value], jax.memory.Space.Host))
      return (index + 1, new_buffers,
              [next_of[h] for h in fetched_names]), ys

    first = [buffers_of[h] for h, _ in carried]
    first_of = dict(read_only)
    first_of.update((carried[k][0], first[k]) for k in host_carried)
    start = [slice_in(h, first_of[h], jnp.int32(0)) for h in fetched_names]
    # A chunked stack on the device is scanned as (chunks, rows, ...): a
    # reshape XLA makes a bitcast.
    if shards > 1:
      xs = []
    else:
      xs = [jnp.reshape(buffers_of[v], (length, *slice_shape)) if chunked
            else buffers_of[v] for v in scanned]
    (_, buffers, _), ys = jax.lax.scan(
        iteration, (jnp.int32(0), first, start), xs, length=length)
    made = [jnp.reshape(y, shape) if chunked else y
            for y in ys[:len(outputs)]]
    return [whole(b) for b in buffers], made + ys[len(outputs):]

  def device_aval(value):
    aval = program.avals[value]
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype,
                                weak_type=getattr(aval, "weak_type", False))

  traced = jax.make_jaxpr(call)(
      [device_aval(v) for v in scalars],
      [device_aval(v) for v in device_stacks],
      [device_aval(v) for v in host_stacks])
  jaxpr = traced.jaxpr
  n_scalars, n_device = len(scalars), len(device_stacks)
  ids = dict(zip(jaxpr.invars, scalars + device_stacks + host_stacks))
  host_inputs = set(jaxpr.invars[n_scalars + n_device:])
  consts = dict(zip(jaxpr.constvars, traced.consts))
  name_stack = program.equations[run[0]].name_stack

  def atoms(eqn):
    inputs = []
    for var in eqn.invars:
      if isinstance(var, _compat.Literal):
        inputs.append(Const(var.val, literal=var))
      elif var in ids:
        inputs.append(ids[var])
      else:
        inputs.append(Const(consts[var]))
    return tuple(inputs)

  # What `call` returns is the program's: the buffers updated in place,
  # then the stacks it makes (on the device, then host).
  returned = dict(zip(jaxpr.outvars, [o for _, o in carried] + outputs
                      + streamed_outs))
  # The first slices' fetch, the scan, then the reshapes back of the
  # buffers and of chunked stacks.
  loop = []
  for eqn in jaxpr.eqns:
    if _compat.is_device_put(eqn) and eqn.invars[0] in host_inputs:
      ids[eqn.outvars[0]] = ids[eqn.invars[0]]  # cut: the program's host value
      continue
    outs = []
    for var in eqn.outvars:
      ids[var] = returned[var] if var in returned else new_id(var.aval)
      outs.append(ids[var])
    loop.append(Equation(eqn, atoms(eqn), tuple(outs), name_stack))
  if sum(e.eqn.primitive is _compat.scan_p for e in loop) != 1:
    raise AssertionError("an update loop traced no single scan")
  # Each stack on host is read once, plus one slice fetched twice.
  to_device = sum(aval_nbytes(program.avals[v]) for v in host_stacks
                  ) * (length + 1) // length
  to_host = sum(aval_nbytes(program.avals[v]) for v in host_outs)
  in_place = dict(carried)
  return (tuple(loop), to_device, to_host, host_outs, _serial_bytes(
      program, [h for h, _ in carried if h not in carried_on_device],
      [h for h in host_stacks if h not in in_place], streamed_outs,
      length))


def _serial_bytes(program: Program, host_carried, read_only,
                  streamed_outs, length: int) -> int:
  """The bytes one link direction would move in the time the loop's
  copies take: each iteration runs two phases, the first half's fetches
  (and the read-only stacks') beside the second half's write-backs, then
  the first half's write-backs (and the new stacks') beside the second
  half's fetches; each phase takes its larger direction. One leaf updated
  in place has no second half: its fetch and write-back, the same buffer,
  run one after the other (the 8B Llama's update loops of one leaf: 615
  ms each way and twice that exposed); two leaves take the time of one
  direction (two AdamW moments of 0.22 GiB: 8.1 ms exposed of a loop
  moving 0.44 GiB each way, 8.6 ms at 55 GB/s; schedule model). A fetch
  moves its leaf and one slice more (of `length`: the last is fetched
  twice)."""
  def size(value):
    return aval_nbytes(program.avals[value])

  half = (len(host_carried) + 1) // 2  # as `update_loop` splits them
  first = sum(size(h) for h in host_carried[:half])
  second = sum(size(h) for h in host_carried[half:])
  fetched = sum(size(h) for h in read_only)
  written = sum(size(v) for v in streamed_outs)

  def fetch(nbytes):
    return nbytes * (length + 1) // length

  return (max(fetch(fetched + first), second)
          + max(first + written, fetch(second)))
