"""The rewrite: a flat program plus its offloads, as a new closed jaxpr.

`rewrite` copies the program's equations in order (nested jits already
inlined) and inserts, where the offloads say:
- a swap-out: `device_put(x, Space.Host)` right after the value's last near
  read, followed by an `optimization_barrier` on the host copy (XLA deletes a
  bare device-host-device round trip). With `SyncMode.SWAP_OUT` the barrier
  also carries the next equation's inputs, so that equation waits for the
  copy and the device buffer is free before anything new is allocated;
- with `swap_out_done_before`, the host copy's barrier carries that later
  equation's inputs instead: compute hides the copy until there, and the
  device buffer is free from there on;
- a recomputation: the offload's equations re-emitted right before
  `issue_before`, reading their inputs through a barrier with the previous
  equation's outputs (and every reader of an earlier swap-in or
  recomputation), so that XLA can neither hoist nor merge them;
- a swap-in: `device_put(h, Space.Device)` right before `issue_before`. Its
  host operand first goes through a barrier with the outputs of the previous
  equation and of the latest equation that read a swapped-in value: the copy
  cannot start earlier, and the reads of offloaded values form a chain XLA's
  scheduler cannot pull apart (it otherwise hoists copies and sinks weight
  gradient matmuls, keeping every prefetched value resident). With
  `SyncMode.SWAP_IN` the equation it is issued before waits for it.

Serialized equations (`jlms._serialize`) are chained: each one's inputs go
through a barrier with the outputs of the serialized equation before it,
and later reads of those outputs go through it too (XLA prunes barrier
operands nobody reads, and the order with them), so XLA cannot start one
before the previous has run.

Every equation the rewrite adds is named for profiles: copies and
recomputations under "jlms/swap_out/<value>", "jlms/swap_in/<value>" and
"jlms/recompute/<value>" (the value as the plan names it, see
`jlms._names.profile_scope`), barriers under the same scope when they carry
one value's copies, else "jlms/<kind>". XLA's op names are "jit(<step>)/"
and that scope.

Equations are built directly rather than re-traced: re-binding every
primitive costs as much as tracing the step again, and tracing
`jlms.offload(step)` must stay within twice the cost of tracing `step`.

Guarantees: the jaxpr computes the program's values exactly (host copies are
exact, barriers are identities, recomputations are the same pure equations
on the same values); every read after a swap-out reads a copy brought back
or remade by its `SwapIn`; inputs and outputs match the program's.
"""

from __future__ import annotations

import bisect
from collections import defaultdict

import jax

from jlms import _compat, _rules
from jlms._config import OffloadConfig, SyncMode
from jlms._names import made_in_backward, profile_scope
from jlms._planner import Offload, shared_kernels
from jlms._program import Const, Program
from jlms._segment_remat import REMAKING_SCOPE
from jlms._update_order import update_tail


def _tieable(atom) -> bool:
  """Whether `atom` can ride along in an optimization barrier."""
  if not isinstance(atom, _compat.Var) or isinstance(atom, _compat.DropVar):
    return False
  dtype = getattr(atom.aval, "dtype", None)
  return dtype is not None and not _compat.is_extended_dtype(dtype)


def rewrite(program: Program, offloads: tuple[Offload, ...],
            config: OffloadConfig, debug_info=None, transfers: bool = True,
            fusion=None, serialized: frozenset = frozenset(),
            pin_contractions: bool = False, pin_updates: bool = False,
            pin_before: tuple[int, ...] = (), shardings=None):
  """The closed jaxpr of `program` with `offloads` applied.

  `shardings` maps a copied value to the sharding it crosses the link in
  (`jlms._sharding.link_shardings`): it is constrained to it before its
  copy to host, so that each device copies its own shard of it, not a
  whole array XLA's partitioner chose to hold (and comes back so).

  `fusion` (from `jlms._simulator.analyse_fusion`, with the offloaded values
  forced to buffers) tells which equations XLA runs in place and which
  values it fuses away: a swap-out's barrier waits for the first equation
  that runs in place, so that the copy to host cannot drift to where a fused
  equation's work really happens, and no barrier reads a fused-away value
  (which would give it a buffer, such as a broadcast zero the size of an
  attention matrix).

  With `pin_contractions`, every matmul and convolution whose outputs are
  first read after the next swap-in or recomputation must also have run
  before it: XLA's scheduler otherwise leaves weight-gradient contractions
  to the end of the step, and each holds its operands (a cotangent, an
  activation) alive until then, which a plan made in jaxpr order does not
  expect. With `pin_updates` too, so must the equations of the
  optimizer's update that write the new parameters and moments
  (`jlms._update_order` places them where the gradients are made).
  `pin_before` names more such places: equations of the program's own
  (a remaking's barrier, `jlms._segment_remat`), whose inputs then wait
  for those contractions.

  With `transfers=False` the same barriers are emitted but the values stay
  on the device: the schedule's constraints without the copies, which is
  how the benchmarks price the barriers alone.
  """
  swap_out_after = defaultdict(list)
  swap_in_before = defaultdict(list)
  recompute_before = defaultdict(list)
  swapped_out_at = {}
  done_before = {}  # value -> equation that waits for its copy to host
  for offload in offloads:
    swapped_out_at[offload.value] = offload.swap_out_after
    if offload.is_recompute:
      for swap_in in offload.swap_ins:
        recompute_before[swap_in.issue_before].append(offload)
      continue
    swap_out_after[offload.swap_out_after].append(offload.value)
    if offload.swap_out_done_before is not None:
      done_before[offload.value] = offload.swap_out_done_before
    for swap_in in offload.swap_ins:
      swap_in_before[swap_in.issue_before].append(offload.value)

  # Each copy and recomputation is emitted under "jlms/<kind>/<value>",
  # the value named as the plan names it: a profile then shows what jlms
  # issued and what it carries. So are barriers, which XLA's compiled
  # copies can take their names from (it drops a copy's own).
  scope = _scopes(program, offloads)
  invars = [_compat.new_var(program.avals[i]) for i in program.invars]
  env: dict[int, object] = dict(zip(program.invars, invars))
  constvars, consts = [], []
  const_vars: dict[int, object] = {}
  eqns: list = []

  def read(atom):
    if not isinstance(atom, Const):
      return env[atom]
    if atom.literal is not None:
      return atom.literal
    var = const_vars.get(id(atom))
    if var is None:
      var = const_vars[id(atom)] = _compat.new_var(
          _compat.abstractify(atom.value))
      constvars.append(var)
      consts.append(atom.value)
    return var

  def barrier(carried: list, dependencies: list, anchor, name) -> list:
    """Barrier `carried` together with `dependencies`; returns the new
    carried vars and the new dependency vars."""
    ins = carried + dependencies
    outs = [_compat.new_var(v.aval) for v in ins]
    eqns.append(_compat.barrier_equation(ins, outs, anchor, name))
    return outs[:len(carried)], outs[len(carried):]

  executes_at = None if fusion is None else fusion.executes_at
  postponable = (_postponable_contractions(
      program, sorted(set(swap_in_before) | set(recompute_before)
                      | set(pin_before)),
      pin_updates) if pin_contractions else frozenset())
  pin_before = frozenset(pin_before) if pin_contractions else frozenset()

  def has_buffer(value: int) -> bool:
    return fusion is None or bool(fusion.materialized[value])

  def tie_to_inputs(carried: list, atoms, anchor, name) -> list:
    """Barrier `carried` with the values of `atoms`; later reads of those
    atoms go through the barrier, so they wait for `carried`."""
    ids = [a for a in dict.fromkeys(a for a in atoms if isinstance(a, int))
           if a in env and _tieable(env[a]) and has_buffer(a)]
    carried_out, tied = barrier(carried, [env[a] for a in ids], anchor, name)
    env.update(zip(ids, tied))
    return carried_out

  host: dict[int, object] = {}
  pending_host: list[int] = []  # swapped out, barrier not yet emitted
  previous_outputs: list = []
  # Outputs of every equation that read a swapped-in value since the last
  # swap-in: the next swap-in waits for all of them, so no such reader (a
  # weight-gradient matmul, typically) can be postponed to the end of the step
  # while holding its swapped-in operand.
  offloaded_reader_outputs: list = []
  serial_outputs: list[int] = []  # of the latest serialized equation
  sync_out = bool(config.sync_mode & SyncMode.SWAP_OUT)
  sync_in = bool(config.sync_mode & SyncMode.SWAP_IN)
  end = len(program)
  anchor = program.equations[0].eqn if end else None

  def recompute(together, anchor) -> None:
    """Re-emit the chains of the recomputations `together` (all remade
    before one equation) as one: each equation once, from the current vars
    of their inputs, which first go through one barrier with the latest
    equation's outputs. XLA can neither hoist the recomputation nor merge
    it with the first; values remade from the same inputs share that
    barrier's outputs, so XLA can make them in one kernel (a relu and its
    mask from one BatchNorm output) instead of reading the inputs twice."""
    nonlocal offloaded_reader_outputs
    values = [offload.value for offload in together]
    # Each equation is named after the first value whose chain it is in.
    owner = {}
    for offload in together:
      for i in offload.recompute:
        owner.setdefault(i, offload.value)
    stacks = {value: _compat.scope_name_stack(scope("recompute", value))
              for value in values}
    chain = [program.equations[i] for i in sorted(owner)]
    made = {out for eq in chain for out in eq.outputs}
    leaves = [a for a in dict.fromkeys(
        a for eq in chain for a in eq.inputs if isinstance(a, int))
              if a not in made and _tieable(env[a])]
    if any(has_buffer(a) for a in leaves):
      # A fused-away input (a broadcast zero) is made inside the chain's
      # kernels; through the barrier it would be a buffer of its own.
      leaves = [a for a in leaves if has_buffer(a)]
    # As for a swap-in: every reader of a value brought back earlier must
    # have run, or XLA postpones them (weight gradients) to the step's end,
    # each holding what it reads.
    dependencies = [a for a in dict.fromkeys(
        live(previous_outputs + offloaded_reader_outputs)) if a not in leaves]
    offloaded_reader_outputs = []
    tied = tie_to_inputs([env[a] for a in leaves], dependencies, anchor,
                         scope("recompute", *values))
    local = dict(zip(leaves, tied))
    for index, eq in zip(sorted(owner), chain):
      outvars = []
      for out_id, old in zip(eq.outputs, eq.eqn.outvars):
        var = _compat.new_var(program.avals[out_id])
        local[out_id] = var
        outvars.append(var)
      eqns.append(_compat.rebuilt_equation(
          eq.eqn, [local[a] if a in local else read(a) for a in eq.inputs],
          outvars, stacks[owner[index]]))
    for value in values:
      env[value] = local[value]

  def constrained(value: int, var, anchor, name):
    """`var` (a copy of `value`) in the sharding `value` crosses the link
    in, where `shardings` names one."""
    sharding = (shardings or {}).get(value)
    if sharding is None:
      return var
    out = _compat.new_var(var.aval)
    eqns.append(_compat.sharding_constraint_equation(var, out, sharding,
                                                     anchor, name))
    return out

  def live(ids):
    # Ids whose current var may be read again: not stale device copies of
    # swapped-out values (reading one would keep it alive).
    return [a for a in ids if isinstance(a, int)
            and swapped_out_at.get(a, end) >= current[0]]

  current = [0]
  for index in range(end + 1):
    current[0] = index
    equation = program.equations[index] if index < end else None
    if equation is not None:
      anchor = equation.eqn
    incoming = swap_in_before.get(index, ())

    # Copies to host due here: those of the previous equation, or those
    # whose plan names this equation as the first that must find their
    # device buffers freed (compute hid the copy until then).
    due = [v for v in pending_host if done_before.get(v, index) <= index]
    if due:
      next_inputs = [] if equation is None else [
          a for a in live(equation.inputs)
          if _tieable(env[a]) and has_buffer(a)]
      # An equation XLA fuses into a far reader runs there, not here: tying
      # the copy to its inputs would let XLA start the copy that late.
      runs_here = executes_at is None or equation is None or (
          executes_at[index] == index)
      waiting = (not next_inputs or not runs_here) and (
          equation is not None and not set(incoming) & set(due))
      timed = any(v in done_before for v in due)
      if not ((sync_out or timed) and waiting):
        # Without sync (or with nothing to wait) the barrier holds the host
        # copy alone, which is what keeps XLA from deleting the round trip.
        tied = tie_to_inputs([host[v] for v in due],
                             next_inputs if sync_out or timed else (),
                             anchor, scope("swap_out", *due))
        host.update(zip(due, tied))
        pending_host = [v for v in pending_host if v not in due]

    if incoming:
      # The dependencies' later reads go through the barrier too: XLA prunes
      # barrier operands whose results nobody reads, and the order with them.
      dependencies = live(previous_outputs + offloaded_reader_outputs)
      ready = tie_to_inputs([host[v] for v in incoming], dependencies,
                            anchor, scope("swap_in", *incoming))
      offloaded_reader_outputs = []
      for value, on_host in zip(incoming, ready):
        on_device = on_host
        if transfers:
          on_device = _compat.new_var(program.avals[value])
          eqns.append(_compat.device_put_equation(
              on_host, on_device, False, anchor, scope("swap_in", value)))
        env[value] = on_device
      if sync_in and equation is not None:
        tied = tie_to_inputs([env[v] for v in incoming], equation.inputs,
                             anchor, scope("swap_in", *incoming))
        env.update(zip(incoming, tied))

    # Remade in program order, so that one remade value read by another's
    # recomputation is the new copy, not the original it replaces; chains
    # that share a kernel (`shared_kernels`) together, behind one barrier.
    # Others keep a barrier each: behind one, XLA may make them all at once
    # and hold what each makes (2 GiB more on the 1024x1024 ResNet).
    remade = recompute_before.get(index, [])
    groups = [[remade[k] for k in group] for group in shared_kernels(
        program, [offload.recompute for offload in remade])]
    for group in sorted(groups, key=lambda g: max(
        i for offload in g for i in offload.recompute)):
      recompute(group, anchor)

    if equation is None:
      break
    if index in pin_before and offloaded_reader_outputs:
      # As before a swap-in: a contraction XLA would postpone past here
      # (a weight gradient, split K ways, whose partial sums it would hold
      # to the loop body's end) runs first.
      pending = [a for a in dict.fromkeys(live(offloaded_reader_outputs))
                 if _tieable(env[a]) and has_buffer(a)]
      if pending:
        env.update(zip(pending, tie_to_inputs(
            [env[a] for a in pending], equation.inputs, anchor,
            REMAKING_SCOPE)))
      offloaded_reader_outputs = []
    if index in serialized:
      previous = [a for a in live(serial_outputs) if _tieable(env[a])]
      if previous:
        chained = tie_to_inputs([env[a] for a in previous], equation.inputs,
                                anchor, "jlms/serialize")
        env.update(zip(previous, chained))
    outvars = []
    for out_id, old in zip(equation.outputs, equation.eqn.outvars):
      if isinstance(old, _compat.DropVar):
        outvars.append(_compat.new_dropvar(old.aval))
      else:
        outvars.append(_compat.new_var(program.avals[out_id]))
        env[out_id] = outvars[-1]
    eqns.append(_compat.rebuilt_equation(
        equation.eqn, [read(a) for a in equation.inputs], outvars,
        equation.name_stack))
    # The latest buffers made: a fused-away result would get a buffer
    # only because a barrier reads it.
    made = [o for o in equation.outputs if has_buffer(o)]
    if made:
      previous_outputs = made
      if index in serialized:
        serial_outputs = made
    reads_offloaded = any(isinstance(a, int) and swapped_out_at.get(a, end)
                          < index for a in equation.inputs) or (
                              index in postponable)
    # A re-layout of a reader's output stands in for it: XLA folds the two
    # together only if the barrier reads the re-laid-out value, not both.
    relayed = [a for a in equation.inputs if a in offloaded_reader_outputs]
    if _rules.rule(equation.primitive).relayout_only and relayed:
      offloaded_reader_outputs = [a for a in offloaded_reader_outputs
                                  if a not in relayed]
      reads_offloaded = True
    if reads_offloaded:
      offloaded_reader_outputs.extend(equation.outputs)

    for value in swap_out_after.get(index, ()):
      on_device = on_host = env[value]
      if transfers:
        on_device = constrained(value, on_device, equation.eqn,
                                scope("swap_out", value))
        on_host = _compat.new_var(_compat.memory_space_aval(
            on_device.aval, jax.memory.Space.Host))
        eqns.append(_compat.device_put_equation(
            on_device, on_host, True, equation.eqn,
            scope("swap_out", value)))
      host[value] = on_host
      pending_host.append(value)

  outvars = [read(a) for a in program.outvars]
  return _compat.closed_jaxpr(constvars, consts, invars, outvars, eqns,
                              debug_info)


def _postponable_contractions(program: Program, barriers,
                              updates: bool = False) -> frozenset:
  """The matmuls and convolutions that XLA's scheduler may run after the
  next swap-in or recomputation: those whose outputs are first needed at
  or after it (a weight gradient, read by the optimizer's update,
  perhaps through a transpose), and the reductions of the forward pass
  that only the step's outputs need (its loss); with `updates`, also the
  equations of the update that write the step's outputs
  (`jlms._update_order`), which XLA would otherwise leave to the end of
  the step, each holding a gradient.
  A contraction read sooner (a forward or input-gradient one, whose
  activation the next equations read) runs before that barrier anyway;
  tying its output to the barrier would only route all its later reads
  through it, which stops XLA from fusing them with, or sharing them
  between, the kernels around them (a relu mask that jax.jit makes once in
  the forward pass is then made again in the backward)."""
  # needed[v]: the first equation that needs `v`, seeing through
  # re-layouts (a weight gradient's transpose to its parameter's layout
  # waits with it) and the update (which only the step's outputs need).
  n = len(program)
  tail = update_tail(program)
  outputs = {a for a in program.outvars if isinstance(a, int)}
  readers: dict[int, list[int]] = {}
  for index, equation in enumerate(program.equations):
    for atom in dict.fromkeys(a for a in equation.inputs
                              if isinstance(a, int)):
      readers.setdefault(atom, []).append(index)
  needed: dict[int, int] = {}
  for index in range(n - 1, -1, -1):
    for out in program.equations[index].outputs:
      first = n
      for reader in readers.get(out, ()):
        equation = program.equations[reader]
        if reader in tail or _rules.rule(equation.primitive).relayout_only:
          first = min([first] + [needed.get(o, n) for o in equation.outputs])
        else:
          first = min(first, reader)
      needed[out] = first
  # for_outputs[v]: only the step's outputs need `v`, through whatever
  # reads it (a loss's sum, divided by the token count).
  for_outputs: dict[int, bool] = {}
  for index in range(n - 1, -1, -1):
    for out in program.equations[index].outputs:
      for_outputs[out] = all(
          for_outputs.get(o, True)
          for reader in readers.get(out, ())
          for o in program.equations[reader].outputs)
  postponable = set()
  for index, equation in enumerate(program.equations):
    # (Not the loss: a scalar holds nothing worth a barrier.)
    writes_output = updates and index in tail and any(
        o in outputs and program.avals[o].shape for o in equation.outputs)
    # A reduction only the step's outputs need (the loss): XLA runs it
    # last, holding what it reads (the logits, 1 GiB a device for a
    # Llama's 128256-word vocabulary) through the whole backward pass.
    # Not a gradient's reduction (a bias's, a BatchNorm scale's): the
    # update needs it where it runs, and pinned it held the 16-block
    # ResNet at remat's peak to 26.885 ms by the schedule model instead of
    # 26.565, at the same peak.
    loss_like = (_rules.rule(equation.primitive).reduces
                 and not made_in_backward(str(equation.name_stack))
                 and all(for_outputs[out] for out in equation.outputs))
    if not (_rules.flops(equation.eqn) or writes_output or loss_like):
      continue
    following = bisect.bisect_right(barriers, index)
    if following == len(barriers):
      continue  # no barrier after it to run before
    if loss_like or all(needed[out] >= barriers[following]
                        for out in equation.outputs):
      postponable.add(index)
  return frozenset(postponable)


def _scopes(program: Program, offloads: tuple[Offload, ...]):
  """`scope(kind, *values)`: "jlms/<kind>/<name>" when the offloaded
  `values` have one name (`jlms._names.profile_scope`), else
  "jlms/<kind>"."""
  offloaded = {o.value for o in offloads}
  names = {out: equation.readable_name() for equation in program.equations
           for out in equation.outputs if out in offloaded}

  def scope(kind: str, *values: int) -> str:
    named = {names.get(v, "") for v in values}
    return profile_scope(kind, named.pop() if len(named) == 1 else "")

  return scope
