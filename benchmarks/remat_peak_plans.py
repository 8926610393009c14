"""What plans that keep and remake reach on issue 13's 16-block ResNet
(256x256, batch 8, Adam) at per-layer remat's XLA peak, against the bound
the issue sets there: half of remat's extra time over jax.jit, by the
schedule model of XLA's compiled program (`../shared/tools/step_time.py`).

`python -m benchmarks.remat_peak_plans [--keep-last 1 2 3] [--json PATH]`

It prints, for the H100 (deviceless):

- **The count floor.** The backward pass reads four activations of each
  block whole (a convolution or a BatchNorm reduction reads them): the
  block's input, both convolution outputs and the first relu's output. The
  budget, less the step's arguments and outputs, holds so many of them at
  the end of the forward pass; every other one is made again, at least one
  write and one read of it at the yardstick's HBM rate. A plan that made
  every relu mask inside the reductions that read it would save at most
  writing each mask once and reading it twice. The floor is that count's
  time less that saving: what a plan with no waste at all would cost.
- **jlms's plan** at that budget, compiled.
- **Plans of the other kind, built by hand**: every block's input kept and,
  in each block but the last `keep_last` ones, the first convolution's
  output, the relu output and its mask and the second convolution's output
  remade from it where the backward pass first reads the second one; in
  those last blocks the second convolution's output is kept and the rest
  remade where the relu output is first read. This is what the floor's
  count suggests (a block input costs three reads and writes to remake,
  the others two). It is handed to jlms's own rewrite and compile in place
  of the fit's choice (`jlms._search.Fitter` is swapped for the length of the
  call), so XLA compiles it exactly as it compiles any plan.

Results: `benchmarks/results/remat_peak_plans_h100.json`.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import time

import jax

import jlms
from jlms import _fit
from jlms import _search
from benchmarks import frontier, frontier_cases
from benchmarks._output import write_json

TARGET = frontier.TARGET
_BLOCK = re.compile(r"/block(\d+)/(Conv_0/conv_general_dilated|"
                    r"Conv_1/conv_general_dilated|relu/max|gt)$")


def block_values(problem: _fit._Problem) -> dict[int, dict[str, int]]:
  """Forward-pass values of each residual block, by role: "conv1" and
  "conv2" (the convolutions' outputs), "relu" (the first relu's output),
  "mask" (its mask), "output" (the second relu's output, where a later
  block reads it) and "input" (the previous block's output, or the stem's
  for block 0)."""
  program, liveness = problem.program, problem.liveness
  blocks: dict[int, dict[str, int]] = {}
  stem = None
  for value in sorted(problem.candidates(), key=liveness.producer.__getitem__):
    name = program.equations[liveness.producer[value]].readable_name()
    if name.endswith("(backward)") or problem.gap(value) is None:
      continue
    if name.endswith("/stem/add"):
      stem = value
    found = _BLOCK.search(name)
    if found is None:
      continue
    roles = blocks.setdefault(int(found[1]), {})
    # A block's first relu is its inner one, the second its output; its
    # first mask is the inner relu's.
    role = {"Conv_0": "conv1", "Conv_1": "conv2", "relu": "relu",
            "gt": "mask"}[found[2].split("/")[0]]
    if role == "relu" and "relu" in roles:
      role = "output"
    roles.setdefault(role, value)
  for index in sorted(blocks):
    previous = blocks.get(index - 1)
    blocks[index]["input"] = stem if previous is None else previous["output"]
  return blocks


def hand_built(problem: _fit._Problem, keep_last: int) -> list:
  """The offloads of the plan of the module docstring."""
  blocks = block_values(problem)
  back: dict[int, _fit._Back] = {}
  offloads = []
  last = max(blocks)
  for index in sorted(blocks):
    roles = blocks[index]
    remade = ["conv1", "relu", "mask"]
    if index <= last - keep_last:
      remade.append("conv2")
      place = problem.gap(roles["conv2"])[1]
    else:
      place = problem.gap(roles["relu"])[1]
    for role in remade:  # in the order each is made from the one before
      value = roles[role]
      near = problem.gap(value)[0]
      option = problem.recompute(value, near, place, back)
      if option is None:
        raise RuntimeError(f"block {index}: its {role} cannot be remade")
      offloads.append(option.offload)  # remade at `place`, for its reads
      back[value] = _fit._Back(place)
  return offloads


@contextlib.contextmanager
def fit_replaced_by(choose):
  """jlms's fit, for the length of the block, returns `choose(problem)`'s
  offloads instead of its own, priced as the fit prices its own."""
  real = _search.Fitter

  class Chosen(_fit.Fitter):
    def continues_to(self, budget_bytes):
      return False

    def fit(self, budget_bytes):
      started = time.perf_counter()
      fusion, residuals, state_copies = self._arguments
      if fusion is None:
        fusion = _fit.analyse_fusion(self.program, self.liveness)
      problem = _fit._Problem(self.program, self.liveness, fusion,
                              self.target, self.min_bytes, residuals,
                              state_copies)
      offloads = tuple(choose(problem))
      return _fit.Fit(offloads, problem.simulate(offloads),
                      problem.simulate(()), problem.step_time(offloads),
                      problem.step_time(()), budget_bytes,
                      time.perf_counter() - started)

  _search.Fitter = Chosen
  try:
    yield
  finally:
    _search.Fitter = real


def _compiled(step, args, yardstick) -> dict:
  memory = jlms.xla_memory(step, *args, target=TARGET)
  times = yardstick.estimate(memory.hlo_text)
  plan = step.plan(*args)
  return {"peak_bytes": memory.peak_bytes,
          "total_ms": round(float(times["total_ms"]), 3),
          "predicted_ms": round(plan.step_time.total_s * 1e3, 3),
          "recomputed": len(plan.recomputed)}


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--keep-last", type=int, nargs="+", default=[1, 2, 3])
  parser.add_argument("--json", default=None)
  options = parser.parse_args(argv)
  yardstick = frontier.load_yardstick()
  if yardstick is None:
    raise SystemExit(f"the schedule model is not at {frontier.YARDSTICK_PATH}: "
                     "this benchmark reports nothing without it")
  case = frontier_cases.resnet()
  args = case.abstract_args()
  jit = jlms.xla_memory(jax.jit(case.step), *args, target=TARGET)
  remat = jlms.xla_memory(jax.jit(frontier_cases.resnet(remat=True).step),
                          *args, target=TARGET)
  jit_ms = float(yardstick.estimate(jit.hlo_text)["total_ms"])
  remat_ms = float(yardstick.estimate(remat.hlo_text)["total_ms"])
  budget = remat.peak_bytes
  bound_ms = jit_ms + (remat_ms - jit_ms) / 2

  step = jlms.offload(case.step, budget=budget, target=TARGET)
  result_plans = {"jlms": _compiled(step, args, yardstick)}
  seen = {}
  for keep_last in options.keep_last:
    label = f"every block input kept, last {keep_last} conv2 kept"

    def choose(problem, keep_last=keep_last):
      seen["problem"] = problem
      return hand_built(problem, keep_last)
    with fit_replaced_by(choose):
      # Any budget below jax.jit's peak: the plan is compiled as it is,
      # and its peak compared with remat's below.
      built = jlms.offload(case.step, budget=jit.peak_bytes - 1,
                           target=TARGET)
      result_plans[label] = _compiled(built, args, yardstick)

  # The floor, from the step's own values and XLA's figures.
  problem = seen["problem"]
  blocks = block_values(problem)
  activation = problem.liveness.nbytes[blocks[0]["conv1"]]
  mask = problem.liveness.nbytes[blocks[0]["mask"]]
  read_whole = 4 * len(blocks)
  fixed = jit.argument_bytes + jit.output_bytes - jit.alias_bytes
  slots = (budget - fixed) // activation
  remade = read_whole - slots
  per_remake_ms = 2 * activation / yardstick.HBM_BW * 1e3
  mask_saving_ms = len(blocks) * 3 * mask / yardstick.HBM_BW * 1e3
  floor_ms = remade * per_remake_ms - mask_saving_ms
  result = {
      "step": case.name, "target": TARGET, "jax": jax.__version__,
      "budget_bytes": budget, "jit_ms": round(jit_ms, 3),
      "remat_ms": round(remat_ms, 3), "bound_ms": round(bound_ms, 3),
      "floor": {"read_whole": read_whole, "held": int(slots),
                "remade_at_least": int(remade),
                "per_remake_ms": round(per_remake_ms, 4),
                "mask_saving_ms": round(mask_saving_ms, 3),
                "extra_ms": round(floor_ms, 3),
                "allowed_extra_ms": round(bound_ms - jit_ms, 3)},
      "plans": result_plans,
  }
  print(f"{case.name} on {TARGET} at remat's XLA peak "
        f"({budget / 2**30:.2f} GiB), schedule model of XLA's program:")
  print(f"  jax.jit {jit_ms:.2f} ms, remat {remat_ms:.2f} ms, bound "
        f"{bound_ms:.2f} ms ({bound_ms - jit_ms:.2f} ms over jax.jit)")
  floor = result["floor"]
  print(f"  floor: {read_whole} activations read whole, {slots} held, "
        f"{remade} remade at {per_remake_ms * 1e3:.1f} us each, less "
        f"{mask_saving_ms:.2f} ms of masks: {floor_ms:.2f} ms over jax.jit "
        f"(allowed {floor['allowed_extra_ms']:.2f})")
  print(f"  {'plan':46s} {'XLA peak':>9s} {'schedule':>9s} {'over jit':>9s}"
        f" {'jlms model':>10s}")
  for label, row in result["plans"].items():
    row["fits"] = row["peak_bytes"] <= budget
    print(f"  {label:46s} {row['peak_bytes'] / 2**30:8.2f}G "
          f"{row['total_ms']:8.2f}ms {row['total_ms'] - jit_ms:8.2f}ms "
          f"{row['predicted_ms']:9.1f}ms"
          + ("" if row["fits"] else "  (over the budget)"))
  write_json(options.json, result)
  return result


if __name__ == "__main__":
  main()
