"""Host copies that run beside compute: streamed loops whose copies XLA
overlaps with their iterations (`jlms._loops`, `jlms._update_fusion`), the
way that streams only each layer's input and remakes the rest
(`jlms._variants.LoopsRemakingStreamed`), and the time model that knows
which copies hide (`jlms._schedule`)."""

import dataclasses
import logging
import re

import jax
import jax.numpy as jnp
import pytest

import jlms
from benchmarks import models
from jlms._config import OffloadConfig
from jlms._cost import time_target
from jlms._liveness import analyse
from jlms._loop_remat import (cheapest, loop_rematerializations,
                              rematerialize_in_loops)
from jlms._loops import find_scan_residuals
from jlms._program import flatten
from jlms._units import format_bytes
from jlms._state import StateCopy
from jlms._update_fusion import _beside_kernels
from jlms._variants import loops_unwrapped
from jlms._schedule import (_kernels_free_to_follow, predict_step_time,
                            scheduler_overlaps, scheduler_slop_factor)
from jlms._cost import kernel_seconds
from jlms_tests.conftest import F32_TOLERANCE, max_relative_error

H100 = time_target("h100")
GIB = 1 << 30


def _scan_mlp(layers=4, width=256, batch=1024):
  return models.scan_mlp_case(layers=layers, width=width, batch=batch)


def _remade(case):
  """The scanned MLP's program with every residual remade in the backward
  loop, its loops unwrapped from the calls that traced them."""
  program = flatten(jax.make_jaxpr(case.step)(*case.abstract_args()))
  liveness = analyse(program)
  chosen = cheapest(loop_rematerializations(program, liveness), 1.0)
  return loops_unwrapped(rematerialize_in_loops(program, chosen), chosen)


def test_a_remade_loop_stacks_its_layer_inputs_ready_at_each_iterations_start():
  case = _scan_mlp()
  plain = flatten(jax.make_jaxpr(case.step)(*case.abstract_args()))
  config = OffloadConfig(min_bytes=1, swapout_threshold=2)
  made = find_scan_residuals(plain, analyse(plain), config)
  # Autodiff's stacks (three on JAX 0.10, two on 0.12) are made by the
  # layer's kernels, but for its input.
  assert len(made) >= 2
  assert sum(r.ready_at_iteration_start for r in made) == 1
  program = _remade(case)
  (carried,) = find_scan_residuals(program, analyse(program), config)
  assert carried.ready_at_iteration_start
  assert program.avals[carried.value].shape == (4, 1024, 256)


def _remade_loops_priced():
  """The 8-layer scanned MLP remade (`_remade`), its analysis, its one
  layer-input stack and its kernels' seconds on an H100."""
  program = _remade(_scan_mlp(layers=8, width=1024, batch=4096))
  liveness = analyse(program)
  (carried,) = find_scan_residuals(program, liveness, OffloadConfig(
      min_bytes=1, swapout_threshold=2))
  return program, liveness, carried, kernel_seconds(program, H100,
                                                    liveness=liveness)


def test_a_slice_ready_at_its_iterations_start_hides_under_the_loop():
  program, liveness, carried, seconds = _remade_loops_priced()
  copy = H100.transfer_seconds(liveness.nbytes[carried.value])
  forward = float(seconds[carried.producer])
  assert forward < copy  # the link bounds this loop

  # As XLA's deviceless schedule runs the slices: beside the kernels.
  deviceless = dataclasses.replace(H100, loop_slices_hide=True)

  def exposed(residual, target=deviceless):
    return predict_step_time(program, liveness, seconds, (), target,
                             residuals=(residual,)).exposed_transfer_s

  backward = sum(float(seconds[r]) for r in carried.readers)
  fetched = max(0.0, copy - backward)  # an iteration ahead, beside it
  # Copied out after the layer's last kernel: the iteration waits for it.
  assert exposed(dataclasses.replace(
      carried, ready_at_iteration_start=False)) == pytest.approx(
          copy + fetched)
  # Copied out from the iteration's start: only what the forward loop's
  # kernels do not cover.
  assert exposed(carried) == pytest.approx(copy - forward + fetched)
  # Where XLA's scheduler has no room, it overlaps nothing.
  crowded = dataclasses.replace(deviceless, streams_hide=False)
  assert exposed(carried, crowded) == pytest.approx(2 * copy)
  # Nor does a real GPU (an H200 ran the scanned MLP's slices in line
  # with its kernels): the targets' own model waits for each whole.
  assert not H100.loop_slices_hide
  assert exposed(carried, H100) == pytest.approx(2 * copy)


def test_a_fused_update_loops_copies_are_priced_beside_its_kernels():
  program, liveness, carried, seconds = _remade_loops_priced()
  loop = carried.readers[0]  # the backward loop
  own = float(seconds[loop])
  stacks = int(0.5 * own * H100.link_bytes_per_s)  # half the loop's time
  edges = stacks // 8  # one slice of each, before and after the loop
  # As XLA's deviceless schedule runs the slices: beside the kernels.
  deviceless = dataclasses.replace(H100, loop_slices_hide=True)

  def exposed(buffers, target=deviceless):
    fetched, written = _beside_kernels(buffers, stacks)
    copy = StateCopy(loop, stacks + edges, stacks + edges,
                     to_device_beside=fetched, to_host_beside=written,
                     edge_bytes=edges)
    return predict_step_time(program, liveness, seconds, (), target,
                             state_copies=(copy,)).exposed_transfer_s

  edge = H100.transfer_seconds(edges)
  whole = 2 * H100.transfer_seconds(stacks + edges)  # both ways, in line
  # A weight's two moments: only the slices at the loop's edges wait.
  assert exposed(2) == pytest.approx(2 * edge)
  # More buffers: XLA waits for about half of the fetches' time too.
  assert exposed(4) == pytest.approx(
      2 * edge + H100.transfer_seconds(stacks - stacks // 2))
  # Where XLA's scheduler has no room, nothing hides.
  crowded = dataclasses.replace(deviceless, streams_hide=False)
  assert exposed(2, crowded) == pytest.approx(whole)
  # Nor on a real GPU (an H200 ran the 4-layer GPT's moments' slices in
  # line with its backward loop): the targets' own model waits for each.
  assert exposed(2, H100) == pytest.approx(whole)
  # Under a latency profile of its copies, the slice fetched before the
  # loop hides under the kernels before it, the one written back after it
  # under those after it, each up to their seconds.
  before, after = float(seconds[:loop].sum()), float(seconds[loop + 1:].sum())
  hidden = max(0.0, edge - before) + max(0.0, edge - after)
  for target in (deviceless, H100):
    profiled = dataclasses.replace(target, copies_profiled=True)
    assert exposed(2, profiled) < exposed(2, target)
  profiled = dataclasses.replace(deviceless, copies_profiled=True)
  assert exposed(2, profiled) == pytest.approx(hidden)
  # The fetches waited for inside the loop's body still wait.
  assert exposed(4, profiled) == pytest.approx(
      hidden + H100.transfer_seconds(stacks - stacks // 2))
  # On the GPU, so do all the slices between the edges.
  assert exposed(2, dataclasses.replace(H100, copies_profiled=True)) == (
      pytest.approx(hidden + 2 * H100.transfer_seconds(stacks)))


def test_kernels_a_loop_does_not_read_may_follow_it():
  """What may hide a loop's last write-back: every kernel the loop does not
  read from, also one the jaxpr makes before it (the tied embedding's
  weight gradient of a GPT, which XLA runs after the backward loop)."""
  def step(x, w):
    unrelated = w @ w
    def layer(carry, _):
      return jnp.tanh(carry @ x), None
    y, _ = jax.lax.scan(layer, x, None, length=4)
    return y, unrelated

  square = jax.ShapeDtypeStruct((1024, 1024), jnp.float32)
  program = flatten(jax.make_jaxpr(step)(square, square))
  liveness = analyse(program)
  seconds = kernel_seconds(program, H100)
  names = [str(equation.primitive) for equation in program.equations]
  matmul, loop = names.index("dot_general"), names.index("scan")
  assert matmul < loop and seconds[matmul] > 0
  free = _kernels_free_to_follow(program, liveness, seconds, loop)
  assert free == pytest.approx(float(seconds[loop + 1:].sum())
                               + float(seconds[matmul]))
  # What the loop reads cannot follow it.
  def feeding(x, w):
    return jax.lax.scan(lambda c, _: (jnp.tanh(c @ x), None), w @ w, None,
                        length=4)[0]
  program = flatten(jax.make_jaxpr(feeding)(square, square))
  seconds = kernel_seconds(program, H100)
  names = [str(equation.primitive) for equation in program.equations]
  loop = names.index("scan")
  assert _kernels_free_to_follow(program, analyse(program), seconds,
                                 loop) == pytest.approx(
                                     float(seconds[loop + 1:].sum()))


def test_xlas_scheduler_overlaps_only_under_its_memory_limit():
  def program_of(nbytes):
    x = jax.ShapeDtypeStruct((nbytes // 4,), jnp.float32)
    return flatten(jax.make_jaxpr(lambda x: x * 2)(x))

  device = 80 * GIB
  small, large = program_of(GIB), program_of(34 * GIB)  # in + out: 68 GiB
  assert scheduler_overlaps(small, None, device)
  assert scheduler_overlaps(small, 40 * GIB, device)
  # Arguments and outputs past 80% of the device: no room at all.
  assert not scheduler_overlaps(large, None, device)
  # A peak past the room left after them.
  assert not scheduler_overlaps(small, 70 * GIB, device)
  assert scheduler_overlaps(small, 70 * GIB, None)  # size unknown


def test_a_plans_scheduler_limit_is_the_room_its_budget_leaves():
  """Fitted to a budget past 80% of the device, a plan is compiled with
  XLA's scheduler limit scaled to the room the budget leaves beside its
  arguments and outputs, and its copies are priced as overlapped up to
  that room; XLA's default where the budget leaves no more, and nothing
  where no factor helps."""
  def program_of(nbytes):
    x = jax.ShapeDtypeStruct((nbytes // 4,), jnp.float32)
    return flatten(jax.make_jaxpr(lambda x: x * 2)(x))

  device = 80 * GIB
  held = program_of(28 * GIB)  # in + out: 56 GiB; XLA's room 8 GiB
  factor = scheduler_slop_factor(held, 79 * GIB, device)
  # 90% of the 23 GiB the budget leaves, as a share of XLA's 8 GiB room;
  # and what the plan holds on host besides, which XLA's scheduler counts.
  assert factor == int(100 * 0.9 * 23 / 8)
  assert scheduler_slop_factor(held, 79 * GIB, device, 4 * GIB) == int(
      100 * (0.9 * 23 + 4) / 8)
  assert not scheduler_overlaps(held, 70 * GIB, device)
  assert scheduler_overlaps(held, 70 * GIB, device, factor)
  assert not scheduler_overlaps(held, 78 * GIB, device, factor)
  # A budget that leaves no more than XLA's own limit; unknown sizes.
  assert scheduler_slop_factor(held, 62 * GIB, device) is None
  assert scheduler_slop_factor(held, None, device) is None
  assert scheduler_slop_factor(held, 79 * GIB, None) is None
  # Arguments and outputs past 80% of the device: the limit is negative.
  assert scheduler_slop_factor(program_of(34 * GIB), 79 * GIB, device) is None


def test_the_least_memory_of_a_scanned_mlp_streams_layer_inputs_and_remakes_the_rest():
  case = _scan_mlp()
  args = case.make_args()
  step = jlms.offload(case.step, budget="min")
  plan = step.plan(*args)
  streamed = [v for v in plan.offloaded if v.streamed]
  # One stack of layer inputs through host, not autodiff's three stacks.
  assert [v.shape for v in streamed] == [(4, 1024, 256)]
  ours = theirs = params = args[0]
  for _ in range(3):  # each step from the last one's parameters
    ours, loss = step(ours, *args[1:])
    theirs, expected_loss = jax.jit(case.step)(theirs, *args[1:])
    assert max_relative_error(loss, expected_loss) <= F32_TOLERANCE
  assert max_relative_error(ours, theirs) <= F32_TOLERANCE


_OPERATION = re.compile(r"^\s*(?:ROOT )?%(\S+) = .*? ([a-z\-]+)\(")


def _loop_bodies(hlo: str) -> list[list[tuple[str, str]]]:
  """(name, opcode) of each instruction, in schedule order, of every
  computation that copies to or from host memory (S(5)) asynchronously."""
  bodies = []
  for block in re.split(r"\n(?=%|ENTRY)", hlo):
    lines = block.splitlines()
    if not lines or "S(5)" not in block or "ENTRY" in lines[0]:
      continue
    operations = [m.groups() for m in map(_OPERATION.match, lines[1:]) if m]
    if any(op.endswith("-start") for _, op in operations):
      bodies.append(operations)
  return bodies


def test_xla_fetches_a_streamed_loops_next_slice_beside_its_matmuls():
  case = models.scan_mlp_case(layers=8, width=1024, batch=2048)
  step = jlms.offload(case.step, budget="min", target="h100")
  args = case.abstract_args()
  assert any(v.streamed for v in step.plan(*args).offloaded)
  hlo = jlms.xla_memory(step, *args, target="h100").hlo_text
  fetching = [operations for operations in _loop_bodies(hlo)
              if any("dynamic-slice-start" in name
                     and "update" not in name for name, _ in operations)]
  assert fetching  # the backward loop
  for operations in fetching:
    names = [name for name, _ in operations]
    matmuls = [i for i, name in enumerate(names) if "gemm" in name]
    for start, name in enumerate(names):
      if "dynamic-slice-start" not in name or "update" in name:
        continue
      done = next(i for i, (_, op) in enumerate(operations)
                  if op.endswith("-done") and i > start
                  and name.replace("start", "done") == names[i])
      # The next iteration's slice comes in while this one's matmuls run:
      # its copy starts before the first of them (where XLA's loop counter
      # made the fetch's index, it started after all but the last one).
      assert start < matmuls[0] < done, (name, names)


@pytest.mark.parametrize("compiles", ["cheaply", "at length"])
def test_at_remats_peak_a_scanned_mlp_remakes_its_layers_rather_than_stream(
    caplog, monkeypatch, compiles):
  from jlms import _search
  if compiles == "at length":  # as a step of more equations would
    monkeypatch.setattr(_search, "_CHEAP_COMPILE_EQUATIONS", 0)
  case = models.scan_mlp_case(layers=8, width=1024, batch=2048)
  remat = models.scan_mlp_case(layers=8, width=1024, batch=2048,
                               remat="nothing_saveable")
  args = case.abstract_args()
  budget = jlms.xla_memory(jax.jit(remat.step), *args,
                           target="h100").peak_bytes
  with caplog.at_level(logging.INFO, logger="jlms"):
    plan = jlms.offload(case.step, budget=budget, target="h100").plan(*args)
  # Streaming the layers' inputs fits with room to spare, but per-layer
  # remat fits too (the simulator puts it just over the budget's margin;
  # XLA at the budget) and moves nothing over the link.
  assert plan.xla_peak_bytes <= budget
  assert plan.offloaded_bytes == 0
  # Found by fitting the budget itself once the margin left room: for a
  # step whose compiles take long, only the way that did not fit the
  # margin (the two streamed ways that did are not fitted again); for one
  # that compiles cheaply, every way (the 16-block ResNet at remat's peak
  # found a plan 0.9% faster so).
  fits_at_budget = [r for r in caplog.records if r.getMessage().startswith(
      f"jlms: fitted {format_bytes(budget)} in")]
  assert len(fits_at_budget) == (1 if compiles == "at length" else 3)


def _gpt_with_moments_on_host(budget: str):
  """The plan of a 4-layer GPT of width 4096 at `budget` on an H100, whose
  state does not fit beside its activations, and XLA's compiled program
  of it."""
  case = models.zoo_gpt_case(seq=1024, batch_size=8, layers=4, width=4096,
                             heads=32)
  args = case.abstract_args()
  step = jlms.offload(case.step, donate_argnums=(0, 1), budget=budget,
                      target="h100")
  plan = step.plan(*args)
  return plan, jlms.xla_memory(step, *args, target="h100").hlo_text


@pytest.mark.slow
def test_xla_runs_a_fused_update_loops_copies_beside_its_matmuls():
  """A GPT whose budget puts one weight's two moments on host: their
  update runs in the backward loop (`jlms._update_fusion`), each fetched a
  layer ahead and written back a layer behind. Every one of those copies
  is in flight while a matmul of the loop runs. (The fetch of the half
  that reads first was waited for right after it started: its index was
  made in the kernel that advances the loop's count, at the body's end,
  and its write-back was then started at the body's top.)"""
  plan, hlo = _gpt_with_moments_on_host("19GiB")
  assert plan.state_leaves == 2 and plan.state_updated_in_loops > 0, plan
  def both_ways(names):
    return (any(n.startswith("dynamic-slice-start") for n in names)
            and any(n.startswith("dynamic-update-slice-start") for n in names))

  copying = [[name for name, _ in operations]
             for operations in _loop_bodies(hlo)]
  copying = [names for names in copying if both_ways(names)]
  assert len(copying) == 1  # the backward loop
  for names in copying:
    matmuls = [i for i, name in enumerate(names) if "gemm" in name]
    starts = [i for i, name in enumerate(names)
              if "slice-start" in name]
    assert len(starts) == 4, names  # two fetches, two write-backs
    for start in starts:
      done = names.index(names[start].replace("-start", "-done"))
      assert any(start < m < done for m in matmuls), (names[start], names)


@pytest.mark.slow
def test_xla_keeps_several_fetches_of_a_fused_loop_in_flight():
  """Six moments on host: the backward loop fetches and writes back six
  buffers an iteration. XLA's scheduler keeps at most
  `ASYNC_COPIES_IN_FLIGHT` such copies in flight in a plan that copies
  (two by default): with two places, the write-backs took both and every
  fetch was waited for right after its start; now most fetches run
  beside a matmul."""
  plan, hlo = _gpt_with_moments_on_host("16GiB")
  assert plan.state_leaves >= 4 and plan.state_updated_in_loops > 0, plan
  bodies = [[name for name, _ in operations]
            for operations in _loop_bodies(hlo)]
  (names,) = [n for n in bodies
              if sum(x.startswith("dynamic-slice-start") for x in n) >= 4]
  matmuls = [i for i, name in enumerate(names) if "gemm" in name]
  fetches = [i for i, name in enumerate(names)
             if name.startswith("dynamic-slice-start")]
  beside = [start for start in fetches
            if any(start < m < names.index(
                names[start].replace("-start", "-done")) for m in matmuls)]
  assert 2 * len(beside) > len(fetches), names
