"""The frontier's train steps run on a real GPU, against what was predicted
for them (issue 13, item 9).

Three halves-and-a-join, on two machines:

    # here, without a GPU: plan each configuration for the H100
    # (deviceless) and export, for CUDA, the very program that would run
    python -m benchmarks.gpu_steps export [--case NAME ...] [--dir .gpu_steps]

    # on the GPU: compile each exported program there, run and time it
    python -m benchmarks.gpu_steps run [--dir .gpu_steps] [--out DIR]

    # here again: the measured times beside jlms's model and the schedule
    # model (../shared/tools/step_time.py) of the GPU's own compiled HLO
    python -m benchmarks.gpu_steps report MEASURED.json [--json PATH]

Why split: planning a budget costs up to three deviceless compiles of the
step (two minutes for the ResNet on a 2-core machine), and a GPU is lent for
minutes. `jax.export` of the jitted step keeps jlms's rewrite as it is (its
host copies, barriers and recomputation are in the StableHLO), so what runs
on the GPU is the program that was planned, compiled by the GPU's own XLA.

The configurations are the frontier's (`benchmarks.frontier`): jax.jit,
per-layer remat (`nothing_saveable`), jlms at the halfway budget and at
remat's peak (the same budgets in bytes as the frontier's JSON), jlms with
`budget="min"`, and for the 1024x1024 ResNet, which jax.jit cannot run on an
H100, remat and plain `jlms.offload` fitted to the H100. Nothing is
donated: each timed step takes the same arguments.

`run` measures, per program: XLA's peak and host bytes of the GPU's compile,
the median of `--steps` steps after two warm-ups (each step waited for with
`block_until_ready`), the allocator's high-water mark after the steps, the
first step's loss, and keeps the GPU's optimized HLO (gzipped) for the
schedule model here.
"""

from __future__ import annotations

import os

import argparse
import concurrent.futures
import dataclasses
import gzip
import json
import pathlib
import statistics
import sys
import time
from typing import Any

GIB = 1 << 30
_REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_DIR = _REPO_ROOT / ".gpu_steps"
DEFAULT_JSON = _REPO_ROOT / "benchmarks" / "results" / "gpu_steps_h100.json"
FRONTIER_JSON = _REPO_ROOT / "benchmarks" / "results" / "frontier_h100.json"
MANIFEST = "manifest.json"

JIT, REMAT = "jax.jit", "remat nothing_saveable"
HALFWAY, REMAT_PEAK = "jlms budget halfway", "jlms budget remat-peak"
MINIMUM, FITS_DEVICE = "jlms budget min", "jlms fits the device"

# Case -> configurations, smallest expected peak last so that the
# allocator's high-water mark after each is that configuration's own where
# it is the largest yet (the list is run in reverse).
CONFIGS = {
    "scan_mlp": [JIT, REMAT, HALFWAY, REMAT_PEAK, MINIMUM],
    "gpt_bf16": [JIT, REMAT, HALFWAY, REMAT_PEAK, MINIMUM],
    "gpt_f32": [JIT, REMAT, HALFWAY, REMAT_PEAK, MINIMUM],
    "resnet": [JIT, REMAT, HALFWAY, REMAT_PEAK, MINIMUM],
    # jax.jit needs 94.6 GiB (XLA, deviceless): out of an H100's memory.
    "resnet_1024": [FITS_DEVICE, REMAT, REMAT_PEAK],
}


@dataclasses.dataclass
class Entry:
    """One exported program and what was predicted for it here."""

    case: str
    config: str
    file: str
    budget_bytes: int | None = None
    predicted_ms: float | None = None
    predicted_peak_bytes: int | None = None
    predicted_host_bytes: int | None = None
    recomputed: int | None = None
    copied: int | None = None
    export_jax: str = ""


# --- export: here, without a GPU ------------------------------------------------


def _frontier_budgets(case: str) -> dict[str, int]:
    """The frontier's budgets in bytes for `case` (config -> bytes)."""
    rows = json.loads(FRONTIER_JSON.read_text())["rows"]
    return {row["config"]: row["budget_bytes"] for row in rows
            if row["case"] == case and row.get("budget_bytes")}


def _callable(config: str, case, remat_case, budgets: dict):
    """(the callable to export, its budget in bytes or None)."""
    import jlms
    from benchmarks import frontier
    if config == JIT:
        return case.step, None
    if config == REMAT:
        return remat_case.step, None
    if config == FITS_DEVICE:
        return jlms.offload(case.step, target=frontier.TARGET), None
    if config == MINIMUM:
        return jlms.offload(case.step, budget="min", target=frontier.TARGET), None
    budget = budgets[config]
    return jlms.offload(case.step, budget=budget, target=frontier.TARGET), budget


def export(cases: list[str], directory: pathlib.Path,
           platforms: tuple[str, ...] = ("cuda",)) -> list[Entry]:
    """Exports each configuration of `cases` for CUDA into `directory`, with
    a manifest of what jlms predicted for each (kept entries of other cases
    stay in it)."""
    import jax
    import jlms
    from benchmarks import frontier
    directory.mkdir(parents=True, exist_ok=True)
    manifest_path = directory / MANIFEST
    entries = [Entry(**e) for e in json.loads(manifest_path.read_text())
               ] if manifest_path.is_file() else []
    entries = [e for e in entries if e.case not in cases]
    for name in cases:
        subject = frontier.make_subject(name)
        budgets = _frontier_budgets(name)
        for config in CONFIGS[name]:
            started = time.perf_counter()
            fn, budget = _callable(config, subject.case, subject.remat_case,
                                   budgets)
            entry = Entry(name, config, f"{name}--{config.replace(' ', '_')}.bin",
                          budget_bytes=budget, export_jax=jax.__version__)
            if isinstance(fn, jlms.OffloadedStep):
                plan = fn.plan(*subject.args)
                entry.predicted_ms = round(plan.step_time.total_s * 1e3, 3)
                entry.predicted_peak_bytes = plan.predicted_peak_bytes
                entry.predicted_host_bytes = plan.predicted_host_bytes
                entry.recomputed = len(plan.recomputed)
                entry.copied = len(plan.offloaded) - len(plan.recomputed)
                step = fn
                fn = lambda *a, step=step: step(*a)  # noqa: E731
            # Over flat leaves: optax's states are pytree types that
            # jax.export does not serialize.
            leaves, treedef = jax.tree.flatten(subject.args)

            def flat(*leaves, fn=fn, treedef=treedef):
                return jax.tree.leaves(fn(*jax.tree.unflatten(treedef, leaves)))

            exported = jax.export.export(jax.jit(flat), platforms=platforms)(
                *leaves)
            (directory / entry.file).write_bytes(exported.serialize())
            entries.append(entry)
            print(f"{name:<12} {config:<24} exported in "
                  f"{time.perf_counter() - started:5.1f} s", flush=True)
            manifest_path.write_text(json.dumps(
                [dataclasses.asdict(e) for e in entries], indent=1))
    return entries


# --- run: on the GPU -------------------------------------------------------------


def _median_ms(compiled, args, steps: int) -> tuple[float, list[float], Any]:
    import jax
    first = jax.block_until_ready(compiled(*args))
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), times, first


def run(directory: pathlib.Path, out: pathlib.Path, steps: int,
        cases: list[str] | None = None) -> list[dict]:
    """Compiles every exported program of the manifest on the local GPU
    (compiles in parallel threads, runs one at a time) and times it."""
    import jax
    from benchmarks import frontier
    from jlms._xla_memory import _memory_of
    entries = [Entry(**e) for e in json.loads((directory / MANIFEST).read_text())]
    if cases:
        entries = [e for e in entries if e.case in cases]
    device = jax.local_devices()[0]
    print(f"gpu_steps: {device.device_kind}, jax {jax.__version__}", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    hlo: dict[str, str] = {}
    order = [name for name in (cases or CONFIGS)
             if any(e.case == name for e in entries)]
    for name in order:
        case, _ = frontier.CASES[name]()
        args = jax.tree.leaves(jax.block_until_ready(jax.jit(case.make_args)()))
        mine = [e for e in entries if e.case == name]
        started = time.perf_counter()

        def compile_one(entry, args):
            exported = jax.export.deserialize(
                bytearray((directory / entry.file).read_bytes()))
            return jax.jit(exported.call).lower(*args).compile()

        with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
            futures = {e.config: pool.submit(compile_one, e, args)
                       for e in mine}
        compile_s = time.perf_counter() - started
        for entry in reversed(mine):  # the smallest peak first
            row = dataclasses.asdict(entry)
            row.update(device=device.device_kind, run_jax=jax.__version__,
                       compile_s=round(compile_s, 1), error=None)
            try:
                compiled = futures[entry.config].result()
                memory = _memory_of(compiled, "local")
                hlo[f"{name}--{entry.config}"] = memory.hlo_text
                before = device.memory_stats() or {}
                median, times, first = _median_ms(compiled, args, steps)
                after = device.memory_stats() or {}
                row.update(
                    measured_ms=round(median, 3),
                    step_ms=[round(t, 3) for t in times],
                    xla_peak_bytes=memory.peak_bytes,
                    xla_host_bytes=memory.host_bytes,
                    host_offloaded_buffers=memory.host_offloaded_buffers,
                    argument_bytes=memory.argument_bytes,
                    in_use_before=before.get("bytes_in_use"),
                    peak_in_use_before=before.get("peak_bytes_in_use"),
                    peak_in_use_after=after.get("peak_bytes_in_use"),
                    loss=float(jax.tree.leaves(first)[-1]))
            except Exception as error:  # one program's failure is a row
                row["error"] = f"{type(error).__name__}: {str(error)[:400]}"
            rows.append(row)
            print(_format_run_row(row), flush=True)
            # Written as each row ends: a run cut short keeps what it did.
            (out / "gpu_steps.json").write_text(json.dumps(rows, indent=1))
            with gzip.open(out / "gpu_steps_hlo.json.gz", "wt") as f:
                json.dump(hlo, f)
        del args
    return rows


def _format_run_row(row: dict) -> str:
    if row["error"]:
        return f"{row['case']:<12} {row['config']:<24} {row['error']}"
    return (f"{row['case']:<12} {row['config']:<24} {row['measured_ms']:9.2f} ms "
            f"XLA peak {row['xla_peak_bytes'] / GIB:6.2f} GiB, host "
            f"{row['xla_host_bytes'] / GIB:5.2f} GiB, loss {row['loss']:.6g}")


# --- report: here again ----------------------------------------------------------


def report(measured: list[dict], yardstick, repeat=()) -> dict:
    """Rows of measured and predicted figures; the errors of each model.
    `repeat`: rows of another run, whose times go beside as `repeat_ms`."""
    frontier_rows = {(r["case"], r["config"]): r for r in
                     json.loads(FRONTIER_JSON.read_text())["rows"]}
    repeated = {(r["case"], r["config"]): r.get("measured_ms") for r in repeat}
    rows = []
    for m in measured:
        f = frontier_rows.get((m["case"], m["config"]), {})
        row = {key: m.get(key) for key in (
            "case", "config", "budget_bytes", "measured_ms", "xla_peak_bytes",
            "xla_host_bytes", "host_offloaded_buffers", "loss", "error", "device", "run_jax", "export_jax", "recomputed",
            "copied")}
        # The allocator's high-water mark is the process's: it is this
        # program's peak (with what the process held besides) only where
        # this program raised it.
        raised = (m.get("peak_in_use_after") or 0) > (
            m.get("peak_in_use_before") or 0)
        row["peak_in_use_bytes"] = m["peak_in_use_after"] if raised else None
        row["repeat_ms"] = repeated.get((m["case"], m["config"]))
        row["predicted_ms"] = m.get("predicted_ms") or f.get("predicted_ms")
        row["deviceless_peak_bytes"] = f.get("peak_bytes")
        row["deviceless_schedule_ms"] = f.get("total_ms")
        row["schedule_ms"] = None
        if yardstick is not None and m.get("hlo_text"):
            row["schedule_ms"] = round(float(
                yardstick.estimate(m["hlo_text"])["total_ms"]), 3)
        rows.append(row)
    return {"rows": rows, "summary": summary(rows)}


def _log_error(rows, key) -> tuple[float | None, float | None]:
    import math
    errors = [math.log(r[key] / r["measured_ms"]) for r in rows
              if r.get(key) and r.get("measured_ms")]
    if not errors:
        return None, None
    rms = math.sqrt(sum(e * e for e in errors) / len(errors))
    worst = max(errors, key=abs)
    return round(rms, 3), round(math.exp(worst) - 1, 3)


def summary(rows: list[dict]) -> dict:
    """Per model: rms log error against the measured times, and the worst
    relative error."""
    result = {}
    for key in ("predicted_ms", "schedule_ms", "deviceless_schedule_ms"):
        rms, worst = _log_error(rows, key)
        result[key] = {"rms_log_error": rms, "worst_error": worst}
    return result


def format_report(result: dict) -> str:
    lines = [f"{'case':<12} {'config':<24} {'measured':>9} {'jlms':>8} "
             f"{'sched.':>8} {'XLA GiB':>8} {'host GiB':>8}  note"]
    for r in result["rows"]:
        def cell(value, digits=1, width=8):
            return f"{'-':>{width}}" if value is None else f"{value:>{width}.{digits}f}"
        lines.append(
            f"{r['case']:<12} {r['config']:<24} {cell(r['measured_ms'], 1, 9)} "
            f"{cell(r['predicted_ms'])} {cell(r['schedule_ms'])} "
            f"{cell(r['xla_peak_bytes'] and r['xla_peak_bytes'] / GIB, 2)} "
            f"{cell(r['xla_host_bytes'] is not None and r['xla_host_bytes'] / GIB, 2)}"
            f"  {r['error'] or ''}")
    for key, errors in result["summary"].items():
        lines.append(f"{key}: rms log error {errors['rms_log_error']}, worst "
                     f"{errors['worst_error']}")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    exporting = commands.add_parser("export")
    exporting.add_argument("--case", nargs="+", default=list(CONFIGS),
                           choices=list(CONFIGS))
    exporting.add_argument("--dir", default=str(DEFAULT_DIR))
    exporting.add_argument("--platforms", nargs="+", default=["cuda"],
                           help="add cpu to run the programs on a CPU too")
    running = commands.add_parser("run")
    running.add_argument("--dir", default=str(DEFAULT_DIR))
    running.add_argument("--out", default=os.environ.get("OUT", "out"))
    running.add_argument("--steps", type=int, default=8)
    running.add_argument("--case", nargs="+", default=None)
    reporting = commands.add_parser("report")
    reporting.add_argument("measured", help="a run's gpu_steps.json")
    reporting.add_argument("--repeat", default=None,
                           help="another run's gpu_steps.json, on the same "
                                "machine: its times go beside as a repeat")
    reporting.add_argument("--hlo", default=None,
                           help="the run's gpu_steps_hlo.json.gz")
    reporting.add_argument("--json", default=str(DEFAULT_JSON))
    args = parser.parse_args(argv)

    if args.command == "export":
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        export(args.case, pathlib.Path(args.dir), tuple(args.platforms))
    elif args.command == "run":
        run(pathlib.Path(args.dir), pathlib.Path(args.out), args.steps, args.case)
    else:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        from benchmarks import frontier
        from benchmarks._output import write_json
        measured = json.loads(pathlib.Path(args.measured).read_text())
        if args.hlo:
            with gzip.open(args.hlo, "rt") as f:
                texts = json.load(f)
            for m in measured:
                m["hlo_text"] = texts.get(f"{m['case']}--{m['config']}")
        repeat = (json.loads(pathlib.Path(args.repeat).read_text())
                  if args.repeat else [])
        result = report(measured, frontier.load_yardstick(), repeat)
        print(format_report(result))
        write_json(args.json, result)


if __name__ == "__main__":
    sys.exit(main())
