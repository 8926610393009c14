"""The largest GPT decoder whose train step fits an 80 GiB H100, three ways.

    JAX_PLATFORMS=cpu python -m benchmarks.largest_gpt
        [--sweeps depth-f32 depth-bf16 width-f32 llama-depth] [--json PATH]
        [--resume]

The model is `frontier_cases.gpt(compute_dtype=..., layers=L, width=W,
heads=W // 128, seq=1024, batch=8, vocab=32768)`: AdamW, parameters and
optimizer state float32. Its arguments are placed on an H100's compile-only
device (`jlms.target_devices("h100")`), so that jlms infers the target and
the device budget. A size fits

- `jax.jit(step, donate_argnums=(0, 1))` when XLA's peak for the H100
  (`jlms.xla_memory`) is at most 79.1 GiB;
- jlms with activations only, `jlms.offload(step, donate_argnums=(0, 1),
  state_on_host=False)`, and jlms with the state on host where needed (the
  default `state_on_host=None`), when `step.plan(*args)` returns (a
  `jlms.BudgetError` means it does not fit; the state on host is also
  bounded by XLA's pinned host pool, 64 GB unless
  `XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB` says otherwise) and the plan's XLA
  peak is at most 79.1 GiB.

Sweeps, each a search per way: the size doubles from a start (4 layers, or
width 512, for jax.jit; the previous way's largest fitting size for the
next) until a size does not fit, halving instead when the start does not
fit, then bisects between the largest fitting and the smallest failing
size, down to one layer or 512 of width.

- `depth-f32`: layers at width 4096 (32 heads), float32 compute;
- `depth-bf16`: the same with bfloat16 compute;
- `width-f32`: width (a multiple of 512, heads = width // 128) at 32
  layers, float32 compute;
- `llama-depth`: layers of Hugging Face `transformers`' Flax Llama at
  Llama-3-8B's widths, float32 parameters and bfloat16 compute, batch 1 x
  sequence 4096, AdamW, the state donated
  (`benchmarks.llama_finetune.llama_step`); its jlms ways plan with a 120
  GiB host budget.

For the largest fitting size of each way the table gives its parameters,
XLA's peak, the state the plan keeps on host and the predicted step time
(`plan.step_time`; for jax.jit the plan's `baseline_step_time` from a jlms
plan of the same size), the next size, which did not fit, and the first
size tried that did not fit. The JSON (by default
`benchmarks/results/largest_gpt_h100.json`) holds every probe and is
rewritten after each (every sweep under its own key, so sweeps may run in
separate processes), so partial results are kept.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import dataclasses
import fcntl
import json
import pathlib
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp

import jlms
from benchmarks import frontier_cases, llama_finetune
from benchmarks.models import GIB
from benchmarks.sharded import on_one_device
from benchmarks.state_on_host import DONATED, TARGET, _first_line, measure

LIMIT_BYTES = int(79.1 * GIB)
SEQ, BATCH, VOCAB, HEAD_DIM = 1024, 8, 32768, 128

_REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_JSON = _REPO_ROOT / "benchmarks" / "results" / f"largest_gpt_{TARGET}.json"

JIT = "jax.jit"
ACTIVATIONS = "jlms, activations only"
STATE_ON_HOST = "jlms, state on host"
WAYS = (JIT, ACTIVATIONS, STATE_ON_HOST)

# name: (what varies, its start for jax.jit, its resolution, compute dtype,
# the model's other size, the model).
SWEEPS = {
    "depth-f32": ("layers", 4, 1, jnp.float32, {"width": 4096}, "gpt"),
    "depth-bf16": ("layers", 4, 1, jnp.bfloat16, {"width": 4096}, "gpt"),
    "width-f32": ("width", 512, 512, jnp.float32, {"layers": 32}, "gpt"),
    "llama-depth": ("layers", 4, 1, jnp.bfloat16, {"width": 4096}, "llama"),
}

#: The host budget of the Llama sweep: issue 39's 120 GiB of pinned memory
#: for the 8B's state on a 128 GiB machine.
LLAMA_HOST_BUDGET = "120GiB"


@dataclasses.dataclass(frozen=True)
class _Model:
  """One size of a sweep's model: its step, where it is donated, and its
  arguments on an H100."""
  name: str
  step: Callable
  donated: tuple
  args: tuple
  parameters: int
  host_budget: str | None = None


def _model(family: str, dtype, layers: int, width: int) -> _Model:
  if family == "llama":  # Llama-3-8B's widths, float32 state, bf16 compute
    if width != 4096 or dtype != jnp.bfloat16:
      raise ValueError("the Llama sweep has Llama-3-8B's width and dtypes")
    step, args, parameters, _, _ = llama_finetune.llama_step("8b", layers)
    return _Model(f"llama-3-8b-L{layers}", step, (0,), args, parameters,
                  LLAMA_HOST_BUDGET)
  case = frontier_cases.gpt(compute_dtype=dtype, layers=layers, width=width,
                            heads=width // HEAD_DIM, seq=SEQ, batch=BATCH,
                            vocab=VOCAB)
  args = on_one_device(jax.eval_shape(case.make_args), TARGET)
  return _Model(case.name, case.step, DONATED, args,
                sum(x.size for x in jax.tree.leaves(args[0])))


def _seconds(step_time) -> float | None:
  return None if step_time is None else round(step_time.total_s, 4)


def _times(step_time) -> dict:
  """A plan's predicted step time and its parts, in seconds."""
  if step_time is None:
    return {}
  return {"predicted_s": _seconds(step_time),
          "predicted_compute_s": round(step_time.compute_s, 4),
          "predicted_recompute_s": round(step_time.recompute_s, 4),
          "predicted_exposed_copy_s": round(step_time.exposed_transfer_s, 4)}


class Prober:
  """Probes one sweep's sizes, remembering each size's jax.jit step time
  from any jlms plan made for it."""

  def __init__(self, sweep: str):
    self.vary, _, _, self.dtype, self.fixed, self.family = SWEEPS[sweep]
    self.jit_seconds: dict[int, float | None] = {}

  def _model(self, size: int):
    shape = {**self.fixed, self.vary: size}
    return shape, _model(self.family, self.dtype, shape["layers"],
                         shape["width"])

  def probe(self, way: str, size: int) -> dict:
    """One size under one way: whether it fits, and its figures."""
    shape, model = self._model(size)
    row: dict[str, Any] = {
        "way": way, **shape, "heads": shape["width"] // HEAD_DIM,
        "parameters": model.parameters,
        "xla_peak_bytes": None, "state_leaves": None, "state_host_bytes": None,
        "predicted_s": None, "predicted_compute_s": None,
        "predicted_recompute_s": None, "predicted_exposed_copy_s": None,
        "jit_predicted_s": None, "not_applied": None, "fits": False,
        "error": None, "seconds": None,
    }
    start = time.perf_counter()
    if way == JIT:
      measured = measure(model.name, way, jax.jit(
          model.step, donate_argnums=model.donated), model.args, None)
      row.update(xla_peak_bytes=measured["peak_bytes"], error=measured["error"])
    else:
      options = {} if model.host_budget is None else {
          "host_budget": model.host_budget}
      step = jlms.offload(model.step, donate_argnums=model.donated,
                          state_on_host=False if way == ACTIVATIONS else None,
                          **options)
      try:
        plan = step.plan(*model.args)
      except Exception as error:  # BudgetError: it does not fit
        row["error"] = _first_line(error)
      else:
        row.update(xla_peak_bytes=plan.xla_peak_bytes,
                   state_leaves=plan.state_leaves,
                   state_host_bytes=plan.state_host_bytes,
                   not_applied=plan.not_applied,
                   **_times(plan.step_time),
                   jit_predicted_s=_seconds(plan.baseline_step_time))
        self.jit_seconds[size] = row["jit_predicted_s"]
    row["fits"] = (row["xla_peak_bytes"] is not None
                   and row["xla_peak_bytes"] <= LIMIT_BYTES)
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row

  def jit_time(self, size: int) -> float | None:
    """jax.jit's predicted step time at `size`, from a jlms plan (one is
    made with the state on the device when none was)."""
    if size not in self.jit_seconds:
      _, model = self._model(size)
      step = jlms.offload(model.step, donate_argnums=model.donated,
                          state_on_host=False)
      try:
        self.jit_seconds[size] = _seconds(
            step.plan(*model.args).baseline_step_time)
      except Exception:  # no plan, no prediction
        self.jit_seconds[size] = None
    return self.jit_seconds[size]


def largest(fits: Callable[[int], bool], start: int, unit: int) -> tuple:
  """Doubling from `start` (halving when it does not fit), then bisection
  to `unit`: (the largest fitting size, the smallest failing size, the
  first failing size tried); each None when none was found."""
  fit, fail, first_fail = None, None, None

  def probe(size: int) -> bool:
    nonlocal first_fail
    ok = fits(size)
    if not ok and first_fail is None:
      first_fail = size
    return ok

  if probe(start):
    fit = start
    while fail is None:
      if probe(2 * fit):
        fit *= 2
      else:
        fail = 2 * fit
  else:
    fail = start
    while fit is None and fail > unit:
      size = max(unit, fail // 2 // unit * unit)
      if probe(size):
        fit = size
      else:
        fail = size
  while fit is not None and fail - fit > unit:
    size = (fit + fail) // 2 // unit * unit
    if probe(size):
      fit = size
    else:
      fail = size
  return fit, fail, first_fail


def _saved_probes(path: str | None, sweep: str) -> dict:
  """The probes of `sweep` in the JSON at `path`, by (way, size): where a
  sweep stopped before its end (hours for the Llama's), `--resume` takes
  them instead of probing those sizes again."""
  if not path or not os.path.exists(path):
    return {}
  with open(path) as f:
    text = f.read()
  saved = (json.loads(text) if text.strip() else {}).get("sweeps", {})
  vary = SWEEPS[sweep][0]
  return {(row["way"], row[vary]): row
          for row in saved.get(sweep, {}).get("probes", ())}


def run_sweep(name: str, json_path: str | None, resume: bool = False) -> dict:
  """One sweep, its three ways in turn, each starting from the previous
  way's largest fitting size; the JSON is rewritten after every probe.
  With `resume`, the probes the JSON holds of this sweep are taken as
  they are (`_saved_probes`)."""
  vary, start, unit, dtype, fixed, family = SWEEPS[name]
  prober = Prober(name)
  saved = _saved_probes(json_path, name) if resume else {}
  result: dict[str, Any] = {
      "model": family, "varies": vary, **fixed,
      "compute_dtype": jnp.dtype(dtype).name,
      "complete": False, "largest": {}, "smallest_not_fitting": {},
      "first_not_fitting": {}, "probes": [],
  }
  if family == "llama":
    result.update(seq=llama_finetune.SEQUENCE,
                  batch=llama_finetune.SIZES["8b"]["batch"],
                  host_budget=LLAMA_HOST_BUDGET)
  for way in WAYS:
    rows: dict[int, dict] = {}

    def fits(size: int, way=way, rows=rows) -> bool:
      rows[size] = saved.get((way, size)) or prober.probe(way, size)
      result["probes"].append(rows[size])
      print(format_probe(name, rows[size]), flush=True)
      _save(json_path, name, result)
      return rows[size]["fits"]

    sizes = largest(fits, start, unit)
    for key, size in zip(("largest", "smallest_not_fitting",
                          "first_not_fitting"), sizes):
      result[key][way] = None if size is None else rows[size]
    fit = sizes[0]
    if fit is not None:
      start = fit
  jit_best = result["largest"][JIT]
  if jit_best is not None:
    jit_best["predicted_s"] = prober.jit_time(jit_best[vary])
  result["complete"] = True
  _save(json_path, name, result)
  return result


def _save(path: str | None, sweep: str, result: dict) -> None:
  """Puts `result` under `sweep` in the JSON at `path`, keeping the other
  sweeps there (under a lock: sweeps may run in separate processes)."""
  if not path:
    return
  with open(path, "a+") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    f.seek(0)
    text = f.read()
    saved = json.loads(text) if text.strip() else {}
    saved.update({
        "target": TARGET, "jax": jax.__version__, "limit_bytes": LIMIT_BYTES,
        "seq": SEQ, "batch": BATCH, "vocab": VOCAB, "head_dim": HEAD_DIM,
        "host_memory_limit_gb": os.environ.get(
            "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"),
    })
    saved.setdefault("sweeps", {})[sweep] = result
    f.seek(0)
    f.truncate()
    json.dump(saved, f, indent=2)


# --- printing ------------------------------------------------------------------


def _gib(value) -> str:
  return "-" if value is None else f"{value / GIB:.2f}"


def format_probe(sweep: str, row: dict) -> str:
  verdict = "fits" if row["fits"] else "no"
  note = f"  {row['error'][:100]}" if row["error"] else ""
  return (f"{sweep:<10} {row['way']:<23} L{row['layers']:<3} w{row['width']:<5} "
          f"{row['parameters'] / 1e9:6.2f}B  peak {_gib(row['xla_peak_bytes']):>7} GiB "
          f" host {_gib(row['state_host_bytes']):>6} GiB  {verdict:<4} "
          f"{row['seconds']:5.0f} s{note}")


_HEADER = (f"{'sweep':<10} {'way':<23} {'largest':>8} {'params B':>8} "
           f"{'peak GiB':>8} {'host GiB':>8} {'step s':>7}  "
           f"{'next':>5}  first not fitting tried")


def format_largest(sweep: str, result: dict, way: str) -> str:
  vary = result["varies"]
  best, fail = result["largest"].get(way), result["first_not_fitting"].get(way)
  letter = "L" if vary == "layers" else "w"
  size = "-" if best is None else f"{letter}{best[vary]}"
  after = result["smallest_not_fitting"].get(way)
  after = "-" if after is None else f"{letter}{after[vary]}"
  step = "-" if best is None or best["predicted_s"] is None else f"{best['predicted_s']:.3f}"
  failed = "-" if fail is None else (
      f"{letter}{fail[vary]} ({fail['parameters'] / 1e9:.2f}B"
      + (f", peak {_gib(fail['xla_peak_bytes'])} GiB)" if fail["error"] is None
         else f"; {fail['error'][:60]})"))
  return (f"{sweep:<10} {way:<23} {size:>8} "
          f"{'-' if best is None else format(best['parameters'] / 1e9, '.2f'):>8} "
          f"{_gib(None if best is None else best['xla_peak_bytes']):>8} "
          f"{_gib(None if best is None else best['state_host_bytes']):>8} "
          f"{step:>7}  {after:>5}  {failed}")


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--sweeps", nargs="+", choices=list(SWEEPS),
                      default=list(SWEEPS))
  parser.add_argument("--json", default=str(DEFAULT_JSON))
  parser.add_argument("--resume", action="store_true",
                      help="take the probes the JSON holds of each sweep "
                      "instead of probing those sizes again")
  args = parser.parse_args(argv)
  started = time.perf_counter()
  results = {name: run_sweep(name, args.json, args.resume)
             for name in args.sweeps}
  print(_HEADER)
  for name, result in results.items():
    for way in WAYS:
      print(format_largest(name, result, way))
  print(f"largest_gpt: {len(results)} sweeps in "
        f"{time.perf_counter() - started:.0f} s")
  return results


if __name__ == "__main__":
  main()
