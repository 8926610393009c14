"""Per-device XLA memory of a sharded train step, jax.jit against jlms.offload.

    python -m benchmarks.sharded [--target h100] [--topology 1x1x8]
                                 [--batch 64] [--budget 4GiB] [--json PATH]

The 16-block BatchNorm ResNet (64 channels, 256x256, adam) with a global
batch of 64 split over the GPUs of `--topology`, compiled by XLA without a
GPU, two ways:

- data parallel: the state (parameters, batch statistics, adam moments)
  replicated, the batch split over the mesh; the mesh axis is explicit
  (`jax.make_mesh`'s default), so the step's values carry their shardings;
- FSDP-style: the same, and every state leaf split along its largest axis
  that the mesh divides; the axis is Auto, XLA all-gathers the parameters
  where they are read and reduce-scatters their gradients.

Every figure is XLA's `memory_analysis()` of one device's program. The
budget rows ask `jlms.offload(step, budget=..., target=...)` for a
per-device budget and report XLA's per-device peak of what it chose.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import time

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

import jlms
from benchmarks import models
from benchmarks._output import write_json

MIB = 1 << 20
AXIS = "data"


def mesh_of(devices, axis_type=AxisType.Explicit) -> Mesh:
  """A one-axis mesh named "data" over `devices`."""
  return Mesh(np.array(devices), (AXIS,), axis_types=(axis_type,))


def _place(leaf, sharding):
  if isinstance(leaf, jax.ShapeDtypeStruct):
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
  return jax.device_put(leaf, sharding)


def on_one_device(abstract, target: str):
  """`abstract`, a pytree of `ShapeDtypeStruct`s, placed on the first
  device of `target`'s compile-only topology, so that jlms takes the target
  and the device's budget from the arguments."""
  sharding = jax.sharding.SingleDeviceSharding(jlms.target_devices(target)[0])
  return jax.tree.map(lambda leaf: _place(leaf, sharding), abstract)


def _fsdp_spec(shape, size: int) -> PartitionSpec:
  """Split the largest axis `size` divides; replicate when none is."""
  axes = [i for i, n in enumerate(shape) if n % size == 0 and n >= size]
  spec = [None] * len(shape)
  if axes:
    spec[max(axes, key=lambda i: shape[i])] = AXIS
  return PartitionSpec(*spec)


def shard_step_args(args: tuple, mesh: Mesh, *, batch_args: int = 2,
                    fsdp: bool = False) -> tuple:
  """The step's arguments placed on `mesh`: the last `batch_args` split
  along their leading (batch) axis, the state before them replicated, or
  with `fsdp` split leaf by leaf (`_fsdp_spec`). Arrays are moved with
  `jax.device_put`; `ShapeDtypeStruct`s get the sharding."""
  size = mesh.shape[AXIS]
  state, batch = args[:len(args) - batch_args], args[len(args) - batch_args:]

  def state_leaf(leaf):
    spec = _fsdp_spec(leaf.shape, size) if fsdp else PartitionSpec()
    return _place(leaf, NamedSharding(mesh, spec))

  def batch_leaf(leaf):
    return _place(leaf, NamedSharding(mesh, PartitionSpec(AXIS)))

  return (*jax.tree.map(state_leaf, state), *jax.tree.map(batch_leaf, batch))


def _seconds(fn):
  start = time.perf_counter()
  result = fn()
  return result, time.perf_counter() - start


def _row(name, case, args, target) -> dict:
  jit, jit_seconds = _seconds(
      lambda: jlms.xla_memory(jax.jit(case.step), *args, target=target))
  step = jlms.offload(case.step, **models.TFLMS_KNOBS)
  plan = step.plan(*args)
  off, jlms_seconds = _seconds(
      lambda: jlms.xla_memory(step, *args, target=target))
  return {
      "layout": name, "model": case.name, "target": target,
      "offloaded": len(plan.offloaded),
      "jit_peak_mib": jit.peak_bytes / MIB,
      "jlms_peak_mib": off.peak_bytes / MIB,
      "jit_temp_mib": jit.temp_bytes / MIB,
      "jlms_temp_mib": off.temp_bytes / MIB,
      "argument_mib": jit.argument_bytes / MIB,
      "host_mib": off.host_bytes / MIB,
      "host_buffers": off.host_offloaded_buffers,
      "peak_ratio": off.peak_bytes / jit.peak_bytes,
      "jit_compile_seconds": jit_seconds,
      "jlms_compile_seconds": jlms_seconds,
  }


def _budget_row(name, case, args, target, budget) -> dict:
  step = jlms.offload(case.step, budget=budget, target=target)
  plan, seconds = _seconds(lambda: step.plan(*args))
  memory = jlms.xla_memory(step, *args, target=target)
  return {
      "layout": name, "budget": budget,
      "budget_mib": plan.budget_bytes / MIB,
      "xla_peak_mib": plan.xla_peak_bytes / MIB,
      "host_mib": memory.host_bytes / MIB,
      "offloaded": len(plan.offloaded),
      "min_bytes": plan.config.min_bytes,
      "swapout_threshold": plan.config.swapout_threshold,
      "seconds": seconds,
  }


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--target", default="h100")
  parser.add_argument("--topology", default="1x1x8")
  parser.add_argument("--blocks", type=int, default=16)
  parser.add_argument("--image-size", type=int, default=256)
  parser.add_argument("--batch", type=int, default=64)
  parser.add_argument("--budget", default="4GiB")
  parser.add_argument("--json", default=None)
  options = parser.parse_args(argv)
  devices = jlms.target_devices(options.target, options.topology)
  case = models.resnet_case(blocks=options.blocks, channels=64,
                            image_size=options.image_size,
                            batch=options.batch)
  layouts = {
      "data parallel": shard_step_args(case.abstract_args(),
                                       mesh_of(devices)),
      "fsdp": shard_step_args(case.abstract_args(),
                              mesh_of(devices, AxisType.Auto), fsdp=True),
  }
  rows = [_row(name, case, args, options.target)
          for name, args in layouts.items()]
  print(f"{case.name}, global batch {options.batch} over {len(devices)} "
        f"devices ({options.target} {options.topology}); XLA MiB per device")
  print(f"{'layout':<14} {'args':>8} {'jit peak':>10} {'jlms peak':>10} "
        f"{'ratio':>6} {'jit temp':>10} {'jlms temp':>10} {'host':>9} "
        f"{'offl':>5}")
  for r in rows:
    print(f"{r['layout']:<14} {r['argument_mib']:>8.1f} "
          f"{r['jit_peak_mib']:>10.1f} {r['jlms_peak_mib']:>10.1f} "
          f"{r['peak_ratio']:>6.3f} {r['jit_temp_mib']:>10.1f} "
          f"{r['jlms_temp_mib']:>10.1f} {r['host_mib']:>9.1f} "
          f"{r['offloaded']:>5}")
  budgets = [_budget_row(name, case, args, options.target, options.budget)
             for name, args in layouts.items()]
  print(f"\n{'layout':<14} {'budget':>10} {'XLA peak':>10} {'host':>9} "
        f"{'offl':>5} {'min_bytes':>10} {'threshold':>9} {'seconds':>8}"
        "  (MiB per device)")
  for b in budgets:
    print(f"{b['layout']:<14} {b['budget_mib']:>10.1f} "
          f"{b['xla_peak_mib']:>10.1f} {b['host_mib']:>9.1f} "
          f"{b['offloaded']:>5} "
          f"{b['min_bytes']:>10} {b['swapout_threshold']:>9} "
          f"{b['seconds']:>8.1f}")
  result = {"target": options.target, "topology": options.topology,
            "devices": len(devices), "global_batch": options.batch,
            "rows": rows, "budgets": budgets}
  write_json(options.json, result)
  return result


if __name__ == "__main__":
  main()
