"""Sharded steps: shardings kept, bytes and budgets per device, multi-host.

Runs that need several CPU devices or processes go through
`jlms_tests/_sharded_worker.py` in a fresh Python (the session's jax has one
CPU device). The H100 figures are XLA's, compiled for `1x1x8` without GPUs.
"""

import json
import os
import re
import socket
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec

import jlms
from benchmarks import models
from benchmarks.sharded import mesh_of, shard_step_args
from jlms import _compat
from jlms._liveness import analyse
from jlms._planner import Offload, SwapIn
from jlms._planning import _returned_undonated
from jlms._program import flatten
from jlms._rewrite import rewrite
from jlms._sharding import (abstract_arguments, device_shape, kept_shardings,
                            leading_split, link_shardings, unseen_split)
from jlms._units import format_bytes
from jlms_tests.conftest import F32_TOLERANCE, TFLMS_KNOBS, max_relative_error

# One worker runs the whole module: its module-scoped fixture compiles
# (or starts processes) once.
pytestmark = pytest.mark.xdist_group("sharding")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = 1 << 30
MIB = 1 << 20
#: The tiny Llama trains by AdamW (benchmarks.real_models, learning rate
#: 1e-4), which moves a parameter by about the learning rate whatever its
#: gradient, so rounding in a gradient element near zero moves it by up to
#: that much. On eight CPU devices two legal compiles of jax.jit's own three
#: steps (XLA CPU's LLVM at levels 3 and 0) differ by 8.6e-6 of the largest
#: leaf, and jlms's plan by 6.9e-6 here and 2.4e-5 on the CI machine. One
#: wrong gradient or copy moves its parameters by a whole step, 1.4e-3 of
#: the largest (0.07).
ADAMW_SHARDED_TOLERANCE = 1e-4


def _worker(args, devices: int):
  """Starts the worker with `devices` CPU devices; returns the process."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  env["XLA_FLAGS"] = " ".join(filter(None, (
      env.get("XLA_FLAGS", ""),
      f"--xla_force_host_platform_device_count={devices}")))
  # stderr goes to a file: a pipe nobody reads while the test waits on
  # another process could fill up and stall the worker.
  log = tempfile.TemporaryFile("w+")
  process = subprocess.Popen(
      [sys.executable, "-m", "jlms_tests._sharded_worker", *args], cwd=ROOT,
      env=env, stdout=subprocess.PIPE, stderr=log, text=True)
  process.log = log
  return process


def _finish(process, timeout: float = 600) -> str:
  try:
    out, _ = process.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    process.kill()
    out, _ = process.communicate()
  process.log.seek(0)
  assert process.returncode == 0, process.log.read()[-4000:]
  return out


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _h100x8_args(case, axis_type=AxisType.Explicit, fsdp=False):
  mesh = mesh_of(jlms.target_devices("h100", "1x1x8"), axis_type)
  return shard_step_args(case.abstract_args(), mesh, fsdp=fsdp)


# --- eight CPU devices: the same outputs and shardings as jax.jit ----------


@pytest.fixture(scope="module")
def eight_device_layouts():
  return json.loads(_finish(_worker(["layouts"], devices=8)))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["data_parallel_explicit",
                                    "data_parallel_auto", "fsdp",
                                    "constrained_explicit", "constrained_auto",
                                    "fsdp_momentum_not_donated"])
def test_sharded_step_equals_jax_jit(eight_device_layouts, layout):
  assert eight_device_layouts["devices"] == 8
  result = eight_device_layouts[layout]
  assert result["offloaded"] > 0, "the test must exercise offloading"
  assert result["error"] <= F32_TOLERANCE
  assert result["shardings_equal"]
  assert result["output_devices"] == 8


@pytest.mark.slow
def test_explicit_fsdp_state_on_host_equals_jax_jit(eight_device_layouts):
  # Under explicit axes a split leaf on host is copied whole for its
  # update (the update loop's slices fail JAX's sharding types, which
  # made jlms.offload report no plan that runs).
  result = eight_device_layouts["fsdp_explicit_state_on_host"]
  assert result["state_leaves"] > 0
  assert result["error"] <= F32_TOLERANCE
  assert result["shardings_equal"]


@pytest.mark.slow
def test_fsdp_outputs_stay_sharded(eight_device_layouts):
  assert eight_device_layouts["fsdp"]["sharded_outputs"] > 0
  assert eight_device_layouts["data_parallel_explicit"]["sharded_outputs"] == 0


@pytest.mark.slow
def test_a_tiny_llama_with_state_on_host_equals_jax_jit_on_eight_devices():
  # Transformers' Flax Llama, FSDP-style over eight CPU devices, the plan
  # of the least memory (the state on host, each device's shards in its
  # own host memory): three steps equal jax.jit's.
  pytest.importorskip("transformers")
  result = json.loads(_finish(_worker(["llama"], devices=8)))
  assert result["devices"] == 8
  assert result["state_leaves"] > 0 and result["offloaded"] > 0
  assert result["error"] <= ADAMW_SHARDED_TOLERANCE


@pytest.mark.slow
def test_a_tiny_llama_with_pinned_state_equals_jax_jit_on_eight_devices():
  # The same, planned for an H100's budget with the state on host (the
  # plan shape of the 8B and the 70B): each update where its gradient is
  # made, every device's shards of its state copied whole, pinned beside
  # the backward pass.
  pytest.importorskip("transformers")
  result = json.loads(_finish(_worker(["llama_pinned"], devices=8)))
  assert result["devices"] == 8 and result["output_devices"] == 8
  assert result["state_leaves"] > 0 and result["state_copies_pinned"] > 0
  assert result["error"] <= ADAMW_SHARDED_TOLERANCE
  assert result["output_devices"] == 8


# --- two processes through jax.distributed, as one process ----------------


@pytest.mark.slow
def test_two_processes_equal_one(tmp_path):
  single = tmp_path / "single.npz"
  _finish(_worker(["step", "--out", str(single)], devices=4))
  address = f"localhost:{_free_port()}"
  distributed = tmp_path / "distributed.npz"
  workers = [
      _worker(["step", "--out", str(distributed), "--coordinator", address,
               "--num-processes", "2", "--process-id", str(i)], devices=2)
      for i in range(2)]
  try:
    for worker in workers:
      _finish(worker)
  finally:
    for worker in workers:
      if worker.poll() is None:
        worker.kill()
  one, two = np.load(single), np.load(distributed)
  assert (int(one["devices"]), int(one["processes"])) == (4, 1)
  assert (int(two["devices"]), int(two["processes"])) == (4, 2)

  def outputs(run, name):
    keys = sorted((k for k in run.files if k.startswith(name + "_")),
                  key=lambda k: int(k.rsplit("_", 1)[1]))
    return [run[k] for k in keys]

  # Within each run jlms gives jax.jit's outputs (the loss, every state leaf).
  for run in (one, two):
    assert outputs(run, "jlms")
    assert max_relative_error(outputs(run, "jlms"), outputs(run, "jit")) <= F32_TOLERANCE
  # Across runs the all-reduces sum in another order (gloo between the
  # processes): jlms differs from one process no more than jax.jit does.
  jit_gap = max_relative_error(outputs(two, "jit"), outputs(one, "jit"))
  jlms_gap = max_relative_error(outputs(two, "jlms"), outputs(one, "jlms"))
  assert jit_gap <= 1e-5
  assert jlms_gap <= jit_gap + 1e-6


# --- per-device sizes and budgets ------------------------------------------


def test_explicit_shardings_give_per_device_sizes():
  case = models.resnet_case(blocks=2, channels=16, image_size=32, batch=16)
  args = _h100x8_args(case)
  plan = jlms.offload(case.step, min_bytes=1, swapout_threshold=4).plan(*args)
  shards = sum(np.prod(leaf.sharding.shard_shape(leaf.shape)) *
               leaf.dtype.itemsize for leaf in jax.tree.leaves(args))
  assert plan.argument_bytes == shards
  activation = max(plan.offloaded, key=lambda v: v.nbytes)
  assert activation.shape[0] == 16  # the global batch
  assert activation.nbytes * 8 == (np.prod(activation.shape) *
                                   activation.dtype.itemsize)


def _traced_avals(leaves):
  return [v.aval for v in jax.make_jaxpr(lambda *x: x)(*leaves).jaxpr.invars]


def test_only_auto_axes_hide_the_split():
  case = models.resnet_case(blocks=1, channels=8, image_size=16, batch=16)
  explicit = jax.tree.leaves(_h100x8_args(case))
  auto = jax.tree.leaves(_h100x8_args(case, AxisType.Auto))
  explicit_avals, auto_avals = _traced_avals(explicit), _traced_avals(auto)
  images = explicit_avals[-2]
  assert device_shape(images) == (2, *images.shape[1:])
  assert device_shape(auto_avals[-2]) == images.shape
  assert unseen_split(explicit_avals, explicit) == 1
  assert unseen_split(auto_avals, auto) == 8  # the batch, split 8 ways
  assert unseen_split(auto_avals, [None] * len(auto)) == 1
  structs = abstract_arguments(auto_avals, auto)
  assert [s.sharding for s in structs] == [x.sharding for x in auto]


def _fsdp_pair(mesh):
  """A weight split along its columns and a batch along its rows, Auto
  axes, as FSDP places them."""
  axis = mesh.axis_names[0]
  weight = jax.ShapeDtypeStruct((1024, 2048), np.float32,
                                sharding=NamedSharding(mesh, PartitionSpec(None, axis)))
  batch = jax.ShapeDtypeStruct((16384, 1024), np.float32,
                               sharding=NamedSharding(mesh, PartitionSpec(axis)))
  return weight, batch


def test_a_copied_value_is_split_like_an_argument_it_resembles():
  mesh = mesh_of(jlms.target_devices("h100", "1x1x8"), AxisType.Auto)
  weight, batch = _fsdp_pair(mesh)
  avals = _traced_avals([weight, batch])
  shapes = {0: jax.ShapeDtypeStruct((1024, 2048), np.float32),  # a gradient
            1: jax.ShapeDtypeStruct((16384, 4096), np.float32),  # activation
            2: jax.ShapeDtypeStruct((3, 5), np.float32)}  # like neither
  chosen = link_shardings(shapes, avals, [weight, batch])
  assert chosen[0].spec == weight.sharding.spec
  assert chosen[1].spec == PartitionSpec(mesh.axis_names[0], None)
  assert 2 not in chosen
  # A value of a replicated argument's shape may be its gradient or its
  # update, which jax.jit's program keeps whole: left to XLA.
  replicated = jax.ShapeDtypeStruct((16384, 4096), np.float32,
                                    sharding=NamedSharding(mesh, PartitionSpec()))
  leaves = [weight, batch, replicated]
  assert set(link_shardings(shapes, _traced_avals(leaves), leaves)) == {0}
  # Where the avals show the split (explicit axes), jlms's sizes are
  # already one device's and the types carry the shardings.
  explicit = _fsdp_pair(mesh_of(jlms.target_devices("h100", "1x1x8")))
  assert link_shardings(shapes, _traced_avals(explicit), explicit) == {}


def test_an_output_returned_in_place_of_an_argument_keeps_its_split():
  mesh = mesh_of(jlms.target_devices("h100", "1x1x8"), AxisType.Auto)
  weight, batch = _fsdp_pair(mesh)
  replicated = jax.ShapeDtypeStruct(
      (3, 5), np.float32, sharding=NamedSharding(mesh, PartitionSpec()))
  leaves = [weight, batch, replicated]
  avals = _traced_avals(leaves)
  # (argument, output): the weight's update at output 2, the replicated
  # leaf's at 0; the batch is not returned.
  assert kept_shardings([(0, 2), (2, 0)], avals, leaves) == (
      (2, weight.sharding),)
  # Explicit axes: the types carry the split already.
  explicit = _fsdp_pair(mesh_of(jlms.target_devices("h100", "1x1x8")))
  assert kept_shardings([(0, 1)], _traced_avals(explicit), explicit) == ()


def test_an_undonated_argument_is_paired_with_an_output_no_donation_takes():
  """step(w, m, x) -> (w - m, m, loss), `w` donated: `m`'s output is the
  second (the first is `w`'s by XLA's aliasing), and with `w` kept on host
  it is still the second (found by review: the first output of `m`'s
  shape, `w`'s, was constrained to `m`'s split)."""
  def step(w, m, x):
    return w - m, m, jnp.sum(x)
  square = jax.ShapeDtypeStruct((4, 4), np.float32)
  program = flatten(jax.make_jaxpr(step)(square, square, square))
  assert _returned_undonated(program, (0,), ()) == ((1, 1),)
  assert _returned_undonated(program, (0,), (0,)) == ((1, 1),)
  # Nothing donated: each argument takes the first output of its kind.
  assert _returned_undonated(program, (), ()) == ((0, 0), (1, 1))


def test_a_leading_axis_cut_over_devices_is_kept_apart_in_its_view():
  mesh = mesh_of(jlms.target_devices("h100", "1x1x8"), AxisType.Auto)
  axis = mesh.axis_names[0]
  rows = jax.ShapeDtypeStruct((1024, 2048), np.float32,
                              sharding=NamedSharding(mesh, PartitionSpec(axis)))
  weight, batch = _fsdp_pair(mesh)  # the weight is cut along its columns
  avals = _traced_avals([rows, weight, batch])
  split = leading_split(avals[0], rows)
  # The update loop views the leaf as (8, 128, 2048), each device's rows
  # in its own slice of the view's first axis.
  assert split.shards == 8
  assert split.view.spec == PartitionSpec(axis, None, None)
  assert split.view.shard_shape((8, 128, 2048)) == (1, 128, 2048)
  assert leading_split(avals[1], weight) is None
  assert leading_split(avals[2], batch).shards == 8
  # Explicit axes: the aval shows the cut, and its type carries the split
  # (an update loop does not take such a leaf: it is copied whole).
  explicit = mesh_of(jlms.target_devices("h100", "1x1x8"))
  shown = jax.ShapeDtypeStruct((1024, 2048), np.float32, sharding=NamedSharding(
      explicit, PartitionSpec(explicit.axis_names[0])))
  assert leading_split(_traced_avals([shown])[0], shown) is None


def test_a_weight_gradient_copied_to_host_crosses_the_link_in_its_shard():
  # A weight gradient (a contraction over the split batch) read after its
  # copy back by a sum alone: with nothing downstream asking for a split,
  # XLA's partitioner all-reduces it and every device copied the whole
  # 8 MiB; constrained like the weight, each copies its 1 MiB.
  mesh = mesh_of(jlms.target_devices("h100", "1x1x8"), AxisType.Auto)
  weight, batch = _fsdp_pair(mesh)

  def step(w, x):
    h = jnp.tanh(x @ w)
    gradient = x.T @ h
    z = jnp.tanh(h) @ w.T
    return w, jnp.sum(z) + jnp.sum(gradient * gradient)

  program = flatten(jax.make_jaxpr(step)(weight, batch))
  liveness = analyse(program)
  made_at = [i for i, e in enumerate(program.equations)
             if e.primitive.name == "dot_general"][1]
  gradient = program.equations[made_at].outputs[0]
  reader = liveness.uses[gradient][-1]
  offloads = (Offload(gradient, made_at, (SwapIn(reader, (reader,)),)),)
  avals = [program.avals[v] for v in program.invars]
  shardings = link_shardings({gradient: program.avals[gradient]}, avals,
                             [weight, batch])
  host_bytes = []
  for given in ({}, shardings):
    rewritten = rewrite(program, offloads, jlms.OffloadConfig(),
                        shardings=given)
    run = jax.jit(lambda *a, r=rewritten: _compat.eval_jaxpr(
        r.jaxpr, r.consts, *a))
    host_bytes.append(jlms.xla_memory(run, weight, batch,
                                      target="h100").host_temp_bytes)
  assert host_bytes == [8 * MIB, MIB]


def test_xla_memory_finds_the_topology_of_the_shardings():
  devices = jlms.target_devices("h100", "1x1x8")
  mesh = mesh_of(devices)
  rows = jax.ShapeDtypeStruct(
      (4096, 4096), np.float32,
      sharding=NamedSharding(mesh, PartitionSpec("data")))
  memory = jlms.xla_memory(lambda x: x * 2, rows, target="h100")
  assert memory.argument_bytes == 8 * MIB  # one eighth of 64 MiB


@pytest.mark.slow
@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto],
                         ids=["explicit", "auto"])
def test_budget_is_per_device(axis_type):
  # Two blocks at 256x256, global batch 64 over 8 H100s: jax.jit's peak is
  # about 1.35 GiB per device, and the whole step's activations are eight
  # times that: a budget read as whole-step bytes could not be met.
  case = models.resnet_case(blocks=2, channels=64, image_size=256, batch=64)
  args = _h100x8_args(case, axis_type)
  step = jlms.offload(case.step, budget="1GiB", target="h100")
  plan = step.plan(*args)
  assert plan.budget_bytes == GIB
  assert plan.offloaded
  assert plan.xla_peak_bytes <= GIB
  # Under Auto axes the simulator's peaks are the whole step's, beside a
  # budget of one device's: the printed plan says which, and a device's
  # share.
  whole = axis_type == AxisType.Auto
  assert plan.split == (8 if whole else 1)
  assert ("predicted peak of the whole step over 8 devices" in str(plan)) == whole
  if whole:
    assert format_bytes(plan.predicted_peak_bytes // 8) in str(plan)
  measured = jlms.xla_memory(step, *args, target="h100")
  assert measured.peak_bytes == plan.xla_peak_bytes
  # Whatever is copied lives on host as one device's shard.
  copied = [v for v in plan.offloaded if not v.recomputed]
  assert (measured.host_offloaded_buffers > 0) == bool(copied)


# --- the claim: 16-block ResNet on 8 H100s -------------------------


@pytest.mark.slow
def test_resnet_on_eight_h100s_peak_is_at_most_a_third_of_jit():
  case = models.resnet_case(blocks=16, channels=64, image_size=256, batch=64)
  args = _h100x8_args(case)
  jit = jlms.xla_memory(jax.jit(case.step), *args, target="h100")
  offloaded = jlms.xla_memory(jlms.offload(case.step, **TFLMS_KNOBS), *args, target="h100")
  # Compiled per device: one GPU holds an eighth of the images.
  images = jax.tree.leaves(args)[-2]
  assert jit.argument_bytes < images.size * images.dtype.itemsize
  assert offloaded.host_offloaded_buffers > 0
  assert offloaded.peak_bytes <= jit.peak_bytes / 3
  # What lives on host is each device's shard: an eighth of the batch.
  host_shapes = set(re.findall(r"\w+\[([\d,]*)\]\{[^}]*S\(5\)",
                               offloaded.hlo_text))
  assert host_shapes and all(s.split(",")[0] == "8" for s in host_shapes)
