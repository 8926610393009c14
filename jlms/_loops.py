"""Residuals that one scan stacks for another, offloaded inside the loops.

Autodiff of `jax.lax.scan` (and of `nn.scan`, `nnx.scan`, and `fori_loop`
with static bounds, which are scans) splits it into a forward scan that
stacks one slice of each residual per iteration, and a backward scan that
reads one slice per iteration, in reverse. The stacks are the whole-model
activations: at the top level they can only be moved to host and brought
back whole, which needs them all on the device at once.

Here a stack goes to host one slice at a time instead: the forward body
copies each slice to pinned host memory as it is made (the stack itself is
allocated in host memory), and the backward body copies the slice it reads
back to the device. With `prefetch` the backward scan fetches the slice
that its next iteration reads while the current one computes, carried
between iterations. Device memory then holds one or two slices of each
residual, however many layers the scan runs.

Two pure steps, as everywhere in jlms: `find_scan_residuals` picks the
stacks (analysis), `offload_scan_residuals` returns a new `Program` whose
scan equations do the copies (rewrite).

Guarantees: the new program computes exactly the same values (the copies
are exact, the prefetched slice is the one the iteration reads); a picked
stack is read by nothing but scans that index it as their scanned input
(`xs`), so no top-level equation ever sees it on host; the program's inputs
and outputs keep their device placement.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jlms import _compat
from jlms._config import OffloadConfig
from jlms._liveness import Liveness
from jlms._names import profile_scope
from jlms._program import Equation, Program
from jlms._retrace import host_aval, traced_call


@dataclasses.dataclass(frozen=True)
class ScanResidual:
  """A stacked output of one scan that later scans read slice by slice."""
  value: int  # the stack's value id
  # Index of the scan equation that stacks it; None for a stack that is on
  # host already (state kept there between steps, `jlms._state`).
  producer: int | None
  readers: tuple[int, ...]  # indices of the scan equations that read it
  label: str = ""  # its name where it has no producer to be named after
  # Whether each slice is there when its iteration starts (the producer's
  # body passes one of its inputs through: a layer's input, its carry):
  # the copy out then runs beside the whole iteration. A slice made by the
  # body is copied after its last kernel, and the iteration waits for it.
  ready_at_iteration_start: bool = False


def _scanned_inputs(equation: Equation) -> range:
  """Positions, among a scan equation's inputs, of its scanned `xs`."""
  layout = _compat.scan_layout(equation.eqn)
  return range(layout.num_consts + layout.num_carry, len(equation.inputs))


def _stacked_outputs(equation: Equation) -> range:
  """Positions, among a scan equation's outputs, of its stacked `ys`."""
  return range(_compat.scan_layout(equation.eqn).num_carry,
               len(equation.outputs))


def _is_scan(equation: Equation) -> bool:
  return equation.primitive is _compat.scan_p


def find_scan_residuals(program: Program, liveness: Liveness,
                        config: OffloadConfig) -> tuple[ScanResidual, ...]:
  """The stacks worth keeping on host: at least `config.min_bytes`, made by
  a scan of two or more iterations, read only as the scanned input of scans
  that start more than `config.swapout_threshold` equations later.

  A one-iteration scan's stack is one slice: streaming it saves nothing
  over moving it whole at the top level, and XLA folds the slicing of a
  one-slice host stack into a bitcast across memory spaces, which it then
  refuses ("Bitcast cannot have different memory spaces")."""
  found = []
  for index, equation in enumerate(program.equations):
    if not _is_scan(equation) or _compat.scan_layout(equation.eqn).length < 2:
      continue
    for position in _stacked_outputs(equation):
      value = equation.outputs[position]
      reads = liveness.uses[value]
      if (liveness.nbytes[value] < config.min_bytes or not reads
          or not _compat.has_plain_layout(program.avals[value])
          or _compat.is_host_aval(program.avals[value])
          or reads[0] - index <= config.swapout_threshold):
        continue
      if all(r < len(program) and reads_only_as_scanned(
          program.equations[r], value) for r in reads):
        found.append(ScanResidual(value, index, reads,
                                  ready_at_iteration_start=_passed_through(
                                      equation, position)))
  return tuple(found)


def _passed_through(equation: Equation, position: int) -> bool:
  """Whether the scan `equation`'s stacked output at `position` is one of
  its body's inputs, passed through unchanged."""
  jaxpr = _compat.scan_layout(equation.eqn).body.jaxpr
  out = jaxpr.outvars[position]
  return isinstance(out, _compat.Var) and out in set(jaxpr.invars)


def reads_only_as_scanned(equation: Equation, value: int) -> bool:
  if not _is_scan(equation):
    return False
  scanned = set(_scanned_inputs(equation))
  positions = [p for p, a in enumerate(equation.inputs) if a == value]
  return all(p in scanned for p in positions)


def offload_scan_residuals(program: Program,
                           residuals: tuple[ScanResidual, ...],
                           prefetch: bool = True) -> Program:
  """`program` with each residual stack allocated in host memory: written
  there slice by slice by its producer, read back slice by slice by its
  readers, each a loop iteration ahead with `prefetch` (see the module
  docstring)."""
  if not residuals:
    return program
  on_host = {r.value for r in residuals}
  avals = list(program.avals)
  for value in on_host:
    avals[value] = _compat.memory_space_aval(avals[value],
                                             jax.memory.Space.Host)
  producers = {r.producer for r in residuals if r.producer is not None}
  readers = {i for r in residuals for i in r.readers}
  equations = list(program.equations)
  # The copies are emitted under "jlms/swap_out/<stack>" and
  # "jlms/swap_in/<stack>", the stack named as the plan names it.
  names = {r.value: r.label if r.producer is None
           else equations[r.producer].readable_name() for r in residuals}
  for index in sorted(producers | readers):
    equation = equations[index]
    eqn = equation.eqn
    if index in producers:
      positions = [p for p in _stacked_outputs(equation)
                   if equation.outputs[p] in on_host]
      eqn = with_host_outputs(eqn, positions, [
          profile_scope("swap_out", names[equation.outputs[p]])
          for p in positions])
    if index in readers:
      positions = [p for p in _scanned_inputs(equation)
                   if equation.inputs[p] in on_host]
      scopes = [profile_scope("swap_in", names[equation.inputs[p]])
                for p in positions]
      if prefetch:
        eqn = prefetching_reader(eqn, positions, scopes)
      else:
        eqn = with_host_inputs(eqn, positions, scopes)
    equations[index] = dataclasses.replace(equation, eqn=eqn)
  return dataclasses.replace(program, equations=tuple(equations),
                             avals=tuple(avals))


def with_host_outputs(eqn, positions: list[int], scopes: list[str]):
  """The scan `eqn` whose body copies its stacked outputs at `positions`
  to host as each iteration makes them, each under its scope."""
  body = _compat.scan_layout(eqn).body
  jaxpr = body.jaxpr
  eqns = list(jaxpr.eqns)
  outvars = list(jaxpr.outvars)
  for position, scope in zip(positions, scopes):
    slice_var = outvars[position]  # a var or a literal: both copy alike
    host_var = _compat.new_var(host_aval(slice_var.aval))
    eqns.append(_compat.device_put_equation(
        slice_var, host_var, True, eqn, scope))
    outvars[position] = host_var
  new_body = _compat.closed_jaxpr(jaxpr.constvars, body.consts,
                                  jaxpr.invars, outvars, eqns,
                                  jaxpr.debug_info)
  new_outvars = list(eqn.outvars)
  for position in positions:
    old = new_outvars[position]
    new_outvars[position] = (
        _compat.new_dropvar(host_aval(old.aval))
        if isinstance(old, _compat.DropVar) else _compat.new_var(host_aval(old.aval)))
  return _compat.with_scan_body(eqn, new_body, outvars=new_outvars)


def with_host_inputs(eqn, positions: list[int], scopes: list[str]):
  """The scan `eqn` whose scanned inputs at `positions` are host stacks:
  its body copies each iteration's slice to the device first, each under
  its scope."""
  body = _compat.scan_layout(eqn).body
  jaxpr = body.jaxpr
  invars = list(jaxpr.invars)
  copies = []
  for position, scope in zip(positions, scopes):
    device_var = invars[position]
    host_var = _compat.new_var(host_aval(device_var.aval))
    invars[position] = host_var
    copies.append(_compat.device_put_equation(
        host_var, device_var, False, eqn, scope))
  new_body = _compat.closed_jaxpr(jaxpr.constvars, body.consts, invars,
                                  jaxpr.outvars, copies + list(jaxpr.eqns),
                                  jaxpr.debug_info)
  new_invars = list(eqn.invars)
  for position in positions:
    new_invars[position] = _compat.new_var(host_aval(new_invars[position].aval))
  return _compat.with_scan_body(eqn, new_body, invars=new_invars)


def prefetching_reader(eqn, positions: list[int], scopes: list[str]):
  """The scan `eqn`, whose scanned inputs at `positions` become host
  stacks, as a call of a new scan that fetches those slices one iteration
  ahead: the slices for iteration `i + 1` are copied to the device while
  iteration `i` computes, carried into the next iteration; each stack's
  fetch runs under its scope.

  The call's body is traced from Python (public `jax.lax.scan`,
  `dynamic_index_in_dim`, `device_put`) rather than assembled by hand; the
  stacks enter it as device values copied to host at its start, and those
  copies are then cut off, so that the call takes the host stacks as its
  inputs.
  """
  layout = _compat.scan_layout(eqn)
  num_consts, num_carry = layout.num_consts, layout.num_carry
  length, reverse, body = layout.length, layout.reverse, layout.body
  host_positions = set(positions)
  scanned = range(num_consts + num_carry, len(eqn.invars))
  others = [p for p in scanned if p not in host_positions]

  def fetch(stacks, iteration):
    index = length - 1 - iteration if reverse else iteration
    index = jnp.clip(index, 0, length - 1)
    fetched = []
    for stack, scope in zip(stacks, scopes):
      with jax.named_scope(scope):
        fetched.append(jax.device_put(
            jax.lax.dynamic_index_in_dim(stack, index, keepdims=False),
            jax.memory.Space.Device))
    return fetched

  def call(*args):
    consts = args[:num_consts]
    carry = list(args[num_consts:num_consts + num_carry])
    stacks = [args[p] for p in positions]

    def iteration(state, other_slices):
      carry, count, fetched = state
      # Behind a barrier the count stays a number of its own: equal to the
      # loop's counter, XLA merges the two and makes the fetch's index in
      # the kernel that advances the counter, which it orders after every
      # read of the old counter, at the body's end: the fetch then has
      # nothing left to hide under (the 16-layer MLP at the least memory:
      # 23.9 ms by the schedule model with the merge, 21.0 without).
      count = jax.lax.optimization_barrier(count)
      slices = dict(zip(positions, fetched))
      slices.update(zip(others, other_slices))
      outs = _compat.eval_jaxpr(body.jaxpr, body.consts, *consts, *carry,
                                *(slices[p] for p in scanned))
      next_state = (outs[:num_carry], count + 1, fetch(stacks, count + 1))
      return next_state, outs[num_carry:]

    start = (carry, jnp.int32(0), fetch(stacks, 0))
    (carry, _, _), ys = jax.lax.scan(
        iteration, start, [args[p] for p in others], length=length,
        reverse=reverse)
    return [*carry, *ys]

  invars = list(eqn.invars)
  for position in positions:
    invars[position] = _compat.new_var(host_aval(invars[position].aval))
  return traced_call(call, [v.aval for v in eqn.invars], positions,
                     "jlms_prefetching_scan", eqn, invars=invars,
                     outvars=list(eqn.outvars))
