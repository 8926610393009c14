"""Short gradient-accumulation loops unrolled (`jlms._unroll`): the same
values, only the loops whose body runs a forward and a backward pass, and
each iteration after the last, as in the loop."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jlms
from jlms import _compat
from jlms._liveness import analyse
from jlms._program import flatten
from jlms._segment_remat import forward_cuts, forward_passes, segment_remats
from jlms._unroll import MAX_ITERATIONS, accumulation_loops, unrolled
from jlms_tests.conftest import F32_TOLERANCE, max_relative_error
from jlms_tests.test_body_remat import (LAYERS, MICROBATCHES,
                                        _accumulating_step, _jitted,
                                        _python_loop_loss, _run,
                                        _scanned_loss)


def _h100_peak(program, args) -> int:
  """XLA's peak for an H100 of `program` as it is, on `args`."""
  return jlms.xla_memory(_jitted(program), *jax.tree.leaves(args),
                         target="h100").peak_bytes


def _scans(program):
  return sum(e.primitive.name == "scan" for e in program.equations)


def _accumulation_loop(program) -> tuple[int, ...]:
  """The index of `program`'s one scan whose body runs a forward and a
  backward pass, as a loop to unroll (whether or not the analysis would
  unroll it)."""
  return tuple(i for i, e in enumerate(program.equations)
               if e.primitive.name == "scan")


@pytest.mark.parametrize("loss_fn", [_python_loop_loss, _scanned_loss])
def test_an_unrolled_accumulation_loop_computes_the_same_values(loss_fn):
  step, args = _accumulating_step(loss_fn)
  program = flatten(jax.make_jaxpr(step)(*args))
  loops = _accumulation_loop(program)
  assert len(loops) == 1
  unrolled_program = unrolled(program, loops)
  # Its layers' own scans, a forward and a backward one a microbatch, stay.
  layer_scans = 2 if loss_fn is _scanned_loss else 0
  assert _scans(unrolled_program) == MICROBATCHES * layer_scans
  # Each iteration's equations its own objects: a way's copies are
  # re-indexed by equation identity (`jlms._variants`).
  assert len({id(e.eqn) for e in unrolled_program.equations}) == len(
      unrolled_program.equations)
  assert max_relative_error(_run(unrolled_program, args),
                            _run(program, args)) <= F32_TOLERANCE


def test_each_iteration_waits_for_the_last():
  # One barrier an iteration after the first, over its inputs and the
  # carry the iteration before made; and a forward pass an iteration,
  # each cut into segments of its own.
  step, args = _accumulating_step(_python_loop_loss)
  program = flatten(jax.make_jaxpr(step)(*args))
  unrolled_program = unrolled(program, accumulation_loops(program))
  barriers = [e for e in unrolled_program.equations
              if e.primitive is _compat.barrier_p]
  assert len(barriers) == MICROBATCHES - 1
  passes = forward_passes(unrolled_program)
  assert len(passes) == MICROBATCHES
  liveness = analyse(unrolled_program)
  cuts = forward_cuts(unrolled_program, liveness)
  remats = segment_remats(unrolled_program, liveness, cuts)
  # As many segments in each: a later one's parameters, which its barrier
  # copies, are no activations its forward pass carries (they were, and
  # hid every cut of the passes after the first).
  remats_per_pass = {sum(start <= r.chain[0] < end for r in remats)
                     for start, end in passes}
  assert len(remats_per_pass) == 1 and min(remats_per_pass) >= LAYERS


def test_xla_runs_one_microbatch_at_a_time():
  # Without the barriers XLA starts every microbatch's forward pass at
  # once (255 MiB for an H100, against 63 for the loop); with them it
  # runs them one after another, as the loop does (66 MiB).
  step, args = _accumulating_step(_python_loop_loss)
  program = flatten(jax.make_jaxpr(step)(*args))
  unrolled_program = unrolled(program, accumulation_loops(program))
  assert _h100_peak(unrolled_program, args) <= 1.1 * _h100_peak(program,
                                                                 args)


def test_long_loops_and_layer_scans_are_not_unrolled():
  step, args = _accumulating_step(_scanned_loss)
  params, batch = args
  # The forward scan of a layer stack has no backward pass in its body and
  # the backward scan no forward one.
  program = flatten(jax.make_jaxpr(
      lambda p, x: jax.value_and_grad(_scanned_loss)(p, x))(
          params, batch[:batch.shape[0] // MICROBATCHES]))
  assert _scans(program) == 2 and accumulation_loops(program) == ()

  # (Layers in a Python loop: a loop over scanned layers is not unrolled
  # at any length, below.)
  params, batch = _accumulating_step(_python_loop_loss)[1]

  def long_step(params, batch):
    def body(total, x):
      return total + jax.grad(_python_loop_loss)(params, x)[0][0], None
    micro = batch.reshape(MAX_ITERATIONS + 1, -1, batch.shape[-1])
    return jax.lax.scan(body, jnp.zeros_like(params[0][0]), micro)[0]

  long_batch = np.zeros((MAX_ITERATIONS + 1, 8, batch.shape[-1]),
                        np.float32)
  program = flatten(jax.make_jaxpr(long_step)(params, long_batch))
  assert accumulation_loops(program) == ()
  assert len(accumulation_loops(program, MAX_ITERATIONS + 1)) == 1
  # Nor a loop of no iterations (its outputs would be made by nothing).
  empty = np.zeros((0, 8, batch.shape[-1]), np.float32)
  program = flatten(jax.make_jaxpr(
      lambda p, b: jax.lax.scan(
          lambda total, x: (total + jax.grad(_python_loop_loss)(p, x)[0][0],
                            x),
          jnp.zeros_like(p[0][0]), b))(params, empty))
  assert accumulation_loops(program) == ()


def test_a_loop_without_a_carry_is_ordered_by_its_outputs():
  # `lax.map` over the microbatches has no carry: each iteration waits for
  # the gradients the one before made. Unordered, XLA ran every
  # microbatch at once (255 MiB for an H100, against 104 as a loop).
  step, args = _accumulating_step(_python_loop_loss)
  params, batch = args

  def mapped_step(params, batch):
    micro = batch.reshape(MICROBATCHES, -1, batch.shape[-1])
    grads = jax.lax.map(lambda x: jax.grad(_python_loop_loss)(params, x),
                        micro)
    return jax.tree.map(lambda g: g.sum(0), grads)

  program = flatten(jax.make_jaxpr(mapped_step)(params, batch))
  unrolled_program = unrolled(program, accumulation_loops(program))
  assert sum(e.primitive is _compat.barrier_p
             for e in unrolled_program.equations) == MICROBATCHES - 1
  assert max_relative_error(_run(unrolled_program, args),
                            _run(program, args)) <= F32_TOLERANCE
  assert _h100_peak(unrolled_program, args) <= 1.1 * _h100_peak(program,
                                                                 args)


def test_each_microbatch_of_scanned_layers_is_a_forward_pass():
  step, args = _accumulating_step(_scanned_loss)
  program = flatten(jax.make_jaxpr(step)(*args))
  unrolled_program = unrolled(program, _accumulation_loop(program))
  assert len(forward_passes(unrolled_program)) == MICROBATCHES


def test_a_loop_over_scanned_layers_is_not_unrolled():
  # Unrolled, JAX 0.10.2's XLA makes every microbatch's residual stacks at
  # once: 294 MiB for an H100 against 108 as a loop (0.12.0.1's: 110 and
  # 110). Its body's own remaking reaches 61 MiB on both.
  step, args = _accumulating_step(_scanned_loss)
  program = flatten(jax.make_jaxpr(step)(*args))
  assert len(_accumulation_loop(program)) == 1
  assert accumulation_loops(program) == ()
