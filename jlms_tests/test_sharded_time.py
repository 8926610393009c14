"""A sharded step's predicted time, per device: its share of the kernels
and host copies, and the exchanges XLA's compiled program makes."""

import dataclasses

import jax
import pytest
from jax.sharding import AxisType

import jlms
from benchmarks import models
from benchmarks.sharded import mesh_of, shard_step_args
from jlms._collectives import collective_bytes
from jlms._cost import time_target
from jlms._schedule import StepTime, per_device

_HLO = """\
HloModule m, is_scheduled=true

%body (p: (s32[], f32[2,4])) -> (s32[], f32[2,4]) {
  %p = (s32[], f32[2,4]{1,0}) parameter(0)
  %x = f32[2,4]{1,0} get-tuple-element(%p), index=1
  %ag = (f32[2,4]{1,0}, f32[16,4]{1,0}) all-gather-start(%x), replica_groups=[1,8]<=[8], dimensions={0}
  %agd = f32[16,4]{1,0} all-gather-done(%ag)
  %rs = f32[2,4]{1,0} reduce-scatter(%agd), replica_groups=[1,8]<=[8], dimensions={0}, to_apply=%add
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %t = (s32[], f32[2,4]{1,0}) tuple(%i, %rs)
}

%gathered (q: u4[2,4]) -> u4[16,4] {
  %q = u4[2,4]{1,0} parameter(0)
  ROOT %g = u4[16,4]{1,0} all-gather(%q), replica_groups=[1,8]<=[8], dimensions={0}
}

ENTRY %main (a: f32[2,4], b: f32[8], c: u4[2,4]) -> f32[8] {
  %c = u4[2,4]{1,0} parameter(2)
  %cg = u4[16,4]{1,0} call(%c), to_apply=%gathered
  %a = f32[2,4]{1,0} parameter(0)
  %b = f32[8]{0} parameter(1)
  %z = s32[] constant(0)
  %init = (s32[], f32[2,4]{1,0}) tuple(%z, %a)
  %w = (s32[], f32[2,4]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %ar = f32[8]{0} all-reduce-start(%b), replica_groups=[1,8]<=[8], to_apply=%add
  ROOT %ard = f32[8]{0} all-reduce-done(%ar)
}
"""


def test_collective_bytes_are_what_one_device_sends_and_gets():
  # Per trip of the loop: the all-gather brings in 14 of its 16 rows, the
  # reduce-scatter sends 14 of them; the all-reduce sends and gets 7/8 of
  # its 32 bytes twice; the called computation's all-gather brings in 14
  # rows of four 4-bit words.
  row = 4 * 4
  per_trip = 14 * row + 14 * row
  assert collective_bytes(_HLO, 8) == (3 * per_trip + int(2 * 32 * 7 / 8)
                                       + 14 * 2)
  assert collective_bytes(_HLO, 1) == 0


def test_per_device_divides_the_work_and_hides_exchanges_under_it():
  h100 = time_target("h100")
  whole = StepTime(0.8, 0.16, 0.08, 8 << 30, 8 << 30, h100.link)
  second = h100.interconnect_bytes_per_s  # bytes in one second
  hidden = per_device(whole, 8, int(0.05 * second), h100)
  assert hidden.compute_s == pytest.approx(0.1)
  assert hidden.recompute_s == pytest.approx(0.02)
  assert hidden.exposed_transfer_s == pytest.approx(0.01)
  assert hidden.d2h_bytes == 1 << 30
  assert hidden.exposed_collective_s == 0  # 50 ms under 130 of kernels
  assert hidden.total_s == pytest.approx(0.13)
  longer = per_device(whole, 8, int(0.2 * second), h100)
  assert longer.exposed_collective_s == pytest.approx(0.07)
  assert longer.total_s == pytest.approx(0.2)
  crowded = per_device(whole, 8, int(0.05 * second),
                       dataclasses.replace(h100, streams_hide=False))
  assert crowded.exposed_collective_s == pytest.approx(0.05)
  # Sizes already per device (explicit axes): only the exchanges added.
  assert per_device(whole, 1, 0, h100).total_s == pytest.approx(
      whole.total_s)


def _gpt():
  return models.zoo_gpt_case(seq=128, batch_size=16, layers=2, width=128,
                             heads=4, vocab=1024)


@pytest.mark.slow  # compiles for eight H100s
def test_an_fsdp_step_is_priced_per_device_with_its_exchanges():
  case = _gpt()
  abstract = jax.eval_shape(case.make_args)
  mesh = mesh_of(jlms.target_devices("h100", "1x1x8"), AxisType.Auto)
  sharded_args = shard_step_args(abstract, mesh, batch_args=1, fsdp=True)
  # A budget the step meets by planning, not by the least-memory search
  # (12 minutes of H100 compiles on two cores).
  options = dict(donate_argnums=(0, 1), budget="50%", target="h100")
  whole_plan = jlms.offload(case.step, **options).plan(*abstract)
  step = jlms.offload(case.step, **options)
  plan = step.plan(*sharded_args)
  # The same jaxpr: each device runs an eighth of jax.jit's kernels.
  assert plan.baseline_step_time.compute_s * 8 == pytest.approx(
      whole_plan.baseline_step_time.compute_s, rel=1e-6)
  assert whole_plan.step_time.collective_bytes == 0
  # What a device exchanges is read from the program that runs.
  memory = jlms.xla_memory(step, *sharded_args, target="h100")
  assert plan.step_time.collective_bytes == collective_bytes(
      memory.hlo_text, 8) > 0
  assert plan.step_time.total_s >= (plan.step_time.collective_bytes
                                    / time_target("h100")
                                    .interconnect_bytes_per_s)
  assert "exchanged over NVLink 4" in plan.step_time.describe()


@pytest.mark.slow  # compiles for eight H100s
def test_explicit_axes_price_a_devices_rows_of_each_contraction():
  # A GPT's embedding lookup does not trace under an Explicit axis; a
  # ResNet, data parallel, does.
  case = models.resnet_case(blocks=2, channels=16, image_size=32, batch=16)
  abstract = case.abstract_args()
  mesh = mesh_of(jlms.target_devices("h100", "1x1x8"), AxisType.Explicit)
  sharded_args = shard_step_args(abstract, mesh)
  options = dict(budget="50%", target="h100")  # planned, not the least
  whole = jlms.offload(case.step, **options).plan(*abstract)
  plan = jlms.offload(case.step, **options).plan(*sharded_args)
  # The avals carry the batch split: convolutions and activations an
  # eighth, the replicated parameters' update whole on every device.
  ratio = (whole.baseline_step_time.compute_s
           / plan.baseline_step_time.compute_s)
  assert 6.5 < ratio <= 8.01  # 5.99 priced as one device


def test_an_arguments_bytes_per_device_follow_its_placement():
  from jax.sharding import NamedSharding, PartitionSpec
  import jax.numpy as jnp
  from jlms._liveness import aval_nbytes
  from jlms._sharding import argument_device_bytes
  mesh = mesh_of(jlms.target_devices("h100", "1x1x8"), AxisType.Auto)
  aval = jax.core.ShapedArray((8, 1024), jnp.float32)
  whole = aval_nbytes(aval)

  def placed(*spec):
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype,
                                sharding=NamedSharding(mesh,
                                                       PartitionSpec(*spec)))

  # Auto axes: the aval shows the whole array, the leaf says the split.
  assert argument_device_bytes(whole, aval, placed("data")) == whole // 8
  assert argument_device_bytes(whole, aval, placed()) == whole
  assert argument_device_bytes(whole, aval, None) == whole
