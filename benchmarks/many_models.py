"""The model zoo under jax.jit, jlms.offload and per-block rematerialisation:
XLA's device memory, host memory, compile costs and a predicted step time.

    python -m benchmarks.many_models [--model all|resnet50|densenet121|...]
        [--image-size N] [--batch-size N] [--target h100|h200|a100|local]
        [--budget 40GiB] [--steps 3] [--json PATH [--merge]] [--markdown PATH]
    python -m benchmarks.many_models --model resnet50 --batch-size 8 \\
        --find-max image-size --budget 80GiB [--max-probes 12]

For each model of the registry's zoo (`benchmarks.models.ZOO`; at its
default size unless given, the size being the sequence length for GPT) the
train step is compiled by XLA for the target, deviceless for
h100/h200/a100, as:

- `jax.jit(step)`;
- `jlms.offload(step, min_bytes=1 MiB, swapout_threshold=20)` (TFLMS's
  rules with the knobs that were jlms's defaults before budgets became the
  default), and `jlms.offload(step, budget=..., target=...)` (the time-aware
  fit) when `--budget` is given (bytes such as 20GiB, a percentage of the
  target's memory, or a fraction of jax.jit's peak such as 0.5x);
- `jax.jit` of the model with every block under `nn.remat` and
  `nothing_saveable` (recompute everything), and under MaxText's offload
  policy (each block input offloaded to pinned host, the rest recomputed).

Every memory figure is XLA's `memory_analysis()` through `jlms.xla_memory`.
Timings are wall seconds on this machine: trace (`jax.make_jaxpr` of the
step), plan (`OffloadedStep.plan`, jlms's analysis and rewrite) and each
compile.

Predicted step time, a transfer model and nothing more (no kernel is run):

- compute = the step's FLOPs / the GPU's FP32 FMA peak. FLOPs are XLA's
  cost analysis of the lowered (unoptimised) HLO, so recomputation counts;
  jlms adds only copies, so its FLOPs are jax.jit's. The peak is computed
  from the target's own description (SMs x FP32 lanes per SM x 2 x clock):
  66.9 TFLOP/s for the H100 SXM and H200, 19.5 for the A100. The models are
  float32; XLA lets cuDNN and cuBLAS use TF32 tensor cores for them, whose
  dense peak (495 TFLOP/s on H100 SXM, NVIDIA's datasheet) no training step
  comes near, so the FP32 peak stands in for a sustained rate.
  `--tflops` replaces it.
- transfer = bytes moved between device and host / link bandwidth: the
  target's host link as jlms's time model has it (`models.host_link`): PCIe
  Gen5 x16 at 52 GB/s achieved for H100 and H200 (64 GB/s per direction
  nominal), PCIe Gen4 x16 at 25 GB/s for A100 (32 nominal), and NVLink-C2C
  at 350 GB/s as on a GH200 (450 GB/s per direction nominal) for
  comparison. `--link-gbps` replaces the PCIe figure. Bytes moved: for jlms
  the plan's swap-out and swap-in bytes, never less than twice XLA's host
  bytes; for the offload policy twice XLA's host bytes (each offloaded
  residual goes out once and comes back once).
- step time = max(compute, transfer) when copies overlap compute, and
  compute + transfer when they do not.

`--find-max image-size|batch-size --budget B` searches the largest size (in
steps of the model's size multiple, or 1 for the batch) whose XLA device peak
fits under B, for jax.jit and for jlms.offload (TFLMS knobs): doubling
from the given size, then bisection, at most `--max-probes` compiles each;
every probe is logged. The ratio of the two is the multiplier (a ratio of
side lengths for image sizes).

`--target local` compiles for the local backend and also runs `--steps`
steps of jax.jit and of jlms.offload on concrete data, reporting the median
step time and `jlms.memory_stats()`.
"""

from __future__ import annotations

# jax, jlms and the zoo are imported inside the functions: whether
# JAX_PLATFORMS=cpu must be set before jax is first imported depends on the
# target, which only the command line tells.
import argparse
import dataclasses
import importlib.resources
import json
import os
import re
import statistics
import time
import traceback

# The registry's units (`benchmarks.models.GIB`), written out here because
# this module imports jax, and so the registry, only once the target is known.
GIB = 1 << 30
MIB = 1 << 20

# Default size and batch of each model for the memory table: large enough
# that jax.jit needs a few GiB on the device.
DEFAULT_SIZES = {
    "resnet50": (224, 32),
    "densenet121": (224, 32),
    "mobilenetv2": (224, 32),
    "inception": (299, 32),
    "unet3d": (128, 1),
    "gpt": (1024, 8),
}

_NVLINK_C2C_BYTES_PER_SECOND = 350e9
# The GPU targets whose host link the registry knows (`models.host_link`).
_GPU_TARGETS = ("h100", "h200", "a100")
_VARIANTS = ("jit", "jlms", "jlms_budget", "remat_nothing_saveable", "remat_offload")


@dataclasses.dataclass(frozen=True)
class Hardware:
    """What the transfer model assumes about one GPU and its host link."""

    gpu: str
    flops_per_second: float
    link: str
    link_bytes_per_second: float

    def predict(self, flops: float, moved_bytes: float) -> dict:
        compute = flops / self.flops_per_second
        transfer = moved_bytes / self.link_bytes_per_second
        c2c = moved_bytes / _NVLINK_C2C_BYTES_PER_SECOND
        return {
            "compute_ms": 1e3 * compute,
            "transfer_ms": 1e3 * transfer,
            "overlapped_ms": 1e3 * max(compute, transfer),
            "serial_ms": 1e3 * (compute + transfer),
            "c2c_overlapped_ms": 1e3 * max(compute, c2c),
            "c2c_serial_ms": 1e3 * (compute + c2c),
        }


def hardware_for(target: str, tflops: float | None, link_gbps: float | None) -> Hardware | None:
    """The transfer model's GPU: from the target's description, or None for a
    local target without `tflops` and `link_gbps`."""
    if target in _GPU_TARGETS:
        from benchmarks import models

        gpu, flops = _target_fp32_peak(target)
        link, link_rate = models.host_link(target)
    elif tflops and link_gbps:
        gpu, flops, link, link_rate = target, 0.0, "given", 0.0
    else:
        return None
    if tflops:
        flops = tflops * 1e12
    if link_gbps:
        link, link_rate = f"{link_gbps:g} GB/s (given)", link_gbps * 1e9
    return Hardware(gpu, flops, link, link_rate)


def _target_field(target: str, name: str) -> str:
    """One field of jlms's description of the GPU `target` (targets/*.txtpb)."""
    text = (importlib.resources.files("jlms") / "targets" / f"{target}.txtpb").read_text()
    return re.search(rf"\b{name}:\s*\"?([^\"\n]+)", text).group(1)


def _target_fp32_peak(target: str) -> tuple[str, float]:
    """(GPU name, FP32 FMA peak in FLOP/s) of `target`: SMs x FP32 lanes per
    SM x 2 FLOP per FMA x clock."""
    lanes = int(_target_field(target, "core_count")) * int(_target_field(target, "fpus_per_core"))
    clock = float(_target_field(target, "clock_rate_ghz")) * 1e9
    return _target_field(target, "name"), lanes * 2 * clock


_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": MIB, "gib": GIB, "tib": 1 << 40,
          "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12}


def parse_bytes(text: str) -> int:
    """`"80GiB"`, `"40 GB"` or `"1073741824"` as a number of bytes."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size in bytes: {text!r} (e.g. 80GiB, 40GB, 1073741824)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def budget_in_bytes(budget: str, jit_peak_bytes: int | None) -> int | str:
    """`"0.5x"`: that fraction of jax.jit's XLA peak, in bytes; anything else
    (`"20GiB"`, `"90%"` of the target's memory) is jlms's to parse."""
    if not budget.endswith("x"):
        return budget
    if jit_peak_bytes is None:
        raise ValueError(f"budget {budget} is relative to jax.jit's peak, which failed")
    return int(float(budget[:-1]) * jit_peak_bytes)


def _build(name: str, size: int, batch_size: int, remat: str | None = None):
    from benchmarks import models

    return models.ZOO[name].build(size, batch_size, remat=remat)


def _timed(fn, *args, **kwargs):
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return result, time.perf_counter() - start


def _error(exception: BaseException) -> dict:
    lines = traceback.format_exception_only(type(exception), exception)
    return {"error": "".join(lines).strip()[:2000]}


def _flops(step, abstract) -> float:
    import jax

    lowered = jax.jit(step).lower(*abstract)
    analysis = lowered.cost_analysis()
    if analysis is None:  # on a GPU, only the compiled program has one
        analysis = lowered.compile().cost_analysis()
    if isinstance(analysis, list):  # older jax: one dict per program
        analysis = analysis[0]
    return float(analysis["flops"])


def _memory_entry(memory, compile_seconds) -> dict:
    entry = memory.as_dict()
    entry["compile_seconds"] = compile_seconds
    return entry


def measure_model(name: str, size: int, batch_size: int, target: str, budget: str | None,
                  hardware: Hardware | None, steps: int) -> dict:
    """One row of the table: every variant's XLA memory, costs and prediction.

    A variant that fails records `{"error": ...}` instead of its figures.
    """
    import jax

    import jlms
    from benchmarks import models

    case = _build(name, size, batch_size)
    abstract = case.abstract_args()
    row = {"model": name, "case": case.name, "target": target, "size": size,
           "batch_size": batch_size}
    print(f"\n== {case.name} on {target} ==", flush=True)
    jaxpr, row["trace_seconds"] = _timed(jax.make_jaxpr(case.step), *abstract)
    row["equations"] = len(jaxpr.jaxpr.eqns)
    row["argument_bytes"] = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract))
    row["flops"] = _flops(case.step, abstract)
    print(f"  {row['equations']} equations, traced in {row['trace_seconds']:.1f} s; "
          f"{row['flops'] / 1e9:.1f} GFLOP", flush=True)

    def compile_variant(key, fn, variant_abstract, **extra):
        try:
            memory, seconds = _timed(jlms.xla_memory, fn, *variant_abstract, target=target)
            row[key] = {**_memory_entry(memory, seconds), **extra}
            print(f"  {key:<24} peak {memory.peak_bytes / GIB:8.2f} GiB, host "
                  f"{memory.host_bytes / GIB:8.2f} GiB, compiled in {seconds:.1f} s", flush=True)
        except Exception as exception:  # recorded, so one failure keeps the rest
            row[key] = {**_error(exception), **extra}
            print(f"  {key:<24} FAILED: {row[key]['error'].splitlines()[-1]}", flush=True)

    compile_variant("jit", jax.jit(case.step), abstract)
    # TFLMS's rules with the knobs that were jlms's defaults before budgets:
    # the column stays comparable with earlier runs of this table.
    offloaded = jlms.offload(case.step, **models.TFLMS_KNOBS)
    try:
        plan, row["plan_seconds"] = _timed(offloaded.plan, *abstract)
        compile_variant("jlms", offloaded, abstract, **_plan_figures(plan))
    except Exception as exception:
        row["jlms"] = _error(exception)
        print(f"  jlms FAILED: {row['jlms']['error'].splitlines()[-1]}", flush=True)
    if budget is not None:
        try:
            budget_bytes = budget_in_bytes(budget, row["jit"].get("peak_bytes"))
            budgeted = jlms.offload(case.step, budget=budget_bytes, target=target)
            plan, seconds = _timed(budgeted.plan, *abstract)
            compile_variant("jlms_budget", budgeted, abstract, budget=budget,
                            budget_bytes=budget_bytes, plan_seconds=seconds,
                            **_plan_figures(plan))
        except Exception as exception:
            row["jlms_budget"] = {**_error(exception), "budget": budget}
            print(f"  jlms_budget FAILED: {row['jlms_budget']['error'].splitlines()[-1]}", flush=True)
    for remat in ("nothing_saveable", "offload"):
        key = f"remat_{remat}"
        try:
            variant = _build(name, size, batch_size, remat)
            variant_abstract = variant.abstract_args()
            compile_variant(key, jax.jit(variant.step), variant_abstract,
                            flops=_flops(variant.step, variant_abstract))
        except Exception as exception:
            row[key] = _error(exception)
    if hardware is not None:
        _add_predictions(row, hardware)
    if target == "local" and steps > 0:
        row["measured"] = run_steps(case, steps)
    return row


def _plan_figures(plan) -> dict:
    return {
        "offloaded_values": len(plan.offloaded),
        "offloaded_bytes": plan.offloaded_bytes,
        "host_traffic_bytes": plan.host_traffic_bytes,
        "predicted_peak_bytes": plan.predicted_peak_bytes,
        "xla_peak_bytes_of_search": plan.xla_peak_bytes,
        "recomputed_values": len(plan.recomputed),
        "jlms_predicted_step_ms": plan.step_time.total_s * 1e3,
        "jlms_predicted_jit_step_ms": plan.baseline_step_time.total_s * 1e3,
    }


def moved_bytes(row: dict, key: str) -> float:
    """Bytes the variant moves between device and host in one step (see the
    module docstring)."""
    entry = row[key]
    twice_host = 2 * entry["host_bytes"]
    return max(twice_host, entry.get("host_traffic_bytes", 0))


def _add_predictions(row: dict, hardware: Hardware) -> None:
    for key in _VARIANTS:
        entry = row.get(key)
        if entry is None or "error" in entry:
            continue
        flops = entry.get("flops", row["flops"])
        entry["moved_bytes"] = moved_bytes(row, key)
        entry["predicted"] = hardware.predict(flops, entry["moved_bytes"])


def run_steps(case, steps: int) -> dict:
    """Median wall time of `steps` steps (after one to compile) under jax.jit
    and under jlms.offload on the local device, and its allocator's figures."""
    import jax

    import jlms
    from benchmarks import models

    result = {"backend": jax.default_backend(), "steps": steps}
    args = case.make_args()
    for key, step in (("jit", jax.jit(case.step)), ("jlms", jlms.offload(case.step, **models.TFLMS_KNOBS))):
        try:
            state, data = args, ()
            times = []
            for index in range(steps + 1):
                start = time.perf_counter()
                outputs = step(*state, *data)
                jax.block_until_ready(outputs)
                if index:
                    times.append(time.perf_counter() - start)
                # The step returns (state, loss); the batch is reused.
                data = args[len(outputs[0]):]
                state = outputs[0]
            stats = jlms.memory_stats()
            result[key] = {"median_step_ms": 1e3 * statistics.median(times),
                           "loss": float(outputs[1]), "memory_stats": _stats_dict(stats)}
            print(f"  measured {key:<5} {result[key]['median_step_ms']:9.1f} ms/step  {stats}",
                  flush=True)
        except Exception as exception:
            result[key] = _error(exception)
            print(f"  measured {key} FAILED: {result[key]['error'].splitlines()[-1]}", flush=True)
    return result


def _stats_dict(stats) -> dict:
    values = stats.as_dict()
    values.pop("raw", None)
    return values


# --- the largest size that fits ---------------------------------------------------


def _peak_bytes(name, variant, size, batch_size, target) -> tuple[int, int, float]:
    """XLA's device peak and host bytes of one probe, and its compile seconds."""
    import jax

    import jlms
    from benchmarks import models

    case = _build(name, size, batch_size)
    step = jax.jit(case.step) if variant == "jit" else jlms.offload(case.step, **models.TFLMS_KNOBS)
    memory, seconds = _timed(jlms.xla_memory, step, *case.abstract_args(), target=target)
    return memory.peak_bytes, memory.host_bytes, seconds


def find_max(name: str, dimension: str, size: int, batch_size: int, target: str,
             budget_bytes: int, variant: str, max_probes: int) -> dict:
    """The largest image size (or batch size) whose XLA device peak under
    `variant` ("jit" or "jlms") fits in `budget_bytes`: doubling, then
    bisection down to the model's size step, at most `max_probes` compiles."""
    from benchmarks import models

    step_size = models.ZOO[name].size_multiple if dimension == "image-size" else 1
    probes = []

    def fits(value) -> bool:
        sizes = (value, batch_size) if dimension == "image-size" else (size, value)
        try:
            peak, host, seconds = _peak_bytes(name, variant, *sizes, target)
            probe = {"value": value, "peak_bytes": peak, "host_bytes": host,
                     "compile_seconds": seconds, "fits": peak <= budget_bytes}
            print(f"  probe {variant:<4} {dimension} {value:>6}: peak {peak / GIB:8.2f} GiB, "
                  f"host {host / GIB:8.2f} GiB ({seconds:.0f} s) -> "
                  f"{'fits' if probe['fits'] else 'too big'}", flush=True)
        except Exception as exception:  # a program XLA cannot build does not fit
            probe = {"value": value, "fits": False, **_error(exception)}
            print(f"  probe {variant:<4} {dimension} {value:>6}: FAILED "
                  f"{probe['error'].splitlines()[-1][:200]}", flush=True)
        probes.append(probe)
        return probe["fits"]

    def probes_left():
        return len(probes) < max_probes

    start = size if dimension == "image-size" else batch_size
    largest_fit, smallest_miss = None, None
    value = max(step_size, start - start % step_size)
    # Down from the start while it does not fit, then up by doubling.
    while probes_left() and largest_fit is None:
        if fits(value):
            largest_fit = value
        else:
            smallest_miss = value
            if value == step_size:
                break
            value = max(step_size, (value // 2) - (value // 2) % step_size)
    while probes_left() and largest_fit is not None and smallest_miss is None:
        value = 2 * largest_fit
        if fits(value):
            largest_fit = value
        else:
            smallest_miss = value
    while (probes_left() and largest_fit is not None and smallest_miss is not None
           and smallest_miss - largest_fit > step_size):
        middle = (largest_fit + smallest_miss) // 2
        middle -= middle % step_size
        if fits(middle):
            largest_fit = middle
        else:
            smallest_miss = middle
    exact = (largest_fit is not None and smallest_miss is not None
             and smallest_miss - largest_fit <= step_size)
    best = max((p for p in probes if p["fits"]), key=lambda p: p["value"], default=None)
    return {"variant": variant, "largest_fit": largest_fit, "smallest_miss": smallest_miss,
            "exact": exact, "capped": not exact and not probes_left(),
            "peak_bytes_at_largest": best and best["peak_bytes"],
            "host_bytes_at_largest": best and best["host_bytes"],
            "probes": probes}


def find_max_both(name, dimension, size, batch_size, target, budget, max_probes) -> dict:
    budget_bytes = parse_bytes(budget)
    print(f"\n== largest {dimension} of {name} under {budget} on {target} "
          f"(batch {batch_size}) ==", flush=True)
    results = {variant: find_max(name, dimension, size, batch_size, target, budget_bytes,
                                 variant, max_probes)
               for variant in ("jit", "jlms")}
    jit_max, jlms_max = results["jit"]["largest_fit"], results["jlms"]["largest_fit"]
    multiplier = jlms_max / jit_max if jit_max and jlms_max else None
    return {"model": name, "dimension": dimension, "target": target, "budget": budget,
            "budget_bytes": budget_bytes, "batch_size": batch_size, "size": size,
            "max_probes": max_probes, "multiplier": multiplier, **results}


# --- printing ---------------------------------------------------------------------------


def _gib(entry: dict | None, field: str = "peak_bytes") -> str:
    if entry is None:
        return "-"
    if "error" in entry:
        return "error"
    return f"{entry[field] / GIB:.2f}"


def _ms(entry: dict | None, field: str) -> str:
    if entry is None or "predicted" not in entry:
        return "-"
    return f"{entry['predicted'][field]:.1f}"


def memory_table(rows: list[dict]) -> list[str]:
    header = ("| model | jax.jit | jlms | jlms host | jlms budget | remat nothing_saveable "
              "| remat offload | remat offload host | trace s | plan s | jit compile s |")
    lines = [header, "|---" * (header.count("|") - 1) + "|"]
    for row in rows:
        jlms_entry = row.get("jlms")
        ratio = ""
        if jlms_entry and "error" not in jlms_entry and "error" not in row["jit"]:
            ratio = f" ({jlms_entry['peak_bytes'] / row['jit']['peak_bytes']:.2f}x)"
        budget = row.get("jlms_budget")
        budget_text = _gib(budget)
        if budget and "budget" in budget:
            budget_text += f" ({budget['budget']})"
        jit_compile = row["jit"].get("compile_seconds")
        lines.append(
            f"| {row['case']} | {_gib(row['jit'])} | {_gib(jlms_entry)}{ratio} "
            f"| {_gib(jlms_entry, 'host_bytes')} | {budget_text} "
            f"| {_gib(row.get('remat_nothing_saveable'))} | {_gib(row.get('remat_offload'))} "
            f"| {_gib(row.get('remat_offload'), 'host_bytes')} | {row['trace_seconds']:.1f} "
            f"| {row.get('plan_seconds', float('nan')):.1f} "
            f"| {'-' if jit_compile is None else f'{jit_compile:.0f}'} |")
    return lines


def time_table(rows: list[dict]) -> list[str]:
    header = ("| model | GFLOP | jax.jit ms | jlms moved GiB | jlms ms overlapped / serial "
              "| jlms ms on C2C, serial | jlms budget moved GiB | jlms budget ms overlapped / "
              "serial | remat nothing_saveable ms | remat offload moved GiB "
              "| remat offload ms overlapped / serial |")
    lines = [header, "|---" * (header.count("|") - 1) + "|"]
    for row in rows:
        jlms_entry = row.get("jlms") or {}
        budgeted = row.get("jlms_budget") or {}
        offload = row.get("remat_offload") or {}
        lines.append(
            f"| {row['case']} | {row['flops'] / 1e9:.0f} | {_ms(row['jit'], 'compute_ms')} "
            f"| {_gib(jlms_entry, 'moved_bytes') if 'moved_bytes' in jlms_entry else '-'} "
            f"| {_ms(jlms_entry, 'overlapped_ms')} / {_ms(jlms_entry, 'serial_ms')} "
            f"| {_ms(jlms_entry, 'c2c_serial_ms')} "
            f"| {_gib(budgeted, 'moved_bytes') if 'moved_bytes' in budgeted else '-'} "
            f"| {_ms(budgeted, 'overlapped_ms')} / {_ms(budgeted, 'serial_ms')} "
            f"| {_ms(row.get('remat_nothing_saveable'), 'compute_ms')} "
            f"| {_gib(offload, 'moved_bytes') if 'moved_bytes' in offload else '-'} "
            f"| {_ms(offload, 'overlapped_ms')} / {_ms(offload, 'serial_ms')} |")
    return lines


def find_max_table(searches: list[dict]) -> list[str]:
    header = ("| model | dimension | batch | budget | jax.jit largest | jlms largest "
              "| multiplier | jlms host GiB at largest | compiles (jit, jlms) | note |")
    lines = [header, "|---" * (header.count("|") - 1) + "|"]
    for search in searches:
        jit, off = search["jit"], search["jlms"]

        def largest(result):
            if result["largest_fit"] is None:
                return "none"
            bound = "" if result["exact"] else f" (< {result['smallest_miss']})" \
                if result["smallest_miss"] else " (no upper bound found)"
            return f"{result['largest_fit']}{bound}"

        host = off["host_bytes_at_largest"]
        notes = [f"{v} capped at {search['max_probes']} compiles"
                 for v, r in (("jit", jit), ("jlms", off)) if r["capped"]]
        multiplier = search["multiplier"]
        lines.append(
            f"| {search['model']} | {search['dimension']} | {search['batch_size']} "
            f"| {search['budget']} | {largest(jit)} | {largest(off)} "
            f"| {'-' if multiplier is None else f'{multiplier:.2f}x'} "
            f"| {'-' if host is None else f'{host / GIB:.1f}'} "
            f"| {len(jit['probes'])}, {len(off['probes'])} | {'; '.join(notes)} |")
    return lines


def measured_table(rows: list[dict]) -> list[str]:
    header = ("| model | backend | steps | jax.jit ms/step | jlms ms/step "
              "| jax.jit peak in use GiB | jlms peak in use GiB |")
    lines = [header, "|---" * (header.count("|") - 1) + "|"]
    for row in rows:
        measured = row["measured"]

        def cell(key, field):
            entry = measured.get(key, {})
            if "error" in entry:
                return "error"
            if field == "median_step_ms":
                return f"{entry[field]:.1f}"
            value = entry["memory_stats"]["peak_bytes_in_use"]
            return "not reported" if value is None else f"{value / GIB:.2f}"

        lines.append(
            f"| {row['case']} | {measured['backend']} | {measured['steps']} "
            f"| {cell('jit', 'median_step_ms')} | {cell('jlms', 'median_step_ms')} "
            f"| {cell('jit', 'peak')} | {cell('jlms', 'peak')} |")
    return lines


def markdown(result: dict) -> str:
    """The figures of `result` (as written to JSON) as markdown tables."""
    assumptions = result.get("hardware")
    parts = [f"# Model zoo on {result['target']}: XLA device memory, deviceless",
             "",
             "Written by `python -m benchmarks.many_models`; every memory figure is XLA's "
             "`memory_analysis()` of the compiled step (GiB, device peak = arguments + "
             "outputs - aliased + temporaries). \"jlms\" is `jlms.offload(step)` with default "
             "knobs; \"remat\" columns put every block under `nn.remat` with "
             "`nothing_saveable`, or with MaxText's offload policy (block inputs to pinned "
             "host). Seconds are wall time on the machine that ran the script."]
    rows = list(result.get("models", {}).values())
    if rows:
        parts += ["", "## Device peak (GiB)", "", *memory_table(rows)]
        if assumptions:
            parts += ["", "## Predicted step time (ms), transfer model", "",
                      f"Compute at {assumptions['flops_per_second'] / 1e12:.1f} TFLOP/s "
                      f"({assumptions['gpu']} FP32 FMA peak), host link "
                      f"{assumptions['link']} at {assumptions['link_bytes_per_second'] / 1e9:.0f} "
                      f"GB/s; C2C: {_NVLINK_C2C_BYTES_PER_SECOND / 1e9:.0f} GB/s. Overlapped: "
                      "max(compute, transfer); serial: compute + transfer. See the module "
                      "docstring of `benchmarks/many_models.py`.", "", *time_table(rows)]
        measured = [row for row in rows if "measured" in row]
        if measured:
            parts += ["", "## Measured on this machine", "", *measured_table(measured)]
        errors = [(row["case"], key, row[key]["error"].splitlines()[-1])
                  for row in rows for key in _VARIANTS if key in row and "error" in row[key]]
        if errors:
            parts += ["", "Failures:", ""]
            parts += [f"- {case} / {key}: `{message[:300]}`" for case, key, message in errors]
    searches = list(result.get("find_max", {}).values())
    if searches:
        parts += ["", "## Largest size under a device budget", "",
                  "Doubling then bisection on XLA's device peak of each probe (deviceless "
                  "compile, default jlms knobs); the multiplier is jlms's largest over "
                  "jax.jit's (a ratio of side lengths for image sizes). Both figures include "
                  "XLA's own rematerialisation, which the GPU compiler applies to any program "
                  "above its memory limit.", ""]
        if result["target"] in _GPU_TARGETS:
            memory = int(_target_field(result["target"], "device_memory_size"))
            parts += [f"The {result['target']} target's device memory is "
                      f"{memory / GIB:.1f} GiB.", ""]
        parts += find_max_table(searches)
        failed = [(search["model"], variant, probe)
                  for search in searches for variant in ("jit", "jlms")
                  for probe in search[variant]["probes"] if "error" in probe]
        if failed:
            parts += ["", "Probes XLA could not compile (counted as not fitting):", ""]
            parts += [f"- {model} / {variant} at {probe['value']}: "
                      f"`{probe['error'].splitlines()[-1][:300]}`"
                      for model, variant, probe in failed]
    return "\n".join(parts) + "\n"


def render_markdown(json_path: str, markdown_path: str) -> None:
    """Rewrites `markdown_path` from the figures in `json_path`."""
    with open(json_path) as f:
        result = json.load(f)
    with open(markdown_path, "w") as f:
        f.write(markdown(result))


def print_rows(rows: list[dict]) -> None:
    print()
    print("\n".join(memory_table(rows)))
    if any("predicted" in (row.get("jit") or {}) for row in rows):
        print()
        print("\n".join(time_table(rows)))
    measured = [row for row in rows if "measured" in row]
    if measured:
        print()
        print("\n".join(measured_table(measured)))


# --- command line -------------------------------------------------------------------------


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="all", choices=["all", *DEFAULT_SIZES])
    parser.add_argument("--image-size", type=int, default=None,
                        help="image or cube side, sequence length for gpt (default: per model)")
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--target", default="h100", choices=["h100", "h200", "a100", "local"])
    parser.add_argument("--budget", default=None,
                        help="device budget: for the table, jlms.offload(budget=...) with "
                             "20GiB, 90%% (of the target's memory) or 0.5x (of jax.jit's "
                             "peak); for --find-max, the limit in bytes (80GiB)")
    parser.add_argument("--find-max", choices=["image-size", "batch-size"], default=None)
    parser.add_argument("--max-probes", type=int, default=12,
                        help="compiles per variant in --find-max")
    parser.add_argument("--steps", type=int, default=3, help="steps run with --target local")
    parser.add_argument("--tflops", type=float, default=None, help="compute rate of the model")
    parser.add_argument("--link-gbps", type=float, default=None, help="host link of the model")
    parser.add_argument("--json", default=None, help="write the figures here")
    parser.add_argument("--merge", action="store_true",
                        help="merge into the figures already in --json (same model or search "
                             "replaced) instead of overwriting them")
    parser.add_argument("--markdown", default=None,
                        help="write the figures (merged ones included) as markdown tables")
    options = parser.parse_args(argv)
    if options.target != "local":
        # Deviceless compiles need the CPU platform chosen before jax is
        # imported; a local GPU must stay visible.
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from benchmarks._output import write_json

    names = list(DEFAULT_SIZES) if options.model == "all" else [options.model]
    if options.find_max and options.budget is None:
        parser.error("--find-max needs --budget")
    hardware = hardware_for(options.target, options.tflops, options.link_gbps)

    result = {"target": options.target, "models": {}, "find_max": {},
              "hardware": None if hardware is None else dataclasses.asdict(hardware)}
    if options.merge and options.json and os.path.exists(options.json):
        with open(options.json) as f:
            previous = json.load(f)
        if previous.get("target") != options.target:
            parser.error(f"{options.json} holds figures for {previous.get('target')}, "
                         f"not {options.target}")
        result["models"].update(previous.get("models", {}))
        result["find_max"].update(previous.get("find_max", {}))
    for name in names:
        default_size, default_batch = DEFAULT_SIZES[name]
        size = options.image_size or default_size
        batch_size = options.batch_size or default_batch
        if options.find_max:
            search = find_max_both(name, options.find_max, size, batch_size, options.target,
                                   options.budget, options.max_probes)
            key = f"{name}-{options.find_max}-b{batch_size}-{options.budget}"
            result["find_max"][key] = search
            print("\n" + "\n".join(find_max_table([search])))
        else:
            row = measure_model(name, size, batch_size, options.target, options.budget,
                                hardware, options.steps)
            result["models"][row["case"]] = row
    if not options.find_max:
        print_rows([row for row in result["models"].values()
                    if row["model"] in names])
    write_json(options.json, result)
    if options.markdown:
        with open(options.markdown, "w") as f:
            f.write(markdown(result))
    return result


if __name__ == "__main__":
    main()
