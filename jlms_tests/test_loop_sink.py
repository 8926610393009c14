"""Loop-invariant masks and fills made inside the scans that read them."""

import logging

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jlms

from benchmarks import models
from jlms import _compat, _variants
from jlms._config import OffloadConfig
from jlms._liveness import analyse
from jlms._loop_remat import loop_rematerializations, rematerialize_in_loops
from jlms._loop_sink import loop_sinks, sink_into_loops
from jlms._program import flatten
from jlms._rewrite import rewrite
from jlms_tests.conftest import F32_TOLERANCE, PLATFORM, max_relative_error


def _scanned_gpt():
  # Causal attention under nn.scan: autodiff hoists the mask broadcast to
  # [batch, heads, seq, seq] and the fill value out of both scans.
  return models.gpt_case(layers=3, width=64, heads=2, seq=32, batch=2,
                         vocab=128, scan_layers=True,
                         optimizer=optax.sgd(1e-2, momentum=0.9))


def _run(program, debug_info, args):
  jaxpr = rewrite(program, (), OffloadConfig(), debug_info)
  _compat.check_jaxpr(jaxpr)
  return jax.jit(lambda *a: jax.core.eval_jaxpr(jaxpr.jaxpr, jaxpr.consts, *a)
                 )(*jax.tree.leaves(args))


@pytest.mark.slow  # a few seconds: the quick tier stays within 2 minutes
def test_the_hoisted_mask_and_fill_are_made_inside_both_scans():
  case = _scanned_gpt()
  args = case.make_args()
  closed = jax.make_jaxpr(case.step)(*args)
  program = flatten(closed)
  liveness = analyse(program)
  sinks = loop_sinks(program, liveness, min_bytes=0)
  batch, heads, seq = 2, 2, 32
  attention_shaped = [s for s in sinks
                      if program.avals[s.value].shape == (batch, heads, seq, seq)]
  # A mask (bool) and a fill (float) for the forward scan and the backward.
  assert len({s.loop for s in attention_shaped}) == 2
  assert {str(program.avals[s.value].dtype) for s in attention_shaped} >= {
      "bool", "float32"}
  for sink in sinks:
    assert 4 * sum(liveness.nbytes[v] for v in sink.leaves) <= (
        liveness.nbytes[sink.value])

  sunk, done = sink_into_loops(program, sinks)
  assert done == sinks
  for sink in sinks:
    scan = sunk.equations[sink.loop]
    assert scan.primitive is _compat.scan_p  # later passes still see a scan
    assert sink.value not in scan.inputs
    assert set(sink.leaves) <= set(scan.inputs)
  expected = jax.tree.leaves(jax.jit(case.step)(*args))
  outputs = _run(sunk, closed.jaxpr.debug_info, args)
  assert max_relative_error(outputs, expected) <= F32_TOLERANCE

  # The scans stay a forward-backward pair whose residuals can be remade.
  sunk_liveness = analyse(sunk)
  (pair,) = loop_rematerializations(sunk, sunk_liveness)
  remade = rematerialize_in_loops(sunk, (pair,))
  outputs = _run(remade, closed.jaxpr.debug_info, args)
  assert max_relative_error(outputs, expected) <= F32_TOLERANCE


def test_a_mask_is_made_in_the_loop_from_its_iotas():
  # At batch 8 the [seq, seq] mask is a sixteenth of the [batch, heads,
  # seq, seq] one the scans read: made in the loop from it, XLA broadcasts
  # it over the batch into a buffer every iteration (the Equinox decoder:
  # 42.6 ms of 469.3); made from the iotas, it fuses into its reader.
  case = models.gpt_case(layers=2, width=64, heads=2, seq=32, batch=8,
                         vocab=128, scan_layers=True)
  program = flatten(jax.make_jaxpr(case.step)(*case.abstract_args()))
  liveness = analyse(program)
  masks = [s for s in loop_sinks(program, liveness, min_bytes=0)
           if str(program.avals[s.value].dtype) == "bool"]
  assert masks
  for sink in masks:
    made = {program.equations[i].primitive.name for i in sink.chain}
    assert "iota" in made, made
    assert sink.leaves == ()


def test_a_loop_input_made_by_a_costly_equation_stays_an_input():
  def step(w, xs):
    table = jax.numpy.exp(w)  # as large as its input: not an expansion

    def body(carry, x):
      return carry + (table * x).sum(), None

    return jax.lax.scan(body, 0.0, xs)[0]

  w = jax.numpy.ones((64, 64))
  xs = jax.numpy.ones((4, 64, 64))
  program = flatten(jax.make_jaxpr(step)(w, xs))
  assert loop_sinks(program, analyse(program), min_bytes=0) == ()


class _MaskingLayer(nn.Module):
  """The usual Flax idiom: the causal mask is made inside the layer."""

  @nn.compact
  def __call__(self, x, _):
    mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
    attention = nn.SelfAttention(num_heads=4, deterministic=True)
    return x + attention(nn.LayerNorm()(x), mask=mask), None


class _MaskingDecoder(nn.Module):
  @nn.compact
  def __call__(self, x):
    layers = nn.scan(_MaskingLayer, variable_axes={"params": 0},
                     split_rngs={"params": True}, length=4)
    return layers()(x, None)[0]


def _masking_decoder_step():
  """A scanned decoder whose layers make their causal mask, at sequence
  256: the mask that autodiff hoists out of both scans takes 2 MiB, past
  the loop sink's 1 MiB, and the values JAX reads it from are a sixteenth
  of it (issue 35's reproduction)."""
  model = _MaskingDecoder()
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 256, 128))
  params = model.init(jax.random.PRNGKey(0), x)["params"]

  def step(params, x):
    loss, grads = jax.value_and_grad(
        lambda p: jnp.mean(model.apply({"params": p}, x) ** 2))(params)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss

  return step, (params, x)


def test_a_scan_whose_inputs_jax_traces_in_another_order_is_sunk():
  # Traced anew, the scan reads its closed-over inputs in the order its
  # body first uses them, not the order they were passed: the rewrite maps
  # JAX's inputs back to the program's instead of asserting one order.
  step, args = _masking_decoder_step()
  closed = jax.make_jaxpr(step)(*args)
  program = flatten(closed)
  sinks = loop_sinks(program, analyse(program))
  assert {s.loop for s in sinks} and all(
      program.avals[s.value].shape == (2, 4, 256, 256) for s in sinks)
  sunk, done = sink_into_loops(program, sinks)
  assert done == sinks
  outputs = _run(sunk, closed.jaxpr.debug_info, args)
  for actual, wanted in zip(outputs, jax.tree.leaves(jax.jit(step)(*args))):
    np.testing.assert_allclose(actual, wanted, rtol=F32_TOLERANCE, atol=1e-7)


def test_a_scan_that_passes_a_carry_through_is_sunk():
  # An auxiliary loss summed in the carry (an MoE's load-balancing term):
  # its cotangent is the same in every iteration of the backward scan,
  # which passes it through, and traced anew JAX forwards it instead of
  # making it. Its reads then read what it passes through; before, the
  # backward scan kept its hoisted mask ("passes some of its outputs
  # through").
  layers, batch, seq, width = 3, 4, 256, 64

  def loss(weights, x):
    def body(carry, w):
      x, total = carry
      scores = jnp.einsum("bqd,bkd->bqk", x @ w, x)
      mask = jnp.tril(jnp.ones((seq, seq), bool))[None]
      p = jax.nn.softmax(jnp.where(mask, scores, -1e9), -1)
      return (x + jnp.einsum("bqk,bkd->bqd", p, x),
              total + jnp.mean(p ** 2)), None
    (x, total), _ = jax.lax.scan(body, (x, jnp.zeros(())), weights)
    return jnp.mean(x ** 2) + 0.01 * total

  def step(weights, x):
    value, grads = jax.value_and_grad(loss)(weights, x)
    return weights - 1e-3 * grads, value

  args = (jax.random.normal(jax.random.key(0), (layers, width, width)) / 8,
          jax.random.normal(jax.random.key(1), (batch, seq, width)))
  closed = jax.make_jaxpr(step)(*args)
  program = flatten(closed)
  sinks = loop_sinks(program, analyse(program))
  assert len({s.loop for s in sinks}) == 2  # the forward and backward scan
  sunk, done = sink_into_loops(program, sinks)
  assert done == sinks
  outputs = _run(sunk, closed.jaxpr.debug_info, args)
  for actual, wanted in zip(outputs, jax.tree.leaves(jax.jit(step)(*args))):
    np.testing.assert_allclose(actual, wanted, rtol=F32_TOLERANCE, atol=1e-7)


@pytest.mark.parametrize("share", ["min", 0.0, 0.5, 0.9])
def test_the_masking_decoder_plans_at_every_budget(share, as_without_a_gpu):
  # Every budget it can meet: the least memory, and budgets from the least
  # memory's predicted peak (share 0) to jax.jit's (share 1).
  step, args = _masking_decoder_step()
  expected = jax.tree.leaves(jax.jit(step)(*args))
  budget = share
  if share != "min":
    least = jlms.offload(step, budget="min").plan(*args)
    low, high = least.predicted_peak_bytes, least.baseline_peak_bytes
    budget = int(low + share * (high - low))
  offloaded = jlms.offload(step, budget=budget, strict=True)
  outputs = offloaded(*args)
  plan = offloaded.plan(*args)
  assert plan.predicted_peak_bytes < plan.baseline_peak_bytes
  if share != "min":
    assert plan.predicted_peak_bytes <= budget
  # Elementwise: the key projection's bias has a zero gradient in exact
  # arithmetic, so its leaf is rounding noise under any program. On a GPU
  # (TF32) gradients of 1e-5 differ by up to 1.8e-7 (an H200).
  atol = 1e-7 if PLATFORM == "cpu" else 1e-6
  for actual, wanted in zip(jax.tree.leaves(outputs), expected):
    np.testing.assert_allclose(actual, wanted, rtol=F32_TOLERANCE, atol=atol)


def test_a_loop_pass_that_fails_drops_its_ways_not_the_plan(monkeypatch, caplog):
  # Fail soft, per choice: where the backward loops cannot be rewritten to
  # remake their residuals, the other ways (as they are, masks made in the
  # loops, residuals streamed) are still fitted, and the step keeps a plan.
  def cannot_rewrite(*args, **kwargs):
    raise NotImplementedError("a loop this pass cannot rewrite")

  monkeypatch.setattr(_variants, "rematerialize_in_loops", cannot_rewrite)
  step, args = _masking_decoder_step()
  offloaded = jlms.offload(step, budget="min", strict=True)
  with caplog.at_level(logging.DEBUG, logger="jlms"):
    outputs = offloaded(*args)
  assert "no LoopsRemaking way" in caplog.text
  assert "a loop this pass cannot rewrite" in caplog.text
  plan = offloaded.plan(*args)
  assert plan.predicted_peak_bytes < plan.baseline_peak_bytes
  for actual, wanted in zip(jax.tree.leaves(outputs),
                            jax.tree.leaves(jax.jit(step)(*args))):
    np.testing.assert_allclose(actual, wanted, rtol=F32_TOLERANCE, atol=1e-7)
