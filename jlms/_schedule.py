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
Scan residuals streamed inside loops move one slice per iteration beside
the loop's own kernels: the loop takes the longer of the two.

This is the same kind of model as the yardstick that prices XLA's compiled
schedule (../shared/tools/step_time.py), applied before compiling, so the
planner can weigh a copy against the compute that would hide it.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from jlms._config import SyncMode
from jlms._cost import GpuTarget, recompute_seconds_together
from jlms._liveness import Liveness, aval_nbytes
from jlms._program import Program


@dataclasses.dataclass(frozen=True)
class StepTime:
  """Predicted seconds of one step, and the bytes it moves over the link."""
  compute_s: float  # the step's own kernels
  recompute_s: float  # kernels re-run to remake values
  exposed_transfer_s: float  # compute waiting for copies, or copies after it
  d2h_bytes: int
  h2d_bytes: int
  link: str

  @property
  def total_s(self) -> float:
    return self.compute_s + self.recompute_s + self.exposed_transfer_s

  def describe(self) -> str:
    ms = lambda seconds: f"{seconds * 1e3:.3g}"
    text = f"{ms(self.total_s)} ms (compute {ms(self.compute_s)}"
    if self.recompute_s:
      text += f", recompute {ms(self.recompute_s)}"
    text += f", waiting for copies {ms(self.exposed_transfer_s)}"
    if self.d2h_bytes or self.h2d_bytes:
      text += (f"; {self.d2h_bytes / 2**30:.2f} GiB to host and "
               f"{self.h2d_bytes / 2**30:.2f} GiB back over {self.link}")
    return text + ")"


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
    key = tuple(together)
    cost = None if remade_memo is None else remade_memo.get(key)
    if cost is None:
      cost = sum(recompute_seconds_together(program, liveness, together,
                                            target))
      if remade_memo is not None:
        remade_memo[key] = cost
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

  streamed = collections.defaultdict(float)  # loop index -> copy seconds
  d2h = h2d = 0
  for residual in residuals:
    size = aval_nbytes(program.avals[residual.value])
    if residual.producer is not None:  # else on host before the step
      streamed[residual.producer] += target.transfer_seconds(size)
      d2h += size
    for reader in residual.readers:
      streamed[reader] += target.transfer_seconds(size)
    h2d += size * len(residual.readers)
  for copy in state_copies:
    # Each direction has its engine: the slower one is what the loop (or
    # the copy of a whole leaf) waits for.
    streamed[copy.index] += max(target.transfer_seconds(copy.to_device),
                                target.transfer_seconds(copy.to_host))
    d2h += copy.to_host
    h2d += copy.to_device

  if not target.hides_copies and not walk:
    # Compute waits for each copy as it is made: every copy is exposed
    # whole, and nothing is left to wait for. Summed event by event, in
    # the order the walk below meets them, in O(copies) instead of
    # O(equations): the greedy fit prices hundreds of trials.
    exposed = 0.0
    events = sorted(set(ins_before) | set(streamed) | set(outs_after))
    for index in events:
      for key, size in ins_before.get(index, ()):
        exposed += target.transfer_seconds(size)
        h2d += size
      if index < n:
        exposed += streamed.get(index, 0.0)
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
      start = max(engine["h2d"], t, out_end.get(key[0], 0.0))
      engine["h2d"] = ready[key] = start + target.transfer_seconds(size)
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
    own = float(kernel_s[index])
    copies = streamed.get(index, 0.0)
    if not target.hides_copies:  # each iteration waits for its slices
      exposed += copies
      t += own + copies
    else:
      if copies > own:  # the loop waits for its slices
        exposed += copies - own
      t += max(own, copies)
    for number in outs_after.get(index, ()):
      size = liveness.nbytes[offloads[number].value]
      start = max(engine["d2h"], t)
      engine["d2h"] = out_end[number] = start + target.transfer_seconds(size)
      d2h += size
      if not target.hides_copies:  # compute waits for the whole copy
        exposed += out_end[number] - t
        t = out_end[number]
  tail = max(0.0, max(engine.values()) - t)
  t += recomputes.get(n, 0.0)
  return StepTime(float(np.sum(kernel_s)), recompute_total,
                  exposed + tail, int(d2h), int(h2d), target.link)
