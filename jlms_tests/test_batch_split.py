"""Runs of equations split over the batch (`jlms._batch_split`): a loss over
a large vocabulary (logits, soft-cap, one-hot cross-entropy, forward and
backward) is found, run in chunks of the batch, and computes what the step
computes; equations that reduce over the batch are never cut; each rule of
`jlms._split_rules` cuts what it may and refuses what it may not."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jlms
from jlms import _batch_split, _compat, _program, _thresholds
from jlms._config import OffloadConfig
from jlms._rewrite import rewrite
from jlms._split_rules import (SUMMED, WHOLE, SplitView, Unsplittable,
                               broadcast_in_dim, dot_general, pointwise,
                               reduce_other, reduce_sum, reshape)
from jlms_tests.conftest import F32_TOLERANCE, max_relative_error

BATCH, SEQ, WIDTH, VOCAB = 8, 64, 8, 4096


def _sgd_step(loss_fn):
  """A step of plain gradient descent on `loss_fn(params, tokens)`."""
  def step(params, tokens):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
    return jax.tree.map(lambda p, g: p - 0.5 * g, params, grads), loss
  return step


def _lm_step(batch_norm: bool = False, integer_labels: bool = False):
  """A tied-embedding language model's step: a gather, one tanh layer, a
  soft-capped projection on the vocabulary and a one-hot cross-entropy of
  the next token, as Gemma's loss; `batch_norm` centres the logits on
  their batch mean (a reduction over the batch that no chunk can make);
  `integer_labels` takes optax's integer-label cross-entropy instead
  (`take_along_axis`: a gather, and a scatter-add backward)."""
  def loss_fn(params, tokens):
    x = params["embed"][tokens]
    x = jnp.tanh(x @ params["w"])
    logits = x @ params["embed"].T
    logits = 30.0 * jnp.tanh(logits / 30.0)
    if batch_norm:
      logits = logits - logits.mean(axis=0, keepdims=True)
    if integer_labels:
      return optax.softmax_cross_entropy_with_integer_labels(
          logits[:, :-1], tokens[:, 1:]).mean()
    one_hot = jax.nn.one_hot(tokens[:, 1:], VOCAB)
    return optax.softmax_cross_entropy(logits[:, :-1], one_hot).mean()

  step = _sgd_step(loss_fn)
  keys = jax.random.split(jax.random.key(0), 3)
  params = {"embed": jax.random.normal(keys[0], (VOCAB, WIDTH)),
            "w": jax.random.normal(keys[1], (WIDTH, WIDTH)) / WIDTH**0.5}
  tokens = jax.random.randint(keys[2], (BATCH, SEQ), 0, VOCAB)
  return step, (params, tokens)


def _program_of(step, args):
  return _program.flatten(jax.make_jaxpr(step)(*args))


def _run(program, args):
  closed = rewrite(program, (), OffloadConfig())
  jaxpr, consts = _compat.jaxpr_parts(closed)
  return jax.jit(lambda *a: _compat.eval_jaxpr(jaxpr, consts, *a))(
      *jax.tree.leaves(args))


def test_the_loss_over_the_vocabulary_is_split_over_the_batch():
  step, args = _lm_step()
  program = _program_of(step, args)
  with _thresholds.overridden(batch_split_min_bytes=1):
    (split,) = _batch_split.batch_splits(program)
  names = {program.equations[i].primitive.name for i in split.equations}
  # Forward and backward of the loss: the projection, its soft-cap, the
  # softmax and the one-hot product.
  assert {"dot_general", "tanh", "exp", "reduce_max", "eq"} <= names, names
  assert split.length == BATCH and BATCH % split.chunks == 0
  assert split.chunks > 1
  # The largest value cut is one of the batch x sequence x vocabulary
  # float32 arrays; what crosses the edge is the size of hidden states.
  assert split.largest_bytes >= BATCH * (SEQ - 1) * VOCAB * 4
  assert split.largest_bytes >= 2 * split.edge_bytes
  # Not below the real threshold: these values are a few hundred KiB.
  assert _batch_split.batch_splits(program) == ()


def test_a_batch_shared_by_devices_is_split_within_each_ones_share():
  # On 8 devices each holds 1 of the 8 rows: contiguous chunks of one row
  # would each lie on one device, and XLA gathered each to all of them
  # and ran the whole loss everywhere (a batch of 16 on 8 CPU devices:
  # 16 chunks of 1, 4.3x jax.jit's time; now 2 interleaved chunks of 8,
  # jax.jit's time, no all-gather). A chunk takes every `chunks`-th row,
  # so it holds as many rows of each device's share.
  step, args = _lm_step()
  program = _program_of(step, args)
  with _thresholds.overridden(batch_split_min_bytes=1):
    (alone,) = _batch_split.batch_splits(program)
    (shared,) = _batch_split.batch_splits(program, devices=4)
    assert _batch_split.batch_splits(program, devices=BATCH) == ()
    split_program, described = _batch_split.split_runs(program, devices=4)
  assert not alone.interleaved and alone.chunks > 2
  assert shared.interleaved and shared.chunks == BATCH // 4
  assert "interleaved" in described[0]
  expected = jax.tree.leaves(jax.jit(step)(*args))
  assert max_relative_error(_run(split_program, args), expected) <= (
      F32_TOLERANCE)
  rows = jnp.arange(BATCH * 3).reshape(BATCH, 3)
  chunked = _batch_split._chunked(rows, 0, 2, interleaved=True)
  assert chunked[1][:, 0].tolist() == [3, 9, 15, 21]  # rows 1, 3, 5, 7
  assert (_batch_split._joined(chunked, 0, interleaved=True) == rows).all()


def test_a_head_whose_gradient_is_large_is_still_worth_splitting():
  """An untied head as Llama's (its weight's gradient a quarter of the
  logits): that gradient is made whole split or not, so the split counts
  only the partial sums it adds, and the loss still runs in chunks."""
  batch, seq, width, vocab = 4, 257, 256, 4096

  def loss_fn(params, tokens):
    logits = params["embed"][tokens] @ params["head"]
    one_hot = jax.nn.one_hot(tokens[:, 1:], vocab)
    return optax.softmax_cross_entropy(logits[:, :-1], one_hot).mean()

  step = _sgd_step(loss_fn)
  keys = jax.random.split(jax.random.key(1), 3)
  params = {"embed": jax.random.normal(keys[0], (vocab, width)),
            "head": jax.random.normal(keys[1], (width, vocab)) / width**0.5}
  tokens = jax.random.randint(keys[2], (batch, seq), 0, vocab)
  program = _program_of(step, (params, tokens))
  head_bytes = width * vocab * 4
  with _thresholds.overridden(batch_split_min_bytes=1):
    (split,) = _batch_split.batch_splits(program)
    split_program, _ = _batch_split.split_runs(program)
  assert split.chunks > 1
  # The head's gradient counts once (its partial sum), not twice.
  assert head_bytes <= split.edge_bytes < 2 * head_bytes
  # JAX makes that gradient transposed, (vocab, width), then transposes
  # it: the chunks sum it in the head's own layout, so that the update
  # reads it as it is (summed transposed, XLA copied Llama's head and its
  # moments whole).
  (loop,) = [e for e in split_program.equations
             if e.primitive is _compat.scan_p]
  handed_on = {tuple(split_program.avals[v].shape) for v in loop.outputs}
  assert (width, vocab) in handed_on and (vocab, width) not in handed_on
  expected = _run(program, (params, tokens))
  actual = _run(split_program, (params, tokens))
  for want, got in zip(expected, actual):
    assert max_relative_error(got, want) < F32_TOLERANCE


@pytest.mark.parametrize("integer_labels,from_first_chunk",
                         [(False, False), (True, False), (True, True)])
def test_the_split_program_computes_what_the_step_computes(
    integer_labels, from_first_chunk):
  # Totals started from zeros (the least memory) or from the first chunk's
  # partial sums, run before the loop (a budget's fit): the same sums.
  step, args = _lm_step(integer_labels=integer_labels)
  program = _program_of(step, args)
  with _thresholds.overridden(batch_split_min_bytes=1):
    split_program, described = _batch_split.split_runs(
        program, totals_from_first_chunk=from_first_chunk)
    (split,) = _batch_split.batch_splits(program)
  assert described
  names = {program.equations[i].primitive.name for i in split.equations}
  if integer_labels:  # the label's gather and its scatter-add are cut
    assert {"gather", "scatter-add"} <= names, names
  loops = [e for e in split_program.equations
           if e.primitive is _compat.scan_p]
  assert loops, "the region runs as a scan over chunks"
  # The first chunk, where it starts the totals, runs before the loop.
  lengths = {_compat.scan_layout(e.eqn).length for e in loops}
  assert lengths == {split.chunks - from_first_chunk}, lengths
  expected = _run(program, args)
  actual = _run(split_program, args)
  for a, e in zip(actual, expected):
    assert max_relative_error(np.asarray(a), np.asarray(e)) <= F32_TOLERANCE


def _three_steps(stepper, args):
  params, tokens = args
  outputs = []
  for _ in range(3):
    params, loss = stepper(params, tokens)
    outputs.append((params, loss))
  return outputs


@pytest.mark.parametrize("split_batch", [True, False])
def test_offload_plans_the_split_and_gives_jax_jits_outputs(split_batch):
  step, args = _lm_step()
  offloaded = jlms.offload(step, budget="min", split_batch=split_batch,
                           strict=True)
  with _thresholds.overridden(batch_split_min_bytes=1):
    plan = offloaded.plan(*args)
  assert bool(plan.split_over_batch) == split_batch, plan
  assert ("split over the batch" in str(plan)) == split_batch
  expected = _three_steps(jax.jit(step), args)
  actual = _three_steps(offloaded, args)
  for (ap, al), (ep, el) in zip(actual, expected):
    assert max_relative_error(np.asarray(al), np.asarray(el)) <= F32_TOLERANCE
    for a, e in zip(jax.tree.leaves(ap), jax.tree.leaves(ep)):
      assert max_relative_error(np.asarray(a), np.asarray(e)) <= F32_TOLERANCE


def test_a_reduction_over_the_batch_is_never_cut():
  step, args = _lm_step(batch_norm=True)
  program = _program_of(step, args)
  with _thresholds.overridden(batch_split_min_bytes=1):
    split_program, _ = _batch_split.split_runs(program)
  expected = _run(program, args)
  actual = _run(split_program, args)
  for a, e in zip(actual, expected):
    assert max_relative_error(np.asarray(a), np.asarray(e)) <= F32_TOLERANCE


def test_a_region_whose_span_has_ordered_effects_is_not_split():
  # The rewrite moves the equations of the span around the loop: two
  # ordered prints between the loss and its backward would swap.
  def loss_fn(params, tokens):
    x = jnp.tanh(params["embed"][tokens] @ params["w"])
    logits = x @ params["embed"].T
    loss = optax.softmax_cross_entropy(
        logits, jax.nn.one_hot(tokens, VOCAB)).mean()
    jax.debug.print("loss {}", loss, ordered=True)
    jax.debug.print("w {}", params["w"].sum(), ordered=True)
    return loss

  _, args = _lm_step()
  program = _program_of(jax.grad(loss_fn), args)
  with _thresholds.overridden(batch_split_min_bytes=1):
    assert _batch_split.batch_splits(program) == ()


def test_split_over_batch_refuses_a_bad_knob():
  with pytest.raises(ValueError, match="split_batch"):
    OffloadConfig(split_batch="yes")


def _view(in_shapes, out_shapes, length=4, **layout):
  return SplitView("test", tuple(in_shapes), tuple(out_shapes), layout,
                   length)


def test_pointwise_cuts_full_operands_and_keeps_broadcast_ones_whole():
  view = _view([(4, 6, 1), (4, 6, 8), ()], [(4, 6, 8)])
  ins, outs = pointwise(view, [None, 0, None], [None])
  assert ins == [0, 0, WHOLE] and outs == [0]
  # A size-1 axis broadcast along the cut axis is whole in every chunk.
  view = _view([(1, 6, 8), (4, 6, 8)], [(4, 6, 8)])
  ins, _ = pointwise(view, [None, None], [0])
  assert ins == [WHOLE, 0]


def test_reductions_over_the_cut_axis_sum_or_refuse():
  view = _view([(4, 6)], [(6,)], axes=(0,))
  assert reduce_sum(view, [0], [None])[1] == [SUMMED]
  with pytest.raises(Unsplittable):
    reduce_other(view, [0], [None])
  # Over another axis, the cut axis carries on.
  view = _view([(4, 6)], [(4,)], axes=(1,))
  assert reduce_other(view, [0], [None])[1] == [0]
  assert reduce_other(view, [None], [0])[0] == [0]


def test_dot_general_sums_a_contracted_cut_and_keeps_free_ones():
  # (batch, width) x (batch, vocab) contracted over the batch: a weight
  # gradient, a partial sum per chunk.
  numbers = (((0,), (0,)), ((), ()))
  view = _view([(4, 8), (4, 16)], [(8, 16)], dimension_numbers=numbers)
  ins, outs = dot_general(view, [0, None], [None])
  assert ins == [0, 0] and outs == [SUMMED]
  # (batch, width) x (width, vocab): the batch is free on the left.
  numbers = (((1,), (0,)), ((), ()))
  view = _view([(4, 8), (8, 16)], [(4, 16)], dimension_numbers=numbers)
  ins, outs = dot_general(view, [None, None], [0])
  assert ins == [0, WHOLE] and outs == [0]


def test_reshape_and_broadcast_map_the_cut_axis():
  view = _view([(4, 6, 8)], [(4, 48)], new_sizes=(4, 48), dimensions=None)
  assert reshape(view, [0], [None])[1] == [0]
  with pytest.raises(Unsplittable):
    reshape(_view([(2, 2, 8)], [(4, 8)], new_sizes=(4, 8),
                  dimensions=None), [None], [0])
  view = _view([(4, 6)], [(4, 6, 8)], broadcast_dimensions=(0, 1))
  assert broadcast_in_dim(view, [None], [0])[0] == [0]
  view = _view([()], [(4, 6)], broadcast_dimensions=())
  assert broadcast_in_dim(view, [None], [0])[0] == [WHOLE]


def test_the_least_memory_starts_a_splits_totals_from_zeros():
  # From the first chunk (a budget's ways), no zeros are written whole;
  # for the least memory XLA held the totals twice that way (Gemma2-2B:
  # 9.83 GiB against 7.71 from zeros), so its ways loop over every chunk.
  from jlms._analysed import AnalysedProgram
  from jlms._config import OffloadConfig
  from jlms._variants import loop_ways

  step, args = _lm_step()
  plain = AnalysedProgram.of(_program_of(step, args))

  def loop_lengths(least_memory):
    (first, *_) = loop_ways(plain, OffloadConfig(), None,
                            least_memory=least_memory)
    return {_compat.scan_layout(e.eqn).length for e in first.program.equations
            if e.primitive is _compat.scan_p}

  with _thresholds.overridden(batch_split_min_bytes=1):
    (split,) = _batch_split.batch_splits(plain.program)
    assert loop_lengths(least_memory=True) == {split.chunks}
    assert loop_lengths(least_memory=False) == {split.chunks - 1}
