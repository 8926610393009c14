"""Re-emitting a flat program with its offloads, in the current trace.

`emit` interprets a `Program` equation by equation, binding each primitive on
traced values, and inserts at the points an offload plan names:
- a swap-out: `jax.device_put(x, Space.Host)` right after the value's last
  near read, wrapped in an `optimization_barrier` (XLA deletes a bare
  device-host-device round trip); with `SyncMode.SWAP_OUT` that barrier also
  carries the next equation's inputs, so the next equation waits for the copy;
- a swap-in: `jax.device_put(h, Space.Device)` before `issue_before`. Its host
  operand passes through a barrier together with the outputs of the previous
  equation and of the latest equation that read a swapped-in value, so the
  copy cannot start earlier (XLA's scheduler would otherwise hoist it and the
  value would be resident again); with `SyncMode.SWAP_IN` the equation it is
  issued before waits for it.

Guarantees: the values computed are those of the program (a copy to host and
back is exact, a barrier is an identity); every read after a swap-out uses a
copy brought back by its `SwapIn`.
"""

from __future__ import annotations

from collections import defaultdict

import jax

from jlms import _compat
from jlms._config import OffloadConfig, SyncMode
from jlms._planner import Offload
from jlms._program import Const, Program


def _tieable(x) -> bool:
  if not isinstance(x, jax.core.Tracer):
    return False
  dtype = getattr(x, "dtype", None)
  return dtype is not None and not _compat.is_extended_dtype(dtype)


def _unique_tieable(values) -> list:
  seen, out = set(), []
  for x in values:
    if _tieable(x) and id(x) not in seen:
      seen.add(id(x))
      out.append(x)
  return out


def emit(program: Program, offloads: tuple[Offload, ...],
         config: OffloadConfig, args) -> list:
  """Runs `program` on `args` (tracers of the current trace) with `offloads`."""
  swap_out_after = defaultdict(list)
  swap_in_before = defaultdict(list)
  swapped_out_at = {}
  for offload in offloads:
    swap_out_after[offload.swap_out_after].append(offload.value)
    swapped_out_at[offload.value] = offload.swap_out_after
    for swap_in in offload.swap_ins:
      swap_in_before[swap_in.issue_before].append(offload.value)

  env: dict[int, object] = dict(zip(program.invars, args))
  outer_stack = _compat.current_name_stack()

  def read(atom):
    return atom.value if isinstance(atom, Const) else env[atom]

  def tie(carried: list, atoms) -> list:
    """Barrier `carried` together with the values of `atoms`: returns the
    carried values, and makes later reads of `atoms` go through the barrier."""
    ids = [a for a in dict.fromkeys(a for a in atoms if isinstance(a, int))
           if _tieable(env[a])]
    tied = jax.lax.optimization_barrier((carried, [env[a] for a in ids]))
    for atom, value in zip(ids, tied[1]):
      env[atom] = value
    return list(tied[0])

  host: dict[int, object] = {}
  pending_host: list[int] = []  # swapped out, barrier not yet emitted
  previous_outputs: list = []
  last_offloaded_reader_outputs: list = []
  sync_out = bool(config.sync_mode & SyncMode.SWAP_OUT)
  sync_in = bool(config.sync_mode & SyncMode.SWAP_IN)
  end = len(program)

  for index in range(end + 1):
    equation = program.equations[index] if index < end else None
    if pending_host:
      next_inputs = ()
      if sync_out and equation is not None:
        next_inputs = [a for a in equation.inputs
                       if isinstance(a, int) and a not in swapped_out_at]
      with jax.named_scope("jlms_swap_out"):
        tied = tie([host[v] for v in pending_host], next_inputs)
      host.update(zip(pending_host, tied))
      pending_host = []

    incoming = swap_in_before.get(index, ())
    if incoming:
      dependencies = _unique_tieable(
          previous_outputs + last_offloaded_reader_outputs)
      with jax.named_scope("jlms_swap_in"):
        ready, _ = jax.lax.optimization_barrier(
            ([host[v] for v in incoming], dependencies))
        for value, on_host in zip(incoming, ready):
          env[value] = jax.device_put(on_host, jax.memory.Space.Device)
        if sync_in and equation is not None:
          tied = tie([env[v] for v in incoming], equation.inputs)
          env.update(zip(incoming, tied))

    if equation is None:
      break
    outputs = _compat.bind_equation(
        equation.eqn, [read(a) for a in equation.inputs],
        outer_stack + equation.name_stack)
    for out_id, out in zip(equation.outputs, outputs):
      env[out_id] = out
    previous_outputs = list(outputs)
    if any(isinstance(a, int) and swapped_out_at.get(a, end) < index
           for a in equation.inputs):
      last_offloaded_reader_outputs = list(outputs)

    for value in swap_out_after.get(index, ()):
      with jax.named_scope("jlms_swap_out"):
        host[value] = jax.device_put(env[value], jax.memory.Space.Host)
      pending_host.append(value)

  return [read(a) for a in program.outvars]
