"""A full AdamW fine-tune of a Llama-3 on H100s, planned deviceless: the
8B on one GPU, the 70B on the eight of one node.

    JAX_PLATFORMS=cpu python -m benchmarks.llama_finetune [--size 8b|70b]
        [--layers N] [--batch B ...] [--host-budget 120GiB]
        [--budget 74GiB] [--accumulate K] [--json PATH]

Hugging Face `transformers`' `FlaxLlamaForCausalLM` (a pinned 4.x) at
Llama-3-8B's configuration (32 layers, width 4096, 32 heads, 8 key/value
heads, MLP 14336) or Llama-3-70B's (80 layers, width 8192, 64 heads, 8
key/value heads, MLP 28672), vocabulary 128256, rope theta 500000; its
parameters in float32 and its compute in bfloat16 (`dtype=jnp.bfloat16`),
AdamW, sequence 4096, the state donated. Plain `jlms.offload(step,
donate_argnums=(0,), host_budget=...)` with the arguments on H100 devices
(the target is taken from them):

- 8b: batch 1 on one H100;
- 70b: batch 8 over a 1x1x8 H100 topology, FSDP-style: every state leaf
  split over the eight devices along its largest axis, the batch along its
  rows, the mesh axis Auto (`benchmarks.sharded.shard_step_args`). The
  host budget is one GPU's pinned pool (XLA keeps one per GPU): 240 GiB,
  a 2 TiB node's eighth less 128 GiB for the processes.

One row per batch asked for (the one with the most tokens per second
marked "best"), per device: planning seconds, XLA's device peak and host
bytes of the program that runs, the plan's state on host, jlms's
predicted step time (as planned, and with the schedule model's constants:
`benchmarks._predicted`), the schedule model of XLA's program
(`../shared/tools/step_time.py`) and, for several devices, with their
exchanges on NVLink beside the kernels (`benchmarks.sharded_time`), the
link floor (the larger direction's bytes at 55 GB/s, each GPU on its own
link), tokens per second of the whole step and model FLOPs utilisation (6
x parameters x tokens per step, shared by the devices, at the H100's
bfloat16 dense peak, 989.4 TFLOP/s) by the schedule model's time. The 8B
plans in about 10 minutes on a 2-core machine; not part of CI.

`--budget` plans for that many bytes a device by jlms's simulator alone,
where the default (the device's memory) has XLA confirm each plan, a
compile of 5 to 12 minutes for the 70B on two cores; XLA's bytes of the
plan are measured and reported either way. The 70B's simulator misses
XLA's peak by 4 to 5 GiB a device (the logits, which XLA keeps for the
loss until the step's end, and a layer's attention temporaries):
`--size 70b --budget 74GiB` gave a plan at 78.78 GiB, inside an 80 GB
H100 (2026-12-03; 74.5GiB gave 79.38).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import pathlib
import time

import jax
import jax.numpy as jnp
from jax.sharding import AxisType

import jlms
from benchmarks import real_models
from benchmarks._output import write_json
from benchmarks._predicted import (prediction_columns, relative_error,
                                   schedule_columns)
from benchmarks.frontier import load_yardstick
from benchmarks.sharded import mesh_of, on_one_device, shard_step_args
from jlms._collectives import collective_bytes
from jlms._cost import time_target

RESULTS = pathlib.Path(__file__).parent / "results"
SEQUENCE = 4096
TARGET = "h100"
# The H100's dense bfloat16 tensor-core peak (NVIDIA's datasheet).
PEAK_FLOPS = 989.4e12

#: Llama-3's configurations (Meta's published config.json of each), with
#: the batch, the GPUs and the host budget of each run.
SIZES = {
    "8b": dict(config=dict(hidden_size=4096, intermediate_size=14336,
                           num_hidden_layers=32, num_attention_heads=32),
               batch=1, devices=1, host_budget="120GiB",
               json="llama_8b_h100.json"),
    "70b": dict(config=dict(hidden_size=8192, intermediate_size=28672,
                            num_hidden_layers=80, num_attention_heads=64),
                batch=8, devices=8, host_budget="240GiB",  # per GPU
                json="llama_70b_h100x8.json"),
}


def llama_step(size: str, layers: int | None = None, batch: int | None = None,
               accumulate: int = 1):
  """(step, abstract args on H100 devices, parameter count, batch,
  devices). `accumulate` > 1: the step adds up the gradients of that many
  microbatches of `batch` rows each by `jax.lax.scan`, then updates once
  (its batch is `accumulate * batch`)."""
  from transformers import FlaxLlamaForCausalLM, LlamaConfig
  spec = SIZES[size]
  shape = dict(spec["config"])
  if layers is not None:
    shape["num_hidden_layers"] = layers
  batch = spec["batch"] if batch is None else batch
  config = LlamaConfig(vocab_size=128256, num_key_value_heads=8,
                       max_position_embeddings=SEQUENCE, rope_theta=500000.0,
                       **shape)
  model = FlaxLlamaForCausalLM(config, dtype=jnp.bfloat16, _do_init=False)
  optimizer = real_models._adamw()
  if accumulate > 1:
    step = real_models._causal_lm_accumulating_step(model, optimizer,
                                                    accumulate)
    batch *= accumulate
  else:
    step = real_models._causal_lm_step(model, optimizer, dropout=False)
  make_args = real_models._causal_lm_args(model, optimizer, batch, SEQUENCE,
                                          config.vocab_size)
  abstract = jax.eval_shape(make_args)
  devices = spec["devices"]
  if devices == 1:
    args = on_one_device(abstract, TARGET)
  else:
    mesh = mesh_of(jlms.target_devices(TARGET, f"1x1x{devices}"),
                   AxisType.Auto)
    args = shard_step_args(abstract, mesh, batch_args=1, fsdp=True)
  parameters = sum(x.size for x in jax.tree.leaves(abstract[0][0]))
  return step, args, parameters, batch, devices


def measure(size: str, layers: int | None, batch: int | None,
            host_budget: str, budget: str | None = None,
            accumulate: int = 1) -> dict:
  step, args, parameters, batch, devices = llama_step(size, layers, batch,
                                                      accumulate)
  offloaded = jlms.offload(step, donate_argnums=(0,), host_budget=host_budget,
                           **({} if budget is None else {"budget": budget}))
  start = time.perf_counter()
  plan = offloaded.plan(*args)
  planning_s = time.perf_counter() - start
  memory = jlms.xla_memory(offloaded, *args, target=TARGET)
  schedule = schedule_columns(load_yardstick().estimate(memory.hlo_text))
  schedule_ms = schedule["schedule_ms"]
  row = {"size": size, "devices": devices, "batch": batch,
         "microbatches": accumulate, "sequence": SEQUENCE,
         "parameters": parameters,
         "planning_s": round(planning_s, 1),
         "peak_gib": round(memory.peak_bytes / 2**30, 2),
         "host_argument_gib": round(memory.host_argument_bytes / 2**30, 2),
         "host_temp_gib": round(memory.host_temp_bytes / 2**30, 2),
         "state_leaves_on_host": plan.state_leaves,
         "state_host_gib": round(plan.state_host_bytes / 2**30, 2),
         **prediction_columns(plan), **schedule}
  if devices > 1:
    exchanged = collective_bytes(memory.hlo_text, devices)
    nvlink_ms = exchanged / time_target(TARGET).interconnect_bytes_per_s * 1e3
    row.update(exchanged_gib=round(exchanged / 2**30, 2),
               nvlink_ms=round(nvlink_ms, 1),
               schedule_nvlink_ms=round(max(schedule_ms, nvlink_ms), 1))
    schedule_ms = max(schedule_ms, nvlink_ms)
  flops_per_device = 6 * parameters * batch * SEQUENCE / devices
  row.update({
      "error": relative_error(row["predicted_ms"], schedule_ms),
      "roofline_error": relative_error(row["roofline_predicted_ms"],
                                       schedule_ms),
      "ratio_to_floor": round(schedule_ms / max(
          schedule["schedule_compute_ms"], schedule["link_floor_ms"]), 2),
      "tokens_per_s": round(batch * SEQUENCE / (schedule_ms / 1e3), 1),
      "mfu": round(flops_per_device / (schedule_ms / 1e3) / PEAK_FLOPS, 3),
  })
  return row


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--size", choices=sorted(SIZES), default="8b")
  parser.add_argument("--layers", type=int, default=None,
                      help="fewer layers than the size's own")
  parser.add_argument("--batch", type=int, nargs="+", default=None,
                      help="batches to plan, one row each; the best for "
                           "throughput is marked (default: the size's)")
  parser.add_argument("--host-budget", default=None)
  parser.add_argument("--budget", default=None,
                      help="plan for these bytes a device by jlms's "
                           "simulator alone (\"74GiB\"), instead of the "
                           "device's memory confirmed by XLA; XLA's bytes "
                           "are measured and reported either way")
  parser.add_argument("--accumulate", type=int, default=1,
                      help="microbatches of each --batch a step adds up "
                           "the gradients of (by jax.lax.scan) before one "
                           "update; its batch is that many times larger")
  parser.add_argument("--json", default=None)
  options = parser.parse_args(argv)
  spec = SIZES[options.size]
  host_budget = options.host_budget or spec["host_budget"]
  rows = []
  for batch in options.batch or [None]:
    try:
      rows.append(measure(options.size, options.layers, batch, host_budget,
                          options.budget, options.accumulate))
    except jlms.BudgetError as error:  # this batch does not fit
      rows.append({"size": options.size, "batch": batch,
                   "error": str(error).splitlines()[0]})
  fitting = [row for row in rows if "tokens_per_s" in row]
  if fitting:
    max(fitting, key=lambda row: row["tokens_per_s"])["best"] = True
  for row in rows:
    print()
    for key, value in row.items():
      print(f"{key:36s} {value}")
  result = {"target": TARGET, "jax": jax.__version__,
            "host_budget": host_budget, "budget": options.budget,
            "rows": rows}
  write_json(options.json or str(RESULTS / spec["json"]), result)
  return result


if __name__ == "__main__":
  main()
