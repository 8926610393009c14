"""The memory/time frontier of four train steps on an H100 (issue 13).

    python -m benchmarks.frontier [--case resnet|gpt_f32|gpt_bf16|scan_mlp|resnet_1024|all]
                                  [--configs SUBSTRING ...] [--json PATH]

For each step (`benchmarks.frontier_cases`: the 16-block BatchNorm ResNet at
256x256, the `nn.scan` GPT decoder in float32 and in bfloat16 compute, and
the 16-layer `jax.lax.scan` MLP; the ResNet at 1024x1024, which does not
fit an H100 under jax.jit), every configuration in `CONFIGS` is
compiled deviceless for the H100 (`jlms.xla_memory(..., target="h100")`),
and its row holds XLA's device peak and host bytes and the step time that
the schedule yardstick `../shared/tools/step_time.py` (`estimate(hlo)`)
predicts from the compiled program: total, compute and exposed copy time.
The configurations:

- `jax.jit`: the plain step;
- `remat nothing_saveable`: every layer under `jax.checkpoint` with
  `nothing_saveable`;
- `xla slop halfway`, `xla slop halfway + host offload`: `jax.jit`
  compiled with `xla_gpu_memory_limit_slop_factor` set to the percent of
  the H100's memory that is the halfway budget (halfway between jax.jit's
  and remat's XLA peaks), the second also with
  `xla_gpu_enable_host_memory_offloading`: XLA's own answer to a limit;
- `jlms budget halfway`, `jlms budget remat-peak`:
  `jlms.offload(step, budget=B, target="h100")`;
- `jlms fits the device`: `jlms.offload(step, target="h100")`, no knobs:
  jax.jit's program for a step that fits, the fastest plan that fits the
  H100's memory for one that does not.

A configuration that fails (an option this XLA refuses, a `BudgetError`)
records the first line of its error in its row; the others go on. Nothing
is donated. More configurations are one `Config(label, build)` entry in
`CONFIGS` each: `build(subject)` returns the callable to compile, given a
`Subject` (the case, its remat twin, and the budgets measured so far).

When the yardstick file is missing the time columns are left empty. The
JSON file keeps the rows of cases not run this time (when it was written by
the same JAX), so `--case` runs in separate processes add up to one table.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import dataclasses
import importlib.util
import json
import math
import pathlib
import time
from collections.abc import Callable
from typing import Any

import warnings

import jax
import jax.numpy as jnp

import jlms
from benchmarks import frontier_cases
from benchmarks import models
from benchmarks._output import write_json

TARGET = "h100"
GIB = 1 << 30
# device_memory_size of jlms/targets/h100.txtpb, should the module that
# reads it not be importable.
H100_MEMORY_BYTES = 84942979072

_REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
YARDSTICK_PATH = _REPO_ROOT.parent / "shared" / "tools" / "step_time.py"
DEFAULT_JSON = _REPO_ROOT / "benchmarks" / "results" / f"frontier_{TARGET}.json"

# Case name -> factory of (plain case, remat case).
CASES: dict[str, Callable[[], tuple[models.StepCase, models.StepCase]]] = {
    "resnet": lambda: (frontier_cases.resnet(), frontier_cases.resnet(remat=True)),
    "gpt_f32": lambda: (frontier_cases.gpt(), frontier_cases.gpt(remat=True)),
    "gpt_bf16": lambda: (frontier_cases.gpt(compute_dtype=jnp.bfloat16),
                         frontier_cases.gpt(remat=True, compute_dtype=jnp.bfloat16)),
    "scan_mlp": lambda: (frontier_cases.scan_mlp(), frontier_cases.scan_mlp(remat=True)),
    # Does not fit an H100 under jax.jit (94.6 GiB by XLA deviceless).
    "resnet_1024": lambda: (frontier_cases.resnet(image_size=1024),
                            frontier_cases.resnet(remat=True, image_size=1024)),
}


# --- what a configuration is given and returns ---------------------------------


@dataclasses.dataclass
class Subject:
    """One step and what the configurations of its rows may use.

    `peaks` fills in as rows complete (config label -> XLA peak bytes);
    `budget(name)` derives the named budgets from them.
    """

    name: str
    case: models.StepCase
    remat_case: models.StepCase
    args: tuple
    peaks: dict[str, int] = dataclasses.field(default_factory=dict)

    def budget(self, name: str) -> int:
        """Bytes of the budget `name`: "halfway" (between jax.jit's and
        remat's XLA peaks) or "remat-peak"."""
        missing = [label for label in (JIT, REMAT) if label not in self.peaks]
        if missing:
            raise RuntimeError(f"no budget: no XLA peak for {', '.join(missing)}")
        jit_peak, remat_peak = self.peaks[JIT], self.peaks[REMAT]
        if name == "halfway":
            return (jit_peak + remat_peak) // 2
        if name == "remat-peak":
            return remat_peak
        raise ValueError(f"unknown budget {name!r}")


@dataclasses.dataclass
class Variant:
    """What a configuration compiles: `fn` (anything `jlms.xla_memory`
    accepts) and facts about it that go into the row as they are."""

    fn: Any
    notes: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Config:
    label: str
    build: Callable[[Subject], Any]  # -> a callable or a Variant


class _WithCompilerOptions:
    """`jax.jit(fn)` whose compile passes `compiler_options`: `xla_memory`
    lowers through `.lower(...)` and compiles the result with no argument."""

    def __init__(self, fn: Callable, options: dict):
        self._jitted = jax.jit(fn)
        self.options = dict(options)

    def lower(self, *args, **kwargs):
        return _LoweredWithOptions(self._jitted.lower(*args, **kwargs), self.options)


class _LoweredWithOptions:
    def __init__(self, lowered, options: dict):
        self._lowered = lowered
        self._options = options

    def compile(self):
        return self._lowered.compile(compiler_options=self._options)


def _device_memory_bytes() -> int:
    try:
        from jlms._xla_memory import target_memory_bytes
        return target_memory_bytes(TARGET)
    except (ImportError, ValueError, OSError):
        return H100_MEMORY_BYTES


def _slop_percent(budget_bytes: int) -> int:
    # XLA takes a whole percent; rounding down keeps the limit within budget.
    return max(1, math.floor(100 * budget_bytes / _device_memory_bytes()))


def _xla_limit(host_offload: bool) -> Callable[[Subject], Variant]:
    def build(subject: Subject) -> Variant:
        budget = subject.budget("halfway")
        options = {"xla_gpu_memory_limit_slop_factor": _slop_percent(budget)}
        if host_offload:
            options["xla_gpu_enable_host_memory_offloading"] = True
        return Variant(_WithCompilerOptions(subject.case.step, options),
                       {"budget_bytes": budget, "compiler_options": options})
    return build


def _jlms_budget(name: str) -> Callable[[Subject], Variant]:
    def build(subject: Subject) -> Variant:
        budget = int(subject.budget(name))
        step = jlms.offload(subject.case.step, budget=budget, target=TARGET)
        return Variant(step, {"budget_bytes": budget})
    return build


JIT = "jax.jit"
REMAT = "remat nothing_saveable"
FITS_DEVICE = "jlms fits the device"

# In order: the budgets of later rows come from the peaks of the first two.
CONFIGS: list[Config] = [
    Config(JIT, lambda subject: subject.case.step),
    Config(REMAT, lambda subject: subject.remat_case.step),
    Config("xla slop halfway", _xla_limit(host_offload=False)),
    Config("xla slop halfway + host offload", _xla_limit(host_offload=True)),
    Config("jlms budget halfway", _jlms_budget("halfway")),
    Config("jlms budget remat-peak", _jlms_budget("remat-peak")),
    # No knobs: fit the device the step is compiled for (the target here).
    Config(FITS_DEVICE, lambda subject: jlms.offload(subject.case.step,
                                                     target=TARGET)),
]


# --- measuring -----------------------------------------------------------------


def load_yardstick(path: pathlib.Path = YARDSTICK_PATH):
    """The step_time module, or None when its file is absent."""
    if not path.is_file():
        return None
    spec = importlib.util.spec_from_file_location("_frontier_step_time", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def make_subject(name: str) -> Subject:
    case, remat_case = CASES[name]()
    args = case.abstract_args()
    remat_args = remat_case.abstract_args()
    if jax.tree.structure(args) != jax.tree.structure(remat_args) or any(
            (a.shape, a.dtype) != (b.shape, b.dtype)
            for a, b in zip(jax.tree.leaves(args), jax.tree.leaves(remat_args))):
        raise ValueError(f"{name}: the remat case takes other arguments than the plain one")
    return Subject(name, case, remat_case, args)


def measure(subject: Subject, config: Config, yardstick) -> dict:
    """One row: XLA's bytes and the yardstick's times, or the error."""
    row: dict[str, Any] = {
        "case": subject.name, "step": subject.case.name, "config": config.label,
        "peak_bytes": None, "host_bytes": None, "temp_bytes": None,
        "total_ms": None, "compute_ms": None, "exposed_copy_ms": None,
        "d2h_mib": None, "h2d_mib": None, "seconds": None, "error": None,
    }
    start = time.perf_counter()
    try:
        variant = config.build(subject)
        if not isinstance(variant, Variant):
            variant = Variant(variant)
        row.update(variant.notes)
        memory = jlms.xla_memory(variant.fn, *subject.args, target=TARGET)
    except Exception as error:  # a row that fails must not stop the others
        row["error"] = _first_line(error)
        row["seconds"] = round(time.perf_counter() - start, 1)
        return row
    row.update(_predicted(variant.fn, subject))
    row.update(peak_bytes=memory.peak_bytes, host_bytes=memory.host_bytes,
               temp_bytes=memory.temp_bytes,
               host_offloaded_buffers=memory.host_offloaded_buffers)
    subject.peaks[config.label] = memory.peak_bytes
    if yardstick is not None:
        try:
            times = yardstick.estimate(memory.hlo_text)
            row.update({key: round(float(times[key]), 3) for key in
                        ("total_ms", "compute_ms", "exposed_copy_ms",
                         "d2h_mib", "h2d_mib")})
        except Exception as error:
            row["error"] = f"yardstick: {_first_line(error)}"
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row


def _predicted(fn, subject: Subject) -> dict:
    """jlms's own prediction of the program that runs: the plan's for a jlms
    step, the plain step's (planned as it is) for a jax.jit program; none
    for programs XLA changes under options jlms does not model."""
    if isinstance(fn, jlms.OffloadedStep):
        plan = fn.plan(*subject.args)
    elif isinstance(fn, _WithCompilerOptions):
        return {}
    else:
        with warnings.catch_warnings():  # a budget above the GPU on purpose
          warnings.simplefilter("ignore", UserWarning)
          plan = jlms.offload(fn, budget="1TiB", target=TARGET).plan(
              *subject.args)
    return {"predicted_ms": round(plan.step_time.total_s * 1e3, 3),
            "predicted_peak_bytes": plan.predicted_peak_bytes,
            "recomputed": len(plan.recomputed),
            "copied": len(plan.offloaded) - len(plan.recomputed)}


def criteria(rows: list[dict]) -> list[str]:
    """Issue 13's time criteria for each case, by the yardstick and by
    jlms's model: no slower than remat; within 10% of jax.jit at the halfway
    budget; at remat's peak within half of remat's extra time over jax.jit."""
    lines = []
    for case in dict.fromkeys(r["case"] for r in rows):
        by = {r["config"]: r for r in rows if r["case"] == case}
        jit, remat = by.get(JIT), by.get(REMAT)
        for label, bound in (("jlms budget halfway", "halfway"),
                             ("jlms budget remat-peak", "remat-peak")):
            row = by.get(label)
            if not (jit and remat and row) or row["error"]:
                lines.append(f"{case} {label}: {row and row['error']}")
                continue
            for key, name in (("total_ms", "yardstick"), ("predicted_ms", "jlms model")):
                if None in (jit.get(key), remat.get(key), row.get(key)):
                    continue
                j, r, t = jit[key], remat[key], row[key]
                limit = 1.10 * j if bound == "halfway" else j + (r - j) / 2
                ok = t <= r and t <= limit
                lines.append(f"{case} {label} ({name}): {t:.1f} ms; jax.jit {j:.1f}, "
                             f"remat {r:.1f}, bound {min(r, limit):.1f}: "
                             f"{'met' if ok else 'NOT met'}")
        lines.extend(_prediction_lines(case, by))
        device = by.get(FITS_DEVICE)
        if not (jit and remat and device) or device["error"] or jit["error"]:
            continue
        memory = _device_memory_bytes()
        if jit["peak_bytes"] <= memory:
            same = (device["peak_bytes"] == jit["peak_bytes"]
                    and not device["host_bytes"])
            lines.append(f"{case} {FITS_DEVICE}: jax.jit fits; peak "
                         f"{device['peak_bytes'] / GIB:.2f} GiB, host "
                         f"{device['host_bytes'] / GIB:.2f} GiB: "
                         f"{'jax.jit program' if same else 'NOT jax.jit program'}")
        else:
            ok = (device["peak_bytes"] <= memory and device["host_bytes"] <= 64 * GIB
                  and device["total_ms"] is not None and remat["total_ms"] is not None
                  and device["total_ms"] <= remat["total_ms"])
            lines.append(f"{case} {FITS_DEVICE}: jax.jit does not fit "
                         f"({jit['peak_bytes'] / GIB:.1f} GiB); peak "
                         f"{device['peak_bytes'] / GIB:.2f} GiB, host "
                         f"{device['host_bytes'] / GIB:.2f} GiB, yardstick "
                         f"{device['total_ms']} ms against remat's "
                         f"{remat['total_ms']}: {'met' if ok else 'NOT met'}")
    return lines


def _prediction_lines(case: str, by: dict) -> list[str]:
    """Issue 13's prediction criteria for each jlms row: the plan's
    predicted peak within 10% of XLA's; its predicted step time against the
    yardstick's, as it is (the 15% criterion) and as a ratio to jax.jit's
    time by the same model (which cancels each model's own bias: the
    yardstick is 13-51% below the H100's measured steps, jlms's model is
    calibrated to them; docs/benchmarks.md)."""
    lines = []
    jit = by.get(JIT)
    for label, row in by.items():
        if not label.startswith("jlms") or row["error"]:
            continue
        peak, predicted = row.get("peak_bytes"), row.get("predicted_peak_bytes")
        if peak and predicted:
            error = predicted / peak - 1
            lines.append(f"{case} {label}: predicted peak {predicted / GIB:.2f} GiB, "
                         f"XLA's {peak / GIB:.2f} ({error:+.1%}): "
                         f"{'met' if abs(error) <= 0.10 else 'NOT met'}")
        ms, yard = row.get("predicted_ms"), row.get("total_ms")
        if not (ms and yard):
            continue
        text = f"{case} {label}: predicted {ms:.1f} ms, yardstick {yard:.1f} ({ms / yard - 1:+.0%})"
        if jit and jit.get("predicted_ms") and jit.get("total_ms"):
            relative = (ms / jit["predicted_ms"]) / (yard / jit["total_ms"]) - 1
            text += f"; as a ratio to jax.jit's time {relative:+.1%}"
        lines.append(text)
    return lines


# --- printing ------------------------------------------------------------------

_HEADER = (f"{'case':<9} {'config':<32} {'XLA peak GiB':>12} {'host GiB':>9} "
           f"{'yardstick ms':>12} {'compute ms':>10} {'exp. copy ms':>12} "
           f"{'jlms model ms':>13} {'s':>6}  note")


def _cell(value, scale=1.0, width=9, digits=2) -> str:
    if value is None:
        return f"{'-':>{width}}"
    return f"{value / scale:>{width}.{digits}f}"


def format_row(row: dict) -> str:
    note = row["error"] or ""
    if not note and row.get("compiler_options"):
        note = f"slop {row['compiler_options']['xla_gpu_memory_limit_slop_factor']}%"
    if row.get("budget_bytes") is not None:
        note = f"budget {row['budget_bytes'] / GIB:.2f} GiB" + (f"; {note}" if note else "")
    return (f"{row['case']:<9} {row['config']:<32} {_cell(row['peak_bytes'], GIB, 12)} "
            f"{_cell(row['host_bytes'], GIB)} {_cell(row['total_ms'], width=12, digits=1)} "
            f"{_cell(row['compute_ms'], width=10, digits=1)} "
            f"{_cell(row['exposed_copy_ms'], width=12, digits=1)} "
            f"{_cell(row.get('predicted_ms'), width=13, digits=1)} "
            f"{_cell(row['seconds'], width=6, digits=0)}  {note}")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--case", default="all", choices=[*CASES, "all"])
    parser.add_argument("--configs", nargs="+", default=None, metavar="SUBSTRING",
                        help="only the configurations whose label contains one "
                             "of these (jax.jit and remat always run: the "
                             "budgets come from them)")
    parser.add_argument("--json", default=str(DEFAULT_JSON))
    args = parser.parse_args(argv)

    yardstick = load_yardstick()
    if yardstick is None:
        print(f"frontier: {YARDSTICK_PATH} is absent: the time columns are unavailable")
    configs = [config for config in CONFIGS
               if args.configs is None or config.label in (JIT, REMAT)
               or any(part in config.label for part in args.configs)]
    names = list(CASES) if args.case == "all" else [args.case]

    rows = []
    started = time.perf_counter()
    print(_HEADER, flush=True)
    for name in names:
        subject = make_subject(name)
        for config in configs:
            row = measure(subject, config, yardstick)
            rows.append(row)
            print(format_row(row), flush=True)
    print(f"frontier: {len(rows)} rows in {time.perf_counter() - started:.0f} s")
    checks = criteria(rows)
    print("\n".join(checks))

    result = {
        "target": TARGET, "device_memory_bytes": _device_memory_bytes(),
        "jax": jax.__version__,
        "yardstick": str(YARDSTICK_PATH) if yardstick is not None else None,
        "rows": _kept_rows(args.json, names) + rows,
        "criteria": checks,
    }
    write_json(args.json, result)
    return result


def _kept_rows(path: str | None, names: list[str]) -> list[dict]:
    """Rows of an existing result file for the cases not run now, so that
    the cases can be run one process each into one file."""
    if not path or not os.path.isfile(path):
        return []
    try:
        with open(path) as f:
            previous = json.load(f)
    except (OSError, ValueError):
        return []
    if not isinstance(previous, dict) or previous.get("jax") != jax.__version__:
        return []
    return [row for row in previous.get("rows", []) if row.get("case") not in names]


if __name__ == "__main__":
    main()
