"""Scan residuals recomputed inside the loop that reads them.

Autodiff of a scan (`jax.lax.scan`, `nn.scan`, `nnx.scan`, a `fori_loop`
with static bounds) gives a forward scan that stacks, per iteration, the
residuals the backward scan reads back one slice per iteration. Here the
forward scan stacks its iteration's carry instead (for a stack of layers:
each layer's input), and the backward scan runs the forward body again on
that slice, the same consts and the same scanned inputs, to remake the
residual slices it reads: what `jax.checkpoint` with `nothing_saveable`
does for one layer, chosen per scan pair by `jlms._fit`'s time model.

Two pure steps: `loop_rematerializations` finds the (forward, backward)
pairs and what moves (analysis); `rematerialize_in_loops` returns the new
`Program` (rewrite). The new loops are traced from Python with public
`jax.lax.scan` inside a nested `jax.jit`, so JAX writes their parameters.

Guarantees: the new program computes the same values (the backward body
remakes each residual slice from exactly the inputs the forward body made
it from); the residuals leave the program, and a stack of each carry takes
their place; every other value keeps its id.
"""

from __future__ import annotations

import dataclasses

import jax

from jlms import _compat
from jlms._liveness import Liveness
from jlms._loops import find_scan_residuals
from jlms._names import profile_scope
from jlms._config import OffloadConfig
from jlms._cost import kernel_seconds
from jlms._program import Equation, Program, flatten
from jlms._retrace import atom_aval, traced_call


@dataclasses.dataclass(frozen=True)
class LoopRemat:
  """A forward scan whose residuals one backward scan remakes."""
  forward: int  # equation index of the forward scan
  backward: int  # equation index of the backward scan
  residuals: tuple[int, ...]  # value ids of the stacks remade


def loop_rematerializations(program: Program, liveness: Liveness,
                            min_bytes: int = 0,
                            target=None) -> tuple[LoopRemat, ...]:
  """The scan pairs whose residual stacks (of at least `min_bytes`) only one
  later scan reads, slice by slice, with the same length; each pair's
  residuals in order of the time it takes to remake a byte of them on
  `target` (a `jlms._cost.GpuTarget`; None: in program order)."""
  found = find_scan_residuals(program, liveness, OffloadConfig(
      min_bytes=max(min_bytes, 1), swapout_threshold=0))
  pairs: dict[tuple[int, int], list[int]] = {}
  for residual in found:
    if len(residual.readers) != 1:
      continue
    forward = program.equations[residual.producer]
    backward = program.equations[residual.readers[0]]
    if forward.eqn.effects or backward.eqn.effects:
      continue
    if (_compat.scan_layout(forward.eqn).length
        != _compat.scan_layout(backward.eqn).length):
      continue
    key = (residual.producer, residual.readers[0])
    pairs.setdefault(key, []).append(residual.value)
  found = []
  for (f, b), values in sorted(_disjoint(pairs, liveness).items()):
    if target is not None:
      values = sorted(values, key=lambda v: _remake_seconds(
          program.equations[f], v, target) / max(liveness.nbytes[v], 1))
    found.append(LoopRemat(f, b, tuple(values)))
  return tuple(found)


def _disjoint(pairs: dict, liveness: Liveness) -> dict:
  """`pairs` with no scan in two of them, the larger residuals first. A
  forward scan's stacks may have two scans reading them slice by slice:
  its backward scan (activations) and the next forward scan of the same
  layers (BatchNorm statistics stacked by layer, carried from one
  microbatch of a Python accumulation loop to the next). Each pair
  rewrites both its scans, so a scan in two pairs would be rewritten
  twice, the second rewrite undoing the first."""
  def residual_bytes(item):
    return sum(liveness.nbytes[v] for v in item[1])

  kept, used = {}, set()
  for (f, b), values in sorted(pairs.items(), key=residual_bytes,
                               reverse=True):
    if f not in used and b not in used:
      kept[f, b] = values
      used.update((f, b))
  return kept


def cheapest(choices: tuple[LoopRemat, ...], fraction: float
             ) -> tuple[LoopRemat, ...]:
  """Each choice with only the cheapest `fraction` of its residuals (at
  least one), in the order `loop_rematerializations` gives them."""
  return tuple(dataclasses.replace(
      c, residuals=c.residuals[:max(1, round(fraction * len(c.residuals)))])
               for c in choices)


def _remake_seconds(forward: Equation, value: int, target) -> float:
  """Seconds, per iteration, to remake one residual slice from the layer's
  inputs: the forward body pruned to that output, priced on `target`."""
  layout = _compat.scan_layout(forward.eqn)
  position = forward.outputs.index(value)
  body = _compat.pruned_jaxpr(layout.body, [position])
  return float(kernel_seconds(flatten(body), target).sum())


def rematerialize_in_loops(program: Program,
                           choices: tuple[LoopRemat, ...]) -> Program:
  """`program` with each choice's residuals remade by its backward scan."""
  if not choices:
    return program
  avals = list(program.avals)
  equations = list(program.equations)
  for choice in choices:
    forward = program.equations[choice.forward]
    backward = program.equations[choice.backward]
    new_forward, carries = _forward_stacking_carries(forward, choice, avals)
    equations[choice.forward] = new_forward
    equations[choice.backward] = _backward_remaking(backward, forward, choice,
                                                    carries, avals)
  return dataclasses.replace(program, equations=tuple(equations),
                             avals=tuple(avals))


def _forward_stacking_carries(forward: Equation, choice: LoopRemat, avals):
  """The forward scan without the chosen stacks, stacking its carries."""
  layout = _compat.scan_layout(forward.eqn)
  nc, nk = layout.num_consts, layout.num_carry
  body_jaxpr, body_consts = _compat.jaxpr_parts(layout.body)
  dropped = {forward.outputs.index(v) - nk for v in choice.residuals}
  kept = [p for p in range(len(forward.outputs) - nk) if p not in dropped]

  def call(*args):
    consts, carry, xs = args[:nc], list(args[nc:nc + nk]), list(args[nc + nk:])

    def iteration(carry, x):
      outs = _compat.eval_jaxpr(body_jaxpr, body_consts, *consts, *carry, *x)
      ys = outs[nk:]
      return outs[:nk], ([ys[p] for p in kept], list(carry))

    carry_out, (ys, stacked) = jax.lax.scan(
        iteration, carry, xs, length=layout.length, reverse=layout.reverse)
    return [*carry_out, *ys, *stacked]

  eqn = traced_call(call, [atom_aval(a, avals) for a in forward.inputs],
                    (), "jlms_forward_stacking_carries", forward.eqn)
  carries = []
  for var in eqn.outvars[nk + len(kept):]:
    avals.append(var.aval)
    carries.append(len(avals) - 1)
  outputs = (*forward.outputs[:nk], *(forward.outputs[nk + p] for p in kept),
             *carries)
  return dataclasses.replace(forward, eqn=eqn, outputs=outputs), carries


def _backward_remaking(backward: Equation, forward: Equation,
                       choice: LoopRemat, carries: list[int], avals):
  """The backward scan reading carry stacks and remaking the residuals."""
  f_layout = _compat.scan_layout(forward.eqn)
  b_layout = _compat.scan_layout(backward.eqn)
  b_body, b_body_consts = _compat.jaxpr_parts(b_layout.body)
  fnc, fnk = f_layout.num_consts, f_layout.num_carry
  bnc, bnk = b_layout.num_consts, b_layout.num_carry
  f_consts = list(forward.inputs[:fnc])
  f_xs = list(forward.inputs[fnc + fnk:])
  b_consts = list(backward.inputs[:bnc])
  b_carry = list(backward.inputs[bnc:bnc + bnk])
  b_xs = list(backward.inputs[bnc + bnk:])
  # Where each of the backward scan's xs comes from: a residual (its index
  # among the forward body's ys) or one of its own other inputs.
  remade = {v: forward.outputs.index(v) - fnk for v in choice.residuals}
  sources = [("remade", remade[a]) if a in remade else ("own", a)
             for a in b_xs]
  others = [a for kind, a in sources if kind == "own"]
  # Only what makes the remade slices runs again, not the whole layer.
  wanted = sorted(set(remade.values()))
  remake_body, remake_consts = _compat.jaxpr_parts(_compat.pruned_jaxpr(
      f_layout.body, [fnk + index for index in wanted]))
  n_fc, n_bc, n_k = len(f_consts), len(b_consts), len(b_carry)
  scope = profile_scope("recompute", forward.readable_name())
  n_o, n_s = len(others), len(carries)

  def call(*args):
    b_consts_in = args[:n_bc]
    f_consts_in = args[n_bc:n_bc + n_fc]
    carry = list(args[n_bc + n_fc:n_bc + n_fc + n_k])
    scanned = list(args[n_bc + n_fc + n_k:])
    own_xs, stacks, f_xs_in = (scanned[:n_o], scanned[n_o:n_o + n_s],
                               scanned[n_o + n_s:])

    def iteration(carry, slices):
      own, carry_slices, f_x = slices
      # Named so that a profile shows the remaking as jlms's recomputation.
      with jax.named_scope(scope):
        made = dict(zip(wanted, _compat.eval_jaxpr(
            remake_body, remake_consts, *f_consts_in, *carry_slices, *f_x)))
      own_iter = iter(own)
      xs = [made[index] if kind == "remade" else next(own_iter)
            for kind, index in sources]
      outs = _compat.eval_jaxpr(b_body, b_body_consts, *b_consts_in, *carry,
                                *xs)
      return outs[:bnk], outs[bnk:]

    carry_out, ys = jax.lax.scan(iteration, carry, (own_xs, stacks, f_xs_in),
                                 length=b_layout.length,
                                 reverse=b_layout.reverse)
    return [*carry_out, *ys]

  inputs = (*b_consts, *f_consts, *b_carry, *others, *carries, *f_xs)
  eqn = traced_call(call, [atom_aval(a, avals) for a in inputs], (),
                    "jlms_backward_remaking_residuals", backward.eqn)
  return dataclasses.replace(backward, eqn=eqn, inputs=tuple(inputs))
