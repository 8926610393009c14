"""A full AdamW fine-tune of an 8B Llama on one H100, planned deviceless.

    JAX_PLATFORMS=cpu python -m benchmarks.llama_8b [--layers 32]
                                                    [--host-budget 120GiB]
                                                    [--json PATH]

Hugging Face `transformers`' `FlaxLlamaForCausalLM` (a pinned 4.x) at
Llama-3-8B's configuration (32 layers, width 4096, 32 heads, 8 key/value
heads, MLP 14336, vocabulary 128256, rope theta 500000), its parameters in
float32 and its compute in bfloat16 (`dtype=jnp.bfloat16`), AdamW, batch 1
x sequence 4096, the state donated. Plain `jlms.offload(step,
donate_argnums=(0,), host_budget=...)` with the arguments on an H100's
devices (the target is taken from them).

One row: planning seconds, XLA's device peak and host bytes of the program
that runs, the plan's state on host, jlms's predicted step time, the
schedule model of XLA's program (`../shared/tools/step_time.py`), its link
floor (the larger direction's bytes at 55 GB/s), and model FLOPs
utilisation (6 x parameters x tokens per step, at the H100's bfloat16
dense peak, 989.4 TFLOP/s) by the schedule model's time. Planning takes
about 12 minutes on a 2-core machine; not part of CI.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import pathlib
import time

import jax
import jax.numpy as jnp

import jlms
from benchmarks import real_models
from benchmarks._output import write_json
from benchmarks.frontier import load_yardstick

DEFAULT_JSON = (pathlib.Path(__file__).parent / "results"
                / "llama_8b_h100.json")
BATCH, SEQUENCE = 1, 4096
# The H100's dense bfloat16 tensor-core peak (NVIDIA's datasheet).
PEAK_FLOPS = 989.4e12
# What the schedule model takes the host link to move each way.
LINK_BYTES_PER_S = 55e9


def llama_8b_step(layers: int):
  """(step, abstract args on an H100, parameter count)."""
  from transformers import FlaxLlamaForCausalLM, LlamaConfig
  config = LlamaConfig(vocab_size=128256, hidden_size=4096,
                       intermediate_size=14336, num_hidden_layers=layers,
                       num_attention_heads=32, num_key_value_heads=8,
                       max_position_embeddings=SEQUENCE, rope_theta=500000.0)
  model = FlaxLlamaForCausalLM(config, dtype=jnp.bfloat16, _do_init=False)
  optimizer = real_models._adamw()
  step = real_models._causal_lm_step(model, optimizer, dropout=False)
  make_args = real_models._causal_lm_args(model, optimizer, BATCH, SEQUENCE,
                                          config.vocab_size)
  sharding = jax.sharding.SingleDeviceSharding(jlms.target_devices("h100")[0])
  args = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
      jax.eval_shape(make_args))
  parameters = sum(x.size for x in jax.tree.leaves(args[0][0]))
  return step, args, parameters


def measure(layers: int, host_budget: str) -> dict:
  step, args, parameters = llama_8b_step(layers)
  offloaded = jlms.offload(step, donate_argnums=(0,), host_budget=host_budget)
  start = time.perf_counter()
  plan = offloaded.plan(*args)
  planning_s = time.perf_counter() - start
  memory = jlms.xla_memory(offloaded, *args, target="h100")
  schedule = load_yardstick().estimate(memory.hlo_text)
  link_floor_ms = (max(schedule["d2h_mib"], schedule["h2d_mib"]) * 2**20
                   / LINK_BYTES_PER_S * 1e3)
  flops = 6 * parameters * BATCH * SEQUENCE
  predicted = plan.step_time
  return {
      "layers": layers, "parameters": parameters,
      "planning_s": round(planning_s, 1),
      "peak_gib": round(memory.peak_bytes / 2**30, 2),
      "host_argument_gib": round(memory.host_argument_bytes / 2**30, 2),
      "host_temp_gib": round(memory.host_temp_bytes / 2**30, 2),
      "state_leaves_on_host": plan.state_leaves,
      "state_host_gib": round(plan.state_host_bytes / 2**30, 2),
      "predicted_ms": round(predicted.total_s * 1e3, 1),
      "predicted_exposed_copy_ms": round(predicted.exposed_transfer_s * 1e3,
                                         1),
      "schedule_ms": round(schedule["total_ms"], 1),
      "schedule_compute_ms": round(schedule["compute_ms"], 1),
      "schedule_exposed_copy_ms": round(schedule["exposed_copy_ms"], 1),
      "d2h_gib": round(schedule["d2h_mib"] / 1024, 2),
      "h2d_gib": round(schedule["h2d_mib"] / 1024, 2),
      "link_floor_ms": round(link_floor_ms, 1),
      "ratio_to_floor": round(schedule["total_ms"] / max(
          schedule["compute_ms"], link_floor_ms), 2),
      "tokens_per_s": round(BATCH * SEQUENCE / (schedule["total_ms"] / 1e3),
                            1),
      "mfu": round(flops / (schedule["total_ms"] / 1e3) / PEAK_FLOPS, 3),
  }


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--layers", type=int, default=32)
  parser.add_argument("--host-budget", default="120GiB")
  parser.add_argument("--json", default=str(DEFAULT_JSON))
  options = parser.parse_args(argv)
  row = measure(options.layers, options.host_budget)
  for key, value in row.items():
    print(f"{key:28s} {value}")
  result = {"target": "h100", "jax": jax.__version__,
            "host_budget": options.host_budget, "rows": [row]}
  write_json(options.json, result)
  return result


if __name__ == "__main__":
  main()
