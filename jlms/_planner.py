"""Choosing what to offload: a pure function of a program, its liveness and the knobs.

Guarantees, for every `Offload` returned:
- the value is made by an equation of the program (never a program input,
  which the caller keeps alive anyway), has a plain memory layout (no PRNG keys or tokens), lives in device
  memory and is at least `min_bytes` large;
- `swap_out_after` is the read right before the first gap longer than
  `swapout_threshold` (or the producer, if that gap starts there);
- every later read belongs to exactly one `SwapIn`, whose `issue_before` lies
  strictly after `swap_out_after` and at or before its first read; it is
  never placed between an equation and the re-layout (transpose, reshape,
  ...) of its output that follows, which XLA folds into the equation only if
  nothing else, such as the swap-in's barrier, reads the equation's output.
"""

from __future__ import annotations

import dataclasses

from jlms import _compat, _rules
from jlms._config import OffloadConfig
from jlms._liveness import Liveness, is_expansion
from jlms._program import Program


@dataclasses.dataclass(frozen=True)
class SwapIn:
  issue_before: int  # the copy to device is emitted right before this equation
  reads: tuple[int, ...]  # the equations served by this device copy


@dataclasses.dataclass(frozen=True)
class Offload:
  """A value that leaves the device after its read `swap_out_after` and is
  back for each `SwapIn`: copied to host and back, or, when `recompute`
  names its producing equations, made again from values that are on the
  device then anyway."""
  value: int
  swap_out_after: int
  swap_ins: tuple[SwapIn, ...]
  # The equation before which the copy to host must have finished, so that
  # the device buffer is free there; None: the next one (`SyncMode.SWAP_OUT`)
  # or none at all (`SyncMode.NONE`), as the config says.
  swap_out_done_before: int | None = None
  # Equation indices, in program order, re-emitted before each swap-in
  # instead of a copy back; () for a transfer.
  recompute: tuple[int, ...] = ()

  @property
  def is_recompute(self) -> bool:
    return bool(self.recompute)


def is_offloadable(aval) -> bool:
  dtype = getattr(aval, "dtype", None)
  if dtype is None or _compat.is_extended_dtype(dtype):
    return False
  space = getattr(aval, "memory_space", None)
  # Values the program itself already placed on host are left alone.
  return space is None or "host" not in str(space).lower()


def plan_offloads(program: Program, liveness: Liveness,
                  config: OffloadConfig,
                  materialized=None) -> tuple[Offload, ...]:
  """The offloads `config` asks for. `materialized` (per value id, from
  `jlms._simulator.analyse_fusion`) leaves out broadcasts that XLA fuses
  into their readers: they have no buffer to free, and a copy to host
  would create one, of a value recomputed from a far smaller one."""
  offloads = []
  for value in candidates(program, liveness, config.min_bytes, materialized):
    offload = _plan_value(value, liveness.producer[value],
                          liveness.uses[value], config)
    if offload is not None:
      offloads.append(_before_relayouts(program, offload))
  return tuple(offloads)


def candidates(program: Program, liveness: Liveness, min_bytes: int,
               materialized=None) -> list[int]:
  """The values `plan_offloads` may move, whatever their reads."""
  return [value for value, nbytes in enumerate(liveness.nbytes)
          if nbytes >= min_bytes and liveness.producer[value] >= 0
          and is_offloadable(program.avals[value])
          and not (materialized is not None and not materialized[value]
                   and is_expansion(program, liveness, value))]


def _before_relayouts(program: Program, offload: Offload) -> Offload:
  """Issue a swap-in one equation earlier when the equation it would follow
  has its output re-laid-out next: the swap-in's barrier would read that
  output and stop XLA folding the re-layout into it."""
  swap_ins = []
  for swap_in in offload.swap_ins:
    at = swap_in.issue_before
    if (offload.swap_out_after + 1 < at < len(program)
        and _rules.rule(program.equations[at].primitive).relayout_only
        and set(program.equations[at].inputs)
        & set(program.equations[at - 1].outputs)):
      swap_in = dataclasses.replace(swap_in, issue_before=at - 1)
    swap_ins.append(swap_in)
  return dataclasses.replace(offload, swap_ins=tuple(swap_ins))


def _plan_value(value: int, producer: int, reads: tuple[int, ...],
                config: OffloadConfig) -> Offload | None:
  previous = producer
  first_far = None
  for position, read in enumerate(reads):
    if read - previous > config.swapout_threshold:
      first_far = position
      break
    previous = read
  if first_far is None:
    return None
  swap_out_after = previous
  groups: list[list[int]] = []
  for read in reads[first_far:]:
    if groups and read - groups[-1][-1] <= config.groupby:
      groups[-1].append(read)
    else:
      groups.append([read])
  swap_ins = tuple(
      SwapIn(issue_before=max(group[0] - config.prefetch_ahead,
                              swap_out_after + 1),
             reads=tuple(group))
      for group in groups)
  return Offload(value, swap_out_after, swap_ins)


def chain_inputs(program: Program, chain: tuple[int, ...]) -> set[int]:
  """The values the equations `chain` read that they do not make."""
  made = {out for i in chain for out in program.equations[i].outputs}
  return {atom for i in chain for atom in program.equations[i].inputs
          if isinstance(atom, int) and atom not in made}


def kernel_facts(program: Program, chain: tuple[int, ...]
                 ) -> tuple[frozenset, bool]:
  """What `shared_kernels` groups a chain by: the values it reads that it
  does not make, and whether it is elementwise (no contraction)."""
  return (frozenset(chain_inputs(program, chain)),
          not any(_rules.flops(program.equations[i].eqn)
                  for i in chain))


def joins_kernel(first: tuple[frozenset, bool],
                 second: tuple[frozenset, bool]) -> bool:
  """Whether `shared_kernels` of two chains with these `kernel_facts`
  groups them as one kernel, the first's: both elementwise, and the second
  reads something, all of it read by the first."""
  (first_reads, first_elementwise), (reads, elementwise) = first, second
  return (first_elementwise and elementwise and bool(reads)
          and reads <= first_reads)


def shared_kernels(program: Program,
                   chains: list[tuple[int, ...]]) -> list[list[int]]:
  """Groups of `chains` (equation indices of recomputations remade before
  one equation) that XLA can make in one kernel, as positions in `chains`,
  the kernel's own chain first: an elementwise chain joins the first
  elementwise chain, of those that read the most, that reads all its
  inputs (a relu's mask joins its relu: both read the BatchNorm output).
  Every other chain is a group of its own. `jlms._rewrite` emits each group
  behind one barrier of its own; the time model prices a joining chain at
  the writing of its value."""
  read = [chain_inputs(program, chain) for chain in chains]
  elementwise = [not any(_rules.flops(program.equations[i].eqn)
                         for i in chain) for chain in chains]
  groups: list[list[int]] = []
  for k in sorted(range(len(chains)), key=lambda k: -len(read[k])):
    kernel = next((g for g in groups if elementwise[g[0]] and elementwise[k]
                   and read[k] and read[k] <= read[g[0]]), None)
    if kernel is None:
      groups.append([k])
    else:
      kernel.append(k)
  return groups
