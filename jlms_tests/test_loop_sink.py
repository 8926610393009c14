"""Loop-invariant masks and fills made inside the scans that read them."""

import jax
import pytest
import optax

from benchmarks import models
from jlms import _compat
from jlms._config import OffloadConfig
from jlms._liveness import analyse
from jlms._loop_remat import loop_rematerializations, rematerialize_in_loops
from jlms._loop_sink import loop_sinks, sink_into_loops
from jlms._program import flatten
from jlms._rewrite import rewrite
from jlms_tests.conftest import F32_TOLERANCE, max_relative_error


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

  sunk = sink_into_loops(program, sinks)
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
