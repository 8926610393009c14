"""Sharded and multi-process runs of `jlms.offload`, one per Python process.

The number of CPU devices is fixed when jax starts, and the test session's
jax already runs with one, so `test_sharding.py` runs this module with
`sys.executable` and `XLA_FLAGS=--xla_force_host_platform_device_count=N`
set, and reads what it prints or writes.

    python -m jlms_tests._sharded_worker layouts
        The small BatchNorm ResNet step on every CPU device, data parallel
        (explicit and Auto mesh axes) and FSDP-style, and an MLP step that
        constrains its activations' sharding inside (`_ConstrainedCase`),
        under jax.jit and jlms.offload. Prints one JSON object: per layout,
        the error against jax.jit, whether every output sharding equals
        jax.jit's, how many values were offloaded, how many devices the
        outputs span and how many of them are split.

    python -m jlms_tests._sharded_worker llama
        The tiny `FlaxLlamaForCausalLM` of `benchmarks.real_models` (AdamW),
        its batch and every state leaf split over all CPU devices
        (FSDP-style, an Auto axis), three steps under jax.jit and under
        `jlms.offload(budget="min")`, which keeps the state on host and
        updates every leaf by a loop over its rows (within each device's
        shard: the tiny leaves are streamed as MiB leaves are). Prints
        one JSON object: the largest relative error over the steps' states
        and losses, the plan's state leaves on host and offloaded values,
        and how many devices the outputs span.

    python -m jlms_tests._sharded_worker llama_pinned
        The same, planned for an H100's budget with the state on host
        (`target="h100"`): each leaf's update runs where its gradient is
        made and its state's whole copies are pinned beside the backward
        pass. Prints the same object, with the plan's pinned copies.

    python -m jlms_tests._sharded_worker step --out FILE
        [--coordinator HOST:PORT --num-processes N --process-id I]
        One data-parallel step under jlms.offload over all devices of all
        processes (joined by `jax.distributed.initialize` when a coordinator
        is given), and the same under jax.jit. Process 0 writes both
        outputs to FILE (.npz: `jlms_<leaf>`, `jit_<leaf>`).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

import jlms
from jlms import _thresholds
from benchmarks import models
from benchmarks.sharded import AXIS, mesh_of, shard_step_args
from jlms_tests.conftest import max_relative_error

# The small model's activations (128 KiB per device) go to host; its
# per-channel vectors stay, as they would with the default 1 MiB floor on
# a real model. Moving those too gives the same values up to float32
# summation order (about 1e-6 on BatchNorm biases, whose gradients are sums
# of cancelling terms; jax.jit on 8 devices against 1 differs by 4e-6 there).
EAGER = dict(min_bytes=1 << 16, swapout_threshold=4)


def small_case(batch: int):
  # Momentum SGD: Adam divides by sqrt(v), which turns gradients that are
  # zero up to rounding (BatchNorm biases) into updates made of rounding
  # noise, and any two reduction orders differ there.
  return models.resnet_case(blocks=2, channels=16, image_size=32, batch=batch,
                            optimizer=optax.sgd(1e-2, momentum=0.9))


def _layout_result(case, args, knobs=EAGER) -> dict:
  expected = jax.jit(case.step)(*args)
  step = jlms.offload(case.step, **knobs)
  actual = step(*args)
  pairs = list(zip(jax.tree.leaves(actual), jax.tree.leaves(expected)))
  return {
      "error": max_relative_error(actual, expected),
      "shardings_equal": all(a.sharding == e.sharding for a, e in pairs),
      "offloaded": len(step.plan(*args).offloaded),
      "output_devices": max(len(a.sharding.device_set) for a, _ in pairs),
      "sharded_outputs": sum(not a.sharding.is_fully_replicated
                             for a, _ in pairs),
  }


class _ConstrainedCase:
  """A tanh MLP step that constrains its activations to the batch split:
  each layer is a nested jit with `out_shardings`, followed by
  `with_sharding_constraint` (Auto axes) or `jax.sharding.reshard`
  (explicit axes)."""

  def __init__(self, mesh, layers: int = 6, width: int = 64):
    self.mesh, self.layers, self.width = mesh, layers, width
    by_batch = NamedSharding(mesh, PartitionSpec(AXIS))
    explicit = mesh.axis_types[0] == AxisType.Explicit
    layer = jax.jit(lambda w, h: jnp.tanh(h @ w), out_shardings=by_batch)

    def loss(weights, x):
      h = x
      for w in weights:
        h = layer(w, h)
        h = (jax.sharding.reshard(h, by_batch) if explicit
             else jax.lax.with_sharding_constraint(h, by_batch))
      return jnp.mean(h ** 2)

    def step(weights, x):
      value, grads = jax.value_and_grad(loss)(weights, x)
      return [w - 0.1 * g for w, g in zip(weights, grads)], value

    self.step = step

  def make_args(self):
    keys = jax.random.split(jax.random.key(0), self.layers + 1)
    weights = [jax.random.normal(k, (self.width, self.width)) / 8
               for k in keys[:-1]]
    x = jax.random.normal(keys[-1], (8 * len(self.mesh.devices.flat),
                                     self.width))
    return shard_step_args((weights, x), self.mesh, batch_args=1)


def _optimizer_step(loss, optimizer):
  """The step of `optimizer` on `loss(weights, x)`: (weights, opt_state,
  x) -> (weights, opt_state, loss)."""
  def step(weights, opt_state, x):
    value, grads = jax.value_and_grad(loss)(weights, x)
    updates, opt_state = optimizer.update(grads, opt_state, weights)
    return optax.apply_updates(weights, updates), opt_state, value
  return step


class _ExplicitFsdpCase:
  """A tanh MLP step with AdamW whose weights (and so their moments) are
  split over the devices under explicit mesh axes, one along its rows and
  one along its columns, gathered where the loss reads them
  (`jax.sharding.reshard`), as explicit FSDP does."""

  def __init__(self, mesh, width: int = 64, hidden: int = 128):
    self.mesh, self.width, self.hidden = mesh, width, hidden
    optimizer = optax.adamw(1e-2)
    self.optimizer = optimizer

    def loss(weights, x):
      first, second = (jax.sharding.reshard(w, PartitionSpec())
                       for w in weights)
      return jnp.mean((jnp.tanh(x @ first) @ second - x) ** 2)

    self.step = _optimizer_step(loss, optimizer)

  def make_args(self):
    keys = jax.random.split(jax.random.key(0), 3)
    weights = (jax.random.normal(keys[0], (self.width, self.hidden)) / 8,
               jax.random.normal(keys[1], (self.hidden, self.width)) / 8)
    x = jax.random.normal(keys[2], (2 * len(self.mesh.devices.flat),
                                    self.width))
    return shard_step_args((weights, self.optimizer.init(weights), x),
                           self.mesh, batch_args=1, fsdp=True)


class _MomentumFsdpCase:
  """A step of momentum SGD, not donated, whose weights (and so their
  momenta) are split over the devices along their rows under an Auto
  axis, with a scanned stack split along its second axis: jlms's program
  at the least memory is not jax.jit's, and XLA's partitioner gave one
  momentum back split along its columns, where jax.jit gave it back as
  it came (the next call, of another signature, was planned again)."""

  def __init__(self, mesh, width: int = 128):
    self.mesh, self.width = mesh, width
    self.optimizer = optimizer = optax.sgd(1e-2, momentum=0.9)

    def loss(weights, x):
      h = jax.nn.gelu(x @ weights["first"]) @ weights["second"]
      h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w) + h, None), h,
                          weights["stack"])
      return jnp.mean((h - x) ** 2)

    self.step = _optimizer_step(loss, optimizer)

  def make_args(self):
    keys = jax.random.split(jax.random.key(0), 4)
    width, devices = self.width, len(self.mesh.devices.flat)
    weights = {
        "first": jax.random.normal(keys[0], (width, 2 * width)) / 8,
        "second": jax.random.normal(keys[1], (2 * width, width)) / 8,
        "stack": jax.random.normal(keys[2], (4, width, width)) / 8}
    specs = {"first": PartitionSpec(AXIS), "second": PartitionSpec(AXIS),
             "stack": PartitionSpec(None, AXIS)}
    split = lambda tree: {name: jax.device_put(
        leaf, NamedSharding(self.mesh, specs[name]))
        for name, leaf in tree.items()}
    weights = split(weights)
    x = jax.device_put(
        jax.random.normal(keys[3], (2 * devices, 16, width)),
        NamedSharding(self.mesh, PartitionSpec(AXIS)))
    return weights, self.optimizer.init(weights), x


def _explicit_state_on_host(devices) -> dict:
  """`_ExplicitFsdpCase` with its state on host, its KiB leaves streamed
  as MiB leaves are: the same as jax.jit's."""
  case = _ExplicitFsdpCase(mesh_of(devices))
  before = _thresholds.THRESHOLDS
  _thresholds.THRESHOLDS = dataclasses.replace(
      before, streamed_leaf_min_bytes=1)
  try:
    with jax.set_mesh(case.mesh):
      expected = jax.jit(case.step)(*case.make_args())
      step = jlms.offload(case.step, donate_argnums=(0, 1), budget="min",
                          state_on_host=True, min_bytes=1024)
      plan = step.plan(*case.make_args())
      actual = step(*step.place(*case.make_args()))
  finally:
    _thresholds.THRESHOLDS = before
  pairs = list(zip(jax.tree.leaves(actual), jax.tree.leaves(expected)))
  return {
      "error": max_relative_error(actual, expected),
      "state_leaves": plan.state_leaves,
      "shardings_equal": all(
          a.sharding.spec == e.sharding.spec for a, e in pairs),
  }


def layouts() -> dict:
  devices = jax.devices()
  case = small_case(batch=2 * len(devices))
  args = case.make_args()
  momentum = _MomentumFsdpCase(mesh_of(devices, AxisType.Auto))
  return {
      "devices": len(devices),
      "data_parallel_explicit": _layout_result(
          case, shard_step_args(args, mesh_of(devices))),
      "data_parallel_auto": _layout_result(
          case, shard_step_args(args, mesh_of(devices, AxisType.Auto))),
      "fsdp": _layout_result(
          case, shard_step_args(args, mesh_of(devices, AxisType.Auto),
                                fsdp=True)),
      "fsdp_explicit_state_on_host": _explicit_state_on_host(devices),
      "fsdp_momentum_not_donated": _layout_result(
          momentum, momentum.make_args(), dict(budget="min")),
  } | {
      f"constrained_{name}": _layout_result(
          constrained, constrained.make_args(),
          dict(min_bytes=1, swapout_threshold=4))
      for name, constrained in (
          ("explicit", _ConstrainedCase(mesh_of(devices))),
          ("auto", _ConstrainedCase(mesh_of(devices, AxisType.Auto))))
  }


def _host(leaf):
  if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
    leaf = jax.random.key_data(leaf)
  return np.asarray(leaf)


def _three_steps(real, stepper, args, place: bool) -> list:
  """Host copies of the states and losses of three steps of `stepper`,
  each fed the last one's state."""
  if place:  # the state a plan keeps on host goes there once
    args = stepper.place(*args)
  outputs = []
  for _ in range(3):
    out = stepper(*args)
    outputs.append(jax.tree.map(_host, out))
    args = real.next_args(args, out)
  return outputs


def llama(pinned: bool = False) -> dict:
  """Three steps of the tiny Llama, FSDP-style over every device, under
  jax.jit and under jlms.offload: the plan of the least memory, or with
  `pinned` the plan for an H100's budget with the state on host (the
  plan shape of the 8B and the 70B: each update where its gradient is
  made, its state's whole copies pinned beside the backward pass)."""
  from benchmarks.real_models import REAL_MODELS
  devices = jax.devices()
  real = REAL_MODELS["llama"]("tiny", batch=len(devices))
  mesh = mesh_of(devices, AxisType.Auto)

  def fresh():  # the steps donate their state
    return shard_step_args(real.make_args(), mesh, batch_args=1, fsdp=True)

  expected = _three_steps(real, real.jitted(), fresh(), place=False)
  _thresholds.THRESHOLDS = dataclasses.replace(
      _thresholds.THRESHOLDS, streamed_leaf_min_bytes=1)
  if pinned:
    step = real.offload(budget="90%", target="h100", state_on_host=True,
                        min_bytes=1024)
  else:
    step = real.offload(budget="min")
  plan = step.plan(*fresh())
  actual = _three_steps(real, step, fresh(), place=True)
  last = jax.tree.leaves(step(*step.place(*fresh())))
  return {
      "devices": len(devices),
      "error": max(max_relative_error(a, e)
                   for a, e in zip(actual, expected)),
      "state_leaves": plan.state_leaves,
      "state_copies_pinned": plan.state_copies_pinned,
      "offloaded": len(plan.offloaded),
      "output_devices": max(len(leaf.sharding.device_set) for leaf in last),
  }


def _global(value, sharding):
  """A global array from the full value every process holds."""
  value = np.asarray(value)
  return jax.make_array_from_callback(value.shape, sharding,
                                      lambda index: value[index])


def step(out: str) -> None:
  devices = jax.devices()
  case = small_case(batch=8)
  host_args = case.make_args()
  placed = shard_step_args(case.abstract_args(), mesh_of(devices))
  args = jax.tree.map(lambda value, spec: _global(value, spec.sharding),
                      host_args, placed)
  results = {"jlms": jlms.offload(case.step, **EAGER)(*args),
             "jit": jax.jit(case.step)(*args)}
  # Every output is replicated (state and loss): each process has all of it.
  arrays = {f"{name}_{i}": np.asarray(leaf.addressable_data(0))
            for name, outputs in results.items()
            for i, leaf in enumerate(jax.tree.leaves(outputs))}
  if jax.process_index() == 0:
    np.savez(out, **arrays, devices=len(devices),
             processes=jax.process_count())


def main(argv=None) -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("mode", choices=("layouts", "llama", "llama_pinned",
                                       "step"))
  parser.add_argument("--out")
  parser.add_argument("--coordinator")
  parser.add_argument("--num-processes", type=int, default=1)
  parser.add_argument("--process-id", type=int, default=0)
  options = parser.parse_args(argv)
  if options.mode != "step":
    print(json.dumps(layouts() if options.mode == "layouts"
                     else llama(pinned=options.mode == "llama_pinned")))
    return
  if options.coordinator:
    jax.distributed.initialize(coordinator_address=options.coordinator,
                               num_processes=options.num_processes,
                               process_id=options.process_id)
  step(options.out)
  if options.coordinator:
    jax.distributed.shutdown()


if __name__ == "__main__":
  main()
