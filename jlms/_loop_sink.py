"""Loop inputs that are cheap expansions, made inside the loop instead.

Autodiff of a scan hoists the residuals that do not depend on the
iteration out of the loop (JAX's scan partial evaluation): an attention
mask broadcast to `[batch, heads, seq, seq]`, a fill value broadcast to the
scores' shape. Both the forward and the backward scan then read them as
loop-invariant inputs, and XLA keeps each as a buffer for as long as either
loop runs (a GPT decoder of width 512 at sequence 1024, batch 8: 320 MiB
for a mask and a fill, beside a 2 GiB peak). Made inside the loop body they
cost nothing: XLA fuses a broadcast into the kernel that reads it.

Two pure steps: `loop_sinks` finds the loop inputs made by a short chain of
fusible, pure equations from values `Thresholds.expansion_factor` times smaller
(analysis); `sink_into_loops` returns the new `Program` whose scans take
the small values and run the chain in their body (rewrite). The new scans
are traced from Python with public `jax.lax.scan`, so JAX writes their
parameters, and stay scans that later passes (`jlms._loop_remat`) read.

Guarantees: the new program computes the same values (the chain is the
same equations on the same inputs, run once per iteration instead of once);
every value keeps its id, but for a loop output that the loop traced anew
passes through (an unchanged carry), whose reads read what it passes
through instead; the equations that made the sunk input outside
the loop stay, and are dead where nothing else reads them.
"""

from __future__ import annotations

import dataclasses
import logging

import jax

from jlms import _compat, _rules, _thresholds
from jlms._liveness import Liveness
from jlms._program import Atom, Const, Equation, Program
from jlms._retrace import Retraced, traced_equations

log = logging.getLogger("jlms")

# A loop input is sunk only when the values its chain starts from are at
# least `Thresholds.expansion_factor` times smaller than it (a broadcast,
# an iota, a mask), by a chain of at most `Thresholds.loop_sink_max_chain`
# equations (an iota, a compare, a select and a broadcast make a causal
# mask), from `Thresholds.loop_sink_min_bytes` on (`jlms._thresholds`).


@dataclasses.dataclass(frozen=True)
class LoopSink:
  """One loop-invariant input of a scan, made inside its body instead."""
  loop: int  # equation index of the scan
  position: int  # the input's position among the scan's consts
  value: int  # the input's value id
  chain: tuple[int, ...]  # indices of the equations that make it, in order
  leaves: tuple[int, ...]  # value ids the chain reads from outside itself


def loop_sinks(program: Program, liveness: Liveness,
               min_bytes: int | None = None) -> tuple[LoopSink, ...]:
  """The consts (of at least `min_bytes`) of each scan that a chain of at
  most `loop_sink_max_chain` pure fusible equations makes from values at
  least `expansion_factor` times smaller (`jlms._thresholds`; `min_bytes`
  None: its `loop_sink_min_bytes`)."""
  if min_bytes is None:
    min_bytes = _thresholds.THRESHOLDS.loop_sink_min_bytes
  found = []
  for index, equation in enumerate(program.equations):
    if equation.primitive is not _compat.scan_p:
      continue
    layout = _compat.scan_layout(equation.eqn)
    for position, atom in enumerate(equation.inputs[:layout.num_consts]):
      if isinstance(atom, Const) or liveness.nbytes[atom] < min_bytes:
        continue
      made = _expansion_chain(program, liveness, atom)
      if made is not None:
        chain, leaves = made
        found.append(LoopSink(index, position, atom, chain, leaves))
  return tuple(found)


def _expansion_chain(program: Program, liveness: Liveness, value: int):
  """(chain, leaves) making `value` by pure fusible equations from leaves
  `expansion_factor` times smaller, or None."""
  expansion = _thresholds.THRESHOLDS.expansion_factor
  max_chain = _thresholds.THRESHOLDS.loop_sink_max_chain
  chain: set[int] = set()
  leaves: set[int] = set()
  pending = [value]
  while pending:
    current = pending.pop()
    index = liveness.producer[current]
    if index < 0:
      leaves.add(current)  # a step input
      continue
    if index in chain:
      continue
    small = expansion * liveness.nbytes[current] < liveness.nbytes[value]
    # A small value is made in the loop too where its own making is
    # fusible: a causal mask from its iotas rather than from the
    # [heads, seq, seq] mask autodiff hoisted, which XLA would broadcast
    # over the batch into a buffer of its own every iteration (the
    # Equinox decoder of the benchmarks: 42.6 ms of its 469.3).
    equation = program.equations[index]
    if not (_rules.is_fusible_equation(equation.eqn)
            and _rules.is_recomputable(equation.eqn)
            and len(chain) < max_chain
            # a captured array: the scan would close over it
            and all(not isinstance(a, Const) or a.literal is not None
                    for a in equation.inputs)):
      if small:
        leaves.add(current)
        continue
      return None
    chain.add(index)
    pending.extend(a for a in equation.inputs if not isinstance(a, Const))
  if expansion * sum(liveness.nbytes[v] for v in leaves) > liveness.nbytes[
      value]:
    return None
  return tuple(sorted(chain)), tuple(sorted(leaves))


def sink_into_loops(program: Program, sinks: tuple[LoopSink, ...]
                    ) -> tuple[Program, tuple[LoopSink, ...]]:
  """`program` with each sink's scan making that input in its body, and the
  sinks done. A loop that cannot be rewritten keeps its inputs as they are
  (a debug log line says why); the other loops are rewritten all the
  same."""
  if not sinks:
    return program, ()
  by_loop: dict[int, list[LoopSink]] = {}
  for sink in sinks:
    by_loop.setdefault(sink.loop, []).append(sink)
  equations: list[Equation] = []
  avals = list(program.avals)
  done: list[LoopSink] = []
  # A loop traced anew may pass an output through (JAX forwards a carry
  # the body leaves as it is): later reads of that output read what it
  # passes through instead.
  renamed: dict[int, Atom] = {}

  def read(atom):
    return renamed.get(atom, atom) if isinstance(atom, int) else atom

  for index, equation in enumerate(program.equations):
    if renamed:
      equation = dataclasses.replace(
          equation, inputs=tuple(read(a) for a in equation.inputs))
    chosen = by_loop.get(index)
    if chosen and any(v in renamed for s in chosen for v in s.leaves):
      log.debug("jlms: %s keeps its loop-invariant inputs: they are made "
                "from an output another loop passes through",
                equation.readable_name())
    elif chosen:
      try:
        retraced = _scan_making_inputs(program, equation, chosen, avals)
      except Exception as error:  # noqa: BLE001 -- this loop's choice only
        log.debug("jlms: %s keeps its %d loop-invariant inputs (%s): %s",
                  equation.readable_name(), len(chosen),
                  type(error).__name__, error)
      else:
        equations.extend(retraced.equations)
        avals.extend(retraced.new_avals)
        done.extend(chosen)
        renamed.update((old, new) for old, new in zip(
            equation.outputs, retraced.outputs) if new is not old)
        continue
    equations.append(equation)
  if not done:
    return program, ()
  return dataclasses.replace(
      program, equations=tuple(equations), avals=tuple(avals),
      outvars=tuple(read(a) for a in program.outvars)), tuple(done)


def _make_inputs(program: Program, sinks: list[LoopSink], leaves: list[int],
                 leaf_values) -> list:
  """Each sink's value, made by running its chain (shared equations once)
  on `leaf_values` in the current trace."""
  env = dict(zip(leaves, leaf_values))

  def read(atom):
    return atom.value if isinstance(atom, Const) else env[atom]

  for index in sorted({i for sink in sinks for i in sink.chain}):
    equation = program.equations[index]
    results = _compat.bind_equation(equation.eqn,
                                    [read(a) for a in equation.inputs])
    env.update(zip(equation.outputs, results))
  return [env[sink.value] for sink in sinks]


def _scan_making_inputs(program: Program, scan: Equation,
                        sinks: list[LoopSink], avals) -> Retraced:
  """The equations (a scan, and whatever else JAX traces) that run `scan`
  with the sinks' inputs made in its body, new ids from `len(avals)`."""
  layout = _compat.scan_layout(scan.eqn)
  nc, nk = layout.num_consts, layout.num_carry
  body_jaxpr, body_consts = _compat.jaxpr_parts(layout.body)
  leaves = sorted({v for sink in sinks for v in sink.leaves})
  sunk = {sink.position for sink in sinks}
  kept = [p for p in range(nc) if p not in sunk]
  made_at = {sink.position: k for k, sink in enumerate(sinks)}
  nl, nkept = len(leaves), len(kept)

  def call(*args):
    leaf_values = args[:nl]
    kept_consts = args[nl:nl + nkept]
    carry = list(args[nl + nkept:nl + nkept + nk])
    xs = list(args[nl + nkept + nk:])

    def iteration(carry, x):
      made = _make_inputs(program, sinks, leaves, leaf_values)
      kept_iter = iter(kept_consts)
      consts = [made[made_at[p]] if p in sunk else next(kept_iter)
                for p in range(nc)]
      outs = _compat.eval_jaxpr(body_jaxpr, body_consts, *consts, *carry, *x)
      return outs[:nk], outs[nk:]

    carry_out, ys = jax.lax.scan(iteration, carry, xs, length=layout.length,
                                 reverse=layout.reverse)
    return [*carry_out, *ys]

  inputs = (*leaves, *(scan.inputs[p] for p in kept), *scan.inputs[nc:])
  retraced = traced_equations(call, inputs, avals, scan.name_stack,
                              like=scan.eqn, output_ids=scan.outputs)
  # An output JAX forwarded (an unchanged carry) comes back as the atom it
  # passes through; `sink_into_loops` reads that in its place.
  return retraced
