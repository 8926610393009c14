"""The predicted step time of a flat program and its offloads on a target.

A schedule model in jaxpr order, the order the rewrite's barriers pin down:
kernels run one after another on the compute stream, each for its
`jlms._cost.kernel_seconds`; copies to host and back run on one copy engine
per direction, first come first served, at the target's link bandwidth.
Where the target's `hides_copies` is False (XLA's scheduler as it is, see
`jlms._cost.GpuTarget`), compute waits for each copy as it is made. A
copy to host starts when the kernel that last reads the value near by has
run; the equation that must find its buffer freed (`swap_out_done_before`,
or the next one under `SyncMode.SWAP_OUT`) waits for it. A copy back starts
where its swap-in is issued, not before its copy to host has ended; each read
it serves waits for it. A recomputation runs its kernel where it is issued.
Scan residuals streamed inside loops, and state that an update fused into
a loop fetches ahead and writes behind, move one slice per iteration, each
waited for whole where the target's `loop_slices_hide` is False (a real
GPU, measured). Where it is True (XLA's deviceless schedule), a slice
fetched an iteration ahead, or copied out from the start of the iteration
that reads it (a layer's input), runs beside the loop's own kernels, each
engine apart, and the loop takes the longest of the three; a slice that
the body makes goes out after its last kernel, and the loop waits for it
whole, as it does for state streamed by the update loop.

This is the same kind of model as the yardstick that prices XLA's compiled
schedule (../shared/tools/step_time.py), applied before compiling, so the
planner can weigh a copy against the compute that would hide it.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from jlms import _compat
from jlms._config import SyncMode
from jlms._cost import GpuTarget, recompute_seconds_together
from jlms._liveness import Liveness, aval_nbytes
from jlms._program import Program, donation_pairs


@dataclasses.dataclass(frozen=True)
class StepTime:
  """Predicted seconds of one step, and the bytes it moves over the link."""
  compute_s: float  # the step's own kernels
  recompute_s: float  # kernels re-run to remake values
  exposed_transfer_s: float  # compute waiting for copies, or copies after it
  d2h_bytes: int
  h2d_bytes: int
  link: str
  #: A sharded step, per device (`per_device`): the time its exchanges
  #: with the other GPUs add, and the bytes they move over `interconnect`.
  exposed_collective_s: float = 0.0
  collective_bytes: int = 0
  interconnect: str = ""

  @property
  def total_s(self) -> float:
    return (self.compute_s + self.recompute_s + self.exposed_transfer_s
            + self.exposed_collective_s)

  def describe(self) -> str:
    ms = lambda seconds: f"{seconds * 1e3:.3g}"
    text = f"{ms(self.total_s)} ms (compute {ms(self.compute_s)}"
    if self.recompute_s:
      text += f", recompute {ms(self.recompute_s)}"
    text += f", waiting for copies {ms(self.exposed_transfer_s)}"
    if self.collective_bytes:
      text += (f", waiting for other GPUs {ms(self.exposed_collective_s)}")
    if self.d2h_bytes or self.h2d_bytes:
      text += (f"; {self.d2h_bytes / 2**30:.2f} GiB to host and "
               f"{self.h2d_bytes / 2**30:.2f} GiB back over {self.link}")
    if self.collective_bytes:
      text += (f"; {self.collective_bytes / 2**30:.2f} GiB exchanged over "
               f"{self.interconnect}")
    return text + ")"


def per_device(step_time: StepTime, split: int, exchanged_bytes: int,
               target: GpuTarget) -> StepTime:
  """`step_time`, priced on a sharded step's jaxpr, as one of its devices
  runs the step. Where the jaxpr's values are whole arrays (`AxisType.Auto`
  axes: `split`, `jlms._sharding.unseen_split`, times one device's), each
  device runs a `split`-th of every kernel and copies a `split`-th of the
  host bytes over its own link (a data-parallel or FSDP step splits its
  batch). It also sends and gets `exchanged_bytes` over the GPU
  interconnect (`jlms._collectives`, read from XLA's compiled program), as
  asynchronous collectives that XLA's scheduler runs beside the kernels:
  hidden up to the kernels' time where it overlaps (`target.streams_hide`,
  see `scheduler_overlaps`), waited for whole where it does not."""
  scale = 1.0 / max(split, 1)
  compute = step_time.compute_s * scale
  recompute = step_time.recompute_s * scale
  exposed = step_time.exposed_transfer_s * scale
  exchange = exchanged_bytes / target.interconnect_bytes_per_s
  waited = (max(0.0, exchange - compute - recompute - exposed)
            if target.streams_hide else exchange)
  return dataclasses.replace(
      step_time, compute_s=compute, recompute_s=recompute,
      exposed_transfer_s=exposed, d2h_bytes=int(step_time.d2h_bytes * scale),
      h2d_bytes=int(step_time.h2d_bytes * scale),
      exposed_collective_s=waited, collective_bytes=int(exchanged_bytes),
      interconnect=target.interconnect)


def _kernels_free_to_follow(program: Program, liveness: Liveness,
                            kernel_s: np.ndarray, index: int) -> float:
  """Seconds of the kernels that XLA may run after equation `index`: every
  one it does not read from, whatever their jaxpr order. XLA's scheduler
  orders the program by its dependences, not by the jaxpr, and fills a
  copy's latency with what is free to go there: on the 6.58B GPT with its
  moments on host, the last write-back of the fused update loop hid under
  the tied embedding's weight-gradient matmul (4.4 ms at the roofline),
  which the jaxpr makes before the backward loop and XLA ran after it."""
  ancestors = {index}
  pending = [index]
  while pending:
    for atom in program.equations[pending.pop()].inputs:
      if isinstance(atom, int):
        producer = liveness.producer[atom]
        if producer >= 0 and producer not in ancestors:
          ancestors.add(producer)
          pending.append(producer)
  return float(np.sum(kernel_s)) - float(
      sum(kernel_s[k] for k in ancestors))


def remade_seconds(program: Program, liveness: Liveness, together,
                   target: GpuTarget, memo: dict | None = None) -> float:
  """Seconds of remaking `together` ((chain, value) pairs remade before one
  equation, in the order they were chosen) at once: what their chains
  share runs once. `memo`, a dict kept by the caller, holds each group's
  price across calls on the same program and target."""
  key = tuple(together)
  if not key:
    return 0.0
  cost = None if memo is None else memo.get(key)
  if cost is None:
    cost = sum(recompute_seconds_together(program, liveness, key, target))
    if memo is not None:
      memo[key] = cost
  return cost


def remade_groups_with(groups: dict, offload) -> dict:
  """`groups` (equation -> the recomputations remade before it, in the
  order chosen) with `offload` added last: those of its swap-ins, where it
  is a recomputation."""
  if not offload.is_recompute:
    return groups
  groups = dict(groups)
  for swap_in in offload.swap_ins:
    groups[swap_in.issue_before] = groups.get(swap_in.issue_before, ()) + (
        (offload.recompute, offload.value),)
  return groups


def with_offload_added(step_time: StepTime, program: Program,
                       liveness: Liveness, offload, target: GpuTarget,
                       groups: dict, memo: dict | None = None) -> StepTime:
  """What `predict_step_time` gives for some offloads and `offload` added
  last, from `step_time`, its figure for those offloads (without `walk`),
  and `groups`, their recomputations by place (`remade_groups_with`); on
  a target whose `hides_copies` is False, where each copy is exposed whole
  and a recomputation adds only to its own place's group. In the time of
  the offload's own group, not of every offload chosen: the greedy fit
  prices a few trials a round, thousands of rounds on a deep step."""
  if target.hides_copies:
    raise ValueError("with_offload_added prices steps whose copies are "
                     "exposed whole; a target that hides copies needs "
                     "predict_step_time's walk")
  if offload.is_recompute:
    added = 0.0
    for index, together in remade_groups_with({}, offload).items():
      before = groups.get(index, ())
      added += (remade_seconds(program, liveness, before + together, target,
                               memo)
                - remade_seconds(program, liveness, before, target, memo))
    return dataclasses.replace(step_time,
                               recompute_s=step_time.recompute_s + added)
  size = liveness.nbytes[offload.value]
  ins = len(offload.swap_ins)
  out = int(offload.swap_out_after < len(program))  # as the walk's events
  return dataclasses.replace(
      step_time,
      exposed_transfer_s=(step_time.exposed_transfer_s
                          + target.transfer_seconds(size) * (ins + out)),
      d2h_bytes=step_time.d2h_bytes + size * out,
      h2d_bytes=step_time.h2d_bytes + size * ins)


def predict_step_time(program: Program, liveness: Liveness,
                      kernel_s: np.ndarray, offloads=(), target: GpuTarget
                      = None, sync_mode: SyncMode = SyncMode.SWAP_OUT,
                      residuals=(), state_copies=(), walk: bool = False,
                      remade_memo: dict | None = None) -> StepTime:
  """The `StepTime` of `program` run with `offloads` (and scan `residuals`
  streamed through host, and the `jlms._state.StateCopy`s of state kept on
  host) on `target`. Where the target hides no copy, it is summed copy by
  copy (the same figure, to rounding) unless `walk` asks for the walk over
  every equation. `remade_memo`, a dict kept by the caller, holds the
  price of each group of recomputations made before one equation across
  calls on the same program and target."""
  n = len(program)
  sync_out = bool(sync_mode & SyncMode.SWAP_OUT)
  sync_in = bool(sync_mode & SyncMode.SWAP_IN)
  outs_after = collections.defaultdict(list)
  done_before = collections.defaultdict(list)
  ins_before = collections.defaultdict(list)
  waits = collections.defaultdict(list)
  recomputes = collections.defaultdict(float)
  recompute_total = 0.0
  remade_before = collections.defaultdict(list)
  for offload in offloads:
    for swap_in in offload.swap_ins if offload.is_recompute else ():
      remade_before[swap_in.issue_before].append(
          (offload.recompute, offload.value))
  for index, together in remade_before.items():
    cost = remade_seconds(program, liveness, together, target, remade_memo)
    recomputes[index] += cost
    recompute_total += cost
  for number, offload in enumerate(offloads):
    if offload.is_recompute:
      continue
    outs_after[offload.swap_out_after].append(number)
    wait = offload.swap_out_done_before
    if wait is None and sync_out:
      wait = offload.swap_out_after + 1
    if wait is not None:
      done_before[min(wait, n)].append(number)
    for swap_in in offload.swap_ins:
      key = (number, swap_in.issue_before)
      ins_before[swap_in.issue_before].append((key, liveness.nbytes[
          offload.value]))
      for read in swap_in.reads:
        waits[min(read, n)].append(key)
      if sync_in:
        waits[min(swap_in.issue_before, n)].append(key)

  # Per loop: its slices' seconds beside its iterations, per engine, and
  # the seconds each iteration waits after its kernels.
  beside = collections.defaultdict(lambda: [0.0, 0.0])  # d2h, h2d
  after = collections.defaultdict(float)
  # Under a latency profile, a loop's first fetch and last write-back
  # (seconds each) hide under the kernels before the loop and those free
  # to follow it.
  first_fetch = collections.defaultdict(float)
  last_write = collections.defaultdict(float)
  d2h = h2d = 0
  hides = target.loop_slices_hide
  for residual in residuals:
    size = aval_nbytes(program.avals[residual.value])
    seconds = target.transfer_seconds(size)
    if residual.producer is not None:  # else on host before the step
      if residual.ready_at_iteration_start and hides:
        beside[residual.producer][0] += seconds
      else:
        after[residual.producer] += seconds
      d2h += size
    for reader in residual.readers:
      # Fetched an iteration ahead (`jlms._loops.prefetching_reader`).
      if hides:
        beside[reader][1] += seconds
      else:
        after[reader] += seconds
    h2d += size * len(residual.readers)
  # Whole state copies pinned beside the backward pass: issued where they
  # are, waited for before `wait_before` (`GpuTarget.pinned_copies_hide`).
  state_outs_after = collections.defaultdict(list)
  pinned = target.pinned_copies_hide
  for number, copy in enumerate(state_copies):
    if not (copy.pinned and pinned):
      continue
    key = ("state", number)
    wait = n if copy.wait_before is None else min(copy.wait_before, n)
    d2h += copy.to_host
    h2d += copy.to_device
    if copy.to_device:
      ins_before[copy.index].append((key, copy.to_device))
      waits[wait].append(key)
    if copy.to_host:
      state_outs_after[copy.index].append((key, copy.to_host))
      done_before[wait].append(key)
  for copy in state_copies:
    if copy.pinned and pinned:
      continue
    # Each direction has its engine. What a loop copies beside its own
    # kernels (the update fused into the backward loop,
    # `jlms._update_fusion._beside_kernels`) runs there where the target's
    # `loop_slices_hide` says so (XLA's deviceless schedule; a GPU waits
    # for it); the rest is waited for after them. XLA waits for each slice's copy right after starting
    # it elsewhere, the fetch and the write-back one after the other,
    # except where an update loop runs one leaf's fetch beside another's
    # write-back (`serial_bytes`).
    if copy.to_device_beside or copy.to_host_beside:
      fetched, written = copy.to_device, copy.to_host
      if hides:
        beside[copy.index][0] += target.transfer_seconds(
            copy.to_host_beside)
        beside[copy.index][1] += target.transfer_seconds(
            copy.to_device_beside)
        fetched -= copy.to_device_beside
        written -= copy.to_host_beside
      if target.copies_profiled:
        # The edges leave the loop's waits; the fetches it waits for
        # inside its body stay.
        edge = min(copy.edge_bytes, fetched, written)
        first_fetch[copy.index] += target.transfer_seconds(edge)
        last_write[copy.index] += target.transfer_seconds(edge)
        fetched, written = fetched - edge, written - edge
      after[copy.index] += (target.transfer_seconds(fetched)
                            + target.transfer_seconds(written))
    elif copy.serial_bytes is not None:
      after[copy.index] += target.transfer_seconds(copy.serial_bytes)
    else:
      after[copy.index] += (target.transfer_seconds(copy.to_device)
                            + target.transfer_seconds(copy.to_host))
    d2h += copy.to_host
    h2d += copy.to_device

  kernels_before = None  # compute before each equation, where needed

  def streamed_wait(index: int) -> float:
    """Seconds the loop at `index` runs past its own kernels for the
    slices it moves."""
    if index not in streamed:
      return 0.0
    own = float(kernel_s[index])
    d2h_beside, h2d_beside = beside.get(index, (0.0, 0.0))
    waited = after.get(index, 0.0)
    if index in first_fetch or index in last_write:
      nonlocal kernels_before
      if kernels_before is None:
        kernels_before = np.concatenate([[0.0], np.cumsum(kernel_s)])
      waited += max(0.0, first_fetch[index] - kernels_before[index])
      waited += max(0.0, last_write[index] - _kernels_free_to_follow(
          program, liveness, kernel_s, index))
    if not target.streams_hide:
      return d2h_beside + h2d_beside + waited
    return max(own, d2h_beside, h2d_beside) - own + waited

  streamed = set(beside) | set(after) | set(first_fetch) | set(last_write)

  if not target.hides_copies and not walk and not (
      pinned and any(c.pinned for c in state_copies)):
    # Compute waits for each copy as it is made: every copy is exposed
    # whole, and nothing is left to wait for. Summed event by event, in
    # the order the walk below meets them, in O(copies) instead of
    # O(equations): the greedy fit prices hundreds of trials.
    exposed = 0.0
    events = sorted(set(ins_before) | streamed | set(outs_after))
    for index in events:
      for key, size in ins_before.get(index, ()):
        exposed += target.transfer_seconds(size)
        h2d += size
      if index < n:
        exposed += streamed_wait(index)
        for number in outs_after.get(index, ()):
          size = liveness.nbytes[offloads[number].value]
          exposed += target.transfer_seconds(size)
          d2h += size
    return StepTime(float(np.sum(kernel_s)), recompute_total, exposed,
                    int(d2h), int(h2d), target.link)

  t = 0.0
  exposed = 0.0
  engine = {"d2h": 0.0, "h2d": 0.0}
  out_end: dict[int, float] = {}
  ready: dict = {}
  for index in range(n + 1):
    for key, size in ins_before.get(index, ()):
      state = key[0] == "state"
      start = max(engine["h2d"], t,
                  0.0 if state else out_end.get(key[0], 0.0))
      engine["h2d"] = ready[key] = start + target.transfer_seconds(size)
      if state:
        continue  # counted with the state's copies; waited for at its read
      h2d += size
      if not target.hides_copies:  # compute waits for the whole copy
        exposed += ready[key] - t
        t = ready[key]
    due = [out_end[k] for k in done_before.get(index, ())]
    due += [ready[k] for k in waits.get(index, ())]
    if due and max(due) > t:
      exposed += max(due) - t
      t = max(due)
    if index == n:
      break
    t += recomputes.get(index, 0.0)
    wait = streamed_wait(index)
    exposed += wait
    t += float(kernel_s[index]) + wait
    for number in outs_after.get(index, ()):
      size = liveness.nbytes[offloads[number].value]
      start = max(engine["d2h"], t)
      engine["d2h"] = out_end[number] = start + target.transfer_seconds(size)
      d2h += size
      if not target.hides_copies:  # compute waits for the whole copy
        exposed += out_end[number] - t
        t = out_end[number]
    for key, size in state_outs_after.get(index, ()):
      start = max(engine["d2h"], t)
      engine["d2h"] = out_end[key] = start + target.transfer_seconds(size)
  tail = max(0.0, max(engine.values()) - t)
  t += recomputes.get(n, 0.0)
  return StepTime(float(np.sum(kernel_s)), recompute_total,
                  exposed + tail, int(d2h), int(h2d), target.link)


#: XLA's GPU scheduler: the share of the device's memory it schedules
#: within, and the share of what is left after the program's arguments and
#: outputs that it lets the program hold by default (`GetSchedulerMemoryLimit`
#: in XLA's gpu_hlo_schedule.cc; the device's size cannot be set per
#: compile from JAX; `xla_gpu_memory_limit_slop_factor` scales the rest,
#: and jlms sets it for plans that copy over the link,
#: `scheduler_slop_factor`).
SCHEDULER_DEVICE_SHARE = 0.8
SCHEDULER_SLOP = 0.95


#: The share of what a budget leaves beside a plan's arguments and outputs
#: that XLA's scheduler may hold while it overlaps copies, where jlms sets
#: its limit (`scheduler_slop_factor`): under XLA's 95%, as the
#: scheduler's estimate runs a little under the buffers XLA assigns.
SCHEDULER_BUDGET_SHARE = 0.9


def _held_bytes(program: Program) -> int:
  """Device bytes of `program`'s arguments and outputs as XLA's scheduler
  counts them: a donated input and the output it becomes once."""
  def on_device(atom) -> int:
    if not isinstance(atom, int) or _compat.is_host_aval(program.avals[atom]):
      return 0
    return aval_nbytes(program.avals[atom])
  aliased = {out for _, out in donation_pairs(program)}
  return (sum(on_device(v) for v in program.invars)
          + sum(on_device(v) for p, v in enumerate(program.outvars)
                if p not in aliased))


def scheduler_slop_factor(program: Program, budget_bytes: int | None,
                          device_bytes: int | None,
                          host_temp_bytes: int = 0) -> int | None:
  """XLA's `xla_gpu_memory_limit_slop_factor` (a percentage) that puts
  its scheduler's memory limit for `program`, fitted to `budget_bytes`,
  at `SCHEDULER_BUDGET_SHARE` of what the budget leaves beside the
  program's arguments and outputs, plus the `host_temp_bytes` it holds in
  host memory: the scheduler counts those as it counts device memory.
  XLA's own limit is 95% of what 80% of the device leaves: for the 8B
  Llama on an H100 (55.7 GiB of arguments on the device, 11 GiB of
  activations on host), 7.2 GiB, where its plan holds 16.7 GiB of
  temporaries on the device, so the scheduler runs each copy beside its
  wait, those of the update loops too (2443 ms by the schedule model,
  the same compiled with the factor at 277, which leaves the host's out;
  at 1000, 1799 ms at 78.81 GiB). None where XLA's default gives as
  much, where no factor gives room (the arguments and outputs alone past
  80% of the device: the limit is negative), or where the budget or the
  device is unknown."""
  if budget_bytes is None or device_bytes is None:
    return None
  held = _held_bytes(program)
  room = SCHEDULER_DEVICE_SHARE * device_bytes - held
  if room <= 0 or budget_bytes <= held:
    return None
  wanted = SCHEDULER_BUDGET_SHARE * (budget_bytes - held) + host_temp_bytes
  factor = int(100 * wanted / room)
  return factor if factor > round(100 * SCHEDULER_SLOP) else None


def scheduler_overlaps(program: Program, peak_bytes: int | None,
                       device_bytes: int | None,
                       slop_factor: int | None = None) -> bool:
  """Whether XLA's latency-hiding scheduler will start `program`'s loop
  copies ahead of their waits: only while the program's device peak
  (`peak_bytes`; where None, its arguments and outputs alone) stays under
  the scheduler's memory limit. Its arguments and outputs on the device count
  in full, a donated input and the output it becomes once; past the
  limit, as where they alone pass 80% of the device, the scheduler keeps
  each copy beside its wait (the 6.58B-parameter GPT with 65.6 GiB of
  state on an H100: its layers' inputs stream with every copy exposed,
  1730 ms by the schedule model where they would hide in 1254). Unknown
  where the device's size is (None): taken to overlap. Under a
  `slop_factor` (`scheduler_slop_factor`), the limit is that percentage of
  the room, not XLA's default 95."""
  if device_bytes is None:
    return True
  held = _held_bytes(program)
  room = SCHEDULER_DEVICE_SHARE * device_bytes - held
  peak = held if peak_bytes is None else peak_bytes
  slop = SCHEDULER_SLOP if slop_factor is None else slop_factor / 100
  return room > 0 and peak - held <= slop * room
